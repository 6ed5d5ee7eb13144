"""The ``pallas_mgpu`` backend: Hopper attention tiles in Pallas through the Mosaic GPU
lowering, served through the kernel contract.

The forward kernel (FlashAttention-3's warp-specialised, ping-pong schedule over the
per-block tile lists, masks on global positions) is ``pallas_mgpu_fwd``; the backward's
dK/dV and dQ kernels are ``pallas_mgpu_bwd`` (D = 256 takes the Triton backward: its
blocks do not fit a CTA's shared memory).  This module says what the backend serves (a
Hopper GPU, bf16 or f16, head dims 64/128/256, every mask but block masks) and refuses
the rest with the reason; float32 is refused so that ``kernel="auto"`` hands it to the
Triton kernel.  Each call runs the config of its shape class from ``mgpu_tuning``'s
committed table, measured per GPU, dtype, head dim, tile kind and mask.

``o`` is returned in the input dtype (as cuDNN does), ``lse`` in float32, natural log.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from jax_seqpar.kernels.base import (TILE_GENERAL, KernelRequest, default_platform,
                                     register_kernel)
from jax_seqpar.kernels.mgpu_tuning import gpu_key, lookup
from jax_seqpar.kernels.pallas_common import default_config
from jax_seqpar.kernels.pallas_gpu_bwd import pallas_bwd
from jax_seqpar.kernels.pallas_mgpu_bwd import mgpu_bwd
from jax_seqpar.kernels.pallas_mgpu_common import (DEFAULT_MGPU_CONFIGS, DTYPES,
                                                   HEAD_DIMS, SMEM_LIMIT, MgpuConfig,
                                                   backward_smem_bytes)
from jax_seqpar.kernels.pallas_mgpu_fwd import mgpu_fwd
from jax_seqpar.masks import MaskSpec


# --------------------------------------------------------------------------- backend
def is_hopper() -> bool:
    """Whether JAX's first GPU is a Hopper (compute capability 9.x)."""
    try:
        cc = str(jax.devices("gpu")[0].compute_capability)
    except Exception:
        return False
    return cc.split(".")[0] == "9"


@functools.lru_cache(maxsize=None)
def _device_kind() -> str:
    """The first GPU's kind (``"NVIDIA H200"``), or "" without a GPU (CPU lowering tests)."""
    try:
        return jax.devices("gpu")[0].device_kind
    except RuntimeError:
        return ""


