"""How much of the Hopper kernel's work on packed causal documents is masked pairs: the
tiles its tile lists send to the forward and to the fused backward, against the pairs a
query may see (issue 41; CPU only, no kernel runs).

The forward's CTA holds ``2 * block_q`` query rows and steps over key blocks of
``block_kv``; the fused backward's CTA holds ``2 * block_kv_bwd`` keys and steps over
query blocks of ``block_q_bwd`` (``pallas_mgpu_fwd`` / ``pallas_mgpu_bwd``, the lists of
``pallas_common.tile_lists``).  Every listed tile costs its whole ``rows x cols`` pairs.
Four numbers per kernel:

* ``aligned``: the tiles of the lists themselves, blocks on multiples of the block size
  (what the kernels run);
* ``per document``: the same tile shapes laid from each document's first token, so no
  tile holds two documents (a document's last blocks are partial, and cost whole
  tiles).  A document of ``L`` tokens with query blocks of ``r`` and key blocks of ``c``
  costs ``sum_i r c (floor((min(L, (i + 1) r) - 1) / c) + 1)``;
* ``steps per document``: the blocks as now, only the streamed steps laid from each
  document's first token (no partial stores needed, but a block that holds two
  documents walks both);
* ``halves per document``: each CTA's two consumer blocks (64 rows each) paired within a
  document (``half_block_ctas``), so that every consumer stores a whole block of its own
  or nothing; a document's last CTA may hold one block, counted at its own pairs or at a
  whole CTA's.

Both are given as computed pairs over useful pairs (a causal document of ``L`` tokens
has ``L (L + 1) / 2``), on the bar's documents (``benchmarks/packed.py``: log-normal
lengths around ``--doc-mean``, seeded as there)::

    python benchmarks/tile_waste.py                        # 64k tokens, documents ~4k
    python benchmarks/tile_waste.py --seq 16384 --doc-mean 4096
    python benchmarks/tile_waste.py --round-docs 128     # every document on a boundary
"""

from __future__ import annotations

import argparse
import json
import os

import _setup  # noqa: F401

import jax.numpy as jnp
import numpy as np

from jax_seqpar.kernels.pallas_common import tile_lists
from jax_seqpar.kernels.pallas_mgpu import DEFAULT_MGPU_CONFIGS
from jax_seqpar.masks import MaskSpec
from _util import out_dir
from packed import lognormal_lengths, packed_ids, round_lengths


