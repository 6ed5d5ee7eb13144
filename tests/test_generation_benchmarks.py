"""The generation benchmarks run end to end on CPU at tiny sizes (their GPU runs are in
benchmarks/RESULTS.md): ``benchmarks/generate.py`` (prefill, and decode against
the memory floor, unrolled and scanned weights; its ring / all-gather baselines are
``test_generate.py``'s) and ``benchmarks/needle.py`` on an exported
retrieval model (``examples/train_long_context.py --export`` writes the same files)."""

import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from jax_seqpar.data.recall import RecallTask  # noqa: E402
from jax_seqpar.models import Llama, LlamaConfig  # noqa: E402
from jax_seqpar.models.hf import save_pretrained  # noqa: E402


def test_generate_benchmark_tiny(tmp_path, monkeypatch):
    import generate as bench
    monkeypatch.setenv("OUT", str(tmp_path))
    assert bench.main(["--configs", "tiny:32:2", "--devices", "1", "--new-tokens", "3",
                       "--repeats", "1", "--strategies", "", "--no-baseline", "--name", "g",
                       "--scan-layers", "both"]) == 0
    rows = json.load(open(tmp_path / "g.json"))["rows"]
    assert [r.get("scan_layers") for r in rows] == [False, True], rows
    for row in rows:
        assert "error" not in row, row
        assert row["decode_ms_per_token"] > 0 and row["fraction_of_floor"] > 0
        assert row["cache_len"] >= 34 and row["prefill_passes"] == 1
        assert row["decode_temp_bytes"] is not None and row["prefill_temp_bytes"] > 0
    # the stacked weights are the unrolled model's numbers: the same greedy tokens
    assert rows[1]["tokens_equal_unrolled"] is True


def test_needle_benchmark_on_an_exported_recall_model(tmp_path, monkeypatch):
    import needle
    task = RecallTask(seq_len=64, pairs=2)
    cfg = LlamaConfig(vocab_size=task.vocab, d_model=32, num_layers=1, num_heads=2,
                      num_kv_heads=1)
    params = jax.jit(Llama(cfg).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    save_pretrained(cfg, params, str(tmp_path / "model"))
    task.save(str(tmp_path / "model"))
    monkeypatch.setenv("OUT", str(tmp_path))
    assert needle.main(["--checkpoint", str(tmp_path / "model"), "--lengths", "48",
                        "--depths", "0,1", "--samples", "3", "--devices", "2"]) == 0
    res = json.load(open(tmp_path / "needle.json"))
    assert res["task"] == "recall" and len(res["accuracy"]) == 1
    assert all(0.0 <= x <= 1.0 for x in res["accuracy"][0])
    assert os.path.exists(tmp_path / "needle.png")
