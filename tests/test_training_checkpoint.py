"""Issue 26, item 3: checkpoints with Orbax and exact resume (``jax_seqpar.training``).

The training runs are ``tests/ckpt_worker.py``: a tiny Llama (vocab 61, d_model 32, one
layer: resume is about state, not depth) with ring attention over 4 devices, FSDP-sharded state, packed-document batches
from a seeded generator with ``get_state`` / ``set_state``, a checkpoint every 2 steps,
the newest 2 kept.  The uninterrupted reference run and every resume run in this
process (one compiled step); each scenario that needs a process to die starts one child
with 4 simulated devices (the same XLA flags otherwise), which SIGKILLs itself or is
killed.  CPU arithmetic is deterministic, so resumed runs must match bit for bit.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt_worker as w
from jax_seqpar.training import (CheckpointConfig, TrainCheckpointer, TrainState,
                                 abstract_train_state)

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
#: Variables that would make a child see a cluster that is not there.
_CLUSTER_VARS = ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "PMIX_SERVER_URI2",
                 "JAX_COORDINATOR_ADDRESS", "JAX_SEQPAR_COORDINATOR",
                 "JAX_SEQPAR_NUM_PROCESSES", "JAX_SEQPAR_PROCESS_ID")
TMP_SUFFIX = ".orbax-checkpoint-tmp"


@pytest.fixture(scope="module")
def child_env(tmp_path_factory):
    """This process's environment (conftest's XLA flags) with 4 devices instead of 8,
    and a persistent compilation cache shared by the children (the second one loads the
    first one's programs instead of compiling them: ~7 s less)."""
    env = {k: v for k, v in os.environ.items() if k not in _CLUSTER_VARS}
    env.update(JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count="
                                         f"{w.DEVICES}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    return env


def worker_cmd(directory, mode, k):
    return [sys.executable, str(TESTS / "ckpt_worker.py"), str(directory), mode, str(k)]


def losses_of(lines):
    return {r["step"]: r["loss"] for r in map(json.loads, (ln for ln in lines
                                                            if ln.startswith("{")))}


def assert_states_equal(a, b, what):
    leaves_a, tree_a = jax.tree_util.tree_flatten_with_path(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert jax.tree.structure(a) == tree_b, what
    for (path, x), y in zip(leaves_a, leaves_b):
        assert x.dtype == y.dtype and np.array_equal(x, y), \
            f"{what}: {jax.tree_util.keystr(path)} differs"


def steps_on_disk(directory):
    return sorted(p.name for p in Path(directory).iterdir())


def committed_steps(directory):
    """The steps a new process finds: Orbax's listing, read-only (nothing cleaned)."""
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
        read_only=True))
    try:
        return sorted(manager.all_steps())
    finally:
        manager.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, in this process: losses, the state after step 4 and at
    the end (host copies), and its checkpoint directory."""
    directory = tmp_path_factory.mktemp("ckpt") / "reference"
    at = {}

    def after_step(step, state, saved, ckpt):
        assert saved == (step % w.SAVE_EVERY == 0)
        if step == 4:
            at[4] = w.to_host(state)

    resumed_from, losses, state = w.run(directory, w.make_mesh(), after_step=after_step)
    assert resumed_from is None and sorted(losses) == list(range(1, w.STEPS + 1))
    assert losses[w.STEPS] < losses[1]  # it trains
    return {"dir": directory, "losses": losses, "state": w.to_host(state), "state4": at[4]}


# --------------------------------------------------------------------------- (a)
def test_resume_after_sigkill_is_bit_identical(reference, child_env, tmp_path):
    """SIGKILL after step 5 (step 4's checkpoint committed, step 5 not saved), restart:
    the restarted run resumes at step 4, and every loss and the final parameters,
    optimizer state, step and key equal the uninterrupted run's bit for bit."""
    directory = tmp_path / "run"
    r = subprocess.run(worker_cmd(directory, "kill_after_commit", 4), env=child_env,
                       cwd=REPO, capture_output=True, text=True, timeout=240)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stdout, r.stderr[-3000:])
    assert "COMMITTED 4" in r.stdout, r.stdout
    killed = losses_of(r.stdout.splitlines())
    assert sorted(killed) == [1, 2, 3, 4, 5]
    assert steps_on_disk(directory) == ["2", "4"]

    resumed_from, resumed, state = w.run(directory, w.make_mesh())
    assert resumed_from == 4 and sorted(resumed) == [5, 6, 7, 8]
    for step, loss in {**killed, **resumed}.items():
        assert loss == reference["losses"][step], (step, loss, reference["losses"][step])
    assert_states_equal(w.to_host(state), reference["state"], "final state")
    assert int(state.step) == w.STEPS
    assert steps_on_disk(directory) == ["6", "8"]


# --------------------------------------------------------------------------- (b)
def test_sigkill_inside_a_save_leaves_the_previous_checkpoint(reference, child_env,
                                                              tmp_path):
    """The child's save of step 6 is held just before its commit (all files written to
    the temporary directory, the rename not done) and the child is SIGKILLed there: the
    partial checkpoint is never listed, the next checkpointer deletes it, and step 4
    restores to the reference run's state after 4 steps."""
    directory = tmp_path / "run"
    errors = open(tmp_path / "child_stderr.txt", "w")  # a file: a full pipe would block it
    proc = subprocess.Popen(worker_cmd(directory, "hang_in_save", 6), env=child_env,
                            cwd=REPO, stdout=subprocess.PIPE, stderr=errors, text=True)
    watchdog = threading.Timer(240, proc.kill)
    watchdog.start()
    lines, tmp = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(w.HANG_MARK):
                tmp = Path(line.split()[1])
                # the kill happens inside the save: its files are in the temporary
                # directory, no step 6 exists, step 4 is committed
                assert tmp.parent == directory and tmp.name.startswith("6" + TMP_SUFFIX)
                assert {"state", "meta"} <= set(os.listdir(tmp)), os.listdir(tmp)
                assert steps_on_disk(directory) == ["2", "4", tmp.name]
                os.kill(proc.pid, signal.SIGKILL)
                break
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait(timeout=60)
        errors.close()
    assert tmp is not None, "".join(lines) + (tmp_path / "child_stderr.txt").read_text()[-3000:]
    assert proc.returncode == -signal.SIGKILL
    killed = losses_of(lines)
    assert {1, 2, 3, 4, 5, 6} <= set(killed)
    assert all(killed[s] == reference["losses"][s] for s in killed)

    # Orbax lists only committed steps, even before anything is cleaned up
    assert committed_steps(directory) == [2, 4] and tmp.exists()

    _, _, abstract, _ = w.setup(w.make_mesh())
    with TrainCheckpointer(CheckpointConfig(directory, save_every=2, keep=2)) as ckpt:
        assert not tmp.exists(), "the partial checkpoint was not cleaned up"
        assert ckpt.all_steps() == [2, 4] and ckpt.latest_step() == 4
        restored = ckpt.restore_latest(abstract)
    assert restored.step == 4 and restored.data_state == {"seed": w.SEED, "index": 4}
    assert_states_equal(w.to_host(restored.state), reference["state4"], "step 4")


# --------------------------------------------------------------------------- (c)
def _small_state(mesh, step, seed=0):
    """A TrainState of a few arrays, FSDP-like sharded over ``mesh``."""
    rng = np.random.default_rng(seed)
    split, rep = NamedSharding(mesh, P("sp", None)), NamedSharding(mesh, P())
    put = jax.device_put
    return TrainState(params={"w": put(rng.standard_normal((8, 3), np.float32), split)},
                      opt_state={"mu": put(rng.standard_normal((8, 3), np.float32), split)},
                      step=put(jnp.int32(step), rep), rng=put(jax.random.key(seed), rep))


def test_keep_last_k(reference, tmp_path):
    """Only the newest ``keep`` checkpoints survive (the reference run kept 6 and 8 of
    2, 4, 6, 8); ``save_every`` decides which steps write; ``force`` writes any step."""
    assert steps_on_disk(reference["dir"]) == ["6", "8"]
    mesh = w.make_mesh()
    cfg = CheckpointConfig(tmp_path / "small", save_every=2, keep=3)
    with TrainCheckpointer(cfg) as ckpt:
        written = [s for s in range(1, 11) if ckpt.save(s, _small_state(mesh, s), {"i": s})]
        assert written == [2, 4, 6, 8, 10]
        assert ckpt.save(11, _small_state(mesh, 11), {"i": 11}, force=True)
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [8, 10, 11]
    assert steps_on_disk(tmp_path / "small") == ["10", "11", "8"]


def test_save_is_asynchronous_and_atomic(tmp_path, monkeypatch):
    """``save`` returns while the checkpoint is still being written: with its commit
    held, the step is not listed and the caller goes on (here: overwrites the arrays it
    saved, through a donating update); once released, the step is committed with the
    values of the moment of the save."""
    from orbax.checkpoint._src.path import atomicity

    release, held = threading.Event(), threading.Event()
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def hold(self, *args, **kwargs):
        if self.get_final().name == "2":
            held.set()
            assert release.wait(60)
        return await finalize(self, *args, **kwargs)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", hold)
    mesh = w.make_mesh()
    state = _small_state(mesh, 2)
    expected = w.to_host(state)
    bump = jax.jit(lambda s: s.replace(params={"w": s.params["w"] + 1.0}),
                   donate_argnums=0)
    with TrainCheckpointer(CheckpointConfig(tmp_path, save_every=1, keep=None)) as ckpt:
        assert ckpt.save(2, state, {"index": 2})
        assert held.wait(60), "the background save never reached its commit"
        # on disk only the temporary directory; a new process would list no step
        assert steps_on_disk(tmp_path) == ["2" + TMP_SUFFIX]
        assert committed_steps(tmp_path) == []
        state = bump(bump(state))  # training goes on while the save is in flight
        release.set()
        ckpt.wait_until_finished()
        assert steps_on_disk(tmp_path) == ["2"] and committed_steps(tmp_path) == [2]
        restored = ckpt.restore_latest(state)
    assert restored.data_state == {"index": 2}
    assert_states_equal(w.to_host(restored.state), expected, "restored")


# --------------------------------------------------------------------------- (d)
@pytest.mark.parametrize("devices,sharding", [(4, "fsdp"), (2, "fsdp"), (2, "replicated")])
def test_restored_arrays_carry_the_requested_shardings(reference, devices, sharding):
    """The reference run's last checkpoint (written FSDP over 4 devices) restored onto
    FSDP over the same 4, FSDP over 2 other devices, and replicated over those 2: every
    leaf has exactly the requested sharding and the saved values."""
    model, optimizer, saved_layout, _ = w.setup(w.make_mesh())
    mesh = w.make_mesh(jax.devices()[-devices:] if devices != w.DEVICES else None)
    abstract = abstract_train_state(model, optimizer, jax.random.key(w.SEED), (w.B, w.S),
                                    mesh=mesh, sharding=sharding, min_elements=0)
    with TrainCheckpointer(CheckpointConfig(reference["dir"], save_every=2)) as ckpt:
        restored = ckpt.restore_latest(abstract)
    assert restored.step == w.STEPS
    for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(abstract)):
        assert got.sharding == want.sharding, (got.sharding, want.sharding)
        assert got.shape == want.shape and got.dtype == want.dtype
    split = [x.sharding.spec for x in jax.tree.leaves(restored.state) if "sp" in x.sharding.spec]
    assert bool(split) == (sharding == "fsdp")  # FSDP really splits some leaves
    assert_states_equal(w.to_host(restored.state), reference["state"], "restored")


