"""llama.cpp GGUF files (``jax_seqpar.models.gguf``, ``jax_seqpar.data.gguf_tokenizer``).

A tiny 2-layer Llama (d_model 64, 2 heads of 32, 1 KV head, FFN 256) is written with
``gguf.GGUFWriter`` as llama.cpp's converter writes it: q / k rows permuted
(``LlamaModel.permute``), each tensor in another ggml type (F32, F16, BF16, Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, Q4_K, Q6_K), a byte-level BPE vocabulary in the metadata.  The same
weights, quantized and dequantized (as float32), are written as a transformers
checkpoint: both loads give the same parameters, bit for bit, and the same logits, on one
device and on FSDP over 8 devices (unrolled and scanned).  The permutation is checked
against its definition and against ggml's RoPE on adjacent pairs; configs, errors and
tokenizers on small files of metadata.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from safetensors.numpy import save_file

gguf = pytest.importorskip("gguf")

from helpers import assert_close  # noqa: E402
from jax_seqpar.data.gguf_tokenizer import gguf_special_tokens, gguf_tokenizer  # noqa: E402
from jax_seqpar.data.tokenize import load_tokenizer  # noqa: E402
from jax_seqpar.layers.rope import RopeScaling, apply_rope, llama3_inv_freq  # noqa: E402
from jax_seqpar.models import Llama  # noqa: E402
from jax_seqpar.models import gguf as gg  # noqa: E402
from jax_seqpar.models.hf import load_pretrained  # noqa: E402
from jax_seqpar.models.stacking import stack_layers  # noqa: E402
from jax_seqpar.sharding.fsdp import fsdp_shardings  # noqa: E402

Q = gguf.GGMLQuantizationType
D, H, HKV, DH, F, L = 64, 2, 1, 32, 256, 2
#: ggml type of each tensor (per layer: layer 0, layer 1)
TYPES = {"token_embd": "Q8_0", "output": "Q4_0", "output_norm": "F32",
         "attn_norm": ("F32", "F32"), "ffn_norm": ("F32", "F32"),
         "attn_q": ("Q8_0", "F16"), "attn_k": ("Q4_0", "BF16"), "attn_v": ("Q4_1", "Q5_0"),
         "attn_output": ("F16", "Q5_1"), "ffn_gate": ("Q5_1", "F32"),
         "ffn_up": ("BF16", "Q8_0"), "ffn_down": ("Q4_K", "Q6_K")}
SPECIALS = ["<|begin|>", "<|end|>", "<|pad|>"]
MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("3", "4"),
          ("1", "2"), ("12", "3")]


def byte_vocab():
    """256 byte-level symbols, the merge products, a token no merge makes, specials."""
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = sorted(ByteLevel.alphabet())
    tokens += [a + b for a, b in MERGES] + ["xyz", "<tool>"] + SPECIALS
    types = [1] * (len(tokens) - 4) + [4] + [3] * 3
    return tokens, types


def add_tokenizer(w, pre="llama-bpe"):
    tokens, types = byte_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_bos_token_id(tokens.index("<|begin|>"))
    w.add_eos_token_id(tokens.index("<|end|>"))
    w.add_pad_token_id(tokens.index("<|pad|>"))
    w.add_chat_template("{{ messages }}")
    return len(tokens)


def write(path, arch="llama", tensors=(), meta=None, tokenizer=True, heads=(H, HKV)):
    """A GGUF file: the model metadata of the tiny model (``meta`` edits it: key ->
    value, None drops), a byte-level BPE vocabulary, ``tensors`` ``[(name, data,
    raw_type)]`` (data in stored order, innermost dimension last)."""
    w = gguf.GGUFWriter(str(path), arch)
    fields = {"context_length": 2048, "embedding_length": D, "block_count": L,
              "feed_forward_length": F, "attention.head_count": heads[0],
              "attention.head_count_kv": heads[1], "rope.freq_base": 10000.0,
              "attention.layer_norm_rms_epsilon": 1e-5, "rope.dimension_count": DH,
              "attention.key_length": DH}
    fields.update(meta or {})
    for key, value in fields.items():
        if value is None:
            continue
        add = {str: w.add_string, float: w.add_float32, bool: w.add_bool}.get(type(value),
                                                                               w.add_uint32)
        add(f"{arch}.{key}", value)
    if tokenizer:
        add_tokenizer(w, tokenizer if isinstance(tokenizer, str) else "llama-bpe")
    for name, data, raw in tensors:
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def k_quant_bytes(rng, rows, n, qtype):
    """Random blocks of a K-quant (gguf-py cannot quantize them) with sane scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, n // block, size), dtype=np.uint8)
    scale = np.array([1e-3, 5e-4] if qtype == Q.Q4_K else [1e-4], np.float16).view(np.uint8)
    if qtype == Q.Q4_K:
        raw[..., :4] = scale           # d, dmin first
    else:
        raw[..., -2:] = scale          # Q6_K: d last
    return raw.reshape(rows, -1)


