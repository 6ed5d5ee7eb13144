"""Packed documents against the same documents as a batch (issue 41's packed bar).

The bar of issue 41 compares the packed call's useful rate (documents around 4k tokens
in a 64k row) with cuDNN's rate on one unpacked 64k causal sequence.  Documents of 4k
are much shorter rows than 64k: each query block sees ~25 key blocks instead of ~256.
This script measures what the same documents cost when a caller does not pack them but
batches them, one document per row, all of one length ``L``:

* ``cudnn one row``: ``jax.nn.dot_product_attention(implementation="cudnn")``, causal, one
  row of ``S`` tokens (the bar's denominator);
* ``packed``: ``jax_seqpar.attention`` (``kernel="auto"``, one-device mesh) on one row
  of ``S / L`` documents of ``L`` tokens with segment ids;
* ``batch cudnn``: cuDNN, causal, ``S / L`` rows of ``L`` tokens: the same useful work,
  what a user with equal documents would run instead;
* ``batch ours``: ``jax_seqpar.attention`` on the same batch, no segment ids;
* ``batch mgpu``: the same through ``kernel="pallas_mgpu"`` (on Hopper): the kernel that
  serves the packed call, on the same documents without segment ids, so the gap between
  it and ``packed`` is what packing costs that kernel;
* ``packed lognormal``: the bar's own case (log-normal lengths around ``L``, as
  ``packed.py``), for reference;
* ``--mgpu-variant NAME:field=value,...`` (as ``kernels.py``'s): ``packed NAME``,
  ``packed lognormal NAME`` and ``batch NAME`` through ``pallas_mgpu`` with those
  ``MgpuConfig`` fields replaced, in the same rotation, and checked like the rest.

* ``--bounds`` (Hopper): ``one row mgpu`` (``pallas_mgpu`` on the unpacked row), and
  ``... unmasked`` rows: ``pallas_mgpu`` traced while its tile lists claim every listed
  tile fully visible, so the kernels run no mask code.  Their values are wrong; their
  times bound what cheaper masks could give.
* ``--kernels NAME,...``: each named call's kernels one by one, in launch order, the
  median over the device rounds (every call's list is in the JSON).  Timed in the rounds,
  the kernels of two calls see the same conditions; timed as a row of calls of their own
  (this flag's first form), a 13 ms call's kernels ran 5-12% faster than in the rounds, a
  110 ms call's 4%, and two compiles of one kernel read 4% apart (RESULTS.md).

First (``--check``, on by default) the one-device calls it times are checked against the
float32 reference (``jax_seqpar.reference``) at a small shape, D 64 and 128, budget 2e-2:
``jax_seqpar.attention`` through ``auto`` and through ``pallas_mgpu`` (on Hopper), without
segment ids and with two sets: documents on block boundaries and documents that start
inside blocks.  Then causal forward + backward, H 16, D 128, bf16.  Useful FLOPs
``3.5 * 2 * H * D * sum(L^2)`` (``packed.py``'s convention).  Wall clock over
``--rounds`` rounds and the device clock over ``--device-rounds``
(``_profile.device_rounds``, with each call's kernel time beside its span), both in a
fresh order each round; rates as a share of ``cudnn one row``'s.  During the wall-clock
rounds ``_util.ClockSampler`` reads the SM clock and board power (``nvidia-smi``, every
10 ms), averaged per function over its calls.  ``--profile NAME,...``: afterwards one
call of each named function under the profiler, its kernels by category and the longest
ones (``_profile``).

    python benchmarks/packed_batch.py                       # one H100/H200, ~3 minutes
    python benchmarks/packed_batch.py --dry-run             # CPU, tiny, xla kernel
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import _setup  # noqa: F401

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_seqpar as jsp  # noqa: E402
from jax_seqpar.parallel.choose import segments_from_lengths  # noqa: E402
from _profile import device_rounds, print_summary, profile_call  # noqa: E402
from _util import (ClockSampler, env_info, out_dir, rel, round_order,  # noqa: E402
                   save_json)
from packed import _inputs, lognormal_lengths, packed_ids, useful_pairs  # noqa: E402


def _ours(mesh, kernel, with_seg, unmasked=False):
    """``unmasked``: trace under ``_unmasked_lists`` (a bound: wrong values)."""
    def fb(q, k, v, do, seg):
        def f(q, k, v):
            return jsp.attention(q, k, v, mesh=mesh, causal=True, kernel=kernel,
                                 segment_ids=seg if with_seg else None)
        with _unmasked_lists(unmasked):
            return jax.vjp(f, q, k, v)[1](do)
    return jax.jit(fb)


@contextlib.contextmanager
def _unmasked_lists(on: bool):
    """While a call traces: the Hopper kernels' tile lists claim every listed tile fully
    visible, so the kernels run no mask code (``--bounds``).  The results are wrong; the
    time is a bound on what cheaper masks could give.  Pair it with a config no other
    row runs (the kernels' jitted functions cache by config)."""
    if not on:
        yield
        return
    from jax_seqpar.kernels import pallas_mgpu_bwd, pallas_mgpu_fwd
    real = pallas_mgpu_fwd.tile_lists

    def all_full(*args, **kwargs):
        tbl = real(*args, **kwargs)
        tbl = tbl.at[..., 1].set(tbl[..., 0])
        if kwargs.get("classes"):  # every class empty too: the kernels visit each tile once
            tbl = tbl.at[..., -3:].set(tbl[..., :1])
        return tbl
    pallas_mgpu_fwd.tile_lists = pallas_mgpu_bwd.tile_lists = all_full
    try:
        yield
    finally:
        pallas_mgpu_fwd.tile_lists = pallas_mgpu_bwd.tile_lists = real


def _cudnn():
    def fb(q, k, v, do, seg):
        f = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
            q, k, v, is_causal=True, implementation="cudnn")
        return jax.vjp(f, q, k, v)[1](do)
    return jax.jit(fb)