# --------------------------------------------------------------------------- errors
def test_errors_name_the_argument_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match="save_every=0 must be a positive int"):
        CheckpointConfig(tmp_path, save_every=0)
    with pytest.raises(ValueError, match="keep=0 must be a positive int"):
        CheckpointConfig(tmp_path, keep=0)
    assert CheckpointConfig("relative/dir").directory == os.path.abspath("relative/dir")
    mesh = w.make_mesh()
    with TrainCheckpointer(CheckpointConfig(tmp_path, save_every=1)) as ckpt:
        assert ckpt.restore_latest(_small_state(mesh, 0)) is None  # nothing yet
        with pytest.raises(ValueError, match="step=3 but state.step=2"):
            ckpt.save(3, _small_state(mesh, 2))
        with pytest.raises(TypeError, match="data_state must be JSON-serialisable"):
            ckpt.save(2, _small_state(mesh, 2), {"rng": np.random.default_rng(0)})
        ckpt.save(np.int64(2), _small_state(mesh, 2))
        ckpt.wait_until_finished()
        bare = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                            _small_state(mesh, 2))
        with pytest.raises(ValueError, match=r"leaf .*params.*'w'.* has no sharding"):
            ckpt.restore(2, bare)
        with pytest.raises(ValueError, match="no checkpoint of step=5"):
            ckpt.restore(5, _small_state(mesh, 2))
    model, optimizer, abstract, step = w.setup(mesh)
    batch = next(w.SeededBatches())
    with pytest.raises(ValueError, match=r"unknown keys \['labels'\]"):
        step.lower(abstract, {**batch, "labels": batch["tokens"]})
    with pytest.raises(ValueError, match=r"batch\['positions'\] has shape \(2, 8\)"):
        step.lower(abstract, {**batch, "positions": batch["positions"][:, :8]})
    with pytest.raises(ValueError, match="sharding='zero3' must be one of"):
        abstract_train_state(model, optimizer, jax.random.key(0), (2, 64), sharding="zero3")
    with pytest.raises(ValueError, match="tokens_shape=.* must be"):
        abstract_train_state(model, optimizer, jax.random.key(0), (64,))


