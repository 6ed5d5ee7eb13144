"""benchmarks/kernel_trace.py on CPU: its reading of Mosaic GPU's profile buffer, on a
buffer built by hand (the GPU writes the real ones)."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kernel_trace  # noqa: E402

NAMES = {"load": 0, "rows": 1, "step": 2, "out": 3, "produce": 4}
EXIT = 1 << 31
CONSUMER = [("load", 0, 100), ("rows", 100, 360), ("step", 150, 250), ("step", 250, 350),
            ("out", 360, 400)]
PRODUCER = [("produce", 0, 450)]


def _trace(regions, base, start_ns, sm, entries):
    events = sorted([(b, NAMES[n]) for n, b, _ in regions]
                    + [(e, NAMES[n] | EXIT) for n, _, e in regions],
                    key=lambda x: (x[0], not x[1] & EXIT))
    row = np.zeros(entries, np.uint32)
    row[0], row[1], row[2] = start_ns % 2 ** 32, sm, 2 * len(events)
    for i, (clk, tag) in enumerate(events):
        row[3 + 2 * i], row[4 + 2 * i] = tag, (base + clk) % 2 ** 32
    return row


def _buffer(blocks, entries=32):
    """``blocks``: (sm, clock at the block's start, global ns at its start)."""
    rows = []
    for sm, base, ns in blocks:
        rows += [_trace(CONSUMER, base, ns, sm, entries)] * 2
        rows.append(_trace(PRODUCER, base, ns, sm, entries))
    return np.concatenate(rows)


@pytest.mark.parametrize("wrap", [0, 2 ** 32 - 1200])
def test_phases_gaps_and_idle_add_up_to_the_span(wrap):
    """Two CTAs on SM 0 (50 cycles apart), one on SM 1; 1 cycle a ns.  Counters that
    wrap inside the call read the same."""
    blocks = [(0, 1000 + wrap, 5000 + wrap), (0, 1500 + wrap, 5500 + wrap),
              (1, 7000 + wrap, 5000 + wrap)]
    got = kernel_trace.summarize(kernel_trace.parse(_buffer(blocks), NAMES, 32))
    assert got["clock_mhz"] == pytest.approx(1000.0)
    assert got["phases_cycles"] == {"load": 300, "first_k": 150, "steps": 600, "out": 300,
                                    "gap": 50, "idle": 500}
    assert got["span_us"] == pytest.approx(0.95)
    assert sum(got["phases_cycles"].values()) == 2 * 950  # every SM cycle of the span
    assert got["cycles_per_step"] == 100 and got["steps"] == 6
    assert got["blocks"] == 3 and got["sms"] == 2


def test_cases_and_their_shapes():
    assert kernel_trace.case_shape("rows", 65536, 4096) == (16, 4096, False)
    assert kernel_trace.case_shape("packed", 65536, 4096) == (1, 65536, True)
    with pytest.raises(ValueError, match="unknown case"):
        kernel_trace.case_shape("nope", 1, 1)


def test_traces_name_their_kernel_and_bad_kernels_are_refused():
    assert kernel_trace.kernel_kind({"dkdv_rows": 1, "step": 2}) == "dkdv"
    assert kernel_trace.kernel_kind({"dq_rows": 1}) == "dq"
    assert kernel_trace.kernel_kind({"rows": 1, "load": 0}) == "fwd"
    # the TMA zeroing kernel records no regions: it is not read as a forward
    assert kernel_trace.kernel_kind({}) == "other"
    with pytest.raises(SystemExit):
        kernel_trace.main(["--kernels", "dkdv"])


def test_the_profiler_is_on_only_when_asked(monkeypatch, tmp_path):
    from jax_seqpar.kernels import pallas_mgpu_common as common
    monkeypatch.delenv(common.TRACE_ENV, raising=False)
    params = common.compiler_params()
    assert params.approx_math and not params.profile_space
    monkeypatch.setenv(common.TRACE_ENV, str(tmp_path))
    monkeypatch.setenv(common.TRACE_RANGES_ENV, "40")
    params = common.compiler_params()
    assert params.profile_space == 40 and params.profile_dir == str(tmp_path)
    monkeypatch.setenv(common.TRACE_RANGES_ENV, "0")
    with pytest.raises(ValueError, match=common.TRACE_RANGES_ENV):
        common.compiler_params()


def test_one_cta_per_sm_gives_phases_without_a_clock():
    """A persistent kernel (one CTA per SM) gives no clock rate: its summary keeps the
    phases and steps and leaves the span unknown and the idle time out."""
    got = kernel_trace.summarize(kernel_trace.parse(
        _buffer([(0, 1000, 5000), (1, 7000, 5000)]), NAMES, 32))
    assert np.isnan(got["clock_mhz"]) and np.isnan(got["span_us"])
    assert got["phases_cycles"]["idle"] == 0 and got["phases_cycles"]["gap"] == 0
    assert got["steps"] == 4 and got["cycles_per_step"] == 100


def test_per_cta_rows():
    """One row per CTA in buffer order: its SM, its start from the first CTA's (global
    timer, us), consumer 0's steps and their median."""
    blocks = [(0, 1000, 5000), (0, 1500, 5500), (1, 7000, 5000)]
    rows = kernel_trace.per_cta(kernel_trace.parse(_buffer(blocks), NAMES, 32))
    assert rows == [[0, 0, 0.0, 2, 100.0], [1, 0, 0.5, 2, 100.0], [2, 1, 0.0, 2, 100.0]]
