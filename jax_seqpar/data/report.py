"""What packing did with the tokens it was given: ``PackingReport``.

Packing may split, cut or drop documents, and it pads what it cannot fill; none of that
is silent.  Every packer returns a report whose counters add up:
``input_tokens == tokens + truncated_tokens + dropped_tokens``, and
``slots == tokens + padding_tokens``.  Reports add (``a + b``), so a pipeline that packs
window after window keeps one running total, and they convert to and from a dict of
plain ints (``as_dict`` / ``from_dict``) so they can live in a JSON iterator state.
"""

from __future__ import annotations

import dataclasses

_COUNTERS = ("documents", "empty_documents", "input_tokens", "tokens", "rows",
             "padding_rows", "pieces", "split_documents", "continued_tokens", "targets",
             "truncated_documents", "truncated_tokens", "dropped_documents",
             "dropped_tokens")


@dataclasses.dataclass(frozen=True)
class PackingReport:
    """Counters of one packing run (or the sum of several with the same ``seq_len``).

    - ``documents``: documents read; ``empty_documents`` of them had no tokens at all.
    - ``input_tokens``: their tokens, BOS/EOS included when the packer added them.
    - ``tokens``: tokens written into rows (every one of them has ``loss_mask`` True).
    - ``rows``: rows holding at least one token; ``padding_rows``: all-padding rows added
      so that the last batch has its full shape.
    - ``pieces``: segments written (a document placed whole is one piece);
      ``split_documents``: documents written as more than one piece;
      ``continued_tokens``: tokens in the pieces after a document's first, which train
      without the document's beginning in their context.
    - ``targets``: next-token targets inside the segments, ``sum(len(piece) - 1)``: what
      the loss trains on (a split costs one target, a one-token piece has none).
    - ``truncated_*`` / ``dropped_*``: documents longer than ``seq_len`` cut to
      ``seq_len`` tokens or left out, by the ``long_documents`` policy.
    """

    seq_len: int
    documents: int = 0
    empty_documents: int = 0
    input_tokens: int = 0
    tokens: int = 0
    rows: int = 0
    padding_rows: int = 0
    pieces: int = 0
    split_documents: int = 0
    continued_tokens: int = 0
    targets: int = 0
    truncated_documents: int = 0
    truncated_tokens: int = 0
    dropped_documents: int = 0
    dropped_tokens: int = 0

    def __post_init__(self):
        if not isinstance(self.seq_len, int) or self.seq_len <= 0:
            raise ValueError(f"seq_len={self.seq_len!r} must be a positive int")
        for name in _COUNTERS:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be a non-negative int")
        lost = self.tokens + self.truncated_tokens + self.dropped_tokens
        if lost != self.input_tokens:
            raise ValueError(f"tokens + truncated_tokens + dropped_tokens = {lost} must equal "
                             f"input_tokens={self.input_tokens}")

    @property
    def slots(self) -> int:
        """Token slots of every emitted row, ``(rows + padding_rows) * seq_len``."""
        return (self.rows + self.padding_rows) * self.seq_len

    @property
    def padding_tokens(self) -> int:
        return self.slots - self.tokens

    @property
    def efficiency(self) -> float:
        """Share of the slots that hold a real token (1.0 = no padding); 0.0 with no rows."""
        return self.tokens / self.slots if self.slots else 0.0

    def __add__(self, other: "PackingReport") -> "PackingReport":
        if not isinstance(other, PackingReport):
            return NotImplemented
        if other.seq_len != self.seq_len:
            raise ValueError(f"cannot add reports of seq_len={self.seq_len} and "
                             f"seq_len={other.seq_len}")
        return PackingReport(self.seq_len, **{n: getattr(self, n) + getattr(other, n)
                                              for n in _COUNTERS})

    def as_dict(self) -> dict:
        """Plain ints only (JSON-ready); ``from_dict`` inverts it."""
        return {"seq_len": self.seq_len, **{n: int(getattr(self, n)) for n in _COUNTERS}}

    @classmethod
    def from_dict(cls, d: dict) -> "PackingReport":
        return cls(**{k: int(v) for k, v in d.items()})

    def summary(self) -> str:
        """One line for logs."""
        s = (f"{self.documents} documents, {self.tokens} tokens in "
             f"{self.rows + self.padding_rows} rows of {self.seq_len}: "
             f"efficiency {self.efficiency:.1%}, {self.split_documents} split")
        if self.truncated_documents:
            s += f", {self.truncated_documents} truncated (-{self.truncated_tokens} tokens)"
        if self.dropped_documents:
            s += f", {self.dropped_documents} dropped (-{self.dropped_tokens} tokens)"
        return s
