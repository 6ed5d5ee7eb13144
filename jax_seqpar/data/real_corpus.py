"""A corpus of long real English documents from freely licensed Debian packages.

``scripts/fetch_corpus.py`` downloads the packages at run time (nothing of them is
committed) and uses this module to turn them into one ``.txt`` file per document under
``.cache/corpus/<source>/``, which ``data.make_iterator`` / ``tokenize_folder`` read
like any folder of text files, plus a ``MANIFEST.json``.  The sources (``SOURCES``):

* ``kjv``: the King James Bible (1611; public domain), Debian ``bible-kjv-text``.  Its
  text is stored compressed for the ``bible`` program of ``bible-kjv``, which prints
  it one verse a line (``Ge1:1 In the beginning ...``); ``kjv_books`` makes one
  document per book (66), chapters headed, verses one a line without their numbers.
* ``jargon``: the Jargon File 4.4.7 (public domain, says its copyright file), Debian
  ``jargon-text``; ``jargon_sections`` makes a document of the front matter, one per
  letter of the glossary, and one of the appendices.
* ``python-docs``: the Python 3.11 documentation (PSF License Version 2; its code
  examples also Zero-Clause BSD), Debian ``python3.11-doc``; every page of prose
  (``python_doc_pages``: the tutorial, library and language references, HOWTOs, FAQs,
  "What's New", ...; not the indexes) through ``html_text.html_to_text``.

Each source names the sentence of its package's copyright file that grants the licence
(``Source.evidence``); the fetch script refuses a package whose file lacks it.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from collections.abc import Iterable, Sequence

#: The 66 books in the order the ``bible`` program prints them.
KJV_BOOKS = (
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth",
    "1 Samuel", "2 Samuel", "1 Kings", "2 Kings", "1 Chronicles", "2 Chronicles", "Ezra",
    "Nehemiah", "Esther", "Job", "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon",
    "Isaiah", "Jeremiah", "Lamentations", "Ezekiel", "Daniel", "Hosea", "Joel", "Amos",
    "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk", "Zephaniah", "Haggai", "Zechariah",
    "Malachi", "Matthew", "Mark", "Luke", "John", "Acts", "Romans", "1 Corinthians",
    "2 Corinthians", "Galatians", "Ephesians", "Philippians", "Colossians",
    "1 Thessalonians", "2 Thessalonians", "1 Timothy", "2 Timothy", "Titus", "Philemon",
    "Hebrews", "James", "1 Peter", "2 Peter", "1 John", "2 John", "3 John", "Jude",
    "Revelation")
_VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")


@dataclasses.dataclass(frozen=True)
class Source:
    """One corpus source: ``packages`` to download (the first holds the text),
    ``license`` in words, and ``evidence``: ``(file in the extracted packages, a
    sentence of it)`` that states the licence."""

    name: str
    packages: tuple
    license: str
    evidence: tuple


SOURCES = {
    "kjv": Source(
        "kjv", ("bible-kjv-text", "bible-kjv"),
        "public domain (the King James Version of 1611); the bible-kjv program that "
        "decompresses it is GPL-2+ and is run, not kept",
        ("usr/share/doc/bible-kjv-text/copyright",
         "The copyright for the King James Version text of the Bible is expired")),
    "jargon": Source(
        "jargon", ("jargon-text",), "public domain (the Jargon File 4.4.7)",
        ("usr/share/doc/jargon-text/copyright",
         "This document (the Jargon File) is in the public domain")),
    "python-docs": Source(
        "python-docs", ("python3.11-doc",),
        "PSF-2.0 (Python Software Foundation License Version 2; code examples also 0BSD)",
        ("usr/share/doc/python3.11/html/copyright.html",
         "This page is licensed under the Python Software Foundation License Version 2")),
}


def slug(name: str) -> str:
    """A file-name-safe lower-case form of ``name``."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


# --------------------------------------------------------------------------- splitting
def kjv_books(lines: Iterable[str], names: Sequence[str] = KJV_BOOKS) -> list:
    """``[(book name, text)]`` from the ``bible`` program's unformatted output (``bible
    -f``: one verse a line, ``<book><chapter>:<verse> <text>``), in order of appearance.

    A book's text is its name, then per chapter a ``Chapter N`` heading and its verses,
    one a line, without verse numbers.  Books are named from ``names`` by their order
    when the output holds exactly that many books, else by their abbreviation.
    """
    books = {}        # abbreviation -> {chapter: [verses]} (dicts keep insertion order)
    for line in lines:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        m = _VERSE.match(line)
        if m is None:
            raise ValueError(f"not a verse line of `bible -f`: {line[:80]!r}")
        abbrev, chapter, _, text = m.groups()
        books.setdefault(abbrev, {}).setdefault(int(chapter), []).append(text.strip())
    use_names = len(books) == len(names)
    out = []
    for i, (abbrev, chapters) in enumerate(books.items()):
        name = names[i] if use_names else abbrev
        parts = [name]
        for chapter, verses in chapters.items():
            parts.append(f"Chapter {chapter}\n\n" + "\n".join(verses))
        out.append((name, "\n\n".join(parts) + "\n"))
    return out


