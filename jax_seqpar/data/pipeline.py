"""The input pipeline: text files -> tokens -> packed ``[B, S]`` batches, on Grain.

Grain does the reading: a ``MapDataset`` of file paths, shuffled with the seed (a new
order every epoch), repeated, optionally split between processes, tokenised in reader
threads, and iterated with a checkpointable state.  One Grain stage of ours,
``PackedBatchDataset``, packs ``window`` documents at a time (``packing.pack_rows``),
shuffles the rows of each window (seeded by the window's index), and stacks them into
batches; the last batch of a finite run is filled with all-padding rows, so every
batch has the same shape and nothing is dropped.

**Several processes** (``shard=``), each iterator yields this process's ``B / P`` rows:

- ``"rows"`` (default): every process reads and packs the same global stream and keeps
  rows ``[p * B/P, (p + 1) * B/P)`` of each global batch.  The global batch is the same
  whatever the process count (2 processes train exactly like 1), at the price of every
  process tokenising the whole corpus.  On a mesh whose batch axis runs over the
  processes in order, ``jax_seqpar.runtime.distributed.from_process_local(batch, mesh,
  P("data", "sp"))`` assembles the global array.  If the processes instead share each
  row (the sequence axis spans processes), give every process ``process_count=1`` so
  they all get the whole global batch, and place it with ``distributed.from_host``.
- ``"documents"``: process ``p`` reads only documents ``p, p + P, ...`` and packs its own
  rows: no repeated work, but the batches depend on the process count, and with a
  finite ``num_epochs`` processes may run out at different steps (stop by step count).

**Resume.** ``iterator.get_state()`` is a small JSON-able dict (Grain's reader position
at the start of the current window, the row within it, the report so far);
``set_state`` on a fresh iterator of the same pipeline re-reads and re-packs that
window and continues with exactly the batches the first one would have given.  It is a
Grain ``DatasetIterator``, so ``grain.checkpoint.CheckpointSave`` / ``CheckpointRestore``
put it in an Orbax checkpoint.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence

import grain
import numpy as np

from jax_seqpar.data.packing import KEYS, PackOptions, empty_rows, pack_rows
from jax_seqpar.data.report import PackingReport
from jax_seqpar.data.tokenize import (load_tokenizer, read_text, text_files, train_bpe)

SHARDS = ("rows", "documents")


def _positive(name, value, allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int"
                         + (" or None" if allow_none else ""))


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What the pipeline makes; everything that decides the batches is here.

    ``batch_size``: rows of the *global* batch (a multiple of the process count).
    ``window``: documents packed together (larger packs tighter and costs memory and
    latency at each window).  ``add_bos`` / ``add_eos``: put the tokenizer's BOS / EOS
    around every document when it has them.  ``num_epochs=None`` repeats for ever.  The
    other fields are ``packing.PackOptions``'.
    """

    seq_len: int
    batch_size: int
    policy: str = "best_fit"
    window: int = 256
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None
    add_bos: bool = True
    add_eos: bool = True
    long_documents: str = "split"
    split_positions: str = "restart"
    shard: str = "rows"
    read_threads: int = 2

    def __post_init__(self):
        PackOptions(self.seq_len, policy=self.policy, long_documents=self.long_documents,
                    split_positions=self.split_positions)  # validates those fields
        _positive("batch_size", self.batch_size)
        _positive("window", self.window)
        _positive("num_epochs", self.num_epochs, allow_none=True)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or \
                not 0 <= self.seed < 2 ** 32:
            raise ValueError(f"seed={self.seed!r} must be an int in [0, 2**32)")
        if self.shard not in SHARDS:
            raise ValueError(f"shard={self.shard!r} must be one of {SHARDS}")
        if isinstance(self.read_threads, bool) or not isinstance(self.read_threads, int) \
                or self.read_threads < 0:
            raise ValueError(f"read_threads={self.read_threads!r} must be an int >= 0")

    def pack_options(self, tokenizer) -> PackOptions:
        pad = getattr(tokenizer, "pad_id", None)
        return PackOptions(self.seq_len, policy=self.policy, pad_id=pad or 0,
                           bos_id=tokenizer.bos_id if self.add_bos else None,
                           eos_id=tokenizer.eos_id if self.add_eos else None,
                           long_documents=self.long_documents,
                           split_positions=self.split_positions)


