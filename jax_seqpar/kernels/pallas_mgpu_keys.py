"""The key-stationary backward kernels' skeleton (Hopper, Mosaic GPU): what the dK/dV
kernel (``pallas_mgpu_bwd._dkdv_call``) and the fused one (``pallas_mgpu_fused.
fused_call``) share.  One CTA per block of ``2 * block_kv_bwd`` keys, a consumer
warpgroup per ``block_kv_bwd`` of them holding dK and dV in registers, and a producer
warpgroup streaming Q, dO, lse and delta of the CTA's tile-list row through a ring
(FlashAttention-2 Alg. 2's outer loop over key blocks, warp-specialised as in
FlashAttention-3, Shah et al., 2024, §3.1).  ``kv_stationary_kernel`` is the kernel
around a consumer's step; the functions before it are its parts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_seqpar.kernels.pallas_mgpu_common import (F32, MgpuConfig, _plgpu,
                                                   compiler_params, on_producer_warps,
                                                   row_loops, traced)


def produce_q_ring(tbl_ref, b, blk, count, g, kvh, bq, stages, refs, smem, ready, free):
    """The producer of a key-stationary backward kernel (dK/dV, the fused one): for each
    of the ``g`` query heads of the GQA group and each of the CTA's ``count`` query
    blocks (the t-th is entry ``t`` of tile-list row ``blk``, a block index), the blocks
    of Q and dO and
    the rows of lse and delta into a ring of ``stages`` slots, each slot's Q (with lse and
    delta) and dO refilled once the consumers have freed it.  ``refs``, ``smem`` and
    ``ready``: (Q, dO, lse, delta) in global memory, their rings and "landed" barriers;
    ``free``: the (Q, dO) slots' "read" barriers."""
    import jax.experimental.pallas as pl
    from jax import lax
    plgpu = _plgpu()
    q_ref, do_ref, lse_ref, dl_ref = refs
    q_smem, do_smem, lse_smem, dl_smem = smem
    q_ready, do_ready, lse_ready, dl_ready = ready
    q_free, do_free = free

    @pl.loop(0, g * count)
    def _(j):
        slot = lax.rem(j, jnp.int32(stages))
        hh = lax.div(j, count)
        t = j - hh * count
        qh = kvh * g + hh
        start = tbl_ref[b, blk, t + 2] * bq
        rows = (b, pl.ds(start, bq), qh)

        @pl.when(j >= stages)
        def _():
            plgpu.barrier_wait(q_free.at[slot])
        plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], q_ready.at[slot])
        plgpu.copy_gmem_to_smem(lse_ref.at[b, qh, pl.ds(start, bq)],
                                lse_smem.at[slot], lse_ready.at[slot])
        plgpu.copy_gmem_to_smem(dl_ref.at[b, qh, pl.ds(start, bq)],
                                dl_smem.at[slot], dl_ready.at[slot])

        @pl.when(j >= stages)
        def _():
            plgpu.barrier_wait(do_free.at[slot])
        plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], do_ready.at[slot])


def kv_shapes(q, k, config: MgpuConfig, split: str | None = None):
    """``(D, g, dtype, bq, bk, stages)`` of a key-stationary kernel: the head dim, query
    heads per key/value head, the input dtype and the backward's blocks.  ``split``: the
    config field that splits dQ between the consumers (refused below D 128, where half
    of dQ's columns would be narrower than a 64-wide wgmma)."""
    D, g = q.shape[3], q.shape[2] // k.shape[2]
    if split is not None and D < 128:
        raise ValueError(f"MgpuConfig.{split} needs a head dim of 128 or more (half of "
                         f"dQ's columns per consumer is a 64-wide wgmma); got {D}")
    return (D, g, q.dtype, config.block_q_bwd, config.block_kv_bwd,
            config.num_stages_bwd)


def kv_stationary_scratch(bk: int, bq: int, D: int, stages: int, dtype):
    """Their shared memory and "landed" barriers: ``(smem, ready)``, the consumers' K and
    V blocks and the Q, dO, lse and delta rings; ``ready``: (K and V, Q, dO, lse,
    delta)."""
    plgpu = _plgpu()
    swz = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    smem = (plgpu.SMEM((2, bk, D), dtype, transforms=swz),
            plgpu.SMEM((2, bk, D), dtype, transforms=swz),
            plgpu.SMEM((stages, bq, D), dtype, transforms=swz),
            plgpu.SMEM((stages, bq, D), dtype, transforms=swz),
            plgpu.SMEM((stages, bq), F32),
            plgpu.SMEM((stages, bq), F32))
    ready = (plgpu.Barrier(num_arrivals=2, num_barriers=2),
             plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages))
    return smem, ready


def kv_cta(tbl_ref, order_ref, masked: bool):
    """Who this is: ``(b, kvh, blk, wg, count, n_full)``, the batch row, key/value head,
    key block (from the launch order), warpgroup, and the block's tile-list count and
    unmasked count (all of it unless ``masked``)."""
    from jax import lax
    b = lax.axis_index("batch")
    kvh = lax.axis_index("heads")
    blk = order_ref[b, lax.axis_index("kv_seq")]
    wg = lax.axis_index("wg")
    count = tbl_ref[b, blk, 0]
    n_full = tbl_ref[b, blk, 1] if masked else count
    return b, kvh, blk, wg, count, n_full


