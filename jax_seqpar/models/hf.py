"""Hugging Face checkpoints in and out of ``models.Llama``: Llama (2, 3, 3.1, 3.2), Mistral,
Qwen2.

    cfg, params = load_pretrained("path/to/Llama-3.1-8B", mesh=mesh, dtype="bfloat16")
    model = Llama(cfg, mesh=mesh, layout="zigzag")
    logits = jax.jit(model.apply)(params, tokens)
    save_pretrained(cfg, params, "out/")            # transformers' from_pretrained reads it

``load_pretrained`` reads ``config.json`` (``LlamaConfig.from_hf``: every field it
cannot map raises a ``ValueError`` naming it) and the weights from ``model.safetensors``
or the shards listed in ``model.safetensors.index.json``.  It is **streamed**: one tensor
at a time, each device's slice read from a memory map of that tensor alone
(``safetensors_io.read_slice``) in the stored layout and placed by
``jax.make_array_from_callback``, then transposed and converted on the devices, each
device its own slice, onto the parameter's sharding: ``jax_seqpar.sharding.fsdp``'s
(``params="fsdp"``), replicated over the mesh (``"replicated"``), or the first device
(``mesh=None``).  So the host holds about one tensor beyond what it already held, and no
device ever holds more of a sharded tensor than its own slice.  Weights are converted to
``param_dtype`` on the devices.

How transformers' tensors become the model's parameters (``tensor_map``): every linear
weight ``W [out, in]`` is transposed (Flax kernels are ``[in, out]``); q/k/v kernels are
``W.T.reshape(d, H, Dh)`` and their Qwen2 biases ``b.reshape(H, Dh)``, the output
projection is ``W.T.reshape(H, Dh, d)``; embeddings, norms and the other biases as they
are.  With ``tie_word_embeddings`` there is no ``lm_head`` (a stored ``lm_head.weight``
is skipped, as transformers overwrites it with the embedding); ``rotary_emb.inv_freq``
buffers of older checkpoints are skipped (recomputed from the config).  A missing,
unexpected or misshapen tensor raises a ``ValueError`` naming it, its file and the
config fields that set its shape.

A llama.cpp ``.gguf`` file is one more source (``models.gguf``: ``load_pretrained`` of a
``.gguf`` path is ``gguf.load_gguf``): its config comes from the metadata, its tensors
are ``gguf.GGUFTensor``s (dequantized, q/k rows un-permuted, then sliced like a
safetensors tensor), checked and placed by the same code (``models.param_stream``).

``save_pretrained`` writes ``config.json`` (``hf_config.config_to_hf``) and safetensors
shards in transformers' names, each tensor gathered to the host on its own (all
processes take part in the gather; only process 0 writes).

Scanned layers (``scan_layers=True``, ``models.stacking``): the checkpoint keeps one tensor
per layer (``model.layers.{i}....``), the model one ``[num_layers, ...]`` parameter under
``layers`` per block parameter.  ``load_pretrained(..., scan_layers=True)`` builds each
stacked parameter directly on its sharding, still one parameter at a time: for each
device's slice of the stacked array (``_read_stacked``), that slice of every layer's
tensor is read from the file into its slot of the slice, layer after layer (every
slice's part of one layer, then the next layer: a GGUF layer is dequantized once), and
``jax.make_array_from_callback`` hands the slices to the devices (no device's slice holds
more than its part of each layer, and no device ever holds the whole stack unless its
sharding says so); then the transpose /
conversion on the devices, with the permutation moved one axis right (the layer axis
stays first and is never split).  As for every parameter, the slices of this process's
devices are on the host together until ``make_array_from_callback`` puts them on the
devices: for a stacked parameter that is this process's share of all its layers.
``tensor_map`` stays per layer: it is the name mapping of either form.
``save_pretrained`` takes either form (``stacking.is_scanned``); of a stacked parameter
it gathers one layer at a time (a jitted ``x[i]``, then the same gather to the host), so
the files are those the unrolled parameters give, byte for byte.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
from typing import Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict
from jax.sharding import Mesh

from jax_seqpar.runtime import distributed
from jax_seqpar.models import stacking
from jax_seqpar.models.hf_config import ARCHITECTURES, config_to_hf, read_generation_config
from jax_seqpar.models.llama import LAYERS, LlamaConfig
from jax_seqpar.models.param_stream import (  # noqa: F401 (re-exported)
    PARAMS_MODES, Entry, Param, _load_params, param_plan, tensor_map)
from jax_seqpar.models.safetensors_io import (TensorInfo, parse_size, plan_shards, read_header,
                                              write_file)

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_LAYER_KEY = re.compile(r"^layer_(\d+)$")


def config_from_hf(hf: dict, *, ignore=(), **overrides) -> LlamaConfig:
    """``LlamaConfig.from_hf``: the config of a transformers ``config.json`` dict."""
    return LlamaConfig.from_hf(hf, ignore=ignore, **overrides)


# --------------------------------------------------------------------------- reading
def checkpoint_tensors(path: str) -> Dict[str, TensorInfo]:
    """``{name: TensorInfo}`` of a checkpoint directory: ``model.safetensors``, or the
    shards that ``model.safetensors.index.json`` lists (every tensor of every listed file
    is returned, listed or not, so that unexpected ones are seen)."""
    index, single = os.path.join(path, INDEX), os.path.join(path, WEIGHTS)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' dict")
        tensors: Dict[str, TensorInfo] = {}
        for file in sorted(set(weight_map.values())):
            infos, _ = read_header(os.path.join(path, file))
            for name, info in infos.items():
                if name in tensors:
                    raise ValueError(f"tensor {name} is stored twice: in "
                                     f"{os.path.basename(tensors[name].file)} and {file}")
                tensors[name] = info
        for name, file in weight_map.items():
            if name not in tensors or os.path.basename(tensors[name].file) != file:
                raise ValueError(f"{index} lists tensor {name} in {file}, which does not "
                                 f"hold it")
        return tensors
    if os.path.exists(single):
        return read_header(single)[0]
    raise ValueError(f"{path}: neither {WEIGHTS} nor {INDEX} found (only safetensors "
                     f"checkpoints are read; convert pytorch_model.bin with transformers' "
                     f"save_pretrained(safe_serialization=True))")


def load_pretrained(path, *, mesh: Optional[Mesh] = None, axis_name: str = "sp",
                    dtype: str = "bfloat16", param_dtype: str = "float32",
                    params: str = "fsdp", ignore_fields=(), parallelism=None,
                    **config_overrides):
    """``(LlamaConfig, params)`` from a transformers checkpoint directory, or from a
    llama.cpp ``.gguf`` file (``gguf.load_gguf``, the same keyword arguments).

    ``dtype`` / ``param_dtype``: the model's activation and parameter dtypes (the weights
    are converted to ``param_dtype`` as they are read).  ``params``: ``"fsdp"`` places
    every tensor on ``fsdp.fsdp_shardings`` over ``mesh[axis_name]``, ``"replicated"``
    replicates it over the mesh; ``mesh=None``: the first device.  ``config_overrides``
    are ``LlamaConfig`` fields (``rope_theta=..., rope_scaling=...`` for context
    extension, ``remat=...``); ``ignore_fields``: config.json fields known not to change
    the model, accepted unread.  ``params`` is ``{"params": ...}`` as ``Llama.init``
    returns it.  ``parallelism`` (a ``sharding.Parallelism`` of ``mesh``): every tensor
    goes onto the sharding that ``Llama(config, mesh=mesh, parallelism=parallelism)``
    gives it by its logical names (``Llama.param_shardings``; still one tensor at a
    time, each device reading only its slice) instead of the one-axis ``params`` modes.

    ``scan_layers=True`` (a config override) returns the scanned form
    (``params["params"]["layers"]``, every leaf ``[num_layers, ...]``), each stacked
    parameter read layer by layer into its slot on its sharding (the module docstring);
    the layer axis is never split.
    """
    path = os.fspath(path)
    if path.endswith(".gguf") and not os.path.isdir(path):   # a llama.cpp file
        from jax_seqpar.models.gguf import load_gguf

        return load_gguf(path, mesh=mesh, axis_name=axis_name, dtype=dtype,
                         param_dtype=param_dtype, params=params, ignore_fields=ignore_fields,
                         parallelism=parallelism, **config_overrides)
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise ValueError(f"{path}: no config.json (give a directory written by "
                         f"transformers' save_pretrained)")
    with open(cfg_file) as f:
        hf = json.load(f)
    # generation_config.json's token ids (where present) win, as in transformers' generate
    cfg = config_from_hf(hf, ignore=ignore_fields, generation_config=read_generation_config(path),
                         dtype=dtype, param_dtype=param_dtype, **config_overrides)
    arch = hf.get("architectures", ["?"])[0] if hf.get("architectures") else hf["model_type"]
    tensors = checkpoint_tensors(path)
    return cfg, _load_params(cfg, tensors, arch, mesh=mesh, axis_name=axis_name,
                             params=params, parallelism=parallelism)


# --------------------------------------------------------------------------- writing
def _to_host(x) -> np.ndarray:
    """The whole array on the host (all processes must call it for a multi-process one)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return distributed.to_host(x)
    return np.asarray(jax.device_get(x))


