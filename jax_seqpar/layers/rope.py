"""Rotary position embeddings (RoPE) from integer *global* token positions.

Rotary embeddings (Su et al., "RoFormer", 2021) rotate each pair of channels of a query or
key by an angle proportional to its token's position, so that ``q_i . k_j`` depends on
``i - j`` only.  Under a zigzag or striped layout the ``t``-th row of a shard is not token
``t``: the angle must come from the token's global position, which
``layouts.permutation(layout, S, G)[t]`` gives for row ``t`` of an array in layout order.
Computing the angles from the row index instead would silently give a different model
on every layout.

Channel pairing follows the Llama convention ("rotate half"): channel ``c`` of the first
half pairs with channel ``c + D/2``, with frequency ``theta ** (-2c / D)``.  Angles are
computed in float32 from int32 positions.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

F32 = jnp.float32


def rope_frequencies(head_dim: int, theta: float = 10000.0):
    """``theta ** (-2c / head_dim)`` for ``c = 0 .. head_dim/2 - 1`` (float32)."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim=}")
    if not theta > 0:
        raise ValueError(f"rope_theta={theta!r} must be positive")
    return theta ** (-jnp.arange(0, head_dim, 2, dtype=F32) / head_dim)


def apply_rope(x: Float[Array, "B S H D"], positions: Int[Array, "*B S"],
               theta: float = 10000.0) -> Float[Array, "B S H D"]:
    """Rotate ``x`` ``[B, S, H, D]`` by the angles of ``positions`` (``[S]`` or ``[B, S]``,
    the global position of each row).  Returns ``x.dtype``; the rotation is in float32."""
    B, S, H, D = x.shape
    positions = jnp.asarray(positions)
    if positions.shape not in ((S,), (B, S)):
        raise ValueError(f"positions must have shape [seq]={(S,)} or [batch, seq]={(B, S)}; "
                         f"got {positions.shape}")
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(f"positions.dtype={positions.dtype} must be an integer dtype")
    angles = positions.astype(F32)[..., None] * rope_frequencies(D, theta)  # [*B, S, D/2]
    if angles.ndim == 2:
        angles = angles[None]
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]  # [B|1, S, 1, D/2]
    x1, x2 = jnp.split(x.astype(F32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
