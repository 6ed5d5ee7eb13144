"""Several processes, one mesh: start-up and host <-> global array helpers.

``initialize()`` connects this process to the others (``jax.distributed.initialize``)
before JAX starts its backends, so that ``jax.devices()`` lists the devices of every
process and one ``jax.make_mesh`` spans them all.  Where the settings come from, first
match wins:

1. the arguments;
2. the variables set by ``python -m jax_seqpar launch`` (``JAX_SEQPAR_COORDINATOR``,
   ``JAX_SEQPAR_NUM_PROCESSES``, ``JAX_SEQPAR_PROCESS_ID``);
3. JAX's own variable ``JAX_COORDINATOR_ADDRESS`` (with the arguments for the rest), or
   a cluster JAX recognises: SLURM (``srun``), Open MPI (``mpirun``), Kubernetes, Cloud
   TPU, and MPI through ``mpi4py`` when asked for with ``cluster_detection_method``;
4. none of these: a single process, and ``jax.distributed`` is not started.

The helpers below turn host data into global arrays sharded over such a mesh and bring
global arrays back to every host, so a script reads the same on one process or many.
"""

from __future__ import annotations

import atexit
import sys

import dataclasses
import os
import re
import zlib
from typing import Any, Optional, Sequence, Union

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

# the variables that ``python -m jax_seqpar launch`` sets for each process it starts; they
# are named in ``launch``, which imports no JAX, so that the launcher starts at once
from jax_seqpar.runtime.launch import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID

CPU_COLLECTIVES = ("gloo", "mpi")

_ADDRESS_RE = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[^:\[\]\s]+):(\d{1,5})$")


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Where this process stands: what ``initialize`` returns."""

    process_index: int
    process_count: int
    local_device_count: int
    device_count: int
    platform: str
    #: ``"host:port"`` of process 0's coordinator; None for a single process.
    coordinator_address: Optional[str]
    #: Where the settings came from: ``"arguments"``, ``"jax_seqpar launch"``,
    #: ``"cluster (<name>)"``, ``"JAX_COORDINATOR_ADDRESS"``, ``"already initialized"``
    #: or ``"single process"``.
    source: str

    @property
    def is_main(self) -> bool:
        """True on process 0, the one that should print and write files."""
        return self.process_index == 0

    def __str__(self) -> str:
        return (f"process {self.process_index} of {self.process_count}: "
                f"{self.local_device_count} of {self.device_count} {self.platform} devices "
                f"(settings from {self.source})")


_STATE: dict = {}  # "settings", "source": what the first successful call settled on


# --------------------------------------------------------------------------- validation
def _check_address(value, what: str) -> str:
    if not isinstance(value, str) or not _ADDRESS_RE.match(value.strip()):
        raise ValueError(f"{what}={value!r} must be 'host:port', e.g. '10.0.0.1:12345'")
    port = int(value.strip().rsplit(":", 1)[1])
    if not 0 < port < 65536:
        raise ValueError(f"{what}={value!r}: the port must be in 1..65535")
    return value.strip()


def _check_int(value, what: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what}={value!r} must be an int")
    if value < minimum:
        raise ValueError(f"{what}={value} must be >= {minimum}")
    return int(value)


def _env_int(name: str, *, minimum: int) -> Optional[int]:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None
    if value < minimum:
        raise ValueError(f"environment variable {name}={raw!r} must be >= {minimum}")
    return value


def _check_device_ids(ids) -> Optional[tuple]:
    if ids is None:
        return None
    if isinstance(ids, (int, np.integer)) and not isinstance(ids, bool):
        ids = [ids]
    try:
        ids = list(ids)
    except TypeError:
        raise TypeError(f"local_device_ids={ids!r} must be an int or a sequence of ints") \
            from None
    if not ids or any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0
                      for i in ids):
        raise ValueError(f"local_device_ids={ids!r} must be a non-empty sequence of "
                         f"non-negative ints")
    if len(set(ids)) != len(ids):
        raise ValueError(f"local_device_ids={ids!r} has repeated ids")
    return tuple(int(i) for i in ids)


def _detected_cluster() -> Optional[tuple]:
    """``(name, process_count)`` of the cluster JAX would auto-detect, or None.

    Uses JAX's private cluster registry (``jax._src.clusters``); if that moves, we answer
    None and let ``jax.distributed.initialize`` detect (or fail) by itself.
    """
    try:
        from jax._src.clusters import ClusterEnv
    except ImportError:  # pragma: no cover - JAX reorganised
        return None
    for env in ClusterEnv._cluster_types:
        try:
            if not env.opt_in_only_method and env.is_env_present():
                return env.__name__, env.get_process_count()
        except Exception:  # a half-configured environment: let JAX report it
            return env.__name__, None
    return None


def _resolve(coordinator_address, num_processes, process_id):
    """Settings from the arguments, then the launcher's variables; ``(settings, source)``."""
    args = {"coordinator_address": coordinator_address, "num_processes": num_processes,
            "process_id": process_id}
    if coordinator_address is not None:
        _check_address(coordinator_address, "coordinator_address")
    if num_processes is not None:
        _check_int(num_processes, "num_processes", minimum=1)
    if process_id is not None:
        _check_int(process_id, "process_id", minimum=0)
    source = "arguments" if any(v is not None for v in args.values()) else None

    env = {"coordinator_address": os.environ.get(ENV_COORDINATOR) or None,
           "num_processes": _env_int(ENV_NUM_PROCESSES, minimum=1),
           "process_id": _env_int(ENV_PROCESS_ID, minimum=0)}
    if env["coordinator_address"] is not None:
        _check_address(env["coordinator_address"], f"environment variable {ENV_COORDINATOR}")
    if any(v is not None for v in env.values()):
        missing = [n for n, v in zip((ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID),
                                     env.values()) if v is None]
        if missing and source is None:
            raise ValueError(f"{', '.join(missing)} not set while other JAX_SEQPAR_* variables "
                             f"are; set all three (python -m jax_seqpar launch does)")
        for name, value in env.items():
            if args[name] is None:
                args[name] = value
        source = source or "jax_seqpar launch"

    n, pid = args["num_processes"], args["process_id"]
    if n is not None and pid is not None and pid >= n:
        raise ValueError(f"process_id={pid} must be < num_processes={n}")
    return args, source


