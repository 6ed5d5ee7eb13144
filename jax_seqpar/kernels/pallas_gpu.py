"""Pallas GPU (Triton lowering) attention tiles behind the kernel contract of ``base.py``.

Forward (FlashAttention-2 Alg. 1, one program per (query block, batch, query head)):
the query block stays in registers, a loop runs over the *visible* key blocks only,
keeping the running max ``m``, denominator ``l`` and unnormalised output in float32
(base-2 exponentials, the scale folded into ``log2(e) * scale``), and the program writes
``o`` and ``lse`` (natural log).  Backward (``pallas_gpu_bwd.py``): FlashAttention-2 Alg. 2
with ``delta = rowsum(dO * O)`` precomputed (BurstAttention Alg. 2, line 2) -- one kernel
for ``dK, dV`` over query blocks, one for ``dQ`` over key blocks.

Which tiles run is decided before the kernel, in XLA, from the position bounds of every
(query block, key block) pair (``MaskSpec.tile_may_be_visible``): each query block gets a
short list of the key blocks it may see: first those whose bounds prove every pair
visible (``MaskSpec.tile_fully_visible``), then the partially visible ones.  The kernel
runs one loop over the first kind with no mask code at all and a second loop that
evaluates the mask over the rest, so fully masked tiles cost nothing and neither loop
has a branch (a branch in the loop body measurably slowed Triton's pipelined
loads).  Because masks are predicates on global positions, the same kernel serves every
ring step, layout and packed-document batch.  With segment ids the lists also drop the
tiles whose blocks share no document (per-block minimum and maximum id, computed once
per call: ``pallas_common.segment_tiles``) and run the tiles inside one document in the
mask-free loop, so packed documents cost about their within-document work
(``PallasConfig.segment_skip``, on by default).

GQA: query head ``h`` reads key/value head ``h // g`` through the block index map; K/V
are never repeated.  Ragged lengths: inputs are padded to whole blocks and padded keys
are masked by index.  float32 inputs use three TF32 tensor-core products per ``dot``
(``_dot_precision``) and smaller tiles (``FLOAT32_CONFIGS``).  Off GPU, the same kernels
run with ``interpret=True`` (slow; for tests).  Block masks (``MaskSpec.block_mask``) are
refused (``NotImplementedError``), so ``kernel="auto"`` falls back to ``xla`` for them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_seqpar.runtime._compat import kernel_io
from jax_seqpar.kernels.base import KernelRequest, default_platform, register_kernel
from jax_seqpar.kernels.pallas_common import (  # noqa: F401  (re-exported names)
    DEFAULT_CONFIGS, DTYPES, F32, FLOAT32_CONFIGS, HEAD_DIMS, LN2, LOG2E, PallasConfig,
    _compiler_params, _dot_precision, _pad_to, check_request, default_config, dot,
    finish_rows, forward_smem_bytes, interpret_mode, mask_tile, needs_mask,
    online_softmax_tile, segment_lists_args, tile_lists)
from jax_seqpar.kernels.pallas_gpu_bwd import pallas_bwd
from jax_seqpar.masks import MaskSpec


def _fwd_kernel(tbl_ref, q_ref, k_ref, v_ref, qpos_ref, kvpos_ref, *refs, mask, scale, bk,
                Tk, has_seg, masked, precision):
    if has_seg:
        qseg_ref, kvseg_ref, o_ref, lse_ref = refs
    else:
        (o_ref, lse_ref), kvseg_ref = refs, None
    bq, D = q_ref.shape
    body = functools.partial(
        online_softmax_tile, q=q_ref[...], qpos=qpos_ref[...],
        qseg=qseg_ref[...] if has_seg else None, tbl_ref=tbl_ref, k_ref=k_ref, v_ref=v_ref,
        kvpos_ref=kvpos_ref, kvseg_ref=kvseg_ref, mask=mask, c=scale * LOG2E, bk=bk, Tk=Tk,
        precision=precision)
    init = (jnp.zeros((bq, D), F32), jnp.full((bq,), -jnp.inf, F32), jnp.zeros((bq,), F32))
    n_full = tbl_ref[1] if masked else tbl_ref[0]
    carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), init)
    if masked:  # the partially visible tiles, after the fully visible ones
        carry = lax.fori_loop(n_full, tbl_ref[0], functools.partial(body, masked=True), carry)
    o, lse = finish_rows(carry)
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = lse


def pallas_fwd(q, k, v, q_pos, kv_pos, mask: MaskSpec, scale: float, q_seg=None, kv_seg=None,
               *, config: PallasConfig, interpret: bool):
    """``(o float32 [B, Tq, Hq, D], lse float32 [B, Hq, Tq])``; see the module docstring."""
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    bq, bk = config.block_q, config.block_k
    Lq, Lk = -(-Tq // bq) * bq, -(-Tk // bk) * bk
    has_seg = q_seg is not None
    q_pos = jnp.broadcast_to(q_pos.astype(jnp.int32), (B, Tq))
    q_pos = _pad_to(q_pos, 1, Lq, edge=True)
    kv_pos = _pad_to(kv_pos.astype(jnp.int32), 0, Lk, edge=True)
    if has_seg:
        q_seg = _pad_to(q_seg.astype(jnp.int32), 1, Lq, edge=True)
        kv_seg = _pad_to(kv_seg.astype(jnp.int32), 1, Lk, edge=True)
    tbl = tile_lists(mask, q_pos, kv_pos, Tk, bq, bk, has_seg,
                     **segment_lists_args(q_seg, kv_seg, config.segment_skip))
    qp, kp, vp = _pad_to(q, 1, Lq), _pad_to(k, 1, Lk), _pad_to(v, 1, Lk)
    nq, nk = Lq // bq, Lk // bk
    grid = (nq, B, Hq)
    in_specs = [
        pl.BlockSpec((None, None, nk + 2), lambda i, b, h: (b, i, 0)),
        pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0)),
        pl.BlockSpec((None, Lk, None, D), lambda i, b, h: (b, 0, h // g, 0)),
        pl.BlockSpec((None, Lk, None, D), lambda i, b, h: (b, 0, h // g, 0)),
        pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
        pl.BlockSpec((Lk,), lambda i, b, h: (0,)),
    ]
    args = [tbl, qp, kp, vp, q_pos, kv_pos]
    if has_seg:
        in_specs += [pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
                     pl.BlockSpec((None, Lk), lambda i, b, h: (b, 0))]
        args += [q_seg, kv_seg]
    args, out_shape = kernel_io(args, [((B, Lq, Hq, D), F32), ((B, Hq, Lq), F32)])
    kernel = functools.partial(
        _fwd_kernel, mask=mask, scale=scale, bk=bk, Tk=Tk, has_seg=has_seg,
        masked=needs_mask(mask, Tk, bk, has_seg), precision=_dot_precision(q.dtype, interpret))
    o, lse = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0)),
                   pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
        out_shape=out_shape,
        compiler_params=None if interpret else _compiler_params(config.num_warps,
                                                                config.num_stages),
        interpret=interpret,
        name="seqpar_attention_fwd",
    )(*args)
    return o[:, :Tq], lse[..., :Tq]


# --------------------------------------------------------------------------- backend
@dataclasses.dataclass(frozen=True)
class PallasKernel:
    """The Pallas backend.  ``config=None`` picks ``default_config(head_dim, dtype)``;
    ``interpret=None`` interprets off GPU (slow, for tests) and compiles on GPU."""

    config: Optional[PallasConfig] = None
    interpret: Optional[bool] = None
    name: str = "pallas"
    skips_masked_blocks = True  # visits only the key blocks its tile lists name

    def __post_init__(self):
        if self.config is not None and not isinstance(self.config, PallasConfig):
            raise TypeError(f"config={self.config!r} must be a PallasConfig or None")

    def _config(self, head_dim: int, dtype) -> PallasConfig:
        return self.config or default_config(head_dim, dtype)

    def _interpret(self) -> bool:
        return interpret_mode(self.interpret)

    @property
    def supports_check_vma(self) -> bool:
        """Compiled kernels declare their outputs' varying axes (``_compat.kernel_io``);
        JAX's Pallas interpreter cannot run under ``check_vma``."""
        return not self._interpret()

    def check(self, request: KernelRequest) -> None:
        check_request(request, self.name, fallback="xla")

    def _check_call(self, q, k, q_pos, kv_pos):
        D = q.shape[-1]
        self.check(KernelRequest(platform=default_platform(), dtype=str(jnp.dtype(q.dtype)),
                                 head_dim=D, mask=MaskSpec()))
        if q_pos.ndim not in (1, 2) or kv_pos.ndim != 1:
            raise ValueError(f"q_pos must be [Tq] or [B, Tq] and kv_pos [Tk]; got shapes "
                             f"{q_pos.shape} and {kv_pos.shape}")

    def fwd(self, q, k, v, q_pos, kv_pos, mask: MaskSpec, scale: float, q_seg=None,
            kv_seg=None):
        self._check_call(q, k, q_pos, kv_pos)
        if mask.block_mask is not None:
            raise NotImplementedError("block_mask is not supported by the pallas kernel")
        return _jitted_fwd(q, k, v, q_pos, kv_pos, mask, float(scale), q_seg, kv_seg,
                           config=self._config(q.shape[-1], q.dtype),
                           interpret=self._interpret())

    def bwd(self, q, k, v, o, lse, do, q_pos, kv_pos, mask: MaskSpec, scale: float,
            q_seg=None, kv_seg=None, delta=None):
        self._check_call(q, k, q_pos, kv_pos)
        if mask.block_mask is not None:
            raise NotImplementedError("block_mask is not supported by the pallas kernel")
        return _jitted_bwd(q, k, v, o, lse, do, q_pos, kv_pos, mask, float(scale), q_seg,
                           kv_seg, delta, config=self._config(q.shape[-1], q.dtype),
                           interpret=self._interpret())


# One jitted function per tile direction: a ring calls it once per step with the same
# shapes, so the kernel is traced and lowered once per program (inlined when compiled).
_jitted_fwd = jax.jit(pallas_fwd, static_argnums=(5, 6),
                      static_argnames=("config", "interpret"))
_jitted_bwd = jax.jit(pallas_bwd, static_argnums=(8, 9),
                      static_argnames=("config", "interpret"))


# Above xla on GPU; on CPU only by name (interpret mode is for tests, never "auto").
register_kernel("pallas", PallasKernel, priority=10, platforms=("gpu",))
