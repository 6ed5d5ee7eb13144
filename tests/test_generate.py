"""Generation (``models.generate``): ring prefill + tree decoding with a striped KV cache.

* greedy tokens on 8 simulated devices equal one device's (float32), for a ragged batch
  whose prompts need several prefill passes; and both equal a plain greedy loop that runs
  the whole model (``Llama.apply``) on the growing sequence;
* transformers' greedy ``generate`` on the tiny reference checkpoints, token for token
  (``tests/fixtures/hf``, written by transformers; no torch here);
* the compiled decode step communicates one ``pmax`` and one ``psum`` per layer, with the
  bytes of Tree Attention Eq. 10-14, and no collective-permute / all-gather;
* stacked blocks (``LlamaConfig(scan_layers=True)``, the same numbers): the same tokens on
  one device and on 8; their prefill holds one block (one layer's ring collectives) and
  no second copy of the cache, which stays one array per layer;
* sampling, ``eos_id`` (the model's ``eos_token_ids`` by default, several ids, None),
  ``callback`` and every bad argument.
"""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from jax_seqpar.runtime.comm import collective_bytes
from jax_seqpar.models import Llama, LlamaConfig
from jax_seqpar.models.generate import CACHE_ALIGN, generate, generator_for, make_plan
from jax_seqpar.models.hf import load_pretrained
from jax_seqpar.models.sampling import sample_logits, top_k_mask, top_p_mask
from jax_seqpar.models.stacking import stack_layers

CFG = LlamaConfig(vocab_size=61, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2)
FIX = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
HF_NAMES = ["llama_plain", "llama_linear", "llama_dynamic", "llama_yarn", "llama_llama3",
            "llama32_tied", "llama_bias", "mistral", "qwen2"]


@functools.lru_cache(maxsize=None)
def mesh(G):
    return jax.make_mesh((G,), ("sp",), devices=jax.devices()[:G],
                         axis_types=(AxisType.Auto,))


@functools.lru_cache(maxsize=None)
def tiny():
    model = Llama(CFG)
    toks = jax.random.randint(jax.random.key(1), (3, 40), 0, CFG.vocab_size)
    return model, jax.jit(model.init)(jax.random.key(0), toks), np.asarray(toks)


LENGTHS = np.array([40, 13, 29])


def greedy_reference(model, params, prompt, n):
    """Greedy decoding by running the whole model on the growing sequence."""
    apply = jax.jit(model.apply)
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(jnp.argmax(apply(params, jnp.asarray([seq]))[0, -1])))
    return seq[len(prompt):]


def test_eight_devices_equal_one_device_and_the_plain_model():
    model, params, toks = tiny()
    one = generate(model, params, toks, max_new_tokens=7, prompt_lengths=LENGTHS)
    # 16-token prefill passes: 3 passes, the first by ring attention, the rest against
    # the cache written so far; rows end in different passes.
    eight = generate(model, params, toks, max_new_tokens=7, prompt_lengths=LENGTHS,
                     mesh=mesh(8), prefill_chunk=16)
    np.testing.assert_array_equal(np.asarray(one), np.asarray(eight))
    b = 1  # the shortest row, beyond its prompt the padding is someone else's tokens
    want = greedy_reference(model, params, toks[b, :LENGTHS[b]], 7)
    np.testing.assert_array_equal(np.asarray(one)[b], want)


def test_stacked_parameters_give_the_same_tokens():
    """The scanned model with the unrolled model's numbers stacked: the same greedy tokens
    on one device and on 8 in three prefill passes (the layer scan's ring pass and its
    passes against the cache)."""
    model, params, toks = tiny()
    one = generate(model, params, toks, max_new_tokens=7, prompt_lengths=LENGTHS)
    scanned = Llama(dataclasses.replace(CFG, scan_layers=True))
    stacked = stack_layers(params)
    for kw in ({}, dict(mesh=mesh(8), prefill_chunk=16)):
        out = generate(scanned, stacked, toks, max_new_tokens=7, prompt_lengths=LENGTHS, **kw)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(one), str(kw))
    with pytest.raises(ValueError, match="params hold 2 decoder blocks but the model's "
                                         "config has num_layers=3"):
        generate(Llama(dataclasses.replace(CFG, num_layers=3)), stacked, toks,
                 max_new_tokens=2)


