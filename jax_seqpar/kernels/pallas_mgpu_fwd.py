"""Hopper attention tiles in Pallas through the Mosaic GPU lowering (``pallas_mgpu``).

The forward follows FlashAttention-3 (Shah et al., 2024, Alg. 1 and §3.1-3.2), run over
the same per-block tile lists as the Triton kernel (``pallas_common.tile_lists``):

* one CTA per (query block of ``2 * block_q`` rows, query head, batch row), three
  warpgroups: a **producer** that only issues TMA copies of the visible K/V blocks into a
  ``num_stages``-deep shared-memory ring, and two **consumers** that own ``block_q`` query
  rows each and run ``S = Q K^T`` and ``O += P V`` on the tensor cores (``wgmma``) with the
  online softmax of FlashAttention-2 Alg. 1, lines 6-10, in float32 between them;
* **ping-pong** (FA3 §3.1, Fig. 1): on two hardware named barriers, a consumer that
  has issued its ``S`` lets the other run its ``P V`` and waits for its own turn only
  before its own ``P V``, so one consumer's softmax runs while the other's products
  occupy the tensor cores (``MgpuConfig.named_sched``); the consumers free ring slots on
  named barriers too (``named_free``); the producer gives its registers to the
  consumers (``set_max_registers``);
* the key blocks a CTA visits are entries ``2 .. 2 + count`` of its tile-list row, the
  ``n_full`` fully visible ones first: the consumers run them without mask code, then
  the partially visible ones with the mask evaluated on **global positions** (query
  positions per row, key positions per column, segment ids, padded keys), so one kernel
  serves every ring step, layout (zigzag, striped), window and packed batch; with segment
  ids the lists also leave out the tiles whose blocks share no document and count the
  tiles inside one document as fully visible (``pallas_common.segment_tiles``, per-block
  id ranges computed once per call, ``MgpuConfig.segment_skip``), and sort the partially
  visible ones by the mask code they need (``MgpuConfig.mask_classes_fwd``): where a key
  block lies in one document the segment test is one comparison per row, folded into
  the online softmax (``softmax_update``), and where positions prove a tile there is no
  position test;
* CTAs are launched **most tiles first** (a permutation of the query blocks by their
  tile count), so under a causal mask the last wave is short rows, not long ones; with
  segment ids, document by document, longest first (``MgpuConfig.doc_order``);
* on tiles the caller states dense or aligned (``base.TILE_DENSE`` / ``TILE_ALIGNED``)
  masks come from row and column indices, and without segment ids the visited blocks and
  the launch order are computed, not read from lists (``index_kind``,
  ``MgpuConfig.index_tiles``);
* rows that see no key give ``o = 0`` and ``lse = -inf`` (the running max is replaced
  by 0 while it is ``-inf``, so no ``-inf - -inf``).

``o`` is returned in the input dtype (as cuDNN does), ``lse`` in float32, natural log.
The backend that serves these tiles through the kernel contract (its refusals, the
tuned configs) is ``pallas_mgpu``; the backward is ``pallas_mgpu_bwd``.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from jax_seqpar.runtime._compat import kernel_io
from jax_seqpar.kernels.base import TILE_ALIGNED, TILE_DENSE, TILE_GENERAL
from jax_seqpar.kernels.pallas_common import _pad_to, segment_lists_args, tile_lists
from jax_seqpar.kernels.pallas_mgpu_common import (
    F32, LN2, LOG2E, SCHED_BARRIERS, SLOT_THREADS, WARP_SLOT_THREADS, MgpuConfig, _load,
    _plgpu, compiler_params, cta_order, doc_cta_order, free_barrier, named_barrier,
    named_barriers_supported, on_producer_warps, produce_kv, row_loops, slot_barrier,
    softmax_update, tile_visible, traced)
from jax_seqpar.masks import MaskSpec

# --------------------------------------------------------------------------- forward
def _fwd_call(tbl, order, q, k, v, q_pos, kv_pos, q_seg, kv_seg, *, mask: MaskSpec,
              scale: float, Tk: int, masked: bool, config: MgpuConfig,
              index: Optional[str] = None, classes: bool = False):
    """``index`` (``index_kind``): None (the tile lists ``tbl`` in launch ``order`` say
    which key blocks a CTA visits; positions are read), ``"aligned"`` (the lists, but
    masks from the row and column indices, which differ from the positions by one
    offset on an aligned tile), or ``"dense"`` / ``"causal"`` (no lists: every key
    block, or those up to the diagonal with the longest rows launched first, computed
    from the indices).  ``classes``: the lists are sorted by mask class
    (``tile_lists(classes=True)``) and each class runs the mask code it needs
    (``MgpuConfig.mask_classes_fwd``)."""
    import jax.experimental.pallas as pl
    plgpu = _plgpu()

    B, Lq, Hq, D = q.shape
    Hkv = k.shape[2]
    g = Hq // Hkv
    dtype = q.dtype
    bq, bk, stages = config.block_q, config.block_kv, config.num_stages
    has_seg = q_seg is not None
    c = scale * LOG2E
    pad_keys = Tk % bk != 0
    nq, nk = Lq // (2 * bq), -(-Tk // bk)
    by_index = index is not None  # masks from indices, positions never read
    named = config.named_sched and named_barriers_supported()
    named_free = config.named_free and named_barriers_supported()
    overlap = config.overlap_fwd and named
    if named_free:
        free_barrier("v", stages - 1, stages)  # enough named barriers for the ring
    slot_threads = WARP_SLOT_THREADS if config.warp_producer else SLOT_THREADS
    no_lists = index in ("dense", "causal")
    ROW = plgpu.Layout.WGMMA.reduce(1)
    COL = plgpu.Layout.WGMMA.reduce(0)
    WGMMA = plgpu.Layout.WGMMA

    def schedule(tbl_ref, order_ref, b):
        """``(cta, count, n_full, block)`` of this CTA (launch slot ``j`` of batch row
        ``b``): its query block, how many key blocks it visits, how many of those first
        ones need no mask, and the t-th's index."""
        j = lax.axis_index("q_seq")
        if index == "dense":
            return j, nk, (nk - 1 if pad_keys else nk), lambda t: t
        if index == "causal":
            cta = nq - 1 - j  # the longest rows first, as cta_order does for the lists
            count, n_full = causal_blocks(cta, 2 * bq, bk, nk, pad_keys,
                                          lambda a, b: lax.div(a, jnp.int32(b)), jnp.minimum)
            return cta, count, n_full, lambda t: t
        cta = order_ref[b, j]
        count = tbl_ref[b, cta, 0]
        return (cta, count, tbl_ref[b, cta, 1] if masked else count,
                lambda t: tbl_ref[b, cta, t + 2])

    def kernel(tbl_ref, order_ref, q_ref, k_ref, v_ref, qpos_ref, kvpos_ref, qseg_ref,
               kvseg_ref, o_ref, lse_ref, scoped):
        (qo_smem2, k_smem, v_smem, lse_smem2), (k_ready, v_ready, q_ready), \
            (k_free, v_free), sched = scoped
        b = lax.axis_index("batch")
        h = lax.axis_index("heads")
        wg = lax.axis_index("wg")
        current = schedule(tbl_ref, order_ref, b)

        def free_slot(which, ref, slot):  # this consumer has read the slot's K or V
            if named_free:
                slot_barrier("arrive", which, slot, stages, slot_threads)
            else:
                plgpu.barrier_arrive(ref.at[slot])

        def rendezvous():  # the two consumers meet (named_sched=False)
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

        def let_other_go():  # this consumer's S is issued: the other may run its P V
            for me in (0, 1):
                pl.when(wg == me)(functools.partial(named_barrier, "arrive",
                                                    SCHED_BARRIERS[1 - me]))

        def wait_turn():  # until the other consumer's S is issued
            for me in (0, 1):
                pl.when(wg == me)(functools.partial(named_barrier, "sync",
                                                    SCHED_BARRIERS[me]))

        def consume(b, h, current):
            """A consumer's work on the CTA's query block ``current`` (``schedule``'s) of
            batch row ``b`` and head ``h``."""
            cta, count, n_full, block = current
            qo, qo_ready = qo_smem2.at[wg], q_ready.at[wg]
            row0 = cta * (2 * bq) + wg * bq

            def slot_of(t):  # the ring slot of the t-th key block
                return lax.rem(t, jnp.int32(stages))
            with jax.named_scope("load"):  # trace regions (TRACE_ENV)
                plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, bq), h], qo,
                                        q_ready.at[wg])
                # the row vectors load while the query block does
                qpos = qseg = None
                if masked and not by_index:
                    qpos = _load(qpos_ref.at[b, pl.ds(row0, bq)], ROW)
                if masked and has_seg:
                    qseg = _load(qseg_ref.at[b, pl.ds(row0, bq)], ROW)
                plgpu.barrier_wait(qo_ready)
            shape = (bq, bk)

            def mask_inputs(t, mode):
                """What the t-th tile's mask reads, loaded before its scores exist: the
                key positions (position test), the key ids (segment test per pair) or
                the one id of the key block (``"fold"``: a test per row)."""
                pos, seg = mode
                start = block(t) * bk
                kvpos = (_load(kvpos_ref.at[pl.ds(start, bk)], COL)
                         if pos and not by_index else None)
                kvseg = (_load(kvseg_ref.at[b, pl.ds(start, bk)], COL) if seg == "pair"
                         else None)
                row_ok = qseg == kvseg_ref[b, start] if seg == "fold" else None
                return start, kvpos, kvseg, row_ok

            def apply_mask(s, inputs, mode):
                start, kvpos, kvseg, _ = inputs
                pos, seg = mode
                pad = None
                col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=WGMMA) + start
                if pad_keys and pos:  # a position-proved tile holds no padded key
                    pad = col < Tk
                tmask = mask if pos else MaskSpec()
                pair_seg = qseg if seg == "pair" else None
                if by_index:  # aligned: positions are indices plus one offset
                    row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=WGMMA) + row0
                    ok = tile_visible(tmask, None, None, pair_seg, kvseg, 0, shape,
                                      extra=pad, diff=col - row)
                else:
                    ok = tile_visible(tmask, qpos, kvpos, pair_seg, kvseg, 0, shape,
                                      extra=pad)
                return s if ok is None else jnp.where(ok, s, -jnp.inf)

            def wait_next_k(t):  # while this step's last product runs
                @pl.when(t + 1 < count)
                def _():
                    plgpu.barrier_wait(k_ready.at[slot_of(t + 1)])

            @traced("step")
            def step(t, carry, mode):
                """One key block; ``mode`` None (fully visible) or the mask tests of
                ``masked_loops`` (position test?, segment test)."""
                acc, m, l = carry
                slot = slot_of(t)
                inputs = mask_inputs(t, mode) if mode is not None else None

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, qo, k_smem.at[slot].transpose((1, 0)))
                    let_other_go() if named else rendezvous()
                    return acc_ref[...]
                with jax.named_scope("qk"):  # trace regions within a step (TRACE_ENV)
                    s = pl.run_scoped(qk, plgpu.ACC((bq, bk), F32))
                    free_slot("k", k_free, slot)
                with jax.named_scope("soft"):
                    if mode is not None:
                        s = apply_mask(s, inputs, mode)
                    m_new, alpha, p = softmax_update(s, m, c, masked=mode is not None,
                                                     row_ok=None if mode is None
                                                     else inputs[3])
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    l = l * alpha
                    p16 = p.astype(dtype)

                def end_softmax():
                    if named:
                        plgpu.barrier_wait(v_ready.at[slot])
                        wait_turn()
                        return
                    plgpu.barrier_arrive(sched)
                    plgpu.barrier_wait(v_ready.at[slot])
                    plgpu.barrier_wait(sched)
                if D <= 128:
                    with jax.named_scope("soft"):
                        l = l + p.sum(axis=1)
                        acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
                    with jax.named_scope("turn"):
                        end_softmax()
                else:
                    with jax.named_scope("turn"):
                        end_softmax()
                    l = l + p.sum(axis=1)

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                    wait_next_k(t)
                with jax.named_scope("pv"):
                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                    free_slot("v", v_free, slot)
                return acc, m_new, l

            m0 = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, F32), ROW)
            l0 = plgpu.layout_cast(jnp.full((bq,), 0.0, F32), ROW)
            acc0 = plgpu.layout_cast(jnp.full((bq, D), 0.0, F32), WGMMA)

            # ----------------------------------------------- overlap_fwd (FA3 §3.2)
            def scores(s, m, l, mode, inputs):
                """The tile's masked online softmax: ``(m, l, p, alpha)``, ``p`` in
                float32 (converted once the registers of the last ``P`` are free)."""
                if mode is not None:
                    s = apply_mask(s, inputs, mode)
                m_new, alpha, p = softmax_update(s, m, c, masked=mode is not None,
                                                 row_ok=None if mode is None else inputs[3])
                l = l * alpha + p.sum(axis=1)
                return lax.optimization_barrier((m_new, l, p, alpha))

            def issue_pv(o_ref, p16, t):
                """``O += P V`` of tile ``t`` issued, once its V block has landed."""
                slot = lax.rem(t, jnp.int32(stages))
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.wgmma(o_ref, p16, v_smem.at[slot])

            @traced("first")
            def first_tile():
                """Tile 0's scores alone (the full mask test: right for any tile)."""
                mode = (True, "pair" if has_seg else None) if masked else None
                inputs = mask_inputs(0, mode) if mode is not None else None
                plgpu.barrier_wait(k_ready.at[0])

                def qk(s_ref):
                    wait_turn()
                    plgpu.wgmma(s_ref, qo, k_smem.at[0].transpose((1, 0)))
                    let_other_go()
                    return s_ref[...]
                s = pl.run_scoped(qk, plgpu.ACC((bq, bk), F32))
                free_slot("k", k_free, 0)
                m, l, p, _ = scores(s, m0, l0, mode, inputs)  # O is still 0: no rescale
                wait_next_k(0)
                return m, l, p.astype(dtype)

            def no_tile():
                return m0, l0, plgpu.layout_cast(jnp.full((bq, bk), 0, dtype), WGMMA)

            @traced("step")
            def step_overlap(t, carry, mode):
                """Tile ``t >= 1``: its ``S`` and tile ``t - 1``'s ``P V`` in flight
                together; its softmax while ``P V`` runs; once ``P V`` is done, ``O``
                rescaled and the new ``P`` converted into the registers the last one held
                (as FA3 does at head dims up to 128: an instruction that writes an operand
                of a product in flight makes ptxas serialize the products, C7513)."""
                acc, m, l, p16 = carry
                slot = lax.rem(t, jnp.int32(stages))
                inputs = mask_inputs(t, mode) if mode is not None else None

                def body(s_ref, o_ref):
                    o_ref[...] = acc
                    wait_turn()
                    plgpu.wgmma(s_ref, qo, k_smem.at[slot].transpose((1, 0)))
                    issue_pv(o_ref, p16, t - 1)
                    let_other_go()
                    s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)   # S done
                    free_slot("k", k_free, slot)
                    m_new, l_new, p, alpha = scores(s, m, l, mode, inputs)
                    wait_next_k(t)
                    acc_new = o_ref[...]                                # P V done
                    acc_new = acc_new * lax.broadcast_in_dim(alpha, acc_new.shape, [0])
                    return acc_new, m_new, l_new, p.astype(dtype)
                out = pl.run_scoped(body, plgpu.ACC((bq, bk), F32), plgpu.ACC((bq, D), F32))
                free_slot("v", v_free, lax.rem(t - 1, jnp.int32(stages)))
                return out

            @traced("last")
            def last_pv(acc, p16):
                def pv(o_ref):
                    o_ref[...] = acc
                    wait_turn()
                    issue_pv(o_ref, p16, count - 1)
                    let_other_go()
                    return o_ref[...]
                acc = pl.run_scoped(pv, plgpu.ACC((bq, D), F32))
                free_slot("v", v_free, lax.rem(count - 1, jnp.int32(stages)))
                return acc

            with jax.named_scope("rows"):
                if overlap:
                    # every issue is one turn: consumer 1 gives consumer 0 the first, and
                    # consumer 0 takes consumer 1's last hand-over at the end
                    pl.when(wg == 1)(functools.partial(named_barrier, "arrive",
                                                       SCHED_BARRIERS[0]))
                    m, l, p16 = lax.cond(count > 0, first_tile, no_tile)
                    acc, m, l, p16 = row_loops(
                        tbl_ref, b, cta, n_full, count, has_seg, classes, masked, step_overlap,
                        (acc0, m, l, p16), start=1)
                    acc = lax.cond(count > 0, last_pv, lambda a, _: a, acc, p16)
                    pl.when(wg == 0)(functools.partial(named_barrier, "sync", SCHED_BARRIERS[0]))
                    carry = acc, m, l
                else:
                    @pl.when(count > 0)
                    def _():
                        plgpu.barrier_wait(k_ready.at[0])
                    # consumer 1 starts half a step behind consumer 0
                    pl.when(wg == 1)(functools.partial(named_barrier, "sync", SCHED_BARRIERS[1])
                                     if named else rendezvous)
                    carry = row_loops(tbl_ref, b, cta, n_full, count, has_seg, classes, masked,
                                      step, (acc0, m0, l0))
                    # consumer 0 matches consumer 1's last wait
                    pl.when(wg == 0)(functools.partial(named_barrier, "arrive",
                                                       SCHED_BARRIERS[1])
                                     if named else rendezvous)
            with jax.named_scope("out"):
                acc, m, l = carry
                has = l > 0.0
                l_safe = jnp.where(has, l, 1.0)
                qo[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(dtype)
                lse_smem = lse_smem2.at[wg]
                lse_smem[...] = jnp.where(has, m * LN2 + jnp.log(l_safe), -jnp.inf)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(qo, o_ref.at[b, pl.ds(row0, bq), h])
                plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(row0, bq)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the blocks are read

        @pl.when(wg < 2)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")
            consume(b, h, current)

        @pl.when(wg == 2)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")

            @traced("produce")
            def produce():
                _, count, _, block = current
                produce_kv(block, b, count, bk, stages, lax.div(h, jnp.int32(g)), k_ref,
                           v_ref, k_smem, v_smem, k_ready, v_ready, k_free, v_free,
                           named_free=named_free, slot_threads=slot_threads)
            on_producer_warps(config.warp_producer, produce)

    def entry(*refs):
        refs = list(refs)
        tbl_ref, order_ref = (None, None) if no_lists else (refs.pop(0), refs.pop(0))
        q_ref, k_ref, v_ref = refs[:3]
        qpos_ref, kvpos_ref = (None, None) if by_index else refs[3:5]
        refs = refs[3 if by_index else 5:]
        qseg_ref, kvseg_ref = (refs.pop(0), refs.pop(0)) if has_seg else (None, None)
        o_ref, lse_ref = refs
        swz = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        smem = (plgpu.SMEM((2, bq, D), dtype, transforms=swz),
                plgpu.SMEM((stages, bk, D), dtype, transforms=swz),
                plgpu.SMEM((stages, bk, D), dtype, transforms=swz),
                plgpu.SMEM((2, bq), F32))
        pl.run_scoped(
            lambda *scoped: kernel(tbl_ref, order_ref, q_ref, k_ref, v_ref, qpos_ref,
                                   kvpos_ref, qseg_ref, kvseg_ref, o_ref, lse_ref, scoped),
            smem,
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_barriers=2)),
            (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )

    args = (([] if no_lists else [tbl, order]) + [q, k, v]
            + ([] if by_index else [q_pos, kv_pos]) + ([q_seg, kv_seg] if has_seg else []))
    args, out_type = kernel_io(args, [((B, Lq, Hq, D), dtype), ((B, Hq, Lq), F32)])
    return plgpu.kernel(
        entry,
        out_type=out_type,
        grid=(Hq, nq, B),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=3,
        thread_name="wg",
        compiler_params=compiler_params(),
    )(*args)


