"""Models built on the sequence-parallel layers (needs ``flax``)."""

from jax_seqpar.models.llama import (Llama, LlamaConfig, head_weights, next_token_loss,
                                     shift_targets)

__all__ = ["Llama", "LlamaConfig", "head_weights", "next_token_loss", "shift_targets"]
