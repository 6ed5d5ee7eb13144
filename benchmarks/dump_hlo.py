"""Dump the compiled HLO of the ring backward (both schemes) and its collective report.

Used to check ``jax_seqpar.runtime.comm`` against what a given backend's compiler emits:
    python benchmarks/dump_hlo.py  [writes $OUT or benchmarks/out/hlo_*.txt]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_seqpar as jsp  # noqa: E402
from jax_seqpar.runtime.comm import analyze_hlo, compiled_text  # noqa: E402
from jax_seqpar.parallel.costs import backward_bytes  # noqa: E402
from jax_seqpar.parallel.ring import ring_shape  # noqa: E402

out = os.environ.get("OUT", "benchmarks/out")
os.makedirs(out, exist_ok=True)
B, S, Hq, Hkv, D = 1, 4096, 4, 4, 64
dt = jnp.bfloat16
ks = jax.random.split(jax.random.PRNGKey(0), 4)
q = jax.random.normal(ks[0], (B, S, Hq, D), dt)
k = jax.random.normal(ks[1], (B, S, Hkv, D), dt)
v = jax.random.normal(ks[2], (B, S, Hkv, D), dt)
do = jax.random.normal(ks[3], (B, S, Hq, D), dt)
for G in (2, 4):
    if G > jax.device_count():
        continue
    mesh = jax.make_mesh((G,), ("sp",), devices=jax.devices()[:G])
    for scheme in ("kv", "q"):
        f = lambda q, k, v: jsp.attention(q, k, v, mesh=mesh, backward=scheme)  # noqa: E731
        _, vjp = jax.jit(lambda q, k, v: jax.vjp(f, q, k, v))(q, k, v)
        text = compiled_text(jax.jit(lambda vjp, do: vjp(do)), vjp, do)
        path = os.path.join(out, f"hlo_bwd_G{G}_{scheme}.txt")
        with open(path, "w") as fh:
            fh.write(text)
        rep = analyze_hlo(text, G)
        want = backward_bytes(scheme, ring_shape(jsp.api.make_config(q, k, axis_name='sp', causal=False, window=None, segment_ids=None, scale=None, layout='contiguous', backward='kv', kernel='xla'), q[:, : S // G], k[:, : S // G], None, G))
        print(G, scheme, rep.total_bytes, want, rep.count_by_kind(), rep.warnings)
        for op in rep.ops:
            print("   ", op)
