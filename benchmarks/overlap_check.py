"""Does the compiled ring overlap each transfer with a local tile?  (compile only)

Compiles the forward and backward of the 1-D ring (``--strategy ring``) or of the
double ring (``--strategy double_ring``: ``--nodes`` x G/nodes devices, axes ("node",
"local"), BurstEngine §3.1 Fig. 4-5) over every device present (8 simulated CPU devices
without an accelerator) and prints, per collective, its mesh axis and what the scheduled
HLO puts in its window (``jax_seqpar.runtime.overlap``): on GPUs the instructions between each
``collective-permute-start`` and its ``-done``; on CPU, whose collectives are
synchronous, those between the collective and its first user; and the kernel compute
scheduled before a kernel reads its data (``until_needed``).  Exits non-zero when an
activation hop has no kernel compute where it must have some: a hop that forwards a
received block (over the ring's axis, or the intra-node axis of a double ring) in its
window, and a double ring's inter-node hop before its block is read.  On a GPU an
activation hop must also be asynchronous: XLA runs a plain ``collective-permute`` (what
it leaves where its scheduler put nothing between a start and its done) on the compute
stream, alone, so the compute after it in program order does not hide it; such hops are
counted apart ("synchronous on the GPU") and fail the check too.

    python benchmarks/overlap_check.py [--seq 65536] [--causal] [--backward kv|q] [--segments]
    python benchmarks/overlap_check.py --strategy double_ring --nodes 2 --causal
    python benchmarks/overlap_check.py --causal --backward q --segments --apart  # each
                                                     # array of a hop its own collective
    python benchmarks/overlap_check.py --causal --unrolled --dump-hlo   # every hop unrolled,
                                                     # the scheduled HLO of both phases to $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import _setup  # noqa: F401,E402  (before JAX: device count, sys.path)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_seqpar as jsp  # noqa: E402
from jax_seqpar.parallel import ring_common  # noqa: E402
from jax_seqpar.runtime.overlap import compiled_text, overlap_windows  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--backward", default="kv", choices=("kv", "q"))
    ap.add_argument("--segments", action="store_true",
                    help="packed documents: segment ids travel with the blocks")
    ap.add_argument("--strategy", default="ring", choices=("ring", "double_ring"))
    ap.add_argument("--nodes", type=int, default=2,
                    help="double_ring: size of the outer (inter-node) axis")
    ap.add_argument("--unrolled", action="store_true",
                    help="every ring hop unrolled (parallel.ring_common.ROLL_HOPS = False)")
    ap.add_argument("--apart", action="store_true",
                    help="each array of a hop its own collective "
                         "(parallel.ring_common.PACK_HOPS = False)")
    ap.add_argument("--dump-hlo", action="store_true",
                    help="write each phase's scheduled HLO to $OUT")
    a = ap.parse_args(argv)
    G = jax.device_count()
    on_gpu = jax.default_backend() == "gpu"
    S = a.seq or (G * (4096 if on_gpu else 16))
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    shape = (1, S, a.heads, a.head_dim)
    q = k = v = do = jax.ShapeDtypeStruct(shape, dtype)
    seg = jax.ShapeDtypeStruct((1, S), jnp.int32) if a.segments else None
    if a.strategy == "double_ring":
        if G % a.nodes:
            ap.error(f"--nodes {a.nodes} must divide the {G} devices")
        mesh = jax.make_mesh((a.nodes, G // a.nodes), ("node", "local"))
        axis_name, inner = ("node", "local"), "local"
    else:
        mesh = jax.make_mesh((G,), ("sp",))
        axis_name, inner = "sp", "sp"
    layout = "zigzag" if a.causal else "contiguous"

    def att(q, k, v, seg=None):
        return jsp.attention(q, k, v, mesh=mesh, axis_name=axis_name, strategy=a.strategy,
                             causal=a.causal, layout=layout, permuted=True,
                             backward=a.backward, segment_ids=seg)

    def fwd_bwd(q, k, v, do, seg=None):
        _, vjp = jax.vjp(lambda q, k, v: att(q, k, v, seg), q, k, v)
        return vjp(do)

    out = os.environ.get("OUT", "benchmarks/out")
    os.makedirs(out, exist_ok=True)
    name = "overlap" if a.strategy == "ring" else f"overlap_double_ring{a.nodes}x"
    name += "_unrolled" if a.unrolled else ""
    name += "_segments" if a.segments else ""
    name += "_apart" if a.apart else ""
    rows, bad, sync, sync_all = [], 0, 0, 0
    saved = ring_common.ROLL_HOPS, ring_common.PACK_HOPS
    ring_common.ROLL_HOPS, ring_common.PACK_HOPS = not a.unrolled, not a.apart
    try:
        texts = {phase: compiled_text(fn, *args) for phase, fn, args in (
            ("forward", att, (q, k, v, seg)), ("fwd+bwd", fwd_bwd, (q, k, v, do, seg)))}
    finally:
        ring_common.ROLL_HOPS, ring_common.PACK_HOPS = saved
    for phase, text in texts.items():
        if a.dump_hlo:
            with open(os.path.join(out, f"{name}_{phase.replace('+', '_')}.hlo.txt"), "w") as f:
                f.write(text)
        # a hop "forwards" a block when its operand is the block a collective brought; a
        # rolled ring's loop-body hops forward the loop's carry instead, and are not
        # counted as forwarding here (their operands do not say which hop they are)
        for w in overlap_windows(text):
            axis = w.axes(mesh)
            sync_all += on_gpu and not w.is_async
            forwarded = w.operand_ops == ("collective-permute",)
            if not w.gradient:
                needs = ((forwarded and axis == inner) or axis == "node")
                if forwarded and axis == inner and not w.overlapped:
                    bad += 1
                elif axis == "node" and not w.compute_until_needed:
                    bad += 1
                elif needs and on_gpu and not w.is_async:  # runs alone on the GPU
                    bad += 1
                    sync += 1
            rows.append({"phase": phase, "collective": w.collective, "kind": w.kind,
                         "axis": axis if isinstance(axis, str) else str(axis),
                         "async": w.is_async, "gradient": w.gradient,
                         "forwards_block": forwarded, "window": len(w.between),
                         "kernel_compute": list(w.compute),
                         "compute_until_needed": len(w.compute_until_needed),
                         "independent_compute": len(w.independent)})
    print(f"{jax.default_backend()} x{G}, {a.strategy} {dict(mesh.shape)}, S={S}, "
          f"causal={a.causal}, backward={a.backward}, segments={a.segments}, "
          f"apart={a.apart}")
    print(f"{'phase':<8} {'collective':<28} {'axis':<6} {'async':>5} {'grad':>5} {'fwd':>4} "
          f"{'window':>6} {'until':>5}  kernel compute in window")
    for r in rows:
        print(f"{r['phase']:<8} {r['collective']:<28} {r['axis']:<6} {str(r['async']):>5} "
              f"{str(r['gradient']):>5} {str(r['forwards_block']):>4} {r['window']:>6} "
              f"{r['compute_until_needed']:>5}  {', '.join(r['kernel_compute'][:3])}")
    with open(os.path.join(out, f"{name}_{jax.default_backend()}{G}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"activation hops without kernel compute where they need it: {bad}"
          + (f" ({sync} of them synchronous on the GPU)" if on_gpu else ""))
    if on_gpu:  # gradient hops included: not a failure, a cost
        print(f"collectives synchronous on the GPU, all hops: {sync_all} of {len(rows)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
