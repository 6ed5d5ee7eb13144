"""Opening a llama.cpp GGUF file and reading its metadata (the ``gguf`` package, the
``[gguf]`` extra): what both the weights (``models.gguf``) and the tokenizer
(``data.gguf_tokenizer``) read.

GGUF (ggml's file format, ``docs/gguf.md`` in ggml): a header of typed key-value
metadata (``general.architecture``, ``<arch>.block_count``, ``tokenizer.ggml.tokens``
...), then the tensors' descriptions and their data, little-endian unless the file says
otherwise.  A model may be split over several files (``split.count``); only whole,
little-endian files are read here.
"""

from __future__ import annotations

import os


def import_gguf():
    """The ``gguf`` module, or an ImportError naming the extra that installs it."""
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("reading GGUF files needs the `gguf` package: "
                          "pip install 'jax_seqpar[gguf]'") from e
    return gguf


def open_gguf(path):
    """A ``gguf.GGUFReader`` of ``path`` (a ``ValueError`` names a bad file)."""
    gguf = import_gguf()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such GGUF file")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from None
    if reader.byte_order != "I":
        raise ValueError(f"{path}: a big-endian GGUF file; only little-endian ones are read")
    if int(meta(reader, "split.count", 1)) > 1:
        raise ValueError(f"{path}: one of {meta(reader, 'split.count')} split GGUF files; "
                         f"merge them first (llama.cpp's llama-gguf-split --merge)")
    return reader


def meta(reader, key: str, default=None):
    """The value of metadata ``key`` (str, number, bool, or a list for an array)."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


__all__ = ["import_gguf", "meta", "open_gguf"]
