"""Checkpoints of a training run with Orbax: save every N steps asynchronously, keep the
last k, restore onto the mesh, and resume exactly.

A thin layer over ``orbax.checkpoint.CheckpointManager`` that fixes the choices a
training loop needs and says what Orbax guarantees:

* **What is saved.** Each checkpoint is one directory ``<directory>/<step>`` with two
  items: ``state``, the train state pytree (``training.TrainState``: parameters,
  optimizer state, step, PRNG key) saved sharded as it is, each process writing the
  shards its devices hold (Orbax's OCDBT/Zarr format, ``StandardSave``); and ``meta``, a
  JSON file with the data iterator's state (``get_state()`` of a Grain iterator, or any
  JSON-able value) and the step.  With these a restarted run continues exactly: same
  parameters, same optimizer moments, same next batch, same keys.
* **Asynchronous.** ``save`` returns once every array has been copied to host memory
  (Orbax copies device-to-host before returning unless told otherwise, so the next step
  may donate and overwrite the state); the files are written by a background thread
  while training goes on.  A later ``save`` first waits for the previous one.
  ``wait_until_finished`` (called by ``close`` and on leaving a ``with`` block) waits
  for the last one: call it before the process exits.
* **Atomic.** Orbax writes a checkpoint into ``<step>.orbax-checkpoint-tmp`` and renames
  it to ``<step>`` only when every item and every process has finished (on file systems
  without atomic rename, such as GCS, it writes a ``commit_success`` file instead).  A
  process killed in the middle of a save leaves a temporary directory that is never
  listed as a step; the next ``TrainCheckpointer`` on the directory deletes it
  (``cleanup_tmp_directories``) and the previous checkpoint is restored.
  ``tests/test_training_checkpoint.py`` kills a run with SIGKILL inside a save to check
  this.
* **Keep the last k.** After each save, steps older than the newest ``keep`` are deleted.
* **Either form of the layers.** A checkpoint saved from a model with unrolled blocks
  (``LlamaConfig(scan_layers=False)``: ``layer_0 ... layer_{L-1}`` in the parameters and
  in every optimizer moment) restores into the state of a scanned model (one ``layers``
  subtree, every leaf ``[L, ...]``), and the reverse: ``restore`` reads the stored tree's
  form from Orbax's metadata, restores that form and converts it on the devices
  (``models.stacking``).

Typical loop (``data`` has ``get_state()`` / ``set_state(dict)``, as Grain iterators do)::

    ckpt = TrainCheckpointer(CheckpointConfig(directory, save_every=100, keep=3))
    abstract = abstract_train_state(model, optimizer, key, (B, S))
    restored = ckpt.restore_latest(abstract)
    if restored is None:
        state = init_train_state(model, optimizer, key, (B, S))
    else:
        state = restored.state
        data.set_state(restored.data_state)
    train_step = make_train_step(model, optimizer, shardings=abstract)
    for step in range(int(state.step) + 1, num_steps + 1):
        state, metrics = train_step(state, next(data))
        ckpt.save(step, state, data.get_state())   # a no-op unless step % save_every == 0
    ckpt.close()
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
import re
import warnings
from typing import Any, Dict, NamedTuple, Optional

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_seqpar.training.state import shardings_of

#: Item names inside each step directory.
STATE_ITEM, META_ITEM = "state", "meta"
#: The two forms of a decoder's blocks in a state (``models.stacking``): the key of the
#: stacked blocks (``models.llama.LAYERS``) and the keys of the unrolled ones.
_STACKED_KEY = "layers"
_LAYER_KEY = re.compile(r"^layer_(\d+)$")
SCANNED, UNROLLED = "scanned", "unrolled"
_HOW = ("restore it into a state of the form it was saved in and convert that with "
        "jax_seqpar.models.stacking.stack_layers / unstack_layers (under jax.jit with "
        "out_shardings to place the result)")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often to checkpoint (frozen, validated).

    ``directory``: the run's checkpoint directory (made absolute here; ``gs://...`` and
    other URLs are kept as given).  ``save_every``: ``save(step, ...)`` writes when
    ``step % save_every == 0`` (or when forced).  ``keep``: how many of the newest
    checkpoints to keep (``None``: all).  ``async_save``: write in a background thread
    (``False``: ``save`` returns when the checkpoint is committed).
    """

    directory: str
    save_every: int = 1000
    keep: Optional[int] = 3
    async_save: bool = True

    def __post_init__(self):
        d = os.fspath(self.directory) if isinstance(self.directory, os.PathLike) \
            else self.directory
        if not isinstance(d, str) or not d:
            raise ValueError(f"directory={self.directory!r} must be a non-empty path")
        object.__setattr__(self, "directory", d if "://" in d else os.path.abspath(d))
        if isinstance(self.save_every, bool) or not isinstance(self.save_every, int) \
                or self.save_every < 1:
            raise ValueError(f"save_every={self.save_every!r} must be a positive int "
                             f"(steps between checkpoints)")
        if self.keep is not None and (isinstance(self.keep, bool) or
                                      not isinstance(self.keep, int) or self.keep < 1):
            raise ValueError(f"keep={self.keep!r} must be a positive int (checkpoints to "
                             f"keep), or None to keep all")
        if not isinstance(self.async_save, bool):
            raise TypeError(f"async_save={self.async_save!r} must be a bool")


