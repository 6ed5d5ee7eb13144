"""What the Hopper (Mosaic GPU) kernels share: configurations, shared-memory budgets,
the launch order, small loads and the Mosaic GPU import.

``pallas_mgpu.py`` (forward and backend) and ``pallas_mgpu_bwd.py`` (backward) import from
here, so neither imports the other's module at load time.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import jax.numpy as jnp

F32 = jnp.float32
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
HEAD_DIMS = (64, 128, 256)
DTYPES = ("bfloat16", "float16")
#: Shared memory a CTA may use on Hopper (227 KiB), less what Mosaic GPU reserves for
#: barriers and its reduction scratch.
SMEM_LIMIT = 227 * 1024 - 2048


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Tiles of the Mosaic GPU kernels.

    ``block_q``: query rows per consumer warpgroup (a CTA holds ``2 * block_q``);
    ``block_kv``: keys per pipeline stage; ``num_stages``: depth of the K/V ring.
    ``*_bwd``: the same for the backward's dK/dV kernel (``block_kv_bwd`` keys per
    consumer, query blocks of ``block_q_bwd`` streamed); ``block_kv_dq``: keys per stage
    of the dQ kernel (whose consumers hold ``block_q_bwd`` queries each).
    """

    block_q: int = 64
    block_kv: int = 128
    num_stages: int = 2
    block_q_bwd: int = 64
    block_kv_bwd: int = 64
    num_stages_bwd: int = 2
    block_kv_dq: int = 64

    def __post_init__(self):
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"MgpuConfig.{f.name}={val!r} must be a positive int")
        for name in ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd", "block_kv_dq"):
            if getattr(self, name) % 64:
                raise ValueError(f"MgpuConfig.{name}={getattr(self, name)} must be a "
                                 f"multiple of 64 (wgmma tiles)")
        for name in ("num_stages", "num_stages_bwd"):
            if getattr(self, name) < 2:
                raise ValueError(f"MgpuConfig.{name}={getattr(self, name)} must be >= 2 "
                                 f"(a single stage cannot overlap loads and compute)")


#: Per-head-dim defaults.  Backward sweep on one H200 at S = 16k (results/
#: mgpu_bwd_sweep16k_h200.json, timed in rotation): dQ stages of 128 keys beat 64 by
#: 1-3%, a third backward stage lost 4-8%.  D = 256 runs the Triton backward (the
#: Mosaic GPU one does not fit shared memory), so its backward fields are unused.
DEFAULT_MGPU_CONFIGS = {
    64: MgpuConfig(block_q=64, block_kv=128, num_stages=4, block_kv_dq=128),
    128: MgpuConfig(block_q=64, block_kv=128, num_stages=2, block_kv_dq=128),
    256: MgpuConfig(block_q=64, block_kv=64, num_stages=2),
}


def forward_smem_bytes(config: MgpuConfig, head_dim: int, dtype) -> int:
    """Shared memory of one forward CTA: two query/output blocks, the K and V rings and
    the two lse rows."""
    item = jnp.dtype(dtype).itemsize
    q_o = 2 * config.block_q * head_dim * item
    kv = 2 * config.num_stages * config.block_kv * head_dim * item
    return q_o + kv + 2 * config.block_q * 4


def backward_smem_bytes(config: MgpuConfig, head_dim: int, dtype) -> int:
    """Shared memory of the larger backward CTA: dK/dV (the K and V of its two consumers,
    the Q, dO, lse and delta rings) or dQ (two Q and dO blocks, the K and V rings)."""
    item = jnp.dtype(dtype).itemsize
    kv = 2 * 2 * config.block_kv_bwd * head_dim * item
    ring = config.num_stages_bwd * config.block_q_bwd * (2 * head_dim * item + 8)
    dq = (2 * 2 * config.block_q_bwd + 2 * config.num_stages_bwd * config.block_kv_dq) \
        * head_dim * item
    return max(kv + ring, dq)


def _plgpu():
    """``jax.experimental.pallas.mosaic_gpu``, imported when a kernel is built."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu


def _load(ref, layout, gmem: bool = True):
    """``plgpu.load`` of a whole (already indexed) ref into a register ``layout``: small
    vectors straight from global memory (positions, segment ids; Mosaic GPU's vectorised
    "optimized" loads read shared memory only, so these are plain loads) or rows staged
    in shared memory (``gmem=False``).  JAX 0.10 wants the index as a second argument,
    later releases deprecate it."""
    plgpu = _plgpu()
    params = inspect.signature(plgpu.load).parameters
    idx = ((),) if params["idx"].default is inspect.Parameter.empty else ()
    return plgpu.load(ref, *idx, layout=layout, optimized=not gmem)


def cta_order(tbl):
    """Query-block order of the launch: most visible tiles first (stable), ``[B, n]``."""
    return jnp.argsort(-tbl[..., 0], axis=1, stable=True).astype(jnp.int32)
