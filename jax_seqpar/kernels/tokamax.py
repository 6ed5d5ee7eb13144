"""The ``tokamax`` backend: tokamax's Mosaic GPU flash attention (openxla/tokamax 0.0.17,
``pip install 'jax_seqpar[tokamax]'``; Python >= 3.12, JAX >= 0.11.1) behind the
local-kernel contract.

tokamax's kernel (``PallasMosaicGpuFlashAttention``, sm90 / sm100) takes its mask as
"causal by index" plus per-row key ranges ``k_start <= j < k_end`` in the *local* key
indices, built from its ``q_indices``; given ``k_indices`` instead, it materialises a dense
``[Tq, Tk]`` boolean mask (``pallas_mosaic_gpu_common.decompose_mask``).  A general ring
tile (keys at traced global positions, two chunks per shard under zigzag) could only be
served exactly through that dense mask, which costs the memory the kernel exists to
avoid.  So, like ``cudnn``, it serves the tiles whose mask is a function of the local
indices, which the caller states through the tile kind (``base.py``):

* ``dense`` tiles (any ``Tq``, ``Tk``): no mask;
* ``aligned`` tiles (``Tq == Tk``, both at the same consecutive positions): causal masks
  and sliding windows ``(left, right)`` on either side of the diagonal (tokamax's
  ``CausalMask(offset=right, window_size=left + right + 1)``: more than cuDNN, whose
  windows stop at the diagonal);

and refuses, with ``NotImplementedError``: general tiles, segment ids, block masks,
float32 (its backward takes bf16 / f16 only), head dims other than 64, 128 and 256, GPUs
before Hopper, and a backward that is not given ``o``.

Forward: tokamax returns softmax residuals ``(m, l)`` per row, ``[B, Hq, Tq]`` float32:
the row maximum of the scaled scores (natural log units) and the sum of
``exp(s - m)``; the contract's lse is ``m + log(l)`` (FlashAttention-2, Alg. 1, line 12).
Backward: tokamax's VJP kernel computes ``P = exp(s - m) / l`` and ``delta = rowsum(dO *
O)`` from the residuals and the output it is given, so a ring hands it the *global*
``o`` and lse of the rows as ``(m, l) = (lse, 1)`` (the same P); this backend sets
``needs_o`` (it cannot take ``delta`` alone).  GQA is native.

Ragged lengths: tokamax 0.0.17's backward pads rows only to a multiple of 8, and its
kernels tile rows by 128 (up to 256 in its autotuning configs), so the rows and keys
past a length that is not a whole tile are read as zeros with no mask.  Such a key's
``P = exp(0 - m)`` overflows when a row's scores lie far below 0, and such a row's
``(m, l)`` are not the ``(+inf, 1)`` that would make its ``P`` zero: dQ and dV came back
with NaN on one H200 (lengths 200 and 300; in float16 also on plain random inputs;
RESULTS.md, "tokamax's backward on ragged lengths").  Its forward masks them.  So this
backend's backward hands tokamax whole tiles (``ROW_TILE``): queries, outputs and
cotangents padded with zero rows whose residual ``m`` is ``+inf`` (``P = 0``), keys and
values with zero rows that a key range (``k_end``) masks; the gradients are cut back.

Every call into tokamax goes through ``tokamax_fwd`` / ``tokamax_bwd`` below (its private
module, pinned by the extra); tests replace them with a reference stand-in on CPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_seqpar.kernels.base import (TILE_GENERAL, KernelRequest, index_masked_tile,
                                     register_kernel)
from jax_seqpar.masks import MaskSpec

F32 = jnp.float32
DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (64, 128, 256)
#: The backward's rows and keys come in multiples of this (the module docstring,
#: "Ragged lengths"): tokamax 0.0.17's VJP tiles are ``compute_wgs * block``, 2 x 64 by
#: its heuristics and at most 2 x 128 among its autotuning configs.
ROW_TILE = 256


def tokamax_module():
    """tokamax's attention modules ``(base, pallas_mosaic_gpu)``, or ImportError."""
    try:
        from tokamax._src.ops.attention import base, pallas_mosaic_gpu
    except ImportError as e:
        raise NotImplementedError(
            "kernel='tokamax' needs tokamax 0.0.17 (pip install 'jax_seqpar[tokamax]'; "
            f"Python >= 3.12, JAX >= 0.11.1): {e}") from None
    return base, pallas_mosaic_gpu


