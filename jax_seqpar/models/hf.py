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
safetensors tensor, ``_read``), checked and placed by the same code (``_load_params``).

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

import functools
import glob
import json
import math
import os
import re
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from jax_seqpar.runtime import distributed
from jax_seqpar.sharding.fsdp import fsdp_shardings, replicated_shardings
from jax_seqpar.models import stacking
from jax_seqpar.models.hf_config import ARCHITECTURES, config_to_hf, read_generation_config
from jax_seqpar.models.llama import LAYERS, LlamaConfig
from jax_seqpar.models.safetensors_io import (DTYPES, TensorInfo, parse_size, plan_shards,
                                              read_header, read_slice, write_file)

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
PARAMS_MODES = ("fsdp", "replicated")
_SKIPPED = re.compile(r".*rotary_emb\.inv_freq$")
_LAYER_KEY = re.compile(r"^layer_(\d+)$")


def config_from_hf(hf: dict, *, ignore=(), **overrides) -> LlamaConfig:
    """``LlamaConfig.from_hf``: the config of a transformers ``config.json`` dict."""
    return LlamaConfig.from_hf(hf, ignore=ignore, **overrides)


class Entry(NamedTuple):
    """One parameter: transformers' name and shape; ``param = W.reshape(view).transpose(perm)``."""
    hf_name: str
    hf_shape: Tuple[int, ...]
    view: Tuple[int, ...]
    perm: Tuple[int, ...]
    fields: str  # the config.json fields that set its shape

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.view[p] for p in self.perm)


def tensor_map(cfg) -> Dict[Tuple[str, ...], Entry]:
    """``{parameter path: Entry}`` for every parameter of ``Llama(cfg)``, in checkpoint
    order: the paths of the unrolled form's ``model.init(...)["params"]``, flattened
    (``layer_i/...``), whatever ``cfg.scan_layers`` says -- one entry per checkpoint
    tensor.  ``param_plan`` groups them into the scanned form's stacked parameters."""
    d, V, F = cfg.d_model, cfg.vocab_size, cfg.ffn_dim
    H, Hkv, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    out: Dict[Tuple[str, ...], Entry] = {}

    def linear(path, name, n_out, n_in, fields):      # W [out, in] -> kernel [in, out]
        out[tuple(path.split("/"))] = Entry(name, (n_out, n_in), (n_out, n_in), (1, 0), fields)

    def same(path, name, shape, fields):
        out[tuple(path.split("/"))] = Entry(name, tuple(shape), tuple(shape),
                                            tuple(range(len(shape))), fields)

    same("embed/embedding", "model.embed_tokens.weight", (V, d), "vocab_size, hidden_size")
    for i in range(cfg.num_layers):
        p, n = f"layer_{i}", f"model.layers.{i}"
        same(f"{p}/attn_norm/scale", f"{n}.input_layernorm.weight", (d,), "hidden_size")
        for proj, heads, hf in (("q", H, "num_attention_heads"), ("k", Hkv, "num_key_value_heads"),
                                ("v", Hkv, "num_key_value_heads")):
            fields = f"{hf}, head_dim, hidden_size"
            out[(p, "attn", f"{proj}_proj", "kernel")] = Entry(
                f"{n}.self_attn.{proj}_proj.weight", (heads * Dh, d), (heads, Dh, d), (2, 0, 1),
                fields)
            if cfg.attention_bias:
                out[(p, "attn", f"{proj}_proj", "bias")] = Entry(
                    f"{n}.self_attn.{proj}_proj.bias", (heads * Dh,), (heads, Dh), (0, 1),
                    f"{hf}, head_dim")
        out[(p, "attn", "o_proj", "kernel")] = Entry(
            f"{n}.self_attn.o_proj.weight", (d, H * Dh), (d, H, Dh), (1, 2, 0),
            "hidden_size, num_attention_heads, head_dim")
        if cfg.attention_out_bias:
            same(f"{p}/attn/o_proj/bias", f"{n}.self_attn.o_proj.bias", (d,), "hidden_size")
        same(f"{p}/mlp_norm/scale", f"{n}.post_attention_layernorm.weight", (d,), "hidden_size")
        for proj, n_out, n_in in (("gate", F, d), ("up", F, d), ("down", d, F)):
            linear(f"{p}/mlp/{proj}_proj/kernel", f"{n}.mlp.{proj}_proj.weight", n_out, n_in,
                   "intermediate_size, hidden_size")
            if cfg.mlp_bias:
                same(f"{p}/mlp/{proj}_proj/bias", f"{n}.mlp.{proj}_proj.bias", (n_out,),
                     "intermediate_size" if n_out == F else "hidden_size")
    same("final_norm/scale", "model.norm.weight", (d,), "hidden_size")
    if not cfg.tie_embeddings:
        linear("lm_head/kernel", "lm_head.weight", V, d, "vocab_size, hidden_size")
    return out


