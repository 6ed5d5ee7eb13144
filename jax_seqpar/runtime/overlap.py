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
to an *activation* (K, V, or Q, dO and the row statistics) that only travels.  An
element of a ``while`` loop's result counts as depending on compute only when the loop
carries compute into that element (``_loop_carry_depends``): the block that a rolled
chain forwards comes out of its loop an activation.
BurstEngine §3.1 (Fig. 5) tells the two apart: an activation hop can overlap with the
computation of the block in hand, while a gradient hop must wait for its own tile.

Two further views do not stop at the first user, which for a ring is often the hop that
forwards the block just received (another collective), not a kernel:

* ``until_needed``: the instructions scheduled between the collective and the first
  kernel compute that depends on its data (through copies, slices and forwarding hops);
  for data no kernel reads (a gradient accumulator, only added and sent on), its first
  user.  A double ring's inter-node hop (``parallel/double_ring.py``) is first forwarded
  over the intra-node ring of the next round, and read by a tile only then; the tiles
  scheduled before that are what the inter-node transfer can hide behind.
* ``independent``: the kernel compute of the computation that neither feeds the
  collective nor depends on it, whatever the schedule: what the dataflow lets run while
  it is in flight; ``feeds``: the kernel compute that depends on it (none for a gradient
  accumulator: its hop never makes a tile wait, BurstEngine Fig. 5's delayed gradients).

What CPU can and cannot show.  The CPU backend runs every collective synchronously and
its scheduler does not aim at overlap (it interleaves the tiles of different hops as
their data allows), so on CPU these windows show the *structure* -- which transfers are
issued before which tiles, which tiles do not wait for a transfer -- and whether this
particular schedule happens to put a tile inside; not that the bytes move while a tile
computes.  That needs asynchronous collectives and a latency-hiding scheduler, i.e. a
GPU (``benchmarks/overlap_check.py`` there prints the ``-start``/``-done`` windows), and,
for the time actually hidden, a profile.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Optional, Set, Tuple

from jax_seqpar.runtime.comm import (KINDS, CollectiveOp, _parse, _replica_groups, compiled_text,
                             op_axes)

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
    #: (name, opcode, is kernel compute) scheduled before a kernel needs its data
    until_needed: Tuple[Tuple[str, str, bool], ...] = ()
    #: kernel compute that neither feeds it nor depends on it (any schedule)
    independent: Tuple[str, ...] = ()
    #: kernel compute that depends on its data (none: no tile ever waits for it)
    feeds: Tuple[str, ...] = ()

    @property
    def compute_until_needed(self) -> Tuple[str, ...]:
        """Names of the compute instructions scheduled before a kernel needs the data."""
        return tuple(name for name, _, is_compute in self.until_needed if is_compute)

    def axes(self, mesh):
        """The mesh axes the collective's devices differ along (``comm.op_axes``):
        e.g. ``"node"`` for a double ring's inter-node hop.  ``mesh``: a ``Mesh`` or a
        ``{name: size}`` dict."""
        shape = dict(getattr(mesh, "shape", mesh))
        n = 1
        for size in shape.values():
            n *= size
        op = CollectiveOp(self.kind, self.collective, self.computation, 0, 0, 1, 0.0,
                          _replica_groups(self.line, n))
        return op_axes(op, mesh)

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


def _operands(rest: str, names) -> List[str]:
    return [o for o in re.findall(r"%([\w.\-]+)", _operand_text(rest)) if o in names]


def _loop_carry_depends(comps, computes, body: str, init: Tuple[bool, ...],
                        memo) -> Tuple[bool, ...]:
    """Which elements of a ``while`` loop's result depend on kernel compute: a fixpoint
    over the carried tuple, from the elements of its initial value that do (``init``),
    where an element read from the body's parameter depends when that element does.  A
    block that a loop only forwards (a rolled ring's activation) does not; an
    accumulator that a tile adds to does."""
    key = (body, init)
    if key in memo:
        return memo[key]
    instrs = comps.get(body, (False, []))[1]
    names = {n for n, *_ in instrs}
    root = next((i for i in instrs if i[4].lstrip().startswith("ROOT")), None)
    params = {n for n, _, op, _, _ in instrs if op == "parameter"}
    carried: Set[int] = {i for i, d in enumerate(init) if d}
    elems: Tuple[bool, ...] = ()
    for _ in range(len(instrs) + 1):  # each pass adds an element or stops
        dep: Dict[str, bool] = {}
        for name, _, op, rest, _ in instrs:
            ops = _operands(rest, names)
            if op == "get-tuple-element" and ops and ops[0] in params:
                m = re.search(r"index=(\d+)", rest)
                dep[name] = m is not None and int(m.group(1)) in carried
            else:
                dep[name] = (op in KERNEL_OPS or (op in _CALLING_OPS and any(
                    computes.get(x, False) for x in _callees(rest)))
                    or any(dep.get(o, False) for o in ops))
        if root is None:
            break
        outs = _operands(root[3], names) if root[2] == "tuple" else [root[0]]
        elems = tuple(dep.get(o, False) or i in carried for i, o in enumerate(outs))
        new = {i for i, d in enumerate(elems) if d}
        if new <= carried:
            break
        carried |= new
    memo[key] = elems
    return elems


def overlap_windows(hlo: str) -> List[OverlapWindow]:
    """Every collective's window of scheduled instructions (see the module doc)."""
    comps = _parse(hlo)
    computes = _compute_computations(comps)
    loops: Dict[str, Tuple[bool, ...]] = {}
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
        ancestors: Dict[str, Set[str]] = {}  # instruction -> what it depends on
        compute_at = [is_compute(op, rest) for _, _, op, rest, _ in instrs]
        rest_of = {n: r for n, _, _, r, _ in instrs}
        for name, _, op, rest, _ in instrs:  # scheduled order: operands come first
            operands = _operands(rest, names)
            src = operands[0] if operands else None
            if op == "get-tuple-element" and src is not None and opcode[src] == "while":
                # an element of a loop's result: the loop's own compute counts only if
                # that element carries it (a forwarded block does not)
                m = re.search(r"index=(\d+)", rest)
                i = int(m.group(1)) if m else -1
                body = re.search(r"\bbody=%?([\w.\-]+)", rest_of[src])
                init = _operands(rest_of[src], names)
                if body and init and opcode[init[0]] == "tuple":
                    init_deps = tuple(depends.get(o, False)
                                      for o in _operands(rest_of[init[0]], names))
                    elems = _loop_carry_depends(comps, computes, body.group(1), init_deps,
                                                loops)
                else:  # an initial value that is not a literal tuple: all or nothing
                    elems = ()
                depends[name] = (elems[i] if 0 <= i < len(elems) else
                                 depends.get(src, True))
            else:
                depends[name] = is_compute(op, rest) or any(depends.get(o, False)
                                                           for o in operands)
            ancestors[name] = set(operands).union(*(ancestors.get(o, ()) for o in operands))
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
            between = tuple((n, o, compute_at[k])
                            for k, (n, _, o, _, _) in enumerate(instrs[i + 1:end], i + 1))
            operands = [o for o in re.findall(r"%([\w.\-]+)", _operand_text(rest))
                        if o in names]
            gradient = any(depends.get(o, False) for o in operands)
            later = [j for j in range(i + 1, len(instrs)) if name in ancestors[instrs[j][0]]]
            needed = next((j for j in later if compute_at[j]), end)
            until = tuple((n, o, compute_at[k])
                          for k, (n, _, o, _, _) in enumerate(instrs[i + 1:needed], i + 1))
            dependent = {instrs[j][0] for j in later}
            independent = tuple(n for k, (n, *_) in enumerate(instrs) if compute_at[k]
                                and n not in dependent and n not in ancestors[name])
            feeds = tuple(instrs[j][0] for j in later if compute_at[j])
            out.append(OverlapWindow(cname, name, kind, is_async, between, gradient,
                                     tuple(opcode[o] for o in operands), line, until,
                                     independent, feeds))
    return out


def overlap_report(fn, *args, **kwargs) -> List[OverlapWindow]:
    """Compile ``fn(*args)`` and return ``overlap_windows`` of its scheduled HLO."""
    return overlap_windows(compiled_text(fn, *args, **kwargs))
