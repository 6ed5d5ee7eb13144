"""Issue 18: parameters, gradients and optimizer state sharded over the devices (FSDP)."""

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import helpers
from jax_seqpar.sharding.fsdp import bytes_per_device, fsdp_shardings, fsdp_spec, replicated_shardings
from jax_seqpar.models import Llama, LlamaConfig, next_token_loss


@pytest.mark.parametrize("shape,n,want", [
    ((64, 256), 4, P(None, "sp")),          # the largest divisible dimension
    ((256, 64), 4, P("sp", None)),
    ((96, 96), 4, P("sp", None)),           # ties: the first
    ((6, 4096), 8, P(None, "sp")),
    ((7, 4099), 4, P(None, None)),          # nothing divisible: replicated
    ((64,), 4, P(None)),                    # small: replicated
    ((512, 512), 1, P(None, None)),         # one shard
])
def test_fsdp_spec(shape, n, want):
    assert fsdp_spec(shape, n, "sp", min_elements=1000) == want


def test_fsdp_spec_validates():
    with pytest.raises(ValueError, match="num_shards"):
        fsdp_spec((8, 8), 0, "sp")
    mesh = helpers.make_mesh(2)
    with pytest.raises(ValueError, match="axis='dp'"):
        fsdp_shardings({"w": jnp.ones((8, 8))}, mesh, "dp")


def _setup(G, mode, seed=0):
    mesh = jax.make_mesh((G,), ("sp",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:G])
    cfg = LlamaConfig(vocab_size=96, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2,
                      remat="attention")
    model = Llama(cfg, mesh=mesh, layout="zigzag")
    tokens = jax.random.randint(jax.random.PRNGKey(seed), (2, 128), 0, 96, jnp.int32)
    opt = optax.adamw(3e-3)
    init = lambda k: model.init(k, tokens)  # noqa: E731
    p_shape = jax.eval_shape(init, jax.random.PRNGKey(1))
    o_shape = jax.eval_shape(opt.init, p_shape)
    if mode == "fsdp":
        p_sh = fsdp_shardings(p_shape, mesh, "sp", min_elements=0)
        o_sh = fsdp_shardings(o_shape, mesh, "sp", min_elements=0)
    else:
        p_sh, o_sh = replicated_shardings(p_shape, mesh), replicated_shardings(o_shape, mesh)
    params = jax.jit(init, out_shardings=p_sh)(jax.random.PRNGKey(1))
    opt_state = jax.jit(opt.init, out_shardings=o_sh)(params)

    def step(params, opt_state, tokens):
        (loss, _), g = jax.value_and_grad(lambda p: next_token_loss(model, p, tokens),
                                          has_aux=True)(params)
        upd, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss

    step = jax.jit(step, in_shardings=(p_sh, o_sh, NamedSharding(mesh, P())),
                   out_shardings=(p_sh, o_sh, None))
    return step, params, opt_state, tokens, (p_shape, p_sh, o_shape, o_sh)


def test_sharded_training_equals_replicated():
    """Three AdamW steps on 4 devices: same losses and parameters either way, and the
    sharded state really is split (each device holds about a quarter)."""
    runs = {}
    for mode in ("replicated", "fsdp"):
        step, params, opt_state, tokens, shapes = _setup(4, mode)
        losses = []
        for _ in range(3):
            params, opt_state, loss = step(params, opt_state, tokens)
            losses.append(float(loss))
        runs[mode] = (losses, params, shapes)
    (l_rep, p_rep, _), (l_fsdp, p_fsdp, (p_shape, p_sh, o_shape, o_sh)) = (
        runs["replicated"], runs["fsdp"])
    np.testing.assert_allclose(l_fsdp, l_rep, rtol=1e-5)
    assert l_rep[-1] < l_rep[0]  # it trains
    for a, b in zip(jax.tree.leaves(p_fsdp), jax.tree.leaves(p_rep)):
        assert helpers.rel_err(a, b) <= 1e-5
    # where the arrays live: the embedding is split over the 4 devices
    emb = p_fsdp["params"]["embed"]["embedding"]
    assert emb.sharding.spec != P(None, None) and len(emb.addressable_shards) == 4
    assert emb.addressable_shards[0].data.size * 4 == emb.size
    full = bytes_per_device(p_shape, replicated_shardings(p_shape, p_sh[
        "params"]["embed"]["embedding"].mesh))
    assert bytes_per_device(p_shape, p_sh) < 0.4 * full
    assert bytes_per_device(o_shape, o_sh) < 0.4 * 2 * full


