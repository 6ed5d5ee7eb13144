"""What the Linen and the NNX attention modules share: options, positions, the call.

``SeqParallelOptions`` holds the static choices of a sequence-parallel self-attention
layer (mesh, axis, layout, strategy, backward, kernel, mask) and does the part of the
layer between the projections: RoPE on queries and keys at their *global* positions,
then ``jax_seqpar.attention`` (or ``remat.seq_selective_attention``).  With
``mesh=None`` it is plain single-device attention (``jax.nn.dot_product_attention``),
which is what the sequence-parallel layer must agree with.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_seqpar.runtime import _compat
from jax_seqpar.api import STRATEGIES, attention
from jax_seqpar.layers.rope import apply_rope
from jax_seqpar.layouts import check_layout, permutation
from jax_seqpar.masks import MaskSpec, WindowArg, normalize_window
from jax_seqpar.parallel.common import BACKWARDS
from jax_seqpar.layers.remat import seq_selective_attention
from jax_seqpar.sharding.specs import check_roles, normalize_role, role_size

F32 = jnp.float32


def check_mesh(mesh: Optional[Mesh], axis_name: str, batch_axis=None,
               head_axis=None) -> None:
    """Raise a ``ValueError`` naming the fix for meshes the Flax layers cannot use."""
    if mesh is None:
        return
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
    check_roles(mesh, axis_name=axis_name, batch_axis=batch_axis, head_axis=head_axis)
    if _compat.has_explicit_axes(mesh):
        raise ValueError(
            "the Flax layers need a mesh with AxisType.Auto axes: the weight gradients of "
            "the projections contract over the sharded sequence axis, which explicit-sharding "
            "meshes refuse to do without an out_sharding that Flax's Dense layers do not "
            "pass.  Build it with jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * "
            "len(names)) or jax.sharding.Mesh(devices, names)")


@dataclasses.dataclass(frozen=True)
class SeqParallelOptions:
    """Static options of a sequence-parallel self-attention layer (hashable).

    ``mesh=None`` gives plain single-device attention.  ``permuted=True`` says the layer's
    inputs are in ``layout`` order (the model permuted its tokens once, at the input);
    RoPE then uses each row's global position, ``layouts.permutation(layout, S, G)``.
    ``seq_selective=True`` computes attention with ``remat.seq_selective_attention`` (for
    ``remat.seq_selective_policy``).  ``batch_axis`` / ``head_axis`` split the batch and
    the heads over more mesh axes (``jax_seqpar.sharding.specs``).  The other fields mean
    what they mean in ``jax_seqpar.attention``.
    """

    mesh: Optional[Mesh] = None
    axis_name: Any = "sp"  # a mesh axis or a tuple of them (one ring over their product)
    batch_axis: Any = None
    head_axis: Any = None
    layout: str = "contiguous"
    permuted: bool = False
    strategy: str = "ring"
    backward: str = "auto"
    kernel: Any = "auto"
    causal: bool = False
    window: WindowArg = None
    seq_selective: bool = False

    def __post_init__(self):
        for name in ("axis_name", "batch_axis", "head_axis"):
            object.__setattr__(self, name, normalize_role(getattr(self, name)))
        check_mesh(self.mesh, self.axis_name, self.batch_axis, self.head_axis)
        check_layout(self.layout)
        object.__setattr__(self, "window", normalize_window(self.window))
        for name in ("permuted", "causal", "seq_selective"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy={self.strategy!r}; choose one of {STRATEGIES}")
        if self.backward not in BACKWARDS:
            raise ValueError(f"unknown backward={self.backward!r}; choose one of {BACKWARDS}")
        if self.seq_selective and (self.mesh is None or self.strategy != "ring"):
            raise ValueError("seq_selective=True needs a mesh and strategy='ring' (it splits "
                             "the ring forward of each shard; remat.seq_selective_attention)")

    @property
    def num_shards(self) -> int:
        return 1 if self.mesh is None else role_size(self.mesh, self.axis_name)

    def positions(self, seq_len: int) -> np.ndarray:
        """int32 ``[S]``: the global position of each row of the layer's input."""
        if self.mesh is None or not self.permuted:
            return np.arange(seq_len, dtype=np.int32)
        return permutation(self.layout, seq_len, self.num_shards).astype(np.int32)

    def shard(self, x):
        """Constrain ``x`` ``[B, S, ...]`` to be split along the sequence (no-op without a mesh)."""
        if self.mesh is None:
            return x
        spec = P(self.batch_axis, self.axis_name, *([None] * (x.ndim - 2)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def attend(self, q, k, v, *, positions=None, segment_ids=None,
               rope_theta: Optional[float] = 10000.0, rope_scaling=None):
        """RoPE (unless ``rope_theta`` is None; scaled by ``rope_scaling``, a
        ``rope.RopeScaling``) at ``positions``, then attention.

        ``q`` ``[B, S, Hq, D]``, ``k, v`` ``[B, S, Hkv, D]`` in the layer's row order.
        ``positions`` (``[S]`` or ``[B, S]`` ints) default to ``self.positions(S)``; they
        only rotate queries and keys -- the mask always uses the layout's positions.
        """
        S = q.shape[1]
        if positions is None:
            positions = self.positions(S)
        if self.mesh is not None and self.head_axis is not None:
            q, k, v = self._split_heads(q, k, v)
        if rope_theta is not None:
            q = apply_rope(q, positions, rope_theta, rope_scaling)
            k = apply_rope(k, positions, rope_theta, rope_scaling)
        if self.mesh is None:
            return plain_attention(q, k, v, causal=self.causal, window=self.window,
                                   segment_ids=segment_ids)
        kw = dict(mesh=self.mesh, axis_name=self.axis_name, batch_axis=self.batch_axis,
                  head_axis=self.head_axis, causal=self.causal,
                  window=self.window, segment_ids=segment_ids, layout=self.layout,
                  permuted=self.permuted, backward=self.backward, kernel=self.kernel)
        if self.seq_selective:
            return seq_selective_attention(q, k, v, **kw)
        return attention(q, k, v, strategy=self.strategy, **kw)


    def _split_heads(self, q, k, v):
        """Lay the projections out as attention takes them (column-parallel q/k/v):
        heads over ``head_axis``; kv heads that the head axis does not divide stay whole
        there (attention repeats them, ``sharding.specs``), so the compiler computes
        them whole instead of splitting and regathering them."""
        T = role_size(self.mesh, self.head_axis)
        kv_axis = self.head_axis if k.shape[2] % T == 0 else None
        def put(x, heads):
            spec = P(self.batch_axis, self.axis_name, heads, None)
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))
        return put(q, self.head_axis), put(k, kv_axis), put(v, kv_axis)


def plain_attention(q, k, v, *, causal=False, window=None, segment_ids=None):
    """Single-device ``jax.nn.dot_product_attention`` in natural token order (GQA allowed).

    float32 inputs get float32 matmuls on every platform (no TF32)."""
    S = q.shape[1]
    pos = jnp.arange(S)
    mask = MaskSpec(causal=causal, window=window).visible(
        pos[None], pos[None], segment_ids, segment_ids)[:, None]  # [B|1, 1, S, S]
    ctx = jax.default_matmul_precision("highest") if q.dtype == F32 else contextlib.nullcontext()
    with ctx:
        return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
