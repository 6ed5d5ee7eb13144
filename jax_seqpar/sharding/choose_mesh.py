"""Which mesh to train on: data, fsdp, sequence and tensor sizes, chosen by a model.

``choose_mesh`` tries every split of the ``N = devices_per_node * nodes`` devices over
the four roles of ``parallelism.ROLES``, models each split's memory and step time, and
returns the fastest that fits, with a reason and every candidate's numbers (as
``parallel.choose.choose_strategy`` does for one attention call).  A model, not a
measurement (``benchmarks/RESULTS.md``, "N-D meshes measured", sets it against one).
Notation: sizes D, F, C, T (data, fsdp, sequence, tensor); L layers of width d, MLP width
f, vocabulary V, Hq / Hkv heads of Dh; global batch B of S tokens; b = B / (D F) rows and
s = S / C tokens per device; e, p the activation and parameter itemsizes.

* Remat: ``remat`` is one of the model's ``REMAT_MODES`` (``layers.remat``); ``RERUN``
  says what each reruns in the backward -- a fraction of each block's matmuls, of its
  attention, and of its two tensor all-reduces -- and ``saved_per_layer`` what each keeps
  (below).  "full" reruns the whole forward (1, 1, 1); "attention" keeps the attention's
  output and lse, so the attention is not rerun, but the q, k, v, o, gate and up
  projections are; "attention_mlp" keeps gate and up too; "seq_selective" keeps half of
  the attention's output, so half the attention is rerun.
* Candidates: every (D, F, C, T) multiplying to N with T dividing ``devices_per_node``
  (tensor stays on NVLink), Hq divisible by T (kv heads repeated as
  ``specs.kv_head_repeats`` says), B divisible by D F, S divisible by 2 C (zigzag) or C.
* Links: ``make_mesh`` orders the axes data, fsdp, sequence, tensor (tensor innermost);
  an axis whose size times the sizes inside it exceeds ``devices_per_node`` crosses
  nodes and runs at ``inter_link`` for all its bytes (a ring goes at its slowest hop).
* Bytes one device sends per step (forward + backward, all layers), under four keys:
  - tensor: one all-reduce after each block side (Megatron-LM, Shoeybi et al. 2019 Fig.
    3: the library keeps the residual whole on the tensor axis, ``parallelism``), each
    2 (T-1)/T of the block's activation, as many in the backward, and the rerun ones:
    ``L (8 + 4 R_t) (T-1)/T * b s d e`` (the same bytes as Korthikanti et al. 2022's
    gathers and reduce-scatters);
  - sequence: the ring (``costs.bytes_per_axis("ring", ...)``, backward "kv" or "q",
    whichever sends less) on b rows, Hq/T and Hkv'/T heads (Hkv' after repetition):
    ``L ((1 + R_a) forward + backward)``;
  - params: parameters split over fsdp x sequence (MaxText's context axis does the
    same), K = F C devices: gathered forward and backward, float32 gradients
    reduce-scattered: ``(K-1)/K * (2 p + 4) * P / T`` over the group's link (inter if
    fsdp or sequence crosses nodes);
  - data: the gradient all-reduce: ``2 (D-1)/D * 4 P / (F C T)``.
  P counts V d (embedding) + V d (head, unless tied) + d (final norm) + L (d (Hq + 2 Hkv)
  Dh + Hq Dh d + 3 d f + 2 d).  The embedding's and head's tensor collectives (4 per
  step) and the norms' all-reduces are left out.
* Memory per device: parameters (p), float32 gradients and AdamW moments split over
  F C T: ``P (p + 12) / (F C T)``; with K > 1 one layer gathered (weights and float32
  gradient); a scanned model (``config.scan_layers``) also holds the blocks' stacked
  float32 gradient until the update, ``4 L P_layer / (F C T)`` (measured: +22.3 GB at 7B
  on one H200, RESULTS "Scanned layers").  Activations, with the residual
  ``a = b s d e`` whole on the tensor axis: one layer's working set ``(5 + 12/T) a``
  (Korthikanti et al. Table 2 without sequence parallelism, ``s b h (10 + 24/t)`` bytes
  at 2-byte activations, flash attention dropping the ``5 a s^2 b / h`` term: the
  norms, the residual adds and the attention's and MLP's inputs stay whole, the rest is
  split over T); with no remat every layer keeps it (``L (5 + 12/T) a``), else each
  layer keeps ``saved_per_layer`` (the block input ``a``, plus the attention's output
  and float32 lse ``b s Hq (Dh e + 4) / T`` and the MLP's gate and up ``2 b s f e / T``
  as the mode says) and one layer's working set is live in the backward; the ring's
  in-flight K, V block and float32 dK, dV; the float32 logits and their gradient
  ``2 b s V/T * 4`` unless the loss is fused (``config.fused_loss``).  Candidates above
  ``device_memory`` are skipped.
* Time: matmuls ``6 P B S + 2 R_m L P_mm B S`` FLOPs (``P_mm``: a block's matmul
  parameters), attention ``4 B S^2 Hq Dh L`` (x 0.5 causal) per forward, 2.5x that
  backward (flash attention, as ``choose_strategy``) and ``R_a`` x that rerun, all over
  ``N * device_flops``.  Each key's collectives take ``bytes / bandwidth + latency`` per
  collective (``comm_time.axis_time``); only the ring overlaps (with attention):
  ``step = matmul + max(attention, ring) + tensor + params + data``.  Not modeled: data
  and fsdp collectives hidden behind the backward, a double ring when the sequence axis
  crosses nodes (``choose_strategy`` picks that within the axis), the imbalance of a
  contiguous layout, XLA's temporaries beyond these.  The fastest wins; ties: fewer
  inter-node bytes, smaller T, fewer bytes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Tuple

import jax.numpy as jnp

from jax_seqpar.layouts import check_divisible, check_layout
from jax_seqpar.parallel.comm_time import Link, axis_time
from jax_seqpar.parallel.costs import AttnShape, bytes_per_axis
from jax_seqpar.sharding.parallelism import ROLES
from jax_seqpar.sharding.specs import kv_head_repeats

KEYS = ("tensor", "sequence", "params", "data")
#: Per remat mode (``layers.remat.REMAT_MODES``; a test keeps the two lists equal): the
#: fraction of each block's matmul parameters, of its attention and of its two tensor
#: all-reduces that the backward reruns (module docstring).
RERUN = {"none": ("", 0.0, 0.0), "full": ("qkv o gate_up down", 1.0, 1.0),
         "attention": ("qkv o gate_up", 0.0, 0.5),
         "seq_selective": ("qkv o gate_up", 0.5, 0.5),
         "attention_mlp": ("qkv o", 0.0, 0.5)}
REMATS = tuple(RERUN)
WORKING_WHOLE, WORKING_SPLIT = 5, 12  # one layer's activations: (5 + 12 / T) residuals
_CONFIG_FIELDS = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "ffn_dim", "tie_embeddings", "dtype", "param_dtype")


@dataclasses.dataclass(frozen=True)
class MeshCandidate:
    """One split of the devices: ``sizes`` per role; ``skipped`` says why it cannot be
    used (None: usable).  Splits that break a divisibility rule carry no numbers."""

    sizes: Dict[str, int]
    skipped: Optional[str] = None
    bytes: Optional[Dict[str, int]] = None    # per device and step, per KEYS entry
    links: Optional[Dict[str, str]] = None    # "intra", "inter", or "none" (size 1)
    seconds: Optional[Dict[str, float]] = None  # matmul, attention and per KEYS entry
    memory: Optional[float] = None            # bytes per device
    step_seconds: Optional[float] = None
    state_memory: Optional[float] = None      # of ``memory``: weights, grads, AdamW

    @property
    def label(self) -> str:
        """``"data=2,fsdp=1,sequence=4,tensor=1"`` (what ``parse_mesh_arg`` reads)."""
        return ",".join(f"{r}={self.sizes[r]}" for r in ROLES)

    @property
    def inter_bytes(self) -> int:
        return sum(n for k, n in self.bytes.items() if self.links[k] == "inter")


@dataclasses.dataclass(frozen=True)
class MeshChoice:
    sizes: Dict[str, int]
    reason: str
    candidates: Tuple[MeshCandidate, ...]

    @property
    def pick(self) -> MeshCandidate:
        return next(c for c in self.candidates if c.sizes == self.sizes)


def param_count(config) -> Tuple[int, int]:
    """``(total, per layer)`` parameters of a Llama-style ``config`` (formula above)."""
    d, ffn, dh = config.d_model, config.ffn_dim, config.head_dim
    hq, hkv = config.num_heads, config.num_kv_heads
    layer = d * (hq + 2 * hkv) * dh + hq * dh * d + 3 * d * ffn + 2 * d
    embed = config.vocab_size * d * (1 if config.tie_embeddings else 2)
    return embed + d + config.num_layers * layer, layer


def _positive(**values) -> None:
    """``ValueError`` naming the first argument that is not a positive int (a positive
    number for ``device_memory`` and ``device_flops``)."""
    for name, val in values.items():
        kinds = (int, float) if name in ("device_memory", "device_flops") else (int,)
        if isinstance(val, bool) or not isinstance(val, kinds) or not val > 0:
            what = "number" if float in kinds else "int"
            raise ValueError(f"{name}={val!r} must be a positive {what}")


def _divisors(n: int):
    return [k for k in range(1, n + 1) if n % k == 0]


def factorizations(n: int):
    """Every ``{role: size}`` over ``ROLES`` whose sizes multiply to ``n``."""
    out = []
    for D in _divisors(n):
        for F in _divisors(n // D):
            for C in _divisors(n // (D * F)):
                out.append(dict(zip(ROLES, (D, F, C, n // (D * F * C)))))
    return out


def _why_invalid(sizes, config, seq_len, global_batch, devices_per_node, layout):
    """The divisibility rules ``sizes`` breaks, joined; None when it breaks none."""
    T, why = sizes["tensor"], []
    if devices_per_node % T:
        why.append(f"tensor={T} does not divide devices_per_node={devices_per_node}")
    if config.num_heads % T:
        why.append(f"num_heads={config.num_heads} not divisible by tensor={T}")
    if global_batch % (sizes["data"] * sizes["fsdp"]):
        why.append(f"global_batch={global_batch} not divisible by data x fsdp = "
                   f"{sizes['data'] * sizes['fsdp']}")
    try:
        check_divisible(layout, seq_len, sizes["sequence"])
    except ValueError as err:
        why.append(str(err))
    return "; ".join(why) or None


def _link_names(sizes, devices_per_node) -> Dict[str, str]:
    """Per KEYS entry: "inter" when the axis (or, for params, fsdp or sequence) crosses
    nodes, "intra" when not, "none" for a group of one device."""
    def crosses(role):
        return math.prod(sizes[r] for r in ROLES[ROLES.index(role):]) > devices_per_node

    def name(roles):
        roles = [r for r in roles if sizes[r] > 1]
        return "none" if not roles else "inter" if any(map(crosses, roles)) else "intra"
    return {"tensor": name(["tensor"]), "sequence": name(["sequence"]),
            "params": name(["fsdp", "sequence"]), "data": name(["data"])}


def _block_matmuls(config) -> Dict[str, int]:
    """A block's matmul parameters by group: ``qkv``, ``o``, ``gate_up``, ``down``."""
    d, f, dh = config.d_model, config.ffn_dim, config.head_dim
    return {"qkv": d * (config.num_heads + 2 * config.num_kv_heads) * dh,
            "o": config.num_heads * dh * d, "gate_up": 2 * d * f, "down": d * f}


