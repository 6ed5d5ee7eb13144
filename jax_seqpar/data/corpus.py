"""A small synthetic text corpus for tests and the demo run, generated from a seed.

Each document is a made-up record: a title naming a subject, a few facts about it
("The colour of Taveni is morulo."), filler prose of random length, and at the end the
same facts asked again in another order ("What is the colour of Taveni? It is
morulo.").  The answers can only be predicted by attending back to the facts, up to tens
of thousands of characters earlier, so a model trained on the corpus has a reason to use
long context.  Lengths are log-normal (median ``median_chars``), as real document
lengths roughly are, which is what makes packing worth measuring.

Everything is drawn from ``random.Random(seed)``, whose stream Python keeps stable
across versions, so the same seed writes the same bytes everywhere.  The default
corpus (48 documents) is about 150 KB.

    python -m jax_seqpar.data.corpus DIR [--documents 48] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import pathlib
import random

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "sh", "th")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")
_ATTRIBUTES = ("colour", "home", "teacher", "number", "river", "tool", "season", "song",
               "guard", "harbour", "festival", "stone")
_NOUNS = ("traveller", "market", "bridge", "lantern", "orchard", "letter", "ship", "valley",
          "clock", "garden", "library", "tower", "road", "window", "field", "storm")
_VERBS = ("crossed", "visited", "painted", "followed", "repaired", "described", "found",
          "carried", "watched", "remembered", "measured", "opened")
_ADJECTIVES = ("old", "quiet", "narrow", "bright", "distant", "heavy", "small", "green",
               "broken", "patient", "early", "hidden")
_TIMES = ("In the morning", "Later that year", "Every winter", "Long before", "At dusk",
          "On the third day", "Without warning", "By the next spring")


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables))


def _sentence(rng: random.Random, subject: str) -> str:
    a, b = rng.sample(_NOUNS, 2)
    who = subject if rng.random() < 0.3 else f"the {rng.choice(_ADJECTIVES)} {a}"
    return (f"{rng.choice(_TIMES)}, {who} {rng.choice(_VERBS)} the "
            f"{rng.choice(_ADJECTIVES)} {b}.")


def make_document(rng: random.Random, target_chars: int) -> str:
    """One record of about ``target_chars`` characters (never fewer than its facts)."""
    subject = _word(rng, 3).capitalize()
    facts = [(attr, _word(rng, 2)) for attr in rng.sample(_ATTRIBUTES, rng.randint(2, 5))]
    head = [f"Record of {subject}.", ""]
    head += [f"The {attr} of {subject} is {value}." for attr, value in facts] + [""]
    rng.shuffle(facts)
    tail = ["", "Questions."]
    tail += [f"What is the {attr} of {subject}? It is {value}." for attr, value in facts]
    budget = target_chars - sum(len(s) + 1 for s in head + tail)
    body, paragraph = [], []
    while budget > 0:
        s = _sentence(rng, subject)
        paragraph.append(s)
        budget -= len(s) + 1
        if len(paragraph) >= rng.randint(3, 7):
            body.append(" ".join(paragraph))
            paragraph = []
    if paragraph:
        body.append(" ".join(paragraph))
    return "\n".join(head + body + tail) + "\n"


def make_documents(documents: int = 48, *, seed: int = 0, median_chars: int = 2000,
                   sigma: float = 1.0, max_chars: int = 40000) -> list[str]:
    """``documents`` records with log-normal lengths (median ``median_chars``, log-sd
    ``sigma``, at most ``max_chars``)."""
    if not isinstance(documents, int) or documents < 1:
        raise ValueError(f"documents={documents!r} must be a positive int")
    if median_chars < 1 or max_chars < median_chars or sigma < 0:
        raise ValueError(f"need 1 <= median_chars={median_chars} <= max_chars={max_chars} "
                         f"and sigma={sigma} >= 0")
    rng = random.Random(seed)
    lengths = [min(max_chars, int(rng.lognormvariate(math.log(median_chars), sigma)))
               for _ in range(documents)]
    return [make_document(rng, n) for n in lengths]


def write_corpus(directory, documents: int = 48, *, seed: int = 0,
                 median_chars: int = 2000, sigma: float = 1.0) -> list[pathlib.Path]:
    """Write ``doc_000.txt``, ``doc_001.txt``, ... into ``directory`` (created if needed,
    same-named files overwritten); returns their paths."""
    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, text in enumerate(make_documents(documents, seed=seed, median_chars=median_chars,
                                            sigma=sigma)):
        p = d / f"doc_{i:03d}.txt"
        p.write_text(text, encoding="utf-8")
        paths.append(p)
    return paths


def main(argv=None):
    p = argparse.ArgumentParser(description="Write the synthetic demo corpus.")
    p.add_argument("directory")
    p.add_argument("--documents", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--median-chars", type=int, default=2000)
    args = p.parse_args(argv)
    paths = write_corpus(args.directory, args.documents, seed=args.seed,
                         median_chars=args.median_chars)
    size = sum(q.stat().st_size for q in paths)
    print(f"wrote {len(paths)} documents, {size / 1024:.0f} KiB, to {args.directory}")


if __name__ == "__main__":
    main()