def test_train_step_with_its_own_loss_gets_a_fresh_key_each_step():
    """``loss_fn(params, batch, key)``: the key comes from splitting ``state.rng`` once
    per step, so it changes every step and is the same again from the same state."""
    import optax

    from jax_seqpar.training import make_train_step

    def loss_fn(params, batch, key):
        noise = jax.random.normal(key, ())
        return jnp.sum(params["w"] ** 2) + noise, {"noise": noise}

    opt = optax.sgd(0.1)
    params = {"w": jnp.ones(3)}
    state = TrainState(params=params, opt_state=opt.init(params), step=jnp.int32(0),
                       rng=jax.random.key(0))
    step = make_train_step(None, opt, loss_fn=loss_fn, donate=False)
    batch = {"tokens": np.zeros((1, 4), np.int32)}
    s1, m1 = step(state, batch)
    s2, m2 = step(s1, batch)
    assert int(s2.step) == 2 and float(m1["noise"]) != float(m2["noise"])
    np.testing.assert_allclose(s1.params["w"], 0.8 * np.ones(3), rtol=1e-6)
    again, m1_again = step(state, batch)  # not donated: the old state is still usable
    assert float(m1_again["noise"]) == float(m1["noise"])
    assert_states_equal(w.to_host(again), w.to_host(s1), "same state, same step")