def start_consumer(k_ref, v_ref, k_smem, v_smem, kv_ready, b, first, bk: int, kvh, wg):
    """A consumer warpgroup's start: its registers raised, its own ``bk`` keys' K and V
    blocks (from the CTA's ``first`` key row on) into shared memory, waited for:
    ``(row0, kw, vw)``, the first key's row and the blocks' views."""
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    plgpu.set_max_registers(240, action="increase")
    row0 = first + wg * bk
    kw, vw = k_smem.at[wg], v_smem.at[wg]
    plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(row0, bk), kvh], kw, kv_ready.at[wg])
    plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(row0, bk), kvh], vw, kv_ready.at[wg])
    plgpu.barrier_wait(kv_ready.at[wg])
    return row0, kw, vw


def ds_ready_once_more(ds_ready, g, count) -> None:
    """With dQ split between the consumers, each one's last dQ product reads the other's
    K block: one more round of the dS barrier (which nobody else waits for) after the
    ``g * count`` steps (query heads of the group times tiles), before either overwrites
    its K block with dK."""
    import jax.experimental.pallas as pl
    from jax import lax
    plgpu = _plgpu()
    nxt = lax.rem(g * count, jnp.int32(2))

    @pl.when(count > 0)
    def _():
        plgpu.barrier_arrive(ds_ready.at[nxt])
        plgpu.barrier_wait(ds_ready.at[nxt])


def store_dkdv(kw, vw, dk, dv, scale: float, dtype, dk_ref, dv_ref, rows,
               read_only: bool = False) -> None:
    """A consumer's dK (times ``scale``) and dV in ``dtype`` through its K and V blocks to
    ``dk_ref[rows]`` and ``dv_ref[rows]``, written out before the CTA ends, or
    (``read_only``: ``MgpuConfig.early_exit``) read out of shared memory, the writes
    finishing after the CTA has ended (``cp.async.bulk.wait_group.read``, as CUTLASS's
    TMA-store epilogues end)."""
    plgpu = _plgpu()
    kw[...] = (dk * scale).astype(dtype)
    vw[...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(kw, dk_ref.at[rows])
    plgpu.copy_smem_to_gmem(vw, dv_ref.at[rows])
    plgpu.wait_smem_to_gmem(0, wait_read_only=read_only)


def reduce_add_dq(dqw, dq, dst) -> None:
    """A consumer's float32 dQ block (or half-block) ``dq`` added into global ``dst`` with
    a TMA reduce-add through its shared-memory block ``dqw``, once the previous step's
    reduce-add has read that block (FlashAttention-3's atomic dQ)."""
    plgpu = _plgpu()
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    dqw[...] = dq
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dqw, dst(), reduction_op="add")


def q_ring_producer(one_warp: bool, tbl_ref, b, blk, count, g, kvh, bq, stages, refs,
                    scoped) -> None:
    """The producer warpgroup: registers given back, then ``produce_q_ring`` from one warp
    or all four (``on_producer_warps``).  ``refs``: Q, dO, lse and delta in global
    memory; ``scoped``: the kernel's ``(smem, ready, free)`` as ``kv_stationary_scratch``
    orders them (the rings at 2-5, their barriers at 1-4, the two "read" barriers
    first)."""
    smem, ready, free = scoped
    _plgpu().set_max_registers(24, action="decrease")
    on_producer_warps(one_warp, lambda: produce_q_ring(
        tbl_ref, b, blk, count, g, kvh, bq, stages, refs, tuple(smem[2:6]),
        tuple(ready[1:5]), tuple(free[:2])))


def key_block_grads(tbl_ref, b, blk, n_full, count, g, has_seg: bool, classes: bool,
                    masked: bool, step, shape):
    """A consumer's dK and dV (``shape``, float32, from zero) after ``step(t, carry, hh=,
    mode=)`` over its tile-list row for each of the ``g`` query heads of the group."""
    import functools
    from jax import lax
    plgpu = _plgpu()

    def head(hh, carry):
        return row_loops(tbl_ref, b, blk, n_full, count, has_seg, classes, masked,
                         functools.partial(step, hh=hh), carry)
    zero = plgpu.layout_cast(jnp.full(shape, 0.0, F32), plgpu.Layout.WGMMA)
    return lax.fori_loop(0, g, head, (zero, zero))


