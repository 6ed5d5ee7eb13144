"""Pallas GPU (Triton lowering) forward for a few query rows against a long key shard.

Split-K decoding (the Flash-Decoding scheme): for one batch row and one key/value head,
the ``g * Tq`` query rows that share it (GQA group x new tokens, padded to 16 for
``tl.dot``) form one small block that stays in registers, and the keys this block may
see are divided among ``splits`` programs.  Each program runs FlashAttention-2's
online softmax over its share of key blocks and writes a partial ``(o, lse)``; the
partials are combined afterwards with the logsumexp merge (associativity of the
reduction: Tree Attention Eq. 9-11, the same combination ``parallel/merge.py`` applies
across devices).  Scores never leave the chip, so the cache is read once, and the grid
``(B, Hkv, splits)`` has enough programs to keep every SM busy even for one sequence.

Which key blocks a row block may see comes from ``pallas_gpu.tile_lists`` (position
bounds; fully masked blocks -- e.g. the cache beyond a sequence's length under a causal
mask -- are never read), and the visible ones are dealt out evenly, so ragged lengths do
not unbalance the programs.  Every visited block evaluates the mask (positions, padded
keys, segment ids); with a handful of rows that costs little next to the loads.

The backward (``tree_decode`` is differentiable) is ``XlaDecodeKernel``'s.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_seqpar.runtime._compat import kernel_io
from jax_seqpar.kernels.base import KernelRequest, default_platform, register_kernel
from jax_seqpar.kernels.pallas_common import (LOG2E, _compiler_params, _dot_precision, _pad_to,
                                           check_request, finish_rows, interpret_mode,
                                           online_softmax_tile, tile_lists)
from jax_seqpar.kernels.xla_decode import XlaDecodeKernel
from jax_seqpar.masks import MaskSpec

F32 = jnp.float32
MIN_ROWS = 16  # tl.dot needs 16 rows


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Key block, launch parameters and how many programs to aim for (``splits`` is
    chosen so that ``B * Hkv * splits`` reaches ``target_programs``)."""

    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    target_programs: int = 4096

    def __post_init__(self):
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"DecodeConfig.{f.name}={val!r} must be a positive int")
        for name in ("block_k", "num_warps"):
            val = getattr(self, name)
            if val & (val - 1):
                raise ValueError(f"DecodeConfig.{name}={val} must be a power of two")
        if self.block_k < 16:
            raise ValueError(f"DecodeConfig.block_k={self.block_k} must be >= 16 (tl.dot)")


