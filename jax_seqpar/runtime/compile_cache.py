"""Compile once: JAX's persistent compilation cache, and the scripts' flags for it.

A program XLA has compiled is written to a folder, keyed by everything that decides the
executable (the lowered module without source locations, the devices, the compile
options, ``XLA_FLAGS``, the jaxlib version); a later process that lowers the same
program reads it back instead of compiling.  A rerun with the same shapes -- a resumed
fine-tuning job, a benchmark run again -- then spends no time in XLA.

    from jax_seqpar.runtime.compile_cache import enable_compile_cache
    enable_compile_cache()          # ~/.cache/jax_seqpar/xla; or enable_compile_cache("DIR")

What JAX does here (read from ``jax/_src/compilation_cache.py``, ``compiler.py`` and
``config.py`` of JAX 0.11.2):

* **CPU executables are cached** (``is_cache_used``: the platforms ``cpu``, ``gpu``,
  ``tpu``, ``neuron`` whose client can serialise executables; the CPU client can).
* ``jax_persistent_cache_min_compile_time_secs`` (default 1 s): programs that compiled
  faster are not written.  ``enable_compile_cache`` sets it to ``MIN_COMPILE_TIME_SECS``
  = 0 (every program is written) unless ``$JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``
  says otherwise.  Measured on a 2-core CPU with ``examples/finetune_long_context.py`` at
  the test's sizes: under the test suite's XLA flags the train steps compile in 0.6 s
  and the initialisation in 0.4 s, so at 1 s nothing at all was cached; the run's 20
  small programs (slicing, seeding: 8-100 ms each) are read back in about 1 ms each, so
  even they gain.  The cost is one file of 10-250 kB per distinct program.
* ``jax_persistent_cache_min_entry_size_bytes`` (default 0): 0 lets JAX pick a minimum
  per filesystem when the cache starts, which is 0 in this version (every size is
  written); left as it is.
* ``jax_compilation_cache_max_size`` (default -1: unbounded) is left as it is; delete the
  folder to reclaim it (entries are about 10 kB - 1 MB for the scripts' programs).
* **Enabling after the first compilation works**: JAX opens the cache at the first
  compilation that finds a folder configured, and the programs compiled before that are
  simply not in it.  Once open, the cache keeps its folder even if the setting changes,
  so ``enable_compile_cache`` with a new folder (or after ``disable_compile_cache``)
  resets JAX's cache state (``jax.experimental.compilation_cache.reset_cache``).
* With several processes only process 0 writes; every process reads.  An entry is
  written in place (no lock unless ``jax_compilation_cache_max_size`` is set), so a
  process reading it while another writes it can get a broken entry: JAX then warns and
  compiles.  The folder is trusted: whoever can write to it can make this process run
  their code, so never point it at a folder others may write to.
* **Several CPU devices** (simulated, or processes with gloo): XLA's CPU runtime in
  jaxlib 0.11.2 runs independent operations of a program concurrently and keeps the
  collectives in one order through a shared token.  A program read back from the cache
  can run a loop's collectives and those outside the loop in different orders on
  different devices (XLA's thunk deserialisation gives a loop body a token of its own),
  and the devices then wait for each other until XLA aborts the process (seen with
  ``examples/train_long_context.py --scan-layers`` on 2 CPU devices: 5 of 11 reruns
  from the cache aborted, none of 10 compiled runs).  ``compile_cache_from_args`` therefore
  leaves the cache off on several CPU devices unless asked (``CPU_HAZARD``).  Programs
  with no collective inside a loop (the unrolled model, attention while its ring was
  unrolled, the demo) were read back and ran correctly in every try, and so did
  generation's decode loop (``benchmarks/generate.py --dry-run``, 3 reruns); the hazard
  is in how XLA restores the program, so any program of that shape may meet it -- since
  2026-11-27 that includes every ring of three or more hops, and every double ring
  with intra-node chains that long or of three or more nodes (dense and causal masks),
  whose middle hops or rounds are a loop (``parallel.ring_common.ROLL_HOPS``).

``--compile-cache DIR`` / ``--no-compile-cache`` (``add_compile_cache_args``,
``compile_cache_from_args``) give every script the same switch: on by default, in
``default_cache_dir()`` or ``$JAX_COMPILATION_CACHE_DIR`` when that is set; off by
default on several CPU devices (above) and when ``JAX_ENABLE_COMPILATION_CACHE=false``.
``compile_cache_stats()`` counts this process's reads and writes (JAX's own monitoring
events), so a script can say how much its run took from the cache.

Like the rest of ``runtime``, this imports nothing else of the package; ``jax`` is
imported only when the cache is switched, so the flags can be parsed before JAX starts.
"""

from __future__ import annotations

import argparse
import os
import threading
import warnings
from typing import Optional

