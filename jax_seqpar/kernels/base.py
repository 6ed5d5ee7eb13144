"""The local-kernel contract and the backend registry.

Every backend computes attention of a query tile against a key/value tile whose rows
carry *global* token positions (see DESIGN.md, "The local-kernel contract")::

    fwd(q, k, v, q_pos, kv_pos, mask, scale, q_seg=None, kv_seg=None) -> (o, lse)
    bwd(q, k, v, o, lse, do, q_pos, kv_pos, mask, scale,
        q_seg=None, kv_seg=None, delta=None) -> (dq, dk, dv)

Shapes: q ``[B, Tq, Hq, D]``, k/v ``[B, Tk, Hkv, D]`` with ``Hq % Hkv == 0``; positions
int32 ``[Tq]`` / ``[Tk]`` (the xla backend also takes per-row query positions ``[B, Tq]``,
which decoding with ragged lengths needs); segment ids int32 ``[B, Tq]`` / ``[B, Tk]``; lse float32
``[B, Hq, Tq]`` (natural log).  ``o`` and the gradients are returned in float32; the
caller casts.  In ``bwd``, ``o`` and ``lse`` may be the *global* output and lse of a
larger attention of which this tile is a part (that is how ring attention uses it), and
``delta = rowsum(do * o)`` ``[B, Hq, Tq]`` may be passed precomputed (BurstAttention
Alg. 2, line 2) so that it is not recomputed at every ring step.

A backend that cannot honour a request raises ``NotImplementedError`` saying why;
``kernel="auto"`` picks the highest-priority registered backend that accepts it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Protocol, Tuple

import jax

from jax_seqpar.masks import MaskSpec

#: Backends that later work will add; asking for them explains rather than "unknown".
PLANNED_KERNELS: Dict[str, str] = {
}


@dataclasses.dataclass(frozen=True)
class KernelRequest:
    """What a caller needs from a local kernel; backends accept or refuse it."""

    platform: str
    dtype: str
    head_dim: int
    mask: MaskSpec
    has_segments: bool = False


class AttentionKernel(Protocol):
    name: str

    def check(self, request: KernelRequest) -> None:
        """Raise ``NotImplementedError`` (with the reason) if ``request`` is unsupported."""

    def fwd(self, q, k, v, q_pos, kv_pos, mask: MaskSpec, scale: float,
            q_seg=None, kv_seg=None) -> Tuple[jax.Array, jax.Array]:
        ...

    def bwd(self, q, k, v, o, lse, do, q_pos, kv_pos, mask: MaskSpec, scale: float,
            q_seg=None, kv_seg=None, delta=None) -> Tuple[jax.Array, jax.Array, jax.Array]:
        ...


@dataclasses.dataclass(frozen=True)
class _Entry:
    factory: Callable[[], AttentionKernel]
    priority: int
    platforms: Tuple[str, ...]


_REGISTRY: Dict[str, _Entry] = {}


def register_kernel(name: str, factory: Callable[[], AttentionKernel], *, priority: int,
                    platforms: Tuple[str, ...] = ("cpu", "gpu", "tpu")) -> None:
    """Register a backend.  Higher ``priority`` wins under ``kernel="auto"`` on ``platforms``."""
    _REGISTRY[name] = _Entry(factory, priority, tuple(platforms))


def available_kernels() -> Tuple[str, ...]:
    """Names of the registered backends, best first."""
    return tuple(sorted(_REGISTRY, key=lambda n: -_REGISTRY[n].priority))


def get_kernel(name: str, request: KernelRequest) -> AttentionKernel:
    """Resolve ``name`` (or ``"auto"``) to a backend that accepts ``request``."""
    if not isinstance(name, str):
        raise TypeError(f"kernel={name!r} must be a string")
    if name == "auto":
        reasons = []
        for cand in available_kernels():
            entry = _REGISTRY[cand]
            if request.platform not in entry.platforms:
                continue
            kern = entry.factory()
            try:
                kern.check(request)
            except NotImplementedError as e:
                reasons.append(f"{cand}: {e}")
                continue
            return kern
        raise NotImplementedError(
            f"kernel='auto' found no backend for {request}: " + "; ".join(reasons))
    if name in _REGISTRY:
        kern = _REGISTRY[name].factory()
        kern.check(request)
        return kern
    if name in PLANNED_KERNELS:
        raise NotImplementedError(f"kernel={name!r}: {PLANNED_KERNELS[name]}; "
                                  f"use one of {('auto',) + available_kernels()}")
    raise ValueError(f"unknown kernel={name!r}; choose one of {('auto',) + available_kernels()}")


def default_platform() -> str:
    return jax.default_backend()
