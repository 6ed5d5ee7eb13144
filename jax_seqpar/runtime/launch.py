"""``python -m jax_seqpar launch``: run one command as N local processes of one JAX job.

Each process gets the variables ``jax_seqpar.runtime.distributed.initialize()`` reads (the
coordinator on 127.0.0.1 and a free port, which the launcher holds until the job ends:
``reserve_port``; the number of processes, its index) and, on
request, its own set of simulated CPU devices (``XLA_FLAGS``) or GPUs
(``CUDA_VISIBLE_DEVICES``).  The output of every process is streamed line by line with a
``[p<i>]`` prefix.  If a process fails, the others are stopped and the launcher exits
with the failed process's code; if ``--timeout`` passes, the processes still running
print their threads' stacks (``faulthandler``), all are stopped and it exits 124.

Stopping is SIGTERM, then SIGKILL after ``--grace`` seconds (default 5) to what is still
running.  A process that has called ``jax.distributed.initialize`` does not stop at
SIGTERM: JAX's preemption notifier catches it (it logs "SIGTERM caught" and records a
preemption notice for ``multihost_utils.reached_preemption_sync_point``) and the process
runs on, so such a job ends at the SIGKILL, a grace later.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import List, Optional, Sequence, TextIO

#: The variables each process gets, which ``runtime.distributed.initialize()`` reads.  This
#: module imports no JAX (nor the rest of the package): the launcher only starts processes.
ENV_COORDINATOR = "JAX_SEQPAR_COORDINATOR"
ENV_NUM_PROCESSES = "JAX_SEQPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_SEQPAR_PROCESS_ID"

#: Exit code when ``--timeout`` passes (the code ``timeout(1)`` uses).
TIMEOUT_EXIT = 124
_DEVICE_FLAG = "--xla_force_host_platform_device_count"
#: Default seconds between SIGTERM and SIGKILL when stopping processes.
GRACE_S = 5.0


def reserve_port(host: str = "127.0.0.1") -> socket.socket:
    """A bound socket on a free TCP port (the OS picks it); ``.getsockname()[1]`` is the port.

    Keep it open until the coordinator listens.  A port that is only looked up and closed
    can be taken before the coordinator binds it: by another job's bind, or as the source
    port of any outgoing connection, since the OS picks both from the same ephemeral range.
    Under load that happened: 1 of 30 concurrent runs of ``test_two_processes_load_and_save``
    failed with "Address already in use" (2026-11-25).  While this socket holds the port,
    the OS neither binds it for others nor connects from it; it sets ``SO_REUSEPORT``,
    as gRPC's servers do, so the coordinator (JAX's gRPC server, ``[::]:port``) can still
    bind it (Linux: same user, both with the option).  It never listens, so no connection
    is ever routed to it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if hasattr(socket, "SO_REUSEPORT"):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((host, 0))
    except OSError:
        s.close()
        raise
    return s


def _with_device_count(xla_flags: str, n: int) -> str:
    """``xla_flags`` with the simulated CPU device count set to ``n`` (replacing any)."""
    kept = [f for f in xla_flags.split() if not f.startswith(_DEVICE_FLAG)]
    return " ".join(kept + [f"{_DEVICE_FLAG}={n}"])


def _gpu_ids(parent_visible: Optional[str], num_processes: int, per_process: int) -> List[str]:
    """The ``CUDA_VISIBLE_DEVICES`` of each process: consecutive groups of the visible GPUs."""
    need = num_processes * per_process
    if parent_visible:
        visible = [g.strip() for g in parent_visible.split(",") if g.strip()]
        if len(visible) < need:
            raise ValueError(f"--gpus-per-process={per_process} x --num-processes="
                             f"{num_processes} needs {need} GPUs but CUDA_VISIBLE_DEVICES="
                             f"{parent_visible!r} lists {len(visible)}")
    else:
        visible = [str(i) for i in range(need)]
    return [",".join(visible[i * per_process:(i + 1) * per_process])
            for i in range(num_processes)]


def process_envs(num_processes: int, port: int, *, devices_per_process: Optional[int] = None,
                 gpus_per_process: Optional[int] = None, base: Optional[dict] = None):
    """The environment of each process (a list of dicts, index = process id)."""
    base = dict(os.environ if base is None else base)
    gpus = (_gpu_ids(base.get("CUDA_VISIBLE_DEVICES"), num_processes, gpus_per_process)
            if gpus_per_process else None)
    envs = []
    for i in range(num_processes):
        env = dict(base)
        env[ENV_COORDINATOR] = f"127.0.0.1:{port}"
        env[ENV_NUM_PROCESSES] = str(num_processes)
        env[ENV_PROCESS_ID] = str(i)
        env["PYTHONUNBUFFERED"] = "1"  # lines reach the launcher as they are printed
        # a Python process then prints every thread's stack on SIGABRT, which the launcher
        # sends a process still running at --timeout before it stops it (_dump_stacks)
        env.setdefault("PYTHONFAULTHANDLER", "1")
        if devices_per_process:
            env["XLA_FLAGS"] = _with_device_count(env.get("XLA_FLAGS", ""),
                                                  devices_per_process)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus[i]
        envs.append(env)
    return envs


