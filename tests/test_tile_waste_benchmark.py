"""benchmarks/tile_waste.py: the tiles of the kernels' lists and of per-document tiling,
against a count over every query-key pair."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import packed  # noqa: E402
import tile_waste  # noqa: E402


def _brute_tiles(seg, q_starts, k_starts, rows, cols, doc=None):
    """Tiles ``[q0, q0 + rows) x [k0, k0 + cols)`` holding a pair with one document (or
    document ``doc`` alone) and key <= query, over every pair (positions past the
    sequence hold none)."""
    S = len(seg)
    n = 0
    for q0 in q_starts:
        for k0 in k_starts:
            q = np.arange(q0, min(q0 + rows, S))[:, None]
            k = np.arange(k0, min(k0 + cols, S))[None, :]
            ok = (seg[q] == seg[k]) & (k <= q)
            if doc is not None:
                ok &= seg[q] == doc
            n += bool(ok.any())
    return n


@pytest.mark.parametrize("lens", [[100, 250, 162], [512], [1, 127, 129, 255]])
def test_listed_tiles_are_the_tiles_with_a_visible_pair(lens):
    S = sum(lens)
    seg = np.asarray(packed.packed_ids(lens, S))
    for rows, cols, transpose in ((128, 128, False), (128, 64, True)):
        bq, bk = (cols, rows) if transpose else (rows, cols)
        want = _brute_tiles(seg, range(0, S, bq), range(0, S, bk), bq, bk)
        assert tile_waste.listed_tiles(seg, rows, cols, transpose) == want


@pytest.mark.parametrize("lens", [[100, 250, 162], [512], [1, 127, 129, 255]])
def test_per_document_tiles_start_at_each_document(lens):
    for bq, bk in ((128, 128), (64, 128), (128, 64)):
        want = 0
        for n in lens:  # one document alone, tiles from its first token
            seg = np.zeros(n, np.int32)
            want += _brute_tiles(seg, range(0, n, bq), range(0, n, bk), bq, bk) * bq * bk
        assert tile_waste.per_document_pairs(lens, bq, bk) == want


@pytest.mark.parametrize("lens", [[100, 250, 162], [512], [1, 127, 129, 255]])
def test_steps_per_document_walk_each_document_of_a_block(lens):
    S = sum(lens)
    seg = np.asarray(packed.packed_ids(lens, S))
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    for cta, step, keys_held in ((128, 128, False), (128, 64, True)):
        want = 0
        for d, s0 in enumerate(starts):  # steps of this document from its first token
            steps = range(s0, S, step)
            q, k = ((steps, range(0, S, cta)) if keys_held else (range(0, S, cta), steps))
            bq, bk = (step, cta) if keys_held else (cta, step)
            want += _brute_tiles(seg, q, k, bq, bk, doc=d) * cta * step
        assert tile_waste.streamed_per_document_pairs(lens, S, cta, step, keys_held) == want


@pytest.mark.parametrize("lens", [[100, 250, 162], [512], [1, 127, 129, 255]])
def test_halves_paired_per_document(lens):
    S = sum(lens)
    seg = np.asarray(packed.packed_ids(lens, S))
    for half, step, keys_held in ((64, 128, False), (64, 64, True)):
        ctas = tile_waste.half_block_ctas(lens, S, half, keys_held)
        rows = [r for r0, n in ctas for r in range(r0, r0 + n * half)]
        assert rows == list(range(S))  # every row in one CTA, in order
        for r0, n in ctas:  # a CTA's halves belong to one document
            ends = [r0 + half - 1, r0 + n * half - 1] if keys_held else [r0, r0 + half]
            assert len({seg[min(i, S - 1)] for i in ends[:n]}) == 1
        own = two = 0
        for r0, n in ctas:
            live = range(r0, r0 + n * half)
            bq, bk = (step, n * half) if keys_held else (n * half, step)
            q, k = ((range(0, S, step), [r0]) if keys_held else ([r0], range(0, S, step)))
            t = _brute_tiles(seg, q, k, bq, bk)
            assert live  # (rows past S hold no pair in _brute_tiles)
            own += t * step * half * n
            two += t * step * half * 2
        assert tile_waste.half_block_pairs(lens, S, half, step, keys_held) == (own, two)


def test_main_writes_the_ratios(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert tile_waste.main(["--seq", "2048", "--doc-mean", "300"]) == 0
    res = json.loads((tmp_path / "tile_waste_2048_300.json").read_text())
    lens = packed.lognormal_lengths(300, 2048, seed=2048 + 300)
    assert res["useful_pairs"] == sum(n * (n + 1) // 2 for n in lens)
    for k in ("forward", "backward"):
        assert res[k]["aligned"] > 1 and res[k]["per_document"] > 1
    assert res["forward"]["tile"] == [128, 128] and res["backward"]["tile"] == [64, 128]
    assert "per document" in capsys.readouterr().out
    # documents on tile boundaries: the lists' tiles are the per-document ones
    assert tile_waste.main(["--seq", "2048", "--doc-mean", "300", "--round-docs", "128"]) == 0
    res = json.loads((tmp_path / "tile_waste_2048_300_r128.json").read_text())
    for k in ("forward", "backward"):
        assert res[k]["aligned"] == pytest.approx(res[k]["per_document"])

