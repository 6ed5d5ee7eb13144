"""Backward of the Pallas GPU attention tile (FlashAttention-2 Alg. 2, split in two kernels).

With the saved (possibly *global*, as in ring attention) ``lse`` and
``delta = rowsum(dO * O)`` (BurstAttention Alg. 2, line 2; BurstEngine Eq. 8):

    P  = exp(S - lse)                   (recomputed, never stored)
    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - delta)     (BurstEngine Eq. 7)
    dK = scale * dS^T Q,   dQ = scale * dS K

* ``dK, dV``: one program per (key block, batch, key/value head); it loops over the ``g``
  query heads of its GQA group and over the query blocks that may see the key block, so
  a shared K/V head accumulates its gradient in registers without atomics.
* ``dQ``: one program per (query block, batch, query head), looping over the visible key
  blocks, like the forward.

Both run over the tile lists of ``pallas_common.tile_lists``: fully masked tiles never
run (with segment ids also those whose blocks share no document), and the fully visible
ones (in one document) run in a first loop without mask code.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_seqpar.runtime._compat import kernel_io
from jax_seqpar.kernels.pallas_common import (F32, LOG2E, PallasConfig, _compiler_params,
                                           _dot_precision, _pad_to, dot, mask_tile, needs_mask,
                                           segment_lists_args, tile_lists)
from jax_seqpar.kernels.xla import attention_delta
from jax_seqpar.masks import MaskSpec


def _probs(s, lse_rows):
    """``exp(s - lse)`` in base 2 (``s`` and ``lse`` already times log2 e); rows with
    ``lse = -inf`` (nothing visible) give 0, not NaN."""
    lse_rows = jnp.where(lse_rows == -jnp.inf, jnp.inf, lse_rows)
    return jnp.exp2(s - lse_rows[:, None])


def _dkdv_kernel(tbl_ref, q_ref, do_ref, k_ref, v_ref, lse_ref, dl_ref, qpos_ref, kvpos_ref,
                 *refs, mask, scale, bq, Tk, g, has_seg, masked, precision):
    if has_seg:
        qseg_ref, kvseg_ref, dk_ref, dv_ref = refs
    else:
        dk_ref, dv_ref = refs
    bk, D = k_ref.shape
    k = k_ref[...]
    v = v_ref[...]
    kvpos = kvpos_ref[...]
    kvseg = kvseg_ref[...] if has_seg else None
    kv_index = pl.program_id(0) * bk + lax.broadcasted_iota(jnp.int32, (bk,), 0)
    c = scale * LOG2E

    def head(hh, carry):
        def body(t, carry, masked):
            dk, dv = carry
            start = pl.multiple_of(tbl_ref[t + 2] * bq, bq)
            qi = q_ref[pl.ds(start, bq), hh, :]
            doi = do_ref[pl.ds(start, bq), hh, :]
            lse = lse_ref[hh, pl.ds(start, bq)] * LOG2E
            dl = dl_ref[hh, pl.ds(start, bq)]
            s = dot(qi, k, trans_b=True, precision=precision) * c
            if masked:
                qs = qseg_ref[pl.ds(start, bq)] if has_seg else None
                s = mask_tile(mask, s, qpos_ref[pl.ds(start, bq)], kvpos, kv_index, Tk, qs,
                              kvseg)
            p = _probs(s, lse)                                         # [bq, bk]
            dv = dv + dot(p.astype(doi.dtype), doi, trans_a=True, precision=precision)
            dp = dot(doi, v, trans_b=True, precision=precision)
            ds = p * (dp - dl[:, None])
            dk = dk + dot(ds.astype(qi.dtype), qi, trans_a=True, precision=precision)
            return dk, dv

        n_full = tbl_ref[1] if masked else tbl_ref[0]
        carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
        if masked:
            carry = lax.fori_loop(n_full, tbl_ref[0], functools.partial(body, masked=True),
                                  carry)
        return carry

    init = (jnp.zeros((bk, D), F32), jnp.zeros((bk, D), F32))
    dk, dv = lax.fori_loop(0, g, head, init)
    dk_ref[...] = dk * scale
    dv_ref[...] = dv


def _dq_kernel(tbl_ref, q_ref, do_ref, k_ref, v_ref, lse_ref, dl_ref, qpos_ref, kvpos_ref,
               *refs, mask, scale, bk, Tk, has_seg, masked, precision):
    if has_seg:
        qseg_ref, kvseg_ref, dq_ref = refs
    else:
        (dq_ref,) = refs
    bq, D = q_ref.shape
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...] * LOG2E
    dl = dl_ref[...]
    qpos = qpos_ref[...]
    qseg = qseg_ref[...] if has_seg else None
    c = scale * LOG2E

    def body(t, dq, masked):
        start = pl.multiple_of(tbl_ref[t + 2] * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        s = dot(q, k, trans_b=True, precision=precision) * c
        if masked:
            idx = start + lax.broadcasted_iota(jnp.int32, (bk,), 0)
            kvs = kvseg_ref[pl.ds(start, bk)] if has_seg else None
            s = mask_tile(mask, s, qpos, kvpos_ref[pl.ds(start, bk)], idx, Tk, qseg, kvs)
        p = _probs(s, lse)
        dp = dot(do, v, trans_b=True, precision=precision)
        ds = p * (dp - dl[:, None])
        return dq + dot(ds.astype(k.dtype), k, precision=precision)

    n_full = tbl_ref[1] if masked else tbl_ref[0]
    dq = lax.fori_loop(0, n_full, functools.partial(body, masked=False), jnp.zeros((bq, D), F32))
    if masked:
        dq = lax.fori_loop(n_full, tbl_ref[0], functools.partial(body, masked=True), dq)
    dq_ref[...] = dq * scale


def pallas_bwd(q, k, v, o, lse, do, q_pos, kv_pos, mask: MaskSpec, scale: float, q_seg=None,
               kv_seg=None, delta=None, *, config: PallasConfig, interpret: bool):
    """``(dq, dk, dv)`` in float32, shapes of ``q, k, v``."""
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    bq, bk = config.block_q_bwd, config.block_k_bwd
    Lq, Lk = -(-Tq // bq) * bq, -(-Tk // bk) * bk
    nq, nk = Lq // bq, Lk // bk
    has_seg = q_seg is not None
    if delta is None:
        delta = attention_delta(o, do)
    q_pos = _pad_to(jnp.broadcast_to(q_pos.astype(jnp.int32), (B, Tq)), 1, Lq, edge=True)
    kv_pos = _pad_to(kv_pos.astype(jnp.int32), 0, Lk, edge=True)
    qp, dop = _pad_to(q, 1, Lq), _pad_to(do.astype(q.dtype), 1, Lq)
    kp, vp = _pad_to(k, 1, Lk), _pad_to(v, 1, Lk)
    # padded query rows: lse = -inf makes their P zero, so they add nothing to dK, dV
    lsep = _pad_to(lse.astype(F32), 2, Lq) if Lq == Tq else jnp.pad(
        lse.astype(F32), ((0, 0), (0, 0), (0, Lq - Tq)), constant_values=-jnp.inf)
    dlp = _pad_to(delta.astype(F32), 2, Lq)
    segs, seg_kw = [], {}
    if has_seg:
        segs = [_pad_to(q_seg.astype(jnp.int32), 1, Lq, edge=True),
                _pad_to(kv_seg.astype(jnp.int32), 1, Lk, edge=True)]
        seg_kw = segment_lists_args(*segs, config.segment_skip)
    masked = needs_mask(mask, Tk, bk, has_seg) or (Tq % bq != 0)
    precision = _dot_precision(q.dtype, interpret)
    params = None if interpret else _compiler_params(config.num_warps_bwd, config.num_stages_bwd)

    # ---- dK, dV: rows are key blocks
    tbl_t = tile_lists(mask, q_pos, kv_pos, Tk, bq, bk, has_seg, transpose=True,
                       **seg_kw)
    specs = [
        pl.BlockSpec((None, None, nq + 2), lambda j, b, h: (b, j, 0)),
        pl.BlockSpec((None, Lq, g, D), lambda j, b, h: (b, 0, h, 0)),
        pl.BlockSpec((None, Lq, g, D), lambda j, b, h: (b, 0, h, 0)),
        pl.BlockSpec((None, bk, None, D), lambda j, b, h: (b, j, h, 0)),
        pl.BlockSpec((None, bk, None, D), lambda j, b, h: (b, j, h, 0)),
        pl.BlockSpec((None, g, Lq), lambda j, b, h: (b, h, 0)),
        pl.BlockSpec((None, g, Lq), lambda j, b, h: (b, h, 0)),
        pl.BlockSpec((None, Lq), lambda j, b, h: (b, 0)),
        pl.BlockSpec((bk,), lambda j, b, h: (j,)),
    ]
    if has_seg:
        specs += [pl.BlockSpec((None, Lq), lambda j, b, h: (b, 0)),
                  pl.BlockSpec((None, bk), lambda j, b, h: (b, j))]
    args, out_shape = kernel_io([tbl_t, qp, dop, kp, vp, lsep, dlp, q_pos, kv_pos, *segs],
                                [((B, Lk, Hkv, D), F32)] * 2)
    kv_spec = pl.BlockSpec((None, bk, None, D), lambda j, b, h: (b, j, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, mask=mask, scale=scale, bq=bq, Tk=Tk, g=g,
                          has_seg=has_seg, masked=masked, precision=precision),
        grid=(nk, B, Hkv),
        in_specs=specs,
        out_specs=[kv_spec, kv_spec],
        out_shape=out_shape,
        compiler_params=params,
        interpret=interpret,
        name="seqpar_attention_dkdv",
    )(*args)

    # ---- dQ: rows are query blocks
    tbl = tile_lists(mask, q_pos, kv_pos, Tk, bq, bk, has_seg, **seg_kw)
    specs = [
        pl.BlockSpec((None, None, nk + 2), lambda i, b, h: (b, i, 0)),
        pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0)),
        pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0)),
        pl.BlockSpec((None, Lk, None, D), lambda i, b, h: (b, 0, h // g, 0)),
        pl.BlockSpec((None, Lk, None, D), lambda i, b, h: (b, 0, h // g, 0)),
        pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
        pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
        pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
        pl.BlockSpec((Lk,), lambda i, b, h: (0,)),
    ]
    if has_seg:
        specs += [pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
                  pl.BlockSpec((None, Lk), lambda i, b, h: (b, 0))]
    args, (dq_shape,) = kernel_io([tbl, qp, dop, kp, vp, lsep, dlp, q_pos, kv_pos, *segs],
                                  [((B, Lq, Hq, D), F32)])
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, mask=mask, scale=scale, bk=bk, Tk=Tk, has_seg=has_seg,
                          masked=needs_mask(mask, Tk, bk, has_seg), precision=precision),
        grid=(nq, B, Hq),
        in_specs=specs,
        out_specs=pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0)),
        out_shape=dq_shape,
        compiler_params=params,
        interpret=interpret,
        name="seqpar_attention_dq",
    )(*args)
    return dq[:, :Tq], dk[:, :Tk], dv[:, :Tk]
