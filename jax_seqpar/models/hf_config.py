"""transformers ``config.json`` <-> ``LlamaConfig`` (Llama, Mistral, Qwen2).

``config_fields_from_hf`` reads what transformers (4.x and 5.x) writes (``LlamaConfig
.from_hf`` builds the config from its fields, so this module does not import the model
and the model imports it) and refuses, with a
``ValueError`` naming the field and what is supported, every field it cannot map
faithfully: an unknown architecture, a RoPE type other than linear / dynamic / yarn /
llama3, partial rotary embeddings, interleaved RoPE, an activation other than SiLU,
per-layer sliding windows, quantization.  ``config_to_hf`` writes the dict transformers'
``from_pretrained`` accepts.

**Which fields are accepted, which refused.**  Every field of a config.json falls in one
of these kinds; nothing that changes the model is silently dropped:

1. *Mapped* (read into ``LlamaConfig``): the fields below, per architecture.
2. *Checked*: read only to refuse what would change the model --
   ``rope_interleaved`` (nanotron's flag, e.g. SmolLM2): ``false`` is transformers'
   rotate-half RoPE, ours; ``true`` rotates adjacent pairs, another function of the same
   weights: refused, even when named in ``ignore``.  ``pretraining_tp`` (Llama 2's
   tensor-parallel degree; any positive int accepted): older transformers 4.x split
   each Llama projection and the LM head into that many slices and concatenated or
   summed the partial products -- the same function up to float rounding (the order
   of a sum); the rewritten modeling code (4.48 era) and 5.x do not read it at all.
   ``attention_dropout`` must be 0, ``hidden_act`` SiLU.
3. *Token ids*, kept as metadata (``LlamaConfig.bos_token_id``, ``eos_token_ids``,
   ``pad_token_id``: they never change what the model computes; ``models.generate``
   stops at ``eos_token_ids`` by default): ``bos_token_id``, ``eos_token_id`` (an int or
   a list), ``pad_token_id``; each must be null or a token id in ``[0, vocab_size)`` (a
   name in ``ignore`` leaves it unread).  ``generation_config`` (the dict of a
   ``generation_config.json`` beside config.json: ``read_generation_config``) supplies
   the same three, and where it gives one (not null) it wins, as transformers'
   ``generate`` reads its generation config; its other fields (sampling settings) are
   not read.
4. *Accepted unread*, because they do not change the function the model computes
   (``_HARMLESS``): names and paths (``_name_or_path``, ``_model_name_or_path`` of the
   GGUF export, ...), other token ids (``unk_token_id``, ``sep_token_id``, ...),
   ``use_cache``, ``dtype`` / ``torch_dtype`` (the load's ``dtype`` decides),
   ``is_llama_config`` (nanotron's marker), ``initializer_range``, generation settings
   and transformers' generic ``PretrainedConfig`` flags.
5. *Tool blocks*, accepted unread: a key that ends in ``_config``, is not a Python
   identifier (it holds a ``.`` or a ``-``, e.g. ``transformers.js_config``: a tool's
   package name) and holds a dict.  Modeling code reads a config's fields as attributes,
   which such a name cannot be, so only the tool that wrote it reads it.  A
   ``*_config`` block with an identifier name (``quantization_config``, ``text_config``,
   MPT's ``attn_config``, ...) may be read by a model, so it falls in 6.
6. Anything else is *refused*, unknown fields included (pass a name in ``ignore=`` when
   it is known not to change the model: it is then accepted unread).

How the fields map (transformers name -> ``LlamaConfig``): ``hidden_size`` -> ``d_model``,
``intermediate_size`` -> ``ffn_dim``, ``num_hidden_layers`` -> ``num_layers``,
``num_attention_heads`` / ``num_key_value_heads`` -> ``num_heads`` / ``num_kv_heads``,
``head_dim`` (None: ``hidden_size / heads``), ``rms_norm_eps`` -> ``norm_eps``,
``tie_word_embeddings`` -> ``tie_embeddings``; RoPE from 5.x's ``rope_parameters`` or the
older top-level ``rope_theta`` / ``rope_scaling`` -> ``rope_theta``, ``rope_scaling``;
Llama's ``attention_bias`` -> ``attention_bias`` and ``attention_out_bias``, ``mlp_bias``;
Qwen2: q/k/v biases always (``attention_bias=True``); Mistral's (and Qwen2's, when every
layer slides) ``sliding_window`` W -> ``window=(W - 1, 0)`` (transformers lets query ``i``
see keys ``j`` with ``i - W < j <= i``); ``bos_token_id`` / ``eos_token_id`` /
``pad_token_id`` -> ``bos_token_id`` / ``eos_token_ids`` (a tuple) / ``pad_token_id``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterable, Optional

from jax_seqpar.layers.rope import ROPE_TYPES, RopeScaling

#: architecture -> (model_type, default max_position_embeddings of its config class)
ARCHITECTURES = {"LlamaForCausalLM": ("llama", 2048),
                 "MistralForCausalLM": ("mistral", 4096 * 32),
                 "Qwen2ForCausalLM": ("qwen2", 32768)}
#: num_key_value_heads of each config class when config.json leaves it out (None: heads)
_DEFAULT_KV_HEADS = {"llama": None, "mistral": 8, "qwen2": 32}
_BY_TYPE = {t: a for a, (t, _) in ARCHITECTURES.items()}

_COMMON = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
           "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
           "tie_word_embeddings", "max_position_embeddings", "rope_theta", "rope_scaling",
           "rope_parameters", "original_max_position_embeddings", "partial_rotary_factor",
           "hidden_act", "attention_dropout", "rope_interleaved", "pretraining_tp"}
_MAPPED = {"llama": _COMMON | {"attention_bias", "mlp_bias"},
           "mistral": _COMMON | {"sliding_window"},
           "qwen2": _COMMON | {"sliding_window", "use_sliding_window", "max_window_layers",
                               "layer_types"}}
#: The token ids kept as ``LlamaConfig`` metadata: config.json / generation_config.json
#: name -> ``LlamaConfig`` field.
TOKEN_ID_FIELDS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_ids",
                   "pad_token_id": "pad_token_id"}
#: Fields that do not change the function the model computes (names and paths, other
#: token ids, metadata, generation and tokenizer settings, PretrainedConfig's generic
#: flags): accepted unread.
_HARMLESS = {"architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
             "_name_or_path", "name_or_path", "_model_name_or_path", "unk_token_id",
             "is_llama_config",
             "use_cache", "initializer_range", "output_attentions", "output_hidden_states",
             "return_dict", "use_return_dict", "torchscript", "id2label", "label2id",
             "problem_type", "tokenizer_class", "finetuning_task", "prefix", "task_specific_params",
             "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
             "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder",
             "sep_token_id", "decoder_start_token_id", "_attn_implementation_autoset",
             "attn_implementation", "_commit_hash", "use_bfloat16", "pruned_heads",
             "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
             "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
             "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
             "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
             "output_scores", "return_dict_in_generate", "forced_bos_token_id",
             "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
             "suppress_tokens", "begin_suppress_tokens", "tf_legacy_loss", "cache_implementation"}


def is_tool_block(key: str, value) -> bool:
    """A tool's own settings, accepted unread (module docstring, kind 5): ``key`` ends in
    ``_config``, is not a Python identifier (e.g. ``transformers.js_config``) and holds a
    dict."""
    return (isinstance(key, str) and key.endswith("_config") and not key.isidentifier()
            and isinstance(value, dict))


def _token_id(name: str, value, vocab_size: int, where: str) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ValueError(f"{name}={value!r} ({where}) is not a token id in [0, {vocab_size}) "
                         f"(vocab_size); it does not change the model: pass "
                         f"ignore={[name]} to leave it unread")
    return value


def token_ids_from_hf(hf: dict, vocab_size: int, *, generation_config: Optional[dict] = None,
                      ignore: Iterable[str] = ()) -> dict:
    """``{"bos_token_id", "eos_token_ids", "pad_token_id"}`` (``LlamaConfig`` fields) of a
    config.json dict ``hf``, each replaced by ``generation_config``'s (a
    ``generation_config.json`` dict) where that gives one that is not null.  ``eos_token_id``
    may be an int or a list (a tuple here; null: ``()``).  Each id must lie in ``[0,
    vocab_size)``; names in ``ignore`` are not read from either dict."""
    if generation_config is not None and not isinstance(generation_config, dict):
        raise TypeError(f"generation_config must be a dict (generation_config.json) or None, "
                        f"got {type(generation_config).__name__}")
    ignore = set(ignore)
    out = {}
    for name, field in TOKEN_ID_FIELDS.items():
        value, where = hf.get(name), "config.json"
        if generation_config is not None and generation_config.get(name) is not None:
            value, where = generation_config[name], "generation_config.json"
        if name in ignore:
            value = None
        if field == "eos_token_ids":
            ids = value if isinstance(value, (list, tuple)) else [value]
            out[field] = tuple(i for i in (_token_id(name, v, vocab_size, where) for v in ids)
                               if i is not None)
        else:
            out[field] = _token_id(name, value, vocab_size, where)
    return out


def read_generation_config(path) -> Optional[dict]:
    """The dict of ``generation_config.json`` in checkpoint directory ``path`` (or of
    ``path`` itself when it is that file); None when there is none."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "generation_config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        out = json.load(f)
    if not isinstance(out, dict):
        raise ValueError(f"{path} holds a {type(out).__name__}, not a JSON object")
    return out


