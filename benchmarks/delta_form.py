"""``delta = rowsum(dO * O)`` on the GPU: the einsum form against a row reduction.

The packed call's profile (RESULTS.md, "Packed documents against the same documents as a
batch") showed one XLA reduction fusion of 0.2 ms beside 11.4 ms of attention kernels,
about 2% of the call, where reading ``dO`` and ``O`` once (64 MB at 64k tokens, H 16,
D 128, bf16) takes about 15 us at the H200's bandwidth.  ``kernels.xla.attention_delta``
is an einsum ``bqhd,bqhd->bhq``: a dot with three batch dimensions and a contraction of
128, whose output order differs from its inputs'.  This script times, on the device's
clock in a fresh order each round:

* the two forms alone at the shapes of the packed bar and its batch;
* the packed call (``jax_seqpar.attention``, ``auto``, log-normal documents around 4k at
  64k tokens, forward + backward) and the same documents' batch through ``pallas_mgpu``
  with each form patched in where the library computes ``delta``;

checks the forms against each other (float32, relative), the two packed calls' gradients
against each other, and prints the reduction fusions of the packed call's compiled HLO.

    python benchmarks/delta_form.py            # one GPU, about a minute
"""

from __future__ import annotations

import argparse
import contextlib
import re

import _setup  # noqa: F401

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_seqpar as jsp  # noqa: E402
from _profile import device_rounds  # noqa: E402
from _util import env_info, out_dir, rel, save_json  # noqa: E402
from packed import _inputs, lognormal_lengths, packed_ids  # noqa: E402

F32 = jnp.float32


def delta_einsum(o, do):
    return jnp.einsum("bqhd,bqhd->bhq", do.astype(F32), o.astype(F32))


def delta_rows(o, do):
    return jnp.swapaxes(jnp.sum(do.astype(F32) * o.astype(F32), axis=-1), 1, 2)


def delta_rows_only(o, do):  # [B, T, H]: no transpose (a lower bound, not a delta)
    return jnp.sum(do.astype(F32) * o.astype(F32), axis=-1)


def delta_barrier(o, do):
    rows = jnp.sum(do.astype(F32) * o.astype(F32), axis=-1)
    return jnp.swapaxes(jax.lax.optimization_barrier(rows), 1, 2)


def delta_dot(o, do):  # bf16 products are exact in float32: the same numbers
    return jnp.einsum("bqhd,bqhd->bhq", do, o, preferred_element_type=F32)


def delta_heads_first(o, do):  # transpose the inputs, then reduce rows in place
    t = lambda x: jnp.swapaxes(x, 1, 2).astype(F32)  # noqa: E731
    return jnp.sum(t(do) * t(o), axis=-1)


FORMS = {"einsum": delta_einsum, "rows": delta_rows}
CANDIDATES = {**FORMS, "rows_only": delta_rows_only, "barrier": delta_barrier,
              "dot": delta_dot, "heads_first": delta_heads_first}
#: the modules that bind ``attention_delta`` by name
MODULES = ("jax_seqpar.kernels.xla", "jax_seqpar.kernels.pallas_mgpu_bwd",
           "jax_seqpar.kernels.pallas_gpu_bwd", "jax_seqpar.parallel.ring",
           "jax_seqpar.parallel.tree")


@contextlib.contextmanager
def patched(fn):
    import importlib
    mods = [importlib.import_module(m) for m in MODULES]
    old = [m.attention_delta for m in mods]
    for m in mods:
        m.attention_delta = fn
    try:
        yield
    finally:
        for m, f in zip(mods, old):
            m.attention_delta = f


