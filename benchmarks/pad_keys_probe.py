"""A defect found on 2026-12-04 and fixed the same day, kept as its check (GPU only): the
Hopper backward's kernels that add dQ from the key side (the fused one, which the H200's
table runs at D 128, and the atomic-dQ dK/dV kernel, the pick at D 64) did not mask the
keys padded past ``Tk`` (K and V are zero there, positions and ids repeat the last
key's), so a padded key's ``P = exp2(0 - lse2)`` was not zero.  Its dQ term is
``dS * 0`` and vanishes while ``P`` is finite; for a query row whose log-sum-exp is below
about -88 (every score of the row under it) ``P`` overflowed, and ``inf * 0`` put NaN
into dQ.  Those kernels now test each key of a tile that may hold padded ones against
``Tk`` (``pallas_mgpu_fused.fused_call``; ``tests/test_pallas_mgpu.py`` checks on CPU
that the test is there).

The probe runs ``pallas_mgpu``'s forward and backward, causal and not, D 64 and 128, on
``T`` keys not a multiple of a CTA's keys (200) and on a multiple (256), with ordinary
random inputs and with every score at -724 (queries and keys of opposite sign, norm 8 per
element), and prints the NaN counts of dQ, dK and dV; it exits 1 if any is NaN::

    python benchmarks/pad_keys_probe.py      # one Hopper GPU, seconds

On one H200 (JAX 0.11.2, RESULTS.md, "A defect found: keys padded past ``Tk``"): before
the fix 256 NaN elements of dQ at D 128, T 200 with the extreme scores, none otherwise.
"""

from __future__ import annotations

import itertools

import _setup  # noqa: F401

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_seqpar.kernels.pallas_mgpu import PallasMgpuKernel  # noqa: E402
from jax_seqpar.masks import MaskSpec  # noqa: E402


def main() -> int:
    kern = PallasMgpuKernel()
    rng = np.random.default_rng(0)
    H = 2
    bad = 0
    for causal, D, T in itertools.product((True, False), (64, 128), (200, 256)):
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
            mask, scale = MaskSpec(causal=causal), D ** -0.5
            o, lse = kern.fwd(q, k, v, pos, pos, mask, scale)
            grads = kern.bwd(q, k, v, o, lse, do, pos, pos, mask, scale)
            nans = [int(jnp.isnan(g).sum()) for g in grads]
            bad += sum(nans)
            what = f"{'causal' if causal else 'dense '} D={D} T={T}"
            print(f"{what} {'extreme' if extreme else 'random '} scores: lse min "
                  f"{float(lse.min()):9.2f}, NaN in dq/dk/dv {nans}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
