"""RoPE scaling (``layers/rope.py``): each type's inverse frequencies and attention
scaling against transformers' own RoPE initialisation (values committed by
``tests/fixtures/make_hf_fixtures.py``), the rotation with scaling, validation, and the
Linen / NNX layers with scaling and biases."""

import dataclasses
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import F32, assert_close
from jax_seqpar.layers import SeqParallelAttention, apply_rope
from jax_seqpar.layers import nnx as spnnx
from jax_seqpar.layers.rope import (RopeScaling, default_inv_freq, rope_frequencies,
                                    rope_parameters)
from jax_seqpar.models import LlamaConfig

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
CHECKPOINTS = ["llama_plain", "llama_linear", "llama_dynamic", "llama_yarn", "llama_llama3",
               "llama32_tied", "mistral", "qwen2"]


def check_inv_freq(got, want, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    err = np.max(np.abs(got - want) / np.abs(want))
    assert err <= 1e-6, f"{what}: inv_freq relative error {err:.2e}"


def case_config(case):
    """The LlamaConfig that config.json with this case's RoPE fields maps to."""
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "num_hidden_layers": 1,
          "hidden_size": 4 * case["head_dim"], "num_attention_heads": 4,
          "head_dim": case["head_dim"], "intermediate_size": 8,
          "max_position_embeddings": case["max_position_embeddings"],
          "rope_parameters": case["rope"]}
    cfg = LlamaConfig.from_hf(hf)
    if case["seq_len"] is not None:
        cfg = dataclasses.replace(cfg, rope_scaling=dataclasses.replace(
            cfg.rope_scaling, seq_len=case["seq_len"]))
    return cfg


