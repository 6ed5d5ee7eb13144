"""Where a step's GPU time goes: one step under ``jax.profiler.trace``, the device's
kernels read back from the Perfetto trace and summed by category (issue 30).

Categories are matched on the kernel name, first match wins (``CATEGORIES``); kernels of
several streams may overlap (a host copy next to a matmul), so the categories can sum
to more than the busy time.  ``busy`` is the union of all kernel intervals on the GPU,
``idle`` the rest of the span from the first kernel's start to the last one's end.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re

#: (category, regex on the lower-cased kernel name), first match wins.
CATEGORIES = (
    ("host transfers", r"memcpy|dtoh|htod|d2h|h2d"),
    ("collectives", r"nccl|all_reduce|all-reduce|allreduce|reduce_scatter|all_gather|collective"),
    ("attention kernels", r"mosaic|fmha|flash|cudnn|attention|attn"),
    ("matmuls", r"gemm|nvjet|cutlass|xmma|cublas|sm90_|sm80_|matmul|dot"),
    ("copies and layout", r"memset|copy|transpose|concatenate|dynamic.update|pad"),
    ("elementwise and reductions (XLA fusions)", r"fusion|loop|input|reduce|convert|scatter|gather|select|broadcast"),
)


def _newest_trace(logdir: str) -> str:
    paths = glob.glob(os.path.join(logdir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {logdir}")
    return max(paths, key=os.path.getmtime)


def category(name: str) -> str:
    low = name.lower()
    for cat, pattern in CATEGORIES:
        if re.search(pattern, low):
            return cat
    return "other"


def _union(intervals):
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarize(path: str, top: int = 25) -> dict:
    """Per-category kernel time (ms), busy / idle / span (ms) and the ``top`` kernels by
    total time, from a Perfetto trace written by ``jax.profiler.trace``."""
    with gzip.open(path) as fh:
        data = json.load(fh)
    events = data["traceEvents"] if isinstance(data, dict) else data
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and re.search(r"gpu|device:", str(e.get("args", {}).get("name", "")).lower())
                and "host" not in str(e.get("args", {}).get("name", "")).lower()}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids
               and e.get("dur", 0) > 0]
    if not kernels:
        raise ValueError(f"no device events in {path} (processes: "
                         f"{sorted({str(e.get('args', {}).get('name')) for e in events if e.get('name') == 'process_name'})})")
    by_cat = collections.Counter()
    by_name = collections.Counter()
    for e in kernels:
        by_cat[category(e["name"])] += e["dur"]
        by_name[e["name"]] += e["dur"]
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    ms = lambda us: us / 1e3  # noqa: E731  (trace times are microseconds)
    return dict(span_ms=ms(end - start), busy_ms=ms(busy), idle_ms=ms(end - start - busy),
                kernels=len(kernels),
                categories_ms={k: ms(v) for k, v in by_cat.most_common()},
                top_kernels_ms=[(n[:160], ms(v)) for n, v in by_name.most_common(top)])


def profile_call(fn, logdir: str) -> dict:
    """Run ``fn()`` (which must block until its work is done) under the profiler and
    summarize the device's kernels."""
    import jax
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
        fn()
    return summarize(_newest_trace(logdir))


def print_summary(s: dict, label: str = "") -> None:
    print(f"profile {label}: span {s['span_ms']:.1f} ms, GPU busy {s['busy_ms']:.1f} ms, "
          f"idle {s['idle_ms']:.1f} ms, {s['kernels']} kernels", flush=True)
    for cat, t in s["categories_ms"].items():
        print(f"  {cat:42s} {t:10.1f} ms  {100 * t / s['span_ms']:5.1f}% of the span",
              flush=True)
    for name, t in s["top_kernels_ms"][:12]:
        print(f"    {t:9.1f} ms  {name[:100]}", flush=True)
