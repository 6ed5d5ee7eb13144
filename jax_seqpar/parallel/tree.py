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
    return tree_reduce(o, lse, cfg.axis_name)


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
