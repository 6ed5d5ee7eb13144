"""benchmarks/scaling.py on CPU: the plan, the correctness check and the efficiency."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import scaling  # noqa: E402


def test_plan_skips_lengths_zigzag_cannot_split():
    cfg = dict(weak=[6], strong=[12], devices=[1, 2, 4])
    assert scaling.plan(cfg, [1, 2, 4]) == [
        ("weak", 6, 1, 6), ("weak", 6, 2, 12), ("weak", 6, 4, 24),
        ("strong", 12, 1, 12), ("strong", 12, 2, 12)]  # 12 tokens cannot make 8 chunks


def test_cpu_run_checks_and_reports(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert scaling.main(["--preset", "cpu", "--devices", "1,2", "--weak", "128",
                         "--strong", "512"]) == 0
    result = json.loads((tmp_path / "scaling_cpu.json").read_text())
    assert all(e <= 1e-5 for e in result["check"].values()), result["check"]
    rows = result["rows"]
    assert [(r["mode"], r["G"], r["S"]) for r in rows] == [
        ("weak", 1, 128), ("weak", 2, 256), ("strong", 1, 512), ("strong", 2, 512)]
    for r in rows:
        assert r["efficiency"] == r["t_1dev_s"] / (r["G"] * r["t_s"])
        if r["G"] == 1:
            assert r["efficiency"] == 1.0