def encode(rng, hf_w, qname, heads=None):
    """``(stored, raw_type, float32 expectation in transformers' order)``: the weight
    (rows permuted for q / k) in ggml type ``qname``; the expectation is that of the
    unpermuted rows (ggml quantizes within rows, so permuting commutes with it)."""
    qtype = Q[qname]
    if qname in ("Q4_K", "Q6_K"):
        raw = k_quant_bytes(rng, hf_w.shape[0], hf_w.shape[1], qtype)
        return raw, qtype, gguf.quants.dequantize(raw, qtype)
    stored = hf_w if heads is None else gg.permute_qk(hf_w, heads)
    if qname in ("F32", "F16"):
        dt = np.float32 if qname == "F32" else np.float16
        return stored.astype(dt), None, hf_w.astype(dt).astype(np.float32)
    return (gguf.quants.quantize(stored, qtype), qtype,
            gguf.quants.dequantize(gguf.quants.quantize(hf_w, qtype), qtype))


def model_tensors(rng, vocab, arch="llama", tied=False):
    """``([(gguf name, stored, raw)], {transformers name: float32 expectation})``."""
    shapes = {"attn_q": (H * DH, D), "attn_k": (HKV * DH, D), "attn_v": (HKV * DH, D),
              "attn_output": (D, H * DH), "ffn_gate": (F, D), "ffn_up": (F, D),
              "ffn_down": (D, F), "attn_norm": (D,), "ffn_norm": (D,)}
    names = [("token_embd.weight", (vocab, D), TYPES["token_embd"]),
             ("output_norm.weight", (D,), TYPES["output_norm"])]
    if not tied:
        names.append(("output.weight", (vocab, D), TYPES["output"]))
    for i in range(L):
        for key, shape in shapes.items():
            names.append((f"blk.{i}.{key}.weight", shape, TYPES[key][i]))
            if arch == "qwen2" and key in ("attn_q", "attn_k", "attn_v"):
                names.append((f"blk.{i}.{key}.bias", shape[:1], "F32"))
    out, want = [], {}
    for name, shape, qname in names:
        w = (rng.normal(size=shape) * (0.1 if len(shape) == 2 else 0.02)
             + (len(shape) == 1 and "bias" not in name)).astype(np.float32)
        heads = None
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = H if ".attn_q." in name else HKV
        stored, raw, expect = encode(rng, w, qname, heads)
        out.append((name, stored, raw))
        want[gg.hf_name(name)] = expect.reshape(shape)
    return out, want


