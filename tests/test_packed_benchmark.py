"""benchmarks/packed.py on CPU, the cheap parts: documents, FLOP counts, the check cases,
the layout phase (its full ``--dry-run`` takes about a minute and is run by hand)."""

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import packed  # noqa: E402


def test_documents_fill_the_sequence_and_count_their_work():
    lens = packed.lognormal_lengths(4096, 65536, seed=1)
    assert sum(lens) == 65536 and min(lens) >= 1
    seg = packed.packed_ids(lens + [100], 65536)  # longer than S: cut at S
    assert seg.shape == (65536,) and (np.diff(seg) >= 0).all()
    assert packed.useful_pairs(seg) == sum(n * n for n in lens)


def test_check_cases_read_one_global_segment_array():
    """A tile's two sides take their ids from one packed sequence, at their positions."""
    for name, (causal, qp, kp, qs, ks) in packed.check_cases(64).items():
        assert qs.shape == (2, len(qp)) and ks.shape == (2, len(kp)), name
        same = np.intersect1d(qp, kp)
        for p in same:
            np.testing.assert_array_equal(qs[:, list(qp).index(p)], ks[:, list(kp).index(p)])
    q_pos, k_pos = packed.check_cases(64)["ring_step_masked_rows"][1:3]
    assert q_pos.min() > k_pos.max()  # every key precedes every query: a ring step


def test_layout_phase_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert packed.main(["--dry-run", "--phases", "layout"]) == 0
    rows = json.loads((tmp_path / "packed_dry.json").read_text())["layout"]
    assert {r["doc_mean"] for r in rows} == {64, 256}
    assert all(r["layout"] in ("contiguous", "zigzag", "striped") for r in rows)