def test_train_mfu_cpu_preset(capsys):
    """``benchmarks/train_mfu.py --preset cpu --packed 64`` runs a packed and an unpacked
    step on the same tokens and prints both; packed FLOPs count within-document pairs."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import train_mfu

    small = LlamaConfig(vocab_size=10, d_model=8, num_layers=1, num_heads=2, num_kv_heads=1,
                        ffn_dim=16)
    fl = train_mfu.flops_per_token(small, 4)
    # q (8x8) + k, v (8x4 each) + o (8x8) = 192, 3 ffn (8x16) = 384, head (8x10) = 80
    assert fl["n_matmul"] == 656 and fl["attention"] == 6 * 1 * 4 * 2 * 4
    # documents of 1 and 3 tokens: (1 + 9) / 4 keys per query on average instead of 4
    packed = train_mfu.flops_per_token(small, 4, documents=[1, 3])
    assert packed["dense"] == fl["dense"] and packed["attention"] == 6 * 1 * 2.5 * 2 * 4
    row = train_mfu.packed_row(512, 64, 10, seed=1)  # 9 documents
    assert row["lengths"].sum() == 512 and len(row["lengths"]) > 3
    starts = np.flatnonzero(np.diff(row["segment_ids"][0], prepend=0))
    assert (row["positions"][0, starts] == 0).all() and row["positions"][0].max() > 0
    assert train_mfu.main(["--preset", "cpu", "--devices", "2", "--steps", "1",
                           "--packed", "64"]) == 0
    out = capsys.readouterr().out
    assert f"tiny  2      512  1 fsdp       {'attention':22s} packed" in out
    assert f"tiny  2      512  1 fsdp       {'attention':22s} unpacked" in out


def test_train_mfu_remat_switches_and_memory_account(capsys):
    """Issue 30: ``--remat`` takes several entries (``+offload`` included), one row each,
    and ``--memory-account`` prints the counted residuals next to XLA's account."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import train_mfu

    assert train_mfu.parse_remat("attention_mlp+offload") == ("attention_mlp", True)
    for bad in ("layer", "attention+host", "none+offload+x"):
        with pytest.raises(ValueError, match="--remat entry"):
            train_mfu.parse_remat(bad)
    cfg = LlamaConfig(vocab_size=10, d_model=8, num_layers=3, num_heads=2, num_kv_heads=1,
                      ffn_dim=16, remat="attention_mlp", dtype="bfloat16")
    per = train_mfu.residual_bytes(cfg, 4)
    # block input 4x8 bf16; attention out 4x(2x4) bf16 + lse 2x4 float32; gate + up 2x4x16
    assert per == {"block input": 64, "attention out + lse": 64 + 32, "mlp gate + up": 256}
    assert train_mfu.residual_bytes(dataclasses.replace(cfg, remat="none"), 4) is None
    assert train_mfu.main(["--preset", "cpu", "--devices", "1", "--steps", "1", "--remat",
                           "attention_mlp,full+offload", "--memory-account",
                           "--opt-memory", "pinned_host"]) == 0
    out = capsys.readouterr().out
    assert "remat attention_mlp: step" in out and "remat full+offload: step" in out
    assert "on the host (block input" in out and "XLA: arguments" in out
    assert "optimizer state 0.00 on the host" in out
