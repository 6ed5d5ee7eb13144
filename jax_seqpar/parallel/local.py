"""Differentiable single-device attention through a local kernel (``custom_vjp``).

The forward saves only ``(o, lse)`` besides the inputs; the backward is the kernel's
``bwd`` (FlashAttention-2 style recomputation from ``lse``), given ``o`` as well, so
backends that derive ``delta = rowsum(dO * O)`` themselves (cuDNN) serve it.
"""

from __future__ import annotations

import functools

import jax

from jax_seqpar.kernels.base import TILE_GENERAL
from jax_seqpar.parallel.common import AttnConfig


def local_attention(cfg: AttnConfig, q, k, v, q_pos, kv_pos, q_seg=None, kv_seg=None, *,
                    tile: str = TILE_GENERAL):
    """Attention of ``q`` over ``k, v`` with global positions; output in ``q.dtype``.

    ``tile`` is what the caller knows statically of the tile (``kernels/base.py``):
    ``"aligned"`` when ``q_pos == kv_pos`` are consecutive (one device's own causal
    attention), else ``"general"`` (a mask-free call is always served as dense).
    """
    return _local(cfg, tile, q, k, v, q_pos, kv_pos, q_seg, kv_seg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _local(cfg: AttnConfig, tile: str, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    o, _ = cfg.kernel.fwd(q, k, v, q_pos, kv_pos, cfg.mask, cfg.scale, q_seg, kv_seg,
                          tile=tile, need_lse=False)  # not differentiated: lse unused
    return o.astype(q.dtype)


def _fwd(cfg, tile, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    o, lse = cfg.kernel.fwd(q, k, v, q_pos, kv_pos, cfg.mask, cfg.scale, q_seg, kv_seg,
                            tile=tile)
    o = o.astype(q.dtype)
    return o, (q, k, v, q_pos, kv_pos, q_seg, kv_seg, o, lse)


def _bwd(cfg, tile, res, do):
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, o, lse = res
    dq, dk, dv = cfg.kernel.bwd(q, k, v, o, lse, do, q_pos, kv_pos, cfg.mask, cfg.scale,
                                q_seg, kv_seg, tile=tile)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_local.defvjp(_fwd, _bwd)
