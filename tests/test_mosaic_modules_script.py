"""``scripts/mosaic_modules.py``: fingerprints of the Hopper kernels' Mosaic GPU modules
(lowered for CUDA on the CPU), the check that a refactor left what runs on the GPU as it
was."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import mosaic_modules  # noqa: E402

from jax_seqpar.kernels.pallas_mgpu_common import named_barriers_supported  # noqa: E402


def test_fingerprints_are_stable_and_tell_configs_apart():
    """The same config twice gives the same digests; a field that changes the kernel (the
    ring's depth on every JAX; the forward's overlap where this JAX has named barriers,
    without them the kernel ignores it) gives others; a field this checkout lacks is
    reported, not lowered; a config that cannot fit is recorded as refused."""
    a = mosaic_modules.fingerprint("fwd", "d64_dense", {})
    assert len(a["mods"]) == 1
    assert mosaic_modules.fingerprint("fwd", "d64_dense", {}) == a
    assert mosaic_modules.fingerprint("fwd", "d64_dense", {"num_stages": 3}) != a
    overlap = mosaic_modules.fingerprint("fwd", "d64_dense", {"overlap_fwd": True})
    assert (overlap != a) == named_barriers_supported()
    assert mosaic_modules.fingerprint("fwd", "d64_dense", {"no_such_field": True}) == {
        "missing": ["no_such_field"]}
    big = mosaic_modules.fingerprint("fwd", "dense", dict(num_stages=3, block_kv=256))
    assert "shared memory" in big["error"]


def test_compare_names_what_differs_and_leaves_out_what_one_side_lacks(tmp_path, capsys):
    old = {"a": {"mods": ["1", "2"]}, "b": {"mods": ["3"]}, "c": {"error": "E"},
           "d": {"missing": ["x"]}, "e": {"mods": ["5"]}}
    new = {"a": {"mods": ["1", "2"]}, "b": {"mods": ["4"]}, "c": {"mods": ["6"]},
           "d": {"mods": ["7"]}}
    assert mosaic_modules.compare(old, new) == ["b", "c"]
    assert mosaic_modules.compare(old, old) == []
    for name, snap in (("old", old), ("new", new)):
        (tmp_path / f"{name}.json").write_text(json.dumps(snap))
    assert mosaic_modules.main(["--compare", str(tmp_path / "old.json"),
                                str(tmp_path / "new.json")]) == 1
    out = capsys.readouterr().out
    assert "3 configurations compared, 2 differ" in out and "differs: b" in out
    assert mosaic_modules.main(["--compare", str(tmp_path / "old.json"),
                                str(tmp_path / "old.json")]) == 0


def test_jobs_cover_the_table_and_refuse_unknown_cases():
    keys = [k for k, *_ in mosaic_modules.jobs(cases=["segs"], kinds=("bwd",))]
    n_table = sum(d == 128 for d, _ in mosaic_modules.table_variants())
    assert len(keys) == len(mosaic_modules.BWD_VARIANTS) + len(
        mosaic_modules.SPLIT_VARIANTS) + n_table
    assert len(set(keys)) == len(keys)
    with pytest.raises(SystemExit):
        mosaic_modules.main(["--out", "x.json", "--cases", "nope"])


def test_triton_fingerprints_cover_the_module_and_its_launch():
    """The Triton kinds: the same config twice gives the same digests, one per kernel's
    module and one per launch (the backward: two kernels); another dtype changes the
    modules; more warps change only the launch's digest; a field the config lacks is
    reported, not lowered."""
    a = mosaic_modules.fingerprint("triton_bwd", "d64_ragged", {"dtype": "bfloat16"})
    assert len(a["mods"]) == 4
    assert mosaic_modules.fingerprint("triton_bwd", "d64_ragged", {"dtype": "bfloat16"}) == a
    f32 = mosaic_modules.fingerprint("triton_bwd", "d64_ragged", {"dtype": "float32"})
    assert f32["mods"][:2] != a["mods"][:2]
    fwd = mosaic_modules.fingerprint("triton_fwd", "segs", {"dtype": "float16"})
    warps = mosaic_modules.fingerprint("triton_fwd", "segs", {"dtype": "float16",
                                                              "num_warps": 8})
    assert warps["mods"][0] == fwd["mods"][0] and warps["mods"][1] != fwd["mods"][1]
    assert len(mosaic_modules.fingerprint("decode", "segs", {"dtype": "float32"})["mods"]) == 2
    assert mosaic_modules.fingerprint("decode", "dense", {"dtype": "bfloat16",
                                                          "no_such_field": 1}) == {
        "missing": ["no_such_field"]}
    keys = [k for k, *_ in mosaic_modules.jobs(kinds=mosaic_modules.TRITON_KINDS)]
    assert len(keys) == len(set(keys)) == 3 * len(mosaic_modules.CASES) * len(
        mosaic_modules.TRITON_DTYPES)
    with pytest.raises(SystemExit):
        mosaic_modules.main(["--out", "x.json", "--kinds", "fwd,nope"])
