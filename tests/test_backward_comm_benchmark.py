"""benchmarks/backward_comm.py on CPU: options, byte accounting and gradient checks."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import backward_comm  # noqa: E402


def test_unknown_kernel_is_named():
    with pytest.raises(ValueError, match="kernel='cudnn'"):
        backward_comm.make_kernel(dict(kernel="cudnn", block=128))


def test_devices_that_do_not_fit_are_refused(capsys):
    with pytest.raises(SystemExit):
        backward_comm.main(["--preset", "cpu", "--devices", "64"])
    assert "--devices" in capsys.readouterr().err


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_cpu_run_counts_bytes_and_checks_gradients(tmp_path, monkeypatch, kernel):
    monkeypatch.setenv("OUT", str(tmp_path))
    # the cpu preset timed once (the timings are not checked), and for the XLA kernel at
    # a smaller head dimension (the Pallas kernels take 64 and up): the bytes (against
    # the formula, which reads head_dim), the schemes' choice and the gradient checks
    # are the same code
    small = dict(repeats=1) if kernel == "pallas" else dict(repeats=1, head_dim=16)
    monkeypatch.setitem(backward_comm.PRESETS, "cpu", dict(backward_comm.PRESETS["cpu"], **small))
    # the Pallas kernel runs interpreted on CPU: a shorter sequence (still 2 shards with
    # several blocks each) keeps its run short
    seq = "256" if kernel == "xla" else "128"
    assert backward_comm.main(["--preset", "cpu", "--devices", "2", "--seq", seq,
                               "--kernel", kernel]) == 0
    stem = "backward_comm_cpu" + ("" if kernel == "xla" else "_pallas")
    rows = json.loads((tmp_path / f"{stem}.json").read_text())["rows"]
    assert {r["kernel"] for r in rows} == {kernel}
    assert len(rows) == 2 * 3  # (MHA, GQA) x (kv, q, auto)
    for r in rows:
        assert r["bytes_per_device"] == r["formula_bytes"] > 0
        assert r["grad_rel_vs_ref"] <= 1e-5
    by = {(r["kv_heads"], r["scheme"]): r for r in rows}
    # MHA: Burst sends less, auto takes it; GQA 8/2: KV sends less, auto keeps it.
    assert by[(8, "q")]["bytes_per_device"] < by[(8, "kv")]["bytes_per_device"]
    assert by[(8, "auto")]["resolved"] == "q"
    assert by[(2, "kv")]["bytes_per_device"] < by[(2, "q")]["bytes_per_device"]
    assert by[(2, "auto")]["resolved"] == "kv"