def launch_kv_stationary(entry, args, q_seg, kv_seg, shape, dtype, bk: int, dq_acc=None):
    """Run ``entry`` over one CTA per (key/value head, tile-list row, batch row) with three
    warpgroups; ``args``: the ten leading operands (the tile lists first: a row per block
    of ``2 * bk`` keys), then the segment ids if given; ``shape``: ``(B, Lk, Hkv, D)`` of K, and of the dK and dV it returns in
    ``dtype``.
    ``dq_acc``: a float32 Ref the kernel adds dQ into (``pl.kernel`` on a Mosaic GPU mesh
    takes Ref operands; ``plgpu.kernel``'s batching wrapper does not)."""
    import jax.experimental.pallas as pl
    from jax_seqpar.runtime._compat import kernel_io
    plgpu = _plgpu()
    B, Lk, Hkv, D = shape
    args = list(args) + ([q_seg, kv_seg] if q_seg is not None else [])
    args, out_type = kernel_io(args, [(shape, dtype)] * 2)
    grid = dict(grid=(Hkv, args[0].shape[1], B), grid_names=("heads", "kv_seq", "batch"),
                num_threads=3, thread_name="wg")
    params = compiler_params()
    if dq_acc is None:
        return plgpu.kernel(entry, out_type=out_type, compiler_params=params, **grid)(*args)
    return pl.kernel(entry, out_type=out_type, mesh=plgpu.Mesh(**grid),
                     compiler_params=params)(*args, dq_acc)


def kv_stationary_kernel(make_step, args, q_seg, kv_seg, dq_acc, *, config: MgpuConfig,
                         scale: float, masked: bool, classes: bool, split: bool,
                         extra_smem=()):
    """The key-stationary backward kernel around a consumer's step (dK/dV, fused): each
    CTA's consumers load their K and V blocks (``start_consumer``), run ``step`` over
    their tile-list row for each query head of the group (``key_block_grads``), meet once
    more on the dS barrier if ``split`` (``ds_ready_once_more``) and store dK (times
    ``scale``) and dV (``store_dkdv``); the producer streams Q, dO, lse and delta
    (``q_ring_producer``).

    ``args``: ``(tbl, order, q, k, v, do, lse2, delta, q_pos, kv_pos)``; ``dq_acc``: the
    float32 Ref dQ is added into, or None.  ``make_step(refs, scoped, cta, row0, kw)`` is
    called in the consumer after its blocks have landed, with the kernel's refs ``(tbl,
    order, q, k, v, do, lse, delta, q_pos, kv_pos, q_seg, kv_seg, dq, dk, dv)`` (None for
    absent ids or dQ), its ``(smem, ready, free)`` (``kv_stationary_scratch``'s blocks,
    then ``extra_smem``; with ``split``, a third "free" barrier pair: dS stored), the
    CTA's ``kv_cta``, the consumer's first key row and its K block; it returns ``step(t,
    carry, hh, mode) -> (dk, dv)``."""
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    q, k = args[2], args[3]
    B, Lk, Hkv, D = k.shape
    g = q.shape[2] // Hkv
    dtype = q.dtype
    bq, bk, stages = config.block_q_bwd, config.block_kv_bwd, config.num_stages_bwd
    has_seg, with_dq = q_seg is not None, dq_acc is not None

    def kernel(refs, scoped):
        tbl_ref, order_ref, _, k_ref, v_ref = refs[:5]
        dk_ref, dv_ref = refs[-2:]
        smem, ready, free = scoped
        cta = b, kvh, blk, wg, count, n_full = kv_cta(tbl_ref, order_ref, masked)
        first = blk * (2 * bk)  # the CTA's first key row

        @pl.when(wg < 2)
        def _consumer():
            with jax.named_scope("load"):  # trace regions (pallas_mgpu_common.TRACE_ENV)
                row0, kw, vw = start_consumer(k_ref, v_ref, smem[0], smem[1], ready[0], b,
                                              first, bk, kvh, wg)
            step = traced("step")(make_step(refs, scoped, cta, row0, kw))
            with jax.named_scope("dkdv_rows"):
                dk, dv = key_block_grads(tbl_ref, b, blk, n_full, count, g, has_seg,
                                         classes, masked, step, (bk, D))
            with jax.named_scope("out"):
                if split:
                    ds_ready_once_more(free[2], g, count)
                store_dkdv(kw, vw, dk, dv, scale, dtype, dk_ref, dv_ref,
                           (b, pl.ds(row0, bk), kvh), read_only=config.early_exit)

        @pl.when(wg == 2)
        def _producer():
            q_ring_producer(config.warp_producer_bwd, tbl_ref, b, blk, count, g, kvh, bq,
                            stages, (refs[2], refs[5], refs[6], refs[7]), scoped)

    n_in = 10 + 2 * has_seg

    def entry(*refs):
        ins = refs[:n_in] if has_seg else refs[:n_in] + (None, None)
        dq_ref = refs[n_in] if with_dq else None
        smem, ready = kv_stationary_scratch(bk, bq, D, stages, dtype)
        frees = (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2
        if split:  # dS stored
            frees += (plgpu.Barrier(num_arrivals=2, num_barriers=2),)
        pl.run_scoped(lambda sm, rd, fr: kernel((*ins, dq_ref, *refs[-2:]), (sm, rd, fr)),
                      smem + tuple(extra_smem), ready, frees, collective_axes="wg")

    return launch_kv_stationary(entry, args, q_seg, kv_seg, (B, Lk, Hkv, D), dtype, bk,
                                dq_acc)
