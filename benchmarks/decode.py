"""Decoding latency: tree vs ring vs all-gather over a sequence-sharded KV cache.

One new token (and Tq = 4) against contexts of growing length, Llama-3-8B-like heads
(Hq = 32, Hkv = 8, D = 128), bf16.  Every strategy is checked against the dense
reference at a small context (causal, ragged lengths), and at every size the ring and
all-gather outputs are compared with the tree's, in the same run.  Prints latency, bytes
sent per device (compiled HLO) and the compiled program's device memory per device
(arguments + outputs + temporaries, from XLA's memory analysis); saves JSON.

    python benchmarks/decode.py                 # CPU, 8 simulated devices, small
    python benchmarks/decode.py --preset gpu    # 4 H200s, 128k .. 2M tokens
"""

from __future__ import annotations

import argparse
import os
import sys

import _setup  # noqa: F401,E402  (before JAX: device count, sys.path)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_seqpar as jsp  # noqa: E402
from jax_seqpar.comm import collective_bytes  # noqa: E402
from jax_seqpar.kernels import XlaKernel  # noqa: E402
from _util import choose_preset, env_info, out_dir, rel, save_json, time_fn  # noqa: E402

PRESETS = {
    "cpu": dict(devices=8, contexts=[8192], batches=[1, 4], tq=[1, 4], heads=(8, 2),
                head_dim=64, dtype="float32", block_k=2048, repeats=3, check_ctx=4096),
    "gpu": dict(devices=4, contexts=[131072, 1048576, 2097152], batches=[1, 8], tq=[1, 4],
                heads=(32, 8), head_dim=128, dtype="bfloat16", block_k=8192, repeats=5,
                check_ctx=16384, max_gather_bytes=40e9),
}
FNS = {"tree": jsp.tree_decode, "ring": jsp.ring_decode, "allgather": jsp.allgather_decode}



def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    args = p.parse_args()
    preset, cfg = choose_preset(PRESETS, args.preset)
    G = min(cfg["devices"], jax.device_count())
    mesh = jax.make_mesh((G,), ("sp",), devices=jax.devices()[:G])
    kernel = XlaKernel(block_q=512, block_k=cfg["block_k"])
    dt = jnp.dtype(cfg["dtype"])
    Hq, Hkv = cfg["heads"]
    D = cfg["head_dim"]
    tol = 2e-2 if dt == jnp.bfloat16 else 1e-5
    info = env_info()
    print(f"# {info}\n# preset {preset}: {cfg}, G={G}")

    # correctness against the dense reference at a small context, causal, ragged lengths
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    S, B, Tq = cfg["check_ctx"], 2, 4
    q = jax.random.normal(ks[0], (B, Tq, Hq, D), dt)
    k = jax.random.normal(ks[1], (B, S, Hkv, D), dt)
    v = jax.random.normal(ks[2], (B, S, Hkv, D), dt)
    lengths = [S, S // 3]
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = jnp.concatenate([jsp.reference_attention(
        up(q[b:b + 1]), up(k[b:b + 1, :L]), up(v[b:b + 1, :L]), causal=True,
        q_pos=jnp.arange(L - Tq, L))[0] for b, L in enumerate(lengths)])
    check = {}
    for name, fn in FNS.items():
        out = fn(q, k, v, mesh=mesh, kv_lengths=jnp.asarray(lengths), causal=True, kernel=kernel)
        check[name] = rel(out, ref)
    print("check vs reference:", {n: f"{e:.1e}" for n, e in check.items()})
    del q, k, v, ref

    rows = []
    for S in cfg["contexts"]:
        for B in cfg["batches"]:
            # Made in place, sharded along the sequence: a 2M-token cache for B = 8 is
            # 34 GB per array, which one device cannot also hold while drawing it.
            sharded = NamedSharding(mesh, P(None, "sp"))
            draw = jax.jit(lambda key, B=B, S=S: jax.random.normal(key, (B, S, Hkv, D), dt),
                           out_shardings=sharded)
            kc, vc = draw(ks[1]), draw(ks[2])
            for Tq in cfg["tq"]:
                q = jax.random.normal(ks[0], (B, Tq, Hq, D), dt)
                outs = {}
                for name, fn in FNS.items():
                    gathered = 2 * B * S * Hkv * D * dt.itemsize
                    if name == "allgather" and gathered > cfg.get("max_gather_bytes", 1 << 62):
                        # An out-of-memory error on one GPU leaves the others waiting in
                        # the collective for ever (seen on 4 H200s): skip, don't try.
                        print(f"allgather S={S} B={B}: skipped, the gathered cache "
                              f"({gathered / 1e9:.0f} GB) would not fit")
                        continue
                    f = jax.jit(lambda q, k, v, fn=fn: fn(q, k, v, mesh=mesh, causal=True,
                                                          kernel=kernel))
                    try:
                        t = time_fn(f, q, kc, vc, repeats=cfg["repeats"])
                        outs[name] = f(q, kc, vc)
                        sent = collective_bytes(f, q, kc, vc).total_bytes
                        mem = f.lower(q, kc, vc).compile().memory_analysis()
                        peak = None if mem is None else (
                            mem.argument_size_in_bytes + mem.output_size_in_bytes
                            + mem.temp_size_in_bytes)
                    except Exception as e:  # e.g. out of memory for the all-gather
                        print(f"{name} S={S} B={B} Tq={Tq}: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:120]}")
                        continue
                    rows.append(dict(strategy=name, context=S, batch=B, tq=Tq,
                                     time_s=t["median_s"], bytes_per_device=sent,
                                     peak_bytes=peak))
                    print(f"measured {rows[-1]}", flush=True)  # survives a later failure
                agree = {n: rel(o, outs["tree"]) for n, o in outs.items() if n != "tree"}
                for r in rows[-len(outs):]:
                    r["rel_vs_tree"] = agree.get(r["strategy"], 0.0)
                del q
            del kc, vc
    print(f"{'S':>8} {'B':>2} {'Tq':>2} {'strategy':<10}{'ms':>9}{'vs tree':>9}"
          f"{'MB sent':>10}{'peak GB':>9}{'diff':>9}")
    for r in rows:
        tree = [x for x in rows if x["strategy"] == "tree" and x["context"] == r["context"]
                and x["batch"] == r["batch"] and x["tq"] == r["tq"]][0]
        peak = "" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 1e9:.1f}"
        print(f"{r['context']:>8} {r['batch']:>2} {r['tq']:>2} {r['strategy']:<10}"
              f"{r['time_s'] * 1e3:>9.3f}{r['time_s'] / tree['time_s']:>9.2f}"
              f"{r['bytes_per_device'] / 1e6:>10.3f}{peak:>9}{r['rel_vs_tree']:>9.1e}")
    save_json({"env": info, "preset": preset, "config": cfg, "check": check, "rows": rows},
              os.path.join(out_dir(), f"decode_{preset}.json"))
    ok = all(e <= tol for e in check.values()) and all(r["rel_vs_tree"] <= tol for r in rows)
    print("CHECKS:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
