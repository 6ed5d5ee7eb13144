"""A defect found on 2026-12-04, kept as its reproduction (GPU only): the Hopper
backward's kernels that add dQ from the key side (the fused one, which the H200's table
runs, and the atomic-dQ dK/dV kernel) do not mask the keys padded past ``Tk`` (K and V are
zero there, positions and ids repeat the last key's), so a padded key's
``P = exp2(0 - lse2)`` is not zero.  Its dQ term is ``dS * 0`` and vanishes while ``P``
is finite; for a query row whose log-sum-exp is below about -88 (every score of the row
under it) ``P`` overflows, and ``inf * 0`` puts NaN into dQ.

The probe runs ``pallas_mgpu``'s forward and backward, causal, D 128, on ``T`` keys not a
multiple of the key block (200) and on a multiple (256), with ordinary random inputs and
with every score at -724 (queries and keys of opposite sign, norm 8 per element), and
prints the NaN counts of dQ, dK and dV::

    python benchmarks/pad_keys_probe.py      # one Hopper GPU, seconds

On one H200 (JAX 0.11.2, RESULTS.md, "The fused backward's consumer blocks paired within
documents"): 256 NaN elements of dQ at T 200 with the extreme scores, none otherwise.
The fix is a padded-key test in those kernels' masked classes, as the dQ kernel has.
"""

from __future__ import annotations

import _setup  # noqa: F401

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_seqpar.kernels.pallas_mgpu import PallasMgpuKernel  # noqa: E402
from jax_seqpar.masks import MaskSpec  # noqa: E402


def main() -> int:
    kern = PallasMgpuKernel()
    rng = np.random.default_rng(0)
    D, H = 128, 2
    bad = 0
    for T in (200, 256):
        for extreme in (False, True):
            u = np.sign(rng.standard_normal((1, 1, H, D)))
            if extreme:  # every score -8192 / sqrt(D): lse far below -88
                q = np.broadcast_to(8 * u, (1, T, H, D))
                k = np.broadcast_to(-8 * u, (1, T, H, D))
            else:
                q, k = rng.standard_normal((2, 1, T, H, D))
            v, do = rng.standard_normal((2, 1, T, H, D))
            q, k, v, do = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, do))
            pos = jnp.arange(T, dtype=jnp.int32)
            mask, scale = MaskSpec(causal=True), D ** -0.5
            o, lse = kern.fwd(q, k, v, pos, pos, mask, scale)
            grads = kern.bwd(q, k, v, o, lse, do, pos, pos, mask, scale)
            nans = [int(jnp.isnan(g).sum()) for g in grads]
            bad += sum(nans)
            print(f"T={T} {'extreme' if extreme else 'random '} scores: lse min "
                  f"{float(lse.min()):9.2f}, NaN in dq/dk/dv {nans}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