def num_splits(config: DecodeConfig, B: int, Hkv: int, n_blocks: int) -> int:
    """Programs per (batch row, kv head): enough for ``target_programs``, at most one
    per key block."""
    want = -(-config.target_programs // (B * Hkv))
    return max(1, min(want, n_blocks))


def _kernel(tbl_ref, q_ref, k_ref, v_ref, qpos_ref, kvpos_ref, *refs, mask, scale, bk, Tk,
            has_seg, splits, precision):
    if has_seg:
        qseg_ref, kvseg_ref, o_ref, lse_ref = refs
    else:
        (o_ref, lse_ref), kvseg_ref = refs, None
    R, D = q_ref.shape
    count = tbl_ref[0]
    share = (count + splits - 1) // splits
    lo = pl.program_id(2) * share
    hi = jnp.minimum(lo + share, count)
    body = functools.partial(
        online_softmax_tile, q=q_ref[...], qpos=qpos_ref[...],
        qseg=qseg_ref[...] if has_seg else None, tbl_ref=tbl_ref, k_ref=k_ref, v_ref=v_ref,
        kvpos_ref=kvpos_ref, kvseg_ref=kvseg_ref, mask=mask, c=scale * LOG2E, bk=bk, Tk=Tk,
        masked=True, precision=precision)
    init = (jnp.zeros((R, D), F32), jnp.full((R,), -jnp.inf, F32), jnp.zeros((R,), F32))
    o_ref[...], lse_ref[...] = finish_rows(lax.fori_loop(lo, jnp.maximum(lo, hi), body, init))


def _rows(x, g, R, edge):
    """Per query row ``[B, Tq]`` -> per kernel row ``[B, R]`` (row ``t * g + j`` is token
    ``t`` of group head ``j``), padded to ``R``."""
    return _pad_to(jnp.repeat(x, g, axis=1), 1, R, edge=edge)


def pallas_decode_fwd(q, k, v, q_pos, kv_pos, mask: MaskSpec, scale: float, q_seg=None,
                      kv_seg=None, *, config: DecodeConfig, interpret: bool):
    """``(o float32 [B, Tq, Hq, D], lse float32 [B, Hq, Tq])``; see the module docstring."""
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    bk = config.block_k
    R = max(MIN_ROWS, 1 << (g * Tq - 1).bit_length())
    Lk = -(-Tk // bk) * bk
    nk = Lk // bk
    has_seg = q_seg is not None
    q_pos = jnp.broadcast_to(q_pos.astype(jnp.int32), (B, Tq))
    row_pos = _rows(q_pos, g, R, edge=True)
    kv_pos = _pad_to(kv_pos.astype(jnp.int32), 0, Lk, edge=True)
    tbl = tile_lists(mask, row_pos, kv_pos, Tk, R, bk, has_seg)  # [B, 1, nk + 2]
    # [B, Tq, Hkv, g, D] -> [B, Hkv, Tq * g, D]: the rows sharing one kv head together
    qr = jnp.swapaxes(q.reshape(B, Tq, Hkv, g, D), 1, 2).reshape(B, Hkv, Tq * g, D)
    qr = _pad_to(qr, 2, R)
    kp, vp = _pad_to(k, 1, Lk), _pad_to(v, 1, Lk)
    splits = num_splits(config, B, Hkv, nk)
    in_specs = [
        pl.BlockSpec((None, None, nk + 2), lambda b, h, s: (b, 0, 0)),
        pl.BlockSpec((None, None, R, D), lambda b, h, s: (b, h, 0, 0)),
        pl.BlockSpec((None, Lk, None, D), lambda b, h, s: (b, 0, h, 0)),
        pl.BlockSpec((None, Lk, None, D), lambda b, h, s: (b, 0, h, 0)),
        pl.BlockSpec((None, R), lambda b, h, s: (b, 0)),
        pl.BlockSpec((Lk,), lambda b, h, s: (0,)),
    ]
    args = [tbl, qr, kp, vp, row_pos, kv_pos]
    if has_seg:
        in_specs += [pl.BlockSpec((None, R), lambda b, h, s: (b, 0)),
                     pl.BlockSpec((None, Lk), lambda b, h, s: (b, 0))]
        args += [_rows(q_seg.astype(jnp.int32), g, R, edge=True),
                 _pad_to(kv_seg.astype(jnp.int32), 1, Lk, edge=True)]
    args, out_shape = kernel_io(args, [((B, Hkv, splits, R, D), F32),
                                       ((B, Hkv, splits, R), F32)])
    kernel = functools.partial(_kernel, mask=mask, scale=scale, bk=bk, Tk=Tk,
                               has_seg=has_seg, splits=splits,
                               precision=_dot_precision(q.dtype, interpret))
    o_part, lse_part = pl.pallas_call(
        kernel,
        grid=(B, Hkv, splits),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, R, D), lambda b, h, s: (b, h, s, 0, 0)),
                   pl.BlockSpec((None, None, None, R), lambda b, h, s: (b, h, s, 0))],
        out_shape=out_shape,
        compiler_params=None if interpret else _compiler_params(config.num_warps,
                                                                config.num_stages),
        interpret=interpret,
        name="seqpar_decode_fwd",
    )(*args)
    # merge the splits (float32; a split that saw nothing has lse = -inf, weight 0)
    top = lse_part.max(axis=2, keepdims=True)
    top = jnp.where(jnp.isneginf(top), 0.0, top)
    w = jnp.exp(lse_part - top)
    total = w.sum(axis=2)  # [B, Hkv, R]
    has = total > 0
    safe = jnp.where(has, total, 1.0)
    o = (w[..., None] * o_part).sum(axis=2) / safe[..., None]
    lse = jnp.where(has, top[:, :, 0] + jnp.log(safe), -jnp.inf)
    o = o[:, :, :Tq * g].reshape(B, Hkv, Tq, g, D)
    lse = lse[:, :, :Tq * g].reshape(B, Hkv, Tq, g)
    return (jnp.swapaxes(o, 1, 2).reshape(B, Tq, Hq, D),
            jnp.swapaxes(lse, 2, 3).reshape(B, Hq, Tq))


@dataclasses.dataclass(frozen=True)
class PallasDecodeKernel:
    """The ``pallas_decode`` backend: few-query-row forward on GPUs (see the module
    docstring), backward through ``XlaDecodeKernel``.  ``interpret=None`` interprets off
    GPU (slow, for tests)."""

    config: DecodeConfig = DecodeConfig()
    interpret: Optional[bool] = None
    name: str = "pallas_decode"

    def __post_init__(self):
        if not isinstance(self.config, DecodeConfig):
            raise TypeError(f"config={self.config!r} must be a DecodeConfig")

    def _interpret(self) -> bool:
        return interpret_mode(self.interpret)

    @property
    def supports_check_vma(self) -> bool:
        return not self._interpret()  # as PallasKernel's

    def check(self, request: KernelRequest) -> None:
        check_request(request, self.name, fallback="xla_decode")

    def fwd(self, q, k, v, q_pos, kv_pos, mask: MaskSpec, scale: float, q_seg=None,
            kv_seg=None):
        self.check(KernelRequest(platform=default_platform(), dtype=str(jnp.dtype(q.dtype)),
                                 head_dim=q.shape[-1], mask=mask))
        if q_pos.ndim not in (1, 2) or kv_pos.ndim != 1:
            raise ValueError(f"q_pos must be [Tq] or [B, Tq] and kv_pos [Tk]; got shapes "
                             f"{q_pos.shape} and {kv_pos.shape}")
        return pallas_decode_fwd(q, k, v, q_pos, kv_pos, mask, scale, q_seg, kv_seg,
                                 config=self.config, interpret=self._interpret())

    def bwd(self, q, k, v, o, lse, do, q_pos, kv_pos, mask: MaskSpec, scale: float,
            q_seg=None, kv_seg=None, delta=None):
        return XlaDecodeKernel().bwd(q, k, v, o, lse, do, q_pos, kv_pos, mask, scale, q_seg,
                                     kv_seg, delta)


# Never picked by "auto" for training shapes; the decode entry points ask for it on GPUs.
register_kernel("pallas_decode", PallasDecodeKernel, priority=-5, platforms=("gpu",))
