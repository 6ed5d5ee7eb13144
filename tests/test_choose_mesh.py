"""``sharding.choose_mesh``: the mesh-size model (pure Python; nothing compiles)."""

import itertools
import math
import types

import pytest

from jax_seqpar.models.llama import LlamaConfig
from jax_seqpar.parallel.comm_time import Link
from jax_seqpar.parallel.costs import AttnShape, bytes_per_axis
from jax_seqpar.sharding.choose_mesh import choose_mesh, param_count, saved_per_layer
from jax_seqpar.sharding.parallelism import ROLES

NVLINK, IB = Link(450e9, 5e-6), Link(50e9, 10e-6)
H200 = dict(device_memory=141e9, device_flops=989e12, intra_link=NVLINK, inter_link=IB)
TINY = LlamaConfig(vocab_size=128, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, ffn_dim=128)  # float32 activations and parameters
M7 = LlamaConfig(vocab_size=32000, d_model=4096, num_layers=32, num_heads=32,
                 num_kv_heads=8, ffn_dim=11008, dtype="bfloat16", param_dtype="float32")
M70 = LlamaConfig(vocab_size=32000, d_model=8192, num_layers=80, num_heads=64,
                  num_kv_heads=8, ffn_dim=28672, dtype="bfloat16", param_dtype="float32")
CLUSTER_B = dict(seq_len=131072, global_batch=8, devices_per_node=8, nodes=8)
CLUSTER_C = dict(seq_len=32768, global_batch=64, devices_per_node=8, nodes=8)


def _tiny(**kw):
    args = dict(seq_len=64, global_batch=4, devices_per_node=4, nodes=2, **H200)
    return choose_mesh(TINY, **{**args, **kw})


def _find(choice, **sizes):
    return next(c for c in choice.candidates if c.sizes == dict(zip(ROLES, sizes.values())))


def _gb(x):
    return f"{x / 1e9:.3g} GB"


def test_candidates_are_every_factorization_with_reasons():
    """2 nodes x 4: the 4-tuples multiplying to 8, by brute force; the valid ones are
    those the rules admit (tensor divides 4 and the 4 heads, data x fsdp divides the
    batch of 2, 24 tokens divide by 2 x sequence), the others say which rule fails."""
    choice = _tiny(seq_len=24, global_batch=2)
    brute = [t for t in itertools.product(range(1, 9), repeat=4) if math.prod(t) == 8]
    got = [tuple(c.sizes[r] for r in ROLES) for c in choice.candidates]
    assert sorted(got) == sorted(brute) and len(brute) == 20
    for c in choice.candidates:
        D, F, C, T = (c.sizes[r] for r in ROLES)
        valid = T in (1, 2, 4) and D * F <= 2 and 24 % (2 * C) == 0
        assert (c.skipped is None) == valid, c
        assert (c.step_seconds is None) == (not valid)
        if T == 8:
            assert "tensor=8 does not divide devices_per_node=4" in c.skipped
            assert "num_heads=4" in c.skipped
        if D * F > 2:
            assert "global_batch=2" in c.skipped
        if C == 8:
            assert "seq_len=24" in c.skipped and "2*num_shards=8" in c.skipped
    contiguous = _tiny(seq_len=24, global_batch=2, layout="contiguous")
    assert all("seq_len" not in (c.skipped or "") for c in contiguous.candidates)