@dataclasses.dataclass(frozen=True)
class PallasMgpuKernel:
    """The ``pallas_mgpu`` backend (Hopper only).  ``config=None`` takes the measured
    config of the call's shape class from ``mgpu_tuning``'s committed table (GPU, dtype,
    head dim, tile kind, mask), else ``DEFAULT_MGPU_CONFIGS[head_dim]``; ``tuned=False``
    always takes the latter."""

    config: Optional[MgpuConfig] = None
    tuned: bool = True
    name: str = "pallas_mgpu"
    tile_aware = True   # receives tile= in fwd/bwd (the tuning table's key)
    skips_masked_blocks = True  # visits only the key blocks its tile lists name

    def __post_init__(self):
        if self.config is not None and not isinstance(self.config, MgpuConfig):
            raise TypeError(f"config={self.config!r} must be an MgpuConfig or None")
        if not isinstance(self.tuned, bool):
            raise TypeError(f"tuned={self.tuned!r} must be a bool")

    def config_for(self, head_dim: int, dtype, mask: MaskSpec, has_segments: bool,
                   tile: str = TILE_GENERAL) -> MgpuConfig:
        """The config a call with these properties runs (see the class docstring)."""
        if self.config is not None:
            return self.config
        kind = _device_kind()
        if not self.tuned or not kind:
            return DEFAULT_MGPU_CONFIGS[head_dim]
        masked = ("segments" if has_segments else "none" if mask.is_dense else "causal")
        return lookup(gpu_key(kind), str(jnp.dtype(dtype)), head_dim, tile, masked)[0]

    #: Under ``shard_map(check_vma=True)`` the kernel bodies would mix mesh-varying
    #: scalars read from the tile lists with loop carries that are not, which JAX 0.10's
    #: loop typing rejects inside a Mosaic GPU kernel; strategies build their shard_map
    #: without the check for this backend, as for interpreted Pallas.
    supports_check_vma = False

    def check(self, request: KernelRequest) -> None:
        if request.platform != "gpu" or not is_hopper():
            raise NotImplementedError(
                "kernel='pallas_mgpu' needs a Hopper GPU (compute capability 9.x: H100, "
                "H200); kernel='pallas' runs the Triton kernel on other GPUs")
        self.check_shapes(request)

    def check_shapes(self, request: KernelRequest) -> None:
        """The refusals that do not depend on the device (tested on CPU)."""
        if request.head_dim not in HEAD_DIMS:
            raise NotImplementedError(f"head_dim={request.head_dim} is not supported by "
                                      f"kernel='pallas_mgpu' (supported: {HEAD_DIMS})")
        if str(request.dtype) not in DTYPES:
            raise NotImplementedError(
                f"dtype {request.dtype} is not supported by kernel='pallas_mgpu' (tensor-"
                f"core bf16/f16 only); kernel='pallas' serves float32")
        if request.mask.block_mask is not None:
            raise NotImplementedError("block-sparse masks (block_mask) are not supported "
                                      "by kernel='pallas_mgpu'; use kernel='xla'")

    def _check_call(self, q, q_pos, kv_pos):
        self.check_shapes(KernelRequest(platform=default_platform(),
                                        dtype=str(jnp.dtype(q.dtype)), head_dim=q.shape[-1],
                                        mask=MaskSpec()))
        if q_pos.ndim not in (1, 2) or kv_pos.ndim != 1:
            raise ValueError(f"q_pos must be [Tq] or [B, Tq] and kv_pos [Tk]; got shapes "
                             f"{q_pos.shape} and {kv_pos.shape}")

    def fwd(self, q, k, v, q_pos, kv_pos, mask: MaskSpec, scale: float, q_seg=None,
            kv_seg=None, *, tile: str = TILE_GENERAL):
        self._check_call(q, q_pos, kv_pos)
        cfg = self.config_for(q.shape[-1], q.dtype, mask, q_seg is not None, tile)
        return _jitted_fwd(q, k, v, q_pos, kv_pos, mask, float(scale), q_seg, kv_seg,
                           config=cfg, tile=tile)

    def bwd(self, q, k, v, o, lse, do, q_pos, kv_pos, mask: MaskSpec, scale: float,
            q_seg=None, kv_seg=None, delta=None, *, tile: str = TILE_GENERAL):
        self._check_call(q, q_pos, kv_pos)
        cfg = self.config_for(q.shape[-1], q.dtype, mask, q_seg is not None, tile)
        if backward_smem_bytes(cfg, q.shape[-1], q.dtype) > SMEM_LIMIT:
            # D = 256: K, V and two Q/dO stages do not fit a CTA's shared memory; the
            # Triton backward (same contract, same tile lists) takes these tiles
            return _jitted_triton_bwd(q, k, v, o, lse, do, q_pos, kv_pos, mask,
                                      float(scale), q_seg, kv_seg, delta,
                                      config=default_config(q.shape[-1], q.dtype),
                                      interpret=False)
        return _jitted_bwd(q, k, v, o, lse, do, q_pos, kv_pos, mask, float(scale), q_seg,
                           kv_seg, delta, config=cfg)


# One jitted function per tile direction, as for the Triton kernel (pallas_gpu.py): a ring
# calls the kernel once per hop with the same shapes, and each call of the bare function
# would build the Mosaic GPU kernel again.  Jitted, a program traces and lowers each
# distinct tile once; XLA inlines the calls when it compiles.
_jitted_fwd = jax.jit(mgpu_fwd, static_argnums=(5, 6), static_argnames=("config", "tile"))
_jitted_bwd = jax.jit(mgpu_bwd, static_argnums=(8, 9), static_argnames=("config",))
_jitted_triton_bwd = jax.jit(pallas_bwd, static_argnums=(8, 9),
                             static_argnames=("config", "interpret"))


register_kernel("pallas_mgpu", PallasMgpuKernel, priority=9, platforms=("gpu",))