def causal_blocks(cta, rows: int, bk: int, nk: int, pad_keys: bool, div, minimum):
    """``(count, n_full)`` of query block ``cta`` (``rows`` queries) on an aligned causal
    tile: it visits key blocks ``0 .. count``, and the first ``n_full`` of them are
    visible to all its rows (their last key precedes its first query) with no padded
    key.  ``div`` / ``minimum`` are integer division and minimum (``lax`` in a kernel,
    plain Python in tests)."""
    r0 = cta * rows
    count = minimum(nk, div(r0 + rows + bk - 1, bk))
    n_full = minimum(div(r0 + 1, bk), count)
    return count, (minimum(n_full, nk - 1) if pad_keys else n_full)


def index_kind(mask: MaskSpec, tile: str, has_seg: bool, Tq: int, Tk: int,
               config: MgpuConfig) -> Optional[str]:
    """How a call may take tiles and masks from indices instead of positions (the
    ``index`` of ``_fwd_call``), by what the caller states of the tile (``base``'s tile
    kinds).  A dense tile has no mask, so positions do not matter; an aligned tile's
    positions are one offset plus the indices, so its masks are functions of the
    indices (FlashAttention-3 and tokamax mask so).  Without segment ids, an unmasked
    or causal one visits a range of key blocks that the kernel computes, reading no tile
    list (``MgpuConfig.index_tiles``); with them, the lists skip what the documents
    allow and the masks still come from indices."""
    if not config.index_tiles or tile not in (TILE_DENSE, TILE_ALIGNED):
        return None
    if tile == TILE_DENSE:
        if not mask.is_dense:
            return None  # not what the contract calls dense: the positions decide
        return "aligned" if has_seg else "dense"
    if Tq != Tk:
        return None  # not what the contract calls aligned: the positions decide
    if has_seg or mask.block_mask is not None:
        return "aligned"
    if mask.is_dense:
        return "dense"
    if mask.right_limit == 0 and mask.left_limit is None:
        return "causal"
    return "aligned"


