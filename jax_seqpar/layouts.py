"""Token layouts: which global positions each device of the sequence axis holds.

With ``G`` devices and ``S`` tokens (``T = S / G`` per device):

* ``"contiguous"``: device ``i`` holds tokens ``[i*T, (i+1)*T)``.
* ``"zigzag"`` (BurstEngine Eq. 11; DistFlashAttn §3.2): the sequence is cut into ``2G``
  chunks of ``T/2`` tokens and device ``i`` holds chunks ``i`` and ``2G-1-i``, so with a
  causal mask every device has the same amount of work.  Needs ``S % (2G) == 0``.
* ``"striped"`` (BurstEngine Eq. 13): token ``t`` lives on device ``t mod G``.  With
  ``stripe=w`` the tokens are dealt in runs of ``w``: token ``t`` lives on device
  ``(t // w) mod G``.  Block-sparse masks use ``w = block_size / G``, so that every
  device holds an equal share of every mask block (BurstEngine §3.4, Fig. 11).

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


def check_divisible(layout: str, seq_len: int, num_shards: int, stripe: int = 1) -> None:
    """Raise ``ValueError`` naming the fix when ``seq_len`` cannot be split for ``layout``."""
    check_layout(layout)
    parts = {"zigzag": 2 * num_shards, "striped": stripe * num_shards}.get(layout, num_shards)
    if seq_len % parts:
        what = {"zigzag": f"2*{num_shards=}",
                "striped": f"{stripe=} x {num_shards=}"}.get(
            layout, f"the number of devices {num_shards}")
        raise ValueError(f"sequence length {seq_len=} must be divisible by {what} for "
                         f"layout={layout!r}; pad the sequence")


def shard_positions(layout: str, shard_index, shard_len: int, num_shards: int, xp=jnp,
                    stripe: int = 1):
    """int32 global positions ``[shard_len]`` of the tokens held by ``shard_index``.

    ``shard_index`` may be traced (``lax.axis_index``); pass ``xp=numpy`` for static use.
    """
    check_layout(layout)
    local = xp.arange(shard_len)
    if layout == "contiguous":
        pos = shard_index * shard_len + local
    elif layout == "striped":
        if shard_len % stripe:
            raise ValueError(f"{stripe=} must divide the tokens per device ({shard_len})")
        pos = ((local // stripe) * num_shards + shard_index) * stripe + local % stripe
    else:
        if shard_len % 2:
            raise ValueError(f"layout='zigzag' needs an even number of tokens per device, "
                             f"got {shard_len}")
        half = shard_len // 2
        first = shard_index * half + local[:half]
        second = (2 * num_shards - 1 - shard_index) * half + local[:half]
        pos = xp.concatenate([first, second])
    return pos.astype(xp.int32)


def permutation(layout: str, seq_len: int, num_shards: int, stripe: int = 1) -> np.ndarray:
    """``perm`` such that ``x[perm]`` is ``x`` in layout order (device 0's tokens first)."""
    check_divisible(layout, seq_len, num_shards, stripe)
    T = seq_len // num_shards
    return np.concatenate([shard_positions(layout, i, T, num_shards, xp=np, stripe=stripe)
                           for i in range(num_shards)])


def permute_sequence(x, layout: str, num_shards: int, axis: int = 1, stripe: int = 1):
    """Reorder ``x`` along ``axis`` from natural order into ``layout`` order."""
    perm = permutation(layout, x.shape[axis], num_shards, stripe)
    return x if layout == "contiguous" else jnp.take(x, jnp.asarray(perm), axis=axis)


def unpermute_sequence(x, layout: str, num_shards: int, axis: int = 1, stripe: int = 1):
    """Inverse of ``permute_sequence``: from ``layout`` order back to natural order."""
    inv = np.argsort(permutation(layout, x.shape[axis], num_shards, stripe))
    return x if layout == "contiguous" else jnp.take(x, jnp.asarray(inv), axis=axis)