def tokamax_mask(mask: MaskSpec, tile: str):
    """``(causal, window)`` for tokamax (``window = (left, right)`` or None), or
    ``NotImplementedError`` saying why."""
    if not index_masked_tile("tokamax", mask, tile,
                             "applies masks by local index (its per-row key ranges)",
                             "kernel='pallas_mgpu', 'pallas' or 'xla'"):
        return False, None
    if mask.window is None:
        return True, None
    return False, (mask.left_limit, mask.right_limit)


def _tokamax_mask(causal: bool, window, kv_len=None):
    """tokamax's mask; ``kv_len``: keys from that index on are masked (padding)."""
    base, _ = tokamax_module()
    m = base.Mask(None, is_causal=causal)
    if window is not None:
        left, right = window
        m &= base.CausalMask(offset=right, window_size=left + right + 1)
    if kv_len is not None:
        m &= base.Mask(k_end=jnp.full((1,), kv_len, jnp.int32))
    return m


def tokamax_fwd(q, k, v, *, scale: float, causal: bool, window=None):
    """tokamax's Mosaic GPU forward, BTNH: ``(o [B, T, N, H] in q.dtype, (m, l))``."""
    _, mgpu = tokamax_module()
    return mgpu.PallasMosaicGpuFlashAttention()(
        q, k, v, mask=_tokamax_mask(causal, window), logits_scale=scale,
        return_residuals=True)


def tokamax_bwd(q, k, v, o, residuals, do, *, scale: float, causal: bool, window=None,
                kv_len=None):
    """tokamax's Mosaic GPU backward from ``residuals = (m, l)`` and the output ``o``:
    ``(dq, dk, dv)`` in the input dtype; ``kv_len``: keys from there on are masked."""
    _, mgpu = tokamax_module()
    op = mgpu.PallasMosaicGpuFlashAttention()
    # the VJP op takes the forward's bound arguments (canonical precision, mask, ...), as
    # tokamax's own custom_vjp passes them
    ba = op.bind(q, k, v, mask=_tokamax_mask(causal, window, kv_len), logits_scale=scale)
    kwargs = {key: val for key, val in ba.kwargs.items() if key != "return_residuals"}
    grads = op.vjp(residuals, o, do, *ba.args, **kwargs)
    grads = grads[0] if isinstance(grads, tuple) else grads
    return grads["q"], grads["k"], grads["v"]


def _is_hopper_or_later() -> bool:
    try:
        cc = jax.devices("gpu")[0].compute_capability
    except Exception:  # pragma: no cover - no GPU: the platform check refuses first
        return False
    return tuple(int(x) for x in str(cc).split(".")) >= (9, 0)


