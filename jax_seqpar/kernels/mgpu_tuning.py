"""Tile sizes of the Hopper kernel (``pallas_mgpu``) chosen by measurement, per shape class.

The best block sizes of a FlashAttention kernel depend on the GPU, the head dim and the
mask: FlashAttention-3 fixes them per head dim and causality in its launch templates
(Shah et al., 2024, §4.1: "block sizes ... chosen per head dimension"), tokamax 0.0.17
keeps an autotuning cache keyed by the call's shapes.  ``DEFAULT_MGPU_CONFIGS`` holds one
hand-measured config per head dim; this module adds a table of measured ones, keyed by

    (GPU, dtype, head dim, tile kind, mask)

where ``mask`` is ``"none"`` (no mask on the tile), ``"causal"`` (a causal mask or a
sliding window: tiles visible along the diagonal) or ``"segments"`` (segment ids, with
or without another mask: packed documents, whose visible tiles follow the documents).
The forward fields (``block_q``, ``block_kv``, ``num_stages``) and the
backward fields are tuned and stored apart: each half of a config is chosen by the time
of its own kernel(s).  The tuner measures three classes per head dim: a dense tile with
no mask, an aligned (diagonal) one with a causal mask, and an aligned one of packed
documents (causal, segment ids of log-normal lengths around 4k tokens).  A key the table
lacks falls back to the class with its mask (a ring's off-diagonal tiles are the same
kernel with other positions), then to ``DEFAULT_MGPU_CONFIGS``.

The table is ``mgpu_tuned.json`` beside this file, written by
``benchmarks/mgpu_tune.py`` (``autotune`` below, run on the GPU it names), and committed:
a user's first call never pays a search.  Sequence length is not part of the key: the
tuner runs at 16k tokens (packed documents at 64k) and RESULTS.md checks the picks at
both lengths.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from jax_seqpar.kernels.base import gpu_key  # noqa: F401  (the table's GPU keys)
from jax_seqpar.kernels.pallas_mgpu_common import (DEFAULT_MGPU_CONFIGS, SMEM_LIMIT,
                                                   MgpuConfig, backward_smem_bytes,
                                                   forward_smem_bytes)

FWD_FIELDS = ("block_q", "block_kv", "num_stages", "overlap_fwd")
BWD_FIELDS = ("block_q_bwd", "block_kv_bwd", "num_stages_bwd", "block_kv_dq", "atomic_dq",
              "split_dq", "overlap_bwd", "dv_with_dp", "row_scores", "doc_order_bwd")
MASKS = ("none", "causal", "segments")
TILES = ("dense", "aligned", "general")
TABLE_PATH = Path(__file__).with_name("mgpu_tuned.json")


def table_key(gpu: str, dtype: str, head_dim: int, tile: str, mask: str) -> str:
    """``"nvidia_h200/bfloat16/d128/aligned/causal"``; arguments are checked."""
    if tile not in TILES:
        raise ValueError(f"tile={tile!r} must be one of {TILES}")
    if mask not in MASKS:
        raise ValueError(f"mask={mask!r} must be one of {MASKS}")
    if head_dim not in DEFAULT_MGPU_CONFIGS:
        raise ValueError(f"head_dim={head_dim} must be one of {tuple(DEFAULT_MGPU_CONFIGS)}")
    return f"{gpu}/{dtype}/d{head_dim}/{tile}/{mask}"


def _check_entry(key: str, entry) -> dict:
    if not isinstance(entry, Mapping):
        raise ValueError(f"mgpu tuning table: entry {key!r} must be an object")
    out = {}
    for part, fields in (("fwd", FWD_FIELDS), ("bwd", BWD_FIELDS)):
        got = entry.get(part, {})
        extra = set(got) - set(fields)
        if extra:
            raise ValueError(f"mgpu tuning table: entry {key!r} {part} has unknown fields "
                             f"{sorted(extra)} (allowed: {fields})")
        out[part] = dict(got)
    # a config that MgpuConfig refuses is an error in the table, not at the first call
    MgpuConfig(**{**out["fwd"], **out["bwd"]})
    return out


def parse_table(data: Mapping) -> Dict[str, dict]:
    """Validate a table read from JSON: ``{"entries": {key: {"fwd": {...}, "bwd": {...},
    ...}}, ...}``.  Extra keys of an entry (the measured times) are kept out."""
    entries = data.get("entries")
    if not isinstance(entries, Mapping):
        raise ValueError("mgpu tuning table: no 'entries' object")
    return {k: _check_entry(k, e) for k, e in entries.items()}


@functools.lru_cache(maxsize=None)
def load_table(path: str = str(TABLE_PATH)) -> Mapping[str, dict]:
    """The committed table (``{}`` when the file is absent)."""
    p = Path(path)
    if not p.exists():
        return {}
    return parse_table(json.loads(p.read_text()))


def lookup(gpu: str, dtype: str, head_dim: int, tile: str, mask: str,
           table: Optional[Mapping[str, dict]] = None) -> Tuple[MgpuConfig, str]:
    """``(config, source)``: the tuned config of this shape class, with ``source`` the
    table key it came from, or ``"default"`` (``DEFAULT_MGPU_CONFIGS``)."""
    table = load_table() if table is None else table
    base = DEFAULT_MGPU_CONFIGS[head_dim]
    # then the class that was tuned for this mask: a causal tile of another kind (a
    # ring's off-diagonal ones) as the aligned causal one, unmasked ones as dense
    keys = [table_key(gpu, dtype, head_dim, tile, mask)]
    keys.append(table_key(gpu, dtype, head_dim, *{"causal": ("aligned", "causal"),
                                                  "none": ("dense", "none"),
                                                  "segments": ("aligned", "segments")}[mask]))
    for key in keys:
        entry = table.get(key)
        if entry is not None:
            fields = {**dataclasses.asdict(base), **entry["fwd"], **entry["bwd"]}
            return MgpuConfig(**fields), key
    return base, "default"


# --------------------------------------------------------------------------- the tuner
def forward_candidates(head_dim: int, dtype: str = "bfloat16") -> List[MgpuConfig]:
    """Forward tiles to try: ``block_kv`` 64-256 keys per stage, 2-4 stages, that fit a
    CTA's shared memory (``block_q`` stays 64 rows per consumer: a warpgroup's ``wgmma``
    accumulators of 64 x ``block_kv`` scores and 64 x D outputs fill its registers);
    those of at most 128 keys also with ``overlap_fwd``, which holds a tile's float32
    scores, the last tile's ``P`` and the outputs at once: 208 of a consumer's 232
    registers at D 128 and 192 keys, 224 at D 64 and 256 keys (a count, not a run; D 64
    at 192 keys, 176, is left out with them)."""
    base = DEFAULT_MGPU_CONFIGS[head_dim]
    out = []
    for bk, stages in itertools.product((64, 128, 192, 256), (2, 3, 4)):
        cfg = dataclasses.replace(base, block_kv=bk, num_stages=stages)
        if forward_smem_bytes(cfg, head_dim, dtype) <= SMEM_LIMIT:
            out.append(cfg)
            if bk <= 128:
                out.append(dataclasses.replace(cfg, overlap_fwd=True))
    return out


def backward_candidates(head_dim: int, dtype: str = "bfloat16",
                        segments: bool = False) -> List[MgpuConfig]:
    """Backward tiles to try: 64 or 128 keys per consumer and queries per stage, 2 or 3
    stages, for the two kernels with FA3's in-warpgroup overlap, its dK/dV step order
    and 128-key dQ stages (all measured better before: ``DEFAULT_MGPU_CONFIGS``'s
    comment) and for the atomic-dQ kernel (split between the consumers from D 128),
    that fit shared memory.  From D 128 also the fused kernel with scores by query row
    (``row_scores``), with and without ``dv_with_dp``, on the one tiling it was measured
    with (64 queries and 64 keys per consumer, 2 stages: with 128 keys a consumer's dK and
    dV alone would take 256 registers a thread).  ``segments`` (a class with segment
    ids): the fused kernels also with their CTAs launched document by document
    (``doc_order_bwd``, which changes nothing without ids)."""
    base = DEFAULT_MGPU_CONFIGS[head_dim]
    variants = [dict(atomic_dq=False, split_dq=False, overlap_bwd=True, dv_with_dp=True,
                     block_kv_dq=128),
                dict(atomic_dq=True, split_dq=head_dim >= 128, overlap_bwd=False,
                     dv_with_dp=False, block_kv_dq=128)]
    out = []
    for bq, bk, stages in itertools.product((64, 128), (64, 128), (2, 3)):
        for var in variants:
            cfg = dataclasses.replace(base, block_q_bwd=bq, block_kv_bwd=bk,
                                      num_stages_bwd=stages, **var)
            if backward_smem_bytes(cfg, head_dim, dtype) <= SMEM_LIMIT:
                out.append(cfg)
    if head_dim >= 128:
        for dv_with_dp in (False, True):
            out.append(dataclasses.replace(
                base, block_q_bwd=64, block_kv_bwd=64, num_stages_bwd=2, block_kv_dq=128,
                atomic_dq=True, split_dq=True, row_scores=True, overlap_bwd=False,
                dv_with_dp=dv_with_dp))
    if segments:
        out += [dataclasses.replace(c, doc_order_bwd=True) for c in out if c.row_scores]
    return out


def wall_timer(runs: Mapping, rounds: int, clock: Callable[[], float] = time.perf_counter
               ) -> Dict[object, float]:
    """Median milliseconds of each ``name: fn`` (a function of no arguments that runs the
    kernel and blocks until it is done), all timed in alternation: one call each per
    round, in a fresh seeded order every round, so that clock drift and each call's
    predecessor hit all alike."""
    import numpy as np
    names = list(runs)
    times = {n: [] for n in names}
    for r in range(rounds):
        for i in np.random.default_rng(r).permutation(len(names)):
            t0 = clock()
            runs[names[i]]()
            times[names[i]].append(1e3 * (clock() - t0))
    return {n: statistics.median(times[n]) for n in names}


def sustained_timer(window_s: float, clock: Callable[[], float] = time.perf_counter
                    ) -> Callable:
    """A timer for ``autotune`` that reads each candidate at the rate it keeps up: in each
    round, every ``name: fn`` (runs once and blocks) in a fresh seeded order, called back
    to back for ``window_s`` seconds; milliseconds per call (the window over its calls),
    the median over the rounds.  Back to back, a GPU runs at its power cap (on an H200
    about 650 W at 1,670-1,780 MHz, ``benchmarks/power_cap.py``), where a kernel that
    does less work per call also runs at a higher clock; training runs so.  Single calls
    in rotation (the device clock) start each from idle, at the boost clock."""
    if not window_s > 0:
        raise ValueError(f"window_s={window_s!r} must be > 0")

    def timer(runs: Mapping, rounds: int) -> Dict[object, float]:
        import numpy as np
        names = list(runs)
        times = {n: [] for n in names}
        for r in range(rounds):
            for i in np.random.default_rng(r).permutation(len(names)):
                fn, calls, t0 = runs[names[i]], 0, clock()
                while clock() - t0 < window_s:
                    fn()
                    calls += 1
                times[names[i]].append(1e3 * (clock() - t0) / calls)
        return {n: statistics.median(times[n]) for n in names}
    return timer


def autotune(candidates: Sequence[MgpuConfig], build: Callable[[MgpuConfig], Callable],
             *, rounds: int = 10, timer: Optional[Callable] = None,
             on_error: Optional[Callable] = None) -> List[Tuple[MgpuConfig, float]]:
    """Time each candidate and return ``[(config, ms)]``, fastest first.

    ``build(config)`` compiles (and should check) the kernel and returns a function of no
    arguments that runs it once and blocks; a candidate whose build raises is left out
    and ``on_error(config, exc)`` is told.  ``timer(runs, rounds) -> {config: ms}`` times
    the built functions (default ``wall_timer``; ``benchmarks/mgpu_tune.py`` passes the
    device's clock)."""
    runs = {}
    for cfg in candidates:
        try:
            runs[cfg] = build(cfg)
        except Exception as e:  # noqa: BLE001 - a failing candidate is reported, not fatal
            if on_error is not None:
                on_error(cfg, e)
    if not runs:
        raise RuntimeError("autotune: every candidate failed to build")
    ms = (timer or wall_timer)(runs, rounds)
    return sorted(((c, float(ms[c])) for c in runs), key=lambda x: x[1])


def fields_of(config: MgpuConfig, fields: Iterable[str]) -> dict:
    return {f: getattr(config, f) for f in fields}


__all__ = ["BWD_FIELDS", "FWD_FIELDS", "MASKS", "TABLE_PATH", "TILES", "autotune",
           "backward_candidates", "fields_of", "forward_candidates", "gpu_key", "load_table",
           "lookup", "parse_table", "sustained_timer", "table_key", "wall_timer"]
