"""llama.cpp GGUF files into ``models.Llama``: the config from the metadata, the weights
dequantized and streamed onto their shardings one tensor at a time (``param_stream``).

    cfg, params = load_gguf("Llama-3.2-1B-Q4_K_M.gguf", mesh=mesh)  # = hf.load_pretrained
    tok = gguf_tokenizer("Llama-3.2-1B-Q4_K_M.gguf")             # data/gguf_tokenizer.py

**File** (GGUF spec, ggml's ``docs/gguf.md``): typed key/value metadata, tensor infos
(name, dims innermost first -- ``ne[0]`` is a row's length --, ggml type, offset), the
aligned data; read with gguf-py's ``GGUFReader`` (a memory map: nothing is read until a
tensor is).  Transformers' ``W [out, in]`` is stored with ``ne = (in, out)``:
``GGUFTensor.shape`` reverses the dims.  Little-endian, unsplit files only.

**Config** (``hf_config_dict``): ``general.architecture`` ``llama`` (Llama 1-3, Mistral)
or ``qwen2``; the ``{arch}.*`` keys of llama.cpp's ``convert_hf_to_gguf.py`` become
config.json fields (``_KEYS``) for ``LlamaConfig.from_hf``, so ``ignore_fields`` and
overrides work as for a checkpoint directory; any other ``{arch}.*`` key is refused by
name (e.g. Mixtral's ``llama.expert_count``).  ``attention.key_length`` is ``head_dim``;
``rope.dimension_count`` below it (partial RoPE) is refused.  RoPE scaling:
``rope.scaling.type`` ``linear`` / ``yarn`` (``factor``, ``original_context_length``,
``yarn_beta_fast/slow``); Llama 3.1's is the tensor ``rope_freqs.weight`` (divisors of
the inverse frequencies), read as ``rope_type="llama3"`` only where ``llama3_inv_freq``
reproduces it (Meta's ``low_freq_factor=1, high_freq_factor=4,
original_max_position_embeddings=8192``, ``factor`` its largest entry; or the
``rope_scaling`` override).  ``attention.sliding_window``: an all-layer window (Mistral /
Qwen2).  No ``output.weight``: tied embeddings.  Biases: Qwen2's q/k/v.  The
tokenizer's bos / eos (+ eot, eom) / padding ids become the config's token ids.

**Tensors**: llama.cpp's names (gguf-py ``constants.py``) map to transformers' (``_BLOCK``,
``hf_name``).  For ``llama`` the converter (``LlamaModel.permute``, on ``q_proj`` with
``num_attention_heads`` and ``k_proj`` with ``num_key_value_heads``, weights and biases)
reorders each head's rows from transformers' rotate-half pairs (``j``, ``j + Dh/2``) to
the adjacent pairs ggml's "normal" RoPE rotates: stored row ``2j + s`` = row
``s Dh/2 + j`` (``permute_qk``); ``unpermute_qk`` undoes it exactly.  ``qwen2`` (ggml's
NeoX RoPE, transformers' pairs) is not permuted.

**Dequantization**: ``gguf.quants.dequantize`` (gguf-py's NumPy ggml block formats,
``QUANT_TYPES``) to float32; F32 / F16 / BF16 are sliced from the memory map as stored.
A ``GGUFTensor`` dequantizes (and un-permutes) its whole tensor once per load, at the
first device slice, and drops it once the parameter is placed (``param_stream._load_tensor``;
stacked layers one after the other): the host holds about one float32 tensor more than
for safetensors.
"""

from __future__ import annotations

import os
import re
from typing import Dict, Optional, Tuple

import numpy as np

from jax_seqpar.layers.rope import as_rope_scaling, default_inv_freq, llama3_inv_freq
from jax_seqpar.data.gguf_file import import_gguf, meta, open_gguf  # noqa: F401 (API)
from jax_seqpar.models import param_stream
from jax_seqpar.models.llama import LlamaConfig
from jax_seqpar.models.safetensors_io import DTYPES

#: general.architecture -> the transformers architecture whose config.json it gives
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
#: ggml types read (dequantized to float32 unless F32 / F16 / BF16)
QUANT_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K",
               "Q4_K", "Q5_K", "Q6_K")
