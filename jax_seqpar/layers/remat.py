"""Checkpoint policies for layers that call sequence-parallel attention.

Under ``jax.checkpoint`` (``flax.linen.remat``, ``nnx.remat``) a layer keeps only what its
policy saves and recomputes the rest in the backward.  The attention forward is a ring
pass (communication plus the dominant compute), and its backward needs only the inputs,
the output ``o`` and the row statistics ``lse``; the ring's ``custom_vjp`` tags ``o`` and
``lse`` with ``checkpoint_name`` (``parallel/ring.py``, ``parallel/selective.py``).

* ``remat_aware_policy()`` -- DistFlashAttn §3.3 ("rematerialization-aware checkpointing"):
  save each layer's attention output and lse, so that the backward of a checkpointed
  layer recomputes the cheap projections and MLP but never re-runs the attention forward
  ("we use each checkpoint not only for the recomputation of its subsequent modules but
  also for the backward computation of its preceding FlashAttention module without
  recomputation").  Memory per layer: the layer input plus ``o`` and ``lse``.
* ``seq_selective_policy()`` -- BurstEngine §3.2 ("sequence-level selective
  checkpointing"): save ``o`` and ``lse`` of the *later* half of each shard's rows only and
  recompute the earlier half, whose causal attention is the cheap part.  Needs the
  attention computed by ``seq_selective_attention`` (the layers' ``seq_selective=True``),
  which produces the two halves as separate values.  Memory: the layer input plus half
  of ``o`` and ``lse``; time: a quarter of an attention forward recomputed per layer
  (zigzag or striped layout, causal mask).

* ``"attention_mlp"`` -- the attention output and lse plus the MLP's gate and up
  projections (``MLP_GATE``, ``MLP_UP``): the backward then recomputes only the q/k/v
  projections (and the elementwise SwiGLU), not the two widest matmuls.  Memory per
  layer: the layer input, ``o``, ``lse`` and two ``[S, ffn_dim]`` activations.

``policy_for(mode, offload=True)``: the same names (plus each block's input,
``BLOCK_INPUT``) are **offloaded** to host memory (JAX memory kinds: ``pinned_host``)
in the forward and brought back in the backward, instead of kept on the device
(``jax.checkpoint_policies.save_and_offload_only_these_names``); what the policy does
not name is recomputed as before.  ``policy_for(mode)`` maps the model's ``remat``
option to a policy.
"""

from __future__ import annotations

import collections
from typing import Optional, Tuple, Union

import jax
from jax.extend import core as jcore
from jax.sharding import Mesh

from jax_seqpar import api
from jax_seqpar.layouts import check_divisible
from jax_seqpar.masks import WindowArg
from jax_seqpar.sharding.specs import head_plan, normalize_role, role_size
from jax_seqpar.parallel.common import ATTN_LSE, ATTN_OUT, BWD_SCOPE, FWD_SCOPE, make_config
from jax_seqpar.parallel import ring_common
from jax_seqpar.parallel.selective import (ATTN_LSE_LATE, ATTN_OUT_LATE, EARLY_SCOPE,
                                           LATE_SCOPE)

__all__ = ["ATTN_OUT", "ATTN_LSE", "ATTN_OUT_LATE", "ATTN_LSE_LATE", "BLOCK_INPUT",
           "MLP_GATE", "MLP_UP", "REMAT_MODES",
           "remat_aware_policy", "seq_selective_policy", "policy_for",
           "seq_selective_attention", "ring_transfer_counts"]

#: ``"none"``: no rematerialisation; ``"full"``: save only each layer's input (the usual
#: per-layer checkpointing, which re-runs the attention forward); ``"attention"``:
#: ``remat_aware_policy``; ``"seq_selective"``: ``seq_selective_policy``;
#: ``"attention_mlp"``: ``"attention"`` and the MLP's gate and up projections.
REMAT_MODES = ("none", "full", "attention", "seq_selective", "attention_mlp")

#: Names the model's blocks give their input and the SwiGLU's two projections
#: (``jax.ad_checkpoint.checkpoint_name``) so that policies can save or offload them.
BLOCK_INPUT = "block_input"
MLP_GATE = "mlp_gate"
MLP_UP = "mlp_up"

#: What each mode keeps, as names (the offloading policy moves exactly these).
_SAVED = {"full": (), "attention": (ATTN_OUT, ATTN_LSE),
          "seq_selective": (ATTN_OUT_LATE, ATTN_LSE_LATE)}
_SAVED["attention_mlp"] = _SAVED["attention"] + (MLP_GATE, MLP_UP)


def remat_aware_policy(*extra_names: str):
    """Save the attention output and lse (plus any ``extra_names``), recompute the rest."""
    return jax.checkpoint_policies.save_only_these_names(*_SAVED["attention"], *extra_names)


def seq_selective_policy(*extra_names: str):
    """Save the later half of each shard's attention output and lse, recompute the rest."""
    return jax.checkpoint_policies.save_only_these_names(*_SAVED["seq_selective"],
                                                         *extra_names)