def test_optimizer_state_in_host_memory_trains_and_checkpoints_alike(tmp_path):
    """Issue 30: ``opt_memory="pinned_host"`` keeps the optimizer state's shards in host
    memory between steps (the step moves it to the device for the update and back);
    the steps give bit-identical losses and states on CPU, the state stays on the host,
    and a checkpoint of it restores onto the same memory kind."""
    from jax_seqpar.training import init_train_state, make_train_step, opt_state_offloaded

    mesh = w.make_mesh()
    model, optimizer, abstract, step = w.setup(mesh)
    key = jax.random.key(w.SEED)
    host_abstract = abstract_train_state(model, optimizer, key, (w.B, w.S), min_elements=0,
                                         opt_memory="pinned_host")
    assert opt_state_offloaded(host_abstract) and not opt_state_offloaded(abstract)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(host_abstract.opt_state)}
    assert kinds == {"pinned_host"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(host_abstract.params)} <= \
        {None, "device"}
    host_step = make_train_step(model, optimizer, shardings=host_abstract)
    a = init_train_state(model, optimizer, key, (w.B, w.S), min_elements=0)
    b = init_train_state(model, optimizer, key, (w.B, w.S), min_elements=0,
                         opt_memory="pinned_host")
    data = w.SeededBatches()
    for _ in range(2):
        batch = next(data)
        a, ma = step(a, batch)
        b, mb = host_step(b, batch)
        assert float(ma["loss"]) == float(mb["loss"])
    assert {x.sharding.memory_kind for x in jax.tree.leaves(b.opt_state)} == {"pinned_host"}
    assert_states_equal(w.to_host(b), w.to_host(a), "optimizer state on the host")
    with TrainCheckpointer(CheckpointConfig(tmp_path, save_every=1)) as ckpt:
        ckpt.save(2, b)
        ckpt.wait_until_finished()
        restored = ckpt.restore_latest(host_abstract)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(restored.state.opt_state)} == \
        {"pinned_host"}
    assert_states_equal(w.to_host(restored.state), w.to_host(a), "restored")
    with pytest.raises(ValueError, match="opt_memory='hbm' must be one of"):
        abstract_train_state(model, optimizer, key, (w.B, w.S), opt_memory="hbm")


# --------------------------------------------------------------------------- (e)
def _layers_model(mesh, scan_layers, num_layers=2):
    """A tiny 2-layer Llama (the worker's sizes) unrolled or scanned, and an optimizer
    whose state mirrors the parameters (Adam's moments)."""
    import optax

    from jax_seqpar.models import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=61, d_model=32, num_layers=num_layers, num_heads=4,
                      num_kv_heads=2, scan_layers=scan_layers)
    return Llama(cfg, mesh=mesh, layout="zigzag", strategy="ring"), optax.adam(1e-2)


