"""The Triton kernels (``pallas``: ``kernels/pallas_gpu*.py``; ``pallas_decode``) lowered for
CUDA on the CPU, for an abstract GPU.

``test_pallas_kernel.py`` and ``test_pallas_decode_kernel.py`` check these kernels'
numbers in interpret mode, which evaluates the kernel bodies with JAX's own primitives
and never runs Pallas's Triton lowering.  A change that the interpreter accepts and the
Triton lowering refuses (a primitive without a Triton rule, a block shape or a dtype
``tl.dot`` cannot take, an index map Triton cannot express) would otherwise show first
on a GPU.  Here every kernel is lowered with ``interpret=False`` as on a GPU: the
backend objects' own entry points, the tables' default tiles for each head dim and dtype,
on the inputs that select the kernels' other code (masks, segment ids, ragged lengths,
GQA), and the ``__gpu$xla.gpu.triton`` custom calls counted.  What the lowered kernels
compute on a GPU is checked by ``benchmarks/kernels.py --phases check`` and
``benchmarks/decode_kernel.py`` (RESULTS.md).

Pallas (JAX >= 0.11) finds the GPU's compute capability from the device or, off a GPU,
from an abstract mesh's ``AbstractDevice``: an H100 here, through the helper of
``scripts/mosaic_modules.py``, which fingerprints these modules (JAX 0.10 needs none).
Each test counts the Triton custom calls in the lowered program, so none passes without
lowering its kernels.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jax_seqpar.kernels import PallasKernel
from jax_seqpar.kernels.pallas_common import DEFAULT_CONFIGS, FLOAT32_CONFIGS, HEAD_DIMS
from jax_seqpar.kernels.pallas_decode import PallasDecodeKernel
from jax_seqpar.masks import MaskSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from mosaic_modules import lower_for_cuda as lowered  # noqa: E402  (an abstract H100)

SDS = jax.ShapeDtypeStruct
TRITON_CALL = "stablehlo.custom_call @__gpu$xla.gpu.triton"
KERNEL = PallasKernel(interpret=False)  # tiles from the tables: DEFAULT / FLOAT32_CONFIGS
DECODE = PallasDecodeKernel(interpret=False)


def avals(B, Tq, Tk, Hq, Hkv, D, dtype, seg):
    q, kv = SDS((B, Tq, Hq, D), dtype), SDS((B, Tk, Hkv, D), dtype)
    pos = [SDS((Tq,), jnp.int32), SDS((Tk,), jnp.int32)]
    segs = [SDS((B, Tq), jnp.int32), SDS((B, Tk), jnp.int32)] if seg else []
    return q, kv, pos, segs


# name: (Tq, Tk, Hq, Hkv, mask, segment ids); ragged lengths (not multiples of a tile)
# run the padded-key code, segment ids the per-block document ranges
CASES = {
    "dense": (256, 256, 4, 4, MaskSpec(), False),
    "causal_gqa_ragged": (200, 328, 4, 2, MaskSpec(causal=True), False),
    "window_segments_mqa": (256, 192, 4, 1, MaskSpec(causal=True, window=(70, 0)), True),
}
# every head dim with bf16 on every case; float16 and float32 (its own tiles) on one
RUNS = ([(D, "bfloat16", case) for D in HEAD_DIMS for case in CASES]
        + [(D, dt, "window_segments_mqa") for D in HEAD_DIMS for dt in ("float16", "float32")])


@pytest.mark.parametrize("D,dtype,case", RUNS)
def test_forward_and_backward_lower_to_triton(D, dtype, case):
    """The forward is one Triton kernel, the backward two (dK/dV over query blocks, dQ over
    key blocks), with the tiles the table gives this head dim and dtype."""
    Tq, Tk, Hq, Hkv, mask, seg = CASES[case]
    dt = jnp.dtype(dtype)
    q, kv, pos, segs = avals(2, Tq, Tk, Hq, Hkv, D, dt, seg)
    lse = SDS((2, Hq, Tq), jnp.float32)

    def fwd(q, k, v, qp, kp, *s):
        return KERNEL.fwd(q, k, v, qp, kp, mask, D ** -0.5, *s)

    def bwd(q, k, v, o, lse, do, qp, kp, *s):
        return KERNEL.bwd(q, k, v, o, lse, do, qp, kp, mask, D ** -0.5, *s)

    assert lowered(fwd, q, kv, kv, *pos, *segs).count(TRITON_CALL) == 1
    assert lowered(bwd, q, kv, kv, q, lse, q, *pos, *segs).count(TRITON_CALL) == 2


def test_the_runs_use_each_table_entry():
    """The parametrisation above reaches every default tile config (bf16/f16 share
    ``DEFAULT_CONFIGS``, float32 has ``FLOAT32_CONFIGS``): none is left unlowered."""
    dims = {dt: {D for D, d, _ in RUNS if d == dt} for dt in ("bfloat16", "float16",
                                                               "float32")}
    assert dims["bfloat16"] == dims["float32"] == set(DEFAULT_CONFIGS) == set(FLOAT32_CONFIGS)


@pytest.mark.parametrize("D,dtype,Tq,seg", [(128, "bfloat16", 1, False),
                                            (64, "float16", 4, True),
                                            (256, "float32", 2, False)])
def test_decode_forward_lowers_to_triton(D, dtype, Tq, seg):
    """The decode kernel (a few query rows against a long cache, split over key blocks):
    one Triton kernel; its splits are merged in XLA."""
    q, kv, pos, segs = avals(2, Tq, 1000, 8, 2, D, jnp.dtype(dtype), seg)
    mask = MaskSpec(causal=True)

    def fwd(q, k, v, qp, kp, *s):
        return DECODE.fwd(q, k, v, qp, kp, mask, D ** -0.5, *s)

    assert lowered(fwd, q, kv, kv, *pos, *segs).count(TRITON_CALL) == 1

