"""Fingerprints of the GPU kernels' modules (the Hopper kernels' Mosaic GPU modules, the
Triton kernels' Triton modules), lowered for CUDA on any machine.

A change to ``jax_seqpar/kernels/pallas_mgpu*.py`` that should not change what runs on
the GPU (taking out a switch that is off, moving code between modules, renaming) can be
checked without a GPU: lower the kernels for CUDA on the CPU before and after, and
compare each Mosaic GPU module's text, its locations left out (they name source lines).
The configurations: the per-dim defaults, every entry of ``kernels/mgpu_tuned.json`` and
single-field variants of the defaults, forward and backward, on dense, aligned and
general causal tiles, segment ids, a window and ragged lengths, at D 64 and 128.  A
variant that names a field the checkout's ``MgpuConfig`` lacks is left out (reported).
The Triton kernels (``pallas``'s forward and backward, ``pallas_decode``; kinds
``triton_fwd``, ``triton_bwd``, ``decode``) are lowered on the same cases with the
tables' tiles for bf16, f16 and f32, for an abstract H100; their digests also cover each
launch's grid, warps and stages (``segment_skip`` is left out: it changes the tile
lists XLA computes, not the kernels).

    python scripts/mosaic_modules.py --out before.json          # about 4 min on 2 cores
    (change the code)
    python scripts/mosaic_modules.py --out after.json
    python scripts/mosaic_modules.py --compare before.json after.json   # exit 1 if differ

``--cases dense,segs`` and ``--kinds fwd,triton_fwd`` narrow the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import sys

#: Single-field (or tied) variants of the per-dim defaults.
FWD_VARIANTS = [
    {}, dict(overlap_fwd=True), dict(warp_producer=True), dict(named_sched=False),
    dict(named_free=False), dict(mask_classes_fwd=False), dict(index_tiles=False),
    dict(doc_order=False), dict(segment_skip=False), dict(num_stages=3, block_kv=256)]
BWD_VARIANTS = [
    {}, dict(atomic_dq=False, overlap_bwd=False), dict(atomic_dq=False, overlap_bwd=True),
    dict(atomic_dq=False, dv_with_dp=True), dict(atomic_dq=True),
    dict(atomic_dq=False, dv_with_dp=True, warp_producer_bwd=True),
    dict(atomic_dq=False, mask_classes=False), dict(atomic_dq=True, warp_producer_bwd=True),
    dict(atomic_dq=True, tma_zero_dq=False), dict(atomic_dq=True, early_exit=False),
    dict(atomic_dq=False, early_exit=False)]
#: The fused backward and the split atomic dQ (D 128 only).
SPLIT_VARIANTS = [
    dict(atomic_dq=True, split_dq=True), dict(atomic_dq=True, split_dq=True, row_scores=True),
    dict(atomic_dq=True, split_dq=True, row_scores=True, mask_classes=False),
    dict(atomic_dq=True, split_dq=True, row_scores=True, dv_with_dp=False),
    dict(atomic_dq=True, split_dq=True, row_scores=True, early_dq=False),
    dict(atomic_dq=True, split_dq=True, row_scores=True, dv_with_dp=False,
         doc_order_bwd=True),
    dict(atomic_dq=True, split_dq=True, row_scores=True, tma_zero_dq=False),
    dict(atomic_dq=True, split_dq=True, row_scores=True, early_exit=False)]
#: name: (D, Tq, Tk, causal, window, segment ids, the tile kind the caller states)
CASES = {
    "dense": (128, 512, 512, False, None, False, "dense"),
    "aligned_causal": (128, 512, 512, True, None, False, "aligned"),
    "general_causal": (128, 512, 384, True, None, False, "general"),
    "segs": (128, 512, 384, True, None, True, "general"),
    "segs_aligned": (128, 512, 512, True, None, True, "aligned"),
    "window": (128, 512, 512, True, (70, 0), True, "general"),
    "d64_ragged": (64, 300, 200, True, None, False, "general"),
    "d64_segs": (64, 512, 512, True, None, True, "aligned"),
    "d64_dense": (64, 512, 512, False, None, False, "dense"),
}


#: The Triton kinds and their dtypes (each with its table's tiles).
TRITON_KINDS = ("triton_fwd", "triton_bwd", "decode")
KINDS = ("fwd", "bwd") + TRITON_KINDS
TRITON_DTYPES = ("bfloat16", "float16", "float32")
#: Pallas reads the compute capability from an abstract mesh's device off a GPU (sm_90).
ABSTRACT_GPU = ("NVIDIA H100 80GB HBM3", "gpu")


def _setup_cpu():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS", "false")


#: An attribute that numbers the modules a process lowers (``entry_0``, ``entry_1``...):
#: left out, so that a module's digest does not depend on what was lowered before it.
_DUMP_NAME = re.compile(r'mosaic_gpu\.dump_basename = "[^"]*"')


def _digest(text: str) -> str:
    return hashlib.sha256(_DUMP_NAME.sub("", text).encode()).hexdigest()[:16]


def table_variants() -> list[tuple[int, dict]]:
    """``(D, fields)`` of every entry of the tuned table, as ``mgpu_tuning`` reads it."""
    from jax_seqpar.kernels import mgpu_tuning
    entries = json.loads(mgpu_tuning.TABLE_PATH.read_text())["entries"]
    return [(int(re.search(r"/d(\d+)/", name).group(1)), {**e["fwd"], **e["bwd"]})
            for name, e in entries.items()]


def lower_for_cuda(fn, *avals) -> str:
    """HLO text of ``jax.jit(fn)`` lowered for CUDA, on an abstract H100 (where Pallas's
    Triton lowering finds its compute capability off a GPU; JAX 0.10 needs none)."""
    import warnings

    import jax
    gpu = jax.sharding.AbstractDevice(device_kind=ABSTRACT_GPU[0], num_cores=None,
                                      platform=ABSTRACT_GPU[1])
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=gpu)
    with warnings.catch_warnings():  # JAX 0.11 deprecates the Pallas Triton backend
        warnings.simplefilter("ignore", DeprecationWarning)
        with jax.sharding.use_abstract_mesh(mesh):
            return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()


def jobs(cases=None, kinds=KINDS):
    """``(key, kind, case, fields)`` for every configuration to lower, in a fixed order;
    a key names its kind, case and fields (or the table entry)."""
    out = []
    table = table_variants()
    for name, (D, *_rest) in CASES.items():
        if cases and name not in cases:
            continue
        for kind in kinds:
            if kind in TRITON_KINDS:
                for dt in TRITON_DTYPES:
                    out.append((f"{kind}/{name}/{dt}", kind, name, {"dtype": dt}))
                continue
            variants = (FWD_VARIANTS if kind == "fwd"
                        else BWD_VARIANTS + (SPLIT_VARIANTS if D == 128 else []))
            for kw in variants:
                out.append((f"{kind}/{name}/{json.dumps(kw, sort_keys=True)}", kind, name, kw))
            for i, (d, kw) in enumerate(table):
                if d == D:
                    out.append((f"{kind}/{name}/table{i}", kind, name, kw))
    return out


def fingerprint(kind: str, case: str, fields: dict) -> dict:
    """``{"mods": [digest per Mosaic GPU module, in lowering order]}`` of one
    configuration, ``{"error": ...}`` if it does not lower, or ``{"missing": [...]}``
    if it names fields this checkout's ``MgpuConfig`` lacks."""
    if kind in TRITON_KINDS:
        return triton_fingerprint(kind, case, fields)
    import jax
    import jax.experimental.mosaic.gpu.core as mcore
    import jax.numpy as jnp
    from jax_seqpar.kernels.pallas_mgpu_bwd import mgpu_bwd
    from jax_seqpar.kernels.pallas_mgpu_common import DEFAULT_MGPU_CONFIGS, MgpuConfig
    from jax_seqpar.kernels.pallas_mgpu_fwd import mgpu_fwd
    from jax_seqpar.masks import MaskSpec

    known = {f.name for f in dataclasses.fields(MgpuConfig)}
    missing = sorted(set(fields) - known)
    if missing:
        return {"missing": missing}
    D, Tq, Tk, causal, window, seg, tile = CASES[case]
    mask = MaskSpec(causal=causal, window=window)
    SDS = jax.ShapeDtypeStruct
    q, kv = SDS((2, Tq, 4, D), jnp.bfloat16), SDS((2, Tk, 2, D), jnp.bfloat16)
    pos = [SDS((Tq,), jnp.int32), SDS((Tk,), jnp.int32)]
    segs = [SDS((2, Tq), jnp.int32), SDS((2, Tk), jnp.int32)] if seg else []
    modules, serde = [], mcore._run_serde_pass

    def spy(module, *a, **k):  # each kernel's own module, before it is serialised
        modules.append(module.operation.get_asm(enable_debug_info=False))
        return serde(module, *a, **k)
    mcore._run_serde_pass = spy
    try:
        cfg = dataclasses.replace(DEFAULT_MGPU_CONFIGS[D], **fields)
        if kind == "fwd":
            def f(q, k, v, qp, kp, *s):
                return mgpu_fwd(q, k, v, qp, kp, mask, 0.1, *s, config=cfg, tile=tile)
            args = (q, kv, kv, *pos, *segs)
        else:
            def f(q, k, v, o, lse, do, qp, kp, *s):
                return mgpu_bwd(q, k, v, o, lse, do, qp, kp, mask, 0.1, *s, config=cfg)
            args = (q, kv, kv, q, SDS((2, 4, Tq), jnp.float32), q, *pos, *segs)
        jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    except Exception as e:  # noqa: BLE001 - recorded: a config may not fit, or be refused
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    finally:
        mcore._run_serde_pass = serde
    return {"mods": [_digest(m) for m in modules]}


