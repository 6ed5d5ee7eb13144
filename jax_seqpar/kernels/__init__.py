"""Local attention tile kernels behind one contract (see ``base.py``)."""

from jax_seqpar.kernels import flash_attn, pallas_gpu, xla, xla_decode  # noqa: F401  (register)
from jax_seqpar.kernels.base import (AttentionKernel, KernelRequest, available_kernels,
                                     get_kernel, register_kernel)
from jax_seqpar.kernels.flash_attn import FlashAttnKernel
from jax_seqpar.kernels.pallas_gpu import PallasConfig, PallasKernel
from jax_seqpar.kernels.xla import XlaKernel
from jax_seqpar.kernels.xla_decode import XlaDecodeKernel

__all__ = ["AttentionKernel", "FlashAttnKernel", "KernelRequest", "PallasConfig", "PallasKernel",
           "XlaDecodeKernel", "XlaKernel", "available_kernels", "get_kernel", "register_kernel"]
