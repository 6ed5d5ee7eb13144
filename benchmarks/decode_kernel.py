"""The local decoding step on one device: which kernel reads a KV-cache shard fastest.

Tree decoding's latency is one device's attention of a few new tokens over its cache
shard plus two tiny all-reduces; this times the first part alone.  Variants:

* ``xla/<bk>``: the blockwise ``XlaKernel`` with key blocks of ``bk`` (the decode default
  before ``XlaDecodeKernel`` was 8192),
* ``xla_decode``: ``XlaDecodeKernel`` (key blocks sized by its score budget);
  ``xla_decode/<bk>`` fixes its blocks, to separate the block size from the rest,
* ``pallas_decode/<bk>/<warps>w<stages>s/<programs>``: ``PallasDecodeKernel`` (split-K
  Triton kernel) with that ``DecodeConfig`` (GPU preset only),
* ``dense``: ``jax.nn.dot_product_attention`` (XLA implementation) with the same mask
  as a boolean array, one dense softmax over the whole shard: an XLA reference, not a
  kernel of this library,
* ``read``: summing K and V in float32: the cache-read floor on this device.

Inputs are what ``tree_decode`` hands the kernel: queries at the end of each sequence
(``causal=True``), per-row query positions and the segment ids that hide entries beyond
each sequence's length (here every sequence is full).  "GB/s" is the bytes of K and V
over the time.  Every variant's output is compared with ``xla/8192``'s at every size,
and at a small shard with ragged lengths against the float32 reference.

    python benchmarks/decode_kernel.py                  # CPU: small, checks the script
    python benchmarks/decode_kernel.py --preset gpu     # 1 GPU, shards of 128k .. 1M
"""

from __future__ import annotations

import argparse
import os
import sys

import _setup  # noqa: F401,E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_seqpar as jsp  # noqa: E402
from jax_seqpar.kernels import (DecodeConfig, PallasDecodeKernel, XlaDecodeKernel,  # noqa: E402
                                XlaKernel)
from jax_seqpar.masks import MaskSpec  # noqa: E402
from _util import choose_preset, env_info, out_dir, rel, save_json, time_fn  # noqa: E402

PRESETS = {
    "cpu": dict(shards=[4096], batches=[1, 2], tq=[1, 4], heads=(8, 2), head_dim=64,
                dtype="float32", blocks=[1024], decode_blocks=[1024], repeats=3,
                check_shard=1024, pallas=[]),
    "gpu": dict(shards=[131072, 524288, 1048576], batches=[1, 8], tq=[1, 4], heads=(32, 8),
                head_dim=128, dtype="bfloat16", blocks=[8192, 65536], decode_blocks=[8192],
                repeats=5, check_shard=16384,
                # PallasDecodeKernel configs: (block_k, num_warps, num_stages, programs)
                pallas=[(64, 4, 3, 1024), (128, 4, 2, 1024), (64, 4, 3, 4096),
                        (128, 8, 3, 2048)]),
}
MASK = MaskSpec(causal=True)


def variants(cfg):
    """``{name: kernel or None}`` (None: a non-kernel variant, see ``step``)."""
    out = {f"xla/{bk}": XlaKernel(block_q=512, block_k=bk) for bk in cfg["blocks"]}
    out["xla_decode"] = XlaDecodeKernel()
    out.update({f"xla_decode/{bk}": XlaDecodeKernel(block_k=bk) for bk in cfg["decode_blocks"]})
    for bk, warps, stages, progs in cfg.get("pallas", []):
        out[f"pallas_decode/{bk}/{warps}w{stages}s/{progs}"] = PallasDecodeKernel(
            DecodeConfig(block_k=bk, num_warps=warps, num_stages=stages,
                         target_programs=progs))
    out["dense"] = None
    return out


def rows_of(lengths, Tq, T):
    """Positions and segment ids exactly as ``jax_seqpar.decode`` builds them."""
    kv_pos = jnp.arange(T, dtype=jnp.int32)
    q_pos = (lengths[:, None] - Tq + jnp.arange(Tq)[None, :]).astype(jnp.int32)
    return q_pos, kv_pos, jnp.ones(q_pos.shape, jnp.int32), (
        kv_pos[None, :] < lengths[:, None]).astype(jnp.int32)


def step(name, kern, D):
    scale = D ** -0.5
    if name == "dense":
        def dense(q, k, v, lengths):
            q_pos, kv_pos, q_seg, kv_seg = rows_of(lengths, q.shape[1], k.shape[1])
            vis = MASK.visible(q_pos, kv_pos, q_seg, kv_seg)  # [B, Tq, T]
            return jax.nn.dot_product_attention(q, k, v, scale=scale, mask=vis[:, None],
                                                implementation="xla").astype(jnp.float32)
        return jax.jit(dense)

    def f(q, k, v, lengths):
        q_pos, kv_pos, q_seg, kv_seg = rows_of(lengths, q.shape[1], k.shape[1])
        return kern.fwd(q, k, v, q_pos, kv_pos, MASK, scale, q_seg, kv_seg)[0]
    return jax.jit(f)