#: JAX's own variable for the folder; honoured as the default when it is set.
ENV_DIR = "JAX_COMPILATION_CACHE_DIR"
#: JAX's own off switch; ``compile_cache_from_args`` leaves the cache off when it says so
#: and no ``--compile-cache DIR`` is given.
ENV_ENABLE = "JAX_ENABLE_COMPILATION_CACHE"

#: What ``enable_compile_cache`` sets ``jax_persistent_cache_min_compile_time_secs`` to
#: (JAX's default is 1 s; the module docstring says why 0).
MIN_COMPILE_TIME_SECS = 0.0
_ENV_MIN_TIME = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": "requests",
           "/jax/compilation_cache/cache_hits": "hits",
           "/jax/compilation_cache/cache_misses": "written"}
_DURATIONS = {"/jax/compilation_cache/compile_time_saved_sec": "saved_s",
              _BACKEND_COMPILE: "compile_s"}
#: Why ``compile_cache_from_args`` leaves the cache off on several CPU devices by default.
CPU_HAZARD = (
    "XLA's CPU runtime (jaxlib 0.11.2) can deadlock on a multi-device program read back "
    "from the cache when a loop of it holds collectives and other collectives lie outside "
    "the loop (seen with the layer loop of LlamaConfig(scan_layers=True) in training): "
    "the devices then run them in different orders and the run stops "
    "with 'Termination timeout for all reduce ... collective permute'.  Freshly compiled "
    "programs order them.  GPUs run each device's operations in program order and should "
    "not be affected (not tried here on several GPUs).  Pass --no-compile-cache if a run "
    "stops so.")
_off_reason: Optional[str] = None
_stats = {"requests": 0, "hits": 0, "written": 0, "saved_s": 0.0, "compile_s": 0.0}
_lock = threading.Lock()
_listening = False


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/jax_seqpar/xla``, else ``~/.cache/jax_seqpar/xla`` (an
    ``XDG_CACHE_HOME`` that is not an absolute path is ignored, as the XDG base directory
    specification asks)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jax_seqpar", "xla")


def _on_event(event: str, **_kw) -> None:
    name = _EVENTS.get(event)
    if name is not None:
        with _lock:
            _stats[name] += 1


def _on_duration(event: str, duration_secs: float, **_kw) -> None:
    name = _DURATIONS.get(event)
    if name is not None:
        with _lock:
            _stats[name] += float(duration_secs)


def _listen() -> None:
    """Count JAX's cache events from now on (once per process)."""
    global _listening
    import jax.monitoring

    with _lock:
        if _listening:
            return
        _listening = True
    jax.monitoring.register_event_listener(_on_event)
    jax.monitoring.register_event_duration_secs_listener(_on_duration)


def compile_cache_stats() -> dict:
    """This process's counts since the cache was first enabled: ``requests`` (programs
    that consulted the cache), ``hits`` (read from it instead of compiled), ``written``,
    ``saved_s`` (JAX's estimate of the compile time the hits saved: their compile times
    as stored, whole seconds rounded down, less the reads, so a low bound),
    ``compile_s`` (time in XLA compilation or cache reads, all programs), and ``folder``."""
    with _lock:
        out = dict(_stats)
    out["folder"] = compile_cache_dir()
    return out


def compile_cache_summary() -> str:
    """One line for a script's output: the folder and what this run took from it."""
    s = compile_cache_stats()
    if s["folder"] is None:
        return "compilation cache: off" + (f" ({_off_reason})" if _off_reason else "")
    return (f"compilation cache {s['folder']}: {s['hits']} of {s['requests']} programs read "
            f"from it, {s['written']} written; {s['compile_s']:.1f} s compiling or reading")


def compile_cache_dir() -> Optional[str]:
    """The folder JAX's persistent cache uses now, or None when it is off."""
    import jax

    if not jax.config.jax_enable_compilation_cache:
        return None
    return jax.config.jax_compilation_cache_dir or None


def _reset_jax_cache_state() -> None:
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()


def enable_compile_cache(directory: Optional[str | os.PathLike] = None, *,
                         min_compile_time_secs: Optional[float] = None) -> str:
    """Turn on JAX's persistent compilation cache in ``directory`` (created if missing;
    default: ``$JAX_COMPILATION_CACHE_DIR`` if set, else ``default_cache_dir()``) and
    return the absolute folder used.

    Programs compiled from now on whose compilation took at least
    ``min_compile_time_secs`` (default: ``MIN_COMPILE_TIME_SECS``, 0, unless
    ``$JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` is set: then JAX's value is kept) are
    written there, and every later compilation of the same program, in this process or
    another, reads them back.  Call it early (before the first ``jit`` runs) so that
    every program can be cached; later works too.
    """
    import jax

    if min_compile_time_secs is None and not os.environ.get(_ENV_MIN_TIME):
        min_compile_time_secs = MIN_COMPILE_TIME_SECS
    if min_compile_time_secs is not None and min_compile_time_secs < 0:
        raise ValueError(f"{min_compile_time_secs=} must be >= 0")
    if directory is None:
        directory = os.environ.get(ENV_DIR) or default_cache_dir()
    folder = os.path.abspath(os.path.expanduser(os.fspath(directory)))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compile cache directory={folder!r} cannot be created ({e}); "
                         f"pass another folder (--compile-cache DIR) or turn it off "
                         f"(--no-compile-cache)") from None
    changed = compile_cache_dir() != folder
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_enable_compilation_cache", True)
    if min_compile_time_secs is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs",
                          float(min_compile_time_secs))
    if changed:  # JAX keeps the folder it opened first (module docstring)
        _reset_jax_cache_state()
    _listen()
    return folder


