"""Packed documents (issue 27): correctness of the document-skipping kernels, then packed
against unpacked attention speed, one GPU call.

Phases (``--phases``, comma-separated; they run in this order, each catches its own
failures, and each starts only while the time budget allows):

* ``check``: every changed kernel path against the float32 reference
  (``jax_seqpar.reference``), forward and backward, bf16, D 64 and 128, random inputs:
  the Triton kernel ``pallas``, the Hopper kernel ``pallas_mgpu`` (its default and its
  other dQ path: atomic at D 128, two kernels at D 64) called directly on tiles with
  packed segment ids -- documents spanning tile borders, short documents (many per
  tile), one document, interleaved (unsorted) ids, a ring step whose first queries see
  no key (fully masked rows), a zigzag shard pair, a ragged non-causal tile -- and
  ``jax_seqpar.attention`` on a one-device mesh (``kernel="auto"``; contiguous and
  striped layouts).  One line PASS/FAIL per case (relative errors, budget 2e-2).
* ``layout``: ``choose_layout``'s model for 8 devices on the timing phase's documents
  (no device work): which layout ``layout="auto"`` would take, and why.
* ``bench``: causal forward + backward at S = 16k, 64k (and 128k), H = 16, D = 128,
  bf16, B = 1, documents of log-normal lengths around 1k / 4k / 16k tokens (sigma 0.6),
  through ``jax_seqpar.attention`` on a one-device mesh: unpacked (no segment ids;
  ``auto`` = cuDNN) and cuDNN called directly on the whole sequence, against packed with
  ``kernel="auto"``, ``"pallas"``, the Hopper kernel with its other dQ path (the
  split atomic dQ at D = 128) and, at 16k/64k, ``pallas_mgpu`` without
  the skipping
  (``MgpuConfig(segment_skip=False)``: the state before).  Timed in alternating rounds
  (``--rounds``, 9 by default; 2 fewer from 128k on)
  (every function once per round, in a shifting order); medians and the median of the
  per-round ratios; then ``--sustained-rounds`` (5) rounds of back-to-back calls,
  about ``--sustained-ms`` (300) of one function at a time with one synchronisation
  (``sustained``: each call in the clock state that calls of its kind keep the GPU in,
  as in a training loop), and ``--device-rounds`` (5) rounds under the profiler, whose
  device times (first kernel's start to last kernel's end of each synchronised call)
  leave out the host's dispatch and round trip that the wall clock adds to every call
  (``device ms``, and the bar's ratio on them: the issue's bar is a rate, so it is read
  on these; RESULTS.md, "fourth pass"; the JSON's ``device_kernels``: each call's
  kernels in launch order, median ms).  ``--round-docs N``: each mix is timed again with
  its documents rounded to multiples of N, so none straddles a tile.  Useful TFLOP/s
  count the within-document causal
  FLOPs,
  ``3.5 * 2 * H * D * sum(L^2)`` (FlashAttention's convention: half of ``4 H D L^2``
  forward, the backward 2.5x); the unpacked calls are counted on their own causal FLOPs.
  ``useful / cuDNN`` is the issue's bar (>= 70% at 64k, >= 60% at 16k).  With
  ``--mgpu-variant`` each variant's gradients are first compared with ``packed auto``'s
  on the same inputs, three calls each (``variant_agreement``, ``vs_packed_auto`` in
  the JSON; ``packed auto`` against itself gives the floor of its dQ's summation order).
* ``train``: one AdamW step of the 1B Llama shape at 64k tokens on one GPU, packed
  (documents around 4k) against unpacked (the issue's bar: packed faster, by a factor).
* ``bench_large``: the timing at 128k (last: "if time allows"), after a check of the
  packed call's gradients there against cuDNN called once per document (documents ~4k).

``--quick`` checks D 128 only (both Hopper dQ paths, the API on one layout), times 16k
and 64k in 3 rounds without the no-skip baseline; ``--budget-s`` (300) stops starting
new work after that many seconds (checked per phase, check group, S and document mix;
``train`` needs ``--train-need-s`` left, ``bench_large`` 80 s).  ``--dry-run`` runs
everything tiny on CPU (interpret mode, the xla kernel) to catch mistakes before a GPU
call.  Prints a compact table last, writes JSON (and a PNG when matplotlib is there) to
``$OUT`` or ``benchmarks/out``, and exits 1 if a check failed.

    python benchmarks/packed.py --dry-run          # CPU, 1-3 minutes
    python benchmarks/packed.py                    # one H200, ~6 minutes
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback

import _setup  # noqa: F401,E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_seqpar as jsp  # noqa: E402
from jax_seqpar.kernels import PallasConfig, PallasKernel, PallasMgpuKernel  # noqa: E402
from jax_seqpar.kernels.pallas_mgpu import DEFAULT_MGPU_CONFIGS, is_hopper  # noqa: E402
from jax_seqpar.layouts import shard_positions  # noqa: E402
from jax_seqpar.masks import MaskSpec  # noqa: E402
from jax_seqpar.parallel.choose import choose_layout, segments_from_lengths  # noqa: E402
from jax_seqpar.reference import reference_attention  # noqa: E402
from _profile import device_rounds  # noqa: E402
from kernels import parse_mgpu_variant  # noqa: E402
from _util import (env_info, out_dir, pyplot, round_order, save_json,  # noqa: E402
                   sustained_rounds)

BF16 = jnp.bfloat16
BUDGET = 2e-2
T0 = time.perf_counter()


def elapsed():
    return time.perf_counter() - T0


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    n = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (n if n > 0 else 1.0))


# --------------------------------------------------------------------------- documents
def lognormal_lengths(mean: int, S: int, seed: int, sigma: float = 0.6):
    """Document lengths (median ``mean``) filling ``S`` tokens; the last one is cut."""
    rng = np.random.default_rng(seed)
    lens = []
    while sum(lens) < S:
        lens.append(max(1, int(rng.lognormal(np.log(mean), sigma))))
    lens[-1] -= sum(lens) - S
    return [n for n in lens if n > 0]


def round_lengths(lens, S: int, multiple: int):
    """``lens`` each rounded to a multiple of ``multiple`` (at least one), the last ones
    cut or lengthened so that they fill ``S`` (a multiple of ``multiple``) again: the same
    mix with every document starting on a tile boundary (``--round-docs``)."""
    if S % multiple:
        raise ValueError(f"round_lengths: S={S} is not a multiple of {multiple}")
    out = [max(multiple, multiple * round(n / multiple)) for n in lens]
    while sum(out) > S:
        out[-1] -= min(out[-1], sum(out) - S)
        out = [n for n in out if n > 0]
    out[-1] += S - sum(out)
    return out


def packed_ids(lens, S):
    """Segment ids ``[S]`` of documents of ``lens`` (cut at ``S``) from position 0."""
    lens = list(lens)
    while sum(lens) > S:
        lens[-1] -= min(lens[-1], sum(lens) - S)
        lens = [n for n in lens if n > 0]
    return segments_from_lengths(lens, S)[0]


def useful_pairs(seg_row) -> float:
    """Sum over documents of L^2 (query-key pairs of a causal document, doubled)."""
    _, counts = np.unique(seg_row, return_counts=True)
    return float((counts.astype(np.float64) ** 2).sum())


# --------------------------------------------------------------------------- check
def check_cases(T, seed=0):
    """``{name: (causal, q_pos, kv_pos, q_seg [B, T], kv_seg [B, T])}`` of one shape."""
    rng = np.random.default_rng(seed)
    B = 2
    ar = np.arange(T)

    def rows(fn):
        return np.stack([fn(b) for b in range(B)]).astype(np.int32)

    spanning = rows(lambda b: packed_ids(lognormal_lengths(T // 10, T, seed + b), T))
    short = rows(lambda b: packed_ids(list(rng.integers(1, 21, T)), T))
    unsorted = rows(lambda b: rng.integers(0, 3, T))  # interleaved: ids go up and down
    # a ring step: queries at T..2T-1, keys at 0..T-1; the queries of documents that
    # start at T or later see no key at all (fully masked rows)
    glob2 = rows(lambda b: packed_ids(lognormal_lengths(T // 6, 2 * T, seed + 7 + b), 2 * T))
    G, S4 = 4, 4 * T
    glob4 = rows(lambda b: packed_ids(lognormal_lengths(T // 5, S4, seed + 9 + b), S4))
    zq, zk = shard_positions("zigzag", 1, T, G, xp=np), shard_positions("zigzag", 0, T, G, xp=np)
    return {
        "docs_spanning_tiles": (True, ar, ar, spanning, spanning),
        "short_docs": (True, ar, ar, short, short),
        "single_doc": (True, ar, ar, np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)),
        "unsorted_ids": (True, ar, ar, unsorted, unsorted),
        "ring_step_masked_rows": (True, ar + T, ar, glob2[:, T:], glob2[:, :T]),
        "zigzag_pair": (True, zq, zk, glob4[:, zq], glob4[:, zk]),
    }


def _inputs(key, B, Tq, Tk, Hq, Hkv, D, dtype=BF16):
    ks = jax.random.split(jax.random.PRNGKey(key), 4)
    return (jax.random.normal(ks[0], (B, Tq, Hq, D), dtype),
            jax.random.normal(ks[1], (B, Tk, Hkv, D), dtype),
            jax.random.normal(ks[2], (B, Tk, Hkv, D), dtype),
            jax.random.normal(ks[3], (B, Tq, Hq, D), dtype))


def _reference(causal):
    @jax.jit
    def f(q, k, v, do, qp, kp, qs, ks):
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        (o, lse), vjp = jax.vjp(lambda q, k, v: reference_attention(
            q, k, v, causal=causal, segment_ids=qs, kv_segment_ids=ks, q_pos=qp,
            kv_pos=kp), f32(q), f32(k), f32(v))
        return o, lse, vjp((f32(do), jnp.zeros_like(lse)))
    return f


def _kernel_fn(kern, causal, scale):
    mask = MaskSpec(causal=causal)

    @jax.jit
    def f(q, k, v, do, qp, kp, qs, ks):
        o, lse = kern.fwd(q, k, v, qp, kp, mask, scale, qs, ks)
        grads = kern.bwd(q, k, v, o.astype(q.dtype), lse, do, qp, kp, mask, scale, qs, ks)
        return o, lse, grads
    return f


def _compare(got, ref, qs=None, ks=None):
    """Relative errors of (o, lse, dq, dk, dv); rows that see nothing must give o = 0,
    lse = -inf and no NaN."""
    o, lse, (dq, dk, dv) = got
    ro, rlse, (rdq, rdk, rdv) = ref
    lse, rlse = np.asarray(lse, np.float64), np.asarray(rlse, np.float64)
    fin = np.isfinite(rlse)
    err = {"o": _rel(o, ro), "dq": _rel(dq, rdq), "dk": _rel(dk, rdk), "dv": _rel(dv, rdv),
           "lse": _rel(np.where(fin, lse, 0), np.where(fin, rlse, 0))}
    bad = []
    if not (np.isneginf(lse) == ~fin).all():
        bad.append("lse -inf pattern")
    empty = ~fin  # [B, H, T]
    if empty.any():
        o_rows = np.abs(np.asarray(o, np.float32)).max(-1).transpose(0, 2, 1)  # [B, H, T]
        if (o_rows[empty] != 0).any():
            bad.append("o != 0 on rows that see nothing")
    if any(np.isnan(np.asarray(x, np.float32)).any() for x in (o, dq, dk, dv)):
        bad.append("NaN")
    return err, bad


def run_check(args, on_gpu):
    rows = []
    T = 128 if args.dry_run else 1024
    dims = [64] if args.dry_run else ([128] if args.quick else [128, 64])
    Hq, Hkv = 4, 2
    backends = {}
    for D in dims:
        if on_gpu:
            backends[D] = {"pallas": PallasKernel()}
        else:  # interpret mode; tiles of 16 so that the tiny shapes have many blocks
            backends[D] = {"pallas": PallasKernel(config=PallasConfig(
                block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16))}
        if on_gpu and is_hopper():  # the default, its other dQ path (not the no-skip one)
            backends[D].update(list(_mgpu_variants(D).items())[:2])
        elif not args.dry_run:
            print("check: no Hopper GPU, pallas_mgpu not checked", flush=True)
    groups = {"causal": check_cases(T)}
    Tq, Tk = (T - 24, T - 80)  # ragged, non-causal: bidirectional packed documents
    seg = np.stack([packed_ids(lognormal_lengths(T // 8, T, 3 + b), T) for b in range(2)])
    groups["noncausal_ragged"] = {"noncausal_ragged": (
        False, np.arange(Tq), np.arange(Tk), seg[:, :Tq].astype(np.int32),
        seg[:, :Tk].astype(np.int32))}
    for D in dims:
        for gname, cases in groups.items():
            causal = next(iter(cases.values()))[0]
            ref_fn = _reference(causal)
            for bname, kern in backends[D].items():
                if elapsed() > args.budget_s:
                    print(f"check D={D} {bname} {gname}: skipped (time budget)", flush=True)
                    continue
                fn = _kernel_fn(kern, causal, D ** -0.5)
                for cname, (_, qp, kp, qs, ks) in cases.items():
                    rows.append(_check_one(fn, ref_fn, f"kernel {bname}", cname, D, qp, kp,
                                           qs, ks, Hq, Hkv))
    if args.dry_run:  # the Hopper paths cannot run here; lower them for CUDA instead
        rows += dry_lowering(T, Hq, Hkv)
    # the public entry point on one device: ring path (halves and merges), kernel="auto"
    mesh = jax.make_mesh((1,), ("sp",), devices=jax.devices()[:1])
    api_runs = [(dims[-1], "contiguous"), (dims[-1], "striped"), (dims[0], "contiguous")]
    if args.quick:
        api_runs = api_runs[:1]
    for D, layout in dict.fromkeys(api_runs):
        if elapsed() > args.budget_s:
            print(f"check api D={D} {layout}: skipped (time budget)", flush=True)
            continue

        @jax.jit
        def api(q, k, v, do, qp, kp, qs, ks, layout=layout):
            o, vjp = jax.vjp(lambda q, k, v: jsp.attention(
                q, k, v, mesh=mesh, causal=True, layout=layout, segment_ids=qs,
                kernel="auto"), q, k, v)
            return o, jnp.zeros(o.shape[:1] + o.shape[2:3] + o.shape[1:2]), vjp(do)
        ref_fn = _reference(True)
        for cname in ("docs_spanning_tiles", "short_docs", "single_doc"):
            _, qp, kp, qs, ks = groups["causal"][cname]
            rows.append(_check_one(api, ref_fn, f"api auto {layout}", cname, D, qp, kp, qs, ks,
                                   Hq, Hkv, check_lse=False))
    return rows


def _mgpu_variants(D):
    """The Hopper kernel's default, its other dQ path (the split atomic dQ at D = 128,
    two kernels at D = 64 whose default is atomic), and the default without the skipping
    (the state before issue 27)."""
    cfg = DEFAULT_MGPU_CONFIGS[D]
    if cfg.atomic_dq:
        name, other = "two_kernel_dq", dataclasses.replace(cfg, atomic_dq=False,
                                                           split_dq=False)
    else:
        name, other = "split_dq", dataclasses.replace(cfg, atomic_dq=True,
                                                      split_dq=D >= 128)
    return {"pallas_mgpu": PallasMgpuKernel(),
            "pallas_mgpu_" + name: PallasMgpuKernel(config=other),
            "pallas_mgpu_no_skip": PallasMgpuKernel(
                config=dataclasses.replace(cfg, segment_skip=False))}


def dry_lowering(T, Hq, Hkv):
    """``--dry-run``: trace and lower (for CUDA) what only a Hopper GPU runs -- the check's
    ``pallas_mgpu`` calls and the bench's packed attention on it -- so that the GPU call
    does not die on a mistake in this script."""
    rows = []
    sds = jax.ShapeDtypeStruct
    mesh = jax.make_mesh((1,), ("sp",), devices=jax.devices()[:1])
    for D in (64, 128):
        for name, kern in _mgpu_variants(D).items():
            row = dict(what=f"lower {name}", case="cuda", D=D)
            try:
                q, kv = sds((2, T, Hq, D), BF16), sds((2, T, Hkv, D), BF16)
                pos, seg = sds((T,), jnp.int32), sds((2, T), jnp.int32)
                txt = jax.jit(_kernel_fn(kern, True, D ** -0.5)).trace(
                    q, kv, kv, q, pos, pos, seg, seg).lower(
                    lowering_platforms=("cuda",)).as_text()
                fb = _attn_fns(mesh, kern, True)
                txt += fb.trace(sds((1, 4 * T, 2, D), BF16), *[sds((1, 4 * T, 2, D), BF16)] * 3,
                                sds((1, 4 * T), jnp.int32)).lower(
                    lowering_platforms=("cuda",)).as_text()
                row.update(ok="mosaic_gpu" in txt, err={}, worst=0.0, problems=[])
            except Exception as e:
                row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            print(f"{'PASS' if row['ok'] else 'FAIL'} check D={D:3d} {row['what']:28s} "
                  f"{row.get('error', 'lowered for cuda')}", flush=True)
            rows.append(row)
    return rows


def _check_one(fn, ref_fn, what, cname, D, qp, kp, qs, ks, Hq, Hkv, check_lse=True):
    row = dict(what=what, case=cname, D=D)
    try:
        t0 = time.perf_counter()
        q, k, v, do = _inputs(D + len(cname), qs.shape[0], len(qp), len(kp), Hq, Hkv, D)
        args = (q, k, v, do, jnp.asarray(qp, jnp.int32), jnp.asarray(kp, jnp.int32),
                jnp.asarray(qs), jnp.asarray(ks))
        got = jax.block_until_ready(fn(*args))
        ref = ref_fn(*args)
        if not check_lse:  # the public API returns no lse: compare o and the gradients
            got = (got[0], ref[1], got[2])
        err, bad = _compare(got, ref)
        if not check_lse:
            del err["lse"]
        worst = max(err.values())
        row.update(err=err, worst=worst, problems=bad, ok=bool(worst <= BUDGET and not bad),
                   seconds=time.perf_counter() - t0)
    except Exception as e:  # one failure never stops the script
        row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        traceback.print_exc(limit=3)
    status = "PASS" if row["ok"] else "FAIL"
    detail = (f"worst {row['worst']:.2e} " + " ".join(f"{k} {v:.1e}" for k, v in row["err"].items())
              + (f" {row['problems']}" if row["problems"] else "")) if "err" in row else row["error"]
    print(f"{status} check D={D:3d} {what:28s} {cname:22s} {detail}", flush=True)
    return row


# --------------------------------------------------------------------------- bench
def _attn_fns(mesh, kernel, packed, layout="contiguous"):
    def f(q, k, v, seg):
        return jsp.attention(q, k, v, mesh=mesh, causal=True, layout=layout,
                             segment_ids=seg if packed else None, kernel=kernel)

    def fb(q, k, v, do, seg):
        return jax.vjp(lambda q, k, v: f(q, k, v, seg), q, k, v)[1](do)
    return jax.jit(fb)


def _cudnn_fb():
    def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    return jax.jit(lambda q, k, v, do, seg: jax.vjp(f, q, k, v)[1](do))


def bench_sizes(args, large: bool):
    """``--sizes`` below 128k (``large=False``) or from 128k on: the large ones run after
    the training step, when the budget allows."""
    sizes = [int(x) for x in args.sizes.split(",")]
    return [S for S in sizes if (S >= 131072) == large]


def run_bench(args, on_gpu, sizes):
    rows = []
    H, D = (2, 64) if args.dry_run else (16, 128)
    means = [int(m) for m in args.doc_means.split(",")]
    mesh = jax.make_mesh((1,), ("sp",), devices=jax.devices()[:1])
    hopper = on_gpu and is_hopper()
    for S in sizes:
        if elapsed() > args.budget_s:
            print(f"bench S={S}: skipped (time budget)", flush=True)
            continue
        fns = {"unpacked auto": (_attn_fns(mesh, "auto", False), False)}
        if on_gpu:
            fns["unpacked cudnn direct"] = (_cudnn_fb(), False)
        fns["packed auto"] = (_attn_fns(mesh, "auto", True), True)
        fns["packed pallas"] = (_attn_fns(mesh, "pallas" if on_gpu else PallasKernel(
            config=PallasConfig(block_q=64, block_k=64, block_q_bwd=64, block_k_bwd=64)),
            True), True)
        for text in args.mgpu_variant:  # the packed call with MgpuConfig fields replaced
            name, kern = parse_mgpu_variant(text)
            fns[f"packed {name}"] = (_attn_fns(mesh, kern, True), True)
        if hopper and not args.quick:  # the packed default's other dQ path
            name, kern = list(_mgpu_variants(D).items())[1]
            fns["packed mgpu " + name[len("pallas_mgpu_"):].replace("_", " ")] = (
                _attn_fns(mesh, kern, True), True)
        if hopper and S <= 65536 and not args.quick:
            fns["packed mgpu no skip"] = (
                _attn_fns(mesh, _mgpu_variants(D)["pallas_mgpu_no_skip"], True), True)
        q, k, v, do = _inputs(S, 1, S, S, H, H, D)
        if on_gpu and S >= 131072 and elapsed() < args.budget_s:
            rows.append(large_check(fns["packed auto"][0], q, k, v, do, S))
        mixes = [(m, r) for m in means for r in [0] + ([args.round_docs] if args.round_docs
                                                      else [])]
        for mean, rnd in mixes:
            if elapsed() > args.budget_s:
                print(f"bench S={S} docs~{mean}: skipped (time budget)", flush=True)
                continue
            lens = lognormal_lengths(mean, S, seed=S + mean)
            if rnd:  # the same mix, each document from a multiple of rnd
                lens = round_lengths(lens, S, rnd)
            seg = jnp.asarray(packed_ids(lens, S)[None])
            useful = 3.5 * 2 * H * D * useful_pairs(np.asarray(seg[0]))
            full = 3.5 * 2 * H * D * float(S) ** 2
            ok = {}
            for name, (fn, _) in fns.items():  # compile (first S only) and warm up
                try:
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(q, k, v, do, seg))
                    jax.block_until_ready(fn(q, k, v, do, seg))
                    ok[name] = fn
                    print(f"  warm S={S} docs~{mean} {name}: {time.perf_counter() - t0:.1f} s",
                          flush=True)
                except Exception as e:
                    print(f"bench S={S} {name}: FAILED {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]}", flush=True)
            agree = (variant_agreement(ok, (q, k, v, do, seg), S, mean)
                     if args.mgpu_variant else {})
            names = list(ok)
            ts = {n: [] for n in names}
            rounds = args.rounds if S < 131072 else max(3, args.rounds - 2)
            for r in range(rounds):  # a new order each round (_util.round_order)
                for n in round_order(names, r, seed=S + mean):
                    t0 = time.perf_counter()
                    jax.block_until_ready(ok[n](q, k, v, do, seg))
                    ts[n].append(time.perf_counter() - t0)
            base = "unpacked cudnn direct" if "unpacked cudnn direct" in ts else "unpacked auto"
            calls = {n: (ok[n], (q, k, v, do, seg)) for n in names}
            kernels = {}  # each call's kernels in launch order, median ms over the rounds
            dev = device_rounds(calls, args.device_rounds if on_gpu else 0, seed=S + mean,
                                per_kernel=kernels)
            sus = sustained_rounds(calls, args.sustained_rounds, args.sustained_ms,
                                   {n: np.median(ts[n]) for n in names}, seed=S + mean)
            for n in names:
                t = np.array(ts[n])
                flops = useful if fns[n][1] else full
                row = dict(S=S, doc_mean=mean, doc_round=rnd, docs=len(lens),
                           useful_share=useful / full,
                           name=n, ms=1e3 * float(np.median(t)), rounds=len(t),
                           tflops=flops / float(np.median(t)) / 1e12,
                           useful_tflops=useful / float(np.median(t)) / 1e12)
                if base in ts:  # the bar: useful rate / cuDNN's unpacked rate
                    tb = np.array(ts[base])
                    row["speedup_vs_cudnn"] = float(np.median(tb / t))
                    row["useful_vs_cudnn_rate"] = float(np.median((useful / t) / (full / tb)))
                if n in sus:
                    row["sustained_ms"], row["sustained_calls"] = sus[n]["ms"], sus[n]["calls"]
                    if base in sus:  # the bar in the steady state of each call
                        row["useful_vs_cudnn_sustained"] = ((useful / sus[n]["ms"])
                                                            / (full / sus[base]["ms"]))
                if n in agree:
                    row["vs_packed_auto"] = agree[n]
                if kernels.get(n):  # the packed calls' kernels (the Hopper kernels by name)
                    row["device_kernels"] = [(k[:60], ms) for k, ms in kernels[n]]
                if n in dev:
                    row["device_ms"] = dev[n]
                    if base in dev:  # the same ratio on the device's own time
                        row["useful_vs_cudnn_device"] = (useful / dev[n]) / (full / dev[base])
                rows.append(row)
                print(f"bench S={S:6d} docs~{mean:5d}{f' r{rnd}' if rnd else ''} "
                      f"({len(lens):3d}, useful "
                      f"{100 * useful / full:4.1f}%) {n:22s} {row['ms']:8.2f} ms  "
                      f"{row['tflops']:6.1f} TFLOP/s"
                      + (f"  useful/cuDNN {100 * row['useful_vs_cudnn_rate']:5.1f}%  "
                         f"speedup {row['speedup_vs_cudnn']:.2f}x"
                         if "useful_vs_cudnn_rate" in row else "")
                      + (f"  sustained {row['sustained_ms']:8.2f} ms" if "sustained_ms" in row
                         else "")
                      + (f" ({100 * row['useful_vs_cudnn_sustained']:5.1f}%)"
                         if "useful_vs_cudnn_sustained" in row else "")
                      + (f"  device {row['device_ms']:8.2f} ms" if "device_ms" in row else "")
                      + (f" ({100 * row['useful_vs_cudnn_device']:5.1f}%)"
                         if "useful_vs_cudnn_device" in row else ""), flush=True)
        del q, k, v, do
    return rows


def variant_agreement(ok, args, S, mean, calls: int = 3):
    """Each ``--mgpu-variant`` call's gradients against ``packed auto``'s on the bench's
    own inputs, ``calls`` times (a race in a variant shows in some calls and not others),
    with ``packed auto`` against itself as the floor (its dQ sums in a different order
    each call): ``{name: {"rel": worst relative norm error, "max": worst max-abs error
    over the reference's max-abs, "dq"/"dk"/"dv": each gradient's worst relative norm
    error}}``, ``rel`` and ``max`` over the three gradients.  Apart, they show whether a
    difference is only dQ's summation order (dK and dV, which no CTA adds into, equal to
    the bit in a correct variant that computes the same products)."""
    if "packed auto" not in ok:
        return {}
    ref = [np.asarray(g, np.float32) for g in ok["packed auto"](*args)]
    out = {}
    for name in ok:
        if not name.startswith("packed ") or name == "packed pallas":
            continue
        rel = mx = 0.0
        each = [0.0] * len(ref)
        for _ in range(calls):
            got = ok[name](*args)
            for i, (g, r) in enumerate(zip(got, ref)):
                g = np.asarray(g, np.float32)
                each[i] = max(each[i], _rel(g, r))
                mx = max(mx, float(np.max(np.abs(g - r)) / max(np.max(np.abs(r)), 1e-30)))
            rel = max(each)
        out[name] = {"rel": rel, "max": mx, **dict(zip(("dq", "dk", "dv"), each))}
        print(f"  agreement S={S} docs~{mean} {name:22s} vs packed auto ({calls} calls): "
              f"rel {rel:.2e}  max {mx:.2e}  (dq {each[0]:.2e} dk {each[1]:.2e} "
              f"dv {each[2]:.2e})", flush=True)
    return out


def per_document_grads(q, k, v, do, seg):
    """``(dq, dk, dv)`` float32 by cuDNN unpacked, one causal call per document (each
    zero-padded to a multiple of 2048 at its end -- few distinct shapes to compile; later
    keys are invisible to earlier queries under the causal mask and padded queries carry
    ``do = 0``, so the document's gradients are exact): a reference that shares no code
    with the packed paths."""
    s = np.asarray(seg[0])
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    ends = np.r_[starts[1:], len(s)]

    def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    fb = jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))
    outs = ([], [], [])
    for a, b in zip(starts, ends):
        pad = -(b - a) % 2048
        parts = [jnp.pad(x[:, a:b], ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v, do)]
        for acc, g in zip(outs, fb(*parts)):
            acc.append(np.asarray(g[:, :b - a], np.float32))
    return [np.concatenate(o, axis=1) for o in outs]


def large_check(fn, q, k, v, do, S):
    """Gradients of the packed call at a long sequence (documents ~4k) against
    ``per_document_grads`` (relative errors, the bf16 budget)."""
    seg = jnp.asarray(packed_ids(lognormal_lengths(4096, S, seed=S + 4096), S)[None])
    t0 = time.perf_counter()
    try:
        ref = per_document_grads(q, k, v, do, seg)
        got = fn(q, k, v, do, seg)
        err = {n: _rel(g, r) for n, g, r in zip(("dq", "dk", "dv"), got, ref)}
        row = dict(what="packed auto vs per-document cuDNN", case=f"S={S} docs~4096", D=q.shape[-1],
                   err=err, worst=max(err.values()), ok=max(err.values()) <= BUDGET,
                   seconds=time.perf_counter() - t0)
    except Exception as e:
        row = dict(what="packed auto vs per-document cuDNN", case=f"S={S}", D=q.shape[-1],
                   ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    print(f"large check S={S}: {'PASS' if row['ok'] else 'FAIL'} "
          f"{row.get('err', row.get('error'))}", flush=True)
    return row


# --------------------------------------------------------------------------- layout
def run_layout(args):
    rows = []
    for S in [int(s) for s in args.sizes.split(",")]:
        for mean in [int(m) for m in args.doc_means.split(",")]:
            lens = lognormal_lengths(mean, S, seed=S + mean)
            c = choose_layout(num_devices=8, seq_len=S, doc_lengths=lens)
            rows.append(dict(S=S, doc_mean=mean, layout=c.layout, costs=c.costs,
                             pairs=c.pairs, reason=c.reason))
            print(f"layout G=8 S={S:6d} docs~{mean:5d}: {c.reason}", flush=True)
    return rows


# --------------------------------------------------------------------------- train
def run_train(args, on_gpu):
    import optax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec
    from jax_seqpar.models import Llama, LlamaConfig, next_token_loss
    from train_mfu import SIZES
    size, S = ("tiny", 512) if args.dry_run else ("1b", 65536)
    mesh = jax.make_mesh((1,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
    cfg = LlamaConfig(**SIZES[size], dtype="bfloat16" if on_gpu else "float32",
                      param_dtype="float32", remat="attention")
    model = Llama(cfg, mesh=mesh, layout="contiguous", backward="auto", kernel="auto")
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, S), 0, cfg.vocab_size, jnp.int32)
    seg = jnp.asarray(packed_ids(lognormal_lengths(max(S // 16, 16), S, seed=5), S)[None])
    opt = optax.adamw(1e-4)
    params = jax.jit(lambda key: model.init(key, tokens))(jax.random.PRNGKey(0))
    opt_state = jax.jit(opt.init)(params)
    # one placement in and out, so the second step does not compile again
    rep = NamedSharding(mesh, PartitionSpec())
    params, opt_state, tokens, seg = jax.device_put((params, opt_state, tokens, seg), rep)
    rows = []
    for name, packed in (("unpacked", False), ("packed", True)):
        if elapsed() > args.budget_s:
            print(f"train {name}: skipped (time budget)", flush=True)
            continue

        def step(params, opt_state, tokens, seg, packed=packed):
            (loss, _), grads = jax.value_and_grad(lambda p: next_token_loss(
                model, p, tokens, segment_ids=seg if packed else None), has_aux=True)(params)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
        step = jax.jit(step, out_shardings=(rep, rep, rep))
        try:
            t0 = time.perf_counter()
            p, o, loss = jax.block_until_ready(step(params, opt_state, tokens, seg))
            first = time.perf_counter() - t0
            ts = []
            for _ in range(args.train_steps):
                t0 = time.perf_counter()
                p, o, loss = jax.block_until_ready(step(p, o, tokens, seg))
                ts.append(time.perf_counter() - t0)
            rows.append(dict(size=size, S=S, name=name, step_s=float(np.median(ts)),
                             first_step_s=first, loss=float(loss)))
            print(f"train {size} S={S} {name:8s} step {rows[-1]['step_s']:.3f} s (first "
                  f"{first:.1f} s) loss {float(loss):.3f}", flush=True)
            del p, o
        except Exception as e:
            print(f"train {name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                  flush=True)
            rows.append(dict(size=size, S=S, name=name, error=str(e)[:300]))
    return rows


# --------------------------------------------------------------------------- output
def table(result):
    checks = result.get("check", [])
    if checks:
        n_ok = sum(r["ok"] for r in checks)
        print(f"\ncheck: {n_ok}/{len(checks)} PASS"
              + "".join(f"\n  FAIL {r['what']} D={r['D']} {r['case']}: "
                        f"{r.get('error') or r.get('problems') or r.get('worst')}"
                        for r in checks if not r["ok"]))
    bench = result.get("bench", [])
    if bench:
        print(f"\n{'S':>6s} {'docs~':>6s} {'#':>4s} {'useful':>6s} {'backend':22s} {'ms':>9s} "
              f"{'TFLOP/s':>8s} {'useful/cuDNN':>12s} {'speedup':>8s} {'sustained':>10s} "
              f"{'(useful/cuDNN)':>14s} {'device ms':>10s} {'(useful/cuDNN)':>14s}")
        for r in bench:
            docs = f"{r['doc_mean']}" + ("r" if r.get("doc_round") else "")
            print(f"{r['S']:6d} {docs:>6s} {r['docs']:4d} {100 * r['useful_share']:5.1f}% "
                  f"{r['name']:22s} {r['ms']:9.2f} {r['tflops']:8.1f} "
                  + (f"{100 * r['useful_vs_cudnn_rate']:11.1f}% {r['speedup_vs_cudnn']:7.2f}x"
                     if "useful_vs_cudnn_rate" in r else " " * 21)
                  + (f" {r['sustained_ms']:10.2f}" if "sustained_ms" in r else " " * 11)
                  + (f" {100 * r['useful_vs_cudnn_sustained']:13.1f}%"
                     if "useful_vs_cudnn_sustained" in r else " " * 15)
                  + (f" {r['device_ms']:10.2f}" if "device_ms" in r else "")
                  + (f" {100 * r['useful_vs_cudnn_device']:13.1f}%"
                     if "useful_vs_cudnn_device" in r else ""))
    for r in result.get("train", []):
        if "error" not in r:
            print(f"train {r['size']} S={r['S']} {r['name']:8s} {r['step_s']:.3f} s/step")
    tr = {r["name"]: r for r in result.get("train", []) if "error" not in r}
    if len(tr) == 2:
        ratio = tr["unpacked"]["step_s"] / tr["packed"]["step_s"]
        print(f"train: the packed step is {ratio:.2f}x as fast as the unpacked one")


def plot(rows, path):
    plt = pyplot()
    if plt is None or not rows:
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['S'] // 1024}k/{r['doc_mean']}{'r' if r.get('doc_round') else ''}"
              f"\n{r['name']}" for r in rows]
    ax.bar(range(len(rows)), [r["tflops"] for r in rows])
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
    ax.set_ylabel("TFLOP/s (packed: useful)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv=None):
    global T0
    T0 = time.perf_counter()     # the budget counts from this call, not from the import
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phases", default="check,layout,bench,train,bench_large")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="tiny, on CPU")
    p.add_argument("--sizes", default=None, help="sequence lengths, comma-separated")
    p.add_argument("--doc-means", default=None, help="median document lengths")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--sustained-rounds", type=int, default=5,
                   help="rounds of back-to-back calls (0: off)")
    p.add_argument("--sustained-ms", type=float, default=300.0,
                   help="length of one function's back-to-back run in a sustained round")
    p.add_argument("--device-rounds", type=int, default=5,
                   help="rounds timed by the profiler on the device's clock (GPU only; 0: "
                        "off)")
    p.add_argument("--train-steps", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="start no new work after this many seconds")
    p.add_argument("--train-need-s", type=float, default=110.0,
                   help="the train phase starts only with this much of the budget left "
                        "(two compilations of the 1B step)")
    p.add_argument("--round-docs", type=int, default=0,
                   help="bench also times each mix with its documents rounded to this "
                        "multiple (every document on a tile boundary; 0: off)")
    p.add_argument("--mgpu-variant", action="append", default=[],
                   help="NAME:field=value,...: bench also times the packed call through "
                        "pallas_mgpu with these MgpuConfig fields replaced (Hopper only)")
    args = p.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    try:
        [parse_mgpu_variant(t) for t in args.mgpu_variant]
    except ValueError as e:
        p.error(str(e))
    if args.mgpu_variant and not (on_gpu and is_hopper()):
        p.error("--mgpu-variant: pallas_mgpu needs a Hopper GPU")
    if args.dry_run:
        args.sizes = args.sizes or "512"
        args.doc_means = args.doc_means or "64,256"
        args.rounds = args.rounds or 2
        args.sustained_rounds, args.sustained_ms = min(args.sustained_rounds, 2), 20.0
        args.train_steps = 1
    else:
        # the headline size first, so that a spent budget cuts the least useful
        args.sizes = args.sizes or ("65536,16384" if args.quick else "65536,16384,131072")
        # one compilation per S serves every document mix (segment ids are an argument)
        args.doc_means = args.doc_means or "1024,4096,16384"
        # 9 rounds: one comparison's spread was 5-8% over 5 (RESULTS.md, "second pass"),
        # as large as the gap to the 64k bar; the timed calls are short next to compiling
        args.rounds = args.rounds or (3 if args.quick else 9)
    info = env_info()
    print(f"# {info}\n# {vars(args)}", flush=True)
    result = dict(env=info, args=vars(args))
    path = os.path.join(out_dir(), "packed_" + ("dry" if args.dry_run else info["backend"])
                        + ".json")
    phases = args.phases.split(",")
    runners = {"check": lambda: run_check(args, on_gpu), "layout": lambda: run_layout(args),
               "bench": lambda: run_bench(args, on_gpu, bench_sizes(args, False)),
               "train": lambda: run_train(args, on_gpu),
               "bench_large": lambda: run_bench(args, on_gpu, bench_sizes(args, True))}
    #: seconds of budget a phase must find left to start (its compilations and runs)
    needs = {"train": args.train_need_s, "bench_large": 80.0}
    for ph in phases:
        if ph not in runners:
            p.error(f"--phases: unknown {ph!r}; choose from {sorted(runners)}")
    for ph in runners:
        if ph not in phases:
            continue
        need = 0.0 if args.dry_run else needs.get(ph, 0.0)
        if ph != "check" and elapsed() + need > args.budget_s:
            print(f"{ph}: skipped (time budget of {args.budget_s:.0f} s spent)", flush=True)
            continue
        print(f"\n## {ph} (at {elapsed():.0f} s)", flush=True)
        try:
            result[ph] = runners[ph]()
        except Exception as e:
            print(f"{ph}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}",
                  flush=True)
            traceback.print_exc(limit=5)
            result[ph + "_error"] = f"{type(e).__name__}: {e}"[:500]
        save_json(result, path)
    bench = result.get("bench", []) + result.pop("bench_large", [])
    # large_check's rows (run inside the timing phase, on its inputs) are checks
    result["check"] = result.get("check", []) + [r for r in bench if "what" in r]
    result["bench"] = [r for r in bench if "what" not in r]
    result["seconds"] = elapsed()
    save_json(result, path)
    print(f"\nJSON: {path} ({elapsed():.0f} s)")
    plot(result.get("bench", []), os.path.splitext(path)[0] + ".png")
    table(result)
    failed = [r for r in result.get("check", []) if not r["ok"]]
    return 1 if failed or any(k.endswith("_error") for k in result) else 0


if __name__ == "__main__":
    sys.exit(main())
