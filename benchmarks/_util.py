"""Shared helpers for the benchmark scripts: timing, environment capture, output files."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time

import jax


def env_info() -> dict:
    devs = jax.devices()
    return {
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": devs[0].device_kind,
        "device_count": len(devs),
    }


def time_fn(fn, *args, warmup: int = 2, repeats: int = 5) -> dict:
    """Median/min wall time of ``fn(*args)`` in seconds, synchronising on the result."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(ts), "min_s": min(ts), "repeats": repeats}


def round_order(names, r: int, seed: int = 0) -> list:
    """The order of round ``r`` when several functions are timed in alternation: a fresh
    seeded permutation each round.  A fixed cyclic rotation keeps each function after
    the same neighbour, and on one H200 the call right after a 110 ms cuDNN call ran
    3-5% slower than the same call elsewhere in the round (three runs of
    ``packed_breakdown.py``, RESULTS.md, "Packed documents, third pass")."""
    import numpy as np
    rng = np.random.default_rng((seed, r))
    return [names[i] for i in rng.permutation(len(names))]


def timed_rounds(calls: dict, rounds: int, reps=None, seed: int = 0, clock=None) -> dict:
    """Median ms per call of each ``name: (fn, args)`` over ``rounds`` rounds in a fresh
    order each round (``round_order``): each round runs ``reps[name]`` calls (default 1)
    back to back with one synchronisation at the end, and divides.  With a running
    ``ClockSampler`` also the mean SM clock and board power over each function's runs.
    ``{name: {"ms", "calls", "sm_mhz", "power_w"}}`` (the last two None without samples)."""
    names = list(calls)
    reps = reps or {}
    ts = {n: [] for n in names}
    spans = {n: [] for n in names}
    for r in range(rounds):
        for n in round_order(names, r, seed=seed):
            fn, args = calls[n]
            k = reps.get(n, 1)
            t0 = time.perf_counter()
            out = None
            for _ in range(k):
                out = fn(*args)
            jax.block_until_ready(out)
            t1 = time.perf_counter()
            ts[n].append((t1 - t0) / k)
            spans[n].append((t0, t1))
    res = {}
    for n in names:
        cs = [c for c in (clock.mean(a, b) for a, b in spans[n])
              if c["n"]] if clock is not None else []
        res[n] = {"ms": 1e3 * statistics.median(ts[n]), "calls": reps.get(n, 1),
                  "sm_mhz": statistics.fmean(c["sm_mhz"] for c in cs) if cs else None,
                  "power_w": statistics.fmean(c["power_w"] for c in cs) if cs else None}
    return res


def sustained_rounds(calls: dict, rounds: int, target_ms: float, single_s: dict,
                     seed: int = 0, clock=None) -> dict:
    """``timed_rounds`` with each function called back to back for about ``target_ms``
    per round (``n`` calls from ``single_s[name]``, its single-call seconds).  So each call
    follows calls of its own kind and the GPU is in the state such calls keep it in, as
    in a training loop (at 64k-token attention an H200 runs at its 700 W cap, about 1.75
    GHz against 1.98 when idle: RESULTS.md, "Packed documents, fourth pass"), and the
    host's round trip is paid once per run.  ``{}`` when ``rounds`` is 0."""
    if not rounds:
        return {}
    reps = {n: max(1, round(target_ms / (1e3 * single_s[n]))) for n in calls}
    return timed_rounds(calls, rounds, reps, seed=seed + 2, clock=clock)


