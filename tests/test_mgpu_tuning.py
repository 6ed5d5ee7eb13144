"""The Hopper kernel's tuned tiles (``kernels/mgpu_tuning.py``): the table's keys, its
validation and fallbacks, the candidates, the tuner's ranking, how ``PallasMgpuKernel``
picks a config, and ``benchmarks/mgpu_tune.py``'s merge into a table.  The timing itself
runs on a GPU (RESULTS.md, "Hopper tiles by measurement")."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from jax_seqpar.kernels import PallasMgpuKernel
from jax_seqpar.kernels import mgpu_tuning as mt
from jax_seqpar.kernels import pallas_mgpu
from jax_seqpar.kernels.pallas_mgpu_common import (DEFAULT_MGPU_CONFIGS, SMEM_LIMIT,
                                                   MgpuConfig, backward_smem_bytes,
                                                   forward_smem_bytes)
from jax_seqpar.masks import MaskSpec

GPU = "nvidia_h200"


def _entry(**fwd_bwd):
    fwd = {k: v for k, v in fwd_bwd.items() if k in mt.FWD_FIELDS}
    bwd = {k: v for k, v in fwd_bwd.items() if k in mt.BWD_FIELDS}
    return {"fwd": fwd, "bwd": bwd}


def test_keys():
    assert mt.gpu_key("NVIDIA H200") == "nvidia_h200"
    assert mt.gpu_key("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    assert mt.table_key(GPU, "bfloat16", 128, "aligned", "causal") == \
        "nvidia_h200/bfloat16/d128/aligned/causal"
    with pytest.raises(ValueError, match="tile="):
        mt.table_key(GPU, "bfloat16", 128, "diagonal", "causal")
    with pytest.raises(ValueError, match="mask="):
        mt.table_key(GPU, "bfloat16", 128, "aligned", "window")
    assert mt.table_key(GPU, "float16", 64, "general", "segments").endswith("general/segments")
    with pytest.raises(ValueError, match="head_dim=96"):
        mt.table_key(GPU, "bfloat16", 96, "aligned", "causal")
    with pytest.raises(ValueError, match="empty"):
        mt.gpu_key("--")


def test_parse_table_refuses_what_the_kernel_would():
    good = {"entries": {"k": _entry(block_kv=64, num_stages=3, overlap_bwd=True)}}
    assert mt.parse_table(good)["k"]["fwd"] == {"block_kv": 64, "num_stages": 3}
    with pytest.raises(ValueError, match="no 'entries'"):
        mt.parse_table({})
    with pytest.raises(ValueError, match="unknown fields"):
        mt.parse_table({"entries": {"k": {"fwd": {"block_q_bwd": 64}}}})
    with pytest.raises(ValueError, match="multiple of 64"):
        mt.parse_table({"entries": {"k": _entry(block_kv=100)}})
    with pytest.raises(ValueError, match="must be an object"):
        mt.parse_table({"entries": {"k": [1]}})


def test_lookup_fallbacks():
    aligned = mt.table_key(GPU, "bfloat16", 128, "aligned", "causal")
    dense = mt.table_key(GPU, "bfloat16", 128, "dense", "none")
    table = mt.parse_table({"entries": {aligned: _entry(block_kv=64, num_stages=4),
                                        dense: _entry(block_kv=192, block_q_bwd=128)}})
    base = DEFAULT_MGPU_CONFIGS[128]
    cfg, src = mt.lookup(GPU, "bfloat16", 128, "aligned", "causal", table)
    assert src == aligned
    assert cfg == dataclasses.replace(base, block_kv=64, num_stages=4)  # the rest default
    # a general tile takes the aligned entry of its mask; no mask takes the dense entry
    assert mt.lookup(GPU, "bfloat16", 128, "general", "causal", table)[1] == aligned
    assert mt.lookup(GPU, "bfloat16", 128, "general", "none", table)[1] == dense
    assert mt.lookup(GPU, "bfloat16", 128, "aligned", "none", table)[0] == \
        dataclasses.replace(base, block_kv=192, block_q_bwd=128)
    # another GPU, dtype or head dim: the per-head-dim default
    for args in (("nvidia_h100", "bfloat16", 128), (GPU, "float16", 128), (GPU, "bfloat16", 64)):
        cfg, src = mt.lookup(*args, "aligned", "causal", table)
        assert (cfg, src) == (DEFAULT_MGPU_CONFIGS[args[2]], "default")


def test_committed_table_loads_and_fits_shared_memory():
    table = mt.load_table()
    assert len(table) >= 4, "the committed table (kernels/mgpu_tuned.json) is missing"
    for key in table:
        gpu, dtype, d, tile, mask = key.split("/")
        cfg, src = mt.lookup(gpu, dtype, int(d[1:]), tile, mask, table)
        assert src == key
        assert forward_smem_bytes(cfg, cfg_d := int(d[1:]), dtype) <= SMEM_LIMIT
        assert backward_smem_bytes(cfg, cfg_d, dtype) <= SMEM_LIMIT


@pytest.mark.parametrize("D", [64, 128])
def test_candidates_fit_and_vary(D):
    fwd, bwd = mt.forward_candidates(D), mt.backward_candidates(D)
    assert len(set(fwd)) == len(fwd) >= 4 and len(set(bwd)) == len(bwd) >= 3
    assert all(forward_smem_bytes(c, D, "bfloat16") <= SMEM_LIMIT for c in fwd)
    assert all(backward_smem_bytes(c, D, "bfloat16") <= SMEM_LIMIT for c in bwd)
    assert len({c.block_kv for c in fwd}) >= (3 if D == 64 else 2)
    assert len({c.num_stages for c in fwd}) >= 2
    if D == 128:  # Mosaic GPU refused these two on an H200 (232,568 / 232,536 bytes)
        tried = {(c.block_kv, c.num_stages) for c in fwd}
        assert (128, 3) not in tried and (192, 2) not in tried and (128, 2) in tried
    assert {c.atomic_dq for c in bwd} == {False, True}
    # the pipelined forward beside each tiling of at most 128 keys, and only there
    assert {c.block_kv for c in fwd if c.overlap_fwd} == {c.block_kv for c in fwd} & {64, 128}
    assert {(c.block_kv, c.num_stages) for c in fwd if c.overlap_fwd} == {
        (c.block_kv, c.num_stages) for c in fwd if not c.overlap_fwd and c.block_kv <= 128}


@pytest.mark.parametrize("D", [64, 128])
def test_fused_backward_is_a_candidate_from_d128(D):
    """``row_scores`` (the fused backward by query row) is tried from D 128, with and
    without ``dv_with_dp``, on the tiling it was measured with; its field reaches the
    table (``BWD_FIELDS``), and a table entry may pick it."""
    fused = [c for c in mt.backward_candidates(D) if c.row_scores]
    if D == 64:
        assert fused == []
        return
    assert {c.dv_with_dp for c in fused} == {False, True}
    assert all((c.block_q_bwd, c.block_kv_bwd, c.num_stages_bwd, c.atomic_dq, c.split_dq)
               == (64, 64, 2, True, True) for c in fused)
    assert "row_scores" in mt.BWD_FIELDS
    key = f"{GPU}/bfloat16/d128/aligned/segments"
    table = mt.parse_table({"entries": {key: {"fwd": {}, "bwd": mt.fields_of(
        fused[0], mt.BWD_FIELDS)}}})
    cfg, src = mt.lookup(GPU, "bfloat16", 128, "aligned", "segments", table)
    assert src == key and cfg.row_scores and cfg.early_dq and not cfg.dv_with_dp
    causal, _ = mt.lookup(GPU, "bfloat16", 128, "aligned", "causal", table)
    assert not causal.row_scores  # other classes keep their own
    # with segment ids, each fused candidate also launched document by document
    seg = mt.backward_candidates(D, segments=True)
    assert seg[:len(mt.backward_candidates(D))] == mt.backward_candidates(D)
    assert [c for c in seg if c.doc_order_bwd] == [
        dataclasses.replace(c, doc_order_bwd=True) for c in fused]
    assert not any(c.doc_order_bwd for c in mt.backward_candidates(D))
    assert "doc_order_bwd" in mt.BWD_FIELDS


def test_sustained_timer_reads_calls_per_window_in_alternation():
    """``sustained_timer``: each candidate back to back for the window, in a fresh order
    each round; milliseconds per call, the median over the rounds."""
    now, calls = [0.0], []

    def run(name, ms):
        def f():
            calls.append(name)
            now[0] += ms / 1e3
        return f
    timer = mt.sustained_timer(0.1, clock=lambda: now[0])
    got = timer({"a": run("a", 2.0), "b": run("b", 30.0)}, rounds=3)
    assert got == pytest.approx({"a": 2.0, "b": 30.0})
    assert calls.count("a") == 3 * 50 and calls.count("b") == 3 * 4  # 0.1 s windows
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="window_s"):
            mt.sustained_timer(bad)


def test_autotune_ranks_by_the_timer_and_reports_failures():
    cands = mt.forward_candidates(64)[:4]
    cost = {c: 10.0 - i for i, c in enumerate(cands)}
    failed = []

    def build(cfg):
        if cfg == cands[1]:
            raise RuntimeError("does not compile")
        return lambda: None

    ranked = mt.autotune(cands, build, rounds=3, on_error=lambda c, e: failed.append(c),
                         timer=lambda runs, rounds: {c: cost[c] for c in runs})
    assert [c for c, _ in ranked] == [cands[3], cands[2], cands[0]]
    assert failed == [cands[1]]
    with pytest.raises(RuntimeError, match="every candidate failed"):
        mt.autotune(cands[:1], lambda c: 1 / 0)


def test_wall_timer_takes_medians_in_alternation():
    now = [0.0]
    calls = []

    def clock():
        return now[0]

    def run(name, ms):
        def f():
            calls.append(name)
            now[0] += ms / 1e3
        return f
    got = mt.wall_timer({"a": run("a", 2.0), "b": run("b", 5.0)}, rounds=5, clock=clock)
    assert got == pytest.approx({"a": 2.0, "b": 5.0})
    assert sorted(calls) == ["a"] * 5 + ["b"] * 5
    assert calls[0::2] != ["a"] * 5 or calls[1::2] != ["b"] * 5  # the order changes


def test_kernel_config_for(monkeypatch):
    aligned = mt.table_key(GPU, "bfloat16", 128, "aligned", "causal")
    table = mt.parse_table({"entries": {aligned: _entry(block_kv=64, num_stages=4)}})
    monkeypatch.setattr(mt, "load_table", lambda: table)
    causal, dense = MaskSpec(causal=True), MaskSpec()
    # no GPU here: the per-head-dim default
    assert PallasMgpuKernel().config_for(128, "bfloat16", causal, False, "aligned") == \
        DEFAULT_MGPU_CONFIGS[128]
    monkeypatch.setattr(pallas_mgpu, "_device_kind", lambda: "NVIDIA H200")
    tuned = dataclasses.replace(DEFAULT_MGPU_CONFIGS[128], block_kv=64, num_stages=4)
    k = PallasMgpuKernel()
    assert k.config_for(128, "bfloat16", causal, False, "aligned") == tuned
    assert k.config_for(128, "bfloat16", causal, False, "general") == tuned
    # segment ids are their own class (none in this table); no mask, no entry: defaults
    assert k.config_for(128, "bfloat16", causal, True, "aligned") == DEFAULT_MGPU_CONFIGS[128]
    assert k.config_for(128, "bfloat16", dense, False, "dense") == DEFAULT_MGPU_CONFIGS[128]
    segs = mt.table_key(GPU, "bfloat16", 128, "general", "segments")
    table[segs] = mt.parse_table({"entries": {segs: _entry(num_stages=3)}})[segs]
    assert k.config_for(128, "bfloat16", causal, True, "general").num_stages == 3
    # the tuned packed-document class (aligned) serves segment ids on other tiles too
    del table[segs]
    packed = mt.table_key(GPU, "bfloat16", 128, "aligned", "segments")
    table[packed] = mt.parse_table({"entries": {packed: _entry(block_kv=64)}})[packed]
    assert k.config_for(128, "bfloat16", causal, True, "general").block_kv == 64
    assert k.config_for(128, "bfloat16", causal, True, "dense").block_kv == 64
    assert PallasMgpuKernel(tuned=False).config_for(128, "bfloat16", causal, False,
                                                    "aligned") == DEFAULT_MGPU_CONFIGS[128]
    own = MgpuConfig(block_kv=192)
    assert PallasMgpuKernel(config=own).config_for(128, "bfloat16", causal, False) == own
    with pytest.raises(TypeError, match="tuned="):
        PallasMgpuKernel(tuned=1)


def test_tune_script_merges_runs_into_a_table(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import mgpu_tune

    def cls(D, masked, fwd, bwd):
        return dict(D=D, masked=masked, fwd=dict(best=fwd, best_ms=1.0, default_ms=1.1),
                    bwd=dict(best=bwd, best_ms=2.0, default_ms=None))
    run = dict(env=dict(device_kind="NVIDIA H200", date="2026-11-24", jax="0.11.2"),
               seq=16384, heads=16, classes=[
                   cls(128, True, dict(block_q=64, block_kv=64, num_stages=3),
                       dict(block_q_bwd=64, block_kv_bwd=64, num_stages_bwd=2,
                            block_kv_dq=128, atomic_dq=False, split_dq=False,
                            overlap_bwd=True)),
                   cls(64, False, dict(block_q=64, block_kv=256, num_stages=2),
                       dict(block_q_bwd=128, block_kv_bwd=64, num_stages_bwd=2,
                            block_kv_dq=128, atomic_dq=True, split_dq=False,
                            overlap_bwd=False))])
    (tmp_path / "run.json").write_text(json.dumps(run))
    table_path = tmp_path / "table.json"
    monkey_argv = ["mgpu_tune.py", "--merge", str(tmp_path / "run.json"), "--table",
                   str(table_path)]
    old, sys.argv = sys.argv, monkey_argv
    try:
        assert mgpu_tune.main() == 0
    finally:
        sys.argv = old
    raw = json.loads(table_path.read_text())["entries"]
    table = mt.parse_table({"entries": raw})
    assert set(table) == {f"{GPU}/bfloat16/d128/aligned/causal",
                          f"{GPU}/bfloat16/d64/dense/none"}
    # which timer read the times: the device clock unless the run says otherwise
    assert {e["fwd_timer"] for e in raw.values()} == {"device"}
    cfg, _ = mt.lookup(GPU, "bfloat16", 64, "dense", "none", table)
    assert (cfg.block_kv, cfg.block_q_bwd, cfg.atomic_dq) == (256, 128, True)


def test_tune_script_merges_one_phase_into_the_table(tmp_path):
    """A run that tuned only the forward (``--phases fwd``) of a packed-document class
    updates that half of the table's entry and keeps the rest of the table."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import mgpu_tune
    old_key = f"{GPU}/bfloat16/d64/dense/none"
    bwd = dict(block_q_bwd=128, block_kv_bwd=64, num_stages_bwd=2, block_kv_dq=128,
               atomic_dq=True, split_dq=False, overlap_bwd=False)
    table_path = tmp_path / "table.json"
    table_path.write_text(json.dumps({"entries": {old_key: {
        "fwd": dict(block_q=64, block_kv=256, num_stages=3), "bwd": bwd}}}))
    run = dict(env=dict(device_kind="NVIDIA H200", date="2026-11-25", jax="0.11.2"),
               seq=16384, heads=16, classes=[dict(
                   D=64, mask="segments", seq=65536,
                   fwd=dict(best=dict(block_q=64, block_kv=128, num_stages=4), best_ms=1.0,
                            default_ms=1.2))])
    (tmp_path / "run.json").write_text(json.dumps(run))
    old, sys.argv = sys.argv, ["mgpu_tune.py", "--merge", str(tmp_path / "run.json"),
                               "--table", str(table_path)]
    try:
        assert mgpu_tune.main() == 0
    finally:
        sys.argv = old
    raw = json.loads(table_path.read_text())["entries"]
    table = mt.parse_table({"entries": raw})
    new_key = f"{GPU}/bfloat16/d64/aligned/segments"
    assert set(table) == {old_key, new_key}
    assert table[old_key]["bwd"] == bwd  # untouched
    assert table[new_key]["fwd"]["num_stages"] == 4 and raw[new_key]["seq"] == 65536
    # the phase the run did not tune: the per-head-dim default's fields
    assert table[new_key]["bwd"] == mt.fields_of(DEFAULT_MGPU_CONFIGS[64], mt.BWD_FIELDS)
