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
import statistics

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


def timeline(path: str) -> list:
    """The device's kernels of a Perfetto trace in start order, as ``(name, start_us,
    dur_us)`` with start times from the first kernel's start."""
    with gzip.open(path) as fh:
        data = json.load(fh)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: str(e.get("args", {}).get("name", "")).lower() for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {p for p, n in names.items() if re.search(r"gpu|device:", n) and "host" not in n}
    ks = sorted((e["ts"], e["dur"], e["name"]) for e in events
                if e.get("ph") == "X" and e.get("pid") in gpu and e.get("dur", 0) > 0)
    t0 = ks[0][0] if ks else 0.0
    return [(n, ts - t0, d) for ts, d, n in ks]


def profile_timeline(fn, logdir: str) -> list:
    """``timeline`` of one ``fn()`` run under the profiler (``fn`` must block)."""
    import jax
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
        fn()
    return timeline(_newest_trace(logdir))


def group_calls(tl: list, n_calls: int, min_gap_us: float = 40.0) -> list:
    """Split a ``timeline`` of ``n_calls`` synchronised calls into one group of kernels
    per call: consecutive calls are separated by the host's round trip (hundreds of
    microseconds on an H200 machine), the kernels of one call by a few at most, so the
    ``n_calls - 1`` widest gaps are the boundaries.  Raises if the narrowest of those is
    under ``min_gap_us`` (a call's own idle gap could then be mistaken for a boundary)."""
    if n_calls < 1 or len(tl) < n_calls:
        raise ValueError(f"{len(tl)} kernels for {n_calls} calls")
    gap, end = {}, tl[0][1] + tl[0][2]
    for i in range(1, len(tl)):  # idle time before kernel i (after every earlier one)
        gap[i] = tl[i][1] - end
        end = max(end, tl[i][1] + tl[i][2])
    gaps = sorted(gap, key=gap.get, reverse=True)[:n_calls - 1]
    if gaps:
        narrowest = min(gap[i] for i in gaps)
        if narrowest < min_gap_us:
            raise ValueError(f"a boundary gap of only {narrowest:.1f} us: calls not "
                             f"separable by the host round trip")
    cuts = [0] + sorted(gaps) + [len(tl)]
    return [tl[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


def device_times(calls, logdir: str) -> list:
    """Run ``calls`` (``(label, fn)`` pairs; each ``fn()`` must block until its work is
    done) in order under one profiler trace and return, per call, ``(label, span_ms,
    busy_ms, kernels)``: the device time from its first kernel's start to its last one's
    end, the sum of its kernels' durations, and the kernels as ``(name, ms)`` in launch
    order.  Host dispatch and the synchronisation after each call are outside the span,
    which is what a wall clock around one synchronised call adds (about 0.5-1 ms per call
    on the H200 machine, so several percent of a 14 ms call and under 1% of a 110 ms
    one)."""
    import jax
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
        for _, fn in calls:
            fn()
    groups = group_calls(timeline(_newest_trace(logdir)), len(calls))
    out = []
    for (label, _), g in zip(calls, groups):
        start, end = g[0][1], max(s + d for _, s, d in g)
        out.append((label, (end - start) / 1e3, sum(d for _, _, d in g) / 1e3,
                    [(name, d / 1e3) for name, _, d in g]))
    return out


def device_rounds(calls: dict, rounds: int, seed: int = 0, busy: dict = None,
                  per_kernel: dict = None) -> dict:
    """Median device time (ms) of each ``name: (fn, args)`` over ``rounds`` rounds in a
    fresh order each round (``_util.round_order``), from one profiler trace
    (``device_times``): each call is synchronised, and its time runs from its first
    kernel's start to its last one's end.  The wall clock around one synchronised call
    adds the host's dispatch and round trip (0.5-0.7 ms on the H200 machine: 14.19 ms
    against 13.66 ms for the packed 64k call, 110.02 against 109.37 for cuDNN's unpacked
    one, RESULTS.md "Packed documents, fourth pass"), a larger share of a short call than
    of a long one; the device time leaves it out of both.  ``{}`` when ``rounds`` is 0 or
    the trace cannot be read (printed).  ``busy``: a dict that receives each call's
    median kernel time (the sum of its kernels' durations), so a span longer than its
    kernels shows as idle time inside the call.  ``per_kernel``: a dict that receives,
    per call, its kernels in launch order as ``(name, median ms over the rounds)``: the
    kernels of two calls compared under the rounds' conditions (a fresh order, the clock
    the rounds hold), where timing one call's kernels in a row of its own lets the clock
    differ between the two (a call after an idle round trip starts near the top clock).
    A call whose rounds launched different numbers of kernels gets ``None``."""
    if not rounds:
        return {}
    import functools

    import jax
    from _util import round_order
    names = list(calls)

    def run(fn, args):
        jax.block_until_ready(fn(*args))
    seq = [(n, functools.partial(run, *calls[n]))
           for r in range(rounds) for n in round_order(names, r, seed=seed + 1)]
    try:
        got = device_times(seq, os.path.join("/tmp", f"jsp_device_rounds_{seed}"))
    except Exception as e:
        print(f"  device time: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        return {}
    spans = {n: [] for n in names}
    kernel_ms = {n: [] for n in names}
    lists = {n: [] for n in names}
    for n, span, kernels, each in got:
        spans[n].append(span)
        kernel_ms[n].append(kernels)
        lists[n].append(each)
    if busy is not None:
        busy.update({n: statistics.median(v) for n, v in kernel_ms.items()})
    if per_kernel is not None:
        for n, ls in lists.items():
            same = len({len(x) for x in ls}) == 1
            per_kernel[n] = ([(name, statistics.median(x[i][1] for x in ls))
                              for i, (name, _) in enumerate(ls[0])] if same else None)
    return {n: statistics.median(v) for n, v in spans.items()}