@jax.jit
def _layer_of(x, i):
    """``x[i]`` of a stacked parameter, on the devices that hold ``x`` (one layer's
    slice: what ``_to_host`` then gathers, instead of the whole stack)."""
    return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def save_pretrained(config, params, path, *, max_shard_size="5GB", dtype=None,
                    architecture: Optional[str] = None, extra_config: Optional[dict] = None
                    ) -> None:
    """Write ``config.json`` and safetensors weights that transformers'
    ``from_pretrained`` loads (``model.safetensors``, or shards of at most
    ``max_shard_size`` with ``model.safetensors.index.json``).

    ``params``: ``{"params": ...}`` or the inner tree, any sharding, unrolled or scanned
    (``models.stacking``: whichever ``params`` holds, whatever ``config.scan_layers``
    says); each tensor is gathered to the host on its own and written at once -- of a
    stacked parameter, one layer's slice at a time.  ``dtype``: the stored dtype
    (default ``config.param_dtype``).  ``architecture``: see ``LlamaConfig.to_hf``.
    ``extra_config``: more ``config.json`` fields (e.g. ``bos_token_id``,
    ``eos_token_id``).  Earlier ``model*.safetensors`` files and the index in ``path`` are
    removed first.  Only process 0 writes; every process must call it.
    """
    path = os.fspath(path)
    tree = params["params"] if isinstance(params, dict) and "params" in params else params
    flat = flatten_dict(tree)
    tmap = tensor_map(config)
    plan = param_plan(config, scanned=stacking.is_scanned(tree))
    for key in flat:
        if key not in plan:
            raise ValueError(f"parameter {'/'.join(key)} is not a parameter of "
                             f"Llama(config); check the config's biases / tie_embeddings"
                             + (" (a tree holds either layer_i or layers, not both)"
                                if key[0] == LAYERS or _LAYER_KEY.match(key[0]) else ""))
    for key, p in plan.items():
        if key not in flat:
            raise ValueError(f"parameter {'/'.join(key)} ({p.names}) is missing")
        if tuple(flat[key].shape) != p.shape:
            raise ValueError(f"parameter {'/'.join(key)} has shape {tuple(flat[key].shape)}; "
                             f"the config gives {p.shape}"
                             + (f" (num_layers={config.num_layers} stacked layers of "
                                f"{p.entries[0].shape})" if p.stacked else ""))
    save_dt = np.dtype(jnp.dtype(dtype or config.param_dtype))
    hf = config_to_hf(config, architecture)
    hf["dtype"] = jnp.dtype(save_dt).name
    hf.update(extra_config or {})
    by_name = {e.hf_name: (k, i if p.stacked else None, e)
               for k, p in plan.items() for i, e in enumerate(p.entries)}
    sizes = [(e.hf_name, math.prod(e.hf_shape) * save_dt.itemsize) for e in tmap.values()]
    groups = plan_shards(sizes, parse_size(max_shard_size))
    files = ([WEIGHTS] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    writer = jax.process_index() == 0
    if writer:
        os.makedirs(path, exist_ok=True)
        for old in glob.glob(os.path.join(path, "model*.safetensors")) + [
                os.path.join(path, INDEX)]:
            if os.path.exists(old):
                os.remove(old)

    def produce(name):
        key, layer, e = by_name[name]
        x = _to_host(flat[key] if layer is None else _layer_of(flat[key], layer))
        inverse = tuple(int(i) for i in np.argsort(e.perm))
        return np.ascontiguousarray(x.transpose(inverse).reshape(e.hf_shape).astype(save_dt))

    for file, group in zip(files, groups):
        entries = [(n, save_dt, by_name[n][2].hf_shape) for n in group]
        if writer:
            write_file(os.path.join(path, file), entries, produce, {"format": "pt"})
        else:
            for n in group:
                produce(n)
    if writer:
        if len(files) > 1:
            index = {"metadata": {"total_size": sum(s for _, s in sizes)},
                     "weight_map": {n: f for f, g in zip(files, groups) for n in g}}
            with open(os.path.join(path, INDEX), "w") as f:
                json.dump(index, f, indent=2)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(hf, f, indent=2, sort_keys=True)
    distributed.barrier("jax_seqpar.save_pretrained")  # the files exist for every process


__all__ = ["ARCHITECTURES", "Entry", "Param", "checkpoint_tensors", "config_from_hf",
           "config_to_hf", "load_pretrained", "param_plan", "save_pretrained", "tensor_map"]
