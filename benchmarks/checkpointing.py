"""Activation checkpointing of the Llama-style model: memory vs time.

Four ways to run forward + backward of the same model and batch:

* ``none``: no rematerialisation (every activation kept);
* ``full``: ``jax.checkpoint`` per block, saving only the block inputs (the attention
  forward runs again in the backward);
* ``attention``: remat-aware policy (DistFlashAttn §3.3): also keep each block's
  attention output and lse, so the attention forward never runs again;
* ``seq_selective``: sequence-level selective checkpointing (BurstEngine §3.2): keep them
  for the later half of each shard only, re-run the earlier rows' ring pass.

For each: the activations kept from the forward for the backward (the ``vjp``
residuals with a sequence axis, per device: what a policy trades), the compiled
program's per-device temporary memory (XLA memory analysis: those plus every work
buffer, without parameters and inputs), the step time (median),
the ring forward passes per layer counted in the program's jaxpr
(``layers.remat.ring_transfer_counts``), and the largest gradient difference from ``none``.
Saves JSON and a PNG.

    python benchmarks/checkpointing.py                # CPU: 8 simulated devices
    python benchmarks/checkpointing.py --preset gpu   # the GPUs present, 128k tokens
"""

from __future__ import annotations

import argparse
import os
import sys

import _setup  # noqa: F401,E402  (before JAX: device count, sys.path)

import jax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

from jax_seqpar.kernels import XlaKernel  # noqa: E402
from jax_seqpar.models import Llama, LlamaConfig, next_token_loss  # noqa: E402
from jax_seqpar.layers.remat import ring_transfer_counts  # noqa: E402
from _util import (choose_preset, env_info, out_dir, progress, pyplot, rel,  # noqa: E402
                   save_json, time_fn)

MODES = ("none", "full", "attention", "seq_selective")
PRESETS = {
    "cpu": dict(devices=8, seq=8192, batch=1, d_model=128, layers=4, heads=8, kv_heads=2,
                vocab=256, dtype="float32", kernel="xla", block=512, layout="zigzag",
                repeats=5),
    "gpu": dict(devices=None, seq=131072, batch=1, d_model=1024, layers=4, heads=16,
                kv_heads=4, vocab=32000, dtype="bfloat16", kernel="pallas", block=None,
                layout="zigzag", repeats=5),
}


def build(cfg, mesh, mode):
    conf = LlamaConfig(vocab_size=cfg["vocab"], d_model=cfg["d_model"],
                       num_layers=cfg["layers"], num_heads=cfg["heads"],
                       num_kv_heads=cfg["kv_heads"], dtype=cfg["dtype"], remat=mode)
    kernel = cfg["kernel"]
    if kernel == "xla" and cfg["block"]:
        kernel = XlaKernel(block_q=cfg["block"], block_k=cfg["block"])
    model = Llama(conf, mesh=mesh, layout=cfg["layout"], kernel=kernel)
    return model, lambda p, t: next_token_loss(model, p, t)[0]


def passes_per_layer(loss, params, toks):
    """Ring forward passes per layer: (run in the forward, re-run in the backward).

    A row group of ``seq_selective`` (half of each shard's queries) counts as half a pass."""
    def passes(n, phase):
        return n[("fwd", phase)] + (n[("fwd_early", phase)] + n[("fwd_late", phase)]) / 2

    one = passes(ring_transfer_counts(loss, params, toks), "forward")  # one per layer
    if not one:  # a single device: no ring transfers to count
        return None, None
    n = ring_transfer_counts(jax.value_and_grad(loss), params, toks)
    return tuple(round(passes(n, phase) / one, 2) for phase in ("forward", "backward"))


