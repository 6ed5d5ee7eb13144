"""What the rings share (``ring.py``, ``double_ring.py``): hop chains, and the custom_vjp.

``chain`` moves a block hop by hop along one mesh axis and visits every device on the
way; in a backward it also carries the block's float32 gradient accumulator, which
collects each visited device's contribution and at the end takes one direct hop home.
The next hop of the block is issued before the block in hand is computed on, and an
accumulator is sent on only after its own tile: the activation and gradient overlap of
BurstEngine §3.1, Fig. 5 (a gradient waits for one round of compute, the "warm-up").
The double ring nests two chains: an inter-node chain whose every visit is a round of
intra-node chains.  Whatever a hop carries travels as one buffer (``Parcel``), so each
hop is one collective.

``make_ring_vjp`` wraps a ring's forward and its two backwards (``"kv"``, ``"q"``) into
one ``custom_vjp`` that saves only ``(o, lse)`` besides the inputs, tagged with
``checkpoint_name`` (``ATTN_OUT``, ``ATTN_LSE``) so that the remat policies can keep them.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Dict

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jax_seqpar.parallel.common import (ATTN_LSE, ATTN_OUT, BWD_SCOPE, AxisName, ring_shift,
                                        send)


# The hops between the first and the last run as one ``lax.fori_loop`` (``chain``'s
# ``rolled``): the program holds at most three copies of a tile however long the ring,
# where unrolled it held one per hop.  Read when a ring is traced (``chain`` with
# ``rolled=None``), by the 1-D ring and by the double ring's intra-node chains;
# ``benchmarks/ring_roll.py`` times both forms (RESULTS.md, "Rolled ring hops").  ``False``
# unrolls every hop, the form before 2026-11-27.
ROLL_HOPS = True


# Whatever a ring hop carries travels as one buffer (``Parcel``).  Read when a ring is
# traced; ``False`` sends every array as its own collective, for comparison
# (``benchmarks/ring_roll.py --switch pack`` times both; RESULTS.md, "One collective per
# ring hop").  Apart, the ``kv`` backward's first hop sends the forward's very arrays, and
# XLA merges the two transfers (CSE): the hop is free, its blocks stay alive from the
# forward to the backward.
PACK_HOPS = True


@jax.tree_util.register_pytree_node_class
class Parcel:
    """A pytree of arrays (any shapes and dtypes) as one flat buffer, so that a ring hop
    is one collective whatever travels: K and V, or Q, dO, D and lse, with segment ids,
    and the dK, dV accumulators.

    XLA's GPU scheduler keeps one asynchronous collective in flight at a time by default
    (``--xla_gpu_experimental_parallel_collective_overlap_limit``, default 1).  Sent as
    several collectives, the parts of a hop after the first found no tile left for their
    window and ran synchronously, alone on the compute stream (RESULTS.md, "The double
    ring on GPUs, and which ring hops overlap there", and "One collective per ring hop").

    The parts are flattened and concatenated in a *carrier* dtype: their own when they
    all share one, else the unsigned integer of the smallest item size, to which every
    part is bitcast (``lax.bitcast_convert_type``; a wider part becomes several carrier
    items, a bool one byte), so the bytes are the parts' bytes and unpacking is exact.
    ``Parcel`` is a pytree whose one leaf is the buffer (the layout is static), so it can
    be a loop's carry, ``ppermute``'s operand and ``jax.tree.map``'s argument (``add``).
    With ``packed=False`` (``PACK_HOPS``) its leaves are the arrays themselves.
    """

    def __init__(self, leaves, layout):
        self.leaves = tuple(leaves)
        self.layout = layout  # (treedef, ((shape, dtype), ...), carrier dtype or None)

    @classmethod
    def of(cls, tree, packed=None) -> "Parcel":
        """Pack ``tree`` (``None`` leaves are kept as ``None``); ``packed=None`` reads
        ``PACK_HOPS``."""
        leaves, treedef = jax.tree.flatten(tree)
        if not leaves:
            raise ValueError("Parcel.of needs at least one array")
        dtypes = [jnp.dtype(x.dtype) for x in leaves]
        parts = tuple((tuple(x.shape), d) for x, d in zip(leaves, dtypes))
        if not (PACK_HOPS if packed is None else packed):
            return cls(leaves, (treedef, parts, None))
        if len(set(dtypes)) == 1:
            carrier = dtypes[0]
        else:
            carrier = jnp.dtype(f"uint{8 * min(d.itemsize for d in dtypes)}")
        flat = [_to_carrier(x, carrier).reshape(-1) for x in leaves]
        buf = flat[0] if len(flat) == 1 else jnp.concatenate(flat)
        return cls((buf,), (treedef, parts, carrier))

    def unpack(self):
        """The packed tree, bit for bit."""
        treedef, parts, carrier = self.layout
        if carrier is None:
            return jax.tree.unflatten(treedef, self.leaves)
        out, start = [], 0
        for shape, dtype in parts:
            ratio = dtype.itemsize // carrier.itemsize
            size = math.prod(shape) * ratio
            x = lax.slice_in_dim(self.leaves[0], start, start + size)
            start += size
            if dtype == jnp.bool_ and carrier != dtype:
                x = x != 0
            elif dtype != carrier:
                x = lax.bitcast_convert_type(
                    x.reshape(shape + ((ratio,) if ratio > 1 else ())), dtype)
            out.append(x.reshape(shape))
        return jax.tree.unflatten(treedef, out)

    def tree_flatten(self):
        return self.leaves, self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(children, layout)


def _to_carrier(x, carrier):
    """``x`` as ``carrier`` items, bit for bit (a bool, which XLA cannot bitcast, as 0 or
    1 in one byte)."""
    if x.dtype == carrier:
        return x
    if x.dtype == jnp.bool_:
        return x.astype(carrier)
    return lax.bitcast_convert_type(x, carrier)


def add(a, b):
    """``a + b`` for pytrees of arrays, where ``None`` stands for zero."""
    if a is None:
        return b
    if b is None:
        return a
    return jax.tree.map(jnp.add, a, b)


def chain(axis_name: AxisName, num: int, direction: int, n: int, travel, visit, home,
          home_dtypes=None, *, visit_start: bool = False, rolled=None):
    """Move ``travel`` ``n`` hops in ``direction`` along ``axis_name`` (``num`` devices)
    and visit each device on the way.

    ``travel`` is a pytree of arrays or a ``Parcel``; it travels as one ``Parcel`` (one
    collective per hop), and so do the accumulators.  ``visit(block, hop, home) ->
    (contrib, home)`` computes one tile with the ``Parcel`` that arrived after ``hop``
    hops (``block.unpack()`` gives the arrays; a nested chain can send it on as it is);
    ``home`` is the state that stays on this device.  With
    ``visit_start``, ``visit(travel, 0, home)`` runs too, once the first hop is issued
    (its ``contrib`` is ignored: it is this device's own, and stays in ``home``).

    ``home_dtypes`` (a pytree of dtypes shaped like ``contrib``): ``contrib`` (float32)
    adds to the travelling block's accumulator, created at the first device it visits;
    after the last visit the accumulator takes one direct hop home, cast to
    ``home_dtypes``.  Returns ``(accumulator of this device's own block, home)``; without
    ``home_dtypes`` there is no accumulator and the first element is ``None``.

    ``rolled``: the middle hops run as one ``fori_loop`` whose index is ``hop`` (``visit``
    must then take a traced ``hop`` and keep the types of ``home`` and ``contrib``), so
    the program holds at most three copies of a tile whatever ``n`` is, and tracing and
    compiling no longer grow with the ring.  The last hop stays apart because it issues
    no next transfer, and with an accumulator the first too, because it creates it.
    With ``rolled=False`` every hop is its own copy (``visit`` may branch on ``hop``);
    ``None`` (the default) takes ``ROLL_HOPS``.
    """
    if rolled is None:
        rolled = ROLL_HOPS
    rev = direction < 0
    shift = functools.partial(ring_shift, axis_name=axis_name, num=num, reverse=rev)
    grads = home_dtypes is not None

    def step(hop, block, acc, home, last):
        # issue the next transfers before computing on the block in hand (overlap): the
        # block onwards, and the accumulator that the previous hop filled
        nxt = None if last else shift(block)
        acc = None if acc is None else shift(acc)
        contrib, home = visit(block, hop, home)
        return nxt, (add(acc, Parcel.of(contrib)) if grads else None), home

    if not isinstance(travel, Parcel):
        travel = Parcel.of(travel)
    block = shift(travel)
    if visit_start:  # computed while the first hop is in flight
        _, home = visit(travel, 0, home)
    acc = None
    first = 2 if grads else 1  # the first hop of the loop
    if rolled and n > first:
        for hop in range(1, first):
            block, acc, home = step(hop, block, acc, home, last=False)
        block, acc, home = lax.fori_loop(
            first, n, lambda hop, carry: step(hop, *carry, last=False), (block, acc, home))
        block, acc, home = step(n, block, acc, home, last=True)
    else:
        for hop in range(1, n + 1):
            block, acc, home = step(hop, block, acc, home, last=hop == n)
    if not grads:
        return None, home
    acc = jax.tree.map(lambda a, dt: a.astype(dt), acc.unpack(), home_dtypes)
    return send(Parcel.of(acc), axis_name, num, -direction * n).unpack(), home


def make_ring_vjp(forward: Callable, backwards: Dict[str, Callable]):
    """``(attn, attn_fwd, attn_bwd)``: ``attn(cfg, q, k, v, seg)`` with a ``custom_vjp``.

    ``forward(cfg, q, k, v, seg) -> (o, lse)`` (float32); ``backwards[cfg.backward](cfg,
    q, k, v, seg, o, lse, do) -> (dq, dk, dv)`` (any float dtype; cast here).
    """
    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def attn(cfg, q, k, v, seg):
        o, _ = forward(cfg, q, k, v, seg)
        return o.astype(q.dtype)

    def attn_fwd(cfg, q, k, v, seg):
        o, lse = forward(cfg, q, k, v, seg)
        # Named, so that a checkpoint policy can keep the residuals (jax_seqpar.layers.remat).
        o = checkpoint_name(o.astype(q.dtype), ATTN_OUT)
        lse = checkpoint_name(lse, ATTN_LSE)
        return o, (q, k, v, seg, o, lse)

    def attn_bwd(cfg, res, do):
        q, k, v, seg, o, lse = res
        with jax.named_scope(BWD_SCOPE):
            dq, dk, dv = backwards[cfg.backward](cfg, q, k, v, seg, o, lse, do)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None

    attn.defvjp(attn_fwd, attn_bwd)
    return attn, attn_fwd, attn_bwd
