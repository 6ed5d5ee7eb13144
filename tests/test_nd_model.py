"""The model and training on N-D meshes (issue 38): data x fsdp x sequence x tensor.

A small GQA Llama (4 query heads, 2 kv heads, one block) on 8 CPU devices: loss and
gradients equal the one-device model (float32, 1e-5) for every factorization the
acceptance names, zigzag and striped, both ring backwards, with a packed batch (segment
ids and positions); the train state laid out by the logical rules; a checkpoint saved
on one factorization resumes on two others with the same next losses; the per-device
work falls by the data and tensor factors.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import assert_close
from jax.sharding import PartitionSpec as P

from jax_seqpar.models import Llama, LlamaConfig, next_token_loss
from jax_seqpar.sharding.parallelism import Parallelism, make_mesh, parse_mesh_arg
from jax_seqpar.training import (CheckpointConfig, TrainCheckpointer, abstract_train_state,
                                 init_train_state, make_train_step)

CFG = LlamaConfig(vocab_size=128, d_model=64, num_layers=1, num_heads=4, num_kv_heads=2)
B, S = 4, 32
TOL = 1e-5

#: the factorizations of 8 devices the acceptance lists (data, fsdp, sequence, tensor)
MESHES = {
    "seq8": dict(sequence=8),
    "data2_seq4": dict(data=2, sequence=4),
    "data4_seq2": dict(data=4, sequence=2),
    "tensor2_seq4": dict(tensor=2, sequence=4),
    "data2_seq2_tensor2": dict(data=2, sequence=2, tensor=2),
    "fsdp2_seq2_tensor2": dict(fsdp=2, sequence=2, tensor=2),
}


def packed_batch(seed=0):
    """Tokens with 3 documents per row: segment ids and positions restarting at 0."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (B, S)).astype(np.int32)
    seg = np.zeros((B, S), np.int32)
    pos = np.zeros((B, S), np.int32)
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(2, S - 2), 2, replace=False))
        for c in cuts:
            seg[b, c:] += 1
        for d in range(3):
            idx = np.flatnonzero(seg[b] == d)
            pos[b, idx] = np.arange(idx.size)
    return {"tokens": tokens, "segment_ids": seg, "positions": pos}


@functools.lru_cache(maxsize=None)
def params_and_reference():
    batch = packed_batch()
    params = jax.jit(Llama(CFG).init)(jax.random.key(0), jnp.asarray(batch["tokens"]))
    return params, loss_and_grads(Llama(CFG), params, batch)


def loss_and_grads(model, params, batch):
    def f(p):
        return next_token_loss(model, p, batch["tokens"], segment_ids=batch["segment_ids"],
                               positions=batch["positions"])[0]
    return jax.jit(jax.value_and_grad(f))(params)


def check_equal(loss, grads, want_loss, want_grads, what):
    assert abs(float(loss) - float(want_loss)) <= TOL * abs(float(want_loss)), what
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                            jax.tree.leaves(want_grads)):
        assert_close(g, w, TOL, f"{what}: d{jax.tree_util.keystr(path)}")


# (mesh, layout, backward): every factorization with zigzag + kv and striped + q; the
# full layout x backward product on data x sequence x tensor
CASES = ([(m, "zigzag", "kv") for m in MESHES] + [(m, "striped", "q") for m in MESHES]
         + [("data2_seq2_tensor2", "zigzag", "q"), ("data2_seq2_tensor2", "striped", "kv")])


@pytest.mark.parametrize("mesh_name,layout,backward", CASES)
def test_loss_and_gradients_equal_one_device(mesh_name, layout, backward):
    params, (want_loss, want_grads) = params_and_reference()
    mesh, par = make_mesh(MESHES[mesh_name])
    model = Llama(CFG, mesh=mesh, parallelism=par, layout=layout, backward=backward)
    placed = jax.device_put(params, model.param_shardings(jax.random.key(0),
                                                          jnp.zeros((B, S), jnp.int32)))
    loss, grads = loss_and_grads(model, placed, packed_batch())
    check_equal(loss, grads, want_loss, want_grads, f"{mesh_name} {layout} {backward}")


