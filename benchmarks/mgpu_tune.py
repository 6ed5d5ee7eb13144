"""Tune the Hopper kernel's tiles per shape class; write the committed table (issue 41).

For each head dim and mask class (``--masks``: ``none`` on a dense tile, ``causal`` on an
aligned one, at ``--seq`` tokens; ``segments``: causal packed documents of log-normal
lengths around 4k tokens on an aligned tile, at ``--seq-segments``), B 1, ``--heads``
heads, bf16, and each of ``--phases`` (fwd, bwd):

* every forward candidate of ``mgpu_tuning.forward_candidates`` is compiled, its output
  and lse checked against the per-head-dim default config's (the bf16 budget of
  docs/ARCHITECTURE.md, "Numerics and how the tests hold them"), and timed; the same
  for the backward candidates (gradients from the same ``o``, lse);
* timing is on the device's clock (``_profile.device_rounds``: all candidates of a phase
  in a fresh order each round, one synchronised call each, first kernel start to last
  kernel end), falling back to the wall clock when the trace cannot be read;
* ``--timer sustained`` instead reads each candidate at the rate it keeps up back to
  back for ``--window-s`` seconds, in a fresh order each round
  (``mgpu_tuning.sustained_timer``): at the power cap, where training runs and where a
  kernel that does less work per call runs at a higher clock;
* the fastest forward and backward halves form the table entry, with both times, the
  default's and the timer beside them.

    python benchmarks/mgpu_tune.py --dims 128 --out $OUT/tune_d128.json
    python benchmarks/mgpu_tune.py --dims 128 --masks segments --phases bwd \
        --timer sustained --rounds 3 --out $OUT/tune_seg.json
    python benchmarks/mgpu_tune.py --merge a.json b.json --table jax_seqpar/kernels/mgpu_tuned.json

Merging updates the table's entries of the runs' classes (a phase a run did not tune
keeps the table's fields) and leaves the other entries as they are.

The table is read by ``PallasMgpuKernel`` (``kernels/mgpu_tuning.py``); RESULTS.md
("Hopper tiles by measurement") has the runs behind the committed one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import _setup  # noqa: F401

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_seqpar.kernels import mgpu_tuning as mt  # noqa: E402
from jax_seqpar.kernels.pallas_mgpu import mgpu_fwd  # noqa: E402
from jax_seqpar.kernels.pallas_mgpu_bwd import mgpu_bwd  # noqa: E402
from jax_seqpar.kernels.pallas_mgpu_common import DEFAULT_MGPU_CONFIGS  # noqa: E402
from jax_seqpar.masks import MaskSpec  # noqa: E402
from _profile import device_rounds  # noqa: E402
from _util import env_info, save_json  # noqa: E402

BUDGET = 2e-2  # bf16: docs/ARCHITECTURE.md, "Numerics and how the tests hold them"


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ok = np.isfinite(b)
    return float(np.linalg.norm((a - b)[ok]) / max(np.linalg.norm(b[ok]), 1e-30))


def _timer(reps):
    """Device-clock timer for ``mgpu_tuning.autotune``: one synchronised call per
    measurement, as ``kernels.py pair`` times them (the device time leaves the host's
    dispatch out).  Wall clock if the profiler trace cannot be read, then with ``reps``
    calls dispatched back to back per measurement so that the host's round trip is a
    small part.  (A first H100 run timed ``reps`` back-to-back calls on the device clock
    too, and ranked D 64 forward tiles in an order that single calls in rotation
    contradicted by 24%: RESULTS.md, "Hopper tiles by measurement".)"""
    def timer(runs, rounds):
        names = {f"c{i}": cfg for i, cfg in enumerate(runs)}
        one = {c: (lambda go=go: jax.block_until_ready(go())) for c, go in runs.items()}
        dev = device_rounds({n: (one[c], ()) for n, c in names.items()}, rounds)
        if len(dev) == len(names):
            return {names[n]: ms for n, ms in dev.items()}
        print("  device clock unavailable: wall clock", flush=True)
        many = {c: (lambda go=go: jax.block_until_ready([go() for _ in range(reps)]))
                for c, go in runs.items()}
        return {c: ms / reps for c, ms in mt.wall_timer(many, rounds).items()}
    return timer


def packed_segments(S, mean=4096, seed=0):
    """Segment ids ``[1, S]`` of documents of log-normal lengths around ``mean`` tokens:
    the packed-document benchmark's (``packed.py``)."""
    from packed import lognormal_lengths, packed_ids
    return jnp.asarray(packed_ids(lognormal_lengths(mean, S, seed), S)[None], jnp.int32)


