"""Configuration and small helpers shared by the per-device algorithms."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
from jax import lax

from jax_seqpar.kernels.base import (TILE_ALIGNED, TILE_DENSE, TILE_GENERAL, AttentionKernel,
                                     KernelRequest, default_gpu, default_platform)
from jax_seqpar.kernels.tiles import TileKernels, tile_kernels
from jax_seqpar.layouts import check_layout
from jax_seqpar.masks import MaskSpec, WindowArg

AxisName = Union[str, Tuple[str, ...]]
BACKWARDS = ("kv", "q", "auto")

#: ``jax.ad_checkpoint.checkpoint_name`` tags of the attention residuals (the output, in the
#: input dtype, and the float32 lse), so that a ``jax.checkpoint`` policy can save them and
#: the backward of a rematerialised layer never re-runs the attention forward
#: (DistFlashAttn §3.3; ``jax_seqpar.layers.remat``).
ATTN_OUT = "seqpar_attn_out"
ATTN_LSE = "seqpar_attn_lse"
#: ``jax.named_scope`` of the ring forward and backward: they show in profiles and in the
#: compiled HLO's ``op_name`` metadata, where tests count how often the forward runs.
FWD_SCOPE = "seqpar_ring_fwd"
BWD_SCOPE = "seqpar_ring_bwd"


@dataclasses.dataclass(frozen=True)
class AttnConfig:
    """Static configuration of one sequence-parallel attention call (hashable)."""

    axis_name: AxisName
    mask: MaskSpec
    scale: float
    kernel: TileKernels  # the backend of each tile kind (kernels/tiles.py)
    layout: str = "contiguous"
    backward: str = "kv"
    stripe: int = 1  # run length of the "striped" layout

    def __post_init__(self):
        if not isinstance(self.kernel, TileKernels):  # one kernel object for every tile kind
            request = KernelRequest(platform=default_platform(), dtype="float32", head_dim=1,
                                    mask=self.mask)
            object.__setattr__(self, "kernel", TileKernels(self.kernel, request))
        check_layout(self.layout)
        if self.backward not in BACKWARDS:
            raise ValueError(f"unknown backward={self.backward!r}; choose one of {BACKWARDS}")


def make_config(q, k, *, axis_name: AxisName, causal: bool, window: WindowArg,
                segment_ids, scale: Optional[float], layout: str, backward: str,
                kernel: Union[str, AttentionKernel], block_mask=None,
                stripe: int = 1, bwd_has_o: bool = True) -> AttnConfig:
    """Validate per-call options and resolve ``kernel`` into a backend per tile kind.

    ``bwd_has_o=False``: the strategy's backward will not pass the forward output ``o``
    to the kernel (only ``delta``), so backends that need it are not chosen.
    """
    mask = MaskSpec(causal=causal, window=window, block_mask=block_mask)
    D = q.shape[-1]
    if scale is None:
        scale = D ** -0.5
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale={scale!r} must be a Python float (or None for 1/sqrt(D))")
    if not isinstance(kernel, str) and not all(
            callable(getattr(kernel, m, None)) for m in ("fwd", "bwd", "check")):
        raise TypeError(f"kernel={kernel!r} must be a backend name ('auto', 'xla', ...) or a "
                        f"kernel object with fwd, bwd and check methods (kernels/base.py)")
    request = KernelRequest(platform=default_platform(), dtype=str(jnp.dtype(q.dtype)),
                            head_dim=D, mask=mask, has_segments=segment_ids is not None,
                            bwd_has_o=bwd_has_o, gpu=default_gpu())
    kernel = tile_kernels(kernel, request)
    return AttnConfig(axis_name=axis_name, mask=mask, scale=float(scale), kernel=kernel,
                      layout=layout, backward=backward, stripe=stripe)


def tile_kind(mask: MaskSpec, aligned: bool) -> str:
    """The tile kind (``kernels/base.py``) of a local call with ``mask``: dense when
    nothing is masked (positions do not matter, whatever the layout), aligned when
    ``aligned`` (both sides at the same consecutive positions) and no block mask, else
    general."""
    if mask.is_dense:
        return TILE_DENSE
    return TILE_ALIGNED if aligned and mask.block_mask is None else TILE_GENERAL


def axis_size(axis_name: AxisName) -> int:
    """Static number of devices along ``axis_name`` (inside shard_map)."""
    return lax.axis_size(axis_name)


def send(x, axis_name: AxisName, num: int, offset: int):
    """Send pytree ``x`` from device ``i`` to device ``(i + offset) mod num`` along the axis."""
    perm = [(i, (i + offset) % num) for i in range(num)]
    return jax.tree.map(lambda a: lax.ppermute(a, axis_name, perm), x)


def ring_shift(x, axis_name: AxisName, num: int, reverse: bool = False):
    """One ring hop: device ``i`` to ``i + 1`` (``i - 1`` if ``reverse``)."""
    return send(x, axis_name, num, -1 if reverse else 1)