def test_parameters_are_split_by_their_logical_names():
    mesh, par = make_mesh(MESHES["fsdp2_seq2_tensor2"])
    model = Llama(CFG, mesh=mesh, parallelism=par)
    sh = model.param_shardings(jax.random.key(0), jnp.zeros((B, S), jnp.int32))["params"]
    embed = ("fsdp", "sequence")
    assert sh["embed"]["embedding"].spec == P("tensor", embed)          # vocab-parallel
    assert sh["lm_head"]["kernel"].spec == P(embed, "tensor")
    attn = sh["layer_0"]["attn"]
    assert attn["q_proj"]["kernel"].spec == P(embed, "tensor", None)    # by output
    assert attn["k_proj"]["kernel"].spec == P(embed, "tensor", None)    # 2 kv heads / 2
    assert attn["o_proj"]["kernel"].spec == P("tensor", None, embed)    # by input
    mlp = sh["layer_0"]["mlp"]
    assert mlp["gate_proj"]["kernel"].spec == P(embed, "tensor")
    assert mlp["down_proj"]["kernel"].spec == P("tensor", embed)           # by input
    assert sh["final_norm"]["scale"].spec == P(None)
    # no device holds a whole table: 1/8 of the embedding each
    emb = sh["embed"]["embedding"]
    assert emb.shard_shape((CFG.vocab_size, CFG.d_model)) == (64, 16)
    # ZeRO-3 across the mesh: the data axis splits the parameters too when asked
    mesh, par = make_mesh(MESHES["data2_seq2_tensor2"])
    zero3 = Llama(CFG, mesh=mesh, parallelism=dataclasses.replace(par, zero3_data=True))
    sh = zero3.param_shardings(jax.random.key(0), jnp.zeros((B, S), jnp.int32))["params"]
    assert sh["layer_0"]["mlp"]["up_proj"]["kernel"].spec == P(("data", "sequence"), "tensor")
    assert Llama(CFG, mesh=mesh, parallelism=par).param_shardings(
        jax.random.key(0), jnp.zeros((B, S), jnp.int32))["params"]["layer_0"]["mlp"][
        "up_proj"]["kernel"].spec == P("sequence", "tensor")


def test_kv_heads_fewer_than_the_tensor_axis():
    """2 kv heads on tensor 4: the k/v projections stay whole on the tensor axis (2 does
    not divide by 4) and attention repeats each kv head twice; still the one-device
    numbers."""
    params, (want_loss, want_grads) = params_and_reference()
    mesh, par = make_mesh(dict(sequence=2, tensor=4))
    model = Llama(CFG, mesh=mesh, parallelism=par)
    sh = model.param_shardings(jax.random.key(0), jnp.zeros((B, S), jnp.int32))["params"]
    assert sh["layer_0"]["attn"]["k_proj"]["kernel"].spec == P("sequence", None, None)
    assert sh["layer_0"]["attn"]["q_proj"]["kernel"].spec == P("sequence", "tensor", None)
    loss, grads = loss_and_grads(model, jax.device_put(params, sh and {"params": sh}),
                                 packed_batch())
    check_equal(loss, grads, want_loss, want_grads, "tensor 4, 2 kv heads")


def test_errors():
    mesh, par = make_mesh(dict(sequence=2, tensor=4))
    with pytest.raises(ValueError, match="plays two roles"):
        Parallelism(data="x", sequence="x")
    with pytest.raises(ValueError, match="pass mesh"):
        Llama(CFG, parallelism=par)
    with pytest.raises(ValueError, match=r"'model' is not an axis"):
        Llama(CFG, mesh=mesh, parallelism=Parallelism(sequence="model"))
    with pytest.raises(ValueError, match="disagree"):
        Llama(CFG, mesh=mesh, parallelism=par, axis_name="other")
    assert parse_mesh_arg("data=2, sequence=4") == dict(data=2, fsdp=1, sequence=4, tensor=1)
    with pytest.raises(ValueError, match="'pipeline=2' must be role=size"):
        parse_mesh_arg("pipeline=2")
    with pytest.raises(ValueError, match="multiply to 6"):
        make_mesh(dict(sequence=3, tensor=2))


# ----------------------------------------------------------------------------- flops
def _forward_flops(sizes, devices):
    mesh, par = make_mesh(sizes, jax.devices()[:devices])
    model = Llama(CFG, mesh=mesh, parallelism=par)
    params, _ = params_and_reference()
    tokens = jnp.asarray(packed_batch()["tokens"])
    cost = jax.jit(lambda p: next_token_loss(model, p, tokens)[0]).lower(
        params).compile().cost_analysis()
    return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]