def _sustained(window_s):
    """``mgpu_tuning.sustained_timer`` over the candidates' calls, each blocked on."""
    timer = mt.sustained_timer(window_s)

    def run(runs, rounds):
        return timer({c: (lambda go=go: jax.block_until_ready(go())) for c, go in runs.items()},
                     rounds)
    return run


def tune_class(D, mask_kind, S, H, rounds, reps, log, phases=("fwd", "bwd"), window_s=None):
    """Forward and backward rankings of one (head dim, mask) class: ``mask_kind`` is
    ``none``, ``causal`` or ``segments`` (causal packed documents around 4k tokens);
    ``window_s``: the sustained timer's window (None: the device clock)."""
    masked = mask_kind != "none"
    ks = jax.random.split(jax.random.PRNGKey(D + masked), 4)
    q, k, v, do = (jax.random.normal(x, (1, S, H, D), jnp.bfloat16) for x in ks)
    pos = jnp.arange(S, dtype=jnp.int32)
    mask = MaskSpec(causal=masked)
    seg = (packed_segments(S),) * 2 if mask_kind == "segments" else ()
    scale = D ** -0.5
    default = DEFAULT_MGPU_CONFIGS[D]

    def fwd_fn(cfg):
        return jax.jit(lambda q, k, v: mgpu_fwd(q, k, v, pos, pos, mask, scale, *seg,
                                                config=cfg))

    def bwd_fn(cfg):
        return jax.jit(lambda q, k, v, o, lse, do: mgpu_bwd(
            q, k, v, o, lse, do, pos, pos, mask, scale, *seg, config=cfg))

    ref_o, ref_lse = jax.block_until_ready(fwd_fn(default)(q, k, v))
    ref_g = (jax.block_until_ready(bwd_fn(default)(q, k, v, ref_o, ref_lse, do))
             if "bwd" in phases else None)

    def errors(cfg, e):
        log(f"  D={D} mask={mask_kind} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")

    def build_fwd(cfg):
        t0 = time.perf_counter()
        f = fwd_fn(cfg)
        o, lse = jax.block_until_ready(f(q, k, v))
        err = max(_rel(o, ref_o), _rel(lse, ref_lse))
        if not err <= BUDGET:
            raise AssertionError(f"forward differs from the default config's by {err:.2e}")
        log(f"  fwd D={D} mask={mask_kind} {mt.fields_of(cfg, mt.FWD_FIELDS)}: compiled and "
            f"checked ({err:.1e}) in {time.perf_counter() - t0:.1f} s")
        return lambda: f(q, k, v)

    def build_bwd(cfg):
        t0 = time.perf_counter()
        f = bwd_fn(cfg)
        g = jax.block_until_ready(f(q, k, v, ref_o, ref_lse, do))
        err = max(_rel(a, b) for a, b in zip(g, ref_g))
        if not err <= BUDGET:
            raise AssertionError(f"gradients differ from the default config's by {err:.2e}")
        log(f"  bwd D={D} mask={mask_kind} {mt.fields_of(cfg, mt.BWD_FIELDS)}: compiled and "
            f"checked ({err:.1e}) in {time.perf_counter() - t0:.1f} s")
        return lambda: f(q, k, v, ref_o, ref_lse, do)

    out = {}
    for phase, cands, build, fields in (
            ("fwd", mt.forward_candidates(D), build_fwd, mt.FWD_FIELDS),
            ("bwd", mt.backward_candidates(D, segments=mask_kind == "segments"), build_bwd,
             mt.BWD_FIELDS)):
        if phase not in phases:
            continue
        key_default = mt.fields_of(default, fields)
        if all(mt.fields_of(c, fields) != key_default for c in cands):
            cands = [default] + list(cands)
        timer = _timer(reps[phase]) if window_s is None else _sustained(window_s)
        ranked = mt.autotune(cands, build, rounds=rounds, timer=timer, on_error=errors)
        rows = [dict(fields=mt.fields_of(c, fields), ms=ms) for c, ms in ranked]
        dflt = [r["ms"] for r in rows if r["fields"] == key_default]
        out[phase] = dict(ranked=rows, best=rows[0]["fields"], best_ms=rows[0]["ms"],
                          default_ms=dflt[0] if dflt else None)
        log(f"{phase} D={D} mask={mask_kind}: best {rows[0]['fields']} {rows[0]['ms']:.3f} ms"
            f" (default {out[phase]['default_ms']}) of {len(rows)} candidates")
    return out