def _dedent(lines: Sequence[str]) -> str:
    """Join ``lines``, each without the file's three-space indent, blank runs squeezed."""
    text = "\n".join(line[3:] if line.startswith("   ") else line.strip() for line in lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def jargon_sections(text: str) -> list:
    """``[(name, text)]`` of the Jargon File's plain-text edition (``jargon.txt``): the
    front matter (chapters 1-12, from ``Chapter 1.`` to the ``Glossary`` heading), the
    glossary body one document per letter heading (``"0"`` for the entries before
    ``A``: numbers and symbols), and the appendices with the bibliography.  The tables
    of contents (lists of names: the file's, the glossary's, and each letter's list of
    its entries, before its first ``:entry:`` line) are left out.  No-break spaces
    become plain ones."""
    lines = text.replace("\xa0", " ").split("\n")      # no-break spaces: plain ones

    def first(pattern, start=0):
        for i in range(start, len(lines)):
            if re.fullmatch(pattern, lines[i]):
                return i
        raise ValueError(f"jargon.txt: no line matching {pattern!r} after line {start}")

    chapter1 = first(r"Chapter 1\..*")
    glossary = first(r"Glossary", chapter1)
    body = first(r"  0", glossary + 1)            # the entries after the contents list
    appendix = first(r"Appendix A\..*", body)
    out = [("front matter", _dedent(lines[chapter1:glossary]))]

    def letter(name, part):
        entry = next((j for j, line in enumerate(part) if re.match(r"\s*:[^:]+:", line)), 0)
        out.append((f"glossary {name}", _dedent(part[entry:])))

    name, start = "0", body
    for i in range(body + 1, appendix):
        m = re.fullmatch(r"  ([A-Z])", lines[i])
        if m:
            letter(name, lines[start + 1:i])
            name, start = m.group(1), i
    letter(name, lines[start + 1:appendix])
    out.append(("appendices", _dedent(lines[appendix:])))
    return out


#: Python documentation pages that are indexes or boilerplate, not prose
_PY_SKIP = re.compile(r"(^|/)(index|genindex[^/]*|py-modindex|search|contents|about|bugs|"
                      r"copyright|download|license)\.html$")


def python_doc_pages(html_root) -> list:
    """The prose pages under a Sphinx HTML tree (``.../html``), sorted: every ``.html``
    but the indexes, the search page, the tables of contents and the legal pages, and
    nothing under ``_static`` / ``_sources`` / ``_downloads`` / ``_images``."""
    root = pathlib.Path(html_root)
    pages = []
    for p in sorted(root.rglob("*.html")):
        rel = p.relative_to(root).as_posix()
        if rel.startswith("_") or _PY_SKIP.search(rel):
            continue
        pages.append(p)
    return pages


def python_docs(html_root, min_chars: int = 2000) -> list:
    """``[(name, text)]``: each page of ``python_doc_pages`` as text, named by its path
    (``library/os``), those shorter than ``min_chars`` left out."""
    from jax_seqpar.data.html_text import html_to_text

    root = pathlib.Path(html_root)
    out = []
    for p in python_doc_pages(root):
        text = html_to_text(p.read_text(encoding="utf-8"))
        if len(text) >= min_chars:
            out.append((p.relative_to(root).with_suffix("").as_posix(), text))
    return out


# --------------------------------------------------------------------------- writing
def write_documents(folder, documents: Sequence) -> list:
    """Write ``[(name, text)]`` as ``NNN_<slug>.txt`` files (in order) into ``folder``,
    after removing the ``.txt`` files already there; returns the paths."""
    d = pathlib.Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    for old in d.glob("*.txt"):
        old.unlink()
    width = max(3, len(str(len(documents))))
    paths = []
    for i, (name, text) in enumerate(documents):
        path = d / f"{i + 1:0{width}d}_{slug(name)}.txt"
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def count_tokens(paths: Sequence, tokenizer, batch: int = 64) -> list:
    """Token counts of the files, with ``tokenizer`` (``encode_batch``), in order."""
    from jax_seqpar.data.tokenize import read_text

    counts = []
    for i in range(0, len(paths), batch):
        counts += [len(t) for t in tokenizer.encode_batch([read_text(p)
                                                           for p in paths[i:i + batch]])]
    return counts


def summarize(documents: Sequence[dict], long_tokens: int = 16384) -> dict:
    """Totals of ``[{"chars", "tokens" (or None), ...}]``: documents, characters, tokens
    and documents of at least ``long_tokens`` tokens (None without token counts)."""
    tokens = [d.get("tokens") for d in documents]
    known = all(t is not None for t in tokens) and bool(tokens)
    return {"documents": len(documents), "chars": sum(d["chars"] for d in documents),
            "tokens": sum(tokens) if known else None,
            f"documents_ge_{long_tokens}_tokens":
                sum(t >= long_tokens for t in tokens) if known else None,
            "longest_tokens": max(tokens) if known else None}


def write_manifest(path, sources: Sequence[dict], tokenizer_name=None) -> dict:
    """``MANIFEST.json``: per source its packages (name, version, file, sha256), licence,
    licence evidence, documents and totals; and the totals over all sources."""
    docs = [d for s in sources for d in s["documents"]]
    manifest = {"tokenizer": tokenizer_name, "total": summarize(docs),
                "sources": [dict(s, total=summarize(s["documents"])) for s in sources]}
    pathlib.Path(path).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest
