"""Global-view decoding entry points: a few queries against a sequence-sharded KV cache.

``tree_decode`` (Tree Attention, Alg. 3): every device attends the (replicated) queries
to its own slice of the cache, then one ``pmax`` and one fused ``psum`` combine the
partial results: ``O(B * Tq * H * D)`` values on the network, whatever the context length.
``ring_decode`` passes the cache slices around the ring instead (the Ring Attention
baseline of the paper), and ``allgather_decode`` gathers the whole cache on every device.
All three return the same ``[B, Tq, Hq, D]`` output, replicated.

``kv_lengths`` ``[B]`` gives each sequence's valid length (ragged batches): cache entries
at positions ``>= kv_lengths[b]`` are masked.  With ``causal=True`` the ``Tq`` queries
sit at the end of each sequence, at positions ``kv_lengths[b] - Tq + t`` (single-token or
multi-token / speculative decoding).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, Float, Int

from jax_seqpar.runtime import _compat
from jax_seqpar.api import check_nonempty
from jax_seqpar.kernels.base import KernelRequest, default_platform
from jax_seqpar.kernels.pallas_decode import PallasDecodeKernel
from jax_seqpar.masks import MaskSpec
from jax_seqpar.parallel.common import make_config, ring_shift
from jax_seqpar.parallel.merge import merge
from jax_seqpar.parallel.tree import tree_attention
from jax_seqpar.sharding.specs import (axis_tuple, check_batch, check_roles, head_plan,
                                       normalize_role, repeat_kv_heads, role_size)

STRATEGIES = ("tree", "ring", "allgather")


def _validate(q, k, v, kv_lengths, mesh, axis_name, batch_axis=None, head_axis=None):
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    check_roles(mesh, axis_name=axis_name, batch_axis=batch_axis, head_axis=head_axis)
    names, G = axis_tuple(axis_name), role_size(mesh, axis_name)
    for name, x in (("q", q), ("k_cache", k), ("v_cache", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must have shape [batch, seq, heads, head_dim]; "
                             f"got shape {getattr(x, 'shape', None)}")
        check_nonempty(name, x.shape)
    if k.shape != v.shape:
        raise ValueError(f"k_cache.shape={k.shape} and v_cache.shape={v.shape} must be equal")
    if not (q.dtype == k.dtype == v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(f"q, k_cache, v_cache must share one floating dtype; got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")
    B, Tq, Hq, D = q.shape
    _, S, Hkv, Dk = k.shape
    if k.shape[0] != B or Dk != D:
        raise ValueError(f"cache shape {k.shape} must match q shape {q.shape} in batch and "
                         f"head_dim")
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq=} must be a multiple of key/value heads {Hkv=}")
    check_batch(B, mesh, batch_axis)
    head_plan(mesh, Hq, Hkv, head_axis)
    if S % G:
        raise ValueError(f"cache length {S=} must be divisible by the number of devices "
                         f"along axis_name={axis_name!r} ({G}); pad the cache")
    if kv_lengths is not None:
        if getattr(kv_lengths, "shape", None) != (B,):
            raise ValueError(f"kv_lengths must have shape [batch] = {(B,)}; got "
                             f"{getattr(kv_lengths, 'shape', None)}")
        if not jnp.issubdtype(kv_lengths.dtype, jnp.integer):
            raise TypeError(f"kv_lengths.dtype={kv_lengths.dtype} must be an integer dtype")
        if not isinstance(kv_lengths, jax.core.Tracer):  # concrete: check the range
            vals = np.asarray(kv_lengths)
            bad = np.flatnonzero((vals < 0) | (vals > S))
            if bad.size:
                raise ValueError(
                    f"kv_lengths={vals.tolist()} must lie in [0, {S}] (0 to the cache "
                    f"length); entries {bad.tolist()} do not")
    return names, G


def clamp_lengths(kv_lengths, S: int):
    """``kv_lengths`` as int32 in ``[0, S]``: traced lengths (under ``jit``) cannot be
    checked, so they are clamped: a length above the cache reads the whole cache, a
    negative one reads nothing (its rows give 0)."""
    return jnp.clip(kv_lengths.astype(jnp.int32), 0, S)


def _rows(lengths, Tq, T, shard):
    """Query positions ``[B, Tq]``, key positions ``[T]`` of ``shard`` and the segment ids
    that hide cache entries beyond each sequence's length."""
    kv_pos = (shard * T + jnp.arange(T)).astype(jnp.int32)
    q_pos = (lengths[:, None] - Tq + jnp.arange(Tq)[None, :]).astype(jnp.int32)
    q_seg = jnp.ones(q_pos.shape, jnp.int32)
    kv_seg = (kv_pos[None, :] < lengths[:, None]).astype(jnp.int32)
    return q_pos, kv_pos, q_seg, kv_seg


