"""benchmarks/merge_checks.py: the last run of a case wins, failures set the exit code."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import merge_checks  # noqa: E402


def _row(case, ok, err=1e-3, kernel="pallas"):
    return dict(case=case, D=64, dtype="bfloat16", kernel=kernel, ok=ok, out=err, dq=err,
                dk=err, dv=2 * err)


def _write(path, rows):
    path.write_text(json.dumps({"env": {"jax": "x"}, "check": rows}))
    return str(path)


def test_last_file_wins_and_summary(tmp_path):
    first = _write(tmp_path / "a.json", [_row("dense", False), _row("causal", True, 1e-3)])
    second = _write(tmp_path / "b.json", [_row("dense", True, 4e-3)])
    out = tmp_path / "merged.json"
    assert merge_checks.main([str(out), first, second]) == 0
    merged = json.loads(out.read_text())
    by_case = {r["case"]: r for r in merged["check"]}
    assert by_case["dense"]["source"] == "b.json" and by_case["dense"]["ok"]
    assert by_case["causal"]["source"] == "a.json"
    assert merged["summary"]["pallas"]["passed"] == 2
    assert merged["summary"]["pallas"]["worst_rel_error"]["bfloat16"] == 8e-3


def test_a_remaining_failure_fails(tmp_path):
    first = _write(tmp_path / "a.json", [_row("dense", True)])
    second = _write(tmp_path / "b.json", [_row("dense", False)])  # the later run failed
    assert merge_checks.main([str(tmp_path / "m.json"), first, second]) == 1
