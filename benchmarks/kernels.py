"""Local attention kernels: correctness, a block-size sweep, TFLOP/s, and ring efficiency.

Phases (``--phases``, comma-separated; default all that the machine can run):

* ``check``: every backend's forward and backward against the dense float32 reference
  on small inputs -- head dims 64/128/256, bf16/f16/f32, causal, window, segment ids,
  GQA/MQA, ragged lengths, position vectors as a ring step or a zigzag/striped shard
  would give, fully masked rows, scores far below exp's range on ragged lengths.  Errors
  are relative (``||x - ref|| / ||ref||``).  On GPUs the ``cudnn`` backend is checked
  too, through the kernel contract, on the tiles a caller would state (it refuses the
  rest); ``--check-kernels`` names must be backends available here.  ``flash_attn``
  reads positions statically, which ``local_attention``'s ``custom_vjp`` traces: its
  ``fwd`` and ``bwd`` are called directly (eagerly, NumPy positions) on general tiles.
* ``sweep``: Pallas block sizes / warps at S = 16k, bf16, causal and not (picks defaults).
* ``bench``: forward and forward+backward TFLOP/s of ``xla``, ``pallas``,
  ``flash_attn`` (when importable) and cuDNN (``jax.nn.dot_product_attention(
  implementation="cudnn")``) and, on Hopper, ``pallas_mgpu``, S in {4k, 16k, 32k}, H = 16, D in {64, 128}, B = 1, bf16,
  with the bf16 matmul rate measured in the same run.  FLOPs: 4 B H S^2 D forward
  (half of it causal), 2.5x that for the backward (FlashAttention-2 convention).
* ``pair``: cuDNN and the chosen backends (``--bench-kernels``), forward and
  forward+backward, timed in rotation over ``--rounds`` rounds (clock drift hits all
  alike); medians and median ratios to cuDNN.  ``--mgpu-variant NAME:field=value``
  adds a ``pallas_mgpu`` backend with changed config fields, to check and time a change
  against the defaults in the same run.
* ``breakdown``: the device's kernels of one forward+backward call of cuDNN and each
  ``--bench-kernels`` backend, in launch order, each kernel's median duration over
  ``--device-rounds`` calls (profiler; GPU only): where one backend's time goes against
  another's, kernel by kernel.
* ``ring``: causal ring attention (zigzag and striped, tokens in layout order), forward +
  backward at ``--ring-seq`` tokens on all GPUs with each of ``--ring-kernels``, against
  one GPU running cuDNN on the whole sequence, with the error against cuDNN.

    python benchmarks/kernels.py                       # CPU: interpret-mode check only
    python benchmarks/kernels.py --phases check,bench  # on a GPU

A check can be split over several runs (``--dims``, ``--dtypes``, ``--cases``,
``--check-kernels``) and merged with ``benchmarks/merge_checks.py``; ``--hang-dump S``
dumps every thread's stack and exits if one case takes more than S seconds (JAX 0.11.2
was seen to hang now and then while lowering a Pallas kernel; see RESULTS.md).

flash-attn-jax on a GPU machine without network: ``bash benchmarks/carry_flash_attn.sh
pack`` here, carry ``.carry``, and ``source benchmarks/carry_flash_attn.sh unpack`` there
before running this script.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import itertools
import os
import sys
import time

import _setup  # noqa: F401,E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_seqpar as jsp  # noqa: E402
from jax_seqpar.kernels import PallasConfig, PallasKernel, XlaKernel  # noqa: E402
from jax_seqpar.kernels import MgpuConfig, PallasMgpuKernel  # noqa: E402
from jax_seqpar.kernels.cudnn import CudnnKernel  # noqa: E402
from jax_seqpar.kernels.pallas_mgpu import is_hopper  # noqa: E402
from jax_seqpar.layouts import shard_positions  # noqa: E402
from jax_seqpar.kernels.base import TILE_ALIGNED, TILE_DENSE, TILE_GENERAL  # noqa: E402
from jax_seqpar.masks import MaskSpec  # noqa: E402
from jax_seqpar.parallel.common import AttnConfig  # noqa: E402
from jax_seqpar.parallel.local import local_attention  # noqa: E402
from _profile import device_rounds as device_rounds_  # noqa: E402
from _profile import group_calls, profile_timeline  # noqa: E402
from _util import env_info, out_dir, round_order, save_json, time_fn  # noqa: E402

BUDGET = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-2}


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    n = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (n if n > 0 else 1.0))


def backends(on_gpu: bool):
    out = {"xla": XlaKernel(), "pallas": PallasKernel()}
    if on_gpu and is_hopper():
        out["pallas_mgpu"] = PallasMgpuKernel()  # the tuned table's configs (mgpu_tuning)
        out["pallas_mgpu_untuned"] = PallasMgpuKernel(tuned=False, name="pallas_mgpu_untuned")
    if on_gpu and is_hopper():
        try:  # the optional tokamax backend, and tokamax called as a user would
            from jax_seqpar.kernels.tokamax import TokamaxKernel, tokamax_module
            tokamax_module()
            out["tokamax"] = TokamaxKernel()
            out["tokamax_direct"] = None
        except Exception as e:
            print(f"tokamax: not available ({type(e).__name__}: {str(e)[:100]})")
    try:
        from jax_seqpar.kernels.flash_attn import FlashAttnKernel
        fa = FlashAttnKernel()
        fa.available()
        out["flash_attn"] = fa
    except Exception as e:  # not installed / no GPU: reported, not fatal
        print(f"flash_attn: not available ({type(e).__name__}: {str(e)[:100]})")
    return out


def make_fn(kernel, mask, scale, tile=TILE_GENERAL):
    cfg = AttnConfig(axis_name="sp", mask=mask, scale=scale, kernel=kernel)

    def f(q, k, v, q_pos, kv_pos, q_seg=None, kv_seg=None):
        return local_attention(cfg, q, k, v, q_pos, kv_pos, q_seg, kv_seg, tile=tile)
    return f


# ---------------------------------------------------------------------------- check
CHECK_CASES = {
    # name: (B, Tq, Tk, Hq, Hkv, positions, causal, window, segments[, "low"]); "low":
    # scores around -24 sqrt(D) (lse far below -88, where exp of a padded key's 0 - lse
    # overflows: the Hopper backward's NaN of 2026-12-04; low_scores)
    "dense": (2, 256, 256, 4, 4, "contiguous", False, None, False),
    "causal_gqa": (2, 256, 256, 8, 2, "contiguous", True, None, False),
    "ragged_causal_mqa": (1, 300, 200, 4, 1, "ring_step", True, None, False),
    "window_segments": (2, 256, 384, 4, 2, "contiguous", True, (70, 0), True),
    "zigzag_shard": (1, 256, 256, 4, 2, "zigzag", True, None, False),
    "striped_shard": (1, 256, 256, 4, 4, "striped", True, None, False),
    "masked_rows": (1, 128, 256, 4, 2, "masked_rows", True, None, False),
    # contiguous and as many queries as keys: also checked as an aligned tile (below)
    "ragged_causal_aligned": (1, 300, 300, 4, 1, "contiguous", True, None, False),
    "window_aligned": (1, 256, 256, 4, 2, "contiguous", True, (70, 0), False),
    "segments_aligned": (2, 256, 256, 4, 2, "contiguous", True, None, True),
    # documents of ~256 tokens: whole key blocks in one document as well as cut ones,
    # so the backward's every mask class runs (MgpuConfig.mask_classes)
    "segments_long": (1, 768, 768, 4, 2, "contiguous", True, None, True),
    # documents of ~1.4k tokens, each over many key blocks and query steps
    "segments_regions": (2, 4096, 4096, 4, 2, "contiguous", True, None, True),
    # keys not a multiple of any kernel's block, every score far below exp's range
    "ragged_low_scores": (1, 200, 200, 4, 2, "contiguous", True, None, False, "low"),
    "ragged_low_scores_dense": (1, 200, 200, 4, 2, "contiguous", False, None, False, "low"),
}


def low_scores(key, q_shape, k_shape, dtype):
    """``(q, k)`` whose scores lie around ``-24 sqrt(D)`` (-192 at D 64), spread by a few
    units: queries ``16 u`` and keys ``-1.5 u`` plus noise of 0.5, ``u`` a random sign
    vector per key/value head (a group's query heads share it).  (Identical keys would
    make dQ vanish; a larger common part, worse bf16 precision in dQ, where it cancels.)"""
    B, Tq, Hq, D = q_shape
    Hkv = k_shape[2]
    ku, kn = jax.random.split(key)
    u = jnp.sign(jax.random.normal(ku, (1, 1, Hkv, D)))
    q = jnp.broadcast_to(16 * jnp.repeat(u, Hq // Hkv, axis=2), q_shape)
    k = -1.5 * u + 0.5 * jax.random.normal(kn, k_shape)
    return q.astype(dtype), k.astype(dtype)


@dataclasses.dataclass(frozen=True)
class MgpuVariant(PallasMgpuKernel):
    """``pallas_mgpu`` with some fields of its config replaced (``--mgpu-variant``), to
    compare a change against the backend in one run: the fields replace those of the
    config the backend would run for the call (the tuned table's, on a GPU it has
    entries for), or of the per-head-dim default when the call's dtype and mask are not
    given."""

    overrides: tuple = ()

    def config_for(self, head_dim, dtype=None, mask=None, has_segments=False,
                   tile=TILE_GENERAL):
        from jax_seqpar.kernels.pallas_mgpu_common import DEFAULT_MGPU_CONFIGS
        base = (DEFAULT_MGPU_CONFIGS[head_dim] if dtype is None or mask is None else
                super().config_for(head_dim, dtype, mask, has_segments, tile))
        return dataclasses.replace(base, **dict(self.overrides))


def parse_mgpu_variant(text):
    """``"NAME:field=value,field=value"`` -> ``(NAME, MgpuVariant)``; values are ints or
    true/false."""
    name, _, spec = text.partition(":")
    fields = {f.name for f in dataclasses.fields(MgpuConfig)}
    over = []
    for item in filter(None, spec.split(",")):
        key, _, val = item.partition("=")
        if key not in fields:
            raise ValueError(f"--mgpu-variant {text!r}: {key!r} is not an MgpuConfig field "
                             f"({sorted(fields)})")
        low = val.lower()
        over.append((key, low == "true" if low in ("true", "false") else int(val)))
    if not name or not over:
        raise ValueError(f"--mgpu-variant {text!r}: expected NAME:field=value[,...]")
    return name, MgpuVariant(name=name, overrides=tuple(over))


def unused_variants(names, phases, check_kernels=None, bench_kernels=None):
    """The ``--mgpu-variant`` names that no phase of this run would call: ``check`` takes
    every backend unless ``--check-kernels`` names some, ``bench`` likewise with
    ``--bench-kernels``; ``pair`` and ``breakdown`` only those ``--bench-kernels`` names."""
    check = None if not check_kernels else set(check_kernels.split(","))
    bench = None if not bench_kernels else set(bench_kernels.split(","))
    used = set()
    if "check" in phases:
        used |= set(names) if check is None else set(names) & check
    if "bench" in phases:
        used |= set(names) if bench is None else set(names) & bench
    if {"pair", "breakdown"} & set(phases) and bench is not None:
        used |= set(names) & bench
    return [n for n in names if n not in used]


def check_kernels_for(available, wanted=None, on_gpu=False):
    """The backends the ``check`` phase runs: ``available`` (name -> kernel; ``None`` for
    the direct calls that only ``pair`` and ``bench`` make) by default, or the names of
    ``--check-kernels``, in that order.  A name that is not available here is refused
    with the ones that are: a check that silently leaves a backend out reads as passed.
    By default the GPU check leaves out ``xla`` (the CPU tests cover it at length) and
    the CPU check ``flash_attn``."""
    usable = {n: k for n, k in available.items() if k is not None}
    if not wanted:
        skip = "xla" if on_gpu else "flash_attn"
        return {n: k for n, k in usable.items() if n != skip}
    names = [n for n in wanted.split(",") if n]
    unknown = [n for n in names if n not in usable]
    if unknown:
        raise ValueError(f"--check-kernels: {', '.join(unknown)} not available here "
                         f"(available: {', '.join(sorted(usable))})")
    return {n: usable[n] for n in names}


def _positions(kind, Tq, Tk):
    if kind == "contiguous":
        return np.arange(Tq) + (Tk - Tq if Tk > Tq else 0), np.arange(Tk)
    if kind == "ring_step":  # queries of device 3 against keys of device 1 and beyond
        return 3 * Tk + np.arange(Tq), Tk + np.arange(Tk)
    if kind == "masked_rows":  # the first queries precede every key (causal: no key)
        return np.arange(Tq) + 64, 100 + np.arange(Tk)
    G = 4
    qp = shard_positions(kind, 2, Tq, G, xp=np)
    kp = shard_positions(kind, 1, Tk, G, xp=np)
    return qp, kp


def _static_fwd_bwd(kern, q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, scale):
    """``(o, vjp)`` of a backend's ``fwd`` and ``bwd`` called as ``local_attention``'s rules
    call them (``o`` saved in the input dtype), with NumPy positions and no ``jit``: the
    general tiles of a backend that reads positions statically (flash-attn), which no
    differentiable call reaches (its positions are traced under ``custom_vjp``)."""
    o, lse = kern.fwd(q, k, v, q_pos, kv_pos, mask, scale, q_seg, kv_seg)
    o = o.astype(q.dtype)

    def vjp(do):
        return tuple(g.astype(x.dtype) for g, x in zip(
            kern.bwd(q, k, v, o, lse, do, q_pos, kv_pos, mask, scale, q_seg, kv_seg),
            (q, k, v)))
    return o, vjp


def check(kernels, dims, dtypes, on_row=lambda rows: None, cases=None, trace=False,
          hang_dump=None):
    """``on_row(rows)`` runs after every case (the caller saves, so a time limit that
    stops the run keeps the cases already checked).  ``cases``: names to run (default
    all); ``trace``: print when each case's forward has run (to locate a hang);
    ``hang_dump``: seconds after which a case dumps every thread's stack and exits."""
    rows = []
    chosen = {n: c for n, c in CHECK_CASES.items() if cases is None or n in cases}
    for (name, case), D, dt in itertools.product(chosen.items(), dims, dtypes):
        if hang_dump:
            faulthandler.dump_traceback_later(hang_dump, exit=True)
        B, Tq, Tk, Hq, Hkv, pos, causal, window, seg, *scores = case
        dtype = jnp.dtype(dt)
        ks = jax.random.split(jax.random.PRNGKey(D), 4)
        q = jax.random.normal(ks[0], (B, Tq, Hq, D), dtype)
        k = jax.random.normal(ks[1], (B, Tk, Hkv, D), dtype)
        budget = BUDGET[dt]
        if scores == ["low"]:
            q, k = low_scores(ks[0], q.shape, k.shape, dtype)
            # float32 scores of ~24 sqrt(D) log2 e (~560 at D 256) round by up to ~3e-5
            # before exp2, P's relative error; in 16 bits dQ, where the keys' common part
            # cancels, carries dS's rounding times that part over the keys' spread (the
            # XLA kernel reads 1.4-5.3e-2 on such inputs).  What these cases must catch, a
            # padded key let through, is NaN or an lse off by far more
            budget = 1e-4 if dt == "float32" else 1e-1
        v = jax.random.normal(ks[2], (B, Tk, Hkv, D), dtype)
        do = jax.random.normal(ks[3], (B, Tq, Hq, D), dtype)
        qp_np, kp_np = (np.asarray(x, np.int32) for x in _positions(pos, Tq, Tk))
        qp, kp = jnp.asarray(qp_np), jnp.asarray(kp_np)
        rng = np.random.default_rng(0)
        qs = jnp.asarray(np.sort(rng.integers(0, 3, (B, Tq)), -1), jnp.int32) if seg else None
        kvs = jnp.asarray(np.sort(rng.integers(0, 3, (B, Tk)), -1), jnp.int32) if seg else None
        mask = MaskSpec(causal=causal, window=window)
        scale = D ** -0.5
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731

        def ref(q, k, v):
            return jsp.reference_attention(q, k, v, causal=causal, window=window, q_pos=qp,
                                           kv_pos=kp, segment_ids=qs, kv_segment_ids=kvs,
                                           scale=scale)[0]
        def ref_fwd_bwd(q, k, v, do):
            ro, rvjp = jax.vjp(ref, q, k, v)
            return ro, rvjp(do)
        t_ref = time.perf_counter()  # its compile is most of a case: 3-12 s on an H200
        ro, rgrads = jax.block_until_ready(
            jax.jit(ref_fwd_bwd)(f32(q), f32(k), f32(v), f32(do)))
        t_ref = time.perf_counter() - t_ref
        # a tile-aware backend is also checked on the tile kind a caller would state for
        # this case (positions traced either way): dense without a mask, aligned with one
        stated = (TILE_DENSE if mask.is_dense else TILE_ALIGNED) \
            if pos == "contiguous" and Tq == Tk else None
        runs = [(kname, kern, TILE_GENERAL) for kname, kern in kernels.items()]
        runs += [(f"{kname}@{stated}", kern, stated) for kname, kern in kernels.items()
                 if stated and getattr(kern, "tile_aware", False)]
        for kname, kern, tile in runs:
            t0 = time.perf_counter()
            try:
                g = make_fn(kern, mask, scale, tile=tile)
                if kname == "flash_attn":  # it needs static positions for causal/window,
                    # which local_attention's custom_vjp traces: its fwd and bwd, eagerly
                    o, vjp = _static_fwd_bwd(kern, q, k, v, qp_np, kp_np, qs, kvs, mask,
                                             scale)
                else:  # positions traced, as inside a ring
                    fn = jax.jit(g)
                    o, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, qp, kp, qs, kvs), q, k, v)
                if trace:
                    jax.block_until_ready(o)
                    print(f"  {name} D={D} {dt} {kname}: forward ran", flush=True)
                grads = vjp(do)
            except NotImplementedError as e:
                print(f"check {name} D={D} {dt} {kname}: refused ({str(e)[:80]})")
                continue
            except Exception as e:  # a compile failure is a failed check, not a crash
                msg = " | ".join(str(e).splitlines()[:3])[:300]
                print(f"check {name} D={D} {dt} {kname}: FAIL {type(e).__name__}: {msg}")
                rows.append(dict(case=name, D=D, dtype=dt, kernel=kname, ok=False,
                                 error=f"{type(e).__name__}: {msg}"))
                continue
            errs = [_rel(o, ro)] + [_rel(g, r) for g, r in zip(grads, rgrads)]
            ok = all(e <= budget for e in errs) and bool(
                np.isfinite(np.asarray(o, np.float32)).all())
            rows.append(dict(case=name, D=D, dtype=dt, kernel=kname, out=errs[0],
                             dq=errs[1], dk=errs[2], dv=errs[3], ok=ok))
            print(f"check {name:18s} D={D:3d} {dt:8s} {kname:10s} out {errs[0]:.1e} "
                  f"dq {errs[1]:.1e} dk {errs[2]:.1e} dv {errs[3]:.1e} "
                  f"{'ok' if ok else 'FAIL'} ({time.perf_counter() - t0:.0f} s; reference "
                  f"{t_ref:.0f} s)", flush=True)
            on_row(rows)
    faulthandler.cancel_dump_traceback_later()
    return rows