def decode_kernel_name(kernel, q):
    """What ``kernel="auto"`` means for decoding: ``pallas_decode`` on GPUs where it
    accepts the head dim and dtype, else ``xla_decode``.

    A few query rows against a long shard is a memory-bound read of the cache; the
    training kernels (``xla``, ``pallas``) walk it in small sequential tiles.  On an H200
    the blockwise ``xla`` kernel read it at 0.3-0.7 TB/s, ``xla_decode`` at 0.5-3.5 and
    ``pallas_decode`` at 0.7-4.1 TB/s (``benchmarks/decode_kernel.py``, RESULTS.md).
    Any other value is passed through.
    """
    if kernel != "auto":
        return kernel
    if default_platform() == "gpu":
        request = KernelRequest(platform="gpu", dtype=str(q.dtype), head_dim=q.shape[-1],
                                mask=MaskSpec(causal=True))
        try:
            PallasDecodeKernel().check(request)
            return "pallas_decode"
        except NotImplementedError:
            pass
    return "xla_decode"


def _decode(strategy, q, k_cache, v_cache, *, mesh, axis_name, kv_lengths, causal, kernel,
            scale, batch_axis=None, head_axis=None):
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy={strategy!r}; choose one of {STRATEGIES}")
    names, G = _validate(q, k_cache, v_cache, kv_lengths, mesh, axis_name, batch_axis,
                         head_axis)
    batch_axis, head_axis = normalize_role(batch_axis), normalize_role(head_axis)
    _, repeats = head_plan(mesh, q.shape[2], k_cache.shape[2], head_axis)
    axis = names if len(names) > 1 else names[0]
    B, Tq = q.shape[:2]
    S = k_cache.shape[1]
    T = S // G
    lengths = (jnp.full((B,), S, jnp.int32) if kv_lengths is None
               else clamp_lengths(kv_lengths, S))
    cfg = make_config(q, k_cache, axis_name=axis, causal=causal, window=None,
                      segment_ids=lengths, scale=scale, layout="contiguous",
                      backward="kv", kernel=decode_kernel_name(kernel, q))

    def tree(q, k, v, lengths):
        idx = lax.axis_index(axis)
        q_pos, kv_pos, q_seg, kv_seg = _rows(lengths, Tq, T, idx)
        return tree_attention(cfg, q, k, v, q_pos, kv_pos, q_seg, kv_seg)

    def ring(q, k, v, lengths):
        idx = lax.axis_index(axis)
        o = jnp.zeros(q.shape, jnp.float32)
        lse = jnp.full((q.shape[0], q.shape[2], Tq), -jnp.inf, jnp.float32)  # local rows
        block = (k, v)
        for step in range(G):
            nxt = ring_shift(block, axis, G) if step < G - 1 else None
            q_pos, kv_pos, q_seg, kv_seg = _rows(lengths, Tq, T, (idx - step) % G)
            o_s, lse_s = cfg.kernel.fwd(q, block[0], block[1], q_pos, kv_pos, cfg.mask,
                                        cfg.scale, q_seg, kv_seg)
            o, lse = merge(o, lse, o_s, lse_s)
            block = nxt
        return o.astype(q.dtype)

    def allgather(q, k, v, lengths):
        k_all = lax.all_gather(k, axis, axis=1, tiled=True)
        v_all = lax.all_gather(v, axis, axis=1, tiled=True)
        q_pos, kv_pos, q_seg, kv_seg = _rows(lengths, Tq, S, 0)
        o, _ = cfg.kernel.fwd(q, k_all, v_all, q_pos, kv_pos, cfg.mask, cfg.scale, q_seg,
                              kv_seg)
        return o.astype(q.dtype)

    fn = {"tree": tree, "ring": ring, "allgather": allgather}[strategy]
    # queries and the output: replicated over the sequence axes, split over batch and heads
    seq, rep = P(batch_axis, axis, head_axis, None), P(batch_axis, None, head_axis, None)
    rows = P(batch_axis)
    # The baselines' results are the same on every device, but they are built from
    # device-varying values, so their replication cannot be checked by type.
    smap = _compat.shard_map(fn, mesh=mesh, in_specs=(rep, seq, seq, rows), out_specs=rep,
                             check_vma=strategy == "tree" and _compat.kernel_checks_vma(cfg.kernel))

    def run(q, k, v, lengths):
        k, v = repeat_kv_heads(k, repeats), repeat_kv_heads(v, repeats)
        q, lengths = _compat.place(q, mesh, rep), _compat.place(lengths, mesh, rows)
        k, v = _compat.place(k, mesh, seq), _compat.place(v, mesh, seq)
        return smap(q, k, v, lengths)

    return jax.jit(run)(q, k_cache, v_cache, lengths)


