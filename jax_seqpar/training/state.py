"""The state of a training run as one pytree, built straight onto its shardings, and the
jitted training step.

``TrainState`` holds everything a step reads and writes: the parameters, the optimizer
state, the number of steps done and a PRNG key.  Keeping them in one pytree is what makes
a checkpoint (``jax_seqpar.training.checkpoint``) complete: save it, and the data
iterator's position, and a restarted run continues bit for bit.

``init_train_state`` never builds the full parameters on one device: it traces the
initialiser with ``jax.eval_shape``, picks a ``NamedSharding`` per leaf
(``jax_seqpar.sharding.fsdp.fsdp_shardings``: each large array split over the mesh axis, or
replicated), and runs the initialiser under ``jax.jit(..., out_shardings=...)``, so
each device computes only its own slice of every array.  ``abstract_train_state`` gives
the same tree as ``jax.ShapeDtypeStruct``s with those shardings, without computing
anything: the target that a checkpoint is restored onto.

``make_train_step`` returns ``step(state, batch) -> (state, metrics)``: one optimizer
step of ``next_token_loss`` (or a given loss), jitted, with the state donated (its
buffers are reused for the new state) and pinned to its shardings.  ``batch`` is the
data pipeline's contract: a dict of ``[B, S]`` arrays in natural token order with
``tokens`` and optionally ``segment_ids``, ``positions`` and ``loss_mask``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Tuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, Sharding

from jax_seqpar.sharding.fsdp import fsdp_shardings, replicated_shardings

#: The keys a batch may have (``tokens`` is required); all ``[B, S]``, natural order.
BATCH_KEYS = ("tokens", "segment_ids", "positions", "loss_mask")
#: How parameters and optimizer state are laid out over the mesh: ``"logical"`` by the
#: model's logical names and its ``parallelism`` (``sharding.parallelism``), ``"fsdp"``
#: each large array split over one axis (``sharding.fsdp``), ``"replicated"``; ``"auto"``
#: is ``"logical"`` for a model with a ``parallelism``, else ``"fsdp"``.
SHARDING_MODES = ("auto", "logical", "fsdp", "replicated")
#: Where the optimizer state lives between steps: ``"device"``, or ``"pinned_host"``
#: (host memory through JAX's memory kinds; the step brings it to the device for the
#: update and writes the new state back).
OPT_MEMORY = ("device", "pinned_host")
#: ``TrainState.rng`` is ``fold_in(key, RNG_STREAM)`` of the initialiser's key, which
#: itself initialises the parameters exactly as ``model.init(key, tokens)`` would.
RNG_STREAM = 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """What a training step carries from one step to the next (a pytree).

    ``params``: the model's parameters (``{"params": ...}`` for Flax Linen);
    ``opt_state``: the optax optimizer state; ``step``: int32 scalar, optimizer steps
    done; ``rng``: a PRNG key, split once per step, so a resumed run draws the keys the
    uninterrupted run would have drawn.
    """

    params: Any
    opt_state: Any
    step: Any
    rng: Any

    def replace(self, **changes) -> "TrainState":
        return dataclasses.replace(self, **changes)


def _check_tokens_shape(tokens_shape) -> Tuple[int, int]:
    shape = tuple(getattr(tokens_shape, "shape", tokens_shape))
    if len(shape) != 2 or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0
                                  for d in shape):
        raise ValueError(f"tokens_shape={tokens_shape!r} must be (batch, seq_len), two "
                         f"positive ints (or an array of that shape)")
    return shape


def _mesh_and_axis(model, mesh: Optional[Mesh], axis: Optional[str]):
    mesh = mesh if mesh is not None else getattr(model, "mesh", None)
    if mesh is None:
        raise ValueError("the model has no mesh (mesh=None): pass mesh=... to place the "
                         "train state (a one-device mesh is fine)")
    axis = axis if axis is not None else getattr(model, "axis_name", "sp")
    return mesh, axis


def _init_fn(model, optimizer, tokens_shape):
    def init(key):
        params = model.init(key, jnp.zeros(tokens_shape, jnp.int32))
        return TrainState(params=params, opt_state=optimizer.init(params),
                          step=jnp.zeros((), jnp.int32),
                          rng=jax.random.fold_in(key, RNG_STREAM))
    return init


def abstract_train_state(model, optimizer, key, tokens_shape, *, mesh: Optional[Mesh] = None,
                         axis: Optional[str] = None, sharding: str = "auto",
                         min_elements: int = 2 ** 14, opt_memory: str = "device") -> TrainState:
    """The train state as ``jax.ShapeDtypeStruct``s carrying their ``NamedSharding``s.

    Nothing is computed or allocated (``jax.eval_shape``).  This is what
    ``TrainCheckpointer.restore_latest`` restores onto, and what ``init_train_state``
    initialises onto.  ``key`` is the initialiser's PRNG key (only its kind matters here:
    a typed ``jax.random.key`` or a raw ``PRNGKey``); ``tokens_shape`` is ``(batch,
    seq_len)`` of any batch the model accepts (the parameters do not depend on it).
    ``mesh`` / ``axis`` default to the model's; ``sharding="logical"`` (the default,
    ``"auto"``, for a model built with a ``parallelism``) lays every parameter out by
    its logical names and the optimizer state like its parameter (``like_params``);
    ``sharding="fsdp"`` (the default for one-axis models) splits each array of
    at least ``min_elements`` over ``axis`` (``fsdp.fsdp_shardings``), ``"replicated"``
    keeps a full copy on every device.  ``opt_memory="pinned_host"`` places the optimizer
    state's shards in host memory (same layout, memory kind ``pinned_host``): the device
    then holds it only while a step updates the parameters.  Measured on one H200 (JAX
    0.11.2, issue 30) that does not pay: the compiled step holds the old and the new state
    on the device at once, so the 7B step at 32k needed 114 GiB of temporaries instead of
    64 and ran out of memory (``benchmarks/RESULTS.md``, "XLA flags and the optimizer
    state in host memory"); ``benchmarks/train_mfu.py --opt-memory pinned_host`` measures
    it again.
    """
    if sharding not in SHARDING_MODES:
        raise ValueError(f"sharding={sharding!r} must be one of {SHARDING_MODES}")
    if opt_memory not in OPT_MEMORY:
        raise ValueError(f"opt_memory={opt_memory!r} must be one of {OPT_MEMORY}")
    mesh, axis = _mesh_and_axis(model, mesh, axis)
    tokens_shape = _check_tokens_shape(tokens_shape)
    shapes = jax.eval_shape(_init_fn(model, optimizer, tokens_shape), key)
    if sharding == "auto":
        sharding = "logical" if getattr(model, "parallelism", None) is not None else "fsdp"
    if sharding == "logical":
        if getattr(model, "parallelism", None) is None or mesh != model.mesh:
            raise ValueError("sharding='logical' lays the state out by the model's "
                             "parallelism on its own mesh: build the model with "
                             "mesh=..., parallelism=... (and leave mesh= out here)")
        params = model.param_shardings(key, jnp.zeros(tokens_shape, jnp.int32))
        shardings = TrainState(params=params,
                               opt_state=like_params(shapes.opt_state, params, mesh),
                               step=NamedSharding(mesh, P()), rng=NamedSharding(mesh, P()))
    elif sharding == "fsdp":
        shardings = fsdp_shardings(shapes, mesh, axis, min_elements=min_elements)
    else:
        shardings = replicated_shardings(shapes, mesh)
    if opt_memory != "device":
        shardings = shardings.replace(opt_state=jax.tree.map(
            lambda sh: sh.with_memory_kind(opt_memory), shardings.opt_state))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)


def like_params(tree, param_shardings, mesh: Mesh):
    """Shardings for an optimizer state: a leaf whose path ends with a parameter's path
    and has its shape (AdamW's moments, momentum, ...) gets that parameter's sharding;
    any other leaf (step counts, scalars) is replicated."""
    by_path = {}
    for path, sh in jax.tree_util.tree_flatten_with_path(
            param_shardings, is_leaf=lambda x: isinstance(x, Sharding))[0]:
        by_path[tuple(str(k) for k in path)] = sh

    def one(path, leaf):
        keys = tuple(str(k) for k in path)
        for start in range(len(keys)):
            sh = by_path.get(keys[start:])
            if sh is not None and len(sh.spec) <= len(leaf.shape):
                return sh
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(one, tree)


def _on_device(sharding: Sharding) -> Sharding:
    return sharding.with_memory_kind("device")


def opt_state_offloaded(shardings) -> bool:
    """Whether a state's optimizer state is placed in host memory (``opt_memory``)."""
    leaves = jax.tree.leaves(shardings_of(shardings).opt_state,
                             is_leaf=lambda x: isinstance(x, Sharding))
    return any(getattr(sh, "memory_kind", None) == "pinned_host" for sh in leaves)


def init_train_state(model, optimizer, key, tokens_shape, **kwargs) -> TrainState:
    """A fresh train state, each array created directly in its shards.

    ``params = model.init(key, tokens)`` (the same values as an unsharded init with the
    same key), ``opt_state = optimizer.init(params)``, ``step = 0``,
    ``rng = fold_in(key, RNG_STREAM)``; laid out by ``abstract_train_state(model,
    optimizer, key, tokens_shape, **kwargs)``, whose arguments these are.  The
    initialiser runs under ``jax.jit`` with those ``out_shardings``, so the full
    parameters never exist on one device.
    """
    abstract = abstract_train_state(model, optimizer, key, tokens_shape, **kwargs)
    init = _init_fn(model, optimizer, _check_tokens_shape(tokens_shape))
    return jax.jit(init, out_shardings=shardings_of(abstract))(key)


def shardings_of(tree):
    """The ``Sharding`` of every leaf of ``tree`` (arrays or ``ShapeDtypeStruct``s; a leaf
    that already is a ``Sharding`` is kept)."""
    def one(path, x):
        if isinstance(x, Sharding):
            return x
        sh = getattr(x, "sharding", None)
        if sh is None:
            raise ValueError(f"leaf {jax.tree_util.keystr(path)} has no sharding; build the "
                             f"tree with abstract_train_state / init_train_state, or give "
                             f"each ShapeDtypeStruct a sharding=")
        return sh
    return jax.tree_util.tree_map_with_path(one, tree,
                                            is_leaf=lambda x: isinstance(x, Sharding))


def _check_batch(batch) -> None:
    """Trace-time check of the batch contract (keys, ``[B, S]`` shapes)."""
    if not isinstance(batch, dict) or "tokens" not in batch:
        raise ValueError(f"batch must be a dict with 'tokens' (and optionally "
                         f"{BATCH_KEYS[1:]}); got {type(batch).__name__} "
                         f"{sorted(batch) if isinstance(batch, dict) else ''}")
    unknown = sorted(set(batch) - set(BATCH_KEYS))
    if unknown:
        raise ValueError(f"batch has unknown keys {unknown}; allowed: {BATCH_KEYS} (drop "
                         f"the others before the step)")
    shape = tuple(batch["tokens"].shape)
    if len(shape) != 2:
        raise ValueError(f"batch['tokens'] must be [batch, seq]; got shape {shape}")
    for name, x in batch.items():
        if x is not None and tuple(x.shape) != shape:
            raise ValueError(f"batch[{name!r}] has shape {tuple(x.shape)}, but "
                             f"batch['tokens'] has {shape}; every entry is [batch, seq]")


def make_train_step(model, optimizer, *, shardings=None, donate: bool = True,
                    loss_fn: Optional[Callable] = None):
    """``step(state, batch) -> (state, metrics)``: one optimizer step, jitted.

    The loss is ``next_token_loss(model, params, batch["tokens"],
    loss_mask=, segment_ids=, positions=)`` (the entries the batch has), or
    ``loss_fn(params, batch, key) -> (loss, metrics)`` when given, where ``key`` is this
    step's PRNG key (``state.rng`` is split once per step: ``rng, key = split(rng)``).
    ``metrics`` is the loss's metrics dict (``loss``, ``accuracy``, ``tokens`` for
    ``next_token_loss``).

    ``shardings``: the state's shardings (a ``TrainState`` of ``Sharding``s, or the
    abstract / concrete state itself); the new state is pinned to them, so it keeps the
    layout it was initialised or restored with.  ``donate=True`` donates the old state
    (its buffers are reused; do not touch it after the call).  An optimizer state placed
    in host memory (``abstract_train_state(opt_memory="pinned_host")``) is moved to the
    device for the update and back by the step's output shardings.  The batch is taken as
    given: NumPy arrays, or ``jax.Array``s already placed (e.g. with
    ``jax_seqpar.runtime.distributed.from_host`` when several processes run).
    """
    import optax

    from jax_seqpar.models import next_token_loss

    if loss_fn is None:
        def loss_fn(params, batch, key):
            del key
            return next_token_loss(model, params, batch["tokens"],
                                   loss_mask=batch.get("loss_mask"),
                                   segment_ids=batch.get("segment_ids"),
                                   positions=batch.get("positions"))

    offloaded = shardings is not None and opt_state_offloaded(shardings)
    device_opt = (jax.tree.map(_on_device, shardings_of(shardings).opt_state,
                               is_leaf=lambda x: isinstance(x, Sharding))
                  if offloaded else None)

    def step(state: TrainState, batch):
        _check_batch(batch)
        rng, key = jax.random.split(state.rng)
        (_, metrics), grads = jax.value_and_grad(
            lambda p: loss_fn(p, batch, key), has_aux=True)(state.params)
        opt_in = state.opt_state
        if offloaded:  # computation reads device memory: bring it over for the update
            opt_in = jax.device_put(opt_in, device_opt)
        updates, opt_state = optimizer.update(grads, opt_in, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(params=params, opt_state=opt_state, step=state.step + 1,
                          rng=rng), metrics

    out_shardings = None if shardings is None else (shardings_of(shardings), None)
    kwargs = {} if out_shardings is None else {"out_shardings": out_shardings}
    return jax.jit(step, donate_argnums=(0,) if donate else (), **kwargs)


__all__ = ["BATCH_KEYS", "OPT_MEMORY", "RNG_STREAM", "SHARDING_MODES", "TrainState",
           "abstract_train_state", "init_train_state", "make_train_step",
           "opt_state_offloaded", "shardings_of"]
