"""cuDNN tiles through the kernel contract: GPU check, tile speed, ring speed (issue 16).

Phases (``--phases``, comma-separated; default ``check,tile,ring`` on GPUs):

* ``check``: the ``cudnn`` backend against the float32 reference on every tile kind it
  serves -- dense (``Tq != Tk``), aligned causal, aligned causal window, GQA -- for
  bf16 / f16 and head dims 64 / 128 / 256: outputs, lse, and gradients from the given
  (reference) ``o`` and ``lse``; plus a tile that is half of a larger attention (its
  backward from the *global* ``o`` and ``lse``, as a ring step calls it).  With several
  GPUs also ring attention with ``kernel="cudnn"`` and ``"auto"`` against
  ``kernel="xla"``: zigzag and contiguous causal, non-causal, both backwards, GQA.
* ``tile``: S = 16k, B = 1, H = 16, D = 128, bf16: forward and forward+backward of the
  cudnn tile through the contract (``parallel.local.local_attention``) against a direct
  ``jax.nn.dot_product_attention(implementation="cudnn")`` call, and the Pallas tile,
  causal and not, in one run.
* ``pair``: forward only, the contract's cudnn tile and the direct call timed
  alternately (ABAB...) with the median ratio, and whether both compiled programs hold
  the same cuDNN custom call (sequential timing rounds drift by more than 5%).
* ``ring``: forward+backward of ``jsp.attention`` on all GPUs (zigzag causal and
  non-causal, ``--ring-seqs``), ``kernel`` in {pallas, cudnn, auto}, ``backward`` in
  {kv, q} for cudnn, against one GPU running cuDNN (``jax.nn``) on the whole sequence:
  the speedup a user sees.

    python benchmarks/cudnn_tiles.py                    # on GPUs: all phases
    python benchmarks/cudnn_tiles.py --phases check     # CPU: refuses (cuDNN is GPU-only)
    python benchmarks/cudnn_tiles.py --plot benchmarks/results/cudnn_tiles_gpu2_x2.json \
        benchmarks/results/cudnn_tiles_gpu4_x4.json      # table + PNG from saved runs
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import _setup  # noqa: F401,E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_seqpar as jsp  # noqa: E402
from jax_seqpar.kernels.base import TILE_ALIGNED, TILE_DENSE, KernelRequest  # noqa: E402
from jax_seqpar.kernels.cudnn import CudnnKernel  # noqa: E402
from jax_seqpar.kernels.tiles import TileKernels  # noqa: E402
from jax_seqpar.masks import MaskSpec  # noqa: E402
from jax_seqpar.parallel.common import AttnConfig  # noqa: E402
from jax_seqpar.parallel.local import local_attention  # noqa: E402
from jax_seqpar.reference import reference_attention  # noqa: E402
from _util import env_info, out_dir, pyplot, save_json, time_fn  # noqa: E402

BUDGET = 2e-2  # bf16 / f16 (docs/ARCHITECTURE.md, numerics)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ok = np.isfinite(b)
    n = np.linalg.norm(np.where(ok, b, 0))
    return float(np.linalg.norm(np.where(ok, a - b, 0)) / (n if n > 0 else 1.0))


def _qkv(seed, B, Tq, Tk, Hq, Hkv, D, dtype):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (B, Tq, Hq, D), dtype)
    k = jax.random.normal(ks[1], (B, Tk, Hkv, D), dtype)
    v = jax.random.normal(ks[2], (B, Tk, Hkv, D), dtype)
    do = jax.random.normal(ks[3], (B, Tq, Hq, D), dtype)
    return q, k, v, do


def _ref(q, k, v, q_pos, kv_pos, mask, scale):
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return reference_attention(f32(q), f32(k), f32(v), q_pos=q_pos, kv_pos=kv_pos,
                               causal=mask.causal, window=mask.window, scale=scale)


# ---------------------------------------------------------------------------- check
TILE_CASES = {
    # name: (B, Tq, Tk, Hq, Hkv, tile, mask)
    "dense": (2, 256, 384, 4, 4, TILE_DENSE, MaskSpec()),
    "dense_gqa": (1, 384, 256, 8, 2, TILE_DENSE, MaskSpec()),
    "aligned_causal": (2, 256, 256, 4, 4, TILE_ALIGNED, MaskSpec(causal=True)),
    "aligned_causal_mqa": (1, 320, 320, 4, 1, TILE_ALIGNED, MaskSpec(causal=True)),
    "aligned_window": (1, 384, 384, 4, 2, TILE_ALIGNED, MaskSpec(causal=True, window=(70, 0))),
}


def check_tiles(dims, dtypes):
    rows = []
    kern = CudnnKernel()
    for (name, (B, Tq, Tk, Hq, Hkv, tile, mask)), D, dt in itertools.product(
            TILE_CASES.items(), dims, dtypes):
        dtype = jnp.dtype(dt)
        q, k, v, do = _qkv(D + Tq, B, Tq, Tk, Hq, Hkv, D, dtype)
        pos = jnp.arange(Tq, dtype=jnp.int32)
        kv_pos = jnp.arange(Tk, dtype=jnp.int32)
        scale = D ** -0.5
        row = dict(case=name, D=D, dtype=dt)
        try:
            ro, rl = _ref(q, k, v, pos, kv_pos, mask, scale)
            _, vjp = jax.vjp(lambda q, k, v: _ref(q, k, v, pos, kv_pos, mask, scale)[0],
                             q.astype(jnp.float32), k.astype(jnp.float32),
                             v.astype(jnp.float32))
            rg = vjp(do.astype(jnp.float32))
            fwd = jax.jit(lambda q, k, v: kern.fwd(q, k, v, pos, kv_pos, mask, scale,
                                                   tile=tile))
            o, lse = fwd(q, k, v)
            bwd = jax.jit(lambda q, k, v, o, lse, do: kern.bwd(
                q, k, v, o, lse, do, pos, kv_pos, mask, scale, tile=tile))
            g = bwd(q, k, v, ro.astype(dtype), rl, do)
            row.update(err_out=_rel(o, ro), err_lse=_rel(lse, rl),
                       err_grads=max(_rel(a, b) for a, b in zip(g, rg)))
            row["ok"] = max(row["err_out"], row["err_lse"], row["err_grads"]) <= BUDGET
        except Exception as e:
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
        print(f"check {name:20s} D={D:3d} {dt:8s} "
              + (f"out {row['err_out']:.1e} lse {row['err_lse']:.1e} grads "
                 f"{row['err_grads']:.1e}" if "err_out" in row else row.get("error", ""))
              + ("" if row["ok"] else "  FAIL"), flush=True)
    return rows


def check_split(D=128, dtype=jnp.bfloat16):
    """A dense tile that is half of a larger attention: backward from the global o, lse."""
    kern = CudnnKernel()
    B, Tq, Tk, H = 1, 256, 512, 4
    q, k, v, do = _qkv(11, B, Tq, Tk, H, H, D, dtype)
    pos, kv_pos = jnp.arange(Tq, dtype=jnp.int32), jnp.arange(Tk, dtype=jnp.int32)
    scale, mask = D ** -0.5, MaskSpec()
    ro, rl = _ref(q, k, v, pos, kv_pos, mask, scale)
    _, vjp = jax.vjp(lambda q, k, v: _ref(q, k, v, pos, kv_pos, mask, scale)[0],
                     *(x.astype(jnp.float32) for x in (q, k, v)))
    rq, rk, rv = vjp(do.astype(jnp.float32))
    h = Tk // 2
    parts = [kern.bwd(q, k[:, s], v[:, s], ro.astype(dtype), rl, do, pos, kv_pos[s], mask,
                      scale, tile=TILE_DENSE) for s in (slice(0, h), slice(h, Tk))]
    dq = parts[0][0] + parts[1][0]
    dk = jnp.concatenate([parts[0][1], parts[1][1]], axis=1)
    dv = jnp.concatenate([parts[0][2], parts[1][2]], axis=1)
    err = max(_rel(dq, rq), _rel(dk, rk), _rel(dv, rv))
    print(f"check split-tile backward from global o/lse: {err:.1e}", flush=True)
    return [dict(case="split_global_o_lse", D=D, dtype=str(jnp.dtype(dtype)), err_grads=err,
                 ok=err <= BUDGET)]


def check_ring(G):
    rows = []
    mesh = jax.make_mesh((G,), ("sp",))
    S, B, D = 2048 * G, 1, 128
    for causal, layout, backward, (Hq, Hkv) in [
            (True, "zigzag", "kv", (8, 2)), (True, "zigzag", "q", (4, 4)),
            (True, "contiguous", "kv", (4, 4)), (True, "contiguous", "q", (8, 2)),
            (False, "zigzag", "q", (4, 4)), (False, "contiguous", "kv", (8, 1))]:
        q, k, v, do = _qkv(G + Hq, B, S, S, Hq, Hkv, D, jnp.bfloat16)
        res = {}
        for kernel in ("xla", "cudnn", "auto"):
            f = lambda q, k, v: jsp.attention(q, k, v, mesh=mesh, causal=causal,  # noqa
                                              layout=layout, backward=backward, kernel=kernel)
            try:
                out, vjp = jax.vjp(f, q, k, v)
                res[kernel] = (out, vjp(do))
            except Exception as e:
                res[kernel] = e
        base = res["xla"]
        for kernel in ("cudnn", "auto"):
            row = dict(case="ring", G=G, causal=causal, layout=layout, backward=backward,
                       Hq=Hq, Hkv=Hkv, kernel=kernel)
            r = res[kernel]
            if isinstance(r, Exception) or isinstance(base, Exception):
                e = r if isinstance(r, Exception) else base
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            else:
                row["err_out"] = _rel(r[0], base[0])
                row["err_grads"] = max(_rel(a, b) for a, b in zip(r[1], base[1]))
                row["ok"] = max(row["err_out"], row["err_grads"]) <= BUDGET
            rows.append(row)
            print(f"check ring G={G} causal={causal!s:5s} {layout:10s} bwd={backward} "
                  f"Hq/Hkv={Hq}/{Hkv} {kernel:5s} "
                  + (f"out {row['err_out']:.1e} grads {row['err_grads']:.1e}"
                     if "err_out" in row else row["error"])
                  + ("" if row["ok"] else "  FAIL"), flush=True)
    return rows


# ---------------------------------------------------------------------------- speed
def attn_flops(B, H, S, D, causal):
    f = 4 * B * H * S * S * D
    return f / 2 if causal else f


def _direct(causal, scale):
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, scale=scale, implementation="cudnn")


def _direct_lse(causal, scale):
    """The direct call asked for its softmax statistics too, as a ring tile needs them."""
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, scale=scale, implementation="cudnn",
        return_residual=True)[0]


def _contract(kernel, causal, scale, S):
    req = KernelRequest(platform="gpu", dtype="bfloat16", head_dim=128,
                        mask=MaskSpec(causal=causal))
    cfg = AttnConfig(axis_name="sp", mask=MaskSpec(causal=causal), scale=scale,
                     kernel=TileKernels(kernel, req))
    pos = jnp.arange(S, dtype=jnp.int32)
    tile = TILE_ALIGNED if causal else TILE_DENSE
    return lambda q, k, v: local_attention(cfg, q, k, v, pos, pos, tile=tile)


def bench_tile(S=16384, H=16, D=128, repeats=5, rounds=2):
    """Contract vs direct cuDNN and Pallas.  The variants are compiled once and timed in
    turn, ``rounds`` times; each round gives each variant's ratio to the direct call
    timed in the same round, and the rows report the median ratio over rounds (GPU
    clocks drift between rounds by more than the differences measured here)."""
    rows = []
    q, k, v, do = _qkv(3, 1, S, S, H, H, D, jnp.bfloat16)
    scale = D ** -0.5
    for causal in (False, True):
        fl = attn_flops(1, H, S, D, causal)
        fns = {"cudnn_direct": _direct(causal, scale),
               "cudnn_direct_lse": _direct_lse(causal, scale),
               "cudnn_contract": _contract("cudnn", causal, scale, S),
               "pallas_contract": _contract("pallas", causal, scale, S)}
        compiled = {}
        for n, f in fns.items():
            try:
                fwd = jax.jit(f)
                fb = jax.jit(lambda q, k, v, do, f=f: jax.vjp(f, q, k, v)[1](do))
                jax.block_until_ready(fwd(q, k, v))
                jax.block_until_ready(fb(q, k, v, do))
                compiled[n] = (fwd, fb)
            except Exception as e:
                print(f"tile {n} causal={causal}: {type(e).__name__}: {str(e)[:200]}")
        times = {n: [] for n in compiled}
        for _ in range(rounds):
            for n, (fwd, fb) in compiled.items():
                times[n].append((time_fn(fwd, q, k, v, warmup=1, repeats=repeats)["median_s"],
                                 time_fn(fb, q, k, v, do, warmup=1,
                                         repeats=repeats)["median_s"]))
        base = times.get("cudnn_direct")
        for n, ts in times.items():
            tf = float(np.median([t[0] for t in ts]))
            tb = float(np.median([t[1] for t in ts]))
            row = dict(S=S, H=H, D=D, causal=causal, kernel=n, rounds=rounds, fwd_s=tf,
                       fwdbwd_s=tb, fwd_s_all=[t[0] for t in ts],
                       fwdbwd_s_all=[t[1] for t in ts], fwd_tflops=fl / tf / 1e12,
                       fwdbwd_tflops=3.5 * fl / tb / 1e12)
            if base:
                rf = [b[0] / t[0] for b, t in zip(base, ts)]
                rb = [b[1] / t[1] for b, t in zip(base, ts)]
                row.update(fwd_vs_direct=float(np.median(rf)), fwd_vs_direct_range=(
                    min(rf), max(rf)), fwdbwd_vs_direct=float(np.median(rb)),
                    fwdbwd_vs_direct_range=(min(rb), max(rb)))
            rows.append(row)
            print(f"tile S={S} causal={causal!s:5s} {n:16s} fwd {row['fwd_tflops']:6.1f} "
                  f"TFLOP/s ({row.get('fwd_vs_direct', 0):.3f}x direct, rounds "
                  f"{row.get('fwd_vs_direct_range', (0, 0))[0]:.3f}-"
                  f"{row.get('fwd_vs_direct_range', (0, 0))[1]:.3f})  fwd+bwd "
                  f"{row['fwdbwd_tflops']:6.1f} ({row.get('fwdbwd_vs_direct', 0):.3f}x, "
                  f"{row.get('fwdbwd_vs_direct_range', (0, 0))[0]:.3f}-"
                  f"{row.get('fwdbwd_vs_direct_range', (0, 0))[1]:.3f})", flush=True)
    return rows


def bench_pair(S=16384, H=16, D=128, pairs=40):
    """Forward: the cudnn tile through the contract against the direct ``jax.nn`` call,
    timed alternately (ABAB..., then BABA...) so that clock drift hits both alike; also
    whether the two compiled programs hold the same cuDNN custom call."""
    import re
    import time

    rows = []
    q, k, v, _ = _qkv(3, 1, S, S, H, H, D, jnp.bfloat16)
    for causal in (False, True):
        fns = {"direct": jax.jit(_direct(causal, D ** -0.5)),
               "contract": jax.jit(_contract("cudnn", causal, D ** -0.5, S))}
        calls = {}
        for n, f in fns.items():
            txt = f.lower(q, k, v).compile().as_text()
            calls[n] = sorted(re.sub(r"%[\w.\-]+", "%", re.sub(
                r"metadata=\{.*?\}", "", line.split("=", 1)[1])).strip()
                for line in txt.splitlines() if "custom-call(" in line)
            jax.block_until_ready(f(q, k, v))
        ts = {n: [] for n in fns}
        for i in range(pairs):
            order = ("direct", "contract") if i % 2 == 0 else ("contract", "direct")
            for n in order:
                t0 = time.perf_counter()
                jax.block_until_ready(fns[n](q, k, v))
                ts[n].append(time.perf_counter() - t0)
        ratio = np.array(ts["direct"]) / np.array(ts["contract"])
        row = dict(S=S, H=H, D=D, causal=causal, pairs=pairs,
                   direct_ms=1e3 * float(np.median(ts["direct"])),
                   contract_ms=1e3 * float(np.median(ts["contract"])),
                   fwd_vs_direct=float(np.median(ratio)),
                   fwd_vs_direct_quartiles=(float(np.percentile(ratio, 25)),
                                            float(np.percentile(ratio, 75))),
                   same_custom_calls=calls["direct"] == calls["contract"],
                   custom_calls=len(calls["contract"]))
        rows.append(row)
        print(f"pair S={S} causal={causal!s:5s} direct {row['direct_ms']:.3f} ms, contract "
              f"{row['contract_ms']:.3f} ms: contract at {row['fwd_vs_direct']:.3f}x direct "
              f"(quartiles {row['fwd_vs_direct_quartiles'][0]:.3f}-"
              f"{row['fwd_vs_direct_quartiles'][1]:.3f}); same cuDNN call: "
              f"{row['same_custom_calls']}", flush=True)
    return rows


def bench_ring(seqs, H=16, D=128, repeats=5):
    G = jax.device_count()
    mesh = jax.make_mesh((G,), ("sp",))
    rows = []
    for S, causal in itertools.product(seqs, (True, False)):
        q, k, v, do = _qkv(5, 1, S, S, H, H, D, jnp.bfloat16)
        fl = 3.5 * attn_flops(1, H, S, D, causal)
        # long sequences: seconds per call, so fewer repeats (the spread is small there)
        reps = dict(warmup=2, repeats=repeats) if S <= 131072 else dict(warmup=1, repeats=2)
        try:
            fb1 = jax.jit(lambda q, k, v, do, c=causal: jax.vjp(
                _direct(c, D ** -0.5), q, k, v)[1](do))
            t1 = time_fn(fb1, q, k, v, do, **reps)["median_s"]
        except Exception as e:  # e.g. out of memory on one GPU
            print(f"ring S={S}: one-GPU cuDNN failed: {type(e).__name__}: {str(e)[:150]}")
            t1 = None
        for kernel, backward in (("pallas", "kv"), ("cudnn", "kv"), ("cudnn", "q"),
                                 ("auto", "auto")):
            layout = "zigzag" if causal else "contiguous"
            f = lambda q, k, v, kernel=kernel, backward=backward: jsp.attention(  # noqa
                q, k, v, mesh=mesh, causal=causal, layout=layout, permuted=True,
                backward=backward, kernel=kernel)
            try:
                fb = jax.jit(lambda q, k, v, do, f=f: jax.vjp(f, q, k, v)[1](do))
                tG = time_fn(fb, q, k, v, do, **reps)["median_s"]
            except Exception as e:
                print(f"ring S={S} {kernel}/{backward}: {type(e).__name__}: {str(e)[:200]}")
                continue
            row = dict(S=S, G=G, causal=causal, layout=layout, kernel=kernel,
                       backward=backward, t_ring_s=tG, t_cudnn_1gpu_s=t1,
                       speedup_vs_cudnn_1gpu=(t1 / tG) if t1 else None,
                       tflops_per_gpu=fl / tG / G / 1e12)
            rows.append(row)
            print(f"ring S={S:7d} G={G} causal={causal!s:5s} {kernel:6s} bwd={backward:4s} "
                  f"{tG * 1e3:8.1f} ms  1-GPU cuDNN {(t1 or 0) * 1e3:8.1f} ms  speedup "
                  f"{row['speedup_vs_cudnn_1gpu'] or 0:.2f}x  "
                  f"{row['tflops_per_gpu']:.0f} TFLOP/s/GPU", flush=True)
    return rows


def ring_table(rows):
    print(f"{'G':>2s} {'S':>7s} {'causal':6s} {'kernel':6s} {'bwd':4s} {'ring ms':>8s} "
          f"{'1-GPU cuDNN ms':>14s} {'speedup':>7s} {'TFLOP/s/GPU':>11s}")
    for r in rows:
        print(f"{r['G']:2d} {r['S']:7d} {r['causal']!s:6s} {r['kernel']:6s} {r['backward']:4s} "
              f"{r['t_ring_s'] * 1e3:8.1f} {(r['t_cudnn_1gpu_s'] or 0) * 1e3:14.1f} "
              f"{r['speedup_vs_cudnn_1gpu'] or 0:7.2f} {r['tflops_per_gpu']:11.0f}")


def ring_plot(rows, path):
    """Speedup over one GPU running cuDNN on the whole sequence, per kernel and G."""
    plt = pyplot()
    if plt is None:
        return
    cases = sorted({(r["causal"], r["S"]) for r in rows}, key=lambda c: (not c[0], c[1]))
    fig, axes = plt.subplots(1, len(cases), figsize=(3.2 * len(cases), 3.4), sharey=True)
    for ax, (causal, S) in zip(list(axes) if len(cases) > 1 else [axes], cases):
        for kernel, backward, mark in (("pallas", "kv", "s--"), ("cudnn", "kv", "o-"),
                                       ("cudnn", "q", "^-"), ("auto", "auto", "x:")):
            rs = sorted((r for r in rows if r["causal"] == causal and r["S"] == S
                         and r["kernel"] == kernel and r["backward"] == backward),
                        key=lambda r: r["G"])
            if rs:
                ax.plot([r["G"] for r in rs], [r["speedup_vs_cudnn_1gpu"] for r in rs], mark,
                        label=f"{kernel} ({backward})")
        counts = sorted({r["G"] for r in rows})
        ax.plot(counts, counts, color="gray", ls=":", label="ideal")
        ax.set_xticks(counts, [str(G) for G in counts])
        ax.set_xlabel("H200 GPUs")
        ax.set_title(f"{S // 1024}k, {'causal zigzag' if causal else 'non-causal'}", fontsize=9)
    (axes[0] if len(cases) > 1 else axes).set_ylabel("speedup vs 1 GPU on cuDNN")
    (axes[0] if len(cases) > 1 else axes).legend(fontsize=7)
    fig.suptitle("ring attention forward + backward (bf16, H=16, D=128)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


def replot(paths):
    import json
    rows = []
    for path in paths:
        with open(path) as f:
            rows += json.load(f).get("ring", [])
    ring_table(rows)
    ring_plot(rows, os.path.join(os.path.dirname(paths[0]), "cudnn_ring_speedup.png"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phases", default="check,tile,ring")
    p.add_argument("--dims", default="64,128,256")
    p.add_argument("--dtypes", default="bfloat16,float16")
    p.add_argument("--ring-seqs", default="131072")
    p.add_argument("--rounds", type=int, default=8,
                   help="tile: timing rounds (each variant once per round; median ratio)")
    p.add_argument("--tag", default="")
    p.add_argument("--plot", nargs="+", default=None, metavar="JSON",
                   help="only print the ring table and draw the PNG from saved result files")
    args = p.parse_args(argv)
    if args.plot:
        replot(args.plot)
        return 0
    if jax.default_backend() != "gpu":
        print("cudnn_tiles.py needs an NVIDIA GPU (cuDNN does not run on CPU; the CPU "
              "tests cover the backend's logic with a stand-in)")
        return 2
    phases = args.phases.split(",")
    info = env_info()
    print(f"# {info}; phases {phases}", flush=True)
    result = {"env": info}
    path = os.path.join(out_dir(), f"cudnn_tiles_gpu{jax.device_count()}{args.tag}.json")
    ok = True
    if "check" in phases:
        rows = check_tiles([int(x) for x in args.dims.split(",")], args.dtypes.split(","))
        rows += check_split()
        if jax.device_count() > 1:
            rows += check_ring(jax.device_count())
        result["check"] = rows
        ok &= all(r["ok"] for r in rows)
        save_json(result, path)
        print(f"CHECK: {sum(r['ok'] for r in rows)}/{len(rows)} passed", flush=True)
    if "tile" in phases:
        result["tile"] = bench_tile(rounds=args.rounds)
        save_json(result, path)
    if "pair" in phases:
        result["pair"] = bench_pair()
        save_json(result, path)
    if "ring" in phases:
        result["ring"] = bench_ring([int(x) for x in args.ring_seqs.split(",")])
        save_json(result, path)
    print("CHECKS:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
