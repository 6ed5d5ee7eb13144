"""Flax NNX sequence-parallel self-attention.

The NNX twin of ``layers/linen.py``: the same projections (``q_proj``, ``k_proj``,
``v_proj``: ``LinearGeneral`` kernels ``[d, H, D]``; ``o_proj``: ``[Hq, D, d]``), RoPE at
global positions (scaled by ``rope_scaling``), the same biases (``use_bias``,
``out_bias``), and the same attention call (``layers/core.py``), so the two modules
compute the same function of the same parameters.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jax_seqpar.layers.core import SeqParallelOptions
from jax_seqpar.layers.rope import RopeScaling, as_rope_scaling
from jax_seqpar.masks import WindowArg


class SeqParallelAttention(nnx.Module):
    """Sequence-parallel multi-head self-attention (NNX).

    ``SeqParallelAttention(in_features, num_heads, head_dim, num_kv_heads=..., mesh=...,
    layout=..., causal=..., rngs=nnx.Rngs(0))``; the options mean what they mean in the
    Linen module (``jax_seqpar.layers.linen.SeqParallelAttention``).  Call with ``x``
    ``[B, S, in_features]`` and optionally ``segment_ids`` / ``positions``.
    """

    def __init__(self, in_features: int, num_heads: int, head_dim: int, *,
                 num_kv_heads: Optional[int] = None, mesh: Optional[Mesh] = None,
                 axis_name: str = "sp", batch_axis: Any = None, head_axis: Any = None,
                 layout: str = "contiguous", permuted: bool = False,
                 strategy: str = "ring", backward: str = "auto", kernel: Any = "auto",
                 causal: bool = False, window: WindowArg = None, seq_selective: bool = False,
                 rope_theta: Optional[float] = 10000.0,
                 rope_scaling: Optional[RopeScaling] = None, use_bias: bool = False,
                 out_bias: Optional[bool] = None, dtype: Any = None,
                 param_dtype: Any = jnp.float32,
                 kernel_init: Callable = nnx.initializers.lecun_normal(), rngs: nnx.Rngs):
        hkv = num_kv_heads or num_heads
        if num_heads % hkv:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={hkv}")
        self.options = SeqParallelOptions(mesh=mesh, axis_name=axis_name,
                                          batch_axis=batch_axis, head_axis=head_axis,
                                          layout=layout,
                                          permuted=permuted, strategy=strategy,
                                          backward=backward, kernel=kernel, causal=causal,
                                          window=window, seq_selective=seq_selective)
        self.rope_theta = rope_theta
        self.rope_scaling = as_rope_scaling(rope_scaling)

        def linear(inp, out, **kw):
            kw.setdefault("use_bias", use_bias)
            return nnx.LinearGeneral(inp, out, dtype=dtype,
                                     param_dtype=param_dtype, kernel_init=kernel_init,
                                     rngs=rngs, **kw)

        self.q_proj = linear(in_features, (num_heads, head_dim))
        self.k_proj = linear(in_features, (hkv, head_dim))
        self.v_proj = linear(in_features, (hkv, head_dim))
        self.o_proj = linear((num_heads, head_dim), in_features, axis=(-2, -1),
                             use_bias=use_bias if out_bias is None else out_bias)

    def __call__(self, x, segment_ids=None, positions=None):
        if x.ndim != 3:
            raise ValueError(f"x must have shape [batch, seq, features]; got {x.shape}")
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        o = self.options.attend(q, k, v, positions=positions, segment_ids=segment_ids,
                                rope_theta=self.rope_theta, rope_scaling=self.rope_scaling)
        return self.o_proj(o)
