"""A scheduling variant of the Hopper forward gives the base config's bits, on shapes
where each persistent CTA serves many items.

A variant that changes only which CTA runs an item, and when (``MgpuConfig.persistent``:
one CTA per SM, items by ticket: ``kernels/pallas_mgpu_sched.py``), runs every item's
arithmetic in the same order as the per-item kernel, so its output and lse must equal
the base config's bit for bit.  The float32-oracle checks (``kernels.py --phases check``,
``packed_batch.py``'s check) use shapes with fewer items than a Hopper GPU has SMs, where a
persistent CTA serves one item; the shapes here give each CTA 8-64 items, so they cover
the ticket ring's reuse, the early query loads and the ring of K/V slots across items.
Prints one line per case and variant; the JSON goes to ``$OUT/same_bits_*.json``.

    python benchmarks/same_bits.py \
        --variant per:persistent=true,overlap_fwd=false,warp_producer=false
    python benchmarks/same_bits.py --dry-run        # CPU: the cases and the comparison only
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import _setup  # noqa: F401

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_seqpar.kernels.base import TILE_ALIGNED, TILE_DENSE, TILE_GENERAL  # noqa: E402
from jax_seqpar.masks import MaskSpec  # noqa: E402
from _util import env_info, out_dir, save_json  # noqa: E402
from packed import _inputs, lognormal_lengths, packed_ids  # noqa: E402


def cases(small: bool):
    """``name -> (B, S, H, causal, tile, doc_mean or None)``; ``small``: CPU sizes."""
    if small:
        return {"packed": (1, 512, 2, True, TILE_ALIGNED, 128),
                "dense": (1, 256, 2, False, TILE_DENSE, None)}
    return {
        "packed lognormal 64k": (1, 65536, 16, True, TILE_ALIGNED, 4096),
        "16 rows of 4k": (16, 4096, 16, True, TILE_ALIGNED, None),
        "causal 16k": (1, 16384, 16, True, TILE_ALIGNED, None),
        "dense 16k": (1, 16384, 16, False, TILE_DENSE, None),
        "causal 16k general": (1, 16384, 16, True, TILE_GENERAL, None),
    }


def parse_variant(text: str):
    """``"NAME:field=value,..."`` -> ``(NAME, {field: value})``, checked as
    ``kernels.py --mgpu-variant`` checks it (MgpuConfig fields; ints or true/false)."""
    from kernels import parse_mgpu_variant
    name, variant = parse_mgpu_variant(text)
    return name, dict(variant.overrides)


def forward(case, config, on_gpu: bool):
    """``(o, lse)`` of one case through the Hopper forward (``mgpu_fwd``) with ``config``,
    or (CPU) through the XLA reference forward, which has no config."""
    B, S, H, causal, tile, doc = case
    q, k, v, _ = _inputs(S + H, B, S, S, H, H, 128)
    pos = jnp.arange(S, dtype=jnp.int32)
    seg = None
    if doc is not None:
        seg = jnp.asarray(packed_ids(lognormal_lengths(doc, S, seed=S + doc), S))[None]
        seg = jnp.repeat(seg, B, 0)
    mask = MaskSpec(causal=causal)
    if not on_gpu:
        from jax_seqpar.reference import reference_attention
        return reference_attention(q, k, v, causal=causal, segment_ids=seg)
    from jax_seqpar.kernels.pallas_mgpu_fwd import mgpu_fwd
    segs = (seg, seg) if seg is not None else ()
    f = jax.jit(lambda q, k, v: mgpu_fwd(q, k, v, pos, pos, mask, 128 ** -0.5, *segs,
                                         config=config, tile=tile))
    return jax.block_until_ready(f(q, k, v))


def compare(a, b) -> dict:
    """How many elements of ``o`` and ``lse`` differ, and by how much at most."""
    out = {}
    for name, x, y in (("o", a[0], b[0]), ("lse", a[1], b[1])):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        same = (x == y) | (np.isnan(x) & np.isnan(y)) | (np.isneginf(x) & np.isneginf(y))
        diff = np.where(same, 0.0, np.abs(np.nan_to_num(x) - np.nan_to_num(y)))
        out[name] = {"differ": int((~same).sum()), "of": int(x.size),
                     "max_abs": float(diff.max())}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", action="append", default=[],
                   help="NAME:field=value,...: fields replaced in the base config")
    p.add_argument("--base", default="",
                   help="field=value,...: fields replaced in the head dim 128 default first")
    p.add_argument("--cases", default="", help="comma-separated case names (default all)")
    p.add_argument("--dry-run", action="store_true", help="tiny, on CPU (reference only)")
    args = p.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu" and not args.dry_run
    from jax_seqpar.kernels.pallas_mgpu_common import DEFAULT_MGPU_CONFIGS
    base = DEFAULT_MGPU_CONFIGS[128]
    if args.base:
        base = dataclasses.replace(base, **parse_variant("base:" + args.base)[1])
    variants = dict(parse_variant(v) for v in args.variant)
    chosen = cases(not on_gpu)
    if args.cases:
        chosen = {n: chosen[n] for n in args.cases.split(",")}
    result = {"env": env_info(), "base": dataclasses.asdict(base), "variants": variants,
              "cases": {}}
    ok = True
    for cname, case in chosen.items():
        ref = forward(case, base, on_gpu)
        for vname, fields in variants.items():
            got = forward(case, dataclasses.replace(base, **fields), on_gpu)
            cmp = compare(ref, got)
            same = all(c["differ"] == 0 for c in cmp.values())
            ok &= same
            result["cases"][f"{cname} / {vname}"] = cmp
            print(f"{cname:26s} {vname:8s} o differ {cmp['o']['differ']}/{cmp['o']['of']} "
                  f"(max {cmp['o']['max_abs']:.1e}) lse differ {cmp['lse']['differ']}"
                  f"/{cmp['lse']['of']}" + ("  SAME" if same else "  DIFFERENT"), flush=True)
    path = os.path.join(out_dir(), "same_bits_" + ("gpu" if on_gpu else "cpu") + ".json")
    save_json(result, path)
    print("SAME BITS: " + ("PASS" if ok else "FAIL"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
