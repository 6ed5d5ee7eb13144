"""Where arrays live on a mesh: fully sharded parameters and optimizer state (``fsdp``)."""

from jax_seqpar.sharding.fsdp import (bytes_per_device, fsdp_shardings, fsdp_spec,
                                      replicated_shardings)

__all__ = ["bytes_per_device", "fsdp_shardings", "fsdp_spec", "replicated_shardings"]