def general_tiles(dims, S, H, rounds, log):
    """``--general``: the table's pick for general causal tiles (it falls back to the
    aligned causal class) against the per-head-dim default, on ring tiles: device 2's
    queries against device 1's keys of a 4-device ring, zigzag and striped, each tile
    ``S`` tokens, forward and backward, on the device's clock in rotation."""
    from jax_seqpar.layouts import shard_positions
    gpu = mt.gpu_key(jax.devices()[0].device_kind)
    rows = []
    for D in dims:
        tuned, src = mt.lookup(gpu, "bfloat16", D, "general", "causal")
        default = DEFAULT_MGPU_CONFIGS[D]
        ks = jax.random.split(jax.random.PRNGKey(D), 4)
        q, k, v, do = (jax.random.normal(x, (1, S, H, D), jnp.bfloat16) for x in ks)
        for layout in ("zigzag", "striped"):
            qp = jnp.asarray(shard_positions(layout, 2, S, 4, xp=np), jnp.int32)
            kp = jnp.asarray(shard_positions(layout, 1, S, 4, xp=np), jnp.int32)
            mask = MaskSpec(causal=True)
            calls, outs = {}, {}
            for name, cfg in (("tuned", tuned), ("default", default)):
                f = jax.jit(lambda q, k, v, c=cfg: mgpu_fwd(q, k, v, qp, kp, mask, D ** -0.5,
                                                           config=c))
                o, lse = jax.block_until_ready(f(q, k, v))
                b = jax.jit(lambda q, k, v, o, lse, do, c=cfg: mgpu_bwd(
                    q, k, v, o, lse, do, qp, kp, mask, D ** -0.5, config=c))
                g = jax.block_until_ready(b(q, k, v, o, lse, do))
                outs[name] = (o, g)
                calls[f"{name} fwd"] = (lambda f=f: jax.block_until_ready(f(q, k, v)), ())
                calls[f"{name} bwd"] = (lambda b=b, o=o, lse=lse: jax.block_until_ready(
                    b(q, k, v, o, lse, do)), ())
            err = max([_rel(outs["tuned"][0], outs["default"][0])]
                      + [_rel(a, b) for a, b in zip(outs["tuned"][1], outs["default"][1])])
            dev = device_rounds(calls, rounds)
            row = dict(D=D, layout=layout, source=src, err_vs_default=err,
                       **{k.replace(" ", "_") + "_ms": v for k, v in dev.items()})
            rows.append(row)
            log(f"general D={D} {layout}: tuned ({src}) fwd {dev.get('tuned fwd', 0):.3f} ms "
                f"bwd {dev.get('tuned bwd', 0):.3f}; default fwd {dev.get('default fwd', 0):.3f}"
                f" bwd {dev.get('default bwd', 0):.3f}; outputs differ by {err:.1e}")
    return rows


