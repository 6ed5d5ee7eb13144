"""Which backend ``kernel="auto"`` should try first, per head dim, on model-shaped calls.

``kernels/base.py``'s ``AUTO_ORDER`` puts cuDNN first on the tiles it serves (dense and
aligned), from runs at D 128.  ``kernels.py pair`` showed ``pallas_mgpu`` ahead of cuDNN
at D 64 with a causal mask.  That was with one row of 16 heads calling the kernels
directly.  This script times what a model runs: ``jax_seqpar.attention`` on a one-device
mesh (the whole sequence is one aligned tile), on the batch, GQA and head counts of real
models, with each of ``--kernels`` named explicitly, and ``kernel="auto"`` beside them.

Per shape and mask: the forward and the forward + backward of each backend, on the wall
clock over ``--rounds`` rounds and on the device clock over ``--device-rounds``
(``_profile.device_rounds``), both in a fresh order each round; ratios to the first
kernel (cuDNN).  Every backend's output and gradients are compared with the first one's
(relative error; bf16 budget 2e-2 between two bf16 kernels).

    python benchmarks/auto_order.py                 # one Hopper GPU, ~4 minutes
    python benchmarks/auto_order.py --dry-run       # CPU, tiny, xla kernel only
"""

from __future__ import annotations

import argparse
import statistics
import time

import _setup  # noqa: F401

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_seqpar as jsp  # noqa: E402
from _profile import device_rounds  # noqa: E402
from _util import env_info, out_dir, rel, round_order, save_json  # noqa: E402
from kernels import attn_flops  # noqa: E402

#: (name, B, S, Hq, Hkv, D): SmolLM2-135M's heads (9 / 3, D 64) at 4k, 16k and 64k tokens
#: a row, 64k tokens a call; Llama-3-8B's (32 / 8, D 128) at 4k, 16k and 32k, 16-32k
#: tokens a call (its 64k call takes ~1 s, too long for a few minutes of rounds)
SHAPES = [
    ("smollm2 16x4k", 16, 4096, 9, 3, 64), ("smollm2 4x16k", 4, 16384, 9, 3, 64),
    ("smollm2 1x64k", 1, 65536, 9, 3, 64),
    ("llama8b 4x4k", 4, 4096, 32, 8, 128), ("llama8b 1x16k", 1, 16384, 32, 8, 128),
    ("llama8b 1x32k", 1, 32768, 32, 8, 128),
    # rows from 1k to 16k at D 128, 16k tokens a call: where the row length decides
    # (``--shapes`` picks them; GQA as Llama-3-8B, MHA as Llama-2-7B's 32 / 32 heads)
    ("llama8b 16x1k", 16, 1024, 32, 8, 128), ("llama8b 8x2k", 8, 2048, 32, 8, 128),
    ("llama8b 2x8k", 2, 8192, 32, 8, 128),
    ("llama2 8x2k", 8, 2048, 32, 32, 128), ("llama2 4x4k", 4, 4096, 32, 32, 128),
    ("llama2 2x8k", 2, 8192, 32, 32, 128), ("llama2 1x16k", 1, 16384, 32, 32, 128),
    # and at D 64 (SmolLM2's heads, 64k tokens a call)
    ("smollm2 64x1k", 64, 1024, 9, 3, 64), ("smollm2 32x2k", 32, 2048, 9, 3, 64),
]
DEFAULT_SHAPES = SHAPES[:6]
DRY_SHAPES = [("dry d64", 2, 64, 4, 2, 64), ("dry d128", 1, 64, 4, 4, 128)]
BUDGET = 2e-2


def _fns(mesh, kernel, causal, window=None):
    def f(q, k, v):
        return jsp.attention(q, k, v, mesh=mesh, causal=causal, window=window, kernel=kernel)

    def fb(q, k, v, do):
        o, vjp = jax.vjp(f, q, k, v)
        return (o, *vjp(do))
    return jax.jit(f), jax.jit(fb)


def window_flops(B, H, S, D, left):
    """Forward FLOPs of causal attention under a sliding window: query ``i`` sees keys
    ``i - left .. i`` (``min(i, left) + 1`` of them)."""
    visible = sum(min(i, left) + 1 for i in range(S))
    return 4 * B * H * D * visible


