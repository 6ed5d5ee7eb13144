"""Where generation puts things on an N-D mesh (``models.generate``): which axes split
the cache's length (``_attention_axis``), which mesh axes split anything
(``_split_axes``), and each parameter's ``PartitionSpec`` for generation: the tensor
axes of the model's ``param_shardings`` only, for the blocks in both forms
(``_tensor_param_specs``, ``_both_forms``; the ``models.generate`` docstring, "N-D
meshes").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jax_seqpar.models.llama import LAYERS, Llama, LlamaConfig
from jax_seqpar.models.stacking import layer_key
from jax_seqpar.sharding.parallelism import Parallelism
from jax_seqpar.sharding.specs import AxisRole, axis_tuple, normalize_role, role_size


def _path_keys(path) -> tuple:
    """A parameter's path as a tuple of names, without a leading ``"params"``."""
    keys = tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
    return keys[1:] if keys[:1] == ("params",) else keys


def _attention_axis(sequence: AxisRole, tensor: AxisRole, heads_split: bool) -> AxisRole:
    """The sequence axes, and after them the tensor axes when those do not split the
    heads (``Parallelism.tensor_as_sequence``'s order: sequence major)."""
    if heads_split or tensor is None:
        return sequence
    return normalize_role(axis_tuple(sequence) + axis_tuple(tensor))


def _split_axes(mesh, axes) -> AxisRole:
    """``axes`` without those of one device (they split nothing), normalized."""
    return normalize_role(tuple(a for a in axis_tuple(axes) if mesh.shape[a] > 1))


@functools.lru_cache(maxsize=16)
def _tensor_param_specs(config: LlamaConfig, mesh: Mesh, par: Parallelism,
                        head_axis: AxisRole) -> tuple:
    """``((path, PartitionSpec), ...)``: the model's ``param_shardings`` with only the
    tensor axes kept (the fsdp / sequence / data splits are gathered once, for good:
    decoding would otherwise gather every weight at every token), for the blocks in both
    forms (``_both_forms``), whichever form the config's ``scan_layers`` builds."""
    if head_axis is None:
        return ()
    tensor = axis_tuple(head_axis)
    model = Llama(config, mesh=mesh, parallelism=par)
    rows = role_size(mesh, par.batch_axes)
    width = 2 * role_size(mesh, par.sequence) * role_size(mesh, head_axis)
    shardings = model.param_shardings(jax.random.key(0), jnp.zeros((rows, width), jnp.int32))
    out = []
    for path, sh in jax.tree_util.tree_flatten_with_path(shardings)[0]:
        dims = []
        for entry in sh.spec:
            kept = tuple(a for a in axis_tuple(entry) if a in tensor)
            if kept and kept != tensor:
                raise NotImplementedError(
                    f"{jax.tree_util.keystr(path)} is split over {kept!r}, part of the "
                    f"tensor axes {tensor!r}: generation splits a weight over all of "
                    f"them or none")
            dims.append(normalize_role(kept))
        out.append((_path_keys(path), P(*dims)))
    return _both_forms(tuple(out), config.num_layers)


def _both_forms(entries: tuple, layers: int) -> tuple:
    """``entries`` (``((path, PartitionSpec), ...)`` of one parameter form) with the
    blocks' entries of the other form (``models.stacking``) added: ``("layers", *rest)``
    split like ``("layer_i", *rest)`` behind its layer axis, which is never split."""
    table = dict(entries)
    for keys, spec in entries:
        if keys[:1] == (LAYERS,):
            for i in range(layers):
                table.setdefault((layer_key(i),) + keys[1:], P(*tuple(spec)[1:]))
        elif keys[:1] == (layer_key(0),):
            table.setdefault((LAYERS,) + keys[1:], P(None, *spec))
    return tuple(table.items())
