"""What the Hopper (Mosaic GPU) kernels share: configurations, shared-memory budgets,
the launch order, small loads and the Mosaic GPU import.

``pallas_mgpu_fwd.py`` (forward) and ``pallas_mgpu_bwd.py`` (backward) import from here, so
neither imports the other's module at load time; ``pallas_mgpu.py`` (the backend) imports
all three.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp

from jax_seqpar.runtime import _compat

F32 = jnp.float32
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
HEAD_DIMS = (64, 128, 256)
DTYPES = ("bfloat16", "float16")
#: Shared memory a CTA may use on Hopper (227 KiB), less what Mosaic GPU reserves for
#: barriers and its reduction scratch.
SMEM_LIMIT = 227 * 1024 - 2048


BOOL_FIELDS = ("atomic_dq", "split_dq", "segment_skip", "overlap_bwd", "index_tiles",
               "named_sched", "named_free", "dv_with_dp", "warp_producer", "warp_producer_bwd",
               "mask_classes", "mask_classes_fwd", "row_scores", "overlap_fwd", "doc_order",
               "early_dq", "early_exit", "doc_order_bwd", "tma_zero_dq")


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Tiles of the Mosaic GPU kernels.

    ``block_q``: query rows per consumer warpgroup (a CTA holds ``2 * block_q``);
    ``block_kv``: keys per pipeline stage; ``num_stages``: depth of the K/V ring.
    ``*_bwd``: the same for the backward's dK/dV kernel (``block_kv_bwd`` keys per
    consumer, query blocks of ``block_q_bwd`` streamed); ``block_kv_dq``: keys per stage
    of the dQ kernel (whose consumers hold ``block_q_bwd`` queries each).
    ``atomic_dq``: accumulate dQ inside the dK/dV kernel (as FlashAttention-3's backward
    does: each consumer adds its ``dS K`` block into a float32 dQ in global memory with a TMA
    reduce-add) instead of a second kernel that recomputes ``P`` and ``dP``; ``split_dq``
    (with ``atomic_dq``, head dims of 128 and more): the two consumers share dS and each
    computes half of dQ's columns.  ``segment_skip``: with segment ids, the tile lists
    drop the tiles whose blocks share no document and list the tiles inside one document
    as fully visible (mask-free loop): ``pallas_common.tile_lists``; the kernels are the
    same either way.  False restores the lists of before (every position-visible tile,
    segments masked in each), a fallback should the skipping misbehave on a GPU.
    ``overlap_bwd`` (the two-kernel backward): each consumer issues its two score-sized
    products (``S`` and ``dP``) back to back and waits for the first alone, so the
    exponentials of ``P`` run while ``dP`` is still on the tensor cores, and (dK/dV) the
    ``dV`` product runs while ``dS`` is formed -- FlashAttention-3's overlap within one
    warpgroup (Shah et al., 2024, §3.2), by ``wgmma_accumulator_load(wait_n=1)``.  The
    atomic-dQ kernel ignores it (the same overlap there, with dQ's accumulator beside dK's
    and dV's, was 3-13% slower: RESULTS.md).  ``dv_with_dp`` (dK/dV kernel of the
    two-kernel backward, in place of ``overlap_bwd``'s pairing there): ``S^T`` alone,
    then ``dP^T`` and ``dV`` issued together and ``dP^T`` waited for alone, so ``dS`` is
    formed while ``dV`` runs, and the ring's dO slot freed once ``dV`` is done, before
    ``dK`` is -- the order of FlashAttention-3's and tokamax's dK/dV step (S and dP are
    never in flight together, so two score-sized accumulators at most are live); the
    atomic-dQ kernel ignores it too.  ``index_tiles`` (forward): on tiles the
    caller states dense or aligned (``base.TILE_DENSE`` / ``TILE_ALIGNED``) the masks come
    from row and column indices, and without segment ids the visited key blocks too (all
    of them, or those up to the diagonal), so the kernel reads neither positions nor tile
    lists there, as FlashAttention-3's and tokamax's kernels do; False reads them on
    every tile (the comparison in RESULTS.md).  ``named_sched`` (forward): the consumers'
    ping-pong on two hardware named barriers, FA3's schedule (Shah et al., 2024, §3.1,
    Fig. 1): a consumer that has issued its ``S = Q K^T`` lets the other one start its
    ``P V`` (``bar.arrive``) and runs its softmax without waiting, then waits for its own
    turn (``bar.sync``) before its ``P V``; False meets on one shared-memory barrier twice
    a step, so that neither consumer starts its softmax before the other has finished its
    own.  ``named_free`` (forward): the consumers tell the producer that a ring slot's K
    or V has been read with ``bar.arrive`` on a named barrier per slot, which the
    producer ``bar.sync``s on before refilling it (as tokamax's sm90 forward does),
    instead of arriving on a shared-memory barrier.  (The same in the backward's two
    kernels measured no gain, 0 to -1.8%: RESULTS.md; they keep their barriers.)  Both
    named-barrier fields need Mosaic GPU's inline PTX (JAX >= 0.11); older JAX takes the
    shared-memory barriers.  ``warp_producer`` (forward): one warp of the producer
    warpgroup issues the K/V loads and the other three end at once (``plgpu.warp_map``),
    as in tokamax's sm90 forward, so three fewer warps sit in the scheduler waiting on
    the ring's barriers; with ``named_free`` the slot barriers then count 2 x 128 + 32
    threads.  ``warp_producer_bwd``: the same in the backward's kernels (their
    producers wait on shared-memory barriers, whose counts do not change); checked on
    the GPU and timed in three runs on one H100, where it moved forward + backward by
    -0.6 to +2.3 points of cuDNN's rate on the device clock and -3.0 to +2.1 on the wall
    clock, inside the runs' noise (RESULTS.md), so off by default.  ``mask_classes``
    (the backward's dQ kernel, with segment ids and ``segment_skip``): its tile lists
    sort the partially visible tiles by ``pallas_common.MASK_CLASSES`` and each class runs
    in a loop of its own with only the mask code it needs: no position test where the
    positions prove every pair visible, and, where the key block lies in one document,
    the segment test folded into the query's lse (``+inf`` where the query's id differs,
    so P = 0 there) instead of a comparison per score.  On one H100, packed documents
    (log-normal around 4k at 64k tokens) ran the dQ kernel 4.6-5.4% faster with it (three
    runs): its masks cost it 4% of its time instead of 9%.  The same in the
    two-kernel dK/dV kernel (``mask_classes_dkdv``, taken out after 90c72e3, where its
    code is) read 2-4% slower, and 2.3-4.5% slower in two runs more (RESULTS.md).
    ``mask_classes_fwd``: the same in the forward, where a folded segment test drops the
    other document's rows from the tile's online softmax (``softmax_update``'s
    ``row_ok``) instead of testing each score; on one H100 the forward on the bar's
    documents ran 1.6-4.4% faster with it (four runs), level on equal documents.
    ``row_scores`` (with ``atomic_dq`` and ``split_dq``): the fused backward computes
    ``S = Q K^T`` with queries as rows, passing ``P`` and ``dS`` to the dV and dK
    products through shared memory (``pallas_mgpu_fused``), FlashAttention-3's layout for
    D 128 with a causal mask, instead of ``S^T`` with lse and delta as column vectors.
    On one H100 it ran level with the two kernels (forward + backward -0.8 to +2.6
    points of cuDNN's rate at 16k and 64k; packed documents 77.4% and 82.9% against
    79.7% and 83.0%): its kernel is 1-4% faster than the two backward kernels together,
    and the zeroed float32 dQ and the pass over it give that back, so off in the
    defaults.  On one H200 (2026-12-02) the tuner ranked it first in all three D 128
    classes, with ``early_dq``: 4.97 against 5.30 ms (causal, 16k) and 9.82 against
    10.38 (dense) on the device's clock, 8.46 against 9.11 on packed documents back to
    back at the power cap; the H200's table takes it there (RESULTS.md).
    The fused kernel of ``row_scores`` indexes a consumer's own blocks in each step
    (``step_index``), so that their wgmma descriptors are formed in the step instead of
    hoisted out of the loop and spilled (its spills fell from 1080 to 124 bytes and its
    time by about a quarter: RESULTS.md).  The same in the two-kernel backward
    (``step_descriptors``, taken out after 90c72e3, where its code is) took their spills
    from 48 and 56 bytes to 8 and none, but the dK/dV kernel read 3.9% slower on one H100.
    ``overlap_fwd`` (the forward, with ``named_sched``): FlashAttention-3's overlap within
    one warpgroup (Shah et al., 2024, §3.2, Alg. 2 "intra-warpgroup overlapping"): each
    step issues the next tile's ``S = Q K^T`` and the previous tile's ``O += P V``
    together and waits for ``S`` alone (``wgmma_accumulator_load(wait_n=1)``), so a
    consumer's softmax runs while its own ``P V`` is still on the tensor cores, beside
    the ping-pong that lets the other consumer's products run then too; ``O`` is rescaled
    once its ``P V`` is done, as FA3 does at head dims up to 128 (an instruction that
    writes an operand of a product in flight makes ptxas serialize the products: C7513).
    The first tile's scores and the last tile's ``P V`` run outside the loop.  Without
    named barriers (older JAX) the forward runs unpipelined.  On one H200 (2026-11-28)
    the tuner picked it for D 128 causal tiles (0.6% faster at 16k; 0.8-2.4% on the
    device clock in three same-run runs at 16k and 64k), not for dense ones (1.6% slower
    in the tuner, 0.0-2.1% faster in those runs), and packed documents, whose class is
    not in the table, keep the unpipelined forward (3.6% slower there): RESULTS.md.
    ``persistent`` (taken out after 68a1b69, where its code and its dynamic tile
    scheduler, ``pallas_mgpu_sched``, are): one CTA per streaming multiprocessor serving
    items handed out in launch order by a counter in global memory.  On one H200 it gave
    the per-item kernel's bits and was level or up to 5% faster on sixteen 4k rows but
    22-24% slower on packed documents (register pressure from values hoisted out of the
    item loop; RESULTS.md, "A dynamic tile scheduler for a persistent forward").
    ``doc_order`` (the forward and the dQ kernel, with segment ids): the query blocks
    launch document by document (``doc_cta_order``: longest document first, each one's
    blocks most tiles first) instead of sorted by tile count across all documents, so
    the CTAs running at once read fewer documents' keys and values.  On one H200, packed
    documents around 4k at 64k tokens, three runs: the forward 0.9-1.7% and the dQ
    kernel 2.4-3.9% faster, the whole call 1.0-1.9 points of cuDNN's rate higher in
    ``packed_batch.py``'s rounds (``packed.py``'s read of the bar moved less than its
    spread between runs), the same bits.  The dK/dV kernel keeps the order by tile
    count: grouped by document (from the segment ids) it read 0.5% and 2.5% slower in
    two runs.
    ``early_dq`` (the fused kernel of ``row_scores``): a step issues its dQ half before
    its ``dK`` product and waits for the dQ products alone, so the dQ half's reduce-add
    (its store to shared memory and the TMA) runs while ``dK`` is on the tensor cores.
    On one H200 (packed documents at 64k, the same run) the fused kernel took 8.497 ms
    against 8.826 without it (-3.7%), its median step 4,348 cycles against 4,434 the day
    before.  Issuing the next tile's ``S`` (or ``S`` and the last tile's dQ half) with
    the last tile's products was correct but ptxas spilled 640-816 bytes a thread and
    the kernel ran 30-38% slower; a consumer holds dK and dV throughout (128 of its 240
    registers at D 128), and a product in flight across the softmax pins its
    accumulator's registers too (RESULTS.md).
    ``early_exit`` (the key-stationary backward kernels): a CTA ends once its dK and dV
    blocks have been read out of shared memory (``cp.async.bulk.wait_group.read``), not
    once their writes and its last dQ reduce-adds have landed, as CUTLASS's TMA-store
    epilogues end; the next CTA on the SM starts that much sooner.  On one H200
    (2026-12-03, nine paired runs of the bar's script, packed documents at 64k) it read
    77.7% of cuDNN's rate against 76.6% on the wall clock and 84.5 against 84.0% back to
    back (medians), level on the device clock (82.8 against 82.9%).  Prefetching into L2
    what the CTA one SM count later loads first read 3-3.5 points slower on the device
    and wall clocks and was taken out (RESULTS.md).
    ``doc_order_bwd`` (the key-stationary backward kernels, with segment ids): their
    CTAs launch document by document (``doc_cta_order(last=True)``: a key block's
    document is the last query block it sees) instead of most tiles first across all
    documents, so that the CTAs running at once add their dQ into one document's rows,
    which stay in L2, rather than into many documents' (the fused kernel's float32 dQ
    of a 4k document, 16 heads of 128, is 32 MiB).  On one H200 (2026-12-03, the fused
    kernel, packed documents at 64k, three paired runs) +0.9 to +1.5 points of cuDNN's
    rate on the device clock and +0.6 to +0.9 back to back (on single calls timed on
    the wall clock -0.2 to -2.3, inside that clock's spread); the H200's D 128 segments
    entry takes it.  The two-kernel dK/dV kernel, grouped by document from the segment
    ids, read 0.5-2.5% slower on 2026-11-28; it was not measured with this order.
    ``doc_blocks_bwd`` (taken out after 379e81a, where its code is): the
    fused kernel's blocks laid from each long document's first token, so that no tile
    holds two documents.  Correct, but slower on one H200: 1.6% fewer tiles on the bar's
    packed documents at 64k, and the kernel took 8.92 ms against 8.62 (ptxas spills 284
    bytes a thread against 132: the tests of the rows a block owns; RESULTS.md, "The
    fused backward's blocks laid per document").
    ``tma_zero_dq`` (the atomic-dQ kernels; on): the float32 dQ they add into is zeroed
    by a Mosaic GPU kernel of TMA stores from one zeroed shared-memory block per CTA
    (``pallas_mgpu_bwd.tma_zeros``) instead of by XLA's broadcast kernel (``zeroed_dq``).
    On one H200 (2026-12-03) the bar's 512 MiB took 0.126 ms against 0.159 (4.26 against
    3.38 TB/s), 0.033 against 0.041 ms at 16k (``benchmarks/zeros_gpu.py``, which also
    checks every element); the whole packed call read level (RESULTS.md, "dQ zeroed by
    TMA stores").
    """

    block_q: int = 64
    block_kv: int = 128
    num_stages: int = 2
    block_q_bwd: int = 64
    block_kv_bwd: int = 64
    num_stages_bwd: int = 2
    block_kv_dq: int = 64
    atomic_dq: bool = False
    split_dq: bool = False
    segment_skip: bool = True
    overlap_bwd: bool = False
    index_tiles: bool = True
    named_sched: bool = True
    named_free: bool = True
    dv_with_dp: bool = False
    warp_producer: bool = False
    warp_producer_bwd: bool = False
    mask_classes: bool = True
    mask_classes_fwd: bool = True
    row_scores: bool = False
    overlap_fwd: bool = False
    doc_order: bool = True
    early_dq: bool = True
    early_exit: bool = True
    doc_order_bwd: bool = False
    tma_zero_dq: bool = True

    def __post_init__(self):
        for name in BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MgpuConfig.{name}={getattr(self, name)!r} must be a bool")
        if self.split_dq and not self.atomic_dq:
            raise ValueError("MgpuConfig.split_dq=True needs atomic_dq=True (it splits the "
                             "atomic dQ product between the consumers)")
        if self.row_scores and not self.split_dq:
            raise ValueError("MgpuConfig.row_scores=True needs atomic_dq=True and "
                             "split_dq=True (it is a layout of the fused, split backward)")
        for f in dataclasses.fields(self):
            if f.name in BOOL_FIELDS:
                continue
            val = getattr(self, f.name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"MgpuConfig.{f.name}={val!r} must be a positive int")
        for name in ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd", "block_kv_dq"):
            if getattr(self, name) % 64:
                raise ValueError(f"MgpuConfig.{name}={getattr(self, name)} must be a "
                                 f"multiple of 64 (wgmma tiles)")
        for name in ("num_stages", "num_stages_bwd"):
            if getattr(self, name) < 2:
                raise ValueError(f"MgpuConfig.{name}={getattr(self, name)} must be >= 2 "
                                 f"(a single stage cannot overlap loads and compute)")