def test_stacked_prefill_holds_one_block_and_one_cache_array_per_layer():
    """The prefill of 4 stacked blocks on 2 devices: one layer's ring permutes in its
    program (the unrolled one has 4 layers'), the cache comes out as 4 arrays per kind,
    and the program's temporary memory exceeds the unrolled one's by less than half the
    cache (one layer's pair and the prompt's rows, not a copy of the whole cache)."""
    cfg = dataclasses.replace(CFG, num_layers=4)
    B, W = 2, 64
    toks, lengths = jnp.zeros((B, W), jnp.int32), jnp.full((B,), W, jnp.int32)
    params = jax.jit(Llama(cfg).init)(jax.random.key(0), toks)
    gen = generator_for(Llama(dataclasses.replace(cfg, scan_layers=True)), (B, W), 8,
                        mesh=mesh(2), cache_len=1024)
    lowered = {name: gen.prefill.lower(p, toks, lengths)
               for name, p in (("unrolled", params), ("stacked", stack_layers(params)))}
    permutes = {k: lo.as_text().count("collective_permute") for k, lo in lowered.items()}
    assert permutes["stacked"] > 0 and permutes["unrolled"] == 4 * permutes["stacked"]
    _, cache = jax.eval_shape(gen.prefill, stack_layers(params), toks, lengths)
    assert [len(kind) for kind in cache] == [4, 4]
    assert {x.shape for x in jax.tree.leaves(cache)} == {(B, 1024, 2, CFG.head_dim)}
    cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    temp = {k: lo.compile().memory_analysis().temp_size_in_bytes for k, lo in lowered.items()}
    # never a stacked copy of the whole cache; JAX 0.11+'s XLA adds under half of one
    # (JAX 0.10.2's: 0.58 of it, 734104 vs 125704 bytes against a 1048576-byte cache)
    old_xla = tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11)
    bound = cache_bytes if old_xla else cache_bytes / 2
    assert temp["stacked"] - temp["unrolled"] < bound, (temp, cache_bytes)


def test_hf_reference_checkpoints_generate_like_transformers():
    """Each checkpoint: its two prompts (7 and 21 tokens) as one ragged batch, greedy,
    8 new tokens, against transformers' greedy ``generate`` run on each prompt alone
    (Mistral's window of 16 is crossed by the 29-token second row)."""
    for name in HF_NAMES:
        r = np.load(os.path.join(FIX, f"{name}.npz"))
        cfg, params = load_pretrained(os.path.join(FIX, name), dtype="float32")
        p0, p1 = r["prompt_0"], r["prompt_1"]
        prompts = np.zeros((2, len(p1)), np.int32)
        prompts[0, :len(p0)], prompts[1] = p0, p1
        out = np.asarray(generate(Llama(cfg), params, prompts, max_new_tokens=8,
                                  prompt_lengths=np.array([len(p0), len(p1)])))
        np.testing.assert_array_equal(out[0], r["generated_0"][len(p0):], name)
        np.testing.assert_array_equal(out[1], r["generated_1"][len(p1):], name)


def test_decode_step_sends_one_pmax_and_one_psum_per_layer():
    model, params, _ = tiny()
    G, B = 8, 3
    gen = generator_for(model, (B, 40), 4, mesh=mesh(G))
    c, slots = CFG, gen.plan.cache_len
    cache = tuple(tuple(jnp.zeros((B, slots, c.num_kv_heads, c.head_dim))
                        for _ in range(c.num_layers)) for _ in range(2))
    report = collective_bytes(jax.jit(gen.step), params, jnp.zeros((B,), jnp.int32),
                              jnp.full((B,), 41, jnp.int32), cache)
    counts = report.count_by_kind()
    assert counts == {"all-reduce": 2 * c.num_layers}, report.summary()
    # Eq. 10-14: pmax of lse [B, Hq, 1] and one fused psum of [B, 1, Hq, D + 1] per layer
    per_layer = 2 * (G - 1) / G * 4 * (B * c.num_heads + B * c.num_heads * (c.head_dim + 1))
    assert report.total_bytes == pytest.approx(c.num_layers * per_layer, rel=1e-6)


