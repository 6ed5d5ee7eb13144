"""The specs of attention's global arrays on an N-D mesh, and the GQA head split.

Every global array of attention and decoding is ``[B, S, H, D]`` (or ``[B, S]`` for
segment ids, ``[B]`` for cache lengths) and is sharded

    P(batch_axis, sequence axes, head_axis, None)

so that each device holds, and computes, only its own batch rows, its own slice of the
sequence and its own heads.  The strategies' collectives (ring ``ppermute``, tree
``pmax``/``psum``, Ulysses all-to-all) name only the sequence axes; the batch and head
axes appear in the specs and nowhere else, so attention adds no traffic on them.

Each role is a mesh axis name, a tuple of names (sharded over their product, major
first, as ``PartitionSpec`` reads a tuple) or None (replicated: today's one-axis
behaviour).  A mesh axis may play one role only.

Heads over a tensor axis of ``T`` devices (Megatron-LM's tensor parallelism, Shoeybi et
al. 2019 §3, "the attention heads are split across GPUs"): the query heads must divide
by ``T``.  With grouped-query attention the key/value heads split too when they divide
by ``T``; when they are fewer than ``T`` or do not divide it, each kv head is repeated
``r = T / gcd(Hkv, T)`` times -- only as far as needed for ``Hkv * r`` to divide by ``T``,
Megatron's rule for ``num_query_groups < tensor_model_parallel_size`` -- so that every
device holds the kv heads of its own query heads.  ``jnp.repeat`` keeps each group's
copies together, so query head ``h`` still reads a copy of kv head ``h // (Hq / Hkv)``.
"""

from __future__ import annotations

import math
from typing import Tuple, Union

import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

AxisRole = Union[None, str, Tuple[str, ...]]


def axis_tuple(axes: AxisRole) -> Tuple[str, ...]:
    """``None`` -> ``()``, ``"a"`` -> ``("a",)``, a tuple or list -> a tuple."""
    if axes is None:
        return ()
    if isinstance(axes, str):
        return (axes,)
    if isinstance(axes, (tuple, list)) and all(isinstance(a, str) for a in axes):
        return tuple(axes)
    raise TypeError(f"a mesh axis role must be an axis name, a tuple of names or None; "
                    f"got {axes!r}")


def normalize_role(axes: AxisRole) -> AxisRole:
    """The hashable spelling of a role: None, one name, or a tuple of two or more."""
    names = axis_tuple(axes)
    if not names:
        return None
    return names[0] if len(names) == 1 else names


def role_size(mesh: Mesh, axes: AxisRole) -> int:
    """Devices along a role (1 for None)."""
    return math.prod(mesh.shape[a] for a in axis_tuple(axes))


def check_roles(mesh: Mesh, **roles: AxisRole) -> None:
    """Every named axis is an axis of ``mesh`` and plays one role only.

    ``check_roles(mesh, axis_name="sp", batch_axis="dp", head_axis=None)``; the keyword
    names are the arguments' names, which the errors repeat.
    """
    seen = {}
    for arg, axes in roles.items():
        for name in axis_tuple(axes):
            if name not in mesh.axis_names:
                raise ValueError(f"{arg}={axes!r}: {name!r} is not an axis of the mesh "
                                 f"(mesh.axis_names={mesh.axis_names})")
            if name in seen:
                other = seen[name]
                where = (f"twice in {arg}={axes!r}" if other == arg
                         else f"in both {other}={roles[other]!r} and {arg}={axes!r}")
                raise ValueError(f"mesh axis {name!r} appears {where}: an axis can shard "
                                 f"one dimension only")
            seen[name] = arg


def activation_spec(batch_axis: AxisRole, seq_axes: AxisRole, head_axis: AxisRole,
                    ndim: int = 4) -> P:
    """``P(batch_axis, seq_axes, head_axis, None)`` truncated to ``ndim`` dimensions
    (``ndim=2``: segment ids ``[B, S]``)."""
    dims = (normalize_role(batch_axis), normalize_role(seq_axes), normalize_role(head_axis),
            None)
    return P(*dims[:ndim])


def kv_head_repeats(q_heads: int, kv_heads: int, num_shards: int, *,
                    head_axis: AxisRole = "head_axis") -> int:
    """How often each kv head is repeated so that heads split over ``num_shards`` devices.

    1 when the kv heads divide by ``num_shards``; else ``num_shards / gcd(kv_heads,
    num_shards)`` (Megatron's rule: repeated only as far as needed).  A ``ValueError``
    names the counts when the query heads do not divide by ``num_shards``.
    """
    if q_heads % kv_heads:
        raise ValueError(f"query heads {q_heads} must be a multiple of key/value heads "
                         f"{kv_heads} (GQA/MQA)")
    if q_heads % num_shards:
        raise ValueError(
            f"head_axis={head_axis!r} splits the heads over {num_shards} devices, but the "
            f"{q_heads} query heads do not divide by {num_shards}; use a head axis whose "
            f"size divides {q_heads} (kv heads: {kv_heads}), or put those devices on "
            f"another role (sequence, batch)")
    return num_shards // math.gcd(kv_heads, num_shards)


def repeat_kv_heads(x, repeats: int):
    """``x`` ``[B, S, Hkv, D]`` with each kv head repeated ``repeats`` times in place
    (head ``j`` becomes heads ``j*r .. j*r + r - 1``); identity for ``repeats == 1``."""
    if repeats == 1:
        return x
    return jnp.repeat(x, repeats, axis=2)


def check_batch(batch: int, mesh: Mesh, batch_axis: AxisRole) -> None:
    """The batch divides by the devices of ``batch_axis``."""
    n = role_size(mesh, batch_axis)
    if batch % n:
        raise ValueError(f"batch_axis={batch_axis!r} splits the batch over {n} devices, but "
                         f"the batch of {batch} does not divide by {n}")


def head_plan(mesh: Mesh, q_heads: int, kv_heads: int, head_axis: AxisRole
              ) -> Tuple[int, int]:
    """``(devices along head_axis, kv repeats)`` for these head counts (see module doc)."""
    T = role_size(mesh, head_axis)
    if T == 1:
        return 1, 1
    return T, kv_head_repeats(q_heads, kv_heads, T, head_axis=head_axis)


def local_heads(q_heads: int, kv_heads: int, T: int, repeats: int) -> Tuple[int, int]:
    """Query and kv heads on one device after the split."""
    return q_heads // T, kv_heads * repeats // T


__all__ = ["AxisRole", "activation_spec", "axis_tuple", "check_batch", "check_roles",
           "head_plan", "kv_head_repeats", "local_heads", "normalize_role",
           "repeat_kv_heads", "role_size"]

