"""Train the Llama-style model on a long-range retrieval task, sequence-parallel.

Task (key/value retrieval over thousands of tokens): each sequence is filler tokens with
``--pairs`` "fact" tokens scattered over its first half, each standing for one (key,
value) pair (one token per pair: ``--keys * --values`` fact tokens).  Its last
``2 * --pairs`` tokens ask for every key again, in a new order, each followed by its
value.  The loss and the accuracy count only those answers, which the model can get
right only by attending from the end of the sequence to the fact with that key,
thousands of tokens earlier; chance is ``1 / --values``.  (With the key and the value as
two separate tokens the task needs an induction head, which this small model does not
form within a few minutes of CPU training; one token per fact needs one attention hop.)

The sequence is split over all devices (8 simulated CPU devices by default; the GPUs
when present) with the library's ring attention; the model permutes its tokens into
``--layout`` order once, at the input.  AdamW with warmup + cosine decay (optax).

    python examples/train_long_context.py                        # CPU, a few minutes
    python examples/train_long_context.py --seq-len 4096 --layout striped --backward q

Writes ``<out>/train_log.json`` (loss and accuracy per step) and ``<out>/loss.png``.
``--scan-layers``: the blocks as one loop over stacked parameters.  Compiled programs are
kept in JAX's persistent compilation cache (``runtime.compile_cache``: ``--compile-cache
DIR``, default ``~/.cache/jax_seqpar/xla`` but off on several CPU devices;
``--no-compile-cache``), so a rerun with the same shapes does not compile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jax_seqpar.runtime.compile_cache import (add_compile_cache_args,  # noqa: E402
                                              compile_cache_from_args, compile_cache_summary)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--devices", type=int, default=None,
                   help="devices on the sequence axis (default: all; 8 simulated on CPU)")
    p.add_argument("--layout", default="zigzag", choices=["contiguous", "zigzag", "striped"])
    p.add_argument("--backward", default="auto", choices=["auto", "kv", "q"])
    p.add_argument("--remat", default="none",
                   choices=["none", "full", "attention", "seq_selective", "attention_mlp"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--pairs", type=int, default=4, help="key/value pairs per sequence")
    p.add_argument("--keys", type=int, default=8, help="distinct keys")
    p.add_argument("--values", type=int, default=8, help="distinct values")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--kernel", default="auto",
                   help="local attention kernel: auto (the library's choice per tile: cuDNN "
                        "and Pallas on GPUs, xla on CPU), or a backend name (xla, pallas, "
                        "cudnn, ...)")
    p.add_argument("--block", type=int, default=None,
                   help="tile size of the xla kernel (default 256); only with the xla "
                        "kernel, which --kernel auto means on CPU")
    p.add_argument("--scan-layers", action="store_true",
                   help="the decoder blocks as one loop over stacked parameters "
                        "(LlamaConfig(scan_layers=True)): XLA compiles one block, not one "
                        "per layer")
    add_compile_cache_args(p)  # --compile-cache DIR / --no-compile-cache
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", default="examples/out")
    p.add_argument("--export", default=None,
                   help="also write the trained model as a transformers checkpoint "
                        "(models.hf.save_pretrained) with the task's token ids in "
                        "recall_task.json: what benchmarks/needle.py evaluates")
    return p.parse_args(argv)


ARGS = parse_args()
# Before JAX starts: simulated CPU devices (the flag only affects the host platform).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={ARGS.devices or 8}")

import jax_seqpar.runtime.distributed as jd  # noqa: E402

# Several processes (python -m jax_seqpar launch, SLURM, ...): join them before JAX
# starts its backends; a no-op for a single process.
INFO = jd.initialize()

import jax  # noqa: E402

COMPILE_CACHE = compile_cache_from_args(ARGS)  # a rerun with the same shapes: no compile
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, PartitionSpec as P  # noqa: E402

from jax_seqpar.kernels import KernelRequest, XlaKernel  # noqa: E402
from jax_seqpar.kernels.tiles import TileKernels  # noqa: E402
from jax_seqpar.masks import MaskSpec  # noqa: E402
from jax_seqpar.data.recall import RecallTask  # noqa: E402
from jax_seqpar.models import Llama, LlamaConfig, next_token_loss  # noqa: E402
from jax_seqpar.training import init_train_state, make_train_step  # noqa: E402


def choose_kernel(a, cfg):
    """``(kernel, description)``: the library's ``kernel="auto"`` on GPUs; on CPU, where
    auto means the xla kernel, that kernel with ``--block`` tiles (default 256)."""
    if a.block is not None and a.kernel not in ("auto", "xla"):
        raise SystemExit(f"--block={a.block} sets the xla kernel's tiles, but --kernel="
                         f"{a.kernel}; drop --block or pass --kernel xla")
    platform = jax.default_backend()
    request = KernelRequest(platform=platform, dtype=cfg.dtype, head_dim=cfg.head_dim,
                            mask=MaskSpec(causal=True))
    resolved = TileKernels(a.kernel, request)
    if resolved.name == "xla":
        block = a.block or 256
        return XlaKernel(block_q=block, block_k=block), f"xla ({block} x {block} tiles)"
    if a.block is not None:
        raise SystemExit(f"--block={a.block} sets the xla kernel's tiles, but --kernel="
                         f"{a.kernel} runs {resolved.name} here; drop --block or pass "
                         f"--kernel xla")
    return a.kernel, resolved.name


def main():
    a = ARGS
    G = a.devices or jax.device_count()
    if G > jax.device_count():
        raise SystemExit(f"--devices={G} but JAX sees {jax.device_count()} devices")
    mesh = jax.make_mesh((G,), ("sp",), devices=jax.devices()[:G],
                         axis_types=(AxisType.Auto,))
    task = RecallTask(a.seq_len, a.pairs, a.keys, a.values)
    cfg = LlamaConfig(vocab_size=task.vocab, d_model=a.d_model, num_layers=a.layers,
                      num_heads=a.heads, num_kv_heads=a.kv_heads, remat=a.remat,
                      scan_layers=a.scan_layers)
    kernel, kernel_desc = choose_kernel(a, cfg)
    model = Llama(cfg, mesh=mesh, layout=a.layout, backward=a.backward, kernel=kernel)
    # Every process draws the same batches from the same seed; from_host places each
    # process's part of them on its devices (replicated: the model permutes and shards
    # the tokens itself).
    rng = np.random.default_rng(a.seed)

    def batch(rng, n):
        return jd.from_host(task.batch(rng, n), mesh, P())

    # One sequence drawn for the initialiser's shape, as before, so the batches stay the same.
    init_tokens, _ = task.batch(rng, 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, a.lr, a.warmup, max(a.steps, a.warmup + 1),
                                                  end_value=a.lr / 10)
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=0.01))
    # Parameters and optimizer state replicated over the mesh (the model is small);
    # training.make_train_step: jitted, the state donated, next_token_loss on the batch dict.
    state = init_train_state(model, opt, jax.random.key(a.seed), init_tokens.shape,
                             sharding="replicated")
    train_step = make_train_step(model, opt, shardings=state)

    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    lead = INFO.is_main  # with several processes, process 0 reports and writes
    say = print if lead else (lambda *args, **kw: None)
    say(f"devices: {G} x {jax.devices()[0].device_kind} ({jax.default_backend()}), "
          f"JAX {jax.__version__}; layout={a.layout}, backward={a.backward}, remat={a.remat}, "
          f"scan_layers={a.scan_layers}")
    say(f"processes: {INFO.process_count} ({INFO.source})")
    say(f"attention kernel: {kernel_desc}")
    say(f"model: {n_params:,} parameters, {cfg.num_layers} layers, d_model {cfg.d_model}; "
          f"task: {a.batch} x {a.seq_len} tokens, {a.pairs} pairs, chance accuracy "
          f"{1 / a.values:.3f}")
    log, t0 = [], time.perf_counter()
    steps = range(a.steps)
    try:
        from tqdm import tqdm
        steps = tqdm(steps, desc="train", dynamic_ncols=True, disable=not lead)
    except ImportError:
        pass
    for step in steps:
        toks, mask = batch(rng, a.batch)
        state, m = train_step(state, {"tokens": toks, "loss_mask": mask})
        if step % a.log_every == 0 or step == a.steps - 1:
            m = jd.to_host(m)  # every process takes part (a collective when several)
            row = {"step": step, "loss": float(m["loss"]), "accuracy": float(m["accuracy"]),
                   "seconds": time.perf_counter() - t0}
            log.append(row)
            msg = f"step {step:4d}  loss {row['loss']:.3f}  accuracy {row['accuracy']:.3f}"
            (steps.set_postfix_str(msg[10:]) if hasattr(steps, "set_postfix_str")
             else say(msg, flush=True))
    wall = time.perf_counter() - t0
    ev_rng = np.random.default_rng(a.seed + 1)
    evaluate = jax.jit(lambda p, t, m: next_token_loss(model, p, t, loss_mask=m)[1])
    evals = [jd.to_host(evaluate(state.params, *batch(ev_rng, a.batch))) for _ in range(4)]
    ev_loss = float(np.mean([e["loss"] for e in evals]))
    ev_acc = float(np.mean([e["accuracy"] for e in evals]))
    first, last = log[0], log[-1]
    say(f"\nfirst logged: loss {first['loss']:.3f}, accuracy {first['accuracy']:.3f}; "
          f"last: loss {last['loss']:.3f}, accuracy {last['accuracy']:.3f}")
    say(f"held-out ({4 * a.batch} sequences): loss {ev_loss:.3f}, accuracy {ev_acc:.3f} "
          f"(chance {1 / a.values:.3f}); {a.steps} steps in {wall:.0f} s")
    say(compile_cache_summary())
    if not lead:
        return
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "train_log.json"), "w") as f:
        json.dump({"args": vars(a), "devices": G, "processes": INFO.process_count,
                   "kernel": kernel_desc,
                   "backend": jax.default_backend(),
                   "jax": jax.__version__, "log": log, "eval_loss": ev_loss,
                   "eval_accuracy": ev_acc, "wall_s": wall}, f, indent=1)
    plot(log, 1 / a.values, os.path.join(a.out, "loss.png"), a, G)
    if a.export:
        from jax_seqpar.models.hf import save_pretrained
        save_pretrained(cfg, state.params, a.export)  # either form: one tensor per layer
        task.save(a.export)
        say(f"exported to {a.export} (transformers format + recall_task.json)")


def plot(log, chance, path, a, G):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not available: no plot")
        return
    steps = [r["step"] for r in log]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.plot(steps, [r["loss"] for r in log])
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss on the answers")
    ax2.plot(steps, [r["accuracy"] for r in log], label="train batch")
    ax2.axhline(chance, color="gray", ls="--", label="chance")
    ax2.set_xlabel("step")
    ax2.set_ylabel("answer accuracy")
    ax2.legend()
    fig.suptitle(f"key/value retrieval, {a.seq_len} tokens over {G} {jax.default_backend()} "
                 f"devices ({a.layout}, backward={a.backward}, remat={a.remat})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
