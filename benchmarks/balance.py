"""Causal load balance: contiguous vs zigzag vs striped layouts.

Prints the (query block, key block) tiles each device computes over the whole ring,
counted from positions (``schedule.tile_counts``, no timing), and the wall time of the
causal forward + backward for each layout, checked against the dense reference on a
small size first.  Saves JSON and, with matplotlib, a PNG.

    python benchmarks/balance.py                # CPU: 8 simulated devices, small
    python benchmarks/balance.py --preset gpu   # 4 H200s, 128k tokens
"""

from __future__ import annotations

import argparse
import os
import sys

import _setup  # noqa: F401,E402  (before JAX: device count, sys.path)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_seqpar as jsp  # noqa: E402
from jax_seqpar.kernels import XlaKernel  # noqa: E402
from jax_seqpar.masks import MaskSpec  # noqa: E402
from jax_seqpar.parallel.schedule import tile_counts  # noqa: E402
from _util import (choose_preset, env_info, out_dir, pyplot, rel, save_json,  # noqa: E402
                   time_fn)

LAYOUTS = ("contiguous", "zigzag", "striped")
PRESETS = {
    "cpu": dict(devices=8, seq=8192, check_seq=2048, heads=4, kv_heads=4, head_dim=64,
                dtype="float32", block=512, repeats=2),
    "gpu": dict(devices=4, seq=131072, check_seq=8192, heads=16, kv_heads=16, head_dim=128,
                dtype="bfloat16", block=2048, repeats=5),
}



def fwd_bwd(mesh, layout, kernel):
    def step(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: jsp.attention(
            q, k, v, mesh=mesh, causal=True, layout=layout, kernel=kernel), q, k, v)
        return out, vjp(do)
    return jax.jit(step)


def inputs(S, cfg, seed=0):
    dt = jnp.dtype(cfg["dtype"])
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    B, H, Hkv, D = 1, cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    return (jax.random.normal(ks[0], (B, S, H, D), dt), jax.random.normal(ks[1], (B, S, Hkv, D), dt),
            jax.random.normal(ks[2], (B, S, Hkv, D), dt), jax.random.normal(ks[3], (B, S, H, D), dt))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    args = p.parse_args()
    preset, cfg = choose_preset(PRESETS, args.preset)
    G = min(cfg["devices"], jax.device_count())
    mesh = jax.make_mesh((G,), ("sp",), devices=jax.devices()[:G])
    kernel = XlaKernel(block_q=cfg["block"], block_k=cfg["block"])
    info = env_info()
    print(f"# {info}\n# preset {preset}: {cfg}, G={G}")
    tol = 2e-2 if cfg["dtype"] == "bfloat16" else 1e-5

    # correctness of each layout at a size the reference can hold
    q, k, v, do = inputs(cfg["check_seq"], cfg, seed=1)
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref_out, rvjp = jax.vjp(lambda q, k, v: jsp.reference_attention(q, k, v, causal=True)[0],
                            up(q), up(k), up(v))
    ref = (ref_out, *rvjp(up(do)))
    errs = {}
    for layout in LAYOUTS:
        out, grads = fwd_bwd(mesh, layout, kernel)(q, k, v, do)
        errs[layout] = max(rel(a, b) for a, b in zip((out, *grads), ref))
    del q, k, v, do, ref, rvjp

    S = cfg["seq"]
    q, k, v, do = inputs(S, cfg)
    rows = []
    for layout in LAYOUTS:
        tiles = tile_counts(layout, MaskSpec(causal=True), S, G, cfg["block"], cfg["block"])
        t = time_fn(fwd_bwd(mesh, layout, kernel), q, k, v, do, repeats=cfg["repeats"])
        rows.append(dict(layout=layout, devices=G, seq=S, tiles=tiles.tolist(),
                         max_tiles=int(tiles.max()), time_s=t["median_s"], min_s=t["min_s"],
                         check_err=errs[layout], check_seq=cfg["check_seq"]))
    base = rows[0]["time_s"]
    print(f"{'layout':<11}{'tiles per device':<34}{'max':>6}{'fwd+bwd ms':>12}"
          f"{'speedup':>9}{'err ref':>10}")
    for r in rows:
        print(f"{r['layout']:<11}{str(r['tiles']):<34}{r['max_tiles']:>6}"
              f"{r['time_s'] * 1e3:>12.1f}{base / r['time_s']:>9.2f}{r['check_err']:>10.1e}")
    d = out_dir()
    save_json({"env": info, "preset": preset, "config": cfg, "rows": rows},
              os.path.join(d, f"balance_{preset}.json"))
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for i, r in enumerate(rows):
            ax.bar([x + 0.27 * i for x in range(G)], r["tiles"], width=0.27, label=r["layout"])
        ax.set_xlabel("device")
        ax.set_ylabel("tiles computed (causal)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(d, f"balance_{preset}.png"), dpi=110)
    ok = all(r["check_err"] <= tol for r in rows)
    print("CHECKS:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