# ---------------------------------------------------------------------------- timing
def attn_flops(B, H, S, D, causal):
    f = 4 * B * H * S * S * D
    return f / 2 if causal else f


def matmul_rate():
    n = 8192
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    t = time_fn(f, a, a, warmup=3, repeats=10)["median_s"]
    return 2 * n ** 3 / t


def _cudnn_fn(causal, scale):
    def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                            implementation="cudnn")
    return f


def _backend_fns(name, kern, S, D, causal):
    """Jitted ``(forward, forward+backward)`` of one backend on ``[B, S, H, D]`` inputs."""
    scale = D ** -0.5
    if name == "cudnn":
        f = _cudnn_fn(causal, scale)
    elif name == "flash_attn":  # the package's own differentiable entry point
        from flash_attn_jax import flash_mha

        def f(q, k, v):
            return flash_mha(q, k, v, softmax_scale=scale, is_causal=causal)
    elif name == "tokamax_direct":  # tokamax's public call, as a user would make it
        import tokamax

        def f(q, k, v):
            return tokamax.dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                 implementation="mosaic")
    else:
        pos = jnp.arange(S, dtype=jnp.int32)
        # the whole sequence on one device: one aligned tile (q and k at the same
        # positions), which the index-masking backends (tokamax) serve
        g = make_fn(kern, MaskSpec(causal=causal), scale, tile=TILE_ALIGNED)
        f = lambda q, k, v: g(q, k, v, pos, pos)  # noqa: E731
    return jax.jit(f), jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))