def mgpu_fwd(q, k, v, q_pos, kv_pos, mask: MaskSpec, scale: float, q_seg=None, kv_seg=None,
             *, config: MgpuConfig, tile: str = TILE_GENERAL):
    """``(o [B, Tq, Hq, D] in q.dtype, lse float32 [B, Hq, Tq])``; see the module docstring.
    ``tile``: what the caller states of the tile (``base.TILE_*``); dense and aligned
    tiles take their masks, and without segment ids their key blocks, from indices."""
    B, Tq, Hq, D = q.shape
    Tk = k.shape[1]
    bq, bk = config.block_q, config.block_kv
    Lq, Lk = -(-Tq // (2 * bq)) * (2 * bq), -(-Tk // bk) * bk
    has_seg = q_seg is not None
    q_pos = _pad_to(jnp.broadcast_to(q_pos.astype(jnp.int32), (B, Tq)), 1, Lq, edge=True)
    kv_pos = _pad_to(kv_pos.astype(jnp.int32), 0, Lk, edge=True)
    masked = (mask.right_limit is not None or mask.left_limit is not None or has_seg
              or Tk % bk != 0)
    segs = (None, None)
    if has_seg:
        segs = (_pad_to(q_seg.astype(jnp.int32), 1, Lq, edge=True),
                _pad_to(kv_seg.astype(jnp.int32), 1, Lk, edge=True))
    index = index_kind(mask, tile, has_seg, Tq, Tk, config)
    tbl = order = None
    seg_kw = segment_lists_args(*segs, config.segment_skip)
    # mask classes need the ids in the lists (segment_skip); with ids there are lists
    classes = bool(seg_kw) and config.mask_classes_fwd
    if index not in ("dense", "causal"):
        tbl = tile_lists(mask, q_pos, kv_pos, Tk, 2 * bq, bk, has_seg, classes=classes,
                         **seg_kw)
        order = (doc_cta_order(tbl, classes=classes) if config.doc_order and has_seg
                 else cta_order(tbl))
    o, lse = _fwd_call(tbl, order, _pad_to(q, 1, Lq), _pad_to(k, 1, Lk),
                       _pad_to(v, 1, Lk), q_pos, kv_pos, *segs, mask=mask, scale=scale,
                       Tk=Tk, masked=masked, config=config, index=index, classes=classes)
    return o[:, :Tq], lse[..., :Tq]