def _arch(hf: dict) -> str:
    archs, mtype = hf.get("architectures"), hf.get("model_type")
    if archs is not None:
        if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
            raise ValueError(f"architectures={archs!r} is not supported; supported: one of "
                             f"{sorted(ARCHITECTURES)}")
        arch = archs[0]
        if mtype is not None and mtype != ARCHITECTURES[arch][0]:
            raise ValueError(f"model_type={mtype!r} does not match architectures={archs!r} "
                             f"(expected model_type={ARCHITECTURES[arch][0]!r})")
        return arch
    if mtype in _BY_TYPE:
        return _BY_TYPE[mtype]
    raise ValueError(f"architectures is missing and model_type={mtype!r} is not supported; "
                     f"supported: architectures {sorted(ARCHITECTURES)} / model_type "
                     f"{sorted(_BY_TYPE)}")


def _rope(hf: dict, max_pos: int):
    """``(rope_theta, RopeScaling | None)`` from either form of the RoPE fields."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling")
    if legacy and params:
        rest = {k: v for k, v in params.items() if k not in ("rope_theta",)}
        old = {("rope_type" if k == "type" else k): v for k, v in legacy.items()}
        if rest != old:
            raise ValueError(f"rope_scaling={legacy!r} and rope_parameters={params!r} "
                             f"disagree; keep one")
    if legacy and not params:
        params = dict(legacy)
    if "type" in params:
        params.setdefault("rope_type", params.pop("type"))
    theta = params.pop("rope_theta", None)
    top = hf.get("rope_theta")
    if theta is not None and top is not None and float(theta) != float(top):
        raise ValueError(f"rope_theta={top!r} and rope_parameters.rope_theta={theta!r} "
                         f"disagree; keep one")
    theta = float(theta if theta is not None else top if top is not None else 10000.0)
    for where, prf in (("rope_parameters.", params.pop("partial_rotary_factor", None)),
                       ("", hf.get("partial_rotary_factor"))):
        if prf is not None and float(prf) != 1.0:
            raise ValueError(f"{where}partial_rotary_factor={prf!r} is not supported "
                             f"(only 1.0: RoPE on the whole head)")
    rtype = params.get("rope_type", "default")
    if rtype not in ROPE_TYPES + ("default",):
        raise ValueError(f"rope_scaling.rope_type={rtype!r} is not supported; supported: "
                         f"{('default',) + ROPE_TYPES}")
    if rtype == "dynamic":  # transformers' dynamic NTK scales from max_position_embeddings
        orig = params.pop("original_max_position_embeddings", max_pos)
        if orig != max_pos:
            raise ValueError(f"rope_scaling.original_max_position_embeddings={orig} differs "
                             f"from max_position_embeddings={max_pos}, which transformers' "
                             f"dynamic scaling uses instead; remove it or make them equal")
        params["original_max_position_embeddings"] = max_pos
    elif rtype in ("yarn", "llama3"):
        if hf.get("original_max_position_embeddings") is not None:  # wins, as in transformers
            params["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", max_pos)
        if rtype == "yarn" and params.get("factor") is None:
            params["factor"] = max_pos / params["original_max_position_embeddings"]
    return theta, RopeScaling.from_dict(params)


def _window(hf: dict, arch: str, num_layers: int):
    if arch == "LlamaForCausalLM":
        return None
    w = hf.get("sliding_window", 4096)  # both config classes default to 4096 when absent
    if arch == "Qwen2ForCausalLM":
        w = w if hf.get("use_sliding_window", False) else None
        types = hf.get("layer_types")
        if types is None:
            first = hf.get("max_window_layers", 28)
            types = ["sliding_attention" if w is not None and i >= first else "full_attention"
                     for i in range(num_layers)]
        if len(types) != num_layers or not set(types) <= {"full_attention",
                                                           "sliding_attention"}:
            raise ValueError(f"layer_types={types!r} must list 'full_attention' or "
                             f"'sliding_attention' for each of the {num_layers} layers")
        sliding = [t == "sliding_attention" and w is not None for t in types]
        if any(sliding) and not all(sliding):
            raise ValueError(
                f"use_sliding_window=True with max_window_layers="
                f"{hf.get('max_window_layers')} / layer_types={types} gives a sliding window "
                f"on some layers only; per-layer windows are not supported (supported: "
                f"every layer sliding, max_window_layers=0, or none)")
        w = w if all(sliding) else None
    if w is None:
        return None
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise ValueError(f"sliding_window={w!r} must be a positive int or null")
    return (w - 1, 0)


def config_fields_from_hf(hf: dict, *, ignore: Iterable[str] = (),
                          generation_config: Optional[dict] = None) -> dict:
    """The ``LlamaConfig`` fields of a transformers ``config.json`` dict (``LlamaConfig
    .from_hf`` builds the config from them, so this module never imports the model).

    The module docstring says which fields are mapped, checked, kept as token ids,
    accepted unread or refused.  ``ignore``: names of fields known not to change the
    model, accepted unread (token ids included: then not kept).  ``generation_config``:
    the dict of the checkpoint's ``generation_config.json`` (``read_generation_config``)
    or None; its ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` win over
    config.json's where not null (``token_ids_from_hf``); nothing else of it is read."""
    if not isinstance(hf, dict):
        raise TypeError(f"hf_config must be a dict (config.json), got {type(hf).__name__}")
    ignore = set(ignore)
    arch = _arch(hf)
    mtype, default_max = ARCHITECTURES[arch]
    unknown = sorted(k for k in set(hf) - _MAPPED[mtype] - set(TOKEN_ID_FIELDS) - _HARMLESS
                     - ignore if not is_tool_block(k, hf[k]))
    if "quantization_config" in unknown:
        raise ValueError("quantization_config: quantized checkpoints are not supported "
                         "(load a float16 / bfloat16 / float32 one)")
    if unknown:
        raise ValueError(f"config fields {unknown} are not supported for {arch} (the "
                         f"model might depend on them); if they do not change the model, "
                         f"pass ignore={unknown}")
    if hf.get("rope_interleaved") not in (None, False):   # even when named in ignore
        raise ValueError(f"rope_interleaved={hf['rope_interleaved']!r} is not supported: "
                         f"interleaved RoPE rotates adjacent pairs of each head, another "
                         f"function of the same weights (only false: transformers' "
                         f"rotate-half RoPE)")
    tp = hf.get("pretraining_tp")
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
        raise ValueError(f"pretraining_tp={tp!r} must be a positive int (transformers "
                         f"computes the same function for every value)")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported (only 'silu' / "
                         f"'swish': SwiGLU)")
    if hf.get("attention_dropout") not in (None, 0, 0.0):
        raise ValueError(f"attention_dropout={hf['attention_dropout']!r} is not supported "
                         f"(only 0: the model has no dropout)")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads"):
        if name not in hf:
            raise ValueError(f"config field {name} is missing ({arch})")
    heads = hf["num_attention_heads"]
    max_pos = hf.get("max_position_embeddings", default_max)
    theta, scaling = _rope(hf, max_pos)
    qwen = arch == "Qwen2ForCausalLM"
    bias = bool(hf.get("attention_bias", False))
    return dict(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads", _DEFAULT_KV_HEADS[mtype]) or heads,
        head_dim=hf.get("head_dim"),
        ffn_dim=hf["intermediate_size"], rope_theta=theta, rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        window=_window(hf, arch, hf["num_hidden_layers"]),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=qwen or bias, attention_out_bias=bias,
        mlp_bias=bool(hf.get("mlp_bias", False)), max_position_embeddings=max_pos,
        **token_ids_from_hf(hf, hf["vocab_size"], generation_config=generation_config,
                            ignore=ignore))


def replace(cfg, **overrides):
    """``dataclasses.replace`` that names an unknown field in a ``ValueError``."""
    names = {f.name for f in dataclasses.fields(cfg)}
    bad = sorted(set(overrides) - names)
    if bad:
        raise ValueError(f"config overrides {bad} are not LlamaConfig fields "
                         f"(fields: {sorted(names)})")
    return dataclasses.replace(cfg, **overrides)


def _choose_arch(cfg) -> str:
    if cfg.attention_bias and not cfg.attention_out_bias and not cfg.mlp_bias:
        return "Qwen2ForCausalLM"
    if cfg.window is not None:
        return "MistralForCausalLM"
    return "LlamaForCausalLM"


def config_to_hf(cfg, architecture: Optional[str] = None) -> dict:
    """The transformers ``config.json`` dict of ``cfg`` (``LlamaConfig``).

    ``architecture=None`` picks ``Qwen2ForCausalLM`` for q/k/v-only biases,
    ``MistralForCausalLM`` for a sliding window, else ``LlamaForCausalLM``.  Raises a
    ``ValueError`` naming the field that the architecture cannot express.  RoPE is written
    in both forms (5.x's ``rope_parameters``; ``rope_theta`` / ``rope_scaling`` for 4.x).
    ``rope_scaling.seq_len`` (dynamic) has no transformers field: transformers recomputes
    the dynamic frequencies per call (equal to ours at sequences of that length).  The
    token ids are written as transformers writes them: ``bos_token_id``, ``pad_token_id``
    (null when None) and ``eos_token_id`` (null, an int for one id, else a list).
    """
    arch = architecture or _choose_arch(cfg)
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture={arch!r} is not supported; supported: "
                         f"{sorted(ARCHITECTURES)}")
    mtype = ARCHITECTURES[arch][0]

    def refuse(field, why):
        raise ValueError(f"{field}={getattr(cfg, field)!r} cannot be written as {arch}: {why}")

    if mtype == "llama":
        if cfg.window is not None:
            refuse("window", "Llama has no sliding window (MistralForCausalLM has)")
        if cfg.attention_bias != cfg.attention_out_bias:
            refuse("attention_out_bias", "Llama's attention_bias biases q, k, v and o "
                   "together (Qwen2ForCausalLM has q/k/v biases only)")
    elif mtype == "mistral":
        for f in ("attention_bias", "attention_out_bias", "mlp_bias"):
            if getattr(cfg, f):
                refuse(f, "Mistral has no biases")
    else:
        if not cfg.attention_bias or cfg.attention_out_bias or cfg.mlp_bias:
            refuse("attention_bias", "Qwen2 has biases on q, k, v and nowhere else "
                   "(attention_bias=True, attention_out_bias=False, mlp_bias=False)")
    if cfg.window is not None and arch != "LlamaForCausalLM":
        sliding = cfg.window[0] + 1  # the right side is cut by the causal mask
    else:
        sliding = None
    s = cfg.rope_scaling
    max_pos = cfg.max_position_embeddings
    if s is not None and s.rope_type == "dynamic":
        if max_pos is not None and max_pos != s.original_max_position_embeddings:
            refuse("max_position_embeddings", "transformers' dynamic scaling reads it as "
                   f"rope_scaling.original_max_position_embeddings="
                   f"{s.original_max_position_embeddings}")
        max_pos = s.original_max_position_embeddings
    if max_pos is None:
        max_pos = (int(s.original_max_position_embeddings * s.factor)
                   if s is not None and s.original_max_position_embeddings else 4096)
    rope = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    legacy = None
    if s is not None:
        legacy = {k: v for k, v in s.to_dict().items() if k != "seq_len"}
        if s.rope_type == "dynamic":
            legacy.pop("original_max_position_embeddings")
        rope.update(legacy)
    out = dict(architectures=[arch], model_type=mtype, vocab_size=cfg.vocab_size,
               hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim,
               num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
               num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
               hidden_act="silu", rms_norm_eps=cfg.norm_eps,
               tie_word_embeddings=cfg.tie_embeddings, max_position_embeddings=max_pos,
               rope_parameters=rope, rope_theta=float(cfg.rope_theta), rope_scaling=legacy,
               attention_dropout=0.0, dtype=cfg.param_dtype,
               bos_token_id=cfg.bos_token_id, pad_token_id=cfg.pad_token_id,
               eos_token_id=(None if not cfg.eos_token_ids else cfg.eos_token_ids[0]
                             if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids)))
    if mtype == "llama":
        out.update(attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias)
    elif mtype == "mistral":
        out.update(sliding_window=sliding)
    else:
        out.update(use_sliding_window=sliding is not None, sliding_window=sliding,
                   max_window_layers=0 if sliding is not None else cfg.num_layers)
    return out


__all__ = ["ARCHITECTURES", "TOKEN_ID_FIELDS", "config_fields_from_hf", "config_to_hf",
           "is_tool_block", "read_generation_config", "replace", "token_ids_from_hf"]
