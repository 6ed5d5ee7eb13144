"""Long-context evaluation of a pretrained model past its trained context (issue 40).

For each RoPE variant (``--rope-scaling`` x ``--rope-theta``, compared in one process on
the same weights, sequences and prompts) and each length of ``--lengths``:

(a) **Perplexity by position** on real documents (``scripts/fetch_corpus.py``'s corpus):
    ``--ppl-samples`` sequences of ``length`` tokens, each the start of one document
    long enough (``_ppl.Documents``), the next-token NLL of every position
    (``_ppl.token_nll_fn``: the LM head applied ``--head-block`` rows at a time on each
    device, never a ``[length, vocab]`` float32 array), averaged over the sequences in
    ``--buckets`` equal position buckets.
(b) **Passkey retrieval**: a random 5-7 digit pass key hidden in real text at each depth
    of ``--depths``, the question last, inside the model's chat template
    (``_passkey.PasskeyPrompts``), ``--passkey-samples`` prompts per cell, greedy
    generation of ``--new-tokens`` tokens (``models.generate``: ring prefill, tree
    decoding); correct when the key's digits appear.

Everything runs sequence-parallel over the devices of a 1-D mesh (``--devices``, all by
default; 2 of the 8 simulated CPU devices with ``--preset cpu``): ``Llama(config,
mesh=mesh, layout="zigzag")``, ``generate(..., mesh=mesh)``.  Writes
``long_eval.json`` (every number, the command, device, JAX version, timings) and, per
variant, ``ppl_<variant>.png`` (perplexity against position, a line per length) and
``passkey_<variant>.png`` (accuracy, length x depth), with several variants also
``ppl_variants.png`` (all of them at the last length), under ``--out``.

Variants: ``--rope-scaling`` takes ``model`` (as the checkpoint says), ``none`` (plain
RoPE), ``linear:F``, ``dynamic:F`` (NTK-aware, computed for each evaluated length, as
transformers' dynamic scaling would), ``yarn:F``; ``--rope-theta`` takes ``model`` or
numbers.  Every combination is a variant.  The trained length is the checkpoint's
``max_position_embeddings``.

    python scripts/fetch_real_model.py && python scripts/fetch_corpus.py
    python benchmarks/long_eval.py --preset cpu          # 256, 512 tokens, in a minute
    python benchmarks/long_eval.py --preset gpu          # 2k-32k, 4 variants
    python benchmarks/long_eval.py --lengths 16384,32768 --rope-scaling none,yarn:4 \\
        --rope-theta model,1e6
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

import _setup  # noqa: F401

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

from jax_seqpar.data.tokenize import load_tokenizer  # noqa: E402
from jax_seqpar.layers.rope import RopeScaling  # noqa: E402
from jax_seqpar.models import Llama, generate  # noqa: E402
from jax_seqpar.models.hf import load_pretrained  # noqa: E402
from jax_seqpar.runtime.compile_cache import (add_compile_cache_args,  # noqa: E402
                                              compile_cache_from_args,
                                              compile_cache_summary)
from _passkey import PasskeyPrompts, chat_renderer, correct  # noqa: E402
from _long_eval_plots import plot  # noqa: E402
from _ppl import Documents, bucket_edges, bucket_means, token_nll_fn  # noqa: E402
from _util import env_info, save_json  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = {
    # two of the 8 simulated CPU devices (benchmarks/_setup.py): they share the machine's
    # cores; this preset took 89 s on 8 of them (2 cores), 44-52 s on 2 and 37 s on 1
    "cpu": dict(lengths=[256, 512], ppl_samples=2, passkey_samples=1,
                rope_scaling="model", devices=2),
    "gpu": dict(lengths=[2048, 4096, 8192, 16384, 32768], ppl_samples=8, passkey_samples=4,
                rope_scaling="model,linear:4,dynamic:4,yarn:4", devices=None),
}
SCALINGS = ("linear", "dynamic", "yarn")


def ints(text):
    return [int(x) for x in text.split(",") if x]


def floats(text):
    return [float(x) for x in text.split(",") if x]


@dataclasses.dataclass(frozen=True)
class Variant:
    """One RoPE variant: ``scaling`` (``"model"``, ``"none"`` or ``"<type>:<factor>"``)
    and ``theta`` (None: the checkpoint's)."""

    scaling: str
    theta: float | None = None

    @property
    def name(self) -> str:
        return self.scaling + ("" if self.theta is None else f" theta={self.theta:g}")

    def config(self, base, length: int):
        """``base`` (a ``LlamaConfig``) with this variant's RoPE, for sequences of
        ``length`` positions (only ``dynamic`` depends on it)."""
        theta = base.rope_theta if self.theta is None else self.theta
        if self.scaling == "model":
            return dataclasses.replace(base, rope_theta=theta)
        if self.scaling == "none":
            return dataclasses.replace(base, rope_theta=theta, rope_scaling=None)
        kind, factor = self.scaling.split(":")
        trained = trained_length(base)
        extra = {"original_max_position_embeddings": trained} if kind != "linear" else {}
        if kind == "dynamic":
            extra["seq_len"] = length
        return dataclasses.replace(base, rope_theta=theta, rope_scaling=RopeScaling(
            kind, float(factor), **extra))


def trained_length(cfg) -> int:
    """The length the checkpoint was trained for: its scaling's original length when it
    has one, else ``max_position_embeddings``."""
    s = cfg.rope_scaling
    if s is not None and s.original_max_position_embeddings:
        return s.original_max_position_embeddings
    if not cfg.max_position_embeddings:
        raise ValueError("the checkpoint states no max_position_embeddings: give a "
                         "variant that needs no trained length")
    return cfg.max_position_embeddings


def parse_variants(scalings: str, thetas: str) -> list:
    """Every combination of the comma-separated ``--rope-scaling`` and ``--rope-theta``."""
    out = []
    for theta in [t for t in thetas.split(",") if t]:
        for s in [s for s in scalings.split(",") if s]:
            if s not in ("model", "none"):
                kind, _, factor = s.partition(":")
                if kind not in SCALINGS or not factor or float(factor) < 1:
                    raise ValueError(f"--rope-scaling {s!r}: give model, none or "
                                     f"{'|'.join(SCALINGS)}:FACTOR with FACTOR >= 1")
            out.append(Variant(s, None if theta == "model" else float(theta)))
    return out


def make_mesh(devices):
    G = devices or jax.device_count()
    return jax.make_mesh((G,), ("sp",), devices=jax.devices()[:G],
                         axis_types=(AxisType.Auto,))


def haystack_documents(docs: Documents, tokens: int, tokenizer) -> list:
    """The documents of ``haystack(docs, tokens, tokenizer)``, in its order."""
    sep, used, n = len(tokenizer.encode("\n\n")), [], 0
    for i in docs.order[::-1]:
        used.append(int(i))
        n += len(docs.tokens(i)) + sep
        if n >= tokens:
            break
    return used


def haystack(docs: Documents, tokens: int, tokenizer) -> np.ndarray:
    """At least ``tokens`` tokens of the corpus: documents in the reverse of their
    seeded order (the perplexity rows take theirs from the front), joined by a blank
    line; the whole corpus when it is shorter."""
    sep = np.asarray(tokenizer.encode("\n\n"), np.int32)
    return np.concatenate([x for i in haystack_documents(docs, tokens, tokenizer)
                           for x in (docs.tokens(i), sep)])


def run_perplexity(model, params, docs, length, a, sep_id):
    """Part (a) for one variant and length: the result dict (module docstring)."""
    rows, weights, info = docs.sequences(length, a.ppl_samples, sep_id)
    fn = token_nll_fn(model, a.head_block)
    nll, times = [], []
    for r in rows:
        t0 = time.perf_counter()
        nll.append(np.asarray(fn(params, r[None, :-1], r[None, 1:]))[0])
        times.append(time.perf_counter() - t0)
    nll = np.stack(nll)
    means = bucket_means(nll, weights, a.buckets)
    total = float((nll * weights).sum() / weights.sum())
    return {"length": length, "sequences": info, "bucket_edges":
            bucket_edges(length, a.buckets).tolist(), "bucket_nll": means.tolist(),
            "bucket_ppl": np.exp(means).tolist(), "nll": total, "ppl": math.exp(total),
            "first_call_seconds": times[0], "seconds": sum(times),
            "tokens_per_second": (length * (len(times) - 1) / sum(times[1:])
                                  if len(times) > 1 else None)}


def passkey_prompts(prompter, length, a):
    """The prompts of one length (the same for every variant): ``[(depth, ids, key,
    needle_at, actual_depth)]``, ``--passkey-samples`` per depth."""
    rng = np.random.default_rng((a.seed, length))
    return [(d, *prompter.make(rng, length, d)) for d in a.depths
            for _ in range(a.passkey_samples)]


def length_groups(variant, cfg, lengths, new_tokens) -> list:
    """The lengths whose passkey prompts share one ``generate`` program: consecutive
    sorted lengths with the same model config, the longest at most twice the shortest
    (the shorter prompts are right-padded to the longest, so a group costs at most 2x
    the prefill compute and saves a compilation per extra length)."""
    groups = []
    for L in sorted(lengths):
        c = variant.config(cfg, L + new_tokens)
        if groups and groups[-1][1] == c and L <= 2 * groups[-1][0][0]:
            groups[-1][0].append(L)
        else:
            groups.append(([L], c))
    return groups


def run_passkey(model, params, mesh, tokenizer, prompts, a):
    """Part (b) for one variant and a group of lengths (``prompts``: ``{length:
    passkey_prompts(...)}``): ``(cells, seconds)``, a cell per length and depth."""
    items = [(L, *p) for L in sorted(prompts) for p in prompts[L]]
    width = max(prompts)
    ids = np.zeros((len(items), width), np.int32)
    lengths = np.asarray([L for L, *_ in items], np.int32)
    for i, (L, _, row, *_) in enumerate(items):
        ids[i, :L] = row
    rows = max(1, min(len(ids), a.max_batch_tokens // width))
    outs, t0 = [], time.perf_counter()
    for i in range(0, len(ids), rows):
        take = np.arange(i, i + rows).clip(max=len(ids) - 1)   # last chunk: repeat a row
        out = generate(model, params, ids[take], mesh=mesh, max_new_tokens=a.new_tokens,
                       prompt_lengths=lengths[take])
        outs.append(np.asarray(out)[:len(ids) - i])
    seconds = time.perf_counter() - t0
    out = np.concatenate(outs)
    eos = set(model.config.eos_token_ids)
    cells = {}
    for (L, depth, _, key, at, actual), row in zip(items, out):
        toks = [int(t) for t in row]
        cut = next((j for j, t in enumerate(toks) if t in eos), len(toks))
        answer = tokenizer.decode(toks[:cut])
        cell = cells.setdefault((L, depth), {"length": L, "depth": depth, "samples": []})
        cell["samples"].append({"key": key, "answer": answer, "correct": correct(answer, key),
                                "needle_at": int(at), "depth_actual": float(actual)})
    for cell in cells.values():
        cell["accuracy"] = float(np.mean([x["correct"] for x in cell["samples"]]))
    return list(cells.values()), seconds


def evaluate(a, cfg, params, tokenizer, mesh, variants) -> dict:
    """Every variant and length; the results (without the run's metadata)."""
    docs = Documents(a.corpus, tokenizer, a.seed)
    results = []
    sep_id = getattr(tokenizer, "eos_id", None)
    prompter = None
    if a.passkey_samples:
        hay = haystack(docs, 2 * max(a.lengths), tokenizer)
        hay_docs = [docs.name(i) for i in haystack_documents(docs, 2 * max(a.lengths),
                                                             tokenizer)]
        render = None if a.no_chat else chat_renderer(tokenizer)
        prompter = PasskeyPrompts(tokenizer, hay, render)
        prompts = {L: passkey_prompts(prompter, L, a) for L in a.lengths}
    for v in variants:
        res = {"name": v.name, "scaling": v.scaling, "theta": v.theta,
               "perplexity": [], "passkey": [], "passkey_seconds": []}
        for L in a.lengths:
            vcfg = v.config(cfg, L)
            res.setdefault("rope", {})[L] = {
                "rope_theta": vcfg.rope_theta,
                "rope_scaling": None if vcfg.rope_scaling is None else
                vcfg.rope_scaling.to_dict()}
            if a.ppl_samples:
                r = run_perplexity(Llama(vcfg, mesh=mesh, layout="zigzag"), params, docs,
                                   L, a, sep_id)
                res["perplexity"].append(r)
                print(f"  {v.name:24s} {L:7d} tokens  perplexity {r['ppl']:8.3f}  by bucket "
                      + " ".join(f"{x:.2f}" for x in r["bucket_ppl"])
                      + f"  ({r['seconds']:.1f} s)", flush=True)
        if prompter is not None:
            for group, pcfg in length_groups(v, cfg, a.lengths, a.new_tokens):
                cells, seconds = run_passkey(Llama(pcfg), params, mesh, tokenizer,
                                             {L: prompts[L] for L in group}, a)
                res["passkey"] += cells
                res["passkey_seconds"].append({"lengths": group, "seconds": seconds})
                for L in group:
                    print(f"  {v.name:24s} {L:7d} tokens  passkey "
                          + " ".join(f"{c['depth']:.2f}:{c['accuracy']:.2f}"
                                     for c in cells if c["length"] == L)
                          + f"  ({seconds:.1f} s for {group})", flush=True)
        res["passkey_accuracy"] = [[next(c["accuracy"] for c in res["passkey"]
                                         if (c["length"], c["depth"]) == (L, d))
                                    for d in a.depths] for L in a.lengths] \
            if prompter is not None else None
        results.append(res)
    return {"variants": results,
            "passkey_template_tokens": None if prompter is None else
            [len(prompter.head), len(prompter.tail)],
            "passkey_haystack_documents": None if prompter is None else hay_docs}


def parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.path.join(
        REPO, ".cache", "real_models", "SmolLM2-135M-Instruct.Q4_1.gguf"),
        help="a .gguf file or a transformers checkpoint directory (default: the real "
             "model of scripts/fetch_real_model.py)")
    p.add_argument("--tokenizer", default=None, help="default: the model's (a GGUF's "
                   "metadata, a checkpoint's tokenizer.json); 'bytes' for bytes")
    p.add_argument("--corpus", default=os.path.join(REPO, ".cache", "corpus"),
                   help="folder of .txt documents (scripts/fetch_corpus.py)")
    p.add_argument("--preset", choices=tuple(PRESETS), default=None,
                   help="default: gpu on GPUs, cpu otherwise")
    p.add_argument("--lengths", type=ints, default=None, help="default: the preset's")
    p.add_argument("--depths", type=floats, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--ppl-samples", type=int, default=None,
                   help="sequences per length (0: no perplexity)")
    p.add_argument("--passkey-samples", type=int, default=None,
                   help="prompts per length and depth (0: no passkey)")
    p.add_argument("--buckets", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--rope-scaling", default=None,
                   help="comma-separated: model, none, linear:F, dynamic:F, yarn:F")
    p.add_argument("--rope-theta", default="model", help="comma-separated: model or numbers")
    p.add_argument("--devices", type=int, default=None,
                   help="default: all (the cpu preset: 2)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--head-block", type=int, default=1024, help="rows per LM-head tile")
    p.add_argument("--max-batch-tokens", type=int, default=131072,
                   help="passkey prompts per generate call: at most this many tokens")
    p.add_argument("--no-chat", action="store_true", help="plain prompts, no chat template")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="default: $OUT, else benchmarks/out/long_eval")
    add_compile_cache_args(p)  # --compile-cache DIR / --no-compile-cache
    return p


def main(argv=None):
    p = parser()
    a = p.parse_args(argv)
    preset = a.preset or ("gpu" if jax.default_backend() == "gpu" else "cpu")
    for k, v in PRESETS[preset].items():   # what the command line left unset
        if getattr(a, k) is None:
            setattr(a, k, v)
    try:
        variants = parse_variants(a.rope_scaling, a.rope_theta)
    except ValueError as e:
        p.error(str(e))
    compile_cache_from_args(a)   # a rerun of the same shapes reads its programs back
    mesh = make_mesh(a.devices)
    G = mesh.size
    bad = [L for L in a.lengths if L % (2 * G)]
    if bad:
        p.error(f"lengths {bad} must be multiples of 2 x {G} devices (zigzag layout)")
    if not os.path.exists(a.model):
        p.error(f"{a.model} is absent: python scripts/fetch_real_model.py")
    if not os.path.isdir(a.corpus):
        p.error(f"{a.corpus} is absent: python scripts/fetch_corpus.py")
    dtype = a.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    a.out = a.out or os.environ.get("OUT") or os.path.join("benchmarks", "out", "long_eval")
    t0 = time.perf_counter()
    cfg, params = load_pretrained(a.model, mesh=mesh, dtype=dtype, params="replicated",
                                  scan_layers=True)
    tokenizer = load_tokenizer(a.tokenizer or a.model)
    load_s = time.perf_counter() - t0
    print(f"long-context evaluation: {os.path.basename(a.model)}, {G} devices "
          f"({jax.default_backend()}), {dtype}, trained length "
          f"{cfg.max_position_embeddings}, preset {preset}", flush=True)
    res = evaluate(a, cfg, params, tokenizer, mesh, variants)
    total_s = time.perf_counter() - t0
    os.makedirs(a.out, exist_ok=True)
    result = dict(command=" ".join([os.path.basename(sys.executable)] + sys.argv[:1]
                                   + list(sys.argv[1:] if argv is None else argv)),
                  env=env_info(), device=str(jax.devices()[0]), devices=G, preset=preset,
                  dtype=dtype, args=vars(a), model=os.path.abspath(a.model),
                  trained_length=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
                  corpus=os.path.abspath(a.corpus), load_seconds=load_s,
                  total_seconds=total_s, compile_cache=compile_cache_summary(), **res)
    save_json(result, os.path.join(a.out, "long_eval.json"))
    pngs = plot(res["variants"], a, cfg.max_position_embeddings, a.out)
    print(f"wrote {os.path.join(a.out, 'long_eval.json')} and {len(pngs)} plots "
          f"({total_s:.1f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
