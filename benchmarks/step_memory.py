"""XLA's memory account of one training step per attention backend, compiled, not run.

``train_mfu.py --memory-account`` prints the account of the step it then runs; this
script only compiles, so a layer-reduced model answers "does this backend change what a
step holds" in seconds per backend: a Llama shape of ``train_mfu.SIZES`` with
``--layers`` layers (what each layer holds is the same as in the full model), one row of
``--seq`` tokens on one device, ``--remat`` as the model's, one process per backend
so that nothing compiled for one is in the next's account.  ``mgpu_two`` is
``pallas_mgpu`` with the two-kernel backward (the table's forward, the dK/dV and dQ
kernels instead of the fused one); other names go to ``jax_seqpar.attention``'s
``kernel=`` as they are.

    python benchmarks/step_memory.py --kernels cudnn,pallas_mgpu,mgpu_two   # one H200
    python benchmarks/step_memory.py --kernels xla --seq 512 --size tiny     # CPU

Prints one JSON row per backend (GiB: XLA's temporaries, arguments, outputs, aliased)
and writes them to ``$OUT/step_memory.json``.  RESULTS.md, "auto on the H200".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import _setup  # noqa: F401


def kernel_for(name: str):
    """The ``kernel=`` of a backend name (``mgpu_two``: the two-kernel backward)."""
    if name != "mgpu_two":
        return name
    from jax_seqpar.kernels import PallasMgpuKernel
    from jax_seqpar.kernels.mgpu_tuning import gpu_key, lookup
    from jax_seqpar.kernels.pallas_mgpu import _device_kind
    kind = _device_kind()
    if not kind:
        raise SystemExit("mgpu_two needs a GPU (the table's config of its kind)")
    cfg = lookup(gpu_key(kind), "bfloat16", 128, "aligned", "causal")[0]
    return PallasMgpuKernel(config=dataclasses.replace(
        cfg, atomic_dq=False, split_dq=False, row_scores=False, overlap_bwd=True))


def one(args) -> dict:
    import train_mfu
    size = dict(train_mfu.SIZES[args.size])
    if args.layers:
        size["num_layers"] = args.layers
    train_mfu.SIZES["_measured"] = size
    dtype = "bfloat16" if args.size != "tiny" else "float32"
    step, state, batches, *_ = train_mfu.build(
        "_measured", 1, args.seq, dtype=dtype, remat=args.remat, params_mode="fsdp",
        kernel=kernel_for(args.one))
    m = step.lower(state, next(iter(batches.values()))).compile().memory_analysis()
    gib = 2 ** 30
    return dict(kernel=args.one, size=args.size, layers=size["num_layers"], seq=args.seq,
                remat=args.remat, temp_gib=m.temp_size_in_bytes / gib,
                args_gib=m.argument_size_in_bytes / gib,
                out_gib=m.output_size_in_bytes / gib, alias_gib=m.alias_size_in_bytes / gib)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", default="cudnn,pallas_mgpu,mgpu_two")
    p.add_argument("--size", default="7b", help="a train_mfu.SIZES name")
    p.add_argument("--layers", type=int, default=4, help="0: the size's own count")
    p.add_argument("--seq", type=int, default=131072)
    p.add_argument("--remat", default="full")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process
    args = p.parse_args(argv)
    if args.layers < 0 or args.seq < 1:
        p.error(f"--layers={args.layers} and --seq={args.seq} must be >= 0 and >= 1")
    if args.one is not None:
        print(json.dumps(one(args)), flush=True)
        return 0
    rows = []
    for name in [n for n in args.kernels.split(",") if n]:
        cmd = [sys.executable, __file__, "--one", name, "--size", args.size, "--layers",
               str(args.layers), "--seq", str(args.seq), "--remat", args.remat]
        out = subprocess.run(cmd, capture_output=True, text=True)
        last = (out.stdout.strip().splitlines() or [""])[-1]
        try:
            row = json.loads(last)
        except json.JSONDecodeError:
            errs = [ln for ln in out.stderr.splitlines() if "Error" in ln] or ["?"]
            row = dict(kernel=name, error=errs[-1][:300])
        print(json.dumps(row), flush=True)
        rows.append(row)
    path = os.path.join(os.environ.get("OUT") or "benchmarks/out", "step_memory.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(rows, fh, indent=1)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
