"""End-to-end training throughput: tokens/s per GPU and MFU of a Llama step (issue 18).

One AdamW training step (forward, backward, update) of ``models.Llama`` with the
sequence sharded over G devices (ring attention, zigzag, ``backward="auto"``,
``kernel="auto"``, a remat policy), bf16 compute with float32 master weights and
optimizer state, and parameters + gradients + optimizer state either fully sharded over
the same devices (``--params fsdp``, ``jax_seqpar.fsdp``: XLA gathers each weight where a
layer uses it) or replicated (``--params replicated``).

Model FLOPs per token (counted, not measured; no recomputation counted):
``6 * N_matmul`` for the weight matmuls forward + backward (``N_matmul``: parameters of
every matmul, the LM head included, the embedding lookup and norms excluded) plus
attention's score and value matmuls, ``12 * L * S * Hq * Dh`` forward + backward,
**halved for the causal mask** (each query sees on average half the sequence):
``6 * L * S * Hq * Dh``.  MFU = tokens/s * FLOPs per token / (G * peak), with
``peak`` = the H200's 989 TFLOP/s dense bf16 spec, and also against the bf16 matmul rate
measured in the same run (8192^3).  Peak memory: the largest ``peak_bytes_in_use`` over
the devices (``memory_stats()``; not available on CPU).

    python benchmarks/train_mfu.py --preset cpu          # tiny model, 8 simulated devices
    python benchmarks/train_mfu.py --preset gpu --sizes 1b --devices 1,2,4 --tokens-per-gpu 32768
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

import _setup  # noqa: F401,E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

from jax_seqpar.fsdp import bytes_per_device, fsdp_shardings, replicated_shardings  # noqa
from jax_seqpar.models import Llama, LlamaConfig, next_token_loss  # noqa: E402
from _util import env_info, out_dir, peak_memory_bytes, save_json  # noqa: E402

H200_BF16_DENSE = 989e12  # spec sheet, dense bf16 FLOP/s

#: Named sizes (Llama-like shapes).  "1b": Llama 3.2 1B's body with a 32k vocabulary;
#: "7b": Llama 2 7B's width and depth with GQA 32/8 (Llama 3 8B's attention) and 32k vocab.
SIZES = {
    "tiny": dict(vocab_size=512, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 ffn_dim=176),
    "1b": dict(vocab_size=32000, d_model=2048, num_layers=16, num_heads=32, num_kv_heads=8,
               ffn_dim=8192),
    "7b": dict(vocab_size=32000, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8,
               ffn_dim=11008),
}

PRESETS = {
    "cpu": dict(sizes=["tiny"], devices=[1, 2, 4], tokens_per_gpu=[256], steps=2,
                dtype="float32", remat="attention", peak=None),
    "gpu": dict(sizes=["1b"], devices=[1, 2, 4], tokens_per_gpu=[32768], steps=3,
                dtype="bfloat16", remat="attention", peak=H200_BF16_DENSE),
}


def flops_per_token(cfg: LlamaConfig, seq_len: int, causal: bool = True) -> dict:
    d, L, H, Hkv, Dh, F, V = (cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
                              cfg.head_dim, cfg.ffn_dim, cfg.vocab_size)
    per_layer = d * H * Dh + 2 * d * Hkv * Dh + H * Dh * d + 3 * d * F
    n_matmul = L * per_layer + d * V
    attn = 12 * L * seq_len * H * Dh * (0.5 if causal else 1.0)
    return dict(n_matmul=n_matmul, dense=6 * n_matmul, attention=attn,
                total=6 * n_matmul + attn)


def matmul_rate(n=8192):
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    jax.block_until_ready(f(a, a))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a, a))
        ts.append(time.perf_counter() - t0)
    return 2 * n ** 3 / float(np.median(ts))


def make_step(model, mesh, p_shape, params_mode: str, lr=1e-4):
    """``(step, opt, p_sh, o_sh, tok_sharding)`` for ``model`` whose parameters have the
    shapes ``p_shape``: one jitted AdamW step ``step(params, opt_state, tokens)`` ->
    ``(params, opt_state, loss)`` with the shardings of ``params_mode``."""
    tok_sharding = NamedSharding(mesh, P(None, "sp"))
    opt = optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=0.1)
    o_shape = jax.eval_shape(opt.init, p_shape)
    shard = fsdp_shardings if params_mode == "fsdp" else (
        lambda t, m, *a: replicated_shardings(t, m))
    p_sh, o_sh = shard(p_shape, mesh, "sp"), shard(o_shape, mesh, "sp")

    def step(params, opt_state, tokens):
        (loss, _), grads = jax.value_and_grad(
            lambda p: next_token_loss(model, p, tokens), has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(step, in_shardings=(p_sh, o_sh, tok_sharding),
                   out_shardings=(p_sh, o_sh, None), donate_argnums=(0, 1))
    return step, opt, p_sh, o_sh, tok_sharding


def build(size: str, G: int, S: int, *, dtype: str, remat: str, params_mode: str,
          lr=1e-4, seed=0):
    """``(step, params, opt_state, tokens, cfg)``; ``step(params, opt, tokens)`` ->
    ``(params, opt, loss)``, jitted with the shardings of ``params_mode``."""
    devs = jax.devices()[:G]
    mesh = jax.make_mesh((G,), ("sp",), axis_types=(AxisType.Auto,), devices=devs)
    cfg = LlamaConfig(**SIZES[size], dtype=dtype, param_dtype="float32", remat=remat)
    model = Llama(cfg, mesh=mesh, layout="zigzag", backward="auto", kernel="auto")
    tokens = jax.random.randint(jax.random.PRNGKey(seed + 1), (1, S), 0, cfg.vocab_size,
                                jnp.int32)
    init = lambda key: model.init(key, tokens)  # noqa: E731
    p_shape = jax.eval_shape(init, jax.random.PRNGKey(seed))
    step, opt, p_sh, o_sh, tok_sharding = make_step(model, mesh, p_shape, params_mode, lr)
    tokens = jax.device_put(tokens, tok_sharding)
    params = jax.jit(init, out_shardings=p_sh)(jax.random.PRNGKey(seed))
    opt_state = jax.jit(opt.init, out_shardings=o_sh)(params)
    state_bytes = (bytes_per_device(p_shape, p_sh)
                   + bytes_per_device(jax.eval_shape(opt.init, p_shape), o_sh))
    return step, params, opt_state, tokens, cfg, state_bytes


def measure(size, G, S, *, dtype, remat, params_mode, steps, peak, rate):
    step, params, opt_state, tokens, cfg, state_bytes = build(
        size, G, S, dtype=dtype, remat=remat, params_mode=params_mode)
    t0 = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, tokens)  # compile + first step
    loss0 = float(loss)
    t_first = time.perf_counter() - t0
    ts, losses = [], [loss0]
    for _ in range(steps):
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, tokens)
        losses.append(float(loss))  # synchronises
        ts.append(time.perf_counter() - t0)
    t = float(np.median(ts))
    fl = flops_per_token(cfg, S)
    tgs = S / t / G
    mem = [peak_memory_bytes(d) for d in jax.devices()[:G]]
    row = dict(size=size, G=G, S=S, tokens_per_gpu=S // G, params_mode=params_mode,
               remat=remat, dtype=dtype, step_s=t, first_step_s=t_first, tgs=tgs,
               flops_per_token=fl["total"], attention_flops_share=fl["attention"] / fl["total"],
               n_matmul_params=fl["n_matmul"], losses=losses,
               state_gib_per_device=state_bytes / 2 ** 30,
               peak_gib=(max(m for m in mem if m is not None) / 2 ** 30
                         if any(m is not None for m in mem) else None))
    if peak:
        row["mfu"] = tgs * fl["total"] / peak
    if rate:
        row["mfu_vs_matmul"] = tgs * fl["total"] / rate
    print(f"{size:4s} G={G} S={S:7d} {params_mode:10s} step {t:8.3f} s  TGS {tgs:9.1f}  "
          + (f"MFU {100 * row['mfu']:5.1f}%  " if peak else "")
          + (f"(of measured matmul {100 * row['mfu_vs_matmul']:5.1f}%)  " if rate else "")
          + f"state {row['state_gib_per_device']:.2f} GiB/dev  peak "
          + (f"{row['peak_gib']:.1f} GiB" if row["peak_gib"] is not None else "n/a")
          + f"  loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
    return row


def table(rows):
    print(f"\n{'size':4s} {'G':>2s} {'S':>8s} {'params':10s} {'step s':>8s} {'TGS':>9s} "
          f"{'MFU%':>6s} {'peak GiB':>8s}")
    for r in rows:
        print(f"{r['size']:4s} {r['G']:2d} {r['S']:8d} {r['params_mode']:10s} {r['step_s']:8.3f} "
              f"{r['tgs']:9.1f} {100 * r.get('mfu', float('nan')):6.1f} "
              f"{r['peak_gib'] if r['peak_gib'] is not None else float('nan'):8.1f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--sizes", default=None, help=f"comma-separated, of {sorted(SIZES)}")
    p.add_argument("--devices", default=None, help="device counts, comma-separated")
    p.add_argument("--tokens-per-gpu", default=None, help="comma-separated")
    p.add_argument("--seq", default=None,
                   help="total sequence lengths (instead of --tokens-per-gpu), comma-separated")
    p.add_argument("--params", default="fsdp", choices=("fsdp", "replicated"))
    p.add_argument("--remat", default=None)
    p.add_argument("--steps", type=int, default=None)
    args = p.parse_args(argv)
    name = args.preset or ("gpu" if jax.default_backend() == "gpu" else "cpu")
    cfg = dict(PRESETS[name])
    if args.sizes:
        cfg["sizes"] = args.sizes.split(",")
        unknown = set(cfg["sizes"]) - set(SIZES)
        if unknown:
            p.error(f"--sizes: unknown {sorted(unknown)}; known {sorted(SIZES)}")
    if args.devices:
        cfg["devices"] = [int(x) for x in args.devices.split(",")]
    if args.tokens_per_gpu:
        cfg["tokens_per_gpu"] = [int(x) for x in args.tokens_per_gpu.split(",")]
    for key in ("remat", "steps"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    counts = [G for G in cfg["devices"] if G <= jax.device_count()]
    if not counts:
        p.error(f"--devices: none of {cfg['devices']} fits the {jax.device_count()} devices")
    info = env_info()
    rate = matmul_rate() if jax.default_backend() == "gpu" else None
    print(f"# {info}\n# preset {name}: {cfg}"
          + (f"\n# bf16 matmul 8192^3: {rate / 1e12:.0f} TFLOP/s" if rate else ""), flush=True)
    result = dict(env=info, preset=name, config=cfg, matmul_flops=rate, rows=[])
    path = os.path.join(out_dir(), f"train_mfu_{name}.json")
    plan = [(size, G, S) for size in cfg["sizes"] for G in counts
            for S in ([int(x) for x in args.seq.split(",")] if args.seq
                      else [t * G for t in cfg["tokens_per_gpu"]])]
    for size, G, S in plan:
        try:
            result["rows"].append(measure(size, G, S, dtype=cfg["dtype"], remat=cfg["remat"],
                                          params_mode=args.params, steps=cfg["steps"],
                                          peak=cfg["peak"], rate=rate))
        except Exception as e:  # e.g. out of memory: record and go on
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            print(f"{size} G={G} S={S}: FAILED {msg}", flush=True)
            result["rows"].append(dict(size=size, G=G, S=S, params_mode=args.params,
                                       error=msg))
        save_json(result, path)
    table([r for r in result["rows"] if "error" not in r])
    return 0


if __name__ == "__main__":
    sys.exit(main())
