"""The decoder's parameters in its two forms, and the conversions between them.

``LlamaConfig(scan_layers=False)`` keeps one subtree per block, ``layer_0`` ...
``layer_{L-1}`` (the model's program holds ``L`` copies of the block);
``scan_layers=True`` keeps one subtree ``layers`` whose every leaf is the ``L`` blocks'
leaves stacked along a new leading axis (``nn.scan``: one block in the program, a loop over
the stack).  The two hold the same numbers: ``stack_layers`` / ``unstack_layers`` convert
any pytree that holds them -- parameters, gradients, optimizer state (whose moments
mirror the parameters' dicts) -- and ``layer_params`` reads block ``i`` of either form.

    from jax_seqpar.models.stacking import stack_layers
    scanned = stack_layers(params)            # {"params": {"layers": ..., "embed": ...}}

Both conversions are plain array code: under ``jax.jit`` with ``out_shardings`` they
place the result directly (``training.checkpoint`` restores a checkpoint of one form
into a model of the other so).
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp

from jax_seqpar.models.llama import LAYERS

_LAYER = re.compile(r"^layer_(\d+)$")


def layer_key(i: int) -> str:
    """The unrolled form's key of block ``i``."""
    return f"layer_{i}"


def _inner(params):
    return params["params"] if isinstance(params, dict) and "params" in params else params


def _unrolled_count(d: dict) -> int:
    """How many ``layer_i`` keys ``d`` holds (0 if none); they must be ``0 .. n-1``."""
    found = sorted(int(m.group(1)) for m in map(_LAYER.match, d) if m)
    if found and found != list(range(len(found))):
        raise ValueError(f"the unrolled blocks must be layer_0 .. layer_{len(found) - 1}; "
                         f"found layer_{found}")
    return len(found)


def is_scanned(params) -> bool:
    """Whether ``params`` (``{"params": ...}`` or the inner tree) has the stacked form."""
    return isinstance(_inner(params), dict) and LAYERS in _inner(params)


def num_layers(params) -> int:
    """The number of blocks ``params`` holds, in either form."""
    p = _inner(params)
    if is_scanned(p):
        return int(jax.tree.leaves(p[LAYERS])[0].shape[0])
    return _unrolled_count(p)


def layer_params(params, i: int):
    """Block ``i``'s parameter subtree (``attn``, ``attn_norm``, ``mlp``, ``mlp_norm``)
    from either form; for the stacked form a slice of every leaf (inside a program that
    reads each block once, e.g. generation's layer loop, the slice is read in place)."""
    p = _inner(params)
    n = num_layers(p)
    if not 0 <= i < n:
        raise IndexError(f"layer {i} of a model with {n} layers")
    if is_scanned(p):
        return jax.tree.map(lambda x: x[i], p[LAYERS])
    return p[layer_key(i)]


def _map_dicts(fn, tree):
    """``fn`` applied to every dict node of ``tree`` that holds blocks in either form
    (its other entries and the rest of the tree are kept)."""
    def holds_blocks(x):
        return isinstance(x, dict) and (LAYERS in x or _unrolled_count(x) > 0)
    return jax.tree.map(lambda x: fn(x) if holds_blocks(x) else x, tree,
                        is_leaf=holds_blocks)


def _stack(leaves):
    if all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        return jax.ShapeDtypeStruct((len(leaves),) + tuple(leaves[0].shape), leaves[0].dtype)
    return jnp.stack(leaves)


def stack_layers(tree: Any) -> Any:
    """The scanned form of ``tree``: every dict with ``layer_0 .. layer_{L-1}`` gets one
    ``layers`` entry instead, each leaf stacked along a new leading axis.  Works on
    arrays and on ``jax.ShapeDtypeStruct``s (shapes only); a tree already stacked is
    returned as it is."""
    def one(d):
        if LAYERS in d:
            if _unrolled_count(d):
                raise ValueError(f"a dict holds both {LAYERS!r} and layer_i entries")
            return d
        n = _unrolled_count(d)
        blocks = [d[layer_key(i)] for i in range(n)]
        structs = {jax.tree.structure(b) for b in blocks}
        if len(structs) > 1:
            raise ValueError(f"the {n} blocks do not have the same parameters, so they "
                             f"cannot be stacked: {sorted(map(str, structs))[:2]}")
        out = {k: v for k, v in d.items() if not _LAYER.match(k)}
        out[LAYERS] = jax.tree.map(lambda *xs: _stack(xs), *blocks)
        return out
    return _map_dicts(one, tree)


def unstack_layers(tree: Any) -> Any:
    """The unrolled form of ``tree`` (inverse of ``stack_layers``): every ``layers``
    entry becomes ``layer_0 .. layer_{L-1}``."""
    def one(d):
        if LAYERS not in d:
            return d
        stacked = d[LAYERS]
        n = int(jax.tree.leaves(stacked)[0].shape[0])
        out = {k: v for k, v in d.items() if k != LAYERS}
        for i in range(n):
            out[layer_key(i)] = jax.tree.map(
                lambda x: (jax.ShapeDtypeStruct(tuple(x.shape[1:]), x.dtype)
                           if isinstance(x, jax.ShapeDtypeStruct) else x[i]), stacked)
        return out
    return _map_dicts(one, tree)


def to_form(tree: Any, scanned: bool) -> Any:
    """``stack_layers(tree)`` if ``scanned`` else ``unstack_layers(tree)``."""
    return stack_layers(tree) if scanned else unstack_layers(tree)


__all__ = ["is_scanned", "layer_key", "layer_params", "num_layers", "stack_layers", "to_form",
           "unstack_layers"]
