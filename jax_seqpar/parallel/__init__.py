"""Per-device algorithms; call them inside ``jax.shard_map`` with the sequence axis name."""

from jax_seqpar.parallel.allgather import allgather_attention
from jax_seqpar.parallel.double_ring import double_ring_attention
from jax_seqpar.parallel.merge import merge
from jax_seqpar.parallel.ring import ring_attention
from jax_seqpar.parallel.tree import tree_attention, tree_reduce

__all__ = ["allgather_attention", "double_ring_attention", "merge", "ring_attention",
           "tree_attention", "tree_reduce"]