#: Per-head-dim defaults.  Backward sweep on one H200 at S = 16k (results/
#: mgpu_bwd_sweep16k_h200.json, timed in rotation): dQ stages of 128 keys beat 64 by
#: 1-3%, a third backward stage lost 4-8%.  ``atomic_dq`` (results/mgpu_atomic_dq*_h200
#: .json and mgpu_split_dq_pair_h200.json, fwd+bwd at 16k in rotation with cuDNN): at
#: D = 64 it lifts the backward from 0.82-0.89x cuDNN to 0.96-1.00x; at D = 128 it loses
#: (0.69-0.80x against the two kernels' 0.88-0.96x), and ``split_dq`` recovers most but
#: not all of it (0.85 / 0.92x against 0.88 / 0.95x in one run), so D = 128 keeps the two
#: kernels, with ``overlap_bwd`` (results/kernels_ovl_pair2_h200.log, on the device's
#: clock at 16k: fwd+bwd 0.906x cuDNN against 0.887 / 0.903x without, causal 0.964x
#: against 0.915 / 0.928x; packed 64k and 16k 1-2% faster in all six comparisons,
#: gradients bit-identical; at D = 64 it does not beat the atomic dQ).  ``dv_with_dp``
#: (results/hopper_tiles/2026-11-25b/): the dK/dV kernel 8% faster at 64k (105.5 against
#: 114.5 ms, device clock), fwd+bwd ahead of tokamax's at 16k and 64k (RESULTS.md).
#: ``warp_producer`` at D = 128 (results/hopper_tiles/2026-11-27/pair_wp*, one H100, three
#: runs): the forward ahead of or level with the warpgroup producer in 9 of 12 cells on
#: the device clock (+0.6 points of cuDNN's rate on average) and 11 of 12 on the wall
#: clock (+2.4); at D = 64 one run was mixed (-2.9 to +4.1), so D = 64 keeps the
#: warpgroup.  D = 256 runs the Triton backward (the Mosaic GPU one does not fit shared
#: memory), so its backward fields are unused.
DEFAULT_MGPU_CONFIGS = {
    64: MgpuConfig(block_q=64, block_kv=128, num_stages=4, block_kv_dq=128, atomic_dq=True),
    128: MgpuConfig(block_q=64, block_kv=128, num_stages=2, block_kv_dq=128,
                    overlap_bwd=True, dv_with_dp=True, warp_producer=True),
    256: MgpuConfig(block_q=64, block_kv=64, num_stages=2),
}