def hf_dir(path, want, arch="LlamaForCausalLM", vocab=None, tied=False):
    """The same float weights as a transformers checkpoint directory."""
    tokens = byte_vocab()[0]
    config = {"architectures": [arch], "vocab_size": vocab, "hidden_size": D,
              "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": H,
              "num_key_value_heads": HKV, "head_dim": DH, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "max_position_embeddings": 2048,
              "tie_word_embeddings": tied, "bos_token_id": tokens.index("<|begin|>"),
              "eos_token_id": tokens.index("<|end|>"), "pad_token_id": tokens.index("<|pad|>")}
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file(want, str(path / "model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny quantized Llama GGUF and the same float weights as a checkpoint dir."""
    d = tmp_path_factory.mktemp("gguf")
    rng = np.random.default_rng(0)
    vocab = len(byte_vocab()[0])
    tensors, want = model_tensors(rng, vocab)
    return dict(gguf=write(d / "tiny.gguf", tensors=tensors), want=want, vocab=vocab,
                tensors=tensors, hf=hf_dir(d / "hf", want, vocab=vocab), dir=d)


@functools.lru_cache(maxsize=None)
def mesh8():
    return jax.make_mesh((8,), ("sp",), devices=jax.devices()[:8], axis_types=(AxisType.Auto,))


@functools.lru_cache(maxsize=None)
def apply_fn(cfg):
    return jax.jit(Llama(cfg).apply)


def host(tree):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def assert_same_tree(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


# --------------------------------------------------------------------------- weights
def test_quantized_gguf_loads_the_checkpoints_weights_and_logits(tiny, monkeypatch):
    """(a) Every parameter equals the dequantized, un-permuted weight bit for bit; the
    logits equal those of the float checkpoint; each tensor is dequantized once."""
    calls = []
    real = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize",
                        lambda data, qtype: calls.append(qtype.name) or real(data, qtype))
    cfg, params = gg.load_gguf(tiny["gguf"], dtype="float32")
    monkeypatch.setattr(gguf.quants, "dequantize", real)
    quantized = sorted(t.name for _, _, t in tiny["tensors"] if t is not None
                       and t.name not in ("BF16",))
    assert sorted(calls) == quantized
    ref_cfg, ref = load_pretrained(tiny["hf"], dtype="float32")
    assert cfg == ref_cfg
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.tie_embeddings) == (H, HKV, DH,
                                                                                   False)
    assert_same_tree(params, ref)
    # the embedding, as read: [vocab, d], rows in token order
    np.testing.assert_array_equal(np.asarray(params["params"]["embed"]["embedding"]),
                                  tiny["want"]["model.embed_tokens.weight"])
    ids = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 16)))
    out = apply_fn(cfg)(params, ids)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(apply_fn(cfg)(ref, ids)))
    assert np.isfinite(np.asarray(out)).all() and float(jnp.std(out)) > 1e-3
    # load_pretrained dispatches a .gguf path here
    _, again = load_pretrained(tiny["gguf"], dtype="float32")
    assert_same_tree(again, ref)


def test_fsdp_on_eight_devices_unrolled_and_scanned(tiny):
    """(a) FSDP over 8 devices: the same values on ``fsdp_shardings``; the scanned form
    (stacked layers, read layer by layer) too; bf16 parameters converted on the devices."""
    mesh = mesh8()
    _, ref = load_pretrained(tiny["hf"], dtype="float32")
    cfg, params = gg.load_gguf(tiny["gguf"], mesh=mesh, params="fsdp", dtype="float32")
    assert_same_tree(params, ref)
    shardings = fsdp_shardings(ref, mesh, "sp")
    split = 0
    for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)):
        assert x.sharding == s
        split += len(set(s.spec) - {None}) > 0
    assert split >= 8
    ids = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 16)))
    out = jax.jit(Llama(cfg, mesh=mesh, layout="zigzag").apply)(params, ids)
    assert_close(out, apply_fn(cfg)(ref, ids), 1e-5, "8-device logits")
    scfg, scanned = gg.load_gguf(tiny["gguf"], mesh=mesh, params="fsdp", dtype="float32",
                                 scan_layers=True)
    assert scfg.scan_layers and "layers" in scanned["params"]
    assert_same_tree(scanned, stack_layers(host(ref)))
    # the same layer-by-layer read of stacked parameters serves safetensors files
    assert_same_tree(load_pretrained(tiny["hf"], mesh=mesh, dtype="float32",
                                     scan_layers=True)[1], scanned)
    for x, s in zip(jax.tree.leaves(scanned), jax.tree.leaves(
            fsdp_shardings(stack_layers(host(ref)), mesh, "sp"))):
        assert x.sharding == s
    _, b16 = gg.load_gguf(tiny["gguf"], mesh=mesh, params="replicated",
                          param_dtype="bfloat16")
    for x, y in zip(jax.tree.leaves(b16), jax.tree.leaves(ref)):
        assert x.dtype == jnp.bfloat16 and x.sharding.is_fully_replicated
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y).astype(jnp.bfloat16))


