"""Fine-tune a Llama-style model at long context on packed documents, sequence-parallel.

What a long-context fine-tuning run does, end to end, with the library's parts:

1. **Model.** ``--checkpoint DIR`` loads a transformers checkpoint, ``--checkpoint
   FILE.gguf`` a llama.cpp file (``models.hf.load_pretrained``: streamed onto FSDP
   shardings over all devices; a GGUF's quantized tensors dequantized); without it, a
   small random model (``--d-model``, ``--layers``, ...) stands in.
2. **Context extension.**  ``--rope-theta`` (one value, or one per stage: LWM raises the
   base with every stage) and/or ``--rope-scaling TYPE:FACTOR`` (``linear``, ``dynamic``,
   ``yarn``, ``llama3``; scaled from the checkpoint's ``max_position_embeddings``, or for
   a random model from the first stage's length).  ``--stages 1024,2048`` trains
   ``--steps`` steps at each sequence length in turn (progressive extension, as LWM).
3. **Data.**  Text files under ``--data DIR`` (one document per file; without
   ``--data``, the repository's synthetic demo corpus, ``data.write_corpus``), tokenised
   with the checkpoint's tokenizer (its ``tokenizer.json`` or the GGUF's metadata; or
   ``--tokenizer``; else a small BPE trained on the files), packed into ``[batch,
   seq_len]`` rows with segment ids and positions restarting at every document
   (``data.make_iterator``, Grain).  ``--batch`` takes one value or one per stage.
4. **Training.**  The sequence is split over all devices (8 simulated CPU devices by
   default; the GPUs when present) with ring attention under ``--layout``;
   ``training.make_train_step`` runs ``next_token_loss`` with the batch's segment ids and
   positions, AdamW with warmup and cosine decay.
5. **Checkpoints.**  ``training.TrainCheckpointer`` saves the train state and the data
   iterator's position every ``--save-every`` steps (Orbax, asynchronous, the newest
   ``--keep`` kept) and after the last step.  **Rerunning the same command resumes** from
   the newest checkpoint: same parameters, optimizer state and next batch, so the run
   continues exactly as if never stopped (``--stop-after N`` stops after step N without a
   final save, to try it).  JAX's persistent compilation cache (``runtime.compile_cache``:
   ``--compile-cache DIR``, default ``~/.cache/jax_seqpar/xla`` but off on several CPU
   devices; ``--no-compile-cache``) spares a rerun with the same shapes the
   compilation; the run says what it read.
   ``--scan-layers`` runs the blocks as one loop over stacked parameters (one block
   compiled, whatever the depth).
6. **Output.**  A progress bar, ``<out>/finetune_log.json`` (loss, accuracy and tokens per
   second per logged step, the packing report of each stage), ``<out>/loss.png``, and with
   ``--export DIR`` a transformers checkpoint (``models.hf.save_pretrained``) with its
   tokenizer (its chat template included), which ``load_pretrained`` and transformers'
   ``from_pretrained`` read.

    python examples/finetune_long_context.py                       # CPU demo, < 1 minute
    python examples/finetune_long_context.py --checkpoint ~/Llama-3.2-1B --data ~/texts \\
        --rope-theta 2e6,8e6 --stages 32768,65536 --steps 200,100 --batch 1 \\
        --remat attention --save-every 50 --ckpt-dir runs/ft --export runs/ft-64k
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jax_seqpar.runtime.compile_cache import (add_compile_cache_args,  # noqa: E402
                                              compile_cache_from_args,
                                              compile_cache_stats, compile_cache_summary)


def int_list(text):
    return [int(float(x)) for x in str(text).split(",") if x]


def float_list(text):
    return [float(x) for x in str(text).split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=None,
                   help="transformers checkpoint directory or a llama.cpp .gguf file "
                        "(default: a random small model)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json or its directory, or 'bytes' (default: the "
                        "checkpoint's, else a BPE trained on --data)")
    p.add_argument("--data", default=None,
                   help="folder of .txt files, one document each (default: the demo corpus, "
                        "written to <out>/corpus)")
    p.add_argument("--stages", type=int_list, default=[256, 512],
                   help="sequence length of each stage, comma-separated")
    p.add_argument("--steps", type=int_list, default=[12, 8],
                   help="optimizer steps per stage (one number: every stage)")
    p.add_argument("--batch", type=int_list, default=[2],
                   help="rows per (global) batch: one number, or one per stage")
    p.add_argument("--rope-theta", type=float_list, default=None,
                   help="RoPE base: one value or one per stage (default: the checkpoint's; "
                        "10000 for a random model)")
    p.add_argument("--rope-scaling", default=None, metavar="TYPE:FACTOR",
                   help="linear, dynamic, yarn or llama3 scaling, e.g. yarn:4")
    p.add_argument("--devices", type=int, default=None,
                   help="devices on the sequence axis (default: all; 8 simulated on CPU)")
    p.add_argument("--mesh", default=None, metavar="ROLES|auto",
                   help="an N-D mesh over the devices: data=..,fsdp=..,sequence=..,tensor=.. "
                        "(sizes multiplying to --devices), or auto (sharding.choose_mesh "
                        "picks them, and says why); default: the sequence over every device")
    p.add_argument("--layout", default="zigzag", choices=["contiguous", "zigzag", "striped"])
    p.add_argument("--backward", default="auto", choices=["auto", "kv", "q"])
    p.add_argument("--kernel", default="auto", help="local attention kernel (auto, xla, ...)")
    p.add_argument("--remat", default="none",
                   choices=["none", "full", "attention", "seq_selective", "attention_mlp"])
    p.add_argument("--dtype", default=None,
                   help="activation dtype (default: bfloat16 on GPUs, float32 on CPU); "
                        "parameters and optimizer state stay float32")
    p.add_argument("--d-model", type=int, default=64, help="random model only")
    p.add_argument("--layers", type=int, default=2, help="random model only")
    p.add_argument("--heads", type=int, default=4, help="random model only")
    p.add_argument("--kv-heads", type=int, default=2, help="random model only")
    p.add_argument("--bpe-vocab", type=int, default=512,
                   help="vocabulary of the BPE trained when there is no tokenizer")
    p.add_argument("--window", type=int, default=64, help="documents packed together")
    p.add_argument("--bos", default="auto", choices=["auto", "yes", "no"],
                   help="start every document with the tokenizer's BOS (auto: as llama.cpp "
                        "would for a GGUF checkpoint, its tokenizer.ggml.add_bos_token; "
                        "yes otherwise); each ends with its EOS")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: 2e-5 for a checkpoint, 3e-3 random)")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", default=None, help="checkpoints (default: <out>/ckpt)")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop after this many steps in all, without a final save "
                        "(a stand-in for a preemption; rerun without it to resume)")
    p.add_argument("--export", default=None, help="write a transformers checkpoint here")
    p.add_argument("--export-dtype", default=None,
                   help="dtype of the exported weights (default: float32)")
    p.add_argument("--scan-layers", action="store_true",
                   help="the decoder blocks as one loop over stacked parameters "
                        "(LlamaConfig(scan_layers=True)): XLA compiles one block, not one "
                        "per layer")
    add_compile_cache_args(p)  # --compile-cache DIR / --no-compile-cache
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--out", default="examples/out/finetune")
    a = p.parse_args(argv)
    if not a.stages or min(a.stages) < 1:
        p.error(f"--stages={a.stages} must be positive sequence lengths")
    if len(a.steps) == 1:
        a.steps = a.steps * len(a.stages)
    if len(a.steps) != len(a.stages) or min(a.steps) < 1:
        p.error(f"--steps={a.steps} must be one positive number or one per stage "
                f"({len(a.stages)} stages)")
    if len(a.batch) == 1:
        a.batch = a.batch * len(a.stages)
    if len(a.batch) != len(a.stages) or min(a.batch) < 1:
        p.error(f"--batch={a.batch} must be one positive number or one per stage "
                f"({len(a.stages)} stages)")
    if a.rope_theta is not None:
        if len(a.rope_theta) == 1:
            a.rope_theta = a.rope_theta * len(a.stages)
        if len(a.rope_theta) != len(a.stages) or min(a.rope_theta) <= 0:
            p.error(f"--rope-theta={a.rope_theta} must be one positive value or one per "
                    f"stage ({len(a.stages)} stages)")
    if a.rope_scaling is not None:
        kind, _, factor = a.rope_scaling.partition(":")
        try:
            a.rope_scaling = (kind, float(factor))
        except ValueError:
            p.error(f"--rope-scaling={a.rope_scaling!r} must be TYPE:FACTOR, e.g. yarn:4")
    for name in ("save_every", "keep", "log_every", "window"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(a, name)} must be positive")
    a.ckpt_dir = a.ckpt_dir or os.path.join(a.out, "ckpt")
    return a


ARGS = parse_args()
# Before JAX starts: simulated CPU devices (the flag only affects the host platform).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={ARGS.devices or 8}")

import jax_seqpar.runtime.distributed as jd  # noqa: E402

INFO = jd.initialize()  # several processes (launcher, SLURM): join them; else a no-op

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

# A rerun with the same shapes (a resumed run, the same stages again) reads its programs
# from JAX's persistent compilation cache instead of compiling them.
COMPILE_CACHE = compile_cache_from_args(ARGS)
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, PartitionSpec as P  # noqa: E402

from jax_seqpar.data import load_tokenizer, make_iterator, train_bpe, write_corpus  # noqa
from jax_seqpar.data.tokenize import read_text, text_files  # noqa: E402
from jax_seqpar.models import Llama, LlamaConfig  # noqa: E402
from jax_seqpar.models.gguf import gguf_config  # noqa: E402
from jax_seqpar.models.hf import load_pretrained, save_pretrained  # noqa: E402
from jax_seqpar.models.stacking import to_form  # noqa: E402
from jax_seqpar.parallel.comm_time import Link  # noqa: E402
from jax_seqpar.sharding import choose_mesh, make_mesh, parse_mesh_arg  # noqa: E402
from jax_seqpar.training import (CheckpointConfig, TrainCheckpointer, TrainState,  # noqa
                                 abstract_train_state, init_train_state, make_train_step,
                                 shardings_of)
from jax_seqpar.training.state import RNG_STREAM  # noqa: E402

LEAD = INFO.is_main  # with several processes, process 0 reports and writes
say = print if LEAD else (lambda *args, **kw: None)


# --------------------------------------------------------------------------- setup
def is_gguf(path) -> bool:
    return str(path).endswith(".gguf") and os.path.isfile(path)


def data_folder(a) -> str:
    """``--data``, or the demo corpus written (once) under ``<out>/corpus``."""
    if a.data is not None:
        text_files(a.data)  # a ValueError naming the folder if it has no .txt files
        return a.data
    folder = os.path.join(a.out, "corpus")
    has_text = os.path.isdir(folder) and any(f.endswith(".txt") for f in os.listdir(folder))
    if LEAD and not has_text:
        write_corpus(folder)
        say(f"wrote the demo corpus to {folder}")
    if INFO.process_count > 1:
        jd.barrier("corpus")
    return folder


def document_bos(a) -> bool:
    """``--bos``: whether the packer starts each document with BOS."""
    if a.bos != "auto":
        return a.bos == "yes"
    if a.checkpoint and is_gguf(a.checkpoint):
        from jax_seqpar.data.gguf_tokenizer import gguf_special_tokens
        return gguf_special_tokens(a.checkpoint).add_bos
    return True


def choose_tokenizer(a, data):
    """The run's tokenizer, kept in ``<ckpt-dir>/tokenizer`` so that a resumed run (and
    the export) uses exactly the one the run started with."""
    kept = os.path.join(a.ckpt_dir, "tokenizer")
    if os.path.exists(os.path.join(kept, "tokenizer_config.json")):
        return load_tokenizer(kept), "kept from the first run"
    if a.tokenizer is not None:
        tok, how = load_tokenizer(a.tokenizer), a.tokenizer
    elif a.checkpoint and is_gguf(a.checkpoint):
        tok, how = load_tokenizer(a.checkpoint), "the GGUF file's tokenizer"
    elif a.checkpoint and os.path.exists(os.path.join(a.checkpoint, "tokenizer.json")):
        tok, how = load_tokenizer(a.checkpoint), "the checkpoint's tokenizer.json"
    else:
        tok = train_bpe((read_text(f) for f in text_files(data)), a.bpe_vocab)
        how = f"BPE ({a.bpe_vocab}) trained on the data"
    if LEAD:
        tok.save(kept)
    if INFO.process_count > 1:
        jd.barrier("tokenizer")
    return tok, how


def rope_scaling_for(a, original: int, seq_len: int):
    """``--rope-scaling TYPE:FACTOR`` as a RoPE scaling dict for one stage."""
    if a.rope_scaling is None:
        return None
    kind, factor = a.rope_scaling
    d = {"rope_type": kind, "factor": factor, "original_max_position_embeddings": original}
    if kind == "llama3":  # Llama 3.1's values
        d.update(low_freq_factor=1.0, high_freq_factor=4.0)
    if kind == "dynamic":  # computed once, for this stage's length
        d["seq_len"] = seq_len
    return d


def base_config(a, vocab_size):
    """``(config of the starting model, its trained context)``, before the stages' RoPE."""
    dtype = a.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    if a.checkpoint and is_gguf(a.checkpoint):
        cfg = gguf_config(a.checkpoint, dtype=dtype, param_dtype="float32", remat=a.remat,
                          scan_layers=a.scan_layers)
    elif a.checkpoint:
        with open(os.path.join(a.checkpoint, "config.json")) as f:
            hf = json.load(f)
        cfg = LlamaConfig.from_hf(hf, dtype=dtype, param_dtype="float32", remat=a.remat,
                                  scan_layers=a.scan_layers)
    if a.checkpoint:
        if vocab_size > cfg.vocab_size:
            raise SystemExit(f"the tokenizer has {vocab_size} tokens but the checkpoint's "
                             f"vocab_size is {cfg.vocab_size}: pass --tokenizer (the "
                             f"checkpoint's own)")
        original = cfg.max_position_embeddings or a.stages[0]
    else:
        original = a.stages[0]
        cfg = LlamaConfig(vocab_size=vocab_size, d_model=a.d_model, num_layers=a.layers,
                          num_heads=a.heads, num_kv_heads=a.kv_heads, dtype=dtype,
                          remat=a.remat, max_position_embeddings=original,
                          scan_layers=a.scan_layers)
    return cfg, original