@dataclasses.dataclass(frozen=True)
class TokamaxKernel:
    """The ``tokamax`` backend (see the module docstring for what it serves)."""

    name: str = "tokamax"
    tile_aware = True   # receives tile= in fwd/bwd
    needs_o = True      # its backward takes o, not delta
    skips_masked_blocks = True  # its causal kernels stop at the diagonal

    @property
    def supports_check_vma(self) -> bool:
        """tokamax's Mosaic kernels take no arrays with varying manual axes (mpmd_map
        refuses them), so the strategies' shard_map runs without ``check_vma``."""
        return False

    def check(self, request: KernelRequest) -> None:
        if request.platform != "gpu":
            raise NotImplementedError(f"kernel='tokamax' runs on NVIDIA GPUs only, not on "
                                      f"{request.platform!r}")
        if str(request.dtype) not in DTYPES:
            raise NotImplementedError(f"kernel='tokamax' supports {DTYPES}, not "
                                      f"{request.dtype} (its backward takes no float32)")
        if request.head_dim not in HEAD_DIMS:
            raise NotImplementedError(f"kernel='tokamax': head_dim={request.head_dim} must "
                                      f"be one of {HEAD_DIMS}")
        if request.has_segments:
            raise NotImplementedError("kernel='tokamax' has no segment ids (packed documents "
                                      "need kernel='pallas_mgpu', 'pallas' or 'xla')")
        if not request.bwd_has_o:
            raise NotImplementedError("kernel='tokamax' needs the forward output o in the "
                                      "backward, and this strategy passes only delta")
        tokamax_mask(request.mask, request.tile)
        tokamax_module()
        if not _is_hopper_or_later():
            raise NotImplementedError("kernel='tokamax' runs its Mosaic GPU kernel on "
                                      "Hopper (sm90) and later only")

    def _prepare(self, q, k, mask, q_seg, tile):
        if q_seg is not None:
            raise NotImplementedError("kernel='tokamax' has no segment ids")
        if str(jnp.dtype(q.dtype)) not in DTYPES:
            raise NotImplementedError(f"kernel='tokamax' supports {DTYPES}, not {q.dtype}")
        causal, window = tokamax_mask(mask, tile)
        if (causal or window is not None) and q.shape[1] != k.shape[1]:
            raise ValueError(f"an aligned tile has as many queries as keys; got "
                             f"{q.shape[1]} and {k.shape[1]}")
        return causal, window

    def fwd(self, q, k, v, q_pos, kv_pos, mask: MaskSpec, scale: float, q_seg=None,
            kv_seg=None, *, tile: str = TILE_GENERAL):
        del q_pos, kv_pos  # dense or aligned: the mask is a function of the indices
        causal, window = self._prepare(q, k, mask, q_seg, tile)
        o, (m, l) = tokamax_fwd(q, k, v, scale=float(scale), causal=causal, window=window)
        # a row with no visible key has l = 0, m = -inf: its lse is -inf (log 0)
        lse = m.astype(F32) + jnp.log(l.astype(F32))
        return o, lse

    def bwd(self, q, k, v, o, lse, do, q_pos, kv_pos, mask: MaskSpec, scale: float,
            q_seg=None, kv_seg=None, delta=None, *, tile: str = TILE_GENERAL):
        del q_pos, kv_pos, delta  # tokamax derives rowsum(dO * O) from o
        if o is None:
            raise NotImplementedError("kernel='tokamax' needs the forward output o in the "
                                      "backward")
        causal, window = self._prepare(q, k, mask, q_seg, tile)
        dt = q.dtype
        Tq, Tk = q.shape[1], k.shape[1]
        # whole tiles only (the module docstring, "Ragged lengths"): zero rows past Tq
        # with m = +inf, so P = 0 there; zero keys past Tk, masked by the key range
        q, o, do = (_pad_rows(x.astype(dt), 1) for x in (q, o, do))
        k, v = _pad_rows(k, 1), _pad_rows(v, 1)
        lse = _pad_rows(lse.astype(F32), 2, jnp.inf)
        kv_len = Tk if k.shape[1] != Tk else None
        dq, dk, dv = tokamax_bwd(q, k, v, o, (lse, jnp.ones_like(lse)), do,
                                 scale=float(scale), causal=causal, window=window,
                                 kv_len=kv_len)
        return (dq[:, :Tq].astype(F32), dk[:, :Tk].astype(F32), dv[:, :Tk].astype(F32))


def _pad_rows(x, axis: int, value=0.0):
    """``x`` with its ``axis`` padded by ``value`` to a multiple of ``ROW_TILE``."""
    pad = -x.shape[axis] % ROW_TILE
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


# After cudnn and pallas_mgpu for dense and aligned tiles (base.AUTO_ORDER); no general tiles.
register_kernel("tokamax", TokamaxKernel, priority=4, platforms=("gpu",))
