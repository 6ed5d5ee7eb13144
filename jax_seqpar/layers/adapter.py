"""The library's attention as Flax's ``attention_fn``.

``flax.linen.MultiHeadDotProductAttention`` and ``flax.nnx.MultiHeadAttention`` accept an
``attention_fn(query, key, value, bias=None, mask=None, ...)`` that receives the projected
``[batch..., length, heads, head_dim]`` arrays.  ``make_attention_fn(mesh, ...)`` returns
one that runs ``jax_seqpar.attention`` with the sequence split over ``mesh[axis_name]``.

What it cannot honour it refuses, naming the argument: a dense ``mask`` or ``bias``
(``[.., S, S]`` arrays are what sequence parallelism avoids; masks here are predicates on
positions: pass ``causal``/``window`` to ``make_attention_fn``, or NNX's ``is_causal``),
dropout on the attention weights, returning the weights (``sow_weights``), custom
einsums, an explicit ``precision`` and cross-attention (query and key lengths differ).
Flax's modules do not apply RoPE; use ``SeqParallelAttention`` (``layers/linen.py``,
``layers/nnx.py``) for that.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax.numpy as jnp
from jax.sharding import Mesh

from jax_seqpar.layers.core import SeqParallelOptions
from jax_seqpar.masks import WindowArg


def make_attention_fn(mesh: Mesh, *, axis_name: str = "sp", causal: bool = False,
                      window: WindowArg = None, layout: str = "contiguous",
                      permuted: bool = False, strategy: str = "ring", backward: str = "auto",
                      kernel: Any = "auto"):
    """An ``attention_fn`` for Flax's multi-head attention modules (see the module doc).

    ``causal``/``window`` apply to every call; NNX's ``is_causal=True`` adds a causal mask.
    Inputs are in natural token order unless ``permuted=True``.
    """
    if mesh is None:
        raise ValueError("make_attention_fn needs a mesh; without one use Flax's own "
                         "dot_product_attention")
    opts = SeqParallelOptions(mesh=mesh, axis_name=axis_name, layout=layout, permuted=permuted,
                              strategy=strategy, backward=backward, kernel=kernel,
                              causal=causal, window=window)

    def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                     dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
                     dtype: Optional[Any] = None, precision=None, module=None,
                     force_fp32_for_softmax: bool = False, einsum_dot_general=None,
                     qk_attn_weights_einsum=None, attn_weights_value_einsum=None,
                     is_causal: bool = False, **unsupported):
        """Sequence-parallel ``attention_fn`` (softmax always in float32)."""
        del broadcast_dropout, dropout_rng, force_fp32_for_softmax
        _refuse(bias=bias, mask=mask, module=module, precision=precision,
                einsum_dot_general=einsum_dot_general,
                qk_attn_weights_einsum=qk_attn_weights_einsum,
                attn_weights_value_einsum=attn_weights_value_einsum)
        if unsupported:
            raise NotImplementedError(f"jax_seqpar attention_fn does not support the "
                                      f"argument(s) {sorted(unsupported)}")
        if dropout_rate > 0.0 and not deterministic:
            raise NotImplementedError(
                f"dropout_rate={dropout_rate} on the attention weights is not supported: the "
                f"weights are never materialised; set dropout_rate=0.0 or deterministic=True")
        if query.ndim < 4:
            raise ValueError(f"query must have shape [batch..., length, heads, head_dim]; "
                             f"got {query.shape}")
        if key.shape[-3] != query.shape[-3]:
            raise NotImplementedError(f"cross-attention (query length {query.shape[-3]}, key "
                                      f"length {key.shape[-3]}) is not supported; only "
                                      f"self-attention is sequence-parallel here")
        dt = dtype or jnp.result_type(query.dtype, key.dtype, value.dtype)
        batch = query.shape[:-3]

        def flat(x):
            return x.astype(dt).reshape((-1,) + x.shape[-3:])

        call = opts if not is_causal or opts.causal else _with_causal(opts)
        out = call.attend(flat(query), flat(key), flat(value), rope_theta=None)
        return out.reshape(batch + out.shape[1:])

    return attention_fn


def _with_causal(opts: SeqParallelOptions) -> SeqParallelOptions:
    return dataclasses.replace(opts, causal=True)


def _refuse(**kw) -> None:
    reasons = {
        "bias": "an additive [.., S, S] bias would have to be materialised on every device",
        "mask": "a dense [.., S, S] mask would have to be materialised on every device; pass "
                "causal=/window= to make_attention_fn (or is_causal=True in NNX) instead",
        "module": "attention weights are never materialised, so they cannot be sown "
                  "(sow_weights=True)",
        "precision": "the kernels choose their own precision (float32 inputs use "
                     "Precision.HIGHEST)",
        "einsum_dot_general": "custom einsums cannot be applied inside the kernels",
        "qk_attn_weights_einsum": "custom einsums cannot be applied inside the kernels",
        "attn_weights_value_einsum": "custom einsums cannot be applied inside the kernels",
    }
    for name, value in kw.items():
        if value is not None:
            raise NotImplementedError(f"jax_seqpar attention_fn cannot honour {name}=...: "
                                      f"{reasons[name]}")
