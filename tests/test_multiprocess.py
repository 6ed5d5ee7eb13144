"""Several processes, one mesh: ``python -m jax_seqpar launch`` and
``jax_seqpar.runtime.distributed``.

The multi-process runs start 2 local processes x 4 simulated CPU devices (gloo
collectives) through the launcher; the workers (``mp_worker_*.py``) gather their results
to process 0, which writes them to an .npz file.  This test process then runs the same
worker code on its own 8 devices and compares, and compares both with a dense oracle.
"""

from __future__ import annotations

import io
import os
import re
import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mp_worker_attention as att_worker
import mp_worker_train as train_worker
from helpers import assert_close, make_mesh, reference_fwd_bwd, rel_err, seconds
from jax_seqpar.runtime import distributed as jd
from jax_seqpar.runtime.launch import TIMEOUT_EXIT, _with_device_count, launch, process_envs

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
F32_TOL = 1e-5
#: Variables that would make the workers see a cluster that is not there.
_CLUSTER_VARS = ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "PMIX_SERVER_URI2",
                 "JAX_COORDINATOR_ADDRESS", jd.ENV_COORDINATOR, jd.ENV_NUM_PROCESSES,
                 jd.ENV_PROCESS_ID)


def _env():
    env = {k: v for k, v in os.environ.items() if k not in _CLUSTER_VARS}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run_launcher(*args, timeout=120, scale_timeout=True):
    """``python -m jax_seqpar launch ARGS`` in a subprocess: ``(returncode, stdout, stderr)``.
    ``timeout`` and (unless ``scale_timeout=False``) a ``--timeout`` among ``ARGS`` are
    scaled by ``helpers.seconds``."""
    args = list(args)
    if scale_timeout and "--timeout" in args:
        i = args.index("--timeout") + 1
        args[i] = f"{seconds(float(args[i])):g}"
    r = subprocess.run([sys.executable, "-m", "jax_seqpar", "launch", *map(str, args)],
                       cwd=REPO, env=_env(), capture_output=True, text=True,
                       timeout=seconds(timeout))
    return r.returncode, r.stdout, r.stderr


#: Both workers in one launch (one start-up of the 2 processes for the two tests); the
#: second ``initialize()`` returns the first one's info, as mp_worker_attention checks.
_BOTH_WORKERS = ("import sys; sys.path.insert(0, sys.argv[1]); "
                 "import mp_worker_attention as a, mp_worker_train as t; "
                 "sys.exit(a.main(sys.argv[2]) or t.main(sys.argv[3]))")


@pytest.fixture(scope="module")
def worker_results(tmp_path_factory):
    """``{"att": ..., "train": ...}``: what process 0 of the 2-process launch wrote."""
    out = tmp_path_factory.mktemp("mp")
    timeout = 150
    code, out_text, err_text = run_launcher(
        "--num-processes", 2, "--devices-per-process", 4, "--timeout", timeout, "--",
        sys.executable, "-c", _BOTH_WORKERS, TESTS, out / "att.npz", out / "train.npz",
        timeout=timeout + 20)
    assert code == 0, f"launch exited {code}\n{out_text}\n{err_text}"
    for p in (0, 1):  # both processes joined one job of 8 devices
        assert f"[p{p}] process {p} of 2: 4 of 8 cpu devices" in out_text, out_text
    return {name: dict(np.load(out / f"{name}.npz")) for name in ("att", "train")}


def _report(rows):
    """Print the measured differences (seen with ``pytest -s``)."""
    for name, mp_vs_sp, mp_vs_ref in rows:
        print(f"{name:<32} 2 processes vs 1: max |diff| {mp_vs_sp[0]:.2e}, rel {mp_vs_sp[1]:.2e}"
              f"; vs dense oracle: rel {mp_vs_ref:.2e}")


def _diff(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b)))), rel_err(a, b)