def _call(mesh, kernel, with_seg):
    def fb(q, k, v, do, seg):
        def f(q, k, v):
            return jsp.attention(q, k, v, mesh=mesh, causal=True, kernel=kernel,
                                 segment_ids=seg if with_seg else None)
        return jax.vjp(f, q, k, v)[1](do)
    return jax.jit(fb)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--form", default="rows", choices=[n for n in CANDIDATES if n != "rows_only"],
                   help="the form timed against the einsum in the packed and batch calls")
    a = p.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    S, H, D, L = (65536, 16, 128, 4096) if on_gpu else (512, 2, 32, 128)
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    out = {"env": env_info(), "alone": {}, "calls": {}, "checks": {}}

    # the two forms alone
    calls = {}
    for shape in ((1, S, H, D), (S // L, L, H, D)):
        key = jax.random.key(sum(shape))
        o, do = (jax.random.normal(k_, shape, F32).astype(dtype)
                 for k_ in jax.random.split(key))
        got = {n: jax.jit(f)(o, do) for n, f in CANDIDATES.items()}
        for n in CANDIDATES:
            if n != "rows_only":
                out["checks"][f"{n} vs einsum {shape}"] = rel(got[n], got["einsum"])
        for n, f in CANDIDATES.items():
            calls[f"{n} {shape}"] = (jax.jit(f), (o, do))
    dev = device_rounds(calls, a.rounds, seed=1)
    for n in calls:
        out["alone"][n] = dev.get(n)
        print(f"alone {n:32s} {out['alone'][n]}", flush=True)

    # the packed call and the batch with each form
    mesh = jax.make_mesh((1,), ("sp",), devices=jax.devices()[:1])
    one = _inputs(0, 1, S, S, H, H, D, dtype)
    seg = jnp.asarray(packed_ids(lognormal_lengths(L, S, seed=S + L), S)[None])
    batch = _inputs(L, S // L, L, L, H, H, D, dtype)
    hopper = False
    if on_gpu:
        from jax_seqpar.kernels.pallas_mgpu import is_hopper
        hopper = is_hopper()
    batch_kernel = "pallas_mgpu" if hopper else ("auto" if on_gpu else "xla")
    # The kernels' backward functions are jitted at module level (one trace per shape), so
    # each form is traced after jax.clear_caches(): the library's own form first, then the
    # patched one; the first one's calls trace again (unpatched) at their warm-up below.
    calls, grads, hlo, jaxprs = {}, {}, {}, {}
    forms = ("einsum", a.form)
    for n in forms:
        with patched(CANDIDATES[n]):
            jax.clear_caches()
            fn = _call(mesh, "auto" if on_gpu else "xla", True)
            args = (*one, seg)
            grads[n] = jax.block_until_ready(fn(*args))
            jaxprs[n] = str(jax.make_jaxpr(fn)(*args))
            hlo[n] = fn.lower(*args).compile().as_text()
            calls[f"packed lognormal {n}"] = (fn, args)
            fb = _call(mesh, batch_kernel, False)
            jax.block_until_ready(fb(*batch, None))
            calls[f"batch {batch_kernel} {n}"] = (fb, (*batch, None))
    for fn, args in calls.values():  # warm: the einsum calls compile again here
        jax.block_until_ready(fn(*args))
    out["checks"]["jaxpr dots einsum / form"] = [jaxprs[n].count("dot_general") for n in forms]
    out["checks"][f"packed grads {a.form} vs einsum"] = max(
        rel(a_, b_) for a_, b_ in zip(grads[a.form], grads["einsum"]))
    out["checks"]["programs differ"] = hlo[a.form] != hlo["einsum"]
    for n, text in hlo.items():  # the reduction fusions: name, output shape
        out[f"input fusions {n}"] = [
            ln.strip()[:160] for ln in text.splitlines()
            if " fusion(" in ln and "kind=kInput" in ln]
        print(f"input fusions ({n}):", *out[f"input fusions {n}"], sep="\n  ", flush=True)
    if on_gpu:
        from _profile import print_summary, profile_call
        for n in forms:
            fn, args = calls[f"packed lognormal {n}"]
            s_ = profile_call(lambda: jax.block_until_ready(fn(*args)), f"/tmp/delta_{n}")
            print_summary(s_, f"packed lognormal {n}")
            out[f"profile {n}"] = s_
    dev = device_rounds(calls, a.rounds, seed=2)
    for n in calls:
        out["calls"][n] = dev.get(n)
        print(f"call  {n:32s} {out['calls'][n]}", flush=True)
    for k_, v in out["checks"].items():
        print(f"check {k_}: {v}", flush=True)
    save_json(out, f"{out_dir()}/delta_form.json")


if __name__ == "__main__":
    main()
