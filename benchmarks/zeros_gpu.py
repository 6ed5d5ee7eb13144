"""The atomic-dQ kernels' zeroed float32 dQ: XLA's broadcast kernel (``zeroed_dq``, what
runs by default) against TMA stores from a zeroed shared-memory block
(``MgpuConfig.tma_zero_dq``, ``pallas_mgpu_bwd.tma_zeros``), with cuDNN's own dQ memset
as the yardstick it was compared with (issue 41; one Hopper GPU).

Check first: each shape is zeroed where the allocator last held NaNs (the buffer of a
NaN-filled call of the same size, freed just before), and every element must be 0.
Then both ways are timed on the device clock in a fresh order each round
(``_profile.device_rounds``), at the bar's packed call (64k tokens, 16 heads of 128)
and at 16k::

    python benchmarks/zeros_gpu.py               # writes $OUT or benchmarks/out/zeros_gpu.json
"""

from __future__ import annotations

import argparse
import os
import sys

import _setup  # noqa: F401

import jax
import jax.numpy as jnp

from _util import env_info, out_dir, save_json
from jax_seqpar.kernels.pallas_mgpu_bwd import tma_zeros, zeroed_dq

#: (B, L, H, D): the bar's call, a 16k one, and shapes whose blocks do not divide evenly
#: among the CTAs or that use a smaller head dim.
SHAPES = [(1, 65536, 16, 128), (1, 16384, 16, 128), (2, 640, 3, 128), (1, 192, 5, 64)]


def _calls(shape):
    after = jnp.ones((shape[0], shape[2], shape[1]), jnp.float32)
    return after, {"xla broadcast": jax.jit(lambda a: zeroed_dq(shape, a)),
                   "tma stores": jax.jit(lambda a: tma_zeros(shape, a))}


def check(shape) -> dict:
    after, calls = _calls(shape)
    out = {}
    for name, fn in calls.items():
        nan = jax.block_until_ready(jnp.full(shape, jnp.nan, jnp.float32) + after.sum())
        del nan  # the next buffer of this size is likely the one just freed
        z = jax.block_until_ready(fn(after))
        bad = int(jnp.sum(z != 0) + jnp.sum(jnp.isnan(z)))
        out[name] = bad
        print(f"check {shape} {name:14s}: {bad} nonzero elements", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args(argv)
    from _profile import device_rounds
    result = {"env": env_info(), "checks": {}, "device_ms": {}}
    ok = True
    for shape in SHAPES:
        got = check(shape)
        result["checks"][str(shape)] = got
        ok &= not any(got.values())
    for shape in SHAPES[:2]:
        after, calls = _calls(shape)
        dev = device_rounds({n: (f, (after,)) for n, f in calls.items()}, args.rounds,
                            seed=shape[1])
        gb = 4 * shape[0] * shape[1] * shape[2] * shape[3] / 1e9
        result["device_ms"][str(shape)] = {n: dict(ms=ms, tb_per_s=gb / ms)
                                          for n, ms in dev.items()}
        for n, ms in dev.items():
            print(f"time  {shape} {n:14s}: {ms:.4f} ms ({gb / ms:.2f} TB/s)", flush=True)
    result["ok"] = ok
    save_json(result, os.path.join(out_dir(), "zeros_gpu.json"))
    print("ZEROS:", "PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
