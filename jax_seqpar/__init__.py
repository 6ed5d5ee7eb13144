"""jax_seqpar: sequence-parallel exact attention for JAX."""

from jax_seqpar import kernels as _kernels  # noqa: F401  (registers the backends)
from jax_seqpar.api import attention
from jax_seqpar.decode import allgather_decode, ring_decode, tree_decode
from jax_seqpar.masks import MaskSpec
from jax_seqpar.reference import reference_attention

__version__ = "0.1.0"
__all__ = ["attention", "tree_decode", "ring_decode", "allgather_decode", "reference_attention",
           "MaskSpec", "__version__"]
