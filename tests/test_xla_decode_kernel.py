"""``XlaDecodeKernel`` (kernels/xla_decode.py): few query rows against a long key shard.

Checked against the dense float32 reference with key blocks that do not divide the shard
(padding), several blocks (the merge loop) and one block, per-row query positions (ragged
decoding), segment ids, GQA/MQA, large scores and rows that see no key.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (BF16, F32, assert_close, assert_lse_close, make_cotangent,
                     make_large_qkv, make_qkv, reference_fwd_bwd, to_np32, tol)
from jax_seqpar.kernels import XlaDecodeKernel, XlaKernel, get_kernel
from jax_seqpar.kernels.base import KernelRequest
from jax_seqpar.masks import MaskSpec

B, D = 2, 16


def _run(kern, q, k, v, q_pos, kv_pos, mask, q_seg=None, kv_seg=None):
    return jax.jit(lambda *a: kern.fwd(*a[:5], mask, D ** -0.5, *a[5:]))(
        q, k, v, q_pos, kv_pos, q_seg, kv_seg)


def _reference_rows(q, k, v, q_pos, kv_pos, kv_seg, causal):
    """Per batch row (query positions may differ by row): reference (o, lse)."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        qs = None if kv_seg is None else jnp.ones((1, q.shape[1]), jnp.int32)
        ks = None if kv_seg is None else kv_seg[b:b + 1]
        qp = q_pos[b] if q_pos.ndim == 2 else q_pos
        o, lse, _ = reference_fwd_bwd(q[b:b + 1], k[b:b + 1], v[b:b + 1], q[b:b + 1] * 0 + 1,
                                      qs, ks, qp, kv_pos, causal=causal)
        outs.append(o)
        lses.append(lse)
    return jnp.concatenate(outs), jnp.concatenate(lses)


