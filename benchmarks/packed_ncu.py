"""One packed (or dense causal) call of the Hopper kernel's forward and backward, for
Nsight Compute: where each of the three kernels' warps wait (issue 41, packed documents).

The call is the one of ``packed_breakdown.py`` (documents log-normal around 4k tokens,
H 16, D 128, bf16, causal; ``--dense`` without segment ids), made once to compile and
once more to profile; ``packed_ncu.sh`` runs it under ``ncu`` and keeps the three kernels
of the second call (``--launch-skip 3 --launch-count 3``: forward, dK/dV, dQ).

    bash benchmarks/packed_ncu.sh 16384     # on a Hopper GPU with ncu; report -> $OUT
    MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=DIR python benchmarks/packed_ncu.py \
        --seq 4096 --set overlap_bwd=false  # ptxas's registers and spills per kernel
"""

from __future__ import annotations

import argparse

import _setup  # noqa: F401

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_seqpar.kernels import PallasMgpuKernel  # noqa: E402
from jax_seqpar.masks import MaskSpec  # noqa: E402
from kernels import parse_mgpu_variant  # noqa: E402
from packed import lognormal_lengths, packed_ids  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--dense", action="store_true", help="no segment ids (dense causal)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="an MgpuConfig field to replace (kernels.py's --mgpu-variant)")
    a = p.parse_args(argv)
    S, H, D = a.seq, 16, 128
    ks = jax.random.split(jax.random.PRNGKey(S), 4)
    q, k, v, do = (jax.random.normal(kk, (1, S, H, D), jnp.bfloat16) for kk in ks)
    seg = None if a.dense else jnp.asarray(
        packed_ids(lognormal_lengths(4096, S, seed=S + 4096), S)[None])
    pos = jnp.arange(S, dtype=jnp.int32)
    # the backend as it runs (the tuned table's config), or with --set fields replaced
    kern = parse_mgpu_variant("set:" + ",".join(a.set))[1] if a.set else PallasMgpuKernel()
    mask = MaskSpec(causal=True)

    @jax.jit
    def fwd_bwd(q, k, v, do, seg):
        o, lse = kern.fwd(q, k, v, pos, pos, mask, D ** -0.5, seg, seg)
        return kern.bwd(q, k, v, o, lse, do, pos, pos, mask, D ** -0.5, seg, seg)
    for _ in range(2):  # compile and run, then the profiled call
        jax.block_until_ready(fwd_bwd(q, k, v, do, seg))
    print(f"packed_ncu: S={S} {'dense causal' if a.dense else 'packed'} done", flush=True)


if __name__ == "__main__":
    main()
