"""benchmarks/packed.py on CPU, the cheap parts: documents, FLOP counts, the check cases,
the layout phase (its full ``--dry-run`` takes about a minute and is run by hand), and the
timing helpers (profiler timelines split into calls, back-to-back rounds, clock samples);
and ``benchmarks/packed_batch.py``'s dry run."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import packed  # noqa: E402


def test_documents_fill_the_sequence_and_count_their_work():
    lens = packed.lognormal_lengths(4096, 65536, seed=1)
    assert sum(lens) == 65536 and min(lens) >= 1
    seg = packed.packed_ids(lens + [100], 65536)  # longer than S: cut at S
    assert seg.shape == (65536,) and (np.diff(seg) >= 0).all()
    assert packed.useful_pairs(seg) == sum(n * n for n in lens)


def test_rounded_documents_start_on_tile_boundaries_and_fill_the_sequence():
    lens = packed.lognormal_lengths(4096, 65536, seed=65536 + 4096)
    got = packed.round_lengths(lens, 65536, 128)
    assert sum(got) == 65536 and all(n % 128 == 0 and n >= 128 for n in got)
    assert len(got) == len(lens)  # this mix keeps its documents
    assert max(abs(a - b) for a, b in zip(got[:-1], lens[:-1])) <= 64
    assert packed.round_lengths([10, 10, 300], 256, 128) == [128, 128]  # cut to fill S
    assert packed.round_lengths([10], 512, 128) == [512]           # lengthened
    with pytest.raises(ValueError, match="multiple of 128"):
        packed.round_lengths([10], 300, 128)


def test_check_cases_read_one_global_segment_array():
    """A tile's two sides take their ids from one packed sequence, at their positions."""
    for name, (causal, qp, kp, qs, ks) in packed.check_cases(64).items():
        assert qs.shape == (2, len(qp)) and ks.shape == (2, len(kp)), name
        same = np.intersect1d(qp, kp)
        for p in same:
            np.testing.assert_array_equal(qs[:, list(qp).index(p)], ks[:, list(kp).index(p)])
    q_pos, k_pos = packed.check_cases(64)["ring_step_masked_rows"][1:3]
    assert q_pos.min() > k_pos.max()  # every key precedes every query: a ring step


def test_variant_agreement_finds_a_race_that_shows_in_one_call():
    """``variant_agreement`` compares every call of each variant with ``packed auto``'s
    gradients: a variant wrong in one call of three is caught, a correct one reads its
    floor, and the Triton call is left out."""
    rng = np.random.default_rng(0)
    ref = [rng.standard_normal((1, 64, 2, 8)).astype(np.float32) for _ in range(3)]
    calls = {"n": 0}

    def racy(*_):
        calls["n"] += 1
        if calls["n"] == 2:  # one block of dQ loses a contribution in the 2nd call
            bad = [g.copy() for g in ref]
            bad[0][:, :16] *= 0.5
            return bad
        return ref
    ok = {"packed auto": lambda *_: ref, "packed pallas": lambda *_: 1 / 0,
          "packed good": lambda *_: [g * (1 + 1e-6) for g in ref], "packed racy": racy}
    got = packed.variant_agreement(ok, (), S=64, mean=16)
    assert set(got) == {"packed auto", "packed good", "packed racy"} and calls["n"] == 3
    assert got["packed auto"] == {"rel": 0.0, "max": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
    assert got["packed racy"]["dq"] > 0.1 and got["packed racy"]["dk"] == 0.0
    assert got["packed good"]["rel"] < 1e-5 and got["packed good"]["max"] < 1e-5
    assert got["packed racy"]["rel"] > 0.1 and got["packed racy"]["max"] > 0.1
    assert packed.variant_agreement({"packed good": ok["packed good"]}, (), 64, 16) == {}


def test_layout_phase_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert packed.main(["--dry-run", "--phases", "layout"]) == 0
    rows = json.loads((tmp_path / "packed_dry.json").read_text())["layout"]
    assert {r["doc_mean"] for r in rows} == {64, 256}
    assert all(r["layout"] in ("contiguous", "zigzag", "striped") for r in rows)


# --------------------------------------------------------------------------- timing helpers
def _trace(tmp_path, kernels):
    """A Perfetto trace as ``jax.profiler`` writes it: a GPU and a host process."""
    import gzip
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 2, "name": "host_op", "ts": 0.0, "dur": 5000.0}]
    events += [{"ph": "X", "pid": 1, "name": n, "ts": ts, "dur": d} for n, ts, d in kernels]
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump({"traceEvents": events}, fh)
    return str(path)


