"""One forward (+ backward) call of a Hopper attention kernel, for Nsight Compute (issue
41): where the kernels' warps wait, and how busy the SMs and tensor cores are.

``--mask packed`` (documents log-normal around 4k tokens, as ``packed_breakdown.py``),
``causal`` or ``none``; H 16, D 128, bf16, B 1.  ``--backend pallas_mgpu`` (this
library's kernel with the tuned table's config, or ``--set FIELD=VALUE`` replaced as
``kernels.py --mgpu-variant`` does) or ``tokamax`` (tokamax 0.0.17's Mosaic GPU kernel,
what a user would pick instead; no packed documents).  The call is made once to compile
and once more to profile; ``kernel_ncu.sh`` runs this under ``ncu`` and keeps the
second call's kernels.

    bash benchmarks/kernel_ncu.sh packed_16k --seq 16384          # report -> $OUT
    bash benchmarks/kernel_ncu.sh tk_fwd --backend tokamax --mask none --fwd-only
    MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=DIR python benchmarks/kernel_ncu.py \\
        --seq 4096 --set overlap_bwd=false  # ptxas's registers and spills per kernel
"""

from __future__ import annotations

import argparse

import _setup  # noqa: F401

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_seqpar.kernels import PallasMgpuKernel  # noqa: E402
from jax_seqpar.kernels.base import TILE_ALIGNED, TILE_GENERAL  # noqa: E402
from jax_seqpar.masks import MaskSpec  # noqa: E402
from kernels import parse_mgpu_variant  # noqa: E402
from packed import lognormal_lengths, packed_ids  # noqa: E402


def kernels_per_call(fwd_only: bool) -> int:
    """Kernels one call launches (what ``kernel_ncu.sh`` skips, then keeps)."""
    return 1 if fwd_only else 3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--mask", choices=("packed", "causal", "none"), default="packed")
    p.add_argument("--backend", choices=("pallas_mgpu", "tokamax"), default="pallas_mgpu")
    p.add_argument("--fwd-only", action="store_true", help="the forward alone")
    p.add_argument("--tile", choices=("general", "aligned"), default="general",
                   help="the tile kind the kernel is told (aligned: as one device's call "
                        "of jax_seqpar.attention, masks from indices)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="an MgpuConfig field to replace (kernels.py's --mgpu-variant)")
    p.add_argument("--kernels-per-call", action="store_true",
                   help="print how many kernels one call launches, and exit")
    a = p.parse_args(argv)
    if a.kernels_per_call:
        print(kernels_per_call(a.fwd_only))
        return
    if a.backend == "tokamax" and (a.mask == "packed" or a.set):
        p.error("--backend tokamax takes neither --mask packed nor --set")
    S, H, D = a.seq, 16, 128
    ks = jax.random.split(jax.random.PRNGKey(S), 4)
    q, k, v, do = (jax.random.normal(kk, (1, S, H, D), jnp.bfloat16) for kk in ks)
    seg = (jnp.asarray(packed_ids(lognormal_lengths(4096, S, seed=S + 4096), S)[None])
           if a.mask == "packed" else None)
    causal = a.mask != "none"
    scale = D ** -0.5
    if a.backend == "tokamax":
        from jax_seqpar.kernels.tokamax import tokamax_bwd, tokamax_fwd

        def fwd(q, k, v, seg):
            return tokamax_fwd(q, k, v, scale=scale, causal=causal)

        def bwd(q, k, v, res, do, seg):
            o, mlse = res
            return tokamax_bwd(q, k, v, o, mlse, do, scale=scale, causal=causal)
    else:
        # the backend as it runs (the tuned table's config), or with --set fields replaced
        kern = (parse_mgpu_variant("set:" + ",".join(a.set))[1] if a.set
                else PallasMgpuKernel())
        mask = MaskSpec(causal=causal)
        pos = jnp.arange(S, dtype=jnp.int32)

        tile = {"general": TILE_GENERAL, "aligned": TILE_ALIGNED}[a.tile]

        def fwd(q, k, v, seg):
            return kern.fwd(q, k, v, pos, pos, mask, scale, seg, seg, tile=tile)

        def bwd(q, k, v, res, do, seg):
            o, lse = res
            return kern.bwd(q, k, v, o, lse, do, pos, pos, mask, scale, seg, seg, tile=tile)

    @jax.jit
    def call(q, k, v, do, seg):
        res = fwd(q, k, v, seg)
        return res if a.fwd_only else bwd(q, k, v, res, do, seg)
    for _ in range(2):  # compile and run, then the profiled call
        jax.block_until_ready(call(q, k, v, do, seg))
    print(f"kernel_ncu: S={S} {a.backend} {a.mask} "
          f"{'forward' if a.fwd_only else 'forward + backward'} done", flush=True)


if __name__ == "__main__":
    main()
