"""Optional backend over flash-attn-jax (FlashAttention-2 CUDA kernels), imported lazily.

flash-attn-jax (0.6.x) exposes, next to its differentiable ``flash_mha``, the two halves
this library's contract needs::

    flash_attn_jax.flash_fwd.flash_mha_fwd(q, k, v, *, softmax_scale, is_causal,
                                           window_size_left, window_size_right)
        -> (out, lse)
    flash_attn_jax.flash_bwd.flash_mha_bwd(dout, q, k, v, out, lse, *, softmax_scale,
                                           is_causal, window_size_left, window_size_right)
        -> (dq, dk, dv)

with BSHD inputs (GQA/MQA native), ``lse`` float32 ``[B, H, Tq]`` and FlashAttention-2's
mask convention: query row ``i`` sees key column ``j`` iff
``i + Tk - Tq - left <= j <= i + Tk - Tq + right`` (``-1`` = unbounded).

This adapter serves only requests it can express *exactly* in that convention:

* bf16 / f16 inputs, no segment ids, no block mask;
* a dense mask (positions do not matter); causal / window masks on an *aligned* tile
  (the caller states that queries and keys sit at the same consecutive positions,
  ``base.TILE_ALIGNED``: the diagonal tiles of a ring), whose positions may be traced;
  or causal / window masks with *concrete*, contiguous positions
  (``q_pos = q0 + arange(Tq)``, ``kv_pos = k0 + arange(Tk)``) whose offset maps onto
  non-negative window sides and leaves no query row without a key.  Positions are
  concrete only outside ``jit``; inside a ring they depend on ``lax.axis_index``.  So a
  causal zigzag or contiguous ring runs entirely on this backend (its off-diagonal tiles
  are dense, its diagonal tiles aligned), while general tiles (windows across devices,
  the striped layout) raise ``NotImplementedError`` -- use ``pallas`` or ``xla``;
* a backward that is given ``o`` (FlashAttention recomputes ``delta = rowsum(dO * O)``
  from it; with the global ``o`` and ``lse`` of a ring this is the right delta).

Anything else raises ``NotImplementedError`` saying why; nothing falls back silently.

Install notes: ``pip install flash-attn-jax`` pins an older JAX in its metadata
(``jax<0.9`` for 0.6.2) although its extension loads under newer JAX; install it with
``pip install --no-deps flash-attn-jax`` next to your JAX, and provide the CUDA 12
runtime it links against (``pip install nvidia-cuda-runtime-cu12``; ``libcudart.so.12``
must be on the loader path).  It supports NVIDIA GPUs of compute capability >= 8.0.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_seqpar.kernels.base import TILE_ALIGNED, TILE_GENERAL, KernelRequest, register_kernel
from jax_seqpar.masks import MaskSpec

F32 = jnp.float32
DTYPES = ("bfloat16", "float16")


def _functions():
    """``(flash_mha_fwd, flash_mha_bwd)`` of flash-attn-jax 0.6.x, or NotImplementedError."""
    try:
        fwd = importlib.import_module("flash_attn_jax.flash_fwd").flash_mha_fwd
        bwd = importlib.import_module("flash_attn_jax.flash_bwd").flash_mha_bwd
    except (ImportError, AttributeError) as e:
        raise NotImplementedError(
            f"kernel='flash_attn' needs the flash-attn-jax package, version 0.6.x ({e}); "
            f"see jax_seqpar/kernels/flash_attn.py for install notes") from None
    return fwd, bwd


def _static_start(pos, name: str) -> int:
    """First position of a contiguous static position vector, else NotImplementedError."""
    if isinstance(pos, jax.core.Tracer):
        raise NotImplementedError(
            f"kernel='flash_attn' needs static {name} for causal/window masks (they are "
            f"traced here, e.g. inside a ring); use kernel='pallas' or 'xla'")
    p = np.asarray(pos)
    if p.ndim != 1 or not np.array_equal(p, p[0] + np.arange(p.shape[0])):
        raise NotImplementedError(f"kernel='flash_attn' needs contiguous {name} "
                                  f"(start + arange(n)); got another vector")
    return int(p[0])


def flash_window(mask: MaskSpec, q_pos, kv_pos, Tq: int, Tk: int,
                 aligned: bool = False) -> Tuple[int, int]:
    """``(left, right)`` in FlashAttention-2's convention for ``mask`` at these positions.

    Our mask: key ``k`` visible from query ``q`` iff ``-left_limit <= k - q <= right_limit``.
    With ``q = q0 + i`` and ``k = k0 + j`` that is
    ``i + d - left_limit <= j <= i + d + right_limit`` with ``d = q0 - k0``; FlashAttention
    centres its band on ``i + Tk - Tq``, so its sides are ``left_limit + (Tk - Tq) - d`` and
    ``right_limit + d - (Tk - Tq)``.  ``aligned``: the caller guarantees ``d = 0`` and
    ``Tq == Tk`` (an aligned tile), so traced positions are fine.
    """
    if mask.left_limit is None and mask.right_limit is None:
        return (-1, -1)
    if aligned:
        if Tq != Tk:
            raise ValueError(f"an aligned tile has as many queries as keys; got {Tq}, {Tk}")
        d = 0
    else:
        d = _static_start(q_pos, "q_pos") - _static_start(kv_pos, "kv_pos")
    shift = Tk - Tq
    left = -1 if mask.left_limit is None else mask.left_limit + shift - d
    right = -1 if mask.right_limit is None else mask.right_limit + d - shift
    if (mask.left_limit is not None and left < 0) or (mask.right_limit is not None and right < 0):
        raise NotImplementedError(
            f"kernel='flash_attn': this position offset needs a negative window side "
            f"(left={left}, right={right}), which FlashAttention cannot express")
    # every query row must see at least one key (FlashAttention's empty rows differ)
    i = np.arange(Tq)
    lo = i + shift - (left if left >= 0 else Tk + Tq)
    hi = i + shift + (right if right >= 0 else Tk + Tq)
    if (np.minimum(hi, Tk - 1) < np.maximum(lo, 0)).any():
        raise NotImplementedError("kernel='flash_attn': some query rows see no key under "
                                  "this mask; use kernel='pallas' or 'xla'")
    return (int(left), int(right))


@dataclasses.dataclass(frozen=True)
class FlashAttnKernel:
    """The ``flash_attn`` backend (see the module docstring for what it accepts)."""

    name: str = "flash_attn"
    tile_aware = True   # receives tile= in fwd/bwd
    needs_o = True      # FlashAttention's backward derives delta from o
    skips_masked_blocks = True  # its causal kernels stop at the diagonal

    def available(self) -> None:
        """Raise ``NotImplementedError`` unless flash-attn-jax imports."""
        _functions()

    def check(self, request: KernelRequest) -> None:
        if str(request.dtype) not in DTYPES:
            raise NotImplementedError(f"kernel='flash_attn' supports {DTYPES}, not "
                                      f"{request.dtype}")
        if request.head_dim % 8 or request.head_dim > 256:
            raise NotImplementedError(f"kernel='flash_attn': head_dim={request.head_dim} "
                                      f"must be a multiple of 8 and <= 256")
        if request.has_segments:
            raise NotImplementedError("kernel='flash_attn' has no segment ids")
        if request.mask.block_mask is not None:
            raise NotImplementedError("kernel='flash_attn' has no block-sparse masks")
        if not request.bwd_has_o:
            raise NotImplementedError("kernel='flash_attn' needs the output o in the "
                                      "backward, and this strategy passes only delta")
        self.available()

    def _args(self, q, k, q_pos, kv_pos, mask, q_seg, tile=TILE_GENERAL):
        if q_seg is not None:
            raise NotImplementedError("kernel='flash_attn' has no segment ids")
        if mask.block_mask is not None:
            raise NotImplementedError("kernel='flash_attn' has no block-sparse masks")
        if str(jnp.dtype(q.dtype)) not in DTYPES:
            raise NotImplementedError(f"kernel='flash_attn' supports {DTYPES}")
        return flash_window(mask, q_pos, kv_pos, q.shape[1], k.shape[1],
                            aligned=tile == TILE_ALIGNED)

    def fwd(self, q, k, v, q_pos, kv_pos, mask: MaskSpec, scale: float, q_seg=None,
            kv_seg=None, *, tile: str = TILE_GENERAL):
        window = self._args(q, k, q_pos, kv_pos, mask, q_seg, tile)
        out, lse = _functions()[0](q, k, v, softmax_scale=float(scale), is_causal=False,
                                   window_size_left=window[0], window_size_right=window[1])
        return out.astype(F32), lse.astype(F32)

    def bwd(self, q, k, v, o, lse, do, q_pos, kv_pos, mask: MaskSpec, scale: float,
            q_seg=None, kv_seg=None, delta: Optional[jax.Array] = None, *,
            tile: str = TILE_GENERAL):
        window = self._args(q, k, q_pos, kv_pos, mask, q_seg, tile)
        if o is None:
            raise NotImplementedError("kernel='flash_attn' needs the output o in the "
                                      "backward (it derives delta from it); tree attention "
                                      "passes only delta: use kernel='pallas' or 'xla'")
        dq, dk, dv = _functions()[1](do.astype(q.dtype), q, k, v, o.astype(q.dtype),
                                     lse.astype(F32), softmax_scale=float(scale),
                                     is_causal=False, window_size_left=window[0],
                                     window_size_right=window[1])
        return dq.astype(F32), dk.astype(F32), dv.astype(F32)


# Never picked by "auto" (cuDNN is faster on the tiles both serve); ask for it by name.
register_kernel("flash_attn", FlashAttnKernel, priority=-10, platforms=("gpu",))
