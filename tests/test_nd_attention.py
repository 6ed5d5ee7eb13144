"""Attention and decoding on N-D meshes: ``batch_axis`` and ``head_axis`` beside the
sequence axes (issue 38, deliverable 1).

Every strategy, both ring backwards, a balanced layout and segment ids against the dense
reference; the GQA head split (kv heads split, or repeated as far as needed); the bytes
on every mesh axis, to the byte; the per-device work falling by the batch and head
factors; the errors.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_seqpar as jsp
from helpers import (F32, assert_close, make_cotangent, make_qkv, reference_fwd_bwd,
                     sorted_segments, tol)
from jax_seqpar.decode import allgather_decode, ring_decode, tree_decode
from jax_seqpar.runtime.comm import collective_bytes
from jax_seqpar.sharding.specs import kv_head_repeats

B, S, D = 4, 32, 16


@functools.lru_cache(maxsize=None)
def mesh_of(*axes):
    """``mesh_of(("dp", 2), ("sp", 2), ("tp", 2))`` over the first devices."""
    names = tuple(a for a, _ in axes)
    shape = tuple(n for _, n in axes)
    return jax.make_mesh(shape, names, devices=jax.devices()[:int(np.prod(shape))])


@functools.lru_cache(maxsize=None)
def auto_mesh_of(*axes):
    """The same with ``AxisType.Auto`` axes (what the Flax layers need)."""
    shape = tuple(n for _, n in axes)
    devices = np.asarray(jax.devices()[:int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, tuple(a for a, _ in axes))


@functools.lru_cache(maxsize=None)
def fwd_bwd(mesh, **kw):
    def f(q, k, v, do, seg):
        out, vjp = jax.vjp(lambda q, k, v: jsp.attention(q, k, v, mesh=mesh, segment_ids=seg,
                                                         **kw), q, k, v)
        return out, vjp(do)

    return jax.jit(f)


def check_against_reference(mesh, *, Hq, Hkv, seg=True, **kw):
    q, k, v = make_qkv(7, B=B, S=S, Hq=Hq, Hkv=Hkv, D=D)
    do = make_cotangent(7, q.shape)
    ids = sorted_segments(7, B, S, num_docs=3) if seg else None
    out, grads = fwd_bwd(mesh, **kw)(q, k, v, do, ids)
    ro, _, rgrads = reference_fwd_bwd(q, k, v, do, ids, causal=kw.get("causal", False))
    t = tol(F32)
    assert_close(out, ro, t, "out")
    for name, g, rg in zip("qkv", grads, rgrads):
        assert_close(g, rg, t, f"d{name}")
    return out


DP_SP_TP = (("dp", 2), ("sp", 2), ("tp", 2))
#: (strategy, backward, layout, Hq, Hkv) on data 2 x sequence 2 x tensor 2
CASES = [
    ("ring", "kv", "zigzag", 8, 2),
    ("ring", "q", "striped", 8, 2),
    ("allgather", "auto", "zigzag", 8, 2),
    ("tree", "auto", "contiguous", 8, 2),
    ("ulysses", "auto", "contiguous", 8, 4),  # 2 kv heads per tensor shard split by 2
]


@pytest.mark.parametrize("strategy,backward,layout,Hq,Hkv", CASES)
def test_strategies_on_data_sequence_tensor(strategy, backward, layout, Hq, Hkv):
    check_against_reference(mesh_of(*DP_SP_TP), Hq=Hq, Hkv=Hkv, axis_name="sp",
                            batch_axis="dp", head_axis="tp", strategy=strategy,
                            backward=backward, layout=layout, causal=True)


@pytest.mark.parametrize("strategy", ["usp", "double_ring"])
def test_two_sequence_axes_with_batch_and_heads(strategy):
    """usp and double_ring take two sequence axes; batch over one more (4 x 2 = 8 would
    leave no room, so data 2 x (outer 2, inner 2))."""
    mesh = mesh_of(("dp", 2), ("outer", 2), ("inner", 2))
    check_against_reference(mesh, Hq=4, Hkv=2, axis_name=("outer", "inner"), batch_axis="dp",
                            strategy=strategy, layout="zigzag", causal=True)


def test_tuple_batch_axis_and_ring_over_tuple():
    """``batch_axis=("dp", "fsdp")``: the batch over the product of two axes."""
    mesh = mesh_of(("dp", 2), ("fsdp", 2), ("sp", 2))
    check_against_reference(mesh, Hq=4, Hkv=4, axis_name="sp", batch_axis=("dp", "fsdp"),
                            causal=True, layout="zigzag")


@pytest.mark.parametrize("Hq,Hkv,T", [(8, 2, 4), (6, 3, 2), (4, 1, 4)])
def test_kv_heads_fewer_than_the_head_axis_are_repeated(Hq, Hkv, T):
    """2 kv heads on 4 tensor shards, 3 on 2, MQA on 4: repeated as far as needed."""
    mesh = mesh_of(("sp", 8 // T), ("tp", T))
    check_against_reference(mesh, Hq=Hq, Hkv=Hkv, axis_name="sp", head_axis="tp",
                            causal=True, backward="q")


def test_repeat_counts():
    assert kv_head_repeats(8, 8, 4) == 1
    assert kv_head_repeats(8, 2, 4) == 2          # 2 -> 4 kv heads
    assert kv_head_repeats(6, 3, 2) == 2          # 3 -> 6 (3 does not divide 2)
    assert kv_head_repeats(12, 4, 6) == 3         # 4 -> 12 = lcm(4, 6)
    assert kv_head_repeats(4, 1, 4) == 4          # MQA
    with pytest.raises(ValueError, match=r"9 query heads do not divide by 2"):
        kv_head_repeats(9, 3, 2)


def test_errors_name_the_arguments():
    mesh = mesh_of(*DP_SP_TP)
    q, k, v = make_qkv(1, B=B, S=S, Hq=6, Hkv=2, D=D)
    with pytest.raises(ValueError, match=r"6 query heads do not divide by 4"):
        jsp.attention(q, k, v, mesh=mesh, axis_name="sp", head_axis=("dp", "tp"))
    with pytest.raises(ValueError, match=r"'sp'.*both axis_name='sp' and head_axis='sp'"):
        jsp.attention(q, k, v, mesh=mesh, axis_name="sp", head_axis="sp")
    with pytest.raises(ValueError, match=r"batch_axis='model': 'model' is not an axis"):
        jsp.attention(q, k, v, mesh=mesh, axis_name="sp", batch_axis="model")
    q3, k3, v3 = make_qkv(1, B=3, S=S, Hq=4, Hkv=2, D=D)
    with pytest.raises(ValueError, match=r"batch of 3 does not divide by 2"):
        jsp.attention(q3, k3, v3, mesh=mesh, axis_name="sp", batch_axis="dp")
    with pytest.raises(TypeError, match=r"mesh axis role"):
        jsp.attention(q, k, v, mesh=mesh, axis_name="sp", batch_axis=2)
    q8, k8, v8 = make_qkv(1, B=B, S=S, Hq=4, Hkv=2, D=D)
    with pytest.raises(ValueError, match=r"query heads Hq=2 and key/value heads Hkv=1"):
        jsp.attention(q8, k8, v8, mesh=mesh, axis_name="sp", head_axis="tp",
                      strategy="ulysses")


def test_bytes_per_axis_to_the_byte():
    """Ring forward on data 2 x sequence 2 x tensor 2: every byte moves on the sequence
    axis, and each hop carries this device's K and V only:
    (G - 1) * 2 * (B / dp) * (S / G) * (Hkv / tp) * D * 4."""
    mesh = mesh_of(*DP_SP_TP)
    Hq, Hkv = 8, 2
    q, k, v = make_qkv(2, B=B, S=S, Hq=Hq, Hkv=Hkv, D=D)
    rep = collective_bytes(lambda q, k, v: jsp.attention(
        q, k, v, mesh=mesh, axis_name="sp", batch_axis="dp", head_axis="tp"), q, k, v)
    G = 2
    want = (G - 1) * 2 * (B // 2) * (S // G) * (Hkv // 2) * D * 4
    assert rep.bytes_by_axis(mesh) == {"sp": want}
    # kv heads repeated for tensor 4 (2 -> 4 kv heads): one kv head per device per hop
    mesh4 = mesh_of(("sp", 2), ("tp", 4))
    rep = collective_bytes(lambda q, k, v: jsp.attention(
        q, k, v, mesh=mesh4, axis_name="sp", head_axis="tp"), q, k, v)
    assert rep.bytes_by_axis(mesh4) == {"sp": (G - 1) * 2 * B * (S // G) * 1 * D * 4}


def _flops(mesh, **kw):
    q, k, v = make_qkv(3, B=B, S=S, Hq=8, Hkv=2, D=D)
    f = jax.jit(lambda q, k, v: jsp.attention(q, k, v, mesh=mesh, axis_name="sp", **kw))
    cost = f.lower(q, k, v).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return cost["flops"]


def test_no_replicated_work():
    """Per-device FLOPs of the compiled program fall by the data and tensor factors."""
    mesh = mesh_of(*DP_SP_TP)
    replicated = _flops(mesh)
    split = _flops(mesh, batch_axis="dp", head_axis="tp")
    assert split * 4 == pytest.approx(replicated, rel=0.02), (split, replicated)


# ----------------------------------------------------------------------------- decoding
def decode_reference(q, k, v, lengths):
    """Per batch row, causal: the queries sit at the end of the row's valid prefix."""
    Tq, S = q.shape[1], k.shape[1]
    rows = []
    for b, n in enumerate(np.asarray(lengths)):
        out, _ = jsp.reference_attention(
            q[b:b + 1], k[b:b + 1], v[b:b + 1], causal=True, q_pos=n - Tq + jnp.arange(Tq),
            kv_pos=jnp.arange(S), segment_ids=jnp.ones((1, Tq), jnp.int32),
            kv_segment_ids=(jnp.arange(S) < n).astype(jnp.int32)[None])
        rows.append(out)
    return jnp.concatenate(rows)


