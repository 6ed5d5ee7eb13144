"""Which mesh axes play which role, and the logical axis rules that follow from it.

``Parallelism(data=None, fsdp=None, sequence=None, tensor=None)``: each role is a mesh
axis name, a tuple of names, or None.  What each role splits:

=========  ==========================================  =================================
role       activations                                 parameters, optimizer state
=========  ==========================================  =================================
data       the batch                                   replicated (``zero3_data=True``:
                                                       split too, ZeRO-3 over the mesh)
fsdp       the batch                                   split (ZeRO-3 / FSDP)
sequence   the tokens (ring / tree / Ulysses in        split, as the fsdp axes (MaxText's
           attention; each device its own rows)        context axis does the same)
tensor     heads, the MLP's hidden units, the          split by output (q, k, v, gate,
           vocabulary (Megatron-LM); the residual      up, embedding, head) or by input
           stream stays whole on it (below)            (o, down): Shoeybi et al. 2019 §3
=========  ==========================================  =================================

One reduction per block side, an all-reduce over the tensor axis after the row-parallel
o and down projections (Megatron-LM, Shoeybi et al. 2019 Fig. 3), not Megatron's
sequence-parallel reduce-scatter onto the rows with an all-gather before the next side
(Korthikanti et al. 2022 §4.2.2).  Both move the same bytes, 2 (T-1)/T of the block's
activation; the reduce-scatter form would save memory and norm work on 1/T of the rows,
but XLA's partitioner (JAX 0.11, measured on CPU) lowered the reshard onto sequence x
tensor rows as an all-reduce, a slice and later an all-gather: 3 (T-1)/T, 1.5x the bytes,
so the residual stream (logical ``residual``) is split over the sequence axes only.

The model never builds a ``PartitionSpec``: its layers name the dimensions of every
parameter and activation with the logical names below, and ``rules()`` maps them onto
the mesh, the convention of Flax's ``nn.with_logical_partitioning`` /
``logical_to_mesh_axes`` (MaxText and EasyDeL use the same).  As in Flax, the rules are
tried in order and a mesh axis already used by one dimension of an array is skipped for
the others, so one rule set serves parameters and activations: ``embed`` is split over
the fsdp axes in a weight, and stays whole in an activation whose batch already took
them.  ``spec()`` adds one thing Flax leaves to the user: a dimension that the chosen
axes do not divide keeps the largest leading group of them that does (a 9-head
projection on a tensor axis of 2 stays whole there, still split by fsdp on ``embed``).

Logical names:

- ``batch``, ``length`` (attention's rows), ``residual`` (the residual stream's rows:
  over the sequence axes, see above), ``heads``, ``kv_heads``, ``head_dim``,
  ``embed``, ``mlp``, ``vocab``; ``layers`` (the stacked blocks' leading axis of a
  scanned model: never split); ``None`` for a dimension that is never split.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Sequence, Tuple

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_seqpar.sharding.specs import AxisRole, axis_tuple, check_roles, normalize_role

ROLES = ("data", "fsdp", "sequence", "tensor")
LOGICAL_NAMES = ("batch", "length", "residual", "heads", "kv_heads", "head_dim", "embed",
                 "mlp", "vocab", "layers")


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """The role of each mesh axis (see the module docstring).  Hashable.

    ``sequence`` is required by the models (a mesh axis of size 1 is fine: no sequence
    parallelism); the other roles default to None (not used).  ``zero3_data=True``
    splits the parameters and the optimizer state over the data axes too (ZeRO-3 across
    the whole mesh: less memory, one more gather per layer over those axes).
    """

    data: AxisRole = None
    fsdp: AxisRole = None
    sequence: AxisRole = None
    tensor: AxisRole = None
    zero3_data: bool = False

    def __post_init__(self):
        for role in ROLES:
            object.__setattr__(self, role, normalize_role(getattr(self, role)))
        if not isinstance(self.zero3_data, bool):
            raise TypeError(f"zero3_data={self.zero3_data!r} must be a bool")
        seen: Dict[str, str] = {}
        for role in ROLES:
            for name in axis_tuple(getattr(self, role)):
                if name in seen:
                    raise ValueError(f"mesh axis {name!r} plays two roles ({seen[name]} and "
                                     f"{role}); give each axis one role")
                seen[name] = role

    @classmethod
    def one_axis(cls, axis_name: AxisRole) -> "Parallelism":
        """Today's one-axis layout: the sequence (and the parameters) over ``axis_name``."""
        return cls(sequence=axis_name)

    # ------------------------------------------------------------------ roles -> axes
    @property
    def batch_axes(self) -> Tuple[str, ...]:
        """Mesh axes that split the batch: data, then fsdp."""
        return axis_tuple(self.data) + axis_tuple(self.fsdp)

    @property
    def param_axes(self) -> Tuple[str, ...]:
        """Mesh axes that split the parameters' ``embed`` dimension (FSDP): fsdp and
        sequence, and data when ``zero3_data``."""
        data = axis_tuple(self.data) if self.zero3_data else ()
        return data + axis_tuple(self.fsdp) + axis_tuple(self.sequence)

    @property
    def sequence_axes(self) -> Tuple[str, ...]:
        return axis_tuple(self.sequence)

    @property
    def tensor_axes(self) -> Tuple[str, ...]:
        return axis_tuple(self.tensor)

    def tensor_as_sequence(self) -> "Parallelism":
        """The same mesh with the tensor axes joined to the sequence axes (sequence
        major): what attention uses when its heads do not divide by the tensor axis
        (``models.Llama``): the tensor devices then split the attention's rows instead of
        its heads, so no device repeats another's work."""
        seq = self.sequence_axes + self.tensor_axes
        return dataclasses.replace(self, sequence=seq, tensor=None)

    def check(self, mesh: Mesh) -> None:
        """Every role names axes of ``mesh``; the models need a sequence role."""
        check_roles(mesh, **{role: getattr(self, role) for role in ROLES})
        if self.sequence is None:
            raise ValueError("Parallelism(sequence=None): the models shard the sequence over "
                             "a mesh axis; name one (an axis of size 1 is fine)")

    def sizes(self, mesh: Mesh) -> Dict[str, int]:
        """Devices per role: ``{"data": 2, "fsdp": 1, "sequence": 4, "tensor": 1}``."""
        return {role: math.prod(mesh.shape[a] for a in axis_tuple(getattr(self, role)))
                for role in ROLES}

    # ------------------------------------------------------------------ rules
    def rules(self) -> Tuple[Tuple[str, Tuple[str, ...]], ...]:
        """Logical axis rules, in Flax's form: ``((logical name, mesh axes), ...)``."""
        tensor = self.tensor_axes
        return (
            ("batch", self.batch_axes),
            ("length", self.sequence_axes),
             ("residual", self.sequence_axes),
            ("heads", tensor),
            ("kv_heads", tensor),
            ("mlp", tensor),
            ("vocab", tensor),
            ("embed", self.param_axes),
            ("head_dim", ()),
            # The stacked blocks' leading axis (LlamaConfig.scan_layers) is never split:
            # split, each step of the layer loop would gather its whole layer from the
            # devices holding it, instead of each device gathering its share of a layer.
            ("layers", ()),
        )

    def spec(self, names: Sequence[Optional[str]], shape: Optional[Sequence[int]] = None,
             mesh: Optional[Mesh] = None) -> P:
        """The ``PartitionSpec`` of an array whose dimensions are ``names``.

        With ``shape`` and ``mesh``, a dimension keeps only the largest leading group of
        its mesh axes whose size divides it (see the module docstring).
        """
        unknown = [n for n in names if n is not None and n not in LOGICAL_NAMES]
        if unknown:
            raise ValueError(f"unknown logical axis names {unknown}; known: {LOGICAL_NAMES}")
        if shape is not None and len(shape) != len(names):
            raise ValueError(f"logical names {tuple(names)} do not match the shape "
                             f"{tuple(shape)}")
        used: set = set()
        dims = [None] * len(names)
        for name, axes in self.rules():
            if name not in names:
                continue
            i = list(names).index(name)
            axes = tuple(a for a in axes if a not in used)  # Flax: skip used axes
            if mesh is not None:  # axes of one device split nothing: leave them out
                axes = tuple(a for a in axes if mesh.shape[a] > 1)
            if shape is not None and mesh is not None:
                axes = _dividing_prefix(axes, shape[i], mesh)
            if axes:
                dims[i] = axes[0] if len(axes) == 1 else axes
                used.update(axes)
        return P(*dims)

    def sharding(self, mesh: Mesh, names: Sequence[Optional[str]],
                 shape: Optional[Sequence[int]] = None) -> NamedSharding:
        return NamedSharding(mesh, self.spec(names, shape, mesh))

    def constrain(self, x, names: Sequence[Optional[str]], mesh: Optional[Mesh]):
        """``with_sharding_constraint`` of ``x`` to its logical names (no-op without a
        mesh)."""
        if mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, self.sharding(mesh, names, x.shape))


