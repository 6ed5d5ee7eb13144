"""tokamax 0.0.17's backward on lengths that are not whole tiles (GPU only, Hopper).

Found on 2026-12-04 by ``kernels.py --phases check --check-kernels cudnn,tokamax``: the
``tokamax`` backend's gradients held NaN on the ragged cases (200 and 300 tokens) --
dV in float16 on ordinary random inputs, dQ (bf16 and f16) where every score lies far
below 0 -- while its forward was right.  tokamax's VJP pads rows only to a multiple of 8
and tiles them by 128, so rows and keys past the length inside the last tile are read as
zeros with no mask (``jax_seqpar/kernels/tokamax.py``, "Ragged lengths").

This probe runs, on the same inputs, tokamax's public call as a user would make it
(``tokamax.dot_product_attention(..., implementation="mosaic")`` under ``jax.vjp``) and
``jsp.attention``'s local path with ``kernel="tokamax"`` (which pads the backward's
operands to whole tiles), against the float32 reference: causal and not, D 64 and 128,
bf16 and f16, lengths 200 and 300 (ragged) and 256 (whole), random scores and scores
around ``-24 sqrt(D)`` (``kernels.low_scores``).  It prints NaN counts and relative
errors, saves ``tokamax_ragged_probe.json`` under ``$OUT`` (default ``benchmarks/out``),
and exits 1 if the backend has a NaN or misses its budget (2e-2; 1e-1 for the low
scores, as ``kernels.py``'s check cases)::

    python benchmarks/tokamax_ragged_probe.py [--dims 128] [--lengths 200,256] [--dtypes ...]
        [--masks dense]
    # tokamax 0.0.17 installed; about 10 s a case on an H200 (48 cases by default)
"""

from __future__ import annotations

import argparse
import itertools
import os

import _setup  # noqa: F401

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_seqpar as jsp  # noqa: E402
from jax_seqpar.kernels.base import TILE_ALIGNED, TILE_DENSE  # noqa: E402
from jax_seqpar.kernels.tokamax import TokamaxKernel  # noqa: E402
from jax_seqpar.masks import MaskSpec  # noqa: E402
from jax_seqpar.parallel.common import AttnConfig  # noqa: E402
from jax_seqpar.parallel.local import local_attention  # noqa: E402
from _util import env_info, out_dir, save_json  # noqa: E402
from kernels import _rel, low_scores  # noqa: E402  (NaN in, NaN out)


def _grads(f, q, k, v, do):
    o, vjp = jax.vjp(f, q, k, v)
    return o, vjp(do)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", default="64,128", help="head dims, comma-separated")
    p.add_argument("--lengths", default="200,256,300", help="sequence lengths")
    p.add_argument("--dtypes", default="bfloat16,float16")
    p.add_argument("--masks", default="causal,dense",
                   help="causal, dense or both (causal first), comma-separated")
    args = p.parse_args()
    import tokamax
    kern = TokamaxKernel()
    rows, bad = [], 0
    Hq, Hkv = 4, 2
    path = os.path.join(out_dir(), "tokamax_ragged_probe.json")
    dims = [int(x) for x in args.dims.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    masks = args.masks.split(",")
    if not masks or set(masks) - {"causal", "dense"}:
        p.error(f"--masks: causal and/or dense, not {args.masks!r}")
    causals = [m == "causal" for m in masks]
    for causal, D, dt, T, low in itertools.product(
            causals, dims, args.dtypes.split(","), lengths, (False, True)):
        dtype = jnp.dtype(dt)
        ks = jax.random.split(jax.random.PRNGKey(T + D), 4)
        q = jax.random.normal(ks[0], (1, T, Hq, D), dtype)
        k = jax.random.normal(ks[1], (1, T, Hkv, D), dtype)
        if low:
            q, k = low_scores(ks[0], q.shape, k.shape, dtype)
        v = jax.random.normal(ks[2], (1, T, Hkv, D), dtype)
        do = jax.random.normal(ks[3], (1, T, Hq, D), dtype)
        pos = jnp.arange(T, dtype=jnp.int32)
        scale = D ** -0.5
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731

        def ref(q, k, v):
            return jsp.reference_attention(q, k, v, causal=causal, q_pos=pos, kv_pos=pos,
                                           scale=scale)[0]

        def public(q, k, v):
            return tokamax.dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                 implementation="mosaic")

        cfg = AttnConfig(axis_name="sp", mask=MaskSpec(causal=causal), scale=scale,
                         kernel=kern)
        tile = TILE_ALIGNED if causal else TILE_DENSE

        def ours(q, k, v):
            return local_attention(cfg, q, k, v, pos, pos, tile=tile)

        ro, rg = jax.jit(lambda *a: _grads(ref, *a))(f32(q), f32(k), f32(v), f32(do))
        budget = 1e-1 if low else 2e-2
        row = dict(causal=causal, D=D, dtype=dt, T=T, low_scores=low, budget=budget)
        for name, f in (("tokamax_public", public), ("backend", ours)):
            o, g = jax.jit(lambda *a, f=f: _grads(f, *a))(q, k, v, do)
            nans = [int(jnp.isnan(x).sum()) for x in g]
            errs = [_rel(o, ro)] + [_rel(x, r) for x, r in zip(g, rg)]
            row[name] = dict(nan_dq_dk_dv=nans, err_out_dq_dk_dv=errs)
            if name == "backend" and (sum(nans) or not max(errs) <= budget):
                bad += 1
        rows.append(row)
        save_json(dict(env=env_info(), rows=rows), path)  # a time limit keeps the rows
        print(f"{'causal' if causal else 'dense '} D={D:3d} {dt:8s} T={T} "
              f"{'low   ' if low else 'random'}  "
              + "  ".join(f"{n}: NaN {row[n]['nan_dq_dk_dv']} err "
                          + " ".join(f"{e:.1e}" for e in row[n]["err_out_dq_dk_dv"])
                          for n in ("tokamax_public", "backend")), flush=True)
    print(f"backend: {len(rows) - bad} of {len(rows)} cases finite and within budget")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