def _saved_state(model, optimizer):
    """A state of ``model`` whose moments are not zeros (one Adam update with the
    parameters as gradients), so that a moment restored into the wrong slot shows."""
    from jax_seqpar.training import init_train_state

    state = init_train_state(model, optimizer, jax.random.key(1), (w.B, w.S), min_elements=0)
    _, opt_state = optimizer.update(state.params, state.opt_state, state.params)
    return state.replace(opt_state=opt_state)


@functools.lru_cache(maxsize=None)
def _saved_layers_state(scan_layers):
    """``_saved_state`` of the 2-layer model in either form, built once for the tests
    below (its initialisation compiles a train-state program; nothing donates it)."""
    return _saved_state(*_layers_model(w.make_mesh(), scan_layers))


@pytest.mark.parametrize("saved_scanned, sharding", [(False, "fsdp"), (True, "replicated")])
def test_restore_into_the_other_form_of_the_layers(tmp_path, saved_scanned, sharding):
    """A state saved from an unrolled model restores into a scanned model's abstract state
    (parameters and both Adam moments ``stack_layers`` of the saved ones) and the
    reverse (``unstack_layers``), every leaf on the requested sharding (FSDP with the
    layer axis unsplit, or replicated); the data state comes back too."""
    from jax_seqpar.models.stacking import to_form
    from jax_seqpar.training.checkpoint import block_forms

    mesh = w.make_mesh()
    state = _saved_layers_state(saved_scanned)
    saved = w.to_host(state)
    model, optimizer = _layers_model(mesh, not saved_scanned)
    abstract = abstract_train_state(model, optimizer, jax.random.key(1), (w.B, w.S),
                                    sharding=sharding, min_elements=0)
    assert block_forms(abstract) == {"unrolled" if saved_scanned else "scanned": 2}
    with TrainCheckpointer(CheckpointConfig(tmp_path, save_every=1)) as ckpt:
        ckpt.save(0, state, {"index": 7})
        ckpt.wait_until_finished()
        assert block_forms(ckpt.stored_tree(0)) == {"scanned" if saved_scanned
                                                   else "unrolled": 2}
        restored = ckpt.restore(0, abstract)
    assert restored.data_state == {"index": 7}
    assert jax.tree.structure(restored.state) == jax.tree.structure(abstract)
    for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(abstract)):
        assert got.sharding == want.sharding, (got.sharding, want.sharding)
        assert got.shape == want.shape and got.dtype == want.dtype
    if not saved_scanned:  # FSDP of the stacked leaves: never the layer axis, the others
        stacked = jax.tree.leaves(restored.state.params["params"]["layers"])
        assert all(x.sharding.spec[0] is None for x in stacked)
        assert any("sp" in x.sharding.spec for x in stacked)
    assert_states_equal(w.to_host(restored.state),
                        w.to_host(to_form(saved, not saved_scanned)), "converted")


def test_restore_across_forms_says_how_to_convert(tmp_path, monkeypatch):
    """What cannot be converted raises a ValueError that names the way out: a checkpoint
    whose state holds no layers, another number of layers, a state that holds both
    forms, and (no metadata) a restore into the other form that fails."""
    mesh = w.make_mesh()
    state = _saved_layers_state(False)
    scanned_abstract = abstract_train_state(*_layers_model(mesh, True), jax.random.key(1),
                                            (w.B, w.S), min_elements=0)
    three = abstract_train_state(*_layers_model(mesh, True, 3), jax.random.key(1),
                                 (w.B, w.S), min_elements=0)
    with TrainCheckpointer(CheckpointConfig(tmp_path, save_every=1)) as ckpt:
        ckpt.save(0, state)
        ckpt.save(2, _small_state(mesh, 2))
        ckpt.wait_until_finished()
        with pytest.raises(ValueError, match=r"checkpoint 2 .* cannot tell the form of its "
                                             r"layers .*stack_layers / unstack_layers"):
            ckpt.restore(2, scanned_abstract)
        with pytest.raises(ValueError, match=r"holds 2 layers \(unrolled\); abstract_state "
                                             r"has 3 \(scanned\)"):
            ckpt.restore(0, three)
        both = scanned_abstract.replace(params={"params": {
            **scanned_abstract.params["params"], "layer_0": state.params["params"]["layer_0"]}})
        with pytest.raises(ValueError, match="holds the blocks in both forms"):
            ckpt.restore(0, both)
        monkeypatch.setattr(TrainCheckpointer, "stored_tree", lambda self, step: None)
        with pytest.raises(ValueError, match=r"metadata cannot be read.*stack_layers"):
            ckpt.restore(0, scanned_abstract)
        same = ckpt.restore(0, state)  # the saved form needs no metadata
    assert_states_equal(w.to_host(same.state), w.to_host(state), "same form")
