"""Static ring schedules: which ring steps any device needs, and tiles per device.

Token positions are a fixed function of (layout, device, T, G), so which
(query shard, key shard) pairs can have a visible entry is known at trace time.  A ring
step at offset ``d`` brings device ``i`` the key/value block of device ``(i - d) mod G``.
``ring_schedule`` finds the fewest hops that reach every needed offset: ``L`` hops
forward (offsets ``1..L``) and ``R`` hops backward (offsets ``G-1 .. G-R``, i.e. the
right-hand neighbours).  A dense or causal mask needs the full ring (``L = G - 1``); a
sliding window of ``w`` tokens needs about ``ceil(w / T)`` hops on its side.

``tile_counts`` reports how many (query block, key block) tiles each device computes,
counted from positions with the same skip test as the kernels (no timing): the measure
of causal load balance (DistFlashAttn §3.2; BurstEngine §3.4).

``double_ring_schedule`` does the same for the double ring on a ``nodes x local`` mesh
(BurstEngine §3.1, Fig. 4): which inter-node rounds, and which intra-node hops in each.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_seqpar.layouts import shard_positions
from jax_seqpar.masks import MaskSpec


@dataclasses.dataclass(frozen=True)
class RingSchedule:
    """``forward`` hops reach offsets 1..forward; ``backward`` hops offsets G-1..G-backward."""

    num_devices: int
    forward: int
    backward: int

    @property
    def hops(self) -> int:
        return self.forward + self.backward

    def chains(self):
        """``(direction, hops)`` for each non-empty chain; direction +1 sends to i + 1."""
        return [(d, n) for d, n in ((1, self.forward), (-1, self.backward)) if n > 0]


def _bounds(layout, i, T, G, stripe):
    p = shard_positions(layout, i, T, G, xp=np, stripe=stripe)
    return int(p.min()), int(p.max())


def needed_offsets(layout: str, mask: MaskSpec, T: int, G: int, stripe: int = 1) -> set:
    """Offsets ``d`` (``1 <= d < G``) at which some device may see some key."""
    out = set()
    for d in range(1, G):
        for i in range(G):
            qlo, qhi = _bounds(layout, i, T, G, stripe)
            klo, khi = _bounds(layout, (i - d) % G, T, G, stripe)
            if mask.tile_may_be_visible(qlo, qhi, klo, khi):
                out.add(d)
                break
    return out


def ring_schedule(layout: str, mask: MaskSpec, T: int, G: int, stripe: int = 1) -> RingSchedule:
    """The shortest two-sided ring that visits every needed offset."""
    return shortest_chains(needed_offsets(layout, mask, T, G, stripe), G)


def shortest_chains(need, G: int) -> RingSchedule:
    """The fewest hops (``L`` forward, ``R`` backward) that reach every offset in ``need``
    (offsets ``1 <= d < G``; ``L`` hops reach ``1..L``, ``R`` hops reach ``G-R..G-1``)."""
    if not need:
        return RingSchedule(G, 0, 0)
    best = (G - 1, 0)
    for L in range(G):
        rest = [d for d in need if d > L]
        R = (G - min(rest)) if rest else 0
        if L + R < sum(best):
            best = (L, R)
    return RingSchedule(G, *best)


@dataclasses.dataclass(frozen=True)
class DoubleRingSchedule:
    """Which rounds and intra-node hops a double ring makes (``double_ring.py``).

    Device ``(n, l)`` (node ``n`` of ``nodes``, local index ``l`` of ``local``) holds
    shard ``n * local + l``.  At *offset* ``(a, b)`` it meets the key/value block of
    device ``((n - a) mod nodes, (l - b) mod local)``: round ``a`` of the inter-node ring
    (``outer``), hop ``b`` of that round's intra-node ring (``intra(a)``).  ``need`` holds
    the offsets at which some device may see some key (``(0, 0)``, its own block,
    always), so a ring visits only those rounds and, in each, only as far as needed.
    """

    nodes: int
    local: int
    need: frozenset  # {(a, b)}: a in [0, nodes), b in [0, local)
    outer: RingSchedule

    def needs(self, a: int, b: int) -> bool:
        return (a % self.nodes, b % self.local) in self.need

    def rounds(self):
        """Offsets ``a`` of the rounds visited: ``0``, then those of each outer chain."""
        return [0] + [(d * h) % self.nodes for d, n in self.outer.chains()
                      for h in range(1, n + 1)]

    def intra(self, a: int) -> RingSchedule:
        """The intra-node hops of round ``a``."""
        a %= self.nodes
        return shortest_chains({b for r, b in self.need if r == a and b}, self.local)

    def chains(self):
        """``(outer chains, intra chains of each visited round)``: the hop counts that fix
        the traffic (``costs.DoubleRingShape``)."""
        return (tuple(n for _, n in self.outer.chains()),
                tuple(tuple(n for _, n in self.intra(a).chains()) for a in self.rounds()))


def double_ring_schedule(layout: str, mask: MaskSpec, T: int, nodes: int, local: int,
                         stripe: int = 1) -> DoubleRingSchedule:
    """The rounds and hops of a double ring over ``nodes x local`` devices, ``T`` tokens
    each, from position bounds (the test of ``needed_offsets``)."""
    G = nodes * local
    bounds = [_bounds(layout, i, T, G, stripe) for i in range(G)]
    need = {(0, 0)}
    for a in range(nodes):
        for b in range(local):
            if (a, b) == (0, 0):
                continue
            for n in range(nodes):
                for l in range(local):
                    src = ((n - a) % nodes) * local + (l - b) % local
                    if mask.tile_may_be_visible(*bounds[n * local + l], *bounds[src]):
                        need.add((a, b))
                        break
                if (a, b) in need:
                    break
    outer = shortest_chains({a for a, _ in need if a}, nodes)
    return DoubleRingSchedule(nodes, local, frozenset(need), outer)


def _blocks(pos: np.ndarray, block: int):
    n = -(-len(pos) // block)
    padded = np.concatenate([pos, np.full(n * block - len(pos), pos[-1])])
    b = padded.reshape(n, block)
    return b.min(axis=1), b.max(axis=1)


def tile_counts(layout: str, mask: MaskSpec, seq_len: int, num_devices: int,
                block_q: int = 512, block_k: int = 512, stripe: int = 1) -> np.ndarray:
    """Tiles of ``block_q x block_k`` each device computes over the whole ring (forward).

    A tile counts unless its position bounds prove it fully masked -- the kernels' rule.
    """
    G = num_devices
    T = seq_len // G
    bq, bk = min(block_q, T), min(block_k, T)
    sched = ring_schedule(layout, mask, T, G, stripe)
    offsets = [0] + list(range(1, sched.forward + 1)) + [G - r for r in range(1, sched.backward + 1)]
    counts = np.zeros(G, np.int64)
    for i in range(G):
        qlo, qhi = _blocks(shard_positions(layout, i, T, G, xp=np, stripe=stripe), bq)
        for d in offsets:
            klo, khi = _blocks(shard_positions(layout, (i - d) % G, T, G, xp=np, stripe=stripe), bk)
            vis = mask.tile_may_be_visible(qlo[:, None], qhi[:, None], klo[None, :], khi[None, :])
            counts[i] += int(np.broadcast_to(vis, (len(qlo), len(klo))).sum())
    return counts
