"""Where arrays live on a mesh: the specs of attention's arrays on N-D meshes and the
GQA head split (``specs``), fully sharded parameters and optimizer state (``fsdp``)."""

from jax_seqpar.sharding.fsdp import (bytes_per_device, fsdp_shardings, fsdp_spec,
                                      replicated_shardings)
from jax_seqpar.sharding.specs import activation_spec, kv_head_repeats

__all__ = ["activation_spec", "bytes_per_device", "fsdp_shardings", "fsdp_spec",
           "kv_head_repeats", "replicated_shardings"]
