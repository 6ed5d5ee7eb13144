"""Layers around the library's attention.

The Flax modules need ``flax`` (``pip install jax_seqpar[flax]``); ``lm_head`` (the fused
LM head + loss) and ``remat`` (checkpoint policies) need only JAX, so the Flax names
below are imported on first use.

* ``SeqParallelAttention`` (Linen, ``layers/linen.py``) and
  ``jax_seqpar.layers.nnx.SeqParallelAttention`` (NNX): self-attention with q/k/v/o
  projections, GQA, RoPE at global positions, causal/window/segment masks.
* ``make_attention_fn``: the library's attention as ``attention_fn`` of Flax's own
  ``MultiHeadDotProductAttention`` / NNX ``MultiHeadAttention``.
* ``apply_rope``: rotary embeddings from integer global positions; ``RopeScaling``: the
  linear / dynamic (NTK) / YaRN / Llama 3.1 scaling types.
"""

import importlib

#: public name -> the module of this package that defines it
_NAMES = {"make_attention_fn": "adapter", "SeqParallelOptions": "core",
          "plain_attention": "core", "SeqParallelAttention": "linen", "RopeScaling": "rope",
          "apply_rope": "rope", "rope_frequencies": "rope", "rope_parameters": "rope"}


def __getattr__(name):
    if name in _NAMES:
        return getattr(importlib.import_module(f"jax_seqpar.layers.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'jax_seqpar.layers' has no attribute {name!r}")


__all__ = ["SeqParallelAttention", "SeqParallelOptions", "make_attention_fn", "apply_rope",
           "rope_frequencies", "rope_parameters", "RopeScaling", "plain_attention"]
