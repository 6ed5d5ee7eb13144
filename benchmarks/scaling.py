"""Ring attention scaling: weak and strong, causal zigzag, forward + backward.

For every device count G (the first G devices) and sequence length S, the time of one
``jax.value_and_grad``-style step of ``jsp.attention(causal=True, layout="zigzag",
permuted=True)`` (the forward and the ``vjp`` of a random cotangent), inputs sharded over
the G devices beforehand, is compared with the single-device kernel on the whole S (the
same work on one device):

    parallel efficiency = T(1 device, S) / (G * T(ring over G devices, S))

* weak scaling: fixed tokens per device (``--weak``; S = tokens x G);
* strong scaling: fixed total tokens (``--strong``).

The same run first checks correctness at ``check_seq`` tokens (2 heads, to keep the
dense reference small): the ring over the most devices and the single-device kernel
against the float32 dense reference, and the ring against the single-device kernel.

    python benchmarks/scaling.py                     # CPU: 8 simulated devices, tiny
                                                     # (they share the cores: checks
                                                     # the script, measures nothing)
    python benchmarks/scaling.py --preset gpu        # 1, 2, 4, 8 GPUs (those present)
    python benchmarks/scaling.py --plot benchmarks/results/scaling_gpu.json

FLOPs for TFLOP/s: 3.5 x 4 B H S^2 D / 2 (causal forward + backward, FlashAttention-2's
convention, as ``benchmarks/kernels.py``).
"""

from __future__ import annotations

import argparse
import os
import sys

import _setup  # noqa: F401,E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_seqpar as jsp  # noqa: E402
from jax_seqpar.kernels import PallasKernel, XlaKernel  # noqa: E402
from jax_seqpar.masks import MaskSpec  # noqa: E402
from _util import (choose_preset, env_info, out_dir, pyplot, rel, replot, save_json,  # noqa: E402
                   time_fn)
from kernels import attn_flops, make_fn  # noqa: E402

PRESETS = {
    "gpu": dict(heads=16, head_dim=128, dtype="bfloat16", kernel="pallas",
                weak=[16384, 32768], strong=[131072, 524288], devices=[1, 2, 4, 8],
                check_seq=16384, repeats=3),
    "cpu": dict(heads=2, head_dim=32, dtype="float32", kernel="xla",
                weak=[256, 512], strong=[2048], devices=[1, 2, 4, 8],
                check_seq=1024, repeats=2),
}
BUDGET = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-2}


def make_kernel(name):
    if name == "pallas":
        return PallasKernel()
    if name == "xla":
        return XlaKernel(block_q=512, block_k=512)
    raise ValueError(f"kernel={name!r}: expected 'pallas' or 'xla'")


def inputs(S, H, D, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    return [jax.random.normal(k, (1, S, H, D), dtype) for k in ks]  # q, k, v, do


def ring_step(G, kernel, permuted):
    """``(mesh, f)``: ``f(q, k, v, do) -> (o, (dq, dk, dv))`` over the first G devices."""
    mesh = jax.make_mesh((G,), ("sp",), devices=jax.devices()[:G])

    def attn(q, k, v):
        return jsp.attention(q, k, v, mesh=mesh, causal=True, layout="zigzag",
                             permuted=permuted, kernel=kernel)

    def step(q, k, v, do):
        o, vjp = jax.vjp(attn, q, k, v)
        return o, vjp(do)
    return mesh, jax.jit(step)


def local_step(kernel, S, D):
    pos = jnp.arange(S, dtype=jnp.int32)
    g = make_fn(kernel, MaskSpec(causal=True), D ** -0.5)

    def step(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: g(q, k, v, pos, pos), q, k, v)
        return o, vjp(do)
    return jax.jit(step)


def check(cfg, kernel, G):
    """Relative errors at ``check_seq`` tokens, 2 heads: ring (G devices) and the local
    kernel against the dense float32 reference, and the ring against the local kernel."""
    S, D, dt = cfg["check_seq"], cfg["head_dim"], jnp.dtype(cfg["dtype"])
    q, k, v, do = inputs(S, 2, D, dt, seed=1)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]

    def ref(q, k, v):
        return jsp.reference_attention(q, k, v, causal=True, scale=D ** -0.5)[0]
    ro, rvjp = jax.vjp(ref, *f32[:3])
    rg = rvjp(f32[3])
    _, ring = ring_step(G, kernel, permuted=False)
    oo, og = ring(q, k, v, do)
    lo, lg = local_step(kernel, S, D)(q, k, v, do)
    errs = {}
    for name, (o, g), (o0, g0) in [("ring_vs_reference", (oo, og), (ro, rg)),
                                   ("local_vs_reference", (lo, lg), (ro, rg)),
                                   ("ring_vs_local", (oo, og), (lo, lg))]:
        errs[name] = max([rel(o, o0)] + [rel(a, b) for a, b in zip(g, g0)])
    return errs


