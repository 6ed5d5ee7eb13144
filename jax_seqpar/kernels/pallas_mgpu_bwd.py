"""Backward of the Hopper (Mosaic GPU) attention tile: FlashAttention-2 Alg. 2 in two
warp-specialised kernels over the tile lists of ``pallas_common.tile_lists``.

With the given -- possibly *global*, as in ring attention -- ``lse`` and
``delta = rowsum(dO * O)`` (BurstAttention Alg. 2, line 2; BurstEngine Eq. 8)::

    P = exp(S - lse),  dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta)  (BurstEngine Eq. 7)
    dK = scale * dS^T Q,  dQ = scale * dS K

* ``dK, dV`` (``_dkdv_call``): one CTA per (block of ``2 * block_kv_bwd`` keys, key/value
  head, batch row); two consumer warpgroups keep ``block_kv_bwd`` keys each, with their
  K, V in shared memory and dK, dV in registers, while a producer warpgroup streams, for
  each of the ``g`` query heads of the GQA group and each query block of the CTA's
  (transposed) tile list, the blocks of Q and dO and the rows of lse and delta through a
  shared-memory ring (TMA).  The kernel works on the transposed tile: ``S^T = K Q^T``,
  so P^T feeds ``dV += P^T dO`` straight from registers, and ``dK += dS^T Q`` likewise.
* ``dQ`` (``_dq_call``): the forward's layout -- one CTA per (block of ``2 * block_q_bwd``
  queries, query head, batch row), two consumers, a producer streaming K and V blocks of
  the tile list -- recomputing ``P`` and ``dP`` and accumulating ``dQ += dS K``.  Both
  kernels launch their CTAs most tiles first; with segment ids the dQ kernel's go
  document by document, as the forward's (``MgpuConfig.doc_order``), and the dK/dV
  (or fused) kernel's with ``MgpuConfig.doc_order_bwd``.
* With ``MgpuConfig.atomic_dq`` there is no dQ kernel: each consumer of the dK/dV kernel
  stages its ``dS^T`` block in shared memory, multiplies ``dS K`` and adds the float32
  product into a zeroed dQ in global memory with a TMA reduce-add, as FlashAttention-3's
  backward does (two of the seven matmuls per tile saved, at the price of a summation
  order that varies from run to run).  With ``split_dq`` as well, the two consumers
  share their dS^T blocks (a barrier per step) and each adds dS K for half of dQ's
  columns over all the CTA's keys: half the accumulator registers and half the
  reduce-adds, FlashAttention-3's split for D = 128.
  ``row_scores`` runs the same fused, split backward with scores by query row
  (``pallas_mgpu_fused``): lse and delta per row, P and dS through shared memory.

* With ``MgpuConfig.overlap_bwd`` (the default at D = 128) each consumer of the two
  kernels issues its two score-sized products together and waits for the first alone
  (``wgmma_accumulator_load(wait_n=1)``), so ``P`` is formed while ``dP`` runs and, in
  the dK/dV kernel, ``dS`` while ``dV`` runs: FlashAttention-3's overlap within one
  warpgroup (§3.2), the same arithmetic in the same order (bit-identical gradients).
  ``MgpuConfig.dv_with_dp`` pairs the dK/dV kernel's products as FlashAttention-3's
  and tokamax's dK/dV steps do instead: ``S^T`` alone, then ``dP^T`` with ``dV``, ``dS``
  formed while ``dV`` runs, the dO slot freed before ``dK`` is done.

The first ``n_full`` entries of each tile-list row run without mask code, the rest
evaluate the mask on global positions, as in the forward.  With segment ids the dQ
kernel's lists sort the rest by mask class (``MgpuConfig.mask_classes``,
``pallas_common.MASK_CLASSES``): one loop per class, the position test only where the
positions leave pairs hidden, and the segment test, where the key block is one document,
folded into the query's lse (``+inf`` for another document's queries: P = 0), one
comparison per row instead of one per score.  Rows whose lse is ``-inf``
(they saw nothing) give ``P = 0``.  dK and dV (and dQ of the two-kernel path) come back
in the input dtype, as cuDNN's, and are cast to float32; atomic dQ stays float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jax_seqpar.runtime._compat import kernel_io
from jax_seqpar.kernels.pallas_common import _pad_to, segment_lists_args, tile_lists
from jax_seqpar.kernels.pallas_mgpu_common import (F32, LOG2E, MgpuConfig, _load, _plgpu,
                                                   compiler_params, cta_order, doc_cta_order,
                                                   keys_before, on_producer_warps,
                                                   produce_kv, row_loops, tile_visible,
                                                   traced)
from jax_seqpar.kernels.pallas_mgpu_keys import (kv_shapes, kv_stationary_kernel,
                                                 reduce_add_dq)
from jax_seqpar.kernels.pallas_mgpu_fused import fused_call
from jax_seqpar.kernels.xla import attention_delta
from jax_seqpar.masks import MaskSpec


# --------------------------------------------------------------------------- dK, dV
def _dkdv_call(tbl, order, q, k, v, do, lse2, delta, q_pos, kv_pos, q_seg, kv_seg, *,
               mask: MaskSpec, scale: float, masked: bool, config: MgpuConfig,
               dq_acc=None, Tk: int | None = None):
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    with_dq = dq_acc is not None
    split_dq = with_dq and config.split_dq
    D, g, dtype, bq, bk, stages = kv_shapes(q, k, config,
                                            split="split_dq" if split_dq else None)
    has_seg = q_seg is not None
    half = D // 2
    c = scale * LOG2E
    overlap = config.overlap_bwd and not with_dq
    # keys padded past Tk: masked where dQ is added from them (as fused_call's); a
    # padded key's own dK and dV rows are cut off, so the kernel without dQ skips it
    pad_keys = with_dq and Tk is not None and Tk % (2 * bk) != 0
    if pad_keys and not masked:
        raise ValueError(f"_dkdv_call: keys padded past Tk={Tk} need masked=True")
    ROW, COL, WGMMA = (plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0),
                       plgpu.Layout.WGMMA)

    def make_step(refs, scoped, cta, row0, kw):
        (tbl_ref, _, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, qpos_ref, kvpos_ref,
         qseg_ref, kvseg_ref, dq_ref, _, _) = refs
        sm, ready, fr = scoped
        (k_smem, v_smem, q_smem, do_smem, lse_smem, dl_smem, ds_smem, dq_smem) = (
            (*sm, None, None) if not with_dq else sm)
        (kv_ready, q_ready, do_ready, lse_ready, dl_ready) = ready
        (q_free, do_free, ds_ready) = fr if split_dq else (*fr, None)
        b, kvh, blk, wg, count, n_full = cta
        if masked:
            kpos = _load(kvpos_ref.at[pl.ds(row0, bk)], ROW)
            kseg = _load(kvseg_ref.at[b, pl.ds(row0, bk)], ROW) if has_seg else None

        def own(t):
            """This consumer's K and V blocks (in step ``t``: the same in every step; the
            fused kernel indexes its own per step, ``step_index``)."""
            return k_smem.at[wg], v_smem.at[wg]

        def mask_scores(s, t, mode):
            """``S^T`` of tile ``t`` with its invisible pairs at ``-inf``: the tests
            ``mode`` (``masked_loops``) names, none for an unmasked tile."""
            if mode is None:
                return s
            pos, seg = mode
            start = tbl_ref[b, blk, t + 2] * bq
            qpos = _load(qpos_ref.at[b, pl.ds(start, bq)], COL) if pos else None
            pair = seg == "pair"
            qseg = _load(qseg_ref.at[b, pl.ds(start, bq)], COL) if pair else None
            # position-proved tiles hold no padded key
            pad = keys_before(Tk, row0, (bk, bq), 0) if pad_keys and pos else None
            ok = tile_visible(mask if pos else MaskSpec(), qpos, kpos if pos else None,
                              qseg, kseg if pair else None, 1, (bk, bq), extra=pad)
            return s if ok is None else jnp.where(ok, s, -jnp.inf)

        def step_overlap(t, carry, hh, mode):
            # S^T and dP^T issued together; P formed while dP^T runs, dS while dV runs
            dk, dv = carry
            slot = lax.rem(hh * count + t, jnp.int32(stages))
            plgpu.barrier_wait(q_ready.at[slot])
            plgpu.barrier_wait(do_ready.at[slot])
            zeros = plgpu.layout_cast(jnp.full((bk, bq), 0.0, F32), WGMMA)

            def body(refs):
                dv_ref, dk_ref, s_ref, dp_ref = refs
                kt, vt = own(t)
                plgpu.wgmma(s_ref, kt, q_smem.at[slot].transpose((1, 0)))
                plgpu.wgmma(dp_ref, vt, do_smem.at[slot].transpose((1, 0)))
                plgpu.barrier_wait(lse_ready.at[slot])
                lse = _load(lse_smem.at[slot], COL, gmem=False)
                s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)   # S^T done
                p = probs_from(s, lse, t, mode)
                plgpu.wgmma(dv_ref, p.astype(dtype), do_smem.at[slot])
                ds_then_dk(p, slot, dk_ref, dp_ref)
            dv, dk, _, _ = pl.run_state(body)((plgpu.ACC.init(dv), plgpu.ACC.init(dk),
                                               plgpu.ACC.init(zeros),
                                               plgpu.ACC.init(zeros)))
            plgpu.barrier_arrive(do_free.at[slot])
            plgpu.barrier_arrive(q_free.at[slot])
            return dk, dv

        def probs_t(t, slot, mode):
            """``P^T`` of tile ``t`` from ``S^T = K Q^T`` issued alone, once its dO
            block has landed too (the serial steps' shared first half)."""
            plgpu.barrier_wait(q_ready.at[slot])

            def st(acc_ref):
                plgpu.wgmma(acc_ref, own(t)[0], q_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]
            s = pl.run_scoped(st, plgpu.ACC((bk, bq), F32))          # S^T [keys, queries]
            plgpu.barrier_wait(lse_ready.at[slot])
            p = probs_from(s, _load(lse_smem.at[slot], COL, gmem=False), t, mode)
            plgpu.barrier_wait(do_ready.at[slot])
            return p

        def probs_from(s, lse, t, mode):
            """``P^T`` from the tile's ``S^T`` and its queries' lse (masks applied)."""
            s = mask_scores(s, t, mode)
            return jnp.exp2(s * c - lax.broadcast_in_dim(lse, s.shape, [1]))

        def ds_then_dk(p, slot, dk_ref, dp_ref):
            """Once ``dP^T`` is done (the product issued after it may still run):
            ``dS^T``, and ``dK += dS^T Q`` issued."""
            plgpu.barrier_wait(dl_ready.at[slot])
            dl = _load(dl_smem.at[slot], COL, gmem=False)
            dp = plgpu.wgmma_accumulator_load(dp_ref, wait_n=1)  # dP^T done
            ds = (p * (dp - lax.broadcast_in_dim(dl, p.shape, [1]))).astype(dtype)
            plgpu.wgmma(dk_ref, ds, q_smem.at[slot])

        def step_dv_with_dp(t, carry, hh, mode):
            # S^T alone; dP^T and dV together, dS formed while dV runs; dO's slot
            # freed when dV is done, Q's when dK is
            dk, dv = carry
            slot = lax.rem(hh * count + t, jnp.int32(stages))
            p = probs_t(t, slot, mode)
            zeros = plgpu.layout_cast(jnp.full((bk, bq), 0.0, F32), WGMMA)

            def body(refs):
                dv_ref, dk_ref, dp_ref = refs
                plgpu.wgmma(dp_ref, own(t)[1], do_smem.at[slot].transpose((1, 0)))
                plgpu.wgmma(dv_ref, p.astype(dtype), do_smem.at[slot])
                ds_then_dk(p, slot, dk_ref, dp_ref)
                plgpu.wgmma_wait(1)                                  # dV done
                plgpu.barrier_arrive(do_free.at[slot])
            dv, dk, _ = pl.run_state(body)((plgpu.ACC.init(dv), plgpu.ACC.init(dk),
                                            plgpu.ACC.init(zeros)))
            plgpu.barrier_arrive(q_free.at[slot])
            return dk, dv

        def step(t, carry, hh, mode):
            if config.dv_with_dp and not with_dq:
                return step_dv_with_dp(t, carry, hh, mode)
            if overlap:
                return step_overlap(t, carry, hh, mode)
            dk, dv = carry
            slot = lax.rem(hh * count + t, jnp.int32(stages))
            p = probs_t(t, slot, mode)

            def dv_dp(refs):
                dv_ref, dp_ref = refs
                plgpu.wgmma(dv_ref, p.astype(dtype), do_smem.at[slot])
                plgpu.wgmma(dp_ref, own(t)[1], do_smem.at[slot].transpose((1, 0)))
            zeros = plgpu.layout_cast(jnp.full((bk, bq), 0.0, F32), WGMMA)
            dv, dp = pl.run_state(dv_dp)((plgpu.ACC.init(dv), plgpu.ACC.init(zeros)))
            plgpu.barrier_arrive(do_free.at[slot])
            plgpu.barrier_wait(dl_ready.at[slot])
            dl = _load(dl_smem.at[slot], COL, gmem=False)
            ds = (p * (dp - lax.broadcast_in_dim(dl, p.shape, [1]))).astype(dtype)
            if not with_dq:
                def dk_fn(acc_ref):
                    plgpu.wgmma(acc_ref, ds, q_smem.at[slot])
                dk = pl.run_state(dk_fn)(plgpu.ACC.init(dk))
                plgpu.barrier_arrive(q_free.at[slot])
                return dk, dv
            dst = dq_ref.at[b, pl.ds(tbl_ref[b, blk, t + 2] * bq, bq), kvh * g + hh]
            # dS^T to shared memory, so that dQ's wgmma reads dS = (dS^T)^T from there
            if split_dq:  # both consumers' blocks (double-buffered by step parity);
                # each then adds dS K for half of dQ's columns over all 2 * bk keys
                par = lax.rem(hh * count + t, jnp.int32(2))
                ds_smem.at[par, wg][...] = ds
                plgpu.commit_smem()
                plgpu.barrier_arrive(ds_ready.at[par])
                plgpu.barrier_wait(ds_ready.at[par])
                cols = pl.ds(pl.multiple_of(wg * half, half), half)
                width = half
            else:
                ds_smem.at[wg][...] = ds
                plgpu.commit_smem()
                width = D
            zq = plgpu.layout_cast(jnp.full((bq, width), 0.0, F32), WGMMA)

            def dk_dq(refs):
                dk_ref_, dq_ref_ = refs
                plgpu.wgmma(dk_ref_, ds, q_smem.at[slot])
                # (operand views made here: made outside this scope, the split's
                # failed to lower on JAX 0.11.2, "Shaped arrays must be represented
                # by ir.Values")
                terms = ([(ds_smem.at[par, w], k_smem.at[w, :, cols]) for w in range(2)]
                         if split_dq else [(ds_smem.at[wg], kw)])
                for ds_t, k_part in terms:
                    plgpu.wgmma(dq_ref_, ds_t.transpose((1, 0)), k_part)
            dk, dq = pl.run_state(dk_dq)((plgpu.ACC.init(dk), plgpu.ACC.init(zq)))
            plgpu.barrier_arrive(q_free.at[slot])
            reduce_add_dq(dq_smem.at[wg], dq,
                          lambda: dst.at[:, cols] if split_dq else dst)
            return dk, dv

        return step

    swz = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    swz32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
    extra = ()
    if split_dq:  # both consumers' dS^T, double-buffered by step parity; dQ half-blocks
        extra = (plgpu.SMEM((2, 2, bk, bq), dtype, transforms=swz),
                 plgpu.SMEM((2, bq, half), F32, transforms=swz32))
    elif with_dq:
        extra = (plgpu.SMEM((2, bk, bq), dtype, transforms=swz),
                 plgpu.SMEM((2, bq, D), F32, transforms=swz32))
    # dQ (with_dq) is a mutable Ref, read and written in place
    return kv_stationary_kernel(
        make_step, (tbl, order, q, k, v, do, lse2, delta, q_pos, kv_pos), q_seg, kv_seg,
        dq_acc, config=config, scale=scale, masked=masked, classes=False, split=split_dq,
        extra_smem=extra)


# --------------------------------------------------------------------------- dQ
def _dq_call(tbl, order, q, k, v, do, lse2, delta, q_pos, kv_pos, q_seg, kv_seg, *,
             mask: MaskSpec, scale: float, Tk: int, masked: bool, config: MgpuConfig,
             classes: bool = False):
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    B, Lq, Hq, D = q.shape
    Hkv = k.shape[2]
    g = Hq // Hkv
    dtype = q.dtype
    bq, bk, stages = config.block_q_bwd, config.block_kv_dq, config.num_stages_bwd
    has_seg = q_seg is not None
    pad_keys = Tk % bk != 0
    c = scale * LOG2E
    ROW, COL, WGMMA = (plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0),
                       plgpu.Layout.WGMMA)

    def kernel(tbl_ref, order_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, qpos_ref,
               kvpos_ref, qseg_ref, kvseg_ref, dq_ref, scoped):
        (q_smem, do_smem, k_smem, v_smem), (q_ready, k_ready, v_ready), \
            (k_free, v_free) = scoped
        b = lax.axis_index("batch")
        h = lax.axis_index("heads")
        wg = lax.axis_index("wg")
        cta = order_ref[b, lax.axis_index("q_seq")]
        count = tbl_ref[b, cta, 0]
        n_full = tbl_ref[b, cta, 1] if masked else count

        @pl.when(wg < 2)
        def _consumer():
            plgpu.set_max_registers(240, action="increase")
            row0 = cta * (2 * bq) + wg * bq
            qw, dow = q_smem.at[wg], do_smem.at[wg]
            with jax.named_scope("load"):  # trace regions (pallas_mgpu_common.TRACE_ENV)
                plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, bq), h], qw, q_ready.at[wg])
                plgpu.copy_gmem_to_smem(do_ref.at[b, pl.ds(row0, bq), h], dow,
                                        q_ready.at[wg])
                lse = _load(lse_ref.at[b, h, pl.ds(row0, bq)], ROW)
                dl = _load(dl_ref.at[b, h, pl.ds(row0, bq)], ROW)
                if masked:
                    qpos = _load(qpos_ref.at[b, pl.ds(row0, bq)], ROW)
                    qseg = _load(qseg_ref.at[b, pl.ds(row0, bq)], ROW) if has_seg else None
                plgpu.barrier_wait(q_ready.at[wg])

            def own(t):
                """This consumer's Q and dO blocks (the same in every step ``t``)."""
                return q_smem.at[wg], do_smem.at[wg]

            def row_lse(t, mode):
                """lse, or (segment test folded: the key block is one document) +inf
                for the queries of another document, so that their P is 0."""
                if mode is None or mode[1] != "fold":
                    return lse
                kseg0 = kvseg_ref[b, tbl_ref[b, cta, t + 2] * bk]
                return jnp.where(qseg == kseg0, lse, jnp.inf)

            def step_overlap(t, dq, mode):
                # S and dP issued together; P formed while dP runs
                slot = lax.rem(t, jnp.int32(stages))
                zeros = plgpu.layout_cast(jnp.full((bq, bk), 0.0, F32), WGMMA)
                lse_t = row_lse(t, mode)

                def body(refs):
                    dq_ref_, s_ref, dp_ref = refs
                    qt, dot = own(t)
                    plgpu.barrier_wait(k_ready.at[slot])
                    plgpu.wgmma(s_ref, qt, k_smem.at[slot].transpose((1, 0)))
                    plgpu.barrier_wait(v_ready.at[slot])
                    plgpu.wgmma(dp_ref, dot, v_smem.at[slot].transpose((1, 0)))
                    s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)   # S done
                    ok = visible(t, mode)
                    if ok is not None:
                        s = jnp.where(ok, s, -jnp.inf)
                    p = jnp.exp2(s * c - lax.broadcast_in_dim(lse_t, s.shape, [0]))
                    dp = plgpu.wgmma_accumulator_load(dp_ref, wait_n=0)  # dP done
                    plgpu.barrier_arrive(v_free.at[slot])
                    ds = p * (dp - lax.broadcast_in_dim(dl, s.shape, [0]))
                    plgpu.wgmma(dq_ref_, ds.astype(dtype), k_smem.at[slot])
                dq, _, _ = pl.run_state(body)((plgpu.ACC.init(dq), plgpu.ACC.init(zeros),
                                               plgpu.ACC.init(zeros)))
                plgpu.barrier_arrive(k_free.at[slot])
                return dq

            def visible(t, mode):
                """The tile's mask (or None) from global positions, ids, padded keys:
                the tests ``mode`` (``masked_loops``) names; None for an unmasked one."""
                if mode is None:
                    return None
                pos, seg = mode
                start = tbl_ref[b, cta, t + 2] * bk
                shape = (bq, bk)
                kpos = _load(kvpos_ref.at[pl.ds(start, bk)], COL) if pos else None
                pair = seg == "pair"
                kseg = _load(kvseg_ref.at[b, pl.ds(start, bk)], COL) if pair else None
                # position-proved tiles hold no padded key
                pad = keys_before(Tk, start, shape, 1) if pad_keys and pos else None
                return tile_visible(mask if pos else MaskSpec(), qpos, kpos,
                                    qseg if pair else None, kseg, 0, shape, extra=pad)

            @traced("step")
            def step(t, dq, mode):
                if config.overlap_bwd:
                    return step_overlap(t, dq, mode)
                slot = lax.rem(t, jnp.int32(stages))
                lse_t = row_lse(t, mode)
                plgpu.barrier_wait(k_ready.at[slot])

                def s_fn(acc_ref):
                    plgpu.wgmma(acc_ref, own(t)[0], k_smem.at[slot].transpose((1, 0)))
                    return acc_ref[...]
                s = pl.run_scoped(s_fn, plgpu.ACC((bq, bk), F32))
                ok = visible(t, mode)
                if ok is not None:
                    s = jnp.where(ok, s, -jnp.inf)
                p = jnp.exp2(s * c - lax.broadcast_in_dim(lse_t, s.shape, [0]))
                plgpu.barrier_wait(v_ready.at[slot])

                def dp_fn(acc_ref):
                    plgpu.wgmma(acc_ref, own(t)[1], v_smem.at[slot].transpose((1, 0)))
                    return acc_ref[...]
                dp = pl.run_scoped(dp_fn, plgpu.ACC((bq, bk), F32))
                plgpu.barrier_arrive(v_free.at[slot])
                ds = p * (dp - lax.broadcast_in_dim(dl, s.shape, [0]))

                def dq_fn(acc_ref):
                    plgpu.wgmma(acc_ref, ds.astype(dtype), k_smem.at[slot])
                dq = pl.run_state(dq_fn)(plgpu.ACC.init(dq))
                plgpu.barrier_arrive(k_free.at[slot])
                return dq

            dq = plgpu.layout_cast(jnp.full((bq, D), 0.0, F32), WGMMA)
            with jax.named_scope("dq_rows"):
                dq = row_loops(tbl_ref, b, cta, n_full, count, has_seg, classes, masked,
                               step, dq)
            with jax.named_scope("out"):
                qw[...] = (dq * scale).astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(qw, dq_ref.at[b, pl.ds(row0, bq), h])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the block is read

        @pl.when(wg == 2)
        def _producer():
            plgpu.set_max_registers(24, action="decrease")
            on_producer_warps(config.warp_producer_bwd, lambda: produce_kv(
                lambda t: tbl_ref[b, cta, t + 2], b, count, bk, stages,
                lax.div(h, jnp.int32(g)), k_ref, v_ref, k_smem, v_smem, k_ready, v_ready,
                k_free, v_free))

    def entry(*refs):
        ins = refs[:12] if has_seg else refs[:10] + (None, None)
        dq_ref = refs[-1]
        swz = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        smem = (plgpu.SMEM((2, bq, D), dtype, transforms=swz),
                plgpu.SMEM((2, bq, D), dtype, transforms=swz),
                plgpu.SMEM((stages, bk, D), dtype, transforms=swz),
                plgpu.SMEM((stages, bk, D), dtype, transforms=swz))
        pl.run_scoped(
            lambda *scoped: kernel(*ins, dq_ref, scoped),
            smem,
            (plgpu.Barrier(num_arrivals=2, num_barriers=2),
             plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)),
            (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
            collective_axes="wg",
        )

    args = [tbl, order, q, k, v, do, lse2, delta, q_pos, kv_pos] + (
        [q_seg, kv_seg] if has_seg else [])
    args, (out_type,) = kernel_io(args, [((B, Lq, Hq, D), dtype)])
    return plgpu.kernel(
        entry, out_type=out_type,
        grid=(Hq, Lq // (2 * bq), B), grid_names=("heads", "q_seq", "batch"),
        num_threads=3, thread_name="wg",
        compiler_params=compiler_params(),
    )(*args)


# --------------------------------------------------------------------------- driver
def zeroed_dq(shape, after):
    """(``MgpuConfig.tma_zero_dq=False``; ``tma_zeros`` otherwise) The zeroed float32 dQ
    that the atomic-dQ kernels add into, made from a zero that an
    ``optimization_barrier`` ties to ``after`` (this call's delta).  From a constant,
    XLA merged the zeros of every call in a program into one multi-output broadcast,
    which allocates all of them at once: a 7B step at 128k tokens (32 layers, three
    calls each) asked for 114 GiB of temporaries instead of 54 (RESULTS.md, "auto on
    the H200").  Without the zero, the first CTA at each query block storing its block and
    the others adding theirs once that store had landed (tickets and counters in global
    memory; tried in 37829e7 and, with the tickets from a warp of their own, ed5f9c9) gave
    the same gradients and read 71% of cuDNN's rate on the bar's packed call against
    81-83% for this way (RESULTS.md, 2026-12-03, evening)."""
    zero, _ = lax.optimization_barrier((jnp.zeros((), F32), after))
    return jnp.broadcast_to(zero, shape)


#: Rows of the shared-memory block a ``tma_zeros`` CTA stores from (64 KiB at D 128),
#: the CTAs per SM, and the stores a CTA keeps in flight.
ZERO_BLOCK_BYTES, ZERO_CTAS_PER_SM, ZERO_IN_FLIGHT = 64 * 1024, 2, 4


def tma_zeros(shape, after):
    """(``MgpuConfig.tma_zero_dq``) Float32 zeros of ``shape`` ``[..., D]`` from a Mosaic
    GPU kernel: each CTA zeroes one block of ``ZERO_BLOCK_BYTES`` in shared memory and
    stores it with TMA over every ``n``-th block of rows of the output seen as ``[rows,
    D]`` (a block of fewer rows, down to 64, where the rows do not divide), with
    ``ZERO_IN_FLIGHT`` stores at a time (the block is never written again, so the waits
    only bound the queue).  ``after`` (this call's delta) is an operand the kernel
    does not read: it orders the zeros after it and keeps the calls of a program apart,
    as ``zeroed_dq``'s barrier does."""
    import jax.experimental.pallas as pl
    from jax_seqpar.kernels.pallas_mgpu_common import sm_count
    plgpu = _plgpu()
    D = shape[-1]
    n_rows = math.prod(shape[:-1])
    rows = max(64, ZERO_BLOCK_BYTES // (4 * D))
    while rows > 64 and n_rows % rows:
        rows //= 2
    if D % 32 or n_rows % rows:
        raise ValueError(f"tma_zeros: shape {shape} needs a last dim that is a multiple of "
                         f"32 and rows (the product of the others) a multiple of 64")
    n_blocks = n_rows // rows
    n_ctas = min(n_blocks, ZERO_CTAS_PER_SM * sm_count())
    swz = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))

    def body(after_ref, out_ref, smem):
        del after_ref
        smem[...] = plgpu.layout_cast(jnp.full((rows, D), 0.0, F32), plgpu.Layout.WGMMA)
        plgpu.commit_smem()

        @pl.loop(lax.axis_index("cta"), n_blocks, step=n_ctas)
        def _(i):
            plgpu.wait_smem_to_gmem(ZERO_IN_FLIGHT - 1, wait_read_only=True)
            plgpu.copy_smem_to_gmem(smem, out_ref.at[pl.ds(pl.multiple_of(i * rows, rows),
                                                           rows)])
        plgpu.wait_smem_to_gmem(0)

    (after,), (out_type,) = kernel_io([after], [((n_rows, D), F32)])
    out = plgpu.kernel(body, out_type=out_type, grid=(n_ctas,), grid_names=("cta",),
                       scratch_types=[plgpu.SMEM((rows, D), F32, transforms=swz)],
                       compiler_params=compiler_params())(after)
    return out.reshape(shape)