@pytest.mark.parametrize("decode", [tree_decode, ring_decode, allgather_decode])
def test_decode_with_batch_and_heads(decode):
    mesh = mesh_of(*DP_SP_TP)
    Tq, Hq, Hkv = 2, 8, 2
    q, _, _ = make_qkv(4, B=B, S=Tq, Hq=Hq, Hkv=Hkv, D=D)
    _, k, v = make_qkv(5, B=B, S=S, Hq=Hq, Hkv=Hkv, D=D)
    lengths = jnp.asarray([S, 20, 9, 31], jnp.int32)
    out = decode(q, k, v, mesh=mesh, axis_name="sp", batch_axis="dp", head_axis="tp",
                 kv_lengths=lengths, causal=True)
    assert_close(out, decode_reference(q, k, v, lengths), tol(F32), decode.__name__)


def test_tree_decode_with_repeated_kv_heads():
    """MQA (one kv head) on tensor 4: the kv head is repeated onto every tensor shard."""
    mesh = mesh_of(("sp", 2), ("tp", 4))
    q, _, _ = make_qkv(4, B=2, S=1, Hq=4, Hkv=1, D=D)
    _, k, v = make_qkv(5, B=2, S=S, Hq=4, Hkv=1, D=D)
    lengths = jnp.asarray([S, 13], jnp.int32)
    out = tree_decode(q, k, v, mesh=mesh, axis_name="sp", head_axis="tp", kv_lengths=lengths,
                      causal=True)
    assert_close(out, decode_reference(q, k, v, lengths), tol(F32), "MQA on tensor 4")