class Restored(NamedTuple):
    """What ``restore`` / ``restore_latest`` return."""

    step: int
    state: Any          # the train state, on the requested shardings
    data_state: Any     # what was passed as ``data_state`` to ``save`` (None if nothing)


def _abstract(tree):
    """``tree`` (abstract or concrete) as ``ShapeDtypeStruct``s that carry a sharding."""
    shardings = shardings_of(tree)  # raises, naming the leaf, where one is missing
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                        tree, shardings)


def block_forms(tree) -> Dict[str, int]:
    """``{form: number of layers}`` of the decoder blocks that ``tree`` holds, read from
    its key paths: ``"scanned"`` for ``layers`` entries (the leading dimension of their
    leaves), ``"unrolled"`` for ``layer_i`` entries (the largest ``i`` plus one); empty
    when it holds none.  Works on states, abstract states and Orbax's metadata trees."""
    forms: Dict[str, int] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        for k in path:
            name = getattr(k, "key", None)
            if name == _STACKED_KEY and getattr(leaf, "shape", None):
                forms.setdefault(SCANNED, int(leaf.shape[0]))
            elif isinstance(name, str) and _LAYER_KEY.match(name):
                forms[UNROLLED] = max(forms.get(UNROLLED, 0),
                                      int(_LAYER_KEY.match(name).group(1)) + 1)
    return forms


def _stacked_sharding(sharding, where: str):
    """The sharding of ``[L, ...]`` whose every ``[i]`` has ``sharding``: the layer axis
    unsplit (``None`` before the per-layer spec)."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, P(None, *sharding.spec),
                             memory_kind=sharding.memory_kind)
    if sharding.is_fully_replicated:  # one device, or every device holds everything
        return sharding
    raise ValueError(f"leaf {where}: cannot derive the stacked form's sharding from "
                     f"{sharding} (give a NamedSharding); or {_HOW}")


def _layer_sharding(sharding, where: str):
    """The sharding of one layer ``x[i]`` of a stacked ``x`` with ``sharding``: its spec
    without the first (layer) entry."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[1:]),
                             memory_kind=sharding.memory_kind)
    if sharding.is_fully_replicated:
        return sharding
    raise ValueError(f"leaf {where}: cannot derive the unrolled form's sharding from "
                     f"{sharding} (give a NamedSharding); or {_HOW}")


def _in_form(abstract, scanned: bool):
    """``abstract`` (``ShapeDtypeStruct``s with shardings) in the scanned or unrolled form:
    shapes by ``models.stacking.to_form``; a stacked leaf's sharding is layer 0's with
    the layer axis unsplit, a layer's the stacked one's without the layer axis."""
    from jax_seqpar.models import stacking

    shardings = {path: x.sharding
                 for path, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    first = jax.tree_util.DictKey(stacking.layer_key(0))
    stacked = jax.tree_util.DictKey(_STACKED_KEY)

    def one(path, x):
        where = jax.tree_util.keystr(path)
        for j, k in enumerate(path):
            name = getattr(k, "key", None)
            if scanned and name == _STACKED_KEY:      # from layer 0 of the unrolled form
                sh = _stacked_sharding(shardings[path[:j] + (first,) + path[j + 1:]], where)
                break
            if not scanned and isinstance(name, str) and _LAYER_KEY.match(name):
                sh = _layer_sharding(shardings[path[:j] + (stacked,) + path[j + 1:]], where)
                break
        else:
            sh = shardings[path]
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)

    return jax.tree_util.tree_map_with_path(one, stacking.to_form(abstract, scanned))


