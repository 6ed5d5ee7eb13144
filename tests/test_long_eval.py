"""The long-context evaluation (issue 40) on a tiny random model, and the corpus
builder's splitting on small synthetic inputs (no network, no real model):

* ``benchmarks/_ppl.py``: the per-token NLL of the tiled, sequence-sharded LM head
  (2 devices, zigzag) equals a direct full-logits ``log_softmax`` on one device, and
  the bucket means equal direct means; long-enough documents are preferred and the
  packed fallback leaves the separators unscored;
* ``benchmarks/_passkey.py``: the prompt has the requested length, the key's sentence
  at the requested depth, the template around it;
* ``benchmarks/long_eval.py`` end to end (one device, byte tokens, no plots): the JSON
  holds every number; its RoPE variants change only the RoPE fields;
* ``benchmarks/long_finetune_data.py``: the fine-tuning data lacks the evaluated
  documents; its passkey conversations end with their keys;
* ``jax_seqpar.data.real_corpus`` / ``html_text`` (what ``scripts/fetch_corpus.py``
  runs): Bible verses to books, the Jargon File to sections, a Sphinx page to text, the
  documents written where ``data.tokenize_folder`` reads them; the licence sentence is
  checked.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "scripts"))

import _passkey  # noqa: E402
import _ppl  # noqa: E402
import fetch_corpus  # noqa: E402
from jax_seqpar.data import real_corpus  # noqa: E402
from jax_seqpar.data.html_text import html_to_text  # noqa: E402
from jax_seqpar.data.tokenize import ByteTokenizer, tokenize_folder  # noqa: E402
from jax_seqpar.models import Llama  # noqa: E402
from jax_seqpar.models.hf import load_pretrained  # noqa: E402

FIXTURE = REPO / "tests" / "fixtures" / "hf" / "llama_plain"   # vocab 128: ASCII bytes
PROSE = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles "
         "begins with a single step! Where there is smoke, is there fire? ")


def mesh(G):
    return jax.make_mesh((G,), ("sp",), devices=jax.devices()[:G],
                         axis_types=(jax.sharding.AxisType.Auto,))


def write_corpus(folder, sizes):
    folder.mkdir(parents=True, exist_ok=True)
    for i, n in enumerate(sizes):
        (folder / f"doc{i}.txt").write_text((f"Document {i}. " + PROSE * 40)[:n])
    return folder


def test_token_nll_and_buckets_equal_full_logits(tmp_path):
    cfg, params = load_pretrained(FIXTURE, mesh=mesh(2), dtype="float32",
                                  params="replicated", scan_layers=True)
    sizes = [20, 100, 50]
    docs = _ppl.Documents(write_corpus(tmp_path, sizes), ByteTokenizer(), seed=1)
    rows, weights, info = docs.sequences(32, 1)
    first = next(int(i) for i in docs.order if sizes[i] >= 33)  # long enough, seeded order
    assert info == [{"documents": [f"doc{first}.txt"], "packed": False}]
    assert np.array_equal(rows[0], ByteTokenizer().encode(docs.paths[first].read_text())[:33])
    tokens, targets = rows[:, :-1], rows[:, 1:]
    nll = np.asarray(_ppl.token_nll_fn(Llama(cfg, mesh=mesh(2), layout="zigzag"),
                                       block=5)(params, tokens, targets))
    logits = Llama(cfg).apply(params, jnp.asarray(tokens)).astype(jnp.float32)
    want = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits, -1)),
                               targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(nll, want, rtol=1e-5, atol=1e-5)
    means = _ppl.bucket_means(nll, weights, 4)
    np.testing.assert_allclose(means, want.reshape(4, 8).mean(1), rtol=1e-5)

    packed_rows, packed_w, packed_info = docs.sequences(64, 2, sep_id=0)
    rest = [int(i) for i in docs.order if i != 1]              # doc1 alone has 65 bytes
    assert [r["packed"] for r in packed_info] == [False, True]
    assert packed_info[1]["documents"] == [f"doc{i}.txt" for i in rest]
    sep = sizes[rest[0]]                       # the first document, then the separator
    assert packed_rows[1, sep] == 0 and packed_w[1, sep - 1] == 0
    assert packed_w[1].sum() == 63


def test_passkey_prompt_puts_the_key_at_the_depth():
    tok = ByteTokenizer()
    hay = tok.encode("It rains. We sing! Why not? " * 30)
    prompter = _passkey.PasskeyPrompts(tok, hay, lambda m: f"<user>{m[0]['content']}<bot>")
    rng = np.random.default_rng(0)
    for depth in (0.0, 0.5, 1.0):
        ids, key, at, actual = prompter.make(rng, 600, depth)
        text = tok.decode(ids)
        needle = _passkey.NEEDLE.format(key=key)
        assert len(ids) == 600 and 5 <= len(key) <= 7
        assert text.startswith("<user>" + _passkey.INTRO) and text.endswith(
            _passkey.QUESTION + "<bot>" + _passkey.ANSWER)   # the answer opened
        assert tok.decode(ids[at:at + len(needle)]) == needle and text.count(key) == 2
        assert abs(actual - depth) <= 0.03
        if 0 < depth < 1:                     # moved to a sentence end
            assert tok.decode(ids[at - 1:at]) in ".!?"
    assert _passkey.correct("The pass key is 48213.", "48213")
    assert not _passkey.correct("The pass key is 482130", "48213")


def test_long_eval_writes_every_number(tmp_path, monkeypatch):
    import _long_eval_plots
    import long_eval
    monkeypatch.setattr(_long_eval_plots, "pyplot", lambda: None)  # no matplotlib: fast
    corpus = write_corpus(tmp_path / "corpus", [700, 900])
    out = tmp_path / "out"
    assert long_eval.main(["--model", str(FIXTURE), "--tokenizer", "bytes", "--corpus",
                           str(corpus), "--lengths", "320", "--depths", "0,1",
                           "--ppl-samples", "1", "--passkey-samples", "1", "--devices", "1",
                           "--new-tokens", "2", "--buckets", "4", "--rope-scaling",
                           "model", "--out", str(out)]) == 0
    res = json.loads((out / "long_eval.json").read_text())
    assert res["env"]["jax"] == jax.__version__ and res["devices"] == 1
    assert "long_eval" in res["command"] and res["total_seconds"] > 0
    (v,) = res["variants"]
    (ppl,) = v["perplexity"]
    assert ppl["length"] == 320 and len(ppl["bucket_ppl"]) == 4
    assert np.isclose(ppl["ppl"], np.exp(np.mean(ppl["bucket_nll"])), rtol=1e-4)
    assert [(c["length"], c["depth"]) for c in v["passkey"]] == [(320, 0.0), (320, 1.0)]
    assert len(v["passkey_accuracy"]) == 1 and len(v["passkey_accuracy"][0]) == 2
    assert all(len(c["samples"]) == 1 and c["samples"][0]["key"] for c in v["passkey"])


def test_finetune_data_holds_out_the_evaluated_documents(tmp_path):
    """``long_finetune_data.py``: the training folder lacks exactly the documents that
    ``long_eval.py`` scores or cuts its haystack from, keeps the others and the extra
    folders, and its passkey conversations (chat template, sizes in the range) end with
    their own key."""
    pytest.importorskip("jinja2")
    import long_eval
    import long_finetune_data
    from jax_seqpar.data.tokenize import load_tokenizer, train_bpe

    tok = train_bpe([PROSE * 4, "0123456789 pass key Remember quiz"], 400)
    tok.chat_template = ("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
                         "{% if add_generation_prompt %}<s>{% endif %}")
    tok.save(tmp_path / "tok")
    corpus = write_corpus(tmp_path / "corpus", [3000, 2500, 400, 2800, 900, 3200])
    extra = tmp_path / "more"
    extra.mkdir()
    for i in range(2):
        (extra / f"doc{i}.txt").write_text(f"Extra {i}. " + PROSE[::-1] * 12)
    out = tmp_path / "out"
    assert long_finetune_data.main([
        "--tokenizer", str(tmp_path / "tok"), "--corpus", str(corpus), "--extra",
        str(extra), "--eval-lengths", "256,512", "--eval-ppl-samples", "1",
        "--passkey-tokens", "3000", "--passkey-lengths", "300,600", "--haystack-tokens",
        "1500", "--out", str(out)]) == 0
    tok = load_tokenizer(tmp_path / "tok")
    docs = _ppl.Documents(corpus, tok, 0)
    want = {n for L in (256, 512) for row in docs.sequences(L, 1, tok.eos_id)[2]
            for n in row["documents"]}
    want |= {docs.name(i) for i in long_eval.haystack_documents(docs, 1024, tok)}
    m = json.loads((out / "MANIFEST.json").read_text())
    assert set(m["held_out"]) == want and 0 < len(want) < 6
    kept = {p.relative_to(out / "text").as_posix() for p in (out / "text").rglob("*.txt")}
    assert kept == ({f"doc{i}.txt" for i in range(6)} - want) | {"more/doc0.txt",
                                                                 "more/doc1.txt"}
    conversations = sorted((out / "passkey").glob("*.txt"))
    assert len(conversations) == m["passkey_documents"] >= 5
    assert m["passkey_tokens"] >= 3000
    held_text = [(corpus / n).read_text()[:60] for n in want]
    for path in conversations:
        text = path.read_text()
        key = text.rsplit(_passkey.ANSWER, 1)[1].strip().rstrip(".")
        assert text.startswith("<s>" + _passkey.INTRO) and key.isdigit()
        assert _passkey.NEEDLE.format(key=key).strip() in text
        assert 300 <= len(tok.encode(text)) <= 600 + 8
        assert not any(h in text for h in held_text)


def test_variants_change_only_the_rope():
    import long_eval
    cfg, _ = load_pretrained(FIXTURE, params="replicated")   # trained length 256
    v = long_eval.parse_variants("none,linear:2,dynamic:4,yarn:8", "model,1e6")
    assert [x.name for x in v][:4] == ["none", "linear:2", "dynamic:4", "yarn:8"]
    assert v[4].name == "none theta=1e+06" and v[4].config(cfg, 512).rope_theta == 1e6
    dyn = v[2].config(cfg, 1024).rope_scaling
    assert (dyn.rope_type, dyn.factor, dyn.seq_len, dyn.original_max_position_embeddings) \
        == ("dynamic", 4.0, 1024, 256)
    assert v[3].config(cfg, 1024).d_model == cfg.d_model
    with pytest.raises(ValueError):
        long_eval.parse_variants("rope:2", "model")


def test_kjv_books_from_bible_output():
    lines = ["Ge1:1 In the beginning.", "Ge1:2 And the earth.", "Ge2:1 Thus the heavens.",
             "Exo1:1 Now these are the names.", ""]
    books = fetch_corpus.kjv_books(lines)
    assert [b[0] for b in books] == ["Ge", "Exo"]            # not 66 books: abbreviations
    assert books[0][1] == ("Ge\n\nChapter 1\n\nIn the beginning.\nAnd the earth.\n\n"
                           "Chapter 2\n\nThus the heavens.\n")
    named = fetch_corpus.kjv_books(lines, names=("Genesis", "Exodus"))
    assert named[1][1].startswith("Exodus\n\nChapter 1\n\nNow these")
    with pytest.raises(ValueError):
        fetch_corpus.kjv_books(["not a verse"])


def test_jargon_sections():
    text = "\n".join([
        "                                The Jargon File", "   Table of Contents",
        "   Glossary", "Chapter 1. Hacker Slang", "", "   Hackers talk.", "Glossary", "",
        "   0", "", "   A", "", "   abbrev", "  0", "", "   /dev/null", "",
        "   :/dev/null: n.", "   A sink.", "  A", "", "   abbrev", "", "   :abbrev: n.",
        "   Short\u00a0form.", "Appendix\u00a0A. Hacker Folklore", "   Koans."])
    sections = fetch_corpus.jargon_sections(text)
    assert [s[0] for s in sections] == ["front matter", "glossary 0", "glossary A",
                                        "appendices"]
    assert sections[0][1] == "Chapter 1. Hacker Slang\n\nHackers talk.\n"
    assert sections[1][1] == ":/dev/null: n.\nA sink.\n"      # the name list left out
    assert sections[2][1] == ":abbrev: n.\nShort form.\n"
    assert sections[3][1] == "Appendix A. Hacker Folklore\nKoans.\n"


def test_html_to_text_and_pages(tmp_path):
    page = ("<html><head><title>T</title><script>var x;</script></head><body>"
            "<div class='nav'>Navigation</div><div class='body' role='main'>"
            "<h1>Built-in Types<a class='headerlink' href='#'>\u00b6</a></h1>"
            "<p>Some  text\n with   spaces &amp; entities.</p><ul><li><p>one</p></li>"
            "<li>two</li></ul><table><tr><th>Op</th><th>Result</th></tr>"
            "<tr><td><p>x or y</p></td><td>y</td></tr></table>"
            "<pre>def f():\n    return 1\n</pre></div><div>Footer</div></body></html>")
    assert html_to_text(page) == ("Built-in Types\n\nSome text with spaces & entities.\n\n"
                                  "* one\n\n* two\n\nOp | Result\nx or y | y\n\n"
                                  "def f():\n    return 1\n")
    html = tmp_path / "html"
    for rel in ("library/os.html", "library/index.html", "genindex-A.html", "search.html",
                "_static/x.html", "tutorial/classes.html"):
        (html / rel).parent.mkdir(parents=True, exist_ok=True)
        (html / rel).write_text(page)
    got = [p.relative_to(html).as_posix() for p in real_corpus.python_doc_pages(html)]
    assert got == ["library/os.html", "tutorial/classes.html"]
    docs = fetch_corpus.python_docs(html, min_chars=10)
    assert [d[0] for d in docs] == ["library/os", "tutorial/classes"]
    paths = fetch_corpus.write_documents(tmp_path / "corpus" / "python-docs", docs)
    assert [p.name for p in paths] == ["001_library_os.txt", "002_tutorial_classes.txt"]
    toks = tokenize_folder(tmp_path / "corpus", "bytes")
    assert [len(t) for t in toks] == [len(d[1].encode()) for d in docs]
    s = fetch_corpus.summarize([{"chars": 5, "tokens": 20000}, {"chars": 7, "tokens": 3}])
    assert (s["documents"], s["chars"], s["tokens"], s["documents_ge_16384_tokens"]) == \
        (2, 12, 20003, 1)
    assert os.path.exists(paths[0])


def test_license_sentence_is_checked(tmp_path):
    src = real_corpus.Source("x", ("x-text",), "public domain",
                             ("usr/share/doc/x/copyright", "is in the public domain"))
    (tmp_path / "usr/share/doc/x").mkdir(parents=True)
    (tmp_path / "usr/share/doc/x/copyright").write_text("This text is in the\npublic domain.")
    assert fetch_corpus.check_license(src, tmp_path) == "is in the public domain"
    (tmp_path / "usr/share/doc/x/copyright").write_text("All rights reserved.")
    with pytest.raises(RuntimeError, match="no longer says"):
        fetch_corpus.check_license(src, tmp_path)
