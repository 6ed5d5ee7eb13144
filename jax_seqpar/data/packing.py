"""Packing variable-length documents into fixed ``[B, S]`` rows, in NumPy.

A packed row holds several documents one after the other.  Four arrays describe it
(the contract ``models.llama.next_token_loss`` reads):

- ``tokens`` int32 ``[B, S]``: the token ids, ``pad_id`` on padding;
- ``segment_ids`` int32 ``[B, S]``: documents numbered 1, 2, ... within each row, 0 on
  padding, so attention keeps documents apart;
- ``positions`` int32 ``[B, S]``: position of each token inside its piece of document
  (transformers' ``position_ids``), restarting at 0 at every document start; 0 on padding;
- ``loss_mask`` bool ``[B, S]``: True on every real token, False on padding.
  ``shift_targets`` turns it (and the segment ids) into per-target weights, so no target
  crosses a document boundary or lands on padding.

Padding sits at the end of a row, after its last document.

**Policies** (``policy=``), each applied to a *window* of documents at a time:

- ``"sequential"``: documents concatenated in their order and the stream cut every
  ``seq_len`` tokens (LWM's packing, with segment ids). No padding except in a window's
  last row, but most documents that meet a row boundary are split.
- ``"first_fit"``: first-fit decreasing: longest first, each into the first row with room.
- ``"best_fit"``: best-fit decreasing: longest first, each into the row it fills the most.
  The two "fit" policies never split a document that fits in one row.

**Documents longer than ``seq_len``** (``long_documents=``): ``"split"`` (default) cuts
them into pieces of ``seq_len`` tokens (the last one shorter; the fit policies pack that
remainder like any document); ``"truncate"`` keeps the first ``seq_len`` tokens;
``"drop"`` leaves them out.  Cut and dropped tokens are counted in the report.

**Positions of a piece** (``split_positions=``).  Every piece that starts a row is a new
segment: it cannot attend to the earlier part of its document, which lies in another row
(or another batch).  By default (``"restart"``) its positions start at 0 like any
document's.  RoPE scores depend only on the offset between two tokens, so for a
RoPE model the two choices are the same function in exact arithmetic; restarting is the
exact one in float32 (an angle ``position x frequency`` loses precision as positions
grow) and matches what the model sees at inference: a context whose first token is at
position 0.  ``"continue"`` gives a piece its offset within the document instead, for
models with absolute position embeddings or RoPE variants that depend on the largest
position (dynamic NTK).  Within one row a document is always one segment with
consecutive positions; a row never holds two pieces of the same document.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from jax_seqpar.data.report import PackingReport

POLICIES = ("sequential", "first_fit", "best_fit")
LONG_DOCUMENTS = ("split", "truncate", "drop")
SPLIT_POSITIONS = ("restart", "continue")
KEYS = ("tokens", "segment_ids", "positions", "loss_mask")
_INT32_MAX = np.iinfo(np.int32).max


def _check_id(name, value, allow_none=True):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or not 0 <= value <= _INT32_MAX:
        raise ValueError(f"{name}={value!r} must be an int in [0, 2**31 - 1]")


@dataclasses.dataclass(frozen=True)
class PackOptions:
    """How documents become rows; see the module docstring for each choice.

    ``bos_id`` / ``eos_id``, when given, are put before / after every document before it
    is packed (so they count towards its length and a split document has them only on
    its first / last piece).
    """

    seq_len: int
    policy: str = "best_fit"
    pad_id: int = 0
    bos_id: int | None = None
    eos_id: int | None = None
    long_documents: str = "split"
    split_positions: str = "restart"

    def __post_init__(self):
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, (int, np.integer)) \
                or self.seq_len < 1:
            raise ValueError(f"seq_len={self.seq_len!r} must be a positive int")
        object.__setattr__(self, "seq_len", int(self.seq_len))
        for name, value, allowed in (("policy", self.policy, POLICIES),
                                     ("long_documents", self.long_documents, LONG_DOCUMENTS),
                                     ("split_positions", self.split_positions,
                                      SPLIT_POSITIONS)):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} must be one of {allowed}")
        _check_id("pad_id", self.pad_id, allow_none=False)
        _check_id("bos_id", self.bos_id)
        _check_id("eos_id", self.eos_id)


class Packed(NamedTuple):
    """``batches``: dicts of ``KEYS`` -> ``[B, S]`` arrays; ``report``: a PackingReport."""

    batches: tuple
    report: PackingReport


def as_document(doc, index=None) -> np.ndarray:
    """``doc`` as a 1-D int32 array of token ids, or a ValueError saying what is wrong."""
    name = "document" if index is None else f"documents[{index}]"
    arr = np.asarray(doc)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D token ids, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > _INT32_MAX):
        raise ValueError(f"{name} has token ids outside [0, 2**31 - 1] "
                         f"(min {arr.min()}, max {arr.max()})")
    return arr.astype(np.int32, copy=False)


def _check_sequence(documents):
    if isinstance(documents, (str, bytes)) or not hasattr(documents, "__len__") or \
            (isinstance(documents, np.ndarray) and documents.ndim != 2):
        raise ValueError("documents must be a sequence of 1-D token arrays (a single "
                         "document goes in a list), got "
                         f"{type(documents).__name__} of shape {np.shape(documents)}")


def _prepare(documents, options: PackOptions):
    """Add BOS/EOS, apply the long-document policy; returns (docs, report counters)."""
    _check_sequence(documents)
    S = options.seq_len
    bos = [] if options.bos_id is None else [options.bos_id]
    eos = [] if options.eos_id is None else [options.eos_id]
    docs, c = [], dict(documents=0, empty_documents=0, input_tokens=0, truncated_documents=0,
                       truncated_tokens=0, dropped_documents=0, dropped_tokens=0)
    for i, doc in enumerate(documents):
        arr = as_document(doc, i)
        c["documents"] += 1
        if arr.size == 0:
            c["empty_documents"] += 1
        if bos or eos:
            arr = np.concatenate([np.asarray(bos, np.int32), arr, np.asarray(eos, np.int32)])
        n = int(arr.size)
        c["input_tokens"] += n
        if n > S and options.long_documents == "drop":
            c["dropped_documents"] += 1
            c["dropped_tokens"] += n
            continue
        if n > S and options.long_documents == "truncate":
            c["truncated_documents"] += 1
            c["truncated_tokens"] += n - S
            arr = arr[:S]
        if arr.size:
            docs.append(arr)
    return docs, c


def _sequential(lengths, S):
    """Rows as lists of ``(doc, start, end)``: the concatenated stream cut every S."""
    rows, row, free = [], [], S
    for i, n in enumerate(lengths):
        start = 0
        while start < n:
            take = min(free, n - start)
            row.append((i, start, start + take))
            start += take
            free -= take
            if free == 0:
                rows.append(row)
                row, free = [], S
    if row:
        rows.append(row)
    return rows


def _fit(lengths, S, best):
    """First-fit / best-fit decreasing over pieces of at most S tokens."""
    items = []
    for i, n in enumerate(lengths):
        items.extend((i, a, min(a + S, n)) for a in range(0, n, S))
    order = sorted(range(len(items)), key=lambda j: items[j][1] - items[j][2])  # stable
    free = np.zeros(len(items), np.int64)
    rows = []
    for j in order:
        i, a, b = items[j]
        n = b - a
        room = free[:len(rows)]
        fits = room >= n
        if fits.any():
            r = int(np.argmin(np.where(fits, room, S + 1))) if best else int(np.argmax(fits))
        else:
            r = len(rows)
            rows.append([])
            free[r] = S
        rows[r].append((i, a, b))
        free[r] -= n
    return rows


def _materialise(docs, rows, options: PackOptions) -> dict:
    S, R = options.seq_len, len(rows)
    out = {"tokens": np.full((R, S), options.pad_id, np.int32),
           "segment_ids": np.zeros((R, S), np.int32),
           "positions": np.zeros((R, S), np.int32)}
    cont = options.split_positions == "continue"
    for r, row in enumerate(rows):
        col = 0
        for seg, (i, a, b) in enumerate(row, start=1):
            n = b - a
            out["tokens"][r, col:col + n] = docs[i][a:b]
            out["segment_ids"][r, col:col + n] = seg
            out["positions"][r, col:col + n] = np.arange(a if cont else 0,
                                                         (a if cont else 0) + n)
            col += n
    out["loss_mask"] = out["segment_ids"] > 0
    return out


def pack_rows(documents: Sequence, options: PackOptions) -> tuple[dict, PackingReport]:
    """Pack ``documents`` (one window) into ``R`` rows by ``options``.

    Returns ``(rows, report)``: ``rows`` maps ``KEYS`` to ``[R, S]`` arrays (``R`` = as
    many rows as the documents need), the report counts what happened to every token.
    """
    if not isinstance(options, PackOptions):
        raise ValueError(f"options must be a PackOptions, got {type(options).__name__}")
    docs, counts = _prepare(documents, options)
    S = options.seq_len
    lengths = [int(d.size) for d in docs]
    if options.policy == "sequential":
        rows = _sequential(lengths, S)
    else:
        rows = _fit(lengths, S, best=options.policy == "best_fit")
    pieces_of = np.bincount([i for row in rows for i, _, _ in row], minlength=len(docs))
    report = PackingReport(
        S, **counts, tokens=sum(lengths), rows=len(rows),
        pieces=int(pieces_of.sum()), split_documents=int((pieces_of > 1).sum()),
        continued_tokens=sum(b - a for row in rows for _, a, b in row if a > 0),
        targets=sum(b - a - 1 for row in rows for _, a, b in row))
    return _materialise(docs, rows, options), report


def empty_rows(n: int, options: PackOptions) -> dict:
    """``n`` all-padding rows (segment 0, loss_mask False): filler for a last batch."""
    return {"tokens": np.full((n, options.seq_len), options.pad_id, np.int32),
            "segment_ids": np.zeros((n, options.seq_len), np.int32),
            "positions": np.zeros((n, options.seq_len), np.int32),
            "loss_mask": np.zeros((n, options.seq_len), bool)}


def pack_documents(documents: Sequence, seq_len: int, *, batch_size: int | None = None,
                   policy: str = "best_fit", pad_id: int = 0, bos_id: int | None = None,
                   eos_id: int | None = None, long_documents: str = "split",
                   split_positions: str = "restart", window: int | None = None) -> Packed:
    """Pack 1-D token arrays into fixed-shape batches.

    ``documents``: a sequence of 1-D integer token arrays.  ``window``: pack this many
    documents at a time (in order; ``None``: all at once), as the Grain pipeline does.
    With ``batch_size=B`` the rows come as ``ceil(R / B)`` batches of ``[B, S]``, the last
    one filled with all-padding rows (counted as ``report.padding_rows``); with ``None``
    as one batch of all ``R`` rows (no batch when there is no token).  The other
    arguments are ``PackOptions``' (module docstring).  Returns ``Packed(batches, report)``.

        batches, report = pack_documents(docs, 4096, batch_size=8)
        for b in batches:
            loss, _ = next_token_loss(model, params, b["tokens"], loss_mask=b["loss_mask"],
                                      segment_ids=b["segment_ids"], positions=b["positions"])
    """
    options = PackOptions(seq_len, policy=policy, pad_id=pad_id, bos_id=bos_id,
                          eos_id=eos_id, long_documents=long_documents,
                          split_positions=split_positions)
    if batch_size is not None and (isinstance(batch_size, bool) or
                                   not isinstance(batch_size, (int, np.integer))
                                   or batch_size < 1):
        raise ValueError(f"batch_size={batch_size!r} must be a positive int or None")
    if window is not None and (isinstance(window, bool) or
                               not isinstance(window, (int, np.integer)) or window < 1):
        raise ValueError(f"window={window!r} must be a positive int or None")
    _check_sequence(documents)
    documents = list(documents)
    step = window or max(len(documents), 1)
    parts, report = [], PackingReport(options.seq_len)
    for lo in range(0, len(documents), step):
        rows, rep = pack_rows(documents[lo:lo + step], options)
        parts.append(rows)
        report = report + rep
    n = report.rows
    pad = (-n) % batch_size if batch_size else 0
    if pad:
        parts.append(empty_rows(pad, options))
        report = dataclasses.replace(report, padding_rows=pad)
    if n == 0:
        return Packed((), report)
    rows = {k: np.concatenate([p[k] for p in parts]) for k in KEYS}
    B = batch_size or n
    batches = tuple({k: v[lo:lo + B] for k, v in rows.items()} for lo in range(0, n + pad, B))
    return Packed(batches, report)