#: {arch}.<key> -> the transformers config.json field it is
_KEYS = {"vocab_size": "vocab_size", "context_length": "max_position_embeddings",
         "embedding_length": "hidden_size", "block_count": "num_hidden_layers",
         "feed_forward_length": "intermediate_size",
         "attention.head_count": "num_attention_heads",
         "attention.head_count_kv": "num_key_value_heads",
         "attention.key_length": "head_dim",
         "attention.layer_norm_rms_epsilon": "rms_norm_eps", "rope.freq_base": "rope_theta"}
_REQUIRED = ("embedding_length", "block_count", "feed_forward_length", "attention.head_count",
             "attention.layer_norm_rms_epsilon")
#: {arch}.<key> read only to check or to build the RoPE scaling / window
_CHECKED = {"attention.value_length", "rope.dimension_count", "rope.scaling.type",
            "rope.scaling.factor", "rope.scaling.original_context_length",
            "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
            "rope.scaling.finetuned", "attention.sliding_window", "expert_count",
            "expert_used_count"}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_GGUF_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
ROPE_FREQS = "rope_freqs.weight"
_META_LLAMA3 = dict(low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)


def _f32(x) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (``1e-05``, not
    ``9.99999974e-06``): the value the original config.json held."""
    return float(str(np.float32(x)))


def hf_name(name: str) -> str:
    """transformers' name of a llama.cpp tensor name (others unchanged)."""
    m = _GGUF_BLOCK.match(name)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
    return _GLOBAL.get(name, name)


def gguf_name(name: str) -> str:
    """llama.cpp's name of a transformers tensor name (``hf_name``'s inverse)."""
    m = _HF_BLOCK.match(name)
    back = {v: k for k, v in _BLOCK.items()}
    if m and m.group(2) in back:
        return f"blk.{m.group(1)}.{back[m.group(2)]}.{m.group(3)}"
    return {v: k for k, v in _GLOBAL.items()}.get(name, name)


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: each head's rows (axis 0), in transformers'
    rotate-half order, reordered to adjacent pairs: row ``2j + s`` <- row ``s Dh/2 + j``."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def unpermute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of ``permute_qk``: row ``s Dh/2 + j`` of a head <- its row ``2j + s``."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


class GGUFTensor:
    """One GGUF tensor as ``hf``'s loader reads it: ``file``, ``dtype`` (the
    ``safetensors_io.DTYPES`` code of what ``read`` returns), ``shape`` (transformers'
    ``[out, in]``), ``read(view, index)`` and ``release()``.  ``heads``: un-permute the
    rows (``unpermute_qk``) in that many heads."""

    def __init__(self, file: str, tensor, heads: Optional[int] = None):
        self.file, self.name, self.heads = file, tensor.name, heads
        self.qtype = tensor.tensor_type
        self._data = tensor.data      # a view of the reader's memory map: nothing read yet
        self.shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        self.dtype = self.qtype.name if self.qtype.name in ("F32", "F16", "BF16") else "F32"
        self._whole: Optional[np.ndarray] = None

    def array(self) -> np.ndarray:
        """The whole tensor, ``shape``, dequantized and un-permuted (kept until
        ``release``; F32 / F16 / BF16 without permutation: the memory map itself)."""
        if self._whole is None:
            if self.dtype == "F32" and self.qtype.name != "F32":
                x = import_gguf().quants.dequantize(self._data, self.qtype)
            elif self.dtype == "BF16":
                x = self._data.view(DTYPES["BF16"])
            else:
                x = self._data
            x = x.reshape(self.shape)
            self._whole = x if self.heads is None else unpermute_qk(x, self.heads)
        return self._whole

    def read(self, view, index=()) -> np.ndarray:
        """A copy of ``array().reshape(view)[index]``."""
        return np.array(self.array().reshape(view)[index], copy=True)

    def release(self) -> None:
        self._whole = None


