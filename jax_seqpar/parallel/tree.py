"""Tree attention, per device (call inside ``shard_map``): queries everywhere, keys local.

Tree Attention (Shyam et al., Alg. 3): attention is the gradient of the energy
``F(zeta) = log sum_a exp(q.k_a + zeta.v_a)`` at ``zeta = 0``, and both ``max`` and
``logsumexp`` are associative, so with the key/value sequence sharded over the axis:

1. each device runs the local kernel on its shard: ``(o_i, lse_i)`` (Alg. 3 line 2);
2. ``m = pmax(lse_i)`` (line 3);
3. ``n_i = o_i * exp(lse_i - m)``, ``d_i = exp(lse_i - m)`` (line 4);
4. one ``psum`` of ``[n_i, d_i]`` packed into a single buffer (line 5: the paper's two
   sum all-reduces fused into one);
5. ``o = n / d``, ``lse = m + log d`` (line 6), the same on every device.

Only ``O(B * Tq * H * D)`` values cross the network, independent of the context length.
The backward (``custom_vjp``) reuses the saved global ``o`` and ``lse``: each device
computes its shard's ``dk, dv`` and a partial ``dq`` with the kernel, and one ``psum``
adds up ``dq`` (no reduction of the forward is recomputed).

``axis_name`` may be a tuple of mesh axes (e.g. ``("node", "gpu")``) so the reduction
spans a 2-D topology.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_seqpar.kernels.xla import attention_delta
from jax_seqpar.layouts import shard_positions

F32 = jnp.float32


def tree_reduce(o, lse, axis_name):
    """Combine per-device partial ``(o, lse)`` into the global ones (Alg. 3, lines 3-6).

    ``o`` ``[B, T, H, D]`` float32, ``lse`` ``[B, H, T]`` float32; rows with no visible
    key anywhere give ``o = 0``, ``lse = -inf``.
    """
    m = lax.pmax(lse, axis_name)
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    d = jnp.exp(lse - m_safe)                      # [B, H, T]; 0 where nothing is visible
    d_rows = jnp.swapaxes(d, 1, 2)[..., None]      # [B, T, H, 1]
    packed = jnp.concatenate([o * d_rows, d_rows], axis=-1)
    packed = lax.psum(packed, axis_name)           # the one fused sum all-reduce
    n_g, d_g = packed[..., :-1], packed[..., -1:]
    has = d_g > 0
    o_g = n_g / jnp.where(has, d_g, 1.0)
    d_g = jnp.swapaxes(d_g[..., 0], 1, 2)          # [B, H, T]
    lse_g = jnp.where(d_g > 0, m_safe + jnp.log(jnp.where(d_g > 0, d_g, 1.0)), -jnp.inf)
    return o_g, lse_g


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def tree_attention(cfg, q, k, v, q_pos, kv_pos, q_seg=None, kv_seg=None):
    """Attention of replicated ``q`` over this device's key/value shard, reduced over
    ``cfg.axis_name``; returns the global output (``q.dtype``) on every device."""
    o, _ = _forward(cfg, q, k, v, q_pos, kv_pos, q_seg, kv_seg)
    return o.astype(q.dtype)


def _forward(cfg, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    o, lse = cfg.kernel.fwd(q, k, v, q_pos, kv_pos, cfg.mask, cfg.scale, q_seg, kv_seg)
    return tree_reduce(o.astype(jnp.float32), lse, cfg.axis_name)


def _fwd(cfg, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    o, lse = _forward(cfg, q, k, v, q_pos, kv_pos, q_seg, kv_seg)
    o = o.astype(q.dtype)
    return o, (q, k, v, q_pos, kv_pos, q_seg, kv_seg, o, lse)


def _bwd(cfg, res, do):
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, o, lse = res
    delta = attention_delta(o, do)
    dq, dk, dv = cfg.kernel.bwd(q, k, v, None, lse, do, q_pos, kv_pos, cfg.mask, cfg.scale,
                                q_seg, kv_seg, delta=delta)
    dq = lax.psum(dq, cfg.axis_name)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


tree_attention.defvjp(_fwd, _bwd)


# --------------------------------------------------------------------------------------
# strategy="tree" for full self-attention: queries gathered, keys and values stay put.
# --------------------------------------------------------------------------------------

def tree_sequence_attention_with_config(cfg, q, k, v, segment_ids=None):
    """Self-attention of a sequence sharded over ``cfg.axis_name`` by tree reduction.

    Per device (inside ``shard_map``; ``q, k, v`` are this device's ``T = S / G`` tokens
    in ``cfg.layout`` order):

    1. ``all_gather`` the queries (and their segment ids): every device holds all ``S``;
    2. attend all queries to the local key/value shard: partial ``(o, lse)`` ``[B, S, ...]``;
    3. Alg. 3 lines 3-6, with the sum all-reduce replaced by its first half, a
       ``psum_scatter``: each device receives the reduced numerator and denominator of its
       own ``T`` queries only (an all-reduce is a reduce-scatter plus an all-gather, and
       nobody needs the other devices' rows).

    Memory: the gathered queries and the partial ``(o, lse)`` are ``O(S)`` per device
    (``S * Hq * (2 D + 2)`` values, float32 for the partials), against ``O(S / G)`` for
    ring attention.  Traffic per device: the query all-gather ``(G-1)/G * S Hq D`` elements,
    a ``pmax`` of ``lse`` and the reduce-scatter of ``(D + 1)`` floats per query row, all
    independent of how long the keys circulate -- there is no ring.  Prefer it when the
    queries are few compared with the keys (decoding: ``tree_decode``) or when ``G`` is
    small and the interconnect latency, not bandwidth, dominates; prefer ring for long
    training sequences, where ``O(S)`` per-device buffers are what sharding avoids.
    """
    seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
    return _tree_seq(cfg, q, k, v, seg)


def _gather(x, axis_name, axis):
    return lax.all_gather(x, axis_name, axis=axis, tiled=True)


def _positions(cfg, T):
    G = lax.axis_size(cfg.axis_name)
    idx = lax.axis_index(cfg.axis_name)
    kv_pos = shard_positions(cfg.layout, idx, T, G, stripe=cfg.stripe)
    q_pos = jnp.concatenate([shard_positions(cfg.layout, j, T, G, stripe=cfg.stripe)
                             for j in range(G)])
    return q_pos, kv_pos


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tree_seq(cfg, q, k, v, seg):
    return _tree_seq_fwd(cfg, q, k, v, seg)[0]


def gathered_query_attention(cfg, q, k, v, q_pos_all, kv_pos, seg_all=None, kv_seg=None):
    """Steps 1-3 above with the positions given: this device's queries ``q`` ``[B, T, ...]``
    are gathered over ``cfg.axis_name`` (every device then holds all ``G * T`` rows, whose
    global positions are ``q_pos_all`` ``[G * T]``, segment ids ``seg_all`` ``[B, G * T]``)
    and attend to the local keys at ``kv_pos`` ``[Tk]`` (``Tk`` need not equal ``T``);
    one ``pmax`` and one ``psum_scatter`` return this device's rows: ``(o, lse)`` with
    ``o`` ``[B, T, Hq, D]`` in ``q.dtype`` and ``lse`` ``[B, Hq, T]`` float32.

    ``models.generate`` uses it to prefill a prompt chunk against the KV cache already
    written (queries few, keys many: Tree Attention Alg. 3, lines 2-6).
    """
    T = q.shape[1]
    ax = cfg.axis_name
    q_all = _gather(q, ax, 1)
    o, lse = cfg.kernel.fwd(q_all, k, v, q_pos_all, kv_pos, cfg.mask, cfg.scale, seg_all,
                            kv_seg)
    o = o.astype(jnp.float32)
    m = lax.pmax(lse, ax)                                  # [B, H, S], Alg. 3 line 3
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    d = jnp.exp(lse - m_safe)
    d_rows = jnp.swapaxes(d, 1, 2)[..., None]              # [B, S, H, 1]
    packed = jnp.concatenate([o * d_rows, d_rows], axis=-1)
    packed = lax.psum_scatter(packed, ax, scatter_dimension=1, tiled=True)  # [B, T, H, D+1]
    n_l, d_l = packed[..., :-1], packed[..., -1:]
    o_l = (n_l / jnp.where(d_l > 0, d_l, 1.0)).astype(q.dtype)
    idx = lax.axis_index(ax)
    m_l = lax.dynamic_slice_in_dim(m_safe, idx * T, T, axis=2)
    d_l = jnp.swapaxes(d_l[..., 0], 1, 2)                  # [B, H, T]
    lse_l = jnp.where(d_l > 0, m_l + jnp.log(jnp.where(d_l > 0, d_l, 1.0)), -jnp.inf)
    return o_l, lse_l


def _tree_seq_fwd(cfg, q, k, v, seg):
    q_pos, kv_pos = _positions(cfg, q.shape[1])
    seg_all = None if seg is None else _gather(seg, cfg.axis_name, 1)
    o_l, lse_l = gathered_query_attention(cfg, q, k, v, q_pos, kv_pos, seg_all, seg)
    return o_l, (q, k, v, seg, o_l, lse_l)


def _tree_seq_bwd(cfg, res, do):
    q, k, v, seg, o, lse = res
    T = q.shape[1]
    ax = cfg.axis_name
    q_pos, kv_pos = _positions(cfg, T)
    delta = attention_delta(o, do)                         # [B, H, T], own rows
    q_all, do_all = _gather(q, ax, 1), _gather(do, ax, 1)
    lse_all, delta_all = _gather(lse, ax, 2), _gather(delta, ax, 2)
    seg_all = None if seg is None else _gather(seg, ax, 1)
    dq, dk, dv = cfg.kernel.bwd(q_all, k, v, None, lse_all, do_all, q_pos, kv_pos, cfg.mask,
                                cfg.scale, seg_all, seg, delta=delta_all)
    dq = lax.psum_scatter(dq, ax, scatter_dimension=1, tiled=True)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_tree_seq.defvjp(_tree_seq_fwd, _tree_seq_bwd)
