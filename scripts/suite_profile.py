"""Where the test suite's time goes: a pytest plugin and its report (issue 37).

As a plugin it records, per test, JAX's own durations for tracing (jaxpr), lowering
(jaxpr to MLIR) and XLA compilation, and for every compiled program its wall time and a
fingerprint of its module text with locations stripped (so that the same program
compiled twice shows up).  Each pytest-xdist worker writes one JSON file.  Run from the
repository root (programs compiled inside subprocesses -- examples, notebooks, README
blocks, launcher jobs -- are not seen):

    SUITE_PROFILE_DIR=/tmp/sp PYTHONPATH=scripts python -m pytest -n 2 -p suite_profile
    python scripts/suite_profile.py /tmp/sp

The report gives the totals, the programs by compile time, the programs compiled more
than once (within a worker and across workers) and the test files by traced + lowered +
compiled time.  Numbers from one run are in benchmarks/RESULTS.md, "The CPU test suite:
where the time goes".
"""

from __future__ import annotations

import collections
import glob
import hashlib
import json
import os
import re
import sys
import time

_state = {"test": None}
_rows: dict = collections.defaultdict(collections.Counter)
_mods: list = []


def _on_duration(event: str, duration_secs: float, **_kw) -> None:
    test = _state["test"]
    if test is None:
        return
    if event.endswith("jaxpr_trace_duration"):
        _rows[test]["trace"] += duration_secs
    elif event.endswith("jaxpr_to_mlir_module_duration"):
        _rows[test]["lower"] += duration_secs
    elif event.endswith("backend_compile_duration"):
        _rows[test]["compile"] += duration_secs


def _install() -> None:
    from jax import monitoring
    from jax._src import compiler  # private: the one place every compilation passes

    monitoring.register_event_duration_secs_listener(_on_duration)
    original = compiler.compile_or_get_cached

    def timed(backend, computation, *args, **kwargs):
        t0 = time.perf_counter()
        out = original(backend, computation, *args, **kwargs)
        seconds = time.perf_counter() - t0
        text = re.sub(r"loc\([^)]*\)", "", str(computation))
        _mods.append((_state["test"], hashlib.sha1(text.encode()).hexdigest()[:16], seconds))
        return out

    compiler.compile_or_get_cached = timed


# ------------------------------------------------------------------------ pytest hooks
def pytest_configure(config):
    del config
    _install()


def pytest_runtest_setup(item):
    _state["test"] = item.nodeid


def pytest_sessionfinish(session):
    del session
    out = os.environ.get("SUITE_PROFILE_DIR", "suite_profile")
    os.makedirs(out, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(out, f"{worker}.json"), "w") as f:
        json.dump({"rows": {k: dict(v) for k, v in _rows.items()}, "mods": _mods}, f)


# ------------------------------------------------------------------------------ report
def report(folder: str) -> str:
    runs = {os.path.basename(p)[:-5]: json.load(open(p))
            for p in sorted(glob.glob(os.path.join(folder, "*.json")))}
    if not runs:
        raise SystemExit(f"no worker files in {folder}")
    totals, per_file = collections.Counter(), collections.defaultdict(collections.Counter)
    lines, mods = [], []
    for worker, run in runs.items():
        for test, row in run["rows"].items():
            for k, v in row.items():
                totals[k] += v
                per_file[test.split("::")[0]][k] += v
        mods += [(worker, *m) for m in run["mods"]]
    lines.append(f"workers {len(runs)}; programs compiled {len(mods)}; seconds: trace "
                 f"{totals['trace']:.1f}, lower {totals['lower']:.1f}, compile "
                 f"{totals['compile']:.1f}")
    edges = (0.02, 0.05, 0.2, 1.0, 2.0, float("inf"))
    lo = 0.0
    for hi in edges:
        sel = [s for *_, s in mods if lo <= s < hi]
        lines.append(f"  programs of {lo:g}-{hi:g} s: {len(sel):5d}, {sum(sel):7.1f} s")
        lo = hi
    seen, within = {}, 0.0
    by_hash = collections.defaultdict(set)
    for worker, _test, h, s in mods:
        if (worker, h) in seen:
            within += s
        seen[(worker, h)] = True
        by_hash[h].add(worker)
    cheapest = {}
    for worker, _test, h, s in mods:
        cheapest[h] = min(s, cheapest.get(h, s))
    across = sum(cheapest[h] * (len(w) - 1) for h, w in by_hash.items())
    lines.append(f"  compiled again in the same worker: {within:.1f} s; in another worker: "
                 f"{across:.1f} s")
    lines.append("test files by trace + lower + compile (s):")
    for f, c in sorted(per_file.items(), key=lambda x: -sum(x[1].values()))[:25]:
        lines.append(f"  {sum(c.values()):7.1f}  trace {c['trace']:6.1f} lower "
                     f"{c['lower']:6.1f} compile {c['compile']:6.1f}  {f}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python scripts/suite_profile.py FOLDER")
    print(report(sys.argv[1]))
