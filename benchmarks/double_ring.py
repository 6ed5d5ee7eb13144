"""The double ring against the 1-D ring on the same devices: checks and step times.

``strategy="double_ring"`` (BurstEngine §3.1: an inter-node ring over ``node`` whose
transfer for the next round is issued before the round's intra-node tiles) sends the
1-D ring's bytes, of which only ``No - 1`` hops cross nodes.  On one machine every hop
takes the same links, so what a user gives up by choosing it there, or gains on several
nodes, starts from its cost against the 1-D ring on the same devices.  For each case
(``layout:mask``; forward + backward of ``jax_seqpar.attention``, loss ``sum(o**2)``,
the backward ``cfg["backward"]``) this script reports

* a check of both strategies, for each of ``kernels``, at ``check_seq`` tokens: outputs
  and gradients (a random cotangent) against the dense float32 ``reference_attention``,
  as relative errors, with the library's budgets (float32 1e-5, bfloat16 2e-2);
* the first call of each (trace, compile and one step) and the step times of both in
  alternating rounds, a fresh order each round (wall clock, and on a GPU also the
  device clock of ``_profile.device_rounds``), with the largest difference between the
  two strategies' outputs and gradients.

The exit code is 1 when a check is over its budget.

    python benchmarks/double_ring.py                     # 8 CPU devices as 2 x 4
    python benchmarks/double_ring.py --preset gpu        # all GPUs as 2 x (G / 2), 128k tokens
    python benchmarks/double_ring.py --mesh 1x4          # one "node": intra-node rings only

The JSON goes to ``$OUT`` (else ``benchmarks/out/``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import _setup  # noqa: F401  (device count and sys.path)

PRESETS = {
    "cpu": dict(batch=1, seq=2048, heads=4, head_dim=32, dtype="float32", rounds=5,
                cases=["zigzag:causal", "contiguous:dense"], backward="auto", check_seq=512,
                check_heads=2, kernels=["auto"], nodes=2),
    "gpu": dict(batch=1, seq=131072, heads=16, head_dim=128, dtype="bfloat16", rounds=7,
                cases=["zigzag:causal", "contiguous:dense"], backward="auto",
                check_seq=16384, check_heads=4, kernels=["auto", "pallas_mgpu"], nodes=2),
}

BUDGET = {"float32": 1e-5, "bfloat16": 2e-2}  # docs/ARCHITECTURE.md, "Numerics"
STRATEGIES = ("double_ring", "ring")


def _meshes(nodes: int, local: int):
    """``{strategy: (mesh, axis_name)}`` over the same ``nodes * local`` devices."""
    import jax
    devices = jax.devices()[:nodes * local]
    return {"double_ring": (jax.make_mesh((nodes, local), ("node", "local"), devices=devices),
                            ("node", "local")),
            "ring": (jax.make_mesh((nodes * local,), ("sp",), devices=devices), "sp")}


def _attention(cfg, strategy, case, meshes, kernel="auto"):
    import jax_seqpar as js

    layout, mask = case.split(":")
    mesh, axis = meshes[strategy]

    def attn(q, k, v):
        return js.attention(q, k, v, mesh=mesh, axis_name=axis, strategy=strategy,
                            causal=mask == "causal", layout=layout,
                            backward=cfg["backward"], kernel=kernel)
    return attn


def _inputs(cfg, seq, heads, n):
    import jax
    import jax.numpy as jnp

    shape = (cfg["batch"], seq, heads, cfg["head_dim"])
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    return [jax.random.normal(k, shape, jnp.float32).astype(cfg["dtype"]) for k in keys]


def check(cfg, case: str, meshes) -> dict:
    """Each strategy and kernel: the largest relative error of the output and the three
    gradients against the float32 reference."""
    import jax
    import jax.numpy as jnp

    import jax_seqpar as js
    from _util import rel

    q, k, v, do = _inputs(cfg, cfg["check_seq"], cfg["check_heads"], 4)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    causal = case.endswith(":causal")
    ro, rvjp = jax.vjp(lambda q, k, v: js.reference_attention(q, k, v, causal=causal)[0],
                       *f32[:3])
    want = (ro, *rvjp(f32[3]))
    errs = {}
    for kernel in cfg["kernels"]:
        for strategy in STRATEGIES:
            o, vjp = jax.vjp(_attention(cfg, strategy, case, meshes, kernel), q, k, v)
            errs[f"{kernel}/{strategy}"] = max(rel(a, b) for a, b in zip((o, *vjp(do)), want))
    return errs


def steps(cfg, case: str, meshes) -> dict:
    """Both strategies in this process: first call, largest difference, step times."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from _profile import device_rounds
    from _util import timed_rounds

    args = _inputs(cfg, cfg["seq"], cfg["heads"], 3)
    fns, outs, first = {}, {}, {}
    for strategy in STRATEGIES:
        attn = _attention(cfg, strategy, case, meshes)
        fns[strategy] = jax.jit(jax.value_and_grad(
            lambda q, k, v, attn=attn: (attn(q, k, v).astype(jnp.float32) ** 2).sum(),
            argnums=(0, 1, 2)))
        t0 = time.perf_counter()
        outs[strategy] = jax.block_until_ready(fns[strategy](*args))
        first[strategy] = time.perf_counter() - t0
    # on the host: the two strategies' arrays live on different meshes
    leaves = [[np.asarray(x, np.float32) for x in jax.tree.leaves(outs[s])] for s in STRATEGIES]
    # the loss is a sum over every output: compare it relatively, the gradients absolutely
    loss_rel = float(abs(leaves[0][0] - leaves[1][0]) / abs(leaves[1][0]))
    grad_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(leaves[0][1:], leaves[1][1:]))
    calls = {s: (f, args) for s, f in fns.items()}
    wall = timed_rounds(calls, cfg["rounds"])
    dev = device_rounds(calls, cfg["rounds"]) if jax.default_backend() == "gpu" else {}
    return dict(case=case, first_call_s=first, loss_rel_diff=loss_rel,
                grad_max_abs_diff=grad_diff, wall_ms={s: r["ms"] for s, r in wall.items()},
                device_ms=dev)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--mesh", default=None,
                   help="NOxNI: NO nodes of NI devices (default: the preset's nodes x the rest)")
    p.add_argument("--cases", default=None, help="layout:mask entries, comma-separated")
    p.add_argument("--backward", default=None, choices=("kv", "q", "auto"))
    p.add_argument("--phases", default="check,steps",
                   help="which of check, steps to run (comma-separated)")
    p.add_argument("--config", default=None, help="a JSON preset (tests)")
    args = p.parse_args(argv)

    import jax

    from _util import (env_info, finish, out_dir, parse_mesh, preset_config, record,
                       save_json)

    preset, cfg = preset_config(PRESETS, args)
    G = jax.device_count()
    if args.mesh:
        mesh = parse_mesh(args.mesh)
        if mesh is None:
            p.error(f"--mesh: expected NOxNI such as 2x4, got {args.mesh!r}")
    else:
        if G % cfg["nodes"]:
            p.error(f"the preset's {cfg['nodes']} nodes do not divide the {G} devices: "
                    f"name --mesh")
        mesh = (cfg["nodes"], G // cfg["nodes"])
    if mesh[0] * mesh[1] > G:
        p.error(f"--mesh {args.mesh} needs {mesh[0] * mesh[1]} devices; there are {G}")
    phases = set(args.phases.split(","))
    if phases - {"check", "steps"}:
        p.error(f"--phases: unknown {sorted(phases - {'check', 'steps'})}")
    cfg["mesh"] = list(mesh)
    info = env_info()
    print(f"# {info}\n# preset {preset}: {cfg}", flush=True)
    meshes = _meshes(*mesh)
    result = {"env": info, "preset": preset, "config": cfg, "check": {}, "steps": []}
    path = os.path.join(out_dir(), "double_ring_{}_{}x{}_{}.json".format(
        preset, *mesh, cfg["backward"]))
    budget, ok = BUDGET[cfg["dtype"]], True
    for case in cfg["cases"] if "check" in phases else ():
        errs = check(cfg, case, meshes)
        result["check"][case] = errs
        passed = all(e <= budget for e in errs.values())
        ok = ok and passed
        print(f"{case:20s} check at {cfg['check_seq']} tokens, relative error "
              + ", ".join(f"{n} {e:.1e}" for n, e in errs.items())
              + (" PASS" if passed else " FAIL"), flush=True)
        save_json(result, path)
    for case in cfg["cases"] if "steps" in phases else ():
        row = steps(cfg, case, meshes)
        record(result, "steps", row,
               f"{case:20s} first call s {row['first_call_s']}; |loss| rel diff "
               f"{row['loss_rel_diff']:.1e}, max |grad diff| {row['grad_max_abs_diff']:.1e}; "
               f"wall ms {row['wall_ms']}; device ms {row['device_ms']}", path)
    return finish(path, ok)


if __name__ == "__main__":
    sys.exit(main())
