"""End-to-end training throughput: tokens/s per GPU and MFU of a Llama step (issue 18).

One AdamW training step (forward, backward, update) of ``models.Llama`` with the
sequence sharded over G devices (ring attention, zigzag, ``backward="auto"``,
``kernel="auto"`` unless ``--kernel`` names a backend, a remat policy), bf16 compute
with float32 master weights and optimizer state, and parameters + gradients + optimizer
state either fully sharded over the same devices (``--params fsdp``,
``jax_seqpar.sharding.fsdp``: XLA gathers each weight where a layer uses it) or
replicated (``--params replicated``).

Model FLOPs per token (counted, not measured; no recomputation counted):
``6 * N_matmul`` for the weight matmuls forward + backward (``N_matmul``: parameters of
every matmul, the LM head included, the embedding lookup and norms excluded) plus
attention's score and value matmuls, ``12 * L * S * Hq * Dh`` forward + backward,
**halved for the causal mask** (each query sees on average half the sequence):
``6 * L * S * Hq * Dh``.  MFU = tokens/s * FLOPs per token / (G * peak), with
``peak`` = the H200's 989 TFLOP/s dense bf16 spec, and also against the bf16 matmul rate
measured in the same run (8192^3).  Peak memory: the largest ``peak_bytes_in_use`` over
the devices (``memory_stats()``; not available on CPU).

**Packed documents** (``--packed MEDIAN``, issue 26): the sequence is one row of
documents with log-normal lengths (median ``MEDIAN`` tokens, log-sd 1, as
``packing_efficiency.py``), packed by ``data.pack_documents`` (``"sequential"``: the row
is full, no padding; a document longer than the row is cut), with segment ids and
positions restarting per document.  The packed step and the unpacked one (the same
tokens without segment ids or positions) are built on one state and timed alternately,
step for step, in the same run.  The packed row's FLOPs count attention **within
documents only**: a document of ``n`` tokens does ``n^2 / 2`` causal pairs, so its
attention term is ``12 * L * Hq * Dh * sum(n_i^2) / 2`` per step, i.e.
``6 * L * Hq * Dh * sum(n_i^2) / S`` per token instead of ``6 * L * Hq * Dh * S``; the
matmul term is the same.  Packed MFU is thus useful work only: the attention kernels
still visit the cross-document tiles that the mask empties (skipping them is the
document-aware attention issue), so packed MFU below unpacked MFU is that waste.

**Memory and remat switches** (issue 30): ``--remat`` takes one or more entries,
comma-separated, each a ``jax_seqpar.layers.remat.REMAT_MODES`` name, ``+offload`` appended to
move what that policy saves (and each block's input) to host memory until the backward
(``LlamaConfig.remat_offload``); every entry is one row.  ``--memory-account`` prints,
per row, what the state (and one layer's parameters, on a device and gathered, in
either form), the gradients and the saved residuals take (counted from the shapes) next
to XLA's own account of the compiled step (``memory_analysis()``: arguments, outputs,
aliased, temporaries; one extra compilation) and the measured peak.
``--opt-memory pinned_host`` keeps the AdamW state in host memory between steps
(``abstract_train_state(opt_memory=...)``).  ``--profile DIR`` traces one more step per row (``_profile.py``: kernel time by
category, GPU idle time).  Host memory: the process's peak RSS.  The GPU memory pool is
95% of the device (``XLA_PYTHON_CLIENT_MEM_FRACTION``, JAX's default is 75%) unless the
environment says otherwise.

    python benchmarks/train_mfu.py --preset cpu          # tiny model, 8 simulated devices
    python benchmarks/train_mfu.py --preset gpu --sizes 1b --devices 1,2,4 --tokens-per-gpu 32768
    python benchmarks/train_mfu.py --preset gpu --sizes 1b --devices 1 --tokens-per-gpu 65536 \
        --packed 4096                                    # packed vs unpacked, one run
    python benchmarks/train_mfu.py --preset gpu --sizes 7b --devices 1 --tokens-per-gpu 32768 \
        --remat attention,attention_mlp,attention_mlp+offload --memory-account
    python benchmarks/train_mfu.py --preset cpu --mesh "none;data=2,sequence=2,tensor=2"
    python benchmarks/train_mfu.py --preset cpu --scan-layers --memory-account

``--scan-layers``: the blocks as one ``nn.scan`` over stacked parameters
(``LlamaConfig(scan_layers=True)``; the JSON gets ``_scan`` in its name).  Compiled steps
are kept in JAX's persistent compilation cache (``runtime.compile_cache``:
``--compile-cache DIR``, default ``~/.cache/jax_seqpar/xla`` but off on several CPU
devices; ``--no-compile-cache`` to time the compilation itself: ``first_step_s``
includes it only when it is not cached).

**N-D meshes** (issue 38): ``--mesh`` takes ``;``-separated meshes, one row each:
``none`` (the one-axis model), ``data=..,fsdp=..,sequence=..,tensor=..`` (role sizes,
``sharding.make_mesh``; ``data * fsdp`` rows of ``tokens_per_gpu * G / rows`` tokens per
step, the state laid out by the model's logical rules) or ``auto``
(``sharding.choose_mesh``).  ``none;sequence=1`` on one device compares today's path with
the N-D one in the same run.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import time

import _setup  # noqa: F401,E402

# JAX's GPU client takes 75% of the device's memory unless told otherwise; the 7B rows
# need more (issue 30: the 75% pool is where "out of memory at 64k" came from).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

from jax_seqpar.parallel.comm_time import Link  # noqa: E402
from jax_seqpar.sharding import choose_mesh, make_mesh, parse_mesh_arg  # noqa: E402
from jax_seqpar.sharding.choose_mesh import saved_per_layer  # noqa: E402
from jax_seqpar.sharding.fsdp import bytes_per_device  # noqa: E402
from jax_seqpar.models import Llama, LlamaConfig  # noqa: E402
from jax_seqpar.models.llama import LAYERS  # noqa: E402
from jax_seqpar.models.stacking import is_scanned, layer_key, num_layers  # noqa: E402
from jax_seqpar.runtime.compile_cache import (add_compile_cache_args,  # noqa: E402
                                              compile_cache_from_args, compile_cache_stats,
                                              compile_cache_summary)
from jax_seqpar.layers.remat import REMAT_MODES  # noqa: E402
from jax_seqpar.training import (OPT_MEMORY, abstract_train_state,  # noqa: E402
                                 init_train_state, make_train_step, shardings_of)
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


def flops_per_token(cfg: LlamaConfig, seq_len: int, causal: bool = True,
                    documents=None) -> dict:
    """Model FLOPs per token (module docstring).  ``documents``: the lengths of the packed
    documents of a ``seq_len`` row; attention then counts within-document pairs only
    (``sum(n^2) / seq_len`` keys per query on average instead of ``seq_len``)."""
    d, L, H, Hkv, Dh, F, V = (cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
                              cfg.head_dim, cfg.ffn_dim, cfg.vocab_size)
    per_layer = d * H * Dh + 2 * d * Hkv * Dh + H * Dh * d + 3 * d * F
    n_matmul = L * per_layer + d * V
    context = seq_len
    if documents is not None:
        lengths = np.asarray(documents, np.float64)
        if lengths.sum() != seq_len:
            raise ValueError(f"documents sum to {lengths.sum():.0f} tokens, not "
                             f"seq_len={seq_len}")
        context = float((lengths ** 2).sum() / seq_len)
    attn = 12 * L * context * H * Dh * (0.5 if causal else 1.0)
    return dict(n_matmul=n_matmul, dense=6 * n_matmul, attention=attn,
                total=6 * n_matmul + attn)


def packed_row(S: int, median: int, vocab: int, seed: int = 0) -> dict:
    """One full row of ``S`` tokens: random documents with log-normal lengths (median
    ``median``, log-sd 1) packed by ``data.pack_documents`` (sequential: no padding).
    Returns the ``[1, S]`` ``tokens``, ``segment_ids``, ``positions`` and the lengths."""
    from jax_seqpar.data import pack_documents

    if median < 1:
        raise ValueError(f"--packed={median} must be a positive document length")
    rng = np.random.default_rng(seed)
    docs, total = [], 0
    while total < S:
        n = max(1, int(np.exp(rng.normal(np.log(median), 1.0))))
        docs.append(rng.integers(0, vocab, n, dtype=np.int32))
        total += n
    rows = pack_documents(docs, S, policy="sequential").batches[0]  # every row, one batch
    row = {k: rows[k][:1] for k in ("tokens", "segment_ids", "positions")}
    seg = row["segment_ids"][0]
    assert seg.min() >= 1, "a sequential row is full"
    row["lengths"] = np.bincount(seg)[1:]
    return row


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


def build(size: str, G: int, S: int, *, dtype: str, remat: str, params_mode: str,
          lr=1e-4, seed=0, packed=None, opt_memory="device", mesh_sizes=None,
          scan_layers=False, rows=None, kernel="auto"):
    """``(step, state, batches, cfg, (state_bytes, params_bytes, per_layer), lengths)``
    (``per_layer``: ``layer_param_bytes``); ``step(state, batch)`` ->
    ``(state, metrics)`` (``jax_seqpar.training.make_train_step``: jitted, the state
    donated and kept on the shardings of ``params_mode``, created in place by
    ``init_train_state``).  ``batches``: ``{"unpacked": {"tokens"}}``, and with ``packed``
    (a median document length) also ``"packed"``: the same tokens with the segment ids and
    positions of ``packed_row``, whose document ``lengths`` are returned (else None).

    ``mesh_sizes`` (``{"data": .., "fsdp": .., "sequence": .., "tensor": ..}``, from
    ``--mesh``): an N-D mesh with ``sharding.Parallelism`` (``Llama(parallelism=...)``,
    the state laid out by the logical rules) and ``data * fsdp`` rows of ``S`` tokens;
    None: the one-axis model over ``G`` devices, one row.  ``rows`` (``--batch``): that
    many rows of ``S`` tokens instead (a multiple of ``data * fsdp``)."""
    devs = jax.devices()[:G]
    mode, offload = parse_remat(remat)
    cfg = LlamaConfig(**SIZES[size], dtype=dtype, param_dtype="float32", remat=mode,
                      remat_offload=offload, scan_layers=scan_layers)
    if mesh_sizes is None:
        mesh = jax.make_mesh((G,), ("sp",), axis_types=(AxisType.Auto,), devices=devs)
        model = Llama(cfg, mesh=mesh, layout="zigzag", backward="auto", kernel=kernel)
        seq, B = NamedSharding(mesh, P(None, "sp")), batch_rows(None, rows)
    else:
        mesh, par = make_mesh(mesh_sizes, devs)
        model = Llama(cfg, mesh=mesh, parallelism=par, layout="zigzag", backward="auto",
                      kernel=kernel)
        seq = par.sharding(mesh, ("batch", "length"))
        B = batch_rows(mesh_sizes, rows)
        if packed is not None:
            raise ValueError("--packed with --mesh: not supported yet (one packed row)")
        params_mode = "logical" if params_mode == "fsdp" else params_mode
    lengths = None
    if packed is None:
        tokens = jax.random.randint(jax.random.PRNGKey(seed + 1), (B, S), 0, cfg.vocab_size,
                                    jnp.int32)
        batches = {"unpacked": {"tokens": jax.device_put(tokens, seq)}}
    else:
        row = packed_row(S, packed, cfg.vocab_size, seed + 1)
        lengths = row.pop("lengths")
        row = {k: jax.device_put(v, seq) for k, v in row.items()}
        batches = {"packed": row, "unpacked": {"tokens": row["tokens"]}}
    opt = optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=0.1)
    key = jax.random.PRNGKey(seed)
    abstract = abstract_train_state(model, opt, key, (B, S), sharding=params_mode,
                                    opt_memory=opt_memory)
    state = init_train_state(model, opt, key, (B, S), sharding=params_mode,
                             opt_memory=opt_memory)
    step = make_train_step(model, opt, shardings=abstract)
    params_bytes = bytes_per_device(abstract.params, shardings_of(abstract.params))
    state_bytes = params_bytes + bytes_per_device(abstract.opt_state,
                                                  shardings_of(abstract.opt_state))
    per_layer = layer_param_bytes(abstract.params)
    return step, state, batches, cfg, (state_bytes, params_bytes, per_layer), lengths


def batch_rows(mesh_sizes, rows=None) -> int:
    """Rows of one step: ``rows`` (``--batch``), else one per ``data * fsdp`` shard (one
    for the one-axis model).  ``ValueError`` when ``rows`` does not divide over them."""
    shards = 1 if mesh_sizes is None else mesh_sizes.get("data", 1) * mesh_sizes.get("fsdp", 1)
    if rows is None:
        return shards
    if rows < 1 or rows % shards:
        raise ValueError(f"--batch {rows} must be a positive multiple of data x fsdp = "
                         f"{shards}")
    return rows


def layer_param_bytes(params) -> tuple:
    """``(on one device, whole)``: the bytes of one decoder block's parameters, from
    ``ShapeDtypeStruct``s with shardings (``abstract_train_state``) in either form: the
    unrolled ``layer_0`` subtree, or the stacked ``layers`` subtree (every leaf
    ``[L, ...]``, the layer axis never split) divided by ``L``.  ``whole`` is what a
    device holds of a block while FSDP has gathered it."""
    inner = params["params"]
    n = num_layers(params)
    block, per = (inner[LAYERS], n) if is_scanned(params) else (inner[layer_key(0)], 1)
    local = bytes_per_device(block, shardings_of(block))
    whole = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                for x in jax.tree.leaves(block))
    return local // per, whole // per


def mesh_label(sizes) -> str:
    return "x".join(f"{k}{v}" for k, v in sizes.items() if v > 1) or "1 device"


H200_MEMORY = 141e9


def device_memory() -> float:
    """Bytes one GPU of this run may hold: its allocator's ``bytes_limit`` (81 GB on an
    H100 80GB at this script's 95% memory fraction); an H200's 141 GB where the backend
    does not say (CPU)."""
    try:
        limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    except Exception:
        limit = None
    return float(limit) if limit and jax.default_backend() == "gpu" else H200_MEMORY


def mesh_choice(size: str, G: int, S: int, remat: str, *, rows: int = 1,
                dtype: str = "bfloat16", scan_layers: bool = False,
                memory: float = H200_MEMORY):
    """``sharding.choose_mesh`` for one node of ``G`` Hopper GPUs (NVLink 450 GB/s per
    device, 989 TFLOP/s, ``memory`` bytes each: an H200's by default, the run's own GPUs'
    in a run), ``rows`` sequences of ``S`` tokens, the row's compute dtype with float32
    parameters, its remat mode and layer form (as ``build``); offloading is not modeled
    (its rows are modeled as the mode without it)."""
    mode, _ = parse_remat(remat)
    cfg = LlamaConfig(**SIZES[size], dtype=dtype, param_dtype="float32",
                      scan_layers=scan_layers)
    return choose_mesh(cfg, seq_len=S, global_batch=rows, devices_per_node=G,
                       intra_link=Link(450e9, 5e-6), device_memory=memory,
                       device_flops=989e12, remat=mode)


def predicted_for(choice, sizes) -> dict:
    """What ``choice`` (a ``MeshChoice``) modeled for the mesh ``sizes``: its step time,
    memory per device, why it was skipped (if it was), and the pick."""
    c = next(c for c in choice.candidates if c.sizes == sizes)
    return dict(pick=dict(choice.sizes), picked=c.sizes == choice.sizes, skipped=c.skipped,
                step_s=c.step_seconds, seconds=c.seconds,
                memory_gib=None if c.memory is None else c.memory / 2 ** 30,
                state_gib=None if c.state_memory is None else c.state_memory / 2 ** 30)


def mesh_arg(text: str, size: str, G: int, S: int, remat: str, rows=None,
             dtype: str = "bfloat16", scan_layers: bool = False):
    """One ``--mesh`` entry -> role sizes (None for ``"none"``).  ``"auto"`` asks
    ``mesh_choice`` (``sharding.choose_mesh``) and prints its reason; ``rows`` sequences
    of ``S`` tokens per step (``--batch``; default one per data x fsdp shard, so one for
    ``auto``)."""
    text = text.strip()
    if text == "none":
        return None
    if text == "auto":
        choice = mesh_choice(size, G, S, remat, rows=rows or 1, dtype=dtype,
                             scan_layers=scan_layers, memory=device_memory())
        print(f"# --mesh auto for {size} G={G} S={S}: {choice.sizes} ({choice.reason})",
              flush=True)
        return dict(choice.sizes)
    sizes = parse_mesh_arg(text)
    if math.prod(sizes.values()) != G:
        raise ValueError(f"--mesh {text!r}: the sizes multiply to "
                         f"{math.prod(sizes.values())}, not the {G} devices of this row")
    return sizes


def parse_remat(entry: str):
    """``"MODE"`` or ``"MODE+offload"`` -> ``(mode, offload)``."""
    mode, _, extra = entry.partition("+")
    if mode not in REMAT_MODES or extra not in ("", "offload"):
        raise ValueError(f"--remat entry {entry!r}: expected MODE or MODE+offload with MODE "
                         f"one of {REMAT_MODES}")
    return mode, extra == "offload"


def residual_bytes(cfg: LlamaConfig, tokens: int) -> dict:
    """Bytes one device keeps per layer between the forward and the backward under
    ``cfg.remat`` (``sharding.choose_mesh.saved_per_layer``: counted from the shapes;
    ``tokens`` per device): the block input, the attention output and lse, the MLP's
    gate and up projections, as the policy saves them.  ``None`` for ``remat="none"``
    (everything is kept)."""
    return None if cfg.remat == "none" else saved_per_layer(cfg, cfg.remat, 1, tokens)


def memory_account(step, state, batch, cfg, G, S, state_bytes, params_bytes,
                   opt_memory="device", layer_bytes=None) -> dict:
    """The counted account (GiB per device) and XLA's account of the compiled step.
    ``layer_bytes``: ``layer_param_bytes`` (one block's parameters, either form)."""
    gib = 2 ** 30
    per = residual_bytes(cfg, S // G)
    where = "host" if cfg.remat_offload else "device"
    acc = dict(params=params_bytes / gib, optimizer_state=(state_bytes - params_bytes) / gib,
               scan_layers=cfg.scan_layers,
               params_per_layer=None if layer_bytes is None else layer_bytes[0] / gib,
               params_per_layer_gathered=None if layer_bytes is None else layer_bytes[1] / gib,
               optimizer_state_where="host" if opt_memory != "device" else "device",
               gradients_if_all_live=params_bytes / gib, residuals_where=where,
               residuals_per_layer={k: v / gib for k, v in (per or {}).items()},
               residuals=(None if per is None else cfg.num_layers * sum(per.values()) / gib))
    try:
        compiled = step.lower(state, batch).compile()
        m = compiled.memory_analysis()
        # buffers XLA placed in host memory (memory space 5 on GPUs): zero means nothing
        # was offloaded, whatever the policy asked
        acc["xla_host_buffers"] = compiled.as_text().count("S(5)")
        acc["xla"] = {k: getattr(m, k) / gib for k in dir(m)
                      if k.endswith("_in_bytes") and isinstance(getattr(m, k), int)}
        x = acc["xla"]
        acc["xla_device_peak_estimate"] = (x["argument_size_in_bytes"]
                                           + x["output_size_in_bytes"]
                                           - x["alias_size_in_bytes"]
                                           + x["temp_size_in_bytes"])
    except Exception as e:  # memory_analysis is best-effort per backend
        acc["xla_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return acc


def print_account(acc: dict, peak_gib) -> None:
    r = acc["residuals"]
    layer = ("" if acc.get("params_per_layer") is None else
             f" ({acc['params_per_layer'] * 1024:.1f} MiB per layer, "
             f"{acc['params_per_layer_gathered'] * 1024:.1f} MiB gathered"
             + (", stacked" if acc.get("scan_layers") else "") + ")")
    print(f"     memory (GiB/device): params {acc['params']:.2f}{layer}, optimizer state "
          f"{acc['optimizer_state']:.2f} on the {acc['optimizer_state_where']}, gradients "
          f"(if all live) "
          f"{acc['gradients_if_all_live']:.2f}, residuals "
          + ("all (remat none)" if r is None else f"{r:.2f} on the {acc['residuals_where']} "
             + "(" + ", ".join(f"{k} {v * 1024:.0f} MiB" for k, v in
                               acc["residuals_per_layer"].items()) + " per layer)"),
          flush=True)
    if "xla" in acc:
        x = acc["xla"]
        print(f"     XLA: arguments {x['argument_size_in_bytes']:.2f}, outputs "
              f"{x['output_size_in_bytes']:.2f}, aliased {x['alias_size_in_bytes']:.2f}, "
              f"temporaries {x['temp_size_in_bytes']:.2f}, host temporaries "
              f"{x.get('host_temp_size_in_bytes', 0.0):.2f}; device estimate "
              f"{acc['xla_device_peak_estimate']:.2f} GiB"
              + (f" vs measured peak {peak_gib:.2f} GiB" if peak_gib else "")
              + f"; {acc.get('xla_host_buffers', 0)} host-memory buffers in the program",
              flush=True)
    elif "xla_error" in acc:
        print(f"     XLA memory analysis unavailable: {acc['xla_error']}", flush=True)


def host_peak_gib() -> float:
    """The process's peak resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def measure(size, G, S, *, dtype, remat, params_mode, steps, peak, rate, packed=None,
            account=False, profile=None, opt_memory="device", mesh_sizes=None,
            scan_layers=False, rows=None, predicted=None, kernel="auto"):
    """One row per batch kind (``unpacked``; with ``packed``, ``packed`` first): each
    compiled and run once, then ``steps`` timed steps of each, alternating.
    ``predicted``: ``choose_mesh``'s numbers for this mesh, copied into the row."""
    step, state, batches, cfg, (state_bytes, params_bytes, layer_bytes), lengths = build(
        size, G, S, dtype=dtype, remat=remat, params_mode=params_mode, packed=packed,
        opt_memory=opt_memory, mesh_sizes=mesh_sizes, scan_layers=scan_layers, rows=rows,
        kernel=kernel)
    B = batch_rows(mesh_sizes, rows)
    acc = (memory_account(step, state, next(iter(batches.values())), cfg, G, S, state_bytes,
                          params_bytes, opt_memory, layer_bytes) if account else None)
    if acc is not None:  # before running: a step that runs out of memory still shows it
        print(f"{size} G={G} S={S} remat {remat}:", flush=True)
        print_account(acc, None)
    first, ts, losses = {}, {k: [] for k in batches}, {k: [] for k in batches}
    for kind, batch in batches.items():
        t0 = time.perf_counter()
        state, metrics = step(state, batch)  # compile + first step
        losses[kind].append(float(metrics["loss"]))
        first[kind] = time.perf_counter() - t0
    for _ in range(steps):
        for kind, batch in batches.items():
            t0 = time.perf_counter()
            state, metrics = step(state, batch)
            losses[kind].append(float(metrics["loss"]))  # synchronises
            ts[kind].append(time.perf_counter() - t0)
    mem = [peak_memory_bytes(d) for d in jax.devices()[:G]]
    prof = None
    if profile:
        from _profile import print_summary, profile_call
        kind, batch = next(iter(batches.items()))
        holder = {"state": state}

        def one():
            holder["state"], m = step(holder["state"], batch)
            float(m["loss"])
        try:
            prof = profile_call(one, os.path.join(profile, f"{size}_G{G}_S{S}_{remat}"))
            print_summary(prof, f"{size} G={G} S={S} {remat} {kind}")
        except Exception as e:
            prof = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            print(f"profile: FAILED {prof['error']}", flush=True)
        state = holder["state"]
    rows = []
    for kind in batches:
        t = float(np.median(ts[kind]))
        fl = flops_per_token(cfg, S, documents=lengths if kind == "packed" else None)
        tgs = B * S / t / G
        row = dict(size=size, G=G, S=S, batch_rows=B, tokens_per_gpu=B * S // G,
                   mesh=mesh_sizes or "one axis",
                   params_mode="logical" if mesh_sizes and params_mode == "fsdp" else params_mode,
                   remat=remat, dtype=dtype, batch=kind, step_s=t, step_times_s=ts[kind],
                   first_step_s=first[kind], tgs=tgs, flops_per_token=fl["total"],
                   attention_flops_share=fl["attention"] / fl["total"],
                   n_matmul_params=fl["n_matmul"], losses=losses[kind],
                   state_gib_per_device=state_bytes / 2 ** 30, host_peak_gib=host_peak_gib(),
                   remat_offload=cfg.remat_offload, opt_memory=opt_memory,
                   scan_layers=cfg.scan_layers,
                   peak_gib=(max(m for m in mem if m is not None) / 2 ** 30
                             if any(m is not None for m in mem) else None))
        if predicted is not None:
            row["choose_mesh"] = predicted
        if acc is not None:
            row["memory_account"] = acc
        if prof is not None and kind == next(iter(batches)):
            row["profile"] = prof
        if kind == "packed":
            row.update(documents=int(len(lengths)), median_document=packed,
                       document_lengths=[int(n) for n in lengths],
                       within_document_pairs=float((lengths.astype(np.float64) ** 2).sum()
                                                   / float(S) ** 2))
        if peak:
            row["mfu"] = tgs * fl["total"] / peak
        if rate:
            row["mfu_vs_matmul"] = tgs * fl["total"] / rate
        label = "" if packed is None else f"{kind:8s} "
        where = "" if mesh_sizes is None else f"mesh {mesh_label(mesh_sizes)} "
        where += "scan " if cfg.scan_layers else ""
        print(f"{size:4s} G={G} S={S:7d} {where}{row['params_mode']:10s} {label}remat {remat}: step {t:8.3f} s  "
              f"TGS {tgs:9.1f}  "
              + (f"MFU {100 * row['mfu']:5.1f}%  " if peak else "")
              + (f"(of measured matmul {100 * row['mfu_vs_matmul']:5.1f}%)  " if rate else "")
              + f"attention {100 * row['attention_flops_share']:4.1f}% of FLOPs  "
              + f"state {row['state_gib_per_device']:.2f} GiB/dev  peak "
              + (f"{row['peak_gib']:.1f} GiB" if row["peak_gib"] is not None else "n/a")
              + f"  host peak {row['host_peak_gib']:.1f} GiB"
              + f"  loss {losses[kind][0]:.3f} -> {losses[kind][-1]:.3f}", flush=True)
        if kind == "packed":
            print(f"     packed: {len(lengths)} documents (median {np.median(lengths):.0f}, "
                  f"longest {lengths.max()}); within-document pairs "
                  f"{100 * row['within_document_pairs']:.1f}% of the causal S^2/2",
                  flush=True)
        if acc is not None and kind == next(iter(batches)) and row["peak_gib"]:
            print(f"     measured peak {row['peak_gib']:.2f} GiB against XLA's estimate "
                  f"{acc.get('xla_device_peak_estimate', float('nan')):.2f} GiB", flush=True)
        rows.append(row)
    return rows


def table(rows):
    kinds = any(r.get("batch") == "packed" for r in rows)
    meshes = any(isinstance(r.get("mesh"), dict) for r in rows)
    print(f"\n{'size':4s} {'G':>2s} {'S':>8s} {'B':>2s} {'params':10s} {'remat':22s} "
          + (f"{'mesh':22s} " if meshes else "")
          + (f"{'batch':8s} " if kinds else "")
          + f"{'step s':>8s} {'TGS':>9s} {'MFU%':>6s} {'peak GiB':>8s}"
          + (f" {'model s':>8s} {'model GiB':>9s}" if meshes else ""))
    for r in rows:
        pred = r.get("choose_mesh") or {}
        label = mesh_label(r["mesh"]) if isinstance(r.get("mesh"), dict) else "one axis"
        print(f"{r['size']:4s} {r['G']:2d} {r['S']:8d} {r['batch_rows']:2d} "
              f"{r['params_mode']:10s} {r['remat']:22s} "
              + (f"{label + ('*' if pred.get('picked') else ''):22s} " if meshes else "")
              + (f"{r['batch']:8s} " if kinds else "")
              + f"{r['step_s']:8.3f} {r['tgs']:9.1f} {100 * r.get('mfu', float('nan')):6.1f} "
              f"{r['peak_gib'] if r['peak_gib'] is not None else float('nan'):8.1f}"
              + (f" {pred.get('step_s') or float('nan'):8.3f}"
                 f" {pred.get('memory_gib') or float('nan'):9.1f}" if meshes else ""))
    if meshes:
        print("(* choose_mesh's pick for that row's size, length and batch; model s / GiB: "
              "its modeled step and memory per device)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--sizes", default=None, help=f"comma-separated, of {sorted(SIZES)}")
    p.add_argument("--devices", default=None, help="device counts, comma-separated")
    p.add_argument("--tokens-per-gpu", default=None, help="comma-separated")
    p.add_argument("--seq", default=None,
                   help="total sequence lengths (instead of --tokens-per-gpu), comma-separated; "
                        "with --batch, each sequence's length")
    p.add_argument("--batch", type=int, default=None, metavar="ROWS",
                   help="sequences per step, each of --seq tokens, on every mesh (a multiple "
                        "of data x fsdp): the same work per step whatever the mesh; default "
                        "one per data x fsdp shard, the --seq tokens split among them")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new row after this many seconds (the row is recorded as "
                        "skipped)")
    p.add_argument("--params", default="fsdp", choices=("fsdp", "replicated"))
    p.add_argument("--remat", default=None,
                   help=f"comma-separated entries, each one of {REMAT_MODES}, optionally "
                        f"with +offload (one row per entry)")
    p.add_argument("--opt-memory", default="device", choices=OPT_MEMORY,
                   help="where the optimizer state lives between steps "
                        "(abstract_train_state(opt_memory=...))")
    p.add_argument("--memory-account", action="store_true",
                   help="print the counted and XLA's memory account per row (compiles the "
                        "step once more)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="trace one more step per row into DIR and print kernel time by "
                        "category")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--mesh", default=None,
                   help="';'-separated meshes, one row each: 'none' (the one-axis model), "
                        "'data=..,fsdp=..,sequence=..,tensor=..' (sizes multiplying to the "
                        "device count; data x fsdp rows per step) or 'auto' "
                        "(sharding.choose_mesh for an H200 node)")
    p.add_argument("--scan-layers", action="store_true",
                   help="the decoder blocks as one loop over stacked parameters "
                        "(LlamaConfig(scan_layers=True)): XLA compiles one block, not one "
                        "per layer")
    p.add_argument("--tag", default=None,
                   help="appended to the JSON's name (one file per process, e.g. one mesh "
                        "each: a process's peak memory is its own)")
    add_compile_cache_args(p)  # --compile-cache DIR / --no-compile-cache
    p.add_argument("--kernel", default="auto",
                   help="the attention backend (jax_seqpar.attention's kernel=), e.g. cudnn "
                        "or pallas_mgpu against auto's pick in another process")
    p.add_argument("--packed", type=int, default=None, metavar="MEDIAN_LEN",
                   help="also time a packed step: documents with log-normal lengths of this "
                        "median, segment ids and per-document positions, alternating with "
                        "the unpacked step on the same tokens (module docstring)")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    if args.batch is not None and (args.batch < 1 or not args.seq):
        p.error(f"--batch={args.batch} must be positive and needs --seq (each row's length)")
    if args.packed is not None and args.packed < 1:
        p.error(f"--packed={args.packed} must be a positive median document length")
    compile_cache_from_args(args)  # rows run again with the same shapes: no compile
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
    if args.steps is not None:
        cfg["steps"] = args.steps
    remats = args.remat.split(",") if args.remat else [cfg["remat"]]
    for entry in remats:
        try:
            parse_remat(entry)
        except ValueError as e:
            p.error(str(e))
    cfg["remat"] = remats
    counts = [G for G in cfg["devices"] if G <= jax.device_count()]
    if not counts:
        p.error(f"--devices: none of {cfg['devices']} fits the {jax.device_count()} devices")
    info = env_info()
    rate = matmul_rate() if jax.default_backend() == "gpu" else None
    print(f"# {info}\n# preset {name}: {cfg}"
          + (f"\n# XLA_FLAGS={os.environ['XLA_FLAGS']}" if os.environ.get("XLA_FLAGS") else "")
          + (f"\n# bf16 matmul 8192^3: {rate / 1e12:.0f} TFLOP/s" if rate else ""), flush=True)
    result = dict(env=info, preset=name, config=cfg, matmul_flops=rate, rows=[],
                  mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
                  xla_flags=os.environ.get("XLA_FLAGS"))
    cfg["packed"] = args.packed
    cfg["scan_layers"] = args.scan_layers
    cfg["batch"] = args.batch
    cfg["kernel"] = args.kernel
    path = os.path.join(out_dir(), f"train_mfu_{name}"
                        + (f"_packed{args.packed}" if args.packed else "")
                        + ("_scan" if args.scan_layers else "")
                        + (f"_{args.tag}" if args.tag else "") + ".json")
    meshes = args.mesh.split(";") if args.mesh else ["none"]
    plan = [(size, G, S, remat, mesh) for size in cfg["sizes"] for G in counts
            for S in ([int(x) for x in args.seq.split(",")] if args.seq
                      else [t * G for t in cfg["tokens_per_gpu"]])
            for remat in cfg["remat"] for mesh in meshes]
    for size, G, S, remat, mesh in plan:
        if mesh.strip() not in ("none", "auto") and math.prod(
                parse_mesh_arg(mesh).values()) != G:
            continue  # a mesh of another device count: not this row
        if args.budget_s is not None and time.perf_counter() - t_start > args.budget_s:
            print(f"{size} G={G} S={S} remat {remat} mesh {mesh}: skipped (--budget-s "
                  f"{args.budget_s:g} spent)", flush=True)
            result["rows"].append(dict(size=size, G=G, S=S, remat=remat, mesh=mesh,
                                       error="skipped: --budget-s spent"))
            continue
        predicted = None
        try:
            sizes = mesh_arg(mesh, size, G, S, remat, rows=args.batch, dtype=cfg["dtype"],
                             scan_layers=args.scan_layers)
            if args.batch is None:  # --seq / tokens per step, split into data x fsdp rows
                n = batch_rows(sizes)
                if S % n:
                    raise ValueError(f"{S} tokens per step do not divide into {n} rows")
                S_row = S // n
            else:
                S_row = S
            if sizes is not None:
                memory = device_memory()
                try:
                    predicted = predicted_for(mesh_choice(
                        size, G, S_row, remat, rows=batch_rows(sizes, args.batch),
                        dtype=cfg["dtype"], scan_layers=args.scan_layers,
                        memory=memory), sizes)
                    predicted["memory"] = memory
                except ValueError as e:  # no mesh fits this GPU's memory
                    predicted = dict(pick=None, error=str(e), memory=memory)
                    print(f"# choose_mesh for {mesh_label(sizes)}: {e}", flush=True)
            if predicted is not None and predicted.get("pick") is not None:
                print(f"# choose_mesh for {mesh_label(sizes)}: modeled "
                      + ("-" if predicted["step_s"] is None else f"{predicted['step_s']:.3g} s")
                      + (f", {predicted['memory_gib']:.1f} GiB"
                         if predicted["memory_gib"] is not None else "")
                      + f"; picks {mesh_label(predicted['pick'])}"
                      + (f" ({predicted['skipped']})" if predicted["skipped"] else ""),
                      flush=True)
            result["rows"].extend(measure(size, G, S_row, dtype=cfg["dtype"],
                                          remat=remat, params_mode=args.params,
                                          steps=cfg["steps"], peak=cfg["peak"], rate=rate,
                                          packed=args.packed, account=args.memory_account,
                                          profile=args.profile, opt_memory=args.opt_memory,
                                          mesh_sizes=sizes, scan_layers=args.scan_layers,
                                          rows=args.batch, predicted=predicted,
                                          kernel=args.kernel))
        except Exception as e:  # e.g. out of memory: record and go on
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            print(f"{size} G={G} S={S} remat {remat} mesh {mesh}: FAILED {msg}", flush=True)
            result["rows"].append(dict(size=size, G=G, S=S, params_mode=args.params,
                                       remat=remat, mesh=mesh, error=msg,
                                       choose_mesh=predicted))
        result["compile_cache"] = compile_cache_stats()
        save_json(result, path)
    table([r for r in result["rows"] if "error" not in r])
    print(f"# {compile_cache_summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