def stage_config(a, cfg, original, i):
    """Stage ``i``'s config: its RoPE base and scaling, the context it trains for."""
    S = a.stages[i]
    scaling = rope_scaling_for(a, original, S)
    max_pos = original if scaling and scaling["rope_type"] == "dynamic" else max(original, S)
    return dataclasses.replace(
        cfg, rope_theta=a.rope_theta[i] if a.rope_theta else cfg.rope_theta,
        rope_scaling=scaling if a.rope_scaling else cfg.rope_scaling,
        max_position_embeddings=max_pos)


def initial_state(a, model, optimizer, key, abstract):
    """A fresh train state: the checkpoint's weights (or a random init) and a new optimizer
    state, on ``abstract``'s shardings."""
    if not a.checkpoint:
        return init_train_state(model, optimizer, key, (a.batch[0], a.stages[0]))
    c = model.config
    _, params = load_pretrained(a.checkpoint, mesh=model.mesh, dtype=c.dtype,
                                parallelism=model.parallelism,
                                param_dtype=c.param_dtype, remat=c.remat,
                                rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
                                max_position_embeddings=c.max_position_embeddings,
                                scan_layers=c.scan_layers)

    def fresh(p):
        p = to_form(p, c.scan_layers)  # the model's form (a no-op: the loader built it)
        return TrainState(params=p, opt_state=optimizer.init(p), step=jnp.zeros((), jnp.int32),
                          rng=jax.random.fold_in(key, RNG_STREAM))
    return jax.jit(fresh, out_shardings=shardings_of(abstract), donate_argnums=0)(params)


