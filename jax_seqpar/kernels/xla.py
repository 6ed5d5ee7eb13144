"""Blockwise online-softmax attention in pure ``jax.numpy`` (any platform).

Forward: for each query block, a ``lax.scan`` over key/value blocks keeps the running
max ``m``, denominator ``l`` and unnormalised output (Ring Attention notes, "blockwise
computation"; FlashAttention-2 Alg. 1), so memory is ``O(block_q * block_k)`` scores
per head rather than ``O(Tq * Tk)``.  Backward: FlashAttention-2 Alg. 2 -- ``P`` is
recomputed from the saved ``lse`` and ``dS = P * (dP - delta)`` with
``delta = rowsum(dO * O)`` (BurstEngine Eq. 7-8).

GQA is done by viewing q as ``[B, T, Hkv, g, D]``; K/V are never repeated.  A tile is
skipped with ``lax.cond`` when the position bounds of its rows prove it fully masked.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from jax_seqpar.runtime._compat import vary_like
from jax_seqpar.kernels.base import KernelRequest, register_kernel
from jax_seqpar.masks import MaskSpec

F32 = jnp.float32


def _precision(dtype):
    # float32 inputs get true float32 matmuls (not TF32) so the 1e-5 budget holds on GPU.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == F32 else lax.Precision.DEFAULT


def _pad_axis(x, axis, new_len, mode="constant", value=0):
    pad = new_len - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    if mode == "edge":
        return jnp.pad(x, widths, mode="edge")
    return jnp.pad(x, widths, constant_values=value)


def _blocks(x, axis, block):
    """Split ``axis`` into ``[n, block]`` and move ``n`` to the front."""
    n = x.shape[axis] // block
    x = x.reshape(x.shape[:axis] + (n, block) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _unblocks(x, axis):
    """Inverse of ``_blocks``: ``[n, ..., block, ...]`` -> ``[..., n*block, ...]``."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def _q_pos_blocks(q_pos, Lq: int, bq: int):
    """Query positions ``[Tq]`` or per batch row ``[B, Tq]``, padded and cut into blocks."""
    q_pos = _pad_axis(q_pos.astype(jnp.int32), q_pos.ndim - 1, Lq, mode="edge")
    return _blocks(q_pos, q_pos.ndim - 1, bq)


@dataclasses.dataclass(frozen=True)
class _Tiles:
    """Key/value side cut into blocks, padded, with per-block position bounds."""

    k: jax.Array      # [nk, B, bk, Hkv, D]
    v: jax.Array
    pos: jax.Array    # [nk, bk]
    valid: jax.Array  # [nk, bk]
    seg: Optional[jax.Array]  # [nk, B, bk]
    lo: jax.Array     # [nk]
    hi: jax.Array     # [nk]


def _kv_tiles(k, v, kv_pos, kv_seg, bk):
    Tk = k.shape[1]
    nk = -(-Tk // bk)
    L = nk * bk
    k, v = _pad_axis(k, 1, L), _pad_axis(v, 1, L)
    pos = _pad_axis(kv_pos.astype(jnp.int32), 0, L, mode="edge")
    valid = jnp.arange(L) < Tk
    seg = None if kv_seg is None else _blocks(_pad_axis(kv_seg, 1, L, mode="edge"), 1, bk)
    pos_b = pos.reshape(nk, bk)
    return _Tiles(_blocks(k, 1, bk), _blocks(v, 1, bk), pos_b, valid.reshape(nk, bk), seg,
                  pos_b.min(axis=1), pos_b.max(axis=1))


def _scores(qi, kj, scale, qp, kp, kvalid, qs, ks, mask: MaskSpec):
    """Masked float32 scores ``[B, Hkv, g, bq, bk]`` of a (query block, key block) tile."""
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qi, kj, preferred_element_type=F32,
                   precision=_precision(qi.dtype)) * scale
    vis = mask.visible(qp, kp, qs, ks) & kvalid[None, :]  # [B or 1, bq, bk]
    if vis.ndim == 2:
        vis = vis[None]
    return jnp.where(vis[:, None, None], s, -jnp.inf)


def _maybe(pred, mask: MaskSpec, fn, skip, *args):
    """``fn(*args)`` if the tile may be visible, else ``skip(*args)`` (no-op for dense masks)."""
    if mask.is_dense:
        return fn(*args)
    return lax.cond(pred, fn, skip, *args)


