"""Ring backward: KV scheme vs BurstAttention's Q scheme vs "auto".

For each (devices, heads, kv heads, sequence length) it prints the bytes each device
sends in the backward (read from the compiled program, next to the formula of
``jax_seqpar.parallel.costs``), the backward's wall time, and the gradient agreement of
the schemes (each against the KV scheme; on small sizes also against the dense
reference).  Saves JSON and, with matplotlib, a PNG.

    python benchmarks/backward_comm.py                # small, CPU (8 simulated devices)
    python benchmarks/backward_comm.py --preset gpu   # GPUs: 2, 4 and 8 (those present), up to 128k
    python benchmarks/backward_comm.py --preset gpu --kernel pallas --devices 2

``--kernel`` picks the local kernel (``xla``, the preset's, or ``pallas``: on CPU the Pallas
interpreter, slow); the result files of a non-default kernel carry its name.
"""

from __future__ import annotations

import argparse
import os
import sys

import _setup  # noqa: F401,E402  (before JAX: device count, sys.path)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_seqpar as jsp  # noqa: E402
from jax_seqpar.runtime.comm import collective_bytes  # noqa: E402
from jax_seqpar.kernels import PallasKernel, XlaKernel  # noqa: E402
from jax_seqpar.parallel.costs import backward_bytes  # noqa: E402
from jax_seqpar.parallel.ring import ring_shape  # noqa: E402

from _util import (choose_preset, env_info, out_dir, progress, pyplot, rel,  # noqa: E402
                   save_json, time_fn)

PRESETS = {
    "cpu": dict(devices=[2, 4, 8], heads=[(8, 8), (8, 2)], seq=[512, 2048], head_dim=64,
                dtype="float32", block=512, check_ref_max=4096, repeats=3, kernel="xla"),
    "gpu": dict(devices=[2, 4, 8], heads=[(16, 16), (16, 4)], seq=[8192, 32768, 131072], head_dim=128,
                dtype="bfloat16", block=2048, check_ref_max=8192, repeats=3, kernel="xla"),
}


KERNELS = ("xla", "pallas")


def make_kernel(cfg):
    """The local kernel named by ``cfg["kernel"]`` (xla tiles: ``cfg["block"]``)."""
    if cfg["kernel"] == "xla":
        return XlaKernel(block_q=cfg["block"], block_k=cfg["block"])
    if cfg["kernel"] == "pallas":
        return PallasKernel()
    raise ValueError(f"kernel={cfg['kernel']!r}: expected one of {KERNELS}")


