"""jax_seqpar: sequence-parallel exact attention for JAX.

The public names below load on first use (PEP 562), so ``python -m jax_seqpar launch``
and ``import jax_seqpar.runtime.launch`` start without importing JAX; ``import
jax_seqpar`` followed by ``jax_seqpar.attention`` behaves as an eager import would.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: public name -> the module that defines it
_PUBLIC = {
    "attention": "jax_seqpar.api",
    "tree_decode": "jax_seqpar.decode",
    "ring_decode": "jax_seqpar.decode",
    "allgather_decode": "jax_seqpar.decode",
    "reference_attention": "jax_seqpar.reference",
    "MaskSpec": "jax_seqpar.masks",
}
__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    if name not in _PUBLIC:  # a subpackage or module (``jax_seqpar.layouts``), as before
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    importlib.import_module("jax_seqpar.kernels")  # registers the kernel backends
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted({*globals(), *_PUBLIC})