def entries_from(run: dict, old: dict) -> dict:
    """Table entries (``mgpu_tuning`` format) from one run's classes; a phase the run did
    not tune keeps its fields (and times) from ``old``, the table's entry of that key."""
    gpu = mt.gpu_key(run["env"]["device_kind"])
    out = {}
    for c in run["classes"]:
        kind = c.get("mask", "causal" if c.get("masked") else "none")
        tile = "dense" if kind == "none" else "aligned"
        key = mt.table_key(gpu, "bfloat16", c["D"], tile, kind)
        entry = {k: v for k, v in old.get(key, {}).items()}
        for phase in ("fwd", "bwd"):
            if phase not in c:
                if phase not in entry:
                    fields = mt.FWD_FIELDS if phase == "fwd" else mt.BWD_FIELDS
                    entry[phase] = mt.fields_of(DEFAULT_MGPU_CONFIGS[c["D"]], fields)
                continue
            dflt = c[phase]["default_ms"]
            entry.update({phase: c[phase]["best"],
                          f"{phase}_ms": round(c[phase]["best_ms"], 4),
                          f"{phase}_default_ms": dflt and round(dflt, 4),
                          f"{phase}_date": run["env"]["date"],
                          f"{phase}_timer": run.get("timer", "device")})
        entry.update(seq=c.get("seq", run["seq"]), heads=run["heads"], date=run["env"]["date"],
                     jax=run["env"]["jax"])
        out[key] = entry
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", default="64,128")
    p.add_argument("--masks", default="none,causal,segments")
    p.add_argument("--phases", default="fwd,bwd", help="fwd, bwd or both")
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--seq-segments", type=int, default=65536,
                   help="tokens of the packed-document class (documents around 4k)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default="benchmarks/out/mgpu_tune.json")
    p.add_argument("--merge", nargs="+", default=None,
                   help="run files to merge into --table instead of tuning")
    p.add_argument("--table", default=None, help="table file to write (merge mode)")
    p.add_argument("--timer", choices=("device", "sustained"), default="device",
                   help="device: single calls in rotation on the device's clock; sustained: "
                        "each candidate back to back for --window-s, at the power cap")
    p.add_argument("--window-s", type=float, default=2.0,
                   help="seconds of back-to-back calls per candidate and round (sustained)")
    p.add_argument("--general", action="store_true",
                   help="time the table's general causal tiles against the defaults instead")
    args = p.parse_args()
    if args.merge:
        if not args.table:
            p.error("--merge needs --table")
        try:  # runs update the table's entries; the others stay
            with open(args.table) as f:
                entries = json.load(f)["entries"]
        except FileNotFoundError:
            entries = {}
        for path in args.merge:
            entries.update(entries_from(json.load(open(path)), entries))
        mt.parse_table({"entries": entries})  # refuse a table the kernel would refuse
        table = {"about": "pallas_mgpu tiles by measurement: benchmarks/mgpu_tune.py; "
                          "kernels/mgpu_tuning.py reads the fwd/bwd fields",
                 "entries": dict(sorted(entries.items()))}
        with open(args.table, "w") as f:
            json.dump(table, f, indent=1)
            f.write("\n")
        print(f"wrote {len(entries)} entries to {args.table}")
        return 0
    if not args.window_s > 0:
        p.error(f"--window-s: expected > 0, got {args.window_s}")
    if jax.default_backend() != "gpu":
        p.error("tuning needs a Hopper GPU")

    def log(msg):
        print(msg, flush=True)
    if args.general:
        rows = general_tiles([int(x) for x in args.dims.split(",")], args.seq, args.heads,
                             args.rounds, log)
        save_json(dict(env=env_info(), seq=args.seq, heads=args.heads, general=rows),
                  args.out)
        return 0
    run = dict(env=env_info(), seq=args.seq, heads=args.heads, rounds=args.rounds,
               timer=args.timer, window_s=args.window_s if args.timer == "sustained" else None,
               classes=[])
    for D in (int(x) for x in args.dims.split(",")):
        for m in args.masks.split(","):
            if m not in ("none", "causal", "segments"):
                p.error(f"--masks: {m!r} is not none, causal or segments")
            S = args.seq_segments if m == "segments" else args.seq
            # about 20 ms of kernels per measurement (wall-clock fallback only)
            flops = 4 * args.heads * S ** 2 * D / (1 if m == "none" else 2)
            if m == "segments":
                flops *= 4096 / S
            fwd_ms = flops / 500e12 * 1e3
            reps = {"fwd": max(1, round(20 / fwd_ms)), "bwd": max(1, round(20 / (2.5 * fwd_ms)))}
            res = tune_class(D, m, S, args.heads, args.rounds, reps, log,
                             phases=args.phases.split(","),
                             window_s=args.window_s if args.timer == "sustained" else None)
            run["classes"].append(dict(D=D, mask=m, seq=S, reps=reps, **res))
            save_json(run, args.out)
    print(json.dumps(entries_from(run, {}), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