#: The part of a Triton custom call's backend config left out of its digest: the module
#: itself, serialised with its locations (the module is digested without them).
_TRITON_IR = re.compile(r'ir = "[^"]*"')
_TRITON_LAUNCH = re.compile(r"@__gpu\$xla\.gpu\.triton.*?mhlo\.backend_config = \{([^}]*)\}")


def triton_fingerprint(kind: str, case: str, fields: dict) -> dict:
    """As ``fingerprint``, for the Triton kinds: one digest per kernel of its Triton module
    (locations left out) and its launch (grid, warps, stages); ``fields`` holds the
    dtype and ``PallasConfig`` (``DecodeConfig`` for ``decode``) fields."""
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import lowering as triton_lowering
    from jax_seqpar.kernels.pallas_common import PallasConfig, default_config
    from jax_seqpar.kernels.pallas_decode import DecodeConfig, PallasDecodeKernel
    from jax_seqpar.kernels.pallas_gpu import PallasKernel
    from jax_seqpar.masks import MaskSpec

    fields = dict(fields)
    dtype = jnp.dtype(fields.pop("dtype"))
    cls = DecodeConfig if kind == "decode" else PallasConfig
    missing = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
    if missing:
        return {"missing": missing}
    D, Tq, Tk, causal, window, seg, _tile = CASES[case]
    Tq = 4 if kind == "decode" else Tq  # a few query rows against the keys
    mask = MaskSpec(causal=causal, window=window)
    SDS = jax.ShapeDtypeStruct
    q, kv = SDS((2, Tq, 4, D), dtype), SDS((2, Tk, 2, D), dtype)
    pos = [SDS((Tq,), jnp.int32), SDS((Tk,), jnp.int32)]
    segs = [SDS((2, Tq), jnp.int32), SDS((2, Tk), jnp.int32)] if seg else []
    modules, real = [], triton_lowering.lower_jaxpr_to_triton_module

    def spy(*a, **k):  # each kernel's module, before it is serialised with locations
        res = real(*a, **k)
        modules.append(res.module.operation.get_asm(enable_debug_info=False))
        return res
    triton_lowering.lower_jaxpr_to_triton_module = spy
    try:
        if kind == "decode":
            kern = PallasDecodeKernel(config=DecodeConfig(**fields), interpret=False)
        else:
            cfg = dataclasses.replace(default_config(D, dtype), **fields)
            kern = PallasKernel(config=cfg, interpret=False)
        if kind == "triton_bwd":
            def f(q, k, v, o, lse, do, qp, kp, *s):
                return kern.bwd(q, k, v, o, lse, do, qp, kp, mask, 0.1, *s)
            args = (q, kv, kv, q, SDS((2, 4, Tq), jnp.float32), q, *pos, *segs)
        else:
            def f(q, k, v, qp, kp, *s):
                return kern.fwd(q, k, v, qp, kp, mask, 0.1, *s)
            args = (q, kv, kv, *pos, *segs)
        text = lower_for_cuda(f, *args)
    except Exception as e:  # noqa: BLE001 - recorded, as in fingerprint
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    finally:
        triton_lowering.lower_jaxpr_to_triton_module = real
    launches = _TRITON_LAUNCH.findall(_TRITON_IR.sub("ir", text))
    return {"mods": [_digest(m) for m in modules] + [_digest(x) for x in launches]}