def mgpu_bwd(q, k, v, o, lse, do, q_pos, kv_pos, mask: MaskSpec, scale: float, q_seg=None,
             kv_seg=None, delta=None, *, config: MgpuConfig):
    """``(dq, dk, dv)`` in float32, shapes of ``q, k, v``; see the module docstring."""
    B, Tq, Hq, D = q.shape
    Tk = k.shape[1]
    bq, bk, bk_dq = config.block_q_bwd, config.block_kv_bwd, config.block_kv_dq
    kmul = math.lcm(2 * bk, bk_dq)  # whole CTAs of the dK/dV kernel, whole dQ stages
    Lq, Lk = -(-Tq // (2 * bq)) * (2 * bq), -(-Tk // kmul) * kmul
    has_seg = q_seg is not None
    if delta is None:
        delta = attention_delta(o, do)
    dtype = q.dtype
    q_pos = _pad_to(jnp.broadcast_to(q_pos.astype(jnp.int32), (B, Tq)), 1, Lq, edge=True)
    kv_pos = _pad_to(kv_pos.astype(jnp.int32), 0, Lk, edge=True)
    qp, dop = _pad_to(q, 1, Lq), _pad_to(do.astype(dtype), 1, Lq)
    kp, vp = _pad_to(k, 1, Lk), _pad_to(v, 1, Lk)
    # lse in log2 units; rows that saw nothing (lse = -inf) and padded rows get +inf, so
    # that P = exp2(S - lse) is 0 for them
    lse2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse.astype(F32) * LOG2E)
    lse2 = jnp.pad(lse2, ((0, 0), (0, 0), (0, Lq - Tq)), constant_values=jnp.inf)
    dl = _pad_to(delta.astype(F32), 2, Lq)
    segs = (None, None)
    if has_seg:
        segs = (_pad_to(q_seg.astype(jnp.int32), 1, Lq, edge=True),
                _pad_to(kv_seg.astype(jnp.int32), 1, Lk, edge=True))
    pos_masked = mask.right_limit is not None or mask.left_limit is not None or has_seg
    # the key-stationary kernels that add dQ mask the keys padded past Tk (fused_call)
    masked_kv = pos_masked or Tk % (2 * bk) != 0
    seg_kw = segment_lists_args(*segs, config.segment_skip)
    # mask classes need the ids in the lists (segment_skip); the atomic-dQ kernel's
    # steps do not take them
    classes = bool(seg_kw) and config.mask_classes and not config.atomic_dq
    # the fused kernel (scores by row) sorts its lists by class as the dQ kernel does
    classes_dkdv = bool(seg_kw) and config.mask_classes and config.row_scores
    tbl_t = tile_lists(mask, q_pos, kv_pos, Tk, bq, 2 * bk, has_seg, transpose=True,
                       classes=classes_dkdv, **seg_kw)
    order_t = (doc_cta_order(tbl_t, last=True, classes=classes_dkdv)
               if config.doc_order_bwd and has_seg else cta_order(tbl_t))
    if config.atomic_dq:
        dq_acc = jax.new_ref((tma_zeros if config.tma_zero_dq else zeroed_dq)(
            (B, Lq, Hq, D), dl))
        args = (tbl_t, order_t, qp, kp, vp, dop, lse2, dl, q_pos, kv_pos, *segs)
        if config.row_scores:
            dk, dv = fused_call(*args, dq_acc, mask=mask, scale=scale, masked=masked_kv,
                                config=config, classes=classes_dkdv, Tk=Tk)
        else:
            dk, dv = _dkdv_call(*args, mask=mask, scale=scale, masked=masked_kv,
                                config=config, dq_acc=dq_acc, Tk=Tk)
        dq = dq_acc[...][:, :Tq] * scale
        return dq, dk[:, :Tk].astype(F32), dv[:, :Tk].astype(F32)
    dk, dv = _dkdv_call(tbl_t, order_t, qp, kp, vp, dop, lse2, dl, q_pos, kv_pos,
                        *segs, mask=mask, scale=scale, masked=pos_masked, config=config)
    tbl = tile_lists(mask, q_pos, kv_pos, Tk, 2 * bq, bk_dq, has_seg, classes=classes,
                     **seg_kw)
    order = (doc_cta_order(tbl, classes=classes) if config.doc_order and has_seg
             else cta_order(tbl))
    dq = _dq_call(tbl, order, qp, kp, vp, dop, lse2, dl, q_pos, kv_pos, *segs,
                  mask=mask, scale=scale, Tk=Tk, masked=pos_masked or Tk % bk_dq != 0,
                  config=config, classes=classes)
    return (dq[:, :Tq].astype(F32), dk[:, :Tk].astype(F32), dv[:, :Tk].astype(F32))