#: What the forward kernel holds beyond its blocks (barriers, the tile-index scratch):
#: Mosaic GPU reported 2648 and 2680 bytes more than the blocks for two D 128 tilings on
#: an H200 (JAX 0.11.2, 2026-11-25: 232,536 and 232,568 bytes against its 232,448 limit).
FWD_SMEM_EXTRA = 3 * 1024


def forward_smem_bytes(config: MgpuConfig, head_dim: int, dtype) -> int:
    """Shared memory of one forward CTA: two query/output blocks, the K and V rings, the
    two lse rows and ``FWD_SMEM_EXTRA``."""
    item = jnp.dtype(dtype).itemsize
    q_o = 2 * config.block_q * head_dim * item
    kv = 2 * config.num_stages * config.block_kv * head_dim * item
    return q_o + kv + 2 * config.block_q * 4 + FWD_SMEM_EXTRA


def backward_smem_bytes(config: MgpuConfig, head_dim: int, dtype) -> int:
    """Shared memory of the larger backward CTA: dK/dV (the K and V of its two consumers,
    the Q, dO, lse and delta rings; with ``atomic_dq`` also each consumer's dS tile and
    float32 dQ block; with ``row_scores`` also its P) or dQ (two Q and dO blocks, the K
    and V rings)."""
    item = jnp.dtype(dtype).itemsize
    kv = 2 * 2 * config.block_kv_bwd * head_dim * item
    ring = config.num_stages_bwd * config.block_q_bwd * (2 * head_dim * item + 8)
    if config.atomic_dq:
        ds_dq = 2 * config.block_q_bwd * (config.block_kv_bwd * item + head_dim * 4)
        if config.split_dq:  # dS^T of both consumers, double-buffered; dQ half-blocks
            ds_dq = 2 * 2 * config.block_kv_bwd * config.block_q_bwd * item \
                + 2 * config.block_q_bwd * head_dim // 2 * 4
        if config.row_scores:  # and each consumer's P
            ds_dq += 2 * config.block_kv_bwd * config.block_q_bwd * item
        return kv + ring + ds_dq
    dq = (2 * 2 * config.block_q_bwd + 2 * config.num_stages_bwd * config.block_kv_dq) \
        * head_dim * item
    return max(kv + ring, dq)