def run_shape(shape, kernels, causal, rounds, dev_rounds, mesh, window=None):
    """``window``: a sliding window ``(left, 0)`` on top of the causal mask, or None."""
    label, B, S, Hq, Hkv, D = shape
    keys = jax.random.split(jax.random.PRNGKey(S + D + B), 4)
    q = jax.random.normal(keys[0], (B, S, Hq, D), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, S, Hkv, D), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, S, Hkv, D), jnp.bfloat16)
    do = jax.random.normal(keys[3], (B, S, Hq, D), jnp.bfloat16)
    calls, outs = {}, {}
    for name in kernels:
        f, fb = _fns(mesh, name, causal, window)
        try:
            outs[name] = jax.block_until_ready(fb(q, k, v, do))
            jax.block_until_ready(f(q, k, v))
        except Exception as e:  # noqa: BLE001 - a backend that cannot serve is reported
            print(f"{label} causal={causal} {name}: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:120]}", flush=True)
            continue
        calls[f"{name} fwd"] = (f, (q, k, v))
        calls[f"{name} fwdbwd"] = (fb, (q, k, v, do))
    names = [n for n in kernels if n in outs]
    first = names[0]
    errs = {n: max(rel(a, b) for a, b in zip(outs[n], outs[first])) for n in names}
    del outs
    wall = {key: [] for key in calls}
    for r in range(rounds):
        for key in round_order(list(calls), r, seed=S + D):
            fn, args = calls[key]
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            wall[key].append(time.perf_counter() - t0)
    dev = device_rounds(calls, dev_rounds, seed=S + D + B)
    fl = (window_flops(B, Hq, S, D, window[0]) if window is not None
          else attn_flops(B, Hq, S, D, causal))
    rows = []
    for n in names:
        row = dict(shape=label, B=B, S=S, Hq=Hq, Hkv=Hkv, D=D, causal=causal,
                   window=None if window is None else list(window), kernel=n,
                   rel_err_vs_first=errs[n], ok=errs[n] <= BUDGET)
        for ph, mult in (("fwd", 1.0), ("fwdbwd", 3.5)):
            t = np.array(wall[f"{n} {ph}"])
            t0 = np.array(wall[f"{first} {ph}"])
            row[f"{ph}_ms"] = 1e3 * float(np.median(t))
            row[f"{ph}_tflops"] = mult * fl / float(np.median(t)) / 1e12
            row[f"{ph}_vs_first"] = float(np.median(t0 / t))
            if f"{n} {ph}" in dev:
                row[f"{ph}_device_ms"] = dev[f"{n} {ph}"]
                row[f"{ph}_vs_first_device"] = dev[f"{first} {ph}"] / dev[f"{n} {ph}"]
        rows.append(row)
        print(f"{label:15s} causal={causal!s:5s}"
              + (f" window={window[0]}" if window is not None else "")
              + f" {n:12s} fwd {row['fwd_tflops']:6.1f} TFLOP/s "
              f"({row['fwd_vs_first']:.3f}x)  fwd+bwd {row['fwdbwd_tflops']:6.1f} "
              f"({row['fwdbwd_vs_first']:.3f}x)"
              + (f"  device {row['fwd_vs_first_device']:.3f}x / "
                 f"{row['fwdbwd_vs_first_device']:.3f}x" if "fwdbwd_vs_first_device" in row
                 else "")
              + f"  err {errs[n]:.1e}{'' if row['ok'] else ' FAIL'}", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", default="cudnn,pallas_mgpu,tokamax,auto",
                   help="backends, the first is the ratios' denominator")
    p.add_argument("--shapes", default=None, help="names from SHAPES, comma-separated")
    p.add_argument("--masks", default="causal,none",
                   help="causal, none and/or window (causal with --window keys back)")
    p.add_argument("--window", type=int, default=2048,
                   help="the sliding window's left side for --masks window")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--device-rounds", type=int, default=5)
    p.add_argument("--dry-run", action="store_true", help="tiny, on CPU (xla kernel)")
    a = p.parse_args(argv)
    kernels = ["xla", "auto"] if a.dry_run else a.kernels.split(",")
    shapes = DRY_SHAPES if a.dry_run else DEFAULT_SHAPES
    if a.shapes:
        want = a.shapes.split(",")
        unknown = set(want) - {s[0] for s in SHAPES}
        if unknown:
            p.error(f"--shapes: unknown {sorted(unknown)}; known: {[s[0] for s in SHAPES]}")
        shapes = [s for s in SHAPES if s[0] in want]
    masks = a.masks.split(",")
    if set(masks) - {"causal", "none", "window"}:
        p.error(f"--masks takes causal, none and/or window, not {a.masks!r}")
    if a.window < 1:
        p.error(f"--window must be a positive number of keys, not {a.window}")
    rounds, dev_rounds = (2, 0) if a.dry_run else (a.rounds, a.device_rounds)
    mesh = jax.make_mesh((1,), ("sp",), devices=jax.devices()[:1])
    info = env_info()
    print(f"# {info}", flush=True)
    rows = []
    for shape in shapes:
        for m in masks:
            window = (a.window, 0) if m == "window" else None
            rows += run_shape(shape, kernels, m != "none", rounds, dev_rounds, mesh, window)
    ok = all(r["ok"] for r in rows)
    for D in sorted({r["D"] for r in rows}):
        for n in kernels[1:]:
            got = [r["fwdbwd_vs_first_device"] if "fwdbwd_vs_first_device" in r
                   else r["fwdbwd_vs_first"] for r in rows if r["D"] == D and r["kernel"] == n]
            if got:
                print(f"D {D} {n}: fwd+bwd vs {kernels[0]} median {statistics.median(got):.3f}x "
                      f"over {len(got)} cells", flush=True)
    save_json(dict(env=info, rows=rows, ok=ok), f"{out_dir()}/auto_order.json")
    print("CHECKS:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
