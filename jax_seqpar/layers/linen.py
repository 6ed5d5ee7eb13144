"""Flax Linen sequence-parallel self-attention.

``SeqParallelAttention``: q/k/v projections (grouped-query: ``num_kv_heads`` may divide
``num_heads``), RoPE at global token positions, exact attention with the sequence split
over ``mesh[axis_name]`` (``jax_seqpar.attention``), output projection.  Parameters:
``q_proj``, ``k_proj``, ``v_proj`` (``DenseGeneral`` kernels ``[d, H, D]``) and ``o_proj``
(``[Hq, D, d]``), each with a ``bias`` (``[H, D]``; ``o_proj``: ``[d]``) when
``use_bias`` (``out_bias`` sets ``o_proj``'s apart, e.g. Qwen2: q/k/v biases only); the
same tree as the NNX module's (``layers/nnx.py``), so parameters move between them and to
a single-device copy (``mesh=None``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jax_seqpar.layers.core import SeqParallelOptions
from jax_seqpar.layers.rope import RopeScaling
from jax_seqpar.masks import WindowArg


class SeqParallelAttention(nn.Module):
    """Sequence-parallel multi-head self-attention (Linen).

    Call with ``x`` ``[B, S, d]`` and optionally ``segment_ids`` ``[B, S]`` (packed
    documents) and ``positions`` (``[S]`` or ``[B, S]`` ints, RoPE angles only), all in the
    same row order.  With ``permuted=True`` that order is the ``layout``'s
    (``layouts.permute_sequence``): RoPE then uses each row's global position and no
    token moves; with ``permuted=False`` rows are in natural order and the library
    permutes on the way in and out.  ``mesh=None``: plain single-device attention.
    ``rope_theta=None`` turns RoPE off; ``rope_scaling`` (``layers.rope.RopeScaling``)
    scales it.  ``seq_selective=True``: compute attention so
    that ``jax_seqpar.layers.remat.seq_selective_policy`` can keep the later half of each shard
    (BurstEngine §3.2).
    """

    num_heads: int
    head_dim: int
    num_kv_heads: Optional[int] = None
    mesh: Optional[Mesh] = None
    axis_name: str = "sp"
    batch_axis: Any = None  # mesh axes of the batch and the heads (jax_seqpar.sharding.specs)
    head_axis: Any = None
    layout: str = "contiguous"
    permuted: bool = False
    strategy: str = "ring"
    backward: str = "auto"
    kernel: Any = "auto"
    causal: bool = False
    window: WindowArg = None
    seq_selective: bool = False
    rope_theta: Optional[float] = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    use_bias: bool = False
    out_bias: Optional[bool] = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable = nn.initializers.lecun_normal()

    def options(self) -> SeqParallelOptions:
        return SeqParallelOptions(mesh=self.mesh, axis_name=self.axis_name,
                                  batch_axis=self.batch_axis, head_axis=self.head_axis,
                                  layout=self.layout,
                                  permuted=self.permuted, strategy=self.strategy,
                                  backward=self.backward, kernel=self.kernel,
                                  causal=self.causal, window=self.window,
                                  seq_selective=self.seq_selective)

    @nn.compact
    def __call__(self, x, segment_ids=None, positions=None):
        if x.ndim != 3:
            raise ValueError(f"x must have shape [batch, seq, features]; got {x.shape}")
        opts = self.options()
        hq, hkv = self.num_heads, self.num_kv_heads or self.num_heads
        if hq % hkv:
            raise ValueError(f"num_heads={hq} must be a multiple of num_kv_heads={hkv}")
        out_bias = self.use_bias if self.out_bias is None else self.out_bias

        def dense(features, names, bias_names, **kw):
            # logical names of the kernel's and the bias's dimensions (sharding.parallelism):
            # q/k/v split by output (heads), o by input: Megatron's column / row split
            return nn.DenseGeneral(
                features, dtype=self.dtype, param_dtype=self.param_dtype,
                kernel_init=nn.with_logical_partitioning(self.kernel_init, names),
                bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(),
                                                       bias_names), **kw)

        q = dense((hq, self.head_dim), ("embed", "heads", "head_dim"), ("heads", "head_dim"),
                  use_bias=self.use_bias, name="q_proj")(x)
        k, v = (dense((hkv, self.head_dim), ("embed", "kv_heads", "head_dim"),
                      ("kv_heads", "head_dim"), use_bias=self.use_bias, name=name)(x)
                for name in ("k_proj", "v_proj"))
        o = opts.attend(q, k, v, positions=positions, segment_ids=segment_ids,
                        rope_theta=self.rope_theta, rope_scaling=self.rope_scaling)
        return dense(x.shape[-1], ("heads", "head_dim", "embed"), (None,), axis=(-2, -1),
                     use_bias=out_bias, name="o_proj")(o)

    def init(self, *args, **kwargs):
        """``nn.Module.init`` with plain arrays: the logical names stay out of the tree
        (``logical_specs`` returns them)."""
        return nn.meta.unbox(super().init(*args, **kwargs))

    def logical_specs(self, *args, **kwargs):
        """The logical names of every parameter (``nn.get_partition_spec``), from the
        same arguments as ``init``; nothing is computed."""
        return logical_specs(self, *args, **kwargs)


def logical_specs(module: nn.Module, *args, **kwargs):
    """Logical ``PartitionSpec`` of every variable of ``module.init(*args, **kwargs)``
    (``nn.with_logical_partitioning`` names; ``P()`` for unnamed ones), by abstract
    evaluation."""
    boxed = jax.eval_shape(lambda: nn.Module.init(module, *args, **kwargs))
    return nn.get_partition_spec(boxed)
