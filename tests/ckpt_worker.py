"""Worker of tests/test_training_checkpoint.py: a tiny Llama trained with ring attention on
4 devices, FSDP-sharded state, Orbax checkpoints every 2 steps.

    python tests/ckpt_worker.py DIR kill_after_commit K   # SIGKILLs itself after step K+1,
                                                          # once step K's save is committed
    python tests/ckpt_worker.py DIR hang_in_save K        # step K's save stops just before
                                                          # its commit; the test kills it

Each step prints one JSON line ``{"step": s, "loss": l}`` (a float32 loss printed as a
Python float round-trips exactly).  The test imports this module and runs the same
``run`` in its own process, uninterrupted and resumed.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time

import numpy as np

DEVICES, B, S = 4, 2, 64
STEPS, SAVE_EVERY, KEEP = 8, 2, 2
SEED = 0
#: Printed by a worker whose save is held just before its commit.
HANG_MARK = "HANG_IN_SAVE"


class SeededBatches:
    """Stand-in for the Grain iterator: batch ``i`` is a function of ``(seed, i)`` only,
    and ``get_state()`` / ``set_state()`` carry ``i``.  Rows hold two packed documents,
    so every entry of the batch contract is used (segment ids, per-document positions,
    a loss mask)."""

    def __init__(self, seed: int = SEED, vocab: int = 61):
        self.seed, self.index, self.vocab = seed, 0, vocab

    def get_state(self) -> dict:
        return {"seed": self.seed, "index": self.index}

    def set_state(self, state: dict) -> None:
        self.seed, self.index = int(state["seed"]), int(state["index"])

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        rng = np.random.default_rng([self.seed, self.index])
        self.index += 1
        cut = rng.integers(8, S - 8, size=(B, 1))
        arange = np.arange(S)[None, :]
        return {"tokens": rng.integers(0, self.vocab, size=(B, S)).astype(np.int32),
                "segment_ids": (1 + (arange >= cut)).astype(np.int32),
                "positions": np.where(arange >= cut, arange - cut, arange).astype(np.int32),
                "loss_mask": rng.random((B, S)) < 0.9}


@functools.lru_cache(maxsize=None)
def setup(mesh):
    """``(model, optimizer, abstract_state, train_step)`` on ``mesh`` (cached: the test
    runs several trainings with one compiled step)."""
    import jax
    import optax

    from jax_seqpar.models import Llama, LlamaConfig
    from jax_seqpar.training import abstract_train_state, make_train_step

    cfg = LlamaConfig(vocab_size=61, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2)
    model = Llama(cfg, mesh=mesh, layout="zigzag", strategy="ring")
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    abstract = abstract_train_state(model, optimizer, jax.random.key(SEED), (B, S),
                                    min_elements=0)
    return model, optimizer, abstract, make_train_step(model, optimizer, shardings=abstract)


def make_mesh(devices=None):
    import jax
    from jax.sharding import AxisType

    devices = devices or jax.devices()[:DEVICES]
    return jax.make_mesh((len(devices),), ("sp",), devices=devices,
                         axis_types=(AxisType.Auto,))


def to_host(state):
    """NumPy copy of a train state (typed PRNG keys as their key data); a copy, so the
    state may be donated afterwards."""
    import jax

    def one(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.array(x)
    return jax.tree.map(one, state)


def run(directory, mesh, *, steps=STEPS, after_step=None, emit=None):
    """Train to ``steps``, resuming from ``directory``'s latest checkpoint if there is one,
    saving every ``SAVE_EVERY`` steps.  ``after_step(step, state, saved, ckpt)`` is called
    after each step's save; ``emit(step, loss)`` after each step.  Returns
    ``(resumed_from, {step: loss}, final state)``."""
    import jax

    from jax_seqpar.training import CheckpointConfig, TrainCheckpointer, init_train_state

    model, optimizer, abstract, train_step = setup(mesh)
    data = SeededBatches()
    losses = {}
    with TrainCheckpointer(CheckpointConfig(directory, save_every=SAVE_EVERY,
                                            keep=KEEP)) as ckpt:
        restored = ckpt.restore_latest(abstract)
        if restored is None:
            resumed_from = None
            state = init_train_state(model, optimizer, jax.random.key(SEED), (B, S),
                                     min_elements=0)
        else:
            resumed_from, state = restored.step, restored.state
            data.set_state(restored.data_state)
        for step in range(int(state.step) + 1, steps + 1):
            state, metrics = train_step(state, next(data))
            losses[step] = float(metrics["loss"])
            if emit:
                emit(step, losses[step])
            saved = ckpt.save(step, state, data.get_state())
            if after_step:
                after_step(step, state, saved, ckpt)
    return resumed_from, losses, state


def _hold_commit_of(step: int) -> None:
    """Make the save of ``step`` stop just before its commit: everything is written to
    the temporary directory, the rename that publishes it never comes."""
    from orbax.checkpoint._src.path import atomicity

    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def held(self, *args, **kwargs):
        if self.get_final().name == str(step):  # the step directory, not an item in it
            print(f"{HANG_MARK} {self.get()}", flush=True)
            time.sleep(600)
        return await finalize(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = held


def main(argv) -> int:
    directory, mode, k = argv[0], argv[1], int(argv[2])
    emit = lambda step, loss: print(json.dumps({"step": step, "loss": loss}),  # noqa: E731
                                    flush=True)
    after_step = None
    if mode == "kill_after_commit":
        def after_step(step, state, saved, ckpt):
            if step == k:
                assert saved
                ckpt.wait_until_finished()     # step k is committed ...
                print(f"COMMITTED {k}", flush=True)
            if step == k + 1:                  # ... and one more step ran, unsaved
                os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "hang_in_save":
        _hold_commit_of(k)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    run(directory, make_mesh(), emit=emit, after_step=after_step)
    return 1  # not reached: the test kills this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
