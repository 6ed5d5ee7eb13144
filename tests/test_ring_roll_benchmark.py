"""benchmarks/ring_roll.py on CPU: the check of both ring forms against the reference, for
the 1-D ring and the double ring, and of both forms of ``--switch pack``."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import ring_roll  # noqa: E402
from jax_seqpar.parallel import ring_common  # noqa: E402


@pytest.mark.parametrize("mesh", [None, "2x4"])  # the 1-D ring on 8 devices; the double ring
def test_cpu_check_of_both_forms(mesh, tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    case = "zigzag:causal" if mesh else "contiguous:dense"
    cfg = dict(ring_roll.PRESETS["cpu"], seq=256, heads=2, head_dim=16, rounds=1,
               check_seq=256, cases=[case])
    assert ring_roll.main(["--preset", "cpu", "--config", json.dumps(cfg), "--phases", "check"]
                          + (["--mesh", mesh] if mesh else [])) == 0
    assert ring_common.ROLL_HOPS  # the script puts the default back
    name = f"ring_roll_cpu_kv_{mesh}.json" if mesh else "ring_roll_cpu_kv.json"
    result = json.loads((tmp_path / name).read_text())
    assert result["config"].get("mesh") == ([2, 4] if mesh else None)
    errs = result["check"][case]
    assert set(errs) == {"auto/rolled", "auto/unrolled"}
    assert all(0 < e <= 1e-5 for e in errs.values()), errs
    assert result["compile"] == result["steps"] == []  # not asked for


def test_cpu_check_of_packed_and_apart_hops(tmp_path, monkeypatch):
    """``--switch pack`` on packed documents (``:docs``) with the ``q`` backward, whose
    hops carry five arrays apart and one buffer packed."""
    monkeypatch.setenv("OUT", str(tmp_path))
    case = "zigzag:causal:docs"
    cfg = dict(ring_roll.PRESETS["cpu"], rounds=1, check_seq=256, cases=[case])
    assert ring_roll.main(["--preset", "cpu", "--config", json.dumps(cfg), "--phases", "check",
                           "--switch", "pack", "--backward", "q", "--seq", "256",
                           "--heads", "2", "--head-dim", "16"]) == 0
    assert ring_common.PACK_HOPS  # put back
    result = json.loads((tmp_path / "ring_roll_cpu_q_pack.json").read_text())
    assert (result["config"]["seq"], result["config"]["heads"],
            result["config"]["head_dim"]) == (256, 2, 16)  # the overrides
    errs = result["check"][case]
    assert set(errs) == {"auto/packed", "auto/apart"}
    assert all(0 < e <= 1e-5 for e in errs.values()), errs
    with pytest.raises(SystemExit):  # --seq must be positive
        ring_roll.main(["--preset", "cpu", "--phases", "check", "--seq", "0"])
    with pytest.raises(SystemExit, match="layout:mask"):
        ring_roll.main(["--preset", "cpu", "--phases", "check", "--cases", "zigzag:causal:x"])
