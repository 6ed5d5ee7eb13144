"""Local attention tile kernels behind one contract (see ``base.py``)."""

from jax_seqpar.kernels import xla  # noqa: F401  (registers "xla")
from jax_seqpar.kernels.base import (AttentionKernel, KernelRequest, available_kernels,
                                     get_kernel, register_kernel)
from jax_seqpar.kernels.xla import XlaKernel

__all__ = ["AttentionKernel", "KernelRequest", "XlaKernel", "available_kernels", "get_kernel",
           "register_kernel"]
