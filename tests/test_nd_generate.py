"""Generation on N-D meshes (issue 38, deliverable 4): ``generate`` with a model's
``parallelism`` on 8 CPU devices.

* greedy tokens equal one device's, ragged prompts, on data 2 x sequence 2 x tensor 2,
  tensor 2 x sequence 4 (three prefill passes) and sequence 2 x tensor 4 (2 kv heads on a
  tensor axis of 4: the cache stores them repeated), and with biases and tied
  embeddings on the last one;
* the KV cache carries ``P(batch axes, sequence, tensor, None)`` and each device holds
  only its rows, positions and kv heads; the weights stay split over the tensor axis;
* the compiled decode step's bytes per mesh axis equal the formula of
  ``models.generate``'s docstring to the byte: the tree reduction on the sequence axis
  only, the row-split projections, the embedding and the logits on the tensor axis,
  nothing on the batch axes (and the prefill sends nothing on them either);
* heads the tensor axis cannot split (SmolLM2's 9 / 3 on tensor 2 x sequence 4): the
  one-device tokens, attention weights whole and the MLP / vocabulary split, the cache
  ``P(None, ("sequence", "tensor"), None, None)`` (its length over both axes, heads
  whole), and the decode step's tree reduction over both axes as one collective, to the
  byte;
* stacked blocks (``LlamaConfig(scan_layers=True)``, the same numbers) on tensor 2 x
  sequence 4, with the heads split and with them whole: the one-device tokens, the
  stacked weights split over the tensor axis with their layer axis whole (the layer
  index itself is ``test_generate.py``'s, with two blocks).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_seqpar.models import Llama, LlamaConfig
from jax_seqpar.models.generate import generate, generator_for
from jax_seqpar.models.stacking import stack_layers
from jax_seqpar.runtime.comm import collective_bytes, op_axes
from jax_seqpar.sharding.parallelism import make_mesh

CFG = LlamaConfig(vocab_size=128, d_model=64, num_layers=1, num_heads=4, num_kv_heads=2)
#: biases everywhere (o and down added once, after the tensor sum) and a tied head
BIAS_CFG = LlamaConfig(vocab_size=128, d_model=64, num_layers=1, num_heads=4,
                       num_kv_heads=2, attention_bias=True, attention_out_bias=True,
                       mlp_bias=True, tie_embeddings=True)
#: SmolLM2's 9 query / 3 kv heads: a tensor axis of 2 cannot split them
WHOLE_HEADS = LlamaConfig(vocab_size=96, d_model=144, num_layers=1, num_heads=9,
                          num_kv_heads=3, ffn_dim=96)
B, WIDTH, N = 4, 24, 6
LENGTHS = np.array([24, 7, 17, 12])

#: name: (mesh sizes, prefill_chunk, batch axis of the cache, cache kv heads)
MESHES = {
    "data2_seq2_tensor2": (dict(data=2, sequence=2, tensor=2), None, "data", 2),
    "tensor2_seq4": (dict(tensor=2, sequence=4), 8, None, 2),      # 3 prefill passes
    "seq2_tensor4": (dict(sequence=2, tensor=4), None, None, 4),   # kv heads repeated
}
#: the other factorizations of tests/test_nd_model.py: the tokens only
MORE_MESHES = {
    "seq8": (dict(sequence=8), None, None, 2),
    "data4_seq2": (dict(data=4, sequence=2), None, "data", 2),
    "fsdp2_seq2_tensor2": (dict(fsdp=2, sequence=2, tensor=2), None, "fsdp", 2),
}


@functools.lru_cache(maxsize=None)
def setup(cfg=CFG):
    """Parameters (biases made nonzero), ragged prompts and the one-device tokens."""
    params = jax.jit(Llama(cfg).init)(jax.random.key(0), jnp.zeros((B, WIDTH), jnp.int32))
    params = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(5), x.shape),
                          params)
    toks = np.asarray(jax.random.randint(jax.random.key(1), (B, WIDTH), 0, cfg.vocab_size))
    one = np.asarray(generate(Llama(cfg), params, toks, max_new_tokens=N,
                              prompt_lengths=LENGTHS))
    return params, toks, one


@functools.lru_cache(maxsize=None)
def nd(name, cfg=CFG):
    """The model on the named mesh, its generator (the one ``generate`` builds) and the
    parameters as the generator places them."""
    sizes, chunk, _, _ = {**MESHES, **MORE_MESHES}[name]
    mesh, par = make_mesh(sizes)
    model = Llama(cfg, mesh=mesh, parallelism=par)
    gen = generator_for(model, (B, WIDTH), N, max_prompt_len=int(LENGTHS.max()),
                        prefill_chunk=chunk)
    return mesh, model, gen, gen.replicate(setup(cfg)[0])


def full_spec(spec, ndim=4):
    return tuple(spec) + (None,) * (ndim - len(spec))


@pytest.mark.parametrize("name", list(MESHES))
def test_greedy_tokens_equal_one_device_and_the_cache_is_split(name):
    params, toks, one = setup()
    mesh, model, gen, placed = nd(name)
    _, chunk, batch, heads = MESHES[name]
    out = generate(model, params, toks, max_new_tokens=N, prompt_lengths=LENGTHS,
                   prefill_chunk=chunk)
    np.testing.assert_array_equal(np.asarray(out), one, name)

    # the weights: split over the tensor axis as the model splits them, no other axis
    attn = placed["params"]["layer_0"]["attn"]
    assert full_spec(attn["q_proj"]["kernel"].sharding.spec, 3) == (None, "tensor", None)
    assert full_spec(attn["o_proj"]["kernel"].sharding.spec, 3) == ("tensor", None, None)
    kv_split = "tensor" if CFG.num_kv_heads % mesh.shape["tensor"] == 0 else None
    assert full_spec(attn["k_proj"]["kernel"].sharding.spec, 3) == (None, kv_split, None)
    emb = placed["params"]["embed"]["embedding"]
    assert emb.addressable_shards[0].data.shape == (CFG.vocab_size // mesh.shape["tensor"],
                                                    CFG.d_model)

    # the cache, after the prefill and after decoding (donated and returned)
    logits, cache = gen.prefill(placed, toks, jnp.asarray(LENGTHS))
    assert gen.cache_heads == heads
    G, T = mesh.shape["sequence"], mesh.shape["tensor"]
    rows = B // (mesh.shape["data"] * mesh.shape["fsdp"])
    local = (rows, gen.plan.cache_len // G, heads // T, CFG.head_dim)
    _, cache = gen.decode()(placed, logits, jnp.asarray(LENGTHS), cache, jax.random.key(0))
    for arr in jax.tree.leaves(cache):
        assert arr.shape == (B, gen.plan.cache_len, heads, CFG.head_dim)
        assert full_spec(arr.sharding.spec) == (batch, "sequence", "tensor", None), name
        assert {s.data.shape for s in arr.addressable_shards} == {local}
    if name == "seq2_tensor4":
        # stored repeated: 1 kv head per device, where the 2 original heads replicated over
        # the tensor axis would take 2 -- gcd(Hkv, T) = 2 times the bytes
        assert local[2] == 1 and local[2] * 2 == CFG.num_kv_heads


@pytest.mark.parametrize("name", list(MORE_MESHES))
def test_greedy_tokens_on_the_other_factorizations(name):
    params, toks, one = setup()
    sizes, chunk, _, _ = MORE_MESHES[name]
    mesh, par = make_mesh(sizes)
    out = generate(Llama(CFG, mesh=mesh, parallelism=par), params, toks, max_new_tokens=N,
                   prompt_lengths=LENGTHS, prefill_chunk=chunk)
    np.testing.assert_array_equal(np.asarray(out), one, name)


def test_biases_and_tied_embeddings_on_four_tensor_devices():
    params, toks, one = setup(BIAS_CFG)
    _, model, _, _ = nd("seq2_tensor4", BIAS_CFG)
    out = generate(model, params, toks, max_new_tokens=N, prompt_lengths=LENGTHS)
    np.testing.assert_array_equal(np.asarray(out), one)


def decode_step_bytes(cfg, b, G, T, itemsize=4):
    """Bytes per device of one decode step (``models.generate``'s docstring)."""
    L, Hq, D, d, V = cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.d_model, cfg.vocab_size
    sequence = L * 2 * (G - 1) / G * 4 * b * (Hq // T) * (D + 2)
    per_layer = 2 * (2 * (T - 1) / T * b * d * itemsize)           # o and down psums
    tensor = (L * per_layer + 2 * (T - 1) / T * b * d * itemsize     # embedding psum
              + (T - 1) / T * b * V * 4)                             # logits all-gather
    return {k: int(round(v)) for k, v in (("sequence", sequence), ("tensor", tensor)) if v}


@pytest.mark.parametrize("name", list(MESHES))
def test_decode_step_bytes_per_axis_match_the_formula(name):
    setup()
    mesh, _, gen, placed = nd(name)
    G, T = mesh.shape["sequence"], mesh.shape["tensor"]
    b = B // (mesh.shape["data"] * mesh.shape["fsdp"])
    c = CFG
    cache = tuple(tuple(jnp.zeros((B, gen.plan.cache_len, gen.cache_heads, c.head_dim))
                        for _ in range(c.num_layers)) for _ in range(2))
    report = collective_bytes(jax.jit(gen.step), placed, jnp.zeros((B,), jnp.int32),
                              jnp.asarray(LENGTHS), cache)
    assert report.bytes_by_axis(mesh) == decode_step_bytes(c, b, G, T), report.summary()
    kinds = sorted((op_axes(op, mesh), op.kind) for op in report.ops)
    L = c.num_layers
    # sequence: one pmax and one psum per layer; tensor: o and down per layer, the
    # embedding, and the logits' all-gather
    assert kinds == sorted([("sequence", "all-reduce")] * 2 * L
                           + [("tensor", "all-reduce")] * (2 * L + 1)
                           + [("tensor", "all-gather")]), kinds


def test_prefill_sends_nothing_on_the_batch_axis():
    params, toks, _ = setup()
    mesh, _, gen, placed = nd("data2_seq2_tensor2")
    axes = collective_bytes(gen.prefill, placed, toks, jnp.asarray(LENGTHS)).bytes_by_axis(mesh)
    assert set(axes) == {"sequence", "tensor"}, axes


def test_errors():
    mesh, par = make_mesh(dict(data=2, sequence=2, tensor=2))
    model = Llama(CFG, mesh=mesh, parallelism=par)
    with pytest.raises(ValueError, match="batch of 3 prompts does not divide by 2"):
        generator_for(model, (3, WIDTH), N)
    with pytest.raises(ValueError, match="axis_name='sp2' and the model's parallelism"):
        generator_for(model, (B, WIDTH), N, axis_name="sp2")


def rows_decode_step_bytes(cfg, b, G, T, itemsize=4):
    """Bytes per device of one decode step with the heads whole (``models.generate``'s
    docstring, "Heads the tensor axes cannot split"), ``N = G * T``:

    * ``("sequence", "tensor")``, per layer: ``2 (N - 1) / N * 4 * b * Hq * (D + 2)``
      (the tree reduction's ``pmax`` of ``[b, Hq, 1]`` and ``psum`` of ``[b, 1, Hq,
      D + 1]``, float32, all heads, over both axes as one group of ``N``);
    * ``"tensor"``: per layer ``2 (T - 1) / T * b * d * s`` (the down ``psum``; o is
      whole), per token ``2 (T - 1) / T * b * d * s`` (the embedding's ``psum``) and
      ``(T - 1) / T * b * V * 4`` (the float32 logits' ``all_gather``).
    """
    L, Hq, D, d, V = cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.d_model, cfg.vocab_size
    n = G * T
    both = L * 2 * (n - 1) / n * 4 * b * Hq * (D + 2)
    tensor = ((L + 1) * 2 * (T - 1) / T * b * d * itemsize        # down psums, embedding
              + (T - 1) / T * b * V * 4)                          # logits all-gather
    return {("sequence", "tensor"): int(round(both)), "tensor": int(round(tensor))}


def test_heads_the_tensor_axis_cannot_split():
    """SmolLM2's 9 query / 3 kv heads on tensor 2 x sequence 4: the model runs attention
    over sequence x tensor rows (``Llama.heads_split``); generation keeps the heads whole
    on the tensor axis and still gives the one-device tokens.  The cache's length is split
    over sequence x tensor (8 stripes, 3 whole kv heads each), the attention weights are
    whole while the MLP and the vocabulary stay split, and the decode step's bytes match
    ``rows_decode_step_bytes`` to the byte."""
    cfg = WHOLE_HEADS
    params, toks, one = setup(cfg)
    mesh, par = make_mesh(dict(tensor=2, sequence=4))
    model = Llama(cfg, mesh=mesh, parallelism=par)
    assert not model.heads_split
    out = generate(model, params, toks, max_new_tokens=N, prompt_lengths=LENGTHS)
    np.testing.assert_array_equal(np.asarray(out), one)

    # the generator generate used (cached): the same compiled programs below
    gen = generator_for(model, (B, WIDTH), N, max_prompt_len=int(LENGTHS.max()))
    G, T = mesh.shape["sequence"], mesh.shape["tensor"]
    assert gen.plan.num_shards == G * T and gen.cache_heads == cfg.num_kv_heads
    placed = gen.replicate(params)
    layer = placed["params"]["layer_0"]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):     # whole on every device
        assert full_spec(layer["attn"][name]["kernel"].sharding.spec, 3) == (None,) * 3
    assert full_spec(layer["mlp"]["gate_proj"]["kernel"].sharding.spec, 2) == (None, "tensor")
    assert full_spec(layer["mlp"]["down_proj"]["kernel"].sharding.spec, 2) == ("tensor", None)
    assert full_spec(placed["params"]["embed"]["embedding"].sharding.spec, 2) == ("tensor",
                                                                                  None)

    # the cache: its length over sequence x tensor (sequence major), kv heads whole
    logits, cache = gen.prefill(placed, toks, jnp.asarray(LENGTHS))
    _, cache = gen.decode()(placed, logits, jnp.asarray(LENGTHS), cache, jax.random.key(0))
    local = (B, gen.plan.cache_len // (G * T), cfg.num_kv_heads, cfg.head_dim)
    for arr in jax.tree.leaves(cache):
        assert arr.shape == (B, gen.plan.cache_len, cfg.num_kv_heads, cfg.head_dim)
        assert full_spec(arr.sharding.spec) == (None, ("sequence", "tensor"), None, None)
        assert {s.data.shape for s in arr.addressable_shards} == {local}
        # 8 distinct stripes: no device holds another's positions
        assert len({s.index[1].start for s in arr.addressable_shards}) == G * T

    # the decode step: the tree reduction over both axes at once, the MLP's down psum,
    # the embedding's psum and the logits' all-gather over the tensor axis
    zeros = tuple(tuple(jnp.zeros(local[:1] + (gen.plan.cache_len,) + local[2:])
                        for _ in range(cfg.num_layers)) for _ in range(2))
    report = collective_bytes(jax.jit(gen.step), placed, jnp.zeros((B,), jnp.int32),
                              jnp.asarray(LENGTHS), zeros)
    assert report.bytes_by_axis(mesh) == rows_decode_step_bytes(cfg, B, G, T), \
        report.summary()
    L = cfg.num_layers
    kinds = sorted((str(op_axes(op, mesh)), op.kind) for op in report.ops)
    assert kinds == sorted([(str(("sequence", "tensor")), "all-reduce")] * 2 * L
                           + [("tensor", "all-reduce")] * (L + 1)
                           + [("tensor", "all-gather")]), kinds


@pytest.mark.parametrize("cfg", [CFG, WHOLE_HEADS], ids=["heads_split", "heads_whole"])
def test_stacked_parameters_on_a_tensor_axis(cfg):
    """The scanned model with the unrolled model's numbers stacked, on tensor 2 x sequence
    4 in three prefill passes: the one-device tokens; the stacked weights carry the
    unrolled splits behind a whole layer axis, and the same generator places unrolled
    parameters as the unrolled model does."""
    params, toks, one = setup(cfg)
    mesh, par = make_mesh(dict(tensor=2, sequence=4))
    model = Llama(dataclasses.replace(cfg, scan_layers=True), mesh=mesh, parallelism=par)
    stacked = stack_layers(params)
    out = generate(model, stacked, toks, max_new_tokens=N, prompt_lengths=LENGTHS,
                   prefill_chunk=8)
    np.testing.assert_array_equal(np.asarray(out), one)

    gen = generator_for(model, (B, WIDTH), N, max_prompt_len=int(LENGTHS.max()),
                        prefill_chunk=8)
    layers = gen.replicate(stacked)["params"]["layers"]
    q = "tensor" if model.heads_split else None
    assert full_spec(layers["attn"]["q_proj"]["kernel"].sharding.spec, 4) == (None, None, q,
                                                                              None)
    assert full_spec(layers["mlp"]["down_proj"]["kernel"].sharding.spec, 3) == (None,
                                                                                "tensor", None)
    unrolled = gen.param_partition_specs(params)["params"]["layer_0"]
    assert full_spec(unrolled["attn"]["q_proj"]["kernel"], 3) == (None, q, None)
    assert full_spec(unrolled["mlp"]["down_proj"]["kernel"], 2) == ("tensor", None)
