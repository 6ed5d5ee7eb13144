"""Needle in a haystack: can the model retrieve one fact from anywhere in a long prompt?

A grid of haystack lengths x needle depths; each cell holds ``--samples`` prompts,
generated with ``jax_seqpar.models.generate`` (ring-attention prefill, tree-attention
decoding over a sequence-sharded KV cache, greedy), and its accuracy.  Writes JSON and a
heatmap PNG.  The model comes from a transformers-format checkpoint
(``models.hf.load_pretrained``):

* ``--task recall`` (default when the checkpoint has ``recall_task.json``): the
  retrieval model that ``examples/train_long_context.py --export DIR`` trains, in its own
  tokens (``data.recall.RecallTask.needle``: filler, one fact token at the depth, its key
  last; correct when the next token is the value).
* ``--task text``: a pretrained language model with its ``tokenizer.json``: the
  haystack is the repository's demo corpus (``data.write_corpus``), the needle the
  sentence "The special magic number is NNNNNNN." at the depth, the prompt ends with
  "What is the special magic number? The special magic number is"; correct when the
  seven digits appear in the ``--new-tokens`` generated tokens (LWM's single-needle test,
  ``scripts/eval_needle.py`` there, in spirit).

    python examples/train_long_context.py --steps 500 --seq-len 1024 --export /tmp/recall
    python benchmarks/needle.py --checkpoint /tmp/recall --lengths 256,512,1024,2048,4096
    python benchmarks/needle.py --checkpoint /path/to/llama --task text --lengths 8192,32768
"""

from __future__ import annotations

import argparse
import os
import time

import _setup  # noqa: F401

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

from jax_seqpar.data.recall import TASK_FILE, RecallTask  # noqa: E402
from jax_seqpar.models import Llama, generate  # noqa: E402
from jax_seqpar.models.hf import load_pretrained  # noqa: E402
from _util import accuracy_heatmap, env_info, out_dir, pyplot, save_json  # noqa: E402

NEEDLE = " The special magic number is {}. "
QUESTION = " What is the special magic number? The special magic number is"


def ints(text):
    return [int(x) for x in text.split(",") if x]


def floats(text):
    return [float(x) for x in text.split(",") if x]


class RecallPrompts:
    """Needle prompts of the retrieval task, in its tokens."""

    new_tokens = 1

    def __init__(self, checkpoint):
        self.task = RecallTask.load(checkpoint)

    def make(self, rng, samples, length, depth):
        prompts, answers = self.task.needle(rng, samples, length, depth)
        return prompts, answers

    def correct(self, out, answers):
        return out[:, 0] == answers


class TextPrompts:
    """Needle prompts in text, through the model's tokenizer."""

    def __init__(self, checkpoint, tokenizer, new_tokens, haystack_dir):
        from jax_seqpar.data import load_tokenizer, write_corpus
        self.tok = load_tokenizer(tokenizer or checkpoint)
        self.new_tokens = new_tokens
        if haystack_dir is None:
            haystack_dir = os.path.join(out_dir(), "needle_haystack")
            write_corpus(haystack_dir)
        text = "".join(open(os.path.join(haystack_dir, f)).read() + "\n"
                       for f in sorted(os.listdir(haystack_dir)) if f.endswith(".txt"))
        self.hay = np.asarray(self.tok.encode(text), np.int32)
        self.question = np.asarray(self.tok.encode(QUESTION), np.int32)

    def make(self, rng, samples, length, depth):
        rows, answers = [], []
        for _ in range(samples):
            number = str(rng.integers(1_000_000, 10_000_000))
            needle = np.asarray(self.tok.encode(NEEDLE.format(number)), np.int32)
            n_hay = length - len(needle) - len(self.question)
            if n_hay < 1:
                raise ValueError(f"length={length} leaves no room for the haystack")
            start = rng.integers(0, max(1, len(self.hay) - n_hay))
            hay = np.resize(self.hay[start:], n_hay)        # wraps around when short
            at = int(round(depth * n_hay))
            rows.append(np.concatenate([hay[:at], needle, hay[at:], self.question]))
            answers.append(number)
        return np.stack(rows), answers

    def correct(self, out, answers):
        return np.array([a in self.tok.decode(row.tolist()) for row, a in zip(out, answers)])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="transformers-format directory")
    p.add_argument("--task", choices=("recall", "text"), default=None,
                   help=f"default: recall when the checkpoint has {TASK_FILE}, else text")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (text task; default: "
                   "the checkpoint's)")
    p.add_argument("--haystack", default=None, help="folder of .txt files (text task)")
    p.add_argument("--lengths", type=ints, default=[256, 512, 1024, 2048])
    p.add_argument("--depths", type=floats, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--samples", type=int, default=8, help="prompts per cell (one batch)")
    p.add_argument("--new-tokens", type=int, default=12, help="text task")
    p.add_argument("--devices", type=int, default=None, help="default: all")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--prefill-chunk", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="needle")
    a = p.parse_args(argv)

    G = a.devices or jax.device_count()
    mesh = jax.make_mesh((G,), ("sp",), devices=jax.devices()[:G],
                         axis_types=(AxisType.Auto,))
    dtype = a.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    cfg, params = load_pretrained(a.checkpoint, mesh=mesh, dtype=dtype, params="replicated")
    model = Llama(cfg)
    task = a.task or ("recall" if os.path.exists(os.path.join(a.checkpoint, TASK_FILE))
                      else "text")
    prompts = (RecallPrompts(a.checkpoint) if task == "recall" else
               TextPrompts(a.checkpoint, a.tokenizer, a.new_tokens, a.haystack))
    rng = np.random.default_rng(a.seed)
    grid = np.zeros((len(a.lengths), len(a.depths)))
    cells = []
    print(f"needle in a haystack: task={task}, {G} devices ({jax.default_backend()}), "
          f"{a.samples} prompts per cell, {dtype}")
    for i, length in enumerate(a.lengths):
        for j, depth in enumerate(a.depths):
            toks, answers = prompts.make(rng, a.samples, length, depth)
            t0 = time.perf_counter()
            out = np.asarray(generate(model, params, toks, mesh=mesh,
                                      max_new_tokens=prompts.new_tokens,
                                      prefill_chunk=a.prefill_chunk))
            seconds = time.perf_counter() - t0
            acc = float(np.mean(prompts.correct(out, answers)))
            grid[i, j] = acc
            cells.append(dict(length=length, depth=depth, accuracy=acc, seconds=seconds))
            print(f"  length {length:7d}  depth {depth:4.2f}  accuracy {acc:.3f}  "
                  f"({seconds:.1f} s)", flush=True)
    print("\naccuracy (rows: length, columns: depth)")
    print("length  " + " ".join(f"{d:6.2f}" for d in a.depths))
    for length, row in zip(a.lengths, grid):
        print(f"{length:6d}  " + " ".join(f"{x:6.2f}" for x in row))
    out = out_dir()
    result = dict(env=env_info(), args=vars(a), task=task, devices=G, dtype=dtype,
                  lengths=a.lengths, depths=a.depths, accuracy=grid.tolist(), cells=cells)
    save_json(result, os.path.join(out, f"{a.name}.json"))
    plt = pyplot()
    if plt is not None:
        fig = accuracy_heatmap(plt, grid, a.depths, a.lengths,
                               xlabel="needle depth (0 = start of the prompt)",
                               title=f"needle in a haystack ({task}, {G} devices)")
        fig.tight_layout()
        fig.savefig(os.path.join(out, f"{a.name}.png"), dpi=120)
        print(f"wrote {os.path.join(out, a.name)}.{{json,png}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
