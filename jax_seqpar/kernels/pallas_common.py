"""What the Pallas (Triton) kernels share: configurations, the per-block tile lists, the
masked tile step, the online-softmax step and epilogue, request checks.

``pallas_gpu.py`` (training forward), ``pallas_gpu_bwd.py`` (its backward) and
``pallas_decode.py`` (split-K decoding) all import from here and from nowhere else in the
Pallas family, so no two of them import each other.  See ``pallas_gpu.py`` for how the
tile lists drive the kernels.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_seqpar.kernels.base import KernelRequest, default_platform
from jax_seqpar.masks import MaskSpec

F32 = jnp.float32
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
HEAD_DIMS = (64, 128, 256)
DTYPES = ("float32", "bfloat16", "float16")


# --------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class PallasConfig:
    """Tile sizes and launch parameters (powers of two; ``block_*`` >= 16 for ``tl.dot``).

    ``segment_skip``: with segment ids, skip the tiles whose blocks share no document and
    run the tiles inside one document without the mask (``tile_lists``); False keeps
    every position-visible tile and masks segments in each (the behaviour before).
    """

    block_q: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    block_q_bwd: int = 64
    block_k_bwd: int = 64
    num_warps_bwd: int = 4
    num_stages_bwd: int = 2
    segment_skip: bool = True

    def __post_init__(self):
        if not isinstance(self.segment_skip, bool):
            raise ValueError(f"PallasConfig.segment_skip={self.segment_skip!r} must be a bool")
        for f in dataclasses.fields(self):
            if f.name == "segment_skip":
                continue
            val = getattr(self, f.name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"PallasConfig.{f.name}={val!r} must be a positive int")
            if f.name.startswith(("block", "num_warps")) and val & (val - 1):
                raise ValueError(f"PallasConfig.{f.name}={val} must be a power of two "
                                 f"(Triton tiles)")
            if f.name.startswith("block") and val < 16:
                raise ValueError(f"PallasConfig.{f.name}={val} must be >= 16 (tl.dot)")


#: Per-head-dim defaults (see benchmarks/kernels.py and RESULTS.md for the sweep).
DEFAULT_CONFIGS = {
    64: PallasConfig(block_q=64, block_k=64, num_warps=4, num_stages=3,
                     block_q_bwd=64, block_k_bwd=64, num_warps_bwd=4),
    128: PallasConfig(block_q=128, block_k=64, num_warps=4, num_stages=3,
                      block_q_bwd=64, block_k_bwd=64, num_warps_bwd=4),
    256: PallasConfig(block_q=64, block_k=32, num_warps=8, num_stages=2,
                      block_q_bwd=32, block_k_bwd=32, num_warps_bwd=8),
}

#: float32 inputs take twice the shared memory per tile: with the bf16 tiles, D = 128
#: asked an H200 for 256 KiB (it has 227 KiB per block), so float32 gets smaller tiles
#: at D = 128 and 256.  Not tuned for speed (float32 is for checks).
FLOAT32_CONFIGS = {
    64: DEFAULT_CONFIGS[64],
    128: PallasConfig(block_q=64, block_k=32, num_warps=4, num_stages=2,
                      block_q_bwd=32, block_k_bwd=32, num_warps_bwd=4),
    256: PallasConfig(block_q=32, block_k=32, num_warps=4, num_stages=2,
                      block_q_bwd=32, block_k_bwd=32, num_warps_bwd=8),
}


def forward_smem_bytes(config: PallasConfig, head_dim: int, dtype) -> int:
    """Shared memory the forward's pipelined loads need (one Q block, ``num_stages``
    buffers of K and V); a lower bound that must stay under the GPU's limit."""
    item = jnp.dtype(dtype).itemsize
    return item * head_dim * (config.block_q + 2 * config.num_stages * config.block_k)


def default_config(head_dim: int, dtype) -> PallasConfig:
    """The default tiles for this head dim and input dtype."""
    table = FLOAT32_CONFIGS if jnp.dtype(dtype) == F32 else DEFAULT_CONFIGS
    return table[head_dim]


