"""Token layouts: which global positions each device of the sequence axis holds.

Only ``"contiguous"`` exists so far: device ``i`` of ``G`` holds tokens
``[i * T, (i + 1) * T)`` with ``T = S / G``.  The ring computes the positions of any
device's block locally from its index, so positions never travel over the network.
"""

from __future__ import annotations

import jax.numpy as jnp

LAYOUTS = ("contiguous",)
#: Layouts that later work will add (they raise NotImplementedError until then).
PLANNED_LAYOUTS = ("zigzag", "striped")


def check_layout(layout: str) -> None:
    if layout in LAYOUTS:
        return
    if layout in PLANNED_LAYOUTS:
        raise NotImplementedError(f"layout={layout!r} is not implemented yet; use 'contiguous'")
    raise ValueError(f"unknown layout={layout!r}; choose one of {LAYOUTS + PLANNED_LAYOUTS}")


def shard_positions(layout: str, shard_index, shard_len: int, num_shards: int):
    """int32 global positions ``[shard_len]`` of the tokens held by ``shard_index``.

    ``shard_index`` may be traced (e.g. ``lax.axis_index``).
    """
    check_layout(layout)
    del num_shards  # contiguous does not need it; zigzag/striped will
    return (shard_index * shard_len + jnp.arange(shard_len)).astype(jnp.int32)


def shard_bounds(layout: str, shard_index, shard_len: int, num_shards: int):
    """(lowest, highest) global position held by ``shard_index``."""
    pos = shard_positions(layout, shard_index, shard_len, num_shards)
    return pos.min(), pos.max()