def call_clock(samples, spans) -> dict:
    """Mean SM clock and board power of the ``ClockSampler`` ``samples`` (``(time, MHz,
    W)``) read during any of the calls' ``spans`` (``(start, end)``), and their number."""
    xs = [(m, w) for t, m, w in samples if any(a <= t <= b for a, b in spans)]
    if not xs:
        return dict(sm_mhz=None, power_w=None, clock_samples=0)
    return dict(sm_mhz=float(np.mean([m for m, _ in xs])),
                power_w=float(np.mean([w for _, w in xs])), clock_samples=len(xs))


def _ragged(S):
    """Three document lengths filling ``S`` whose boundaries fall inside blocks."""
    a, b = S // 8 + S // 27, S // 2 - S // 10
    return [a, b, S - a - b]


def check(on_gpu, kernels, dims=(64, 128)) -> bool:
    """The one-device calls against the float32 reference; prints one line per case.
    ``kernels``: ``{name: kernel= of jax_seqpar.attention}``; ``dims``: head dims."""
    from jax_seqpar.reference import reference_attention
    mesh = jax.make_mesh((1,), ("sp",), devices=jax.devices()[:1])
    B, S, H = 2, (1024 if on_gpu else 128), 4
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    ok = True
    for D in dims:
        q, k, v, do = _inputs(D, B, S, S, H, H, D, dtype)
        aligned = [S // 8, S // 2, S - S // 8 - S // 2]
        for kind, lens in (("causal  ", None), ("segments", aligned), ("ragged  ", _ragged(S))):
            with_seg = lens is not None
            # the second ids: documents that start inside blocks, so every kind of masked
            # tile occurs (cut by a document boundary on either side, or on the diagonal)
            seg_arg = (jnp.asarray(segments_from_lengths(lens, S)[0][None].repeat(B, 0))
                       if with_seg else None)

            def ref(q, k, v):
                return reference_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                           v.astype(jnp.float32), causal=True,
                                           segment_ids=seg_arg)[0]
            r_out, r_vjp = jax.vjp(ref, q, k, v)
            r_grads = r_vjp(do.astype(jnp.float32))
            for name, kernel in kernels.items():
                def f(q, k, v):
                    return jsp.attention(q, k, v, mesh=mesh, causal=True, kernel=kernel,
                                         segment_ids=seg_arg)
                out, vjp = jax.vjp(f, q, k, v)
                errs = [rel(a, b) for a, b in zip((out, *vjp(do)), (r_out, *r_grads))]
                good = max(errs) <= 2e-2
                ok &= good
                print(f"check D={D:3d} {kind} {name:12s} "
                      + " ".join(f"{n} {e:.1e}" for n, e in zip(("out", "dq", "dk", "dv"), errs))
                      + (" ok" if good else " FAIL"), flush=True)
    return ok


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=65536)
    p.add_argument("--doc-lens", default="4096,1024,16384",
                   help="document lengths, comma-separated (each divides --seq)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--device-rounds", type=int, default=5)
    p.add_argument("--dry-run", action="store_true", help="tiny, on CPU (xla kernel)")
    p.add_argument("--profile", default="",
                   help="comma-separated names of timed functions to profile once each")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the check against the float32 reference")
    p.add_argument("--mgpu-variant", action="append", default=[],
                   help="NAME:field=value,...: also time pallas_mgpu with these MgpuConfig "
                        "fields replaced (Hopper only)")
    p.add_argument("--bounds", action="store_true",
                   help="also time pallas_mgpu on the 64k row, and with no mask code (every "
                        "listed tile run as fully visible: wrong values, a bound) on the "
                        "log-normal documents and the batch (Hopper only)")
    p.add_argument("--kernels", default="",
                   help="comma-separated names of timed functions whose kernels are listed "
                        "one by one, in launch order (medians over the device rounds)")
    p.add_argument("--check-dims", default="64,128",
                   help="head dims of the check, comma-separated (a variant such as "
                        "split_dq serves only D >= 128)")
    a = p.parse_args(argv)
    try:
        check_dims = tuple(int(x) for x in a.check_dims.split(","))
    except ValueError:
        p.error(f"--check-dims: expected comma-separated ints, got {a.check_dims!r}")
    on_gpu = jax.default_backend() == "gpu"
    checked = True
    from jax_seqpar.kernels.pallas_mgpu import is_hopper
    hopper = on_gpu and is_hopper()
    from kernels import parse_mgpu_variant
    try:
        variants = dict(parse_mgpu_variant(t) for t in a.mgpu_variant)
    except ValueError as e:
        p.error(str(e))
    if variants and not hopper:
        p.error("--mgpu-variant: pallas_mgpu needs a Hopper GPU")
    if a.bounds and not hopper:
        p.error("--bounds: pallas_mgpu needs a Hopper GPU")
    if a.check:
        kernels = {"auto": "auto", **({"pallas_mgpu": "pallas_mgpu"} if hopper else {}),
                   **variants}
        checked = check(on_gpu, kernels, check_dims)
    if a.dry_run:
        a.seq, a.doc_lens, a.rounds, a.device_rounds = 512, "128,64", 2, 0
    S, (H, D) = a.seq, ((2, 32) if a.dry_run else (16, 128))
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    doc_lens = [int(x) for x in a.doc_lens.split(",")]
    for L in doc_lens:
        if S % L:
            p.error(f"--doc-lens: {L} does not divide --seq {S}")
    mesh = jax.make_mesh((1,), ("sp",), devices=jax.devices()[:1])
    kernel = "auto" if on_gpu else "xla"
    dense = _cudnn() if on_gpu else _ours(mesh, kernel, False)
    full = 3.5 * 2 * H * D * float(S) ** 2
    one = _inputs(0, 1, S, S, H, H, D, dtype)
    calls = {"cudnn one row": (dense, (*one, None), full)}
    if a.bounds:
        from kernels import MgpuVariant
        # index_tiles=False: the forward reads its lists on every tile (the bound needs
        # them), and a config of its own keeps the bound's kernels out of the others' cache
        nomask = MgpuVariant(name="unmasked", overrides=(("index_tiles", False),))
        calls["one row mgpu"] = (_ours(mesh, "pallas_mgpu", False), (*one, None), full)
        calls["one row mgpu unmasked"] = (_ours(mesh, nomask, False, True), (*one, None),
                                          full)
    for L in doc_lens:
        n = S // L
        seg = jnp.asarray(segments_from_lengths([L] * n, S)[0][None])
        useful = 3.5 * 2 * H * D * n * float(L) ** 2
        batch = _inputs(L, n, L, L, H, H, D, dtype)
        calls[f"packed L{L}"] = (_ours(mesh, kernel, True), (*one, seg), useful)
        if on_gpu:
            calls[f"batch cudnn L{L}"] = (_cudnn(), (*batch, None), useful)
        calls[f"batch ours L{L}"] = (_ours(mesh, kernel, False), (*batch, None), useful)
        if hopper:
            calls[f"batch mgpu L{L}"] = (_ours(mesh, "pallas_mgpu", False), (*batch, None),
                                         useful)
        lens = lognormal_lengths(L, S, seed=S + L)
        seg_ln = jnp.asarray(packed_ids(lens, S)[None])
        useful_ln = 3.5 * 2 * H * D * useful_pairs(np.asarray(seg_ln[0]))
        calls[f"packed lognormal L{L}"] = (_ours(mesh, kernel, True), (*one, seg_ln),
                                           useful_ln)
        if a.bounds:
            calls[f"packed lognormal unmasked L{L}"] = (_ours(mesh, nomask, True, True),
                                                        (*one, seg_ln), useful_ln)
            calls[f"batch mgpu unmasked L{L}"] = (_ours(mesh, nomask, False, True),
                                                  (*batch, None), useful)
        for name, kern in variants.items():
            calls[f"packed {name} L{L}"] = (_ours(mesh, kern, True), (*one, seg), useful)
            calls[f"packed lognormal {name} L{L}"] = (_ours(mesh, kern, True),
                                                      (*one, seg_ln), useful_ln)
            calls[f"batch {name} L{L}"] = (_ours(mesh, kern, False), (*batch, None), useful)
    for name, (fn, args, _) in calls.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        jax.block_until_ready(fn(*args))
        print(f"  warm {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    names = list(calls)
    ts = {n: [] for n in names}
    spans = {n: [] for n in names}  # (start, end) of each wall-clock call
    with ClockSampler() as clk:
        for r in range(a.rounds):
            for n in round_order(names, r, seed=S):
                fn, args, _ = calls[n]
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*args))
                t1 = time.perf_counter()
                ts[n].append(t1 - t0)
                spans[n].append((t0, t1))
    busy, per_kernel = {}, {}
    dev = device_rounds({n: (c[0], c[1]) for n, c in calls.items()}, a.device_rounds,
                        seed=S, busy=busy, per_kernel=per_kernel)
    base = "cudnn one row"
    rows = []
    for n in names:
        useful = calls[n][2]
        t = np.array(ts[n])
        row = dict(name=n, ms=1e3 * float(np.median(t)),
                   useful_tflops=useful / float(np.median(t)) / 1e12,
                   of_cudnn_row_wall=float(np.median((useful / t) / (full / np.array(ts[base])))))
        if n in dev and base in dev:
            row["device_ms"] = dev[n]
            row["device_busy_ms"] = busy[n]
            row["useful_tflops_device"] = useful / (dev[n] / 1e3) / 1e12
            row["of_cudnn_row_device"] = (useful / dev[n]) / (full / dev[base])
        row.update(call_clock(clk.samples, spans[n]))
        rows.append(row)
        print(f"{n:24s} {row['ms']:8.2f} ms {row['useful_tflops']:6.1f} TFLOP/s "
              f"{100 * row['of_cudnn_row_wall']:5.1f}% of cuDNN one row (wall)"
              + (f"  device {row['device_ms']:8.2f} ms "
                 f"{100 * row['of_cudnn_row_device']:5.1f}% (kernels "
                 f"{row['device_busy_ms']:.2f} ms)" if "device_ms" in row else "")
              + (f"  {row['sm_mhz']:5.0f} MHz {row['power_w']:4.0f} W" if row["clock_samples"]
                 else ""),
              flush=True)
    for n in filter(None, a.profile.split(",")):
        if n not in calls:
            print(f"profile {n!r}: no such function (have {names})", flush=True)
            continue
        fn, args, _ = calls[n]
        try:
            print_summary(profile_call(lambda: jax.block_until_ready(fn(*args)),
                                       f"/tmp/packed_batch_profile_{len(n)}"), n)
        except Exception as e:  # a trace that cannot be read costs the profile only
            print(f"profile {n!r}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    for n in filter(None, a.kernels.split(",")):
        if n not in calls:
            print(f"kernels {n!r}: no such function (have {names})", flush=True)
        elif per_kernel.get(n) is None:
            print(f"kernels {n!r}: no device rounds, or their kernels differed", flush=True)
        else:
            print(f"kernels {n!r}: " + ", ".join(
                f"{name[:28]} {dur:.3f}" for name, dur in per_kernel[n] if dur >= 0.02)
                + f" (ms, launch order, medians over {a.device_rounds} device rounds; "
                "those of 20 us or more)", flush=True)
    path = os.path.join(out_dir(), "packed_batch.json")
    save_json(dict(env=env_info(), seq=S, heads=H, head_dim=D, rounds=a.rounds,
                   device_rounds=a.device_rounds, checked=checked if a.check else None,
                   rows=rows, kernels={n: ([(k[:80], ms) for k, ms in v] if v else None)
                                       for n, v in per_kernel.items()}), path)
    print(f"wrote {path}")
    if not checked:
        raise SystemExit("a check failed (see the 'check' lines above)")


if __name__ == "__main__":
    main()
