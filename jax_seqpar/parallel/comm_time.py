"""A communication-*time* model per mesh axis (a model, not a measurement).

BurstEngine (Sun et al. 2025), §3.1, Table 1 gives the forward + backward communication
time of three rings on ``N_inter`` nodes of ``N_intra`` GPUs, with a per-step time
``T_x = Lat_x + P / B_x`` for a transfer of ``P`` bytes over intra-node (NVLink) or
inter-node (NIC) links::

    RingAttention   6 max(N T_intra, N T_inter)
    DoubleRing      4 max((N - N_inter) T_intra, N_inter T_inter)
                    + 2 ((N - N_inter) T_intra + N_inter T_inter)
    BurstAttention  5 max((N - N_inter) T_intra, N_inter T_inter)

We read ``N`` as ``G = N_inter * N_intra``, the number of ring steps (the caption
defines ``G`` while the formulas use ``N``; with ``N = G`` a double ring's
``G - N_inter`` intra-node and ``N_inter`` inter-node hops add up to the ring), and ``P``
as one device's block of one ``[T, H, D]`` tensor.  The factors count such blocks per
step: RingAttention moves K, V forward and K, V, dK, dV backward (6) over one flat ring,
whose every step waits for the slowest (inter-node) link; DoubleRing overlaps the
intra- and inter-node rings for the activations (K, V both ways: 4) but not for the
gradients dK, dV (2, summed); BurstAttention moves K, V forward and Q, dQ, dO backward
(5, the row statistics D and lse left out as in the paper), all overlapped.

For the strategies Table 1 does not cover (``ulysses``, ``usp``) ``axis_time`` adds, per
mesh axis, the bytes ``costs.bytes_per_axis`` counts over that axis's bandwidth plus one
latency per collective, with no overlap between axes or with compute.

``strategy="double_ring"`` (``parallel/double_ring.py``) is BurstEngine's topology-aware
ring, not Table 1's DoubleRing row (DoubleRing Attention, which does not overlap the
gradients): its intra- and inter-node transfers run concurrently in the forward and the
backward alike.  ``double_ring_time`` models it from the bytes it actually sends
(``costs.bytes_per_axis``): per phase, the slower of the two axes, each moving its bytes
in its hops.  It makes ``G - No`` intra-node and ``No - 1`` inter-node hops (Table 1
counts ``N_inter`` inter-node steps: the ring's return hop, which the implementation
does not make; ``table1_time(..., steps=(G - No, No - 1))`` uses the implementation's
counts).  With those counts, float32 and multi-head attention (so that a float32
accumulator block weighs ``P`` too), ``double_ring_time`` is, exactly,

* ``backward="kv"``: ``6 max((G - No) T_intra, (No - 1) T_inter)`` (K, V forward; K, V,
  dK, dV backward, all overlapped): the DoubleRing row's ``4 max + 2 sum`` with the
  gradients overlapped too;
* ``backward="q"``: the BurstAttention row times ``1 + 2 / (5 D)``: the row statistics
  D and lse (two float32 per row, ``2 P / D``) that Table 1 leaves out.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from jax_seqpar.parallel.costs import DoubleRingShape, bytes_per_axis

METHODS = ("ring", "double_ring", "burst")


@dataclasses.dataclass(frozen=True)
class Link:
    """One mesh axis's link: bytes per second one device sends at, and latency (s)."""

    bandwidth: float
    latency: float = 0.0

    def __post_init__(self):
        if not self.bandwidth > 0 or self.latency < 0:
            raise ValueError(f"Link(bandwidth={self.bandwidth}, latency={self.latency}) needs "
                             f"a positive bandwidth (bytes/s) and a latency >= 0 (s)")

    def step(self, nbytes: float) -> float:
        """``T = Lat + P / B`` (BurstEngine Table 1)."""
        return self.latency + nbytes / self.bandwidth


