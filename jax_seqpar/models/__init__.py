"""Models built on the sequence-parallel layers (needs ``flax``).

``generate`` (``models/generate.py``) is the function: ``jax_seqpar.models.generate(model,
params, prompts, max_new_tokens=...)``; its module's other names import from
``jax_seqpar.models.generate``.
"""

from jax_seqpar.models.llama import (Llama, LlamaConfig, head_weights, next_token_loss,
                                     shift_targets)
from jax_seqpar.models.generate import generate  # noqa: E402  (after llama: it imports it)
from jax_seqpar.models.sampling import sample_logits

__all__ = ["Llama", "LlamaConfig", "generate", "head_weights", "next_token_loss",
           "sample_logits", "shift_targets"]
