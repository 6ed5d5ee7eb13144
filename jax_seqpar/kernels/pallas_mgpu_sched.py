"""A dynamic tile scheduler for persistent Hopper (Mosaic GPU) kernels.

A persistent kernel launches one CTA per streaming multiprocessor; each CTA serves
items (launch slots of the per-item kernel's grid) in turn.  With a static assignment
(item ``w * n_sm + sm``, or a serpentine) CTAs with longer items fall behind, so the
items running at one moment spread over the launch order.  Here the items go out in
launch order as CTAs ask for them, from one counter in global memory, as the tile
scheduler of FlashAttention-3 does for its persistent kernels (Shah et al., 2024, §3.1;
its ``DynamicPersistentTileScheduler``): CTA ``sm`` starts with item ``sm`` and then takes
``n_sm + atom.add(counter, 1)``.  (On packed documents the persistent forward is as slow
with this order as with the static one: RESULTS.md, "A dynamic tile scheduler for a
persistent forward".)

One thread of the producer takes each ticket (``take_ticket``: a fetch-and-add through
inline PTX, since Mosaic GPU's ``atomic_add`` returns nothing in JAX 0.11.2) one item
ahead, stores it in a ring of ``TICKET_SLOTS`` shared-memory words and arrives on that
slot's barrier; the two consumer warpgroups wait on it, read the word and free the slot.
An item at or past ``n_items`` ends every loop of the CTA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_seqpar.kernels.pallas_mgpu_common import _plgpu

#: Tickets a CTA holds at once: the producer runs at most this many items ahead of the
#: consumers' reads.
TICKET_SLOTS = 4
#: Streaming multiprocessors of an H100 / H200 SXM (the persistent CTAs when no GPU can
#: be asked: CPU lowering tests).
HOPPER_SMS = 132


def sm_count() -> int:
    """The first GPU's streaming multiprocessors, or ``HOPPER_SMS`` without a GPU."""
    try:
        return int(jax.devices("gpu")[0].core_count)
    except (RuntimeError, AttributeError):
        return HOPPER_SMS


def new_counter():
    """The counter the CTAs take tickets from: a zeroed int32 in global memory, one per
    call (a ``jax.new_ref``, which ``pl.kernel`` takes as an operand it may write)."""
    return jax.new_ref(jnp.zeros((1,), jnp.int32))


def item_index(item, nq: int, Hq: int, div=lambda a, b: a // b, rem=lambda a, b: a % b):
    """``(b, j, h)`` of flat ``item`` of the grid ``(Hq, nq, B)``, heads fastest, as the
    hardware launches the per-item kernel's grid: so items taken in order run the launch
    slots in their most-tiles-first order, the heads of one query block together.
    ``div`` / ``rem``: integer division and remainder (``lax`` in a kernel)."""
    return div(item, nq * Hq), rem(div(item, Hq), nq), rem(item, Hq)


def ticket_slot(w):
    """The ring slot of the ticket taken during a CTA's ``w``-th item (its ``w + 1``-th)."""
    return jax.lax.rem(w, jnp.int32(TICKET_SLOTS))


def scratch():
    """``(tickets, ready, free)``: the ticket ring in shared memory, a barrier per slot
    that the producer's thread arrives on once its ticket is stored, and one that both
    consumers arrive on once they have read it."""
    plgpu = _plgpu()
    return (plgpu.SMEM((TICKET_SLOTS,), jnp.int32),
            plgpu.Barrier(num_arrivals=1, num_barriers=TICKET_SLOTS),
            plgpu.Barrier(num_arrivals=2, num_barriers=TICKET_SLOTS))


def take_ticket(counter_ref, slot_ref, one_warp: bool) -> None:
    """One thread of the calling warpgroup (``one_warp``: warp) adds 1 to the counter in
    global memory (``atom.add.u32``: PTX ISA, "atom") and stores the value it held into
    ``slot_ref``, a one-word shared-memory ref; then the warp syncs (``bar.warp.sync``),
    so that the write is ordered before the barrier arrival that publishes it, whichever
    of the warp's threads arrives."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    plgpu = _plgpu()
    scope = mgpu_utils.ThreadSubset.WARP if one_warp else mgpu_utils.ThreadSubset.WARPGROUP

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
    def emit(_ctx, counter, slot):
        i32 = ir.IntegerType.get_signless(32)
        with mgpu_utils.single_thread(scope=scope):
            held = mgpu_utils.inline_ptx("atom.add.u32 $0, [$1], 1;",
                                         mgpu_utils.memref_ptr(counter), result_types=i32,
                                         has_side_effects=True)
            memref.store(held, slot, [arith.constant(ir.IndexType.get(), 0)])
        mgpu_utils.inline_ptx("bar.warp.sync -1;", has_side_effects=True)

    emit(counter_ref, slot_ref)


def hand_out(w, n_sm: int, counter_ref, sched, one_warp: bool):
    """(The producer, during its ``w``-th item.)  Take the next ticket, publish it to the
    consumers, and return the item it names: ``n_sm`` plus the counter's old value.  The
    slot is reused only once both consumers have read its previous ticket."""
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    tickets, ready, free = sched
    s = ticket_slot(w)
    pl.when(w >= TICKET_SLOTS)(lambda: plgpu.barrier_wait(free.at[s]))
    take_ticket(counter_ref, tickets.at[pl.ds(s, 1)], one_warp)
    plgpu.barrier_arrive(ready.at[s])
    plgpu.barrier_wait(ready.at[s])  # the stored word, seen by every thread here
    return tickets[s] + jnp.int32(n_sm)


def receive(w, n_sm: int, sched):
    """(A consumer, at the start of its ``w``-th item.)  The item after it: wait for the
    producer's ticket, read it, and free its slot."""
    plgpu = _plgpu()
    tickets, ready, free = sched
    s = ticket_slot(w)
    plgpu.barrier_wait(ready.at[s])
    item = tickets[s] + jnp.int32(n_sm)
    plgpu.barrier_arrive(free.at[s])
    return item