# --------------------------------------------------------------------------- attention
@pytest.mark.multiprocess
def test_ring_attention_two_processes_equals_one(worker_results):
    """Ring attention (plain, causal contiguous, causal zigzag; both backwards) across
    2 processes x 4 devices: outputs and gradients equal one process on 8 devices and
    the dense reference."""
    mp = worker_results["att"]
    assert int(mp["process_count"]) == 2 and int(mp["device_count"]) == 8
    sp = att_worker.run(make_mesh(8))
    q, k, v, do = map(jnp.asarray, att_worker.host_inputs())
    rows = []
    for name, case in att_worker.CASES.items():
        assert not mp[f"{name}/fully_addressable"], "the outputs never spanned processes"
        ro, _, rgrads = reference_fwd_bwd(q, k, v, do, causal=case["causal"])
        for what, ref in zip(att_worker.OUTPUTS, (ro, *rgrads)):
            key = f"{name}/{what}"
            assert_close(mp[key], sp[key], F32_TOL, f"{key}: 2 processes vs 1")
            assert_close(mp[key], ref, F32_TOL, f"{key}: 2 processes vs reference")
            rows.append((key, _diff(mp[key], sp[key]), rel_err(mp[key], ref)))
    _report(rows)


# --------------------------------------------------------------------------- training
def _dense_step():
    """The worker's training step on one device with jax.nn attention (no sharding)."""
    params = jax.tree.map(jnp.asarray, train_worker.host_params())
    tokens, targets = map(jnp.asarray, train_worker.host_batch())
    dev = jax.devices()[0]
    params, tokens, targets = jax.device_put((params, tokens, targets), dev)
    opt_state = train_worker.optimizer().init(params)
    new, _, loss, grads = train_worker.train_step(None)(params, opt_state, tokens, targets)
    return {"loss": np.asarray(loss),
            **{f"params/{k}": np.asarray(x) for k, x in new.items()},
            **{f"grads/{k}": np.asarray(x) for k, x in grads.items()}}


@pytest.mark.multiprocess
def test_training_step_two_processes_equals_one(worker_results):
    """One AdamW step of a small attention model (ring, causal, zigzag) across 2 processes
    x 4 devices: loss, gradients and updated parameters equal one process on 8 devices
    and a dense single-device step."""
    mp = worker_results["train"]
    assert int(mp["process_count"]) == 2 and not mp["tokens_fully_addressable"]
    sp = train_worker.run(make_mesh(8))
    dense = _dense_step()
    keys = ["loss"] + sorted(k for k in sp if k.startswith(("params/", "grads/")))
    assert len(keys) == 13
    rows = []
    for key in keys:
        assert_close(mp[key], sp[key], F32_TOL, f"{key}: 2 processes vs 1")
        assert_close(mp[key], dense[key], F32_TOL, f"{key}: 2 processes vs dense")
        rows.append((key, _diff(mp[key], sp[key]), rel_err(mp[key], dense[key])))
    # the step moved the parameters: the comparison above is not of the initial values
    start = train_worker.host_params()
    assert all(np.abs(mp[f"params/{k}"] - start[k]).max() > 1e-3 for k in start)
    _report(rows)


@pytest.mark.multiprocess
def test_demo_under_the_launcher():
    """``python -m jax_seqpar demo`` across 2 processes: process 0 checks and reports."""
    code, out, err = run_launcher(
        "-n", 2, "--devices-per-process", 4, "--timeout", 100, "--", sys.executable, "-m",
        "jax_seqpar", "demo", "--seq-len", 256, "--head-dim", 16, timeout=120)
    assert code == 0, out + err
    assert "[p0] 8 x cpu (cpu) in 2 processes" in out, out
    assert "budget 1e-05: PASS" in out, out
    rows = [ln.split()[1:] for ln in out.splitlines() if ln.startswith(("[p0] ring",
                                                                        "[p0] allgather"))]
    assert [r[:3] for r in rows] == [["ring", "8", "256"], ["allgather", "8", "256"]], out
    assert all(float(e) <= F32_TOL for r in rows for e in r[3:7])
    assert "[p1] ring" not in out  # only process 0 reports