def _compiler_params(num_warps, num_stages):
    from jax.experimental.pallas import triton as plgpu
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def dot(a, b, trans_a=False, trans_b=False, precision=None):
    """2-D ``a @ b`` (optionally transposed operands) with float32 accumulation, as one
    ``dot_general`` (the Triton lowering maps it to ``tl.dot``)."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def _dot_precision(dtype, interpret: bool):
    """float32 inputs need near-float32 products for the 1e-5 budget (plain TF32 keeps
    10 mantissa bits).  Compiled, they use three TF32 tensor-core products (hi*hi +
    hi*lo + lo*hi, ~22 bits) rather than Triton's exact float32 dot, which runs as FMAs
    on the CUDA cores (an H200 check with it printed nothing for minutes; see
    RESULTS.md).  The interpreter runs the dot on the host, exactly (``HIGHEST``)."""
    if jnp.dtype(dtype) != F32:
        return None
    return lax.Precision.HIGHEST if interpret else lax.DotAlgorithmPreset.TF32_TF32_F32_X3


# --------------------------------------------------------------------------- tiles
def _pad_to(x, axis, length, edge=False):
    pad = length - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, mode="edge") if edge else jnp.pad(x, widths)


def block_ranges(x, block: int):
    """Per-block ``(min, max)`` of ``x`` ``[..., L]`` (``L`` a multiple of ``block``),
    each ``[..., L // block]``."""
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    return xb.min(-1), xb.max(-1)


def segment_tiles(q_seg, kv_seg, bq: int, bk: int):
    """``(may_share, one_segment)`` ``[B, nq, nk]`` from the per-block minimum and maximum
    segment id of each side (computed once per call).

    ``may_share`` is False only when the two blocks' id ranges are disjoint, which proves
    that no query of the one block has a key of the other with its id; it holds for any
    ids (sorted or not, in any layout), so a skipped tile is always fully masked.
    ``one_segment``: both blocks hold one and the same id, so every pair shares it and a
    kernel may skip the segment test.  Packed documents in increasing position order give
    narrow ranges (a device's shard is in increasing position order in every layout), so
    tiles between different documents are skipped; arbitrary ids give wide ranges and
    merely skip less.  ``q_seg`` ``[B, Lq]``, ``kv_seg`` ``[B, Lk]``, padded (edge values)
    to whole blocks.
    """
    q_lo, q_hi = block_ranges(q_seg, bq)          # [B, nq]
    k_lo, k_hi = block_ranges(kv_seg, bk)         # [B, nk]
    q_lo, q_hi = q_lo[:, :, None], q_hi[:, :, None]
    k_lo, k_hi = k_lo[:, None, :], k_hi[:, None, :]
    may_share = (q_lo <= k_hi) & (k_lo <= q_hi)
    one_segment = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
    return may_share, one_segment


#: The mask classes of ``tile_lists(classes=True)``, in list order after the fully
#: visible tiles: (does the tile need the position test, how its segment test runs).
#: ``"fold"``: the key block holds one document, so the segment test is a condition on the
#: query alone, which a backward kernel folds into the query's lse (``+inf``: P = 0) at no
#: cost per score; ``"pair"``: the test per score, as without classes.
MASK_CLASSES = ((False, "fold"), (True, "fold"), (False, "pair"), (True, "pair"))


def tile_lists(mask: MaskSpec, q_pos, kv_pos, Tk: int, bq: int, bk: int, has_seg: bool,
               transpose: bool = False, q_seg=None, kv_seg=None, classes: bool = False):
    """Per row block, the column blocks it may see, as ``int32 [B, n_rows, n_cols + 2]``.

    Entry 0 is the number ``c`` of visible blocks, entry 1 the number ``f <= c`` of them
    whose bounds prove every pair visible; entries ``2 .. 2+c`` are the block indices,
    the ``f`` fully visible ones first, so a kernel runs two loops: one without any mask
    code over the first ``f`` and one that evaluates the mask over the other ``c - f``.
    (Softmax accumulation is order-independent.)  Rows are query blocks
    (``transpose=False``) or key blocks (``True``).  ``q_pos`` ``[B, Lq]`` and ``kv_pos``
    ``[Lk]`` are padded (edge values) to whole blocks.

    Segment ids: with ``q_seg`` ``[B, Lq]`` and ``kv_seg`` ``[B, Lk]`` (padded like the
    positions), a tile is also skipped when the blocks' id ranges prove that they share
    no document, and counts as fully visible when both blocks lie in one and the same
    document (``segment_tiles``).  Without them (``has_seg`` alone) segments make no
    tile fully visible and skip none: the kernels' ``segment_skip=False``.

    ``classes`` (with segment ids): the partially visible tiles are ordered by
    ``MASK_CLASSES`` -- whether their positions alone prove every pair visible (then no
    position test), and whether their key block lies in one document (then the segment
    test depends on the query alone) -- and three more entries close each row:
    ``[..., n_cols + 2 : n_cols + 5]`` are where the 2nd, 3rd and 4th class start (the
    1st starts at ``f``, the 4th ends at ``c``), so a kernel runs one loop per class
    with only the mask code that class needs.
    """
    B, Lq = q_pos.shape
    qb = q_pos.reshape(B, Lq // bq, bq)
    kb = kv_pos.reshape(-1, bk)
    q_lo, q_hi = qb.min(-1)[:, :, None], qb.max(-1)[:, :, None]  # [B, nq, 1]
    k_lo, k_hi = kb.min(-1)[None, None], kb.max(-1)[None, None]  # [1, 1, nk]
    nq, nk = qb.shape[1], kb.shape[0]
    shape = (B, nq, nk)
    vis = jnp.broadcast_to(jnp.asarray(mask.tile_may_be_visible(q_lo, q_hi, k_lo, k_hi)), shape)
    full = jnp.broadcast_to(jnp.asarray(mask.tile_fully_visible(q_lo, q_hi, k_lo, k_hi)), shape)
    whole = (jnp.arange(nk) + 1) * bk <= Tk  # no padded key in the block
    pos_full = full & whole[None, None, :]
    if classes and q_seg is None:
        raise ValueError("tile_lists(classes=True) needs q_seg and kv_seg (the classes "
                         "sort the tiles that segments mask)")
    if q_seg is not None:
        may_share, one_segment = segment_tiles(q_seg, kv_seg, bq, bk)
        vis = vis & may_share
        full = full & one_segment
    elif has_seg:
        full = full & False
    full = full & whole[None, None, :] & vis
    if not classes:
        if transpose:
            vis, full = jnp.swapaxes(vis, 1, 2), jnp.swapaxes(full, 1, 2)
        order, count, n_full = compact_tiles(vis, full)
        return jnp.concatenate([count[..., None], n_full[..., None], order], axis=-1)
    k_lo_seg, k_hi_seg = block_ranges(kv_seg, bk)
    k_one = (k_lo_seg == k_hi_seg)[:, None, :]               # [B, 1, nk]
    group = class_groups(full, k_one, pos_full)
    if transpose:
        vis, group = jnp.swapaxes(vis, 1, 2), jnp.swapaxes(group, 1, 2)
    order, ends = class_order(vis, group)
    return class_rows(ends, order)


def class_groups(full, k_one, pos_full):
    """Each tile's group for ``class_order``: 0 fully visible, then ``MASK_CLASSES``'
    order (``k_one``: the key block is one document, so its segment test folds;
    ``pos_full``: positions prove every pair visible)."""
    return jnp.where(full, 0, 1 + jnp.where(k_one, 0, 2) + jnp.where(pos_full, 0, 1))


def class_order(vis, group):
    """``(order, ends)``: each row's visible columns by group (``partition_tiles``) and
    the end of each of the ``1 + len(MASK_CLASSES)`` groups."""
    order, counts = partition_tiles(vis, group, 1 + len(MASK_CLASSES))
    return order, jnp.cumsum(counts, -1, dtype=jnp.int32)


def class_rows(ends, entries):
    """A class-sorted tile-list row: ``[count, n_full, entries..., c2, c3, c4]`` (the
    layout ``masked_loops`` reads), from ``class_order``'s group ends."""
    return jnp.concatenate([ends[..., -1:], ends[..., :1], entries, ends[..., 1:4]],
                           axis=-1)


def compact_tiles(vis, full):
    """The column indices of each row, fully visible ones first, then the other visible
    ones, each group in increasing order, then zeros: ``(order [..., n], count, n_full)``.

    A stable partition by prefix sums and one scatter with unique targets (invisible
    columns are dropped), linear in the columns, not a sort: on one H200 the three lists
    of a packed fwd+bwd at 64k tokens took 0.46 ms this way and 0.65 ms sorted (at 16k
    0.27 and 0.24 ms; RESULTS.md, "Packed documents, second pass").
    """
    order, counts = partition_tiles(vis, jnp.where(full, 0, 1), 2)
    return order, counts.sum(-1), counts[..., 0]


def partition_tiles(vis, group, n_groups: int):
    """The visible column indices of each row ordered by ``group`` (ints in
    ``0 .. n_groups - 1``), each group in increasing order, then zeros:
    ``(order [..., n], counts [..., n_groups])``.  ``compact_tiles`` is its two-group
    case.

    Every group's prefix sums come out of one cumulative sum over a ``[..., n_groups,
    n]`` one-hot (one XLA reduce-window), not one cumulative sum and one count per group.
    With ``doc_cta_order`` reading group ends, the lists of the bar's packed call took 93
    us in 38 kernels on one H200 instead of 134 us in 48 (RESULTS.md, "Tile lists in one
    pass")."""
    n_cols = vis.shape[-1]
    col = jnp.arange(n_cols, dtype=jnp.int32)
    ids = jnp.arange(n_groups, dtype=jnp.int32)[:, None]
    onehot = vis[..., None, :] & (group[..., None, :] == ids)          # [..., G, n]
    ranks = jnp.cumsum(onehot, -1, dtype=jnp.int32)                     # within a group
    counts = ranks[..., -1]                                             # [..., G]
    offset = jnp.cumsum(counts, -1, dtype=jnp.int32) - counts           # group starts
    own = jnp.where(onehot, offset[..., None] + ranks - 1, 0).sum(-2)   # [..., n]
    # invisible columns go to n_cols + col: out of bounds (dropped), and still distinct,
    # so the scatter's unique_indices promise holds
    dest = jnp.where(vis, own, n_cols + col)
    rows = vis.shape[:-1]
    flat = dest.reshape(-1, n_cols)
    cols = jnp.broadcast_to(col, flat.shape)
    r = jnp.broadcast_to(jnp.arange(flat.shape[0], dtype=jnp.int32)[:, None], flat.shape)
    order = jnp.zeros(flat.shape, jnp.int32).at[r, flat].set(cols, mode="drop",
                                                             unique_indices=True)
    return order.reshape(*rows, n_cols), counts


def segment_lists_args(q_seg, kv_seg, skip: bool):
    """The ``q_seg=, kv_seg=`` keywords of ``tile_lists`` (padded ids, or none when
    ``skip`` is off or there are no segment ids)."""
    if q_seg is None or not skip:
        return {}
    return dict(q_seg=q_seg, kv_seg=kv_seg)


def mask_tile(mask: MaskSpec, s, q_pos, kv_pos, kv_index, Tk: int, q_seg=None, kv_seg=None):
    """``s`` with invisible pairs set to -inf: positions, padded keys, segments."""
    diff = kv_pos[None, :] - q_pos[:, None]
    ok = (kv_index < Tk)[None, :]
    if mask.right_limit is not None:
        ok = ok & (diff <= mask.right_limit)
    if mask.left_limit is not None:
        ok = ok & (-diff <= mask.left_limit)
    if q_seg is not None:
        ok = ok & (q_seg[:, None] == kv_seg[None, :])
    return jnp.where(ok, s, -jnp.inf)


def needs_mask(mask: MaskSpec, Tk: int, bk: int, has_seg: bool) -> bool:
    return (mask.right_limit is not None or mask.left_limit is not None or has_seg
            or Tk % bk != 0)


# --------------------------------------------------------------------------- forward
def online_softmax_tile(t, carry, *, q, qpos, qseg, tbl_ref, k_ref, v_ref, kvpos_ref,
                        kvseg_ref, mask, c, bk, Tk, masked, precision):
    """One step of FlashAttention-2's forward loop (Alg. 1, lines 6-10) inside a kernel:
    the key block named by entry ``t`` of the tile list, scores in log2 units (``c`` =
    scale * log2 e), the mask if ``masked``, then the running ``(acc, m, l)`` updated."""
    acc, m, l = carry
    start = pl.multiple_of(tbl_ref[t + 2] * bk, bk)
    k = k_ref[pl.ds(start, bk), :]
    v = v_ref[pl.ds(start, bk), :]
    s = dot(q, k, trans_b=True, precision=precision) * c  # [rows, bk] float32
    if masked:
        idx = start + lax.broadcasted_iota(jnp.int32, (bk,), 0)
        kvs = kvseg_ref[pl.ds(start, bk)] if kvseg_ref is not None else None
        s = mask_tile(mask, s, qpos, kvpos_ref[pl.ds(start, bk)], idx, Tk, qseg, kvs)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_use)
    p = jnp.exp2(s - m_use[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v, precision=precision)
    return acc, m_new, l


def finish_rows(carry):
    """``(o, lse)`` of a finished loop: ``o = acc / l``, natural-log ``lse``; rows that
    saw no key give ``o = 0, lse = -inf``."""
    acc, m, l = carry
    has = l > 0
    l_safe = jnp.where(has, l, 1.0)
    return acc / l_safe[:, None], jnp.where(has, (m + jnp.log2(l_safe)) * LN2, -jnp.inf)


# --------------------------------------------------------------------------- checks
def check_request(request: KernelRequest, name: str, fallback: str) -> None:
    """What the Pallas kernels (``name``) refuse, with ``NotImplementedError``: head dims
    outside ``HEAD_DIMS``, dtypes outside ``DTYPES``, block masks (use ``fallback``)."""
    if request.head_dim not in HEAD_DIMS:
        raise NotImplementedError(f"head_dim={request.head_dim} is not supported by the "
                                  f"{name} kernel (supported: {HEAD_DIMS})")
    if str(request.dtype) not in DTYPES:
        raise NotImplementedError(f"dtype {request.dtype} is not supported by the {name} "
                                  f"kernel (supported: {DTYPES})")
    if request.mask.block_mask is not None:
        raise NotImplementedError(f"block-sparse masks (block_mask) are not supported by "
                                  f"the {name} kernel; use kernel={fallback!r}")


def interpret_mode(interpret: Optional[bool]) -> bool:
    """``interpret=None``: interpret off GPU (slow, for tests), compile on GPU."""
    return default_platform() != "gpu" if interpret is None else interpret
