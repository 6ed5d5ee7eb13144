"""Worker of tests/test_multiprocess.py: one training step of a tiny attention model whose
sequence is sharded over the devices of every process.

    python -m jax_seqpar launch -n 2 --devices-per-process 4 -- \\
        python tests/mp_worker_train.py OUT.npz

The model is defined here (``jax_seqpar.models`` did not exist when this test was
written): token embedding, one causal GQA ``jax_seqpar.attention`` layer (ring, zigzag)
with query/key/value/output projections and a residual connection, a readout, and the
mean next-token cross-entropy.  One ``optax.adamw`` step; process 0 writes the loss,
the gradients and the updated parameters to ``OUT.npz``.  The test runs
``train_step`` in its own process on 8 devices and compares.
"""

from __future__ import annotations

import functools
import sys

import numpy as np

VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM = 32, 32, 4, 2, 8
BATCH, SEQ = 2, 64
LEARNING_RATE = 1e-2


def host_params(seed: int = 0):
    """Float32 parameters as NumPy arrays (the same on every process)."""
    rng = np.random.default_rng(seed)

    def init(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

    return {"embed": init(VOCAB, DIM), "wq": init(DIM, HEADS * HEAD_DIM),
            "wk": init(DIM, KV_HEADS * HEAD_DIM), "wv": init(DIM, KV_HEADS * HEAD_DIM),
            "wo": init(HEADS * HEAD_DIM, DIM), "readout": init(DIM, VOCAB)}


def host_batch(seed: int = 1):
    """``(tokens, targets)`` int32 ``[BATCH, SEQ]``: targets are the tokens shifted by one."""
    rng = np.random.default_rng(seed)
    seq = rng.integers(0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)
    return seq[:, :-1], seq[:, 1:]


def loss_fn(params, tokens, targets, mesh):
    """Mean next-token cross-entropy; ``mesh=None``: dense ``jax.nn`` attention, one device."""
    import jax
    import jax.numpy as jnp

    import jax_seqpar as jsp

    B, S = tokens.shape
    x = jax.nn.one_hot(tokens, VOCAB, dtype=jnp.float32) @ params["embed"]
    q = (x @ params["wq"]).reshape(B, S, HEADS, HEAD_DIM)
    k = (x @ params["wk"]).reshape(B, S, KV_HEADS, HEAD_DIM)
    v = (x @ params["wv"]).reshape(B, S, KV_HEADS, HEAD_DIM)
    if mesh is None:
        att = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    else:
        att = jsp.attention(q, k, v, mesh=mesh, axis_name="sp", strategy="ring", causal=True,
                            layout="zigzag")
    h = x + att.reshape(B, S, HEADS * HEAD_DIM) @ params["wo"]
    logits = h @ params["readout"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(targets, VOCAB, dtype=jnp.float32), -1))


@functools.lru_cache(maxsize=None)
def train_step(mesh):
    """Jitted ``(params, opt_state, tokens, targets) -> (params, opt_state, loss, grads)``
    (``mesh=None``: the dense single-device oracle)."""
    import jax
    import optax

    opt = optimizer()

    def step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets, mesh)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    return jax.jit(step)


def optimizer():
    import optax

    return optax.adamw(LEARNING_RATE, weight_decay=0.1)


def run(mesh) -> dict:
    """One step on ``mesh``: host ``loss``, ``grads/<name>`` and the updated ``params/<name>``
    (on every process)."""
    import jax
    from jax.sharding import PartitionSpec as P

    import jax_seqpar.runtime.distributed as jd

    params = jd.from_host(host_params(), mesh, P())  # replicated on every device
    tokens, targets = jd.from_host(host_batch(), mesh, P(None, "sp"))
    with jax.set_mesh(mesh):  # explicit-axis mesh: optax's step counter needs one too
        opt_state = jax.jit(optimizer().init)(params)
        params, opt_state, loss, grads = train_step(mesh)(params, opt_state, tokens, targets)
    host = jd.to_host({"params": params, "grads": grads, "loss": loss})
    return {"loss": host["loss"],
            "tokens_fully_addressable": np.bool_(tokens.is_fully_addressable),
            **{f"params/{k}": v for k, v in host["params"].items()},
            **{f"grads/{k}": v for k, v in host["grads"].items()}}


def main(out_path: str) -> int:
    import jax_seqpar.runtime.distributed as jd

    info = jd.initialize()
    import jax

    print(info, flush=True)
    results = run(jax.make_mesh((jax.device_count(),), ("sp",)))
    if info.is_main:
        np.savez(out_path, process_count=np.int32(info.process_count), **results)
        print(f"loss {float(results['loss']):.6f}; wrote {out_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
