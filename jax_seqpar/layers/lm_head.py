"""Fused LM head + cross-entropy, tiled along the sequence and the vocabulary.

BurstEngine §3.3, Algorithm 3 ("sequence-level fusion of LM head and loss function").
The logits ``h @ w`` of a long sequence against a large vocabulary dwarf everything else
(float32 ``[128k, 128k]`` is 64 GiB); this module never holds them.  The hidden states
``h`` are cut into row tiles of ``block_s`` tokens (Alg. 3 line 1), the head weights
``w [d, V]`` into column tiles of ``block_v`` words (lines 3 and 8), and the forward
produces the gradients ``dh`` and ``dW`` as it goes (lines 8-13): the backward of the
``custom_vjp`` only multiplies them by the incoming cotangent, so no logit is computed
twice across forward and backward.

Which pass structure, and its cost (``R`` rows, ``d`` model width, ``V`` vocabulary)
---------------------------------------------------------------------------------------
The gradient of a softmax needs each row's *final* logsumexp, so the gradient tiles of a
row tile cannot be formed while its lse is still running.  Alg. 3 answers with two inner
loops per row tile: lines 3-6 accumulate the lse over the vocabulary tiles, line 7 forms
the loss, and lines 8-13 form ``exp(Logits_ij - Lse_i)`` and the two gradient products.
Line 9 reads ``Logits_ij`` -- the tiles of line 4 -- without computing them again, and
the text says the fusion works "without the need to recompute P and Logits"; that needs
the row tile's logits for the whole vocabulary, ``block_s x V``, kept between the loops.
Both readings are offered:

* ``block_v=None`` (default; ``block_v >= V`` means the same): **Alg. 3 as written**.
  Each row tile's logits ``[block_s, V]`` are computed once in one matmul (lines 3-4 with
  a single vocabulary tile), reduced to the lse (5-6), turned into the gradient tile
  (9-11) and consumed by the two gradient matmuls (12-13).  **3 matmuls, 6·R·d·V FLOPs**:
  exactly the floor (forward logits + ``dh`` + ``dW``), plus O(R·V) elementwise work.
  Memory beyond inputs and gradients: ``block_s x V`` float32 logits and the gradient
  tile in the compute dtype.  Pick ``block_s`` so that fits (the default aims at 2^29
  elements, 2 GiB of float32).
* ``block_v < V``: **two passes over vocabulary tiles** per row tile: lines 3-6 with an
  online (running max) lse, then lines 8-13 with every logits tile computed again.
  **4 matmuls, 8·R·d·V FLOPs** (4/3 of the floor), memory ``block_s x block_v``.
* Not differentiated (evaluation: the ``custom_vjp``'s primal): lines 1-7 only, one
  logits matmul (2·R·d·V FLOPs; 4·R·d·V with ``block_v < V``), no gradient tiles.

Why not one logits pass with O(block_s x block_v) memory: ``dh_i = sum_j P_ij W_j^T``
could be rescaled online like attention's output (the row scale ``exp(m_old - m_new)``
factors out), but ``dW_j = sum_i H_i^T P_ij`` mixes rows, and each row needs a different
final scale ``exp(-Lse_i)`` that is unknown until the row's last vocabulary tile: the
vocabulary tiles' contributions to ``dW`` cannot be corrected after the fact, and
swapping the loops moves the problem to ``dh``.  So the choice is between holding a row
tile's logits (3 matmuls) and recomputing them (4 matmuls); the default holds them.

Conventions
-----------
``h [B, S, d]``, ``w [d, V]`` (a Flax ``Dense`` kernel; pass ``embedding.T`` for a tied
embedding), ``targets [B, S]`` ints, ``weights [B, S]`` or None.  Paper signs: Alg. 3
lines 12-13 print ``(grad Logits + E)``; the gradient of ``-log p_y`` is ``P - E``, which
is what is computed.  Line 7's ``-H_i . W_target`` (a gather of ``w`` columns) is taken
from the logits tile instead (the target's logit is picked where its column is), which
costs no extra pass over ``w`` and gives the accuracy from the same rounded logits.

Extras users of such losses expect: per-token ``weights`` (the mean is over the total
weight, exact across devices), ignored labels (``targets < 0`` and ``ignore_index``),
``z_loss`` (``coef * lse^2`` per token), ``label_smoothing`` (target distribution
``(1 - eps) onehot + eps / V``) and ``logit_softcap`` (logits ``c * tanh(z / c)``).

Parallelism (``mesh``): ``h``, ``targets``, ``weights`` sharded along the sequence over
``axis_name`` (any token order -- the loss is a sum over tokens, so a layout only has to
permute ``h`` and ``targets`` alike, as ``models.llama.next_token_loss`` does); ``w``
replicated, or sharded along the vocabulary over ``vocab_axis`` (vocab parallel): each row
tile's lse then combines across the vocabulary shards with one ``pmax`` and one ``psum``
(Tree Attention's reduction: the sum of exponentials, the target logit and, for label
smoothing, the logit sum travel packed in one buffer), ``dh`` is ``psum``-ed over the
vocabulary axis and ``dW`` stays sharded.  ``dW`` of the replicated (or vocabulary-
sharded) weights is ``psum``-ed over the sequence (and batch) axes once, at the end.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, Float, Int

from jax_seqpar.runtime import _compat

F32 = jnp.float32
AxisName = Union[str, Tuple[str, ...]]

#: Default row-tile size aims at this many logits per tile (2 GiB of float32).
TILE_ELEMENTS = 1 << 29


def _axes(name) -> Tuple[str, ...]:
    if name is None:
        return ()
    return tuple(name) if isinstance(name, (tuple, list)) else (name,)


@dataclasses.dataclass(frozen=True)
class LMHeadConfig:
    """Static options of one fused LM-head loss call (hashable; see ``fused_lm_head_loss``)."""

    block_s: Optional[int] = None
    block_v: Optional[int] = None
    ignore_index: Optional[int] = None
    z_loss: float = 0.0
    label_smoothing: float = 0.0
    logit_softcap: Optional[float] = None
    dtype: Optional[str] = None
    mesh: Optional[Mesh] = None
    seq_axes: Tuple[str, ...] = ()
    vocab_axis: Optional[str] = None
    batch_axes: Tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("block_s", "block_v"):
            val = getattr(self, name)
            if val is not None and (isinstance(val, bool) or not isinstance(val, int)
                                    or val < 1):
                raise ValueError(f"{name}={val!r} must be a positive int or None")
        if self.ignore_index is not None and (isinstance(self.ignore_index, bool)
                                              or not isinstance(self.ignore_index, int)):
            raise TypeError(f"ignore_index={self.ignore_index!r} must be an int or None")
        if not (isinstance(self.z_loss, (int, float)) and self.z_loss >= 0):
            raise ValueError(f"z_loss={self.z_loss!r} must be a float >= 0 (0 disables it)")
        if not (isinstance(self.label_smoothing, (int, float))
                and 0 <= self.label_smoothing < 1):
            raise ValueError(f"label_smoothing={self.label_smoothing!r} must be in [0, 1)")
        cap = self.logit_softcap
        if cap is not None and not (isinstance(cap, (int, float)) and cap > 0):
            raise ValueError(f"logit_softcap={cap!r} must be a positive float or None")
        if self.dtype is not None:
            try:
                jnp.dtype(self.dtype)
            except TypeError:
                raise ValueError(f"dtype={self.dtype!r} is not a dtype name") from None
        if self.mesh is None:
            if self.vocab_axis is not None or self.batch_axes:
                raise ValueError("vocab_axis and batch_axis need a mesh; pass mesh=...")
            return
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got "
                            f"{type(self.mesh).__name__}")
        named = self.seq_axes + self.batch_axes + _axes(self.vocab_axis)
        for name in named:
            if name not in self.mesh.axis_names:
                raise ValueError(f"axis {name!r} is not an axis of the mesh "
                                 f"(mesh.axis_names={self.mesh.axis_names})")
        if len(set(named)) != len(named):
            raise ValueError(f"axis_name, vocab_axis and batch_axis must name different "
                             f"mesh axes; got {named}")

    def shards(self, axes) -> int:
        return int(np.prod([self.mesh.shape[a] for a in axes])) if axes else 1


# --------------------------------------------------------------------------- tile loops
def _tiled(total: int, size: int, body, carry):
    """``body(start, length, carry)`` over ``[0, total)`` in tiles of ``size``.

    The full tiles run in a ``fori_loop`` (traced ``start``, static ``length``); an uneven
    last tile runs once more with its own static length, so nothing is padded or copied.
    """
    n, tail = divmod(total, size)
    if n == 1 and not tail:
        return body(0, size, carry)
    if n:
        carry = lax.fori_loop(0, n, lambda i, c: body(i * size, size, c), carry)
    if tail:
        carry = body(n * size, tail, carry)
    return carry


class _Rows:
    """Per-row quantities of one row tile once its lse is final (Alg. 3 line 7)."""

    def __init__(self, cfg: LMHeadConfig, V: int, m, s, zy, zsum, r):
        eps, zc = float(cfg.label_smoothing), float(cfg.z_loss)
        self.lse = m + jnp.log(s)
        nll = self.lse - (1.0 - eps) * zy
        if eps:
            nll = nll - (eps / V) * zsum
        self.zl = zc * self.lse * self.lse
        self.obj = nll + self.zl
        self.correct = (zy >= m).astype(F32)      # the target's logit is the row maximum
        # d(r * obj)/dz = a * softmax(z) - b * onehot - c   (times the softcap's slope)
        self.a = r * (1.0 + 2.0 * zc * self.lse)
        self.b = r * (1.0 - eps)
        self.c = r * (eps / V)


class _Local:
    """Alg. 3 on one device's rows and vocabulary columns (runs inside ``shard_map`` or
    alone).  ``v0`` is the global index of this device's first vocabulary column."""

    def __init__(self, cfg: LMHeadConfig, V: int, v0, cdt):
        self.cfg, self.V, self.v0, self.cdt = cfg, V, v0, cdt
        self.cap = cfg.logit_softcap
        self.vaxis = cfg.vocab_axis

    def logits(self, hc, wt):
        """Alg. 3 line 4: ``Logits_ij = H_i W_j`` (compute-dtype operands, float32 sums)."""
        z = jnp.dot(hc, wt, preferred_element_type=F32)
        if self.cap is not None:
            z = self.cap * jnp.tanh(z / self.cap)
        return z

    def tile_stats(self, z, yc, col0):
        """Max, target logit (0 where the target is elsewhere) and logit sum of a tile."""
        n, bv = z.shape
        local = yc - col0
        hit = (local >= 0) & (local < bv)
        picked = jnp.take_along_axis(z, jnp.clip(local, 0, bv - 1)[:, None], axis=1)[:, 0]
        zy = jnp.where(hit, picked, 0.0)
        zsum = jnp.sum(z, axis=1) if self.cfg.label_smoothing else jnp.zeros((n,), F32)
        return jnp.max(z, axis=1), zy, zsum

    def combine(self, m, s, zy, zsum):
        """Across vocabulary shards: one ``pmax`` and one packed ``psum`` (Tree Attention)."""
        if self.vaxis is None:
            return m, s, zy, zsum
        g = lax.pmax(m, self.vaxis)
        parts = [s * jnp.exp(m - g), zy] + ([zsum] if self.cfg.label_smoothing else [])
        red = lax.psum(jnp.stack(parts), self.vaxis)
        return g, red[0], red[1], (red[2] if self.cfg.label_smoothing else zsum)

    def grad_tile(self, z, rows: _Rows, yc, col0):
        """Alg. 3 lines 9-11 (with the sign of ``P - E``) for one tile, in the compute dtype."""
        n, bv = z.shape
        p = jnp.exp(z - rows.lse[:, None])
        cols = col0 + lax.broadcasted_iota(jnp.int32, (n, bv), 1)
        onehot = cols == yc[:, None]
        g = rows.a[:, None] * p - jnp.where(onehot, rows.b[:, None], 0.0)
        if self.cfg.label_smoothing:
            g = g - rows.c[:, None]
        if self.cap is not None:
            g = g * (1.0 - jnp.square(z / self.cap))   # d(c tanh(x / c))/dx
        return g.astype(self.cdt)

    def row_tile(self, hc, yc, rc, w, dw):
        """One row tile ``H_i`` (Alg. 3 lines 2-13): returns its rows' values, ``dh_i``
        (float32) and ``dW`` with this tile's contribution added.  ``dw=None``: the loss
        alone (lines 2-7; no gradient tile, no gradient matmul)."""
        Vl = w.shape[1]
        bv = Vl if self.cfg.block_v is None else min(self.cfg.block_v, Vl)
        dot_t = lambda g, wt: lax.dot_general(  # noqa: E731  g @ wt.T
            g, wt, (((1,), (1,)), ((), ())), preferred_element_type=F32)
        dot_h = lambda g: lax.dot_general(  # noqa: E731  hc.T @ g
            hc, g, (((0,), (0,)), ((), ())), preferred_element_type=F32)
        if bv == Vl:   # Alg. 3 as written: the row tile's logits are kept between the loops
            z = self.logits(hc, w)                                   # line 4
            m, zy, zsum = self.tile_stats(z, yc, self.v0)
            s = jnp.sum(jnp.exp(z - m[:, None]), axis=1)             # lines 5-6
            m, s, zy, zsum = self.combine(m, s, zy, zsum)
            rows = _Rows(self.cfg, self.V, m, s, zy, zsum, rc)       # line 7
            if dw is None:
                return rows, None, None
            g = self.grad_tile(z, rows, yc, self.v0)                 # lines 9-11
            dh = dot_t(g, w)                                         # line 12
            dw = dw + dot_h(g)                                       # line 13
        else:          # two passes over vocabulary tiles, the logits computed twice
            n = hc.shape[0]

            def lse_pass(start, size, c):                            # lines 3-6, online
                m, s, zy, zsum = c
                z = self.logits(hc, lax.dynamic_slice_in_dim(w, start, size, axis=1))
                mt, zyt, zst = self.tile_stats(z, yc, self.v0 + start)
                mn = jnp.maximum(m, mt)
                s = s * jnp.exp(m - mn) + jnp.sum(jnp.exp(z - mn[:, None]), axis=1)
                return mn, s, zy + zyt, zsum + zst

            init = (jnp.full((n,), -jnp.inf, F32),) + tuple(jnp.zeros((n,), F32)
                                                            for _ in range(3))
            init = _compat.vary_like(init, hc, yc, w)
            m, s, zy, zsum = self.combine(*_tiled(Vl, bv, lse_pass, init))
            rows = _Rows(self.cfg, self.V, m, s, zy, zsum, rc)       # line 7
            if dw is None:
                return rows, None, None

            def grad_pass(start, size, c):                           # lines 8-13
                dh, dw = c
                wt = lax.dynamic_slice_in_dim(w, start, size, axis=1)
                g = self.grad_tile(self.logits(hc, wt), rows, yc, self.v0 + start)
                dwt = lax.dynamic_slice_in_dim(dw, start, size, axis=1) + dot_h(g)
                return dh + dot_t(g, wt), lax.dynamic_update_slice_in_dim(dw, dwt, start, 1)

            dh0 = _compat.vary_like(jnp.zeros((n, hc.shape[1]), F32), hc, w)
            dh, dw = _tiled(Vl, bv, grad_pass, (dh0, dw))
        if self.vaxis is not None:
            dh = lax.psum(dh, self.vaxis)
        return rows, dh, dw