def test_qwen2_biases_unpermuted_and_tied_embeddings(tmp_path):
    """(c) qwen2: q/k/v biases, q/k stored as transformers has them; no output.weight:
    tied embeddings."""
    rng = np.random.default_rng(2)
    vocab = len(byte_vocab()[0])
    tensors, want = model_tensors(rng, vocab, arch="qwen2", tied=True)
    path = write(tmp_path / "qwen.gguf", arch="qwen2", tensors=tensors)
    cfg, params = gg.load_gguf(path, dtype="float32")
    assert (cfg.attention_bias, cfg.attention_out_bias, cfg.mlp_bias) == (True, False, False)
    assert cfg.tie_embeddings and "lm_head" not in params["params"]
    ref_cfg, ref = load_pretrained(hf_dir(tmp_path / "hf", want, "Qwen2ForCausalLM", vocab,
                                          tied=True), dtype="float32")
    assert cfg == ref_cfg
    assert_same_tree(params, ref)


# --------------------------------------------------------------------------- permutation
def test_permutation_is_llama_cpps_and_its_inverse_is_exact():
    """(b) ``permute_qk`` is ``LlamaModel.permute``: stored row ``2j + s`` of a head is
    transformers' row ``s Dh/2 + j``; ``unpermute_qk`` inverts it on any array."""
    heads, dh = 3, 8
    rows = np.arange(heads * dh)
    got = gg.permute_qk(rows, heads)
    for h in range(heads):
        for j in range(dh // 2):
            for s in range(2):
                assert got[h * dh + 2 * j + s] == h * dh + s * dh // 2 + j
    x = np.random.default_rng(3).normal(size=(heads * dh, 5)).astype(np.float32)
    np.testing.assert_array_equal(gg.unpermute_qk(gg.permute_qk(x, heads), heads), x)
    np.testing.assert_array_equal(gg.permute_qk(gg.unpermute_qk(x, heads), heads), x)
    assert not np.array_equal(gg.permute_qk(x, heads), x)


def test_permuted_weights_under_ggml_rope_give_the_models_attention_scores():
    """(b) What the permutation is for: ggml's "normal" RoPE rotates adjacent pairs
    ``(2j, 2j+1)`` by ``pos * theta^(-2j/Dh)``; on the stored (permuted) q / k weights it
    gives the same scores ``q_i . k_j`` as this library's rotate-half RoPE on the
    un-permuted ones (which is what the loader hands the model)."""
    rng = np.random.default_rng(4)
    S, theta = 12, 10000.0
    x = rng.normal(size=(S, D)).astype(np.float32)
    wq = rng.normal(size=(H * DH, D)).astype(np.float32) / 8
    wk = rng.normal(size=(HKV * DH, D)).astype(np.float32) / 8
    pos = np.arange(S)

    def ggml_rope(y):             # [S, heads, Dh], pairs (2j, 2j+1)
        ang = pos[:, None] * theta ** (-np.arange(0, DH, 2) / DH)[None]
        c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
        a, b = y[..., 0::2], y[..., 1::2]
        out = np.empty_like(y, dtype=np.float64)
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
        return out

    def scores(q, k):             # GQA: every q head reads the one k head
        return np.einsum("qhd,kd->hqk", q, k[:, 0])

    q_st = (x @ gg.permute_qk(wq, H).T).reshape(S, H, DH).astype(np.float64)
    k_st = (x @ gg.permute_qk(wk, HKV).T).reshape(S, HKV, DH).astype(np.float64)
    want = scores(ggml_rope(q_st), ggml_rope(k_st))
    loaded_q, loaded_k = gg.unpermute_qk(gg.permute_qk(wq, H), H), \
        gg.unpermute_qk(gg.permute_qk(wk, HKV), HKV)
    q = apply_rope(jnp.asarray((x @ loaded_q.T).reshape(1, S, H, DH)), pos, theta)[0]
    k = apply_rope(jnp.asarray((x @ loaded_k.T).reshape(1, S, HKV, DH)), pos, theta)[0]
    got = scores(np.asarray(q, np.float64), np.asarray(k, np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # without un-permuting, the scores are another function
    q_bad = apply_rope(jnp.asarray(q_st.reshape(1, S, H, DH), jnp.float32), pos, theta)[0]
    k_bad = apply_rope(jnp.asarray(k_st.reshape(1, S, HKV, DH), jnp.float32), pos, theta)[0]
    assert np.abs(scores(np.asarray(q_bad), np.asarray(k_bad)) - want).max() > 1e-2


# --------------------------------------------------------------------------- config
def test_config_from_metadata_and_overrides(tmp_path):
    """(c) Every key, the RoPE scalings, the window, overrides as for config.json."""
    emb = [("token_embd.weight", np.zeros((4, D), np.float32), None)]
    cfg = gg.gguf_config(write(tmp_path / "a.gguf", tensors=emb), scan_layers=True,
                         rope_theta=5e5)
    assert (cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.ffn_dim, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.norm_eps, cfg.max_position_embeddings) == (
        len(byte_vocab()[0]), D, L, F, H, HKV, DH, 1e-5, 2048)
    assert cfg.tie_embeddings and cfg.scan_layers and cfg.rope_theta == 5e5
    assert cfg.window is None and cfg.rope_scaling is None
    tokens = byte_vocab()[0]
    hf_dict, arch = gg.hf_config_dict(gg.open_gguf(tmp_path / "a.gguf"))
    assert arch == "llama" and hf_dict["architectures"] == ["LlamaForCausalLM"]
    assert (hf_dict["bos_token_id"], hf_dict["eos_token_id"], hf_dict["pad_token_id"]) == (
        tokens.index("<|begin|>"), tokens.index("<|end|>"), tokens.index("<|pad|>"))
    yarn = gg.gguf_config(write(tmp_path / "y.gguf", tensors=emb, tokenizer=False, meta={
        "vocab_size": 7, "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
        "rope.scaling.original_context_length": 512, "attention.sliding_window": 16}))
    assert yarn.vocab_size == 7 and yarn.window == (15, 0)
    assert yarn.rope_scaling == RopeScaling("yarn", 4.0, original_max_position_embeddings=512)
    lin = gg.gguf_config(write(tmp_path / "l.gguf", "qwen2", emb, meta={
        "rope.scaling.type": "linear", "rope.scaling.factor": 2.0, "attention.key_length": None,
        "rope.dimension_count": None}))
    assert lin.rope_scaling == RopeScaling("linear", 2.0) and lin.head_dim == D // H
    assert lin.attention_bias and not lin.attention_out_bias
    # Llama 3.1: llama.cpp stores its frequency factors as rope_freqs.weight
    l3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8192)
    base = 10000.0 ** (-np.arange(0, DH, 2) / DH)
    freqs = (base / llama3_inv_freq(DH, 10000.0, **l3)).astype(np.float32)
    f = write(tmp_path / "r.gguf", tensors=emb + [("rope_freqs.weight", freqs, None)])
    assert gg.gguf_config(f).rope_scaling == RopeScaling("llama3", **l3)
    other = dict(l3, original_max_position_embeddings=64)
    freqs = (base / llama3_inv_freq(DH, 10000.0, **other)).astype(np.float32)
    f = write(tmp_path / "r2.gguf", tensors=emb + [("rope_freqs.weight", freqs, None)])
    with pytest.raises(ValueError, match="rope_freqs.weight.*is not rope_type='llama3'"):
        gg.gguf_config(f)
    assert gg.gguf_config(f, rope_scaling=dict(other, rope_type="llama3")).rope_scaling == \
        RopeScaling("llama3", **other)


@pytest.mark.parametrize("arch, meta, match", [
    ("gpt2", {}, r"general.architecture='gpt2' is not supported; supported: \['llama', "
                 r"'qwen2'\]"),
    ("llama", {"expert_count": 8}, "mixture-of-experts"),
    ("llama", {"attention.scale": 0.5}, r"\['llama.attention.scale'\].*ignore_fields"),
    ("llama", {"rope.dimension_count": 16}, "partial RoPE"),
    ("llama", {"rope.scaling.type": "longrope", "rope.scaling.factor": 2.0},
     "rope.scaling.type='longrope' is not supported"),
    ("llama", {"block_count": None}, "llama.block_count is missing"),
])
def test_unsupported_metadata_is_named(tmp_path, arch, meta, match):
    """(d) An unsupported architecture or key raises a ValueError naming it."""
    emb = [("token_embd.weight", np.zeros((4, D), np.float32), None)]
    with pytest.raises(ValueError, match=match):
        gg.gguf_config(write(tmp_path / "x.gguf", arch, emb, meta=meta))


def test_bad_tensors_are_named(tiny):
    """(d) An unsupported ggml type, a missing and an unexpected tensor."""
    d, tensors = tiny["dir"], tiny["tensors"]
    raw = np.zeros((D, D // 32 * gguf.GGML_QUANT_SIZES[Q.IQ4_NL][1]), np.uint8)
    bad = [t if t[0] != "blk.1.attn_q.weight" else (t[0], raw, Q.IQ4_NL) for t in tensors]
    with pytest.raises(ValueError, match="tensor blk.1.attn_q.weight in bad.gguf has ggml "
                                         "type IQ4_NL; supported: F32, F16, BF16, Q4_0"):
        gg.load_gguf(write(d / "bad.gguf", tensors=bad))
    missing = [t for t in tensors if t[0] != "blk.1.ffn_up.weight"]
    with pytest.raises(ValueError, match=r"tensor blk.1.ffn_up.weight \(model.layers.1.mlp."
                                         r"up_proj.weight\) is missing from missing.gguf"):
        gg.load_gguf(write(d / "missing.gguf", tensors=missing))
    extra = tensors + [("blk.0.attn_q_norm.weight", np.ones(DH, np.float32), None)]
    with pytest.raises(ValueError, match="unexpected tensor blk.0.attn_q_norm.weight in "
                                         "extra.gguf"):
        gg.load_gguf(write(d / "extra.gguf", tensors=extra))
    with pytest.raises(ValueError, match="no such GGUF file"):
        gg.load_gguf(d / "nope.gguf")


def test_every_listed_type_is_read_as_its_dequantization():
    """Each of ``QUANT_TYPES`` is a ggml type that gguf-py dequantizes: a row of 256 read
    through ``GGUFTensor`` (a stand-in for the reader's tensor) is that dequantization."""
    rng = np.random.default_rng(5)
    for name in gg.QUANT_TYPES:
        qtype = Q[name]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        # any bytes are blocks; below 64 the float16 scales are finite (exponent <= 15)
        raw = rng.integers(0, 64, (2, 256 // block * size), dtype=np.uint8)
        if name in ("F32", "F16"):
            raw = rng.normal(size=(2, 256)).astype(np.float32 if name == "F32" else np.float16)
        elif name == "BF16":
            raw = gguf.quants.quantize(rng.normal(size=(2, 256)).astype(np.float32), qtype)
        fake = type("T", (), dict(name="w", tensor_type=qtype, data=raw,
                                  shape=np.array([256, 2], np.uint64)))
        t = gg.GGUFTensor("f.gguf", fake)
        assert t.shape == (2, 256)
        want = gguf.quants.dequantize(raw, qtype).astype(np.float32)
        got = t.read((2, 256)).astype(np.float32)
        np.testing.assert_array_equal(got, want, err_msg=name)


# --------------------------------------------------------------------------- tokenizer
def test_byte_level_bpe_tokenizer(tiny, tmp_path):
    """(e) Merges, Llama 3's split (digits in threes) and whole-word vocabulary, specials
    and user-defined tokens whole, byte-level round trips; GPT-2's split for 'gpt-2'."""
    tokens = byte_vocab()[0]
    tok = gguf_tokenizer(tiny["gguf"])
    ids = {t: i for i, t in enumerate(tokens)}
    assert tok.vocab_size == len(tokens)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (ids["<|begin|>"], ids["<|end|>"],
                                                    ids["<|pad|>"])
    assert tok.chat_template == "{{ messages }}" and tok.special.add_bos
    assert tok.encode("hello world").tolist() == [ids[t] for t in
                                                  ["hello", "Ġw", "o", "r", "l", "d"]]
    assert tok.encode("<|begin|>hello<tool><|end|>").tolist() == [
        ids["<|begin|>"], ids["hello"], ids["<tool>"], ids["<|end|>"]]
    assert tok.encode("12345").tolist() == [ids["123"], ids["4"], ids["5"]]
    assert tok.encode("xyz").tolist() == [ids["xyz"]]
    text = "héllo wörld 😀 <|end|>\n 12"
    assert tok.decode(tok.encode(text)) == text
    # the library's API: load_tokenizer reads a .gguf too
    assert load_tokenizer(tiny["gguf"]).encode("hello").tolist() == [ids["hello"]]
    assert gguf_special_tokens(tiny["gguf"]).eos_id == ids["<|end|>"]
    emb = [("token_embd.weight", np.zeros((4, D), np.float32), None)]
    gpt2 = gguf_tokenizer(write(tmp_path / "g.gguf", tensors=emb, tokenizer="gpt-2"))
    assert gpt2.encode("12345").tolist() == [ids["12"], ids["34"], ids["5"]]
    assert gpt2.encode("xyz").tolist() == [ids["x"], ids["y"], ids["z"]]
    assert not gpt2.special.add_bos
    with pytest.raises(ValueError, match="tokenizer.ggml.pre='tekken' is not supported"):
        gguf_tokenizer(write(tmp_path / "t.gguf", tensors=emb, tokenizer="tekken"))


def test_sentencepiece_bpe_tokenizer_and_unsupported_models(tmp_path):
    """(e) ``llama`` vocabularies: merges from the scores, the space prefix, byte
    fallback for unknown characters, control tokens whole."""
    pieces = ["▁", "h", "e", "l", "o", "w", "he", "ll", "▁he", "llo", "▁hello"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-10.0] * 6 + [-1.0, -2.0, -3.0, -4.0, -5.0]
    w = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    tok = gguf_tokenizer(tmp_path / "spm.gguf")
    ids = {t: i for i, t in enumerate(tokens)}
    assert (tok.bos_id, tok.eos_id, tok.special.unk_id, tok.special.add_bos) == (1, 2, 0, True)
    assert tok.encode("hello").tolist() == [ids["▁hello"]]
    assert tok.encode("<s>hello hello").tolist() == [1, ids["▁hello"], ids["▁hello"]]
    got = tok.encode("héllo")
    assert got.tolist() == [ids["▁"], ids["h"], ids["<0xC3>"], ids["<0xA9>"], ids["llo"]]
    assert tok.decode(got) == "héllo" and tok.decode(tok.encode("hello wo")) == "hello wo"
    w = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "llama")
    w.add_tokenizer_model("bert")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model='bert' is not supported"):
        gguf_tokenizer(tmp_path / "bert.gguf")
