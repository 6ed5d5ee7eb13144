"""Perplexity by position on long real documents (``long_eval.py``, part a).

* ``Documents(folder, tokenizer, seed)``: the ``.txt`` files of a corpus folder
  (``scripts/fetch_corpus.py``), tokenized on demand and cached, visited in one seeded
  order.
* ``Documents.sequences(length, count)``: ``count`` rows of ``length + 1`` tokens, each
  the start of one document long enough (the same seeded order at every length, so the
  longer lengths reuse the shorter lengths' documents where they can); only when too
  few documents are that long, further rows pack consecutive documents (in the seeded
  order) separated by the tokenizer's EOS -- such rows say ``packed`` and the
  prediction of each separator is not scored (weight 0).
* ``token_nll_fn(model)``: per-token next-token NLL ``[B, L]`` in natural order.  The
  model gives its final hidden states in its own (zigzag) row order, sharded over its
  mesh axis; each device applies the LM head to its own rows ``block`` at a time inside
  a ``shard_map`` (float32 logits ``[block, vocab]`` at a time, never ``[L, vocab]``),
  and only the ``[B, L]`` NLL goes back to natural order.
* ``bucket_means(nll, weights, buckets)``: the weighted mean NLL of equal position
  buckets.
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_seqpar.data.tokenize import read_text, text_files
from jax_seqpar.models.llama import head_weights

F32 = jnp.float32


class Documents:
    """The documents of ``folder`` (``*.txt``, recursively), tokenized when first
    needed; ``order`` is a seeded permutation of them."""

    def __init__(self, folder, tokenizer, seed: int = 0):
        self.folder = pathlib.Path(folder)
        self.paths = text_files(folder)
        self.tokenizer = tokenizer
        self.order = np.random.default_rng(seed).permutation(len(self.paths))
        self._tokens = {}

    def name(self, i: int) -> str:
        return self.paths[i].relative_to(self.folder).as_posix()

    def tokens(self, i: int) -> np.ndarray:
        if i not in self._tokens:
            self._tokens[i] = np.asarray(self.tokenizer.encode(read_text(self.paths[i])),
                                         np.int32)
        return self._tokens[i]

    def may_hold(self, i: int, n: int) -> bool:
        """False when document ``i`` certainly has fewer than ``n`` tokens (a BPE token
        is at least one byte), so it need not be tokenized to know."""
        return self.paths[i].stat().st_size >= n

    def sequences(self, length: int, count: int, sep_id=None):
        """``(rows [count, length + 1] int32, weights [count, length] float32, info)``:
        see the module docstring.  ``info`` names each row's documents and ``packed``."""
        need = length + 1
        rows, weights, info, used = [], [], [], set()
        for i in self.order:
            if len(rows) == count:
                break
            if self.may_hold(i, need) and len(self.tokens(i)) >= need:
                rows.append(self.tokens(i)[:need])
                weights.append(np.ones(length, np.float32))
                info.append({"documents": [self.name(i)], "packed": False})
                used.add(int(i))
        rest = [int(i) for i in self.order if int(i) not in used]
        while len(rows) < count and rest:
            row, seps, names = [], [], []
            while len(row) < need and rest:
                i = rest.pop(0)
                if row and sep_id is not None:
                    seps.append(len(row))
                    row.append(int(sep_id))
                row.extend(self.tokens(i).tolist())
                names.append(self.name(i))
            if len(row) < need:
                break
            weight = np.ones(length, np.float32)
            for p in seps:                  # input p - 1 predicts the separator at p
                if p - 1 < length:
                    weight[p - 1] = 0.0
            rows.append(np.asarray(row[:need], np.int32))
            weights.append(weight)
            info.append({"documents": names, "packed": True})
        if len(rows) < count:
            raise ValueError(f"the corpus {self.folder} holds fewer than {count} sequences "
                             f"of {need} tokens, even packed")
        return np.stack(rows), np.stack(weights), info


def _local_nll(h, w, y, block: int):
    """NLL of ``y`` under ``softmax(h @ w)`` for ``h [B, n, d]``, ``y [B, n]``, ``block``
    rows at a time (float32 logits ``[block, V]``, operands in ``h``'s dtype)."""
    B, n, d = h.shape
    R = B * n
    t = min(block, R)
    pad = -R % t
    rows = jnp.pad(h.reshape(R, d), ((0, pad), (0, 0))).reshape(-1, t, d)
    ys = jnp.pad(y.reshape(R), (0, pad)).reshape(-1, t)
    w = w.astype(h.dtype)

    def tile(args):
        hc, yc = args
        z = jnp.dot(hc, w, preferred_element_type=F32)
        picked = jnp.take_along_axis(z, yc[:, None], axis=1)[:, 0]
        return jax.nn.logsumexp(z, axis=-1) - picked

    return lax.map(tile, (rows, ys)).reshape(-1)[:R].reshape(B, n)


def token_nll_fn(model, block: int = 1024):
    """A jitted ``fn(params, tokens [B, L], targets [B, L]) -> nll [B, L]`` (float32,
    natural order) for a ``models.Llama`` with or without a mesh; see the module
    docstring."""
    local = functools.partial(_local_nll, block=block)
    if model.mesh is not None:
        ax = model.axis_name
        local = jax.shard_map(local, mesh=model.mesh, in_specs=(P(None, ax, None), P(),
                                                                P(None, ax)),
                              out_specs=P(None, ax))

    @jax.jit
    def fn(params, tokens, targets):
        h = model.apply(params, tokens, layout_order=True, return_hidden=True)
        nll = local(h, head_weights(model, params), model.to_layout(targets))
        return model.from_layout(nll)

    return fn


def bucket_edges(length: int, buckets: int) -> np.ndarray:
    """``buckets + 1`` integer position edges splitting ``[0, length)`` evenly."""
    return np.linspace(0, length, buckets + 1).round().astype(int)


def bucket_means(nll, weights, buckets: int) -> np.ndarray:
    """Weighted mean of ``nll [N, L]`` over the rows and the positions of each of
    ``buckets`` equal position buckets (NaN for a bucket of weight 0)."""
    nll, weights = np.asarray(nll, np.float64), np.asarray(weights, np.float64)
    e = bucket_edges(nll.shape[1], buckets)
    out = []
    for a, b in zip(e[:-1], e[1:]):
        wsum = weights[:, a:b].sum()
        out.append((nll[:, a:b] * weights[:, a:b]).sum() / wsum if wsum else np.nan)
    return np.asarray(out)
