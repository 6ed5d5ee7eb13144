"""Collective accounting: bytes each device sends, read from the compiled program.

``collective_bytes(fn, *args)`` lowers and compiles ``fn`` (jitting it if needed), walks
the optimised HLO, and for every collective computes the bytes one device sends, times
the number of times it runs (a collective inside a ``while`` loop counts once per
iteration, using XLA's ``known_trip_count``).  Per-device send volumes, for a group of
``G`` devices and an operand of ``n`` bytes on each device:

=====================  ==========================  =====================================
collective             bytes sent per device       algorithm assumed
=====================  ==========================  =====================================
``collective-permute`` ``n``                       point to point (each device sends once)
``all-gather``         ``(G - 1) * n``             ring (each shard reaches G-1 devices)
``all-reduce``         ``2 (G - 1) / G * n``       ring reduce-scatter + all-gather
``reduce-scatter``     ``(G - 1) / G * n``         ring
``all-to-all``         ``(G - 1) / G * n``         direct
=====================  ==========================  =====================================

These are the textbook volumes (Tree Attention Eq. 10-14 use the same conventions); the
library that runs the collective may move the bytes differently, but never fewer.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Dict, List, Optional, Tuple

import jax
import numpy as np

KINDS = ("collective-permute", "all-gather", "all-reduce", "reduce-scatter", "all-to-all")

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
_ARRAY_RE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z0-9]*)?)\[([0-9,]*)\]")
_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*->.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_CALLS_RE = re.compile(r"\b(condition|body|to_apply|calls|true_computation|false_computation)"
                       r"=%?([\w.\-]+)")
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _shape_bytes(shape: str) -> int:
    total = 0.0
    for dtype, dims in _ARRAY_RE.findall(shape):
        if dtype.startswith("f8") or "e4m3" in dtype or "e5m2" in dtype:
            size = 1
        elif dtype in _DTYPE_BYTES:
            size = _DTYPE_BYTES[dtype]
        else:
            continue  # token[] and friends
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * size
    return int(total)


def _group_size(line: str, num_devices: int) -> int:
    m = re.search(r"replica_groups=\{(\{[^}]*\})", line)
    if m:
        first = m.group(1).strip("{}")
        return len([x for x in first.split(",") if x.strip()]) or num_devices
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)  # iota form [groups, size]<=[...]
    if m:
        return int(m.group(2))
    return num_devices


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    kind: str
    name: str
    computation: str
    operand_bytes: int      # bytes of the operand(s) on one device
    group_size: int
    executions: int         # how many times it runs per call (loop trip counts)
    bytes_sent: float       # per device, per call, all executions included
    #: the device (partition) ids that talk: replica groups, or for a collective-permute
    #: its (source, target) pairs; () when the HLO names none (all devices, one group)
    groups: Tuple[Tuple[int, ...], ...] = ()


@dataclasses.dataclass
class CommReport:
    ops: List[CollectiveOp]
    warnings: List[str]

    def bytes_by_kind(self) -> Dict[str, int]:
        out = {k: 0 for k in KINDS}
        for op in self.ops:
            out[op.kind] += op.bytes_sent
        return {k: int(round(v)) for k, v in out.items() if v}

    def count_by_kind(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for op in self.ops:
            out[op.kind] = out.get(op.kind, 0) + op.executions
        return out

    def bytes_by_axis(self, mesh) -> Dict[object, int]:
        """Bytes per mesh axis: ``{axis name: bytes}`` (a tuple of names for collectives
        whose groups span several axes; ``None`` for groups of one device).

        ``mesh`` is a ``jax.sharding.Mesh`` or a ``{name: size}`` dict in mesh order.
        Device (partition) id ``d`` of the compiled program is the ``d``-th device of the
        mesh in row-major order; an op belongs to the axes along which the devices of its
        groups (or of each source/target pair) differ.
        """
        out: Dict[object, float] = {}
        for op in self.ops:
            key = op_axes(op, mesh)
            out[key] = out.get(key, 0) + op.bytes_sent
        return {k: int(round(v)) for k, v in out.items() if v}

    @property
    def total_bytes(self) -> int:
        return int(round(sum(op.bytes_sent for op in self.ops)))

    def summary(self) -> str:
        parts = [f"{k}: {v:,} B" for k, v in self.bytes_by_kind().items()]
        return ", ".join(parts) if parts else "no collectives"


def _mesh_shape(mesh) -> Dict[str, int]:
    shape = getattr(mesh, "shape", mesh)
    return dict(shape)


def op_axes(op: CollectiveOp, mesh):
    """Mesh axes along which ``op``'s devices differ (see ``CommReport.bytes_by_axis``)."""
    shape = _mesh_shape(mesh)
    names, sizes = tuple(shape), tuple(shape.values())
    n = math.prod(sizes)
    groups = op.groups or (tuple(range(n)),)
    varying = set()
    for g in groups:
        if any(d >= n for d in g):
            raise ValueError(f"{op.name} names device {max(g)}, outside the mesh {shape}")
        coords = [np.unravel_index(d, sizes) for d in g]
        for a in range(len(sizes)):
            if len({c[a] for c in coords}) > 1:
                varying.add(a)
    axes = tuple(names[a] for a in sorted(varying))
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _replica_groups(line: str, num_devices: int) -> Tuple[Tuple[int, ...], ...]:
    """Device groups of a collective, in any of the HLO spellings; () if none is given."""
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
    if m:
        return tuple(tuple(int(x) for x in p.split(","))
                     for p in re.findall(r"\{(\d+,\d+)\}", m.group(1)))
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if m:
        return tuple(tuple(int(x) for x in g.split(",") if x)
                     for g in re.findall(r"\{([\d,]*)\}", m.group(1)))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:  # iota form: [groups, size] <= reshape(iota, dims).transpose(perm)
        dims = [int(x) for x in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(x) for x in m.group(4).split(",")])
        return tuple(tuple(int(x) for x in g)
                     for g in ids.reshape(int(m.group(1)), int(m.group(2))))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:  # mesh form: mesh['a'=2,'b'=4] {'b'}: groups vary along the named axes
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        inside = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(2))]
        outside = [i for i in range(len(names)) if i not in inside]
        ids = np.arange(math.prod(sizes)).reshape(sizes).transpose(outside + inside)
        size = math.prod(sizes[i] for i in inside)
        return tuple(tuple(int(x) for x in g) for g in ids.reshape(-1, size))
    return ()