def _dividing_prefix(axes: Tuple[str, ...], size: int, mesh: Mesh) -> Tuple[str, ...]:
    """The longest leading run of ``axes`` whose device count divides ``size``."""
    n = len(axes)
    while n and size % math.prod(mesh.shape[a] for a in axes[:n]):
        n -= 1
    return axes[:n]


def parse_mesh_arg(text: str) -> Dict[str, int]:
    """``"data=2,fsdp=1,sequence=4,tensor=1"`` -> ``{"data": 2, ..., "tensor": 1}``
    (roles left out are 1).  ``ValueError`` naming the bad part otherwise."""
    sizes = {role: 1 for role in ROLES}
    for part in filter(None, (p.strip() for p in text.split(","))):
        role, sep, value = part.partition("=")
        role = role.strip()
        if not sep or role not in ROLES:
            raise ValueError(f"--mesh {text!r}: {part!r} must be role=size with a role in "
                             f"{ROLES}")
        try:
            n = int(value)
        except ValueError:
            raise ValueError(f"--mesh {text!r}: the size in {part!r} must be an int") from None
        if n < 1:
            raise ValueError(f"--mesh {text!r}: the size in {part!r} must be >= 1")
        sizes[role] = n
    return sizes


def make_mesh(sizes: Dict[str, int], devices=None, *, axis_types=None
              ) -> Tuple[Mesh, Parallelism]:
    """A mesh with one axis per role (``data``, ``fsdp``, ``sequence``, ``tensor``, in
    that order: the tensor axis innermost, on the fastest links) and its
    ``Parallelism``.  ``sizes`` must multiply to the number of ``devices`` (default: all).
    ``axis_types`` defaults to ``AxisType.Auto`` for every axis (what the Flax models
    need)."""
    devices = jax.devices() if devices is None else list(devices)
    shape = tuple(int(sizes.get(role, 1)) for role in ROLES)
    if math.prod(shape) != len(devices):
        raise ValueError(f"mesh sizes {dict(zip(ROLES, shape))} multiply to "
                         f"{math.prod(shape)}, but there are {len(devices)} devices")
    if axis_types is None:
        axis_types = (jax.sharding.AxisType.Auto,) * len(ROLES)
    mesh = jax.make_mesh(shape, ROLES, devices=devices, axis_types=axis_types)
    return mesh, Parallelism(data="data", fsdp="fsdp", sequence="sequence", tensor="tensor")


__all__ = ["LOGICAL_NAMES", "Parallelism", "ROLES", "make_mesh", "parse_mesh_arg"]