def _inputs(B, H, S, D, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.PRNGKey(S + D), 4)
    return tuple(jax.random.normal(x, (B, S, H, D), dtype) for x in ks)


def time_backend(name, kern, B, H, S, D, causal, dtype=jnp.bfloat16, repeats=5):
    q, k, v, do = _inputs(B, H, S, D, dtype)
    fwd, fb = _backend_fns(name, kern, S, D, causal)
    tf = time_fn(fwd, q, k, v, repeats=repeats)["median_s"]
    tb = time_fn(fb, q, k, v, do, repeats=repeats)["median_s"]
    return tf, tb, fwd(q, k, v), fb(q, k, v, do)


def bench(kernels, sizes, dims, rate):
    rows = []
    names = ["cudnn"] + list(kernels)
    for S, D, causal in itertools.product(sizes, dims, (False, True)):
        fl = attn_flops(1, 16, S, D, causal)
        outs = {}
        for name in names:
            try:
                tf, tb, o, g = time_backend(name, kernels.get(name), 1, 16, S, D, causal)
            except Exception as e:
                print(f"bench S={S} D={D} causal={causal} {name}: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:100]}")
                continue
            outs[name] = (o, g)
            rows.append(dict(S=S, D=D, causal=causal, kernel=name, fwd_s=tf, fwdbwd_s=tb,
                             fwd_tflops=fl / tf / 1e12, fwdbwd_tflops=3.5 * fl / tb / 1e12,
                             fwd_pct_matmul=100 * fl / tf / rate,
                             fwdbwd_pct_matmul=100 * 3.5 * fl / tb / rate))
            print(f"bench S={S:6d} D={D:3d} causal={causal!s:5s} {name:10s} "
                  f"fwd {rows[-1]['fwd_tflops']:6.1f} TFLOP/s  fwd+bwd "
                  f"{rows[-1]['fwdbwd_tflops']:6.1f}", flush=True)
        if "cudnn" in outs:  # agreement with cuDNN in the same run
            o0, g0 = outs["cudnn"]
            for r in rows[-len(outs):]:
                o, g = outs[r["kernel"]]
                r["rel_out_vs_cudnn"] = _rel(o, o0)
                r["rel_grads_vs_cudnn"] = max(_rel(a, b) for a, b in zip(g, g0))
        del outs
    return rows