def useful_causal_pairs(lens) -> int:
    """Query-key pairs a causal document mask lets through, summed over documents."""
    return int(sum(n * (n + 1) // 2 for n in lens))


def listed_tiles(seg, rows: int, cols: int, transpose: bool) -> int:
    """Tiles the kernels' lists hold for one packed causal row ``seg`` ``[S]``: row blocks
    of ``rows`` queries (``transpose``: of ``rows`` keys), column blocks of ``cols``."""
    S = seg.shape[0]
    pos = jnp.arange(S, dtype=jnp.int32)
    s = jnp.asarray(seg, jnp.int32)[None]
    bq, bk = (cols, rows) if transpose else (rows, cols)
    tbl = tile_lists(MaskSpec(causal=True), pos[None], pos, S, bq, bk, True,
                     transpose=transpose, q_seg=s, kv_seg=s)
    return int(np.asarray(tbl[..., 0]).sum())


def per_document_pairs(lens, q_block: int, k_block: int) -> int:
    """Pairs computed with query blocks of ``q_block`` and key blocks of ``k_block``
    laid from each document's first token (the same count for the transposed walk:
    it is a count of tiles that hold a visible pair)."""
    total = 0
    for n in lens:
        for i in range(-(-n // q_block)):
            last_q = min(n, (i + 1) * q_block) - 1
            total += q_block * k_block * (last_q // k_block + 1)
    return total


def _bounds(lens):
    """Each document's first row and the row after its last."""
    ends = np.cumsum(lens)
    return ends - np.asarray(lens), ends


def streamed_per_document_pairs(lens, S: int, cta: int, step: int, keys_held: bool) -> int:
    """Pairs computed with the CTAs' blocks on multiples of ``cta`` (as now) and their
    streamed steps of ``step`` laid from each document's first token: a block that holds
    two documents walks each one's steps.  ``keys_held``: the backward's walk (a block
    of keys, query steps from the block's first key to the document's end); else the
    forward's (a block of queries, key steps from the document's start)."""
    starts, ends = _bounds(lens)
    total = 0
    for b0 in range(0, S, cta):
        for s, e in zip(starts, ends):
            lo, hi = max(b0, s), min(b0 + cta, e)
            if lo >= hi:
                continue
            if keys_held:
                n = (e - 1 - s) // step - (lo - s) // step + 1
            else:
                n = (hi - 1 - s) // step + 1
            total += n * cta * step
    return int(total)


def half_block_ctas(lens, S: int, half: int, keys_held: bool):
    """CTAs of two ``half``-row blocks (one per consumer) paired within each document:
    a half that holds two documents belongs to the later one when the CTA holds keys
    (the backward: its keys of the earlier document see few queries) and to the earlier
    one when it holds queries (the forward).  A document's last CTA may hold one half.
    Returns ``[(first row, number of halves)]``."""
    seg = np.asarray(packed_ids(lens, S))
    owner = seg[np.arange(S // half) * half + (half - 1 if keys_held else 0)]
    ctas, h = [], 0
    while h < len(owner):
        two = h + 1 < len(owner) and owner[h + 1] == owner[h]
        ctas.append((h * half, 2 if two else 1))
        h += 2 if two else 1
    return ctas


def half_block_pairs(lens, S: int, half: int, step: int, keys_held: bool) -> tuple:
    """Pairs computed by ``half_block_ctas``' CTAs, steps of ``step`` on multiples of it
    (as the lists'): ``(each half costing its own pairs, a one-half CTA costing two)``."""
    starts, ends = _bounds(lens)
    own = two = 0
    for r0, n in half_block_ctas(lens, S, half, keys_held):
        r1 = r0 + n * half
        steps = set()
        for s, e in zip(starts, ends):
            lo, hi = max(r0, s), min(r1, e)
            if lo >= hi:
                continue
            first, last = (lo // step, (e - 1) // step) if keys_held else (s // step,
                                                                            (hi - 1) // step)
            steps.update(range(first, last + 1))
        own += len(steps) * step * half * n
        two += len(steps) * step * half * 2
    return int(own), int(two)


def waste(lens, S: int, head_dim: int = 128) -> dict:
    """Computed over useful pairs for the forward and the fused backward's tiles."""
    cfg = DEFAULT_MGPU_CONFIGS[head_dim]
    seg = np.asarray(packed_ids(lens, S))
    useful = useful_causal_pairs(lens)
    fwd_r, fwd_c = 2 * cfg.block_q, cfg.block_kv
    bwd_r, bwd_c = 2 * cfg.block_kv_bwd, cfg.block_q_bwd  # keys held, queries streamed
    fwd = listed_tiles(seg, fwd_r, fwd_c, False) * fwd_r * fwd_c
    bwd = listed_tiles(seg, bwd_r, bwd_c, True) * bwd_r * bwd_c
    return dict(
        seq=S, documents=len(lens), useful_pairs=useful,
        forward=dict(tile=[fwd_r, fwd_c], aligned=fwd / useful,
                     per_document=per_document_pairs(lens, fwd_r, fwd_c) / useful,
                     steps_per_document=streamed_per_document_pairs(
                         lens, S, fwd_r, fwd_c, False) / useful,
                     halves_per_document=[x / useful for x in half_block_pairs(
                         lens, S, fwd_r // 2, fwd_c, False)]),
        backward=dict(tile=[bwd_c, bwd_r], aligned=bwd / useful,
                      per_document=per_document_pairs(lens, bwd_c, bwd_r) / useful,
                      steps_per_document=streamed_per_document_pairs(
                          lens, S, bwd_r, bwd_c, True) / useful,
                      halves_per_document=[x / useful for x in half_block_pairs(
                          lens, S, bwd_r // 2, bwd_c, True)]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=65536)
    p.add_argument("--doc-mean", type=int, default=4096)
    p.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    p.add_argument("--round-docs", type=int, default=0,
                   help="documents rounded to this multiple, as packed.py --round-docs")
    args = p.parse_args(argv)
    S, mean = args.seq, args.doc_mean
    lens = lognormal_lengths(mean, S, seed=S + mean)  # the bar's documents (packed.py)
    if args.round_docs:
        lens = round_lengths(lens, S, args.round_docs)
    res = waste(lens, S, args.head_dim)
    print(f"S={S} documents~{mean}{f' rounded to {args.round_docs}' if args.round_docs else ''}"
          f": {res['documents']} documents, "
          f"{res['useful_pairs']:,} useful pairs")
    for k in ("forward", "backward"):
        r = res[k]
        print(f"  {k:8s} tiles {r['tile'][0]}x{r['tile'][1]} (queries x keys): computed / "
              f"useful {r['aligned']:.4f} as listed, {r['per_document']:.4f} per document, "
              f"{r['steps_per_document']:.4f} with only the steps per document, "
              f"{r['halves_per_document'][0]:.4f}-{r['halves_per_document'][1]:.4f} with "
              f"halves paired per document")
    path = os.path.join(out_dir(), f"tile_waste_{S}_{mean}"
                        + (f"_r{args.round_docs}" if args.round_docs else "") + ".json")
    with open(path, "w") as fh:
        json.dump(res, fh, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
