"""Streamed checkpoint loading (issue 25): host memory and time of ``load_pretrained``.

Writes a random transformers-format checkpoint of a named shape (``train_mfu.SIZES``:
``1b``, ``7b``) as sharded bfloat16 safetensors, tensor by tensor with NumPy (values
tiled from one small random block, so 7B parameters take seconds), then loads it with
``jax_seqpar.models.hf.load_pretrained`` in a **fresh subprocess** that only loads, and
reports:

* load time (to every array ready on its devices);
* host peak RSS (``ru_maxrss``) and the RSS before loading; on CPU the loaded parameters
  themselves live in host memory, so the loader's own transient memory is also reported:
  the largest ``RSS(t) - RSS before - bytes of the tensors already loaded`` sampled every
  2 ms during the load (target: <= largest tensor + 1 GiB);
* the largest tensor's bytes (on disk, and in the parameter dtype), the parameters'
  bytes per device, and the device memory in use (GPUs).

``--train-step`` then runs one AdamW training step and one forward (loss) at
``--seq-len`` tokens on the loaded parameters (``training.make_train_step``: zigzag ring,
remat, FSDP shardings).

    python benchmarks/hf_load.py --shape 1b                       # CPU: load only
    python benchmarks/hf_load.py --shape 7b --devices 1 --train-step --seq-len 32768
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time

import _setup  # noqa: F401

import numpy as np  # noqa: E402

GIB = 2 ** 30


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


# --------------------------------------------------------------------------- writing
def write_checkpoint(shape: str, path: str, max_shard_gb: float = 2.0) -> dict:
    """A random bf16 checkpoint of ``train_mfu.SIZES[shape]`` in transformers' format."""
    import ml_dtypes

    from jax_seqpar.models import LlamaConfig
    from jax_seqpar.models.hf import INDEX, tensor_map
    from jax_seqpar.models.safetensors_io import plan_shards, write_file
    from train_mfu import SIZES

    cfg = LlamaConfig(**SIZES[shape], param_dtype="bfloat16", max_position_embeddings=8192)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    block = (np.random.default_rng(0).standard_normal(1 << 20) * 0.02).astype(bf16)
    entries = {e.hf_name: e for e in tensor_map(cfg).values()}

    def produce(name):
        e = entries[name]
        if name.endswith("norm.weight"):
            return np.ones(e.hf_shape, bf16)
        return np.resize(block, e.hf_shape)

    os.makedirs(path, exist_ok=True)
    t0 = time.perf_counter()
    sizes = [(n, int(np.prod(e.hf_shape)) * 2) for n, e in entries.items()]
    groups = plan_shards(sizes, int(max_shard_gb * 1e9))
    files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    for file, group in zip(files, groups):
        write_file(os.path.join(path, file), [(n, bf16, entries[n].hf_shape) for n in group],
                   produce, {"format": "pt"})
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": sum(s for _, s in sizes)},
                   "weight_map": {n: fl for fl, g in zip(files, groups) for n in g}}, f)
    hf = cfg.to_hf()
    hf["dtype"] = "bfloat16"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=1)
    total = sum(s for _, s in sizes)
    return dict(write_s=time.perf_counter() - t0, checkpoint_bytes=total, files=len(files),
                largest_tensor_bytes_disk=max(s for _, s in sizes),
                parameters=total // 2)


# --------------------------------------------------------------------------- loading
def load_only(args) -> dict:
    """Runs in the fresh subprocess: load, measure, optionally train one step."""
    import jax
    from jax.sharding import AxisType

    from jax_seqpar.models import hf, param_stream
    from _util import env_info, peak_memory_bytes

    on_cpu = jax.default_backend() == "cpu"
    devs = jax.devices()[:args.devices or (1 if on_cpu else jax.device_count())]
    mesh = jax.make_mesh((len(devs),), ("sp",), axis_types=(AxisType.Auto,), devices=devs)
    jax.block_until_ready(jax.device_put(np.zeros(8), devs[0]))  # backend up
    base = rss_bytes()
    loaded = [0]
    transient = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            transient[0] = max(transient[0], rss_bytes() - base - loaded[0])
            time.sleep(0.002)

    inner = param_stream._load_tensor

    def counting(info, e, sharding, dtype):   # count each tensor once it is on its devices
        arr = jax.block_until_ready(inner(info, e, sharding, dtype))
        loaded[0] += sum(s.data.nbytes for s in arr.addressable_shards) if on_cpu else 0
        return arr

    param_stream._load_tensor = counting
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    cfg, params = hf.load_pretrained(args.dir, mesh=mesh, dtype=args.dtype,
                                     param_dtype=args.param_dtype, params=args.params)
    jax.block_until_ready(params)
    load_s = time.perf_counter() - t0
    stop.set()
    thread.join()
    param_stream._load_tensor = inner
    leaves = jax.tree.leaves(params)
    largest = max(leaves, key=lambda x: x.size)
    per_dev = sum(s.data.nbytes for x in leaves for s in x.addressable_shards
                  if s.device == devs[0])
    row = dict(env=env_info(), devices=len(devs), params_mode=args.params,
               param_dtype=args.param_dtype, load_s=load_s, rss_before=base,
               peak_rss=peak_rss_bytes(), loader_transient_peak=transient[0],
               params_host_bytes=loaded[0], param_bytes_device0=per_dev,
               largest_tensor_param_bytes=largest.nbytes,
               largest_tensor_shape=list(largest.shape),
               device_peak_bytes=peak_memory_bytes(devs[0]))
    if args.train_step:
        row.update(train_step(cfg, params, mesh, args))
    return row


def train_step(cfg, params, mesh, args) -> dict:
    import dataclasses

    import jax
    import jax.numpy as jnp

    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_seqpar.sharding.fsdp import fsdp_shardings, replicated_shardings
    from jax_seqpar.models import Llama, next_token_loss
    from jax_seqpar.training import TrainState, make_train_step
    from _util import peak_memory_bytes

    cfg = dataclasses.replace(cfg, remat=args.remat)
    model = Llama(cfg, mesh=mesh, layout="zigzag")
    opt = optax.adamw(1e-4, b1=0.9, b2=0.95, weight_decay=0.1)
    o_shape = jax.eval_shape(opt.init, params)
    o_sh = (fsdp_shardings(o_shape, mesh, "sp") if args.params == "fsdp"
            else replicated_shardings(o_shape, mesh))
    rep = NamedSharding(mesh, P())
    state = TrainState(params=params, opt_state=jax.jit(opt.init, out_shardings=o_sh)(params),
                       step=jax.device_put(jnp.zeros((), jnp.int32), rep),
                       rng=jax.device_put(jax.random.key(0), rep))
    step = make_train_step(model, opt, shardings=state)
    tokens = jax.device_put(jax.random.randint(jax.random.key(0), (1, args.seq_len), 0,
                                               cfg.vocab_size, jnp.int32),
                            NamedSharding(mesh, P(None, "sp")))
    fwd = jax.jit(lambda p, t: next_token_loss(model, p, t)[0])
    t0 = time.perf_counter()
    loss_fwd = float(fwd(params, tokens))
    fwd_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    float(fwd(params, tokens))
    fwd_again_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    params = None                       # donated with the state
    state, metrics = step(state, {"tokens": tokens})
    loss = float(metrics["loss"])
    step_s = time.perf_counter() - t0
    return dict(seq_len=args.seq_len, forward_loss=loss_fwd, forward_s_with_compile=fwd_s,
                forward_s=fwd_again_s,
                train_loss=loss, train_step_s_with_compile=step_s,
                device_peak_bytes_after_step=peak_memory_bytes(mesh.devices.flat[0]),
                finite=bool(np.isfinite(loss) and np.isfinite(loss_fwd)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1b", help="train_mfu.SIZES key: tiny, 1b, 7b")
    p.add_argument("--dir", default=None, help="checkpoint directory (default: /tmp/...)")
    p.add_argument("--devices", type=int, default=None,
                   help="default: every GPU; 1 on CPU")
    p.add_argument("--params", default="fsdp", choices=("fsdp", "replicated"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--param-dtype", default="float32")
    p.add_argument("--train-step", action="store_true")
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--remat", default="attention")
    p.add_argument("--keep", action="store_true", help="keep the written checkpoint")
    p.add_argument("--load-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.load_only:
        print("RESULT " + json.dumps(load_only(args)), flush=True)
        return 0
    args.dir = args.dir or f"/tmp/jax_seqpar_hf_{args.shape}"
    written = write_checkpoint(args.shape, args.dir)
    print(f"# wrote {args.dir}: {written['checkpoint_bytes'] / GIB:.2f} GiB in "
          f"{written['files']} files, {written['write_s']:.1f} s", flush=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--load-only", "--dir", args.dir,
           "--params", args.params, "--dtype", args.dtype, "--param-dtype", args.param_dtype,
           "--seq-len", str(args.seq_len), "--remat", args.remat]
    cmd += ["--devices", str(args.devices)] if args.devices else []
    cmd += ["--train-step"] if args.train_step else []
    out = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write(out.stderr[-3000:])
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        print(out.stdout[-3000:])
        return out.returncode or 1
    row = dict(shape=args.shape, **written, **json.loads(lines[-1][7:]))
    if not args.keep:
        import shutil
        shutil.rmtree(args.dir)
    from _util import out_dir, save_json
    name = (f"hf_load_{args.shape}_{row['env']['backend']}{row['devices']}_{args.params}_"
            f"{args.param_dtype}{'_train' if args.train_step else ''}.json")
    save_json(row, os.path.join(out_dir(), name))
    limit = row["largest_tensor_bytes_disk"] + GIB
    over = row["loader_transient_peak"] if row["env"]["backend"] == "cpu" else (
        row["peak_rss"] - row["rss_before"])
    print(f"\nshape {args.shape}: {written['parameters'] / 1e9:.2f}B parameters, "
          f"{row['devices']} {row['env']['device_kind']}, params={args.params} "
          f"({args.param_dtype})\n"
          f"  load {row['load_s']:.1f} s; host RSS before {row['rss_before'] / GIB:.2f} GiB, "
          f"peak {row['peak_rss'] / GIB:.2f} GiB; parameters in host memory "
          f"{row['params_host_bytes'] / GIB:.2f} GiB; loader transient peak "
          f"{row['loader_transient_peak'] / GIB:.2f} GiB\n"
          f"  largest tensor {row['largest_tensor_bytes_disk'] / GIB:.3f} GiB on disk, "
          f"{row['largest_tensor_param_bytes'] / GIB:.3f} GiB as {args.param_dtype}; "
          f"target RSS over what must stay <= largest + 1 GiB = {limit / GIB:.2f} GiB: "
          f"{over / GIB:.2f} GiB {'OK' if over <= limit else 'OVER'}")
    if row.get("device_peak_bytes"):
        print(f"  device 0 peak after load {row['device_peak_bytes'] / GIB:.2f} GiB")
    if args.train_step:
        print(f"  S={row['seq_len']}: forward loss {row['forward_loss']:.3f} "
              f"({row['forward_s_with_compile']:.1f} s with compile, {row['forward_s']:.2f} s "
              f"again), train step loss "
              f"{row['train_loss']:.3f} ({row['train_step_s_with_compile']:.1f} s with "
              f"compile), device peak {(row['device_peak_bytes_after_step'] or 0) / GIB:.1f} "
              f"GiB, finite {row['finite']}")
    return 0 if over <= limit and row.get("finite", True) else 1


if __name__ == "__main__":
    sys.exit(main())