def table1_time(method: str, *, nodes: int, gpus_per_node: int, block_bytes: float,
                intra: Link, inter: Link, steps: Optional[Tuple[int, int]] = None) -> float:
    """Forward + backward communication time (s) of BurstEngine Table 1's ``method``.

    ``block_bytes`` is ``P``: one device's block of one tensor, ``B * (S/G) * H * D * e``.
    ``steps``: ``(intra-node, inter-node)`` steps; default Table 1's ``(N - N_inter,
    N_inter)`` (and ``N`` for the flat ring); ``(G - nodes, nodes - 1)`` are the hops
    the implementation makes (a flat ring then makes their sum).
    """
    G = nodes * gpus_per_node
    t_intra, t_inter = intra.step(block_bytes), inter.step(block_bytes)
    if nodes == 1:  # no inter-node link: every ring is one NVLink ring
        t_inter = t_intra
    intra_steps, inter_steps = steps if steps is not None else (G - nodes, nodes)
    ring_steps = G if steps is None else intra_steps + inter_steps
    if method == "ring":
        return 6 * max(ring_steps * t_intra, ring_steps * t_inter)
    if method == "double_ring":
        return (4 * max(intra_steps * t_intra, inter_steps * t_inter)
                + 2 * (intra_steps * t_intra + inter_steps * t_inter))
    if method == "burst":
        return 5 * max(intra_steps * t_intra, inter_steps * t_inter)
    raise ValueError(f"unknown method={method!r}; choose one of {METHODS}")


def axis_time(bytes_by_axis: Dict[str, float], collectives_by_axis: Dict[str, int],
              links: Dict[str, Link]) -> float:
    """Sum over mesh axes of ``bytes / bandwidth + collectives * latency`` (s)."""
    missing = set(bytes_by_axis) - set(links)
    if missing:
        raise ValueError(f"no Link given for mesh axes {sorted(missing)}; pass links="
                         f"{{axis: Link(bandwidth, latency)}} for every axis")
    return sum(links[a].step(0) * collectives_by_axis.get(a, 0) + b / links[a].bandwidth
               for a, b in bytes_by_axis.items())


def overlapped_time(bytes_by_axis: Dict[str, float], hops_by_axis: Dict[str, int],
                    links: Dict[str, Link]) -> float:
    """One phase whose mesh axes move their bytes concurrently: the slowest axis's
    ``hops * latency + bytes / bandwidth`` (s)."""
    missing = set(bytes_by_axis) - set(links)
    if missing:
        raise ValueError(f"no Link given for mesh axes {sorted(missing)}; pass links="
                         f"{{axis: Link(bandwidth, latency)}} for every axis")
    return max((links[a].latency * hops_by_axis.get(a, 0) + b / links[a].bandwidth
                for a, b in bytes_by_axis.items()), default=0.0)


def double_ring_time(shape, axes: Dict[str, int], links: Dict[str, Link], *,
                     backward: str = "q", chains=None) -> float:
    """Forward + backward communication time (s) of ``strategy="double_ring"``: the
    bytes ``costs.bytes_per_axis`` counts, both axes overlapped in each phase (BurstEngine
    Fig. 5).  ``shape``: ``costs.AttnShape``; ``axes``: ``{outer: No, inner: Ni}``;
    ``chains``: ``schedule.DoubleRingSchedule.chains()`` (default: the whole double ring).
    A hop's latency is paid once per hop (the arrays of a hop travel together), and
    each accumulator chain's hop home once more in the backward."""
    outer, inner = axes
    No, Ni = axes[outer], axes[inner]
    b = bytes_per_axis("double_ring", shape, axes, backward=backward, chains=chains)
    oc, ic = chains if chains is not None else (None, None)
    s = DoubleRingShape(No, Ni, shape.batch, shape.tokens(No * Ni), shape.q_heads,
                        shape.kv_heads, shape.head_dim, shape.itemsize, shape.has_segments,
                        oc, ic)
    (ho, hi), (co, ci) = s.hops(), s.chain_count()
    fwd = overlapped_time(b["forward"], {outer: ho, inner: hi}, links)
    bwd = overlapped_time(b["backward"], {outer: ho + co, inner: hi + ci}, links)
    return fwd + bwd
