"""Which sequence-parallel strategy to use on a mesh: a model-based choice, with a reason.

``choose_strategy`` estimates, for one attention call (forward + backward), the time of
every strategy that can run on the given mesh axes, and returns the fastest with the
estimates of all of them.  It is a *model*, as ``costs.choose_backward`` is for the
backward: bytes per mesh axis from ``costs.bytes_per_axis`` (what the tests check
against the compiled programs), over per-axis links (``comm_time.Link``: bandwidth per
device and latency), plus the attention FLOPs over a device rate when one is given.

How each candidate spends its time (``S`` tokens on ``G`` devices):

* ``ring`` (one axis, or the axes flattened into one ring): K/V hops overlap the tiles,
  so ``max(compute, comm)``; on two axes every hop waits for the slowest link, since the
  devices at a node's edge send across nodes on every step (``G - 1`` steps at the
  inter-node speed).
* ``double_ring`` (two axes; BurstEngine §3.1, Fig. 4-5): intra- and inter-node hops
  overlap each other and the tiles: ``max(compute, comm_time.double_ring_time)``.
* ``usp`` (two axes; heads divisible by the inner axis): Ulysses all-to-alls over the
  inner axis (not overlapped) + a ring over the outer axis (overlapped).
* ``ulysses`` (heads divisible by all devices): all-to-alls over every device, not
  overlapped; on two axes the share of each device's bytes bound for other nodes goes
  over the outer link while the rest goes over the inner one.
* ``allgather``: gathers K/V (not overlapped, bytes spread as for ulysses) and holds the
  whole sequence's K/V on every device: left out when ``memory_bytes`` is given and that
  does not fit.

The ring schemes take ``backward="q"`` or ``"kv"``, whichever sends fewer bytes.  With
no ``device_flops`` the compute is taken as zero: the choice is then by communication
time alone (exposed communication for every strategy), which favours the strategies
that send the least over the slow axis.  Where the compute hides the communication of
several strategies, the one that communicates least wins the tie.  Not modeled:
sliding windows (a window shorter than a node's share of the sequence makes the flat
ring, which then sends only to its neighbours, cheaper than the double ring, whose
rounds still cross the nodes) and the kernels' own speed differences.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import numpy as np

from jax_seqpar.layouts import check_divisible, permutation
from jax_seqpar.masks import MaskSpec
from jax_seqpar.parallel.comm_time import Link, axis_time, double_ring_time
from jax_seqpar.parallel.costs import AttnShape, bytes_per_axis


@dataclasses.dataclass(frozen=True)
class StrategyChoice:
    strategy: str
    reason: str
    #: modeled seconds per candidate; ``None`` with the reason in ``skipped``
    times: Dict[str, float]
    skipped: Dict[str, str]
    backward: str  # the ring backward scheme assumed ("kv" or "q")


def _fwd_bwd(b) -> Dict[str, float]:
    return {a: b["forward"][a] + b["backward"][a] for a in b["forward"]}


def choose_strategy(axes: Dict[str, int], *, seq_len: int, q_heads: int, kv_heads: int,
                    head_dim: int, links: Dict[str, Link], itemsize: int = 2, batch: int = 1,
                    causal: bool = True, device_flops: Optional[float] = None,
                    memory_bytes: Optional[float] = None) -> StrategyChoice:
    """The modeled fastest strategy for one attention call, forward + backward.

    ``axes``: mesh axes in ``axis_name`` order, ``{name: size}``: one axis, or
    ``{outer: No, inner: Ni}`` with ``outer`` the slow (inter-node) axis.  ``links``: a
    ``comm_time.Link`` per axis.  ``device_flops``: a device's attention FLOP/s (then
    compute counts, and overlapped communication hides behind it); ``memory_bytes``: what a
    device can spend on gathered K/V (``allgather``).
    """
    names = tuple(axes)
    if len(names) not in (1, 2):
        raise ValueError(f"axes={axes!r} must name one or two mesh axes")
    missing = set(names) - set(links)
    if missing:
        raise ValueError(f"no Link for mesh axes {sorted(missing)}: pass links={{axis: "
                         f"Link(bandwidth_bytes_per_s, latency_s)}}")
    G = 1
    for n in axes.values():
        G *= n
    if seq_len % (2 * G):
        raise ValueError(f"seq_len={seq_len} must be divisible by 2 * {G} devices")
    shape = AttnShape(batch, seq_len, q_heads, kv_heads, head_dim, itemsize)
    flops = 4 * batch * seq_len * seq_len * q_heads * head_dim * 3.5 / G  # fwd + bwd (2.5x)
    compute = 0.0 if not device_flops else flops * (0.5 if causal else 1.0) / device_flops
    # the link a flat ring waits for: the slowest of the axes that have a neighbour
    slow = min([a for a in names if axes[a] > 1] or names, key=lambda a: links[a].bandwidth)

    def spread(nbytes: float, collectives: int) -> float:
        """A collective over all ``G`` devices, destinations spread evenly: on two axes
        the share that leaves the node goes over ``outer``, concurrently with the rest."""
        if len(names) == 1:
            return axis_time({names[0]: nbytes}, {names[0]: collectives}, links)
        outer, inner = names
        remote = (G - axes[inner]) / (G - 1) if G > 1 else 0.0
        return max(axis_time({outer: nbytes * remote}, {outer: collectives}, links),
                   axis_time({inner: nbytes * (1 - remote)}, {inner: collectives}, links))

    def ring_bytes(backward):
        return _fwd_bwd(bytes_per_axis("ring", shape, {"all": G}, backward=backward))["all"]

    backward = min(("kv", "q"), key=ring_bytes)
    times: Dict[str, float] = {}
    comm: Dict[str, float] = {}  # communication alone: breaks ties when compute hides it
    skipped: Dict[str, str] = {}
    # flat ring: G - 1 steps, each waiting for the slowest link when there are two axes
    comm["ring"] = axis_time({slow: ring_bytes(backward)}, {slow: 2 * G - 1}, links)
    times["ring"] = max(compute, comm["ring"])
    if len(names) == 2:
        outer, inner = names
        comm["double_ring"] = double_ring_time(shape, axes, links, backward=backward)
        times["double_ring"] = max(compute, comm["double_ring"])
        if q_heads % axes[inner] or kv_heads % axes[inner]:
            skipped["usp"] = (f"heads Hq={q_heads}, Hkv={kv_heads} not divisible by "
                              f"{inner}={axes[inner]}")
        else:
            b = _fwd_bwd(bytes_per_axis("usp", shape, axes, backward=backward))
            a2a = axis_time({inner: b[inner]}, {inner: 8}, links)
            ring = axis_time({outer: b[outer]}, {outer: 2 * axes[outer] - 1}, links)
            comm["usp"] = a2a + ring
            times["usp"] = a2a + max(compute, ring)
    if q_heads % G or kv_heads % G:
        skipped["ulysses"] = f"heads Hq={q_heads}, Hkv={kv_heads} not divisible by {G}"
    else:
        b = _fwd_bwd(bytes_per_axis("ulysses", shape, {"all": G}))["all"]
        comm["ulysses"] = spread(b, 8)
        times["ulysses"] = compute + comm["ulysses"]
    gathered = 2 * batch * seq_len * kv_heads * head_dim * itemsize
    if memory_bytes is not None and gathered > memory_bytes:
        skipped["allgather"] = (f"gathered K/V take {gathered / 2**30:.2f} GiB > "
                                f"memory_bytes={memory_bytes / 2**30:.2f} GiB")
    else:
        b = _fwd_bwd(bytes_per_axis("allgather", shape, {"all": G}))["all"]
        comm["allgather"] = spread(b, 2)
        times["allgather"] = compute + comm["allgather"]
    order = sorted(times, key=lambda k: (times[k], comm[k]))
    best = order[0]
    others = ", ".join(f"{k} {times[k] * 1e3:.3g} ms" for k in order[1:])
    reason = (f"strategy={best!r}: modeled {times[best] * 1e3:.3g} ms per forward + backward"
              f" (vs {others}; backward={backward!r}"
              + (f"; compute {compute * 1e3:.3g} ms, communication {comm[best] * 1e3:.3g} ms"
                 if device_flops else
                 "; communication only, no device_flops given")
              + "".join(f"; no {k}: {v}" for k, v in skipped.items()) + ")")
    return StrategyChoice(best, reason, times, skipped, backward)


# --------------------------------------------------------------------------- layouts
@dataclasses.dataclass(frozen=True)
class LayoutChoice:
    layout: str
    reason: str
    #: modeled critical path per layout: the sum over ring steps of the busiest device's
    #: tiles (``block x block``) that may see a key of their own document
    costs: Dict[str, int]
    #: (query device, key device) pairs of different devices that compute, per layout
    pairs: Dict[str, int]
    block: int


def segments_from_lengths(doc_lengths, seq_len: int) -> np.ndarray:
    """Segment ids ``[B, seq_len]`` of packed documents: ``doc_lengths`` is one sequence
    of lengths (one row) or one per batch row; a row's documents follow each other from
    position 0 and the rest of the row (if any) is one more document."""
    rows = doc_lengths
    if len(rows) and np.ndim(rows[0]) == 0:
        rows = [rows]
    out = []
    for lens in rows:
        lens = [int(n) for n in lens]
        if any(n < 1 for n in lens):
            raise ValueError(f"doc_lengths={lens} must be positive")
        if sum(lens) > seq_len:
            raise ValueError(f"doc_lengths sum to {sum(lens)} > seq_len={seq_len}")
        if sum(lens) < seq_len:
            lens.append(seq_len - sum(lens))
        out.append(np.repeat(np.arange(len(lens), dtype=np.int32), lens))
    return np.stack(out)


def _block_ranges(x, block: int):
    """``(min, max)`` over blocks of ``block`` along the last axis (edge-padded)."""
    n = -(-x.shape[-1] // block)
    pad = n * block - x.shape[-1]
    if pad:
        x = np.concatenate([x, np.repeat(x[..., -1:], pad, axis=-1)], axis=-1)
    xb = x.reshape(*x.shape[:-1], n, block)
    return xb.min(-1), xb.max(-1)


def layout_tiles(layout: str, segment_ids: np.ndarray, num_devices: int, *,
                 causal: bool = True, window=None, block: int = 128) -> np.ndarray:
    """``W[h, i]``: tiles of ``block x block`` that device ``i`` computes at ring step ``h``
    (keys of device ``i - h``), summed over the batch rows: tiles whose position bounds
    may be visible and whose segment id ranges overlap -- the skip tests of the kernels
    (``pallas_common.tile_lists``), applied to every pair the ring visits."""
    seg = np.asarray(segment_ids)
    B, S = seg.shape
    G = num_devices
    T = S // G
    perm = permutation(layout, S, G)
    pos = perm.reshape(G, T)
    sg = seg[:, perm].reshape(B, G, T)
    p_lo, p_hi = _block_ranges(pos, block)         # [G, nb]
    s_lo, s_hi = _block_ranges(sg, block)          # [B, G, nb]
    mask = MaskSpec(causal=causal, window=window)
    W = np.zeros((G, G), np.int64)
    for h in range(G):
        j = (np.arange(G) - h) % G
        vis = np.broadcast_to(np.asarray(mask.tile_may_be_visible(
            p_lo[:, :, None], p_hi[:, :, None], p_lo[j][:, None, :], p_hi[j][:, None, :])),
            (G, p_lo.shape[1], p_lo.shape[1]))
        share = ((s_lo[:, :, :, None] <= s_hi[:, j][:, :, None, :])
                 & (s_lo[:, j][:, :, None, :] <= s_hi[:, :, :, None]))  # [B, G, nb, nb]
        W[h] = (vis[None] & share).sum(axis=(0, 2, 3))
    return W


def choose_layout(segment_ids=None, *, num_devices: int, seq_len: Optional[int] = None,
                  doc_lengths=None, causal: bool = True, window=None, block: int = 128,
                  candidates=("contiguous", "zigzag", "striped")) -> LayoutChoice:
    """The token layout for packed documents, from their lengths, with the reason.

    Give the concrete ``segment_ids`` ``[B, S]`` (NumPy) or ``doc_lengths`` (one row's, or
    one list per row) with ``seq_len``; neither means one document per row.  A ring of
    ``num_devices`` runs one step per key device; its time is modeled as the sum over the
    steps of the busiest device's tiles (``layout_tiles``: the tiles that may see a key of
    their own document; pairs and tiles sharing no document are skipped, as the ring and
    the kernels do).  Zigzag balances one causal triangle (BurstEngine Eq. 11), but with
    documents much shorter than a device's ``S / G`` tokens every contiguous shard holds
    about the same within-document work, and its pairs with other devices share only the
    documents that cross a border; zigzag cuts every shard into two chunks (more
    documents cut) and striped spreads each document over every device (each tile's id
    range covers many documents, so little is skipped).  The cheapest layout wins; within
    1% of it, the earlier of ``candidates`` (contiguous first: it also lets a window of
    the longest document cut the transfers, see ``ring.py``).
    """
    if segment_ids is not None:
        seg = np.asarray(segment_ids)
        if seg.ndim != 2:
            raise ValueError(f"segment_ids must be [batch, seq]; got shape {seg.shape}")
        source = "segment ids"
    else:
        if seq_len is None:
            raise ValueError("choose_layout needs segment_ids, or seq_len (with doc_lengths)")
        seg = segments_from_lengths(doc_lengths if doc_lengths is not None else [[seq_len]],
                                    seq_len)
        source = "document lengths" if doc_lengths is not None else "one document per row"
    B, S = seg.shape
    G = num_devices
    T = S // G
    usable = []
    for lay in candidates:
        try:
            check_divisible(lay, S, G)
        except ValueError:
            continue
        usable.append(lay)
    if not usable:
        raise ValueError(f"seq_len={S} cannot be split over {G} devices by any of "
                         f"{candidates}")
    blk = block  # coarser for long shards (at most 1024 blocks each): a model, not a kernel
    while T // blk > 1024:
        blk *= 2
    blk = max(1, min(blk, T // 2 if "zigzag" in usable else T))
    costs, pairs = {}, {}
    for lay in usable:
        W = layout_tiles(lay, seg, G, causal=causal, window=window, block=blk)
        costs[lay] = int(W.max(axis=1).sum())
        pairs[lay] = int((W[1:] > 0).sum())
    low = min(costs.values())
    best = next(lay for lay in usable if costs[lay] <= 1.01 * low)
    lens = np.concatenate([np.diff(np.flatnonzero(np.diff(r, prepend=r[0] - 1) != 0),
                                   append=S) for r in seg])
    others = ", ".join(f"{lay} {costs[lay]} ({pairs[lay]} pairs)" for lay in usable
                       if lay != best)
    reason = (f"layout={best!r}: modeled {costs[best]} tiles of {blk}x{blk} on the ring's "
              f"critical path, {pairs[best]} of {G * (G - 1)} device pairs computing (vs "
              f"{others or 'nothing else'}); from the {source}: {len(lens)} documents, "
              f"mean {lens.mean():.0f} and longest {lens.max()} tokens, over {T} tokens per "
              f"device{', causal' if causal else ''}")
    return LayoutChoice(best, reason, costs, pairs, blk)
