"""Hugging Face checkpoints (``jax_seqpar.models.hf``) against transformers' own outputs.

The checkpoints and reference values under ``tests/fixtures/hf/`` were written by
transformers itself (``tests/fixtures/make_hf_fixtures.py``); nothing here needs torch.
Logits within 1e-5 (float32, norm-wise) on one device and on 8 devices (zigzag for every
checkpoint, striped for Mistral); save -> load round trips; multi-file checkpoints;
``params="fsdp"`` / ``"replicated"`` shardings; every bad input raising a ``ValueError``
that names the field or tensor; the scanned form (``scan_layers=True``, issue 39) loaded
onto each placement and saved to the same files as the unrolled one.
"""

import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from helpers import assert_close, seconds
from jax_seqpar.sharding.fsdp import fsdp_shardings
from jax_seqpar.layers.rope import RopeScaling
from jax_seqpar.models import Llama, LlamaConfig
from jax_seqpar.models.hf import (checkpoint_tensors, load_pretrained, save_pretrained,
                                  tensor_map)
from jax_seqpar.models.hf import config_from_hf
from jax_seqpar.models.hf_config import read_generation_config

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
NAMES = ["llama_plain", "llama_linear", "llama_dynamic", "llama_yarn", "llama_llama3",
         "llama32_tied", "llama_bias", "mistral", "qwen2"]
TOL = 1e-5


@functools.lru_cache(maxsize=None)
def auto_mesh(G=8):
    return jax.make_mesh((G,), ("sp",), devices=jax.devices()[:G],
                         axis_types=(AxisType.Auto,))


def ref(name):
    return np.load(os.path.join(FIX, f"{name}.npz"))


def hf_json(name):
    with open(os.path.join(FIX, name, "config.json")) as f:
        return json.load(f)


def logits(cfg, params, ids, mesh=None, layout="zigzag"):
    return jax.jit(Llama(cfg, mesh=mesh, layout=layout).apply)(params, jnp.asarray(ids))


# --------------------------------------------------------------------------- config
def test_configs_map_every_field():
    want = {"llama_plain": dict(rope_theta=10000.0, rope_scaling=None, window=None),
            "llama32_tied": dict(head_dim=32, tie_embeddings=True, rope_theta=500000.0),
            "llama_bias": dict(attention_bias=True, attention_out_bias=True, mlp_bias=True),
            "mistral": dict(window=(15, 0), rope_theta=1e6, attention_bias=False),
            "qwen2": dict(attention_bias=True, attention_out_bias=False, window=None)}
    for name in NAMES:
        cfg = LlamaConfig.from_hf(hf_json(name))
        assert (cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
                cfg.ffn_dim, cfg.norm_eps) == (128, 64, 2, 4, 2, 96, 1e-6), name
        for field, val in want.get(name, {}).items():
            assert getattr(cfg, field) == val, (name, field)
        # the tensor map covers exactly the model's parameter tree
        shapes = jax.eval_shape(Llama(cfg).init, jax.random.key(0),
                                jnp.zeros((1, 4), jnp.int32))["params"]
        flat = {tuple(k.key for k in path): v.shape
                for path, v in jax.tree_util.tree_leaves_with_path(shapes)}
        assert flat == {k: e.shape for k, e in tensor_map(cfg).items()}, name
        # to_hf -> from_hf is the identity; the architecture is kept
        back = cfg.to_hf()
        assert back["architectures"] == hf_json(name)["architectures"], name
        assert LlamaConfig.from_hf(back) == cfg, name
    ys = LlamaConfig.from_hf(hf_json("llama_yarn")).rope_scaling
    assert ys == RopeScaling("yarn", 4.0, original_max_position_embeddings=2048)


def test_legacy_rope_fields_and_overrides():
    """transformers 4.x files: rope_theta / rope_scaling (with "type") at the top."""
    hf = hf_json("llama_llama3")
    params = hf.pop("rope_parameters")
    hf["rope_theta"] = params.pop("rope_theta")
    hf["rope_scaling"] = dict(params, type=params.pop("rope_type"))
    assert LlamaConfig.from_hf(hf) == LlamaConfig.from_hf(hf_json("llama_llama3"))
    # context extension: overrides replace fields after the mapping
    cfg = LlamaConfig.from_hf(hf, rope_theta=8e6, rope_scaling=None, dtype="bfloat16")
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.dtype) == (8e6, None, "bfloat16")
    with pytest.raises(ValueError, match=r"rope_theta=1.0 and rope_parameters.rope_theta="
                                         r"500000.0 disagree"):
        LlamaConfig.from_hf(dict(hf_json("llama_llama3"), rope_theta=1.0))


