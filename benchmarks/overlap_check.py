"""Does the compiled ring overlap each transfer with a local tile?  (compile only)

Compiles the 1-D ring's forward and backward over every device present (8 simulated CPU
devices without an accelerator) and prints, per collective, what the scheduled HLO puts
in its window (``jax_seqpar.overlap``): on GPUs the instructions between each
``collective-permute-start`` and its ``-done``; on CPU, whose collectives are
synchronous, those between the collective and its first user.  Exits non-zero when an
activation hop that forwards a received block has no kernel compute in its window.

    python benchmarks/overlap_check.py [--seq 65536] [--causal] [--backward kv|q]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import _setup  # noqa: F401,E402  (before JAX: device count, sys.path)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_seqpar as jsp  # noqa: E402
from jax_seqpar.overlap import overlap_report  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--backward", default="kv", choices=("kv", "q"))
    a = ap.parse_args(argv)
    G = jax.device_count()
    on_gpu = jax.default_backend() == "gpu"
    S = a.seq or (G * (4096 if on_gpu else 16))
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    shape = (1, S, a.heads, a.head_dim)
    q = k = v = do = jax.ShapeDtypeStruct(shape, dtype)
    mesh = jax.make_mesh((G,), ("sp",))
    layout = "zigzag" if a.causal else "contiguous"

    def att(q, k, v):
        return jsp.attention(q, k, v, mesh=mesh, causal=a.causal, layout=layout,
                             permuted=True, backward=a.backward)

    def fwd_bwd(q, k, v, do):
        _, vjp = jax.vjp(att, q, k, v)
        return vjp(do)

    rows, bad = [], 0
    for phase, fn, args in (("forward", att, (q, k, v)), ("fwd+bwd", fwd_bwd, (q, k, v, do))):
        for w in overlap_report(fn, *args):
            forwarded = w.operand_ops == ("collective-permute",)
            if forwarded and not w.gradient and not w.overlapped:
                bad += 1
            rows.append({"phase": phase, "collective": w.collective, "kind": w.kind,
                         "async": w.is_async, "gradient": w.gradient,
                         "forwards_block": forwarded, "window": len(w.between),
                         "kernel_compute": list(w.compute)})
    print(f"{jax.default_backend()} x{G}, S={S}, causal={a.causal}, backward={a.backward}")
    print(f"{'phase':<8} {'collective':<28} {'async':>5} {'grad':>5} {'fwd':>4} "
          f"{'window':>6}  kernel compute in window")
    for r in rows:
        print(f"{r['phase']:<8} {r['collective']:<28} {str(r['async']):>5} "
              f"{str(r['gradient']):>5} {str(r['forwards_block']):>4} {r['window']:>6}  "
              f"{', '.join(r['kernel_compute'][:3])}")
    out = os.environ.get("OUT", "benchmarks/out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"overlap_{jax.default_backend()}{G}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"forwarded activation hops without kernel compute: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
