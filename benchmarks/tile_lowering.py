"""What it costs to build a program with many `pallas_mgpu` tiles: bare calls vs one jitted
function per tile direction.

A ring calls the local kernel once per hop, and an unrolled model once per layer, with
the same shapes.  `kernels/pallas_mgpu.py` calls its kernels through `jax.jit`
(`_jitted_fwd`, `_jitted_bwd`), so a program traces and lowers each distinct tile
once; before, every call built its Mosaic GPU kernel again.  This script measures both
ways in fresh processes (``--child``); the "bare" way swaps the module's jitted
functions for the plain ones, which is the code before the change.

* ``ring``: ``jax.grad`` of causal ring attention on ``G`` simulated CPU devices, traced
  and lowered for CUDA (``lowering_platforms=("cuda",)``): runs on any machine, no GPU.
* ``layers`` (GPU only): ``L`` calls of ``jax_seqpar.attention`` on one device in one
  program (as ``L`` unrolled layers, each on its own inputs), forward + backward:
  lowering, compilation, and the first call's time.

    python benchmarks/tile_lowering.py --jobs ring:8:zigzag:128,ring:8:striped:64
    python benchmarks/tile_lowering.py --jobs layers:8:16384:128      # one Hopper GPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _bare(pm):
    """The code before the change: the kernels called without a jit of their own."""
    pm._jitted_fwd = pm.mgpu_fwd
    pm._jitted_bwd = pm.mgpu_bwd
    pm._jitted_triton_bwd = pm.pallas_bwd


def child(spec: dict) -> dict:
    if spec["kind"] == "ring":  # simulated CPU devices (_setup: 8), lowered for CUDA
        os.environ["JAX_PLATFORMS"] = "cpu"
    import _setup  # noqa: F401
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType

    import jax_seqpar as jsp
    from jax_seqpar.kernels import pallas_mgpu as pm
    if spec["how"] == "bare":
        _bare(pm)
    kern = pm.PallasMgpuKernel()
    row = dict(spec)
    if spec["kind"] == "ring":
        G, D = spec["G"], spec["D"]
        mesh = jax.make_mesh((G,), ("sp",), axis_types=(AxisType.Auto,),
                             devices=jax.devices()[:G])
        SDS = jax.ShapeDtypeStruct
        q, kv = SDS((1, 1024 * G, 8, D), jnp.bfloat16), SDS((1, 1024 * G, 2, D), jnp.bfloat16)

        def loss(q, k, v):
            return jsp.attention(q, k, v, mesh=mesh, causal=True, layout=spec["layout"],
                                 kernel=kern).astype(jnp.float32).sum()
        t0 = time.perf_counter()
        txt = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
            lowering_platforms=("cuda",)).as_text()
        row.update(lower_s=time.perf_counter() - t0, text_mb=len(txt) / 1e6,
                   mosaic_calls_in_text=txt.count("custom_call @mosaic_gpu"))
        return row
    # layers: L tiles on one GPU
    L, S, D = spec["L"], spec["S"], spec["D"]
    mesh = jax.make_mesh((1,), ("sp",), devices=jax.devices()[:1])
    keys = jax.random.split(jax.random.PRNGKey(0), 4 * L)
    shape = (1, S, 16, D)
    xs = [jax.random.normal(k, shape, jnp.bfloat16) for k in keys]

    def loss(xs):
        tot = 0.0
        for i in range(L):
            q, k, v, c = xs[4 * i: 4 * i + 4]
            o = jsp.attention(q, k, v, mesh=mesh, causal=True, kernel=kern)
            tot = tot + jnp.sum(o.astype(jnp.float32) * c.astype(jnp.float32))
        return tot
    f = jax.jit(jax.grad(loss))
    t0 = time.perf_counter()
    lowered = f.trace(xs).lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    jax.block_until_ready(compiled(xs))
    t3 = time.perf_counter()
    jax.block_until_ready(compiled(xs))
    t4 = time.perf_counter()
    row.update(lower_s=t1 - t0, compile_s=t2 - t1, first_call_s=t3 - t2,
               second_call_s=t4 - t3)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", default="ring:4:zigzag:128,ring:8:zigzag:128,ring:8:striped:64",
                   help="ring:G:LAYOUT:D and/or layers:L:S:D, comma-separated")
    p.add_argument("--hows", default="bare,jitted")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(json.loads(a.child))), flush=True)
        return 0
    rows = []
    for job in a.jobs.split(","):
        kind, *f = job.split(":")
        if kind == "ring" and len(f) == 3 and 2 <= int(f[0]) <= 8:
            spec = dict(kind="ring", G=int(f[0]), layout=f[1], D=int(f[2]))
        elif kind == "layers" and len(f) == 3:
            spec = dict(kind="layers", L=int(f[0]), S=int(f[1]), D=int(f[2]))
        else:
            p.error(f"--jobs: {job!r} is not ring:G:LAYOUT:D (G 2-8) or layers:L:S:D")
        for how in a.hows.split(","):
            if how not in ("bare", "jitted"):
                p.error(f"--hows takes bare and/or jitted, not {how!r}")
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                                  json.dumps(dict(spec, how=how))], capture_output=True,
                                 text=True, cwd=HERE)
            if out.returncode != 0:
                print(f"{job} {how}: FAILED\n{out.stderr[-2000:]}", flush=True)
                continue
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{job:24s} {how:7s} " + "  ".join(
                f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in row.items() if k.endswith(("_s", "_mb", "_text"))), flush=True)
    from _util import env_info, out_dir, save_json
    save_json(dict(env=env_info(), rows=rows), f"{out_dir()}/tile_lowering.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
