"""Which instructions a compiled program schedules while each collective is in flight.

Overlapping the transfer of the next block with the computation of the current one is
what makes a ring cheap (Ring Attention §3; BurstEngine §3.1, "fine-grained
communication-computation overlapping").  Whether the compiler kept that overlap can be
read from the *scheduled* HLO (``jax.jit(f).lower(...).compile().as_text()``, marked
``is_scheduled=true``): inside a computation the instructions are printed in execution
order.

``overlap_windows(hlo)`` returns, for every collective, its *window*:

* an asynchronous collective (``collective-permute-start`` ... ``-done``,
  ``all-to-all-start``, or an ``async-start`` wrapping a collective, as GPU backends
  emit): the instructions scheduled strictly between the start and its done;
* a synchronous collective (what the CPU backend emits: it runs the transfer as one
  blocking instruction): the instructions scheduled between the collective and its first
  user in the same computation, i.e. the work an asynchronous version could overlap
  without rescheduling anything.  On CPU this shows the program order the overlap needs;
  that the transfer actually runs concurrently can only be seen on a GPU.

An instruction counts as *kernel compute* when it is, or calls (a fusion, conditional,
while or call, transitively), a ``dot``, ``convolution``, ``custom-call`` or
``exponential``: the matmuls and the softmax of an attention tile, not the copies,
slices and additions around them.

Each window also says whether the collective sends a *gradient*: data that depends,
inside its computation, on kernel compute (an accumulator of dK, dV or dQ), as opposed
to an *activation* (K, V, or Q, dO and the row statistics) that only travels.
BurstEngine §3.1 (Fig. 5) tells the two apart: an activation hop can overlap with the
computation of the block in hand, while a gradient hop must wait for its own tile.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Optional, Tuple

from jax_seqpar.comm import KINDS, _parse, compiled_text

KERNEL_OPS = ("dot", "convolution", "custom-call", "exponential")
_CALLING_OPS = ("fusion", "conditional", "while", "call")
_CALLEES_RE = re.compile(r"\b(?:condition|body|to_apply|calls|true_computation|"
                         r"false_computation)=%?([\w.\-]+)")
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class OverlapWindow:
    computation: str
    collective: str          # instruction name (the start of an async pair)
    kind: str                # collective kind, e.g. "collective-permute"
    is_async: bool
    between: Tuple[Tuple[str, str, bool], ...]  # (name, opcode, is kernel compute)
    gradient: bool           # its operands depend on kernel compute in the computation
    operand_ops: Tuple[str, ...]  # opcodes of its operands (e.g. a forwarded block's
                                  # "collective-permute"; "parameter" for an input)
    line: str                # the collective's HLO line

    @property
    def compute(self) -> Tuple[str, ...]:
        """Names of the compute instructions in the window."""
        return tuple(name for name, _, is_compute in self.between if is_compute)

    @property
    def overlapped(self) -> bool:
        return bool(self.compute)


def _callees(rest: str) -> List[str]:
    out = _CALLEES_RE.findall(rest)
    b = _BRANCHES_RE.search(rest)
    if b:
        out += [c.strip().lstrip("%") for c in b.group(1).split(",") if c.strip()]
    return out


def _compute_computations(comps) -> Dict[str, bool]:
    """computation name -> whether it (transitively) contains kernel compute."""
    memo: Dict[str, bool] = {}

    def has(c: str, seen=()) -> bool:
        if c in memo:
            return memo[c]
        if c in seen or c not in comps:
            return False
        res = False
        for _, _, op, rest, _ in comps[c][1]:
            if op in KERNEL_OPS or (op in _CALLING_OPS and any(
                    has(x, seen + (c,)) for x in _callees(rest))):
                res = True
                break
        memo[c] = res
        return res

    return {c: has(c) for c in comps}


def _collective_kind(op: str, rest: str, comps) -> Optional[str]:
    """The collective kind an instruction starts (sync or async), else None."""
    base = op[:-6] if op.endswith("-start") else op
    if base in KINDS:
        return base
    if op == "async-start":
        for callee in _callees(rest):
            for _, _, inner, _, _ in comps.get(callee, (False, []))[1]:
                if inner in KINDS:
                    return inner
    return None


def _operand_text(rest: str) -> str:
    """The operand list of an instruction (what follows its opcode, up to the attributes)."""
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "(":
            depth += 1
        elif ch == ")":
            if depth == 0:
                return rest[:i]
            depth -= 1
    return rest


def overlap_windows(hlo: str) -> List[OverlapWindow]:
    """Every collective's window of scheduled instructions (see the module doc)."""
    comps = _parse(hlo)
    computes = _compute_computations(comps)
    out: List[OverlapWindow] = []
    wrapped = {c for _, (_, ins) in comps.items() for _, _, op, rest, _ in ins
               if op == "async-start" for c in _callees(rest)}  # counted at their start
    for cname, (_, instrs) in comps.items():
        if cname in wrapped:
            continue

        def is_compute(op, rest):
            return op in KERNEL_OPS or (op in _CALLING_OPS and any(
                computes.get(x, False) for x in _callees(rest)))

        names = {n for n, *_ in instrs}
        opcode = {n: o for n, _, o, _, _ in instrs}
        depends: Dict[str, bool] = {}  # instruction -> depends on kernel compute
        for name, _, op, rest, _ in instrs:  # scheduled order: operands come first
            operands = [o for o in re.findall(r"%([\w.\-]+)", _operand_text(rest))
                        if o in names]
            depends[name] = is_compute(op, rest) or any(depends.get(o, False)
                                                       for o in operands)
        for i, (name, _, op, rest, line) in enumerate(instrs):
            if op.endswith("-done") or op == "async-done":
                continue
            kind = _collective_kind(op, rest, comps)
            if kind is None:
                continue
            is_async = op.endswith("-start")
            use = re.compile(r"%" + re.escape(name) + r"(?![\w.\-])")
            end = len(instrs)
            for j in range(i + 1, len(instrs)):
                j_op, j_rest = instrs[j][2], instrs[j][3]
                if use.search(_operand_text(j_rest)):
                    if not is_async or j_op.endswith("-done") or j_op == "async-done":
                        end = j
                        break
            between = tuple((n, o, is_compute(o, r)) for n, _, o, r, _ in instrs[i + 1:end])
            operands = [o for o in re.findall(r"%([\w.\-]+)", _operand_text(rest))
                        if o in names]
            gradient = any(depends.get(o, False) for o in operands)
            out.append(OverlapWindow(cname, name, kind, is_async, between, gradient,
                                     tuple(opcode[o] for o in operands), line))
    return out


def overlap_report(fn, *args, **kwargs) -> List[OverlapWindow]:
    """Compile ``fn(*args)`` and return ``overlap_windows`` of its scheduled HLO."""
    return overlap_windows(compiled_text(fn, *args, **kwargs))
