"""Packing (jax_seqpar.data.packing): invariants on random document sets, every policy.

Documents are built from distinct token values (document i holds ``base_i + arange(L)``),
so every token of the output names its document and its offset in it; the checks then
rebuild the documents from the packed rows.
"""

import dataclasses
import zlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jax_seqpar.data import (POLICIES, PackingReport, PackOptions, pack_documents,
                             pack_rows)
from jax_seqpar.data.packing import as_document

PAD = 0


def make_docs(rng, n, seq_len, median=None, sigma=1.0, long_share=0.1):
    """``n`` documents of log-normal lengths, some longer than ``seq_len``; token values
    are distinct over all documents and never 0 (the pad id)."""
    median = median or max(1, seq_len // 4)
    lengths = np.maximum(1, np.exp(rng.normal(np.log(median), sigma, n)).astype(int))
    longs = rng.random(n) < long_share
    lengths[longs] = rng.integers(seq_len + 1, 3 * seq_len + 2, longs.sum())
    lengths[rng.random(n) < 0.05] = 0  # a few empty documents
    base = 1 + np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return [np.arange(b, b + n, dtype=np.int32) for b, n in zip(base, lengths)]


def segments(rows):
    """Every (row, segment id, column slice) of a packed batch."""
    out = []
    for r, seg in enumerate(rows["segment_ids"]):
        for s in np.unique(seg[seg > 0]):
            cols = np.flatnonzero(seg == s)
            out.append((r, int(s), slice(cols[0], cols[-1] + 1)))
    return out


def check_layout(rows, seq_len, pad_id=PAD):
    """Shapes, dtypes, segment numbering, padding at the row ends, loss_mask."""
    tok, seg, pos, mask = (rows[k] for k in ("tokens", "segment_ids", "positions", "loss_mask"))
    R = tok.shape[0]
    for a, dt in ((tok, np.int32), (seg, np.int32), (pos, np.int32), (mask, np.bool_)):
        assert a.shape == (R, seq_len) and a.dtype == dt
    np.testing.assert_array_equal(mask, seg > 0)
    assert np.all(tok[seg == 0] == pad_id) and np.all(pos[seg == 0] == 0)
    for row in seg:
        n = int((row > 0).sum())
        assert np.all(row[:n] > 0) and np.all(row[n:] == 0), "padding only at the row end"
        steps = np.diff(row[:n])
        assert n == 0 or (row[0] == 1 and np.all((steps == 0) | (steps == 1))), \
            "segments numbered 1, 2, ... in order"


def check_documents(rows, docs, options: PackOptions, report: PackingReport):
    """Each document's tokens appear exactly once (or as the policy cuts them), each
    segment is one run of one document, positions restart or continue as asked."""
    S = options.seq_len
    check_layout(rows, S, options.pad_id)
    starts = np.array([d[0] if d.size else -1 for d in docs])
    nonempty = np.flatnonzero(starts >= 0)
    pieces = {}
    for r, s, cols in segments(rows):
        v = rows["tokens"][r, cols]
        assert np.all(np.diff(v) == 1), "a segment is one consecutive run of one document"
        i = nonempty[np.searchsorted(starts[nonempty], v[0], side="right") - 1]
        offset = int(v[0] - starts[i])
        assert offset + v.size <= docs[i].size
        first = 0 if options.split_positions == "restart" else offset
        np.testing.assert_array_equal(rows["positions"][r, cols], first + np.arange(v.size))
        pieces.setdefault(i, []).append((offset, v.size, r))
    n_targets = n_continued = 0
    for i, d in enumerate(docs):
        got = sorted(pieces.get(i, []))
        n_targets += sum(n - 1 for _, n, _ in got)
        n_continued += sum(n for o, n, _ in got if o > 0)
        kept = sum(n for _, n, _ in got)
        if d.size > S and options.long_documents == "drop":
            assert not got
            continue
        want = min(d.size, S) if options.long_documents == "truncate" else d.size
        assert kept == want, (i, d.size, got)
        assert [o for o, _, _ in got] == list(np.cumsum([0] + [n for _, n, _ in got])[:-1])
        assert len({r for _, _, r in got}) == len(got), "one row holds one piece of a doc"
        if options.policy != "sequential" and 0 < d.size <= S:
            assert len(got) == 1, "the fit policies never split a document that fits"
    long = [d.size for d in docs if d.size > S]
    assert report.documents == len(docs)
    assert report.empty_documents == sum(d.size == 0 for d in docs)
    assert report.input_tokens == sum(d.size for d in docs)
    assert report.tokens == int(rows["loss_mask"].sum())
    assert report.rows == rows["tokens"].shape[0]
    assert report.pieces == sum(len(p) for p in pieces.values())
    assert report.split_documents == sum(len(p) > 1 for p in pieces.values())
    assert report.targets == n_targets
    assert report.continued_tokens == n_continued
    assert report.truncated_tokens == (sum(n - S for n in long)
                                       if options.long_documents == "truncate" else 0)
    assert report.dropped_tokens == (sum(long) if options.long_documents == "drop" else 0)
    assert report.efficiency == pytest.approx(rows["loss_mask"].mean() if report.rows else 0)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("long_documents", ["split", "truncate", "drop"])
@pytest.mark.parametrize("split_positions", ["restart", "continue"])
def test_every_token_once_segments_positions(policy, long_documents, split_positions):
    rng = np.random.default_rng(zlib.crc32(f"{policy}/{long_documents}/{split_positions}".encode()))
    for trial in range(8):
        S = int(rng.choice([8, 33, 128, 512]))
        docs = make_docs(rng, int(rng.integers(1, 120)), S)
        opts = PackOptions(S, policy=policy, long_documents=long_documents,
                           split_positions=split_positions)
        rows, report = pack_rows(docs, opts)
        check_documents(rows, docs, opts, report)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 70), max_size=40), seq_len=st.integers(1, 40),
       policy=st.sampled_from(POLICIES))