def build_mesh(a, cfg, G):
    """``(mesh, parallelism)``: the sequence over all ``G`` devices (parallelism None), or
    the roles of ``--mesh`` (``auto``: ``sharding.choose_mesh`` for one node of ``G``
    devices with H200-like numbers; on CPU only the shape of the choice means anything)."""
    devices = jax.devices()[:G]
    if a.mesh is None:
        return jax.make_mesh((G,), ("sp",), devices=devices, axis_types=(AxisType.Auto,)), None
    if a.mesh == "auto":
        choice = choose_mesh(cfg, seq_len=max(a.stages), global_batch=min(a.batch),
                             devices_per_node=G, intra_link=Link(450e9, 5e-6),
                             device_memory=141e9, device_flops=989e12,
                             remat=a.remat,
                             layout=a.layout)
        sizes = dict(choice.sizes)
        say(f"--mesh auto: {sizes} ({choice.reason})")
    else:
        try:
            sizes = parse_mesh_arg(a.mesh)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    if math.prod(sizes.values()) != G:
        raise SystemExit(f"--mesh {a.mesh}: the sizes multiply to {math.prod(sizes.values())}, "
                         f"not the {G} devices (--devices)")
    if any(b % (sizes["data"] * sizes["fsdp"]) for b in a.batch):
        raise SystemExit(f"--batch {a.batch} must divide by data x fsdp = "
                         f"{sizes['data'] * sizes['fsdp']}")
    return make_mesh(sizes, devices)


