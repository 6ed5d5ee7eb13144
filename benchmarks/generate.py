"""Generation speed: ring-attention prefill and tree-attention decoding (``models.generate``).

For each configuration ``SIZE:PROMPT:BATCH`` (``train_mfu.SIZES`` shapes, bf16 weights
and activations, random weights and prompts; the KV cache sharded over ``--devices``):

* **prefill**: one call of the compiled prefill (``Generator.prefill``; compile timed
  apart), tokens/s and MFU.  FLOPs, forward only: ``2 * N_matmul`` per token plus the
  causal attention ``2 * L * P * Hq * Dh`` per token (half of ``4 * P * Hq * Dh``), against
  989 TFLOP/s per GPU (H200 dense bf16 spec);
* **decode**: ``--new-tokens`` greedy steps of the compiled decode loop (one
  ``lax.while_loop``), ms per token (the median of ``--repeats`` runs, each reusing the
  cache the previous returned), against the **memory-bandwidth floor**: the bytes a step
  must read -- every weight once plus each row's visible K/V cache (``2 * L * Hkv * Dh``
  values per token of context, the context growing by one per step) -- over the best HBM
  rate measured in the same run (a large ``sum``, and a copy counting bytes read plus
  written), per device;
* **dense baseline** (one device): the same model and loop, but what a user would write
  without this library: a contiguous ``[B, cache_len, Hkv, D]`` cache updated with
  ``dynamic_update_slice`` and ``jax.nn.dot_product_attention`` over it with a length
  mask.

    python benchmarks/generate.py --dry-run                      # CPU, tiny, 2 devices
    python benchmarks/generate.py --configs 7b:131072:1,7b:32768:8,1b:131072:1
    python benchmarks/generate.py --devices 4 --configs 7b:524288:1,1b:1048576:1,1b:524288:8
    python benchmarks/generate.py --dry-run --scan-layers both   # unrolled vs stacked

With several devices the same cache is also decoded with ``ring`` and ``allgather``
(``--strategies``; ``generator_for(..., decode_strategy=)``: the step with the cache
shards circulating, or gathered, instead of tree attention's two all-reduces).

``--scan-layers`` builds the model with ``LlamaConfig(scan_layers=True)`` (the blocks'
weights stacked along a leading layer axis; the same random numbers either way), and
``--scan-layers both`` runs every configuration unrolled and then scanned (issue 39):
the prefill of stacked weights is one ``lax.scan`` over the layers (compile time), the
decode step reads static slices of them inside its ``while_loop``, which XLA may read
in place, copy at every step or hoist out of the loop (a second copy of the weights).
Each row has ``scan_layers``, the compile times, ms per token, and the temporary bytes
of the compiled prefill and decode programs (``prefill_temp_bytes``,
``decode_temp_bytes``: ``memory_analysis()``, per program, so comparable within one
run; a copy of the weights made by the decode program shows there).  ``peak_bytes`` is
the process's high-water mark so far: within one run it covers every earlier row too.

    python benchmarks/generate.py --configs 7b:32768:1,1b:131072:1 --scan-layers both \
        --strategies "" --no-baseline
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time

import _setup  # noqa: F401

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

from jax_seqpar.models import Llama, LlamaConfig  # noqa: E402
from jax_seqpar.models.generate import LlamaParts, generator_for  # noqa: E402
from jax_seqpar.models.stacking import layer_params, stack_layers  # noqa: E402
from jax_seqpar.parallel.comm_time import Link  # noqa: E402
from jax_seqpar.sharding import choose_mesh, make_mesh, parse_mesh_arg  # noqa: E402
from _util import env_info, out_dir, peak_memory_bytes, save_json  # noqa: E402
from train_mfu import H200_BF16_DENSE, SIZES, flops_per_token  # noqa: E402


def hbm_rates(gib=4):
    """Measured HBM rates (bytes/s): a large read (``sum`` of a bf16 array) and a copy
    (``x + 1``, bytes read plus written).  The floor uses the larger: the best rate this
    device showed for moving bytes."""
    n = int(gib * (1 << 30)) // 2
    x = jnp.ones((n // 8192, 8192), jnp.bfloat16)
    rates = {}
    for name, f, nbytes in (("read_sum", lambda x: jnp.sum(x, dtype=jnp.float32), 2 * n),
                            ("copy", lambda x: x + 1, 4 * n)):
        f = jax.jit(f)
        jax.block_until_ready(f(x))
        ts = []
        for _ in range(10):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x))
            ts.append(time.perf_counter() - t0)
        rates[name] = nbytes / statistics.median(ts)
    del x
    return rates


def dense_decoder(cfg: LlamaConfig, B: int, C: int, N: int):
    """The baseline: ``(params, first_tok, lengths, k, v) -> tokens`` on one device, with
    ``jax.nn.dot_product_attention`` over a contiguous cache."""
    parts = LlamaParts(cfg)

    def step(p, tok, pos, ks, vs):
        x = parts.embed(p, tok[:, None])
        ks, vs = list(ks), list(vs)
        for layer in range(cfg.num_layers):
            def attend(q, k, v, layer=layer):
                upd = jax.vmap(lambda c, new, at: lax.dynamic_update_slice_in_dim(
                    c, new, at, axis=0))
                ks[layer] = upd(ks[layer], k, pos)
                vs[layer] = upd(vs[layer], v, pos)
                mask = (jnp.arange(C)[None, :] <= pos[:, None])[:, None, None, :]
                return jax.nn.dot_product_attention(q, ks[layer], vs[layer], mask=mask)
            x = parts.block(layer_params(p, layer), x, pos[:, None], attend)
        return parts.logits(p, x)[:, 0], tuple(ks), tuple(vs)

    def run(params, first, lengths, ks, vs):
        p = params["params"]
        out = jnp.zeros((B, N), jnp.int32).at[:, 0].set(first)

        def body(i, s):
            tok, out, ks, vs = s
            logits, ks, vs = step(p, tok, lengths + i - 1, ks, vs)
            new = jnp.argmax(logits, -1).astype(jnp.int32)
            return new, out.at[:, i].set(new), ks, vs
        _, out, ks, vs = lax.fori_loop(1, N, body, (first, out, ks, vs))
        return out, ks, vs
    return jax.jit(run, donate_argnums=(3, 4))


def auto_mesh(size, P_, B, G):
    """``--mesh auto``: ``sharding.choose_mesh``'s split for this model, prompt and batch on
    one node of ``G`` H200s (its model is the training step's: weights, optimizer state
    and activations; generation holds no optimizer state, so the pick errs towards
    splitting more), printed with its reason."""
    choice = choose_mesh(LlamaConfig(**SIZES[size], dtype="bfloat16"), seq_len=P_,
                         global_batch=B, devices_per_node=G, intra_link=Link(450e9, 5e-6),
                         device_memory=141e9, device_flops=H200_BF16_DENSE)
    print(f"# --mesh auto for {size}:{P_}:{B}: {choice.sizes} ({choice.reason})", flush=True)
    return make_mesh(dict(choice.sizes), jax.devices()[:G])


def median_time(fn, repeats):
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts


def temp_bytes(compiled):
    """The temporary bytes of a compiled program (None where the backend does not say)."""
    try:
        return compiled.memory_analysis().temp_size_in_bytes
    except Exception:  # noqa: BLE001
        return None


def run_config(size, P_, B, a, mesh, rate, par=None, scan=None):
    """``par`` (a ``sharding.Parallelism`` of ``mesh``, from ``--mesh``): the N-D model,
    weights split over the tensor axis, prompts over the batch axes; None: the one-axis
    model over ``mesh["sp"]``.  ``scan``: the model built with ``LlamaConfig(scan_layers=
    True)`` and its weights stacked along a leading layer axis: the unrolled model's
    numbers (``stacking.stack_layers``, inside the initialising program), so both forms
    should give the same tokens.  None: ``a.scan_layers`` (a bool, or ``--scan-layers``'
    ``"on"``)."""
    if scan is None:
        scan = getattr(a, "scan_layers", False)
        scan = scan if isinstance(scan, bool) else scan == "on"
    G = mesh.devices.size
    dtype = "float32" if a.dry_run else "bfloat16"
    cfg = LlamaConfig(**SIZES[size], dtype=dtype, param_dtype=dtype, scan_layers=scan)
    model = Llama(cfg) if par is None else Llama(cfg, mesh=mesh, parallelism=par)
    N = a.new_tokens
    rep = NamedSharding(mesh, P())
    unrolled = Llama(dataclasses.replace(cfg, scan_layers=False))
    init = (lambda k, t: stack_layers(unrolled.init(k, t))) if scan else unrolled.init
    params = jax.jit(init, out_shardings=rep)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    prompts = jax.random.randint(jax.random.key(1), (B, P_), 0, cfg.vocab_size, jnp.int32)
    lengths = jnp.full((B,), P_, jnp.int32)
    gen = generator_for(model, (B, P_), N, mesh=mesh, prefill_chunk=a.prefill_chunk,
                        eos_id=None)   # every row runs all N steps (timed)
    if par is not None:
        params = gen.replicate(params)  # split over the tensor axis as the model splits it
    row = dict(size=size, prompt=P_, batch=B, devices=G, new_tokens=N, scan_layers=scan,
               mesh=dict(mesh.shape) if par is not None else {"sp": G},
               cache_len=gen.plan.cache_len, prefill_chunk=gen.plan.chunk,
               prefill_passes=gen.plan.num_chunks)
    # ---- prefill
    t0 = time.perf_counter()
    prefill = gen.prefill.lower(params, prompts, lengths).compile()
    row["prefill_compile_s"] = time.perf_counter() - t0
    row["prefill_temp_bytes"] = temp_bytes(prefill)
    logits, cache = jax.block_until_ready(prefill(params, prompts, lengths))
    t0 = time.perf_counter()
    logits, cache = jax.block_until_ready(prefill(params, prompts, lengths))
    t_pre = time.perf_counter() - t0
    fl = flops_per_token(cfg, P_, causal=True)
    pre_flops = B * P_ * (2 * fl["n_matmul"] + fl["attention"] / 3)  # forward: 1/3
    row.update(prefill_s=t_pre, prefill_tokens_per_s=B * P_ / t_pre,
               prefill_mfu=pre_flops / t_pre / (G * H200_BF16_DENSE))
    # ---- decode (the cache is donated and returned: reuse it)
    rng = jax.random.key(2)
    t0 = time.perf_counter()
    params = jax.block_until_ready(gen.decode_params(params))  # as models.generate does
    row["decode_params_s"] = time.perf_counter() - t0            # stacked blocks: unstacked
    t0 = time.perf_counter()
    decode = gen.decode(None).lower(params, logits, lengths, cache, rng).compile()
    row["decode_compile_s"] = time.perf_counter() - t0
    row["decode_temp_bytes"] = temp_bytes(decode)
    state = {"cache": cache}

    def one():
        out, state["cache"] = decode(params, logits, lengths, state["cache"], rng)
        jax.block_until_ready(out)
        return out
    out = one()
    t_dec, ts = median_time(one, a.repeats)
    steps = N - 1
    ms = 1e3 * t_dec / steps
    c = cfg
    w_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params))
    kv_per_tok = 2 * c.num_layers * c.num_kv_heads * c.head_dim * jnp.dtype(dtype).itemsize
    ctx = P_ + (N - 2) / 2                       # mean context over the decode steps
    step_bytes = w_bytes + B * ctx * kv_per_tok / G   # per device
    floor_ms = 1e3 * step_bytes / rate
    row.update(decode_ms_per_token=ms, decode_runs_s=ts, weight_bytes_per_device=w_bytes,
               kv_cache_bytes_per_device=B * gen.plan.cache_len * kv_per_tok // G,
               floor_ms_per_token=floor_ms, fraction_of_floor=floor_ms / ms,
               peak_bytes=peak_memory_bytes(mesh.devices.flat[0]))
    # ---- the same step with the decoding baselines (several devices: issue 29)
    for strategy in a.strategies:
        other = generator_for(model, (B, P_), N, mesh=mesh, prefill_chunk=a.prefill_chunk,
                              decode_strategy=strategy, eos_id=None)
        dec = other.decode(None).lower(params, logits, lengths, state["cache"],
                                       rng).compile()

        def three(dec=dec):
            o, state["cache"] = dec(params, logits, lengths, state["cache"], rng)
            jax.block_until_ready(o)
        three()
        t_s, _ = median_time(three, a.repeats)
        row[f"{strategy}_decode_ms_per_token"] = 1e3 * t_s / steps
        row[f"tree_speedup_vs_{strategy}"] = (1e3 * t_s / steps) / ms
    state.clear()
    # ---- dense baseline on one device
    if G == 1 and not a.no_baseline:
        C = gen.plan.cache_len
        k = tuple(jax.random.normal(jax.random.key(10 + i), (B, C, c.num_kv_heads,
                                                             c.head_dim), dtype)
                  for i in range(c.num_layers))
        v = tuple(x * 0.5 for x in k)
        base = dense_decoder(cfg, B, C, N)
        first = jnp.argmax(logits, -1).astype(jnp.int32)
        t0 = time.perf_counter()
        base_c = base.lower(params, first, lengths, k, v).compile()
        row["dense_compile_s"] = time.perf_counter() - t0
        st = {"k": k, "v": v}

        def two():
            o, st["k"], st["v"] = base_c(params, first, lengths, st["k"], st["v"])
            jax.block_until_ready(o)
        two()
        t_b, _ = median_time(two, a.repeats)
        row.update(dense_ms_per_token=1e3 * t_b / steps,
                   speedup_vs_dense=(1e3 * t_b / steps) / ms)
        del st, k, v
    return row, out


def main(argv=None):
    from jax_seqpar.runtime.compile_cache import add_compile_cache_args, compile_cache_from_args

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="7b:131072:1,7b:32768:8,1b:131072:1,1b:131072:8,"
                   "1b:32768:1,7b:32768:1",
                   help="comma-separated SIZE:PROMPT:BATCH, run in this order")
    p.add_argument("--devices", type=int, default=None, help="default: all")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill-chunk", type=int, default=None)
    p.add_argument("--budget-s", type=float, default=1e9,
                   help="start no new configuration after this many seconds")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--strategies", default=None,
                   help="decoding baselines timed on the same cache: ring,allgather "
                        "(default: both when there are several devices)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU: the tiny shape, short prompts, 2 devices, float32")
    p.add_argument("--name", default=None)
    p.add_argument("--mesh", default=None, metavar="data=..,fsdp=..,sequence=..,tensor=..",
                   help="an N-D mesh over the devices (sharding.make_mesh): weights over "
                        "the tensor axis, prompts over data x fsdp, the cache over the "
                        "sequence (and tensor heads); 'auto': sharding.choose_mesh per "
                        "configuration; 'none' (the default): the one-axis model, the "
                        "cache over every device, weights replicated.  Several, "
                        "';'-separated: each configuration on each mesh, in one run")
    p.add_argument("--scan-layers", nargs="?", const="on", default="off",
                   choices=("off", "on", "both"),
                   help="the model with LlamaConfig(scan_layers=True), its weights "
                        "stacked (the same numbers); 'both': each configuration unrolled, "
                        "then scanned, compared in one table")
    add_compile_cache_args(p)  # --compile-cache DIR / --no-compile-cache
    a = p.parse_args(argv)
    compile_cache_from_args(a)  # the same configurations again: prefill/decode not recompiled
    if a.dry_run:
        a.configs, a.new_tokens, a.repeats = "tiny:256:1,tiny:128:4", 6, 1
        a.devices = a.devices or 2
    G = a.devices or jax.device_count()
    meshes = {}   # --mesh entry -> (mesh, Parallelism or None); "auto" is per configuration
    for entry in [m.strip() for m in (a.mesh or "none").split(";") if m.strip()]:
        if entry == "auto":
            meshes[entry] = None
        elif entry == "none":
            meshes[entry] = (jax.make_mesh((G,), ("sp",), devices=jax.devices()[:G],
                                           axis_types=(AxisType.Auto,)), None)
        else:
            sizes = parse_mesh_arg(entry)
            if math.prod(sizes.values()) != G:
                p.error(f"--mesh {entry}: the sizes multiply to {math.prod(sizes.values())}, "
                        f"not {G} devices (--devices)")
            meshes[entry] = make_mesh(sizes, jax.devices()[:G])
    a.strategies = ([x for x in a.strategies.split(",") if x] if a.strategies is not None
                    else (["ring", "allgather"] if G > 1 else []))
    t_start = time.perf_counter()
    rates = hbm_rates(4 if jax.default_backend() == "gpu" else 1 / 16)
    rate = max(rates.values())
    print(f"{G} x {jax.devices()[0].device_kind}, JAX {jax.__version__}; HBM: "
          + ", ".join(f"{k} {v / 1e12:.2f} TB/s" for k, v in rates.items()), flush=True)
    rows = []
    name = a.name or f"generate_{jax.default_backend()}{G}"
    forms = {"off": (False,), "on": (True,), "both": (False, True)}[a.scan_layers]
    tokens_by_config = {}   # configuration -> (first mesh, its greedy tokens)
    for spec in a.configs.split(","):
        if time.perf_counter() - t_start > a.budget_s:
            print(f"budget spent: skipping {spec}")
            continue
        size, P_, B = spec.split(":")
        for entry, placed in meshes.items():
            tokens = {}
            for scan in forms:
                try:
                    if placed is None:  # auto, per configuration: choose_mesh's pick
                        mesh, par = auto_mesh(size, int(P_), int(B), G)
                    else:
                        mesh, par = placed
                    row, out = run_config(size, int(P_), int(B), a, mesh, rate, par, scan)
                    tokens[scan] = np.asarray(out)
                    if scan and False in tokens:  # the same numbers: the same greedy tokens?
                        row["tokens_equal_unrolled"] = bool(np.array_equal(out, tokens[False]))
                    first = tokens_by_config.setdefault(spec, (entry, tokens[scan]))
                    if first[0] != entry:   # every mesh decodes the same numbers
                        row["tokens_equal_mesh"] = dict(
                            mesh=first[0], equal=bool(np.array_equal(out, first[1])))
                except Exception as e:  # noqa: BLE001  (out of memory at one size: go on)
                    row = dict(size=size, prompt=int(P_), batch=int(B), devices=G,
                               scan_layers=scan, error=f"{type(e).__name__}: {str(e)[:300]}")
                row["mesh_arg"] = entry
                rows.append(row)
                print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                       if k != "decode_runs_s"}, flush=True)
                save_json(dict(env=env_info(), hbm_rates=rates, hbm_rate_used=rate, rows=rows),
                          os.path.join(out_dir(), f"{name}.json"))
                jax.clear_caches()
    print(f"\n{'config':>16} {'mesh':>18} {'prefill tok/s':>13} {'MFU':>6} "
          f"{'decode ms/tok':>13} "
          f"{'floor ms':>9} {'of floor':>8} {'dense ms':>9} {'x dense':>7} "
          + " ".join(f"{s + ' ms':>13}" for s in a.strategies))
    for r in rows:
        tag = f"{r['size']}:{r['prompt']}:{r['batch']}" + ("+scan" if r["scan_layers"] else "")
        where = r["mesh_arg"]
        if "error" in r:
            print(f"{tag:>16} {where:>18} {r['error'][:90]}")
            continue
        print(f"{tag:>16} {where:>18} {r['prefill_tokens_per_s']:13.0f} {r['prefill_mfu']:6.3f} "
              f"{r['decode_ms_per_token']:13.3f} {r['floor_ms_per_token']:9.3f} "
              f"{r['fraction_of_floor']:8.3f} {r.get('dense_ms_per_token', math.nan):9.3f} "
              f"{r.get('speedup_vs_dense', math.nan):7.2f} "
              + " ".join(f"{r.get(s + '_decode_ms_per_token', math.nan):13.3f}"
                         for s in a.strategies))
    if len(forms) > 1:
        print_scan_comparison(rows)
    return 0


def print_scan_comparison(rows):
    """``--scan-layers both``: per configuration, the stacked weights against the unrolled
    ones (compile seconds, decode ms per token, the programs' temporary bytes)."""
    def mib(x):
        return math.nan if x is None else x / 2**20
    print(f"\n{'config':>16} {'form':>8} {'prefill comp s':>14} {'decode comp s':>13} "
          f"{'decode ms/tok':>13} {'prefill tmp MiB':>15} {'decode tmp MiB':>14} "
          f"{'peak MiB':>9} {'same tokens':>11}")
    for r in rows:
        if "error" in r:
            continue
        tag = f"{r['size']}:{r['prompt']}:{r['batch']}"
        print(f"{tag:>16} {'scanned' if r['scan_layers'] else 'unrolled':>8}"
              f" {r['prefill_compile_s']:14.1f} {r['decode_compile_s']:13.1f}"
              f" {r['decode_ms_per_token']:13.3f} {mib(r['prefill_temp_bytes']):15.1f}"
              f" {mib(r['decode_temp_bytes']):14.1f} {mib(r['peak_bytes']):9.0f}"
              f" {str(r.get('tokens_equal_unrolled', '')):>11}")


if __name__ == "__main__":
    raise SystemExit(main())
