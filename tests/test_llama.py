"""The Llama-style model: sequence-parallel (8 devices, zigzag / contiguous / striped)
against the same parameters on one device, and the natural-order target shift.

The model runs its blocks as one scan (``scan_layers=True``: XLA compiles one block per
program, not one per layer, so these programs compile faster); its weights are the
unrolled model's initialisation stacked (``models.stacking.stack_layers``), so the numbers
are the unrolled model's.  ``test_scan_layers.py`` checks the two forms against each
other."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from helpers import assert_close, assert_trees_close, sorted_segments
from jax_seqpar.models import Llama, LlamaConfig, next_token_loss, shift_targets
from jax_seqpar.models.stacking import stack_layers

B, S = 2, 64
CFG = LlamaConfig(vocab_size=61, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  scan_layers=True)
TOL = 1e-5


@functools.lru_cache(maxsize=None)
def auto_mesh(G):
    return jax.make_mesh((G,), ("sp",), devices=jax.devices()[:G],
                         axis_types=(AxisType.Auto,))


def tokens(seed=0):
    return jax.random.randint(jax.random.key(seed), (B, S), 0, CFG.vocab_size)


@functools.lru_cache(maxsize=None)
def logits_loss_and_grad(model):
    """One jitted program per model: the logits, and the loss and its gradients (the
    tests read all three; one compile, not one for the logits and one for the rest)."""
    def f(params, toks, seg):
        (loss, m), grads = jax.value_and_grad(
            lambda p: next_token_loss(model, p, toks, segment_ids=seg), has_aux=True)(params)
        return model.apply(params, toks, seg), (loss, m), grads
    return jax.jit(f)


@functools.lru_cache(maxsize=None)
def single_device_params():
    unrolled = Llama(dataclasses.replace(CFG, scan_layers=False))
    return jax.jit(lambda k, t: stack_layers(unrolled.init(k, t)))(jax.random.key(0),
                                                                     tokens())


def compare_with_single_device(model, seg=None, what=""):
    params = single_device_params()
    toks = tokens(1)
    logits, (loss, m), grads = logits_loss_and_grad(model)(params, toks, seg)
    rlogits, (rloss, rm), rgrads = logits_loss_and_grad(Llama(CFG))(params, toks, seg)
    assert_close(logits, rlogits, TOL, f"{what}: logits")
    assert_close(loss, rloss, TOL, f"{what}: loss")
    assert float(m["tokens"]) == float(rm["tokens"])
    assert_trees_close(grads, rgrads, TOL, f"{what}: dparams")


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_sequence_parallel_model_matches_single_device(layout):
    compare_with_single_device(Llama(CFG, mesh=auto_mesh(8), layout=layout), what=layout)


def test_striped_packed_documents_burst_backward():
    seg = sorted_segments(3, B, S, num_docs=3)
    model = Llama(CFG, mesh=auto_mesh(4), layout="striped", backward="q")
    compare_with_single_device(model, seg, "striped+segments")


def test_targets_shift_in_natural_order():
    """Every token after the first is the target of exactly one row, whatever the layout."""
    toks = jnp.asarray(np.arange(B * S).reshape(B, S) % 1000)
    targets, weights = shift_targets(toks)
    assert float(weights.sum()) == B * (S - 1)
    np.testing.assert_array_equal(np.asarray(targets[:, :-1]), np.asarray(toks[:, 1:]))
    model = Llama(CFG, mesh=auto_mesh(8), layout="zigzag")
    lt, lw = model.to_layout(targets), model.to_layout(weights)
    perm = model.permutation(S)
    assert perm.tolist() != list(range(S))
    for b in range(B):
        got = sorted(np.asarray(lt[b])[np.asarray(lw[b]) > 0].tolist())
        assert got == sorted(np.asarray(toks[b, 1:]).tolist())
        # row t of the layout predicts the token after the one it holds
        np.testing.assert_array_equal(np.asarray(lt[b])[np.asarray(lw[b]) > 0],
                                      np.asarray(toks[b])[perm[np.asarray(lw[b]) > 0] + 1])
    seg = jnp.asarray(np.repeat([[0] * 10 + [1] * (S - 10)], B, 0))
    mask = jnp.ones((B, S), bool).at[:, 20].set(False)
    _, w = shift_targets(toks, loss_mask=mask, segment_ids=seg)
    assert float(w[0, 9]) == 0 and float(w[0, 19]) == 0 and float(w.sum()) == B * (S - 3)


def test_loss_is_cross_entropy_of_natural_order_logits():
    model = Llama(CFG, mesh=auto_mesh(8), layout="zigzag")
    params, toks = single_device_params(), tokens(2)
    _, (loss, m), _ = logits_loss_and_grad(model)(params, toks, None)
    logits, _, _ = logits_loss_and_grad(Llama(CFG))(params, toks, None)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, toks[:, 1:, None], axis=-1)
    assert_close(loss, nll.mean(), TOL, "loss")
    acc = (jnp.argmax(logits[:, :-1], -1) == toks[:, 1:]).mean()
    assert abs(float(m["accuracy"]) - float(acc)) < 1e-6


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="num_kv_heads"):
        LlamaConfig(vocab_size=8, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="remat='selective'"):
        LlamaConfig(vocab_size=8, remat="selective")
    with pytest.raises(ValueError, match="head_dim=7"):
        LlamaConfig(vocab_size=8, d_model=28, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="vocab_size"):
        LlamaConfig(vocab_size=0)
    with pytest.raises(ValueError, match="remat='attention'"):
        Llama(LlamaConfig(vocab_size=8, remat="attention")).init(
            jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    assert LlamaConfig(vocab_size=8, d_model=64).ffn_dim == 176
    with pytest.raises(dataclasses.FrozenInstanceError):
        CFG.d_model = 3
