"""Token layouts: which global positions each device of the sequence axis holds.

With ``G`` devices and ``S`` tokens (``T = S / G`` per device):

* ``"contiguous"``: device ``i`` holds tokens ``[i*T, (i+1)*T)``.
* ``"zigzag"`` (BurstEngine Eq. 11; DistFlashAttn §3.2): the sequence is cut into ``2G``
  chunks of ``T/2`` tokens and device ``i`` holds chunks ``i`` and ``2G-1-i``, so with a
  causal mask every device has the same amount of work.  Needs ``S % (2G) == 0``.
* ``"striped"`` (BurstEngine Eq. 13): token ``t`` lives on device ``t mod G``.

Inside a device, tokens are in increasing position order in every layout.  The ring
computes any device's positions from its index, so positions never travel.
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp

LAYOUTS = ("contiguous", "zigzag", "striped")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout={layout!r}; choose one of {LAYOUTS}")


def check_divisible(layout: str, seq_len: int, num_shards: int) -> None:
    """Raise ``ValueError`` naming the fix when ``seq_len`` cannot be split for ``layout``."""
    check_layout(layout)
    parts = 2 * num_shards if layout == "zigzag" else num_shards
    if seq_len % parts:
        what = (f"2*{num_shards=}" if layout == "zigzag" else f"the number of devices {num_shards}")
        raise ValueError(f"sequence length {seq_len=} must be divisible by {what} for "
                         f"layout={layout!r}; pad the sequence")


def shard_positions(layout: str, shard_index, shard_len: int, num_shards: int, xp=jnp):
    """int32 global positions ``[shard_len]`` of the tokens held by ``shard_index``.

    ``shard_index`` may be traced (``lax.axis_index``); pass ``xp=numpy`` for static use.
    """
    check_layout(layout)
    local = xp.arange(shard_len)
    if layout == "contiguous":
        pos = shard_index * shard_len + local
    elif layout == "striped":
        pos = shard_index + num_shards * local
    else:
        if shard_len % 2:
            raise ValueError(f"layout='zigzag' needs an even number of tokens per device, "
                             f"got {shard_len}")
        half = shard_len // 2
        first = shard_index * half + local[:half]
        second = (2 * num_shards - 1 - shard_index) * half + local[:half]
        pos = xp.concatenate([first, second])
    return pos.astype(xp.int32)


def permutation(layout: str, seq_len: int, num_shards: int) -> np.ndarray:
    """``perm`` such that ``x[perm]`` is ``x`` in layout order (device 0's tokens first)."""
    check_divisible(layout, seq_len, num_shards)
    T = seq_len // num_shards
    return np.concatenate([shard_positions(layout, i, T, num_shards, xp=np)
                           for i in range(num_shards)])


def permute_sequence(x, layout: str, num_shards: int, axis: int = 1):
    """Reorder ``x`` along ``axis`` from natural order into ``layout`` order."""
    if layout == "contiguous":
        check_divisible(layout, x.shape[axis], num_shards)
        return x
    return jnp.take(x, jnp.asarray(permutation(layout, x.shape[axis], num_shards)), axis=axis)


def unpermute_sequence(x, layout: str, num_shards: int, axis: int = 1):
    """Inverse of ``permute_sequence``: from ``layout`` order back to natural order."""
    if layout == "contiguous":
        check_divisible(layout, x.shape[axis], num_shards)
        return x
    inv = np.argsort(permutation(layout, x.shape[axis], num_shards))
    return jnp.take(x, jnp.asarray(inv), axis=axis)
