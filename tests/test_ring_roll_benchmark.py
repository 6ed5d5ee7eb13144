"""benchmarks/ring_roll.py on CPU: the check of both ring forms against the reference."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import ring_roll  # noqa: E402
from jax_seqpar.parallel import ring  # noqa: E402


def test_cpu_check_of_both_forms(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    cfg = dict(ring_roll.PRESETS["cpu"], seq=256, heads=2, head_dim=16, rounds=1,
               check_seq=256, cases=["contiguous:dense"])
    assert ring_roll.main(["--preset", "cpu", "--config", json.dumps(cfg),
                           "--phases", "check"]) == 0
    assert ring.ROLL_HOPS  # the script puts the default back
    result = json.loads((tmp_path / "ring_roll_cpu_kv.json").read_text())
    errs = result["check"]["contiguous:dense"]
    assert set(errs) == {"auto/rolled", "auto/unrolled"}
    assert all(0 < e <= 1e-5 for e in errs.values()), errs
    assert result["compile"] == result["steps"] == []  # not asked for
