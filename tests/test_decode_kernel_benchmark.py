"""benchmarks/decode_kernel.py on CPU: every variant checked and timed, results saved."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import decode_kernel  # noqa: E402


def test_cpu_run_checks_every_variant(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert decode_kernel.main(["--preset", "cpu"]) == 0
    result = json.loads((tmp_path / "decode_kernel_cpu.json").read_text())
    names = set(decode_kernel.variants(decode_kernel.PRESETS["cpu"]))
    assert set(result["check"]) == names and max(result["check"].values()) <= 1e-5
    cfg = result["config"]
    sizes = len(cfg["shards"]) * len(cfg["batches"]) * len(cfg["tq"])
    assert len(result["rows"]) == sizes * len(names)
    for r in result["rows"]:
        assert r["time_s"] > 0 and r["rel_vs_first"] <= 1e-5