def test_no_replicated_work():
    """Per-device FLOPs on data 2 x sequence 2 x tensor 2 are a quarter of those on
    sequence 2 alone: the data and tensor axes split the work, nothing is repeated."""
    alone = _forward_flops(dict(sequence=2), 2)
    split = _forward_flops(dict(data=2, sequence=2, tensor=2), 8)
    assert split * 4 == pytest.approx(alone, rel=0.05), (split, alone)


# ----------------------------------------------------------------------------- training
OPT = optax.adamw(1e-2)


@functools.lru_cache(maxsize=None)
def model_and_step(name):
    """The model on ``MESHES[name]`` and its train step, compiled once for the tests that
    train on that factorization (laid out like ``abstract_train_state``, which is what
    ``init_train_state`` and a restore give)."""
    mesh, par = make_mesh(MESHES[name])
    model = Llama(CFG, mesh=mesh, parallelism=par)
    abstract = abstract_train_state(model, OPT, jax.random.key(0), (B, S))
    return model, make_train_step(model, OPT, shardings=abstract)


def train(name, state=None, steps=2, ckpt=None, start=0, save_at=None):
    model, step = model_and_step(name)
    if state is None:
        state = init_train_state(model, OPT, jax.random.key(0), (B, S))
    losses = []
    for i in range(start, start + steps):
        state, m = step(state, packed_batch(i))
        losses.append(float(m["loss"]))
        if ckpt is not None and i + 1 == save_at:
            ckpt.save(i + 1, state, force=True)
    return model, state, losses


def test_train_state_follows_the_rules_and_steps_like_one_device():
    mesh, par = make_mesh(MESHES["data2_seq2_tensor2"])
    model = Llama(CFG, mesh=mesh, parallelism=par)
    abstract = abstract_train_state(model, OPT, jax.random.key(0), (B, S))
    mu = abstract.opt_state[0].mu["params"]["layer_0"]["mlp"]["gate_proj"]["kernel"]
    assert mu.sharding.spec == P("sequence", "tensor")  # AdamW's moments like their param
    _, _, losses = train("data2_seq2_tensor2", steps=2)
    one = Llama(CFG)
    params = jax.jit(one.init)(jax.random.key(0), jnp.zeros((B, S), jnp.int32))
    opt_state = jax.jit(OPT.init)(params)

    @jax.jit  # one program for the reference step, not one per operation
    def one_device_step(params, opt_state, b):
        (l, _), g = jax.value_and_grad(lambda p: next_token_loss(
            one, p, b["tokens"], segment_ids=b["segment_ids"], positions=b["positions"]),
            has_aux=True)(params)
        upd, opt_state = OPT.update(g, opt_state, params)
        return l, optax.apply_updates(params, upd), opt_state

    for i in range(2):
        l, params, opt_state = one_device_step(params, opt_state, packed_batch(i))
        assert abs(float(l) - losses[i]) <= TOL * abs(float(l)), (i, float(l), losses[i])


def test_checkpoint_resumes_on_other_factorizations(tmp_path):
    """Saved on sequence 8; resumed on data 2 x sequence 2 x tensor 2 (every role
    changes) and on fsdp 2 x sequence 2 x tensor 2 (the parameters and moments split
    differently again): the next losses equal those of the uninterrupted run (1e-6)."""
    with TrainCheckpointer(CheckpointConfig(tmp_path, save_every=1)) as ckpt:
        _, _, losses = train("seq8", steps=4, ckpt=ckpt, save_at=2)
        ckpt.wait_until_finished()
    want = losses[2:]
    for name in ("data2_seq2_tensor2", "fsdp2_seq2_tensor2"):
        model, _ = model_and_step(name)
        abstract = abstract_train_state(model, OPT, jax.random.key(0), (B, S))
        with TrainCheckpointer(CheckpointConfig(tmp_path, save_every=1)) as ckpt:
            restored = ckpt.restore_latest(abstract)
        assert restored.step == 2
        _, _, got = train(name, state=restored.state, steps=2, start=2)
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=name)


