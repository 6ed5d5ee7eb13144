"""One call's local kernels, one per tile kind (``base.TILE_KINDS``).

A strategy makes tiles of three kinds (``base.py``): dense tiles (no mask), aligned
tiles (the diagonal of a ring: same consecutive positions on both sides) and general
tiles (positions decide).  Backends differ in what they serve: cuDNN reads no positions,
so it takes dense and aligned tiles only, while the Pallas and xla kernels take all
three.  ``TileKernels`` resolves, once per call, the backend of each kind, and routes
every tile to its backend: ``kernel="auto"`` gives each kind the fastest backend that
accepts it (``base.AUTO_ORDER``), a backend name forces that backend on every tile and
raises, when a tile of a kind it refuses comes up, an error naming the kind and the
backend's reason.

With ``"auto"``, a tile kind that ``base.AUTO_ORDER_SHORT_ROWS`` orders by row count gets
a second backend for tiles of at most that many query rows and keys, and each tile is
routed by its own length (``route_length``: its longer side, or the keys a query may see
under a window if fewer; known when it is traced), the same in its forward and backward.

``TileKernels`` itself follows the kernel contract (``fwd``/``bwd`` with an extra
``tile=`` keyword), so a strategy calls it as it would call one backend.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple, Union

from jax_seqpar.kernels.base import (TILE_ALIGNED, TILE_DENSE, TILE_GENERAL, TILE_KINDS,
                                     AttentionKernel, KernelRequest, get_kernel,
                                     short_rows_limit)
from jax_seqpar.masks import MaskSpec

_NO_MASK = MaskSpec()


def route_length(mask: MaskSpec, rows: int, keys: int) -> int:
    """The length of a ``rows x keys`` tile that ``base.AUTO_ORDER_SHORT_ROWS`` compares
    with its limits: the longer side, or, under a window bounded on both sides, the keys
    one query may see (``left + right + 1``) where fewer.  A window of 2k keys over rows
    of 16k costs a kernel per row what rows of 2k do: at D 128 ``pallas_mgpu`` was
    1.07-1.09x cuDNN there, as on short rows (RESULTS.md, "Short rows at D 128")."""
    n = max(rows, keys)
    left, right = mask.left_limit, mask.right_limit
    if left is not None and right is not None:
        n = min(n, max(left + right + 1, 1))
    return n


def _request_for(request: KernelRequest, tile: str) -> KernelRequest:
    mask = _NO_MASK if tile == TILE_DENSE else request.mask
    return dataclasses.replace(request, tile=tile, mask=mask)


@dataclasses.dataclass(frozen=True, eq=False)
class TileKernels:
    """The backend of each tile kind for one call (hashable by ``spec`` and ``request``).

    ``spec`` is a backend name (``"auto"``, ``"cudnn"``, ...) or a kernel object; an
    object serves every tile kind (it is not asked), as before tile kinds existed.
    ``request`` describes the call (its ``tile`` field is ignored).
    """

    spec: Union[str, AttentionKernel]
    request: KernelRequest

    def __post_init__(self):
        chosen: Dict[str, AttentionKernel] = {}
        refused: Dict[str, str] = {}
        for tile in TILE_KINDS:
            if not isinstance(self.spec, str):
                chosen[tile] = self.spec
                continue
            try:
                chosen[tile] = get_kernel(self.spec, _request_for(self.request, tile))
            except NotImplementedError as e:
                refused[tile] = str(e)
        if not chosen:  # nothing at all: say why for the simplest kind
            raise NotImplementedError(refused[TILE_DENSE])
        short: Dict[str, Tuple[int, AttentionKernel]] = {}
        for tile in chosen:
            limit = (short_rows_limit(self.request.platform, tile, self.request.head_dim)
                     if self.spec == "auto" else None)
            if limit is None:
                continue
            kern = get_kernel("auto", dataclasses.replace(
                _request_for(self.request, tile), rows=limit))
            if getattr(kern, "name", None) != getattr(chosen[tile], "name", None):
                short[tile] = (limit, kern)
        object.__setattr__(self, "_chosen", chosen)
        object.__setattr__(self, "_refused", refused)
        object.__setattr__(self, "_short", short)

    # -- identity (static argument of jit / custom_vjp) ---------------------------------
    def _key(self):
        return (self.spec, self.request)

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return isinstance(other, TileKernels) and self._key() == other._key()

    # -- what was chosen ----------------------------------------------------------------
    def kernel_for(self, tile: str) -> AttentionKernel:
        """The backend of ``tile``, or ``NotImplementedError`` naming the kind and why."""
        if tile not in TILE_KINDS:
            raise ValueError(f"tile={tile!r} must be one of {TILE_KINDS}")
        if tile in self._chosen:
            return self._chosen[tile]
        raise NotImplementedError(
            f"kernel={self.spec!r} cannot serve a {tile!r} tile, which this call needs "
            f"({_WHY[tile]}): {self._refused[tile]}. Use kernel='auto' to give each tile "
            f"kind the fastest backend that serves it")

    @property
    def choices(self) -> Dict[str, Optional[str]]:
        """``{tile kind: backend name or None (refused)}``."""
        return {t: (getattr(self._chosen[t], "name", type(self._chosen[t]).__name__)
                    if t in self._chosen else None) for t in TILE_KINDS}

    @property
    def short_rows(self) -> Dict[str, Tuple[int, str]]:
        """``{tile kind: (rows, backend name)}``: the kinds whose tiles of at most
        ``rows`` query rows and keys go to another backend (``base.AUTO_ORDER_SHORT_ROWS``)."""
        return {t: (limit, getattr(k, "name", type(k).__name__))
                for t, (limit, k) in self._short.items()}

    @property
    def name(self) -> str:
        names = {n for n in self.choices.values() if n is not None}
        short = ", ".join(f"{t}<={limit}={n}" for t, (limit, n) in self.short_rows.items())
        if len(names) == 1 and not short:
            return names.pop()
        return ", ".join([f"{t}={n}" for t, n in self.choices.items() if n is not None]
                         + ([short] if short else []))

    @property
    def kernels(self) -> Tuple[AttentionKernel, ...]:
        seen = []
        for k in (*self._chosen.values(), *(k for _, k in self._short.values())):
            if all(k is not s for s in seen):
                seen.append(k)
        return tuple(seen)

    @property
    def supports_check_vma(self) -> bool:
        return all(bool(getattr(k, "supports_check_vma", True)) for k in self.kernels)

    @property
    def needs_o(self) -> bool:
        """Whether some chosen backend's backward needs the forward output ``o``."""
        return any(bool(getattr(k, "needs_o", False)) for k in self.kernels)

    @property
    def skips_masked_blocks(self) -> bool:
        """Whether the backend of aligned tiles skips a causal tile's masked key blocks
        inside the kernel (``base.py``); False when aligned tiles are refused."""
        kerns = [self._chosen.get(TILE_ALIGNED)]
        if TILE_ALIGNED in self._short:
            kerns.append(self._short[TILE_ALIGNED][1])
        return all(bool(getattr(k, "skips_masked_blocks", False)) for k in kerns)

    def kernel_at(self, tile: str, length: Optional[int]) -> AttentionKernel:
        """The backend of a ``tile`` of ``length`` (``route_length``; None: unknown, the
        kind's backend for any length), or ``NotImplementedError`` as ``kernel_for``."""
        kern = self.kernel_for(tile)
        short = self._short.get(tile)
        if short is not None and length is not None and length <= short[0]:
            kern = short[1]
        return kern

    def skips_masked_blocks_for(self, rows: int, mask: MaskSpec = _NO_MASK) -> bool:
        """``skips_masked_blocks`` of the backend that serves an aligned tile of ``rows``
        query rows and keys under ``mask`` (the one ``auto`` routes it to)."""
        if TILE_ALIGNED not in self._chosen:
            return False
        kern = self.kernel_at(TILE_ALIGNED, route_length(mask, rows, rows))
        return bool(getattr(kern, "skips_masked_blocks", False))

    def check(self, request: KernelRequest) -> None:
        self.kernel_at(request.tile, request.rows).check(request)

    # -- the contract, routed by tile kind ----------------------------------------------
    def _route(self, mask: MaskSpec, tile: str, rows: int):
        if mask.is_dense:
            tile = TILE_DENSE
        kern = self.kernel_at(tile, rows)
        extra = {"tile": tile} if getattr(kern, "tile_aware", False) else {}
        return kern, extra

    def fwd(self, q, k, v, q_pos, kv_pos, mask: MaskSpec, scale: float, q_seg=None,
            kv_seg=None, *, tile: str = TILE_GENERAL, need_lse: bool = True):
        """``(o, lse)``.  ``need_lse=False`` (the caller discards lse) lets a backend with
        ``skips_lse`` run a cheaper forward; lse may then be None."""
        kern, extra = self._route(mask, tile, route_length(mask, q.shape[1], k.shape[1]))
        if not need_lse and getattr(kern, "skips_lse", False):
            extra["with_lse"] = False
        return kern.fwd(q, k, v, q_pos, kv_pos, mask, scale, q_seg, kv_seg, **extra)

    def bwd(self, q, k, v, o, lse, do, q_pos, kv_pos, mask: MaskSpec, scale: float,
            q_seg=None, kv_seg=None, delta=None, *, tile: str = TILE_GENERAL):
        kern, extra = self._route(mask, tile, route_length(mask, q.shape[1], k.shape[1]))
        return kern.bwd(q, k, v, o, lse, do, q_pos, kv_pos, mask, scale, q_seg, kv_seg,
                        delta=delta, **extra)


_WHY = {
    TILE_DENSE: "a tile with no mask",
    TILE_ALIGNED: "a diagonal tile: queries and keys at the same consecutive positions",
    TILE_GENERAL: "a tile whose mask depends on the traced global positions, e.g. under a "
                  "window, a block mask, the striped layout, or tree attention",
}


def tile_kernels(kernel, request: KernelRequest) -> TileKernels:
    """``kernel`` (a name, a kernel object or a ``TileKernels``) for ``request``."""
    if isinstance(kernel, TileKernels):
        return kernel
    return TileKernels(kernel, dataclasses.replace(request, tile=TILE_GENERAL))


__all__ = ["TILE_ALIGNED", "TILE_DENSE", "TILE_GENERAL", "TileKernels", "route_length",
           "tile_kernels"]
