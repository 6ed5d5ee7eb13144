"""benchmarks/double_ring.py on CPU: both strategies checked against the reference on the
same 8 devices (the preset's 2 x 4), their steps timed, and --mesh's errors."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import double_ring  # noqa: E402


def test_cpu_check_and_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    cfg = dict(double_ring.PRESETS["cpu"], seq=256, heads=2, head_dim=16, rounds=1,
               check_seq=256, cases=["zigzag:causal"])
    assert double_ring.main(["--preset", "cpu", "--config", json.dumps(cfg)]) == 0
    result = json.loads((tmp_path / "double_ring_cpu_2x4_auto.json").read_text())
    assert result["config"]["mesh"] == [2, 4]
    errs = result["check"]["zigzag:causal"]
    assert set(errs) == {"auto/double_ring", "auto/ring"}
    assert all(0 < e <= 1e-5 for e in errs.values()), errs
    (row,) = result["steps"]
    assert set(row["wall_ms"]) == {"double_ring", "ring"}
    assert all(t > 0 for t in row["wall_ms"].values())
    assert row["grad_max_abs_diff"] < 1e-5  # the same gradients by two schedules
    assert row["device_ms"] == {}  # no device clock on CPU


def test_mesh_argument_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    for bad, msg in (("2by4", "expected NOxNI"), ("4x4", "needs 16 devices")):
        with pytest.raises(SystemExit) as e:
            double_ring.main(["--preset", "cpu", "--mesh", bad])
        assert e.value.code == 2
        assert msg in capsys.readouterr().err
