"""The ``tokamax`` backend on a Hopper GPU: forward and backward against the float32 oracle.

``jax_seqpar.attention(..., kernel="tokamax")`` on a one-GPU mesh (the whole sequence is
one aligned tile) for dense, causal and two-sided sliding-window masks, MHA and GQA,
head dims 64 and 128, bf16; the output, lse-dependent gradients and all three input
gradients are compared with ``reference_attention`` evaluated in float32 on the same bf16
values (relative Frobenius error, budget 2e-2 as for every bf16 backend), and with
tokamax's own public call (``tokamax.dot_product_attention(implementation="mosaic")``,
what a user would call instead).  Speed is ``benchmarks/kernels.py --phases pair
--bench-kernels tokamax,tokamax_direct,pallas_mgpu``.

    python benchmarks/tokamax_tiles.py        # on a Hopper GPU with tokamax installed
"""

from __future__ import annotations

import argparse
import os

import _setup  # noqa: F401

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_seqpar as jsp  # noqa: E402
from jax_seqpar.reference import reference_attention  # noqa: E402
from _util import env_info, out_dir, save_json  # noqa: E402

BUDGET = 2e-2
#: name: (B, S, Hq, Hkv, causal, window)
CASES = {
    "dense_mha": (2, 2048, 8, 8, False, None),
    "causal_gqa": (1, 4096, 16, 4, True, None),
    "window_both_sides": (1, 4096, 8, 2, False, (256, 64)),
    "causal_window": (2, 2048, 8, 8, True, (512, 0)),
}


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def run_case(name, D, mesh):
    B, S, Hq, Hkv, causal, window = CASES[name]
    ks = jax.random.split(jax.random.key(S + D + Hkv), 4)
    q = jax.random.normal(ks[0], (B, S, Hq, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, S, Hkv, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, S, Hkv, D), jnp.bfloat16)
    do = jax.random.normal(ks[3], (B, S, Hq, D), jnp.bfloat16)

    def ours(q, k, v):
        return jsp.attention(q, k, v, mesh=mesh, causal=causal, window=window,
                             kernel="tokamax")

    def oracle(q, k, v):
        return reference_attention(q, k, v, causal=causal, window=window)[0]

    o, vjp = jax.jit(lambda q, k, v: jax.vjp(ours, q, k, v))(q, k, v)
    g = jax.jit(vjp)(do)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ro, rvjp = jax.vjp(oracle, *f32)
    rg = rvjp(do.astype(jnp.float32))
    row = dict(case=name, D=D, B=B, S=S, Hq=Hq, Hkv=Hkv, causal=causal, window=window,
               rel_out=_rel(o, ro), **{f"rel_d{n}": _rel(a, b) for n, a, b in
                                        zip("qkv", g, rg)})
    try:
        import tokamax
        w = None if window is None else tuple(window)
        direct = jax.jit(lambda q, k, v: tokamax.dot_product_attention(
            q, k, v, is_causal=causal, local_window_size=w,
            implementation="mosaic"))(q, k, v)
        row["rel_out_vs_tokamax_direct"] = _rel(o, direct)
    except Exception as e:  # reported, not fatal
        row["tokamax_direct_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    row["ok"] = all(row[x] <= BUDGET for x in ("rel_out", "rel_dq", "rel_dk", "rel_dv"))
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", default="64,128")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    mesh = jax.make_mesh((1,), ("sp",), devices=jax.devices()[:1])
    rows = []
    for D in (int(x) for x in a.dims.split(",")):
        for name in CASES:
            try:
                rows.append(run_case(name, D, mesh))
            except Exception as e:
                rows.append(dict(case=name, D=D, ok=False,
                                 error=f"{type(e).__name__}: {str(e)[:300]}"))
            print({k: (round(v, 6) if isinstance(v, float) else v)
                   for k, v in rows[-1].items()}, flush=True)
    path = os.path.join(a.out or out_dir(), "tokamax_tiles.json")
    save_json(dict(env=env_info(), device=str(jax.devices()[0]), budget=BUDGET,
                   rows=rows), path)
    print(f"{sum(r['ok'] for r in rows)} of {len(rows)} cases within {BUDGET}; "
          f"wrote {path}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
