"""How to write the decode step's matmuls so XLA reads the cache at full speed (B > 1).

``benchmarks/decode_kernel.py`` found the one-block decode forward at ~2.4 TB/s for one
sequence but ~1.1 TB/s for eight (H200), as fast as XLA's own dense attention.  This
times formulations of the same unmasked step, ``softmax(q k^T / sqrt(D)) v`` for a few
query rows against a ``[B, T, Hkv, D]`` cache, to find which one the kernel should use:

* ``einsum``: batched over (b, h) in one einsum each for scores and output (the kernel's);
* ``rows``: a Python loop over batch rows, each row one einsum pair (static slices);
* ``map``: ``lax.map`` over batch rows (a loop with dynamic slices of the leading axis);
* ``vpu``: scores as a float32 multiply-and-reduce over D instead of a matmul.

    python benchmarks/decode_formulations.py --preset gpu
"""

from __future__ import annotations

import argparse
import os
import sys

import _setup  # noqa: F401,E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from _util import choose_preset, env_info, out_dir, rel, save_json, time_fn  # noqa: E402

F32 = jnp.float32
PRESETS = {
    "cpu": dict(shards=[4096], batches=[2], tq=[1, 4], heads=(8, 2), head_dim=64,
                dtype="float32", repeats=3),
    "gpu": dict(shards=[524288, 1048576], batches=[1, 8], tq=[1, 4], heads=(32, 8),
                head_dim=128, dtype="bfloat16", repeats=5),
}


def _one(q, k, v, scale):
    """q [B, Tq, Hkv, g, D], k/v [B, T, Hkv, D] -> o [B, Tq, Hkv, g, D] float32."""
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=F32) * scale
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v, preferred_element_type=F32)


def einsum(q, k, v, scale):
    return _one(q, k, v, scale)


def rows(q, k, v, scale):
    return jnp.concatenate([_one(q[b:b + 1], k[b:b + 1], v[b:b + 1], scale)
                            for b in range(q.shape[0])])


def mapped(q, k, v, scale):
    return lax.map(lambda a: _one(a[0][None], a[1][None], a[2][None], scale)[0], (q, k, v))


def vpu(q, k, v, scale):
    s = jnp.sum(q[:, :, None].astype(F32) * k[:, None, :, :, None].astype(F32), axis=-1)
    s = jnp.moveaxis(s, 2, -1) * scale  # [B, Tq, Hkv, g, T]
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bqhgk,bkhd->bqhgd", p.astype(v.dtype), v, preferred_element_type=F32)


FORMS = {"einsum": einsum, "rows": rows, "map": mapped, "vpu": vpu}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    args = p.parse_args(argv)
    preset, cfg = choose_preset(PRESETS, args.preset)
    dt = jnp.dtype(cfg["dtype"])
    Hq, Hkv = cfg["heads"]
    D = cfg["head_dim"]
    info = env_info()
    print(f"# {info}\n# preset {preset}: {cfg}", flush=True)
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    out, ok = [], True
    for T in cfg["shards"]:
        for B in cfg["batches"]:
            k = jax.random.normal(ks[1], (B, T, Hkv, D), dt)
            v = jax.random.normal(ks[2], (B, T, Hkv, D), dt)
            cache = 2 * k.size * dt.itemsize
            for Tq in cfg["tq"]:
                q = jax.random.normal(ks[0], (B, Tq, Hkv, Hq // Hkv, D), dt)
                base = None
                for name, fn in FORMS.items():
                    f = jax.jit(lambda q, k, v, fn=fn: fn(q, k, v, D ** -0.5))
                    try:
                        t = time_fn(f, q, k, v, repeats=cfg["repeats"])["median_s"]
                        o = f(q, k, v)
                    except Exception as e:
                        print(f"{name} T={T} B={B} Tq={Tq}: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:120]}", flush=True)
                        continue
                    base = o if base is None else base
                    err = rel(o, base)
                    ok &= err <= (2e-2 if dt == jnp.bfloat16 else 1e-5)
                    out.append(dict(form=name, shard=T, batch=B, tq=Tq, time_s=t,
                                    gb_per_s=cache / t / 1e9, rel_vs_einsum=err))
                    print(f"T={T} B={B} Tq={Tq} {name:7s} {t * 1e3:8.3f} ms "
                          f"{cache / t / 1e9:6.0f} GB/s diff {err:.1e}", flush=True)
                    save_json({"env": info, "config": cfg, "rows": out},
                              os.path.join(out_dir(), f"decode_formulations_{preset}.json"))
            del k, v
    print("CHECKS:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