class _Printer:
    """Writes whole lines from several threads without interleaving them."""

    def __init__(self):
        self._lock = threading.Lock()

    def line(self, stream: TextIO, text: str) -> None:
        with self._lock:
            stream.write(text if text.endswith("\n") else text + "\n")
            stream.flush()


#: What JAX 0.11's runtime logs when a job's processes disconnect from the coordinator,
#: even in order (``jax.distributed.shutdown``): a warning that the task-watching RPC was
#: cancelled, and its gRPC trace (seen on 2 H200s, 2026-11-23).  The launcher holds such
#: blocks back and prints them only if that process then fails.
_SHUTDOWN_START = re.compile(r"WatchTasksAsync failed for task \d+: (CANCELLED|UNAVAILABLE)")
_SHUTDOWN_MORE = re.compile(r"^(Additional GRPC error information|:(CANCELLED|UNAVAILABLE)|"
                            r"=== Source Location Trace|external/xla\S*grpc_util|\s*$)")


def _pump(src, dst: TextIO, prefix: str, printer: _Printer, proc=None) -> None:
    """Copy ``src`` to ``dst`` line by line with ``prefix``; with ``proc``, hold back the
    runtime's shutdown warnings (``_SHUTDOWN_START``) and print them only if ``proc``
    exits non-zero, so that a successful job ends quietly and a failing one shows all."""
    held, in_block = [], False
    for raw in iter(src.readline, b""):
        text = raw.decode("utf-8", errors="replace")
        if proc is not None and (_SHUTDOWN_START.search(text)
                                 or (in_block and _SHUTDOWN_MORE.match(text))):
            held.append(text)
            in_block = True
            continue
        in_block = False
        printer.line(dst, prefix + text)
    src.close()
    if held:
        try:
            code = proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            code = None
        if code != 0:
            for text in held:
                printer.line(dst, prefix + text)


def _dump_stacks(procs: Sequence[subprocess.Popen], note) -> None:
    """Ask every running process for its threads' stacks before it is stopped: SIGABRT,
    which ``faulthandler`` (on in every process: ``PYTHONFAULTHANDLER``) answers by
    printing them to stderr, which the launcher passes on; then the process ends."""
    running = [(i, p) for i, p in enumerate(procs) if p.poll() is None]
    for i, p in running:
        note(f"process {i} (pid {p.pid}): its threads' stacks follow on its stderr")
        try:
            os.kill(p.pid, signal.SIGABRT)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and any(p.poll() is None for _, p in running):
        time.sleep(0.05)


