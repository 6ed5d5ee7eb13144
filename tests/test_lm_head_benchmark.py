"""benchmarks/lm_head.py on CPU: every variant runs, agrees on the loss, and the fused one
needs less memory than the naive one (compiled estimate)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import lm_head  # noqa: E402


def test_cpu_preset_runs_every_variant(tmp_path):
    assert lm_head.main(["--preset", "cpu", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "lm_head_cpu.json").read_text())["rows"]
    assert len(rows) == len(lm_head.PRESETS["cpu"]["shapes"]) * len(lm_head.VARIANTS)
    for r in rows:
        assert r["status"] == "ok" and r["time_s"] > 0, r
    for S, V in lm_head.PRESETS["cpu"]["shapes"]:
        got = {r["variant"]: r for r in rows if (r["S"], r["V"]) == (S, V)}
        assert got["floor"]["x_floor"] == 1.0 and got["fused"]["x_floor"] > 0
        for v in ("fused", "chunked"):
            for key in ("loss", "dh_norm", "dw_norm"):
                assert abs(got[v][key] - got["naive"][key]) <= 1e-5 * abs(got["naive"][key])
        fused = got["fused"]["memory_analysis"]["temp"]
        assert fused < got["naive"]["memory_analysis"]["temp"] / 2, (S, V)
