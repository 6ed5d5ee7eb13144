"""Rolled against unrolled ring hops: compile time, program size and step time.

``parallel.ring.ROLL_HOPS`` runs a ring's middle hops as one ``fori_loop``
(``ring_common.chain``'s ``rolled``); ``False`` unrolls every hop (the form before
2026-11-27).  For each case (``layout:mask``, forward + backward of ``jax_seqpar.attention``
on all devices) this script reports

* per form, from a fresh process each (``--child``; no trace or compilation reused):
  ``trace_s``, ``lower_s``, ``compile_s`` of the jitted gradient on abstract inputs, the
  optimised program's HLO lines and its ``while`` loops;
* both forms compiled in this process: the largest difference between their outputs and
  gradients, and their step times in alternating rounds (fresh order each round; wall
  clock, and on a GPU also the device clock of ``_profile.device_rounds``).

    python benchmarks/ring_roll.py                      # 8 CPU devices, small shapes
    python benchmarks/ring_roll.py --preset gpu         # all GPUs, 128k tokens

The JSON goes to ``$OUT`` (else ``benchmarks/out/``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import _setup  # noqa: F401  (device count and sys.path)

PRESETS = {
    "cpu": dict(batch=1, seq=2048, heads=4, head_dim=32, dtype="float32", rounds=5,
                cases=["contiguous:causal", "zigzag:causal", "contiguous:dense"],
                backward="kv"),
    "gpu": dict(batch=1, seq=131072, heads=16, head_dim=128, dtype="bfloat16", rounds=7,
                cases=["zigzag:causal", "contiguous:dense"], backward="auto"),
}


def _grad_fn(cfg, layout, mask, mesh):
    """The jitted forward + backward of one case (a new function object each call)."""
    import jax

    import jax_seqpar as js

    def loss(q, k, v):
        o = js.attention(q, k, v, mesh=mesh, axis_name="sp", causal=mask == "causal",
                         layout=layout, backward=cfg["backward"])
        return (o.astype("float32") ** 2).sum()

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _inputs(cfg, abstract: bool):
    import jax
    import jax.numpy as jnp

    shape = (cfg["batch"], cfg["seq"], cfg["heads"], cfg["head_dim"])
    dt = jnp.dtype(cfg["dtype"])
    if abstract:
        return [jax.ShapeDtypeStruct(shape, dt)] * 3
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    return [jax.random.normal(k, shape, jnp.float32).astype(dt) for k in keys]


def _mesh():
    import jax
    return jax.make_mesh((jax.device_count(),), ("sp",))


def child(cfg, case: str, rolled: bool) -> dict:
    """Trace, lower and compile one case in this (fresh) process."""
    import jax

    from jax_seqpar.parallel import ring
    ring.ROLL_HOPS = rolled
    layout, mask = case.split(":")
    fn = _grad_fn(cfg, layout, mask, _mesh())
    args = _inputs(cfg, abstract=True)
    jax.jit(lambda x: x + 1)(jax.numpy.zeros(4)).block_until_ready()  # backend start-up
    t0 = time.perf_counter()
    traced = fn.trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    text = compiled.as_text()
    return dict(case=case, rolled=rolled, trace_s=t1 - t0, lower_s=t2 - t1,
                compile_s=t3 - t2, total_s=t3 - t0, hlo_lines=text.count("\n"),
                while_loops=text.count(" while("))


def run_child(preset: str, cfg_json: str, case: str, rolled: bool) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--preset", preset, "--config", cfg_json,
           "--child", case, "--rolled", str(int(rolled))]
    # this process holds most of a GPU's memory already; the child only compiles
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    for line in out.stdout.splitlines():
        if line.startswith("CHILD "):
            return json.loads(line[len("CHILD "):])
    raise RuntimeError(f"child {case} rolled={rolled} failed:\n{out.stderr[-3000:]}")


def steps(cfg, case: str) -> dict:
    """Both forms in this process: their largest difference, and their step times."""
    import jax
    import jax.numpy as jnp

    from _profile import device_rounds
    from _util import timed_rounds
    from jax_seqpar.parallel import ring

    layout, mask = case.split(":")
    mesh = _mesh()
    args = _inputs(cfg, abstract=False)
    fns, outs = {}, {}
    for name, rolled in (("rolled", True), ("unrolled", False)):
        ring.ROLL_HOPS = rolled
        fns[name] = _grad_fn(cfg, layout, mask, mesh)
        outs[name] = jax.block_until_ready(fns[name](*args))  # traced with this form
    ring.ROLL_HOPS = True
    diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
               for a, b in zip(jax.tree.leaves(outs["rolled"]), jax.tree.leaves(outs["unrolled"])))
    calls = {n: (f, args) for n, f in fns.items()}
    wall = timed_rounds(calls, cfg["rounds"])
    dev = device_rounds(calls, cfg["rounds"]) if jax.default_backend() == "gpu" else {}
    return dict(case=case, max_abs_diff=diff,
                wall_ms={n: r["ms"] for n, r in wall.items()}, device_ms=dev)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--cases", default=None, help="layout:mask entries, comma-separated")
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rolled", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import jax

    from _util import choose_preset, env_info, out_dir, save_json

    preset, cfg = choose_preset(PRESETS, args.preset)
    cfg = json.loads(args.config) if args.config else dict(cfg)
    if args.cases:
        cfg["cases"] = args.cases.split(",")
    if args.child:
        print("CHILD " + json.dumps(child(cfg, args.child, bool(args.rolled))), flush=True)
        return 0
    info = env_info()
    print(f"# {info}\n# preset {preset}: {cfg}", flush=True)
    result = {"env": info, "preset": preset, "config": cfg, "compile": [], "steps": []}
    path = os.path.join(out_dir(), f"ring_roll_{preset}.json")
    for case in cfg["cases"]:
        for rolled in (False, True):
            row = run_child(preset, json.dumps(cfg), case, rolled)
            result["compile"].append(row)
            print(f"{case:20s} {'rolled' if rolled else 'unrolled':8s} trace {row['trace_s']:.2f} "
                  f"lower {row['lower_s']:.2f} compile {row['compile_s']:.2f} total "
                  f"{row['total_s']:.2f} s, {row['hlo_lines']} HLO lines, "
                  f"{row['while_loops']} while", flush=True)
            save_json(result, path)
    for case in cfg["cases"]:
        row = steps(cfg, case)
        result["steps"].append(row)
        print(f"{case:20s} max |rolled - unrolled| {row['max_abs_diff']:.1e}; wall ms "
              f"{row['wall_ms']}; device ms {row['device_ms']}", flush=True)
        save_json(result, path)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
