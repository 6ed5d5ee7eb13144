"""Test configuration: 8 simulated CPU devices, shared fixtures.

The environment variables must be set before JAX initialises its backends, so this
module sets them at import time, before anything imports ``jax``.
"""

import os

_FLAGS = {
    # 8 simulated CPU devices for the multi-device tests (docs/ARCHITECTURE.md, "Numerics").
    "--xla_force_host_platform_device_count": "8",
    # Compile each module on one thread.  Numerics are unaffected; without it, two
    # pytest-xdist workers on a 2-core machine compile ~2.5x slower, not 2x faster.
    "--xla_cpu_parallel_codegen_split_count": "1",
    # LLVM's optimisation level for the CPU code XLA emits (default 2).  The suite is
    # dominated by compiling ~500 small programs, and at level 0 each compiles in ~60%
    # of the CPU time.  It changes only the machine code of the CPU kernels: XLA's HLO
    # passes, fusion, scheduling and buffer assignment (which the byte-count, overlap,
    # remat and memory tests read) are the same, and without fast-math (off by default)
    # LLVM may not reorder float arithmetic at any level.  Subprocesses (launcher,
    # notebooks) inherit it.
    "--xla_backend_optimization_level": "0",
}


def _fusion_emitter_flags() -> dict:
    """XLA's newer CPU fusion emitters (MLIR) compile the suite's many small fusions ~3x
    slower than the older elemental emitter (tests/test_xla_kernel.py on JAX 0.11.2:
    50.9 s of CPU time with them, 16.1 s without).  Both emit IEEE arithmetic without
    fast-math, and the tests that read the compiled program (bytes per collective,
    overlap, remat) pass under either.  How to ask for the old emitter depends on the
    jaxlib (an unknown flag aborts XLA), so the version is read from the installed
    package's metadata, without importing jax: a flag up to 0.10, a backend option in
    0.11; 0.12 has only the new emitters."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(x) for x in version("jaxlib").split(".")[:2])
    except (PackageNotFoundError, ValueError):  # pragma: no cover - unusual install
        return {}
    if (major, minor) <= (0, 10):
        return {"--xla_cpu_use_fusion_emitters": "false"}
    if (major, minor) == (0, 11):
        return {"--xla_backend_extra_options": "xla_cpu_disable_new_fusion_emitters"}
    return {}


_FLAGS.update(_fusion_emitter_flags())
_flags = os.environ.get("XLA_FLAGS", "")
for _name, _value in _FLAGS.items():
    if _name not in _flags:  # never duplicate (or override) a flag the user set
        _flags = f"{_flags} {_name}={_value}".strip()
os.environ["XLA_FLAGS"] = _flags
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# JAX writes the whole Python stack of every operation into the MLIR locations (and from
# there into the HLO metadata) by default.  The tests' programs carry each equation's own
# source line without it; the full stacks cost about 3.5% of the CPU time of the
# compile-heavy files (tests/test_layouts.py + test_scan_layers.py, two runs each:
# 63.4-64.4 s -> 61.1-62.3 s; 2026-11-25).  Subprocesses inherit it.  Without the stacks,
# XLA's op_name of an operation inside a nested jit loses its named_scope, so
# tests/test_remat.py, which counts those scopes, turns them back on.
os.environ.setdefault("JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS", "false")

import gc  # noqa: E402

# Python's cyclic garbage collector, at its default thresholds (700, 10, 10), took 40 s of
# the suite's 805 s of test time (2 workers; timed with gc.callbacks, 2026-11-25): JAX's
# caches keep hundreds of thousands of objects alive, and each full collection walks
# them all.  At these thresholds it takes 0.4 s where it took 4.7 s in test_attention.py
# and test_decode.py, whose CPU time fell by about as much (64.9 -> 61.9 s).  Garbage in
# reference cycles is still collected, less often; everything else is freed by reference
# counting as before.
gc.set_threshold(50_000, 20, 100)

import jax  # noqa: E402
import pytest  # noqa: E402

import helpers  # noqa: E402  (tests/ is on sys.path: pytest "prepend" import mode)


# --------------------------------------------------------------------------- memory maps
# Every program XLA compiles for the CPU keeps its machine code in memory maps of its own,
# and JAX's caches keep the programs alive.  Linux allows a process vm.max_map_count maps
# (65,530 by default); the mmap that goes past it fails, and XLA's compiler crashes with a
# segmentation fault instead of raising.  XLA's newer CPU fusion emitters, the only ones
# JAX 0.12 has (``_fusion_emitter_flags``), leave more maps per program: test_layouts.py
# compiles 128 programs on JAX 0.11.2 and 0.12.0.1 alike and ends at 7.0k maps on the
# first, 12.6k on the second; 0.11.2 with the new emitters leaves as many maps as 0.12.
# A worker running half of the suite on 0.12 crossed the limit near its end: the
# newest-JAX leg's crashes in test_layouts.py and test_pallas_kernel.py (the core file
# held 65,387 maps; 2026-11-26; ``scripts/cpu_program_maps.py`` counts maps per program).
# So at the end of each test file a worker past half the limit drops JAX's caches
# (``jax.clear_caches``: back to about 650 maps), and later files compile afresh.
# Checked per file, not per test: reading /proc/self/maps costs ~20 ms at 30k maps.
def _map_count():
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:  # not Linux
        return 0


def _map_limit():
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


_MAP_LIMIT = _map_limit()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    if _MAP_LIMIT is None or (nextitem is not None and nextitem.path == item.path):
        return
    if _map_count() > _MAP_LIMIT // 2:
        jax.clear_caches()
        gc.collect()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """Freeze the heap once the tests are done.  After the session pytest runs two full
    garbage collections (its unraisable-exception plugin, at unconfigure and at cleanup),
    and each walks every object JAX's caches hold: 3-4 million in a worker at the end of
    the suite, where the worker's end took 11.6 s and xdist, after 5 s, interrupted it with
    a SIGINT (the ``KeyboardInterrupt`` "ignored in gc_callback" printed after the last
    test; 2026-11-27).  Frozen objects are skipped by the collector; garbage made after
    this point is still collected, and the process ends right after."""
    del session
    gc.freeze()


def pytest_configure(config):
    del config
    n = len(jax.devices())
    if n < 8:  # pragma: no cover - misconfigured environment
        raise pytest.UsageError(
            f"the tests need 8 devices, JAX sees {n}: jax was initialised before "
            f"tests/conftest.py could set XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}")


# --------------------------------------------------------------------------- scheduling
# ``make test`` runs ``pytest -n 2 --dist worksteal``: a worker that runs out of tests
# takes some of the other's.  Back to back on the 2-core CI machine (2026-11-25) that took
# 326.6 s of pytest, where ``--dist load`` with the two policies below took 341.2 s (both
# workers ending within 0.2 s of each other); the policies apply to ``--dist load``, the
# default of a plain ``pytest -n N``.  Neither changes what runs:
#
# * tests that share compiled programs or a costly module-scoped fixture form one unit of
#   work, sent to one worker (the program compiles, the fixture runs, once, not once per
#   worker); every other test is a unit of its own.  (xdist's ``--dist loadgroup`` would
#   do this from ``xdist_group`` marks, but it does not group under pytest 9.)
# * the longest tests are collected first, so that neither worker is left with a long test
#   at the end while the other is idle.

#: path prefix of a test's node id (file, or file::test) -> unit of work
GROUPS = {
    # the 2-process launch is a module-scoped fixture shared by these two tests
    "test_multiprocess.py::test_ring_attention_two_processes_equals_one": "mp_workers",
    "test_multiprocess.py::test_training_step_two_processes_equals_one": "mp_workers",
    # lru_cached jitted losses / compiled programs shared by the tests of each file
    "test_remat.py": "remat",
    "test_llama.py": "llama",
    "test_generate.py": "generate",
    "test_packed_training.py": "packed_training",
    # one reference training run (module fixture) and a compilation cache for its children
    "test_training_checkpoint.py": "training_checkpoint",
    # the one-device references (lru_cached) and the generators of the N-D tests
    "test_nd_model.py": "nd_model",
    "test_nd_generate.py": "nd_generate",
    # one unrolled reference per (layout, packed), shared by the remat cases
    "test_scan_layers.py::test_scanned_equals_unrolled": "scan_layers",
    # lru_cached compiled programs that several tests of the file read (outputs, HLO
    # bytes, overlap windows): on two workers each would compile on both
    "test_burst.py": "burst",
    "test_double_ring.py": "double_ring",
    "test_lm_head.py": "lm_head",
    "test_xla_kernel.py": "xla_kernel",
    "test_overlap.py": "overlap",
    # test_pallas_mgpu.py's cached Mosaic GPU lowerings of the packed-documents case
    # (``_packed_bwd``): the variant sweep, early_dq and early_exit read the same ones
    "test_pallas_mgpu.py::test_backward_variant_lowers_on_packed_documents": "mgpu_packed",
    "test_pallas_mgpu.py::test_fused_backward_early_dq_reduces_beside_dk": "mgpu_packed",
    "test_pallas_mgpu.py::test_early_exit_ends_on_the_reads": "mgpu_packed",
}

#: path prefixes of the longest tests (measured with --durations), longest first
LONGEST_FIRST = (
    "test_nd_model.py",
    "test_notebooks.py::test_notebook_executes",
    "test_multiprocess.py::test_training_example_two_processes_equals_one",
    "test_multiprocess.py::test_ring_attention_two_processes_equals_one",
    "test_multiprocess.py::test_training_step_two_processes_equals_one",
    "test_remat.py",
    "test_double_ring.py",
    "test_burst.py",
    "test_scan_layers.py::test_scanned_equals_unrolled",
    "test_packed_training.py",
    "test_generate.py",
    "test_nd_generate.py",
    "test_llama.py",
    "test_training_checkpoint.py",
    "test_finetune_example.py",
    "test_backward_comm_benchmark.py::test_cpu_run_counts_bytes_and_checks_gradients",
    "test_multiprocess.py::test_demo_under_the_launcher",
    "test_multiprocess.py::test_failing_process_skips_the_orderly_exit",
    "test_readme.py",
    "test_fsdp.py::test_train_mfu_cpu_preset",
    "test_fsdp.py::test_sharded_training_equals_replicated",
    "test_fsdp.py::test_train_mfu_remat_switches_and_memory_account",
    "test_scaling_benchmark.py::test_cpu_run_checks_and_reports",
    "test_layouts.py::test_block_sparse_matches_reference",
    "test_pallas_kernel.py::test_parallel_strategies_with_pallas_match_reference",
    "test_decode_kernel_benchmark.py",
)


def _match(nodeid, prefixes):
    name = nodeid.rsplit("/", 1)[-1]  # "test_x.py::test_y[param]"
    for i, prefix in enumerate(prefixes):
        if name == prefix or name.startswith((prefix + "::", prefix + "[")):
            return i
    return None


def pytest_collection_modifyitems(config, items):
    """The longest tests first.  Under ``--dist load`` the groups come next (each one unit
    of work, several tests long), then the single tests: a long unit sent last would leave
    one worker idle at the end (the ``xla_kernel`` group did, for 10 s, in its collection
    place).  Under ``--dist worksteal`` (``make test``) the rest keeps its collection
    order: moving the groups forward there cost 75-85 s of a 480 s suite (same 2-core
    machine, 2026-11-26: 554 and 566 s with it, 480 s without)."""
    grouped = config.getvalue("dist") == "load"

    def key(item):
        rank = _match(item.nodeid, LONGEST_FIRST)
        if rank is not None:
            return rank
        single = grouped and _match(item.nodeid, list(GROUPS)) is None
        return len(LONGEST_FIRST) + int(single)

    items.sort(key=key)  # stable: within each class the collection order stays


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``-n N`` (``--dist load``): load scheduling whose units are the groups above."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            i = _match(nodeid, list(GROUPS))
            return nodeid if i is None else "group:" + GROUPS[list(GROUPS)[i]]

    config.option.loadscopereorder = False  # keep the collection order (longest first)
    return GroupScheduling(config, log)


@pytest.fixture
def mesh():
    """Factory: ``mesh(G)`` is a 1-D mesh over the first ``G`` devices, axis ``"sp"``."""
    return helpers.make_mesh


@pytest.fixture
def rel_err():
    return helpers.rel_err


@pytest.fixture
def make_qkv():
    return helpers.make_qkv
