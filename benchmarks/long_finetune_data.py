"""The training data of the long-context fine-tuning run (issue 40, step 6): real text
without the evaluation's documents, plus passkey conversations.

``long_eval.py`` measures two things on a corpus folder: perplexity on the first
documents of a seeded order, and passkey retrieval in a haystack cut from the last
ones.  Fine-tuning on those documents would measure memory, not context, so this script
writes a training folder (one ``.txt`` per document, what ``examples/
finetune_long_context.py --data`` reads) from which they are held out:

* ``text/``: every document of ``--corpus`` that ``long_eval.py`` (same ``--seed``, up to
  ``--eval-ppl-samples`` per length of ``--eval-lengths``) neither scores nor cuts its
  haystack from, and every document of the ``--extra`` folders (other text, e.g. the
  Python documentation, never evaluated);
* ``passkey/``: conversations of ``long_eval.py``'s retrieval task (``_passkey``: the
  same instruction, needle and question in the model's chat template) whose haystack is
  cut from the training text of ``text/``, with fresh random keys, lengths drawn
  log-uniformly from ``--passkey-lengths`` and depths uniformly from 0 to 1, each ending
  with the answer ("The pass key is 48213."; the packer then closes the document with
  the tokenizer's EOS, which for a chat model ends the assistant's turn), until they
  hold ``--passkey-tokens`` tokens.

The base model cannot do this task at its own trained length (RESULTS.md: 0-10% at
4-8k), so a RoPE change alone cannot give it retrieval at 32k; LongLoRA (Chen et al.
2023, section 4.2) fine-tunes on passkey data for the same reason.  ``MANIFEST.json``
names the held-out documents and counts the tokens of each part.

    python benchmarks/long_finetune_data.py --corpus .cache/corpus \\
        --extra .cache/corpus-extra --out .cache/finetune_data
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys

import _setup  # noqa: F401

import numpy as np  # noqa: E402

from jax_seqpar.data.tokenize import load_tokenizer, read_text, text_files  # noqa: E402
from _passkey import PasskeyPrompts, chat_renderer  # noqa: E402
from _ppl import Documents  # noqa: E402
from long_eval import haystack_documents  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ints(text):
    return [int(x) for x in text.split(",") if x]


def held_out(corpus, tokenizer, lengths, ppl_samples, seed) -> list:
    """The documents of ``corpus`` that ``long_eval.py`` evaluates with these arguments:
    its perplexity rows' documents at every length and its passkey haystack's."""
    docs = Documents(corpus, tokenizer, seed)
    names = set()
    for L in lengths:
        _, _, info = docs.sequences(L, ppl_samples, getattr(tokenizer, "eos_id", None))
        names.update(n for row in info for n in row["documents"])
    names.update(docs.name(i) for i in haystack_documents(docs, 2 * max(lengths), tokenizer))
    return sorted(names)


def passkey_documents(tokenizer, haystack, lengths, tokens, seed, spread="log"):
    """``[(text, length, key, depth)]``: passkey conversations (module docstring) with
    ``tokens`` tokens in all."""
    render = chat_renderer(tokenizer)
    if render is None:
        raise ValueError("the tokenizer has no chat template: the passkey conversations "
                         "are written in it")
    prompts = PasskeyPrompts(tokenizer, haystack, render)
    rng = np.random.default_rng((seed, 40))
    lo, hi = (math.log(x) if spread == "log" else x for x in lengths)
    out, total = [], 0
    while total < tokens:
        x = rng.uniform(lo, hi)
        length = int(round(math.exp(x) if spread == "log" else x))
        ids, key, _, depth = prompts.make(rng, length, float(rng.uniform(0.0, 1.0)))
        text = tokenizer.decode(ids) + f" {key}."
        out.append((text, length, key, depth))
        total += length
    return out


def write(a) -> dict:
    tok = load_tokenizer(a.tokenizer or a.model)
    hold = held_out(a.corpus, tok, a.eval_lengths, a.eval_ppl_samples, a.seed)
    if os.path.exists(a.out):
        shutil.rmtree(a.out)
    text_dir = os.path.join(a.out, "text")
    train, counts = [], {}
    for folder, prefix in [(a.corpus, "")] + [(x, os.path.basename(os.path.normpath(x)))
                                               for x in a.extra]:
        for path in text_files(folder):
            rel = os.path.relpath(path, folder)
            if not prefix and rel.replace(os.sep, "/") in hold:
                continue
            dest = os.path.join(text_dir, prefix, rel)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copyfile(path, dest)
            train.append(dest)
    # the passkey haystack: the training text, in a seeded order, until it has enough
    order = np.random.default_rng((a.seed, 41)).permutation(len(train))
    sep = np.asarray(tok.encode("\n\n"), np.int32)
    parts, n = [], 0
    for i in order:
        ids = np.asarray(tok.encode(read_text(train[i])), np.int32)
        counts[train[i]] = len(ids)
        parts += [ids, sep]
        n += len(ids) + len(sep)
        if n >= a.haystack_tokens:
            break
    hay = np.concatenate(parts)
    keys = passkey_documents(tok, hay, a.passkey_lengths, a.passkey_tokens, a.seed,
                             a.passkey_spread)
    pk_dir = os.path.join(a.out, "passkey")
    os.makedirs(pk_dir)
    for j, (text, *_rest) in enumerate(keys):
        with open(os.path.join(pk_dir, f"{j:05d}.txt"), "w", encoding="utf-8") as f:
            f.write(text)
    text_tokens = sum(len(x) for x in tok.encode_batch([read_text(p) for p in train]))
    manifest = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "corpus": os.path.abspath(a.corpus), "extra": [os.path.abspath(x) for x in a.extra],
        "held_out": hold, "held_out_for": {"lengths": a.eval_lengths,
                                           "ppl_samples": a.eval_ppl_samples,
                                           "seed": a.seed},
        "text_documents": len(train), "text_tokens": int(text_tokens),
        "passkey_documents": len(keys), "passkey_tokens": int(sum(k[1] for k in keys)),
        "passkey_lengths": a.passkey_lengths, "passkey_spread": a.passkey_spread,
        "haystack_tokens": int(len(hay))}
    with open(os.path.join(a.out, "MANIFEST.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.path.join(
        REPO, ".cache", "real_models", "SmolLM2-135M-Instruct.Q4_1.gguf"),
        help="the model whose tokenizer and chat template to use (.gguf or a checkpoint)")
    p.add_argument("--tokenizer", default=None, help="default: the model's")
    p.add_argument("--corpus", default=os.path.join(REPO, ".cache", "corpus"),
                   help="the folder long_eval.py evaluates on (--corpus there)")
    p.add_argument("--extra", action="append", default=[],
                   help="a further folder of training text, never evaluated (repeatable)")
    p.add_argument("--eval-lengths", type=ints, default=[4096, 8192, 16384, 32768],
                   help="long_eval.py's --lengths whose documents are held out")
    p.add_argument("--eval-ppl-samples", type=int, default=8,
                   help="long_eval.py's --ppl-samples (at most) whose documents are held out")
    p.add_argument("--seed", type=int, default=0, help="long_eval.py's --seed")
    p.add_argument("--passkey-tokens", type=int, default=2_000_000)
    p.add_argument("--passkey-lengths", type=ints, default=[1024, 32704],
                   help="shortest,longest conversation in tokens (leave room for the answer and "
                        "EOS below the training length: a longer one would be split)")
    p.add_argument("--passkey-spread", choices=("log", "uniform"), default="log",
                   help="conversation lengths drawn log-uniformly (as many short as long) "
                        "or uniformly (most tokens at long lengths)")
    p.add_argument("--haystack-tokens", type=int, default=400_000,
                   help="training text the passkey haystacks are cut from")
    p.add_argument("--out", default=os.path.join(REPO, ".cache", "finetune_data"))
    return p


def main(argv=None):
    p = parser()
    a = p.parse_args(argv)
    if len(a.passkey_lengths) != 2 or not 0 < a.passkey_lengths[0] <= a.passkey_lengths[1]:
        p.error(f"--passkey-lengths={a.passkey_lengths} must be shortest,longest")
    for folder in [a.corpus] + a.extra:
        if not os.path.isdir(folder):
            p.error(f"{folder} is not a folder (python scripts/fetch_corpus.py)")
    m = write(a)
    print(f"wrote {a.out}: {m['text_documents']} documents of text ({m['text_tokens']:,} "
          f"tokens; {len(m['held_out'])} held out for long_eval.py), "
          f"{m['passkey_documents']} passkey conversations ({m['passkey_tokens']:,} tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
