"""Decoding latency: tree vs ring vs all-gather over a sequence-sharded KV cache.

One new token (and Tq = 4) against contexts of growing length, Llama-3-8B-like heads
(Hq = 32, Hkv = 8, D = 128), bf16.  Every strategy is checked against the dense
reference at a small context (causal, ragged lengths), and at every size the ring and
all-gather outputs are compared with the tree's, in the same run.  Prints latency, bytes
sent per device (compiled HLO) and the compiled program's device memory per device
(arguments + outputs + temporaries, from XLA's memory analysis); saves JSON.

    python benchmarks/decode.py                 # CPU, 8 simulated devices, small
    python benchmarks/decode.py --preset gpu    # 1, 2 and 4 H200s, 128k .. 2M tokens
    python benchmarks/decode.py --preset gpu8   # 8 GPUs, 128k .. 4M tokens
    python benchmarks/decode.py --preset gpu --kernel xla   # another local kernel
    python benchmarks/decode.py --plot benchmarks/results/decode_gpu.json   # PNG only
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
from jax_seqpar.runtime.comm import analyze_hlo  # noqa: E402
from jax_seqpar.decode import decode_kernel_name  # noqa: E402
from jax_seqpar.kernels import PallasDecodeKernel, XlaDecodeKernel, XlaKernel  # noqa: E402
from _util import (choose_preset, env_info, out_dir, pyplot, rel, replot, save_json,  # noqa: E402
                   time_fn)

PRESETS = {
    "cpu": dict(devices=[2, 8], contexts=[8192], batches=[1, 4], tq=[1, 4], heads=(8, 2),
                head_dim=64, dtype="float32", block_k=2048, repeats=3, check_ctx=4096),
    "gpu": dict(devices=[1, 2, 4], contexts=[131072, 1048576, 2097152], batches=[1, 8], tq=[1, 4],
                heads=(32, 8), head_dim=128, dtype="bfloat16", block_k=8192, repeats=5,
                check_ctx=16384, max_gather_bytes=40e9, max_device_bytes=80e9),
    # issue 9: one full node of 8 GPUs, 128k .. 4M tokens of context
    "gpu8": dict(devices=[8], contexts=[131072, 1048576, 2097152, 4194304], batches=[1, 8],
                 tq=[1, 4], heads=(32, 8), head_dim=128, dtype="bfloat16", block_k=8192,
                 repeats=5, check_ctx=16384, max_gather_bytes=40e9, max_device_bytes=80e9),
}
FNS = {"tree": jsp.tree_decode, "ring": jsp.ring_decode, "allgather": jsp.allgather_decode}



def check_against_reference(cfg, mesh, kernel, dt):
    """Every strategy vs the dense reference at a small context, causal, ragged lengths,
    and the tree's gradients."""
    Hq, Hkv = cfg["heads"]
    D = cfg["head_dim"]
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    S, B, Tq = cfg["check_ctx"], 2, 4
    q = jax.random.normal(ks[0], (B, Tq, Hq, D), dt)
    k = jax.random.normal(ks[1], (B, S, Hkv, D), dt)
    v = jax.random.normal(ks[2], (B, S, Hkv, D), dt)
    lengths = [S, S // 3]
    up = lambda x: x.astype(jnp.float32)  # noqa: E731

    def reference(q, k, v):
        return jnp.concatenate([jsp.reference_attention(
            q[b:b + 1], k[b:b + 1, :L], v[b:b + 1, :L], causal=True,
            q_pos=jnp.arange(L - Tq, L))[0] for b, L in enumerate(lengths)])

    def tree(q, k, v):
        return jsp.tree_decode(q, k, v, mesh=mesh, kv_lengths=jnp.asarray(lengths),
                               causal=True, kernel=kernel)

    ref, ref_vjp = jax.vjp(reference, up(q), up(k), up(v))
    errs = {name: rel(fn(q, k, v, mesh=mesh, kv_lengths=jnp.asarray(lengths), causal=True,
                         kernel=kernel), ref)
            for name, fn in FNS.items()}
    # tree_decode is differentiable: its dq, dk, dv against the reference's
    do = jax.random.normal(jax.random.PRNGKey(1), q.shape, dt)
    grads = jax.jit(lambda q, k, v, do: jax.vjp(tree, q, k, v)[1](do))(q, k, v, do)
    errs["tree_grads"] = max(rel(g, r) for g, r in zip(grads, ref_vjp(up(do))))
    return errs


def measure(cfg, G, kernel, dt):
    """Rows of (strategy, context, batch, tq) -> latency, bytes sent, memory, on G devices."""
    mesh = jax.make_mesh((G,), ("sp",), devices=jax.devices()[:G])
    Hq, Hkv = cfg["heads"]
    D = cfg["head_dim"]
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    rows = []
    for S in cfg["contexts"]:
        for B in cfg["batches"]:
            cache_bytes = 2 * B * S * Hkv * D * dt.itemsize
            if cache_bytes / G > cfg.get("max_device_bytes", 1 << 62):
                print(f"G={G} S={S} B={B}: skipped, {cache_bytes / G / 1e9:.0f} GB of cache "
                      f"per device")
                continue
            # Made in place, sharded along the sequence: a 2M-token cache for B = 8 is
            # 34 GB per array, which one device cannot also hold while drawing it.
            sharded = NamedSharding(mesh, P(None, "sp"))
            draw = jax.jit(lambda key, B=B, S=S: jax.random.normal(key, (B, S, Hkv, D), dt),
                           out_shardings=sharded)
            kc, vc = draw(ks[1]), draw(ks[2])
            for Tq in cfg["tq"]:
                q = jax.random.normal(ks[0], (B, Tq, Hq, D), dt)
                outs, new = {}, []
                for name, fn in FNS.items():
                    if name == "allgather" and cache_bytes > cfg.get("max_gather_bytes", 1 << 62):
                        # An out-of-memory error on one GPU leaves the others waiting in
                        # the collective for ever (seen on 4 H200s): skip, don't try.
                        print(f"allgather G={G} S={S} B={B}: skipped, the gathered cache "
                              f"({cache_bytes / 1e9:.0f} GB) would not fit")
                        continue
                    f = jax.jit(lambda q, k, v, fn=fn: fn(q, k, v, mesh=mesh, causal=True,
                                                          kernel=kernel))
                    try:
                        compiled = f.lower(q, kc, vc).compile()  # once: time, HLO, memory
                        t = time_fn(compiled, q, kc, vc, repeats=cfg["repeats"])
                        outs[name] = compiled(q, kc, vc)
                        sent = analyze_hlo(compiled.as_text(), G).total_bytes
                        mem = compiled.memory_analysis()
                        peak = None if mem is None else (
                            mem.argument_size_in_bytes + mem.output_size_in_bytes
                            + mem.temp_size_in_bytes)
                    except Exception as e:  # e.g. out of memory for the all-gather
                        print(f"{name} G={G} S={S} B={B} Tq={Tq}: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:120]}")
                        continue
                    new.append(dict(devices=G, strategy=name, context=S, batch=B, tq=Tq,
                                    time_s=t["median_s"], min_s=t["min_s"],
                                    bytes_per_device=sent, peak_bytes=peak))
                    print(f"measured {new[-1]}", flush=True)  # survives a later failure
                for r in new:
                    r["rel_vs_tree"] = (rel(outs[r["strategy"]], outs["tree"])
                                        if "tree" in outs else None)
                rows += new
                del q, outs
            del kc, vc
    return rows


def table(rows):
    print(f"{'G':>2} {'S':>8} {'B':>2} {'Tq':>2} {'strategy':<10}{'ms':>9}{'vs tree':>9}"
          f"{'MB sent':>10}{'peak GB':>9}{'diff':>9}")
    for r in rows:
        tree = [x for x in rows if x["strategy"] == "tree" and all(
            x[c] == r[c] for c in ("devices", "context", "batch", "tq"))]
        ratio = f"{r['time_s'] / tree[0]['time_s']:.2f}" if tree else "-"
        peak = "" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 1e9:.1f}"
        diff = "" if r["rel_vs_tree"] is None else f"{r['rel_vs_tree']:.1e}"
        print(f"{r['devices']:>2} {r['context']:>8} {r['batch']:>2} {r['tq']:>2} "
              f"{r['strategy']:<10}{r['time_s'] * 1e3:>9.3f}{ratio:>9}"
              f"{r['bytes_per_device'] / 1e6:>10.3f}{peak:>9}{diff:>9}")


