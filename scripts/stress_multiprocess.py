"""Run every multi-process test many times at once and report the runs that hang.

A process of a finished multi-process job that does not exit is a defect that shows
only now and then, under load.  This script starts ``--runs`` copies of each test
marked ``multiprocess`` (``pytest -m multiprocess``) at the same time, each in its own
pytest process with its own temporary folders, waits for them with a deadline, and
reports per test how many passed, failed and hung.  A run past the deadline is stopped
with SIGABRT first, so that every Python process under it that has ``faulthandler``
on (the launcher turns it on in the processes it starts) prints the stack of each of
its threads, and those stacks are shown; then the run is killed.  Since ``runs`` copies
share the machine's cores, the tests' own time limits are stretched by ``runs / cores``
(``JAX_SEQPAR_TEST_TIME_SCALE``, read by ``tests/helpers.py``): a run that outlives them
is stuck, not merely starved.

    python scripts/stress_multiprocess.py --runs 30            # every multiprocess test
    python scripts/stress_multiprocess.py --runs 6 -k load_and_save --deadline 300

Not part of the test suite (it takes minutes and loads every core); exit code 0 only
if no run failed or hung.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def collect(keyword: str | None) -> list[str]:
    """The node ids of the tests marked ``multiprocess`` (optionally filtered by ``-k``)."""
    cmd = [sys.executable, "-m", "pytest", "-m", "multiprocess", "--collect-only", "-q",
           "-p", "no:cacheprovider"] + (["-k", keyword] if keyword else [])
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [line.strip() for line in out.splitlines() if "::" in line]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first found, deepest last), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def signal_all(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def run_batch(node: str, runs: int, deadline: float, workdir: Path) -> dict:
    """``runs`` concurrent pytest runs of ``node``; ``{"passed", "failed", "hung"}`` lists of
    (index, log path)."""
    procs = []
    for i in range(runs):
        log = workdir / f"run{i}.log"
        f = open(log, "w")
        # runs / cores times as many processes as cores: the tests' time limits stretch
        # as much (tests/helpers.py), so that a run past them is stuck, not starved
        scale = max(1.0, runs / (os.cpu_count() or 1))
        env = dict(os.environ, PYTHONFAULTHANDLER="1", JAX_SEQPAR_TEST_TIME_SCALE=f"{scale:g}")
        p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "-x", node, f"--basetemp={workdir / f'tmp{i}'}"],
                             cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        procs.append((i, p, f, log))
    start = time.monotonic()
    result = {"passed": [], "failed": [], "hung": []}
    while procs:
        still = []
        for i, p, f, log in procs:
            code = p.poll()
            if code is None and time.monotonic() - start < deadline:
                still.append((i, p, f, log))
                continue
            if code is None:  # past the deadline: stacks first, then stop everything
                tree = descendants(p.pid)
                signal_all(tree[::-1], signal.SIGABRT)
                time.sleep(5)
                signal_all([p.pid] + tree, signal.SIGKILL)
                p.wait()
                result["hung"].append((i, log))
            else:
                result["passed" if code == 0 else "failed"].append((i, log))
            f.close()
        procs = still
        time.sleep(0.2)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30, help="concurrent runs of each test")
    ap.add_argument("--deadline", type=float, default=900.0,
                    help="seconds a batch of runs may take before its runs count as hung")
    ap.add_argument("-k", dest="keyword", default=None, help="only tests matching (pytest -k)")
    ap.add_argument("--keep", type=Path, default=None, help="folder for the logs (default: a "
                    "temporary one, deleted unless something failed or hung)")
    args = ap.parse_args(argv)
    nodes = collect(args.keyword)
    if not nodes:
        print("no test marked multiprocess was collected", file=sys.stderr)
        return 2
    root = args.keep or Path(tempfile.mkdtemp(prefix="stress_mp_"))
    bad = 0
    for n, node in enumerate(nodes):
        workdir = root / f"test{n}"
        workdir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        r = run_batch(node, args.runs, args.deadline, workdir)
        print(f"{node}: {len(r['passed'])} passed, {len(r['failed'])} failed, "
              f"{len(r['hung'])} hung of {args.runs} concurrent runs "
              f"({time.monotonic() - t0:.0f} s)", flush=True)
        for kind in ("failed", "hung"):
            for i, log in r[kind]:
                bad += 1
                print(f"--- {kind}: run {i}, log {log}; its last 80 lines:")
                print("".join(log.read_text(errors="replace").splitlines(True)[-80:]))
    print(f"{len(nodes)} tests x {args.runs} runs: "
          f"{'no failure, no hang' if not bad else f'{bad} runs failed or hung'}; logs in {root}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