def _plgpu():
    """``jax.experimental.pallas.mosaic_gpu``, imported when a kernel is built."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu


#: Set to a directory, every Hopper kernel built afterwards records its named regions
#: (``jax.named_scope`` in the kernel bodies) with Mosaic GPU's on-device profiler and
#: writes one trace per call there (``compiler_params``); ``benchmarks/kernel_trace.py``
#: reads them.  Unset, the scopes cost nothing: the kernels are the same.
TRACE_ENV = "JAX_SEQPAR_MGPU_TRACE"
#: Ranges (begin and end events) one warpgroup may record in a call; more are dropped.
TRACE_RANGES_ENV = "JAX_SEQPAR_MGPU_TRACE_RANGES"


def compiler_params():
    """The Mosaic GPU compiler parameters of this package's Hopper kernels: approximate
    math, and with ``TRACE_ENV`` set (read when a kernel is traced) the on-device
    profiler, ``TRACE_RANGES_ENV`` ranges per warpgroup (default 64), bounds-checked
    where JAX has the check (0.11 and later), so that a longer row truncates its trace
    instead of overrunning shared memory."""
    plgpu = _plgpu()
    trace_dir = os.environ.get(TRACE_ENV, "")
    if not trace_dir:
        return plgpu.CompilerParams(approx_math=True)
    ranges = int(os.environ.get(TRACE_RANGES_ENV, "64"))
    if ranges < 1:
        raise ValueError(f"{TRACE_RANGES_ENV} must be a positive count, got {ranges}")
    extra = {}
    if "profile_bounds_check" in {f.name for f in dataclasses.fields(plgpu.CompilerParams)}:
        extra["profile_bounds_check"] = True  # JAX >= 0.11
    return plgpu.CompilerParams(approx_math=True, profile_space=ranges,
                                profile_dir=trace_dir, **extra)


def traced(name: str):
    """A decorator: the function's work is the trace region ``name`` (``TRACE_ENV``)."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with jax.named_scope(name):
                return fn(*args, **kwargs)
        return run
    return wrap