def _rope_scaling(reader, p: str, theta: float, head_dim: int, overrides: dict):
    """transformers' ``rope_scaling`` dict (or None) of the metadata / ``rope_freqs``."""
    stype = meta(reader, p + "rope.scaling.type", "none")
    factor = meta(reader, p + "rope.scaling.factor")
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        if stype != "none":
            raise ValueError(f"{p}rope.scaling.type={stype!r} and a {ROPE_FREQS} tensor: "
                             f"two RoPE scalings at once are not supported")
        got = np.asarray(freqs.data, np.float64).ravel()
        user = as_rope_scaling(overrides.get("rope_scaling"))
        want = (user.to_dict() if user is not None and user.rope_type == "llama3" else
                dict(rope_type="llama3", factor=_f32(got.max()), **_META_LLAMA3))
        w = {k: v for k, v in want.items() if k != "rope_type"}
        ratio = default_inv_freq(head_dim, theta) / llama3_inv_freq(head_dim, theta, **w)
        if got.shape == ratio.shape and np.allclose(got, ratio, rtol=1e-5, atol=0):
            return want
        if "rope_scaling" in overrides:  # replaced by the caller, as for a checkpoint dir
            return None
        raise ValueError(f"{ROPE_FREQS} (llama.cpp's per-frequency RoPE divisors) is not "
                         f"rope_type='llama3' with {w} (it holds {np.round(got, 4)}); other "
                         f"frequency factors are not supported.  If the original config.json "
                         f"had another llama3 rope_scaling, pass it as rope_scaling={{...}}: "
                         f"it is checked against the tensor")
    if stype == "none":
        return None
    if stype not in ("linear", "yarn"):
        raise ValueError(f"{p}rope.scaling.type={stype!r} is not supported; supported: "
                         f"'none', 'linear', 'yarn' (and Llama 3.1's {ROPE_FREQS})")
    if factor is None:
        raise ValueError(f"{p}rope.scaling.type={stype!r} without {p}rope.scaling.factor")
    out = {"rope_type": stype, "factor": _f32(factor)}
    if stype == "yarn":
        orig = meta(reader, p + "rope.scaling.original_context_length")
        if orig is None:
            raise ValueError(f"{p}rope.scaling.type='yarn' without "
                             f"{p}rope.scaling.original_context_length")
        out["original_max_position_embeddings"] = int(orig)
        for key in ("beta_fast", "beta_slow"):
            if meta(reader, f"{p}rope.scaling.yarn_{key}") is not None:
                out[key] = _f32(meta(reader, f"{p}rope.scaling.yarn_{key}"))
    return out


def hf_config_dict(reader, *, ignore=(), overrides=None) -> Tuple[dict, str]:
    """``(transformers config.json dict, general.architecture)`` of a GGUF's metadata
    (the module docstring says how each key maps)."""
    arch = meta(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"general.architecture={arch!r} is not supported; supported: "
                         f"{sorted(ARCHITECTURES)} (Mistral GGUFs say 'llama')")
    p = arch + "."
    unknown = sorted(k for k in reader.fields if k.startswith(p) and k not in ignore
                     and k[len(p):] not in _KEYS and k[len(p):] not in _CHECKED)
    if unknown:
        raise ValueError(f"GGUF metadata {unknown} is not supported for {arch} (the model "
                         f"might depend on it); if it does not change the model, pass "
                         f"ignore_fields={unknown}")
    for key in _REQUIRED:
        if meta(reader, p + key) is None:
            raise ValueError(f"GGUF metadata {p + key} is missing")
    if meta(reader, p + "expert_count", 0):
        raise ValueError(f"{p}expert_count={meta(reader, p + 'expert_count')}: mixture-of-"
                         f"experts models are not supported")
    out = {"architectures": [ARCHITECTURES[arch]]}
    for key, field in _KEYS.items():
        v = meta(reader, p + key)
        if v is not None:
            out[field] = _f32(v) if isinstance(v, float) else v
    out.setdefault("num_key_value_heads", out["num_attention_heads"])  # llama.cpp's default
    names = {t.name for t in reader.tensors}
    if "vocab_size" not in out:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if tokens is None and embed is None:
            raise ValueError(f"GGUF metadata {p}vocab_size is missing (and there is no "
                             f"tokenizer.ggml.tokens list nor token_embd.weight)")
        out["vocab_size"] = len(tokens.data) if tokens is not None else int(embed.shape[-1])
    head_dim = out.get("head_dim") or out["hidden_size"] // out["num_attention_heads"]
    for key in ("attention.value_length", "rope.dimension_count"):
        v = meta(reader, p + key)
        if v is not None and v != head_dim:
            raise ValueError(f"{p}{key}={v} differs from the head size {head_dim} ("
                             + ("partial RoPE is not supported: RoPE on the whole head only)"
                                if key.startswith("rope") else "values of another size than "
                                "keys are not supported)"))
    out["rope_scaling"] = _rope_scaling(reader, p, out.get("rope_theta", 10000.0), head_dim,
                                        overrides or {})
    window = meta(reader, p + "attention.sliding_window")
    if window:
        if arch == "llama":
            out["architectures"] = ["MistralForCausalLM"]
            out["sliding_window"] = int(window)
        else:
            out.update(use_sliding_window=True, sliding_window=int(window), max_window_layers=0)
    elif arch == "llama" and "blk.0.attn_q.bias" in names:
        out["attention_bias"] = True
    if arch == "llama" and "blk.0.ffn_up.bias" in names:
        out["mlp_bias"] = True
    out["tie_word_embeddings"] = "output.weight" not in names
    eos = [meta(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(i for i in eos if i is not None))
    out.update(bos_token_id=meta(reader, "tokenizer.ggml.bos_token_id"),
               pad_token_id=meta(reader, "tokenizer.ggml.padding_token_id"),
               eos_token_id=eos[0] if len(eos) == 1 else eos or None)
    return out, arch


def _config(reader, ignore_fields, overrides):
    ignore = tuple(ignore_fields)
    d, arch = hf_config_dict(reader, ignore=ignore, overrides=overrides)
    return LlamaConfig.from_hf(d, ignore=ignore, **overrides), arch


def gguf_config(path, *, ignore_fields=(), **overrides):
    """The ``LlamaConfig`` of a GGUF file's metadata (``overrides`` as
    ``LlamaConfig.from_hf``'s)."""
    return _config(open_gguf(path), ignore_fields, overrides)[0]


def gguf_tensors(reader, cfg, arch: str) -> Dict[str, GGUFTensor]:
    """``{transformers name: GGUFTensor}`` of every tensor (``rope_freqs.weight``, read
    into the config, left out); q / k of ``llama`` un-permuted with ``cfg``'s heads."""
    path = os.fspath(reader.data.filename)
    heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads} if arch == "llama" else {}
    out = {}
    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            continue
        if t.tensor_type.name not in QUANT_TYPES:
            raise ValueError(f"tensor {t.name} in {os.path.basename(path)} has ggml type "
                             f"{t.tensor_type.name}; supported: {', '.join(QUANT_TYPES)}")
        name = hf_name(t.name)
        proj = name.rsplit(".", 2)[-2] if name.startswith("model.layers.") else None
        out[name] = GGUFTensor(path, t, heads.get(proj))
    return out


