"""Scanned layers (issue 39): ``LlamaConfig(scan_layers=True)`` is the same model as the
unrolled one, only compiled once per block.

With the same numbers (``stacking.stack_layers`` of the unrolled parameters) the scanned
model gives the unrolled model's logits, loss and gradients on 4 CPU devices (float32,
norm-wise 1e-6 per leaf) for every remat mode (offload included), zigzag and striped, a
packed batch with positions, and on an 8-device N-D mesh with a tensor axis; its parameters are
the unrolled ones stacked on a leading ``layers`` axis that no sharding splits; the
conversions between the forms round-trip, also through optimizer state.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from helpers import assert_close
from jax_seqpar.models import Llama, LlamaConfig, next_token_loss
from jax_seqpar.models.llama import LAYERS
from jax_seqpar.models.stacking import (is_scanned, layer_params, num_layers, stack_layers,
                                        unstack_layers)
from jax_seqpar.sharding.fsdp import fsdp_shardings
from jax_seqpar.sharding.parallelism import make_mesh
from jax_seqpar.training import abstract_train_state, init_train_state, make_train_step

CFG = LlamaConfig(vocab_size=96, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2)
B, S = 2, 32
TOL = 1e-6


def batch(packed: bool, seed=0):
    rng = np.random.default_rng(seed)
    out = {"tokens": jnp.asarray(rng.integers(0, CFG.vocab_size, (B, S)), jnp.int32)}
    if packed:  # two documents per row, positions restarting in each
        cut = rng.integers(4, S - 4, B)
        seg = (np.arange(S)[None] >= cut[:, None]).astype(np.int32)
        pos = np.where(seg == 0, np.arange(S)[None], np.arange(S)[None] - cut[:, None])
        out |= {"segment_ids": jnp.asarray(seg), "positions": jnp.asarray(pos, jnp.int32)}
    return out


@functools.lru_cache(maxsize=None)
def unrolled_params():
    return jax.jit(Llama(CFG).init)(jax.random.key(0), batch(False)["tokens"])


def loss_and_grads(model, params, data):
    def f(p):
        return next_token_loss(model, p, data["tokens"], segment_ids=data.get("segment_ids"),
                               positions=data.get("positions"))[0]
    return jax.jit(jax.value_and_grad(f))(params)


def check_same(loss, grads, want_loss, want_grads, what):
    assert abs(float(loss) - float(want_loss)) <= TOL * abs(float(want_loss)), \
        f"{what}: loss {float(loss)} vs {float(want_loss)}"
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                            jax.tree.leaves(want_grads)):
        assert_close(g, w, TOL, f"{what}: d{jax.tree_util.keystr(path)}")


def mesh8():
    return make_mesh({"sequence": 8})[0]


# (remat, offload, layout, packed): every REMAT_MODES entry (full and attention_mlp with
# remat_offload: the same policy, its saved names moved to the host), both layouts,
# packed batches with positions on three
CASES = [("none", False, "zigzag", True), ("full", True, "striped", True),
         ("attention", False, "zigzag", False), ("seq_selective", False, "striped", True),
         ("attention_mlp", True, "zigzag", True)]


def mesh4():
    """4 devices: zigzag and striped still cut every sequence into 8 / 32 pieces across
    shard boundaries, and the ring programs (unrolled hops) compile in half the time of
    8 devices'.  The N-D test below keeps 8."""
    return jax.make_mesh((4,), ("sp",), devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto,))


@functools.lru_cache(maxsize=None)
def unrolled_reference(layout, packed):
    """The unrolled model's loss and gradients without remat: every policy must give
    these (tests/test_remat.py checks the policies agree on the unrolled model), so the
    remat cases of one (layout, packed) share one reference compile."""
    return loss_and_grads(Llama(CFG, mesh=mesh4(), layout=layout), unrolled_params(),
                          batch(packed))


@pytest.mark.parametrize("remat,offload,layout,packed", CASES)
def test_scanned_equals_unrolled(remat, offload, layout, packed):
    cfg = dataclasses.replace(CFG, remat=remat, remat_offload=offload)
    mesh = mesh4()
    unrolled = Llama(CFG, mesh=mesh, layout=layout)
    scanned = Llama(dataclasses.replace(cfg, scan_layers=True), mesh=mesh, layout=layout)
    params, data = unrolled_params(), batch(packed)
    want = unrolled_reference(layout, packed)
    loss, grads = loss_and_grads(scanned, stack_layers(params), data)
    check_same(loss, unstack_layers(grads), *want, f"{remat}+{offload}/{layout}")
    if remat == "none":  # the forward does not depend on the policy: logits once
        kw = {k: data.get(k) for k in ("segment_ids", "positions")}
        assert_close(jax.jit(scanned.apply)(stack_layers(params), data["tokens"], **kw),
                     jax.jit(unrolled.apply)(params, data["tokens"], **kw), TOL, "logits")


def test_scanned_equals_unrolled_on_an_nd_mesh():
    """data 2 x sequence 2 x tensor 2: the stacked weights keep their tensor split."""
    mesh, par = make_mesh({"data": 2, "sequence": 2, "tensor": 2})
    data = batch(True)
    unrolled = Llama(CFG, mesh=mesh, parallelism=par, backward="q")
    scanned = Llama(dataclasses.replace(CFG, scan_layers=True), mesh=mesh, parallelism=par,
                    backward="q")
    params = unrolled_params()
    want = loss_and_grads(unrolled, params, data)
    loss, grads = loss_and_grads(scanned, stack_layers(params), data)
    check_same(loss, unstack_layers(grads), *want, "data2_seq2_tensor2")


