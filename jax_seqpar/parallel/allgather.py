"""All-gather-KV attention, per device (call inside ``shard_map``): the baseline.

Every device gathers the whole K and V (``all_gather``), then attends its query block to
all of it with the local kernel.  Simple, but each device holds ``O(S)`` keys and values;
ring attention holds ``O(S / G)``.  The backward of ``all_gather`` is a reduce-scatter
of dK and dV, which JAX derives.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from jax_seqpar.layouts import shard_positions
from jax_seqpar.masks import WindowArg
from jax_seqpar.parallel.common import AttnConfig, axis_size, make_config
from jax_seqpar.parallel.local import local_attention


def allgather_attention(
    q: Float[Array, "B T Hq D"],
    k: Float[Array, "B T Hkv D"],
    v: Float[Array, "B T Hkv D"],
    segment_ids: Optional[Int[Array, "B T"]] = None,
    *,
    axis_name="sp",
    causal: bool = False,
    window: WindowArg = None,
    scale: Optional[float] = None,
    block_mask=None,
    layout: str = "contiguous",
    stripe: int = 1,
    backward: str = "auto",
    kernel="auto",
) -> Float[Array, "B T Hq D"]:
    """Same signature and result as ``ring_attention``; ``backward`` has no effect here."""
    cfg = make_config(q, k, axis_name=axis_name, causal=causal, window=window,
                      segment_ids=segment_ids, scale=scale, layout=layout,
                      backward=backward, kernel=kernel, block_mask=block_mask, stripe=stripe)
    return allgather_attention_with_config(cfg, q, k, v, segment_ids)


def allgather_attention_with_config(cfg: AttnConfig, q, k, v, segment_ids=None):
    T = q.shape[1]
    G = axis_size(cfg.axis_name)
    idx = lax.axis_index(cfg.axis_name)
    gather = lambda x: lax.all_gather(x, cfg.axis_name, axis=1, tiled=True)  # noqa: E731
    k_all, v_all = gather(k), gather(v)
    seg_all = None if segment_ids is None else gather(segment_ids)
    q_pos = shard_positions(cfg.layout, idx, T, G, stripe=cfg.stripe)
    kv_pos = jnp.concatenate([shard_positions(cfg.layout, j, T, G, stripe=cfg.stripe)
                              for j in range(G)])
    return local_attention(cfg, q, k_all, v_all, q_pos, kv_pos, segment_ids, seg_all)
