"""Live parity with transformers: what ``save_pretrained`` writes, transformers'
``from_pretrained`` loads, and its logits equal ours (float32, <= 1e-5).

Needs the optional ``[hf]`` extra (``pip install -e ".[hf]"``: transformers and torch);
skipped without it.  The default suite checks the same mappings against committed
fixtures instead (``tests/test_hf.py``).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="live transformers parity needs the [hf] extra "
                                            "(pip install -e '.[hf]')")
transformers = pytest.importorskip("transformers", reason="live transformers parity needs "
                                                          "the [hf] extra")

from flax.traverse_util import unflatten_dict  # noqa: E402

from helpers import assert_close  # noqa: E402
from jax_seqpar.models import Llama, LlamaConfig  # noqa: E402
from jax_seqpar.models.hf import load_pretrained, save_pretrained, tensor_map  # noqa: E402

BODY = dict(vocab_size=96, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
            ffn_dim=80, norm_eps=1e-6, max_position_embeddings=131072)
CONFIGS = {
    "llama_biases": dict(attention_bias=True, attention_out_bias=True, mlp_bias=True),
    "llama32_like": dict(tie_embeddings=True, head_dim=32, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}),
    "yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 2048},
                 max_position_embeddings=8192),
    "linear": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mistral": dict(window=(11, 0), rope_theta=1e6),
    "qwen2": dict(attention_bias=True, rope_theta=1e6),
    "qwen2_sliding": dict(attention_bias=True, window=(11, 0)),
}


def random_params(cfg, seed=0):
    rng = np.random.default_rng(seed)
    flat = {}
    for key, e in tensor_map(cfg).items():
        x = rng.standard_normal(e.shape).astype(np.float32)
        flat[key] = (1 + 0.1 * x if key[-1] == "scale" else 0.5 * x if key[-1] == "embedding"
                     else 0.1 * x)
    return {"params": unflatten_dict(flat)}


def transformers_logits(path, ids, dtype=torch.float32):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=dtype).eval()
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids), dtype=torch.long)).logits.float().numpy(), model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_transformers_loads_what_we_save(name, tmp_path):
    cfg = LlamaConfig(**{**BODY, **CONFIGS[name]})
    params = random_params(cfg)
    save_pretrained(cfg, params, tmp_path, max_shard_size="60KB")
    ids = jax.random.randint(jax.random.key(1), (2, 48), 0, cfg.vocab_size)
    want, model = transformers_logits(tmp_path, ids)
    expected_arch = cfg.to_hf()["architectures"][0]
    assert type(model).__name__ == expected_arch
    ours = jax.jit(Llama(cfg).apply)(params, ids)
    assert_close(ours, want, 1e-5, f"{name}: logits vs transformers")
    # and it reads back into the same config
    cfg2, _ = load_pretrained(tmp_path, dtype="float32")
    assert cfg2 == cfg


def test_bfloat16_checkpoint_in_transformers(tmp_path):
    cfg = LlamaConfig(**BODY)
    params = random_params(cfg, 3)
    save_pretrained(cfg, params, tmp_path, dtype="bfloat16")
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    ids = jax.random.randint(jax.random.key(2), (1, 32), 0, cfg.vocab_size)
    want, model = transformers_logits(tmp_path, ids)   # upcast to float32 on load
    assert model.model.embed_tokens.weight.dtype == torch.float32
    _, p16 = load_pretrained(tmp_path, dtype="float32")
    assert_close(jax.jit(Llama(cfg).apply)(p16, ids), want, 1e-5, "bf16 weights")
    np.testing.assert_array_equal(
        np.asarray(p16["params"]["embed"]["embedding"]),
        np.asarray(jnp.asarray(params["params"]["embed"]["embedding"]).astype(jnp.bfloat16)
                   .astype(jnp.float32)))


@pytest.mark.parametrize("name", ["llama32_like", "mistral", "qwen2"])
def test_greedy_generation_equals_transformers_generate(name, tmp_path):
    """``models.generate`` (ring prefill, tree decoding, 2 devices) against transformers'
    greedy ``generate`` on the same saved checkpoint, token for token; the Mistral
    window (12) is crossed by the 40 tokens of prompt and continuation."""
    from jax.sharding import AxisType

    from jax_seqpar.models import generate

    cfg = LlamaConfig(**{**BODY, **CONFIGS[name]})
    save_pretrained(cfg, random_params(cfg, 5), tmp_path)
    _, model = transformers_logits(tmp_path, np.zeros((1, 4), np.int64))
    prompt = np.random.default_rng(7).integers(0, cfg.vocab_size, (1, 28))
    with torch.no_grad():
        ids = torch.tensor(prompt)         # an explicit mask: no token id counts as padding
        want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=12, min_new_tokens=12, eos_token_id=None,
                              pad_token_id=cfg.vocab_size - 1).numpy()[0, 28:]
    cfg2, params = load_pretrained(tmp_path, dtype="float32")
    mesh = jax.make_mesh((2,), ("sp",), devices=jax.devices()[:2],
                         axis_types=(AxisType.Auto,))
    ours = generate(Llama(cfg2), params, prompt, max_new_tokens=12, mesh=mesh)
    np.testing.assert_array_equal(np.asarray(ours)[0], want)