def _process(process_index, process_count):
    if process_index is None or process_count is None:
        import jax  # only asked when not given: the data code itself needs no devices
        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    _positive("process_count", process_count)
    if isinstance(process_index, bool) or not isinstance(process_index, int) or \
            not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index!r} must be an int in "
                         f"[0, process_count={process_count})")
    return process_index, process_count


class _ReadAndEncode(grain.transforms.Map):
    """One file -> its token ids (a class, not a lambda, so it pickles for mp_prefetch)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def map(self, path):
        return self.tokenizer.encode(read_text(path))


class PackedBatchIterator(grain.DatasetIterator):
    """Batches of packed rows from an iterator of token arrays; see the module docstring.

    ``report`` is the ``PackingReport`` of every window packed so far (rows not yet
    emitted included) and of the padding rows emitted; ``tokenizer`` is set by
    ``make_iterator``.
    """

    def __init__(self, parent, ds: "PackedBatchDataset"):
        super().__init__(parent)
        self._ds = ds
        self.tokenizer = None
        self._start(window=0, report=PackingReport(ds.options.seq_len), emitted=0)

    def _start(self, window, report, emitted):
        self._window = window          # index of the window loaded (or to load next)
        self._window_state = None      # reader state at the start of the loaded window
        self._rows, self._next_row = None, 0
        self._report_before = self._report = report
        self._emitted = emitted        # rows emitted so far (padding rows included)

    @property
    def report(self) -> PackingReport:
        return self._report

    def _load_window(self) -> bool:
        """Read and pack the next window; False when the reader is exhausted."""
        self._window_state = self._parent.get_state()
        docs = []
        for _ in range(self._ds.config.window):
            try:
                docs.append(next(self._parent))
            except StopIteration:
                break
        if not docs:
            self._rows = None
            return False
        rows, rep = pack_rows(docs, self._ds.options)
        if self._ds.config.shuffle:
            order = np.random.default_rng([self._ds.config.seed, self._window]).permutation(
                rep.rows)
            rows = {k: v[order] for k, v in rows.items()}
        self._rows, self._next_row = rows, 0
        self._report_before, self._report = self._report, self._report + rep
        return True

    def _row(self):
        while self._rows is None or self._next_row >= len(self._rows["tokens"]):
            if self._rows is not None:
                self._window += 1
            if not self._load_window():
                if self._emitted % self._ds.rows_per_batch == 0:
                    raise StopIteration
                self._report = dataclasses.replace(
                    self._report, padding_rows=self._report.padding_rows + 1)
                self._emitted += 1
                return empty_rows(1, self._ds.options)
        r = self._next_row
        self._next_row += 1
        self._emitted += 1
        return {k: v[r:r + 1] for k, v in self._rows.items()}

    def __next__(self) -> dict:
        rows = [self._row() for _ in range(self._ds.rows_per_batch)]
        lo, hi = self._ds.keep
        return {k: np.concatenate([r[k] for r in rows])[lo:hi] for k in KEYS}

    def get_state(self) -> dict:
        in_window = self._rows is not None and self._next_row < len(self._rows["tokens"])
        if in_window:
            parent, window, row, report = (self._window_state, self._window,
                                           self._next_row, self._report_before)
        else:  # between windows: start from the reader's position
            parent, window, row, report = (self._parent.get_state(),
                                           self._window + (self._rows is not None), 0,
                                           self._report)
        return {"parent": parent, "window": int(window), "row": int(row),
                "emitted": int(self._emitted), "report": report.as_dict()}

    def set_state(self, state: dict):
        report = PackingReport.from_dict(state["report"])
        if report.seq_len != self._ds.options.seq_len:
            raise ValueError(f"the state is of seq_len={report.seq_len}, this pipeline "
                             f"packs seq_len={self._ds.options.seq_len}")
        self._parent.set_state(state["parent"])
        self._start(window=state["window"], report=report, emitted=state["emitted"])
        if state["row"]:
            if not self._load_window():
                raise ValueError("the state points inside a window this pipeline no longer "
                                 "has: is it the same data and config?")
            self._next_row = state["row"]


class PackedBatchDataset(grain.IterDataset):
    """Grain stage: token arrays in, packed batch dicts out (``PackedBatchIterator``).

    ``rows_per_batch`` rows are packed per batch and rows ``keep = (lo, hi)`` of each
    are yielded (a process's slice of the global batch under ``shard="rows"``).
    """

    def __init__(self, parent: grain.IterDataset, config: DataConfig, options: PackOptions,
                 rows_per_batch: int, keep: tuple[int, int]):
        super().__init__(parent)
        self.config, self.options = config, options
        self.rows_per_batch, self.keep = rows_per_batch, keep

    def __iter__(self) -> PackedBatchIterator:
        return PackedBatchIterator(self._parent.__iter__(), self)

    def __str__(self) -> str:
        return (f"PackedBatchDataset(seq_len={self.options.seq_len}, "
                f"policy={self.options.policy}, rows={self.rows_per_batch})")


def text_dataset(files: Sequence, tokenizer, config: DataConfig, *,
                 process_index: int | None = None,
                 process_count: int | None = None) -> PackedBatchDataset:
    """A Grain dataset of this process's packed batches (``[B / P, S]`` each).

    ``files``: text files, one document each (their order, then the seeded shuffle,
    decides the stream); ``tokenizer``: anything ``tokenize.load_tokenizer`` takes;
    ``process_index`` / ``process_count`` default to JAX's.
    """
    if not isinstance(config, DataConfig):
        raise ValueError(f"config must be a DataConfig, got {type(config).__name__}")
    files = [str(f) for f in files]
    if not files:
        raise ValueError("files is empty: nothing to read")
    tokenizer = load_tokenizer(tokenizer)
    p, P = _process(process_index, process_count)
    if config.batch_size % P:
        raise ValueError(f"batch_size={config.batch_size} must be a multiple of "
                         f"process_count={P}")
    local = config.batch_size // P
    ds = grain.MapDataset.source(files)
    if config.shuffle:
        ds = ds.shuffle(seed=config.seed)
    ds = ds.repeat(config.num_epochs)
    if config.shard == "documents" and P > 1:
        ds = ds[p::P]
    ds = ds.map(_ReadAndEncode(tokenizer))
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=config.read_threads,
                                              prefetch_buffer_size=config.window))
    if config.shard == "rows":
        rows, keep = config.batch_size, (p * local, (p + 1) * local)
    else:
        rows, keep = local, (0, local)
    return PackedBatchDataset(ds, config, config.pack_options(tokenizer), rows, keep)


def make_iterator(data, *, seq_len: int, batch_size: int, tokenizer=None, seed: int = 0,
                  policy: str = "best_fit", num_epochs: int | None = None,
                  process_index: int | None = None, process_count: int | None = None,
                  bpe_vocab_size: int = 512, pattern: str = "*.txt",
                  **config) -> PackedBatchIterator:
    """One call from a folder of text files to an iterator of packed batches with state.

    ``data``: a directory (every ``pattern`` file under it is one document) or a list of
    files.  ``tokenizer``: a ``tokenizer.json`` path or its directory (a model's own),
    ``"bytes"``, a tokenizer object, or ``None`` to train a byte-level BPE of
    ``bpe_vocab_size`` on the files (deterministic, so every process trains the same).
    ``batch_size`` is global; each process gets ``batch_size / process_count`` rows
    (module docstring).  Further keywords go to ``DataConfig``.

    The iterator's ``tokenizer`` gives ``vocab_size`` (size the model's embedding by it)
    and ``save(dir)``; ``report`` the packing efficiency so far;
    ``get_state()`` / ``set_state()`` resume exactly.
    """
    files = text_files(data, pattern) if isinstance(data, (str, pathlib.Path)) else \
        [pathlib.Path(f) for f in data]
    cfg = DataConfig(seq_len, batch_size, policy=policy, seed=seed, num_epochs=num_epochs,
                     **config)
    if tokenizer is None:
        tokenizer = train_bpe((read_text(f) for f in files), bpe_vocab_size)
    tokenizer = load_tokenizer(tokenizer)
    it = iter(text_dataset(files, tokenizer, cfg, process_index=process_index,
                           process_count=process_count))
    it.tokenizer = tokenizer
    return it