def test_device_calls_are_split_at_the_host_round_trip(tmp_path):
    import _profile
    # two calls: [a, b, c] with a long kernel overlapping b, then [d]; host idle 400 us
    kernels = [("c", 1020.0, 5.0), ("a", 1000.0, 300.0), ("b", 1010.0, 5.0),
               ("d", 1700.0, 50.0)]
    tl = _profile.timeline(_trace(tmp_path, kernels))
    assert [n for n, _, _ in tl] == ["a", "b", "c", "d"] and tl[0][1] == 0.0  # no host op
    calls = _profile.group_calls(tl, 2)
    assert [[n for n, _, _ in g] for g in calls] == [["a", "b", "c"], ["d"]]
    with pytest.raises(ValueError, match="boundary gap"):
        _profile.group_calls(tl, 3)   # a 5 us gap inside a call is no call boundary
    with pytest.raises(ValueError, match="4 kernels for 5 calls"):
        _profile.group_calls(tl, 5)


def test_sustained_and_device_rounds_on_cpu(capsys):
    import jax
    import jax.numpy as jnp
    f = jax.jit(lambda x: x * 2)
    g = jax.jit(lambda x: jnp.sin(x))
    x = jnp.ones(8)
    import _profile
    import _util
    calls = {"f": (f, (x,)), "g": (g, (x,))}
    got = _util.sustained_rounds(calls, 2, 10.0, {"f": 1e-3, "g": 2e-3}, seed=0)
    assert got["f"]["calls"] == 10 and got["g"]["calls"] == 5 and got["f"]["ms"] > 0
    assert got["f"]["sm_mhz"] is None  # no clock sampler given
    assert _util.sustained_rounds(calls, 0, 10.0, {"f": 1e-3, "g": 1e-3}) == {}
    # no device kernels in a CPU trace: no device times, and it says so
    assert _profile.device_rounds(calls, 1, seed=0) == {}
    assert "device time: FAILED" in capsys.readouterr().out


def test_device_rounds_report_kernel_time_beside_the_span(monkeypatch):
    """``device_rounds(busy=..., per_kernel=...)``: the median span per call and, beside
    it, the median sum of its kernels' durations (a span longer than its kernels is idle
    time), and each kernel's median over the rounds by its place in the call (``None``
    for a call whose rounds launched different kernels)."""
    import _profile
    fake = {"f": [(3.0, 2.5, [("a", 1.0), ("b", 1.5)]), (5.0, 2.0, [("a", 0.5), ("b", 1.5)]),
                  (4.0, 3.0, [("a", 2.0), ("b", 1.0)])],
            "g": [(1.0, 1.0, [("c", 1.0)])] * 2 + [(1.0, 1.0, [("c", 0.5), ("d", 0.5)])]}

    def device_times(seq, logdir):
        seen = {n: 0 for n in fake}
        out = []
        for n, _ in seq:
            out.append((n, *fake[n][seen[n]]))
            seen[n] += 1
        return out
    monkeypatch.setattr(_profile, "device_times", device_times)
    busy, per = {}, {}
    got = _profile.device_rounds({"f": (None, ()), "g": (None, ())}, 3, busy=busy,
                                 per_kernel=per)
    assert got == {"f": 4.0, "g": 1.0} and busy == {"f": 2.5, "g": 1.0}
    assert per == {"f": [("a", 1.0), ("b", 1.5)], "g": None}


def test_clock_sampler_without_nvidia_smi(monkeypatch):
    import shutil
    import _util
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with _util.ClockSampler() as clk:
        pass
    assert clk.samples == [] and clk.mean(0.0, 1e9) == {"n": 0}
    clk.samples = [(1.0, 1700.0, 650.0), (2.0, 1800.0, 690.0), (9.0, 1980.0, 100.0)]
    assert clk.mean(0.5, 2.5) == {"sm_mhz": 1750.0, "power_w": 670.0, "n": 2}


def test_call_clock_averages_the_samples_inside_the_calls():
    import packed_batch
    samples = [(0.5, 1000.0, 100.0), (1.5, 1800.0, 600.0), (2.5, 1900.0, 650.0),
               (3.5, 1000.0, 100.0), (4.5, 1700.0, 700.0)]
    got = packed_batch.call_clock(samples, [(1.0, 3.0), (4.0, 5.0)])
    assert got == dict(sm_mhz=1800.0, power_w=650.0, clock_samples=3)
    assert packed_batch.call_clock(samples, [(5.5, 6.0)])["clock_samples"] == 0