def _block_rows(cfg: LMHeadConfig, R: int, Vl: int) -> int:
    if cfg.block_s is not None:
        return min(cfg.block_s, R)
    bv = Vl if cfg.block_v is None else min(cfg.block_v, Vl)
    bs = max(256, (TILE_ELEMENTS // bv) // 256 * 256)
    return min(bs, R)


def _per_device(cfg: LMHeadConfig, V: int, grads: bool, h, w, targets, weights):
    """Loss, metrics and (``grads=True``) the cotangent-free gradients of this device's rows.

    Returns ``(loss, accuracy, z_loss, tokens, dh, dw, dweights)``; ``dh``/``dweights`` are
    this device's rows, ``dw`` this device's vocabulary columns, already summed over rows.
    With ``grads=False`` (the loss is not differentiated: evaluation) the gradient tiles
    and matmuls are skipped and only the first four are returned.
    """
    B, T, d = h.shape
    R, Vl = B * T, w.shape[1]
    cdt = jnp.dtype(cfg.dtype) if cfg.dtype is not None else h.dtype
    row_axes = cfg.batch_axes + cfg.seq_axes
    vidx = 0 if cfg.vocab_axis is None else lax.axis_index(cfg.vocab_axis)
    v0 = (vidx * Vl).astype(jnp.int32) if cfg.vocab_axis else 0
    h2 = h.reshape(R, d).astype(cdt)
    wc = w.astype(cdt)
    y = targets.reshape(R).astype(jnp.int32)
    valid = (y >= 0) & (y < V)
    if cfg.ignore_index is not None:
        valid = valid & (y != cfg.ignore_index)
    wr = jnp.where(valid, weights.reshape(R).astype(F32), 0.0)
    total = jnp.sum(wr)
    bad = jnp.any(y >= V)
    if row_axes:
        total, bad = lax.psum((total, bad.astype(F32)), row_axes)
        bad = bad > 0
    denom = jnp.where(total > 0, total, 1.0)
    r = wr / denom                                    # each row's share of the mean
    local = _Local(cfg, V, v0, cdt)
    bs = _block_rows(cfg, R, Vl)

    def body(start, size, c):                         # Alg. 3 line 1: row tiles H_i
        obj, zl, corr, *g = c
        sl = lambda x: lax.dynamic_slice_in_dim(x, start, size, 0)  # noqa: E731
        rows, dh, dw = local.row_tile(sl(h2), sl(y), sl(r), wc, g[1] if g else None)
        put = lambda buf, x: lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype),  # noqa
                                                             start, 0)
        out = (put(obj, rows.obj), put(zl, rows.zl), put(corr, rows.correct))
        return out + ((put(g[0], dh), dw) if g else ())

    init = tuple(_compat.vary_like(jnp.zeros((R,), F32), h, targets, weights)
                 for _ in range(3))
    if grads:
        init += (_compat.vary_like(jnp.zeros((R, d), h.dtype), h),
                 _compat.vary_like(jnp.zeros((d, Vl), F32), h, w))
    obj, zl, corr, *g = _tiled(R, bs, body, init)
    sums = jnp.stack([jnp.sum(r * obj), jnp.sum(r * corr), jnp.sum(r * zl)])
    if row_axes:
        sums = lax.psum(sums, row_axes)
    loss = jnp.where(bad, jnp.nan, sums[0])
    if not grads:
        return loss, sums[1], sums[2], total
    dh, dw = g
    if row_axes:
        dw = lax.psum(dw, row_axes)
    dweights = jnp.where(valid, (obj - loss) / denom, 0.0).reshape(B, T)
    return (loss, sums[1], sums[2], total, dh.reshape(B, T, d), dw.astype(w.dtype), dweights)


