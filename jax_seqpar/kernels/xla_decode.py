"""Forward for a few query rows against a long key/value shard (decoding), pure jnp.

The blockwise ``xla`` kernel walks key blocks with ``lax.scan``, cuts K and V into a
stacked ``[n, B, block, H, D]`` copy first, and guards each tile with a ``lax.cond``.
With one to a few query rows each step has almost no arithmetic, so a long cache shard
becomes a long chain of tiny, latency-bound steps (measured on H200: ~0.25 TB/s of the
~4.8 TB/s HBM rate, ``benchmarks/RESULTS.md``).  Here instead:

* key blocks are as large as a score budget allows (``max_score_bytes`` of float32
  scores ``[B, Hq, Tq, block]``), so a shard is a handful of steps, often one;
* blocks are read in place with ``lax.dynamic_slice`` (no stacked copy of the cache);
* no per-tile ``cond``: a fully masked block yields ``m = -inf`` and weight 0 in the
  merge, so skipping would only save arithmetic that is not the bottleneck;
* batch rows are computed one by one with static slices (up to ``max_unrolled_batch``
  rows; beyond, batched): XLA read an 8-row cache ~3x faster that way on H200 than with
  the batch as an einsum batch dimension (``benchmarks/RESULTS.md``, "Why the rows one
  by one").

Inside a block the softmax is one row reduction over all its keys, which XLA runs in
parallel: the split-K idea of Flash-Decoding, with the merge across blocks the same
logsumexp combination as ``parallel/merge.py`` (Tree Attention Eq. 9-11: the reduction
is associative, so blocks, like devices, may be combined in any grouping).

The backward (``tree_decode`` is differentiable) is the ``xla`` kernel's, with key
blocks of the same size.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax

from jax_seqpar.kernels.base import KernelRequest, register_kernel
from jax_seqpar.kernels.xla import XlaKernel, _pad_axis, _precision, _scores
from jax_seqpar.masks import MaskSpec

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class XlaDecodeKernel:
    """Few-query-row forward (see the module docstring).

    ``block_k=None`` sizes key blocks from ``max_score_bytes`` (float32 scores of one
    batch row, or of all rows above ``max_unrolled_batch``); an int fixes them.  Compile
    time grows with the unrolled rows.
    """

    block_k: int | None = None
    max_score_bytes: int = 1 << 30
    block_q: int = 512  # the backward's query blocks
    max_unrolled_batch: int = 32
    name: str = "xla_decode"

    def __post_init__(self):
        if self.block_k is not None and (not isinstance(self.block_k, int) or self.block_k < 1):
            raise ValueError(f"block_k={self.block_k!r} must be a positive int or None")
        for f in ("max_score_bytes", "block_q", "max_unrolled_batch"):
            val = getattr(self, f)
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{f}={val!r} must be a positive int")

    def check(self, request: KernelRequest) -> None:
        XlaKernel().check(request)

    def key_block(self, B: int, Tq: int, Hq: int, Tk: int) -> int:
        """Keys per step for ``B`` batch rows at once: ``block_k``, or the most whose
        float32 scores fit the budget, rounded so the steps split ``Tk`` evenly."""
        if self.block_k is not None:
            return min(self.block_k, Tk)
        fit = max(1, self.max_score_bytes // (4 * B * Hq * Tq))
        steps = math.ceil(Tk / fit)
        return math.ceil(Tk / steps)

    def fwd(self, q, k, v, q_pos, kv_pos, mask: MaskSpec, scale: float, q_seg=None,
            kv_seg=None):
        B = q.shape[0]
        if B == 1 or B > self.max_unrolled_batch:
            return self._fwd(q, k, v, q_pos, kv_pos, mask, scale, q_seg, kv_seg)
        # One batch row at a time, with static slices: on H200 (JAX 0.11.2) the batched
        # form read an 8-row cache at ~1.1 TB/s and the per-row form at 2.4-3.4 TB/s
        # (benchmarks/RESULTS.md, "Why the rows one by one").
        def row(x, b):
            return None if x is None else x[b:b + 1]
        outs = [self._fwd(row(q, b), row(k, b), row(v, b),
                          row(q_pos, b) if q_pos.ndim == 2 else q_pos, kv_pos, mask, scale,
                          row(q_seg, b), row(kv_seg, b)) for b in range(B)]
        return (jnp.concatenate([o for o, _ in outs]),
                jnp.concatenate([lse for _, lse in outs]))

    def _fwd(self, q, k, v, q_pos, kv_pos, mask, scale, q_seg, kv_seg):
        B, Tq, Hq, D = q.shape
        Tk, Hkv = k.shape[1], k.shape[2]
        g = Hq // Hkv
        bk = self.key_block(B, Tq, Hq, Tk)
        n = -(-Tk // bk)
        L = n * bk
        k, v = _pad_axis(k, 1, L), _pad_axis(v, 1, L)
        kv_pos = _pad_axis(kv_pos.astype(jnp.int32), 0, L, mode="edge")
        if kv_seg is not None:
            kv_seg = _pad_axis(kv_seg, 1, L, mode="edge")
        qg = q.reshape(B, Tq, Hkv, g, D)

        def block(start):
            """Unnormalised ``(m, l, acc)`` of the keys ``start : start + bk``."""
            kj = lax.dynamic_slice_in_dim(k, start, bk, axis=1)
            vj = lax.dynamic_slice_in_dim(v, start, bk, axis=1)
            kp = lax.dynamic_slice_in_dim(kv_pos, start, bk, axis=0)
            ks = None if kv_seg is None else lax.dynamic_slice_in_dim(kv_seg, start, bk, axis=1)
            valid = start + jnp.arange(bk) < Tk
            s = _scores(qg, kj, scale, q_pos, kp, valid, q_seg, ks, mask)  # [B,Hkv,g,Tq,bk]
            m = s.max(axis=-1)
            m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
            p = jnp.exp(s - m_safe[..., None])
            acc = jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v.dtype), vj,
                             preferred_element_type=F32, precision=_precision(v.dtype))
            return m, p.sum(axis=-1), acc

        def combine(a, b):
            (ma, la, acca), (mb, lb, accb) = a, b
            m = jnp.maximum(ma, mb)
            m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
            wa, wb = jnp.exp(ma - m_safe), jnp.exp(mb - m_safe)
            return m, la * wa + lb * wb, acca * wa[..., None] + accb * wb[..., None]

        m, l, acc = block(0)
        if n > 1:
            m, l, acc = lax.fori_loop(1, n, lambda i, c: combine(c, block(i * bk)), (m, l, acc))
        has = l > 0
        lse = jnp.where(has, m + jnp.log(jnp.where(has, l, 1.0)), -jnp.inf)
        o = acc / jnp.where(has, l, 1.0)[..., None]
        return (jnp.einsum("bhgqd->bqhgd", o).reshape(B, Tq, Hq, D),
                lse.reshape(B, Hq, Tq))

    def bwd(self, q, k, v, o, lse, do, q_pos, kv_pos, mask: MaskSpec, scale: float,
            q_seg=None, kv_seg=None, delta=None):
        B, Tq, Hq, _ = q.shape
        bk = self.key_block(B, Tq, Hq, k.shape[1])
        return XlaKernel(block_q=self.block_q, block_k=bk).bwd(
            q, k, v, o, lse, do, q_pos, kv_pos, mask, scale, q_seg, kv_seg, delta)


# Never picked by "auto" for training shapes; the decode entry points ask for it.
register_kernel("xla_decode", XlaDecodeKernel, priority=-5)
