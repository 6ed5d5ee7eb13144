"""Attention masks as predicates on global token positions.

A mask never looks at array indices, only at the *global* position of each query and
key (and, for packed documents, their segment ids).  The same predicate therefore
serves every ring step and every token layout: a device that holds keys from another
device simply evaluates the predicate on those keys' positions.

``window`` follows ``jax.nn.dot_product_attention(local_window_size=...)``: with
``window=(left, right)`` query ``i`` sees key ``j`` iff ``i - left <= j <= i + right``;
``causal=True`` additionally cuts the right side at ``i``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

import jax.numpy as jnp

WindowArg = Union[None, int, Tuple[int, int]]


def normalize_window(window: WindowArg) -> Optional[Tuple[int, int]]:
    """Turn ``window`` (None, int w, or (left, right)) into None or a (left, right) pair."""
    if window is None:
        return None
    if isinstance(window, bool):
        raise TypeError(f"window={window!r} must be None, an int or a (left, right) pair of ints")
    if isinstance(window, int):
        window = (window, window)
    try:
        left, right = window
    except (TypeError, ValueError):
        raise TypeError(
            f"window={window!r} must be None, an int or a (left, right) pair of ints") from None
    for side, val in (("left", left), ("right", right)):
        if isinstance(val, bool) or not isinstance(val, int):
            raise TypeError(f"window {side} side {val!r} must be an int")
        if val < 0:
            raise ValueError(f"window={window!r}: both sides must be >= 0")
    return (int(left), int(right))


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """The static part of a mask: causal flag and sliding window (left, right).

    Segment ids are data, not configuration, so they are passed to the kernels
    as arrays next to the positions.
    """

    causal: bool = False
    window: Optional[Tuple[int, int]] = None

    def __post_init__(self):
        object.__setattr__(self, "window", normalize_window(self.window))
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal={self.causal!r} must be a bool")

    @property
    def right_limit(self) -> Optional[int]:
        """Largest allowed ``k - q`` (None: unbounded)."""
        lim = None if self.window is None else self.window[1]
        if self.causal:
            lim = 0 if lim is None else min(lim, 0)
        return lim

    @property
    def left_limit(self) -> Optional[int]:
        """Largest allowed ``q - k`` (None: unbounded)."""
        return None if self.window is None else self.window[0]

    @property
    def is_dense(self) -> bool:
        return self.right_limit is None and self.left_limit is None

    def visible(self, q_pos, kv_pos, q_seg=None, kv_seg=None):
        """Boolean visibility of each (query, key) pair.

        ``q_pos`` ``[..., Tq]`` and ``kv_pos`` ``[..., Tk]`` broadcast to ``[..., Tq, Tk]``.
        Segment ids (same leading shape) restrict attention to equal ids.
        """
        diff = kv_pos[..., None, :] - q_pos[..., :, None]  # k - q
        ok = jnp.ones(diff.shape, dtype=bool)
        if self.right_limit is not None:
            ok = ok & (diff <= self.right_limit)
        if self.left_limit is not None:
            ok = ok & (-diff <= self.left_limit)
        if q_seg is not None:
            ok = ok & (q_seg[..., :, None] == kv_seg[..., None, :])
        return ok

    def tile_may_be_visible(self, q_lo, q_hi, kv_lo, kv_hi):
        """False only when position bounds *prove* a tile fully masked.

        ``[q_lo, q_hi]`` and ``[kv_lo, kv_hi]`` bound the positions in the tile (scalars,
        possibly traced).  Segment ids are not used here: skipping is conservative.
        """
        ok = True  # works for Python/NumPy bounds (static schedules) and traced ones
        if self.right_limit is not None:  # need some k - q <= right: kv_lo - q_hi <= right
            ok = ok & (kv_lo - q_hi <= self.right_limit)
        if self.left_limit is not None:  # need some q - k <= left: q_lo - kv_hi <= left
            ok = ok & (q_lo - kv_hi <= self.left_limit)
        return ok