# --------------------------------------------------------------------------- training
def read_log(path, upto):
    """``(rows, packing reports)`` of an earlier run's log: its rows up to step ``upto`` (a
    resumed run recomputes the steps after its checkpoint) and its stages' reports."""
    if upto == 0 or not os.path.exists(path):
        return [], {}
    with open(path) as f:
        old = json.load(f)
    return [r for r in old.get("log", []) if r["step"] <= upto], old.get("packing", {})


def main():
    a = ARGS
    G = a.devices or jax.device_count()
    if G > jax.device_count():
        raise SystemExit(f"--devices={G} but JAX sees {jax.device_count()} devices")
    data = data_folder(a)
    tokenizer, tok_how = choose_tokenizer(a, data)
    add_bos = document_bos(a)
    cfg, original = base_config(a, tokenizer.vocab_size)
    mesh, par = build_mesh(a, cfg, G)
    seq = G if par is None else par.sizes(mesh)["sequence"]
    for S in a.stages:
        if S % (2 * seq) and a.layout == "zigzag":
            raise SystemExit(f"--stages: {S} must be divisible by 2*{seq} devices for "
                             f"--layout zigzag")
        if S % seq:
            raise SystemExit(f"--stages: {S} must be divisible by {seq} devices")
    configs = [stage_config(a, cfg, original, i) for i in range(len(a.stages))]
    models = [Llama(c, mesh=mesh, layout=a.layout, backward=a.backward, kernel=a.kernel,
                    parallelism=par) for c in configs]
    total = sum(a.steps)
    ends = np.cumsum(a.steps).tolist()           # last step of each stage
    lr = a.lr if a.lr is not None else (2e-5 if a.checkpoint else 3e-3)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, a.warmup, max(total, a.warmup + 1),
                                                  end_value=lr / 10)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1))
    key = jax.random.key(a.seed)
    # The parameters do not depend on the sequence length or RoPE: one state for all stages.
    abstract = abstract_train_state(models[0], optimizer, key, (a.batch[0], a.stages[0]))
    n_params = sum(x.size for x in jax.tree.leaves(abstract.params))
    say(f"devices: {G} x {jax.devices()[0].device_kind} ({jax.default_backend()}), JAX "
        f"{jax.__version__}, {INFO.process_count} process(es); layout={a.layout}, "
        f"backward={a.backward}, remat={a.remat}, dtype={cfg.dtype}, "
        f"scan_layers={cfg.scan_layers}")
    say(f"model: {a.checkpoint or 'random init'}, {n_params:,} parameters; tokenizer: "
        f"{tok_how}, {tokenizer.vocab_size} tokens; data: {data} (BOS per document: "
        f"{'yes' if add_bos else 'no'})")
    for i, c in enumerate(configs):
        say(f"stage {i + 1}: {a.steps[i]} steps of {a.batch[i]} x {a.stages[i]} tokens, "
            f"rope_theta={c.rope_theta:g}, rope_scaling="
            f"{c.rope_scaling.to_dict() if c.rope_scaling else None}")

    os.makedirs(a.out, exist_ok=True)
    log_path = os.path.join(a.out, "finetune_log.json")
    t_start = time.perf_counter()
    with TrainCheckpointer(CheckpointConfig(a.ckpt_dir, save_every=a.save_every,
                                            keep=a.keep)) as ckpt:
        restored = ckpt.restore_latest(abstract)
        if restored is None:
            state, done, data_state = initial_state(a, models[0], optimizer, key,
                                                    abstract), 0, None
        else:
            state, done, data_state = restored.state, restored.step, restored.data_state
            say(f"resumed from {a.ckpt_dir} at step {done}")
        log, reports = read_log(log_path, done)
        steps = range(done, min(total, a.stop_after or total))
        bar = None
        try:
            from tqdm import tqdm
            bar = tqdm(total=total, initial=done, desc="fine-tune", dynamic_ncols=True,
                       disable=not LEAD)
        except ImportError:
            pass
        for i, model in enumerate(models):
            first, last = (ends[i - 1] if i else 0) + 1, ends[i]
            todo = [s for s in steps if first <= s + 1 <= last]
            if not todo:
                continue
            it = make_iterator(data, seq_len=a.stages[i], batch_size=a.batch[i],
                               tokenizer=tokenizer, seed=a.seed + i, window=a.window,
                               add_bos=add_bos,
                               process_index=0, process_count=1)  # every process: all rows
            if data_state is not None and data_state["stage"] == i:
                it.set_state(data_state["iterator"])
            train_step = make_train_step(model, optimizer, shardings=abstract)
            t0, tokens = time.perf_counter(), 0
            for s in todo:
                step = s + 1
                batch = next(it)
                tokens += int(batch["loss_mask"].sum())
                state, m = train_step(state, jd.from_host(batch, mesh, P()))
                ckpt.save(step, state, {"stage": i, "iterator": it.get_state()},
                          force=step == total)
                if step % a.log_every == 0 or step in (first, last):
                    m = jd.to_host(m)  # synchronises: the time below includes the step
                    now = time.perf_counter()
                    row = {"step": step, "stage": i + 1, "seq_len": a.stages[i],
                           "loss": float(m["loss"]), "accuracy": float(m["accuracy"]),
                           "tokens_per_s": tokens / (now - t0),
                           "compile": s == todo[0], "seconds": now - t_start}
                    log.append(row)
                    t0, tokens = now, 0
                    if bar is not None:
                        bar.set_postfix_str(f"stage {i + 1}  loss {row['loss']:.3f}  "
                                            f"{row['tokens_per_s']:,.0f} tok/s")
                    else:
                        say(f"step {step:5d}  loss {row['loss']:.3f}", flush=True)
                if bar is not None:
                    bar.update(1)
            reports[str(i + 1)] = it.report.summary()  # JSON keys: the stage as a string
        if bar is not None:
            bar.close()
    wall = time.perf_counter() - t_start
    finished = int(state.step)
    say(f"step {finished} of {total} in {wall:.0f} s"
        + ("" if finished == total else f" (stopped by --stop-after {a.stop_after}; rerun "
                                        f"without it to resume)"))
    if LEAD:
        with open(log_path, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items()}, "devices": G,
                       "processes": INFO.process_count, "backend": jax.default_backend(),
                       "jax": jax.__version__, "parameters": int(n_params),
                       "config": configs[-1].to_hf(), "tokenizer": tok_how,
                       "packing": reports, "steps_done": finished, "log": log,
                       "wall_s": wall, "compile_cache": compile_cache_stats()}, f, indent=1)
        plot(log, ends, os.path.join(a.out, "loss.png"), a, G)
    if a.export and finished == total:
        extra = {k: v for k, v in (("bos_token_id", tokenizer.bos_id),
                                   ("eos_token_id", tokenizer.eos_id),
                                   ("pad_token_id", tokenizer.pad_id)) if v is not None}
        save_pretrained(configs[-1], state.params, a.export, dtype=a.export_dtype,
                        extra_config=extra)  # either form: one tensor per layer is written
        if LEAD:
            tokenizer.save(a.export)
        say(f"exported to {a.export} (models.hf.load_pretrained / transformers read it)")
    say(compile_cache_summary())


def plot(log, ends, path, a, G):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not available: no plot")
        return
    if not log:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    steps = [r["step"] for r in log]
    ax1.plot(steps, [r["loss"] for r in log])
    ax1.set_xlabel("step")
    ax1.set_ylabel("next-token loss")
    timed = [r for r in log if not r["compile"]]
    ax2.plot([r["step"] for r in timed], [r["tokens_per_s"] for r in timed], ".")
    ax2.set_xlabel("step")
    ax2.set_ylabel("tokens / s (non-padding)")
    for end in ends[:-1]:
        for ax in (ax1, ax2):
            ax.axvline(end + 0.5, color="gray", ls="--", lw=0.8)
    fig.suptitle(f"fine-tuning at {', '.join(map(str, a.stages))} tokens over {G} "
                 f"{jax.default_backend()} devices ({a.layout})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
