"""Packed training data: packing (NumPy), tokenisation (``tokenizers``), a Grain pipeline.

- ``pack_documents(documents, seq_len, ...)``: token arrays -> fixed ``[B, S]`` batches of
  ``tokens``, ``segment_ids``, ``positions``, ``loss_mask`` and a ``PackingReport``.
- ``make_iterator(folder, seq_len=..., batch_size=..., ...)``: text files -> an
  iterator of packed batches with a checkpointable state (Grain).
- ``load_tokenizer`` / ``train_bpe`` / ``ByteTokenizer``: text -> token ids;
  ``gguf_tokenizer``: the tokenizer in a llama.cpp GGUF file's metadata.
- ``write_corpus(dir)``: the synthetic corpus of the tests and the demo;
  ``real_corpus``: long real English documents from freely licensed Debian packages
  (``scripts/fetch_corpus.py`` fetches them; ``html_text`` turns HTML pages into text).

Only ``packing`` and ``report`` are imported eagerly; the pipeline needs ``grain`` and
the tokenizers ``tokenizers`` (the ``[train]`` extra), imported on first use.
"""

from jax_seqpar.data.packing import (KEYS, LONG_DOCUMENTS, POLICIES, SPLIT_POSITIONS,
                                     PackOptions, Packed, pack_documents, pack_rows)
from jax_seqpar.data.report import PackingReport
from jax_seqpar.data.corpus import make_documents, write_corpus

_LAZY = {
    "DataConfig": "pipeline", "PackedBatchDataset": "pipeline",
    "PackedBatchIterator": "pipeline", "make_iterator": "pipeline",
    "text_dataset": "pipeline",
    "ByteTokenizer": "tokenize", "TextTokenizer": "tokenize", "load_tokenizer": "tokenize",
    "train_bpe": "tokenize", "tokenize_folder": "tokenize", "text_files": "tokenize",
    "gguf_tokenizer": "gguf_tokenizer", "gguf_special_tokens": "gguf_tokenizer",
    "GGUFSpecialTokens": "gguf_tokenizer",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"jax_seqpar.data.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'jax_seqpar.data' has no attribute {name!r}")


__all__ = ["KEYS", "LONG_DOCUMENTS", "POLICIES", "SPLIT_POSITIONS", "PackOptions", "Packed",
           "PackingReport", "pack_documents", "pack_rows", "make_documents", "write_corpus",
           *_LAZY]