def tree_decode(
    q: Float[Array, "B Tq Hq D"],
    k_cache: Float[Array, "B S Hkv D"],
    v_cache: Float[Array, "B S Hkv D"],
    *,
    mesh: Mesh,
    axis_name="sp",
    batch_axis=None,
    head_axis=None,
    kv_lengths: Optional[Int[Array, "B"]] = None,
    causal: bool = False,
    kernel="auto",
    scale: Optional[float] = None,
) -> Float[Array, "B Tq Hq D"]:
    """Decode with Tree Attention: queries replicated, KV cache sharded along ``S``.

    Differentiable (``custom_vjp``: dq is summed over the devices, dk/dv stay local).
    ``axis_name`` may be a tuple of mesh axes: the reductions then span all of them.
    ``batch_axis`` / ``head_axis`` split the batch rows and the heads (queries, cache and
    output ``P(batch_axis, ., head_axis, None)``), as in ``jax_seqpar.attention``: the
    reductions stay on ``axis_name``; kv heads fewer than the head axis are repeated as
    far as needed (``sharding.specs``).
    ``kv_lengths`` ``[B]``: the valid cache entries of each sequence, in ``[0, S]``;
    concrete lengths outside that range raise ``ValueError``, traced ones (under
    ``jit``) are clamped into it (``clamp_lengths``).
    """
    return _decode("tree", q, k_cache, v_cache, mesh=mesh, axis_name=axis_name,
                   kv_lengths=kv_lengths, causal=causal, kernel=kernel, scale=scale,
                   batch_axis=batch_axis, head_axis=head_axis)


def ring_decode(q, k_cache, v_cache, *, mesh: Mesh, axis_name="sp", batch_axis=None,
                head_axis=None, kv_lengths=None,
                causal: bool = False, kernel="auto", scale: Optional[float] = None):
    """Decode baseline: the cache slices circulate around the ring (G - 1 hops of K, V).

    Same signature and result as ``tree_decode``; forward only.
    """
    return _decode("ring", q, k_cache, v_cache, mesh=mesh, axis_name=axis_name,
                   kv_lengths=kv_lengths, causal=causal, kernel=kernel, scale=scale,
                   batch_axis=batch_axis, head_axis=head_axis)


def allgather_decode(q, k_cache, v_cache, *, mesh: Mesh, axis_name="sp", batch_axis=None,
                     head_axis=None, kv_lengths=None,
                     causal: bool = False, kernel="auto", scale: Optional[float] = None):
    """Decode baseline: every device gathers the whole cache.  Same signature as
    ``tree_decode``; forward only."""
    return _decode("allgather", q, k_cache, v_cache, mesh=mesh, axis_name=axis_name,
                   kv_lengths=kv_lengths, causal=causal, kernel=kernel, scale=scale,
                   batch_axis=batch_axis, head_axis=head_axis)