def peak_memory_bytes(device=None):
    """Peak bytes in use on ``device`` so far (None where the backend does not say)."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:
        return None
    return stats.get("peak_bytes_in_use")


def progress(iterable, **kw):
    try:
        from tqdm import tqdm
    except ImportError:  # the GPU image may not have it
        return iterable
    return tqdm(iterable, **kw)


def out_dir(default: str = "benchmarks/out") -> str:
    d = os.environ.get("OUT") or default
    os.makedirs(d, exist_ok=True)
    return d


def save_json(obj, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def record(result: dict, key: str, row, line: str, path: str) -> None:
    """Append ``row`` to ``result[key]``, print ``line``, and save the JSON so far (a
    phase's row as it comes, so a run stopped part way keeps what it measured)."""
    result[key].append(row)
    print(line, flush=True)
    save_json(result, path)


def finish(path: str, ok: bool) -> int:
    """Say where the JSON went and whether the checks passed; the exit code."""
    print("wrote", path)
    print("CHECKS:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def choose_preset(presets: dict, name=None):
    """``(name, config)``: the named preset, else "gpu" on GPUs and "cpu" otherwise."""
    name = name or ("gpu" if jax.default_backend() == "gpu" else "cpu")
    return name, presets[name]


def preset_config(presets: dict, args):
    """``(name, config)`` from a script's arguments: ``choose_preset(presets,
    args.preset)``, replaced by the JSON of ``args.config`` when given (tests), then
    ``args.cases`` (comma-separated) and ``args.backward`` where the script has them and
    they are set."""
    name, cfg = choose_preset(presets, args.preset)
    cfg = json.loads(args.config) if args.config else dict(cfg)
    if getattr(args, "cases", None):
        cfg["cases"] = args.cases.split(",")
    if getattr(args, "backward", None):
        cfg["backward"] = args.backward
    return name, cfg


def parse_mesh(text: str):
    """``"NOxNI"`` (e.g. ``"2x4"``) as ``(nodes, local)``, or ``None`` when it is not two
    positive integers joined by ``x`` (the double ring's ``--mesh``)."""
    try:
        nodes, local = (int(x) for x in text.lower().split("x"))
    except ValueError:
        return None
    return (nodes, local) if min(nodes, local) >= 1 else None


def rel(a, b) -> float:
    """``||a - b|| / ||b||`` in float32."""
    import jax.numpy as jnp

    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def pyplot():
    """``matplotlib.pyplot`` with the non-interactive Agg backend, or None (with a message)
    where matplotlib is not installed (the GPU image may lack it)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not available: no plot")
        return None
    return plt


def replot(path: str, table, plot) -> None:
    """``--plot JSON``: print ``table(rows)`` and draw ``plot(rows, <path>.png)`` from the
    ``rows`` of a saved result file, without running anything."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    table(rows)
    plot(rows, os.path.splitext(path)[0] + ".png")


class ClockSampler:
    """SM clock (MHz) and board power (W) of GPU 0, sampled every ``period_ms`` by
    ``nvidia-smi`` in a background thread, stamped with ``time.perf_counter()`` when read,
    so that a timed call's interval can be matched to the clock it ran at.  Does nothing
    (``samples`` stays empty) where ``nvidia-smi`` is missing.

        with ClockSampler() as clk:
            t0 = time.perf_counter(); f(); t1 = time.perf_counter()
        clk.mean(t0, t1)   # {"sm_mhz": ..., "power_w": ..., "n": ...}
    """

    def __init__(self, period_ms: int = 10):
        self.period_ms = period_ms
        self.samples = []  # (perf_counter, sm_mhz, power_w)
        self._proc = None
        self._thread = None

    def __enter__(self):
        import shutil
        import subprocess
        import threading
        if shutil.which("nvidia-smi") is None:
            return self
        self._proc = subprocess.Popen(
            ["nvidia-smi", "-i", "0", "--query-gpu=clocks.sm,power.draw",
             "--format=csv,noheader,nounits", f"-lms={self.period_ms}"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

        def read():
            for line in self._proc.stdout:
                try:
                    mhz, watts = (float(x) for x in line.split(","))
                except ValueError:
                    continue
                self.samples.append((time.perf_counter(), mhz, watts))
        self._thread = threading.Thread(target=read, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
            self._thread.join(timeout=10)
        return False

    def mean(self, t0: float, t1: float) -> dict:
        """Mean clock and power over the samples read between ``t0`` and ``t1``."""
        xs = [(m, w) for t, m, w in self.samples if t0 <= t <= t1]
        if not xs:
            return {"n": 0}
        return {"sm_mhz": statistics.fmean(m for m, _ in xs),
                "power_w": statistics.fmean(w for _, w in xs), "n": len(xs)}


def accuracy_heatmap(plt, grid, depths, lengths, *, xlabel: str, title: str):
    """A length x depth accuracy grid (rows: ``lengths``, columns: ``depths``), each
    cell written in; returns the figure (the caller saves it)."""
    import numpy as np

    grid = np.asarray(grid)
    fig, ax = plt.subplots(figsize=(1.3 + 0.9 * len(depths), 1.1 + 0.5 * len(lengths)))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(depths)), [f"{d:.2f}" for d in depths])
    ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("prompt length (tokens)")
    for (i, j), x in np.ndenumerate(grid):
        ax.text(j, i, f"{x:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, label="accuracy")
    ax.set_title(title)
    return fig