def saved_per_layer(config, remat: str, rows: int, tokens: int,
                    tensor: int = 1) -> Dict[str, int]:
    """Bytes one layer keeps for the backward on one device under ``remat`` (not "none"),
    by what is kept: its input, and as the mode says the attention's output and float32
    lse and the MLP's gate and up (``layers.remat``'s names; module docstring); ``rows``
    x ``tokens`` per device, heads and MLP units split by ``tensor``."""
    if remat not in REMATS or remat == "none":
        raise ValueError(f"remat={remat!r}: one of {REMATS[1:]} keeps a per-layer set")
    e = jnp.dtype(config.dtype).itemsize
    n = rows * tokens
    attn = n * config.num_heads * (config.head_dim * e + 4) // tensor
    kept = {"block input": n * config.d_model * e}
    if remat in ("attention", "attention_mlp"):
        kept["attention out + lse"] = attn
    if remat == "seq_selective":
        kept["attention out + lse (later half)"] = attn // 2
    if remat == "attention_mlp":
        kept["mlp gate + up"] = 2 * n * config.ffn_dim * e // tensor
    return kept


def _model(sizes, config, *, seq_len, global_batch, devices_per_node, links,
           device_flops, remat, causal) -> MeshCandidate:
    """Bytes, memory and time of one valid split (the module docstring's formulas)."""
    D, F, C, T = (sizes[r] for r in ROLES)
    L, d, V, dh = config.num_layers, config.d_model, config.vocab_size, config.head_dim
    hq, hkv = config.num_heads, config.num_kv_heads
    e, p = jnp.dtype(config.dtype).itemsize, jnp.dtype(config.param_dtype).itemsize
    groups, R_a, R_t = RERUN[remat]
    mm = _block_matmuls(config)
    rerun_mm = sum(mm[g] for g in groups.split())
    K, N = F * C, D * F * C * T
    P, P_layer = param_count(config)
    b, s = global_batch // (D * F), seq_len // C
    act = b * s * d * e
    shape = AttnShape(b, seq_len, hq // T, hkv * kv_head_repeats(hq, hkv, T) // T, dh, e)

    def ring(backward):
        r = bytes_per_axis("ring", shape, {"sequence": C}, backward=backward)
        return L * ((1 + R_a) * r["forward"]["sequence"] + r["backward"]["sequence"])

    nbytes = {"tensor": int(L * (8 + 4 * R_t) * ((T - 1) * act // T)),
              "sequence": int(min(ring("kv"), ring("q"))),
              "params": (K - 1) * (2 * p + 4) * P // (K * T),
              "data": 2 * (D - 1) * 4 * P // (D * K * T)}
    count = {"tensor": L * (8 + 4 * R_t) * (T > 1),           # collectives: one latency each
             "sequence": L * ((C - 1) * (1 + R_a) + C) * (C > 1),  # ring hops (+ home hop)
             "params": 3 * (L + 1) * (K > 1), "data": (L + 1) * (D > 1)}
    names = _link_names(sizes, devices_per_node)
    link_of = {k: links["inter" if v == "inter" else "intra"] for k, v in names.items()}
    secs = {k: axis_time({k: nbytes[k]}, {k: count[k]}, link_of) for k in KEYS}
    rate = N * device_flops
    secs["matmul"] = (6 * P + 2 * L * rerun_mm) * global_batch * seq_len / rate
    secs["attention"] = (4 * global_batch * seq_len ** 2 * hq * dh * L
                         * (0.5 if causal else 1.0) * (3.5 + R_a) / rate)
    step = (secs["matmul"] + max(secs["attention"], secs["sequence"]) + secs["tensor"]
            + secs["params"] + secs["data"])
    working = (WORKING_WHOLE + WORKING_SPLIT / T) * act
    acts = (L * working if remat == "none"
            else L * sum(saved_per_layer(config, remat, b, s, T).values()) + working)
    acts += (C > 1) * b * s * shape.kv_heads * dh * (2 * 2 * e + 2 * 4)
    if not getattr(config, "fused_loss", False):
        acts += 2 * b * s * (V / T) * 4
    state = P * (p + 12) / (K * T)
    stacked = 4 * L * P_layer / (K * T) if getattr(config, "scan_layers", False) else 0
    memory = state + (K > 1) * P_layer * (p + 4) / T + stacked + acts
    return MeshCandidate(dict(sizes), None, nbytes, names, secs, memory, step, state)


def _gb(x: float) -> str:
    return f"{x / 1e12:.3g} TB" if x >= 1e12 else f"{x / 1e9:.3g} GB"


def _reason(best: MeshCandidate, ranked, too_big, device_memory, links) -> str:
    """Why ``best``: its time, the runner-up, memory, and what each used axis carries."""
    z, where = best.sizes, {"intra": "within the node", "inter": "across nodes"}
    bw = {k: f"{links[k].bandwidth / 1e9:.3g} GB/s" for k in links}
    parts = [f"{best.label}: modeled {best.step_seconds:.3g} s per step (matmuls "
             f"{best.seconds['matmul']:.3g} s, attention {best.seconds['attention']:.3g} s)"]
    if len(ranked) > 1:
        nxt = ranked[1]
        tie = "" if nxt.step_seconds > best.step_seconds else (
            f", a tie broken by bytes: it sends {_gb(nxt.inter_bytes)} across nodes and "
            f"{_gb(sum(nxt.bytes.values()))} in all, the pick {_gb(best.inter_bytes)} and "
            f"{_gb(sum(best.bytes.values()))}")
        parts.append(f"next best {nxt.label} {nxt.step_seconds:.3g} s{tie}")
    faster = [c for c in too_big if c.step_seconds < best.step_seconds]
    if faster:
        f = min(faster, key=lambda c: c.step_seconds)
        parts.append(f"{len(faster)} faster split(s) do not fit, e.g. {f.label} "
                     f"({f.step_seconds:.3g} s) needs {_gb(f.memory)} > device_memory "
                     f"{_gb(device_memory)}")
    parts.append(f"{_gb(best.memory)} per device of {_gb(device_memory)} (weights, "
                 f"gradients and AdamW state {_gb(best.state_memory)})")
    n, lk = best.bytes, best.links
    if z["tensor"] > 1:
        parts.append(f"tensor={z['tensor']} splits the weights and optimizer state and "
                     f"moves {_gb(n['tensor'])} of all-reduces per step at "
                     f"{bw['intra']}")
    if z["sequence"] > 1:
        hidden = best.seconds["sequence"] <= best.seconds["attention"]
        parts.append(f"sequence={z['sequence']} {where[lk['sequence']]}: the ring's "
                     f"{_gb(n['sequence'])} per step ride {bw[lk['sequence']]}, "
                     f"{'hidden behind' if hidden else 'longer than'} the attention")
    if n["params"]:
        parts.append(f"parameters over fsdp x sequence = {z['fsdp'] * z['sequence']} "
                     f"{where[lk['params']]}: {_gb(n['params'])} of gathers and gradient "
                     f"reduce-scatters at {bw[lk['params']]}")
    if z["data"] > 1:
        parts.append(f"data={z['data']} {where[lk['data']]} carries only the "
                     f"{_gb(n['data'])} gradient all-reduce at {bw[lk['data']]}")
    return "; ".join(parts)


def choose_mesh(config, *, seq_len: int, global_batch: int, devices_per_node: int,
                nodes: int = 1, intra_link: Link, inter_link: Optional[Link] = None,
                device_memory: float, device_flops: float, remat: str = "full",
                layout: str = "zigzag", causal: bool = True) -> MeshChoice:
    """The modeled fastest ``{role: size}`` mesh for training ``config`` (module docstring).

    ``config``: any object with ``LlamaConfig``'s size and dtype fields.  ``intra_link``
    / ``inter_link``: ``comm_time.Link`` (bytes/s per device, latency) inside a node and
    between nodes (``inter_link`` required when ``nodes > 1``).  ``device_memory`` in
    bytes, ``device_flops`` in FLOP/s per device; ``remat`` one of ``REMATS`` (the
    model's ``REMAT_MODES``); ``layout``
    sets the sequence's divisibility; ``causal`` halves the attention FLOPs.  Returns
    the pick's sizes, the reason, and every candidate (``MeshCandidate``) in
    ``factorizations`` order.
    """
    _positive(seq_len=seq_len, global_batch=global_batch, devices_per_node=devices_per_node,
              nodes=nodes, device_memory=device_memory, device_flops=device_flops)
    missing = [f for f in _CONFIG_FIELDS if not hasattr(config, f)]
    if missing:
        raise ValueError(f"config={type(config).__name__} lacks fields {missing} "
                         f"(LlamaConfig's are needed)")
    if not isinstance(intra_link, Link):
        raise ValueError(f"intra_link={intra_link!r} must be a comm_time.Link")
    if nodes > 1 and not isinstance(inter_link, Link):
        raise ValueError(f"inter_link={inter_link!r} must be a comm_time.Link when "
                         f"nodes={nodes} > 1")
    if remat not in REMATS:
        raise ValueError(f"remat={remat!r} is not modeled; choose one of {REMATS}")
    check_layout(layout)
    links = {"intra": intra_link, "inter": inter_link or intra_link}
    kw = dict(seq_len=seq_len, global_batch=global_batch, devices_per_node=devices_per_node)
    out = []
    for sizes in factorizations(devices_per_node * nodes):
        why = _why_invalid(sizes, config, layout=layout, **kw)
        if why:
            out.append(MeshCandidate(sizes, why))
            continue
        c = _model(sizes, config, links=links, device_flops=device_flops, remat=remat,
                   causal=causal, **kw)
        if c.memory > device_memory:
            c = dataclasses.replace(c, skipped=f"needs {_gb(c.memory)} per device > "
                                               f"device_memory={_gb(device_memory)}")
        out.append(c)
    modeled = [c for c in out if c.memory is not None]
    if not modeled:
        near = min(out, key=lambda c: c.skipped.count(";"))
        raise ValueError(f"no split of {devices_per_node * nodes} devices divides seq_len="
                         f"{seq_len} and global_batch={global_batch}; nearest "
                         f"{near.label}: {near.skipped}")
    ranked = sorted((c for c in modeled if c.skipped is None),
                    key=lambda c: (c.step_seconds, c.inter_bytes, c.sizes["tensor"],
                                   sum(c.bytes.values())))
    if not ranked:
        low = min(modeled, key=lambda c: c.memory)
        raise ValueError(f"device_memory={_gb(device_memory)} holds no candidate: the "
                         f"smallest need is {_gb(low.memory)} ({low.label})")
    too_big = [c for c in modeled if c.skipped is not None]
    reason = _reason(ranked[0], ranked, too_big, device_memory, links)
    return MeshChoice(dict(ranked[0].sizes), reason, tuple(out))


__all__ = ["KEYS", "MeshCandidate", "MeshChoice", "REMATS", "RERUN", "choose_mesh",
           "factorizations", "param_count", "saved_per_layer"]