# ----------------------------------------------------------------------------- loading
def test_pretrained_checkpoint_streams_onto_the_rules():
    """A transformers checkpoint loaded onto data 2 x sequence 2 x tensor 2: every tensor
    on the sharding the logical rules give it, and the model's logits equal transformers'
    (the committed reference) to 1e-5."""
    import os

    from helpers import assert_close as close
    from jax_seqpar.models.hf import load_pretrained

    fix = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
    ref = np.load(os.path.join(fix, "llama_plain.npz"))
    mesh, par = make_mesh(MESHES["data2_seq2_tensor2"])
    cfg, params = load_pretrained(os.path.join(fix, "llama_plain"), mesh=mesh,
                                  parallelism=par, dtype="float32")
    model = Llama(cfg, mesh=mesh, parallelism=par)
    ids = np.concatenate([ref["input_ids"]] * 2)  # a batch the data axis can split
    want = model.param_shardings(jax.random.key(0), jnp.asarray(ids))
    for got, w in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
        assert got.sharding == w
    logits = jax.jit(model.apply)(params, jnp.asarray(ids))
    close(logits[: len(ref["input_ids"])], ref["logits"], TOL, "llama_plain on 2x2x2")


SMOL = LlamaConfig(vocab_size=96, d_model=144, num_layers=1, num_heads=9, num_kv_heads=3,
                   ffn_dim=96)  # SmolLM2-135M's head counts (9 query, 3 kv) at a toy width


@functools.lru_cache(maxsize=None)
def smol_reference():
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 96, (2, 48)), jnp.int32)
    params = jax.jit(Llama(SMOL).init)(jax.random.key(1), tokens)
    batch = {"tokens": tokens, "segment_ids": jnp.asarray(np.repeat([[1, 2]] * 2, 24, 1)),
             "positions": jnp.asarray(np.tile(np.arange(24), (2, 2)))}
    return tokens, params, batch, loss_and_grads(Llama(SMOL), params, batch)


def test_smollm2_head_counts_on_tensor_3():
    """SmolLM2-135M's heads as tensor 3 x sequence 2 on 6 devices: every head count
    splits by 3; loss and gradients equal one device."""
    tokens, params, batch, want = smol_reference()
    mesh, par = make_mesh(dict(sequence=2, tensor=3), jax.devices()[:6])
    model = Llama(SMOL, mesh=mesh, parallelism=par)
    assert model.heads_split
    sh = model.param_shardings(jax.random.key(1), tokens)
    assert sh["params"]["layer_0"]["attn"]["k_proj"]["kernel"].spec == P(
        "sequence", "tensor", None)
    got = loss_and_grads(model, jax.device_put(params, sh), batch)
    check_equal(*got, *want, "9/3 heads on tensor 3 x sequence 2")


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_smollm2_head_counts_on_tensor_2(layout):
    """9 query heads do not divide by a tensor axis of 2: attention runs with the tensor
    devices splitting its rows (sequence x tensor, ``Llama.heads_split``), its weights
    whole on the tensor axis; the MLP and the vocabulary still split over it.  Loss and
    gradients equal one device; no replicated work (FLOPs per device)."""
    tokens, params, batch, want = smol_reference()
    mesh, par = make_mesh(dict(sequence=2, tensor=2), jax.devices()[:4])
    model = Llama(SMOL, mesh=mesh, parallelism=par, layout=layout)
    assert not model.heads_split and model.options().num_shards == 4
    sh = model.param_shardings(jax.random.key(1), tokens)["params"]
    assert sh["layer_0"]["attn"]["q_proj"]["kernel"].spec == P("sequence", None, None)
    assert sh["layer_0"]["mlp"]["up_proj"]["kernel"].spec == P("sequence", "tensor")
    got = loss_and_grads(model, jax.device_put(params, {"params": sh}), batch)
    check_equal(*got, *want, f"9/3 heads on tensor 2 x sequence 2, {layout}")
    if layout == "zigzag":  # per-device FLOPs: half of sequence 2 alone
        def flops(sizes, n):
            m, p = make_mesh(sizes, jax.devices()[:n])
            mod = Llama(SMOL, mesh=m, parallelism=p, layout=layout)
            cost = jax.jit(lambda q: next_token_loss(mod, q, tokens)[0]).lower(
                params).compile().cost_analysis()
            return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]
        assert 2 * flops(dict(sequence=2, tensor=2), 4) == pytest.approx(
            flops(dict(sequence=2), 2), rel=0.05)