# --------------------------------------------------------------------------- programs
@functools.lru_cache(maxsize=64)
def _program(cfg: LMHeadConfig, V: int, grads: bool):
    """The jitted forward (loss, metrics and, with ``grads``, the gradients) for one static
    configuration."""
    fn = functools.partial(_per_device, cfg, V, grads)
    if cfg.mesh is not None:
        b = cfg.batch_axes or None
        seq = cfg.seq_axes if len(cfg.seq_axes) > 1 else cfg.seq_axes[0]
        rows, hid = P(b, seq), P(b, seq, None)
        wspec = P(None, cfg.vocab_axis)
        in_specs = (hid, wspec, rows, rows)
        out_specs = (P(), P(), P(), P()) + ((hid, wspec, rows) if grads else ())
        sm = _compat.shard_map(fn, mesh=cfg.mesh, in_specs=in_specs, out_specs=out_specs)

        def fn(h, w, t, wt):  # noqa: F811
            args = [_compat.place(x, cfg.mesh, s) for x, s in zip((h, w, t, wt), in_specs)]
            return sm(*args)
    return jax.jit(fn)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(cfg, h, w, targets, weights):
    """Not differentiated (evaluation): lines 1-7 only, 2·R·d·V FLOPs."""
    loss, acc, zl, tokens = _program(cfg, w.shape[1], False)(h, w, targets, weights)
    return loss, (acc, zl, tokens)


