"""``PallasDecodeKernel`` (kernels/pallas_decode.py) in interpret mode on CPU.

Against the dense float32 reference per batch row: GQA/MQA row packing, ragged lengths
(causal: the cache beyond a length is never read), windows, key shards that are not a
multiple of the block, more programs than visible blocks, rows that see nothing.
The compiled GPU path is checked by ``benchmarks/decode_kernel.py`` (RESULTS.md).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import BF16, F32, assert_close, assert_lse_close, make_cotangent, make_qkv, \
    reference_fwd_bwd, to_np32, tol
from jax_seqpar.kernels import DecodeConfig, PallasDecodeKernel, get_kernel
from jax_seqpar.kernels.base import KernelRequest
from jax_seqpar.kernels.pallas_decode import num_splits
from jax_seqpar.masks import MaskSpec

B, D = 2, 64  # the smallest head dim the Pallas kernels accept
SMALL = DecodeConfig(block_k=16, target_programs=16)


def _run(kern, q, k, v, q_pos, kv_pos, mask, q_seg=None, kv_seg=None):
    return jax.jit(lambda *a: kern.fwd(*a[:5], mask, D ** -0.5, *a[5:]))(
        q, k, v, q_pos, kv_pos, q_seg, kv_seg)


def _reference_rows(q, k, v, q_pos, kv_pos, kv_seg, mask):
    outs, lses = [], []
    for b in range(q.shape[0]):
        qs = None if kv_seg is None else jnp.ones((1, q.shape[1]), jnp.int32)
        ks = None if kv_seg is None else kv_seg[b:b + 1]
        o, lse, _ = reference_fwd_bwd(q[b:b + 1], k[b:b + 1], v[b:b + 1], q[b:b + 1], qs, ks,
                                      q_pos[b], kv_pos, causal=mask.causal, window=mask.window)
        outs.append(o)
        lses.append(lse)
    return jnp.concatenate(outs), jnp.concatenate(lses)


CASES = {
    # name: (Tq, Tk, Hq, Hkv, mask, ragged, dtype, config)
    "one_token_gqa_causal_ragged": (1, 200, 8, 2, MaskSpec(causal=True), True, F32, SMALL),
    "four_tokens_mqa_causal_ragged": (4, 150, 4, 1, MaskSpec(causal=True), True, F32, SMALL),
    "mha_dense_full": (2, 96, 2, 2, MaskSpec(), False, F32, SMALL),
    "window_partial_block": (3, 100, 4, 2, MaskSpec(causal=True, window=(40, 0)), False, F32,
                             SMALL),
    "more_programs_than_blocks": (1, 70, 4, 2, MaskSpec(causal=True), True, F32,
                                  DecodeConfig(block_k=32, target_programs=4096)),
    "one_program_per_head": (2, 130, 4, 2, MaskSpec(causal=True), True, F32,
                             DecodeConfig(block_k=16, target_programs=1)),
    "bf16_causal_ragged": (4, 160, 8, 2, MaskSpec(causal=True), True, BF16, SMALL),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
    Tq, Tk, Hq, Hkv, mask, ragged, dtype, config = CASES[name]
    q, k, v = make_qkv(list(CASES).index(name), B=B, S=Tq, Sk=Tk, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
    lengths = np.array([Tk, Tk // 3 + 2]) if ragged else np.array([Tk, Tk])
    q_pos = jnp.asarray(lengths[:, None] - Tq + np.arange(Tq)[None], jnp.int32)
    kv_pos = jnp.arange(Tk, dtype=jnp.int32)
    kv_seg = jnp.asarray(np.arange(Tk)[None] < lengths[:, None], jnp.int32) if ragged else None
    q_seg = None if kv_seg is None else jnp.ones((B, Tq), jnp.int32)
    o, lse = _run(PallasDecodeKernel(config), q, k, v, q_pos, kv_pos, mask, q_seg, kv_seg)
    chex.assert_shape([o, lse], [q.shape, (B, Hq, Tq)])
    chex.assert_type(o, F32)
    ro, rlse = _reference_rows(q, k, v, q_pos, kv_pos, kv_seg, mask)
    assert_close(o, ro, tol(dtype), "o")
    assert_lse_close(lse, rlse, tol(dtype))


def test_rows_that_see_no_key():
    q, k, v = make_qkv(3, B=B, S=1, Sk=48, Hq=4, Hkv=2, D=D)
    q_pos = jnp.full((1,), 47, jnp.int32)
    kv_pos = jnp.arange(48, dtype=jnp.int32)
    kv_seg = jnp.asarray(np.stack([np.ones(48), np.zeros(48)]), jnp.int32)  # row 1: none
    o, lse = _run(PallasDecodeKernel(SMALL), q, k, v, q_pos, kv_pos, MaskSpec(),
                  jnp.ones((B, 1), jnp.int32), kv_seg)
    o, lse = to_np32(o), to_np32(lse)
    assert np.isneginf(lse[1]).all() and (o[1] == 0).all()
    chex.assert_tree_all_finite((lse[0], o))


def test_backward_goes_through_xla_decode():
    q, k, v = make_qkv(4, B=B, S=2, Sk=64, Hq=4, Hkv=2, D=D)
    do = make_cotangent(4, q.shape)
    q_pos, kv_pos = jnp.arange(62, 64, dtype=jnp.int32), jnp.arange(64, dtype=jnp.int32)
    mask = MaskSpec(causal=True)
    kern = PallasDecodeKernel(SMALL)
    o, lse = _run(kern, q, k, v, q_pos, kv_pos, mask)
    grads = kern.bwd(q, k, v, o, lse, do, q_pos, kv_pos, mask, D ** -0.5)
    _, _, rg = reference_fwd_bwd(q, k, v, do, None, None, q_pos, kv_pos, causal=True)
    for nm, g, r in zip("qkv", grads, rg):
        assert_close(g, r, 1e-5, f"d{nm}")


def test_splits_and_config_validation():
    cfg = DecodeConfig(target_programs=1024)
    assert num_splits(cfg, 1, 8, 10_000) == 128
    assert num_splits(cfg, 8, 8, 10_000) == 16
    assert num_splits(cfg, 1, 8, 5) == 5      # never more programs than key blocks
    assert num_splits(cfg, 64, 8, 100) == 2
    for bad, msg in ((dict(block_k=48), "power of two"), (dict(block_k=8), ">= 16"),
                     (dict(target_programs=0), "target_programs")):
        with pytest.raises(ValueError, match=msg):
            DecodeConfig(**bad)
    with pytest.raises(TypeError, match="DecodeConfig"):
        PallasDecodeKernel(config="fast")


def test_refusals_name_the_reason():
    kern = PallasDecodeKernel(SMALL)
    with pytest.raises(NotImplementedError, match="head_dim=32"):
        kern.check(KernelRequest(platform="gpu", dtype="bfloat16", head_dim=32, mask=MaskSpec()))
    with pytest.raises(NotImplementedError, match="int8"):
        kern.check(KernelRequest(platform="gpu", dtype="int8", head_dim=64, mask=MaskSpec()))
    req = KernelRequest(platform="gpu", dtype="bfloat16", head_dim=128, mask=MaskSpec())
    assert not isinstance(get_kernel("auto", req), PallasDecodeKernel)