def test_ring_and_allgather_decoding_give_the_same_tokens_with_their_own_traffic():
    """The baselines of ``benchmarks/generate.py``: same tokens; the ring step permutes
    the cache shards (G - 1 hops per layer), the all-gather step gathers them."""
    model, params, toks = tiny()
    G, B = 4, 3
    tree = generate(model, params, toks, max_new_tokens=4, prompt_lengths=LENGTHS,
                    mesh=mesh(G))
    tree_gen = generator_for(model, (B, 40), 4, mesh=mesh(G),    # generate's own: compiled
                             max_prompt_len=int(LENGTHS.max()))
    p = tree_gen.replicate(params)
    for strategy, kind in (("ring", "collective-permute"), ("allgather", "all-gather")):
        gen = generator_for(model, (B, 40), 4, mesh=mesh(G), decode_strategy=strategy,
                            max_prompt_len=int(LENGTHS.max()))
        assert gen.plan == tree_gen.plan
        logits, cache = tree_gen.prefill(p, toks, jnp.asarray(LENGTHS))
        cache_copy = jax.tree.map(jnp.copy, cache)
        out, _ = gen.decode()(p, logits, jnp.asarray(LENGTHS), cache, jax.random.key(0))
        np.testing.assert_array_equal(np.asarray(out), np.asarray(tree), strategy)
        counts = collective_bytes(jax.jit(gen.step), p, jnp.zeros((B,), jnp.int32),
                                  jnp.asarray(LENGTHS), cache_copy).count_by_kind()
        assert counts.get(kind, 0) > 0 and "all-reduce" not in counts, (strategy, counts)
    with pytest.raises(ValueError, match="decode_strategy='star'"):
        generator_for(model, (B, 40), 4, decode_strategy="star")


def assert_stopped(out, free, ids):
    """``out`` is ``free`` up to each row's first token in ``ids``, then ``ids[0]``."""
    for b in range(len(free)):
        hits = np.flatnonzero(np.isin(free[b], ids))
        stop = hits[0] if hits.size else free.shape[1]
        np.testing.assert_array_equal(out[b, :stop + 1], free[b, :stop + 1])
        assert (out[b, stop + 1:] == ids[0]).all(), (b, out[b], ids)


def test_eos_stops_rows_and_fills_them():
    model, params, toks = tiny()
    kw = dict(max_new_tokens=6, prompt_lengths=LENGTHS)
    free = np.asarray(generate(model, params, toks, **kw))  # CFG has no eos_token_ids
    eos = int(free[0, 2])
    out = np.asarray(generate(model, params, toks, eos_id=eos, **kw))
    assert_stopped(out, free, [eos])
    # the model's eos_token_ids are the default; eos_id=None never stops.  The ids are
    # metadata: the same compiled programs as the model without them
    with_eos = Llama(dataclasses.replace(CFG, eos_token_ids=(eos,)))
    assert generator_for(with_eos, toks.shape, 6, max_prompt_len=int(LENGTHS.max())) is \
        generator_for(model, toks.shape, 6, max_prompt_len=int(LENGTHS.max()), eos_id=eos)
    np.testing.assert_array_equal(np.asarray(generate(with_eos, params, toks, **kw)), out)
    np.testing.assert_array_equal(
        np.asarray(generate(with_eos, params, toks, eos_id=None, **kw)), free)
    # two ids: each row stops at whichever comes first, filled with the first id
    second = next(int(t) for t in free[1] if t != eos)
    two = np.asarray(generate(with_eos, params, toks, eos_id=[eos, second], **kw))
    assert_stopped(two, free, [eos, second])
    assert (two != free).any() and (two != out).any()


def test_the_loop_ends_when_every_row_has_stopped_at_one_of_several_ids():
    model, params, toks = tiny()
    firsts = np.asarray(generate(model, params, toks, max_new_tokens=6,  # the eos test's
                                 prompt_lengths=LENGTHS))[:, 0]
    ids = list(dict.fromkeys(firsts.tolist()))[::-1]
    assert len(ids) > 1
    seen = []
    out = generate(Llama(dataclasses.replace(CFG, eos_token_ids=ids)), params, toks,
                   max_new_tokens=6, prompt_lengths=LENGTHS,
                   callback=lambda step, t: seen.append(step))
    out = np.asarray(jax.block_until_ready(out))
    np.testing.assert_array_equal(out[:, 0], firsts)
    assert (out[:, 1:] == ids[0]).all() and seen == [0]   # no step after the first token


