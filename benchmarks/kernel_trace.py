"""Where a Hopper kernel's SM time goes, CTA by CTA (issue 41): the forward (or the
backward's two kernels) run with Mosaic GPU's on-device profiler
(``pallas_mgpu_common.TRACE_ENV``), its regions read back and summed per phase.

Each warpgroup of each CTA records the cycle counter of its SM (``%clock``) at the start
and end of the forward's named regions: the consumers' ``load`` (the query block's load),
``rows`` (the key blocks), each ``step`` (one key block; ``first`` / ``last`` for the
pipelined forward's peeled ends) and ``out`` (normalising and storing ``O`` and lse);
the producer's ``produce``.  The profiler also keeps each warpgroup's SM and the global
timer at its start.  From those, per case:

* ``phases``: the SMs' cycles over the kernel's span split into the CTAs' query loads,
  their wait for the first key block, their steps, their output, the gaps between one
  CTA's end and the next one's start on the same SM, and the idle tail (an SM with no
  CTA left while others run);
* ``cycles_per_step``: the steps' cycles over the steps, and the median step in the
  middle of a CTA against its first and last;
* ``clock_mhz``: the SMs' cycles per global-timer microsecond.

Cases (H 16, D 128, bf16, causal, the tile an aligned call states): ``row``, one row of
64k tokens; ``rows``, sixteen rows of 4k; ``packed``, 64k tokens in log-normal documents
around 4k (issue 41's bar).  The same calls without the profiler are timed beside, so
the profiler's own cost shows.  Most of that cost is each CTA copying its trace buffer
out at its end, which lands in the gaps between CTAs and grows with the buffer:
``--ranges`` runs each case with several buffer sizes, so the gap can be read at zero
(a straight-line fit, by hand: RESULTS.md).  The phases assume one query (or key) block
per CTA, as the kernels run it.

    python benchmarks/kernel_trace.py --cases row,rows,packed [--set overlap_fwd=false]
    python benchmarks/kernel_trace.py --kernels bwd --cases rows --ranges 0,300

``--kernels bwd`` traces the backward's two kernels instead (their regions: ``load``,
the CTA's stationary blocks; ``step``, one streamed block; ``out``; the rows named
``dkdv_rows`` and ``dq_rows`` tell the kernels apart).

Within a step the unpipelined forward also records ``qk`` (``S`` issued and waited for,
the K slot freed), ``soft`` (mask and online softmax), ``turn`` (V's wait and the
ping-pong's) and ``pv``; the fused backward (``row_scores``) ``sp`` (``S`` and ``P``),
``front`` (``dP``, ``dV``, ``dS``), ``meet`` (the consumers' dS barrier), ``back`` (``dK``
and the dQ half) and ``red`` (the dQ reduce-add).  The phases above do not use them;
``--raw`` keeps them.  Their events cost cycles of their own: with them a forward step
read about 3,300 cycles where it reads about 2,800 without (RESULTS.md), so compare
such traces with each other only.  ``--per-cta`` keeps one row per CTA (``per_cta``).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import _setup  # noqa: F401

CASES = ("row", "rows", "packed")
PHASES = ("load", "first_k", "steps", "out", "gap", "idle")


def case_shape(case: str, seq: int, doc: int):
    """``(B, S, segment ids?)`` of a case: the work of one row of ``seq`` tokens."""
    if case == "row":
        return 1, seq, False
    if case == "rows":
        return seq // doc, doc, False
    if case == "packed":
        return 1, seq, True
    raise ValueError(f"unknown case {case!r}; expected one of {CASES}")


def _wrap32(x):
    """Differences of 32-bit counters (``%clock``, the global timer's low word)."""
    return (np.asarray(x, np.int64) + 2 ** 31) % 2 ** 32 - 2 ** 31


def parse(buffer, names: dict, entries: int, traces_per_block: int = 3):
    """The raw profile buffer (``entries`` per warpgroup: the global timer's low word at
    its start, its SM, the entries used, then a tag and a clock per event) -> a list per
    block of ``{"sm", "start_ns", "wg": [events per warpgroup: (name, is_begin,
    clock)]}``; clocks are the SM's counter, so blocks on one SM compare."""
    buf = np.asarray(buffer).astype(np.int64)
    blocks = buf.reshape(-1, traces_per_block, entries)
    unintern = {v: k for k, v in names.items()}
    out = []
    for blk in blocks:
        wgs = []
        for tr in blk:
            used = int(tr[2])
            ev = tr[3:3 + used].reshape(-1, 2)
            wgs.append([(unintern[int(tag) & 0x7FFFFFFF], not (int(tag) >> 31), int(clk))
                        for tag, clk in ev])
        out.append({"sm": int(blk[0][1]), "start_ns": int(blk[0][0]), "wg": wgs})
    return out


def _regions(events):
    """``{name: [(begin, end), ...]}`` of one warpgroup's events."""
    open_, regs = {}, {}
    for name, begin, clk in events:
        if begin:
            open_.setdefault(name, []).append(clk)
        elif open_.get(name):
            regs.setdefault(name, []).append((open_[name].pop(), clk))
    return regs


def block_phases(block, consumers=(0, 1)):
    """One CTA on its SM's clock: ``(t0, t_end, phases, steps)``, ``phases`` the cycles
    of ``load`` / ``first_k`` / ``steps`` / ``out`` along the CTA's timeline (the consumers
    overlap, so each phase runs from the first consumer entering it to the last leaving
    it; ``out`` to the CTA's last event), ``steps`` each step's cycles (consumer 0)."""
    events = [e for w in block["wg"] for e in w]
    if not events:
        return None
    base = events[0][2]
    rel = lambda c: int(_wrap32(c - base))  # noqa: E731
    t0 = min(rel(e[2]) for e in events)
    t_end = max(rel(e[2]) for e in events)
    regs = [_regions(block["wg"][w]) for w in consumers]

    step_names = ("first", "step", "last")

    def steps_of(r):
        return sorted((rel(b), rel(e)) for nm in step_names for b, e in r.get(nm, []))
    all_steps = [steps_of(r) for r in regs]
    q_end = max((rel(r["load"][-1][1]) for r in regs if r.get("load")), default=None)
    s_begin = min((s[0][0] for s in all_steps if s), default=None)
    s_end = max((s[-1][1] for s in all_steps if s), default=None)
    ph = dict.fromkeys(PHASES[:4], 0)
    if q_end is not None:
        ph["load"] = q_end - t0
        if s_begin is not None:
            ph["first_k"] = max(0, s_begin - q_end)
            ph["steps"] = s_end - s_begin
            ph["out"] = max(0, t_end - s_end)  # the output and whatever ends the CTA
        else:
            ph["out"] = max(0, t_end - q_end)
    steps0 = [e - b for b, e in all_steps[0]] if all_steps else []
    return base + t0, base + t_end, ph, steps0


def summarize(blocks):
    """Per-phase SM cycles over a traced call, the steps' cycles and the SM clock."""
    per_sm = {}
    for blk in blocks:
        got = block_phases(blk)
        if got is not None:
            per_sm.setdefault(blk["sm"], []).append((got, blk["start_ns"]))
    totals = dict.fromkeys(PHASES, 0)
    steps_all, first, middle, last, rates = [], [], [], [], []
    ends_ns, starts_ns, n_blocks = [], [], 0
    for sm, items in per_sm.items():
        ref = items[0][0][0]
        items.sort(key=lambda it: _wrap32(it[0][0] - ref))
        for i, ((t0, t1, ph, steps), _ns) in enumerate(items):
            n_blocks += 1
            for k, v in ph.items():
                totals[k] += v
            if i + 1 < len(items):
                totals["gap"] += max(0, int(_wrap32(items[i + 1][0][0] - t1)))
            steps_all.extend(steps)
            if len(steps) >= 3:
                first.append(steps[0])
                last.append(steps[-1])
                middle.extend(steps[1:-1])
        (a0, _, _, _), a_ns = items[0]
        (b0, b1, _, _), b_ns = items[-1]
        dns = int(_wrap32(b_ns - a_ns))
        if dns > 0:
            rates.append(int(_wrap32(b0 - a0)) / dns * 1e3)  # MHz
        starts_ns.append(a_ns)
        ends_ns.append((b_ns, int(_wrap32(b1 - b0))))
    # one CTA per SM (a persistent kernel) gives no rate: the span and idle time are
    # then left out (NaN, 0)
    mhz = float(np.median(rates)) if rates else float("nan")
    ref_ns = starts_ns[0]
    start_ns = [int(_wrap32(a - ref_ns)) for a in starts_ns]
    end_ns = [_wrap32(b - ref_ns) + c / mhz * 1e3 for b, c in ends_ns]
    span_ns = max(end_ns) - min(start_ns)
    # an SM's cycles before its first CTA starts and after its last one ends
    totals["idle"] = (int(sum((s - min(start_ns)) + (max(end_ns) - e)
                              for s, e in zip(start_ns, end_ns)) * mhz / 1e3)
                      if rates else 0)
    all_cycles = sum(totals.values())
    n_steps = len(steps_all)
    return {
        "blocks": n_blocks, "sms": len(per_sm), "clock_mhz": round(mhz, 1),
        "span_us": round(span_ns / 1e3, 2),
        "phases_cycles": totals,
        "phases_share": {k: round(v / all_cycles, 4) for k, v in totals.items()},
        "steps": n_steps,
        "cycles_per_step": round(totals["steps"] / max(1, n_steps), 1),
        "step_median": {"first": _med(first), "middle": _med(middle), "last": _med(last),
                        "all": _med(steps_all)},
        "step_mean_middle": round(float(np.mean(middle)), 1) if middle else None,
        "cycles_per_block": {k: round(totals[k] / max(1, n_blocks), 1) for k in PHASES},
    }


def _med(x):
    return float(np.median(x)) if len(x) else None


def per_cta(blocks):
    """One row per CTA, in the buffer's (launch) order: ``[index, SM, start (us from
    the first CTA's start, global timer), steps, median step (cycles)]`` (consumer 0's
    steps; 0 and None for a CTA without steps): to read a step's cost against when the
    CTA ran and how long its row was."""
    rows, ref = [], None
    for i, blk in enumerate(blocks):
        got = block_phases(blk)
        if got is None:
            continue
        ref = blk["start_ns"] if ref is None else ref
        steps = got[3]
        rows.append([i, blk["sm"], round(int(_wrap32(blk["start_ns"] - ref)) / 1e3, 3),
                     len(steps), _med(steps)])
    t0 = min((r[2] for r in rows), default=0.0)
    for r in rows:
        r[2] = round(r[2] - t0, 3)
    return rows


def kernel_kind(names) -> str:
    """Which kernel a trace is of, by its regions: ``fwd``, ``dq`` or ``dkdv`` (the
    fused backward's too), or ``other`` for a kernel without these regions (the TMA
    zeroing of the float32 dQ, ``pallas_mgpu_bwd.tma_zeros``), which is not summarised."""
    if "dkdv_rows" in names:
        return "dkdv"
    if "dq_rows" in names:
        return "dq"
    return "fwd" if "rows" in names else "other"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--kernels", default="fwd", help="fwd, bwd (its dK/dV and dQ kernels) "
                   "or fwd,bwd")
    p.add_argument("--seq", type=int, default=65536)
    p.add_argument("--doc", type=int, default=4096, help="row length of 'rows'")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="an MgpuConfig field to replace (kernels.py's --mgpu-variant)")
    p.add_argument("--calls", type=int, default=3, help="calls before the one kept")
    p.add_argument("--ranges", default="0", type=lambda t: [int(x) for x in t.split(",")],
                   help="trace sizes (ranges per warpgroup) to run each case with; each is "
                        "raised to what the longest row needs")
    p.add_argument("--max-ranges", type=int, default=1 << 20,
                   help="at most this many ranges (the buffer takes shared memory: a CTA "
                        "whose row needs more has its trace cut short)")
    p.add_argument("--raw", type=int, default=0, metavar="N",
                   help="also keep the events of the first N CTAs (per kernel and trace size) "
                        "in the JSON, as parsed: for a persistent kernel, whose CTAs serve "
                        "many items, which the phases above do not split")
    p.add_argument("--per-cta", action="store_true",
                   help="also keep one row per CTA (per_cta): its SM, start, steps and "
                        "median step")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "trace.json"))
    a = p.parse_args(argv)
    cases = [c for c in a.cases.split(",") if c]
    for c in cases:
        case_shape(c, a.seq, a.doc)
    calls = [c for c in a.kernels.split(",") if c]
    if not calls or set(calls) - {"fwd", "bwd"}:
        p.error(f"--kernels {a.kernels!r}: expected fwd, bwd or fwd,bwd")

    import jax
    import jax.numpy as jnp
    from jax.experimental.mosaic.gpu import profiler as mprof

    from jax_seqpar.kernels import PallasMgpuKernel
    from jax_seqpar.kernels.base import TILE_ALIGNED
    from jax_seqpar.kernels.pallas_mgpu_common import TRACE_ENV, TRACE_RANGES_ENV
    from jax_seqpar.masks import MaskSpec
    from kernels import parse_mgpu_variant
    from packed import lognormal_lengths, packed_ids

    kept = {}

    def keep(self, buffer, f, grid, block):  # instead of the profiler's JSON
        kept[kernel_kind(self.interned_names)] = (
            np.asarray(buffer).copy(), dict(self.interned_names), self.entries_per_warpgroup,
            grid)
        os.unlink(f.name)  # the next call of the same kernel writes its own
    mprof.ProfilerSpec.dump = keep
    kern = (parse_mgpu_variant("set:" + ",".join(a.set))[1] if a.set else PallasMgpuKernel())
    H, D = 16, 128
    report = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "set": a.set, "seq": a.seq, "doc": a.doc, "cases": {}}
    for case in cases:
        B, S, has_seg = case_shape(case, a.seq, a.doc)
        ks = jax.random.split(jax.random.PRNGKey(S + B), 4)
        q, k, v, do = (jax.random.normal(kk, (B, S, H, D), jnp.bfloat16) for kk in ks)
        seg = (jnp.asarray(packed_ids(lognormal_lengths(a.doc, S, seed=S + a.doc), S)[None])
               if has_seg else None)
        pos = jnp.arange(S, dtype=jnp.int32)
        mask = MaskSpec(causal=True)

        def fwd(q, k, v, seg):
            return kern.fwd(q, k, v, pos, pos, mask, D ** -0.5, seg, seg, tile=TILE_ALIGNED)

        def bwd(q, k, v, o, lse, do, seg):
            return kern.bwd(q, k, v, o, lse, do, pos, pos, mask, D ** -0.5, seg, seg,
                            tile=TILE_ALIGNED)
        os.environ.pop(TRACE_ENV, None)
        o, lse = jax.jit(fwd)(q, k, v, seg)  # the backward's inputs, untraced
        # enough ranges for the longest row's steps (the dK/dV kernel's are query blocks
        # of 64), and any more asked for: a CTA copies its whole trace buffer out at its
        # end, so the gaps between CTAs grow with the buffer (fit against it to read the
        # gap without the profiler)
        need = min(-(-S // 64) + 8, a.max_ranges)
        for name in calls:
            fn, args = (fwd, (q, k, v, seg)) if name == "fwd" else (bwd, (q, k, v, o, lse,
                                                                          do, seg))
            entry = report["cases"].setdefault(case, {}).setdefault(name, {})
            for ranges in [None] + sorted({max(need, r) for r in a.ranges}):
                if ranges is None:
                    os.environ.pop(TRACE_ENV, None)
                else:
                    os.environ[TRACE_ENV] = os.path.join(
                        os.environ.get("TMPDIR", "/tmp"), "jsp_trace")
                    os.makedirs(os.environ[TRACE_ENV], exist_ok=True)
                    os.environ[TRACE_RANGES_ENV] = str(ranges)
                jax.clear_caches()  # traced again, with or without the profiler
                call = jax.jit(fn)
                jax.block_until_ready(call(*args))
                kept.clear()
                ts = []
                for _ in range(a.calls):
                    t = time.perf_counter()
                    jax.block_until_ready(call(*args))
                    ts.append(time.perf_counter() - t)
                ms = round(float(np.median(ts)) * 1e3, 3)
                if ranges is None:
                    entry["plain_call_ms"] = ms
                    continue
                if not kept:
                    raise RuntimeError(f"{case} {name}: the traced kernels wrote no profile")
                for kind, (buf, names, n_entries, grid) in sorted(kept.items()):
                    if kind == "other":
                        continue
                    blocks = parse(buf, names, n_entries)
                    summary = summarize(blocks)
                    summary.update(B=B, S=S, grid=list(grid), call_ms=ms, ranges=ranges,
                                   entries=n_entries)
                    print(f"kernel_trace {case} {kind}: {json.dumps(summary)}", flush=True)
                    if a.raw:
                        summary["raw_blocks"] = blocks[:a.raw]
                    if a.per_cta:
                        summary["per_cta"] = per_cta(blocks)
                    entry.setdefault(kind, []).append(summary)
        os.environ.pop(TRACE_ENV, None)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