#: The forward's named barriers: Mosaic GPU keeps 0 for the CTA and 1-3 for its
#: warpgroups' own (``warpgroup_barrier``); a CTA has 16.  Two for the consumers'
#: ping-pong, then (``named_free``) one per ring slot for K and one for V.
SCHED_BARRIERS = (4, 5)
FREE_BARRIER_BASE = 6
NAMED_BARRIERS = 16


def free_barrier(which: str, slot: int, stages: int) -> int:
    """The named barrier of ring slot ``slot``'s K (``which="k"``) or V (``"v"``)."""
    if which not in ("k", "v"):
        raise ValueError(f"which={which!r} must be 'k' or 'v'")
    index = FREE_BARRIER_BASE + slot + (stages if which == "v" else 0)
    if not 0 <= slot < stages or index >= NAMED_BARRIERS:
        raise ValueError(f"slot {slot} of {stages} stages has no named barrier (at most "
                         f"{(NAMED_BARRIERS - FREE_BARRIER_BASE) // 2} stages)")
    return index


#: Threads on a ring slot's named barrier: both consumer warpgroups arrive, the
#: producer warpgroup syncs (``WARP_SLOT_THREADS``: its one producing warp does).
SLOT_THREADS = 3 * 128
WARP_SLOT_THREADS = 2 * 128 + 32


