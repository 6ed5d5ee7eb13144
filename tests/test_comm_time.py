"""BurstEngine Table 1's communication-time model (parallel/comm_time.py) and its script."""

import pytest

from jax_seqpar.parallel.comm_time import Link, axis_time, table1_time

INTRA, INTER = Link(900e9, 5e-6), Link(50e9, 10e-6)


def test_table1_by_hand():
    P = 16.8e6
    ti, tx = 5e-6 + P / 900e9, 10e-6 + P / 50e9
    kw = dict(nodes=8, gpus_per_node=8, block_bytes=P, intra=INTRA, inter=INTER)
    assert table1_time("ring", **kw) == pytest.approx(6 * 64 * tx)
    assert table1_time("double_ring", **kw) == pytest.approx(
        4 * max(56 * ti, 8 * tx) + 2 * (56 * ti + 8 * tx))
    assert table1_time("burst", **kw) == pytest.approx(5 * 8 * tx)  # inter-node bound


def test_table1_orders_and_limits():
    kw = dict(gpus_per_node=8, block_bytes=4e6, intra=INTRA, inter=INTER)
    t = {m: table1_time(m, nodes=4, **kw) for m in ("ring", "double_ring", "burst")}
    assert t["burst"] < t["double_ring"] < t["ring"]
    # one node: every step is an NVLink step T; ring 6*8 T, double ring 4*7 T + 2*8 T,
    # burst 5*7 T (the formulas' N - N_inter = 7 intra steps, N_inter = 1 "inter" step)
    one = {m: table1_time(m, nodes=1, **kw) for m in t}
    step = INTRA.step(4e6)
    assert [one[m] / step for m in ("ring", "double_ring", "burst")] == pytest.approx(
        [48, 44, 35])
    with pytest.raises(ValueError, match="method"):
        table1_time("tree", nodes=2, **kw)


def test_axis_time_and_link_errors():
    t = axis_time({"gpu": 9e9, "node": 5e9}, {"gpu": 8, "node": 14},
                  {"gpu": INTRA, "node": INTER})
    assert t == pytest.approx(9e9 / 900e9 + 8 * 5e-6 + 5e9 / 50e9 + 14 * 10e-6)
    with pytest.raises(ValueError, match="node"):
        axis_time({"node": 1.0}, {}, {"gpu": INTRA})
    with pytest.raises(ValueError, match="bandwidth"):
        Link(0.0)


def test_comm_model_script_prints_a_model(capsys):
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "comm_model.py"
    spec = importlib.util.spec_from_file_location("comm_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--seq", "131072"])
    out = capsys.readouterr().out
    assert "MODEL (not a measurement)" in out
    for name in ("ring", "double_ring", "burst", "usp (gpu x node)"):
        assert name in out


@pytest.mark.parametrize("nodes,gpus", [(2, 4), (4, 2), (8, 8)])
def test_double_ring_time_matches_table1_with_the_implementations_hops(nodes, gpus):
    """``double_ring_time`` (bytes from ``costs``, axes overlapped, BurstEngine Fig. 5)
    against Table 1 with the hops the implementation makes (G - No intra-node, No - 1
    inter-node): float32 MHA, no latency, so that every hop of a block of one tensor
    is ``P`` bytes: 6 max(...) for backward="kv" (the DoubleRing row with the gradients
    overlapped too), the BurstAttention row times 1 + 2/(5D) for "q" (D and lse)."""
    from jax_seqpar.parallel.comm_time import double_ring_time
    from jax_seqpar.parallel.costs import AttnShape
    G, H, D = nodes * gpus, 4, 64
    shape = AttnShape(1, G * 32, H, H, D, 4)
    P = 32 * H * D * 4
    intra, inter = Link(900e9), Link(50e9)
    axes, links = {"node": nodes, "gpu": gpus}, {"node": inter, "gpu": intra}
    steps = (G - nodes, nodes - 1)
    slowest = max(steps[0] * P / intra.bandwidth, steps[1] * P / inter.bandwidth)
    assert double_ring_time(shape, axes, links, backward="kv") == pytest.approx(6 * slowest)
    burst = table1_time("burst", nodes=nodes, gpus_per_node=gpus, block_bytes=P,
                        intra=intra, inter=inter, steps=steps)
    assert double_ring_time(shape, axes, links, backward="q") == pytest.approx(
        burst * (1 + 2 / (5 * D)))
    no_overlap = table1_time("double_ring", nodes=nodes, gpus_per_node=gpus, block_bytes=P,
                             intra=intra, inter=inter, steps=steps)
    assert 6 * slowest <= no_overlap  # overlapping the gradients never costs time