@pytest.mark.parametrize("change, match", [
    (dict(architectures=["GPTNeoXForCausalLM"]), "architectures.*supported"),
    (dict(architectures=None, model_type="gemma"), "model_type='gemma'"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0],
                           "long_factor": [1.0], "original_max_position_embeddings": 64}),
     "rope_type='longrope' is not supported"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}),
     "low_freq_factor is required"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 8.0, "rope_theta": 1e4,
                           "beta_fast": 4}), "beta_fast=4 is not used by rope_type='linear'"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1"),
    (dict(quantization_config={"quant_method": "gptq"}), "quantization_config"),
    (dict(some_new_field=3), r"\['some_new_field'\].*ignore="),
    (dict(layer_types=["full_attention"] * 2), r"\['layer_types'\]"),  # Llama has none
])
def test_unsupported_config_fields_raise(change, match):
    hf = {k: v for k, v in {**hf_json("llama_plain"), **change}.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf(hf)


# config.json of real checkpoints (their published fields and values): SmolLM2-135M-Instruct
# (nanotron's extra fields, a transformers.js block), Llama-3.1-8B-Instruct (llama3 RoPE,
# three eos ids), Qwen2.5-7B-Instruct (its generation_config.json adds an eos id).
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 1, "eos_token_id": 2, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 576, "initializer_range": 0.041666666666666664, "intermediate_size": 1536,
    "is_llama_config": True, "max_position_embeddings": 8192, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30,
    "num_key_value_heads": 3, "pad_token_id": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_interleaved": False, "rope_scaling": None, "rope_theta": 100000,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16", "fp16": "float16"}},
    "transformers_version": "4.42.3", "use_cache": True, "vocab_size": 49152}
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256}
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584,
    "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 32768,
    "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 152064}
QWEN25_7B_GENERATION = {"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True,
                        "eos_token_id": [151645, 151643], "repetition_penalty": 1.05,
                        "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                        "transformers_version": "4.37.0"}


def test_real_configs_load_with_their_token_ids_and_round_trip(tmp_path):
    smol = LlamaConfig.from_hf(SMOLLM2_135M)
    assert (smol.vocab_size, smol.d_model, smol.ffn_dim, smol.num_layers, smol.num_heads,
            smol.num_kv_heads, smol.head_dim, smol.norm_eps, smol.rope_theta,
            smol.max_position_embeddings, smol.tie_embeddings, smol.rope_scaling) == \
        (49152, 576, 1536, 30, 9, 3, 64, 1e-5, 100000.0, 8192, True, None)
    assert (smol.bos_token_id, smol.eos_token_ids, smol.pad_token_id) == (1, (2,), 2)
    # transformers' GGUF export adds these; pretraining_tp > 1 is the same function
    # (transformers <= 4.47 sliced the matmuls; later versions do not read it)
    for extra in (dict(_model_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct",
                       unk_token_id=0), dict(pretraining_tp=2)):
        assert LlamaConfig.from_hf(dict(SMOLLM2_135M, **extra)) == smol
    llama = LlamaConfig.from_hf(LLAMA31_8B)
    assert (llama.num_kv_heads, llama.ffn_dim, llama.bos_token_id, llama.eos_token_ids) == \
        (8, 14336, 128000, (128001, 128008, 128009))
    assert llama.rope_scaling == RopeScaling("llama3", 8.0, 8192, low_freq_factor=1.0,
                                             high_freq_factor=4.0)
    qwen = LlamaConfig.from_hf(QWEN25_7B)
    assert (qwen.attention_bias, qwen.window, qwen.eos_token_ids, qwen.pad_token_id) == \
        (True, None, (151645,), None)
    # generation_config.json's ids win where it gives them (as transformers' generate)
    gen = LlamaConfig.from_hf(QWEN25_7B, generation_config=QWEN25_7B_GENERATION)
    assert (gen.bos_token_id, gen.eos_token_ids, gen.pad_token_id) == \
        (151643, (151645, 151643), 151643)
    assert gen == dataclasses.replace(qwen, eos_token_ids=[151645, 151643],
                                      pad_token_id=151643)
    assert LlamaConfig.from_hf(QWEN25_7B, generation_config={"eos_token_id": None}) == qwen
    # to_hf writes the ids back as transformers does (one eos id as an int, several a list)
    assert (smol.to_hf()["eos_token_id"], llama.to_hf()["eos_token_id"]) == \
        (2, [128001, 128008, 128009])
    for cfg in (smol, llama, qwen, gen):
        assert LlamaConfig.from_hf(cfg.to_hf()) == cfg
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN25_7B_GENERATION))
    assert read_generation_config(tmp_path) == QWEN25_7B_GENERATION
    assert read_generation_config(tmp_path / "none") is None