def disable_compile_cache() -> None:
    """Turn JAX's persistent compilation cache off (also when ``$JAX_COMPILATION_CACHE_DIR``
    turned it on): nothing is read from or written to any folder from now on."""
    import jax

    was_on = compile_cache_dir() is not None
    jax.config.update("jax_enable_compilation_cache", False)
    if was_on:
        _reset_jax_cache_state()


def add_compile_cache_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--compile-cache DIR`` and ``--no-compile-cache`` (exclusive) to ``parser``;
    ``compile_cache_from_args`` applies them.  Returns ``parser``."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--compile-cache", default=None, metavar="DIR",
                       help="JAX's persistent compilation cache: a rerun with the same "
                            "shapes reads its programs from DIR instead of compiling them "
                            f"(default: ${ENV_DIR} if set, else $XDG_CACHE_HOME/jax_seqpar/xla "
                            f"or ~/.cache/jax_seqpar/xla; here {default_cache_dir()}; "
                            f"off by default on several CPU devices and when "
                            f"{ENV_ENABLE}=false: runtime.compile_cache says why)")
    group.add_argument("--no-compile-cache", action="store_true",
                       help="compile everything, read and write no cache")
    return parser


def _env_says_off() -> bool:
    """JAX's own switch, ``JAX_ENABLE_COMPILATION_CACHE=false`` (or 0, no, off)."""
    return os.environ.get(ENV_ENABLE, "").strip().lower() in ("0", "false", "no", "off")


def _multi_device_cpu() -> bool:
    """Whether this job computes on several CPU devices (simulated ones, or processes
    joined by ``jax.distributed``).  Starts JAX's backend: call after
    ``runtime.distributed.initialize()``."""
    import jax

    return jax.default_backend() == "cpu" and jax.device_count() > 1


def compile_cache_from_args(args: argparse.Namespace) -> Optional[str]:
    """Apply the flags of ``add_compile_cache_args``: the folder in use, or None (off).

    ``--no-compile-cache``: off.  ``--compile-cache DIR``: on, in ``DIR``.  Neither: on in
    the default folder (``enable_compile_cache()``), except that

    * ``JAX_ENABLE_COMPILATION_CACHE=false`` in the environment (JAX's own switch) keeps
      it off, and ``$JAX_COMPILATION_CACHE_DIR`` turns it on there;
    * on several CPU devices it stays off (``CPU_HAZARD``): programs read back from the
      cache can deadlock there.  ``--compile-cache DIR`` (or the variable) still turns it
      on, with a warning.

    In these two cases nothing is changed (the cache stays off unless this process had
    already turned it on, and the folder then in use is returned).

    Call it after ``runtime.distributed.initialize()`` (it may start JAX's backend).
    """
    global _off_reason
    _off_reason = None
    if getattr(args, "no_compile_cache", False):
        disable_compile_cache()
        _off_reason = "--no-compile-cache"
        return None
    directory = getattr(args, "compile_cache", None)
    if directory is None and _env_says_off():
        _off_reason = f"{ENV_ENABLE}={os.environ[ENV_ENABLE]}"
        return compile_cache_dir()  # left as it is (off, unless this process turned it on)
    explicit = directory is not None or bool(os.environ.get(ENV_DIR))
    if _multi_device_cpu():
        if not explicit:
            _off_reason = ("the default on several CPU devices; --compile-cache DIR turns it "
                           "on, see runtime.compile_cache.CPU_HAZARD")
            return compile_cache_dir()  # left as it is, likewise
        warnings.warn(f"the persistent compilation cache on several CPU devices: {CPU_HAZARD}",
                      RuntimeWarning, stacklevel=2)
    return enable_compile_cache(directory)


__all__ = ["CPU_HAZARD", "ENV_DIR", "ENV_ENABLE", "MIN_COMPILE_TIME_SECS", "add_compile_cache_args",
           "compile_cache_dir", "compile_cache_from_args", "compile_cache_stats",
           "compile_cache_summary", "default_cache_dir", "disable_compile_cache",
           "enable_compile_cache"]
