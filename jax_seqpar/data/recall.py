"""A synthetic long-range retrieval task, in token ids (NumPy): training and needle prompts.

Vocabulary: id 0 unused, then ``keys`` key tokens, ``values`` value tokens, ``filler``
filler tokens and ``keys * values`` fact tokens (one token per (key, value) pair).

* Training sequences (``batch``): filler with ``pairs`` fact tokens scattered over the
  first half; the last ``2 * pairs`` tokens ask every key again, in a new order, each
  followed by its value.  Only the answers carry loss, and the model can only get them
  right by attending from the end back to the fact with that key, thousands of tokens
  earlier (one attention hop: each fact is one token).
* Needle prompts (``needle``): a haystack of filler of a given length with one fact at a
  given depth, ending with the key: the model's next token should be the value.  This is
  the needle-in-a-haystack test of long-context models (the fact is the needle), in the
  task's own tokens.

``examples/train_long_context.py`` trains on it; ``benchmarks/needle.py`` evaluates the
trained model, which ``--export`` saves with this task's ids in ``recall_task.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

TASK_FILE = "recall_task.json"


@dataclasses.dataclass(frozen=True)
class RecallTask:
    """Token layout of the task (see the module docstring)."""

    seq_len: int
    pairs: int = 4
    keys: int = 8
    values: int = 8
    filler: int = 32

    def __post_init__(self):
        for name in ("seq_len", "pairs", "keys", "values", "filler"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name}={val!r} must be a positive int")
        if self.pairs > self.keys:
            raise ValueError(f"pairs={self.pairs} must not exceed keys={self.keys} (keys are "
                             f"distinct within a sequence)")
        if 4 * self.pairs >= self.seq_len:
            raise ValueError(f"seq_len={self.seq_len} is too short for pairs={self.pairs}")

    @property
    def key0(self) -> int:
        return 1

    @property
    def val0(self) -> int:
        return 1 + self.keys

    @property
    def fill0(self) -> int:
        return self.val0 + self.values

    @property
    def fact0(self) -> int:
        return self.fill0 + self.filler

    @property
    def vocab(self) -> int:
        return self.fact0 + self.keys * self.values

    def batch(self, rng: np.random.Generator, batch: int):
        """Training sequences: ``tokens`` ``[B, S]`` int32 and ``loss_mask`` ``[B, S]``
        (True on the answers)."""
        S, n = self.seq_len, self.pairs
        toks = rng.integers(self.fill0, self.fill0 + self.filler, size=(batch, S))
        mask = np.zeros((batch, S), bool)
        for b in range(batch):
            keys = rng.choice(self.keys, size=n, replace=False)
            vals = rng.integers(0, self.values, size=n)
            facts = rng.choice(S // 2, size=n, replace=False)  # in the first half
            toks[b, facts] = self.fact0 + keys * self.values + vals
            order = rng.permutation(n)
            q = S - 2 * n + 2 * np.arange(n)
            toks[b, q], toks[b, q + 1] = self.key0 + keys[order], self.val0 + vals[order]
            mask[b, q + 1] = True
        return toks.astype(np.int32), mask

    def needle(self, rng: np.random.Generator, batch: int, length: int, depth: float):
        """Needle prompts ``[B, length]`` int32 and the expected next tokens ``[B]``.

        Filler, one fact at position ``round(depth * (length - 2))`` (``depth`` in
        [0, 1]: 0 at the start, 1 just before the question), and the fact's key as the
        last token.
        """
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth={depth!r} must lie in [0, 1]")
        if isinstance(length, bool) or not isinstance(length, int) or length < 2:
            raise ValueError(f"length={length!r} must be an int >= 2")
        toks = rng.integers(self.fill0, self.fill0 + self.filler, size=(batch, length))
        keys = rng.integers(0, self.keys, size=batch)
        vals = rng.integers(0, self.values, size=batch)
        at = int(round(depth * (length - 2)))
        toks[:, at] = self.fact0 + keys * self.values + vals
        toks[:, -1] = self.key0 + keys
        return toks.astype(np.int32), (self.val0 + vals).astype(np.int32)

    def save(self, directory: str) -> None:
        """Write ``recall_task.json`` into ``directory`` (beside an exported checkpoint)."""
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, TASK_FILE), "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)

    @classmethod
    def load(cls, directory: str) -> "RecallTask":
        path = os.path.join(directory, TASK_FILE)
        if not os.path.exists(path):
            raise ValueError(f"{directory!r} has no {TASK_FILE}: export the model with "
                             f"examples/train_long_context.py --export, or evaluate a text "
                             f"model with --task text")
        with open(path) as f:
            return cls(**json.load(f))


__all__ = ["RecallTask", "TASK_FILE"]