@pytest.mark.multiprocess
def test_training_example_two_processes_equals_one(tmp_path):
    """examples/train_long_context.py under the launcher (2 processes x 2 devices) logs
    the same losses as one process with 4 devices; only process 0 reports and writes."""
    args = [TESTS.parent / "examples" / "train_long_context.py", "--steps", 4,
            "--seq-len", 256, "--log-every", 1, "--batch", 2, "--d-model", 32,
            "--layers", 1]  # one block: the processes, not the depth, are under test
    code, out, err = run_launcher(
        "-n", 2, "--devices-per-process", 2, "--timeout", 150, "--", sys.executable, *args,
        "--out", tmp_path / "mp", timeout=170)
    assert code == 0, out + err
    assert "[p0] processes: 2 (jax_seqpar launch)" in out, out
    assert "[p1] held-out" not in out and "[p0] held-out" in out, out
    assert "[p0] attention kernel: xla (256 x 256 tiles)" in out, out  # auto on CPU
    single = subprocess.run([sys.executable, *map(str, [*args, "--devices", 4, "--out",
                                                        tmp_path / "one"])], cwd=REPO, env=_env(),
                            capture_output=True, text=True, timeout=seconds(150))
    assert single.returncode == 0, single.stdout + single.stderr
    logs = [json.loads((tmp_path / d / "train_log.json").read_text()) for d in ("mp", "one")]
    assert [lg["processes"] for lg in logs] == [2, 1] and [lg["devices"] for lg in logs] == [4, 4]
    assert logs[1]["kernel"] == "xla (256 x 256 tiles)"
    for a, b in zip(logs[0]["log"], logs[1]["log"]):
        assert a["step"] == b["step"]
        np.testing.assert_allclose([a["loss"], a["accuracy"]], [b["loss"], b["accuracy"]],
                                   rtol=1e-5)
    assert len(logs[0]["log"]) == 4 and not (tmp_path / "mp" / "p1").exists()


# --------------------------------------------------------------------------- launcher
_CHILD = ("import os, sys, time; p = int(os.environ['JAX_SEQPAR_PROCESS_ID']); "
          "print('hello from', p, 'of', os.environ['JAX_SEQPAR_NUM_PROCESSES'], "
          "os.environ['JAX_SEQPAR_COORDINATOR'], os.environ.get('XLA_FLAGS', ''), flush=True); ")


@pytest.mark.multiprocess
def test_launch_prefixes_output_and_sets_environment():
    code, out, err = run_launcher("-n", 3, "--devices-per-process", 2, "--",
                                  sys.executable, "-c",
                                  _CHILD + "print('to stderr', p, file=sys.stderr)", timeout=60)
    assert code == 0, out + err
    lines = out.splitlines()
    coordinators = set()
    for p in range(3):
        (line,) = [ln for ln in lines if ln.startswith(f"[p{p}] hello from {p} of 3 ")]
        coordinators.add(line.split()[6])
        assert line.count("--xla_force_host_platform_device_count") == 1
        assert line.endswith("--xla_force_host_platform_device_count=2"), line
        assert f"[p{p}] to stderr {p}" in err.splitlines()
    assert len(coordinators) == 1 and coordinators.pop().startswith("127.0.0.1:")


@pytest.mark.multiprocess
def test_launch_fails_loudly_when_a_process_fails(tmp_path):
    """Process 1 exits 3 while process 0 would sleep for a minute: the launcher stops
    process 0 at once, exits 3 and names process 1.  Process 1 exits only once process 0
    has said hello (a marker file), else on a loaded machine the launcher may stop
    process 0 before its first line (1 failure in a full ``make test``, 2026-11-26)."""
    marker = str(tmp_path / "p0_said_hello")
    wait = (f"import pathlib; m = pathlib.Path({marker!r}); t = time.monotonic()\n"
            "while not m.exists() and time.monotonic() - t < 30: time.sleep(0.05)\n")
    t0 = time.monotonic()
    code, out, err = run_launcher(
        "-n", 2, "--", sys.executable, "-c",
        _CHILD + f"open({marker!r}, 'w').close() if p == 0 else None\n" + wait
        + "sys.exit(3) if p == 1 else time.sleep(60)", timeout=60)
    assert code == 3, out + err
    assert "process 1 failed with exit code 3" in err, err
    assert "[p0] hello from 0" in out and "[p1] hello from 1" in out
    assert time.monotonic() - t0 < seconds(30)