# --------------------------------------------------------------------------- start-up
def initialize(coordinator_address: Optional[str] = None,
               num_processes: Optional[int] = None,
               process_id: Optional[int] = None,
               local_device_ids: Union[int, Sequence[int], None] = None,
               *,
               cpu_collectives: Optional[str] = "gloo",
               cluster_detection_method: Optional[str] = None,
               initialization_timeout: int = 300) -> ProcessInfo:
    """Join the other processes of this job (``jax.distributed.initialize``), once.

    Call it first thing, before any JAX computation or ``jax.devices()``.  Settings come
    from the arguments, else from ``python -m jax_seqpar launch``'s variables, else from
    a cluster JAX detects (SLURM, Open MPI, ...; see the module docstring).  Without any
    of these the process runs alone and ``jax.distributed`` is not started, so the same
    script works with and without a launcher.  A detected cluster of one process is
    treated the same way.

    Args:
      coordinator_address: ``"host:port"`` of process 0 (which starts the coordinator).
      num_processes, process_id: the job's size and this process's index.
      local_device_ids: the local devices this process uses (GPUs: the ids CUDA sees).
      cpu_collectives: cross-process collectives of the CPU backend, ``"gloo"`` (default,
        needs nothing installed) or ``"mpi"``; None leaves JAX's setting alone.  Only the
        CPU backend reads it, so it is harmless on GPU runs.
      cluster_detection_method: passed to JAX (e.g. ``"mpi4py"``; ``"deactivate"`` turns
        detection off).
      initialization_timeout: seconds to wait for all processes to connect.

    Returns:
      ``ProcessInfo`` (process index and count, local and global device counts, platform).

    A second call returns the same information; with settings that contradict the first
    call it raises ``RuntimeError``.  Calling it after JAX has started its backends (for
    example after ``jax.devices()``) raises ``RuntimeError`` unless no processes need
    connecting.
    """
    if cpu_collectives is not None and cpu_collectives not in CPU_COLLECTIVES:
        raise ValueError(f"cpu_collectives={cpu_collectives!r} must be one of "
                         f"{CPU_COLLECTIVES} or None")
    _check_int(initialization_timeout, "initialization_timeout", minimum=1)
    device_ids = _check_device_ids(local_device_ids)
    settings, source = _resolve(coordinator_address, num_processes, process_id)
    requested = dict(settings, local_device_ids=device_ids)

    first = _STATE.get("settings")
    if first is not None or jax.distributed.is_initialized():  # a second call
        if first is not None:
            clash = [f"{k}={v!r} (first call: {first[k]!r})" for k, v in requested.items()
                     if v is not None and first[k] is not None and v != first[k]]
            if clash:
                raise RuntimeError("jax_seqpar.runtime.distributed.initialize() was already called "
                                   "with other settings: " + ", ".join(clash))
        return process_info(source=_STATE.get("source", "already initialized"))

    if source is None:  # nothing given: a cluster JAX knows, or a single process
        cluster = _detected_cluster()
        if os.environ.get("JAX_COORDINATOR_ADDRESS"):
            source = "JAX_COORDINATOR_ADDRESS"
        elif cluster is not None and cluster[1] != 1:
            source = f"cluster ({cluster[0]})"
        elif cluster_detection_method not in (None, "deactivate"):
            source = f"cluster ({cluster_detection_method})"
    if source is None or (settings["num_processes"] == 1 and source != "arguments"):
        return _remember(requested, source or "single process", single=True)

    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    try:
        jax.distributed.initialize(
            coordinator_address=settings["coordinator_address"],
            num_processes=settings["num_processes"],
            process_id=settings["process_id"],
            local_device_ids=None if device_ids is None else list(device_ids),
            cluster_detection_method=cluster_detection_method,
            initialization_timeout=initialization_timeout)
    except RuntimeError as e:
        if "must be called before" in str(e):
            raise RuntimeError(
                "jax_seqpar.runtime.distributed.initialize() must run before JAX starts its "
                "backends: call it at the top of the script, before jax.devices(), "
                "jax.make_mesh() or any computation") from e
        raise
    except ValueError as e:
        raise ValueError(f"jax.distributed.initialize could not find its settings ({e}); "
                         f"pass coordinator_address, num_processes and process_id, or start "
                         f"the processes with python -m jax_seqpar launch") from e
    _install_orderly_exit()
    return _remember(requested, source, single=False)