def _parse(hlo: str):
    """Split HLO text into computations: name -> (is_entry, [(name, shape, op, rest, line)])."""
    comps: Dict[str, Tuple[bool, list]] = {}
    current: Optional[str] = None
    for line in hlo.splitlines():
        if current is None:
            m = _COMP_RE.match(line)
            if m:
                current = m.group(2)
                comps[current] = (bool(m.group(1)), [])
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR_RE.match(line)
        if m:
            comps[current][1].append((m.group(1), m.group(2), m.group(3), m.group(4), line))
    return comps


def analyze_hlo(hlo: str, num_devices: int) -> CommReport:
    """Collective send volumes per device from optimised HLO text (see module doc)."""
    comps = _parse(hlo)
    entry = [n for n, (is_entry, _) in comps.items() if is_entry]
    if len(entry) != 1:
        raise ValueError("could not find the ENTRY computation in the HLO text")
    mult: Dict[str, int] = {entry[0]: 1}
    warnings: List[str] = []
    order = [entry[0]]
    # Breadth-first over the call graph, multiplying by loop trip counts.
    i = 0
    while i < len(order):
        cname = order[i]
        i += 1
        for _, _, op, rest, line in comps.get(cname, (False, []))[1]:
            callees = [(kind, callee) for kind, callee in _CALLS_RE.findall(rest)]
            b = _BRANCHES_RE.search(rest)
            if b:
                callees += [("branch", c.strip().lstrip("%")) for c in b.group(1).split(",") if c.strip()]
            for kind, callee in callees:
                factor = 1
                if op == "while" and kind in ("body", "condition"):
                    t = _TRIP_RE.search(line)
                    if t:
                        factor = int(t.group(1)) + (1 if kind == "condition" else 0)
                    else:
                        warnings.append(f"while loop in {cname} has no known trip count; "
                                        f"its collectives are counted once")
                m = mult[cname] * factor
                if callee not in mult:
                    mult[callee] = m
                    order.append(callee)
                else:
                    mult[callee] += m
    ops: List[CollectiveOp] = []
    for cname, (_, instrs) in comps.items():
        if cname not in mult:
            continue
        shapes = {name: shape for name, shape, _, _, _ in instrs}
        # Parameters are named in the computation header; operands that are parameters
        # appear as instructions too ("parameter(0)"), so ``shapes`` covers them.
        for name, shape, op, rest, line in instrs:
            base = op[:-6] if op.endswith("-start") else op
            if base not in KINDS or op.endswith("-done"):
                continue
            operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
            n = sum(_shape_bytes(shapes.get(o, "")) for o in operands)
            if n == 0:  # operand shapes printed inline
                n = _shape_bytes(rest.split(")")[0])
            groups = _replica_groups(line, num_devices)
            G = (len(groups[0]) if groups and base != "collective-permute"
                 else _group_size(line, num_devices))
            per_exec = {
                "collective-permute": n,
                "all-gather": (G - 1) * n,
                "all-reduce": 2 * (G - 1) / G * n,
                "reduce-scatter": (G - 1) / G * n,
                "all-to-all": (G - 1) / G * n,
            }[base]
            ex = mult[cname]
            ops.append(CollectiveOp(base, name, cname, n, G, ex, per_exec * ex, groups))
    return CommReport(ops=ops, warnings=sorted(set(warnings)))


def compiled_text(fn, *args, **kwargs) -> str:
    """Optimised HLO text of ``fn(*args, **kwargs)`` (``fn`` is jitted if it is not already),
    or of ``fn`` itself when it is already compiled (``jax.jit(f).lower(...).compile()``:
    run that executable too, since calling the jitted ``f`` afterwards compiles again)."""
    if isinstance(fn, jax.stages.Compiled):
        if args or kwargs:
            raise TypeError("a compiled executable is read as it is: pass no arguments")
        return fn.as_text()
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return jitted.lower(*args, **kwargs).compile().as_text()


def collective_bytes(fn, *args, num_devices: Optional[int] = None, **kwargs) -> CommReport:
    """Compile ``fn`` on ``args`` (or read the executable ``fn``: ``compiled_text``) and
    report the bytes each device sends per collective kind."""
    text = compiled_text(fn, *args, **kwargs)
    if num_devices is None:
        m = re.search(r"num_partitions=(\d+)", text)
        num_devices = int(m.group(1)) if m else jax.device_count()
    return analyze_hlo(text, num_devices)
