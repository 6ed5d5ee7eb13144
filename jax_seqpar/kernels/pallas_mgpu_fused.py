"""The fused Hopper backward with scores by query row (``MgpuConfig.row_scores``).

One kernel for dK, dV and dQ, FlashAttention-3's backward in the layout its D 128 causal
configuration takes (Shah et al., 2024, §3.3 and Appendix B.2; its ``SdP_swapAB``
false): with the given ``lse`` and ``delta = rowsum(dO * O)`` (BurstEngine Eq. 7-8)::

    S = Q K^T,  P = exp(S - lse),  dP = dO V^T,  dS = P * (dP - delta)
    dV += P^T dO,  dK += dS^T Q  (this CTA's keys),  dQ += dS K  (reduce-added)

One CTA per (block of ``2 * block_kv_bwd`` keys, key/value head, batch row), as
``pallas_mgpu_bwd._dkdv_call``: two consumer warpgroups keep ``block_kv_bwd`` keys each,
with dK and dV in registers, while a producer streams Q, dO, lse and delta of the
CTA's tile-list row (``produce_q_ring``).  What differs from that kernel's transposed
step (``S^T = K Q^T``):

* The scores are ``[queries, keys]``, so lse and delta are per row: two values a
  thread, where the transposed layout holds sixteen of each (a column vector of the
  wgmma accumulator).  The segment test of a tile whose keys are one document folds
  into the row's lse (``MASK_CLASSES``' ``"fold"``: ``+inf`` for another document's
  queries), as the dQ kernel's does.
* ``P`` and ``dS`` go to shared memory in the input dtype, and ``dV += P^T dO`` and
  ``dK += dS^T Q`` read them transposed from there, so neither stays in registers as a
  wgmma operand.
* dQ is split between the consumers as in ``split_dq``: once both have stored their
  ``dS`` (a barrier per step, double-buffered by step parity), each multiplies the
  whole ``[queries, 2 * block_kv_bwd]`` dS by half of K's columns and adds that half of
  the dQ block into a zeroed float32 dQ in global memory with a TMA reduce-add.

The consumer's own K, V and P blocks are indexed in each step (``step_index``): hoisted
out of the loop, their wgmma descriptors took registers that ptxas then spilled (1080
bytes a thread; 124 this way, on one H100).

Step order, with ``MgpuConfig.dv_with_dp`` (FlashAttention-3's): ``S`` alone; ``P``
formed and stored; ``dP`` and ``dV`` issued together, ``dS`` formed while ``dV`` runs,
stored; the barrier; the dQ half and ``dK`` issued together, and with ``early_dq``
(the default) the dQ half first, its reduce-add running while ``dK`` does.  Without
``dv_with_dp`` ``S`` and ``dP`` are issued together and ``P`` is formed while ``dP``
runs.  The summation order of dQ varies from run to run.

Tried and taken out (756eed8): letting the consumer whose keys no query of a tile sees
(each key block's diagonal query block in a causal document: 2% of the consumers' steps
on the bar's packed documents at 64k) skip its products, its partner running the step
alone with the full mask test.  Correct (dK and dV then summed in another order), but
ptxas spilled 448 / 508 bytes a thread instead of 132 / 184, and the bar read 0.9
points lower over three runs on one H200 (RESULTS.md, 2026-12-03, night).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_seqpar.kernels.pallas_mgpu_common import (F32, LOG2E, MgpuConfig, _load, _plgpu,
                                                   keys_before, step_index, tile_visible)
from jax_seqpar.kernels.pallas_mgpu_keys import (kv_shapes, kv_stationary_kernel,
                                                 reduce_add_dq)
from jax_seqpar.masks import MaskSpec


def fused_call(tbl, order, q, k, v, do, lse2, delta, q_pos, kv_pos, q_seg, kv_seg, dq_acc,
               *, mask: MaskSpec, scale: float, masked: bool, config: MgpuConfig,
               classes: bool = False, Tk: int | None = None):
    """``(dk, dv)`` in the input dtype; ``dS K`` (dQ before its scale) is added into the
    float32 Ref ``dq_acc`` ``[B, Lq, Hq, D]``.  Arguments as ``pallas_mgpu_bwd.
    _dkdv_call``'s; ``tbl``: the transposed tile lists, sorted by mask class if
    ``classes``.

    ``Tk``: the keys before padding.  Keys past it (K and V zero, positions and ids the
    last key's) are masked in every position-tested class, which holds each CTA whose
    keys run past ``Tk`` (``pallas_common.tile_lists``: such a tile is never whole):
    else a padded key's ``P = exp2(0 - lse2)`` overflows for a query row whose lse is
    below about -88, and ``inf * 0`` puts NaN into dQ.  ``masked`` must then be true."""
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    D, g, dtype, bq, bk, stages = kv_shapes(q, k, config, split="row_scores")
    has_seg = q_seg is not None
    half = D // 2
    c = scale * LOG2E
    pad_keys = Tk is not None and Tk % (2 * bk) != 0
    if pad_keys and not masked:
        raise ValueError(f"fused_call: keys padded past Tk={Tk} need masked=True")
    ROW, COL, WGMMA = (plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0),
                       plgpu.Layout.WGMMA)

    def make_step(refs, scoped, cta, row0, kw):
        (tbl_ref, _, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, qpos_ref, kvpos_ref,
         qseg_ref, kvseg_ref, dq_ref, _, _) = refs
        (k_smem, v_smem, q_smem, do_smem, lse_smem, dl_smem, p_smem, ds_smem, dq_smem), \
            (kv_ready, q_ready, do_ready, lse_ready, dl_ready), (q_free, do_free, ds_ready) \
            = scoped
        b, kvh, blk, wg, count, n_full = cta
        first = row0 - wg * bk  # the CTA's first key row
        if masked:
            kpos = _load(kvpos_ref.at[pl.ds(row0, bk)], COL)
            kseg = _load(kvseg_ref.at[b, pl.ds(row0, bk)], COL) if has_seg else None

        def row_lse(lse, start, mode):
            """lse, or (the CTA's keys are one document) +inf where P must be 0: for the
            queries of another document."""
            if mode is None or mode[1] != "fold":
                return lse
            qseg = _load(qseg_ref.at[b, pl.ds(start, bq)], ROW)
            return jnp.where(qseg == kvseg_ref[b, first], lse, jnp.inf)

        def visible(start, mode):
            """The tile's mask (None: all visible) from the tests ``mode`` names."""
            if mode is None:
                return None
            pos, seg = mode
            qpos = _load(qpos_ref.at[b, pl.ds(start, bq)], ROW) if pos else None
            pair = seg == "pair"
            qseg = _load(qseg_ref.at[b, pl.ds(start, bq)], ROW) if pair else None
            extra = None
            if pad_keys and pos:  # position-proved tiles hold no padded key
                extra = keys_before(Tk, row0, (bq, bk), 1)
            return tile_visible(mask if pos else MaskSpec(), qpos, kpos if pos else None,
                                qseg, kseg if pair else None, 0, (bq, bk), extra=extra)

        def step(t, carry, hh, mode):
            dk, dv = carry
            j = hh * count + t
            slot = lax.rem(j, jnp.int32(stages))
            par = lax.rem(j, jnp.int32(2))
            token = tbl_ref[b, blk, t + 2]
            start = token * bq
            w_own = step_index(wg, token)  # descriptors formed in the step: no spills
            kt, vt = k_smem.at[w_own], v_smem.at[w_own]
            pt = p_smem.at[w_own]
            plgpu.barrier_wait(q_ready.at[slot])
            plgpu.barrier_wait(do_ready.at[slot])
            zeros = plgpu.layout_cast(jnp.full((bq, bk), 0.0, F32), WGMMA)

            def probs(s_ref, lse, wait_n):
                """P of the tile once ``S`` is done (``wait_n`` products may still
                run), stored for the dV product."""
                s = plgpu.wgmma_accumulator_load(s_ref, wait_n=wait_n)
                ok = visible(start, mode)
                if ok is not None:
                    s = jnp.where(ok, s, -jnp.inf)
                p = jnp.exp2(s * c - lax.broadcast_in_dim(lse, s.shape, [0]))
                pt[...] = p.astype(dtype)
                plgpu.commit_smem()
                return p

            def grads(p, dv_ref, dp_ref):
                """dV issued; dS formed (while dV runs) and stored."""
                plgpu.wgmma(dv_ref, pt.transpose((1, 0)), do_smem.at[slot])
                plgpu.barrier_wait(dl_ready.at[slot])
                dl = _load(dl_smem.at[slot], ROW, gmem=False)
                dp = plgpu.wgmma_accumulator_load(dp_ref, wait_n=1)  # dP done
                ds = p * (dp - lax.broadcast_in_dim(dl, p.shape, [0]))
                ds_smem.at[par, wg][...] = ds.astype(dtype)
                plgpu.commit_smem()

            def lse_row():
                plgpu.barrier_wait(lse_ready.at[slot])
                return row_lse(_load(lse_smem.at[slot], ROW, gmem=False), start, mode)

            if config.dv_with_dp:  # S alone, then dP and dV together
                def s_fn(s_ref):
                    plgpu.wgmma(s_ref, q_smem.at[slot], kt.transpose((1, 0)))
                    return probs(s_ref, lse_row(), 0)
                with jax.named_scope("sp"):  # trace regions within a step (TRACE_ENV)
                    p = pl.run_scoped(s_fn, plgpu.ACC((bq, bk), F32))

                def front(refs):
                    dv_ref, dp_ref = refs
                    plgpu.wgmma(dp_ref, do_smem.at[slot], vt.transpose((1, 0)))
                    grads(p, dv_ref, dp_ref)
                with jax.named_scope("front"):
                    dv, _ = pl.run_state(front)((plgpu.ACC.init(dv),
                                                 plgpu.ACC.init(zeros)))
            else:  # S and dP together, P formed while dP runs
                def front(refs):
                    dv_ref, s_ref, dp_ref = refs
                    plgpu.wgmma(s_ref, q_smem.at[slot], kt.transpose((1, 0)))
                    plgpu.wgmma(dp_ref, do_smem.at[slot], vt.transpose((1, 0)))
                    grads(probs(s_ref, lse_row(), 1), dv_ref, dp_ref)  # dP runs on
                dv, _, _ = pl.run_state(front)((plgpu.ACC.init(dv), plgpu.ACC.init(zeros),
                                                plgpu.ACC.init(zeros)))
            plgpu.barrier_arrive(do_free.at[slot])
            # both consumers' dS are stored: each multiplies all 2 * bk keys' dS by
            # half of K's columns
            with jax.named_scope("meet"):
                plgpu.barrier_arrive(ds_ready.at[par])
                plgpu.barrier_wait(ds_ready.at[par])
            cols = pl.ds(pl.multiple_of(wg * half, half), half)
            zq = plgpu.layout_cast(jnp.full((bq, half), 0.0, F32), WGMMA)

            def dq_dst():
                return dq_ref.at[b, pl.ds(start, bq), kvh * g + hh].at[:, cols]

            def dk_product(dk_ref_):
                plgpu.wgmma(dk_ref_, ds_smem.at[par, wg].transpose((1, 0)),
                            q_smem.at[slot])

            def dq_products(dq_ref_):
                for w in range(2):  # (w_own - wg + w: w, as the step's index)
                    kk = k_smem.at[w_own - wg + w, :, cols]
                    plgpu.wgmma(dq_ref_, ds_smem.at[par, w], kk)

            if config.early_dq:  # the dQ half first; its reduce-add runs beside dK
                def back(refs):
                    dk_ref_, dq_ref_ = refs
                    dq_products(dq_ref_)
                    dk_product(dk_ref_)
                    dq = plgpu.wgmma_accumulator_load(dq_ref_, wait_n=1)  # dK runs on
                    with jax.named_scope("red"):
                        reduce_add_dq(dq_smem.at[wg], dq, dq_dst)
                with jax.named_scope("back"):
                    dk, _ = pl.run_state(back)((plgpu.ACC.init(dk), plgpu.ACC.init(zq)))
                    plgpu.barrier_arrive(q_free.at[slot])
                return dk, dv

            def back(refs):
                dk_ref_, dq_ref_ = refs
                dk_product(dk_ref_)
                dq_products(dq_ref_)
            with jax.named_scope("back"):
                dk, dq = pl.run_state(back)((plgpu.ACC.init(dk), plgpu.ACC.init(zq)))
                plgpu.barrier_arrive(q_free.at[slot])
            with jax.named_scope("red"):
                reduce_add_dq(dq_smem.at[wg], dq, dq_dst)
            return dk, dv

        return step

    swz = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    swz32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
    extra = (plgpu.SMEM((2, bq, bk), dtype, transforms=swz),       # P, per consumer
             plgpu.SMEM((2, 2, bq, bk), dtype, transforms=swz),    # dS, parity x consumer
             plgpu.SMEM((2, bq, half), F32, transforms=swz32))     # dQ halves
    return kv_stationary_kernel(
        make_step, (tbl, order, q, k, v, do, lse2, delta, q_pos, kv_pos), q_seg, kv_seg,
        dq_acc, config=config, scale=scale, masked=masked, classes=classes, split=True,
        extra_smem=extra)