def _stop(procs: Sequence[subprocess.Popen], grace: float = GRACE_S) -> None:
    """SIGTERM every running process's group, then SIGKILL what is left after ``grace``
    seconds (JAX's preemption notifier catches SIGTERM in a process of a distributed
    job, so those end at the SIGKILL)."""
    running = [p for p in procs if p.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in running:
            try:
                os.killpg(p.pid, sig)  # each child leads its own session (start_new_session)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while running and time.monotonic() < deadline:
            running = [p for p in running if p.poll() is None]
            time.sleep(0.05)
        if not running:
            return


def _exit_code(returncode: int) -> int:
    """A shell-style exit code: a process killed by signal ``s`` gives 128 + s."""
    return 128 - returncode if returncode < 0 else returncode


class _Terminated(Exception):
    """The launcher received SIGTERM."""


def _terminated(signum, frame):
    del signum, frame
    raise _Terminated


def launch(command: Sequence[str], num_processes: int, *,
           devices_per_process: Optional[int] = None, gpus_per_process: Optional[int] = None,
           timeout: Optional[float] = None, port: Optional[int] = None,
           grace: float = GRACE_S,
           stdout: TextIO = sys.stdout, stderr: TextIO = sys.stderr) -> int:
    """Run ``command`` as ``num_processes`` processes of one job; return the exit code.

    0 if every process exits 0.  Otherwise the code of the first process seen failing
    (the others are stopped), or ``TIMEOUT_EXIT`` if ``timeout`` seconds pass first.
    Stopping sends SIGTERM, then SIGKILL ``grace`` seconds later (module docstring).
    """
    command = list(command)
    if not command:
        raise ValueError("no command to launch: give it after '--', e.g. "
                         "python -m jax_seqpar launch --num-processes 2 -- python train.py")
    for name, value in (("num_processes", num_processes),
                        ("devices_per_process", devices_per_process),
                        ("gpus_per_process", gpus_per_process)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive int")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace >= 0:
        raise ValueError(f"grace={grace!r} must be a number of seconds >= 0")
    if port is not None and not (isinstance(port, int) and 0 < port < 65536):
        raise ValueError(f"port={port!r} must be in 1..65535")
    held = None if port else reserve_port()  # released when the job has ended
    port = port or held.getsockname()[1]
    envs = process_envs(num_processes, port, devices_per_process=devices_per_process,
                        gpus_per_process=gpus_per_process)
    printer = _Printer()
    note = lambda text: printer.line(stderr, f"[launch] {text}")  # noqa: E731
    note(f"{num_processes} processes, coordinator 127.0.0.1:{port}: {shlex.join(command)}")

    procs: List[subprocess.Popen] = []
    pumps: List[threading.Thread] = []
    # The processes lead their own sessions (so that stopping one stops its children too),
    # which also shields them from signals sent to the launcher: pass SIGTERM on.
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        for i, env in enumerate(envs):
            try:
                p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
            except OSError as e:
                note(f"could not start process {i}: {e}")
                _stop(procs, grace)
                return 127
            procs.append(p)
            for src, dst in ((p.stdout, stdout), (p.stderr, stderr)):
                t = threading.Thread(target=_pump, args=(src, dst, f"[p{i}] ", printer, p),
                                     daemon=True)
                t.start()
                pumps.append(t)
        code = _watch(procs, timeout, note, grace)
    except (KeyboardInterrupt, _Terminated) as e:
        code = 143 if isinstance(e, _Terminated) else 130
        note(f"{'terminated' if code == 143 else 'interrupted'}; stopping all processes")
        _stop(procs, grace)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if held is not None:
            held.close()
    for t in pumps:
        t.join(timeout=GRACE_S)
    return code


def _watch(procs, timeout, note, grace=GRACE_S) -> int:
    start = time.monotonic()
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            i, c = failed[0]
            others = [j for j, cj in enumerate(codes) if cj is None]
            note(f"process {i} failed with exit code {_exit_code(c)}"
                 + (f"; stopping process{'es' if len(others) > 1 else ''} "
                    f"{', '.join(map(str, others))}" if others else ""))
            _stop(procs, grace)
            return _exit_code(c)
        if all(c == 0 for c in codes):
            return 0
        if timeout is not None and time.monotonic() - start > timeout:
            running = [str(i) for i, c in enumerate(codes) if c is None]
            note(f"timeout: {timeout:g} s passed with process{'es' if len(running) > 1 else ''} "
                 f"{', '.join(running)} still running; stopping all")
            _dump_stacks(procs, note)
            _stop(procs, grace)
            return TIMEOUT_EXIT
        time.sleep(0.05)


def add_parser(sub) -> None:
    """The ``launch`` subcommand of ``python -m jax_seqpar``."""
    p = sub.add_parser(
        "launch", help="run a command as N local processes of one JAX job",
        description=__doc__.splitlines()[0].split(": ", 1)[1],
        epilog="example: python -m jax_seqpar launch --num-processes 2 "
               "--devices-per-process 4 -- python -m jax_seqpar demo")
    p.add_argument("--num-processes", "-n", type=int, required=True,
                   help="number of processes to start")
    p.add_argument("--devices-per-process", type=int, default=None,
                   help="simulated CPU devices per process (sets XLA_FLAGS)")
    p.add_argument("--gpus-per-process", type=int, default=None,
                   help="GPUs per process: process i sees GPUs i*K..i*K+K-1 of the visible "
                        "ones (sets CUDA_VISIBLE_DEVICES)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds after which all processes are stopped (exit code 124)")
    p.add_argument("--grace", type=float, default=GRACE_S,
                   help="seconds between SIGTERM and SIGKILL when stopping the processes "
                        f"(default {GRACE_S:g}; a process of a jax.distributed job catches "
                        "SIGTERM and stops only at the SIGKILL)")
    p.add_argument("--port", type=int, default=None,
                   help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("command", nargs="*", help="the command each process runs, after '--'")
    p.set_defaults(func=_cmd_launch)


def _cmd_launch(args) -> int:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    try:
        return launch(command, args.num_processes, devices_per_process=args.devices_per_process,
                      gpus_per_process=args.gpus_per_process, timeout=args.timeout,
                      port=args.port, grace=args.grace)
    except ValueError as e:
        print(f"python -m jax_seqpar launch: error: {e}", file=sys.stderr)
        return 2