class Param(NamedTuple):
    """One parameter of the model's form: its checkpoint tensors (one, or with
    ``stacked`` the ``num_layers`` tensors of layers ``0 .. L-1``, stacked on a new
    leading axis: ``param[i] = entries[i]``'s parameter)."""
    entries: Tuple[Entry, ...]
    stacked: bool

    @property
    def view(self) -> Tuple[int, ...]:
        """The stored layout (``Entry.view``), with the layer axis first if stacked."""
        e = self.entries[0]
        return (len(self.entries),) + e.view if self.stacked else e.view

    @property
    def perm(self) -> Tuple[int, ...]:
        """``param = view.transpose(perm)``: ``Entry.perm`` moved past the layer axis."""
        e = self.entries[0]
        return (0,) + tuple(p + 1 for p in e.perm) if self.stacked else e.perm

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.view[p] for p in self.perm)

    @property
    def names(self) -> str:
        """The checkpoint tensors, for messages."""
        first, last = self.entries[0].hf_name, self.entries[-1].hf_name
        return first if first == last else f"{first} .. {last}"


def param_plan(cfg, scanned: Optional[bool] = None) -> Dict[Tuple[str, ...], Param]:
    """``{parameter path: Param}`` of ``Llama(cfg)``'s parameters in the unrolled
    (``scanned=False``: ``tensor_map`` one to one) or the scanned form (every
    ``layer_i/rest`` of ``tensor_map`` becomes ``layers/rest``, stacked in layer order);
    ``scanned=None``: ``cfg.scan_layers``."""
    scanned = cfg.scan_layers if scanned is None else scanned
    out: Dict[Tuple[str, ...], Param] = {}
    for key, e in tensor_map(cfg).items():
        if not (scanned and _LAYER_KEY.match(key[0])):
            out[key] = Param((e,), False)
            continue
        skey = (LAYERS,) + key[1:]   # tensor_map lists the layers in order
        out[skey] = Param((out[skey].entries if skey in out else ()) + (e,), True)
    return out


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


def _hint(name: str, cfg) -> str:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m and int(m.group(1)) >= cfg.num_layers:
        return f"config.json has num_hidden_layers={cfg.num_layers}"
    if name == "lm_head.weight":
        return f"config.json has tie_word_embeddings={str(cfg.tie_embeddings).lower()}"
    if name.endswith(".bias"):
        return ("q/k/v/o biases come from attention_bias (Llama) / Qwen2ForCausalLM, MLP "
                "biases from mlp_bias; config.json's architecture and fields give "
                f"attention_bias={cfg.attention_bias}, attention_out_bias="
                f"{cfg.attention_out_bias}, mlp_bias={cfg.mlp_bias}")
    return "the architecture has no such weight"


def _check(tensors: Dict[str, TensorInfo], tmap, cfg, arch: str) -> None:
    wanted = {e.hf_name: e for e in tmap.values()}
    for name, e in wanted.items():
        if name not in tensors:
            missing = sorted(set(wanted) - set(tensors))
            raise ValueError(f"tensor {name} is missing from the checkpoint ({arch}; "
                             f"{len(missing)} missing: {missing[:4]}{'...' * (len(missing) > 4)}"
                             f"); {_hint(name, cfg)}")
        info = tensors[name]
        if info.shape != e.hf_shape:
            raise ValueError(f"tensor {name} in {os.path.basename(info.file)} has shape "
                             f"{list(info.shape)}; config.json ({e.fields}) gives "
                             f"{list(e.hf_shape)}")
    for name, info in tensors.items():
        if name in wanted or _SKIPPED.match(name) or (cfg.tie_embeddings
                                                       and name == "lm_head.weight"):
            continue
        raise ValueError(f"unexpected tensor {name} in {os.path.basename(info.file)}: "
                         f"{arch} with this config.json has no such weight "
                         f"({_hint(name, cfg)})")


@functools.lru_cache(maxsize=None)
def _relayout(perm, dtype, sharding):
    """Jitted ``transpose(x, perm).astype(dtype)`` onto ``sharding``: each device
    transposes its own slice (the input's sharding is the output's, permuted), no
    communication."""
    return jax.jit(lambda x: jnp.transpose(x, perm).astype(dtype), out_shardings=sharding)