@dataclasses.dataclass(frozen=True)
class XlaKernel:
    """Pure-jnp blockwise kernel.  ``block_q``/``block_k`` bound the score tile size."""

    block_q: int = 512
    block_k: int = 512
    name: str = "xla"

    def __post_init__(self):
        for f in ("block_q", "block_k"):
            val = getattr(self, f)
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{f}={val!r} must be a positive int")

    def check(self, request: KernelRequest) -> None:
        if jnp.dtype(request.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                                            jnp.dtype(jnp.float16)):
            raise NotImplementedError(f"dtype {request.dtype} is not supported by the xla kernel")

    # ------------------------------------------------------------------ forward
    def fwd(self, q, k, v, q_pos, kv_pos, mask: MaskSpec, scale: float, q_seg=None, kv_seg=None):
        """``(o, lse)`` of one tile (the kernel contract, ``kernels/base.py``)."""
        return _jitted_fwd(self, q, k, v, q_pos, kv_pos, mask, float(scale), q_seg, kv_seg)

    def bwd(self, q, k, v, o, lse, do, q_pos, kv_pos, mask: MaskSpec, scale: float,
            q_seg=None, kv_seg=None, delta=None):
        """``(dq, dk, dv)`` of one tile (the kernel contract, ``kernels/base.py``)."""
        return _jitted_bwd(self, q, k, v, o, lse, do, q_pos, kv_pos, mask, float(scale),
                           q_seg, kv_seg, delta)

    def _fwd(self, q, k, v, q_pos, kv_pos, mask: MaskSpec, scale: float, q_seg=None,
             kv_seg=None):
        B, Tq, Hq, D = q.shape
        Hkv = k.shape[2]
        g = Hq // Hkv
        bq, bk = min(self.block_q, Tq), min(self.block_k, k.shape[1])
        nq = -(-Tq // bq)
        Lq = nq * bq
        kv = _kv_tiles(k, v, kv_pos, kv_seg, bk)
        qb = _blocks(_pad_axis(q, 1, Lq).reshape(B, Lq, Hkv, g, D), 1, bq)
        qpb = _q_pos_blocks(q_pos, Lq, bq)
        qsb = None if q_seg is None else _blocks(_pad_axis(q_seg, 1, Lq, mode="edge"), 1, bq)
        pv_dtype = v.dtype

        def q_block(args):
            qi, qp, qs = args
            q_lo, q_hi = qp.min(), qp.max()

            def step(carry, t):
                kj, vj, kp, kvalid, ks, klo, khi = t

                def compute(carry):
                    m, l, acc = carry
                    s = _scores(qi, kj, scale, qp, kp, kvalid, qs, ks, mask)
                    m_new = jnp.maximum(m, s.max(axis=-1))
                    m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
                    alpha = jnp.exp(m - m_safe)
                    p = jnp.exp(s - m_safe[..., None])
                    l = l * alpha + p.sum(axis=-1)
                    pv = jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(pv_dtype), vj,
                                    preferred_element_type=F32, precision=_precision(pv_dtype))
                    return m_new, l, acc * alpha[..., None] + pv

                pred = mask.tile_may_be_visible(q_lo, q_hi, klo, khi)
                return _maybe(pred, mask, compute, lambda c: c, carry), None

            init = (jnp.full((B, Hkv, g, bq), -jnp.inf, F32), jnp.zeros((B, Hkv, g, bq), F32),
                    jnp.zeros((B, Hkv, g, bq, D), F32))
            init = vary_like(init, qi, qs, kv.k, kv.v, kv.seg)
            (m, l, acc), _ = lax.scan(step, init, (kv.k, kv.v, kv.pos, kv.valid, kv.seg, kv.lo, kv.hi))
            has = l > 0
            lse = jnp.where(has, m + jnp.log(jnp.where(has, l, 1.0)), -jnp.inf)
            o = acc / jnp.where(has, l, 1.0)[..., None]
            return jnp.einsum("bhgqd->bqhgd", o), lse

        o, lse = lax.map(q_block, (qb, qpb, qsb))  # [nq, B, bq, Hkv, g, D], [nq, B, Hkv, g, bq]
        o = _unblocks(o, 1)[:, :Tq].reshape(B, Tq, Hq, D)
        lse = _unblocks(lse, 3)[..., :Tq].reshape(B, Hq, Tq)
        return o, lse

    # ----------------------------------------------------------------- backward
    def _bwd(self, q, k, v, o, lse, do, q_pos, kv_pos, mask: MaskSpec, scale: float,
             q_seg=None, kv_seg=None, delta=None):
        B, Tq, Hq, D = q.shape
        Tk, Hkv = k.shape[1], k.shape[2]
        g = Hq // Hkv
        if delta is None:
            delta = attention_delta(o, do)
        bq, bk = min(self.block_q, Tq), min(self.block_k, Tk)
        nq = -(-Tq // bq)
        Lq = nq * bq
        kv = _kv_tiles(k, v, kv_pos, kv_seg, bk)
        nk = kv.k.shape[0]

        def qview(x):
            return _blocks(_pad_axis(x, 1, Lq).reshape(B, Lq, Hkv, g, D), 1, bq)

        def rowview(x, fill):  # [B, Hq, Tq] -> [nq, B, Hkv, g, bq]
            x = _pad_axis(x.astype(F32), 2, Lq, value=fill).reshape(B, Hkv, g, Lq)
            return _blocks(x, 3, bq)

        qb, dob = qview(q), qview(do)
        lseb, deltab = rowview(lse, -jnp.inf), rowview(delta, 0.0)
        qpb = _q_pos_blocks(q_pos, Lq, bq)
        qsb = None if q_seg is None else _blocks(_pad_axis(q_seg, 1, Lq, mode="edge"), 1, bq)

        def q_block(dkv, args):
            qi, doi, lsei, deli, qp, qs = args
            q_lo, q_hi = qp.min(), qp.max()
            lse_ok = jnp.isfinite(lsei)
            lse_safe = jnp.where(lse_ok, lsei, 0.0)

            def step(dq, t):
                kj, vj, kp, kvalid, ks, klo, khi = t

                def compute(dq):
                    s = _scores(qi, kj, scale, qp, kp, kvalid, qs, ks, mask)
                    p = jnp.where(lse_ok[..., None], jnp.exp(s - lse_safe[..., None]), 0.0)
                    dv = jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(do.dtype), doi,
                                    preferred_element_type=F32, precision=_precision(do.dtype))
                    dp = jnp.einsum("bqhgd,bkhd->bhgqk", doi, vj, preferred_element_type=F32,
                                    precision=_precision(v.dtype))
                    ds = p * (dp - deli[..., None])
                    dq = dq + jnp.einsum("bhgqk,bkhd->bqhgd", ds.astype(k.dtype), kj,
                                         preferred_element_type=F32,
                                         precision=_precision(k.dtype)) * scale
                    dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds.astype(q.dtype), qi,
                                    preferred_element_type=F32, precision=_precision(q.dtype)) * scale
                    return dq, dk, dv

                def skip(dq):
                    z = vary_like(jnp.zeros((B, bk, Hkv, D), F32), qi, doi, kj, vj)
                    return dq, z, z

                pred = mask.tile_may_be_visible(q_lo, q_hi, klo, khi)
                dq, dk, dv = _maybe(pred, mask, compute, skip, dq)
                return dq, (dk, dv)

            dq0 = vary_like(jnp.zeros((B, bq, Hkv, g, D), F32), qi, doi, lsei, kv.k, kv.v)
            dq, (dk, dv) = lax.scan(step, dq0, (kv.k, kv.v, kv.pos, kv.valid, kv.seg, kv.lo, kv.hi))
            return (dkv[0] + dk, dkv[1] + dv), dq

        z = vary_like(jnp.zeros((nk, B, bk, Hkv, D), F32), qb, dob, lseb, kv.k, kv.v)
        (dk, dv), dq = lax.scan(q_block, (z, z), (qb, dob, lseb, deltab, qpb, qsb))
        dq = _unblocks(dq, 1)[:, :Tq].reshape(B, Tq, Hq, D)
        dk = _unblocks(dk, 1)[:, :Tk]
        dv = _unblocks(dv, 1)[:, :Tk]
        return dq, dk, dv


# Each tile is its own jitted function: a ring calls the kernel once per step and tile
# kind with the same shapes, so the tile is traced and lowered once per program instead
# of once per call (the compiler inlines it all the same).
_jitted_fwd = jax.jit(XlaKernel._fwd, static_argnums=(0, 6, 7))
_jitted_bwd = jax.jit(XlaKernel._bwd, static_argnums=(0, 9, 10))


def attention_delta(o, do):
    """``delta[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d]`` in float32, ``[B, H, T]``.

    BurstAttention Alg. 2 line 2 / BurstEngine Eq. 8 (the "D" of the backward).
    """
    return jnp.einsum("bqhd,bqhd->bhq", do.astype(F32), o.astype(F32))


register_kernel("xla", XlaKernel, priority=0)