def pair(kernels, sizes, dims, rounds=30, device_rounds=0):
    """Forward and forward+backward of cuDNN and each backend, timed in rotation (one call
    of each per round, in a fresh seeded order every round: ``_util.round_order``) so that
    clock drift and each call's predecessor hit all alike;
    medians and the median of the per-round ratios to cuDNN (sequential rounds of 2-ms
    kernels were seen to drift by 10-15% between runs).  ``device_rounds``: as many more
    rounds under the profiler, the ratios of the median device times as well
    (``_profile.device_rounds``: without the host's dispatch and round trip)."""
    rows = []
    names = ["cudnn"] + list(kernels)
    for S, D, causal in itertools.product(sizes, dims, (False, True)):
        q, k, v, do = _inputs(1, 16, S, D)
        fl = attn_flops(1, 16, S, D, causal)
        fns = {}
        for n in names:
            f, fb = _backend_fns(n, kernels.get(n), S, D, causal)
            fns[(n, "fwd")] = (f, (q, k, v))
            fns[(n, "fwdbwd")] = (fb, (q, k, v, do))
        for f, a in fns.values():  # compile and warm up
            jax.block_until_ready(f(*a))
            jax.block_until_ready(f(*a))
        keys = list(fns)
        ts = {key: [] for key in keys}
        for r in range(rounds):
            for key in round_order(keys, r, seed=S + D):
                f, a = fns[key]
                t0 = time.perf_counter()
                jax.block_until_ready(f(*a))
                ts[key].append(time.perf_counter() - t0)
        dev = device_rounds_({f"{n} {ph}": fns[(n, ph)] for n, ph in keys}, device_rounds,
                             seed=S + D + causal)
        for n in names:
            row = dict(S=S, D=D, causal=causal, kernel=n, rounds=rounds)
            for ph, mult in (("fwd", 1.0), ("fwdbwd", 3.5)):
                t = np.array(ts[(n, ph)])
                row[f"{ph}_ms"] = 1e3 * float(np.median(t))
                row[f"{ph}_tflops"] = mult * fl / float(np.median(t)) / 1e12
                row[f"{ph}_vs_cudnn"] = float(np.median(np.array(ts[("cudnn", ph)]) / t))
                if f"{n} {ph}" in dev:
                    row[f"{ph}_device_ms"] = dev[f"{n} {ph}"]
                    row[f"{ph}_device_tflops"] = mult * fl / dev[f"{n} {ph}"] / 1e9
                    row[f"{ph}_vs_cudnn_device"] = dev[f"cudnn {ph}"] / dev[f"{n} {ph}"]
            rows.append(row)
            print(f"pair S={S:6d} D={D:3d} causal={causal!s:5s} {n:12s} fwd "
                  f"{row['fwd_tflops']:6.1f} TFLOP/s ({row['fwd_vs_cudnn']:.3f}x cuDNN)  "
                  f"fwd+bwd {row['fwdbwd_tflops']:6.1f} ({row['fwdbwd_vs_cudnn']:.3f}x)"
                  + (f"  device: fwd {row['fwd_device_tflops']:6.1f} "
                     f"({row['fwd_vs_cudnn_device']:.3f}x) fwd+bwd "
                     f"{row['fwdbwd_device_tflops']:6.1f} ({row['fwdbwd_vs_cudnn_device']:.3f}x)"
                     if "fwdbwd_vs_cudnn_device" in row else ""), flush=True)
    return rows


