"""Command line: ``python -m jax_seqpar {info, demo, launch}`` (also the ``jax-seqpar`` script).

``demo`` runs ring and all-gather attention (causal, GQA, forward and backward) on all
devices, checks them against the dense reference and prints a table.  On a machine with
no accelerator it simulates 8 CPU devices; this must be decided before JAX starts its
backend, so the CLI sets it up before touching any device.  Its programs go to JAX's
persistent compilation cache (``runtime.compile_cache``: ``--compile-cache DIR``,
``--no-compile-cache``; off by default on several CPU devices), so running it again with
the same sizes does not compile.  (``info`` compiles nothing; ``launch`` starts commands
that take their own flags.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _simulate_cpu_devices(n: int) -> None:
    """Ask for ``n`` host devices (only affects the CPU platform; GPUs are used as they are),
    unless ``XLA_FLAGS`` already asks for a number."""
    flag = f"--xla_force_host_platform_device_count={n}"
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return  # set by the user or by `launch --devices-per-process`: keep it
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except Exception:  # backend already initialised, or option unknown: XLA_FLAGS decides
        pass


def _join_processes():
    """``jax_seqpar.runtime.distributed.initialize()``: a no-op unless started by ``launch`` or a
    cluster scheduler; must run before JAX starts its backends."""
    from jax_seqpar.runtime.distributed import initialize

    return initialize()


def cmd_info(args) -> int:
    _simulate_cpu_devices(args.cpu_devices)
    proc = _join_processes()
    import jax

    import jax_seqpar
    from jax_seqpar.kernels import available_kernels
    from jax_seqpar.kernels.base import PLANNED_KERNELS

    print(f"jax_seqpar {jax_seqpar.__version__}")
    print(f"jax {jax.__version__}, jaxlib {getattr(jax.lib, '__version__', '?')}")
    print(f"default backend: {jax.default_backend()}")
    if proc.process_count > 1:
        print(f"process {proc.process_index} of {proc.process_count}, "
              f"{proc.local_device_count} local devices")
    devs = jax.devices()
    print(f"devices ({len(devs)}):")
    for d in devs:
        where = f", process {d.process_index}" if proc.process_count > 1 else ""
        print(f"  {d.id}: {d.device_kind} ({d.platform}{where})")
    planned = f" (planned: {', '.join(PLANNED_KERNELS)})" if PLANNED_KERNELS else ""
    print(f"kernel backends: {', '.join(available_kernels())}{planned}")
    return 0


def _rel(a, b) -> float:
    import jax.numpy as jnp

    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def cmd_demo(args) -> int:
    _simulate_cpu_devices(8)
    proc = _join_processes()
    from jax_seqpar.runtime.compile_cache import compile_cache_from_args

    cache = compile_cache_from_args(args)
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jax_seqpar as jsp
    from jax_seqpar.runtime.comm import collective_bytes
    from jax_seqpar.runtime.distributed import from_host, to_host

    multi = proc.process_count > 1  # every process runs all of this; process 0 reports
    say = print if proc.is_main else (lambda *a, **k: None)

    devs = jax.devices()
    G = len(devs)
    S = args.seq_len or max(8 * 1024, 1024 * G)
    B, Hq, Hkv, D = 1, args.heads, args.kv_heads, args.head_dim
    dtype = jnp.dtype(args.dtype)
    budget = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2}[dtype]
    mesh = jax.make_mesh((G,), ("sp",), devices=devs)
    ks = jax.random.split(jax.random.PRNGKey(args.seed), 4)
    q = jax.random.normal(ks[0], (B, S, Hq, D), dtype)
    k = jax.random.normal(ks[1], (B, S, Hkv, D), dtype)
    v = jax.random.normal(ks[2], (B, S, Hkv, D), dtype)
    do = jax.random.normal(ks[3], (B, S, Hq, D), dtype)
    where = f" in {proc.process_count} processes" if multi else ""
    say(f"{G} x {devs[0].device_kind} ({jax.default_backend()}){where}, jax {jax.__version__}; "
        f"causal GQA attention B={B} S={S} Hq={Hq} Hkv={Hkv} D={D} {dtype.name}, "
        f"forward + backward")

    def ref_fn(q, k, v):
        return jsp.reference_attention(q, k, v, causal=True)[0]

    inputs = (q, k, v, do)
    if multi:  # the same values on every process become one array over all processes
        inputs = from_host(inputs, mesh, P(None, "sp"))
    results = []
    for strategy in ("ring", "allgather"):
        def step(q, k, v, do, strategy=strategy):
            out, vjp = jax.vjp(lambda q, k, v: jsp.attention(
                q, k, v, mesh=mesh, strategy=strategy, causal=True), q, k, v)
            return out, vjp(do)

        fn = jax.jit(step)
        jax.block_until_ready(fn(*inputs))  # compile + warm up
        t0 = time.perf_counter()
        out, grads = jax.block_until_ready(fn(*inputs))
        dt = time.perf_counter() - t0
        comm = collective_bytes(fn, *inputs)
        if multi:
            out, grads = to_host((out, grads))  # a collective: every process takes part
        results.append((strategy, out, grads, dt, comm.total_bytes))
    if not proc.is_main:
        return 0
    # The dense reference, on this process's first device, only after the last collective:
    # work that one process does alone before a collective keeps its peers waiting in the
    # collective's rendezvous, which on CPU (gloo) gives up after a fixed 30 s.
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref_out, ref_vjp = jax.vjp(ref_fn, up(q), up(k), up(v))
    ref_grads = ref_vjp(up(do))
    ok, rows = True, []
    for strategy, out, grads, dt, sent in results:
        errs = [_rel(out, ref_out)] + [_rel(g, r) for g, r in zip(grads, ref_grads)]
        ok &= all(e <= budget for e in errs)
        rows.append((strategy, G, S, *errs, dt, sent))
    head = ("strategy", "devices", "tokens", "err out", "err dq", "err dk", "err dv",
            "time (s)", "sent/device")
    print(("{:<10}{:>8}{:>8}" + "{:>10}" * 4 + "{:>10}{:>14}").format(*head))
    for r in rows:
        print(("{:<10}{:>8}{:>8}" + "{:>10.1e}" * 4 + "{:>10.3f}{:>12.2f}MB").format(
            *r[:-1], r[-1] / 1e6))
    print(f"relative errors are ||x - ref|| / ||ref|| against the float32 dense reference; "
          f"budget {budget:g}: {'PASS' if ok else 'FAIL'}")
    print("bytes are what one device sends in forward + backward, read from the compiled HLO")
    if cache is not None:
        from jax_seqpar.runtime.compile_cache import compile_cache_summary

        print(compile_cache_summary())
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jax_seqpar", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("info", help="devices, JAX version, kernel backends")
    pi.add_argument("--cpu-devices", type=int, default=8,
                    help="CPU devices to simulate when there is no accelerator (default 8)")
    pd = sub.add_parser("demo", help="ring vs all-gather attention, checked against the reference")
    pd.add_argument("--seq-len", type=int, default=None,
                    help="total tokens (default max(8192, 1024 x devices))")
    pd.add_argument("--heads", type=int, default=4)
    pd.add_argument("--kv-heads", type=int, default=1)
    pd.add_argument("--head-dim", type=int, default=64)
    pd.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    pd.add_argument("--seed", type=int, default=0)
    from jax_seqpar.runtime.compile_cache import add_compile_cache_args

    add_compile_cache_args(pd)
    from jax_seqpar.runtime.launch import add_parser as add_launch_parser

    add_launch_parser(sub)
    args = p.parse_args(argv)
    if args.cmd == "launch":
        return args.func(args)
    return {"info": cmd_info, "demo": cmd_demo}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
