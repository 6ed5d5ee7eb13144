"""Issue 19 item 5: ``parallel.choose.choose_strategy`` (a model; nothing compiles)."""

import pytest

from jax_seqpar.parallel.choose import choose_strategy
from jax_seqpar.parallel.comm_time import Link

NVLINK, NIC = Link(900e9, 5e-6), Link(50e9, 10e-6)
CLUSTER = dict(links={"node": NIC, "gpu": NVLINK}, head_dim=128)


def test_many_nodes_prefer_the_double_ring():
    """8 nodes x 8 GPUs, 128k tokens: the flat ring waits for the NIC at every one of its
    63 steps; the double ring sends 7 of its 63 hops across nodes, overlapped with the
    56 NVLink hops; USP's all-to-alls inside the node are not overlapped."""
    c = choose_strategy({"node": 8, "gpu": 8}, seq_len=131072, q_heads=32, kv_heads=8,
                        **CLUSTER)
    assert c.strategy == "double_ring" and c.backward == "kv"  # GQA group 4
    assert c.times["double_ring"] < c.times["usp"] < c.times["ring"] / 5
    assert "ulysses" in c.skipped and "divisible by 64" in c.skipped["ulysses"]
    assert "strategy='double_ring'" in c.reason and "ring" in c.reason


def test_heads_decide_usp_and_ulysses():
    c = choose_strategy({"node": 8, "gpu": 8}, seq_len=131072, q_heads=12, kv_heads=4,
                        **CLUSTER)
    assert "usp" in c.skipped and "gpu=8" in c.skipped["usp"] and "usp" not in c.times
    one_node = choose_strategy({"node": 1, "gpu": 8}, seq_len=131072, q_heads=32,
                               kv_heads=8, **CLUSTER)
    assert one_node.strategy == "ulysses"  # one node: all-to-alls on NVLink send least
    assert one_node.times["ring"] == pytest.approx(one_node.times["double_ring"])


def test_compute_hides_communication_and_ties_go_to_less_traffic():
    kw = dict(seq_len=1 << 20, q_heads=32, kv_heads=8, device_flops=400e12, **CLUSTER)
    c = choose_strategy({"node": 8, "gpu": 8}, **kw)
    assert c.times["ring"] == c.times["double_ring"]  # both hidden behind 1.2 s of tiles
    assert c.strategy == "double_ring" and "compute" in c.reason
    small = choose_strategy({"node": 8, "gpu": 8}, memory_bytes=2**30, **kw)
    assert "allgather" in small.skipped and "GiB" in small.skipped["allgather"]


def test_one_axis_and_errors():
    c = choose_strategy({"sp": 8}, seq_len=65536, q_heads=8, kv_heads=8,
                        links={"sp": NVLINK}, head_dim=128)
    assert set(c.times) == {"ring", "ulysses", "allgather"}
    with pytest.raises(ValueError, match="no Link"):
        choose_strategy({"node": 2, "gpu": 4}, seq_len=4096, q_heads=8, kv_heads=8,
                        links={"gpu": NVLINK}, head_dim=64)
    with pytest.raises(ValueError, match="one or two mesh axes"):
        choose_strategy({"a": 2, "b": 2, "c": 2}, seq_len=4096, q_heads=8, kv_heads=8,
                        links={}, head_dim=64)
    with pytest.raises(ValueError, match="divisible by 2 \\* 8"):
        choose_strategy({"sp": 8}, seq_len=4100, q_heads=8, kv_heads=8,
                        links={"sp": NVLINK}, head_dim=64)