class TrainCheckpointer:
    """Saves and restores a run's train state and data position (see the module doc).

    ``TrainCheckpointer(CheckpointConfig(directory, save_every=..., keep=...))``; use it
    as a context manager, or call ``close()`` at the end, so the last asynchronous save
    finishes before the process exits.
    """

    def __init__(self, config: CheckpointConfig):
        if not isinstance(config, CheckpointConfig):
            raise TypeError(f"config must be a CheckpointConfig, got "
                            f"{type(config).__name__}: TrainCheckpointer(CheckpointConfig("
                            f"directory, save_every=..., keep=...))")
        import orbax.checkpoint as ocp

        self.config = config
        self._ocp = ocp
        policies = ocp.checkpoint_managers
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=policies.FixedIntervalPolicy(config.save_every),
            preservation_policy=(None if config.keep is None    # None: keep every step
                                 else policies.LatestN(config.keep)),
            enable_async_checkpointing=config.async_save,
            cleanup_tmp_directories=True,   # remove what a killed save left behind
            create=True)
        self._manager = ocp.CheckpointManager(config.directory, options=options,
                                              item_names=(STATE_ITEM, META_ITEM))
        # Orbax removes the temporary directories of interrupted saves in a background
        # thread that it joins only at the first save (orbax-checkpoint 0.12.8); join it
        # now, so that what is on disk after construction is what the listing says.
        # (Private, hence the guard; tests/test_training_checkpoint.py checks the effect.)
        getattr(self._manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()

    # ----------------------------------------------------------------------- saving
    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` would write (``step % save_every == 0``)."""
        return self._manager.should_save(step)

    def save(self, step: int, state, data_state: Any = None, *, force: bool = False) -> bool:
        """Checkpoint ``state`` (after ``step`` optimizer steps) and ``data_state`` (the
        data iterator's JSON-able ``get_state()``: the position of the *next* batch).

        A no-op returning False unless ``step % save_every == 0`` or ``force``.  Returns
        once the arrays are in host memory; the files are written in the background
        (``async_save``).  ``state.step``, if present, must equal ``step``.
        """
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative int")
        step = int(step)
        if not (force or self.should_save(step)):
            return False
        try:  # here, not in the background thread that writes it
            json.dumps(data_state)
        except (TypeError, ValueError) as e:
            raise TypeError(f"data_state must be JSON-serialisable (a Grain iterator's "
                            f"get_state() dict is); got {type(data_state).__name__}: {e}"
                            ) from None
        held = getattr(state, "step", None)
        if held is not None and int(held) != step:  # the save syncs with the step anyway
            raise ValueError(f"step={step} but state.step={int(held)}: pass the number of "
                             f"optimizer steps the state has taken")
        args = self._ocp.args
        return self._manager.save(step, args=args.Composite(**{
            STATE_ITEM: args.StandardSave(state),
            META_ITEM: args.JsonSave({"step": step, "data_state": data_state})}),
            force=force)

    def wait_until_finished(self) -> None:
        """Block until the last asynchronous save is committed (raises its error, if any)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for pending saves and release Orbax's resources."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> "TrainCheckpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------------- restoring
    def all_steps(self) -> list:
        """The steps of this directory's checkpoints, oldest first: the committed ones,
        plus a save this object has started and not yet committed (Orbax's bookkeeping;
        it commits unless the process dies).  A new ``TrainCheckpointer`` on the
        directory, as after a restart, lists only committed checkpoints."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> Optional[int]:
        """The newest of ``all_steps()``, or None."""
        return self._manager.latest_step()

    def stored_tree(self, step: int):
        """The ``state`` item of checkpoint ``step`` as Orbax's metadata describes it (a
        tree of dicts and lists whose leaves carry the saved shapes, dtypes and
        shardings; nothing is read but the metadata), or None where it cannot be read."""
        ocp = self._ocp
        try:
            path = ocp.path.step.find_step_path(
                self._manager.directory, ocp.path.step.standard_name_format(), step=step)
            handler = ocp.StandardCheckpointHandler()
            try:
                return handler.metadata(path / STATE_ITEM).tree
            finally:
                handler.close()
        except Exception:  # noqa: BLE001 - no metadata: restore as saved, see restore
            return None

    def restore(self, step: int, abstract_state) -> Restored:
        """The checkpoint of ``step``, its arrays placed on ``abstract_state``'s shardings.

        ``abstract_state``: the state's tree with a sharding on every leaf
        (``abstract_train_state(...)``, or a concrete state of the same structure).  The
        shardings may differ from those the checkpoint was written with (another mesh,
        replicated instead of FSDP): Orbax reads each device's slice.

        The decoder's blocks may be in the other form than the checkpoint's (saved from
        an unrolled model, restored into a scanned one, or the reverse; ``block_forms``
        reads the form of each, the stored one from Orbax's metadata, ``stored_tree``):
        the checkpoint is restored in its own form onto the shardings the requested ones
        imply (a stacked leaf: each layer's sharding with the layer axis unsplit; a
        layer's: the stacked sharding without it), then converted on the devices by a
        jitted ``models.stacking.to_form`` onto the requested shardings, the restored
        tree donated.  Converting holds both forms of the state for a moment (the stacked
        and the per-layer arrays cannot share buffers): about twice the state's memory
        at the peak.  Where the forms cannot be told, a ``ValueError`` says how to
        convert by hand.  A restore into the saved form is a plain Orbax restore.
        """
        self._manager.wait_until_finished()  # a save of this object in flight commits first
        if step not in self._manager.all_steps():
            raise ValueError(f"no checkpoint of step={step} in {self.config.directory}; "
                             f"committed steps: {self.all_steps()}")
        target = _abstract(abstract_state)
        wanted = block_forms(target)
        if len(wanted) > 1:
            raise ValueError(f"abstract_state holds the blocks in both forms ({wanted}: "
                             f"'layers' and layer_i entries); give it one form")
        stored = None
        if wanted:
            tree = self.stored_tree(step)
            stored = None if tree is None else block_forms(tree)
        state = None
        if not wanted or (stored is not None and set(stored) == set(wanted)):
            out = self._restore(step, target)       # the saved form: as Orbax restores it
        elif stored is None:  # no metadata: try the requested form as it is
            try:
                out = self._restore(step, target)
            except Exception as e:  # noqa: BLE001 - re-raised with the way out
                first = (str(e).splitlines() or [""])[0][:200]
                raise ValueError(
                    f"checkpoint {step} in {self.config.directory}: its metadata cannot be "
                    f"read, so its form of the layers is unknown, and restoring it as "
                    f"{next(iter(wanted))} failed ({type(e).__name__}: {first} ...); if "
                    f"it was saved in the other form, {_HOW}") from e
        else:
            (form, n), = wanted.items()
            if len(stored) != 1:
                raise ValueError(
                    f"checkpoint {step} in {self.config.directory}: cannot tell the form of "
                    f"its layers (its state holds {stored or 'no layer_i or layers entries'}"
                    f"; abstract_state is {form}); {_HOW}")
            (stored_form, stored_n), = stored.items()
            if stored_n != n:
                raise ValueError(f"checkpoint {step} in {self.config.directory} holds "
                                 f"{stored_n} layers ({stored_form}); abstract_state has {n} "
                                 f"({form})")
            out = self._restore(step, _in_form(target, stored_form == SCANNED))
            state = self._convert(out[STATE_ITEM], target, form == SCANNED)
        meta = out[META_ITEM]
        if meta.get("step") != step:
            raise ValueError(f"checkpoint {step} in {self.config.directory} records step "
                             f"{meta.get('step')!r} in its {META_ITEM!r} item: the directory "
                             f"was written by something else")
        return Restored(step=step, state=out[STATE_ITEM] if state is None else state,
                        data_state=meta.get("data_state"))

    def _restore(self, step: int, target):
        args = self._ocp.args
        return self._manager.restore(step, args=args.Composite(**{
            STATE_ITEM: args.StandardRestore(target), META_ITEM: args.JsonRestore()}))

    @staticmethod
    def _convert(restored, target, scanned: bool):
        """``restored`` (the other form) in ``target``'s form, on its shardings."""
        from jax_seqpar.models import stacking

        convert = jax.jit(stacking.to_form, static_argnums=1,
                          out_shardings=shardings_of(target), donate_argnums=0)
        with warnings.catch_warnings():  # stacked and per-layer buffers never alias
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            return convert(restored, scanned)

    def restore_latest(self, abstract_state) -> Optional[Restored]:
        """``restore(latest_step(), abstract_state)``, or None when there is no checkpoint
        (a fresh run)."""
        step = self.latest_step()
        return None if step is None else self.restore(step, abstract_state)


__all__ = ["CheckpointConfig", "META_ITEM", "Restored", "SCANNED", "STATE_ITEM",
           "TrainCheckpointer", "UNROLLED", "block_forms"]