def on_slot(slot, stages: int, fn) -> None:
    """``fn(s)`` for the static ``s`` equal to the traced ring ``slot`` (a named
    barrier's index is an immediate of the instruction)."""
    import jax.experimental.pallas as pl
    for s in range(stages):
        pl.when(slot == s)(lambda s=s: fn(s))


def slot_barrier(op: str, which: str, slot, stages: int, threads: int = SLOT_THREADS) -> None:
    """``named_barrier(op, ...)`` on ring ``slot``'s K or V barrier: a consumer's
    ``"arrive"`` once it has read the operand, the producer's ``"sync"`` before it
    refills the slot; ``threads`` (``SLOT_THREADS`` or ``WARP_SLOT_THREADS``) arrive in
    all."""
    on_slot(slot, stages, lambda s: named_barrier(op, free_barrier(which, s, stages),
                                                  threads))


def named_barriers_supported() -> bool:
    """Whether this JAX can emit inline PTX from a Pallas Mosaic GPU kernel."""
    try:
        from jax.experimental.mosaic.gpu import utils as mgpu_utils
    except ImportError:
        return False
    return hasattr(mgpu_utils, "inline_ptx") and hasattr(_plgpu(), "inline_mgpu")


def named_barrier(op: str, index: int, threads: int = 256) -> None:
    """``bar.sync`` (arrive and wait) or ``bar.arrive`` (arrive only) on the hardware
    named barrier ``index``, complete when ``threads`` threads have arrived (PTX ISA,
    "bar.sync / bar.arrive"); from one warpgroup, 128 of them."""
    if op not in ("sync", "arrive"):
        raise ValueError(f"op={op!r} must be 'sync' or 'arrive'")
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    @_plgpu().inline_mgpu()
    def emit(_ctx):
        mgpu_utils.inline_ptx(f"bar.{op} {int(index)}, {int(threads)};",
                              has_side_effects=True)
    emit()


def _load(ref, layout, gmem: bool = True):
    """``plgpu.load`` of a whole (already indexed) ref into a register ``layout``: small
    vectors straight from global memory (positions, segment ids; Mosaic GPU's vectorised
    "optimized" loads read shared memory only, so these are plain loads) or rows staged
    in shared memory (``gmem=False``)."""
    return _compat.mgpu_load(_plgpu(), ref, layout=layout, optimized=not gmem)


def cta_order(tbl):
    """Query-block order of the launch: most visible tiles first (stable), ``[B, n]``."""
    return jnp.argsort(-tbl[..., 0], axis=1, stable=True).astype(jnp.int32)


def doc_cta_order(tbl, last: bool = False, classes: bool = False):
    """(``MgpuConfig.doc_order``) A launch order of query blocks that keeps each
    document's blocks together, from the tile lists alone: a block's document is the
    first key block it sees (its smallest list entry; a packed document's query blocks
    share it), documents go longest first (the most tiles any of their blocks has) and
    each document's blocks most tiles first; ``[B, n]``.  Without documents (one causal
    row) that is ``cta_order``'s order.  Only the order of the CTAs changes, never what
    they compute.  ``last`` (``MgpuConfig.doc_order_bwd``, transposed lists, rows of key
    blocks): a row's document is the last query block it sees (its largest entry),
    which a causal document's key blocks share.  ``classes``: the lists were built with
    ``tile_lists(classes=True)``.

    A row's groups (fully visible, then each mask class) are each in increasing order,
    so its smallest entry is the smallest of its groups' first entries and its largest
    the largest of their last: read from at most five places of the row rather than by
    a reduction over all of it (with ``partition_tiles``' single cumulative sum, the
    packed 64k call's lists went from 134 to 93 us on one H200: RESULTS.md, "Tile lists
    in one pass")."""
    import jax
    B, n, width = tbl.shape
    count = tbl[..., 0]
    if classes:  # group ends: f, the three class starts, c
        ends = jnp.concatenate([tbl[..., 1:2], tbl[..., -3:], tbl[..., :1]], -1)
    else:
        ends = tbl[..., 1::-1]  # f, c
    begins = jnp.concatenate([jnp.zeros_like(ends[..., :1]), ends[..., :-1]], -1)
    nonempty = ends > begins
    at = jnp.clip((ends - 1) if last else begins, 0, None) + 2
    picked = jnp.take_along_axis(tbl, at, axis=-1)
    if last:  # as a smallest entry: the order below is the same code
        picked = width - 1 - picked
    first = jnp.where(nonempty, picked, jnp.iinfo(jnp.int32).max).min(-1)  # [B, n]
    # (entries are key blocks below ``width``; an empty row is a document of its own)
    first = jnp.where(count > 0, first, width + jnp.arange(n)[None, :])
    longest = jax.vmap(lambda f, c: jnp.zeros((width + n,), c.dtype).at[f].max(c)[f])(
        first, count)
    return jax.vmap(lambda c, f, z: jnp.lexsort((-c, f, -z)))(
        count, first, longest).astype(jnp.int32)


