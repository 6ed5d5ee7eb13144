"""Compile time of the model's programs, unrolled vs scanned layers (issue 39).

Each measurement runs in a fresh process (``--child``), so that no trace or compilation
of an earlier one is reused, and reports

* ``train``: one AdamW step of ``models.Llama`` on one device (``training.make_train_step``
  with the state's abstract shardings): ``lower_s`` (tracing and lowering the jitted step
  on abstract inputs: ``jax.ShapeDtypeStruct``s, nothing allocated) and ``compile_s``
  (``lowered.compile()``), timed apart from execution; with ``--run-steps N`` also the
  step time (median of N steps after the first), MFU and peak memory;
* ``generate``: the prefill and the decode loop of ``models.generate``
  (``benchmarks/generate.py``'s ``run_config``: compile times, prefill tokens/s, decode
  ms per token against the HBM floor);
* ``cache``: the persistent compilation cache: the same training step in two fresh
  processes sharing a new cache folder; ``ready_s`` (model, state initialised, step
  compiled: everything before the first step) of the second against the first.

    python benchmarks/compile_time.py --jobs train:7b:32768:attention_mlp \\
        --forms unrolled,scanned --run-steps 4

``--jobs`` entries: ``train:SIZE:SEQ:REMAT``, ``generate:SIZE:PROMPT`` (``--new-tokens``),
``cache:SIZE:SEQ:REMAT`` (scanned); each runs once per ``--forms`` entry (``cache`` only
with the forms given).  The JSON goes to ``$OUT`` (else ``benchmarks/out/``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

T_START = time.perf_counter()
HERE = os.path.dirname(os.path.abspath(__file__))


def child(spec: dict) -> dict:
    """One measurement in this (fresh) process; returns its row."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # as train_mfu.py
    import _setup  # noqa: F401  (device count and sys.path)
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from jax_seqpar.models import Llama, LlamaConfig
    from jax_seqpar.training import abstract_train_state, init_train_state, make_train_step
    from _util import env_info, peak_memory_bytes
    from train_mfu import H200_BF16_DENSE, SIZES, flops_per_token, parse_remat

    if spec.get("cache_dir"):
        from jax_seqpar.runtime.compile_cache import enable_compile_cache
        enable_compile_cache(spec["cache_dir"])
    t_imported = time.perf_counter()
    kind, size, scanned = spec["kind"], spec["size"], spec["form"] == "scanned"
    row = dict(spec, imports_s=t_imported - T_START, env=env_info())
    on_gpu = jax.default_backend() == "gpu"
    dtype = "bfloat16" if on_gpu else "float32"
    if kind == "generate":
        import generate as gen_bench

        args = argparse.Namespace(new_tokens=spec["new_tokens"], dry_run=not on_gpu,
                                  prefill_chunk=None, repeats=3, strategies=(),
                                  no_baseline=True, scan_layers=scanned)
        mesh = jax.make_mesh((1,), ("sp",), axis_types=(AxisType.Auto,),
                             devices=jax.devices()[:1])
        rate = max(gen_bench.hbm_rates().values()) if on_gpu else 1e11
        out, _ = gen_bench.run_config(size, spec["seq"], 1, args, mesh, rate)
        row.update(out)
        return row
    mode, offload = parse_remat(spec["remat"])
    S = spec["seq"]
    cfg = LlamaConfig(**SIZES[size], dtype=dtype, param_dtype="float32", remat=mode,
                      remat_offload=offload, scan_layers=scanned)
    mesh = jax.make_mesh((1,), ("sp",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:1])
    model = Llama(cfg, mesh=mesh, layout="zigzag")
    opt = optax.adamw(1e-4, b1=0.9, b2=0.95, weight_decay=0.1)
    key = jax.random.PRNGKey(0)
    seq = NamedSharding(mesh, P(None, "sp"))
    abstract = abstract_train_state(model, opt, key, (1, S))
    batch = {"tokens": jax.ShapeDtypeStruct((1, S), jnp.int32, sharding=seq)}
    step = make_train_step(model, opt, shardings=abstract)
    t0 = time.perf_counter()
    lowered = step.lower(abstract, batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    row.update(lower_s=t1 - t0, compile_s=t2 - t1, hlo_lines=len(lowered.as_text().splitlines()))
    mem = compiled.memory_analysis()
    if mem is not None:  # XLA's account of the step: the state in and out, temporaries
        row.update(temp_bytes=mem.temp_size_in_bytes, argument_bytes=mem.argument_size_in_bytes,
                   output_bytes=mem.output_size_in_bytes, alias_bytes=mem.alias_size_in_bytes)
    if kind == "cache" or spec.get("run_steps"):
        state = init_train_state(model, opt, key, (1, S))
        tokens = jax.device_put(
            jax.random.randint(jax.random.PRNGKey(1), (1, S), 0, cfg.vocab_size, jnp.int32),
            seq)
        jax.block_until_ready(state)
        row["ready_s"] = time.perf_counter() - t_imported
        times = []
        for _ in range(max(1, spec.get("run_steps") or 1) + 1):
            t = time.perf_counter()
            state, metrics = compiled(state, {"tokens": tokens})
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t)
        steady = sorted(times[1:])[len(times[1:]) // 2]
        fl = flops_per_token(cfg, S)["total"] * S
        row.update(step_times_s=times, step_s=steady, loss=float(metrics["loss"]),
                   mfu=fl / steady / H200_BF16_DENSE if on_gpu else None,
                   peak_bytes=peak_memory_bytes(jax.devices()[0]))
    return row


def run_child(spec: dict, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE)
    except subprocess.TimeoutExpired:
        return dict(spec, error=f"timed out after {timeout:.0f} s")
    wall = time.perf_counter() - t0
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        return dict(spec, error=f"rc={p.returncode}: {p.stderr[-2000:]}", process_s=wall)
    return dict(json.loads(lines[-1]), process_s=wall)


def parse_jobs(text: str, forms, new_tokens: int):
    jobs = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        parts = entry.split(":")
        kind = parts[0]
        if kind in ("train", "cache") and len(parts) == 4:
            base = dict(kind=kind, size=parts[1], seq=int(parts[2]), remat=parts[3])
        elif kind == "generate" and len(parts) == 3:
            base = dict(kind=kind, size=parts[1], seq=int(parts[2]), new_tokens=new_tokens)
        else:
            raise ValueError(f"--jobs entry {entry!r}: expected train:SIZE:SEQ:REMAT, "
                             f"cache:SIZE:SEQ:REMAT or generate:SIZE:PROMPT")
        for form in forms:
            jobs.append(dict(base, form=form))
    return jobs


def summary(row: dict) -> str:
    if "error" in row:
        return f"{row['kind']} {row['size']} {row['seq']} {row['form']}: ERROR {row['error'][-300:]}"
    keys = ("lower_s", "compile_s", "temp_bytes", "argument_bytes", "ready_s", "step_s", "mfu", "prefill_compile_s",
            "decode_compile_s", "prefill_tokens_per_s", "decode_ms_per_token",
            "fraction_of_floor", "peak_bytes", "process_s")
    vals = " ".join(f"{k}={row[k]:.4g}" for k in keys if isinstance(row.get(k), (int, float)))
    return f"{row['kind']} {row['size']} {row['seq']} {row.get('remat', '')} {row['form']}: {vals}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", default="train:tiny:256:none")
    p.add_argument("--forms", default="unrolled,scanned")
    p.add_argument("--run-steps", type=int, default=0,
                   help="also run the train step this many times (after a first one)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--timeout-s", type=float, default=600.0, help="per child process")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new job after this many seconds")
    p.add_argument("--name", default="compile_time")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is not None:
        sys.path.insert(0, HERE)
        print(json.dumps(child(json.loads(a.child)), default=str), flush=True)
        return
    from _util import out_dir  # noqa: E402  (no JAX in the parent)

    forms = [f.strip() for f in a.forms.split(",") if f.strip()]
    for f in forms:
        if f not in ("unrolled", "scanned"):
            raise ValueError(f"--forms entry {f!r}: unrolled or scanned")
    rows, t0 = [], time.perf_counter()
    for job in parse_jobs(a.jobs, forms, a.new_tokens):
        if a.budget_s is not None and time.perf_counter() - t0 > a.budget_s:
            rows.append(dict(job, error="skipped: --budget-s spent"))
            print(summary(rows[-1]), flush=True)
            continue
        if job["kind"] == "cache":
            with tempfile.TemporaryDirectory() as d:
                for run in ("cold", "cached"):
                    r = run_child(dict(job, cache_dir=d, run=run, run_steps=1), a.timeout_s)
                    rows.append(r)
                    print(summary(r) + f" [{run}]", flush=True)
            continue
        rows.append(run_child(dict(job, run_steps=a.run_steps), a.timeout_s))
        print(summary(rows[-1]), flush=True)
    path = os.path.join(out_dir(), f"{a.name}.json")
    with open(path, "w") as f:
        json.dump(rows, f, indent=1, default=str)
    print(f"# wrote {path}", flush=True)


if __name__ == "__main__":
    main()
