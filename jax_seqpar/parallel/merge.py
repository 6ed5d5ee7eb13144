"""Online-softmax merge of partial attention results ``(o, lse)``.

If ``o_a, lse_a`` is attention of a query over key set A and ``o_b, lse_b`` over a
disjoint set B, attention over A u B is

    lse = log(exp(lse_a) + exp(lse_b))
    o   = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b

(Ring Attention / blockwise parallel transformer; BurstAttention Alg. 1, lines 10-12).
Everything is float32.  A set with no visible key has ``lse = -inf`` and contributes
weight 0; if both are empty the result is ``o = 0, lse = -inf`` without NaN.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float


def merge(
    o_a: Float[Array, "B T H D"], lse_a: Float[Array, "B H T"],
    o_b: Float[Array, "B T H D"], lse_b: Float[Array, "B H T"],
) -> tuple[Float[Array, "B T H D"], Float[Array, "B H T"]]:
    """Combine two partial ``(o, lse)`` pairs over disjoint key sets (float32)."""
    m = jnp.maximum(lse_a, lse_b)
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)  # both empty: any finite shift works
    w_a = jnp.exp(lse_a - m_safe)
    w_b = jnp.exp(lse_b - m_safe)
    total = w_a + w_b
    nonempty = total > 0
    total_safe = jnp.where(nonempty, total, 1.0)
    lse = jnp.where(nonempty, m_safe + jnp.log(total_safe), -jnp.inf)

    def rows(w):  # [B, H, T] -> [B, T, H, 1]
        return jnp.swapaxes(w / total_safe, 1, 2)[..., None]

    o = rows(w_a) * o_a.astype(jnp.float32) + rows(w_b) * o_b.astype(jnp.float32)
    return o, lse
