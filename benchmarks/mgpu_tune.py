"""Tune the Hopper kernel's tiles per shape class; write the committed table (issue 41).

For each head dim and mask (no mask on a dense tile, causal on an aligned one), at
``--seq`` tokens, B 1, ``--heads`` heads, bf16:

* every forward candidate of ``mgpu_tuning.forward_candidates`` is compiled, its output
  and lse checked against the per-head-dim default config's (the bf16 budget of
  docs/ARCHITECTURE.md, "Numerics and how the tests hold them"), and timed; the same
  for the backward candidates (gradients from the same ``o``, lse);
* timing is on the device's clock (``_profile.device_rounds``: all candidates of a phase
  in a fresh order each round, one synchronised call each, first kernel start to last
  kernel end), falling back to the wall clock when the trace cannot be read;
* the fastest forward and backward halves form the table entry, with both times and
  the default's beside them.

    python benchmarks/mgpu_tune.py --dims 128 --out $OUT/tune_d128.json
    python benchmarks/mgpu_tune.py --merge a.json b.json --table jax_seqpar/kernels/mgpu_tuned.json

The table is read by ``PallasMgpuKernel`` (``kernels/mgpu_tuning.py``); RESULTS.md
("Hopper tiles by measurement") has the runs behind the committed one.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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


def tune_class(D, masked, S, H, rounds, reps, log):
    """Forward and backward rankings of one (head dim, mask) class."""
    ks = jax.random.split(jax.random.PRNGKey(D + masked), 4)
    q, k, v, do = (jax.random.normal(x, (1, S, H, D), jnp.bfloat16) for x in ks)
    pos = jnp.arange(S, dtype=jnp.int32)
    mask = MaskSpec(causal=masked)
    scale = D ** -0.5
    default = DEFAULT_MGPU_CONFIGS[D]

    def fwd_fn(cfg):
        return jax.jit(lambda q, k, v: mgpu_fwd(q, k, v, pos, pos, mask, scale, config=cfg))

    def bwd_fn(cfg):
        return jax.jit(lambda q, k, v, o, lse, do: mgpu_bwd(
            q, k, v, o, lse, do, pos, pos, mask, scale, config=cfg))

    ref_o, ref_lse = jax.block_until_ready(fwd_fn(default)(q, k, v))
    ref_g = jax.block_until_ready(bwd_fn(default)(q, k, v, ref_o, ref_lse, do))

    def errors(cfg, e):
        log(f"  D={D} masked={masked} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")

    def build_fwd(cfg):
        t0 = time.perf_counter()
        f = fwd_fn(cfg)
        o, lse = jax.block_until_ready(f(q, k, v))
        err = max(_rel(o, ref_o), _rel(lse, ref_lse))
        if not err <= BUDGET:
            raise AssertionError(f"forward differs from the default config's by {err:.2e}")
        log(f"  fwd D={D} masked={masked} {mt.fields_of(cfg, mt.FWD_FIELDS)}: compiled and "
            f"checked ({err:.1e}) in {time.perf_counter() - t0:.1f} s")
        return lambda: f(q, k, v)

    def build_bwd(cfg):
        t0 = time.perf_counter()
        f = bwd_fn(cfg)
        g = jax.block_until_ready(f(q, k, v, ref_o, ref_lse, do))
        err = max(_rel(a, b) for a, b in zip(g, ref_g))
        if not err <= BUDGET:
            raise AssertionError(f"gradients differ from the default config's by {err:.2e}")
        log(f"  bwd D={D} masked={masked} {mt.fields_of(cfg, mt.BWD_FIELDS)}: compiled and "
            f"checked ({err:.1e}) in {time.perf_counter() - t0:.1f} s")
        return lambda: f(q, k, v, ref_o, ref_lse, do)

    out = {}
    for phase, cands, build, fields in (
            ("fwd", mt.forward_candidates(D), build_fwd, mt.FWD_FIELDS),
            ("bwd", mt.backward_candidates(D), build_bwd, mt.BWD_FIELDS)):
        key_default = mt.fields_of(default, fields)
        if all(mt.fields_of(c, fields) != key_default for c in cands):
            cands = [default] + list(cands)
        ranked = mt.autotune(cands, build, rounds=rounds, timer=_timer(reps[phase]),
                             on_error=errors)
        rows = [dict(fields=mt.fields_of(c, fields), ms=ms) for c, ms in ranked]
        dflt = [r["ms"] for r in rows if r["fields"] == key_default]
        out[phase] = dict(ranked=rows, best=rows[0]["fields"], best_ms=rows[0]["ms"],
                          default_ms=dflt[0] if dflt else None)
        log(f"{phase} D={D} masked={masked}: best {rows[0]['fields']} {rows[0]['ms']:.3f} ms"
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


def entries_from(run: dict) -> dict:
    """Table entries (``mgpu_tuning`` format) from one run's classes."""
    gpu = mt.gpu_key(run["env"]["device_kind"])
    out = {}
    for c in run["classes"]:
        tile, mask = ("aligned", "causal") if c["masked"] else ("dense", "none")
        key = mt.table_key(gpu, "bfloat16", c["D"], tile, mask)
        out[key] = dict(fwd=c["fwd"]["best"], bwd=c["bwd"]["best"],
                        fwd_ms=round(c["fwd"]["best_ms"], 4),
                        fwd_default_ms=c["fwd"]["default_ms"] and round(c["fwd"]["default_ms"], 4),
                        bwd_ms=round(c["bwd"]["best_ms"], 4),
                        bwd_default_ms=c["bwd"]["default_ms"] and round(c["bwd"]["default_ms"], 4),
                        seq=run["seq"], heads=run["heads"], date=run["env"]["date"],
                        jax=run["env"]["jax"])
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", default="64,128")
    p.add_argument("--masks", default="none,causal")
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default="benchmarks/out/mgpu_tune.json")
    p.add_argument("--merge", nargs="+", default=None,
                   help="run files to merge into --table instead of tuning")
    p.add_argument("--table", default=None, help="table file to write (merge mode)")
    p.add_argument("--general", action="store_true",
                   help="time the table's general causal tiles against the defaults instead")
    args = p.parse_args()
    if args.merge:
        if not args.table:
            p.error("--merge needs --table")
        entries = {}
        for path in args.merge:
            entries.update(entries_from(json.load(open(path))))
        mt.parse_table({"entries": entries})  # refuse a table the kernel would refuse
        table = {"about": "pallas_mgpu tiles by measurement: benchmarks/mgpu_tune.py; "
                          "kernels/mgpu_tuning.py reads the fwd/bwd fields",
                 "entries": dict(sorted(entries.items()))}
        with open(args.table, "w") as f:
            json.dump(table, f, indent=1)
            f.write("\n")
        print(f"wrote {len(entries)} entries to {args.table}")
        return 0
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
               classes=[])
    for D in (int(x) for x in args.dims.split(",")):
        for m in args.masks.split(","):
            masked = {"none": False, "causal": True}[m]
            # about 20 ms of kernels per measurement
            flops = 4 * args.heads * args.seq ** 2 * D / (2 if masked else 1)
            fwd_ms = flops / 500e12 * 1e3
            reps = {"fwd": max(1, round(20 / fwd_ms)), "bwd": max(1, round(20 / (2.5 * fwd_ms)))}
            res = tune_class(D, masked, args.seq, args.heads, args.rounds, reps, log)
            run["classes"].append(dict(D=D, masked=masked, reps=reps, **res))
            save_json(run, args.out)
    print(json.dumps(entries_from(run), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