def measure(cfg, kernel, G, S, t1_cache):
    H, D, dt, reps = cfg["heads"], cfg["head_dim"], jnp.dtype(cfg["dtype"]), cfg["repeats"]
    q, k, v, do = inputs(S, H, D, dt)
    if S not in t1_cache:
        t1_cache[S] = time_fn(local_step(kernel, S, D), q, k, v, do, warmup=1,
                              repeats=reps)["median_s"]
    t1 = t1_cache[S]
    if G == 1:
        tG = t1
    else:
        mesh, f = ring_step(G, kernel, permuted=True)
        sh = NamedSharding(mesh, P(None, "sp"))
        args = [jax.device_put(x, sh) for x in (q, k, v, do)]
        del q, k, v, do
        tG = time_fn(f, *args, warmup=1, repeats=reps)["median_s"]
    fl = 3.5 * attn_flops(1, H, S, D, True)
    return dict(G=G, S=S, t_1dev_s=t1, t_s=tG, efficiency=t1 / (G * tG),
                tflops_per_device=fl / tG / G / 1e12)


def table(rows):
    print(f"{'mode':6s} {'size':>8s} {'G':>2s} {'S':>8s} {'1 dev (s)':>10s} {'ring (s)':>9s} "
          f"{'eff.':>5s} {'TFLOP/s/dev':>11s}")
    for r in rows:
        print(f"{r['mode']:6s} {r['size']:8d} {r['G']:2d} {r['S']:8d} {r['t_1dev_s']:10.4f} "
              f"{r['t_s']:9.4f} {r['efficiency']:5.2f} {r['tflops_per_device']:11.1f}")


def plot(rows, path):
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
    for ax, mode in zip(axes, ("weak", "strong")):
        for size in sorted({r["size"] for r in rows if r["mode"] == mode}):
            rs = sorted((r for r in rows if r["mode"] == mode and r["size"] == size),
                        key=lambda r: r["G"])
            label = f"{size // 1024}k tokens" + (" per device" if mode == "weak" else "")
            ax.plot([r["G"] for r in rs], [r["efficiency"] for r in rs], "o-", label=label)
        counts = sorted({r["G"] for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(G) for G in counts])
        ax.minorticks_off()
        ax.set_xlabel("devices")
        ax.set_title(f"{mode} scaling")
        ax.axhline(1.0, color="gray", ls=":")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("parallel efficiency")
    fig.suptitle("ring attention, causal zigzag, forward + backward")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


def plan(cfg, counts):
    """``[(mode, size, G, S)]`` in run order; zigzag needs S divisible by 2G."""
    out = []
    for mode, sizes in (("weak", cfg["weak"]), ("strong", cfg["strong"])):
        for size in sizes:
            for G in counts:
                S = size * G if mode == "weak" else size
                if S % (2 * G) == 0:
                    out.append((mode, size, G, S))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--devices", default=None, help="comma-separated device counts")
    p.add_argument("--weak", default=None, help="tokens per device, comma-separated")
    p.add_argument("--strong", default=None, help="total tokens, comma-separated")
    p.add_argument("--plot", default=None, metavar="JSON",
                   help="only print the table and draw the PNG from a saved result file")
    args = p.parse_args(argv)
    if args.plot:
        replot(args.plot, table, plot)
        return 0
    preset, cfg = choose_preset(PRESETS, args.preset)
    cfg = dict(cfg)
    for key in ("devices", "weak", "strong"):
        if getattr(args, key):
            cfg[key] = [int(x) for x in getattr(args, key).split(",")]
    counts = [G for G in cfg["devices"] if G <= jax.device_count()]
    if not counts:
        p.error(f"--devices: none of {cfg['devices']} fits the {jax.device_count()} devices")
    kernel = make_kernel(cfg["kernel"])
    info = env_info()
    path = os.path.join(out_dir(), f"scaling_{preset}.json")
    print(f"# {info}\n# preset {preset}: {cfg}; device counts {counts}", flush=True)
    errs = check(cfg, kernel, max(counts))
    ok = all(e <= BUDGET[cfg["dtype"]] for e in errs.values())
    print("check:", {n: f"{e:.1e}" for n, e in errs.items()}, "PASS" if ok else "FAIL",
          flush=True)
    result = {"env": info, "preset": preset, "config": cfg, "check": errs, "rows": []}
    t1_cache = {}
    for mode, size, G, S in plan(cfg, counts):
        try:
            row = measure(cfg, kernel, G, S, t1_cache)
        except Exception as e:  # e.g. out of memory for the largest single-device runs
            print(f"{mode} {size} G={G} S={S}: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:120]}", flush=True)
            continue
        row = dict(mode=mode, size=size, **row)
        result["rows"].append(row)
        print(f"{mode} {size} G={G} S={S}: 1 device {row['t_1dev_s']:.4f} s, ring "
              f"{row['t_s']:.4f} s, efficiency {row['efficiency']:.2f}", flush=True)
        save_json(result, path)
    save_json(result, path)
    table(result["rows"])
    plot(result["rows"], os.path.splitext(path)[0] + ".png")
    print("CHECKS:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