def _source_sharding(sharding, perm):
    """The sharding of the stored (view) layout whose transpose by ``perm`` is ``sharding``."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (len(perm) - len(sharding.spec))
    src = [None] * len(perm)
    for i, p in enumerate(perm):
        src[p] = spec[i]
    return NamedSharding(sharding.mesh, P(*src))


def _read(info, view: Tuple[int, ...], index) -> np.ndarray:
    """``tensor.reshape(view)[index]``: ``read_slice`` of a safetensors tensor; any other
    source (``gguf.GGUFTensor``: ``file``, ``dtype``, ``shape`` like a ``TensorInfo``)
    reads itself (``source.read(view, index)``)."""
    return read_slice(info, view, index) if isinstance(info, TensorInfo) \
        else info.read(view, index)


def _release(infos) -> None:
    """Let sources other than safetensors drop what they hold (a dequantized tensor)."""
    for info in infos:
        if not isinstance(info, TensorInfo):
            info.release()


def _key(index) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)


def _read_stacked(infos: Sequence, view: Tuple[int, ...], indices) -> Dict[tuple, np.ndarray]:
    """``{_key(index): stack([t.reshape(view) for t in tensors])[index]}`` for every
    index of ``indices``: the slice ``index[1:]`` of each layer that ``index[0]`` selects,
    read into its slot of that output, layer after layer (all slices of one layer's
    tensor, then the next layer; never all layers' whole tensors)."""
    jobs = []
    for index in indices:
        index = tuple(index) + (slice(None),) * (len(view) + 1 - len(index))
        layers = range(len(infos))[index[0]]
        shape = (len(layers),) + tuple(len(range(n)[i]) for n, i in zip(view, index[1:]))
        dtypes = {DTYPES[infos[i].dtype] for i in layers}
        out = np.empty(shape, dtypes.pop() if len(dtypes) == 1 else np.result_type(*dtypes))
        jobs.append((_key(index), {i: slot for slot, i in enumerate(layers)}, index[1:], out))
    for i in range(len(infos)):
        for _, slots, rest, out in jobs:
            if i in slots:
                out[slots[i]] = _read(infos[i], view, rest)
        _release(infos[i:i + 1])
    return {key: out for key, _, _, out in jobs}


def _load_tensor(infos: Sequence, p: Param, sharding, dtype) -> jax.Array:
    """One parameter onto ``sharding``: each device's slice read in the stored layout and
    dtype (whole rows of the file; of a stacked parameter, that slice of every layer's
    tensor written into its slot, layer by layer), put on its device, then transposed
    and converted there.  A slice that several devices share is read once."""
    view = p.entries[0].view
    src = _source_sharding(sharding, p.perm)
    if p.stacked:
        slices = _read_stacked(infos, view, {
            _key(i): i for i in src.addressable_devices_indices_map(p.view).values()}.values())
    else:
        slices = {}

    def read(index):
        key = _key(index)
        if key not in slices:
            slices[key] = _read(infos[0], view, index)
        return slices[key]

    x = jax.make_array_from_callback(p.view, src, read)
    _release(infos)
    if p.perm != tuple(range(len(p.perm))) or x.dtype != dtype:
        x = _relayout(p.perm, jnp.dtype(dtype), sharding)(x)
    # wait, so that the host copies of this tensor are freed before the next one is read
    # (host memory stays near one tensor even if reading outpaces the transfers)
    return jax.block_until_ready(x)


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


def _load_params(cfg, tensors: Dict[str, TensorInfo], arch: str, *, mesh, axis_name,
                 params, parallelism) -> dict:
    """``{"params": ...}`` of ``Llama(cfg)`` from ``tensors`` (``{transformers name:
    source}``: safetensors ``TensorInfo``s or other sources, ``_read``), checked against
    ``tensor_map(cfg)`` and placed one parameter at a time (``load_pretrained``)."""
    _check(tensors, tensor_map(cfg), cfg, arch)
    plan = param_plan(cfg)
    if parallelism is not None:
        if mesh is None:
            raise ValueError("parallelism=... places the tensors on a mesh; pass mesh=...")
        shardings = _logical_shardings(cfg, mesh, parallelism)
        missing = set(plan) - set(shardings)
        if missing:  # pragma: no cover - tensor_map and the model disagree
            raise ValueError(f"the model has no parameter for {sorted(missing)[:3]}")
    elif mesh is None:
        one = SingleDeviceSharding(jax.local_devices()[0])
        shardings = {k: one for k in plan}
    elif params not in PARAMS_MODES:
        raise ValueError(f"params={params!r} must be one of {PARAMS_MODES}")
    else:
        # nested, so that fsdp_shardings sees the "layers" key of stacked parameters
        shapes = unflatten_dict({k: jax.ShapeDtypeStruct(p.shape, jnp.dtype(cfg.param_dtype))
                                 for k, p in plan.items()})
        shardings = flatten_dict(fsdp_shardings(shapes, mesh, axis_name) if params == "fsdp"
                                 else replicated_shardings(shapes, mesh))
    pdt = np.dtype(jnp.dtype(cfg.param_dtype))
    flat = {k: _load_tensor([tensors[e.hf_name] for e in p.entries], p, shardings[k], pdt)
            for k, p in plan.items()}
    return {"params": unflatten_dict(flat)}


def _logical_shardings(cfg, mesh: Mesh, parallelism) -> dict:
    """``{flattened parameter path: NamedSharding}`` of the N-D model (abstract: nothing
    is initialised)."""
    from flax.traverse_util import flatten_dict

    from jax_seqpar.models.llama import Llama

    model = Llama(cfg, mesh=mesh, parallelism=parallelism)
    sizes = parallelism.sizes(mesh)
    tokens = jnp.zeros((sizes["data"] * sizes["fsdp"], 2 * sizes["sequence"]), jnp.int32)
    return flatten_dict(model.param_shardings(jax.random.key(0), tokens)["params"])


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