def test_parameters_are_the_unrolled_ones_stacked_on_an_unsplit_axis():
    scanned = Llama(dataclasses.replace(CFG, scan_layers=True))
    toks = batch(False)["tokens"]
    shapes = jax.eval_shape(lambda: scanned.init(jax.random.key(0), toks))
    # unrolled_params is cached: call it outside the trace, or the cache keeps tracers
    # whenever this test is the first of its worker to ask for it
    unrolled = unrolled_params()
    want = jax.eval_shape(lambda: stack_layers(unrolled))
    assert jax.tree.structure(shapes) == jax.tree.structure(want)
    assert jax.tree.leaves(jax.tree.map(lambda a, b: a.shape == b.shape, shapes, want))
    assert set(shapes["params"]) == {LAYERS, "embed", "final_norm", "lm_head"}
    # every named stacked leaf's logical names start with "layers", which no rule splits
    # (the norm scales carry no names: never split)
    specs = scanned.logical_specs(jax.random.key(0), toks)["params"][LAYERS]
    named = [s for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)) if len(s)]
    assert len(named) == 7 and all(s[0] == LAYERS for s in named), named
    mesh, par = make_mesh({"fsdp": 2, "sequence": 2, "tensor": 2})
    model = Llama(dataclasses.replace(CFG, scan_layers=True), mesh=mesh, parallelism=par)
    sh = model.param_shardings(jax.random.key(0), jnp.zeros((2, 8), jnp.int32))["params"]
    for s in jax.tree.leaves(sh[LAYERS]):
        assert s.spec[0] is None, s.spec
    q = sh[LAYERS]["attn"]["q_proj"]["kernel"].spec   # [layers, embed, heads, head_dim]
    assert q[1] == ("fsdp", "sequence") and q[2] == "tensor", q
    # the one-axis FSDP rule never picks the layer axis, even where it is the largest
    long = {"params": {LAYERS: {"w": jax.ShapeDtypeStruct((64, 32, 16), jnp.float32)},
                       "other": jax.ShapeDtypeStruct((64, 32, 16), jnp.float32)}}
    fs = fsdp_shardings(long, mesh8(), "sequence")["params"]
    assert fs[LAYERS]["w"].spec == P(None, "sequence", None)
    assert fs["other"].spec == P("sequence", None, None)


def test_train_state_and_step_follow_the_stacked_form():
    """``init_train_state`` lays the optimizer moments out like the stacked parameters, and
    one step from the same numbers gives the unrolled model's new parameters."""
    mesh, par = make_mesh({"data": 2, "sequence": 2}, jax.devices()[:4])
    opt = optax.adamw(1e-3)
    models = {s: Llama(dataclasses.replace(CFG, scan_layers=s), mesh=mesh, parallelism=par)
              for s in (False, True)}
    abstract = abstract_train_state(models[True], opt, jax.random.key(0), (B, S))
    mu = abstract.opt_state[0].mu["params"][LAYERS]["attn"]["q_proj"]["kernel"]
    assert mu.shape[0] == CFG.num_layers and mu.sharding.spec[0] is None
    data = batch(True)
    start = init_train_state(models[False], opt, jax.random.key(0), (B, S))
    scanned_start = start.replace(params=stack_layers(start.params),
                                  opt_state=stack_layers(start.opt_state))
    new_u, m_u = make_train_step(models[False], opt, donate=False)(start, data)
    new_s, m_s = make_train_step(models[True], opt, shardings=abstract,
                                 donate=False)(scanned_start, data)
    assert abs(float(m_u["loss"]) - float(m_s["loss"])) <= TOL * abs(float(m_u["loss"]))
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(unstack_layers(new_s.params))[0],
                            jax.tree.leaves(new_u.params)):
        assert_close(a, b, 1e-5, f"params after one step: {jax.tree_util.keystr(path)}")


def test_conversions_round_trip_and_read_one_layer():
    params = unrolled_params()
    stacked = stack_layers(params)
    assert is_scanned(stacked) and not is_scanned(params)
    assert num_layers(stacked) == num_layers(params) == CFG.num_layers
    assert jax.tree.structure(stack_layers(stacked)) == jax.tree.structure(stacked)
    assert jax.tree.structure(unstack_layers(params)) == jax.tree.structure(params)
    back = unstack_layers(stacked)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back),
                                                    jax.tree.leaves(params)))
    for i in range(CFG.num_layers):
        for a, b in zip(jax.tree.leaves(layer_params(stacked, i)),
                        jax.tree.leaves(layer_params(params, i))):
            assert np.array_equal(a, b)
    with pytest.raises(IndexError, match="layer 2 of a model with 2 layers"):
        layer_params(stacked, 2)
    # optimizer state: every dict that holds the blocks is converted
    opt = optax.adam(1e-3).init(params)
    assert is_scanned(stack_layers(opt)[0].mu)
    with pytest.raises(ValueError, match=re.escape("layer_0 .. layer_1")):
        stack_layers({"layer_0": {"w": 1.0}, "layer_2": {"w": 1.0}})
    with pytest.raises(ValueError, match="same parameters"):
        stack_layers({"layer_0": {"w": jnp.ones(2)}, "layer_1": {"v": jnp.ones(2)}})
    with pytest.raises(TypeError, match="scan_layers"):
        LlamaConfig(vocab_size=8, scan_layers="yes")