def _fused_fwd(cfg, h, w, targets, weights):
    loss, acc, zl, tokens, dh, dw, dwt = _program(cfg, w.shape[1], True)(h, w, targets,
                                                                          weights)
    return (loss, (acc, zl, tokens)), (dh, dw, dwt)


def _fused_bwd(cfg, res, ct):
    """The gradients were made in the forward (Alg. 3 lines 12-13): scale them by the
    loss cotangent.  The metrics carry no gradient."""
    dh, dw, dwt = res
    g = ct[0].astype(F32)
    return ((g * dh.astype(F32)).astype(dh.dtype), (g * dw.astype(F32)).astype(dw.dtype),
            None, g * dwt)


_fused.defvjp(_fused_fwd, _fused_bwd)


# --------------------------------------------------------------------------- public API
def _validate(h, w, targets, weights, cfg: LMHeadConfig):
    if getattr(h, "ndim", None) != 3:
        raise ValueError(f"h must have shape [batch, seq, d_model]; got shape "
                         f"{getattr(h, 'shape', None)}")
    if getattr(w, "ndim", None) != 2:
        raise ValueError(f"w must have shape [d_model, vocab] (a Dense kernel; pass "
                         f"embedding.T for a tied embedding); got shape "
                         f"{getattr(w, 'shape', None)}")
    for name, x in (("h", h), ("w", w)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name}.dtype={x.dtype} must be a floating dtype")
    B, S, d = h.shape
    if w.shape[0] != d:
        raise ValueError(f"w.shape={w.shape} must be [d_model={d}, vocab] to match "
                         f"h.shape={h.shape}; for a tied embedding [vocab, d] pass its .T")
    if getattr(targets, "shape", None) != (B, S):
        raise ValueError(f"targets must have shape [batch, seq] = {(B, S)}; got "
                         f"{getattr(targets, 'shape', None)}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"targets.dtype={targets.dtype} must be an integer dtype")
    if weights is not None:
        if getattr(weights, "shape", None) != (B, S):
            raise ValueError(f"weights must have shape [batch, seq] = {(B, S)} or be None; "
                             f"got {getattr(weights, 'shape', None)}")
        if not (jnp.issubdtype(weights.dtype, jnp.floating)
                or jnp.issubdtype(weights.dtype, jnp.integer) or weights.dtype == bool):
            raise TypeError(f"weights.dtype={weights.dtype} must be float, int or bool")
    if not isinstance(targets, jax.core.Tracer):
        hi = int(np.max(np.asarray(targets))) if targets.size else -1
        if hi >= w.shape[1]:
            raise ValueError(f"targets hold {hi}, out of range for vocab={w.shape[1]}; "
                             f"targets must be < vocab (negative ones are ignored)")
    if cfg.mesh is not None:
        for what, axes, size in (("axis_name", cfg.seq_axes, S),
                                 ("batch_axis", cfg.batch_axes, B),
                                 ("vocab_axis", _axes(cfg.vocab_axis), w.shape[1])):
            n = cfg.shards(axes)
            if size % n:
                dim = {"axis_name": "seq", "batch_axis": "batch", "vocab_axis": "vocab"}[what]
                raise ValueError(f"{dim} size {size} must be divisible by the {n} devices of "
                                 f"{what}={axes}; pad it")


def fused_lm_head_loss(
    h: Float[Array, "B S d"],
    w: Float[Array, "d V"],
    targets: Int[Array, "B S"],
    weights: Optional[Float[Array, "B S"]] = None,
    *,
    mesh: Optional[Mesh] = None,
    axis_name: AxisName = "sp",
    vocab_axis: Optional[str] = None,
    batch_axis: Optional[AxisName] = None,
    block_s: Optional[int] = None,
    block_v: Optional[int] = None,
    ignore_index: Optional[int] = None,
    z_loss: float = 0.0,
    label_smoothing: float = 0.0,
    logit_softcap: Optional[float] = None,
    dtype=None,
) -> Tuple[Float[Array, ""], Dict[str, Float[Array, ""]]]:
    """Weighted mean cross-entropy of ``softmax(h @ w)`` against ``targets``, fused
    (BurstEngine Alg. 3): the ``[B, S, V]`` logits are never stored, and the gradients
    with respect to ``h`` and ``w`` are made in the forward pass (see the module docstring
    for the two pass structures, their FLOPs and memory).

    Args:
      h: final hidden states ``[B, S, d]``.
      w: head weights ``[d, V]`` (a Dense kernel; ``embedding.T`` for a tied embedding).
      targets: ``[B, S]`` ints in ``[0, V)``; negative ones (and ``ignore_index``) are
        ignored.  Concrete targets ``>= V`` raise; traced ones make the loss NaN.
      weights: ``[B, S]`` per-token weights (padding, prompt masking) or None (all 1).
      mesh, axis_name: shard the sequence of ``h``/``targets``/``weights`` over
        ``mesh[axis_name]`` (a name or a tuple of names); ``mesh=None`` runs on one device.
      vocab_axis: a second mesh axis that shards ``w`` along the vocabulary (vocab
        parallel; ``dW`` comes back sharded the same way).  None: ``w`` replicated.
      batch_axis: optional mesh axis (or axes) sharding the batch.
      block_s: rows per tile (Alg. 3 ``B_s``; ``B * S`` rows per device are tiled).  None:
        about ``2^29 / block_v`` rows (2 GiB of float32 logits per tile).
      block_v: vocabulary columns per tile (Alg. 3 ``B_v``).  None: the whole (local)
        vocabulary, Alg. 3 as written (3 matmuls); smaller: 4 matmuls, less memory.
        Neither needs to divide the sizes: an uneven last tile is handled as it is.
      ignore_index: a target value to ignore in addition to negative ones.
      z_loss: coefficient of ``lse^2`` added per token (PaLM's z-loss).
      label_smoothing: ``eps``: the target distribution is ``(1 - eps) onehot + eps / V``.
      logit_softcap: ``c``: logits are ``c * tanh(h @ w / c)`` (Gemma 2's soft cap).
      dtype: the matmul operand dtype (default ``h.dtype``); lse, sums and gradients
        accumulate in float32 whatever it is.

    Returns:
      ``(loss, metrics)``: ``loss`` = sum of ``weight * (ce + z_loss * lse^2)`` over the
      valid tokens divided by their total weight (0 when there is none);
      ``metrics = {"loss", "accuracy", "tokens", "z_loss"}`` (accuracy: weighted fraction
      of tokens whose target logit is the row maximum; tokens: the total weight; z_loss:
      its share of the loss).  Metrics carry no gradient.
    """
    cfg = LMHeadConfig(block_s=block_s, block_v=block_v, ignore_index=ignore_index,
                       z_loss=z_loss, label_smoothing=label_smoothing,
                       logit_softcap=logit_softcap,
                       dtype=None if dtype is None else jnp.dtype(dtype).name,
                       mesh=mesh, seq_axes=_axes(axis_name) if mesh is not None else (),
                       vocab_axis=vocab_axis, batch_axes=_axes(batch_axis))
    _validate(h, w, targets, weights, cfg)
    if weights is None:
        weights = jnp.ones(targets.shape, F32)
    loss, (acc, zl, tokens) = _fused(cfg, h, w, targets, weights.astype(F32))
    metrics = {"loss": loss, "accuracy": acc, "tokens": tokens, "z_loss": zl}
    return loss, jax.tree.map(lax.stop_gradient, metrics)


def reference_lm_head_loss(h, w, targets, weights=None, *, ignore_index=None, z_loss=0.0,
                           label_smoothing=0.0, logit_softcap=None, dtype=None):
    """The naive version (full ``[B, S, V]`` float32 logits, ``jax.nn.log_softmax``): the
    oracle of the tests and the "naive" baseline of ``benchmarks/lm_head.py``."""
    cdt = h.dtype if dtype is None else jnp.dtype(dtype)
    V = w.shape[1]
    z = jnp.einsum("bsd,dv->bsv", h.astype(cdt), w.astype(cdt), preferred_element_type=F32)
    if logit_softcap is not None:
        z = logit_softcap * jnp.tanh(z / logit_softcap)
    logp = jax.nn.log_softmax(z, axis=-1)
    lse = jax.nn.logsumexp(z, axis=-1)
    valid = (targets >= 0) & (targets < V)
    if ignore_index is not None:
        valid = valid & (targets != ignore_index)
    wt = jnp.ones(targets.shape, F32) if weights is None else weights.astype(F32)
    wt = jnp.where(valid, wt, 0.0)
    y = jnp.clip(targets, 0, V - 1)
    ce = -jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]
    if label_smoothing:
        ce = (1 - label_smoothing) * ce - label_smoothing * jnp.mean(logp, axis=-1)
    zl = z_loss * lse * lse
    total = jnp.sum(wt)
    denom = jnp.where(total > 0, total, 1.0)
    loss = jnp.sum(wt * (ce + zl)) / denom
    correct = (jnp.argmax(z, axis=-1) == y).astype(F32)
    return loss, {"loss": loss, "accuracy": jnp.sum(wt * correct) / denom, "tokens": total,
                  "z_loss": jnp.sum(wt * zl) / denom}