def test_each_type_equals_transformers_initialisation():
    with open(os.path.join(FIX, "rope_cases.json")) as f:
        cases = json.load(f)
    ref = np.load(os.path.join(FIX, "rope_cases.npz"))
    types = set()
    for case in cases:
        name = case["name"]
        cfg = case_config(case)
        inv, scale = rope_parameters(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        check_inv_freq(inv, ref[f"{name}/inv_freq"], name)
        assert abs(scale - float(ref[f"{name}/attention_scaling"])) <= 1e-6 * scale, name
        plain = default_inv_freq(cfg.head_dim, cfg.rope_theta)
        moved = np.max(np.abs(inv - plain) / plain)
        # every scaled case moves the frequencies, but transformers' dynamic initialisation
        assert (moved < 1e-6) == (name.startswith(("default", "dynamic_init"))), name
        types.add(case["rope"]["rope_type"])
    assert types == {"default", "linear", "dynamic", "yarn", "llama3"}
    for name in CHECKPOINTS:
        r = np.load(os.path.join(FIX, f"{name}.npz"))
        with open(os.path.join(FIX, name, "config.json")) as f:
            cfg = LlamaConfig.from_hf(json.load(f))
        inv, scale = rope_parameters(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        check_inv_freq(inv, r["inv_freq"], name)
        assert abs(scale - float(r["attention_scaling"])) <= 1e-6, name
        if cfg.rope_scaling is None:  # the plain float32 path the model has always used
            check_inv_freq(rope_frequencies(cfg.head_dim, cfg.rope_theta), r["inv_freq"], name)


def test_apply_rope_with_scaling_is_the_scaled_rotation():
    B, S, H, D = 2, 16, 3, 16
    x = jax.random.normal(jax.random.key(0), (B, S, H, D), F32)
    pos = jnp.asarray(np.random.default_rng(0).integers(0, 5000, (B, S)), jnp.int32)
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512}
    inv, scale = rope_parameters(D, 10000.0, yarn)
    assert scale > 1
    ang = np.asarray(pos, np.float64)[..., None, None] * inv.astype(np.float64)  # B S 1 D/2
    c, s = np.cos(ang) * scale, np.sin(ang) * scale
    xn = np.asarray(x, np.float64)
    x1, x2 = xn[..., :D // 2], xn[..., D // 2:]
    want = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    assert_close(apply_rope(x, pos, 10000.0, yarn), want, 1e-5, "yarn rotation")
    assert_close(apply_rope(x, pos, 10000.0, RopeScaling.from_dict(yarn)), want, 1e-5, "obj")
    # no scaling: the unchanged plain path, bit for bit
    np.testing.assert_array_equal(np.asarray(apply_rope(x, pos, 500.0, None)),
                                  np.asarray(apply_rope(x, pos, 500.0)))


@pytest.mark.parametrize("kw, match", [
    (dict(rope_type="longrope", factor=2.0), "rope_type='longrope' is not supported"),
    (dict(rope_type="linear", factor=0.5), "factor=0.5 must be a number >= 1"),
    (dict(rope_type="yarn", factor=2.0), "original_max_position_embeddings is required"),
    (dict(rope_type="llama3", factor=8.0, original_max_position_embeddings=8192,
          low_freq_factor=4.0, high_freq_factor=1.0), "high_freq_factor=1.0 must be greater"),
    (dict(rope_type="dynamic", factor=2.0, original_max_position_embeddings=64,
          mscale=1.0), "mscale=1.0 is not used by rope_type='dynamic'"),
    (dict(rope_type="dynamic", factor=2.0, original_max_position_embeddings=64,
          seq_len=0), "seq_len=0 must be a positive int"),
])
def test_rope_scaling_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        RopeScaling(**kw)


def test_rope_scaling_dicts():
    d = {"type": "linear", "factor": 2}
    s = RopeScaling.from_dict(d)
    assert s == RopeScaling("linear", 2.0) and hash(s) == hash(RopeScaling("linear", 2.0))
    assert RopeScaling.from_dict({"rope_type": "default"}) is None
    assert LlamaConfig(vocab_size=8, rope_scaling=d).rope_scaling == s
    assert repr(s) == "RopeScaling(rope_type='linear', factor=2.0)"
    for bad, match in [({"rope_type": "linear"}, "factor is required"),
                       ({"rope_type": "linear", "factor": 2, "rope_theta": 1e4},
                        "set LlamaConfig.rope_theta"),
                       ({"rope_type": "linear", "factor": 2, "foo": 1}, r"\['foo'\]"),
                       ({"rope_type": "default", "factor": 2}, "rope_type='default'")]:
        with pytest.raises(ValueError, match=match):
            RopeScaling.from_dict(bad)
    with pytest.raises(TypeError, match="rope_scaling"):
        LlamaConfig(vocab_size=8, rope_scaling="yarn")


def test_linen_and_nnx_twins_with_biases_and_scaling():
    """q/k/v biases without an output bias (Qwen2), YaRN scaling: the same parameter tree
    and the same outputs from the Linen and the NNX layer (one device)."""
    DM, HQ, HKV, D = 32, 4, 2, 8
    yarn = RopeScaling("yarn", 4.0, original_max_position_embeddings=64)
    kw = dict(num_kv_heads=HKV, causal=True, rope_scaling=yarn, use_bias=True, out_bias=False)
    linen = SeqParallelAttention(num_heads=HQ, head_dim=D, **kw)
    x = jax.random.normal(jax.random.key(1), (2, 16, DM), F32)
    params = jax.jit(linen.init)(jax.random.key(0), x)["params"]
    params = jax.tree.map(lambda p: p + 0.1, params)  # biases are initialised to 0
    assert params["q_proj"]["bias"].shape == (HQ, D) and "bias" not in params["o_proj"]
    m = spnnx.SeqParallelAttention(DM, HQ, D, rngs=nnx.Rngs(0), **kw)
    assert m.o_proj.bias is None
    for name in params:
        for leaf, val in params[name].items():
            getattr(getattr(m, name), leaf)[...] = val
    chex.assert_trees_all_equal_shapes(
        params, {n: {k: getattr(getattr(m, n), k)[...] for k in params[n]} for n in params})
    out = linen.apply({"params": params}, x)
    assert_close(m(x), out, 1e-6, "nnx vs linen")
    plain = SeqParallelAttention(num_heads=HQ, head_dim=D, **dict(kw, rope_scaling=None))
    assert float(jnp.abs(plain.apply({"params": params}, x) - out).max()) > 1e-3
