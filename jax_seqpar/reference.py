"""Dense float32 attention: the oracle every test compares against.

Deliberately simple: it materialises the full ``[B, Hq, Tq, Tk]`` score matrix in
float32, so use it only on test-sized inputs.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jax_seqpar.masks import BlockMask, MaskSpec, WindowArg


def reference_attention(
    q: Float[Array, "B Tq Hq D"],
    k: Float[Array, "B Tk Hkv D"],
    v: Float[Array, "B Tk Hkv D"],
    *,
    causal: bool = False,
    window: WindowArg = None,
    segment_ids: Optional[Int[Array, "B Tq"]] = None,
    kv_segment_ids: Optional[Int[Array, "B Tk"]] = None,
    q_pos: Optional[Int[Array, "Tq"]] = None,
    kv_pos: Optional[Int[Array, "Tk"]] = None,
    scale: Optional[float] = None,
    block_mask=None,
) -> tuple[Float[Array, "B Tq Hq D"], Float[Array, "B Hq Tq"]]:
    """Return ``(out, lse)`` of softmax attention, computed densely in float32.

    ``out[b, i, h] = sum_j softmax_j(scale * q_i . k_j + mask) v_j`` and
    ``lse[b, h, i] = log sum_j exp(scale * q_i . k_j)`` over visible keys.  Positions
    default to ``arange``; ``kv_segment_ids`` defaults to ``segment_ids`` (self-attention).
    Rows with no visible key give ``out = 0`` and ``lse = -inf``.  Query head ``h``
    uses key/value head ``h // (Hq // Hkv)`` (GQA/MQA).
    """
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"{Hq=} must be a multiple of {Hkv=}")
    g = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    q_pos = jnp.arange(Tq) if q_pos is None else q_pos
    kv_pos = jnp.arange(Tk) if kv_pos is None else kv_pos
    if kv_segment_ids is None:
        kv_segment_ids = segment_ids
    qf = q.astype(jnp.float32).reshape(B, Tq, Hkv, g, D)
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, kf, precision=jax.lax.Precision.HIGHEST) * scale
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        table = np.asarray(block_mask)
        block_mask = BlockMask(table, max(Tq, Tk) // table.shape[0])
    mask = MaskSpec(causal=causal, window=window, block_mask=block_mask).visible(
        q_pos[None], kv_pos[None],
        None if segment_ids is None else segment_ids,
        None if kv_segment_ids is None else kv_segment_ids)  # [B or 1, Tq, Tk]
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)  # -inf for fully masked rows
    p = jnp.where(jnp.isfinite(lse)[..., None], jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0)[..., None]), 0.0)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p, vf, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(B, Tq, Hq, D), lse.reshape(B, Hq, Tq)
