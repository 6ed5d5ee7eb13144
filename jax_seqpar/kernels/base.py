"""The local-kernel contract and the backend registry.

Every backend computes attention of a query tile against a key/value tile whose rows
carry *global* token positions (docs/ARCHITECTURE.md, "The local-kernel contract")::

    fwd(q, k, v, q_pos, kv_pos, mask, scale, q_seg=None, kv_seg=None) -> (o, lse)
    bwd(q, k, v, o, lse, do, q_pos, kv_pos, mask, scale,
        q_seg=None, kv_seg=None, delta=None) -> (dq, dk, dv)

Shapes: q ``[B, Tq, Hq, D]``, k/v ``[B, Tk, Hkv, D]`` with ``Hq % Hkv == 0``; positions
int32 ``[Tq]`` / ``[Tk]`` (the xla backend also takes per-row query positions ``[B, Tq]``,
which decoding with ragged lengths needs); segment ids int32 ``[B, Tq]`` / ``[B, Tk]``; lse float32
``[B, Hq, Tq]`` (natural log).  ``o`` is returned in float32 or in the input dtype
(cuDNN), the gradients in float32; the caller casts.  In ``bwd``, ``o`` and ``lse`` may be the *global* output and lse of a
larger attention of which this tile is a part (that is how ring attention uses it), and
``delta = rowsum(do * o)`` ``[B, Hq, Tq]`` may be passed precomputed (BurstAttention
Alg. 2, line 2) so that it is not recomputed at every ring step.

**Tile kinds.**  The caller states what it knows *statically* about a tile, since under
``jit`` the positions are traced and a backend that cannot read them (cuDNN,
flash-attn-jax) could otherwise serve nothing but unmasked tiles:

* ``TILE_DENSE``: no mask on this tile (the caller passes ``MaskSpec()``); positions do
  not matter.  Segment ids, if any, still apply.
* ``TILE_ALIGNED``: query and key rows carry the *same consecutive* positions,
  ``q_pos == kv_pos == p0 + arange(T)``.  A causal or sliding-window mask is then the
  same function of the local indices ``(i, j)`` as of the positions, so a backend may
  apply it by index and ignore the traced positions.  (The diagonal tiles of a ring.)
* ``TILE_GENERAL``: the positions decide; only backends that read them serve it.

``KernelRequest.tile`` carries the kind; a backend that reads the kind from its calls
sets ``tile_aware = True`` and receives ``tile=`` in ``fwd``/``bwd``.  A backend whose
backward needs ``o`` (it cannot take ``delta`` alone) sets ``needs_o = True``;
``KernelRequest.bwd_has_o`` says whether the caller will pass ``o``.  A backend that
skips the masked key blocks of a causal tile inside the kernel at no cost per block (no
``lax.cond`` waiting for a predicate) sets ``skips_masked_blocks = True``: a strategy
then hands it a device's whole causal block as one aligned tile rather than as the
block's causal halves (``parallel/pairs.py``).

A backend that cannot honour a request raises ``NotImplementedError`` saying why;
``kernel="auto"`` picks, per tile kind (and head dim where one measured differently), the
first backend of ``AUTO_ORDER`` (measured speeds) that accepts it, then the other
registered backends by priority; ``AUTO_ORDER_SHORT_ROWS`` overrides that order for
tiles of few rows and keys where those measured differently, and ``AUTO_ORDER_GPU`` for
one kind of GPU where that GPU measured differently (``KernelRequest.gpu``).
``TileKernels`` resolves one call's backend for each tile kind.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Dict, Optional, Protocol, Tuple

import jax

from jax_seqpar.masks import MaskSpec

#: Backends that later work will add; asking for them explains rather than "unknown".
PLANNED_KERNELS: Dict[str, str] = {
}

TILE_DENSE = "dense"
TILE_ALIGNED = "aligned"
TILE_GENERAL = "general"
TILE_KINDS = (TILE_DENSE, TILE_ALIGNED, TILE_GENERAL)

#: ``kernel="auto"``: backends to try first, fastest first, per (platform, tile kind), and
#: per (platform, tile kind, head dim) where a head dim measured differently; backends not
#: listed follow by priority.  Forward + backward through ``jax_seqpar.attention`` on one
#: device, bf16, as a ratio to cuDNN, one H100, JAX 0.11.2, 2026-11-27
#: (``benchmarks/auto_order.py``, RESULTS.md "Which backend auto tries first"):
#:
#: * D 128 (Llama-3-8B's 32 / 8 heads): ``pallas_mgpu`` 1.11x with a causal mask on rows
#:   of 4k, 0.99x at 16k and 0.97x at 32k, 0.92-0.99x without a mask; so cuDNN first
#:   on dense and aligned tiles, except short ones (``AUTO_ORDER_SHORT_ROWS`` below).
#:   (``kernels.py pair``, three runs the same day, one row of 16 heads: 0.95-1.00x.)
#: * D 64 (SmolLM2's 9 / 3 heads, 64k tokens a call): ``pallas_mgpu`` 1.02-1.03x with a
#:   causal mask on rows of 4k-64k (device clock 1.01-1.07x; ``pair``, one row of 16
#:   heads: 1.02-1.07x in three runs on the H100, medians of three runs on an H200
#:   1.04-1.05x, 2026-11-25), so it comes first on aligned tiles at D 64;
#:   0.96-0.97x without a mask, so dense tiles keep cuDNN.
#: * tokamax 0.0.17 (the optional ``tokamax`` backend: dense and aligned tiles) trails
#:   ``pallas_mgpu`` in all 12 cells of that run (0.82-1.02x cuDNN), so it comes after it.
#: * General tiles (positions decide): cuDNN cannot read positions, so the Hopper kernel
#:   ``pallas_mgpu`` (it refuses other GPUs and float32), then the Triton ``pallas``
#:   (cuDNN's 0.6-0.7x on an H200, 2026-11-23), then xla (10-15x slower than Triton).
AUTO_ORDER: Dict[tuple, Tuple[str, ...]] = {
    ("gpu", TILE_DENSE): ("cudnn", "pallas_mgpu", "tokamax", "pallas", "xla"),
    ("gpu", TILE_ALIGNED): ("cudnn", "pallas_mgpu", "tokamax", "pallas", "xla"),
    ("gpu", TILE_ALIGNED, 64): ("pallas_mgpu", "cudnn", "tokamax", "pallas", "xla"),
    ("gpu", TILE_GENERAL): ("pallas_mgpu", "pallas", "xla"),
}

#: ``kernel="auto"`` on short rows: per (platform, tile kind, head dim), ``(rows, order)``:
#: a tile whose query rows and keys are both at most ``rows`` tries ``order`` first, a
#: longer one ``AUTO_ORDER``'s.  Forward + backward through ``jax_seqpar.attention`` on
#: one device, bf16, 16k tokens a call (as many keys as rows), as a ratio to cuDNN (wall
#: clock; device clock alike), one H100, JAX 0.11.2, 2026-11-27 (``benchmarks/
#: auto_order.py``, RESULTS.md "Short rows at D 128"):
#:
#: * causal, three runs: Llama-3-8B's 32 / 8 heads at rows of 1k 1.31-1.33x, 2k
#:   1.19-1.20x, 4k 1.09-1.10x, 8k 1.03-1.05x, 16k 0.98x; Llama-2-7B's 32 / 32 heads at 2k
#:   1.11-1.12x, 4k 1.05-1.07x, 8k 1.01-1.02x, 16k 0.97-0.98x;
#: * no mask, three runs: 32 / 8 heads at 1k 1.20-1.22x, 2k 1.08-1.10x, 4k 0.99-1.00x;
#:   32 / 32 at 2k 1.03-1.06x, 4k 0.99x; 16k 0.96x.
#:
#: * causal with a sliding window of 2048 keys, two runs: 32 / 8 heads at rows of 4k
#:   1.13-1.15x, 8k 1.10-1.11x, 16k 1.07-1.09x; 32 / 32 at 8k 1.06-1.07x.  A window makes
#:   every row short: ``tiles.route_length`` counts the keys a query may see.
#:
#: So ``pallas_mgpu`` comes first at D 128 on aligned tiles of up to 8k rows or 8k keys
#: of window (a batch of short sequences, a ring's diagonal tile of 8k tokens a device or
#: fewer, a sliding window) and on dense ones of up to 2k.  One H200 run the same day
#: agreed (32 / 8 heads; causal 1k 1.13x, 2k 1.14x, 4k 1.08x, 8k 1.00x, 16k 0.96x; no
#: mask 1k 1.11x, 2k 1.02x, 4k 0.98x).
AUTO_ORDER_SHORT_ROWS: Dict[tuple, Tuple[int, Tuple[str, ...]]] = {
    ("gpu", TILE_ALIGNED, 128): (8192, ("pallas_mgpu", "cudnn", "tokamax", "pallas", "xla")),
    ("gpu", TILE_DENSE, 128): (2048, ("pallas_mgpu", "cudnn", "tokamax", "pallas", "xla")),
}


#: ``kernel="auto"`` on one kind of GPU: per (GPU key (``gpu_key``), tile kind, head dim),
#: the order to try, ahead of ``AUTO_ORDER_SHORT_ROWS`` and ``AUTO_ORDER``.  The Hopper
#: kernel's block sizes and backward are tuned per GPU (``mgpu_tuning``), so its speed
#: against cuDNN is a property of the GPU.
#:
#: * H200, aligned tiles at D 128: with the table's fused backward (2026-12-02)
#:   ``pallas_mgpu`` is level with or ahead of cuDNN on rows of every length.  Forward +
#:   backward through ``jax_seqpar.attention`` on one device, bf16, causal, ratio to cuDNN,
#:   wall clock (device clock), one H200, JAX 0.11.2, 2026-12-03 (``benchmarks/
#:   auto_order.py``, RESULTS.md "auto on the H200"): Llama-3-8B's 32 / 8 heads at rows
#:   of 8k 1.067x (1.062x), 16k 1.015x (1.028x), 32k 1.003x (1.018x); Llama-2-7B's 32 / 32
#:   at 8k 1.054x (1.038x), 16k 1.004x (0.998x); the forward alone 0.97-1.10x.  A second
#:   run after the change (``auto`` = ``pallas_mgpu``): 16k 1.030x (1.025x) and 1.011x
#:   (1.008x), 32k 0.993x (1.013x).  One row of 16 heads (``kernels.py pair``, three
#:   runs, 2026-12-02): 1.068x (1.028x) at 16k, 1.041x (1.013x) at 64k.  Dense tiles
#:   keep cuDNN (0.95-1.00x).  The H100's table still runs the two-kernel backward
#:   there, so its order stays ``AUTO_ORDER``'s.
AUTO_ORDER_GPU: Dict[tuple, Tuple[str, ...]] = {
    ("nvidia_h200", TILE_ALIGNED, 128): ("pallas_mgpu", "cudnn", "tokamax", "pallas", "xla"),
}


def gpu_key(device_kind: str) -> str:
    """A device kind as a table key: ``"NVIDIA H200"`` -> ``"nvidia_h200"``."""
    key = re.sub(r"[^a-z0-9]+", "_", str(device_kind).lower()).strip("_")
    if not key:
        raise ValueError(f"device_kind={device_kind!r} gives an empty key")
    return key


@dataclasses.dataclass(frozen=True)
class KernelRequest:
    """What a caller needs from a local kernel; backends accept or refuse it."""

    platform: str
    dtype: str
    head_dim: int
    mask: MaskSpec
    has_segments: bool = False
    tile: str = TILE_GENERAL
    bwd_has_o: bool = True  # the backward will be given the forward output ``o``
    rows: Optional[int] = None  # the tile's longer side where known (``AUTO_ORDER_SHORT_ROWS``)
    gpu: Optional[str] = None  # the GPU's kind as ``gpu_key`` gives it (``AUTO_ORDER_GPU``)

    def __post_init__(self):
        if self.tile not in TILE_KINDS:
            raise ValueError(f"tile={self.tile!r} must be one of {TILE_KINDS}")
        if self.gpu is not None and (not isinstance(self.gpu, str) or not self.gpu
                                     or self.gpu != gpu_key(self.gpu)):
            raise ValueError(f"gpu={self.gpu!r} must be None or a key as gpu_key() gives "
                             f"it (e.g. 'nvidia_h200')")
        if self.rows is not None and (isinstance(self.rows, bool)
                                      or not isinstance(self.rows, int) or self.rows < 1):
            raise ValueError(f"rows={self.rows!r} must be a positive int or None")


def index_masked_tile(name: str, mask: MaskSpec, tile: str, why: str,
                      alternatives: str) -> bool:
    """The rule shared by backends that apply masks by local index and read no positions
    (cuDNN, tokamax): whether this tile carries a mask they must apply by index (False:
    no mask at all).  Refuses, with ``NotImplementedError``: block masks, a mask on a
    dense tile, and any mask on a general tile (``why`` says why the backend cannot,
    ``alternatives`` which backends can)."""
    if mask.block_mask is not None:
        raise NotImplementedError(f"kernel={name!r} has no block-sparse masks")
    if mask.is_dense:
        return False
    if tile == TILE_DENSE:
        raise NotImplementedError(f"kernel={name!r}: a dense tile was given a mask")
    if tile != TILE_ALIGNED:
        raise NotImplementedError(
            f"kernel={name!r} {why}, so it serves only dense tiles and aligned (diagonal) "
            f"tiles; a general tile needs {alternatives}")
    return True


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


def short_rows_limit(platform: str, tile: str, head_dim: Optional[int]) -> Optional[int]:
    """The row count up to which ``AUTO_ORDER_SHORT_ROWS`` orders this platform, tile kind
    and head dim, or None where it has no entry."""
    entry = AUTO_ORDER_SHORT_ROWS.get((platform, tile, head_dim))
    return None if entry is None else entry[0]


def auto_candidates(platform: str, tile: str, head_dim: Optional[int] = None,
                    rows: Optional[int] = None, gpu: Optional[str] = None) -> Tuple[str, ...]:
    """The order in which ``kernel="auto"`` tries backends for this platform, tile kind,
    head dim, (where known) the tile's ``rows``, the longer of its query and key sides,
    and GPU kind: ``AUTO_ORDER_GPU``'s entry on a GPU it names, else
    ``AUTO_ORDER_SHORT_ROWS``'s entry when the rows are at most its limit, else
    ``AUTO_ORDER``'s entry for the head dim if it has one, else the tile kind's; then
    every other registered backend by priority."""
    short = AUTO_ORDER_SHORT_ROWS.get((platform, tile, head_dim))
    on_gpu = AUTO_ORDER_GPU.get((gpu, tile, head_dim)) if platform == "gpu" else None
    if on_gpu is not None:
        order = on_gpu
    elif short is not None and rows is not None and rows <= short[0]:
        order = short[1]
    else:
        order = AUTO_ORDER.get((platform, tile, head_dim), AUTO_ORDER.get((platform, tile), ()))
    first = tuple(n for n in order if n in _REGISTRY)
    return first + tuple(n for n in available_kernels() if n not in first)


def get_kernel(name: str, request: KernelRequest) -> AttentionKernel:
    """Resolve ``name`` (or ``"auto"``) to a backend that accepts ``request``."""
    if not isinstance(name, str):
        raise TypeError(f"kernel={name!r} must be a string")
    if name == "auto":
        reasons = []
        for cand in auto_candidates(request.platform, request.tile, request.head_dim,
                                    request.rows, request.gpu):
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


def default_gpu() -> Optional[str]:
    """The first GPU's kind as a key (``gpu_key``), or None without a GPU."""
    if jax.default_backend() != "gpu":
        return None
    return gpu_key(jax.devices()[0].device_kind)
