"""Local attention tile kernels behind one contract (see ``base.py``)."""

from jax_seqpar.kernels import (cudnn, flash_attn, pallas_decode, pallas_gpu,  # noqa: F401
                                pallas_mgpu, tokamax, xla, xla_decode)  # (importing registers the backends)
from jax_seqpar.kernels.base import (AttentionKernel, KernelRequest, available_kernels,
                                     get_kernel, register_kernel)
from jax_seqpar.kernels.cudnn import CudnnKernel
from jax_seqpar.kernels.flash_attn import FlashAttnKernel
from jax_seqpar.kernels.pallas_decode import DecodeConfig, PallasDecodeKernel
from jax_seqpar.kernels.pallas_gpu import PallasConfig, PallasKernel
from jax_seqpar.kernels.pallas_mgpu import MgpuConfig, PallasMgpuKernel
from jax_seqpar.kernels.xla import XlaKernel
from jax_seqpar.kernels.tiles import TileKernels
from jax_seqpar.kernels.tokamax import TokamaxKernel
from jax_seqpar.kernels.xla_decode import XlaDecodeKernel

__all__ = ["AttentionKernel", "CudnnKernel", "DecodeConfig", "FlashAttnKernel", "KernelRequest", "MgpuConfig", "PallasConfig",
           "PallasDecodeKernel", "PallasKernel", "PallasMgpuKernel", "TileKernels", "TokamaxKernel", "XlaDecodeKernel", "XlaKernel",
           "available_kernels", "get_kernel", "register_kernel"]