@pytest.mark.multiprocess
def test_launch_timeout_stops_every_process():
    t0 = time.monotonic()
    code, out, err = run_launcher("-n", 2, "--timeout", 2, "--", sys.executable, "-c",
                                  _CHILD + "time.sleep(60)", timeout=60, scale_timeout=False)
    assert code == TIMEOUT_EXIT, out + err
    assert "timeout: 2 s passed with processes 0, 1 still running" in err, err
    # each hung process shows where it is (faulthandler), not only that it was stopped
    for p in (0, 1):
        assert f"[launch] process {p} (pid" in err, err
        assert f"[p{p}] Fatal Python error: Aborted" in err, err
        assert any(line.startswith(f"[p{p}]") and "time.sleep" not in line
                   and 'File "<string>", line 1' in line for line in err.splitlines()), err
    assert time.monotonic() - t0 < seconds(30)


@pytest.mark.multiprocess
def test_launch_passes_sigterm_on():
    """SIGTERM to the launcher stops its processes (they run in their own sessions)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "jax_seqpar", "launch", "-n", "2", "--", sys.executable, "-c",
         "import os, time; print('pid', os.getpid(), flush=True); time.sleep(60)"],
        cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = [int(proc.stdout.readline().split()[-1]) for _ in range(2)]
    proc.terminate()
    _, err = proc.communicate(timeout=seconds(30))
    assert proc.returncode == 143 and "terminated; stopping all processes" in err, err
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.multiprocess
def test_launch_in_process_api_and_argument_errors():
    out, err = io.StringIO(), io.StringIO()
    assert launch([sys.executable, "-c", "print('x')"], 2, stdout=out, stderr=err) == 0
    assert sorted(out.getvalue().splitlines()) == ["[p0] x", "[p1] x"]
    with pytest.raises(ValueError, match="no command to launch"):
        launch([], 2)
    with pytest.raises(ValueError, match="num_processes=0"):
        launch(["true"], 0)
    with pytest.raises(ValueError, match="timeout=-1"):
        launch(["true"], 2, timeout=-1)
    with pytest.raises(ValueError, match="grace=-1"):
        launch(["true"], 2, grace=-1)
    code, _, err_text = run_launcher("-n", 2, timeout=60)
    assert code == 2 and "no command to launch" in err_text


#: A process of a launched job: a plain bind of the coordinator's port must fail (the
#: launcher holds it); a listening socket with SO_REUSEPORT on all addresses, as JAX's
#: gRPC server binds it, must succeed.
_PORT_CHILD = ("import os, socket; port = int(os.environ['JAX_SEQPAR_COORDINATOR'].rsplit(':', 1)[1]); "
               "plain = socket.socket()\n"
               "try:\n    plain.bind(('0.0.0.0', port)); print('plain bind: taken')\n"
               "except OSError as e:\n    print('plain bind: refused', e.errno)\n"
               "srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)\n"
               "srv.bind(('0.0.0.0', port)); srv.listen(); print('server bind: ok', flush=True)")


@pytest.mark.multiprocess
@pytest.mark.skipif(not hasattr(__import__("socket"), "SO_REUSEPORT"), reason="no SO_REUSEPORT")
def test_launch_holds_the_coordinator_port_until_the_job_ends():
    """A port only looked up and closed could be taken before the coordinator binds it
    (seen under load: "Address already in use"); the launcher holds it instead."""
    import errno
    import socket

    out, err = io.StringIO(), io.StringIO()
    assert launch([sys.executable, "-c", _PORT_CHILD], 1, stdout=out, stderr=err) == 0, \
        out.getvalue() + err.getvalue()
    assert out.getvalue().splitlines() == [f"[p0] plain bind: refused {errno.EADDRINUSE}",
                                           "[p0] server bind: ok"], out.getvalue()
    port = int(re.search(r"127\.0\.0\.1:(\d+)", err.getvalue()).group(1))
    with socket.socket() as s:  # released when the job has ended
        s.bind(("127.0.0.1", port))


def test_process_envs_devices_and_gpus():
    envs = process_envs(2, 1234, devices_per_process=4, gpus_per_process=2,
                        base={"XLA_FLAGS": "--a=1 --xla_force_host_platform_device_count=8",
                              "CUDA_VISIBLE_DEVICES": "3,4,5,6,7"})
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3,4", "5,6"]
    assert envs[1]["XLA_FLAGS"] == "--a=1 --xla_force_host_platform_device_count=4"
    assert [e[jd.ENV_PROCESS_ID] for e in envs] == ["0", "1"]
    assert envs[0][jd.ENV_COORDINATOR] == "127.0.0.1:1234"
    assert [e["CUDA_VISIBLE_DEVICES"] for e in process_envs(2, 1, gpus_per_process=1,
                                                            base={})] == ["0", "1"]
    with pytest.raises(ValueError, match="needs 4 GPUs but CUDA_VISIBLE_DEVICES='0,1'"):
        process_envs(2, 1, gpus_per_process=2, base={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert _with_device_count("", 3) == "--xla_force_host_platform_device_count=3"


# --------------------------------------------------------------------------- initialize
@pytest.fixture
def no_cluster(monkeypatch):
    """No cluster variables, and no earlier initialize() call in this process."""
    for name in _CLUSTER_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(jd, "_STATE", {})
    return monkeypatch


def test_initialize_single_process_without_settings(no_cluster):
    info = jd.initialize()
    assert (info.process_index, info.process_count) == (0, 1)
    assert info.device_count == info.local_device_count == len(jax.devices())
    assert info.source == "single process" and info.is_main
    assert jd.initialize() == info  # idempotent
    with pytest.raises(RuntimeError, match="already called with other settings: "
                                           "num_processes=2 \\(first call: 1\\)"):
        jd.initialize(num_processes=2)
    no_cluster.setattr(jd, "_STATE", {})
    no_cluster.setenv(jd.ENV_NUM_PROCESSES, "1")  # a launch of one process needs nothing
    no_cluster.setenv(jd.ENV_PROCESS_ID, "0")
    no_cluster.setenv(jd.ENV_COORDINATOR, "127.0.0.1:1")
    info = jd.initialize()
    assert info.process_count == 1 and info.source == "jax_seqpar launch"


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(coordinator_address="10.0.0.1"), ValueError, "coordinator_address='10.0.0.1'"),
    (dict(coordinator_address="h:99999"), ValueError, "the port must be in"),
    (dict(num_processes=0), ValueError, "num_processes=0 must be >= 1"),
    (dict(num_processes="2"), TypeError, "num_processes='2' must be an int"),
    (dict(process_id=-1), ValueError, "process_id=-1 must be >= 0"),
    (dict(num_processes=2, process_id=2), ValueError, "process_id=2 must be < num_processes=2"),
    (dict(local_device_ids=[0, 0]), ValueError, "local_device_ids=.* repeated"),
    (dict(local_device_ids="0"), ValueError, "local_device_ids"),
    (dict(cpu_collectives="nccl"), ValueError, "cpu_collectives='nccl'"),
])
def test_initialize_argument_errors(no_cluster, kwargs, error, match):
    with pytest.raises(error, match=match):
        jd.initialize(**kwargs)


def test_initialize_environment_errors(no_cluster):
    no_cluster.setenv(jd.ENV_NUM_PROCESSES, "two")
    with pytest.raises(ValueError, match="JAX_SEQPAR_NUM_PROCESSES='two' must be an integer"):
        jd.initialize()
    no_cluster.setenv(jd.ENV_NUM_PROCESSES, "2")
    with pytest.raises(ValueError, match="JAX_SEQPAR_COORDINATOR, JAX_SEQPAR_PROCESS_ID not set"):
        jd.initialize()
    no_cluster.setenv(jd.ENV_PROCESS_ID, "0")
    no_cluster.setenv(jd.ENV_COORDINATOR, "127.0.0.1:1")
    # a job of 2 processes, but JAX's backends already run in this process
    with pytest.raises(RuntimeError, match="must run before JAX starts its backends"):
        jd.initialize()


def test_from_host_and_to_host_single_process():
    mesh = make_mesh(8)
    x = np.arange(2 * 16 * 3, dtype=np.float32).reshape(2, 16, 3)
    g = jd.from_host(x, mesh, jax.sharding.PartitionSpec(None, "sp"))
    assert g.sharding.spec == jax.sharding.PartitionSpec(None, "sp")
    assert len(g.addressable_shards) == 8 and g.addressable_shards[1].data.shape == (2, 2, 3)
    np.testing.assert_array_equal(jd.to_host(g), x)
    part = jd.from_process_local(x, mesh, jax.sharding.PartitionSpec(None, "sp"))
    np.testing.assert_array_equal(jd.to_host(part), x)
    with pytest.raises(TypeError, match="spec="):
        jd.from_host(x, mesh, "sp")


_QUIET_CHILD = ("import jax_seqpar.runtime.distributed as jd; info = jd.initialize(); import jax; "
                "from jax._src.distributed import global_state as g; "
                "print('ok', info.process_index, len(jax.devices()), flush=True); ")


@pytest.mark.multiprocess
def test_normal_exit_is_orderly_and_quiet():
    """Every process leaves through jax.distributed.shutdown at exit (registered by
    initialize), so a successful job prints no runtime errors; an explicit shutdown()
    disconnects the client, and a second one is a no-op."""
    code, out, err = run_launcher("-n", 2, "--devices-per-process", 1, "--timeout", 60, "--",
                                  sys.executable, "-c", _QUIET_CHILD, timeout=90)
    assert code == 0, out + err
    assert "[p0] ok 0 2" in out and "[p1] ok 1 2" in out, out
    for word in ("CANCELLED", "WatchTasks", "Error", "Traceback", "failed"):
        assert word not in err and word not in out, (word, out, err)
    code, out, err = run_launcher(
        "-n", 2, "--devices-per-process", 1, "--timeout", 60, "--", sys.executable, "-c",
        _QUIET_CHILD + "jd.shutdown(); print('client', g.client, flush=True); jd.shutdown()",
        timeout=90)
    assert code == 0 and "[p0] client None" in out and "[p1] client None" in out, out + err


@pytest.mark.multiprocess
def test_failing_process_skips_the_orderly_exit():
    """An uncaught exception marks the process failed: it exits at once (no shutdown
    barrier to wait at), loudly, and the launcher stops the job.  The other process, in
    the distributed job, catches the launcher's SIGTERM (JAX's preemption notifier) and
    ends at the SIGKILL ``--grace`` seconds later (0.5 here, 5 by default)."""
    start = time.monotonic()
    code, out, err = run_launcher(
        "-n", 2, "--devices-per-process", 1, "--timeout", 120, "--grace", 0.5, "--",
        sys.executable, "-c",
        _QUIET_CHILD + "import time; time.sleep(90) if info.process_index == 0 else "
        "(_ for _ in ()).throw(RuntimeError('boom in p1'))", timeout=150)
    assert code == 1, (code, out, err)
    assert "boom in p1" in out + err
    assert "process 1 failed with exit code 1" in err, err
    # without leaving at once, process 1 waited at JAX's shutdown barrier until process
    # 0 had slept its 90 s (measured: the job took as long as the sleep)
    assert time.monotonic() - start < seconds(60), time.monotonic() - start


#: What JAX 0.11.2 printed on 2 H200s when two processes left a job (2026-11-23).
_GRPC_SHUTDOWN = (
    "W1123 00:42:45.305952 1414 pjrt_client.cc:1605] WatchTasksAsync failed for task 0: "
    "CANCELLED: CANCELLED\n"
    "Additional GRPC error information from remote target coordination_service while "
    "calling /xla.coordination.CoordinationService/WatchTasks:\n"
    ":CANCELLED:CANCELLED [type.googleapis.com/tensorflow.DerivedStatus='']\n"
    "=== Source Location Trace: === \n"
    "external/xla+/xla/tsl/distributed_runtime/rpc/grpc_util.h:89\n\n")


@pytest.mark.multiprocess
@pytest.mark.parametrize("exit_code", [0, 1])
def test_launcher_hides_the_runtime_shutdown_warning_unless_the_process_fails(exit_code):
    child = ("import sys; sys.stderr.write(" + repr(_GRPC_SHUTDOWN) + "); "
             "print('after', flush=True); sys.exit(" + str(exit_code) + ")")
    code, out, err = run_launcher("-n", 2, "--", sys.executable, "-c", child, timeout=60)
    assert "after" in out  # (a failing process may stop the other before it prints)
    err = "\n".join(line for line in err.splitlines() if line.startswith("[p"))  # not argv
    if exit_code == 0:
        assert "[p0] after" in out and "[p1] after" in out
        assert code == 0 and "WatchTasks" not in err and "grpc_util" not in err, err
    else:
        assert code == 1 and "WatchTasksAsync failed for task 0: CANCELLED" in err, err
        assert "grpc_util.h:89" in err