def test_packing_property(lengths, seq_len, policy):
    base = 1 + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int)
    docs = [np.arange(b, b + n, dtype=np.int32) for b, n in zip(base, lengths)]
    opts = PackOptions(seq_len, policy=policy)
    rows, report = pack_rows(docs, opts)
    check_documents(rows, docs, opts, report)


def test_sequential_is_the_stream_cut_every_seq_len():
    rng = np.random.default_rng(1)
    docs = make_docs(rng, 60, 64)
    rows, report = pack_rows(docs, PackOptions(64, policy="sequential"))
    stream = np.concatenate(docs)
    np.testing.assert_array_equal(rows["tokens"][rows["loss_mask"]], stream)
    assert rows["loss_mask"][:-1].all(), "only the last row has padding"
    assert report.rows == -(-stream.size // 64)


def test_fit_policies_fill_rows_and_best_fit_is_at_least_as_tight():
    """Log-normal lengths at seq_len 8192, as in a long-context fine-tuning mix."""
    rng = np.random.default_rng(2)
    L = np.maximum(1, np.exp(rng.normal(np.log(1024), 1.0, 512)).astype(int))
    docs = [np.ones(n, np.int32) for n in L]
    eff = {p: pack_documents(docs, 8192, policy=p).report for p in POLICIES}
    windowed = {p: pack_documents(docs, 8192, policy=p, window=128).report for p in POLICIES}
    assert eff["best_fit"].rows <= eff["first_fit"].rows
    assert all(r.efficiency > 0.99 for r in eff.values()), eff
    assert all(r.efficiency > 0.9 for r in windowed.values()), windowed
    # sequential pads only a window's last row but splits far more documents
    assert windowed["sequential"].split_documents > 5 * windowed["best_fit"].split_documents
    assert eff["best_fit"].split_documents == int((L > 8192).sum())


def test_bos_eos_wrap_each_document_and_count_towards_its_length():
    rng = np.random.default_rng(3)
    docs = make_docs(rng, 40, 32, long_share=0.2)
    BOS, EOS = 10 ** 8, 10 ** 8 + 1
    for policy in POLICIES:
        (b,), rep = pack_documents(docs, 32, policy=policy, bos_id=BOS, eos_id=EOS)
        t = b["tokens"][b["loss_mask"]]
        assert (t == BOS).sum() == len(docs) and (t == EOS).sum() == len(docs)
        assert rep.input_tokens == rep.tokens == sum(d.size + 2 for d in docs)
        for r, s, cols in segments(b):
            v = b["tokens"][r, cols]
            assert BOS not in v[1:] and EOS not in v[:-1]  # only at a document's ends


def test_batches_have_fixed_shape_and_padding_rows_are_counted():
    rng = np.random.default_rng(4)
    docs = make_docs(rng, 50, 64)
    full = pack_documents(docs, 64)
    (one,) = full.batches
    packed = pack_documents(docs, 64, batch_size=8)
    R = full.report.rows
    assert len(packed.batches) == -(-R // 8)
    assert all(b[k].shape == (8, 64) for b in packed.batches for k in b)
    assert packed.report.padding_rows == (-R) % 8
    assert packed.report.efficiency == pytest.approx(full.report.tokens /
                                                     (len(packed.batches) * 8 * 64))
    stacked = {k: np.concatenate([b[k] for b in packed.batches]) for k in one}
    for k in one:
        np.testing.assert_array_equal(stacked[k][:R], one[k])
    assert not stacked["loss_mask"][R:].any() and not stacked["segment_ids"][R:].any()
    assert pack_documents([], 64, batch_size=8).batches == ()


def test_windows_pack_independently():
    rng = np.random.default_rng(5)
    docs = make_docs(rng, 70, 48)
    whole = pack_documents(docs, 48, window=25)
    parts = [pack_documents(docs[i:i + 25], 48) for i in (0, 25, 50)]
    for k in whole.batches[0]:
        np.testing.assert_array_equal(whole.batches[0][k],
                                      np.concatenate([p.batches[0][k] for p in parts]))
    total = parts[0].report + parts[1].report + parts[2].report
    assert whole.report == total
    assert PackingReport.from_dict(total.as_dict()) == total


def test_report_counters_must_add_up():
    with pytest.raises(ValueError, match="input_tokens"):
        PackingReport(8, input_tokens=5, tokens=4)
    with pytest.raises(ValueError, match="seq_len"):
        PackingReport(8) + PackingReport(16)
    r = PackingReport(8, documents=1, input_tokens=3, tokens=3, rows=1, padding_rows=1)
    assert (r.slots, r.padding_tokens, r.efficiency) == (16, 13, 3 / 16)
    assert "efficiency 18.8%" in r.summary()


@pytest.mark.parametrize("kwargs, match", [
    (dict(seq_len=0), "seq_len"),
    (dict(seq_len=8, policy="greedy"), "policy"),
    (dict(seq_len=8, long_documents="cut"), "long_documents"),
    (dict(seq_len=8, split_positions="keep"), "split_positions"),
    (dict(seq_len=8, pad_id=-1), "pad_id"),
    (dict(seq_len=8, bos_id=2 ** 31), "bos_id"),
    (dict(seq_len=8, batch_size=0), "batch_size"),
    (dict(seq_len=8, window=0), "window"),
])
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pack_documents([np.arange(3)], **kwargs)


@pytest.mark.parametrize("documents, match", [
    ([np.zeros((2, 2), np.int32)], r"documents\[0\] must be 1-D"),
    ([np.arange(3), np.ones(3)], r"documents\[1\] must hold integer"),
    ([np.array([1, -2])], r"documents\[0\] has token ids outside"),
    (np.arange(5), "a single document goes in a list"),
    ("text", "documents must be"),
])
def test_bad_documents_are_named(documents, match):
    with pytest.raises(ValueError, match=match):
        pack_documents(documents, 8)


def test_lists_and_other_int_dtypes_are_documents():
    assert as_document([1, 2, 3]).dtype == np.int32
    (b,), rep = pack_documents([[5, 6], np.array([7], np.uint16), []], 4, policy="sequential")
    np.testing.assert_array_equal(b["tokens"], [[5, 6, 7, 0]])
    np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 2, 0]])
    assert rep.empty_documents == 1