def plot(rows, path):
    """Latency vs context, one panel per (devices, batch), Tq = 1 solid, Tq = 4 dashed."""
    plt = pyplot()
    if plt is None:
        return
    Gs = sorted({r["devices"] for r in rows})
    Bs = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(len(Bs), len(Gs), figsize=(4 * len(Gs), 3.2 * len(Bs)),
                             squeeze=False, sharey=True)
    colors = {"tree": "C0", "ring": "C3", "allgather": "C2"}
    for i, B in enumerate(Bs):
        for j, G in enumerate(Gs):
            ax = axes[i][j]
            for name in FNS:
                for Tq, style in ((1, "-o"), (4, "--s")):
                    pts = sorted((r["context"], r["time_s"] * 1e3) for r in rows
                                 if (r["strategy"], r["devices"], r["batch"], r["tq"])
                                 == (name, G, B, Tq))
                    if pts:
                        ax.plot(*zip(*pts), style, color=colors[name], ms=4,
                                label=f"{name} Tq={Tq}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{G} device(s), B={B}")
            ax.set_xlabel("context (tokens)")
            if j == 0:
                ax.set_ylabel("latency (ms)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--devices", default=None,
                   help="comma-separated device counts (default: the preset's)")
    p.add_argument("--contexts", default=None,
                   help="comma-separated context lengths (default: the preset's)")
    p.add_argument("--kernel", choices=("auto", "pallas_decode", "xla_decode", "xla"),
                   default="auto",
                   help="local kernel: auto (the decoders' default: pallas_decode on GPUs, "
                        "else xla_decode), or one by name (xla: key blocks of the preset's "
                        "block_k); result files of a named kernel carry its name")
    p.add_argument("--plot", default=None, metavar="JSON",
                   help="only draw the PNG from a saved result file")
    args = p.parse_args()
    if args.plot:
        replot(args.plot, table, plot)
        return 0
    preset, cfg = choose_preset(PRESETS, args.preset)
    if args.contexts:
        cfg = dict(cfg, contexts=[int(x) for x in args.contexts.split(",")])
    counts = ([int(x) for x in args.devices.split(",")] if args.devices
              else cfg["devices"])
    counts = [G for G in counts if G <= jax.device_count()]
    kernel = {"auto": "auto", "pallas_decode": PallasDecodeKernel(),
              "xla_decode": XlaDecodeKernel(),
              "xla": XlaKernel(block_q=512, block_k=cfg["block_k"])}[args.kernel]
    stem = f"decode_{preset}" + ("" if args.kernel == "auto" else f"_{args.kernel}")
    if args.kernel == "auto":
        dummy = jnp.zeros((1, 1, cfg["heads"][0], cfg["head_dim"]), cfg["dtype"])
        args.kernel = f"auto ({decode_kernel_name('auto', dummy)})"
    dt = jnp.dtype(cfg["dtype"])
    tol = 2e-2 if dt == jnp.bfloat16 else 1e-5
    info = env_info()
    print(f"# {info}\n# preset {preset}: {cfg}, device counts {counts}, kernel {args.kernel}")
    G = max(counts)
    mesh = jax.make_mesh((G,), ("sp",), devices=jax.devices()[:G])
    check = check_against_reference(cfg, mesh, kernel, dt)
    print("check vs reference:", {n: f"{e:.1e}" for n, e in check.items()}, flush=True)
    rows = []
    for G in sorted(counts, reverse=True):  # the acceptance numbers (most devices) first
        rows += measure(cfg, G, kernel, dt)
        save_json({"env": info, "preset": preset, "config": cfg, "kernel": args.kernel,
                   "check": check, "rows": rows}, os.path.join(out_dir(), stem + ".json"))
    table(rows)
    plot(rows, os.path.join(out_dir(), stem + ".png"))
    ok = all(e <= tol for e in check.values()) and all(
        r["rel_vs_tree"] is None or r["rel_vs_tree"] <= tol for r in rows)
    print("CHECKS:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
