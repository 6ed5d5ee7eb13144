"""Text to token ids: a model's own ``tokenizer.json`` through ``tokenizers``, or bytes.

``load_tokenizer(path)`` reads the ``tokenizer.json`` a Hugging Face checkpoint ships
(the Rust ``tokenizers`` package: no torch, no network) and takes the BOS / EOS / pad
tokens from the ``tokenizer_config.json`` (or ``special_tokens_map.json``) beside it, and
the chat template from ``chat_template.jinja`` or ``tokenizer_config.json``.
``train_bpe(texts)`` trains a small byte-level BPE for tests and demos, and
``ByteTokenizer`` uses the UTF-8 bytes themselves.  All three share one interface:
``encode(text) -> int32 array``, ``decode(ids)``, ``vocab_size``, ``bos_id``, ``eos_id``,
``pad_id``, ``save(directory)``.

``encode`` never adds special tokens: the packer adds BOS / EOS per document
(``PackOptions.bos_id`` / ``eos_id``), so a tokenizer whose post-processor would add a
BOS of its own cannot double it.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable, Sequence

import numpy as np

from jax_seqpar.data.text_tokenizer import (CONFIG_FILE, TOKENIZER_FILE,  # noqa: F401
                                            ByteTokenizer, TextTokenizer, _import_tokenizers)

SPECIALS_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
BPE_SPECIALS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2 of a tokenizer from train_bpe


def _special(configs: list[dict], key: str, tok, where):
    for config in configs:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value:
            i = tok.token_to_id(value)
            if i is None:
                raise ValueError(f"{key}={value!r} in {where} is not in the tokenizer's "
                                 "vocabulary")
            return i
    return None


def load_tokenizer(source, *, bos_id=None, eos_id=None, pad_id=None):
    """A tokenizer from ``source``: ``"bytes"`` (``ByteTokenizer``), a ``tokenizer.json``
    file, a directory holding one (a model checkpoint's folder), or a llama.cpp ``.gguf``
    file (``gguf_tokenizer.gguf_tokenizer``: its ids unless overridden here).

    BOS / EOS / pad come from ``tokenizer_config.json`` or ``special_tokens_map.json`` in
    the same directory (``bos_token``, ``eos_token``, ``pad_token``); the keyword
    arguments override them.
    """
    if isinstance(source, (TextTokenizer, ByteTokenizer)):
        return source
    if isinstance(source, str) and source == "bytes":
        return ByteTokenizer()
    path = pathlib.Path(source)
    if path.suffix == ".gguf" and path.is_file():
        from jax_seqpar.data.gguf_tokenizer import gguf_tokenizer

        tok = gguf_tokenizer(path)
        ids = TextTokenizer(tok.tokenizer, bos_id=tok.bos_id if bos_id is None else bos_id,
                            eos_id=tok.eos_id if eos_id is None else eos_id,
                            pad_id=tok.pad_id if pad_id is None else pad_id)  # checked
        tok.bos_id, tok.eos_id, tok.pad_id = ids.bos_id, ids.eos_id, ids.pad_id
        return tok
    if path.is_dir():
        if (path / CONFIG_FILE).exists() and not (path / TOKENIZER_FILE).exists() and \
                json.loads((path / CONFIG_FILE).read_text()).get("tokenizer_class") == "bytes":
            return ByteTokenizer()
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise ValueError(f"tokenizer={str(source)!r}: no such tokenizer.json (give the file, "
                         "the directory holding it, or 'bytes')")
    tok = _import_tokenizers().Tokenizer.from_file(str(path))
    configs = []
    for name in (CONFIG_FILE, SPECIALS_FILE):
        if (path.parent / name).is_file():
            configs.append(json.loads((path.parent / name).read_text()))
    where = " or ".join(n for n in (CONFIG_FILE, SPECIALS_FILE)
                        if (path.parent / n).is_file())
    ids = {k: _special(configs, f"{k}_token", tok, where) for k in ("bos", "eos", "pad")}
    return TextTokenizer(tok, bos_id=ids["bos"] if bos_id is None else bos_id,
                         eos_id=ids["eos"] if eos_id is None else eos_id,
                         pad_id=ids["pad"] if pad_id is None else pad_id,
                         chat_template=_chat_template(path.parent, configs))


def _chat_template(folder: pathlib.Path, configs: list[dict]):
    """The chat template beside a ``tokenizer.json``: ``chat_template.jinja`` (newer
    transformers) or ``tokenizer_config.json``'s ``chat_template`` (a string, or a list
    of named templates: the one named ``default``); None when there is none."""
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        return (folder / CHAT_TEMPLATE_FILE).read_text()
    found = next((c["chat_template"] for c in configs if c.get("chat_template")), None)
    if isinstance(found, list):
        found = next((t.get("template") for t in found
                      if isinstance(t, dict) and t.get("name") == "default"), None)
    return found if isinstance(found, str) else None


def train_bpe(texts: Iterable[str], vocab_size: int = 512, *,
              min_frequency: int = 2) -> TextTokenizer:
    """Train a byte-level BPE on ``texts`` (in memory, offline, deterministic).

    All 256 bytes are in its alphabet, so it encodes any string and decodes it back
    exactly.  Ids 0, 1, 2 are ``<pad>``, ``<s>`` (BOS), ``</s>`` (EOS).
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or \
            vocab_size < 256 + len(BPE_SPECIALS):
        raise ValueError(f"vocab_size={vocab_size!r} must be an int >= "
                         f"{256 + len(BPE_SPECIALS)} (256 bytes + {len(BPE_SPECIALS)} "
                         "special tokens)")
    tk = _import_tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
        special_tokens=list(BPE_SPECIALS),
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts), trainer=trainer)
    return TextTokenizer(tok, pad_id=0, bos_id=1, eos_id=2)


def text_files(folder, pattern: str = "*.txt") -> list[pathlib.Path]:
    """The files of ``folder`` matching ``pattern`` (recursively), in sorted order."""
    d = pathlib.Path(folder)
    if not d.is_dir():
        raise ValueError(f"data={str(folder)!r} is not a directory")
    files = sorted(p for p in d.rglob(pattern) if p.is_file())
    if not files:
        raise ValueError(f"data={str(folder)!r} has no files matching {pattern!r}")
    return files


def read_text(path) -> str:
    """One document: the whole file, UTF-8 (a decoding error names the file)."""
    try:
        return pathlib.Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text: {e}") from e


def tokenize_files(paths: Sequence, tokenizer) -> list[np.ndarray]:
    """Token arrays of the given text files, one document per file, in order."""
    return tokenizer.encode_batch([read_text(p) for p in paths])


def tokenize_folder(folder, tokenizer, pattern: str = "*.txt") -> list[np.ndarray]:
    """Token arrays of every ``pattern`` file under ``folder``, in sorted path order."""
    return tokenize_files(text_files(folder, pattern), load_tokenizer(tokenizer))
