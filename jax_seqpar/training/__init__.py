"""Training: the train state and step (``state``), checkpoints and exact resume with Orbax
(``checkpoint``).

``checkpoint`` needs ``orbax-checkpoint`` (the ``[train]`` extra); it is imported on first
use of its names, so the train state and step work without it.
"""

from jax_seqpar.training.state import (BATCH_KEYS, OPT_MEMORY, TrainState,
                                       abstract_train_state, init_train_state,
                                       make_train_step, opt_state_offloaded, shardings_of)

_CHECKPOINT_NAMES = ("CheckpointConfig", "Restored", "TrainCheckpointer")


def __getattr__(name):
    if name in _CHECKPOINT_NAMES:
        from jax_seqpar.training import checkpoint
        return getattr(checkpoint, name)
    raise AttributeError(f"module 'jax_seqpar.training' has no attribute {name!r}")


__all__ = ["BATCH_KEYS", "OPT_MEMORY", "TrainState", "abstract_train_state",
           "init_train_state", "make_train_step", "opt_state_offloaded", "shardings_of",
           *_CHECKPOINT_NAMES]
