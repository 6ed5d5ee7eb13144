"""Where a packed causal fwd+bwd spends its time (issue 27), one H200: 64k and 16k tokens
in documents ~4k, H = 16, D = 128, bf16, through ``jax_seqpar.attention`` on a one-device
mesh against the Hopper kernel's forward and backward called alone, the tile lists
alone, and Hopper-kernel configurations (dQ paths, tile sizes), in alternating rounds
(a fresh order each round).  The runs of 2026-11-23 later also timed ``rows2`` /
``rows4`` (``MgpuConfig.rows_per_cta``, several key blocks per dK/dV CTA: commit
b93a8f5, reverted after; RESULTS.md, "Packed documents, third pass").
Runs: results/packed_breakdown_h200.json, packed_breakdown_2_h200.json (9 rounds;
"api fwd+bwd" then ran the split atomic dQ, the same configuration as "split_dq", and
was 8% slower), packed_rows_per_cta{,_2}_h200.json (fixed rotation) and
packed_shuffled_breakdown_h200.json (a fresh order each round).  In a fixed rotation
"api fwd+bwd" always ran right after cuDNN's 110 ms call and read 3-5% slower than the
same configuration elsewhere in the round; in a fresh order the two agree to 0.3%.

Three clocks (RESULTS.md, "fourth pass"): every function once per round, synchronised
(wall clock); ``--sustained-ms``: runs of back-to-back calls of about that length;
``--device-rounds``: rounds under the profiler, timed by the device's kernel spans
(``_profile.device_rounds``).  The SM clock and board power of each function's calls
are sampled alongside (``_util.ClockSampler``); ``--profile`` lists the kernels of one
public packed call.

    python benchmarks/packed_breakdown.py      # one H200, ~2 minutes
    python benchmarks/packed_breakdown.py --variants two_kernel_dq,split_dq --rounds 15
    python benchmarks/packed_breakdown.py --sizes 65536 --variants split_dq \
        --sustained-ms 300 --device-rounds 9 --profile
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import traceback

import _setup  # noqa: F401

import jax
import jax.numpy as jnp
import numpy as np

import jax_seqpar as jsp
from jax_seqpar.kernels import PallasMgpuKernel
from jax_seqpar.kernels.pallas_common import segment_lists_args, tile_lists
from jax_seqpar.kernels.pallas_mgpu import DEFAULT_MGPU_CONFIGS
from jax_seqpar.masks import MaskSpec
from _profile import device_rounds as device_rounds_
from _util import ClockSampler, timed_rounds
from packed import lognormal_lengths, packed_ids, useful_pairs

OUT = os.environ.get("OUT", "/tmp")
res = {"jax": jax.__version__, "device": str(jax.devices()[0]), "rows": [], "notes": []}
H, D = 16, 128
SCALE = D ** -0.5
MASK = MaskSpec(causal=True)


def note(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    res["notes"].append(s)


def inputs(S):
    ks = jax.random.split(jax.random.PRNGKey(S), 4)
    q, k, v, do = (jax.random.normal(kk, (1, S, H, D), jnp.bfloat16) for kk in ks)
    lens = lognormal_lengths(4096, S, seed=S + 4096)
    seg = jnp.asarray(packed_ids(lens, S)[None])
    return q, k, v, do, seg


def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def breakdown(S, names, rounds, sustained_ms=0.0, profile=False, device_rounds=0):
    """Time the calls above at ``S`` tokens, with the Hopper-kernel configurations
    ``names`` (of ``VARIANTS``), over ``rounds`` rounds; with ``sustained_ms`` also
    time each function in runs of back-to-back calls of about that many milliseconds;
    with ``device_rounds`` time that many rounds on the device's clock (``_profile.
    device_rounds``); with ``profile`` list the device kernels of one public packed call."""
    q, k, v, do, seg = inputs(S)
    pos = jnp.arange(S, dtype=jnp.int32)
    useful = 3.5 * 2 * H * D * useful_pairs(np.asarray(seg[0]))
    mesh = jax.make_mesh((1,), ("sp",), devices=jax.devices()[:1])
    kern = PallasMgpuKernel()
    try:  # the kernel's own forward, for "kernel bwd" (fails off Hopper: rows skipped)
        o, lse = jax.jit(lambda q, k, v, s: kern.fwd(q, k, v, pos, pos, MASK, SCALE, s, s))(
            q, k, v, seg)
    except Exception as e:
        note(f"S={S} kernel forward FAILED {type(e).__name__}: {str(e)[:200]}")
        o = lse = None

    def api(kernel):
        def f(q, k, v, s):
            return jsp.attention(q, k, v, mesh=mesh, causal=True, segment_ids=s, kernel=kernel)
        return f

    def cudnn_full(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    fns = {
        "cudnn unpacked fwd+bwd": jax.jit(lambda q, k, v, do, s: jax.vjp(cudnn_full, q, k, v)[1](do)),
        "api fwd+bwd": jax.jit(lambda q, k, v, do, s: jax.vjp(lambda *a: api("auto")(*a, s),
                                                              q, k, v)[1](do)),
        "api fwd": jax.jit(lambda q, k, v, do, s: api("auto")(q, k, v, s)),
        "kernel fwd": jax.jit(lambda q, k, v, do, s: kern.fwd(q, k, v, pos, pos, MASK, SCALE,
                                                              s, s)),
        "kernel bwd": jax.jit(lambda q, k, v, do, s: kern.bwd(q, k, v, o, lse, do, pos, pos,
                                                              MASK, SCALE, s, s)),
    }
    cfg = DEFAULT_MGPU_CONFIGS[D]

    def lists(s):
        sp = segment_lists_args(s, s, True)
        pb = jnp.broadcast_to(pos, (1, S))
        a = tile_lists(MASK, pb, pos, S, 2 * cfg.block_q, cfg.block_kv, True, **sp)
        b = tile_lists(MASK, pb, pos, S, cfg.block_q_bwd, 2 * cfg.block_kv_bwd, True,
                       transpose=True, **sp)
        c = tile_lists(MASK, pb, pos, S, 2 * cfg.block_q_bwd, cfg.block_kv_dq, True, **sp)
        return a, b, c
    fns["tile lists x3"] = jax.jit(lambda q, k, v, do, s: lists(s))
    every = {
        "two_kernel_dq": cfg,
        "split_dq": dataclasses.replace(cfg, atomic_dq=True, split_dq=True),
        "overlap_bwd": dataclasses.replace(cfg, overlap_bwd=True),
        "no_overlap": dataclasses.replace(cfg, overlap_bwd=False),
        "dq_kv64": dataclasses.replace(cfg, block_kv_dq=64),
        "fwd_kv64_s4": dataclasses.replace(cfg, block_kv=64, num_stages=4),
        "dq_kv64_fwd_kv64_s4": dataclasses.replace(cfg, block_kv_dq=64, block_kv=64,
                                                   num_stages=4),
    }
    variants = {n: every[n] for n in names}
    for name, c in variants.items():
        kv = PallasMgpuKernel(config=c)
        fns[f"api fwd+bwd {name}"] = jax.jit(
            lambda q, k, v, do, s, kv=kv: jax.vjp(lambda *a: api(kv)(*a, s), q, k, v)[1](do))
    ok = {}
    for n, fn in fns.items():
        try:
            jax.block_until_ready(fn(q, k, v, do, seg))
            ok[n] = fn
        except Exception as e:
            note(f"S={S} {n} FAILED {type(e).__name__}: {str(e)[:300]}")
    args = (q, k, v, do, seg)
    calls = {n: (f, args) for n, f in ok.items()}
    for f, a in calls.values():  # warm
        jax.block_until_ready(f(*a))
    modes = [("single", None)]
    if sustained_ms:
        single = timed_rounds(calls, 1)
        modes.append(("sustained", {n: max(1, round(sustained_ms / single[n]["ms"]))
                                    for n in ok}))
    for mode, reps in modes:
        with ClockSampler() as clk:
            ms = timed_rounds(calls, rounds, reps, clock=clk)
        base = ms.get("cudnn unpacked fwd+bwd", {}).get("ms")
        for n, m in ms.items():
            t = m["ms"]
            row = dict(S=S, name=n, timing=mode, **m)
            if n.startswith("api fwd+bwd") and base:
                row["useful_vs_cudnn"] = (useful / t) / (3.5 * 2 * H * D * float(S) ** 2 / base)
            res["rows"].append(row)
            clock = (f"  {m['sm_mhz']:6.0f} MHz {m['power_w']:5.0f} W"
                     if m["sm_mhz"] is not None else "")
            note(f"S={S} {mode:9s} x{row['calls']:<3d} {n:28s} {t:8.3f} ms{clock}"
                 + (f"  useful/cuDNN {100 * row['useful_vs_cudnn']:.1f}%"
                    if "useful_vs_cudnn" in row else ""))
    if device_rounds:
        dev = device_rounds_(calls, device_rounds, seed=S)
        base = dev.get("cudnn unpacked fwd+bwd")
        for n, t in dev.items():
            row = dict(S=S, name=n, timing="device", calls=1, ms=t)
            if n.startswith("api fwd+bwd") and base:
                row["useful_vs_cudnn"] = (useful / t) / (3.5 * 2 * H * D * float(S) ** 2 / base)
            res["rows"].append(row)
            note(f"S={S} {'device':9s} x1   {n:28s} {t:8.3f} ms"
                 + (f"  useful/cuDNN {100 * row['useful_vs_cudnn']:.1f}%"
                    if "useful_vs_cudnn" in row else ""))
    if profile and "api fwd+bwd" in ok:
        from _profile import profile_timeline
        fn = ok["api fwd+bwd"]
        tl = profile_timeline(lambda: jax.block_until_ready(fn(*args)),
                              f"/tmp/jsp_trace_{S}")
        res["timeline_" + str(S)] = tl
        if not tl:
            note(f"S={S} profile: no device kernels in the trace")
            return
        note(f"S={S} profile of one 'api fwd+bwd': {len(tl)} kernels, span "
             f"{(tl[-1][1] + tl[-1][2]) / 1e3:.3f} ms, busy "
             f"{sum(d for _, _, d in tl) / 1e3:.3f} ms")
        for name, start, dur in tl:
            note(f"    {start / 1e3:8.3f} ms  {dur:9.1f} us  {name[:110]}")
    # check the variants' gradients against the default
    g0 = ok["api fwd+bwd"](q, k, v, do, seg)
    for n in ok:
        if n.startswith("api fwd+bwd "):
            g = ok[n](q, k, v, do, seg)
            note(f"  {n}: rel err vs default dq {rel(g[0], g0[0]):.2e} dk {rel(g[1], g0[1]):.2e}"
                 f" dv {rel(g[2], g0[2]):.2e}")


VARIANTS = ["two_kernel_dq", "split_dq", "overlap_bwd", "no_overlap", "dq_kv64", "fwd_kv64_s4",
            "dq_kv64_fwd_kv64_s4"]


def main():
    import argparse
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"Hopper-kernel configurations to time, of {VARIANTS}")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--sustained-ms", type=float, default=0.0,
                   help="also time runs of back-to-back calls of about this many ms")
    p.add_argument("--device-rounds", type=int, default=0,
                   help="also time this many rounds on the device's clock (profiler)")
    p.add_argument("--profile", action="store_true",
                   help="list the device kernels of one public packed call")
    p.add_argument("--sizes", default="65536,16384")
    args = p.parse_args()
    unknown = {n for n in args.variants.split(",") if n} - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {sorted(unknown)}")
    for S in (int(x) for x in args.sizes.split(",")):
        try:
            breakdown(S, [n for n in args.variants.split(",") if n], args.rounds,
                      args.sustained_ms, args.profile, args.device_rounds)
        except Exception:
            traceback.print_exc()
    with open(os.path.join(OUT, "packed_breakdown.json"), "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
