"""What holds the clock while the packed bar is read: power cap, heat, or nothing.

The packed bar of issue 41 is read in device rounds, where every call runs at the clock
the rounds leave it (RESULTS.md: a short call's kernels ran 8-12% slower there than in a
row of its own).  This script runs each function back to back for ``--seconds`` and
samples, every ``--period-ms`` through ``nvidia-smi``, the SM clock, board power, GPU
temperature and the clock's active limit reasons (the bitmask
``clocks_throttle_reasons.active``: software power cap, hardware slowdown, thermal
slowdowns), then prints per function the calls per second, the mean clock and power,
and the share of samples in which each reason was active.  Functions: cuDNN on one
unpacked row (the bar's denominator), the packed call on log-normal documents (the
bar's case) and, on Hopper, ``pallas_mgpu`` on the same row and both on a batch of
equal rows as long as the mean document.

    python benchmarks/power_cap.py                 # one H100/H200, about a minute
    V=fused:atomic_dq=true,split_dq=true,row_scores=true,dv_with_dp=false
    python benchmarks/power_cap.py --no-extra --repeat 3 --mgpu-variant $V   # two ways, in turn
    python benchmarks/power_cap.py --dry-run       # CPU: no nvidia-smi, says so
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import threading
import time

import _setup  # noqa: F401

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from _util import env_info, out_dir, save_json  # noqa: E402

#: The bits of ``clocks_throttle_reasons.active`` (NVML's clocks event reasons).
REASONS = {"sw_power_cap": 0x4, "hw_slowdown": 0x8, "sw_thermal": 0x20,
           "hw_thermal": 0x40, "hw_power_brake": 0x80}
QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def parse_sample(line: str):
    """``(sm_mhz, power_w, temp_c, reasons bitmask)`` of one ``nvidia-smi`` csv line, or
    None for a line that is not one (a header, an error)."""
    parts = [x.strip() for x in line.split(",")]
    if len(parts) != 4:
        return None
    try:
        return float(parts[0]), float(parts[1]), float(parts[2]), int(parts[3], 16)
    except ValueError:
        return None


def summarize(samples, calls: int, seconds: float) -> dict:
    """Calls per second, mean clock / power / temperature and each reason's share of the
    ``samples`` (as ``parse_sample`` returns them)."""
    out = dict(calls=calls, calls_per_s=calls / seconds, samples=len(samples))
    if samples:
        a = np.asarray([s[:3] for s in samples])
        out.update(sm_mhz=float(a[:, 0].mean()), power_w=float(a[:, 1].mean()),
                   temp_c=float(a[:, 2].mean()))
        for name, bit in REASONS.items():
            out[name] = float(np.mean([bool(s[3] & bit) for s in samples]))
    return out


def run_sampled(fn, args, seconds: float, period_ms: int):
    """``fn(*args)`` back to back for ``seconds`` (one sync per call) while ``nvidia-smi``
    samples; returns ``(calls, seconds run, samples)``."""
    samples = []
    proc = None
    if shutil.which("nvidia-smi"):
        proc = subprocess.Popen(["nvidia-smi", "-i", "0", f"--query-gpu={QUERY}",
                                 "--format=csv,noheader,nounits", f"-lms={period_ms}"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

        def read():
            for line in proc.stdout:
                s = parse_sample(line)
                if s is not None:
                    samples.append(s)
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        jax.block_until_ready(fn(*args))
        calls += 1
    took = time.perf_counter() - t0
    if proc is not None:
        proc.terminate()
        proc.wait(timeout=10)
        reader.join(timeout=10)
    return calls, took, samples


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--period-ms", type=int, default=20)
    p.add_argument("--pause", type=float, default=5.0,
                   help="idle seconds before each function (the clock recovers)")
    p.add_argument("--dry-run", action="store_true", help="tiny, on CPU (xla kernel)")
    p.add_argument("--mgpu-variant", action="append", default=[],
                   help="NAME:field=value,...: also the packed call through pallas_mgpu with "
                        "these MgpuConfig fields replaced (Hopper only)")
    p.add_argument("--no-extra", dest="extra", action="store_false",
                   help="leave out pallas_mgpu's one row and the batches of equal rows")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the functions' windows this many times over, in turn")
    a = p.parse_args(argv)
    from kernels import parse_mgpu_variant
    try:
        variants = dict(parse_mgpu_variant(t) for t in a.mgpu_variant)
    except ValueError as e:
        p.error(str(e))
    if a.repeat < 1:
        p.error(f"--repeat: expected >= 1, got {a.repeat}")
    from packed_batch import _cudnn, _ours
    from packed import _inputs, lognormal_lengths, packed_ids
    on_gpu = jax.default_backend() == "gpu"
    S, H, D = (512, 2, 32) if a.dry_run else (65536, 16, 128)
    if a.dry_run:
        a.seconds, a.pause = 0.5, 0.0
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    mesh = jax.make_mesh((1,), ("sp",), devices=jax.devices()[:1])
    kernel = "auto" if on_gpu else "xla"
    one = _inputs(0, 1, S, S, H, H, D, dtype)
    L = S // 16
    seg = jnp.asarray(packed_ids(lognormal_lengths(L, S, seed=S + L), S)[None])
    batch = _inputs(L, S // L, L, L, H, H, D, dtype)
    calls = {"cudnn one row" if on_gpu else "xla one row":
             ((_cudnn() if on_gpu else _ours(mesh, kernel, False)), (*one, None)),
             f"packed lognormal L{L}": (_ours(mesh, kernel, True), (*one, seg))}
    from jax_seqpar.kernels.pallas_mgpu import is_hopper
    hopper = on_gpu and is_hopper()
    if variants and not hopper:
        p.error("--mgpu-variant: pallas_mgpu needs a Hopper GPU")
    for name, kern in variants.items():
        calls[f"packed lognormal {name} L{L}"] = (_ours(mesh, kern, True), (*one, seg))
    if hopper and a.extra:  # the Hopper kernel on the same work, and short rows
        calls["mgpu one row"] = (_ours(mesh, "pallas_mgpu", False), (*one, None))
        calls[f"batch cudnn L{L}"] = (_cudnn(), (*batch, None))
        calls[f"batch mgpu L{L}"] = (_ours(mesh, "pallas_mgpu", False), (*batch, None))
    if shutil.which("nvidia-smi") is None:
        print("no nvidia-smi here: calls per second only", flush=True)
    rows = {}
    for name, (fn, args) in calls.items():
        jax.block_until_ready(fn(*args))  # every function compiled before the windows
    order = [(f"{n} #{i + 1}" if a.repeat > 1 else n, n) for i in range(a.repeat)
             for n in calls]
    for name, key in order:
        fn, args = calls[key]
        time.sleep(a.pause)
        n, took, samples = run_sampled(fn, args, a.seconds, a.period_ms)
        rows[name] = summarize(samples, n, took)
        r = rows[name]
        print(f"{name:28s} {r['calls_per_s']:7.1f} calls/s"
              + (f"  {r['sm_mhz']:5.0f} MHz {r['power_w']:4.0f} W {r['temp_c']:3.0f} C  "
                 + " ".join(f"{k} {100 * r[k]:3.0f}%" for k in REASONS)
                 if r["samples"] else ""), flush=True)
    path = os.path.join(out_dir(), "power_cap.json")
    save_json(dict(env=env_info(), seq=S, heads=H, head_dim=D, seconds=a.seconds,
                   period_ms=a.period_ms, rows=rows), path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
