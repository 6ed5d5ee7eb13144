"""Communication volume of the ring schemes, and the automatic backward choice.

Every formula counts the bytes **one device sends** in one call, hop by hop, exactly as
``parallel/ring.py`` moves them; ``tests/test_burst.py`` checks them to the byte against
the compiled program (``jax_seqpar.comm``).  Notation: ``G`` devices, ``T = S / G`` tokens
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
from typing import Optional, Tuple

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


def forward_bytes(s: RingShape) -> int:
    """Bytes one device sends in the ring forward."""
    kv = 2 * s.batch * s.tokens * s.kv_heads * s.head_dim * s.itemsize
    return sum(s.chains) * (kv + _seg(s))


def backward_bytes(scheme: str, s: RingShape) -> int:
    """Bytes one device sends in the ring backward with ``scheme`` in {"kv", "q"}."""
    B, T, D = s.batch, s.tokens, s.head_dim
    if scheme == "kv":
        travel = 2 * B * T * s.kv_heads * D * s.itemsize + _seg(s)
        acc_elems = 2 * B * T * s.kv_heads * D
    elif scheme == "q":
        rows = B * T * s.q_heads * D * s.itemsize if s.o_travels else B * s.q_heads * T * ACC_BYTES
        travel = (2 * B * T * s.q_heads * D * s.itemsize + B * s.q_heads * T * ACC_BYTES + rows
                  + _seg(s))
        acc_elems = B * T * s.q_heads * D
    else:
        raise ValueError(f"unknown backward scheme {scheme!r}; choose 'kv' or 'q'")
    return sum(n * travel + (n - 1) * acc_elems * ACC_BYTES + acc_elems * s.itemsize
               for n in s.chains)


@dataclasses.dataclass(frozen=True)
class BackwardChoice:
    scheme: str
    reason: str
    kv_bytes: int
    q_bytes: int


def choose_backward(s: RingShape, *, link_bytes_per_s: Optional[float] = None) -> BackwardChoice:
    """Pick the backward scheme that sends fewer bytes per device (ties go to "kv").

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