# ----------------------------------------------------------------------------- layers
def test_flax_layers_take_batch_and_head_axes():
    """Linen and NNX layers on data 2 x sequence 2 x tensor 2 equal the one-device layer
    with the same parameters, output and input gradient."""
    from flax import nnx

    from jax_seqpar.layers import SeqParallelAttention
    from jax_seqpar.layers.nnx import SeqParallelAttention as SeqParallelAttentionNNX

    mesh = auto_mesh_of(*DP_SP_TP)
    x = make_qkv(8, B=B, S=S, Hq=1, Hkv=1, D=32)[0][:, :, 0]     # [B, S, 32]
    kw = dict(num_heads=4, head_dim=8, num_kv_heads=2, causal=True)
    plain = SeqParallelAttention(**kw)
    params = jax.jit(plain.init)(jax.random.key(0), x)
    nd = SeqParallelAttention(**kw, mesh=mesh, axis_name="sp", batch_axis="dp",
                              head_axis="tp", layout="zigzag")

    def out_and_grad(layer):
        return jax.jit(jax.value_and_grad(lambda x: (layer.apply(params, x) ** 2).sum()))(x)

    (want, dwant), (got, dgot) = out_and_grad(plain), out_and_grad(nd)
    assert_close(got, want, tol(F32), "linen loss")
    assert_close(dgot, dwant, tol(F32), "linen dx")
    layer = SeqParallelAttentionNNX(32, 4, 8, num_kv_heads=2, mesh=mesh, axis_name="sp",
                                    batch_axis="dp", head_axis="tp", causal=True,
                                    rngs=nnx.Rngs(0))
    assert layer.options.batch_axis == "dp" and layer.options.head_axis == "tp"
    ref = SeqParallelAttentionNNX(32, 4, 8, num_kv_heads=2, causal=True, rngs=nnx.Rngs(0))
    assert_close(layer(x), ref(x), tol(F32), "nnx output")