@pytest.mark.parametrize("change, kwargs, match", [
    (dict(rope_interleaved=True), {}, r"rope_interleaved=True is not supported: interleaved"),
    (dict(rope_interleaved=True), dict(ignore=["rope_interleaved"]), "rope_interleaved=True"),
    (dict(pretraining_tp=0), {}, "pretraining_tp=0 must be a positive int"),
    (dict(attn_config={"alibi": True}), {}, r"\['attn_config'\].*ignore="),  # identifier
    (dict(**{"foo.bar_config": 3}), {}, r"\['foo.bar_config'\]"),            # not a dict
    (dict(eos_token_id=[2, 49152]), {}, r"eos_token_id=49152 \(config.json\) is not a "
                                        r"token id in \[0, 49152\).*ignore=\['eos_token_id'\]"),
    (dict(pad_token_id=-1), {}, r"pad_token_id=-1 \(config.json\)"),
    ({}, dict(generation_config={"eos_token_id": [2, 60000]}),
     r"eos_token_id=60000 \(generation_config.json\)"),
])
def test_real_config_fields_that_change_the_model_or_are_bad_ids_raise(change, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf(dict(SMOLLM2_135M, **change), **kwargs)


def test_ignored_token_ids_are_left_unread():
    cfg = LlamaConfig.from_hf(dict(SMOLLM2_135M, pad_token_id=-1), ignore=["pad_token_id"])
    assert (cfg.eos_token_ids, cfg.pad_token_id) == ((2,), None)
    with pytest.raises(ValueError, match=r"eos_token_ids=\(3, 61\) must hold token ids in "
                                         r"\[0, 61\)"):
        LlamaConfig(vocab_size=61, eos_token_ids=(3, 61))
    assert LlamaConfig(vocab_size=61, eos_token_ids=np.int64(3)).eos_token_ids == (3,)


def test_mistral_window_defaults_like_transformers():
    """MistralConfig's sliding_window is 4096 when config.json leaves it out; null is none."""
    hf = hf_json("mistral")
    assert LlamaConfig.from_hf({k: v for k, v in hf.items() if k != "sliding_window"}
                               ).window == (4095, 0)
    assert LlamaConfig.from_hf(dict(hf, sliding_window=None)).window is None


def test_qwen2_sliding_windows():
    hf = hf_json("qwen2")
    per_layer = dict(hf, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    per_layer.pop("layer_types")
    with pytest.raises(ValueError, match="use_sliding_window=True with max_window_layers=1"):
        LlamaConfig.from_hf(per_layer)
    mixed = dict(hf, use_sliding_window=True, sliding_window=16,
                 layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ValueError, match="per-layer windows are not supported"):
        LlamaConfig.from_hf(mixed)
    every = dict(per_layer, max_window_layers=0)
    assert LlamaConfig.from_hf(every).window == (15, 0)
    assert LlamaConfig.from_hf(dict(every, use_sliding_window=False)).window is None
    cfg = LlamaConfig.from_hf(every)
    assert LlamaConfig.from_hf(cfg.to_hf()) == cfg


def test_to_hf_refuses_what_an_architecture_cannot_express():
    cfg = LlamaConfig(vocab_size=16, window=(7, 0))
    assert cfg.to_hf()["architectures"] == ["MistralForCausalLM"]
    assert cfg.to_hf()["sliding_window"] == 8
    with pytest.raises(ValueError, match="window=.*LlamaForCausalLM"):
        cfg.to_hf("LlamaForCausalLM")
    with pytest.raises(ValueError, match="mlp_bias=True cannot be written as Mistral"):
        LlamaConfig(vocab_size=16, mlp_bias=True).to_hf("MistralForCausalLM")
    with pytest.raises(ValueError, match="attention_out_bias"):
        LlamaConfig(vocab_size=16, attention_bias=True, mlp_bias=True).to_hf()
    with pytest.raises(ValueError, match="architecture='Foo'"):
        LlamaConfig(vocab_size=16).to_hf("Foo")


# --------------------------------------------------------------------------- logits
@pytest.mark.parametrize("name", NAMES)
def test_logits_one_device(name):
    r = ref(name)
    cfg, params = load_pretrained(os.path.join(FIX, name), dtype="float32")
    first = {jax.local_devices()[0]}
    assert all(x.sharding.device_set == first for x in jax.tree.leaves(params))
    assert_close(logits(cfg, params, r["input_ids"]), r["logits"], TOL, name)


@pytest.mark.parametrize("name, layout", [(n, "zigzag") for n in NAMES] + [
    ("mistral", "striped")])   # striped layouts of the model itself: tests/test_llama.py
def test_logits_on_a_mesh(name, layout):
    """FSDP-loaded onto 4 devices, run sequence-parallel: every fixture's 64 tokens cross
    the shards (8 zigzag chunks), at half the compile time of 8 devices' ring."""
    r = ref(name)
    mesh = auto_mesh(4)
    cfg, params = load_pretrained(os.path.join(FIX, name), mesh=mesh, dtype="float32")
    assert_close(logits(cfg, params, r["input_ids"], mesh, layout), r["logits"], TOL,
                 f"{name} {layout}")


def test_dynamic_ntk_at_a_stated_length_and_scaling_matters():
    """transformers' dynamic NTK recomputes its frequencies for a 64-token input when
    max_position_embeddings=32; ours, computed once for seq_len=64, gives its logits.
    Ignoring the scaling of a llama3 checkpoint is far off (the test is not vacuous)."""
    r = ref("llama_dynamic")
    stated = RopeScaling("dynamic", 4.0, original_max_position_embeddings=32, seq_len=64)
    cfg, params = load_pretrained(os.path.join(FIX, "llama_dynamic"), dtype="float32",
                                  rope_scaling=stated)
    assert_close(logits(cfg, params, r["input_ids"]), r["logits_dynamic_long"], TOL, "dyn")
    r = ref("llama_llama3")
    cfg, params = load_pretrained(os.path.join(FIX, "llama_llama3"), dtype="float32",
                                  rope_scaling=None)
    err = np.linalg.norm(np.asarray(logits(cfg, params, r["input_ids"])) - r["logits"])
    assert err / np.linalg.norm(r["logits"]) > 1e-3


# --------------------------------------------------------------------------- files
def test_multi_file_checkpoint_is_read_by_its_index():
    path = os.path.join(FIX, "llama_plain")
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert len(files) == 3 and os.path.exists(os.path.join(path,
                                                           "model.safetensors.index.json"))
    tensors = checkpoint_tensors(path)
    assert {os.path.basename(t.file) for t in tensors.values()} == set(files)
    _, params = load_pretrained(path, dtype="float32")
    with safe_open(os.path.join(path, "model-00003-of-00003.safetensors"), "numpy") as f:
        name = next(n for n in f.keys() if n.endswith("down_proj.weight"))
        layer = name.split(".")[2]
        np.testing.assert_array_equal(
            np.asarray(params["params"][f"layer_{layer}"]["mlp"]["down_proj"]["kernel"]),
            f.get_tensor(name).T)


def random_params(cfg, seed=0):
    rng = np.random.default_rng(seed)
    flat = {k: rng.standard_normal(e.shape).astype(np.float32)
            for k, e in tensor_map(cfg).items()}
    from flax.traverse_util import unflatten_dict
    return {"params": unflatten_dict(flat)}


def test_fsdp_and_replicated_shardings_and_round_trip(tmp_path):
    """A checkpoint large enough to be split: every tensor on its FSDP sharding (no device
    holds a whole sharded tensor), or replicated; values equal to what was saved."""
    cfg = LlamaConfig(vocab_size=512, d_model=128, num_layers=1, num_heads=4, num_kv_heads=2,
                      ffn_dim=256, attention_bias=True, max_position_embeddings=4096)
    params = random_params(cfg)
    save_pretrained(cfg, params, tmp_path, max_shard_size="200KB")
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    mesh = auto_mesh()
    loaded_cfg, fsdp = load_pretrained(tmp_path, mesh=mesh, dtype="float32")
    assert loaded_cfg == cfg
    _, repl = load_pretrained(tmp_path, mesh=mesh, dtype="float32", params="replicated")
    want = fsdp_shardings(params, mesh, "sp")
    split = 0
    for x, r, w, s in zip(jax.tree.leaves(fsdp), jax.tree.leaves(repl),
                          jax.tree.leaves(params), jax.tree.leaves(want)):
        assert x.sharding.spec == s.spec and x.sharding.mesh == mesh
        assert r.sharding.is_fully_replicated and len(r.sharding.device_set) == 8
        if s.spec != P(*[None] * x.ndim):
            split += 1
            assert all(sh.data.size * 8 == x.size for sh in x.addressable_shards)
        np.testing.assert_array_equal(np.asarray(x), w)
        np.testing.assert_array_equal(np.asarray(r), w)
    assert split >= 4  # embedding, lm_head and the MLP kernels at least


def test_save_round_trip_in_hf_names(tmp_path):
    """Saved files hold transformers' names and layouts (read back by safetensors
    itself), the config survives, and loading gives the same parameters."""
    for name in ("qwen2", "llama32_tied", "llama_bias"):
        src = os.path.join(FIX, name)
        cfg, params = load_pretrained(src, dtype="float32")
        out = tmp_path / name
        save_pretrained(cfg, params, out)
        assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
        saved, orig = load_file(out / "model.safetensors"), {}
        for t in checkpoint_tensors(src):
            with safe_open(checkpoint_tensors(src)[t].file, "numpy") as f:
                orig[t] = f.get_tensor(t)
        assert saved.keys() == orig.keys(), name
        for t in saved:
            np.testing.assert_array_equal(saved[t], orig[t], err_msg=f"{name} {t}")
        cfg2, params2 = load_pretrained(out, dtype="float32")
        assert cfg2 == cfg
        jax.tree.map(np.testing.assert_array_equal, params2, params)
    # bf16 on disk: read back (converted) by our reader and by safetensors' jax reader
    save_pretrained(cfg, params, tmp_path / "bf16", dtype="bfloat16")
    with open(tmp_path / "bf16" / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    _, p16 = load_pretrained(tmp_path / "bf16", dtype="float32")
    k = params["params"]["embed"]["embedding"]
    np.testing.assert_array_equal(np.asarray(p16["params"]["embed"]["embedding"]),
                                  np.asarray(k.astype(jnp.bfloat16).astype(jnp.float32)))
    with safe_open(tmp_path / "bf16" / "model.safetensors", "flax") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == jnp.bfloat16


def test_save_refuses_a_tree_that_is_not_the_config(tmp_path):
    cfg = LlamaConfig(vocab_size=32, d_model=16, num_heads=2, num_kv_heads=1, num_layers=1)
    params = random_params(cfg)
    with pytest.raises(ValueError, match="parameter lm_head/kernel is not a parameter"):
        save_pretrained(dataclasses.replace(cfg, tie_embeddings=True), params, tmp_path)
    with pytest.raises(ValueError, match="parameter layer_0/attn/q_proj/bias .* missing"):
        save_pretrained(dataclasses.replace(cfg, attention_bias=True), params, tmp_path)
    with pytest.raises(ValueError, match="max_shard_size='lots'"):
        save_pretrained(cfg, params, tmp_path, max_shard_size="lots")


# --------------------------------------------------------------------------- bad inputs
def edited_copy(tmp_path, name, edit):
    """A copy of fixture ``name`` whose one-file tensors dict is passed through ``edit``."""
    dst = tmp_path / name
    shutil.copytree(os.path.join(FIX, name), dst)
    tensors = load_file(dst / "model.safetensors")
    save_file(edit(tensors), dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_extra_and_misshapen_tensors_are_named(tmp_path):
    up = "model.layers.1.mlp.up_proj.weight"

    def drop(t):
        del t[up]
        return t

    with pytest.raises(ValueError, match=f"tensor {up} is missing"):
        load_pretrained(edited_copy(tmp_path / "a", "qwen2", drop))
    with pytest.raises(ValueError, match="unexpected tensor model.layers.2.mlp.up_proj.weight"
                                         ".*num_hidden_layers=2"):
        load_pretrained(edited_copy(tmp_path / "b", "qwen2",
                                    lambda t: {**t, up.replace(".1.", ".2."): t[up]}))
    with pytest.raises(ValueError, match=f"tensor {up} in model.safetensors has shape "
                                         r"\[96, 32\]; config.json \(intermediate_size"):
        load_pretrained(edited_copy(tmp_path / "c", "qwen2",
                                    lambda t: {**t, up: t[up][:, :32].copy()}))
    with pytest.raises(ValueError, match="unexpected tensor model.layers.0.mlp.up_proj.bias"
                                         ".*mlp_bias=False"):
        load_pretrained(edited_copy(tmp_path / "d", "qwen2",
                                    lambda t: {**t, "model.layers.0.mlp.up_proj.bias":
                                               np.zeros(96, np.float32)}))
    # a stored lm_head of a tied model and rotary buffers are skipped, as in transformers
    tied = edited_copy(tmp_path / "e", "llama32_tied", lambda t: {
        **t, "lm_head.weight": t["model.embed_tokens.weight"],
        "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(16, np.float32)})
    load_pretrained(tied)


def test_bad_directories_and_arguments(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_pretrained(tmp_path)
    shutil.copy(os.path.join(FIX, "qwen2", "config.json"), tmp_path / "config.json")
    with pytest.raises(ValueError, match="neither model.safetensors nor"):
        load_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"config overrides \['num_experts'\]"):
        load_pretrained(os.path.join(FIX, "qwen2"), num_experts=8)
    with pytest.raises(ValueError, match="params='zero'"):
        load_pretrained(os.path.join(FIX, "qwen2"), mesh=auto_mesh(), params="zero")
    src = os.path.join(FIX, "llama_plain")
    bad = tmp_path / "idx"
    shutil.copytree(src, bad)
    with open(bad / "model.safetensors.index.json") as f:
        index = json.load(f)
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00003.safetensors"
    with open(bad / "model.safetensors.index.json", "w") as f:
        json.dump(index, f)
    with pytest.raises(ValueError, match="lists tensor model.norm.weight in "
                                         "model-00001-of-00003.safetensors, which does not"):
        load_pretrained(bad)
    hf = hf_json("qwen2")
    assert config_from_hf(dict(hf, my_note="x"), ignore=["my_note"]) == \
        LlamaConfig.from_hf(hf)


def test_hf_load_benchmark_tiny(tmp_path, monkeypatch, capsys):
    """``benchmarks/hf_load.py`` writes a checkpoint, loads it in a fresh process and
    reports host memory against the target."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import hf_load

    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert hf_load.main(["--shape", "tiny", "--dir", str(tmp_path / "ckpt"), "--devices",
                         "2"]) == 0
    out = capsys.readouterr().out
    assert "loader transient peak" in out and "OK" in out
    with open(tmp_path / "out" / "hf_load_tiny_cpu2_fsdp_float32.json") as f:
        row = json.load(f)
    assert row["parameters"] > 0 and row["peak_rss"] >= row["rss_before"] > 0
    assert not os.path.exists(tmp_path / "ckpt")


@pytest.mark.multiprocess
def test_two_processes_load_and_save(tmp_path):
    """2 processes x 4 devices: each process reads only its devices' slices, save
    gathers each tensor from both and process 0 writes files equal to the source."""
    cfg = LlamaConfig(vocab_size=512, d_model=128, num_layers=1, num_heads=4, num_kv_heads=2,
                      ffn_dim=256, max_position_embeddings=4096)
    save_pretrained(cfg, random_params(cfg, 5), tmp_path / "src")
    tests = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(tests)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_SEQPAR_", "SLURM_", "OMPI_", "JAX_COORDINATOR"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
        [repo, tests] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])))
    r = subprocess.run([sys.executable, "-m", "jax_seqpar", "launch", "--num-processes", "2",
                        "--devices-per-process", "4", "--timeout", f"{seconds(150):g}", "--",
                        sys.executable, "-c", "import sys, mp_worker_hf as w; "
                        "sys.exit(w.main(sys.argv[1], sys.argv[2]))",
                        str(tmp_path / "src"), str(tmp_path / "dst")],
                       cwd=repo, env=env, capture_output=True, text=True, timeout=seconds(170))
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    assert "[p1] process 1 of 2 saved" in r.stdout
    src, dst = checkpoint_tensors(tmp_path / "src"), checkpoint_tensors(tmp_path / "dst")
    assert src.keys() == dst.keys() and len({t.file for t in dst.values()}) > 1
    for name in src:
        with safe_open(src[name].file, "numpy") as f, safe_open(dst[name].file, "numpy") as g:
            np.testing.assert_array_equal(f.get_tensor(name), g.get_tensor(name), name)


# --------------------------------------------------------------------------- scanned
SCANNED = ["llama_plain", "llama32_tied", "llama_bias", "qwen2"]  # index, tied, biases


def test_scanned_load_gives_transformers_logits_on_one_device():
    """``scan_layers=True``: the stacked parameters (``layers``, every leaf ``[L, ...]``)
    equal ``stack_layers`` of the unrolled load, on the first device, and the scanned
    model gives transformers' logits."""
    from jax_seqpar.models.stacking import stack_layers

    first = {jax.local_devices()[0]}
    for name in SCANNED:
        r = ref(name)
        cfg, params = load_pretrained(os.path.join(FIX, name), dtype="float32",
                                      scan_layers=True)
        assert cfg.scan_layers and set(params["params"]) >= {"layers"}
        assert not any(k.startswith("layer_") for k in params["params"]), name
        assert all(x.sharding.device_set == first for x in jax.tree.leaves(params))
        _, unrolled = load_pretrained(os.path.join(FIX, name), dtype="float32")
        want = stack_layers(unrolled)
        assert jax.tree.structure(params) == jax.tree.structure(want), name
        jax.tree.map(np.testing.assert_array_equal, params, want)
        assert_close(logits(cfg, params, r["input_ids"]), r["logits"], TOL, f"{name} scanned")


@pytest.mark.parametrize("name, placement", [("llama_plain", "fsdp"),
                                             ("qwen2", "data2_seq2_tensor2")])
def test_scanned_load_gives_transformers_logits_on_a_mesh(name, placement):
    """The scanned form on 8 devices: FSDP over one axis (zigzag), and the logical rules
    of data 2 x sequence 2 x tensor 2, where every stacked parameter lands on the
    sharding the scanned model gives it (its layer axis unsplit)."""
    from jax_seqpar.sharding.parallelism import make_mesh

    r = ref(name)
    path = os.path.join(FIX, name)
    if placement == "fsdp":
        cfg, params = load_pretrained(path, mesh=auto_mesh(), dtype="float32",
                                      scan_layers=True)
        out = logits(cfg, params, r["input_ids"], auto_mesh())
    else:
        mesh, par = make_mesh(dict(data=2, sequence=2, tensor=2))
        cfg, params = load_pretrained(path, mesh=mesh, parallelism=par, dtype="float32",
                                      scan_layers=True)
        model = Llama(cfg, mesh=mesh, parallelism=par)
        ids = jnp.asarray(np.concatenate([r["input_ids"]] * 2))  # the data axis splits it
        want = model.param_shardings(jax.random.key(0), ids)
        assert jax.tree.structure(params) == jax.tree.structure(want)
        for got, w in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
            assert got.sharding == w
        stacked = jax.tree.leaves(params["params"]["layers"])
        assert all(x.sharding.spec[0] is None for x in stacked)
        assert any(set(x.sharding.spec) - {None} for x in stacked)  # the rules split some
        out = jax.jit(model.apply)(params, ids)[: len(r["input_ids"])]
    assert params["params"]["layers"]["mlp"]["up_proj"]["kernel"].shape == (2, 64, 96)
    assert_close(out, r["logits"], TOL, f"{name} scanned {placement}")


def test_scanned_fsdp_placement_streams_and_saves_the_same_files(tmp_path, monkeypatch):
    """A 2-layer checkpoint large enough to be split, loaded scanned onto FSDP over 8
    devices: every stacked parameter on ``fsdp_shardings`` of the stacked tree (layer axis
    never split), each read of a split one a device's slice (1/8 of every layer's tensor,
    written into its slot), values ``stack_layers`` of what was saved; replicated too.
    ``save_pretrained`` of the scanned parameters writes the same files, byte for byte, as
    saving the unrolled ones (one layer gathered at a time)."""
    import jax_seqpar.models.param_stream as param_stream
    from jax_seqpar.models.stacking import stack_layers

    cfg = LlamaConfig(vocab_size=512, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2,
                      ffn_dim=256, attention_bias=True, max_position_embeddings=4096)
    params = random_params(cfg, 3)
    save_pretrained(cfg, params, tmp_path / "unrolled", max_shard_size="300KB")
    reads = []
    real_read = param_stream.read_slice

    def spy(info, view=None, index=()):
        out = real_read(info, view, index)
        reads.append((os.path.basename(info.file), info.offset, out.size,
                      int(np.prod(info.shape))))
        return out

    monkeypatch.setattr(param_stream, "read_slice", spy)
    mesh = auto_mesh()
    loaded_cfg, scanned = load_pretrained(tmp_path / "unrolled", mesh=mesh, dtype="float32",
                                          scan_layers=True)
    monkeypatch.setattr(param_stream, "read_slice", real_read)
    assert loaded_cfg == dataclasses.replace(cfg, scan_layers=True)
    want = stack_layers(params)
    shardings = fsdp_shardings(want, mesh, "sp")
    assert jax.tree.structure(scanned) == jax.tree.structure(want)
    split = 0
    for x, w, s in zip(jax.tree.leaves(scanned), jax.tree.leaves(want),
                       jax.tree.leaves(shardings)):
        assert x.sharding == s
        np.testing.assert_array_equal(np.asarray(x), w)
    for x in jax.tree.leaves(scanned["params"]["layers"]):
        assert x.shape[0] == 2 and x.sharding.spec[0] is None
        if set(x.sharding.spec) != {None}:
            split += 1
            assert all(sh.data.size * 8 == x.size for sh in x.addressable_shards)
    assert split >= 4  # q/k/v/o and the MLP kernels
    # a split tensor is read in device slices, never whole (norms / biases are replicated)
    whole = {(f, off) for f, off, n, total in reads if n == total}
    sliced = {(f, off) for f, off, n, total in reads if n * 8 == total}
    assert len(sliced) >= 2 * split and not whole & sliced
    _, repl = load_pretrained(tmp_path / "unrolled", mesh=mesh, dtype="float32",
                              params="replicated", scan_layers=True)
    for x, w in zip(jax.tree.leaves(repl), jax.tree.leaves(want)):
        assert x.sharding.is_fully_replicated and len(x.sharding.device_set) == 8
        np.testing.assert_array_equal(np.asarray(x), w)

    save_pretrained(loaded_cfg, scanned, tmp_path / "scanned", max_shard_size="300KB")
    files = sorted(os.listdir(tmp_path / "unrolled"))
    assert len(files) > 3 and sorted(os.listdir(tmp_path / "scanned")) == files
    for f in files:
        with open(tmp_path / "unrolled" / f, "rb") as a, open(tmp_path / "scanned" / f,
                                                               "rb") as b:
            assert a.read() == b.read(), f


def test_save_refuses_a_stacked_tree_that_is_not_the_config(tmp_path):
    from jax_seqpar.models.stacking import stack_layers, unstack_layers

    cfg = LlamaConfig(vocab_size=32, d_model=16, num_heads=2, num_kv_heads=1, num_layers=2)
    scanned = stack_layers(random_params(cfg))
    with pytest.raises(ValueError, match=r"parameter layers/attn_norm/scale has shape "
                                         r"\(2, 16\); the config gives \(3, 16\) "
                                         r"\(num_layers=3 stacked layers of \(16,\)\)"):
        save_pretrained(dataclasses.replace(cfg, num_layers=3), scanned, tmp_path)
    with pytest.raises(ValueError, match=r"parameter layers/attn/q_proj/bias \("
                                         r"model.layers.0.self_attn.q_proj.bias .. "
                                         r"model.layers.1.self_attn.q_proj.bias\) is missing"):
        save_pretrained(dataclasses.replace(cfg, attention_bias=True), scanned, tmp_path)
    both = {"params": {**scanned["params"], "layer_0": unstack_layers(scanned)["params"]
                       ["layer_0"]}}
    with pytest.raises(ValueError, match=r"parameter layer_0/.* not a parameter .*either "
                                         r"layer_i or layers"):
        save_pretrained(cfg, both, tmp_path)


def test_load_pretrained_keeps_the_token_ids_generation_config_gives(tmp_path):
    """config.json's ids, overridden by generation_config.json's where it states them
    (as transformers' generate reads them); the weights are read as before."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(os.path.join(FIX, "llama_plain"), ckpt)
    hf = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**hf, "bos_token_id": 1, "eos_token_id": 2}))
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    cfg, _ = load_pretrained(ckpt, dtype="float32")
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (1, (2, 7), None)
    (ckpt / "generation_config.json").unlink()
    assert load_pretrained(ckpt, dtype="float32")[0].eos_token_ids == (2,)
