"""Communication volume of the ring schemes, and the automatic backward choice.

Every formula counts the bytes **one device sends** in one call, hop by hop, exactly as
``parallel/ring.py`` moves them; ``tests/test_burst.py`` checks them to the byte against
the compiled program (``jax_seqpar.runtime.comm``).  Notation: ``G`` devices, ``T = S / G`` tokens
per device, batch ``B``, head dim ``D``, ``Hq`` query heads, ``Hkv`` key/value heads,
``e`` bytes per input element, float32 accumulators and row statistics (4 B).  The ring
runs in chains of hops (``schedule.ring_schedule``): one chain of ``G - 1`` hops for
dense and causal masks, shorter chains for sliding windows; ``H = sum(chains)``.

* forward: K and V make ``H`` hops: ``H * 2*B*T*Hkv*D*e``.
* ``backward="kv"`` (Ring Attention): K, V make ``H`` hops.  Each chain of ``n`` hops
  carries a dK, dV accumulator, created at the first device it visits, for ``n - 1``
  hops in float32, then one direct hop home in the input dtype:
  ``H * 2*B*T*Hkv*D*e + sum_chains ((n-1) * 2*B*T*Hkv*D*4 + 2*B*T*Hkv*D*e)``.
* ``backward="q"`` (BurstAttention Alg. 2, lines 3-16): Q and dO make ``H`` hops with the
  float32 row statistics D = rowsum(dO * O) and lse; the dQ accumulator goes as above:
  ``H * (2*B*T*Hq*D*e + 2*B*Hq*T*4) + sum_chains ((n-1) * B*T*Hq*D*4 + B*T*Hq*D*e)``.
* segment ids (int32, ``B*T*4``) travel with K, V (forward, "kv") or with Q ("q").
* with a local kernel whose backward needs the output ``o`` (cuDNN), "q" carries ``O``
  (``B*T*Hq*D*e``) in place of D (``B*Hq*T*4``): ``RingShape.o_travels``.

Per token and head and full ring, that is ``4*D`` elements for "kv" against ``3*D + 2``
for "q" (BurstAttention §3.3, Table 1): the Burst scheme moves ~25% less for MHA.  With
GQA the K/V side shrinks by ``g = Hq / Hkv`` and "kv" wins for ``g >= 2``.

(Casting before the hop home is what XLA's GPU compiler does by itself when the gradient
is cast right after it; doing it explicitly makes the volume the same on every backend.
The CPU backend sends bfloat16 collectives as float32, so byte-exact comparisons on CPU
use float32 inputs.)
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

ACC_BYTES = 4  # float32 gradient accumulators and row statistics


@dataclasses.dataclass(frozen=True)
class RingShape:
    """Per-device shapes that fix the traffic of a ring call."""

    num_devices: int
    batch: int
    tokens: int          # per device (T = S / G)
    q_heads: int
    kv_heads: int
    head_dim: int
    itemsize: int        # bytes per element of q/k/v/dO
    has_segments: bool = False
    chains: Optional[Tuple[int, ...]] = None  # hop chains; None: the full ring (G - 1,)
    o_travels: bool = False  # "q" carries O instead of D (kernels with needs_o)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if f.name not in ("has_segments", "chains", "o_travels") and (not isinstance(val, int) or val < 1):
                raise ValueError(f"{f.name}={val!r} must be a positive int")
        if self.chains is None:
            object.__setattr__(self, "chains", (self.num_devices - 1,) if self.num_devices > 1 else ())
        if any(n < 1 for n in self.chains) or sum(self.chains) > self.num_devices - 1:
            raise ValueError(f"chains={self.chains!r} must be positive hop counts adding up "
                             f"to at most G - 1 = {self.num_devices - 1}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads={self.q_heads} must be a multiple of "
                             f"kv_heads={self.kv_heads}")


def _seg(s: RingShape) -> int:
    return s.batch * s.tokens * 4 if s.has_segments else 0


def _hop(phase: str, s) -> Tuple[int, int]:
    """``(bytes of the block that travels one hop, elements of its float32 accumulator)``
    in ``phase``: ``"forward"``, or the backward scheme ``"kv"`` / ``"q"``."""
    B, T, D = s.batch, s.tokens, s.head_dim
    if phase == "forward":
        return 2 * B * T * s.kv_heads * D * s.itemsize + _seg(s), 0
    if phase == "kv":
        return 2 * B * T * s.kv_heads * D * s.itemsize + _seg(s), 2 * B * T * s.kv_heads * D
    if phase == "q":
        rows = B * T * s.q_heads * D * s.itemsize if s.o_travels else B * s.q_heads * T * ACC_BYTES
        travel = (2 * B * T * s.q_heads * D * s.itemsize + B * s.q_heads * T * ACC_BYTES + rows
                  + _seg(s))
        return travel, B * T * s.q_heads * D
    raise ValueError(f"unknown backward scheme {phase!r}; choose 'kv' or 'q'")


def _chains(chains, travel: int, acc_elems: int, home_itemsize: int) -> int:
    """Bytes of hop chains: each of ``n`` hops moves the block, its accumulator rides
    ``n - 1`` hops in float32 and takes one hop home at ``home_itemsize`` per element."""
    return sum(n * travel + (n - 1) * acc_elems * ACC_BYTES + acc_elems * home_itemsize
               for n in chains if n)


def forward_bytes(s: RingShape) -> int:
    """Bytes one device sends in the ring forward."""
    return _chains(s.chains, _hop("forward", s)[0], 0, 0)


def backward_bytes(scheme: str, s: RingShape) -> int:
    """Bytes one device sends in the ring backward with ``scheme`` in {"kv", "q"}."""
    if scheme not in ("kv", "q"):
        raise ValueError(f"unknown backward scheme {scheme!r}; choose 'kv' or 'q'")
    if isinstance(s, DoubleRingShape):
        return sum(double_ring_bytes(scheme, s))
    return _chains(s.chains, *_hop(scheme, s), s.itemsize)


@dataclasses.dataclass(frozen=True)
class DoubleRingShape:
    """Per-device shapes and hop chains of a double-ring call (``double_ring.py``):
    ``nodes x local`` devices, ``outer_chains`` the inter-node chains of rounds,
    ``intra_chains`` the intra-node chains of each visited round, round 0 first
    (``schedule.DoubleRingSchedule.chains``; default: the whole double ring)."""

    nodes: int
    local: int
    batch: int
    tokens: int          # per device (T = S / (nodes * local))
    q_heads: int
    kv_heads: int
    head_dim: int
    itemsize: int
    has_segments: bool = False
    outer_chains: Optional[Tuple[int, ...]] = None
    intra_chains: Optional[Tuple[Tuple[int, ...], ...]] = None
    o_travels: bool = False

    def __post_init__(self):
        for f in ("nodes", "local", "batch", "tokens", "q_heads", "kv_heads", "head_dim",
                  "itemsize"):
            val = getattr(self, f)
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{f}={val!r} must be a positive int")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads={self.q_heads} must be a multiple of "
                             f"kv_heads={self.kv_heads}")
        full = (self.local - 1,) if self.local > 1 else ()
        if self.outer_chains is None:
            object.__setattr__(self, "outer_chains",
                               (self.nodes - 1,) if self.nodes > 1 else ())
        if self.intra_chains is None:
            object.__setattr__(self, "intra_chains",
                               (full,) * (1 + sum(self.outer_chains)))
        if len(self.intra_chains) != 1 + sum(self.outer_chains):
            raise ValueError(f"intra_chains={self.intra_chains!r} must list one round per "
                             f"visited round: 1 + sum(outer_chains) = "
                             f"{1 + sum(self.outer_chains)}")

    @property
    def num_devices(self) -> int:
        return self.nodes * self.local

    def hops(self) -> Tuple[int, int]:
        """``(inter-node, intra-node)`` hops of a block (``No - 1``, ``G - No`` in full)."""
        return sum(self.outer_chains), sum(sum(c) for c in self.intra_chains)

    def chain_count(self) -> Tuple[int, int]:
        """``(inter-node, intra-node)`` chains: each ends with one hop home in a backward."""
        return (len([n for n in self.outer_chains if n]),
                sum(len([n for n in c if n]) for c in self.intra_chains))


def double_ring_bytes(phase: str, s: DoubleRingShape) -> Tuple[int, int]:
    """``(outer, inner)`` bytes one device sends in ``phase`` ("forward", "kv", "q").

    Inter-node: the outer chains, their accumulators homed in the input dtype.
    Intra-node: every visited round's chains; round 0's accumulators (this device's own
    block, final) home in the input dtype, the other rounds' in float32 (they join the
    inter-node accumulator).
    """
    travel, acc = _hop(phase, s)
    outer = _chains(s.outer_chains, travel, acc, s.itemsize)
    inner = sum(_chains(c, travel, acc, s.itemsize if r == 0 else ACC_BYTES)
                for r, c in enumerate(s.intra_chains))
    return outer, inner


@dataclasses.dataclass(frozen=True)
class BackwardChoice:
    scheme: str
    reason: str
    kv_bytes: int
    q_bytes: int


def choose_backward(s, *, link_bytes_per_s: Optional[float] = None) -> BackwardChoice:
    """Pick the backward scheme that sends fewer bytes per device (ties go to "kv").

    ``s`` is a ``RingShape`` or a ``DoubleRingShape`` (bytes of both mesh axes added:
    per hop the two schemes' ratio is nearly the same on either axis).

    Both schemes run the same FLOPs over the same links, so a link bandwidth scales
    their transfer times alike: when given, it only adds the estimated time per scheme
    to ``reason`` and does not change the choice.
    """
    kv, q = backward_bytes("kv", s), backward_bytes("q", s)
    scheme = "q" if q < kv else "kv"
    g = s.q_heads // s.kv_heads
    reason = (f"backward={scheme!r}: sends {min(kv, q):,} B per device vs "
              f"{max(kv, q):,} B for {'kv' if scheme == 'q' else 'q'!r} "
              f"(G={s.num_devices}, GQA group g={g}, D={s.head_dim}, itemsize={s.itemsize})")
    if link_bytes_per_s:
        reason += (f"; at {link_bytes_per_s / 1e9:.0f} GB/s: kv {kv / link_bytes_per_s * 1e3:.3f} ms,"
                   f" q {q / link_bytes_per_s * 1e3:.3f} ms")
    return BackwardChoice(scheme, reason, kv, q)


# --------------------------------------------------------------------------------------
# Bytes per mesh axis: every strategy (issue 19)
# --------------------------------------------------------------------------------------
#
# ``G`` devices on the axis, ``S`` tokens, ``T = S / G`` per device; ``e`` bytes per input
# element.  Textbook volumes as ``comm.py`` counts them: an all-gather sends ``(G-1) n``,
# a reduce-scatter and an all-to-all ``(G-1)/G n``, an all-reduce ``2 (G-1)/G n`` for an
# operand of ``n`` bytes on each device.
#
# * allgather: forward gathers K, V (and segment ids): ``(G-1) (2 B T Hkv D e + 4 B T)``;
#   backward reduce-scatters dK, dV ``[B, S, Hkv, D]``: ``(G-1)/G * 2 B S Hkv D e``.
# * tree (``tree.py``): forward gathers Q (and ids), one pmax of lse ``[B, Hq, S]`` f32,
#   one reduce-scatter of ``[B, S, Hq, D+1]`` f32; backward gathers Q, dO, lse, delta
#   (and ids) and reduce-scatters the f32 dQ ``[B, S, Hq, D]``.
# * ulysses (DeepSpeed-Ulysses §3.1): forward all-to-alls Q, K, V in and O out, each
#   device sending ``(G-1)/G`` of them, ``(G-1)/G * B T (2 Hq + 2 Hkv) D e``, and gathers
#   segment ids ``(G-1) 4 B T``; the backward is the transpose: dO in, dQ, dK, dV out,
#   the same ``(G-1)/G * B T (2 Hq + 2 Hkv) D e``.
# * usp (Ulysses over ``inner`` of ``Ni`` devices x ring over ``outer`` of ``No``):
#   the ulysses volumes on ``inner`` with ``T = S / (No Ni)``, and on ``outer`` the ring
#   volumes of a ring of ``No`` devices holding ``S / No`` tokens and ``Hq / Ni``,
#   ``Hkv / Ni`` heads (``forward_bytes`` / ``backward_bytes``).
# * double_ring (BurstEngine §3.1, Fig. 4; ``double_ring.py``) on ``No`` nodes x ``Ni``
#   local devices, ``T = S / (No Ni)``: the ring's hop volumes (``_hop``: a block ``t``
#   and an accumulator of ``a`` float32 elements per hop) on two axes.  With the whole
#   double ring (dense or causal masks) and ``No, Ni >= 2``, per device and call:
#     outer: ``(No-1) t + (No-2) 4a + a e``          (one chain of No-1 rounds)
#     inner: ``No (Ni-1) t + No (Ni-2) 4a + a e + (No-1) 4a``
#            (an intra-node chain of Ni-1 hops in each of the No rounds; the hop home of
#            round 0's accumulator in the input dtype, of the other rounds' in float32)
#   with ``t = 2 B T Hkv D e (+ 4 B T ids)``, ``a = 0`` forward;
#   ``t`` the same and ``a = 2 B T Hkv D`` for backward "kv";
#   ``t = 2 B T Hq D e + 2 * 4 B Hq T (+ ids)``, ``a = B T Hq D`` for backward "q".
#   ``G - No`` intra-node and ``No - 1`` inter-node hops: the 1-D ring's ``G - 1``.
#   Sliding windows shorten the chains (``schedule.double_ring_schedule``).

PHASES = ("forward", "backward")


@dataclasses.dataclass(frozen=True)
class AttnShape:
    """Global shapes of one self-attention call (the sequence ``seq_len`` not yet split)."""

    batch: int
    seq_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    itemsize: int
    has_segments: bool = False

    def tokens(self, num_devices: int) -> int:
        if self.seq_len % num_devices:
            raise ValueError(f"seq_len={self.seq_len} must be divisible by the "
                             f"{num_devices} devices it is split over")
        return self.seq_len // num_devices


def _ids(s: AttnShape, T: int) -> int:
    return s.batch * T * 4 if s.has_segments else 0


def allgather_bytes(s: AttnShape, G: int) -> Dict[str, int]:
    T = s.tokens(G)
    kv = 2 * s.batch * T * s.kv_heads * s.head_dim * s.itemsize
    return {"forward": (G - 1) * (kv + _ids(s, T)), "backward": (G - 1) * kv}


def tree_bytes(s: AttnShape, G: int) -> Dict[str, int]:
    T, B, H, D = s.tokens(G), s.batch, s.q_heads, s.head_dim
    rows = B * H * T * ACC_BYTES  # one float32 per query row on one device
    fwd = ((G - 1) * (B * T * H * D * s.itemsize + _ids(s, T))
           + 2 * (G - 1) * rows                                # pmax of lse [B, H, S]
           + (G - 1) * B * T * H * (D + 1) * ACC_BYTES)        # reduce-scatter [B,S,H,D+1]
    bwd = ((G - 1) * (2 * B * T * H * D * s.itemsize + 2 * rows + _ids(s, T))
           + (G - 1) * B * T * H * D * ACC_BYTES)              # reduce-scatter of dQ
    return {"forward": fwd, "backward": bwd}


def ulysses_bytes(s: AttnShape, G: int) -> Dict[str, int]:
    """Bytes one device sends on the Ulysses axis of ``G`` devices (heads divide by G)."""
    if s.q_heads % G or s.kv_heads % G:
        raise ValueError(f"q_heads={s.q_heads} and kv_heads={s.kv_heads} must be divisible "
                         f"by the {G} devices of the Ulysses axis")
    T = s.tokens(G)
    qkvo = s.batch * T * (2 * s.q_heads + 2 * s.kv_heads) * s.head_dim * s.itemsize
    a2a = (G - 1) * qkvo // G  # exact: the heads divide by G
    return {"forward": a2a + (G - 1) * _ids(s, T), "backward": a2a}


def ring_bytes(s: AttnShape, G: int, backward: str = "kv", chains=None,
               o_travels: bool = False) -> Dict[str, int]:
    shape = RingShape(G, s.batch, s.tokens(G), s.q_heads, s.kv_heads, s.head_dim,
                      s.itemsize, s.has_segments, chains, o_travels)
    return {"forward": forward_bytes(shape), "backward": backward_bytes(backward, shape)}


def bytes_per_axis(strategy: str, s: AttnShape, axes: Dict[str, int], *,
                   backward: str = "kv", chains=None,
                   o_travels: bool = False) -> Dict[str, Dict[str, int]]:
    """``{"forward": {axis: bytes}, "backward": {axis: bytes}}`` one device sends.

    ``axes`` maps mesh axis names to sizes, in ``axis_name`` order: one axis for ring,
    allgather, tree and ulysses, ``{outer: No, inner: Ni}`` for usp and double_ring.
    ``backward`` and ``chains`` (``schedule.ring_schedule``; default the whole ring)
    describe the ring; for double_ring ``chains`` is ``(outer_chains, intra_chains)``
    (``schedule.DoubleRingSchedule.chains``).
    """
    names = tuple(axes)
    if strategy == "double_ring":
        if len(names) != 2:
            raise ValueError(f"double_ring needs axes={{outer: No, inner: Ni}}; got {axes!r}")
        outer, inner = names
        No, Ni = axes[outer], axes[inner]
        oc, ic = chains if chains is not None else (None, None)
        shape = DoubleRingShape(No, Ni, s.batch, s.tokens(No * Ni), s.q_heads, s.kv_heads,
                                s.head_dim, s.itemsize, s.has_segments, oc, ic, o_travels)
        out = {p: double_ring_bytes(ph, shape)
               for p, ph in (("forward", "forward"), ("backward", backward))}
        return {p: {outer: b[0], inner: b[1]} for p, b in out.items()}
    if strategy == "usp":
        if len(names) != 2:
            raise ValueError(f"usp needs axes={{outer: No, inner: Ni}}; got {axes!r}")
        outer, inner = names
        No, Ni = axes[outer], axes[inner]
        inner_shape = dataclasses.replace(s, seq_len=s.seq_len // No)  # one outer block
        if s.seq_len % No:
            raise ValueError(f"seq_len={s.seq_len} must be divisible by {outer}={No}")
        ring_shape = dataclasses.replace(s, q_heads=s.q_heads // Ni, kv_heads=s.kv_heads // Ni)
        u = ulysses_bytes(inner_shape, Ni)
        r = ring_bytes(ring_shape, No, backward, chains, o_travels) if No > 1 else {
            p: 0 for p in PHASES}
        return {p: {outer: r[p], inner: u[p]} for p in PHASES}
    if len(names) != 1:
        raise ValueError(f"strategy={strategy!r} runs on one axis; got axes={axes!r}")
    G = axes[names[0]]
    if strategy == "ring":
        b = ring_bytes(s, G, backward, chains, o_travels) if G > 1 else {p: 0 for p in PHASES}
    elif strategy in ("allgather", "tree", "ulysses"):
        b = {"allgather": allgather_bytes, "tree": tree_bytes,
             "ulysses": ulysses_bytes}[strategy](s, G)
    else:
        raise ValueError(f"unknown strategy={strategy!r} for bytes_per_axis")
    return {p: {names[0]: b[p]} for p in PHASES}
