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


def choose_preset(presets: dict, name=None):
    """``(name, config)``: the named preset, else "gpu" on GPUs and "cpu" otherwise."""
    name = name or ("gpu" if jax.default_backend() == "gpu" else "cpu")
    return name, presets[name]


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
