"""Version shims: every use of a JAX API that moved between releases, and every use of
JAX's private modules, goes through here.  Supported: JAX 0.10.2 to 0.12 (pyproject.toml);
.ci/run tests the oldest, the GPU machines' (0.11.2) and the newest."""

from __future__ import annotations

import inspect

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec


def shard_map(f, *, mesh, in_specs, out_specs, check_vma=True):
    """``jax.shard_map`` (one place, so that a future signature change is one edit)."""
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=check_vma)


def has_explicit_axes(mesh) -> bool:
    """True for meshes whose axes are ``AxisType.Explicit`` (``jax.make_mesh``'s default)."""
    types = getattr(mesh, "axis_types", None) or ()
    return any(t == AxisType.Explicit for t in types)


def place(x, mesh, spec: PartitionSpec):
    """Lay ``x`` out as ``spec`` on ``mesh`` before entering ``shard_map``.

    On explicit-axis meshes ``shard_map`` demands that inputs already carry the spec,
    so we ``reshard``; on auto-axis meshes ``shard_map`` reshards by itself.
    """
    if x is None or not has_explicit_axes(mesh):
        return x
    return jax.sharding.reshard(x, NamedSharding(mesh, spec))


def _vma(x) -> frozenset:
    try:
        aval = jax.typeof(x)
    except Exception:  # pragma: no cover - not an array
        return frozenset()
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


def vary_like(tree, *refs):
    """Mark the arrays of ``tree`` as varying over every mesh axis any of ``refs`` varies over.

    Inside ``shard_map(check_vma=True)`` a loop carry initialised with ``jnp.zeros`` is
    device-invariant while the loop body makes it device-varying; kernels call this on
    their initial carries so they work both inside and outside ``shard_map``.
    """
    axes = frozenset().union(*[_vma(r) for r in jax.tree.leaves(refs)])
    if not axes:
        return tree

    def fix(x):
        missing = tuple(sorted(axes - _vma(x)))
        if not missing:
            return x
        return jax.lax.pcast(x, missing, to="varying")

    return jax.tree.map(fix, tree)


def take_seq(x, idx, mesh, spec: PartitionSpec):
    """``x[:, idx]`` (a token permutation) laid out as ``spec``.

    On explicit-axis meshes a gather along a sharded axis needs its output sharding
    spelled out; on auto-axis meshes the compiler chooses.
    """
    if has_explicit_axes(mesh):
        return x.at[:, idx].get(out_sharding=NamedSharding(mesh, spec))
    return jax.numpy.take(x, idx, axis=1)


def mgpu_load(plgpu, ref, *, layout, optimized: bool):
    """``plgpu.load`` (Pallas Mosaic GPU) of a whole ref: JAX 0.10 wants the index as a
    second argument, 0.11 deprecates it, 0.12 has no such parameter."""
    idx = inspect.signature(plgpu.load).parameters.get("idx")
    extra = ((),) if idx is not None and idx.default is inspect.Parameter.empty else ()
    return plgpu.load(ref, *extra, layout=layout, optimized=optimized)


def kernel_io(args, out_shapes):
    """Prepare a ``pallas_call`` for use inside and outside ``shard_map(check_vma=True)``.

    Marks every array of ``args`` as varying over the union of their mesh axes (a
    ``pallas_call`` needs its inputs to agree) and returns ``(args, out_structs)`` with the
    outputs' ``ShapeDtypeStruct`` carrying that same varying set, as ``check_vma`` demands.
    ``out_shapes`` is a list of ``(shape, dtype)``.
    """
    args = vary_like(list(args), *args)
    mat = None
    for a in args:
        mat = getattr(jax.typeof(a), "manual_axis_type", None)
        if mat is not None:
            break
    structs = []
    for shape, dtype in out_shapes:
        if mat is None:
            structs.append(jax.ShapeDtypeStruct(shape, dtype))
        else:
            structs.append(jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat))
    return args, structs


def kernel_checks_vma(kernel) -> bool:
    """Whether ``kernel`` can run inside ``shard_map(check_vma=True)``.

    Pallas in interpret mode cannot (JAX's interpreter mixes varying and invariant
    values in its own loop); such kernels set ``supports_check_vma = False`` and the
    shard_map around them is built without the check.
    """
    return bool(getattr(kernel, "supports_check_vma", True))


# --------------------------------------------------------------------------------------
# cuDNN fused attention (JAX's private module); kernels/cudnn.py is the only caller.
# --------------------------------------------------------------------------------------

_CUDNN_NEEDS = ("dot_product_attention", "MaskType", "AttentionLayout",
                "_dot_product_attention_bwd_p_wrapper")


def cudnn_module():
    """``jax._src.cudnn.fused_attention_stablehlo``, or ``NotImplementedError`` naming the
    installed JAX version when it lacks what ``kernels/cudnn.py`` uses."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except ImportError as e:  # pragma: no cover - depends on the JAX build
        raise NotImplementedError(
            f"kernel='cudnn' needs jax._src.cudnn.fused_attention_stablehlo, which JAX "
            f"{jax.__version__} does not have ({e})") from None
    missing = [n for n in _CUDNN_NEEDS if not hasattr(fa, n)]
    if missing:  # pragma: no cover - depends on the JAX build
        raise NotImplementedError(
            f"kernel='cudnn' needs {missing} from jax._src.cudnn.fused_attention_stablehlo, "
            f"which JAX {jax.__version__} does not have (written against JAX 0.10-0.11)")
    return fa


def _cudnn_mask(fa, causal: bool, window_left):
    mask_type = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    # cuDNN's window is the exclusive left bound of a causal band: keys (i - w, i].
    return mask_type, (None if window_left is None else int(window_left) + 1)


def cudnn_attention_fwd(q, k, v, *, scale: float, causal: bool, window_left=None,
                        with_lse: bool = True):
    """cuDNN flash attention, BTNH: returns ``(o [B, T, N, H] in q.dtype,
    stats [B, N, T] float32)``; the statistics are the natural-log logsumexp of the
    scaled scores of each row.  ``with_lse=False``: cuDNN's inference kernel, which
    writes no statistics (``stats`` is None)."""
    fa = cudnn_module()
    mask_type, window = _cudnn_mask(fa, causal, window_left)
    out = fa.dot_product_attention(q, k, v, scale=scale, mask_type=mask_type,
                                   sliding_window_length=window, return_residual=with_lse)
    return tuple(out) if with_lse else (out, None)


def cudnn_attention_bwd(q, k, v, o, stats, do, *, scale: float, causal: bool,
                        window_left=None):
    """cuDNN's attention backward primitive from the given output ``o`` and statistics
    (lse ``[B, N, T]`` float32): ``(dq, dk, dv)`` in the input dtype.  ``o`` and ``stats``
    may be those of a larger attention this tile belongs to (cuDNN derives
    ``rowsum(dO * O)`` from them)."""
    fa = cudnn_module()
    mask_type, window = _cudnn_mask(fa, causal, window_left)
    unused = jax.numpy.zeros(0, q.dtype)
    grads = fa._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v, unused, unused, unused, unused, unused, unused, unused, stats, o, do,
        scale=scale, seed=0, dropout_rate=0.0, variadic_args=(False, False),
        mask_type=mask_type, layout=fa.AttentionLayout.BTNH.value,
        sliding_window_length=window)
    return tuple(grads[:3])
