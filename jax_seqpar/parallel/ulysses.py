"""Ulysses (head-parallel) attention and the Ulysses x ring hybrid, per device.

``strategy="ulysses"`` (DeepSpeed-Ulysses, Jacobs et al. 2023, §3.1): the sequence is
sharded over ``G`` devices of one mesh axis.  One ``all_to_all`` turns each device's
sequence shard of q, k, v ``[B, T, H, D]`` into a head shard of the whole sequence
``[B, S, H/G, D]``; every device runs the local kernel over the full sequence for its
``H/G`` heads; a second ``all_to_all`` turns the output back into a sequence shard.
Each device sends ``(G - 1)/G`` of its q, k, v and o (``costs.ulysses_bytes``), a volume
that does not grow with ``G`` at a fixed ``S/G``, but the heads limit ``G``: ``Hq`` and
``Hkv`` must both be multiples of ``G``.

GQA without repeating K/V: the all-to-all deals query heads ``[j Hq/G, (j+1) Hq/G)``
and key/value heads ``[j Hkv/G, (j+1) Hkv/G)`` to device ``j``.  With ``g = Hq / Hkv``,
query head ``h`` of device ``j`` (local index ``h - j Hq/G``) meets local key head
``(h - j Hq/G) // g = h // g - j Hkv/G``, i.e. global key head ``h // g``: the grouping
of the undivided attention.

After the all-to-all the sequence is in *layout order* (device 0's tokens first), so the
tile's positions are ``layouts.permutation(layout, S, G)``; for the contiguous layout that
is ``arange(S)`` and a causal or window mask is an *aligned* tile (the kernel may apply it
by index), otherwise a *general* one; without a mask the tile is *dense* in any layout
(no position matters).  Ulysses needs no causal balance (every device
attends the whole sequence on its heads) but accepts every layout.  The backward is
JAX's: the transpose of an all-to-all is the reverse all-to-all, and ``local_attention``
has its own ``custom_vjp``.

``strategy="usp"`` (Unified Sequence Parallelism, Fang & Zhao 2024, §3;
LoongTrain's 2-D attention, Gu et al. 2024, §3): ``axis_name=(outer, inner)`` on a 2-D
mesh, Ulysses over ``inner`` (``Ni`` devices) and ring attention over ``outer``
(``No`` devices).  Token order: the global sequence is permuted by the layout over
``No`` shards (``layouts.permutation(layout, S, No)``), and each of these outer blocks
of ``S / No`` tokens is split contiguously over the inner axis: device ``(o, i)`` holds
tokens ``perm[o*S/No + i*T : o*S/No + (i+1)*T]`` with ``T = S / (No*Ni)``, which is the
order ``P(None, (outer, inner))`` deals the permuted sequence in.  After the all-to-all
over ``inner``, device ``(o, i)`` holds heads chunk ``i`` of the whole outer block
``o``, i.e. exactly ring shard ``o`` of ``No`` in ``layout`` (zigzag-balanced for
``layout="zigzag"``), and ``ring.ring_attention_with_config`` runs over ``outer``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import jax.numpy as jnp
from jax import lax

from jax_seqpar.layouts import permutation
from jax_seqpar.parallel.common import AttnConfig, axis_size, tile_kind
from jax_seqpar.parallel.local import local_attention
from jax_seqpar.parallel.ring import ring_attention_with_config


def check_heads(q_heads: int, kv_heads: int, num_devices: int, axis_name,
                strategy: str = "ulysses") -> None:
    """Raise ``ValueError`` unless both head counts split over ``num_devices``."""
    if q_heads % num_devices or kv_heads % num_devices:
        raise ValueError(
            f"strategy={strategy!r} splits the heads over mesh axis {axis_name!r} of size "
            f"{num_devices}: query heads Hq={q_heads} and key/value heads Hkv={kv_heads} "
            f"must both be divisible by {num_devices}; use strategy='ring' (or a smaller "
            f"axis) for these heads")


def seq_to_heads(x, axis_name):
    """``[B, T, H, D]`` sequence shard -> ``[B, G*T, H/G, D]`` head shard (layout order)."""
    return lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)


def heads_to_seq(x, axis_name):
    """Inverse of ``seq_to_heads``."""
    return lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)


def gather_seq(x, axis_name):
    """``[B, T]`` (segment ids) -> ``[B, G*T]`` in the same order as ``seq_to_heads``."""
    return lax.all_gather(x, axis_name, axis=1, tiled=True)


def ulysses_attention_with_config(cfg: AttnConfig, q, k, v, segment_ids=None):
    """Per-device Ulysses attention over the single mesh axis ``cfg.axis_name``.

    ``q, k, v`` ``[B, T, H, D]`` and ``segment_ids`` ``[B, T]`` are this device's shard,
    in ``cfg.layout`` order; returns this device's output shard in ``q.dtype``.
    """
    G = axis_size(cfg.axis_name)
    B, T, Hq, D = q.shape
    check_heads(Hq, k.shape[2], G, cfg.axis_name)
    qh, kh, vh = (seq_to_heads(x, cfg.axis_name) for x in (q, k, v))
    seg = None if segment_ids is None else gather_seq(segment_ids, cfg.axis_name)
    perm = permutation(cfg.layout, G * T, G, cfg.stripe)  # positions in layout order
    aligned = cfg.mask.block_mask is None and np.array_equal(perm, np.arange(G * T))
    pos = jnp.asarray(perm, jnp.int32)
    o = local_attention(cfg, qh, kh, vh, pos, pos, seg, seg, tile=tile_kind(cfg.mask, aligned))
    return heads_to_seq(o, cfg.axis_name)


def usp_axes(axis_name):
    """``(outer, inner)`` of a usp ``axis_name``, or a ``ValueError`` naming the fix."""
    if not (isinstance(axis_name, tuple) and len(axis_name) == 2):
        raise ValueError(
            f"strategy='usp' needs axis_name=(outer, inner), two mesh axes: ring attention "
            f"over `outer` and Ulysses over `inner`; got axis_name={axis_name!r}. For one "
            f"mesh axis use strategy='ulysses' or 'ring'")
    return axis_name


def usp_attention_with_config(cfg: AttnConfig, q, k, v, segment_ids=None):
    """Per-device USP attention: Ulysses over ``inner`` x ring over ``outer``.

    ``cfg.axis_name`` is ``(outer, inner)``; ``q, k, v`` are this device's shard in the
    token order of the module docstring (``permutation(layout, S, No)``, each outer
    block split contiguously over ``inner``).  ``cfg.layout``/``stripe`` describe the
    ring's view over ``outer``.
    """
    outer, inner = usp_axes(cfg.axis_name)
    Ni = axis_size(inner)
    check_heads(q.shape[2], k.shape[2], Ni, inner, strategy="usp")
    qh, kh, vh = (seq_to_heads(x, inner) for x in (q, k, v))
    seg = None if segment_ids is None else gather_seq(segment_ids, inner)
    ring_cfg = dataclasses.replace(cfg, axis_name=outer)
    o = ring_attention_with_config(ring_cfg, qh, kh, vh, seg)
    return heads_to_seq(o, inner)
