"""The fused backward's dQ without a zeroed buffer (``MgpuConfig.dq_first_store``).

The atomic-dQ backward (FlashAttention-3's, Shah et al., 2024, §3.3) adds every CTA's
``dS K`` blocks into a float32 dQ with TMA reduce-adds, so XLA zeroes that dQ first: on
the bar's packed call at 64k tokens (one H200, 16 heads of 128) a 0.16 ms pass over 512
MiB, 1.4% of the call.  Here the first CTA to reach a query block stores its block
there, and the others add theirs once that store has landed, into a dQ that nobody
zeroed:

* Tickets.  As the producer fills the ring slot of step ``j`` (query block ``i`` of
  query head ``h``), one of its threads adds 1 to ``arrivals[b, i, h]`` in global memory
  (``atom.add``, PTX ISA "atom", returning the old value), stores the old value in the
  slot's word in shared memory and arrives on the slot's barrier (``take_ticket``).
* Writes.  Each consumer writes its half of the block's columns (``split_dq``): with a
  plain TMA store if the slot's word is 0, the CTA being first; otherwise it waits until
  ``stored[b, i, h]`` is 2, both halves of the first CTA landed (``ld`` in a loop, then
  an acquire fence and a proxy fence between the generic and the async proxy, whose TMA
  reduce-add comes next), and adds (``write``).
* Releases.  A consumer that stored first waits for that store to land
  (``cp.async.bulk.wait_group`` without ``.read``) and adds 1 to ``stored`` with release
  semantics, after a proxy fence: at the consumers' meeting of its next step, which
  comes before that step's write, or at the CTA's end (``release``).

No cycle of waits: a CTA waits only at a write where it was not first, for the CTA
whose ticket for that block is older.  A producer takes its tickets in step order, each
once the one before has returned (it stores the old value first), so that CTA's tickets
for all steps up to the block's are older too, and a CTA that is stuck sits at a step
no later than that block's; following waits from CTA to CTA the tickets at which they
are stuck decrease strictly, which no cycle can.  A CTA that was first does not wait at
that step, and it releases in the next step before it could wait there; the CTAs it
waits for hold tickets, so they are resident and running.

Query blocks that no CTA reaches (rows that see no key) keep whatever the buffer held:
``arrivals`` says which ones they are, and the caller selects 0 there
(``pallas_mgpu_bwd.mgpu_bwd``).  FlashAttention-3's deterministic backward orders every
writer of a block this way (a semaphore per block); here only the first one is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_seqpar.kernels.pallas_mgpu_common import _plgpu

#: What the consumers wait for before adding: both halves (one per consumer) stored.
HALVES = 2


def counters(B: int, n_blocks: int, Hq: int):
    """The zeroed counters of one call, ``int32 [2 * B * n_blocks * Hq]``: ``arrivals``
    then ``stored``, each flat over ``(b, query block, query head)``, as a Ref the kernel
    takes (``jax.new_ref``)."""
    return jax.new_ref(jnp.zeros((2 * B * n_blocks * Hq,), jnp.int32))


def flat_index(b, block, h, n_blocks: int, Hq: int):
    """Where ``(b, block, h)`` sits in ``arrivals``; ``stored``'s entry is ``B * n_blocks
    * Hq`` further (``stored_offset``)."""
    return (b * n_blocks + block) * Hq + h


def stored_offset(B: int, n_blocks: int, Hq: int) -> int:
    return B * n_blocks * Hq


def reached(ctr, B: int, n_blocks: int, Hq: int):
    """``bool [B, n_blocks, Hq]``: the query blocks some CTA wrote (any arrival)."""
    return ctr[:B * n_blocks * Hq].reshape(B, n_blocks, Hq) > 0


def scratch(stages: int):
    """``(words, word_ready, pending)``: a ticket word per ring slot, the slot's barrier
    that publishes it, and per consumer the flat index of a stored block whose release is
    due (``-1``: none)."""
    plgpu = _plgpu()
    return (plgpu.SMEM((stages,), jnp.int32),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
            plgpu.SMEM((2,), jnp.int32))


def take_ticket(ctr_ref, idx, words, word_ready, slot, one_warp: bool) -> None:
    """(The producer, once slot ``slot``'s loads are issued.)  Add 1 to
    ``arrivals[idx]``, store the old value in ``words[slot]`` and arrive on
    ``word_ready[slot]``.  The store waits for the atomic's value, so this producer's
    tickets return in order (the argument for no cycle of waits)."""
    import jax.experimental.pallas as pl
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    plgpu = _plgpu()
    scope = mgpu_utils.ThreadSubset.WARP if one_warp else mgpu_utils.ThreadSubset.WARPGROUP

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
    def emit(_ctx, counter, word):
        i32 = ir.IntegerType.get_signless(32)
        with mgpu_utils.single_thread(scope=scope):
            old = mgpu_utils.inline_ptx("atom.relaxed.gpu.global.add.u32 $0, [$1], 1;",
                                        mgpu_utils.memref_ptr(counter), result_types=i32,
                                        has_side_effects=True)
            memref.store(old, word, [arith.constant(ir.IndexType.get(), 0)])
        mgpu_utils.inline_ptx("bar.warp.sync -1;", has_side_effects=True)

    emit(ctr_ref.at[pl.ds(idx, 1)], words.at[pl.ds(slot, 1)])
    plgpu.barrier_arrive(word_ready.at[slot])


def is_first(words, word_ready, slot):
    """(A consumer.)  Whether its CTA took the first ticket of this step's block."""
    _plgpu().barrier_wait(word_ready.at[slot])
    return words[slot] == 0


def _wait_stored(stored_ref) -> None:
    """Wait until ``stored_ref`` (one word in global memory) reaches ``HALVES``: one
    thread loads it in a loop, then an acquire fence (Mosaic GPU's semaphore wait) and a
    fence between the generic and the async proxy, so that the TMA reduce-add this thread
    issues next sees the first store."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    plgpu = _plgpu()

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def emit(_ctx, word):
        mgpu_utils.SemaphoreRef(mgpu_utils.memref_ptr(word)).wait(
            HALVES, decrement=False, memory_scope="gpu")
        mgpu_utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)

    emit(stored_ref)


def _signal_stored(stored_ref) -> None:
    """Add 1 to ``stored_ref`` with release semantics, after a proxy fence (the store it
    announces was written by the async proxy)."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    plgpu = _plgpu()

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def emit(_ctx, word):
        mgpu_utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)
        mgpu_utils.SemaphoreRef(mgpu_utils.memref_ptr(word)).signal(1, memory_scope="gpu")

    emit(stored_ref)


def write(dqw, dq, dst, first, ctr_ref, idx, offset: int, pending, wg) -> None:
    """A consumer's float32 half-block ``dq`` into global ``dst()`` through its shared
    block ``dqw`` (once the previous write has read it): stored if ``first`` (and its
    release made due), else added once the first CTA's halves have landed."""
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    dqw[...] = dq
    plgpu.commit_smem()

    @pl.when(first)
    def _():
        plgpu.copy_smem_to_gmem(dqw, dst())
        pending[wg] = idx

    @pl.when(jnp.logical_not(first))
    def _():
        _wait_stored(ctr_ref.at[pl.ds(offset + idx, 1)])
        plgpu.copy_smem_to_gmem(dqw, dst(), reduction_op="add")


def release(ctr_ref, offset: int, pending, wg) -> None:
    """If a store of this consumer awaits its release: wait for it to land, announce it
    in ``stored``, and clear ``pending``."""
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    idx = pending[wg]

    @pl.when(idx >= 0)
    def _():
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)
        _signal_stored(ctr_ref.at[pl.ds(offset + idx, 1)])
        pending[wg] = jnp.int32(-1)
