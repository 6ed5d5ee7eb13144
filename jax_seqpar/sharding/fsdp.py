"""Fully sharded parameters and optimizer state (ZeRO-3 / FSDP) through JAX's sharding.

Sequence parallelism splits activations over a mesh axis; the parameters, their
gradients and the optimizer state would still be replicated on every device, which for
a 7B-parameter model trained with AdamW in float32 is about 112 GB per device.  Here
each array of those pytrees is split along one of its dimensions over the same mesh
axis (or over several axes), with ``NamedSharding``: a ``jax.jit`` step that takes and
returns them so sharded leaves the rest to XLA, which gathers each weight where a layer
uses it and reduce-scatters its gradient (ZeRO-3; BurstEngine §4 shards parameters the
same way).  Nothing here gathers by hand.

Which dimension: the largest one divisible by the number of shards (ties: the first),
so that every shard holds an equal slice; arrays with no such dimension, or fewer than
``min_elements`` elements (norm scales, step counters), stay replicated, where the
saving would be smaller than the cost of one more collective.  The leading axis of the
stacked blocks of a scanned model (leaves under a ``"layers"`` key,
``LlamaConfig.scan_layers``) is never chosen: split over the devices, every step of the
layer loop would gather a whole layer from the few devices that hold it, where FSDP
wants each device to hold a slice of every layer.

    shardings = fsdp_shardings(params, mesh, "sp")
    params = jax.device_put(params, shardings)
    opt_state = jax.device_put(opt_state, fsdp_shardings(opt_state, mesh, "sp"))
    step = jax.jit(train_step, in_shardings=(shardings, opt_shardings, batch),
                   out_shardings=(shardings, opt_shardings, None), donate_argnums=(0, 1))
"""

from __future__ import annotations

import math
from typing import Sequence, Tuple, Union

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AxisNames = Union[str, Tuple[str, ...]]


def _axes(mesh: Mesh, axis: AxisNames) -> Tuple[str, ...]:
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    for name in names:
        if name not in mesh.axis_names:
            raise ValueError(f"axis={name!r} is not an axis of the mesh "
                             f"(mesh.axis_names={mesh.axis_names})")
    return names


#: The key under which a scanned model keeps its stacked blocks (``models.llama.LAYERS``).
STACKED_KEY = "layers"


def fsdp_spec(shape: Sequence[int], num_shards: int, axis: AxisNames,
              min_elements: int = 2 ** 14, *, stacked: bool = False) -> P:
    """The ``PartitionSpec`` that splits an array of ``shape`` over ``axis`` (FSDP rule);
    ``stacked``: dimension 0 is a layer axis, never split (module docstring)."""
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards={num_shards!r} must be a positive int")
    spec = [None] * len(shape)
    if num_shards == 1 or math.prod(shape) < min_elements:
        return P(*spec)
    candidates = [(d, i) for i, d in enumerate(shape)
                  if d % num_shards == 0 and not (stacked and i == 0)]
    if not candidates:
        return P(*spec)
    _, dim = max(candidates, key=lambda c: (c[0], -c[1]))
    spec[dim] = axis
    return P(*spec)


def fsdp_shardings(tree, mesh: Mesh, axis: AxisNames = "sp", *,
                   min_elements: int = 2 ** 14):
    """``NamedSharding`` for every array leaf of ``tree``: split over ``axis`` (FSDP).

    ``tree`` may hold arrays or ``jax.ShapeDtypeStruct``s (e.g. from ``jax.eval_shape``
    of the initialiser, so the full parameters never exist on one device).  Scalars and
    small arrays are replicated.
    """
    names = _axes(mesh, axis)
    num = math.prod(mesh.shape[n] for n in names)
    spec_axis = names[0] if len(names) == 1 else names

    def one(path, x):
        shape = getattr(x, "shape", None)
        if shape is None:
            raise TypeError(f"fsdp_shardings: leaf {x!r} has no shape")
        stacked = any(getattr(k, "key", None) == STACKED_KEY for k in path)
        return NamedSharding(mesh, fsdp_spec(tuple(shape), num, spec_axis, min_elements,
                                             stacked=stacked))

    return jax.tree_util.tree_map_with_path(one, tree)


def replicated_shardings(tree, mesh: Mesh):
    """``NamedSharding`` that replicates every leaf of ``tree`` (the plain data-parallel /
    sequence-parallel layout), for comparison with ``fsdp_shardings``."""
    return jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)


def bytes_per_device(tree, shardings) -> int:
    """Bytes of ``tree`` that one device holds under ``shardings`` (for reports/tests)."""
    total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(
            shardings, is_leaf=lambda v: isinstance(v, NamedSharding))):
        shard = s.shard_shape(tuple(x.shape))
        total += math.prod(shard) * jax.numpy.dtype(x.dtype).itemsize
    return total


__all__ = ["bytes_per_device", "fsdp_shardings", "fsdp_spec", "replicated_shardings"]