# --------------------------------------------------------------------------- in-kernel
#: Window sides from which ``tile_visible`` compares differences rather than shifted
#: positions (``q + r`` could leave int32).
_SHIFTED_LIMIT = 2 ** 30


def keys_before(Tk: int, first, shape, k_axis: int):
    """The padded-key test of a ``shape`` tile of scores in the WGMMA layout: its keys
    (along ``k_axis``, the first at row ``first``) lie before ``Tk``.  Keys padded past
    ``Tk`` are zero, with the last key's position and id, so the mask's own tests let
    them through (``tile_visible``'s ``extra``)."""
    plgpu = _plgpu()
    key = plgpu.broadcasted_iota(jnp.int32, shape, k_axis, layout=plgpu.Layout.WGMMA)
    return key + first < Tk


def tile_visible(mask, q_pos, k_pos, q_seg, k_seg, q_axis: int, shape, extra=None,
                 diff=None):
    """Visibility of a ``shape`` tile of scores (or None: all visible) from row vectors:
    query positions / segment ids along axis ``q_axis``, key ones along the other, and an
    ``extra`` condition (padded keys) conjoined last.  The mask of the contract: keys ``j``
    with ``left <= q - j`` ... as ``MaskSpec.right_limit`` / ``left_limit`` say.
    ``diff``: the tile's key minus query positions, given whole (computed from indices
    on aligned tiles) instead of ``q_pos`` and ``k_pos``.

    From the row vectors, ``k - q <= r`` is evaluated as ``k <= q + r`` (and the left
    limit likewise), the limit added to the short query vector: one comparison per score
    where the difference cost a subtraction as well (one H100, packed documents at 64k:
    the dK/dV kernel 5.8% faster, RESULTS.md).  That form is exact while ``q + r`` and
    ``q - l`` fit int32: positions are token indices (below ``2**30``), and a window side
    of ``2**30`` or more (a caller's "unbounded") takes the difference form."""
    from jax import lax
    k_axis = 1 - q_axis
    along = lambda x, axis: lax.broadcast_in_dim(x, shape, [axis])  # noqa: E731
    limits = [lim for lim in (mask.right_limit, mask.left_limit) if lim is not None]
    if diff is None and any(lim >= _SHIFTED_LIMIT for lim in limits):
        diff = along(k_pos, k_axis) - along(q_pos, q_axis)
    terms = []
    if diff is None:
        kb = None if k_pos is None else along(k_pos, k_axis)
        if mask.right_limit is not None:
            terms.append(kb <= along(q_pos + mask.right_limit, q_axis))
        if mask.left_limit is not None:
            terms.append(kb >= along(q_pos - mask.left_limit, q_axis))
    else:
        if mask.right_limit is not None:
            terms.append(diff <= mask.right_limit)
        if mask.left_limit is not None:
            terms.append(diff >= -mask.left_limit)
    if q_seg is not None:
        terms.append(along(q_seg, q_axis) == along(k_seg, k_axis))
    if extra is not None:
        terms.append(extra)
    ok = None
    for term in terms:
        ok = term if ok is None else ok & term
    return ok


def softmax_update(s, m, c: float, masked: bool = True, row_ok=None):
    """One key block of the online softmax (FlashAttention-2 Alg. 1, lines 8-10, in log2
    units): ``(m_new, alpha, p)`` from the block's unscaled scores ``s`` ``[rows, keys]``
    (``-inf`` where masked), the running max ``m`` (``c``: the scale times log2 e), so
    that ``acc * alpha + p @ V`` and ``l * alpha + rowsum(p)`` continue the rows.

    ``masked``: some row may have seen only ``-inf`` so far, whose max is replaced by 0
    while it is ``-inf`` (no ``-inf - -inf``).  ``row_ok`` (a bool per row, or None): rows
    that are False see none of the block's keys -- a segment test that depends on the
    query alone (``MASK_CLASSES``' ``"fold"``) -- and keep their ``m``, with ``p = 0``
    and ``alpha = 1`` (0 while ``m`` is ``-inf``, when their sums are still 0), at a cost
    per row, not per score."""
    from jax import lax
    m_new = jnp.maximum(m, s.max(axis=1) * c)
    if row_ok is not None:
        m_new = jnp.where(row_ok, m_new, m)
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
    alpha = jnp.exp2(m - m_use)
    if row_ok is not None:
        m_use = jnp.where(row_ok, m_use, jnp.inf)  # exp2(s - inf) = 0: the row is out
    # scores stay unscaled; the scale folds into the exp2 argument (one fused
    # multiply-add per element)
    p = jnp.exp2(s * c - lax.broadcast_in_dim(m_use, s.shape, [0]))
    return m_new, alpha, p


