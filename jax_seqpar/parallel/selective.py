"""Ring attention for sequence-level selective checkpointing, per device (BurstEngine §3.2).

BurstEngine §3.2: under gradient checkpointing, the attention of the *later* part of a
sequence is the expensive part to recompute (with a causal mask a query at position ``i``
sees ``i + 1`` keys), while storing it costs the same per token as storing the earlier
part.  So store the later part and recompute only the earlier one.

Here the forward computes the attention of each shard's query rows in two groups, the
first half and the second half of the shard, each by its own pass along the ring
(``ring._ring_forward`` with ``half``; XLA merges the two passes' identical key/value
transfers).  Under the causal contiguous and zigzag layouts each half takes exactly its
visible part of every device pair with mask-free kernel calls (``pairs._half_fwd``), so
the two passes together do the work of one.  The later group's ``(o, lse)`` are tagged
``ATTN_OUT_LATE`` / ``ATTN_LSE_LATE`` with ``checkpoint_name``; the concatenated
``(o, lse)`` are tagged ``ATTN_OUT`` / ``ATTN_LSE`` like the plain ring's.  Inside
``jax.checkpoint`` with ``jax_seqpar.layers.remat.seq_selective_policy()``, the backward keeps
the saved later rows and re-runs the ring pass of the earlier rows only; the backward
itself is the plain ring's (``backward="kv"`` or ``"q"``) on the full ``(o, lse)``.

With ``layout="zigzag"`` (or ``"striped"``) the first half of every shard is exactly the
first half of the sequence, so under a causal mask the recomputed rows cost a quarter of
the attention forward: ``(S/2)^2 / 2`` of ``S^2 / 2`` query-key pairs.  With
``"contiguous"`` every device splits its own block, which saves less.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jax_seqpar.parallel import ring
from jax_seqpar.parallel.common import ATTN_LSE, ATTN_OUT, AttnConfig, axis_size
from jax_seqpar.parallel.costs import choose_backward

#: ``checkpoint_name`` tags of the later half of each shard's rows.
ATTN_OUT_LATE = "seqpar_attn_out_late"
ATTN_LSE_LATE = "seqpar_attn_lse_late"
#: ``named_scope`` of the two row groups' ring passes (profiles, HLO ``op_name``).
EARLY_SCOPE = "seqpar_rows_early"
LATE_SCOPE = "seqpar_rows_late"


def selective_ring_attention_with_config(cfg: AttnConfig, q, k, v, segment_ids=None):
    """Same result as ``ring.ring_attention_with_config``; the forward computes the
    earlier and the later half of this shard's query rows as separate values."""
    T = q.shape[1]
    if T % 2:
        raise ValueError(f"sequence-selective checkpointing splits each shard in halves; "
                         f"the {T} tokens per device must be even")
    if cfg.backward == "auto":
        shape = ring.ring_shape(cfg, q, k, segment_ids, axis_size(cfg.axis_name))
        cfg = dataclasses.replace(cfg, backward=choose_backward(shape).scheme)
    return _selective(cfg, q, k, v, segment_ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _selective(cfg: AttnConfig, q, k, v, seg):
    return _selective_fwd(cfg, q, k, v, seg)[0]


def _selective_fwd(cfg: AttnConfig, q, k, v, seg):
    with jax.named_scope(EARLY_SCOPE):
        o1, lse1 = ring._ring_forward(cfg, q, k, v, seg, half=0)
    with jax.named_scope(LATE_SCOPE):
        o2, lse2 = ring._ring_forward(cfg, q, k, v, seg, half=1)
    o2 = checkpoint_name(o2.astype(q.dtype), ATTN_OUT_LATE)
    lse2 = checkpoint_name(lse2, ATTN_LSE_LATE)
    o = checkpoint_name(jnp.concatenate([o1.astype(q.dtype), o2], axis=1), ATTN_OUT)
    lse = checkpoint_name(jnp.concatenate([lse1, lse2], axis=-1), ATTN_LSE)
    return o, (q, k, v, seg, o, lse)


_selective.defvjp(_selective_fwd, ring._ring_bwd)
