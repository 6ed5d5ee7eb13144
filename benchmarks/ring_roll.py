"""Two forms of the ring's hops against each other: compile time, program size, step time.

``--switch roll`` (the default): ``parallel.ring_common.ROLL_HOPS`` runs a ring's middle
hops as one ``fori_loop`` (``ring_common.chain``'s ``rolled``); ``False`` unrolls every
hop (the form before 2026-11-27).  ``--switch pack``: ``ring_common.PACK_HOPS`` sends
whatever a hop carries as one buffer (``ring_common.Parcel``: one collective per hop);
``False`` sends each array apart.  For each case (``layout:mask``, or ``layout:mask:docs``
with packed documents; forward + backward of ``jax_seqpar.attention`` on all devices: the
1-D ring, or with ``--mesh NOxNI`` the double ring over ``NO`` nodes of ``NI`` devices,
whose intra-node chains roll) this script reports

* per form (``rolled`` / ``unrolled``, or ``packed`` / ``apart``), from a fresh process
  each (``--child``; no trace or compilation reused):
  ``trace_s``, ``lower_s``, ``compile_s`` of the jitted gradient on abstract inputs, the
  optimised program's HLO lines, its ``while`` loops and its temporaries per device
  (``memory_analysis``, MiB);
* a check of both forms, for each of ``kernels``, at ``check_seq`` tokens: outputs and
  gradients (a random cotangent) against the dense float32 ``reference_attention``, as
  relative errors, with the library's budgets (float32 1e-5, bfloat16 2e-2);
* both forms compiled in this process: the largest difference between their outputs and
  gradients, and their step times in alternating rounds (fresh order each round; wall
  clock, and on a GPU also the device clock of ``_profile.device_rounds``).

The exit code is 1 when a check is over its budget.

    python benchmarks/ring_roll.py                      # 8 CPU devices, small shapes
    python benchmarks/ring_roll.py --preset gpu         # all GPUs, 128k tokens
    python benchmarks/ring_roll.py --phases check       # only the check
    python benchmarks/ring_roll.py --preset gpu --switch pack --backward q
    python benchmarks/ring_roll.py --switch pack --backward q --phases compile \
      --cases zigzag:causal:docs --seq 8192 --dtype bfloat16 --head-dim 64  # CPU, memory
    XLA_FLAGS=--xla_force_host_platform_device_count=32 \
      python benchmarks/ring_roll.py --mesh 4x8         # the double ring, 32 CPU devices

The JSON goes to ``$OUT`` (else ``benchmarks/out/``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

import _setup  # noqa: F401  (device count and sys.path)

PRESETS = {
    "cpu": dict(batch=1, seq=2048, heads=4, head_dim=32, dtype="float32", rounds=5,
                cases=["contiguous:causal", "zigzag:causal", "contiguous:dense"],
                backward="kv", check_seq=512, check_heads=2, kernels=["auto"]),
    "gpu": dict(batch=1, seq=131072, heads=16, head_dim=128, dtype="bfloat16", rounds=7,
                cases=["zigzag:causal", "contiguous:dense"], backward="auto",
                check_seq=16384, check_heads=4, kernels=["auto", "pallas_mgpu"]),
}


BUDGET = {"float32": 1e-5, "bfloat16": 2e-2}  # docs/ARCHITECTURE.md, "Numerics"


def _case(case: str):
    """``"layout:mask[:docs]"`` -> ``(layout, mask, docs)``; ``docs``: packed documents
    (``_segments``)."""
    parts = case.split(":")
    if len(parts) not in (2, 3) or parts[2:] not in ([], ["docs"]):
        raise SystemExit(f"case {case!r}: expected layout:mask or layout:mask:docs")
    return parts[0], parts[1], len(parts) == 3


def _segments(cfg, seq):
    """Segment ids ``[batch, seq]`` of documents of ``3 * seq / 16`` tokens (the last one
    shorter), so that documents cross device boundaries."""
    import jax.numpy as jnp
    ids = jnp.arange(seq, dtype=jnp.int32) // max(1, 3 * seq // 16)
    return jnp.broadcast_to(ids, (cfg["batch"], seq))


def _attention(cfg, layout, mask, mesh, kernel="auto"):
    import jax_seqpar as js

    double = len(mesh.axis_names) == 2
    axis = tuple(mesh.axis_names) if double else "sp"

    def attn(q, k, v, seg=None):
        return js.attention(q, k, v, mesh=mesh, axis_name=axis, causal=mask == "causal",
                            layout=layout, backward=cfg["backward"], kernel=kernel,
                            strategy="double_ring" if double else "ring", segment_ids=seg)
    return attn


def _grad_fn(cfg, layout, mask, mesh):
    """The jitted forward + backward of one case (a new function object each call)."""
    import jax

    attn = _attention(cfg, layout, mask, mesh)

    def loss(q, k, v, seg=None):
        return (attn(q, k, v, seg).astype("float32") ** 2).sum()

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _inputs(cfg, abstract: bool, seq=None, heads=None, n: int = 3):
    import jax
    import jax.numpy as jnp

    shape = (cfg["batch"], seq or cfg["seq"], heads or cfg["heads"], cfg["head_dim"])
    dt = jnp.dtype(cfg["dtype"])
    if abstract:
        return [jax.ShapeDtypeStruct(shape, dt)] * n
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    return [jax.random.normal(k, shape, jnp.float32).astype(dt) for k in keys]


#: ``--switch``: the ``parallel.ring_common`` flag, and the names of its two forms (on, off)
SWITCHES = {"roll": ("ROLL_HOPS", ("rolled", "unrolled")),
            "pack": ("PACK_HOPS", ("packed", "apart"))}


def _forms(cfg):
    """``[(name, on), ...]`` of ``cfg["switch"]``: the default form first."""
    on, off = SWITCHES[cfg.get("switch", "roll")][1]
    return [(on, True), (off, False)]


@contextlib.contextmanager
def _form(cfg, on: bool):
    """The ``ring_common`` flag of ``cfg["switch"]`` set to ``on`` while a program is
    traced, then put back (a test runs this script inside a pytest worker)."""
    from jax_seqpar.parallel import ring_common
    flag = SWITCHES[cfg.get("switch", "roll")][0]
    saved = getattr(ring_common, flag)
    setattr(ring_common, flag, on)
    try:
        yield
    finally:
        setattr(ring_common, flag, saved)


def _mesh(cfg):
    """All devices as one ring axis, or ``cfg["mesh"] = [nodes, local]`` for the double
    ring (its first ``nodes * local`` devices)."""
    import jax
    if not cfg.get("mesh"):
        return jax.make_mesh((jax.device_count(),), ("sp",))
    nodes, local = cfg["mesh"]
    if nodes * local > jax.device_count():
        raise SystemExit(f"--mesh {nodes}x{local} needs {nodes * local} devices; this "
                         f"process has {jax.device_count()} (on CPU set XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={nodes * local})")
    return jax.make_mesh((nodes, local), ("node", "local"),
                         devices=jax.devices()[:nodes * local])


def child(cfg, case: str, on: bool) -> dict:
    """Trace, lower and compile one case in this (fresh) process."""
    import jax

    from jax_seqpar.parallel import ring_common
    setattr(ring_common, SWITCHES[cfg.get("switch", "roll")][0], on)
    layout, mask, docs = _case(case)
    fn = _grad_fn(cfg, layout, mask, _mesh(cfg))
    args = _inputs(cfg, abstract=True)
    if docs:
        args.append(jax.ShapeDtypeStruct((cfg["batch"], cfg["seq"]), jax.numpy.int32))
    jax.jit(lambda x: x + 1)(jax.numpy.zeros(4)).block_until_ready()  # backend start-up
    t0 = time.perf_counter()
    traced = fn.trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    text = compiled.as_text()
    mem = compiled.memory_analysis()
    return dict(case=case, form={v: k for k, v in _forms(cfg)}[on], trace_s=t1 - t0,
                lower_s=t2 - t1, compile_s=t3 - t2, total_s=t3 - t0, hlo_lines=text.count("\n"),
                while_loops=text.count(" while("),
                temp_mib=None if mem is None else mem.temp_size_in_bytes / 2**20)


def run_child(preset: str, cfg_json: str, case: str, on: bool) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--preset", preset, "--config", cfg_json,
           "--child", case, "--on", str(int(on))]
    # this process holds most of a GPU's memory already; the child only compiles
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    for line in out.stdout.splitlines():
        if line.startswith("CHILD "):
            return json.loads(line[len("CHILD "):])
    raise RuntimeError(f"child {case} on={on} failed:\n{out.stderr[-3000:]}")


def check(cfg, case: str) -> dict:
    """Both forms, each kernel of ``cfg["kernels"]``: the largest relative error of the
    output and the three gradients against the float32 reference."""
    import jax
    import jax.numpy as jnp

    import jax_seqpar as js
    from _util import rel

    layout, mask, docs = _case(case)
    mesh = _mesh(cfg)
    q, k, v, do = _inputs(cfg, abstract=False, seq=cfg["check_seq"],
                          heads=cfg["check_heads"], n=4)
    seg = _segments(cfg, cfg["check_seq"]) if docs else None
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    ref = lambda q, k, v: js.reference_attention(q, k, v, causal=mask == "causal",  # noqa
                                                 segment_ids=seg)[0]
    ro, rvjp = jax.vjp(ref, *f32[:3])
    want = (ro, *rvjp(f32[3]))
    errs = {}
    for kernel in cfg["kernels"]:
        for name, on in _forms(cfg):
            with _form(cfg, on):
                attn = _attention(cfg, layout, mask, mesh, kernel)
                o, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, seg), q, k, v)  # noqa: B023
                got = (o, *vjp(do))
            errs[f"{kernel}/{name}"] = max(rel(a, b) for a, b in zip(got, want))
    return errs


def steps(cfg, case: str) -> dict:
    """Both forms in this process: their largest difference, and their step times."""
    import jax
    import jax.numpy as jnp

    from _profile import device_rounds
    from _util import timed_rounds

    layout, mask, docs = _case(case)
    mesh = _mesh(cfg)
    args = _inputs(cfg, abstract=False)
    if docs:
        args.append(_segments(cfg, cfg["seq"]))
    fns, outs = {}, {}
    for name, on in _forms(cfg):
        with _form(cfg, on):
            fns[name] = _grad_fn(cfg, layout, mask, mesh)
            outs[name] = jax.block_until_ready(fns[name](*args))  # traced with this form
    first, second = (jax.tree.leaves(o) for o in outs.values())
    diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
               for a, b in zip(first, second))
    calls = {n: (f, args) for n, f in fns.items()}
    wall = timed_rounds(calls, cfg["rounds"])
    dev = device_rounds(calls, cfg["rounds"]) if jax.default_backend() == "gpu" else {}
    return dict(case=case, max_abs_diff=diff,
                wall_ms={n: r["ms"] for n, r in wall.items()}, device_ms=dev)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--cases", default=None,
                   help="layout:mask[:docs] entries, comma-separated (docs: packed documents)")
    p.add_argument("--backward", default=None, choices=("kv", "q", "auto"),
                   help="the ring's backward (default: the preset's)")
    p.add_argument("--mesh", default=None,
                   help="NOxNI: the double ring over NO nodes of NI devices (default: the "
                        "1-D ring over all devices)")
    p.add_argument("--switch", default=None, choices=sorted(SWITCHES),
                   help="roll (default): rolled against unrolled hops; pack: each hop's "
                        "arrays as one buffer against apart")
    p.add_argument("--phases", default="check,compile,steps",
                   help="which of check, compile, steps to run (comma-separated)")
    p.add_argument("--seq", type=int, default=None, help="tokens (default: the preset's)")
    p.add_argument("--heads", type=int, default=None, help="heads (default: the preset's)")
    p.add_argument("--head-dim", type=int, default=None,
                   help="head dim (default: the preset's)")
    p.add_argument("--dtype", default=None, choices=sorted(BUDGET),
                   help="dtype (default: the preset's)")
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--on", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import jax

    from _util import (env_info, finish, out_dir, parse_mesh, preset_config, record,
                       save_json)

    preset, cfg = preset_config(PRESETS, args)
    for key in ("seq", "heads", "head_dim"):
        val = getattr(args, key)
        if val is not None and val < 1:
            p.error(f"--{key.replace('_', '-')}: expected a positive int, got {val}")
        if val is not None:
            cfg[key] = val
    if args.dtype:
        cfg["dtype"] = args.dtype
    if args.mesh:
        mesh = parse_mesh(args.mesh)
        if mesh is None:
            p.error(f"--mesh: expected NOxNI such as 2x4, got {args.mesh!r}")
        cfg["mesh"] = list(mesh)
    if args.switch:
        cfg["switch"] = args.switch
    if args.child:
        print("CHILD " + json.dumps(child(cfg, args.child, bool(args.on))), flush=True)
        return 0
    info = env_info()
    print(f"# {info}\n# preset {preset}: {cfg}", flush=True)
    result = {"env": info, "preset": preset, "config": cfg, "check": {}, "compile": [],
              "steps": []}
    mesh = "_{}x{}".format(*cfg["mesh"]) if cfg.get("mesh") else ""
    switch = "" if cfg.get("switch", "roll") == "roll" else f"_{cfg['switch']}"
    path = os.path.join(out_dir(), f"ring_roll_{preset}_{cfg['backward']}{mesh}{switch}.json")
    phases = set(args.phases.split(","))
    if phases - {"check", "compile", "steps"}:
        p.error(f"--phases: unknown {sorted(phases - {'check', 'compile', 'steps'})}")
    budget, ok = BUDGET[cfg["dtype"]], True
    for case in cfg["cases"] if "check" in phases else ():
        errs = check(cfg, case)
        result["check"][case] = errs
        ok = ok and all(e <= budget for e in errs.values())
        print(f"{case:20s} check at {cfg['check_seq']} tokens, relative error "
              + ", ".join(f"{n} {e:.1e}" for n, e in errs.items())
              + (" PASS" if all(e <= budget for e in errs.values()) else " FAIL"), flush=True)
        save_json(result, path)
    for case in cfg["cases"] if "compile" in phases else ():
        for name, on in _forms(cfg)[::-1]:
            row = run_child(preset, json.dumps(cfg), case, on)
            record(result, "compile", row,
                   f"{case:20s} {name:8s} trace {row['trace_s']:.2f} "
                   f"lower {row['lower_s']:.2f} compile {row['compile_s']:.2f} total "
                   f"{row['total_s']:.2f} s, {row['hlo_lines']} HLO lines, "
                   f"{row['while_loops']} while, temporaries {row['temp_mib'] or 0:.1f} MiB "
                   f"per device", path)
    for case in cfg["cases"] if "steps" in phases else ():
        row = steps(cfg, case)
        record(result, "steps", row,
               f"{case:20s} max |{' - '.join(n for n, _ in _forms(cfg))}| "
               f"{row['max_abs_diff']:.1e}; wall ms {row['wall_ms']}; device ms "
               f"{row['device_ms']}", path)
    return finish(path, ok)


if __name__ == "__main__":
    sys.exit(main())
