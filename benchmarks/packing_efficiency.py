"""Packing efficiency of each policy (CPU, seconds): share of non-padding slots, share of
documents split, share of tokens in a piece after their document's first (trained without
the document's beginning), over window sizes.

Document lengths are log-normal (median ``--median``, log-sd 1), as in long-context
fine-tuning mixes, plus the demo corpus tokenised with its BPE.

    python benchmarks/packing_efficiency.py [--seq-len 8192 --median 1024] [--json F]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import _setup  # noqa: F401  (the repository on sys.path)
import numpy as np

from jax_seqpar.data import POLICIES, pack_documents, write_corpus  # noqa: E402


def measure(docs, seq_len, windows):
    rows = []
    for window in windows:
        for policy in POLICIES:
            t = time.perf_counter()
            rep = pack_documents(docs, seq_len, policy=policy, window=window).report
            rows.append(dict(seq_len=seq_len, window=window, policy=policy,
                             efficiency=rep.efficiency,
                             split=rep.split_documents / rep.documents,
                             continued=rep.continued_tokens / rep.tokens,
                             seconds=time.perf_counter() - t))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--median", type=int, default=1024)
    p.add_argument("--documents", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    lengths = np.maximum(1, np.exp(rng.normal(np.log(args.median), 1.0, args.documents)))
    docs = [np.zeros(int(n), np.int32) for n in lengths]
    results = [dict(r, data=f"log-normal median {args.median}")
               for r in measure(docs, args.seq_len, (64, 256, None))]
    from jax_seqpar.data import tokenize_folder, train_bpe  # needs `tokenizers`
    with tempfile.TemporaryDirectory() as d:
        texts = [q.read_text() for q in write_corpus(d)]
        corpus = tokenize_folder(d, train_bpe(texts, 512))
    results += [dict(r, data="demo corpus, BPE 512") for r in measure(corpus, 1024, (16, None))]
    print(f"{'data':<26} {'S':>6} {'window':>6} {'policy':<11} {'efficiency':>10} "
          f"{'split':>7} {'continued':>9} {'time':>7}")
    for r in results:
        print(f"{r['data']:<26} {r['seq_len']:>6} {str(r['window']):>6} {r['policy']:<11} "
              f"{r['efficiency']:>10.2%} {r['split']:>7.2%} {r['continued']:>9.2%} "
              f"{r['seconds']:>6.2f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
