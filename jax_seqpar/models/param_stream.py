"""The parameters of a checkpoint streamed onto their shardings, whatever the file format:
the plan from transformers' tensor names to ``models.Llama``'s parameters (``tensor_map``,
``param_plan``), the checks of names and shapes (``_check``), and the placement of one
parameter at a time (``_load_params`` / ``_load_tensor``).  ``models.hf`` (safetensors)
and ``models.gguf`` (llama.cpp files) give it a ``{name: tensor source}`` dict: a
``safetensors_io.TensorInfo`` is read through ``read_slice``, any other source reads
itself (``read(view, index)``; ``release()`` once the parameter is placed).

How transformers' tensors become the model's parameters (``tensor_map``): every linear
weight ``W [out, in]`` is transposed (Flax kernels are ``[in, out]``); q/k/v kernels are
``W.T.reshape(d, H, Dh)`` and their Qwen2 biases ``b.reshape(H, Dh)``, the output
projection is ``W.T.reshape(H, Dh, d)``; embeddings, norms and the other biases as they
are.  Each device's slice is read in the stored layout and dtype, put on its device by
``jax.make_array_from_callback``, then transposed and converted there (``_relayout``), so
the host holds about one tensor and no device more than its slice; a stacked parameter
(``scan_layers``) is read layer by layer into each slice (``_read_stacked``; the
``models.hf`` docstring, "Scanned layers").
"""

from __future__ import annotations

import functools
import os
import re
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from jax_seqpar.models.llama import LAYERS
from jax_seqpar.models.safetensors_io import DTYPES, TensorInfo, read_slice
from jax_seqpar.sharding.fsdp import fsdp_shardings, replicated_shardings

PARAMS_MODES = ("fsdp", "replicated")
_LAYER_KEY = re.compile(r"^layer_(\d+)$")
_SKIPPED = re.compile(r".*rotary_emb\.inv_freq$")


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
