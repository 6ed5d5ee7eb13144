"""LM head + cross-entropy, forward + backward on one device: naive vs chunked vs fused.

Variants (all ``jax.value_and_grad`` of the mean cross-entropy with respect to ``h`` and
``w``, bf16 operands with float32 accumulation on the GPU preset):

* ``naive``: full ``[S, V]`` float32 logits and ``jax.nn.log_softmax``
  (``lm_head.reference_lm_head_loss``); at S = V = 128k it needs ~128 GiB and is expected
  to run out of memory on an H200 -- recorded as ``oom``;
* ``chunked``: ``lax.scan`` over sequence chunks with ``jax.checkpoint`` around each
  chunk's logits + loss: the logits are never whole, but the backward recomputes them
  (4 matmuls: the approach BurstEngine's Alg. 3 improves on);
* ``fused``: ``lm_head.fused_lm_head_loss`` (Alg. 3: gradients made in the forward;
  3 matmuls with the default ``block_v=None``, 4 with a smaller ``--block-v``);
* ``floor``: the three matmuls alone, each as one whole XLA dot of ``S x d x V`` with
  bf16 operands and float32 accumulation: ``h @ w`` (float32 out), ``g @ w.T`` and
  ``h.T @ g`` (``g`` a random bf16 ``[S, V]``); their times summed.  The matmul-bound
  floor that the fused variant is measured against.

Time: median of ``--repeats`` calls after one warm-up, each synchronised with
``jax.block_until_ready``.  Memory: JAX cannot reset ``peak_bytes_in_use``, so on GPUs
every (shape, variant) runs in its own subprocess and reports its device's
``peak_bytes_in_use`` (inputs included); every variant also reports the compiled
``memory_analysis`` (argument + output + temporary bytes) as a second, static estimate.
A failing variant (OOM or otherwise) is recorded with its error and the run goes on.

    python benchmarks/lm_head.py --preset cpu      # tiny shapes, in one process, < 1 min
    python benchmarks/lm_head.py --preset gpu      # one H200: S in {32k, 128k}, V in {32k, 128k}
    python benchmarks/lm_head.py --preset gpu --block-s 8192 --block-v 16384 --variants fused
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import _setup  # noqa: F401,E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from jax_seqpar.layers.lm_head import fused_lm_head_loss, reference_lm_head_loss  # noqa: E402
from _util import env_info, save_json, time_fn  # noqa: E402

F32 = jnp.float32
VARIANTS = ("floor", "fused", "chunked", "naive")
PRESETS = {
    "cpu": dict(shapes=[(512, 1024), (1024, 2048)], d=64, dtype="float32", repeats=3,
                block_s=256, block_v=None, isolate=False),
    "gpu": dict(shapes=[(32768, 32768), (32768, 131072), (131072, 32768), (131072, 131072)],
                d=4096, dtype="bfloat16", repeats=5, block_s=None, block_v=None,
                isolate=True),
}


# --------------------------------------------------------------------------- variants
def inputs(S, d, V, dtype, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(k1, (1, S, d), dtype)
    w = (jax.random.normal(k2, (d, V), dtype) * (1.0 / d ** 0.5)).astype(dtype)
    t = jax.random.randint(k3, (1, S), 0, V)
    return h, w, t


def chunked_loss(h, w, t, chunk):
    """Mean cross-entropy over sequence chunks; each chunk checkpointed (recomputed in the
    backward)."""
    _, S, d = h.shape
    n = S // chunk

    @jax.checkpoint
    def piece(hc, tc, w):
        z = jnp.dot(hc, w, preferred_element_type=F32)
        zy = jnp.take_along_axis(z, tc[:, None], axis=1)[:, 0]
        return jnp.sum(jax.nn.logsumexp(z, axis=1) - zy)

    def body(acc, xs):
        return acc + piece(xs[0], xs[1], w), None

    total, _ = lax.scan(body, jnp.zeros((), F32),
                        (h.reshape(n, chunk, d), t.reshape(n, chunk)))
    return total / S


def default_chunk(S, V, block_s):
    """The chunk of ``chunked``: ``block_s`` or the fused default's row tile, dividing S."""
    from jax_seqpar.layers.lm_head import TILE_ELEMENTS
    c = block_s or max(256, TILE_ELEMENTS // V // 256 * 256)
    c = min(c, S)
    while S % c:
        c -= 1
    return c


def loss_grad_fn(variant, S, V, block_s, block_v):
    """A jitted ``(h, w, t) -> ((loss, |dh|, |dW|))`` for one of naive/chunked/fused."""
    if variant == "naive":
        loss = lambda h, w, t: reference_lm_head_loss(h, w, t)[0]  # noqa: E731
    elif variant == "chunked":
        c = default_chunk(S, V, block_s)
        loss = lambda h, w, t: chunked_loss(h, w, t, c)  # noqa: E731
    elif variant == "fused":
        loss = lambda h, w, t: fused_lm_head_loss(  # noqa: E731
            h, w, t, block_s=block_s, block_v=block_v)[0]
    else:
        raise ValueError(variant)

    def run(h, w, t):
        val, (dh, dw) = jax.value_and_grad(loss, argnums=(0, 1))(h, w, t)
        return val, dh, dw
    return jax.jit(run)


def memory_estimate(fn, *args) -> dict:
    try:
        ma = fn.lower(*args).compile().memory_analysis()
        parts = dict(argument=ma.argument_size_in_bytes, output=ma.output_size_in_bytes,
                     temp=ma.temp_size_in_bytes, alias=ma.alias_size_in_bytes)
        parts["total"] = parts["argument"] + parts["output"] + parts["temp"] - parts["alias"]
        return parts
    except Exception as e:  # memory_analysis is best effort on some backends
        return {"error": str(e)[:200]}


def measure_floor(S, d, V, dtype, repeats):
    """The three matmuls, each one whole dot (bf16 operands, float32 accumulation)."""
    h, w, _ = inputs(S, d, V, dtype)
    h2 = h[0]
    logits = jax.jit(lambda h, w: jnp.dot(h, w, preferred_element_type=F32))
    t_z = time_fn(logits, h2, w, warmup=1, repeats=repeats)["median_s"]
    g = jax.jit(lambda k: jax.random.normal(k, (S, V), dtype))(jax.random.key(7))
    dh = jax.jit(lambda g, w: lax.dot_general(g, w, (((1,), (1,)), ((), ())),
                                              preferred_element_type=F32))
    dw = jax.jit(lambda h, g: lax.dot_general(h, g, (((0,), (0,)), ((), ())),
                                              preferred_element_type=F32))
    t_dh = time_fn(dh, g, w, warmup=1, repeats=repeats)["median_s"]
    t_dw = time_fn(dw, h2, g, warmup=1, repeats=repeats)["median_s"]
    return {"time_s": t_z + t_dh + t_dw, "parts_s": {"logits": t_z, "dh": t_dh, "dw": t_dw}}


def run_variant(spec: dict) -> dict:
    """Time one variant at one shape in this process; never raises."""
    S, V, d = spec["S"], spec["V"], spec["d"]
    dtype = jnp.dtype(spec["dtype"])
    out = {"S": S, "V": V, "d": d, "dtype": dtype.name, "variant": spec["variant"],
           "block_s": spec.get("block_s"), "block_v": spec.get("block_v")}
    try:
        if spec["variant"] == "floor":
            out.update(measure_floor(S, d, V, dtype, spec["repeats"]))
        else:
            fn = loss_grad_fn(spec["variant"], S, V, spec.get("block_s"), spec.get("block_v"))
            args = inputs(S, d, V, dtype)
            out["memory_analysis"] = memory_estimate(fn, *args)
            val, dh, dw = jax.block_until_ready(fn(*args))
            out["loss"] = float(val)
            out["dh_norm"] = float(jnp.linalg.norm(dh.astype(F32)))
            out["dw_norm"] = float(jnp.linalg.norm(dw.astype(F32)))
            del val, dh, dw
            out["time_s"] = time_fn(fn, *args, warmup=0, repeats=spec["repeats"])["median_s"]
        out["status"] = "ok"
    except Exception as e:
        msg = str(e)
        out["status"] = "oom" if ("RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()
                                  ) else "error"
        out["error"] = msg[:400]
    try:
        stats = jax.devices()[0].memory_stats() or {}
        out["peak_bytes"] = stats.get("peak_bytes_in_use")
    except Exception:
        out["peak_bytes"] = None
    return out


def run_isolated(spec: dict, timeout: float) -> dict:
    """``run_variant`` in a fresh process, so that its device peak memory is its own."""
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    base = {k: spec[k] for k in ("S", "V", "d", "dtype", "variant")}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {**base, "status": "timeout", "error": f"over {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout)[-400:]
    status = "oom" if "RESOURCE_EXHAUSTED" in tail or "out of memory" in tail.lower() else "error"
    return {**base, "status": status, "error": f"exit {proc.returncode}: {tail}"}


# --------------------------------------------------------------------------- report
def add_derived(rows):
    """TFLOP/s of the useful 6·S·d·V, the ratio to the floor and memory in GiB."""
    floors = {(r["S"], r["V"]): r["time_s"] for r in rows
              if r["variant"] == "floor" and r.get("status") == "ok"}
    for r in rows:
        t = r.get("time_s")
        if r.get("status") == "ok" and t:
            r["tflops"] = 6 * r["S"] * r["d"] * r["V"] / t / 1e12
            f = floors.get((r["S"], r["V"]))
            r["x_floor"] = t / f if f else None
    return rows


def mib(x):
    return "-" if x is None else f"{x / 2**20:.1f}"


def table(rows):
    print(f"{'S':>7} {'V':>7} {'variant':>8} {'status':>7} {'time ms':>9} {'x floor':>8} "
          f"{'TFLOP/s':>8} {'peak MiB':>9} {'est MiB':>9} {'loss':>9}")
    for r in rows:
        est = (r.get("memory_analysis") or {}).get("total")
        ok = r.get("status") == "ok"
        xf = r.get("x_floor")
        print(f"{r['S']:>7} {r['V']:>7} {r['variant']:>8} {r.get('status', '?'):>7} "
              f"{r['time_s'] * 1e3 if ok else float('nan'):>9.2f} "
              f"{xf if xf else float('nan'):>8.3f} {r.get('tflops', float('nan')):>8.1f} "
              f"{mib(r.get('peak_bytes')):>9} {mib(est):>9} "
              f"{r.get('loss', float('nan')):>9.5f}")


def plot(rows, path):
    """Time (as a multiple of the 3-matmul floor) and peak memory per variant and shape."""
    from _util import pyplot

    plt = pyplot()
    if plt is None:
        return
    shapes = list(dict.fromkeys((r["S"], r["V"]) for r in rows))
    names = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / len(names)
    for j, v in enumerate(names):
        xs = [i + j * width for i in range(len(shapes))]
        got = {(r["S"], r["V"]): r for r in rows if r["variant"] == v}
        ok = {sv: r for sv, r in got.items() if r.get("status") == "ok"}
        ax1.bar(xs, [ok.get(sv, {}).get("x_floor") or 0 for sv in shapes], width, label=v,
                color=f"C{j}")
        ax2.bar(xs, [(ok.get(sv, {}).get("peak_bytes") or 0) / 2 ** 30 for sv in shapes],
                width, label=v, color=f"C{j}")
        for x, sv in zip(xs, shapes):
            if got.get(sv, {}).get("status") == "oom":
                for ax in (ax1, ax2):
                    ax.annotate("OOM", (x, 0.03), xycoords=("data", "axes fraction"),
                                rotation=90, ha="center", fontsize=7, color=f"C{j}")
    labels = [f"S={S // 1024}k\nV={V // 1024}k" for S, V in shapes]
    for ax in (ax1, ax2):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))], labels)
    ax1.axhline(1.15, color="gray", ls=":", label="1.15x floor")
    ax1.set_ylabel("fwd + bwd time / floor")
    ax2.set_yscale("log")
    ax2.set_ylabel("peak memory (GiB)")
    ax1.legend(fontsize=7, loc="upper left")
    fig.suptitle("LM head + cross-entropy, d = 4096, bf16, one H200", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--out", default=None, help="output folder (default $OUT or "
                   "benchmarks/out)")
    p.add_argument("--block-s", type=int, default=None, help="fused row tile (and the "
                   "chunked variant's chunk); default: the preset's / the library's")
    p.add_argument("--block-v", type=int, default=None, help="fused vocabulary tile; "
                   "default: the whole vocabulary (Alg. 3 as written, 3 matmuls)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per subprocess")
    p.add_argument("--isolate", choices=("auto", "yes", "no"), default="auto",
                   help="one subprocess per variant (default: on the gpu preset)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--plot", default=None, metavar="JSON",
                   help="only print the table and draw the PNG of a saved result file")
    args = p.parse_args(argv)
    if args.plot:
        with open(args.plot) as f:
            rows = json.load(f)["rows"]
        table(rows)
        plot(rows, os.path.splitext(args.plot)[0] + ".png")
        return 0
    if args.worker:
        print("RESULT " + json.dumps(run_variant(json.loads(args.worker))), flush=True)
        return 0
    preset = args.preset or ("gpu" if jax.default_backend() == "gpu" else "cpu")
    cfg = dict(PRESETS[preset])
    for k in ("block_s", "block_v", "repeats"):
        if getattr(args, k) is not None:
            cfg[k] = getattr(args, k)
    isolate = cfg["isolate"] if args.isolate == "auto" else args.isolate == "yes"
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}; choose from {VARIANTS}")
    out = args.out or os.environ.get("OUT") or "benchmarks/out"
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"lm_head_{preset}.json")
    info = env_info()
    print(f"# {info}\n# preset {preset}: {cfg} isolate={isolate}", flush=True)
    rows = []
    t0 = time.perf_counter()
    for S, V in cfg["shapes"]:
        for variant in variants:
            spec = dict(S=S, V=V, d=cfg["d"], dtype=cfg["dtype"], variant=variant,
                        repeats=cfg["repeats"], block_s=cfg["block_s"], block_v=cfg["block_v"])
            r = run_isolated(spec, args.timeout) if isolate else run_variant(spec)
            rows.append(r)
            add_derived(rows)
            save_json({"env": info, "preset": preset, "config": cfg, "rows": rows}, path)
            t = r.get("time_s")
            print(f"[{time.perf_counter() - t0:6.1f} s] S={S} V={V} {variant}: "
                  f"{r.get('status')} {'' if t is None else f'{t * 1e3:.1f} ms'} "
                  f"{r.get('error', '')[:160]}", flush=True)
    table(rows)
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
