"""Flax layers around the library's attention (needs ``flax``: ``pip install jax_seqpar[flax]``).

* ``SeqParallelAttention`` (Linen, ``layers/linen.py``) and
  ``jax_seqpar.layers.nnx.SeqParallelAttention`` (NNX): self-attention with q/k/v/o
  projections, GQA, RoPE at global positions, causal/window/segment masks.
* ``make_attention_fn``: the library's attention as ``attention_fn`` of Flax's own
  ``MultiHeadDotProductAttention`` / NNX ``MultiHeadAttention``.
* ``apply_rope``: rotary embeddings from integer global positions; ``RopeScaling``: the
  linear / dynamic (NTK) / YaRN / Llama 3.1 scaling types.
"""

from jax_seqpar.layers.adapter import make_attention_fn
from jax_seqpar.layers.core import SeqParallelOptions, plain_attention
from jax_seqpar.layers.linen import SeqParallelAttention
from jax_seqpar.layers.rope import RopeScaling, apply_rope, rope_frequencies, rope_parameters

__all__ = ["SeqParallelAttention", "SeqParallelOptions", "make_attention_fn", "apply_rope",
           "rope_frequencies", "rope_parameters", "RopeScaling", "plain_attention"]