# ----------------------------------------------------------------------------- bytes
def _bytes(sizes, layers, grad):
    """Bytes per mesh axis of the compiled forward (hidden states) or training gradient
    of a ``layers``-block model whose roles other than ``sizes`` have size 1."""
    from jax_seqpar.runtime.comm import collective_bytes

    cfg = LlamaConfig(vocab_size=128, d_model=64, num_layers=layers, num_heads=4,
                      num_kv_heads=2, ffn_dim=128)
    n = int(np.prod(list(sizes.values())))
    mesh, par = make_mesh(sizes, jax.devices()[:n])
    model = Llama(cfg, mesh=mesh, parallelism=par)
    tokens = jnp.zeros((B, S), jnp.int32)
    # only the compiled program is read: abstract parameters on their shardings (the
    # same program as for placed arrays, without running the initialisation)
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          jax.eval_shape(model.init, jax.random.key(0), tokens),
                          model.param_shardings(jax.random.key(0), tokens))
    if grad:
        f = jax.grad(lambda p, t: next_token_loss(model, p, t)[0])
    else:
        f = lambda p, t: model.apply(p, t, return_hidden=True)  # noqa: E731
    rep = collective_bytes(jax.jit(f), params, tokens)
    kinds = {}
    for op in rep.ops:
        from jax_seqpar.runtime.comm import op_axes
        key = (op_axes(op, mesh), op.kind)
        kinds[key] = kinds.get(key, 0) + op.bytes_sent
    return cfg, rep.bytes_by_axis(mesh), kinds


def test_bytes_per_axis_follow_the_formulas():
    """Per mesh axis, what the compiled programs send per device, to the byte (float32,
    ``B`` rows of ``S`` tokens, ``d`` = 64; one role of size 2 at a time; per layer is
    the difference between 2 blocks and 1):

    - data (D): the gradients' all-reduce, ``2 (D-1)/D * 4 (P + 1)`` for the whole step
      (``P`` parameters, and the loss's token count), one block;
    - fsdp (F) x tensor (T) together, forward: each block's matmul weights gathered once
      over fsdp, ``(F-1)/F * 4 * P_block / T`` per layer (their tensor slice; norm scales
      stay replicated), and over tensor one all-reduce of the block's activation per
      side, ``2 * 2 (T-1)/T * 4 (B/F) S d`` per layer (Megatron-LM;
      ``sharding.parallelism``);
    - sequence (G): the ring's hops of one block's step, ``costs.forward_bytes +
      costs.backward_bytes`` (``backward="auto"``), K and V of the local rows only.
    """
    from jax_seqpar.parallel.costs import RingShape, backward_bytes, choose_backward, forward_bytes

    cfg, got, _ = _bytes(dict(data=2), 1, True)
    P = sum(x.size for x in jax.tree.leaves(jax.eval_shape(
        Llama(cfg).init, jax.random.key(0), jnp.zeros((B, S), jnp.int32))))
    assert got == {"data": 2 * 1 / 2 * 4 * (P + 1)}, got

    d, H, Hkv, Dh, ffn = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 128
    p_block = d * (H + 2 * Hkv) * Dh + H * Dh * d + 3 * d * ffn
    ft = dict(fsdp=2, tensor=2)
    (_, one, _), (_, two, _) = _bytes(ft, 1, False), _bytes(ft, 2, False)
    F = T = 2
    assert two["fsdp"] - one["fsdp"] == (F - 1) / F * 4 * p_block / T
    assert two["tensor"] - one["tensor"] == 2 * 2 * (T - 1) / T * 4 * (B // F) * S * d
    assert set(two) == {"fsdp", "tensor"}  # no collective spans both

    _, _, s1 = _bytes(dict(sequence=2), 1, True)
    G = 2
    shape = RingShape(num_devices=G, batch=B, tokens=S // G, q_heads=H, kv_heads=Hkv,
                      head_dim=Dh, itemsize=4)
    scheme = choose_backward(shape).scheme
    ring = forward_bytes(shape) + backward_bytes(scheme, shape)
    # one block: the ring is all the point-to-point traffic
    assert s1[("sequence", "collective-permute")] == ring
