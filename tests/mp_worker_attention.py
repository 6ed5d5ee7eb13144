"""Worker of tests/test_multiprocess.py: ring attention, forward and backward, on a mesh
that spans every process.

    python -m jax_seqpar launch -n 2 --devices-per-process 4 -- \\
        python tests/mp_worker_attention.py OUT.npz

Every process draws the same host inputs, turns them into global arrays sharded along the
sequence over all devices of all processes, runs ``jax_seqpar.attention`` (outputs and
the gradients of ``<out, do>``) for each case of ``CASES``, gathers the results to every
host, and process 0 writes them to ``OUT.npz``.  The test runs ``CASES`` through
``fwd_bwd`` in its own (single) process on 8 devices and compares.
"""

from __future__ import annotations

import functools
import sys

import numpy as np

SHAPE = dict(B=2, S=64, Hq=4, Hkv=2, D=16)
#: name -> keyword arguments of jax_seqpar.attention
CASES = {
    "ring_kv": dict(strategy="ring", causal=False, layout="contiguous", backward="kv"),
    "ring_causal_zigzag_q": dict(strategy="ring", causal=True, layout="zigzag", backward="q"),
    "ring_causal_kv": dict(strategy="ring", causal=True, layout="contiguous", backward="kv"),
}
OUTPUTS = ("out", "dq", "dk", "dv")


def host_inputs(seed: int = 0):
    """q, k, v, do as float32 NumPy arrays (the same on every process)."""
    rng = np.random.default_rng(seed)
    B, S, Hq, Hkv, D = (SHAPE[n] for n in ("B", "S", "Hq", "Hkv", "D"))
    shapes = ((B, S, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D), (B, S, Hq, D))
    return tuple(rng.standard_normal(s).astype(np.float32) for s in shapes)


@functools.lru_cache(maxsize=None)
def fwd_bwd(mesh, name):
    """Jitted ``(q, k, v, do) -> (out, dq, dk, dv)`` for ``CASES[name]`` on ``mesh``."""
    import jax

    import jax_seqpar as jsp

    kw = CASES[name]

    def f(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: jsp.attention(q, k, v, mesh=mesh, axis_name="sp",
                                                         **kw), q, k, v)
        return (out, *vjp(do))

    return jax.jit(f)


def run(mesh) -> dict:
    """Every case on ``mesh``: ``{"<case>/<out|dq|dk|dv>": host array}`` (all processes)."""
    import jax_seqpar.runtime.distributed as jd
    from jax.sharding import PartitionSpec as P

    q, k, v, do = jd.from_host(host_inputs(), mesh, P(None, "sp"))
    results = {}
    for name in CASES:
        outs = fwd_bwd(mesh, name)(q, k, v, do)
        results[f"{name}/fully_addressable"] = np.bool_(all(o.is_fully_addressable
                                                            for o in outs))
        for what, x in zip(OUTPUTS, jd.to_host(outs)):
            results[f"{name}/{what}"] = x
    return results


def main(out_path: str) -> int:
    import jax_seqpar.runtime.distributed as jd

    info = jd.initialize()  # before anything asks JAX for devices
    assert jd.initialize() == info, "a second initialize() must return the same info"
    try:
        jd.initialize(num_processes=info.process_count + 1)
    except RuntimeError as e:
        assert "already called with other settings: num_processes=" in str(e), e
    else:
        raise AssertionError("initialize() with contradicting settings did not raise")
    import jax

    print(info, flush=True)
    results = run(jax.make_mesh((jax.device_count(),), ("sp",)))
    if info.is_main:
        np.savez(out_path, process_count=np.int32(info.process_count),
                 device_count=np.int32(info.device_count), **results)
        print(f"wrote {out_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