def check(cfg, dt):
    """Each variant vs the float32 reference, ragged lengths, at a small shard."""
    Hq, Hkv = cfg["heads"]
    D, T, B, Tq = cfg["head_dim"], cfg["check_shard"], 2, 4
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(ks[0], (B, Tq, Hq, D), dt)
    k = jax.random.normal(ks[1], (B, T, Hkv, D), dt)
    v = jax.random.normal(ks[2], (B, T, Hkv, D), dt)
    lengths = jnp.array([T, T // 3], jnp.int32)
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = jnp.concatenate([jsp.reference_attention(
        up(q[b:b + 1]), up(k[b:b + 1, :L]), up(v[b:b + 1, :L]), causal=True,
        q_pos=jnp.arange(L - Tq, L))[0] for b, L in enumerate([T, T // 3])])
    return {name: rel(step(name, kern, D)(q, k, v, lengths), ref)
            for name, kern in variants(cfg).items()}


def measure(cfg, dt, save=lambda rows: None):
    """Rows of (variant, shard, batch, tq); ``save(rows)`` after every size (a run cut
    short keeps what it measured)."""
    Hq, Hkv = cfg["heads"]
    D = cfg["head_dim"]
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    read = jax.jit(lambda k, v: jnp.sum(k, dtype=jnp.float32) + jnp.sum(v, dtype=jnp.float32))
    rows = []
    for T in cfg["shards"]:
        for B in cfg["batches"]:
            k = jax.random.normal(ks[1], (B, T, Hkv, D), dt)
            v = jax.random.normal(ks[2], (B, T, Hkv, D), dt)
            cache = 2 * k.size * dt.itemsize
            lengths = jnp.full((B,), T, jnp.int32)
            t_read = time_fn(read, k, v, repeats=cfg["repeats"])["median_s"]
            for Tq in cfg["tq"]:
                q = jax.random.normal(ks[0], (B, Tq, Hq, D), dt)
                base, new = None, []
                for name, kern in variants(cfg).items():
                    try:
                        f = step(name, kern, D)
                        t = time_fn(f, q, k, v, lengths, repeats=cfg["repeats"])["median_s"]
                        out = f(q, k, v, lengths)
                    except Exception as e:  # e.g. the dense scores do not fit
                        print(f"{name} T={T} B={B} Tq={Tq}: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:120]}", flush=True)
                        continue
                    base = out if base is None else base
                    new.append(dict(variant=name, shard=T, batch=B, tq=Tq, time_s=t,
                                    gb_per_s=cache / t / 1e9, read_s=t_read,
                                    read_gb_per_s=cache / t_read / 1e9,
                                    rel_vs_first=rel(out, base)))
                    print(f"T={T} B={B} Tq={Tq} {name}: {t * 1e3:.3f} ms, "
                          f"{cache / t / 1e9:.0f} GB/s (read floor {cache / t_read / 1e9:.0f} "
                          f"GB/s), diff {new[-1]['rel_vs_first']:.1e}", flush=True)
                rows += new
                save(rows)
                del q
            del k, v
    return rows


def table(rows):
    print(f"{'shard':>8} {'B':>2} {'Tq':>2} {'variant':<30}{'ms':>9}{'GB/s':>7}"
          f"{'vs first':>9}{'read GB/s':>10}{'diff':>9}")
    for r in rows:
        first = [x for x in rows if (x["shard"], x["batch"], x["tq"])
                 == (r["shard"], r["batch"], r["tq"])][0]
        print(f"{r['shard']:>8} {r['batch']:>2} {r['tq']:>2} {r['variant']:<30}"
              f"{r['time_s'] * 1e3:>9.3f}{r['gb_per_s']:>7.0f}"
              f"{first['time_s'] / r['time_s']:>9.2f}{r['read_gb_per_s']:>10.0f}"
              f"{r['rel_vs_first']:>9.1e}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    args = p.parse_args(argv)
    preset, cfg = choose_preset(PRESETS, args.preset)
    dt = jnp.dtype(cfg["dtype"])
    tol = 2e-2 if dt == jnp.bfloat16 else 1e-5
    info = env_info()
    print(f"# {info}\n# preset {preset}: {cfg}", flush=True)
    errs = check(cfg, dt)
    print("check vs reference:", {n: f"{e:.1e}" for n, e in errs.items()}, flush=True)
    path = os.path.join(out_dir(), f"decode_kernel_{preset}.json")

    def save(rows):
        save_json({"env": info, "preset": preset, "config": cfg, "check": errs, "rows": rows},
                  path)
    rows = measure(cfg, dt, save)
    save(rows)
    table(rows)
    ok = all(e <= tol for e in errs.values()) and all(r["rel_vs_first"] <= tol for r in rows)
    print("CHECKS:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