def test_bytes_by_hand():
    """data=2, sequence=2, tensor=2 on 2 nodes x 4 (tensor, then sequence inside a node,
    data across): 4 rows x 64 tokens, float32 everywhere, remat full."""
    per_layer = 64 * (4 + 2 * 2) * 16 + 4 * 16 * 64 + 3 * 64 * 128 + 2 * 64  # 36992
    P = 2 * 128 * 64 + 64 + 2 * per_layer
    assert param_count(TINY) == (P, per_layer) == (90432, 36992)
    c = _find(_tiny(), data=2, fsdp=1, sequence=2, tensor=2)
    assert c.links == {"tensor": "intra", "sequence": "intra", "params": "intra",
                       "data": "inter"}
    act = (4 // 2) * (64 // 2) * 64 * 4             # b s d e = 16384 bytes
    assert c.bytes["tensor"] == 2 * 12 * act // 2   # (8 + 4 remat) collectives, (T-1)/T
    assert c.bytes["params"] == (2 * 4 + 4) * P // 2 // 2  # (K-1)/K (2p + 4) P / T
    assert c.bytes["data"] == 2 * 4 * P // 2 // 4          # 2 (D-1)/D 4 P / (F C T)
    # ring: 2 rows, 2 of 4 query heads, 1 of 2 kv heads; K/V of 2*32*1*16*4 = 4096 B
    # each: forward one hop of K, V; backward "kv" K, V and dK, dV home, all x 2 layers
    assert c.bytes["sequence"] == 2 * (2 * 8192 + 16384)
    r = bytes_per_axis("ring", AttnShape(2, 64, 2, 1, 16, 4), {"sequence": 2})
    assert c.bytes["sequence"] == 2 * (2 * r["forward"]["sequence"]
                                       + r["backward"]["sequence"])
    assert c.seconds["data"] == pytest.approx(c.bytes["data"] / IB.bandwidth
                                              + 3 * IB.latency)  # L + 1 over IB
    assert c.seconds["tensor"] == pytest.approx(c.bytes["tensor"] / NVLINK.bandwidth
                                                + 24 * NVLINK.latency)
    assert c.state_memory == P * 16 / 4
    # + one gathered layer (f32 weights and gradient) / T, L residuals (whole on the
    # tensor axis) and one working set of 5 + 12 / T residuals, the ring's K, V in flight
    # and f32 dK, dV (fused loss: no logits)
    assert c.memory == (P * 16 / 4 + per_layer * 8 / 2 + (2 + 5 + 12 / 2) * act
                        + 2 * 32 * 1 * 16 * (2 * 2 * 4 + 2 * 4)) == 747264
    assert c.inter_bytes == c.bytes["data"]
    rate = 8 * H200["device_flops"]  # fwd 1 + bwd 2 (matmuls) + the blocks' rerun
    blocks = 2 * (64 * 8 * 16 + 4 * 16 * 64 + 3 * 64 * 128)  # matmul parameters, 2 layers
    assert c.seconds["matmul"] == pytest.approx((6 * P + 2 * blocks) * 4 * 64 / rate)
    assert c.seconds["attention"] == pytest.approx(
        4 * 4 * 64 * 64 * 4 * 16 * 2 * 0.5 * 4.5 / rate)
    half = LlamaConfig(**{**vars(TINY), "param_dtype": "bfloat16"})
    h = _find(choose_mesh(half, seq_len=64, global_batch=4, devices_per_node=4, nodes=2,
                          **H200), data=2, fsdp=1, sequence=2, tensor=2)
    assert h.bytes["params"] == (2 * 2 + 4) * P // 2 // 2  # bf16 gathers, f32 gradients
    assert h.bytes["data"] == c.bytes["data"] and h.state_memory == P * 14 / 4
    flat = _find(_tiny(remat="none"), data=2, fsdp=1, sequence=2, tensor=2)
    assert flat.bytes["tensor"] == 2 * 8 * act // 2
    assert flat.bytes["sequence"] == 2 * (8192 + 16384)
    assert flat.bytes["params"] == c.bytes["params"] and flat.memory > c.memory


def test_one_node_batch_one_goes_sequence():
    """(a) 1 x 8, 7B-like, 128k tokens, batch 1: data and fsdp cannot split one row; the
    ring's bytes hide behind the attention, Megatron's 361 GB do not."""
    choice = choose_mesh(M7, seq_len=131072, global_batch=1, devices_per_node=8, **H200)
    assert choice.sizes == {"data": 1, "fsdp": 1, "sequence": 8, "tensor": 1}
    for c in choice.candidates:
        if c.sizes["data"] * c.sizes["fsdp"] > 1:
            assert "global_batch=1" in c.skipped
    pick, tp = choice.pick, _find(choice, data=1, fsdp=1, sequence=1, tensor=8)
    assert pick.seconds["sequence"] < pick.seconds["attention"]
    assert tp.bytes["tensor"] > 2.5 * (pick.bytes["sequence"] + pick.bytes["params"])
    assert pick.step_seconds < tp.step_seconds and pick.inter_bytes == 0
    assert "sequence=8 within the node" in choice.reason
    assert f"the ring's {_gb(pick.bytes['sequence'])} per step ride 450 GB/s" in choice.reason
    assert "hidden behind the attention" in choice.reason


def test_eight_nodes_data_across_sequence_inside():
    """(b) 8 x 8, batch 8 of 128k: data (not fsdp: its gathers would cross nodes)
    across nodes, the sequence on NVLink; only the gradient all-reduce leaves a node."""
    choice = choose_mesh(M7, **CLUSTER_B, **H200)
    pick = choice.pick
    assert choice.sizes == {"data": 8, "fsdp": 1, "sequence": 8, "tensor": 1}
    assert pick.links["sequence"] == pick.links["params"] == "intra"
    assert pick.inter_bytes == pick.bytes["data"] < pick.bytes["sequence"] / 10
    fsdp = _find(choice, data=1, fsdp=8, sequence=8, tensor=1)
    assert fsdp.links["params"] == "inter" and fsdp.step_seconds > pick.step_seconds
    assert (f"data=8 across nodes carries only the {_gb(pick.bytes['data'])} gradient "
            f"all-reduce at 50 GB/s") in choice.reason
    assert "sequence=8 within the node" in choice.reason


def test_70b_needs_its_state_split():
    """(c) 70B-like on 8 x 8, batch 64 of 32k: ~1.1 TB of weights, gradients and AdamW
    state do not fit 8 ways (the faster data=8 splits are skipped for memory)."""
    choice = choose_mesh(M70, **CLUSTER_C, **H200)
    pick = choice.pick
    assert pick.sizes["tensor"] > 1 and pick.sizes["fsdp"] * pick.sizes["tensor"] >= 16
    assert pick.memory <= 141e9
    modeled = [c for c in choice.candidates if c.memory is not None]
    for c in modeled:
        if c.sizes["fsdp"] * c.sizes["sequence"] * c.sizes["tensor"] <= 8:
            assert c.skipped and "device_memory=141 GB" in c.skipped
    fastest = min(modeled, key=lambda c: c.step_seconds)
    assert fastest.skipped and fastest.step_seconds < pick.step_seconds
    assert "faster split(s) do not fit" in choice.reason
    assert f"{_gb(pick.memory)} per device of 141 GB" in choice.reason
    roomy = choose_mesh(M70, **CLUSTER_C, **{**H200, "device_memory": 1e13})
    assert roomy.pick.step_seconds == fastest.step_seconds  # more memory: never slower


@pytest.mark.parametrize("model, cluster", [(M7, CLUSTER_B), (M70, CLUSTER_C)])
def test_slower_inter_node_link_never_adds_inter_node_bytes(model, cluster):
    base = choose_mesh(model, **cluster, **H200).pick
    for factor in (10, 100):
        slow = choose_mesh(model, **cluster,
                           **{**H200, "inter_link": Link(50e9 / factor, 10e-6)})
        assert slow.pick.inter_bytes <= base.inter_bytes
        assert slow.pick.step_seconds >= base.step_seconds
    if model is M70:
        # tensor=8 would keep the parameter gathers off the slower IB, but the library
        # keeps the residual whole on the tensor axis: 8 rows of 32k tokens' block
        # inputs (80 x 4.3 GB) do not fit, so no slower link moves the pick there
        t8 = [c for c in slow.candidates if c.sizes["tensor"] == 8 and c.memory]
        assert t8 and all("device_memory" in c.skipped for c in t8)
        assert slow.pick.sizes == base.sizes


@pytest.mark.parametrize("kw, match", [
    (dict(seq_len=0), "seq_len=0"), (dict(global_batch=-1), "global_batch=-1"),
    (dict(devices_per_node=2.5), "devices_per_node=2.5"), (dict(nodes=True), "nodes=True"),
    (dict(device_memory=0), "device_memory=0"), (dict(device_flops=None), "device_flops"),
    (dict(inter_link=None), "inter_link=None"), (dict(intra_link=450e9), "intra_link"),
    (dict(remat="selective"), "remat='selective'"), (dict(layout="diagonal"), "layout"),
    (dict(device_memory=1e5), "device_memory=0.0001 GB.*smallest need is"),
    (dict(seq_len=63, global_batch=3), "seq_len=63 and global_batch=3"),
])
def test_errors_name_the_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        _tiny(**kw)


def test_config_is_duck_typed():
    fields = {f: getattr(TINY, f) for f in ("vocab_size", "d_model", "num_layers",
                                            "num_heads", "num_kv_heads", "head_dim",
                                            "ffn_dim", "tie_embeddings", "dtype",
                                            "param_dtype")}
    args = dict(seq_len=64, global_batch=4, devices_per_node=4, nodes=2, **H200)
    got, tiny = choose_mesh(types.SimpleNamespace(**fields), **args), _tiny()
    assert got.sizes == tiny.sizes
    # no fused_loss attribute: the float32 logits and their gradient are counted
    logits = 2 * (4 // 2) * (64 // 2) * (128 / 2) * 4
    assert got.pick.memory == pytest.approx(tiny.pick.memory + logits)
    assert got.pick.bytes == tiny.pick.bytes
    with pytest.raises(ValueError, match=r"lacks fields \['ffn_dim'\]"):
        choose_mesh(types.SimpleNamespace(**{k: v for k, v in fields.items()
                                             if k != "ffn_dim"}), **args)


def test_remat_modes_are_the_models():
    """Every ``REMAT_MODES`` entry is modeled; what a mode keeps orders the memory, what
    it reruns the time (7B-like, 2 x 32k on 2 devices, sequence 2)."""
    from jax_seqpar.layers.remat import REMAT_MODES
    from jax_seqpar.sharding.choose_mesh import REMATS
    assert set(REMATS) == set(REMAT_MODES)
    big = dict(seq_len=32768, global_batch=2, devices_per_node=2,
               **{**H200, "device_memory": 1e13})
    got = {m: _find(choose_mesh(M7, remat=m, **big), data=1, fsdp=1, sequence=2, tensor=1)
           for m in REMATS}
    mem = {m: c.memory for m, c in got.items()}
    assert mem["none"] > mem["attention_mlp"] > mem["attention"] > mem["seq_selective"]
    assert mem["seq_selective"] > mem["full"]
    t = {m: c.seconds for m, c in got.items()}
    assert t["full"]["attention"] > t["seq_selective"]["attention"] > t["none"]["attention"]
    assert t["attention"]["attention"] == t["attention_mlp"]["attention"] == t["none"]["attention"]
    assert t["full"]["matmul"] > t["attention"]["matmul"] > t["attention_mlp"]["matmul"]
    assert t["attention_mlp"]["matmul"] > t["none"]["matmul"]
    # by hand: attention_mlp keeps per layer the input, the attention's output and f32 lse,
    # and gate and up (bf16), on 2 rows... here 2 rows x 16k tokens per device
    b, s, d, e = 2, 16384, 4096, 2
    keep = {"block input": b * s * d * e, "attention out + lse": b * s * 32 * (128 * e + 4),
            "mlp gate + up": 2 * b * s * 11008 * e}
    assert saved_per_layer(M7, "attention_mlp", b, s) == keep
    assert mem["attention_mlp"] - mem["full"] == pytest.approx(
        32 * (sum(keep.values()) - b * s * d * e))
    half = saved_per_layer(M7, "seq_selective", b, s, tensor=2)
    assert half["attention out + lse (later half)"] == keep["attention out + lse"] // 4
    with pytest.raises(ValueError, match="remat='none'"):
        saved_per_layer(M7, "none", b, s)


def test_scanned_model_holds_the_stacked_gradient():
    """A scanned model keeps the blocks' float32 gradient as one stack until the update:
    4 L P_layer bytes over the state's split (measured +22.3 GB at 7B on one H200)."""
    scanned = LlamaConfig(**{**vars(M7), "scan_layers": True})
    args = dict(seq_len=32768, global_batch=2, devices_per_node=2, **H200)
    for sizes in ({"data": 2}, {"fsdp": 2}, {"tensor": 2}):
        sizes = {r: sizes.get(r, 1) for r in ROLES}
        a = _find(choose_mesh(M7, **args), **sizes)
        b = _find(choose_mesh(scanned, **args), **sizes)
        split = sizes["fsdp"] * sizes["tensor"]
        assert b.memory - a.memory == pytest.approx(4 * 32 * param_count(M7)[1] / split)


@pytest.mark.parametrize("name, seq_len, remat, pick", [
    ("1b", 32768, "attention_mlp", "data"), ("1b", 131072, "full", "data"),
    ("7b", 32768, "attention_mlp", "fsdp"), ("7b", 131072, "full", "fsdp")])
def test_picks_the_measured_best_on_two_h200s(name, seq_len, remat, pick):
    """RESULTS.md, "N-D meshes measured": 2 H200s, 2 sequences per step, scanned layers.
    Measured fastest: data=2 for the 1B shape, fsdp=2 for the 7B one (data=2 ran out of
    memory there: 94 GB of replicated state); tensor=2 slowest in all four."""
    from jax_seqpar.models import LlamaConfig as Config
    shapes = {"1b": dict(vocab_size=32000, d_model=2048, num_layers=16, num_heads=32,
                         num_kv_heads=8, ffn_dim=8192), "7b": vars(M7)}
    cfg = Config(**{**shapes[name], "dtype": "bfloat16", "param_dtype": "float32",
                    "scan_layers": True})
    choice = choose_mesh(cfg, seq_len=seq_len, global_batch=2, devices_per_node=2,
                         remat=remat, **H200)
    assert [r for r, n in choice.sizes.items() if n > 1] == [pick]
    tensor = _find(choice, data=1, fsdp=1, sequence=1, tensor=2)
    others = [c for c in choice.candidates if c.sizes["tensor"] == 1]
    assert all(tensor.step_seconds > c.step_seconds for c in others)
    if name == "7b":
        assert "device_memory" in _find(choice, data=2, fsdp=1, sequence=1, tensor=1).skipped


def test_four_h100s_as_measured():
    """RESULTS.md, "N-D meshes measured", 4 H100s (75.7 GiB the allocator holds), 4 x 32k,
    scanned, ``attention_mlp``.  1B measured: data 4 1.026 s < data 2 x sequence 2 1.067 <
    sequence 4 1.137 < tensor 2 x sequence 2 1.142; the 7B ran out of memory on fsdp 4 and
    on fsdp 2 x sequence 2, and the model holds no mesh for it there."""
    from jax_seqpar.models import LlamaConfig as Config
    h100 = dict(H200, device_memory=81559 * 2 ** 20 * 0.95)
    args = dict(seq_len=32768, global_batch=4, devices_per_node=4, remat="attention_mlp",
                **h100)
    one_b = Config(vocab_size=32000, d_model=2048, num_layers=16, num_heads=32,
                   num_kv_heads=8, ffn_dim=8192, dtype="bfloat16", param_dtype="float32",
                   scan_layers=True)
    choice = choose_mesh(one_b, **args)
    assert choice.sizes == dict(data=4, fsdp=1, sequence=1, tensor=1)
    order = [_find(choice, data=4, fsdp=1, sequence=1, tensor=1),
             _find(choice, data=2, fsdp=1, sequence=2, tensor=1),
             _find(choice, data=1, fsdp=1, sequence=4, tensor=1),
             _find(choice, data=1, fsdp=1, sequence=2, tensor=2)]
    assert [c.step_seconds for c in order] == sorted(c.step_seconds for c in order)
    seven_b = LlamaConfig(**{**vars(M7), "scan_layers": True})
    with pytest.raises(ValueError, match="device_memory=.* holds no candidate"):
        choose_mesh(seven_b, **args)
