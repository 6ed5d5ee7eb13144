"""Fetch a corpus of long real English documents (issue 40) into ``.cache/corpus/``.

    python scripts/fetch_corpus.py                 # all sources
    python scripts/fetch_corpus.py --sources kjv   # some of them

Each source of ``jax_seqpar.data.real_corpus.SOURCES`` (the King James Bible, the
Jargon File, the Python 3.11 documentation) comes from Debian packages that ``apt-get
download`` fetches into a temporary folder (no root needed, nothing installed);
``dpkg-deb -x`` unpacks them there, the licence sentence is checked in the package's
copyright file, and the documents are written one per ``.txt`` file to
``<out>/<source>/``.  ``<out>/MANIFEST.json`` records each package's version, file and
SHA-256, the licence, and every document's characters and tokens.  Token counts use
the SmolLM2 tokenizer of the real model's GGUF file when it is there
(``scripts/fetch_real_model.py``; ``--tokenizer`` for another), and the summary printed
at the end gives documents, characters, tokens and documents of 16k+ tokens.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from jax_seqpar.data.real_corpus import (SOURCES, count_tokens, jargon_sections,  # noqa: E402
                                         kjv_books, python_docs, summarize,
                                         write_documents, write_manifest)

LONG = 16384


def default_out() -> pathlib.Path:
    return pathlib.Path(os.environ.get("JAX_SEQPAR_CORPUS", REPO / ".cache" / "corpus"))


def sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download(package: str, tmp: pathlib.Path) -> dict:
    """``apt-get download`` one package into ``tmp`` and unpack it into ``tmp/<package>``;
    returns ``{"package", "version", "file", "sha256", "root"}``."""
    before = set(tmp.glob("*.deb"))
    run = subprocess.run(["apt-get", "download", "-q", package], cwd=tmp,
                         capture_output=True, text=True)   # (quiet unless it fails)
    if run.returncode:
        raise RuntimeError(f"apt-get download {package} failed ({run.returncode}):\n"
                           f"{run.stdout}{run.stderr}")
    new = sorted(set(tmp.glob(f"{package}_*.deb")) - before)
    if len(new) != 1:
        raise RuntimeError(f"apt-get download {package} gave {new}, expected one .deb")
    deb = new[0]
    version = subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], check=True,
                             capture_output=True, text=True).stdout.strip()
    root = tmp / package
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return {"package": package, "version": version, "file": deb.name, "sha256": sha256(deb),
            "root": root}


def check_license(source, root: pathlib.Path) -> str:
    """The licence sentence of ``source`` in its copyright file, or an error."""
    rel, sentence = source.evidence
    text = " ".join((root / rel).read_text(errors="replace").split())
    if sentence not in text:
        raise RuntimeError(f"{source.name}: {rel} no longer says {sentence!r}; check the "
                           "licence before using this package")
    return sentence


def kjv_documents(pkgs: dict) -> list:
    """Run the ``bible`` program on the whole text (one verse a line) and split it."""
    program = pkgs["bible-kjv"]["root"] / "usr" / "bin" / "bible"
    data = pkgs["bible-kjv-text"]["root"] / "usr" / "lib"
    out = subprocess.run([str(program), "-f", "-p", str(data), "gen1:1-rev22:21"],
                         check=True, capture_output=True, text=True,
                         stdin=subprocess.DEVNULL).stdout
    books = kjv_books(out.splitlines())
    if len(books) != 66:
        raise RuntimeError(f"the bible program printed {len(books)} books, expected 66")
    return books


def jargon_documents(pkgs: dict) -> list:
    path = pkgs["jargon-text"]["root"] / "usr/share/doc/jargon-text/jargon.txt.gz"
    return jargon_sections(gzip.decompress(path.read_bytes()).decode("utf-8"))


def python_doc_documents(pkgs: dict) -> list:
    return python_docs(pkgs["python3.11-doc"]["root"] / "usr/share/doc/python3.11/html")


MAKERS = {"kjv": kjv_documents, "jargon": jargon_documents,
          "python-docs": python_doc_documents}


def load_tokenizer_for_counts(name):
    """The tokenizer that counts tokens: ``name`` (any ``load_tokenizer`` source), else
    the real model's GGUF tokenizer when the file is there, else None."""
    from jax_seqpar.data.tokenize import load_tokenizer
    if name:
        return load_tokenizer(name), str(name)
    import fetch_real_model
    path = fetch_real_model.gguf_path()
    if path.exists():
        return load_tokenizer(path), path.name
    return None, None


def fetch(names, out: pathlib.Path, tokenizer_name=None) -> dict:
    """Fetch the named sources into ``out``; returns the manifest."""
    tok, tok_name = load_tokenizer_for_counts(tokenizer_name)
    sources = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        for name in names:
            src = SOURCES[name]
            pkgs = {p: download(p, tmp) for p in src.packages}
            evidence = check_license(src, pkgs[src.packages[0]]["root"])
            docs = MAKERS[name](pkgs)
            paths = write_documents(out / name, docs)
            counts = count_tokens(paths, tok) if tok is not None else [None] * len(paths)
            documents = [{"file": p.relative_to(out).as_posix(), "title": title,
                          "chars": len(text), "tokens": n}
                         for p, (title, text), n in zip(paths, docs, counts)]
            sources.append({"name": name, "license": src.license,
                            "license_evidence": {"file": src.evidence[0],
                                                 "says": evidence},
                            "packages": [{k: v for k, v in pkgs[p].items() if k != "root"}
                                         for p in src.packages],
                            "documents": documents})
            print_summary(name, summarize(documents))
    manifest = write_manifest(out / "MANIFEST.json", kept_sources(out, names) + sources,
                              tok_name)
    print_summary("all", manifest["total"])
    return manifest


def kept_sources(out: pathlib.Path, fetched) -> list:
    """The sources of an earlier ``MANIFEST.json`` that this run did not fetch again and
    whose folders are still there (so fetching one source keeps the others listed)."""
    path = out / "MANIFEST.json"
    if not path.exists():
        return []
    old = json.loads(path.read_text()).get("sources", [])
    return [{k: v for k, v in s.items() if k != "total"} for s in old
            if s["name"] not in fetched and (out / s["name"]).is_dir()]


def print_summary(name: str, s: dict) -> None:
    tokens = "?" if s["tokens"] is None else f"{s['tokens']:,}"
    long = s[f"documents_ge_{LONG}_tokens"]
    print(f"{name:12s} {s['documents']:5d} documents  {s['chars']:12,} characters  "
          f"{tokens:>11s} tokens  {'?' if long is None else long:>4} documents >= {LONG} "
          f"tokens  (longest {s['longest_tokens'] or '?'})", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sources", default=",".join(SOURCES),
                   help=f"comma-separated, of {', '.join(SOURCES)} (default: all)")
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="default: $JAX_SEQPAR_CORPUS or .cache/corpus")
    p.add_argument("--tokenizer", default=None, help="for the token counts (default: the "
                   "real model's GGUF when fetched)")
    a = p.parse_args(argv)
    names = [n for n in a.sources.split(",") if n]
    unknown = sorted(set(names) - set(SOURCES))
    if unknown:
        p.error(f"unknown sources {unknown}; known: {list(SOURCES)}")
    out = a.out or default_out()
    fetch(names, out, a.tokenizer)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
