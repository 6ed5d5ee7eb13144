"""Differentiable single-device attention through a local kernel (``custom_vjp``).

The forward saves only ``(o, lse)`` besides the inputs; the backward is the kernel's
``bwd`` (FlashAttention-2 style recomputation from ``lse``).
"""

from __future__ import annotations

import functools

import jax

from jax_seqpar.parallel.common import AttnConfig


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def local_attention(cfg: AttnConfig, q, k, v, q_pos, kv_pos, q_seg=None, kv_seg=None):
    """Attention of ``q`` over ``k, v`` with global positions; output in ``q.dtype``."""
    o, _ = cfg.kernel.fwd(q, k, v, q_pos, kv_pos, cfg.mask, cfg.scale, q_seg, kv_seg)
    return o.astype(q.dtype)


def _fwd(cfg, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    o, lse = cfg.kernel.fwd(q, k, v, q_pos, kv_pos, cfg.mask, cfg.scale, q_seg, kv_seg)
    o = o.astype(q.dtype)
    return o, (q, k, v, q_pos, kv_pos, q_seg, kv_seg, o, lse)


def _bwd(cfg, res, do):
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, o, lse = res
    dq, dk, dv = cfg.kernel.bwd(q, k, v, o, lse, do, q_pos, kv_pos, cfg.mask, cfg.scale,
                                q_seg, kv_seg)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


local_attention.defvjp(_fwd, _bwd)