def test_sampling_is_deterministic_per_key_and_streams_in_order():
    model, params, toks = tiny()
    kw = dict(max_new_tokens=5, prompt_lengths=LENGTHS, temperature=0.8, top_k=20,
              top_p=0.9, mesh=mesh(4))
    seen = []
    a = generate(model, params, toks, rng=jax.random.key(3),
                 callback=lambda step, t: seen.append((step, t.tolist())), **kw)
    a = np.asarray(jax.block_until_ready(a))
    b = np.asarray(generate(model, params, toks, rng=jax.random.key(3), **kw))
    c = np.asarray(generate(model, params, toks, rng=jax.random.key(4), **kw))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert [s for s, _ in seen] == list(range(5))
    np.testing.assert_array_equal(np.array([t for _, t in seen]).T, a)


def test_sampling_functions():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]]))
    key = jax.random.key(0)
    np.testing.assert_array_equal(sample_logits(logits, key), [0, 3])
    assert np.isinf(top_k_mask(logits, 2)).sum(axis=-1).tolist() == [2, 2]
    # nucleus of 0.7: {0.5, 0.3} and {0.4, 0.3}; p tiny keeps only the most likely
    kept = np.isfinite(top_p_mask(logits, 0.7))
    assert kept.tolist() == [[True, True, False, False], [False, False, True, True]]
    for _ in range(3):
        key, sub = jax.random.split(key)
        np.testing.assert_array_equal(
            sample_logits(logits, sub, temperature=1.0, top_p=1e-3), [0, 3])
        np.testing.assert_array_equal(
            sample_logits(logits, sub, temperature=2.0, top_k=1), [0, 3])
    draws = jax.vmap(lambda k: sample_logits(logits, k, temperature=1.0))(
        jax.random.split(jax.random.key(1), 4000))
    freq = np.bincount(np.asarray(draws[:, 0]), minlength=4) / 4000
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), "max_new_tokens=0"),
    (dict(cache_len=30), "prompts .40 tokens wide. are longer than cache_len=30"),
    (dict(cache_len=44), "no room for max_new_tokens=8"),
    (dict(cache_len=50, mesh_g=4), "cache_len=50 must be divisible by the 4 devices"),
    (dict(prefill_chunk=6, mesh_g=4), "prefill_chunk=6 must be a positive multiple"),
    (dict(prompt_lengths=np.array([3, 0, 2])), r"rows \[1\] do not"),
    (dict(prompt_lengths=np.array([3, 4])), "shape \\[batch\\]"),
    (dict(temperature=-1.0), "temperature=-1.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(top_k=0), "top_k=0"),
    (dict(eos_id=61), r"eos_id=61 is not a token id in \[0, 61\)"),
    (dict(eos_id=-1), "eos_id=-1 is not a token id"),
    (dict(eos_id=[3, 61]), r"eos_id=\[3, 61\] holds 61, which is not a token id"),
    (dict(eos_id=(3, True)), r"eos_id=\(3, True\) holds True"),
    (dict(eos_id="eos"), "eos_id='eos' is not a recognised option.*'model'"),
    (dict(prompts=np.zeros((3,), np.int32)), "prompts must be integer"),
])
def test_bad_arguments_name_themselves(kwargs, match):
    model, params, toks = tiny()
    kwargs = dict(kwargs)
    G = kwargs.pop("mesh_g", 1)
    prompts = kwargs.pop("prompts", toks)
    kwargs.setdefault("max_new_tokens", 8)
    with pytest.raises(ValueError, match=match):
        generate(model, params, prompts, mesh=mesh(G), **kwargs)


def test_plan_pads_prompts_to_whole_passes():
    plan = make_plan(2, 100, 10, 4, max_prompt_len=90, prefill_chunk=32)
    assert (plan.num_chunks, plan.padded_len, plan.cache_len) == (4, 128, 128)
    plan = make_plan(2, 100, 50, 4, max_prompt_len=100)       # 149 -> 38 slots -> 40
    assert (plan.num_chunks, plan.chunk, plan.cache_len) == (1, 100, 160)
    # long shards: whole blocks of CACHE_ALIGN slots (no padded copy in the kernel)
    plan = make_plan(1, 131072, 64, 1, max_prompt_len=131072)
    assert plan.cache_len == 131072 + CACHE_ALIGN
    assert make_plan(1, 4000, 64, 8, max_prompt_len=4000).cache_len == 8 * 512