CASES = {
    # name: (Tq, Tk, Hq, Hkv, block_k, causal, ragged lengths, dtype)
    "one_row_many_blocks_padded": (1, 100, 4, 2, 24, True, False, F32),
    "one_row_one_block": (1, 100, 4, 4, None, False, False, F32),
    "four_rows_ragged_gqa": (4, 90, 8, 2, 32, True, True, F32),
    "mqa_ragged_blocks_of_7": (3, 50, 4, 1, 7, True, True, F32),
    "bf16_ragged": (4, 128, 8, 2, 48, True, True, BF16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_reference(name):
    Tq, Tk, Hq, Hkv, bk, causal, ragged, dtype = CASES[name]
    q, k, v = make_qkv(1, B=B, S=Tq, Sk=Tk, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
    lengths = np.array([Tk, Tk // 3 + 1]) if ragged else np.array([Tk, Tk])
    q_pos = jnp.asarray(lengths[:, None] - Tq + np.arange(Tq)[None], jnp.int32)  # [B, Tq]
    kv_pos = jnp.arange(Tk, dtype=jnp.int32)
    kv_seg = jnp.asarray(np.arange(Tk)[None] < lengths[:, None], jnp.int32) if ragged else None
    q_seg = None if kv_seg is None else jnp.ones((B, Tq), jnp.int32)
    o, lse = _run(XlaDecodeKernel(block_k=bk), q, k, v, q_pos, kv_pos, MaskSpec(causal=causal),
                  q_seg, kv_seg)
    chex.assert_shape([o, lse], [q.shape, (B, Hq, Tq)])
    chex.assert_type(o, F32)
    ro, rlse = _reference_rows(q, k, v, q_pos, kv_pos, kv_seg, causal)
    assert_close(o, ro, tol(dtype), "o")
    assert_lse_close(lse, rlse, tol(dtype))


def test_score_budget_sets_the_block_and_results_do_not_depend_on_it():
    Tq, Tk, Hq = 2, 200, 4
    q, k, v = make_large_qkv(2, B=B, S=Tq, Sk=Tk, Hq=Hq, Hkv=2, D=D)  # scores up to ~1e3
    pos = jnp.arange(Tk - Tq, Tk, dtype=jnp.int32), jnp.arange(Tk, dtype=jnp.int32)
    one = XlaDecodeKernel()
    assert one.key_block(B, Tq, Hq, Tk) == Tk
    small = XlaDecodeKernel(max_score_bytes=4 * B * Hq * Tq * 64)  # room for 64 keys
    assert small.key_block(B, Tq, Hq, Tk) == 50  # 4 even steps of 50 rather than 64+64+64+8
    mask = MaskSpec(causal=True)
    o1, l1 = _run(one, q, k, v, *pos, mask)
    o2, l2 = _run(small, q, k, v, *pos, mask)
    ro, rlse, _ = reference_fwd_bwd(q, k, v, q, None, None, *pos, causal=True)
    for o, lse in ((o1, l1), (o2, l2)):
        assert_close(o, ro, 1e-5, "o")
        assert_lse_close(lse, rlse, 1e-5)


def test_rows_that_see_no_key_are_zero_with_minus_inf_lse():
    q, k, v = make_qkv(3, B=B, S=2, Sk=60, Hq=4, Hkv=2, D=D)
    q_pos = jnp.zeros((2,), jnp.int32)
    kv_pos = jnp.arange(60, dtype=jnp.int32)
    kv_seg = jnp.asarray(np.stack([np.ones(60), np.zeros(60)]), jnp.int32)  # row 1: none
    q_seg = jnp.ones((B, 2), jnp.int32)
    o, lse = _run(XlaDecodeKernel(block_k=16), q, k, v, q_pos, kv_pos, MaskSpec(), q_seg,
                  kv_seg)
    o, lse = to_np32(o), to_np32(lse)
    assert np.isneginf(lse[1]).all() and (o[1] == 0).all()
    chex.assert_tree_all_finite((lse[0], o))


def test_backward_is_the_xla_kernels_with_the_same_blocks():
    Tq, Tk = 4, 70
    q, k, v = make_qkv(4, B=B, S=Tq, Sk=Tk, Hq=4, Hkv=2, D=D)
    do = make_cotangent(4, q.shape)
    q_pos = jnp.arange(Tk - Tq, Tk, dtype=jnp.int32)
    kv_pos = jnp.arange(Tk, dtype=jnp.int32)
    mask = MaskSpec(causal=True)
    kern = XlaDecodeKernel(block_k=32)
    o, lse = _run(kern, q, k, v, q_pos, kv_pos, mask)
    grads = jax.jit(lambda *a: kern.bwd(*a, mask, D ** -0.5))(q, k, v, o, lse, do, q_pos, kv_pos)
    _, _, rg = reference_fwd_bwd(q, k, v, do, None, None, q_pos, kv_pos, causal=True)
    for nm, g, r in zip("qkv", grads, rg):
        assert_close(g, r, 1e-5, f"d{nm}")


def test_no_per_block_cond_and_blocks_sliced_in_place():
    q, k, v = make_qkv(0, B=1, S=1, Sk=64, Hq=2, Hkv=2, D=D)
    pos = jnp.zeros((1,), jnp.int32), jnp.arange(64, dtype=jnp.int32)
    mask = MaskSpec(causal=True)
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: XlaDecodeKernel(block_k=16).fwd(
        q, k, v, *pos, mask, 0.25))(q, k, v))
    assert "cond[" not in jaxpr and "dynamic_slice[" in jaxpr
    assert "cond[" in str(jax.make_jaxpr(lambda q, k, v: XlaKernel(8, 16).fwd(
        q, k, v, *pos, mask, 0.25))(q, k, v))  # what this kernel avoids


def test_options_are_validated_and_registered():
    with pytest.raises(ValueError, match="block_k=0"):
        XlaDecodeKernel(block_k=0)
    with pytest.raises(ValueError, match="max_score_bytes"):
        XlaDecodeKernel(max_score_bytes=0)
    with pytest.raises(ValueError, match="max_unrolled_batch"):
        XlaDecodeKernel(max_unrolled_batch=0)
    req = KernelRequest(platform="cpu", dtype="float32", head_dim=D, mask=MaskSpec())
    assert isinstance(get_kernel("xla_decode", req), XlaDecodeKernel)
    assert not isinstance(get_kernel("auto", req), XlaDecodeKernel)
    with pytest.raises(NotImplementedError, match="int8"):
        XlaDecodeKernel().check(KernelRequest(platform="cpu", dtype="int8", head_dim=D,
                                              mask=MaskSpec()))


@pytest.mark.parametrize("unrolled", [32, 1])
def test_rows_one_by_one_and_batched_agree_with_reference(unrolled):
    Tq, Tk, Bn = 2, 80, 3
    q, k, v = make_qkv(5, B=Bn, S=Tq, Sk=Tk, Hq=4, Hkv=2, D=D)
    lengths = np.array([Tk, 30, 55])
    q_pos = jnp.asarray(lengths[:, None] - Tq + np.arange(Tq)[None], jnp.int32)
    kv_pos = jnp.arange(Tk, dtype=jnp.int32)
    kv_seg = jnp.asarray(np.arange(Tk)[None] < lengths[:, None], jnp.int32)
    q_seg = jnp.ones((Bn, Tq), jnp.int32)
    kern = XlaDecodeKernel(block_k=24, max_unrolled_batch=unrolled)
    o, lse = _run(kern, q, k, v, q_pos, kv_pos, MaskSpec(causal=True), q_seg, kv_seg)
    ro, rlse = _reference_rows(q, k, v, q_pos, kv_pos, kv_seg, True)
    assert_close(o, ro, 1e-5, "o")
    assert_lse_close(lse, rlse, 1e-5)
