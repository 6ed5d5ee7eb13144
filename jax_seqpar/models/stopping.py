"""When a generated row stops (``models.generate``'s ``eos_id``): by default
(``"model"``) at any of the model's ``config.eos_token_ids`` -- from the checkpoint's
config.json / generation_config.json, as transformers' ``generate`` stops at its
generation config's ``eos_token_id`` --; at an int or any of a sequence of ints instead;
never with ``None``.  A stopped row's later positions hold the first stop id.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, Union

import numpy as np

from jax_seqpar.models.llama import LlamaConfig

#: ``eos_id``'s default: stop at the model's ``config.eos_token_ids`` (none: never stop).
EOS_FROM_MODEL = "model"
#: What ``eos_id`` takes: ``"model"``, None, a token id or a sequence of token ids.
EosArg = Union[str, None, int, Sequence[int]]


def eos_ids_for(eos_id: EosArg, config: LlamaConfig) -> tuple:
    """The token ids that stop a row, as a tuple (``()``: no row stops), for ``eos_id``:
    ``"model"`` -> ``config.eos_token_ids``; None -> ``()``; an int or a sequence of ints
    -> those, each checked to lie in ``[0, config.vocab_size)`` (a ``ValueError`` naming
    ``eos_id``), duplicates dropped (the first stays first: it fills stopped rows)."""
    V = config.vocab_size

    def bad(what):
        return ValueError(f"eos_id={eos_id!r} {what}; eos_id takes a token id in [0, {V}) "
                          f"(vocab_size), a sequence of them, None (never stop) or "
                          f"{EOS_FROM_MODEL!r} (the model's eos_token_ids, the default)")
    if isinstance(eos_id, str):
        if eos_id != EOS_FROM_MODEL:
            raise bad("is not a recognised option")
        return tuple(config.eos_token_ids)
    if eos_id is None:
        return ()
    many = isinstance(eos_id, (Sequence, np.ndarray))
    ids = np.asarray(eos_id).reshape(-1).tolist() if isinstance(eos_id, np.ndarray) \
        else list(eos_id) if many else [eos_id]
    for i in ids:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)) \
                or not 0 <= i < V:
            raise bad(f"holds {i!r}, which is not a token id in [0, {V})" if many
                      else f"is not a token id in [0, {V})")
    return tuple(dict.fromkeys(int(i) for i in ids))


def without_token_ids(config: LlamaConfig) -> LlamaConfig:
    """``config`` without its token ids (metadata that the programs never read)."""
    if config.bos_token_id is None and not config.eos_token_ids \
            and config.pad_token_id is None:
        return config
    return dataclasses.replace(config, bos_token_id=None, eos_token_ids=(), pad_token_id=None)


__all__ = ["EOS_FROM_MODEL", "EosArg", "eos_ids_for", "without_token_ids"]