def residual_mb(loss, params, toks, G):
    """MB per device of the activations kept from the forward for the backward.

    The residuals are the leaves of the ``vjp`` closure (shapes only, via ``eval_shape``);
    leaves shaped like a parameter are the weights the backward needs (the same in every
    mode), the rest are activations, split over the ``G`` devices."""
    tree = jax.eval_shape(lambda p: jax.vjp(lambda q: loss(q, toks), p)[1], params)
    weights = {x.shape for x in jax.tree.leaves(params)}
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)
               if x.shape not in weights) / G / 2**20


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--seq", type=int, default=None, help="override the preset's length")
    p.add_argument("--kernel", default=None, help="override the preset's kernel")
    args = p.parse_args()
    preset, cfg = choose_preset(PRESETS, args.preset)
    cfg = dict(cfg, **{k: v for k, v in (("seq", args.seq), ("kernel", args.kernel)) if v})
    G = min(cfg["devices"] or jax.device_count(), jax.device_count())
    mesh = jax.make_mesh((G,), ("sp",), devices=jax.devices()[:G],
                         axis_types=(AxisType.Auto,))
    info = env_info()
    print(f"# {info}\n# preset {preset}: {cfg}, G={G}")
    toks = jax.random.randint(jax.random.key(0), (cfg["batch"], cfg["seq"]), 0, cfg["vocab"])
    params = None
    rows, ref = [], None
    for mode in progress(MODES, desc="modes"):
        model, loss = build(cfg, mesh, mode)
        if params is None:
            params = jax.jit(model.init)(jax.random.key(1), toks[:, :2 * G])
        step = jax.jit(jax.value_and_grad(loss))
        compiled = step.lower(params, toks).compile()
        mem = compiled.memory_analysis()
        t = time_fn(compiled, params, toks, warmup=1, repeats=cfg["repeats"])
        val, grads = compiled(params, toks)
        flat = jax.tree.leaves(grads)
        if ref is None:
            ref = (val, flat)
        err = max([rel(a, b) for a, b in zip(flat, ref[1])] + [rel(val, ref[0])])
        fwd, again = passes_per_layer(loss, params, toks)
        rows.append(dict(mode=mode, resid_mb=residual_mb(loss, params, toks, G),
                         temp_mb=mem.temp_size_in_bytes / 2**20,
                         arg_mb=mem.argument_size_in_bytes / 2**20, time_s=t["median_s"],
                         min_s=t["min_s"], attn_passes_fwd=fwd, attn_passes_rerun=again,
                         loss=float(val), max_rel_err_vs_none=err))
        print(f"  {mode}: {rows[-1]}", flush=True)
    base = rows[0]
    print(f"\n{'mode':<14}{'saved MB/dev':>13}{'temp MB/dev':>12}{'vs none':>9}{'step s':>9}"
          f"{'vs none':>9}{'attn fwd/layer':>16}{'re-run':>8}{'err':>10}")
    for r in rows:
        print(f"{r['mode']:<14}{r['resid_mb']:>13.2f}{r['temp_mb']:>12.1f}"
              f"{r['temp_mb'] / base['temp_mb']:>9.2f}"
              f"{r['time_s']:>9.3f}{r['time_s'] / base['time_s']:>9.2f}"
              f"{_num(r['attn_passes_fwd']):>16}{_num(r['attn_passes_rerun']):>8}"
              f"{r['max_rel_err_vs_none']:>10.1e}")
    d = out_dir()
    save_json({"env": info, "preset": preset, "config": cfg, "devices": G, "rows": rows},
              os.path.join(d, f"checkpointing_{preset}.json"))
    plot(rows, os.path.join(d, f"checkpointing_{preset}.png"))
    tol = 2e-2 if cfg["dtype"] == "bfloat16" else 1e-5
    ok = all(r["max_rel_err_vs_none"] <= tol for r in rows)
    print("CHECKS:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def _num(x):
    return "n/a" if x is None else f"{x:.2f}"


def plot(rows, path):
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for r in rows:
        ax.scatter(r["resid_mb"], r["time_s"], s=40)
        ax.annotate(r["mode"], (r["resid_mb"], r["time_s"]), textcoords="offset points",
                    xytext=(5, 5))
    ax.set_xlabel("activations saved for the backward, per device (MB)")
    ax.set_ylabel("forward + backward step (s)")
    ax.set_title("activation checkpointing: memory vs time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