# --------------------------------------------------------------------------- shut-down
def shutdown() -> None:
    """Leave the job in order: every process's client disconnects at a shutdown barrier,
    then process 0 stops the coordinator (``jax.distributed.shutdown``).

    ``initialize()`` registers this to run when the interpreter exits normally.  Without
    it the processes tear their runtime down in whatever order they exit, and the
    coordinator can go while the others still watch it: each then logs gRPC errors
    (``WatchTasksAsync failed ... CANCELLED``) on a run that succeeded.  After an uncaught
    exception in a job of several processes, the traceback is printed and the process
    exits at once with code 1, skipping the exit handlers (JAX's own would wait at the
    shutdown barrier until the others get there), and the launcher (or the cluster) stops
    the others.
    """
    if _STATE.get("failed") or not jax.distributed.is_initialized():
        return
    _finish_pending_work()
    jax.distributed.shutdown()


def _finish_pending_work() -> None:
    """Wait for every computation this process dispatched whose result is alive, while the
    other processes are still here to take part in its collectives.

    A process that leaves with a collective in flight leaves its peers' halves of it
    waiting for a partner that is gone, and each peer then blocks at exit, when its
    runtime joins the thread that runs it (seen as a job whose processes had all
    finished their work but one never exited; ``scripts/stress_multiprocess.py``)."""
    for x in jax.live_arrays():
        try:
            x.block_until_ready()
        except Exception:  # noqa: BLE001 - deleted or donated meanwhile: nothing to wait for
            pass


def _install_orderly_exit() -> None:
    if _STATE.get("exit_installed"):
        return
    previous = sys.excepthook

    def hook(*exc_info):
        _STATE["failed"] = True
        previous(*exc_info)
        if jax.process_count() > 1:
            # JAX's own exit handler would wait at the shutdown barrier until every other
            # process got there (measured: the whole of the others' remaining run), so
            # leave now; the launcher (or the cluster) sees the exit code and stops them
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001 - a closed stream must not mask the exit
                    pass
            os._exit(1)

    sys.excepthook = hook
    atexit.register(shutdown)
    _STATE["exit_installed"] = True


def _remember(requested: dict, source: str, *, single: bool) -> ProcessInfo:
    """Record what the first call settled on (later calls are checked against it)."""
    info = process_info(source=source)
    settled = dict(requested, num_processes=info.process_count, process_id=info.process_index)
    if not single:
        settled["coordinator_address"] = info.coordinator_address
    _STATE.update(settings=settled, source=source)
    return info


