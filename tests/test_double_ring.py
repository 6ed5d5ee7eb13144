"""Issue 19 item 1: strategy="double_ring" (BurstEngine §3.1, Fig. 4-5) on 2-D meshes.

Each configuration compiles two programs once (the forward with its residuals, and the
backward); the same compiled programs give the numerics (outputs and gradients against
the dense reference), the bytes per mesh axis (to the byte, ``costs.bytes_per_axis``)
and the overlap windows of the scheduled HLO (``jax_seqpar.runtime.overlap``).  Small shapes:
S = 64 tokens on 8 devices, D = 8.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

import helpers
import jax_seqpar as jsp
from jax_seqpar.runtime.comm import analyze_hlo
from jax_seqpar.layouts import permute_sequence, unpermute_sequence
from jax_seqpar.masks import MaskSpec
from jax_seqpar.runtime.overlap import overlap_windows
from jax_seqpar.parallel.costs import (AttnShape, DoubleRingShape, backward_bytes,
                                       bytes_per_axis, choose_backward, double_ring_bytes)
from jax_seqpar.parallel.schedule import double_ring_schedule

F32, BF16 = jnp.float32, jnp.bfloat16
B, S, D = 1, 64, 8
AXES = ("node", "local")


@dataclasses.dataclass(frozen=True)
class Case:
    mesh: tuple            # (nodes, local)
    Hq: int
    Hkv: int
    backward: str
    causal: bool = True
    window: tuple = None
    layout: str = "zigzag"
    segments: bool = False
    dtype: object = F32
    permuted: bool = True  # arrays in layout order (no reorder collectives to count)


CASES = {
    # causal zigzag over the whole 2-D order, GQA, KV backward
    "zigzag_gqa_kv_2x4": Case((2, 4), 4, 2, "kv"),
    # causal zigzag, packed documents, Burst backward, 4 nodes (inter-node accumulators)
    "zigzag_segments_q_4x2": Case((4, 2), 2, 2, "q", segments=True),
    # a two-sided sliding window (steps skipped), MQA, bf16, "auto" (-> "kv")
    "window_bf16_auto_4x2": Case((4, 2), 4, 1, "auto", causal=False, window=(11, 3),
                                 layout="contiguous", dtype=BF16),
    # causal striped, natural-order arrays (the api permutes), "auto" (-> "q")
    "striped_natural_auto_2x4": Case((2, 4), 2, 2, "auto", layout="striped",
                                     permuted=False),
    # 8 nodes of one device: the inter-node chains' middle rounds as one loop (5 and 6
    # iterations), both backwards
    "zigzag_q_8x1": Case((8, 1), 2, 2, "q"),
    "contiguous_kv_8x1": Case((8, 1), 2, 1, "kv", layout="contiguous"),
}


@functools.lru_cache(maxsize=None)
def _mesh(shape):
    return jax.make_mesh(shape, AXES, devices=jax.devices()[:shape[0] * shape[1]])


def _inputs(c: Case):
    q, k, v = helpers.make_qkv(c.Hq + 7 * c.Hkv, B=B, S=S, Hq=c.Hq, Hkv=c.Hkv, D=D,
                               dtype=c.dtype)
    do = helpers.make_cotangent(c.Hq, q.shape, c.dtype)
    seg = helpers.sorted_segments(c.Hkv, B, S) if c.segments else None
    return q, k, v, do, seg


def _order(x, c: Case):
    """Natural token order -> the order the program takes (layout order if permuted)."""
    return permute_sequence(x, c.layout, 8) if c.permuted else x


@functools.lru_cache(maxsize=None)
def _run(name):
    """Compile the forward (with residuals) and the backward once; run them.

    Returns ``(case, outputs, gradients, forward HLO, backward HLO)``, the outputs and
    gradients in natural token order."""
    c = CASES[name]
    q, k, v, do, seg = _inputs(c)
    mesh = _mesh(c.mesh)
    seg_in = None if seg is None else _order(seg, c)

    def att(q, k, v):
        return jsp.attention(q, k, v, mesh=mesh, axis_name=AXES, strategy="double_ring",
                             causal=c.causal, window=c.window, layout=c.layout,
                             segment_ids=seg_in, backward=c.backward, permuted=c.permuted)

    args = tuple(_order(x, c) for x in (q, k, v))
    fwd = jax.jit(lambda q, k, v: jax.vjp(att, q, k, v)).lower(*args).compile()
    out, vjp = fwd(*args)
    bwd = jax.jit(lambda vjp, do: vjp(do)).lower(vjp, _order(do, c)).compile()
    grads = bwd(vjp, _order(do, c))
    def back(x):  # on the host: a sharded array cannot be gathered without a sharding
        x = jax.device_get(x)
        return unpermute_sequence(x, c.layout, 8) if c.permuted else x

    return c, back(out), tuple(back(g) for g in grads), fwd.as_text(), bwd.as_text()


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
    c, out, grads, _, _ = _run(name)
    q, k, v, do, seg = _inputs(c)
    ref_o, _, ref_g = helpers.reference_fwd_bwd(q, k, v, do, seg, causal=c.causal,
                                                window=c.window)
    tol = helpers.tol(c.dtype)
    assert out.dtype == c.dtype
    helpers.assert_close(out, ref_o, tol, f"{name} out")
    for what, g, r in zip(("dq", "dk", "dv"), grads, ref_g):
        assert g.dtype == c.dtype
        helpers.assert_close(g, r, tol, f"{name} {what}")


def _schedule(c: Case):
    return double_ring_schedule(c.layout, MaskSpec(causal=c.causal, window=c.window),
                                S // 8, *c.mesh)


@pytest.mark.parametrize("name", ["zigzag_gqa_kv_2x4", "zigzag_segments_q_4x2"])
def test_bytes_per_axis(name):
    """Forward and backward bytes per mesh axis equal ``costs`` to the byte (float32:
    the CPU backend sends bf16 collectives as f32), and add up to the 1-D ring's."""
    c, _, _, fwd_text, bwd_text = _run(name)
    mesh = _mesh(c.mesh)
    shape = AttnShape(B, S, c.Hq, c.Hkv, D, 4, c.segments)
    axes = dict(zip(AXES, c.mesh))
    want = bytes_per_axis("double_ring", shape, axes, backward=c.backward,
                          chains=_schedule(c).chains())
    assert analyze_hlo(fwd_text, 8).bytes_by_axis(mesh) == want["forward"]
    assert analyze_hlo(bwd_text, 8).bytes_by_axis(mesh) == want["backward"]
    ring = bytes_per_axis("ring", shape, {"sp": 8}, backward=c.backward)
    assert sum(want["forward"].values()) == ring["forward"]["sp"]  # G - 1 hops in all
    No, Ni = c.mesh
    t = 2 * B * (S // 8) * c.Hkv * D * 4 + (B * (S // 8) * 4 if c.segments else 0)
    assert want["forward"] == {"node": (No - 1) * t, "local": No * (Ni - 1) * t}


def test_rounds_roll_when_they_make_the_same_tiles():
    """``_uniform_round``: the rounds a rolled inter-node chain loops over must make the
    same tiles; a causal zigzag's all do, a window's (which reaches the rounds next to a
    node and not the others) do not. The 8 x 1 programs hold one round loop each way."""
    from jax_seqpar.parallel.double_ring import _uniform_round
    causal = double_ring_schedule("zigzag", MaskSpec(causal=True), 8, 8, 1)
    assert _uniform_round(causal, [1, 2, 3, 4, 5, 6]) == 1
    window = double_ring_schedule("contiguous", MaskSpec(window=(20, 0)), 8, 8, 1)
    assert window.needs(1, 0) and window.needs(2, 0) and not window.needs(4, 0)
    assert _uniform_round(window, [1, 2, 3, 4]) is None
    assert _uniform_round(window, []) is None
    for name in ("zigzag_q_8x1", "contiguous_kv_8x1"):
        _, _, _, fwd_text, bwd_text = _run(name)
        assert fwd_text.count(" while(") >= 1 and bwd_text.count(" while(") >= 1, name


def test_window_skips_steps():
    """Window (11, 3) on 4 x 2 devices of 8 tokens: the keys of a query lie at most 2
    shards to the left and 1 to the right (shard distances 1, 2 and -1), which on the
    4 x 2 grid are 4 of the 7 offsets (a, b) != (0, 0): one round each way around the
    node ring and one intra-node hop in each round, instead of 3 rounds of 1 hop."""
    c = CASES["window_bf16_auto_4x2"]
    sched = _schedule(c)
    assert sched.need == {(0, 0), (0, 1), (1, 0), (1, 1), (3, 1)}
    assert sched.outer.chains() == [(1, 1), (-1, 1)]
    assert sched.chains() == ((1, 1), ((1,), (1,), (1,)))
    full = double_ring_schedule("contiguous", MaskSpec(causal=True), 8, 4, 2)
    assert full.chains() == ((3,), ((1,),) * 4)


def _windows(name):
    c, _, _, fwd_text, bwd_text = _run(name)
    return c, _mesh(c.mesh), overlap_windows(fwd_text), overlap_windows(bwd_text)


@pytest.mark.parametrize("name", ["zigzag_gqa_kv_2x4", "zigzag_segments_q_4x2"])
def test_overlap_forward(name):
    """Forward (BurstEngine Fig. 5, activations): K, V and the ids (one buffer) make G - No hops over
    ``local`` and No - 1 over ``node``.  Every inter-node hop has tiles scheduled before
    a kernel reads the block it brings (the round in hand computes while it travels) and
    tiles that do not depend on it at all; every intra-node hop that forwards a received
    block has a tile between it and its first use (the 1-D ring's property), or else
    tiles before its block is read and tiles independent of it.  An inter-node hop's
    first user is often the intra-node hop that forwards its block in the next round,
    and an intra-node hop's the inter-node hop that carries its block on (a collective,
    scheduled early by CPU), so those windows are not tested.
    """
    c, mesh, fwd, _ = _windows(name)
    No, Ni = c.mesh
    arrays = 1  # K, V and the ids in one buffer (ring_common.Parcel)
    assert all(w.kind == "collective-permute" and not w.is_async for w in fwd)  # CPU
    by_axis = {a: [w for w in fwd if w.axes(mesh) == a] for a in AXES}
    # The inter-node chain's No - 1 hops, rolled when there are two or more (every round
    # of a causal zigzag makes the same tiles): the first from this device's block, one in
    # the loop's body (run No - 2 times); the last round forwards nothing. So the text
    # holds min(No, 3) rounds: round 0, the loop's body, the last.
    assert len(by_axis["node"]) == arrays * min(No - 1, 2)
    rounds = min(No, 3)
    # A round's Ni - 1 intra-node hops, rolled (ring_common.ROLL_HOPS) when there are two
    # or more: the first from the round's block, then one loop whose body forwards the
    # block it received (run Ni - 2 times); the last hop forwards nothing.
    hops = min(Ni - 1, 2)  # intra-node transfers per round in the program's text
    assert len(by_axis["local"]) == arrays * rounds * hops
    assert not any(w.gradient for w in fwd)
    for w in by_axis["node"]:
        assert w.compute_until_needed and w.independent, (w.collective, w.until_needed)
    # K and V that arrived: all but round 0's first hop, which sends this device's own
    # (packed); a block carried out of the rounds' loop is read from its result
    forwarded = [w for w in by_axis["local"] if w.operand_ops in (
        ("collective-permute",), ("copy",), ("get-tuple-element",))]
    assert len(forwarded) == rounds * hops - 1
    if Ni > 2:  # each round's loop body forwards K and V once: a body per round in the text
        entry = {w.computation for w in by_axis["node"]}
        assert len({w.computation for w in forwarded} - entry) == rounds
    # a tile in the window, or (when the block's first user is the inter-node hop that
    # carries it on, as for the inter-node hops above) tiles scheduled before any kernel
    # reads it and tiles independent of it
    late = [w for w in forwarded
            if not (w.overlapped or (w.compute_until_needed and w.independent))]
    assert not late, [(w.collective, w.between) for w in late]


@pytest.mark.parametrize("name", ["zigzag_gqa_kv_2x4", "zigzag_segments_q_4x2"])
def test_overlap_backward(name):
    """Backward (Fig. 5, gradients): the activation hops (K, V; or Q, dO, D, lse, ids)
    have tiles scheduled before a kernel reads them; no tile depends on any gradient
    accumulator hop (it is added to and sent on one round late, BurstEngine's warm-up),
    so each has independent tiles to hide behind.  The accumulators cross nodes No - 1
    times: No - 2 float32 hops and one hop home (dK and dV in one buffer)."""
    c, mesh, _, bwd = _windows(name)
    No, Ni = c.mesh
    acts = [w for w in bwd if not w.gradient]
    grads = [w for w in bwd if w.gradient]
    for w in acts:
        assert w.compute_until_needed, (w.collective, w.until_needed)
    # dK and dV in one buffer (ring_common.Parcel), as dQ
    assert len([w for w in grads if w.axes(mesh) == "node"]) == No - 1
    for w in grads:
        assert w.feeds == () and w.independent, (w.collective, w.feeds)


def test_backward_bytes_formula_and_auto():
    """The closed forms of ``costs`` (module comment) for the whole double ring, and
    ``backward="auto"``'s choice by total bytes (MHA -> "q", GQA group 4 -> "kv")."""
    No, Ni, T, H, Dh, e = 4, 8, 128, 4, 64, 2
    s = DoubleRingShape(No, Ni, 1, T, H, H, Dh, e)
    t, a = 2 * T * H * Dh * e + 2 * 4 * H * T, T * H * Dh
    assert double_ring_bytes("q", s) == (
        (No - 1) * t + (No - 2) * 4 * a + a * e,
        No * (Ni - 1) * t + No * (Ni - 2) * 4 * a + a * e + (No - 1) * 4 * a)
    assert choose_backward(s).scheme == "q"
    gqa = dataclasses.replace(s, kv_heads=1)
    assert choose_backward(gqa).scheme == "kv"
    assert choose_backward(gqa).kv_bytes == backward_bytes("kv", gqa) == sum(
        double_ring_bytes("kv", gqa))


def test_axis_errors():
    q, k, v = helpers.make_qkv(1, B=B, S=S, Hq=2, Hkv=2, D=D)
    mesh = _mesh((2, 4))
    with pytest.raises(ValueError, match=r"axis_name=\(outer, inner\).*strategy='ring'"):
        jsp.attention(q, k, v, mesh=helpers.make_mesh(8), axis_name="sp",
                      strategy="double_ring")
    with pytest.raises(ValueError, match=r"axis_name=\(outer, inner\)"):
        jsp.attention(q, k, v, mesh=mesh, axis_name=("node",), strategy="double_ring")
    with pytest.raises(ValueError, match=r"'node' appears twice in axis_name"):
        jsp.attention(q, k, v, mesh=mesh, axis_name=("node", "node"),
                      strategy="double_ring")
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        jsp.attention(q, k, v, mesh=mesh, axis_name=("node", "gpu"),
                      strategy="double_ring")
    with pytest.raises(ValueError, match=r"divisible by 2\*num_shards=8"):
        jsp.attention(q[:, :56], k[:, :56], v[:, :56], mesh=mesh, axis_name=AXES,
                      strategy="double_ring", layout="zigzag")


def test_overlap_check_script_takes_the_double_ring(tmp_path, monkeypatch, capsys):
    """``benchmarks/overlap_check.py --strategy double_ring`` (for the GPU run later)."""
    import importlib.util
    import pathlib
    bench = pathlib.Path(__file__).parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    monkeypatch.setenv("OUT", str(tmp_path))
    spec = importlib.util.spec_from_file_location("overlap_check", bench / "overlap_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rc = mod.main(["--strategy", "double_ring", "--nodes", "4", "--seq", "64", "--heads", "2",
                   "--head-dim", "8", "--backward", "q"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "double_ring {'node': 4, 'local': 2}" in out and " node " in out
    assert (tmp_path / "overlap_double_ring4x_cpu8.json").exists()


def test_per_device_function_in_a_users_shard_map():
    """``parallel.double_ring_attention`` inside one's own ``shard_map`` over the tuple
    of axes (shard ``n * Ni + l`` on device ``(n, l)``): the forward equals the reference."""
    from jax.sharding import PartitionSpec as P
    from jax_seqpar.runtime._compat import place, shard_map
    from jax_seqpar.parallel import double_ring_attention
    q, k, v = helpers.make_qkv(3, B=B, S=S, Hq=2, Hkv=2, D=D)
    mesh = _mesh((2, 4))
    spec = P(None, AXES)
    f = jax.jit(shard_map(lambda q, k, v: double_ring_attention(q, k, v, axis_name=AXES),
                          mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    ref = helpers.reference_fwd_bwd(q, k, v, q)[0]
    out = f(*(place(x, mesh, spec) for x in (q, k, v)))
    helpers.assert_close(out, ref, helpers.tol(F32), "per-device double ring")
