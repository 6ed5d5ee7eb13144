"""The ``cudnn`` backend: cuDNN's fused flash attention, as JAX exposes it, behind the
local-kernel contract.

cuDNN reads no positions: it knows only "no mask", "causal" (query row ``i`` sees keys
``j <= i``) and a causal band ``i - w < j <= i``.  So it serves exactly the tiles whose
mask those describe, which the caller states through the tile kind (``base.py``):

* ``dense`` tiles (any ``Tq``, ``Tk``): no mask;
* ``aligned`` tiles (``Tq == Tk``, both sides at the same consecutive positions): the
  causal mask, and a sliding window ``(left, right)`` when its right side is cut at the
  diagonal (``causal=True`` or ``right == 0``);

and refuses, with ``NotImplementedError``, general tiles, segment ids, block masks,
float32 (cuDNN's flash attention takes bf16 and f16), head dims above 256 (128 before
Hopper) or not a multiple of 8, and a backward that is not given ``o``.  Padding masks
(cuDNN's ragged lengths) are not used: the contract expresses ragged rows by positions.

Forward: ``(o, lse)`` with the softmax statistics cuDNN returns next to the output
(natural-log logsumexp of the scaled scores, ``[B, Hq, Tq]`` float32, as the contract's
lse).  Backward: cuDNN's backward primitive takes the output and the statistics as
operands, so a ring hands it the *global* ``o`` and ``lse`` of the rows (FlashAttention-2
recomputation, BurstEngine Eq. 7-8: ``P = exp(S - lse)``, ``delta = rowsum(dO * O)``),
which is why this backend sets ``needs_o``: it cannot take ``delta`` alone.  GQA is
native (``Hq % Hkv == 0``, no repeated K/V).

Every call into JAX's private module goes through ``_compat.cudnn_attention_fwd`` /
``cudnn_attention_bwd``; tests replace those with a reference stand-in on CPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_seqpar.runtime import _compat
from jax_seqpar.kernels.base import (TILE_GENERAL, KernelRequest, index_masked_tile,
                                     register_kernel)
from jax_seqpar.masks import MaskSpec

F32 = jnp.float32
DTYPES = ("bfloat16", "float16")


def _max_head_dim() -> int:
    """256 on Hopper and later (compute capability >= 9.0), else 128 (cuDNN's limits)."""
    try:
        cc = jax.devices("gpu")[0].compute_capability
    except Exception:  # pragma: no cover - no GPU: the platform check refuses first
        return 128
    return 256 if tuple(int(x) for x in str(cc).split(".")) >= (9, 0) else 128


def cudnn_mask(mask: MaskSpec, tile: str):
    """``(causal, window_left)`` for cuDNN, or ``NotImplementedError`` saying why.

    ``mask`` applies to a tile of kind ``tile``; dense masks need nothing, aligned tiles
    take causal masks and windows whose right side stops at the diagonal.
    """
    if not index_masked_tile("cudnn", mask, tile, "reads no positions",
                             "kernel='pallas' or 'xla'"):
        return False, None
    if mask.right_limit != 0:
        raise NotImplementedError(
            f"kernel='cudnn' applies windows only up to the diagonal (causal=True or a "
            f"right side of 0); got window={mask.window}, causal={mask.causal}")
    return True, mask.left_limit


def _check_aligned(q_pos, kv_pos):
    """When positions are concrete, make sure an 'aligned' tile is one."""
    if isinstance(q_pos, jax.core.Tracer) or isinstance(kv_pos, jax.core.Tracer):
        return
    qp, kp = np.asarray(q_pos), np.asarray(kv_pos)
    if qp.ndim != 1 or qp.shape != kp.shape or not np.array_equal(qp, kp) \
            or not np.array_equal(qp, qp[0] + np.arange(qp.shape[0])):
        raise ValueError("an 'aligned' tile needs q_pos == kv_pos == p0 + arange(T)")


@dataclasses.dataclass(frozen=True)
class CudnnKernel:
    """The ``cudnn`` backend (see the module docstring for what it serves)."""

    name: str = "cudnn"
    tile_aware = True   # receives tile= in fwd/bwd
    needs_o = True      # its backward takes o, not delta
    skips_masked_blocks = True  # a causal tile costs half a dense one, no per-block branch

    def check(self, request: KernelRequest) -> None:
        if request.platform != "gpu":
            raise NotImplementedError(f"kernel='cudnn' runs on NVIDIA GPUs only, not on "
                                      f"{request.platform!r}")
        if str(request.dtype) not in DTYPES:
            raise NotImplementedError(f"kernel='cudnn' supports {DTYPES}, not {request.dtype} "
                                      f"(use kernel='pallas' or 'xla' for float32)")
        hmax = _max_head_dim()
        if request.head_dim % 8 or request.head_dim > hmax:
            raise NotImplementedError(f"kernel='cudnn': head_dim={request.head_dim} must be "
                                      f"a multiple of 8 and <= {hmax} on this GPU")
        if request.has_segments:
            raise NotImplementedError("kernel='cudnn' has no segment ids here (packed "
                                      "documents need kernel='pallas' or 'xla')")
        if not request.bwd_has_o:
            raise NotImplementedError("kernel='cudnn' needs the forward output o in the "
                                      "backward, and this strategy passes only delta")
        cudnn_mask(request.mask, request.tile)
        _compat.cudnn_module()

    def _prepare(self, q, k, q_pos, kv_pos, mask, q_seg, tile):
        if q_seg is not None:
            raise NotImplementedError("kernel='cudnn' has no segment ids")
        if str(jnp.dtype(q.dtype)) not in DTYPES:
            raise NotImplementedError(f"kernel='cudnn' supports {DTYPES}, not {q.dtype}")
        causal, window_left = cudnn_mask(mask, tile)
        if causal:
            if q.shape[1] != k.shape[1]:
                raise ValueError(f"an aligned tile has as many queries as keys; got "
                                 f"{q.shape[1]} and {k.shape[1]}")
            _check_aligned(q_pos, kv_pos)
        return causal, window_left

    skips_lse = True    # fwd(..., with_lse=False) runs cuDNN's inference kernel

    def fwd(self, q, k, v, q_pos, kv_pos, mask: MaskSpec, scale: float, q_seg=None,
            kv_seg=None, *, tile: str = TILE_GENERAL, with_lse: bool = True):
        """``(o, lse)``; ``with_lse=False`` gives ``(o, None)`` from cuDNN's inference
        kernel, which writes no statistics (a forward whose lse nobody reads)."""
        causal, window_left = self._prepare(q, k, q_pos, kv_pos, mask, q_seg, tile)
        o, lse = _compat.cudnn_attention_fwd(q, k, v, scale=float(scale), causal=causal,
                                             window_left=window_left, with_lse=with_lse)
        # o stays in the input dtype (the contract allows it): a caller that merges casts
        # it to float32, one that returns it does not pay for a round trip
        return o, (lse.astype(F32) if with_lse else None)

    def bwd(self, q, k, v, o, lse, do, q_pos, kv_pos, mask: MaskSpec, scale: float,
            q_seg=None, kv_seg=None, delta=None, *, tile: str = TILE_GENERAL):
        del delta  # cuDNN derives rowsum(dO * O) from o
        if o is None:
            raise NotImplementedError("kernel='cudnn' needs the forward output o in the "
                                      "backward")
        causal, window_left = self._prepare(q, k, q_pos, kv_pos, mask, q_seg, tile)
        dt = q.dtype
        dq, dk, dv = _compat.cudnn_attention_bwd(
            q, k, v, o.astype(dt), lse.astype(F32), do.astype(dt), scale=float(scale),
            causal=causal, window_left=window_left)
        return dq.astype(F32), dk.astype(F32), dv.astype(F32)


# First for dense and aligned tiles on GPUs (base.AUTO_ORDER); refuses general tiles.
register_kernel("cudnn", CudnnKernel, priority=5, platforms=("gpu",))