def load_gguf(path, *, mesh=None, axis_name: str = "sp", dtype: str = "bfloat16",
              param_dtype: str = "float32", params: str = "fsdp", ignore_fields=(),
              parallelism=None, **config_overrides):
    """``(LlamaConfig, params)`` from a llama.cpp GGUF file, with ``hf.load_pretrained``'s
    keyword arguments and placement (``params="fsdp"`` / ``"replicated"``, ``mesh=None``:
    the first device, ``parallelism=...``, ``scan_layers=True``), one tensor at a time.
    ``ignore_fields``: GGUF metadata keys (or config.json fields) known not to change the
    model, accepted unread.  A missing tensor, an unexpected one or one of another shape
    raises a ``ValueError`` naming it."""
    reader = open_gguf(path)
    cfg, arch = _config(reader, ignore_fields,
                        dict(dtype=dtype, param_dtype=param_dtype, **config_overrides))
    tensors = gguf_tensors(reader, cfg, arch)
    for e in param_stream.tensor_map(cfg).values():
        if e.hf_name not in tensors:
            raise ValueError(f"tensor {gguf_name(e.hf_name)} ({e.hf_name}) is missing from "
                             f"{os.path.basename(os.fspath(path))} ({arch}, "
                             f"{cfg.num_layers} layers); {param_stream._hint(e.hf_name, cfg)}")
    return cfg, param_stream._load_params(cfg, tensors, f"{arch} GGUF", mesh=mesh, axis_name=axis_name,
                                params=params, parallelism=parallelism)


def gguf_tokenizer(path):
    """``jax_seqpar.data.gguf_tokenizer.gguf_tokenizer``: the file's tokenizer."""
    from jax_seqpar.data.gguf_tokenizer import gguf_tokenizer as make

    return make(path)


__all__ = ["ARCHITECTURES", "GGUFTensor", "QUANT_TYPES", "gguf_config", "gguf_name",
           "gguf_tensors", "gguf_tokenizer", "hf_config_dict", "hf_name", "load_gguf",
           "open_gguf", "permute_qk", "unpermute_qk"]