def policy_for(mode: str, offload: bool = False):
    """The ``jax.checkpoint`` policy of a ``REMAT_MODES`` entry (``None`` for "none").

    ``offload=True``: what the mode saves, and each block's input (``BLOCK_INPUT``: the
    model's blocks tag it, so that the backward reads the host copy rather than keeping
    the device one alive), goes to ``pinned_host`` memory in the forward and comes back
    in the backward; nothing else is saved.
    """
    if mode not in REMAT_MODES:
        raise ValueError(f"unknown remat={mode!r}; choose one of {REMAT_MODES}")
    if not isinstance(offload, bool):
        raise TypeError(f"offload={offload!r} must be a bool")
    if mode == "none":
        if offload:
            raise ValueError("offloading residuals needs a remat policy (remat='none' keeps "
                             "every activation on the device); choose one of "
                             f"{REMAT_MODES[1:]}")
        return None
    if offload:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=(),
            names_which_can_be_offloaded=(BLOCK_INPUT,) + _SAVED[mode],
            offload_src="device", offload_dst="pinned_host")
    if mode == "full":
        return jax.checkpoint_policies.nothing_saveable
    return jax.checkpoint_policies.save_only_these_names(*_SAVED[mode])


def seq_selective_attention(q, k, v, *, mesh: Mesh, axis_name: Union[str, Tuple[str, ...]] = "sp",
                            batch_axis=None, head_axis=None, causal: bool = False, window: WindowArg = None,
                            segment_ids=None, layout: str = "contiguous",
                            permuted: bool = False, backward: str = "auto", kernel="auto",
                            scale: Optional[float] = None):
    """``jax_seqpar.attention(strategy="ring", ...)`` whose forward computes the earlier and
    the later half of every shard's query rows separately (``parallel/selective.py``), so
    that ``seq_selective_policy`` can keep the later half.  Same arguments, same result
    (up to float32 rounding); each device's ``S / G`` tokens must be even."""
    if isinstance(axis_name, list):
        axis_name = tuple(axis_name)
    api._validate(q, k, v, segment_ids, mesh, axis_name, "ring", backward, layout,
                  batch_axis, head_axis)
    batch_axis, head_axis = normalize_role(batch_axis), normalize_role(head_axis)
    if not isinstance(permuted, bool):
        raise TypeError(f"permuted={permuted!r} must be a bool")
    G = role_size(mesh, axis_name)
    _, repeats = head_plan(mesh, q.shape[2], k.shape[2], head_axis)
    check_divisible(layout, q.shape[1], G)
    if (q.shape[1] // G) % 2:
        raise ValueError(f"seq_selective_attention splits each shard in halves: the "
                         f"sequence length {q.shape[1]} must be divisible by 2*{G} devices")
    cfg = make_config(q, k, axis_name=axis_name, causal=causal, window=window,
                      segment_ids=segment_ids, scale=scale, layout=layout,
                      backward=backward, kernel=kernel)
    args = (q, k, v) if segment_ids is None else (q, k, v, segment_ids.astype("int32"))
    key = (cfg, "ring_selective", mesh, G, permuted, len(args), batch_axis, head_axis,
           repeats, (ring_common.ROLL_HOPS, ring_common.PACK_HOPS))
    try:
        hash(key)
    except TypeError:  # an unhashable user kernel object: no caching
        return api._program.__wrapped__(*key)(*args)
    return api._program(*key)(*args)


def ring_transfer_counts(fn, *args, **kwargs) -> collections.Counter:
    """Count the ring transfers (``ppermute``) in the program of ``fn(*args, **kwargs)``.

    A diagnostic for checkpoint policies: every ring forward pass makes the same number of
    transfers, so counting them counts attention forwards.  Keys are
    ``(part, phase)``: ``part`` is ``"fwd"`` (ring forward; ``"fwd_early"`` /
    ``"fwd_late"`` for the row groups of ``seq_selective_attention``) or ``"bwd"`` (ring
    backward); ``phase`` is ``"backward"`` for equations in the transposed (gradient)
    program -- there, forward transfers are rematerialisation -- else ``"forward"``.
    Counted on the jaxpr, before XLA may merge identical transfers.
    """
    counts: collections.Counter = collections.Counter()

    def sub_jaxprs(eqn):
        for val in eqn.params.values():
            for item in (val if isinstance(val, (list, tuple)) else (val,)):
                if isinstance(item, jcore.ClosedJaxpr):
                    yield item.jaxpr
                elif isinstance(item, jcore.Jaxpr):
                    yield item

    def walk(jaxpr, stack: str):
        for eqn in jaxpr.eqns:
            here = f"{stack}/{eqn.source_info.name_stack}"
            if eqn.primitive.name == "ppermute":
                if FWD_SCOPE in here:
                    part = ("fwd_early" if EARLY_SCOPE in here else
                            "fwd_late" if LATE_SCOPE in here else "fwd")
                else:
                    part = "bwd" if BWD_SCOPE in here else "other"
                counts[(part, "backward" if "transpose(" in here else "forward")] += 1
            for sub in sub_jaxprs(eqn):
                walk(sub, f"{here}/{eqn.primitive.name}")

    walk(jax.make_jaxpr(fn)(*args, **kwargs).jaxpr, "")
    return counts