def process_info(source: Optional[str] = None) -> ProcessInfo:
    """This process's ``ProcessInfo`` (starts JAX's backends if they have not started)."""
    coordinator = None
    if jax.distributed.is_initialized():
        try:  # the address JAX connected to (not public API)
            from jax._src.distributed import global_state
            coordinator = global_state.coordinator_address
        except (ImportError, AttributeError):  # pragma: no cover - JAX reorganised
            pass
    devices = jax.devices()
    return ProcessInfo(
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        local_device_count=jax.local_device_count(),
        device_count=len(devices),
        platform=devices[0].platform,
        coordinator_address=coordinator,
        source=source or _STATE.get("source", "single process"))


# --------------------------------------------------------------------------- arrays
def _sharding(mesh, spec) -> NamedSharding:
    if isinstance(spec, NamedSharding):
        return spec
    if spec is None:
        spec = PartitionSpec()
    if not isinstance(spec, PartitionSpec):
        raise TypeError(f"spec={spec!r} must be a jax.sharding.PartitionSpec")
    return NamedSharding(mesh, spec)


def from_host(x, mesh, spec=None) -> jax.Array:
    """A global array sharded as ``spec`` over ``mesh``, from the **whole** host array ``x``.

    Every process passes the same full array (e.g. drawn from the same seed, or read from
    the same file); each one places only the slices its own devices hold.  Works
    unchanged on a single process.  ``x`` may be a pytree of arrays.
    """
    sharding = _sharding(mesh, spec)

    def one(a):
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

    return jax.tree.map(one, x)


def from_process_local(x, mesh, spec, global_shape=None) -> jax.Array:
    """A global array from this process's **part** of it (``x``: its slice only).

    Process ``p`` passes the rows its devices hold along each sharded axis (for a sequence
    sharded as ``P(None, "sp")`` over all devices in process order: tokens
    ``[p * S/P, (p+1) * S/P)``).  Wraps ``jax.make_array_from_process_local_data``.
    """
    sharding = _sharding(mesh, spec)
    return jax.tree.map(
        lambda a: jax.make_array_from_process_local_data(sharding, np.asarray(a),
                                                         global_shape), x)


def _replicated(x) -> jax.Array:
    """``x`` copied to every device of the job, as a global array (a collective that every
    process must join).  ``x``: a global array, or a host value that each process gives
    for itself (concatenated along its first axis in process order; a scalar counts as
    one row)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if isinstance(x.sharding, NamedSharding):
            whole = x.sharding.update(spec=PartitionSpec())
        else:
            devices = sorted(x.sharding.device_set, key=lambda d: d.id)
            whole = NamedSharding(jax.sharding.Mesh(np.array(devices), ("devices",)),
                                  PartitionSpec())
        return jax.jit(lambda a: a, out_shardings=whole)(x)
    block = np.asarray(x)
    if block.ndim == 0:
        block = block[None]
    devices = np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
    mesh = jax.sharding.Mesh(devices, ("processes", "local"))
    rows = jax.make_array_from_single_device_arrays(
        (jax.process_count() * block.shape[0],) + block.shape[1:],
        NamedSharding(mesh, PartitionSpec("processes")),
        [jax.device_put(block, d) for d in jax.local_devices()])
    return jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, PartitionSpec()))(rows)


def to_host(tree) -> Any:
    """The full value of every global array in ``tree`` as NumPy, on every process; a host
    value (NumPy, or an array of this process only) comes back as every process's value
    concatenated along the first axis in process order (a scalar counts as one row).

    Every process must call it: it runs one collective per leaf.  It returns only when
    the collective has finished on **every** local device, not only on the one it reads
    (``jax.experimental.multihost_utils.process_allgather`` waits for the first alone, so
    a process that exits right after it can leave a gather running on its other devices;
    a peer whose device waits for that gather then never finishes, and blocks at exit
    when its runtime joins the thread that runs it).  On a single process it is
    ``np.asarray``.
    """
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    gathered = jax.block_until_ready(jax.tree.map(_replicated, tree))
    return jax.tree.map(lambda g: np.asarray(g.addressable_data(0)), gathered)


def barrier(name: str) -> None:
    """Wait until every process reaches ``barrier(name)`` (no-op on a single process).

    A gather of ``crc32(name)`` from every process (``to_host``: finished on every local
    device before it returns); a process that reached a barrier of another name raises
    ``RuntimeError`` naming both."""
    if jax.process_count() == 1:
        return
    mine = np.uint32(zlib.crc32(name.encode()))
    seen = to_host(mine)
    if not (seen == mine).all():
        raise RuntimeError(f"barrier({name!r}): process {jax.process_index()} reached it while "
                           f"another process is at a barrier of another name (crc32 values "
                           f"{seen.tolist()} by process)")
