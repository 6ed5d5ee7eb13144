"""Global-view entry points: natural-order arrays in, natural-order arrays out.

``attention`` shards the sequence axis of ``q, k, v`` over the mesh axis ``axis_name``
with ``jax.shard_map`` and runs a per-device algorithm from ``jax_seqpar.parallel``.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, Float, Int

from jax_seqpar.runtime import _compat
from jax_seqpar.sharding.specs import (AxisRole, activation_spec, check_batch, check_roles,
                                       head_plan, local_heads, normalize_role,
                                       repeat_kv_heads, role_size)
from jax_seqpar.layouts import check_divisible, permutation
from jax_seqpar.masks import BlockMask, WindowArg
from jax_seqpar.parallel.allgather import allgather_attention_with_config
from jax_seqpar.parallel.choose import LayoutChoice, choose_layout
from jax_seqpar.parallel.common import BACKWARDS, make_config
from jax_seqpar.parallel.double_ring import (double_ring_attention_with_config,
                                             double_ring_axes)
from jax_seqpar.parallel import ring_common as _ring_common
from jax_seqpar.parallel.ring import ring_attention_with_config
from jax_seqpar.parallel.selective import selective_ring_attention_with_config
from jax_seqpar.parallel.tree import tree_sequence_attention_with_config
from jax_seqpar.parallel.ulysses import (check_heads, ulysses_attention_with_config,
                                         usp_attention_with_config, usp_axes)

STRATEGIES = ("ring", "allgather", "tree", "ulysses", "usp", "double_ring")
PLANNED_STRATEGIES = ()


def check_nonempty(name: str, shape) -> None:
    """A zero-sized batch, sequence, head or head_dim axis has nothing to attend."""
    for axis, n in zip(("batch", "seq", "heads", "head_dim"), shape):
        if n == 0:
            raise ValueError(f"{name}.shape={tuple(shape)} has {axis}=0: attention needs at "
                             f"least one {'token' if axis == 'seq' else axis} per input; "
                             f"skip the call for empty inputs")


def _validate(q, k, v, segment_ids, mesh, axis_name, strategy, backward, layout,
              batch_axis=None, head_axis=None):
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    check_roles(mesh, axis_name=axis_name, batch_axis=batch_axis, head_axis=head_axis)
    if strategy in PLANNED_STRATEGIES:
        raise NotImplementedError(f"strategy={strategy!r} is not implemented yet; "
                                  f"use one of {STRATEGIES}")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy={strategy!r}; choose one of {STRATEGIES}")
    if backward not in BACKWARDS:
        raise ValueError(f"unknown backward={backward!r}; choose one of {BACKWARDS}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must have shape [batch, seq, heads, head_dim]; "
                             f"got shape {getattr(x, 'shape', None)}")
        check_nonempty(name, x.shape)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name}.dtype={x.dtype} must be a floating dtype")
    if k.shape != v.shape:
        raise ValueError(f"k.shape={k.shape} and v.shape={v.shape} must be equal")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    B, S, Hq, D = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (B, S, D):
        raise ValueError(f"k/v shape {k.shape} must match q shape {q.shape} in batch, "
                         f"sequence and head_dim (self-attention)")
    Hkv = k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq=} must be a multiple of key/value heads {Hkv=} "
                         f"(GQA/MQA)")
    check_batch(B, mesh, batch_axis)
    head_plan(mesh, Hq, Hkv, head_axis)  # raises for query heads the head axis cannot split
    if layout not in ("striped", "auto"):  # striped: once its stripe is known; auto: chosen
        check_divisible(layout, S, role_size(mesh, axis_name))
    if segment_ids is not None:
        if getattr(segment_ids, "shape", None) != (B, S):
            raise ValueError(f"segment_ids must have shape [batch, seq] = {(B, S)}; "
                             f"got {getattr(segment_ids, 'shape', None)}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise TypeError(f"segment_ids.dtype={segment_ids.dtype} must be an integer dtype")


def attention(
    q: Float[Array, "B S Hq D"],
    k: Float[Array, "B S Hkv D"],
    v: Float[Array, "B S Hkv D"],
    *,
    mesh: Mesh,
    axis_name: Union[str, Tuple[str, ...]] = "sp",
    batch_axis: AxisRole = None,
    head_axis: AxisRole = None,
    strategy: str = "ring",
    causal: bool = False,
    window: WindowArg = None,
    segment_ids: Optional[Int[Array, "B S"]] = None,
    block_mask=None,
    layout: str = "contiguous",
    permuted: bool = False,
    backward: str = "auto",
    kernel="auto",
    scale: Optional[float] = None,
) -> Float[Array, "B S Hq D"]:
    """Exact softmax self-attention with the sequence sharded over ``mesh[axis_name]``.

    Args:
      q, k, v: ``[B, S, Hq, D]`` and ``[B, S, Hkv, D]`` with ``Hq % Hkv == 0``; one dtype.
      mesh, axis_name: the sequence axis is split into ``mesh.shape[axis_name]`` shards.
      batch_axis, head_axis: mesh axes (a name, a tuple of names, or None: replicated)
        that split the batch and the heads.  The arrays are sharded
        ``P(batch_axis, axis_name, head_axis, None)``: each device computes its own rows
        and heads, and the strategy's collectives run over ``axis_name`` only
        (``jax_seqpar.sharding.specs``).  The query heads must divide by the devices of
        ``head_axis``; the kv heads split with them when they divide too, else each kv
        head is repeated ``T / gcd(Hkv, T)`` times, only as far as needed (Megatron's
        rule).  Other head counts raise a ``ValueError`` naming them.
      strategy: ``"ring"`` (K/V circulate, O(S/G) memory), ``"allgather"`` (every device
        gathers K/V: the baseline) or ``"tree"`` (every device gathers the queries, K/V stay
        put, and the partial outputs are combined by Tree Attention's logsumexp reduction;
        O(S) query memory per device -- see ``parallel.tree``), ``"ulysses"``
        (DeepSpeed-Ulysses: all-to-alls trade sequence shards for head shards; heads must
        divide by the axis size), ``"usp"`` (``axis_name=(outer, inner)``: Ulysses over
        ``inner`` x ring over ``outer``; see ``parallel.ulysses``) or ``"double_ring"``
        (``axis_name=(outer, inner)``, ``outer`` the slow inter-node axis: BurstEngine's
        topology-aware double ring, intra-node rings over ``inner`` and an inter-node
        ring over ``outer`` whose transfers overlap them; see ``parallel.double_ring``).
        ``parallel.choose.choose_strategy`` picks one from the mesh, heads, sequence
        length and per-axis bandwidths, with the reason.
      causal, window: ``window`` as ``jax.nn.dot_product_attention``'s
        ``local_window_size``: ``(left, right)`` lets query i see keys i-left..i+right.
      segment_ids: ``[B, S]`` ints; a query sees only keys with the same id (packed
        documents).  The kernels and the ring skip the tiles and device pairs whose id
        ranges share no document (exact for any ids; fastest for packed documents, whose
        ids do not decrease along the sequence).
      block_mask: block-sparse attention (BurstEngine §3.4): a static boolean array
        ``[S/b, S/b]`` (NumPy, or a concrete JAX array); query block ``i`` sees key block
        ``j`` iff ``block_mask[i, j]``.  With ``layout="striped"`` the tokens are dealt in
        runs of ``b / G`` so every device holds an equal share of every block (``b`` must
        then be a multiple of ``G``).
      layout: how tokens are dealt to devices: ``"contiguous"``, ``"zigzag"`` or
        ``"striped"`` (the last two balance causal work; see ``jax_seqpar.layouts``), or
        ``"auto"``: the one ``parallel.choose.choose_layout`` models fastest from the
        document lengths of concrete ``segment_ids`` (short packed documents: contiguous;
        one long document: zigzag; documents about a shard long: striped); traced ids
        count as one document per row.  ``api.auto_layout`` returns the choice with
        its reason.
      permuted: False (default): arrays are in natural token order, permuted into the
        layout on the way in and back on the way out.  True: they already are in layout
        order (``layouts.permute_sequence``) and the output stays so -- the efficient path
        for a model that permutes its tokens once, at the input.  For ``"usp"`` the
        layout is over the outer axis only: ``permute_sequence(x, layout, mesh.shape[outer])``;
        for ``"double_ring"`` (and ``"ring"`` on a tuple of axes) over all devices, in
        ``(outer, inner)`` order: ``permute_sequence(x, layout, No * Ni)``.
      backward: ring backward scheme: ``"kv"`` (Ring Attention: K, V, dK, dV circulate),
        ``"q"`` (BurstAttention: Q, dQ, dO, D, lse circulate) or ``"auto"`` (fewer bytes;
        see ``jax_seqpar.parallel.costs``).  Ignored by ``"allgather"`` and ``"tree"``.
      kernel: local tile backend (``"auto"``, ``"xla"``) or a kernel object.
      scale: score scale, default ``1 / sqrt(D)``.

    Returns: ``[B, S, Hq, D]`` in ``q.dtype``, natural token order.
    """
    if isinstance(axis_name, list):
        axis_name = tuple(axis_name)
    _validate(q, k, v, segment_ids, mesh, axis_name, strategy, backward, layout,
              batch_axis, head_axis)
    batch_axis, head_axis = normalize_role(batch_axis), normalize_role(head_axis)
    if not isinstance(permuted, bool):
        raise TypeError(f"permuted={permuted!r} must be a bool")
    G = role_size(mesh, axis_name)
    T, repeats = head_plan(mesh, q.shape[2], k.shape[2], head_axis)
    hq, hkv = local_heads(q.shape[2], k.shape[2], T, repeats)  # per device along head_axis
    if strategy == "usp":  # the layout deals the sequence over the outer (ring) axis
        outer, inner = usp_axes(axis_name)
        check_heads(hq, hkv, mesh.shape[inner], inner, strategy)
        G = mesh.shape[outer]
    elif strategy == "ulysses":
        check_heads(hq, hkv, G, axis_name, strategy)
    elif strategy == "double_ring":
        double_ring_axes(axis_name)
    if layout == "auto":
        layout = auto_layout(segment_ids, S=q.shape[1], G=G, causal=causal, window=window,
                             block_mask=block_mask, permuted=permuted).layout
    bm = _block_mask(block_mask, q.shape[1])
    stripe = 1
    if bm is not None and layout == "striped":
        if bm.block_size % G:
            raise ValueError(f"block_mask blocks of {bm.block_size} tokens must be a multiple "
                             f"of the {G} devices for layout='striped' (BurstEngine §3.4); "
                             f"use fewer, larger blocks or another layout")
        stripe = bm.block_size // G
    check_divisible(layout, q.shape[1], G, stripe)
    cfg = make_config(q, k, axis_name=axis_name, causal=causal, window=window,
                      segment_ids=segment_ids, scale=scale, layout=layout,
                      backward=backward, kernel=kernel, block_mask=bm, stripe=stripe,
                      bwd_has_o=strategy != "tree")  # tree's backward passes delta only
    args = (q, k, v) if segment_ids is None else (q, k, v, segment_ids.astype(jnp.int32))
    key = (cfg, strategy, mesh, G, permuted, len(args), batch_axis, head_axis, repeats,
           (_ring_common.ROLL_HOPS, _ring_common.PACK_HOPS))
    try:
        hash(key)
    except TypeError:  # e.g. a user kernel object that is not hashable: no caching
        return _program.__wrapped__(*key)(*args)
    return _program(*key)(*args)


def auto_layout(segment_ids, *, S: int, G: int, causal: bool, window=None, block_mask=None,
                permuted: bool = False) -> LayoutChoice:
    """What ``layout="auto"`` picks (``choose.choose_layout``), with the reason: from the
    segment ids when they are concrete (NumPy, or a JAX array outside ``jit``), else as
    one document per row (under ``jit`` the ids are traced: call ``choose_layout`` with
    the document lengths outside and pass its layout)."""
    if permuted:
        raise ValueError("layout='auto' chooses the layout, so the arrays cannot already be "
                         "in its order (permuted=True): call jax_seqpar.parallel.choose."
                         "choose_layout(...) and permute with its .layout")
    if block_mask is not None:
        raise ValueError("layout='auto' does not model block masks (block_mask); name the "
                         "layout ('striped' balances them: BurstEngine §3.4)")
    if segment_ids is not None and not isinstance(segment_ids, jax.core.Tracer):
        return choose_layout(np.asarray(segment_ids), num_devices=G, causal=causal,
                             window=window)
    return choose_layout(num_devices=G, seq_len=S, causal=causal, window=window)


@functools.lru_cache(maxsize=256)
def _program(cfg, strategy: str, mesh, G: int, permuted: bool, nargs: int,
             batch_axis=None, head_axis=None, repeats: int = 1, hops=(True, True)):
    """The jitted global program for one static configuration (cached, so repeated eager
    calls reuse the compiled executable instead of tracing a fresh closure each time).

    ``G`` is the number of layout shards: the devices of ``axis_name``, but for "usp"
    only those of the outer (ring) axis (``parallel.ulysses``, token order).  ``repeats``:
    how often each kv head is repeated for ``head_axis`` (``sharding.specs``).
    ``hops``: ``parallel.ring_common``'s ``(ROLL_HOPS, PACK_HOPS)``, which the rings
    read when traced; only a key here, so that a program of another form is not reused."""
    per_device = {"ring": ring_attention_with_config,
                  "allgather": allgather_attention_with_config,
                  "tree": tree_sequence_attention_with_config,
                  "ulysses": ulysses_attention_with_config,
                  "usp": usp_attention_with_config,
                  "double_ring": double_ring_attention_with_config,
                  # not a public strategy: jax_seqpar.layers.remat.seq_selective_attention
                  "ring_selective": selective_ring_attention_with_config}[strategy]
    seq = activation_spec(batch_axis, cfg.axis_name, head_axis)
    specs = (seq, seq, seq, activation_spec(batch_axis, cfg.axis_name, None, ndim=2))[:nargs]
    fn = _compat.shard_map(lambda q, k, v, s=None: per_device(cfg, q, k, v, s), mesh=mesh,
                           in_specs=specs, out_specs=seq,
                           check_vma=_compat.kernel_checks_vma(cfg.kernel))
    layout, stripe = cfg.layout, cfg.stripe

    def run(q, k, v, *seg):
        k, v = repeat_kv_heads(k, repeats), repeat_kv_heads(v, repeats)
        args = (q, k, v, *seg)
        if not permuted:  # natural order in and out; the ring works in layout order
            args = tuple(_reorder(a, layout, G, stripe, mesh, spec, False)
                         for a, spec in zip(args, specs))
        args = tuple(_compat.place(a, mesh, spec) for a, spec in zip(args, specs))
        out = fn(*args)
        return out if permuted else _reorder(out, layout, G, stripe, mesh, seq, True)

    # Under jit, explicit-axis meshes get their reshards (and their transposes in the
    # backward) placed by the compiler; eagerly, a cotangent would reach the transposed
    # shard_map unsharded.
    return jax.jit(run)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5, 6))
def _reorder(x, layout, G, stripe, mesh, spec, inverse):
    """Permute tokens into (``inverse=False``) or out of ``layout`` order.

    A permutation's transpose is the inverse permutation, so the backward is another
    gather; JAX's generic rule (a scatter-add) fails on explicit-axis meshes.
    """
    if layout == "contiguous":
        return x
    perm = permutation(layout, x.shape[1], G, stripe)
    idx = jnp.asarray(np.argsort(perm) if inverse else perm)
    return _compat.take_seq(x, idx, mesh, spec)


def _reorder_fwd(x, layout, G, stripe, mesh, spec, inverse):
    return _reorder(x, layout, G, stripe, mesh, spec, inverse), None


def _reorder_bwd(layout, G, stripe, mesh, spec, inverse, _, ct):
    return (_reorder(ct, layout, G, stripe, mesh, spec, not inverse),)


def _block_mask(block_mask, S: int) -> Optional[BlockMask]:
    """Validate ``block_mask`` (``[S/b, S/b]`` booleans) into a static ``BlockMask``."""
    if block_mask is None or isinstance(block_mask, BlockMask):
        if isinstance(block_mask, BlockMask) and block_mask.num_blocks * block_mask.block_size != S:
            raise ValueError(f"block_mask covers {block_mask.num_blocks} x "
                             f"{block_mask.block_size} tokens but the sequence has {S=}")
        return block_mask
    if isinstance(block_mask, jax.core.Tracer):
        raise TypeError("block_mask must be concrete (a NumPy array), not a traced value: "
                        "it decides statically which tiles are computed")
    table = np.asarray(block_mask)
    if table.ndim != 2 or table.shape[0] != table.shape[1]:
        raise ValueError(f"block_mask must have shape [S/b, S/b]; got {table.shape}")
    if table.dtype != np.bool_:
        raise TypeError(f"block_mask.dtype={table.dtype} must be bool")
    n = table.shape[0]
    if n == 0 or S % n:
        raise ValueError(f"block_mask has {n} blocks, which must divide the sequence "
                         f"length {S=}")
    return BlockMask(table, S // n)


_reorder.defvjp(_reorder_fwd, _reorder_bwd)
