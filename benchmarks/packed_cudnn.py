"""cuDNN's own packed ("ragged", THD) attention against the library's packed path (issue
27), one H200: can cuDNN serve packed documents itself, and is it faster?

cuDNN's packed mode, as JAX 0.11 exposes it in ``jax._src.cudnn.fused_attention_stablehlo
.dot_product_attention(q_seqlen=, kv_seqlen=, q_offsets=, kv_offsets=)``, takes the
documents as runs: per batch row, the start and length of each of at most ``M``
segments, ``M`` static.  For each S in 16k, 64k, 128k (H = 16, D = 128, bf16, causal,
documents log-normal around 4k), this script:

* checks its output, statistics and gradients against cuDNN called once per document
  (``packed.per_document_grads``) and against ``jax_seqpar.attention`` packed
  (``kernel="auto"``), and reports the layout of its softmax statistics
  (``[B * M, N, T]``: segment ``i``'s rows at local indices ``0 .. len_i``);
* times forward + backward with ``M`` = the exact number of documents and ``M`` = 64
  (a static bound a caller would have to pick), against the library's packed call and
  cuDNN on the unpacked sequence, in alternating rounds.

    python benchmarks/packed_cudnn.py     # one H200, ~2 minutes
"""

from __future__ import annotations

import json
import os
import time

import _setup  # noqa: F401

import jax
import jax.numpy as jnp
import numpy as np

import jax_seqpar as jsp
from jax_seqpar.kernels import PallasMgpuKernel
from jax_seqpar.masks import MaskSpec
from packed import lognormal_lengths, packed_ids, per_document_grads, useful_pairs
from _util import env_info, out_dir, round_order, save_json

H, D = 16, 128
SCALE = D ** -0.5
res = {"env": None, "rows": [], "checks": [], "notes": []}


def note(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    res["notes"].append(s)


def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def runs(seg_row, M):
    """cuDNN's packed arguments for one row of segment ids: ``seqlen [1, M]`` and
    ``offsets [1, M + 1]`` (-1 past the last run), and the runs' starts and lengths."""
    seg_row = np.asarray(seg_row)
    starts = np.flatnonzero(np.r_[True, seg_row[1:] != seg_row[:-1]])
    lens = np.diff(np.r_[starts, len(seg_row)])
    if len(starts) > M:
        raise ValueError(f"{len(starts)} documents exceed M={M}")
    sl = -np.ones((1, M), np.int32)
    off = -np.ones((1, M + 1), np.int32)
    sl[0, :len(starts)] = lens
    off[0, :len(starts)] = starts
    off[0, len(starts)] = len(seg_row)
    return jnp.asarray(sl), jnp.asarray(off), starts, lens


def cudnn_packed(seg_row, M):
    from jax._src.cudnn import fused_attention_stablehlo as fa
    sl, off, starts, lens = runs(seg_row, M)

    def f(q, k, v):
        return fa.dot_product_attention(q, k, v, q_seqlen=sl, kv_seqlen=sl, q_offsets=off,
                                        kv_offsets=off, scale=SCALE,
                                        mask_type=fa.MaskType.CAUSAL, return_residual=True)
    return f, starts, lens


def main():
    res["env"] = env_info()
    mesh = jax.make_mesh((1,), ("sp",), devices=jax.devices()[:1])
    pos_mask = MaskSpec(causal=True)
    for S in (16384, 65536, 131072):
        ks = jax.random.split(jax.random.PRNGKey(S), 4)
        q, k, v, do = (jax.random.normal(kk, (1, S, H, D), jnp.bfloat16) for kk in ks)
        seg = jnp.asarray(packed_ids(lognormal_lengths(4096, S, seed=S + 4096), S)[None])
        ndocs = len(np.unique(np.asarray(seg[0])))
        useful = 3.5 * 2 * H * D * useful_pairs(np.asarray(seg[0]))
        full = 3.5 * 2 * H * D * float(S) ** 2
        ref = per_document_grads(q, k, v, do, seg)
        pos = jnp.arange(S, dtype=jnp.int32)
        _, lse = jax.jit(lambda q, k, v, s: PallasMgpuKernel().fwd(
            q, k, v, pos, pos, pos_mask, SCALE, s, s))(q, k, v, seg)
        lse = np.asarray(lse)[0]

        def api(q, k, v):
            return jsp.attention(q, k, v, mesh=mesh, causal=True, segment_ids=seg,
                                 kernel="auto")
        fns = {"packed auto": jax.jit(lambda q, k, v, do: jax.vjp(api, q, k, v)[1](do))}
        g = fns["packed auto"](q, k, v, do)
        res["checks"].append(dict(S=S, what="packed auto", **{
            n: rel(a, b) for n, a, b in zip(("dq", "dk", "dv"), g, ref)}))
        note(f"S={S} packed auto vs per-document cuDNN: {res['checks'][-1]}")
        for M in (ndocs, 64):
            f, starts, lens = cudnn_packed(seg[0], M)
            o, st = jax.jit(f)(q, k, v)
            st = np.asarray(st)
            stat_err = max(float(np.abs(st[i, :, :n] - lse[:, a:a + n]).max())
                           for i, (a, n) in enumerate(zip(starts, lens)))
            fb = jax.jit(lambda q, k, v, do, f=f: jax.vjp(lambda *a: f(*a)[0], q, k, v)[1](do))
            g = fb(q, k, v, do)
            row = dict(S=S, what=f"cudnn packed M={M}", stats_shape=list(st.shape),
                       stats_err_vs_mgpu_lse=stat_err,
                       **{n: rel(a, b) for n, a, b in zip(("dq", "dk", "dv"), g, ref)})
            res["checks"].append(row)
            note(f"S={S} cudnn packed M={M} vs per-document cuDNN: {row}")
            fns[f"cudnn packed M={M}"] = fb

        def cu(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        fns["unpacked cudnn"] = jax.jit(lambda q, k, v, do: jax.vjp(cu, q, k, v)[1](do))
        for fn in fns.values():
            jax.block_until_ready(fn(q, k, v, do))
        names = list(fns)
        ts = {n: [] for n in names}
        for r in range(5):
            for n in round_order(names, r, seed=S):
                t0 = time.perf_counter()
                jax.block_until_ready(fns[n](q, k, v, do))
                ts[n].append(time.perf_counter() - t0)
        tb = np.array(ts["unpacked cudnn"])
        for n in names:
            t = np.array(ts[n])
            fl = full if n == "unpacked cudnn" else useful
            row = dict(S=S, name=n, docs=ndocs, ms=1e3 * float(np.median(t)),
                       tflops=fl / float(np.median(t)) / 1e12,
                       useful_vs_cudnn=float(np.median((useful / t) / (full / tb))))
            res["rows"].append(row)
            note(f"S={S} {n:20s} {row['ms']:8.2f} ms {row['tflops']:6.1f} TF/s "
                 f"useful/cuDNN {100 * row['useful_vs_cudnn']:5.1f}%")
        del q, k, v, do, fns
    save_json(res, os.path.join(out_dir(), "packed_cudnn.json"))


if __name__ == "__main__":
    main()