def step_index(index, token):
    """``index`` (a consumer's own block in a shared-memory array), as a value the
    compiler cannot prove the same in every step: ``token`` is loaded in the step and
    never negative (a tile-list entry), so ``where(token >= 0, index, 0)`` is ``index``.
    The wgmma descriptors of a ref indexed so are formed in the step (uniform-register
    arithmetic) rather than hoisted out of the loop and kept, or spilled, in registers."""
    return jnp.where(token >= 0, index, 0)


def masked_loops(tbl_ref, b, row, n_full, count, has_seg: bool, classes: bool, run, carry):
    """The masked part of a tile-list row: ``carry = run(lo, hi, mode, carry)`` over each
    class's entries ``lo .. hi`` with ``mode = (position test?, segment test)`` (see
    ``pallas_common.MASK_CLASSES``), or over all of them with the full test when the
    lists have no classes (segment test ``"pair"``, or None without segment ids).
    The class starts are the row's last three entries, which ``tile_lists`` keeps in
    order between ``n_full`` and ``count`` (a CPU test checks it): a row whose classes
    covered more entries than ``count`` would make the consumers wait forever for ring
    slots the producer never fills."""
    from jax_seqpar.kernels.pallas_common import MASK_CLASSES
    if not classes:
        return run(n_full, count, (True, "pair" if has_seg else None), carry)
    n = tbl_ref.shape[-1]
    bounds = [n_full] + [tbl_ref[b, row, n - 3 + i] for i in range(3)] + [count]
    for i, mode in enumerate(MASK_CLASSES):
        carry = run(bounds[i], bounds[i + 1], mode, carry)
    return carry


#: Streaming multiprocessors of an H100 / H200 SXM (``sm_count`` without a GPU: CPU
#: lowering tests).
HOPPER_SMS = 132


def sm_count() -> int:
    """The first GPU's streaming multiprocessors, or ``HOPPER_SMS`` without a GPU."""
    try:
        return int(jax.devices("gpu")[0].core_count)
    except (RuntimeError, AttributeError):
        return HOPPER_SMS


def on_producer_warps(one_warp: bool, produce) -> None:
    """``produce()`` in the producer warpgroup: in all four of its warps, or
    (``one_warp``: ``MgpuConfig.warp_producer`` / ``warp_producer_bwd``) in its first warp
    alone, the other three ending at once (``plgpu.warp_map``)."""
    if not one_warp:
        produce()
        return
    import jax.experimental.pallas as pl
    _plgpu().warp_map(lambda warp: pl.when(warp == 0)(produce))


def produce_kv(block, b, count, bk, stages, kvh, k_ref, v_ref, k_smem, v_smem,
               k_ready, v_ready, k_free, v_free, named_free: bool = False,
               slot_threads: int = SLOT_THREADS):
    """The producer warpgroup of a kernel that streams K/V blocks (forward, dQ): for
    each of the CTA's ``count`` key blocks (the t-th is ``block(t)``: an entry of its
    tile-list row, or computed), wait until the consumers have freed its ring slot, then
    start the TMA copies of K and V into it.  ``named_free``: the consumers free slots on
    named barriers (``free_barrier``; 2 x 128 consumer threads arrive, the producer's
    sync: ``slot_threads`` in all) instead of the shared-memory barriers ``k_free`` /
    ``v_free``.  Run from the whole producer warpgroup or from one warp of it."""
    import jax.experimental.pallas as pl
    from jax import lax
    plgpu = _plgpu()

    @pl.loop(0, count)
    def _(t):
        slot = lax.rem(t, jnp.int32(stages))
        rows = (b, pl.ds(block(t) * bk, bk), kvh)

        def wait_free(which, ref):
            if named_free:
                slot_barrier("sync", which, slot, stages, slot_threads)
            else:
                plgpu.barrier_wait(ref.at[slot])

        pl.when(t >= stages)(lambda: wait_free("k", k_free))
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
        pl.when(t >= stages)(lambda: wait_free("v", v_free))
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])


def row_loops(tbl_ref, b, row, n_full, count, has_seg: bool, classes: bool, masked: bool,
              step, carry, start: int = 0):
    """One tile-list row: ``carry = step(t, carry, mode=...)`` over its unmasked entries,
    then (``masked``) over each mask class's (``masked_loops``); ``start``: entries before
    it are left out (run by the caller), whichever loop they belong to."""
    from jax import lax
    first = (lambda lo: lo) if start == 0 else (lambda lo: jnp.maximum(lo, start))
    carry = lax.fori_loop(start, n_full, functools.partial(step, mode=None), carry)
    if masked:
        carry = masked_loops(
            tbl_ref, b, row, n_full, count, has_seg, classes,
            lambda lo, hi, mode, carry: lax.fori_loop(
                first(lo), hi, functools.partial(step, mode=mode), carry),
            carry)
    return carry
