"""The plots of ``long_eval.py``: perplexity against position (a line per length, one
figure per variant, and the variants together at the last length, log scale) and the
passkey accuracy heatmap (length x depth) of each variant."""

from __future__ import annotations

import os

import numpy as np

from jax_seqpar.data.real_corpus import slug
from _util import accuracy_heatmap, pyplot


def _ppl_axes(ax, trained, longest, title):
    if trained and trained <= longest:
        ax.axvline(trained, color="grey", ls="--", lw=1, label="trained length")
    ax.set_yscale("log")            # past the trained length it can explode
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel("perplexity (position bucket)")
    ax.set_title(title)
    ax.legend(fontsize=8)


def _line(ax, r, label):
    e = np.asarray(r["bucket_edges"])
    ax.plot((e[:-1] + e[1:]) / 2, r["bucket_ppl"], marker="o", label=label)


def _save(plt, fig, path, written):
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)


def plot(results, a, trained, out) -> list:
    """``ppl_<variant>.png`` and ``passkey_<variant>.png`` for every variant of
    ``results`` (``long_eval.evaluate``'s), ``ppl_variants.png`` when there are several;
    ``a``: the parsed arguments (lengths, depths).  Returns the paths written (none
    without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return []
    written = []
    longest = max(a.lengths)
    for v in results:
        name = slug(v["name"])
        if v["perplexity"]:
            fig, ax = plt.subplots(figsize=(6.5, 4))
            for r in v["perplexity"]:
                _line(ax, r, f"{r['length']} tokens")
            _ppl_axes(ax, trained, longest, f"perplexity by position: {v['name']}")
            _save(plt, fig, os.path.join(out, f"ppl_{name}.png"), written)
        if v["passkey_accuracy"]:
            fig = accuracy_heatmap(plt, v["passkey_accuracy"], a.depths, a.lengths,
                                   xlabel="pass key depth (0 = start of the text)",
                                   title=f"passkey retrieval: {v['name']}")
            _save(plt, fig, os.path.join(out, f"passkey_{name}.png"), written)
    if len(results) > 1 and all(v["perplexity"] for v in results):
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for v in results:
            _line(ax, v["perplexity"][-1], v["name"])
        length = results[0]["perplexity"][-1]["length"]
        _ppl_axes(ax, trained, longest, f"perplexity by position at {length} tokens")
        _save(plt, fig, os.path.join(out, "ppl_variants.png"), written)
    return written
