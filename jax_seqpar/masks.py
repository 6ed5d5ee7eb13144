"""Attention masks as predicates on global token positions.

A mask never looks at array indices, only at the *global* position of each query and
key (and, for packed documents, their segment ids).  The same predicate therefore
serves every ring step and every token layout: a device that holds keys from another
device simply evaluates the predicate on those keys' positions.

``window`` follows ``jax.nn.dot_product_attention(local_window_size=...)``: with
``window=(left, right)`` query ``i`` sees key ``j`` iff ``i - left <= j <= i + right``;
``causal=True`` additionally cuts the right side at ``i``.

``BlockMask`` is block-sparse attention (BurstEngine §3.4, Fig. 11): the sequence is cut
into blocks of ``block_size`` tokens and query block ``a`` sees key block ``b`` iff
``table[a, b]``.  All parts combine with AND.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

import jax.numpy as jnp
import numpy as np

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


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMask:
    """A static boolean ``[S / block_size, S / block_size]`` table of visible block pairs.

    Hashable (by content), so it can sit in a static configuration.
    """

    table: np.ndarray
    block_size: int

    def __post_init__(self):
        t = np.asarray(self.table)
        if t.ndim != 2 or t.shape[0] != t.shape[1]:
            raise ValueError(f"block_mask must be a square [S/b, S/b] boolean array, "
                             f"got shape {t.shape}")
        if t.dtype != np.bool_:
            raise TypeError(f"block_mask must be boolean, got dtype {t.dtype}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) \
                or self.block_size < 1:
            raise ValueError(f"block_size={self.block_size!r} must be a positive int")
        t = t.copy()
        t.setflags(write=False)
        object.__setattr__(self, "table", t)
        # summed-area table: sat[a, b] = number of True in table[:a, :b]
        sat = np.zeros((t.shape[0] + 1, t.shape[1] + 1), np.int32)
        sat[1:, 1:] = t.astype(np.int32).cumsum(0).cumsum(1)
        object.__setattr__(self, "_sat", sat)

    @property
    def num_blocks(self) -> int:
        return self.table.shape[0]

    def __hash__(self):
        return hash((self.block_size, self.table.shape, self.table.tobytes()))

    def __eq__(self, other):
        return (isinstance(other, BlockMask) and self.block_size == other.block_size
                and np.array_equal(self.table, other.table))

    def visible(self, q_pos, kv_pos):
        """``table[q_pos // b, kv_pos // b]`` broadcast to ``[..., Tq, Tk]``."""
        t = jnp.asarray(self.table)
        return t[(q_pos // self.block_size)[..., :, None], (kv_pos // self.block_size)[..., None, :]]

    def any_visible(self, q_lo, q_hi, kv_lo, kv_hi, xp=jnp):
        """Whether any block pair in the position ranges is visible (summed-area lookup)."""
        sat = xp.asarray(self._sat)
        b = self.block_size
        a0, a1, b0, b1 = q_lo // b, q_hi // b + 1, kv_lo // b, kv_hi // b + 1
        return (sat[a1, b1] - sat[a0, b1] - sat[a1, b0] + sat[a0, b0]) > 0


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """The static part of a mask: causal flag, sliding window (left, right), block mask.

    Segment ids are data, not configuration, so they are passed to the kernels
    as arrays next to the positions.
    """

    causal: bool = False
    window: Optional[Tuple[int, int]] = None
    block_mask: Optional[BlockMask] = None

    def __post_init__(self):
        object.__setattr__(self, "window", normalize_window(self.window))
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal={self.causal!r} must be a bool")
        if self.block_mask is not None and not isinstance(self.block_mask, BlockMask):
            raise TypeError(f"block_mask must be a BlockMask, got {type(self.block_mask).__name__}")

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
        """True when no tile can ever be skipped (no causal, window or block mask)."""
        return self.right_limit is None and self.left_limit is None and self.block_mask is None

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
        if self.block_mask is not None:
            ok = ok & self.block_mask.visible(q_pos, kv_pos)
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
        if self.block_mask is not None:
            xp = np if isinstance(q_lo, (int, np.integer, np.ndarray)) else jnp
            ok = ok & self.block_mask.any_visible(q_lo, q_hi, kv_lo, kv_hi, xp=xp)
        return ok

    def tile_fully_visible(self, q_lo, q_hi, kv_lo, kv_hi):
        """True only when position bounds *prove* every pair of a tile visible (so a
        kernel may skip evaluating the mask).  Block masks and segments are not used:
        with a block mask this is always False."""
        if self.block_mask is not None:
            return False
        ok = True
        if self.right_limit is not None:  # every k - q <= right: kv_hi - q_lo <= right
            ok = ok & (kv_hi - q_lo <= self.right_limit)
        if self.left_limit is not None:  # every q - k <= left: q_hi - kv_lo <= left
            ok = ok & (q_hi - kv_lo <= self.left_limit)
        return ok