def test_packed_batch_dry_run_checks_the_dims_asked(tmp_path, monkeypatch, capsys):
    """benchmarks/packed_batch.py on CPU: its check at the head dims of ``--check-dims``,
    the timing rows, the JSON; a malformed ``--check-dims`` is refused by name."""
    import packed_batch
    monkeypatch.setenv("OUT", str(tmp_path))
    packed_batch.main(["--dry-run", "--check-dims", "32"])
    out = capsys.readouterr().out
    checks = [line for line in out.splitlines() if line.startswith("check ")]
    assert checks and all(line.startswith("check D= 32") and line.endswith(" ok")
                          for line in checks), checks
    result = json.loads((tmp_path / "packed_batch.json").read_text())
    assert result["checked"] is True
    assert all("clock_samples" in r for r in result["rows"])
    assert {r["name"] for r in result["rows"]} >= {"packed L128", "batch ours L128"}
    with pytest.raises(SystemExit):
        packed_batch.main(["--dry-run", "--check-dims", "x"])
    assert "--check-dims" in capsys.readouterr().err


def test_power_cap_reads_nvidia_smi_lines():
    """``power_cap.parse_sample`` reads clock, power, temperature and the reasons
    bitmask; ``summarize`` gives each reason's share of the samples."""
    import power_cap
    assert power_cap.parse_sample("1605, 699.1, 61, 0x0000000000000004") == (
        1605.0, 699.1, 61.0, 4)
    assert power_cap.parse_sample("clocks.sm [MHz], power.draw [W]") is None
    assert power_cap.parse_sample("1605, [N/A], 61, 0x0") is None
    got = power_cap.summarize([(1600.0, 700.0, 60.0, 0x4), (1800.0, 500.0, 62.0, 0x0),
                               (1700.0, 690.0, 61.0, 0x4 | 0x20)], calls=30, seconds=2.0)
    assert got["calls_per_s"] == 15.0 and got["sm_mhz"] == 1700.0
    assert got["sw_power_cap"] == 2 / 3 and got["sw_thermal"] == 1 / 3
    assert got["hw_slowdown"] == 0.0
    assert power_cap.summarize([], 3, 1.0) == dict(calls=3, calls_per_s=3.0, samples=0)


def test_power_cap_repeats_windows_and_takes_variants(monkeypatch, capsys):
    """``power_cap.py --repeat N`` runs every function's window N times in turn (rows
    named ``#1`` ..); ``--mgpu-variant`` needs a Hopper GPU; bad values are refused."""
    import packed_batch
    import power_cap
    monkeypatch.setattr(packed_batch, "_ours", lambda *a, **k: (lambda *args: 0))
    monkeypatch.setattr(power_cap, "run_sampled", lambda fn, args, s, p: (4, 2.0, []))
    monkeypatch.setattr(power_cap, "save_json", lambda *a, **k: None)
    power_cap.main(["--dry-run", "--repeat", "2", "--pause", "0"])
    names = [ln.split("  ")[0].strip() for ln in capsys.readouterr().out.splitlines()
             if "calls/s" in ln]
    assert names == ["xla one row #1", "packed lognormal L32 #1", "xla one row #2",
                     "packed lognormal L32 #2"]
    for argv, msg in ((["--repeat", "0"], "--repeat"),
                      (["--mgpu-variant", "x:early_dq=true"], "Hopper"),
                      (["--mgpu-variant", "x:nope=1"], "nope")):
        with pytest.raises(SystemExit):
            power_cap.main(["--dry-run", *argv])
        assert msg in capsys.readouterr().err


def test_packed_bench_takes_variants_only_on_hopper(capsys):
    """``packed.py --mgpu-variant``: refused on a machine without a Hopper GPU, and a
    field MgpuConfig lacks is named."""
    import packed
    for argv, msg in ((["--mgpu-variant", "x:early_dq=true"], "Hopper"),
                      (["--mgpu-variant", "x:nope=1"], "nope")):
        with pytest.raises(SystemExit):
            packed.main(["--dry-run", "--phases", "bench", *argv])
        assert msg in capsys.readouterr().err