def breakdown(kernels, sizes, dims, calls=5):
    """Per backend (cuDNN first), the device's kernels of one synchronised forward +
    backward call in launch order, with each kernel's median duration (ms) over
    ``calls`` calls under one profiler trace (``_profile.group_calls`` splits the calls
    at the host's round trips).  Rows: ``S, D, causal, kernel, span_ms, kernels`` with
    ``kernels`` a list of ``(name, median_ms)``."""
    rows = []
    names = ["cudnn"] + list(kernels)
    for S, D, causal in itertools.product(sizes, dims, (False, True)):
        q, k, v, do = _inputs(1, 16, S, D)
        for n in names:
            _, fb = _backend_fns(n, kernels.get(n), S, D, causal)
            jax.block_until_ready(fb(q, k, v, do))

            def run():
                for _ in range(calls):
                    jax.block_until_ready(fb(q, k, v, do))
            try:
                groups = group_calls(profile_timeline(run, f"/tmp/jsp_breakdown_{n}"), calls)
            except Exception as e:  # noqa: BLE001 - a backend's failure is reported
                print(f"breakdown S={S} D={D} causal={causal} {n}: FAILED "
                      f"{type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            width = min(len(g) for g in groups)
            per = [(groups[0][i][0], float(np.median([g[i][2] for g in groups])) / 1e3)
                   for i in range(width)]
            span = float(np.median([(max(s + d for _, s, d in g) - g[0][1]) / 1e3
                                    for g in groups]))
            rows.append(dict(S=S, D=D, causal=causal, kernel=n, span_ms=span,
                             kernels=per, counts=sorted({len(g) for g in groups})))
            print(f"breakdown S={S:6d} D={D:3d} causal={causal!s:5s} {n:14s} span "
                  f"{span:8.3f} ms, {width} kernels", flush=True)
            for name, ms in per:
                if ms >= 0.005:
                    print(f"    {ms:8.3f} ms  {name[:110]}", flush=True)
    return rows


#: Candidates per head dim: forward (block_q, block_k, warps, stages), backward
#: (block_q, block_k, warps).  A first sweep (results/kernels_gpu_sweep1.json) over
#: forward and backward tiles found these the best forward and backward halves.
SWEEP = {
    128: [PallasConfig(128, 64, 4, 3, 64, 64, 4), PallasConfig(128, 64, 8, 2, 64, 64, 4),
          PallasConfig(128, 64, 8, 3, 64, 64, 4)],
    64: [PallasConfig(64, 64, 4, 3, 64, 64, 4), PallasConfig(128, 64, 4, 3, 64, 64, 4)],
}


def sweep(dims, S=16384):
    """S = 16k, bf16, causal and not: fwd and fwd+bwd TFLOP/s per config; returns the rows
    and the best config per head dim (by the sum of all four rates)."""
    rows, best = [], {}
    for D in dims:
        for cfg in SWEEP.get(D, []):
            score = 0.0
            for causal in (False, True):
                try:
                    tf, tb, _, _ = time_backend("pallas", PallasKernel(config=cfg), 1, 16, S,
                                                D, causal, repeats=3)
                except Exception as e:
                    print(f"sweep D={D} {cfg}: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:100]}")
                    score = -1.0
                    break
                fl = attn_flops(1, 16, S, D, causal)
                rows.append(dict(D=D, causal=causal, config=dataclasses.asdict(cfg),
                                 fwd_tflops=fl / tf / 1e12, fwdbwd_tflops=3.5 * fl / tb / 1e12))
                score += rows[-1]["fwd_tflops"] + rows[-1]["fwdbwd_tflops"]
                print(f"sweep D={D} causal={causal!s:5s} {cfg}: fwd "
                      f"{rows[-1]['fwd_tflops']:.1f} fwd+bwd {rows[-1]['fwdbwd_tflops']:.1f}",
                      flush=True)
            if score > best.get(D, (0.0, None))[0]:
                best[D] = (score, cfg)
    return rows, {D: cfg for D, (_, cfg) in best.items()}


# ---------------------------------------------------------------------------- ring
def ring(kernel_names, S=131072, H=16, D=128, layouts=("zigzag", "striped"), repeats=3):
    """Causal ring attention, forward+backward, on all GPUs (``jsp.attention`` with each
    backend, tokens already in layout order as a model keeps them), against **one GPU
    running cuDNN** (``jax.nn.dot_product_attention``) on the whole sequence: the speedup
    a user sees.  Each ring's output and gradients are compared with cuDNN's (permuted)."""
    from jax_seqpar.layouts import permute_sequence
    G = jax.device_count()
    q, k, v, do = _inputs(1, H, S, D)
    scale = D ** -0.5
    fb1 = jax.jit(lambda q, k, v, do: jax.vjp(_cudnn_fn(True, scale), q, k, v))
    t1 = time_fn(lambda *a: fb1(*a)[1](a[3]), q, k, v, do, repeats=repeats)["median_s"]
    o1, vjp1 = fb1(q, k, v, do)
    ref = [o1, *vjp1(do)]
    mesh = jax.make_mesh((G,), ("sp",))
    fl = 3.5 * attn_flops(1, H, S, D, True)
    rows = []
    for layout in layouts:
        perm = [permute_sequence(x, layout, G) for x in (q, k, v, do)]
        ref_p = [permute_sequence(x, layout, G) for x in ref]
        for name in kernel_names:
            def f(q, k, v, name=name):
                return jsp.attention(q, k, v, mesh=mesh, causal=True, layout=layout,
                                     permuted=True, kernel=name, scale=scale)
            fb = jax.jit(lambda q, k, v, do, f=f: (lambda o, vjp: (o, *vjp(do)))(
                *jax.vjp(f, q, k, v)))
            try:
                tG = time_fn(fb, *perm, repeats=repeats)["median_s"]
                outs = fb(*perm)
            except Exception as e:
                print(f"ring {layout} {name}: {type(e).__name__}: {str(e)[:200]}")
                continue
            err = max(_rel(a, b) for a, b in zip(outs, ref_p))
            row = dict(S=S, G=G, H=H, D=D, layout=layout, kernel=name, t_ring_s=tG,
                       t_cudnn_1gpu_s=t1, speedup_vs_cudnn_1gpu=t1 / tG,
                       tflops_per_gpu=fl / tG / G / 1e12, rel_err_vs_cudnn=err,
                       ok=err <= BUDGET["bfloat16"])
            rows.append(row)
            print(f"ring S={S} G={G} {layout:8s} {name:12s} {tG * 1e3:8.1f} ms, one GPU "
                  f"cuDNN {t1 * 1e3:8.1f} ms: {row['speedup_vs_cudnn_1gpu']:.2f}x, "
                  f"{row['tflops_per_gpu']:.0f} TFLOP/s/GPU, err {err:.1e}", flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phases", default=None)
    p.add_argument("--dims", default="64,128,256", help="head dims for check/sweep")
    p.add_argument("--dtypes", default=None, help="dtypes for check (default: all on GPU)")
    p.add_argument("--check-kernels", default=None,
                   help="backends for check, comma-separated (default: every one available "
                        "but xla on GPUs, where cudnn is checked through the kernel contract "
                        "too, and flash_attn on CPU)")
    p.add_argument("--cases", default=None, help="check cases (default: all), comma-separated")
    p.add_argument("--trace", action="store_true", help="check: report each forward")
    p.add_argument("--hang-dump", type=float, default=None,
                   help="check: dump all stacks and exit if one case takes this many seconds")
    p.add_argument("--pallas-config", default=None,
                   help="check: PallasConfig fields as 8 comma-separated ints (block_q, "
                        "block_k, warps, stages, then the same four for the backward)")
    p.add_argument("--sizes", default="4096,16384,32768", help="sequence lengths for bench")
    p.add_argument("--bench-dims", default="64,128", help="head dims for bench")
    p.add_argument("--rounds", type=int, default=30, help="pair: timing rounds")
    p.add_argument("--device-rounds", type=int, default=9,
                   help="pair: rounds timed on the device's clock (profiler; GPU only)")
    p.add_argument("--ring-kernels", default="auto,pallas_mgpu,pallas",
                   help="ring: backends (kernel= of jsp.attention)")
    p.add_argument("--ring-seq", type=int, default=131072, help="ring: total tokens")
    p.add_argument("--bench-kernels", default=None,
                   help="backends for bench besides cuDNN (default: all available)")
    p.add_argument("--mgpu-variant", action="append", default=[],
                   help="NAME:field=value,...: a pallas_mgpu backend whose per-head-dim "
                        "default MgpuConfig has these fields replaced, usable by NAME in "
                        "--check-kernels and --bench-kernels (e.g. atomic:atomic_dq=true)")
    args = p.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    phases = (args.phases or ("check,sweep,bench,ring" if on_gpu else "check")).split(",")
    dims = [int(x) for x in args.dims.split(",")]
    info = env_info()
    print(f"# {info}; phases {phases}")
    kernels = backends(on_gpu)
    for text in args.mgpu_variant:
        try:
            name, kern = parse_mgpu_variant(text)
        except ValueError as e:
            p.error(str(e))
        kernels[name] = kern
    unused = unused_variants([parse_mgpu_variant(t)[0] for t in args.mgpu_variant], phases,
                             args.check_kernels, args.bench_kernels)
    if unused:
        p.error(f"--mgpu-variant {', '.join(unused)}: no phase of this run calls it; name it "
                f"in --check-kernels or --bench-kernels as well")
    result = {"env": info}
    path = os.path.join(out_dir(), f"kernels_{'gpu' if on_gpu else 'cpu'}.json")
    ok = True
    if "check" in phases:
        dtypes = (args.dtypes.split(",") if args.dtypes else
                  ["bfloat16", "float16", "float32"] if on_gpu else ["float32", "bfloat16"])
        checkable = dict(kernels)
        if args.pallas_config:
            fields = [int(x) for x in args.pallas_config.split(",")]
            kernels["pallas"] = checkable["pallas"] = PallasKernel(
                config=PallasConfig(*fields))
        if on_gpu:  # the cudnn backend through the contract, on the tiles a caller
            # states (dense, aligned); bench and pair call cuDNN directly as "cudnn"
            checkable["cudnn"] = CudnnKernel()
        try:
            ck = check_kernels_for(checkable, args.check_kernels, on_gpu)
        except ValueError as e:
            p.error(str(e))
        def save_partial(rows):
            result["check"] = rows
            save_json(result, path)
        cases = args.cases.split(",") if args.cases else None
        if cases and set(cases) - set(CHECK_CASES):
            p.error(f"--cases: unknown {sorted(set(cases) - set(CHECK_CASES))}; known: "
                    f"{sorted(CHECK_CASES)}")
        result["check"] = check(ck, dims if on_gpu else [64], dtypes, on_row=save_partial,
                                cases=cases, trace=args.trace, hang_dump=args.hang_dump)
        ok &= all(r["ok"] for r in result["check"])
        save_json(result, path)
    tuned = {}
    if "sweep" in phases:
        result["sweep"], tuned = sweep([d for d in dims if d in (64, 128)])
        result["tuned"] = {D: dataclasses.asdict(c) for D, c in tuned.items()}
        save_json(result, path)
    if "ring" in phases and jax.device_count() > 1:
        result["ring"] = ring(args.ring_kernels.split(","), S=args.ring_seq)
        ok &= all(r["ok"] for r in result["ring"])
        save_json(result, path)
    if "bench" in phases:
        rate = matmul_rate()
        result["matmul_tflops"] = rate / 1e12
        print(f"bf16 matmul 8192^3: {rate / 1e12:.1f} TFLOP/s", flush=True)
        kerns = {n: k for n, k in kernels.items() if n != "xla"}
        for D, cfg in tuned.items():
            kerns[f"pallas_D{D}_tuned"] = PallasKernel(config=cfg)
        kerns["xla"] = kernels["xla"]
        if args.bench_kernels:
            kerns = {n: k for n, k in kerns.items() if n in args.bench_kernels.split(",")}
        result["bench"] = []
        for S in [int(x) for x in args.sizes.split(",")]:
            for D in [int(x) for x in args.bench_dims.split(",")]:
                ks = {n: k for n, k in kerns.items() if not n.startswith("pallas_D")
                      or n == f"pallas_D{D}_tuned"}
                result["bench"] += bench(ks, [S], [D], rate)
                save_json(result, path)
    if "pair" in phases:
        names = (args.bench_kernels or "pallas_mgpu,pallas").split(",")
        result["pair"] = pair({n: kernels[n] for n in names if n in kernels},
                              [int(x) for x in args.sizes.split(",")],
                              [int(x) for x in args.bench_dims.split(",")], args.rounds,
                              args.device_rounds if jax.default_backend() == "gpu" else 0)
        save_json(result, path)
    if "breakdown" in phases and jax.default_backend() == "gpu":
        names = (args.bench_kernels or "pallas_mgpu").split(",")
        result["breakdown"] = breakdown({n: kernels[n] for n in names if n in kernels},
                                        [int(x) for x in args.sizes.split(",")],
                                        [int(x) for x in args.bench_dims.split(",")],
                                        max(args.device_rounds, 1))
        save_json(result, path)
    print("CHECKS:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