def snapshot(cases=None, kinds=KINDS, log=print) -> dict:
    out = {}
    for key, kind, case, fields in jobs(cases, kinds):
        out[key] = fingerprint(kind, case, fields)
    log(f"{len(out)} configurations: {sum('mods' in v for v in out.values())} lowered, "
        f"{sum('error' in v for v in out.values())} refused, "
        f"{sum('missing' in v for v in out.values())} naming fields this checkout lacks")
    return out


def compare(old: dict, new: dict) -> list[str]:
    """The keys whose modules (or whether they lower) differ, among those both snapshots
    could build; the rest are left out."""
    both = [k for k in old if k in new and "missing" not in old[k] and "missing" not in new[k]]
    return [k for k in both if old[k].get("mods") != new[k].get("mods")
            or ("error" in old[k]) != ("error" in new[k])]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the fingerprints of this checkout here (JSON)")
    p.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    p.add_argument("--cases", help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--kinds", default=",".join(KINDS))
    args = p.parse_args(argv)
    if args.compare:
        old, new = (json.loads(open(f).read()) for f in args.compare)
        diff = compare(old, new)
        left = [k for k in old if k not in new or "missing" in old[k] or "missing" in new[k]]
        print(f"{len(old) - len(left)} configurations compared, {len(diff)} differ"
              + (f"; {len(left)} left out (absent from one snapshot, or naming fields "
                 f"one checkout lacks)" if left else ""))
        for k in diff:
            print("  differs:", k)
        return 1 if diff else 0
    if not args.out:
        p.error("give --out PATH or --compare OLD NEW")
    cases = args.cases.split(",") if args.cases else None
    unknown = sorted(set(cases or ()) - set(CASES))
    if unknown:
        p.error(f"--cases: unknown {unknown}; known: {', '.join(CASES)}")
    _setup_cpu()
    kinds = tuple(args.kinds.split(","))
    if set(kinds) - set(KINDS):
        p.error(f"--kinds: unknown {sorted(set(kinds) - set(KINDS))}; known: {', '.join(KINDS)}")
    res = snapshot(cases, kinds)
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1, sort_keys=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