def test_long_document_pieces_positions():
    """A document of 2.5 rows: each piece starts a row as a new segment; positions
    restart (default) or carry the piece's offset in the document."""
    doc = np.arange(1, 21, dtype=np.int32)
    for policy in POLICIES:
        (b,), rep = pack_documents([doc], 8, policy=policy)
        assert rep.split_documents == 1 and rep.pieces == 3 and rep.targets == 20 - 3
        assert rep.continued_tokens == 12
        np.testing.assert_array_equal(b["positions"][:, 0], 0)
        (c,), _ = pack_documents([doc], 8, policy=policy, split_positions="continue")
        starts = sorted(c["positions"][:, 0].tolist())
        assert starts == [0, 8, 16]
        np.testing.assert_array_equal(c["tokens"][c["loss_mask"]] - 1,
                                      c["positions"][c["loss_mask"]])
    (t,), rep = pack_documents([doc], 8, long_documents="truncate")
    np.testing.assert_array_equal(t["tokens"], [doc[:8]])
    assert (rep.truncated_documents, rep.truncated_tokens) == (1, 12)
    dropped = pack_documents([doc, doc[:3]], 8, long_documents="drop")
    assert (dropped.report.dropped_documents, dropped.report.tokens) == (1, 3)


def test_targets_never_cross_a_document_and_cover_every_inner_pair():
    """What the model does with a packed batch: ``models.llama.shift_targets``."""
    llama = pytest.importorskip("jax_seqpar.models.llama")
    rng = np.random.default_rng(6)
    docs = make_docs(rng, 30, 64, long_share=0.2)
    (b,), rep = pack_documents(docs, 64, policy="best_fit")
    targets, weights = (np.asarray(x) for x in llama.shift_targets(
        b["tokens"], loss_mask=b["loss_mask"], segment_ids=b["segment_ids"]))
    on = weights > 0
    assert on.sum() == rep.targets
    np.testing.assert_array_equal(targets[on], b["tokens"][on] + 1)  # next token, same doc
    assert np.all(b["segment_ids"][:, :-1][on[:, :-1]] == b["segment_ids"][:, 1:][on[:, :-1]])


def test_options_are_frozen():
    opts = PackOptions(16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.seq_len = 8


def test_efficiency_benchmark_runs(tmp_path):
    """benchmarks/packing_efficiency.py (small): every policy and window reported."""
    import json
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    pytest.importorskip("tokenizers")
    import packing_efficiency
    out = tmp_path / "packing.json"
    rows = packing_efficiency.main(["--seq-len", "512", "--median", "64", "--documents",
                                    "200", "--json", str(out)])
    assert json.loads(out.read_text()) == rows and len(rows) == 3 * 3 + 2 * 3
    assert all(0.5 < r["efficiency"] <= 1 and 0 <= r["continued"] < 1 for r in rows)