def run(cfg, causal: bool):
    dtype = jnp.dtype(cfg["dtype"])
    kernel = make_kernel(cfg)
    grid = [(G, hq, hkv, S) for G in cfg["devices"] if G <= jax.device_count()
            for hq, hkv in cfg["heads"] for S in cfg["seq"]]
    rows = []
    for G, Hq, Hkv, S in progress(grid, desc="configs"):
        mesh = jax.make_mesh((G,), ("sp",), devices=jax.devices()[:G])
        ks = jax.random.split(jax.random.PRNGKey(S + G + Hkv), 4)
        D, B = cfg["head_dim"], 1
        q = jax.random.normal(ks[0], (B, S, Hq, D), dtype)
        k = jax.random.normal(ks[1], (B, S, Hkv, D), dtype)
        v = jax.random.normal(ks[2], (B, S, Hkv, D), dtype)
        do = jax.random.normal(ks[3], (B, S, Hq, D), dtype)
        shape = ring_shape(jsp.api.make_config(q, k, axis_name='sp', causal=causal, window=None, segment_ids=None, scale=None, layout='contiguous', backward='kv', kernel='xla'), q[:, : S // G], k[:, : S // G], None, G)
        grads = {}
        for scheme in ("kv", "q", "auto"):
            def fwd(q, k, v, scheme=scheme):
                return jsp.attention(q, k, v, mesh=mesh, causal=causal, backward=scheme,
                                     kernel=kernel)

            _, vjp = jax.jit(lambda q, k, v: jax.vjp(fwd, q, k, v))(q, k, v)
            bwd = jax.jit(lambda vjp, do: vjp(do)).lower(vjp, do).compile()  # read and run
            comm = collective_bytes(bwd)
            t = time_fn(bwd, vjp, do, repeats=cfg["repeats"])
            grads[scheme] = bwd(vjp, do)
            resolved = scheme if scheme != "auto" else (
                "kv" if comm.total_bytes == backward_bytes("kv", shape) else "q")
            rows.append(dict(devices=G, q_heads=Hq, kv_heads=Hkv, seq=S, head_dim=D,
                             dtype=dtype.name, causal=causal, kernel=cfg["kernel"], scheme=scheme, resolved=resolved,
                             bytes_per_device=comm.total_bytes,
                             formula_bytes=backward_bytes(resolved, shape),
                             time_s=t["median_s"], min_s=t["min_s"]))
        for i, scheme in ((-2, "q"), (-1, "auto")):
            rows[i]["grad_rel_vs_kv"] = max(rel(a, b) for a, b in zip(grads[scheme], grads["kv"]))
        if S <= cfg["check_ref_max"]:
            up = lambda x: x.astype(jnp.float32)  # noqa: E731
            _, rvjp = jax.vjp(lambda q, k, v: jsp.reference_attention(q, k, v, causal=causal)[0],
                              up(q), up(k), up(v))
            ref = rvjp(up(do))
            for i, scheme in enumerate(("kv", "q", "auto")):
                rows[-3 + i]["grad_rel_vs_ref"] = max(rel(a, b) for a, b in zip(grads[scheme], ref))
        del grads
    return rows


def print_table(rows):
    hdr = (f"{'G':>2} {'Hq':>3} {'Hkv':>3} {'S':>7} {'causal':>6} {'scheme':>6} {'->':>3} "
           f"{'MB sent':>9} {'formula':>9} {'bwd ms':>8} {'vs kv':>6} {'err ref':>8}")
    print(hdr)
    base = {}
    for r in rows:
        key = (r["devices"], r["q_heads"], r["kv_heads"], r["seq"], r["causal"])
        if r["scheme"] == "kv":
            base[key] = r["time_s"]
        err = r.get("grad_rel_vs_ref")
        print(f"{r['devices']:>2} {r['q_heads']:>3} {r['kv_heads']:>3} {r['seq']:>7} "
              f"{str(r['causal']):>6} {r['scheme']:>6} {r['resolved']:>3} "
              f"{r['bytes_per_device'] / 1e6:>9.2f} {r['formula_bytes'] / 1e6:>9.2f} "
              f"{r['time_s'] * 1e3:>8.2f} {r['time_s'] / base[key]:>6.2f} "
              f"{'' if err is None else f'{err:.1e}':>8}")


def plot(rows, path):
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for scheme, marker in (("kv", "o"), ("q", "s")):
        sel = [r for r in rows if r["scheme"] == scheme]
        labels = [f"G{r['devices']} {r['q_heads']}/{r['kv_heads']} {r['seq'] // 1024}k"
                  f"{' c' if r['causal'] else ''}" for r in sel]
        axes[0].plot(labels, [r["bytes_per_device"] / 1e6 for r in sel], marker, label=scheme)
        axes[1].plot(labels, [r["time_s"] * 1e3 for r in sel], marker, label=scheme)
    axes[0].set_ylabel("MB sent per device (backward)")
    axes[1].set_ylabel("backward time (ms)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=70, labelsize=7)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="default: gpu on GPUs, cpu otherwise")
    p.add_argument("--causal", choices=("no", "yes", "both"), default="no")
    p.add_argument("--kernel", choices=KERNELS, default=None,
                   help="local kernel (default: the preset's, xla)")
    p.add_argument("--devices", default=None, help="comma-separated device counts")
    p.add_argument("--seq", default=None, help="comma-separated sequence lengths")
    args = p.parse_args(argv)
    preset, cfg = choose_preset(PRESETS, args.preset)
    cfg = dict(cfg)
    if args.kernel:
        cfg["kernel"] = args.kernel
    for key in ("devices", "seq"):
        if getattr(args, key):
            cfg[key] = [int(x) for x in getattr(args, key).split(",")]
    if not any(G <= jax.device_count() for G in cfg["devices"]):
        p.error(f"--devices: none of {cfg['devices']} fits the {jax.device_count()} devices")
    info = env_info()
    print(f"# {info}")
    print(f"# preset {preset}: {cfg}")
    rows = []
    for causal in {"no": [False], "yes": [True], "both": [False, True]}[args.causal]:
        rows += run(cfg, causal)
    print_table(rows)
    d = out_dir()
    stem = f"backward_comm_{preset}" + ("" if cfg["kernel"] == "xla" else f"_{cfg['kernel']}")
    save_json({"env": info, "preset": preset, "config": cfg, "rows": rows},
              os.path.join(d, stem + ".json"))
    plot(rows, os.path.join(d, stem + ".png"))
    bad = [r for r in rows if r["bytes_per_device"] != r["formula_bytes"]
           or r.get("grad_rel_vs_kv", 0) > (2e-2 if r["dtype"] == "bfloat16" else 1e-5)
           or r.get("grad_rel_vs_ref", 0) > (2e-2 if r["dtype"] == "bfloat16" else 1e-5)]
    print("CHECKS:", "PASS" if not bad else f"FAIL ({len(bad)} rows)")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
