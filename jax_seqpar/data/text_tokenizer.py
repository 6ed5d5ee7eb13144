"""The tokenizer interface every text source of ``jax_seqpar.data`` shares:
``encode(text) -> int32 array``, ``encode_batch``, ``decode(ids)``, ``vocab_size``,
``bos_id``, ``eos_id``, ``pad_id``, ``save(directory)``.

``TextTokenizer`` may also carry a chat template (``chat_template``, Jinja, as
transformers keeps it in ``tokenizer_config.json`` and a GGUF file in its metadata):
``render_chat(messages)`` renders a conversation with it, and ``save`` writes it back, so
a fine-tuned model's exported tokenizer keeps its base model's template.

``TextTokenizer`` wraps a ``tokenizers.Tokenizer`` (a checkpoint's ``tokenizer.json``,
``tokenize.train_bpe``'s, or one rebuilt from a GGUF file by ``gguf_tokenizer``);
``ByteTokenizer`` uses UTF-8 bytes.  ``tokenize.load_tokenizer`` picks one for a path.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

import numpy as np

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("jax_seqpar.data needs the `tokenizers` package: "
                          "pip install 'jax_seqpar[train]'") from e
    return tokenizers


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with the special ids the packer needs.

    ``bos_id`` / ``eos_id`` / ``pad_id`` are ``None`` when the tokenizer has no such token;
    ``chat_template`` is ``None`` when it has no chat template.
    """

    def __init__(self, tokenizer, *, bos_id=None, eos_id=None, pad_id=None,
                 chat_template=None):
        self.tokenizer = tokenizer
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        if chat_template is not None and not isinstance(chat_template, str):
            raise TypeError(f"chat_template must be a string (Jinja), not "
                            f"{type(chat_template).__name__}")
        self.chat_template = chat_template or None
        n = self.vocab_size
        for name, value in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad_id)):
            if value is not None and not 0 <= value < n:
                raise ValueError(f"{name}={value} is outside the vocabulary [0, {n})")

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encs = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, np.int32) for e in encs]

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in np.asarray(ids).ravel()],
                                     skip_special_tokens=False)

    def _token(self, i):
        return None if i is None else self.tokenizer.id_to_token(i)

    def render_chat(self, messages, *, add_generation_prompt: bool = True) -> str:
        """``messages`` (``[{"role": ..., "content": ...}, ...]``) rendered by the chat
        template (Jinja, in a sandbox; blocks trimmed as chat templates are written to
        be), with the generation prompt that opens the assistant's turn.  ``encode`` the
        result for the prompt's ids (the template writes the special tokens as text)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template (chat_template is None)")
        try:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:  # pragma: no cover - jinja2 ships with the [gguf] extra
            raise ImportError("render_chat needs jinja2: pip install 'jax_seqpar[gguf]'"
                              ) from None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        specials = {f"{k}_token": self._token(i) for k, i in (("bos", self.bos_id),
                                                               ("eos", self.eos_id))
                    if i is not None}
        return env.from_string(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **specials)

    def save(self, directory) -> pathlib.Path:
        """Write ``tokenizer.json`` and a ``tokenizer_config.json`` naming BOS / EOS / pad
        and holding the chat template (if any), the layout ``load_tokenizer`` (and
        transformers) read; returns the directory."""
        d = pathlib.Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(d / TOKENIZER_FILE))
        config = {k: self._token(getattr(self, f"{k[:-6]}_id"))
                  for k in ("bos_token", "eos_token", "pad_token")}
        config["chat_template"] = self.chat_template
        (d / CONFIG_FILE).write_text(json.dumps(
            {k: v for k, v in config.items() if v is not None}, indent=2) + "\n")
        return d


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0-255 are bytes, 256 is BOS, 257 EOS (vocab 258).

    Needs no training and no file, and round-trips every string; sequences are about
    four times longer than with a trained BPE on English text.
    """

    bos_id, eos_id, pad_id, vocab_size = 256, 257, None, 258

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        ids = np.asarray(ids).ravel()
        return bytes(ids[ids < 256].astype(np.uint8).tolist()).decode("utf-8", "replace")

    def save(self, directory) -> pathlib.Path:
        d = pathlib.Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / CONFIG_FILE).write_text(json.dumps({"tokenizer_class": "bytes"}) + "\n")
        return d


__all__ = ["ByteTokenizer", "TextTokenizer"]
