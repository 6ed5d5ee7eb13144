"""Issue 27: packed documents.  The ring skips the (query shard, key shard) pairs that share
no document, the answer stays exact, and ``layout="auto"`` picks a layout from the
document lengths.

The skipped pairs are counted from an instrumented run: a kernel object that wraps the
xla kernel and bumps a host counter (``jax.debug.callback``) whenever a call of its runs,
which inside a ``lax.cond`` branch happens only when the branch is taken.  Call shapes
tell the pairs apart: a device's own block is one ``T x T`` call (with segment ids), and
so is a contiguous pair of two devices; a zigzag pair is ``T x T/2`` (keys from a lower
device) or ``T/2 x T`` (from a higher one).
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import jax_seqpar as jsp
from jax_seqpar.api import auto_layout
from jax_seqpar.kernels import XlaKernel
from jax_seqpar.layouts import permutation
from jax_seqpar.masks import MaskSpec
from jax_seqpar.parallel.choose import choose_layout, segments_from_lengths
from jax_seqpar.parallel.schedule import ring_schedule

G, S, B = 8, 128, 2
T = S // G
CALLS = collections.Counter()


@dataclasses.dataclass(frozen=True)
class CountingKernel(XlaKernel):
    """The xla kernel, counting its calls per ``(fwd|bwd, Tq, Tk)`` when they run."""

    name: str = "counting"

    def _count(self, what, q, k):
        key = (what, q.shape[1], k.shape[1])
        jax.debug.callback(lambda: CALLS.update([key]))

    def fwd(self, q, k, v, q_pos, kv_pos, mask, scale, q_seg=None, kv_seg=None):
        self._count("fwd", q, k)
        return super().fwd(q, k, v, q_pos, kv_pos, mask, scale, q_seg, kv_seg)

    def bwd(self, q, k, v, o, lse, do, q_pos, kv_pos, mask, scale, q_seg=None, kv_seg=None,
            delta=None):
        self._count("bwd", q, k)
        return super().bwd(q, k, v, o, lse, do, q_pos, kv_pos, mask, scale, q_seg, kv_seg,
                           delta=delta)


def _docs(kind, seed):
    """Natural-order segment ids ``[B, S]``: ``short`` documents of 1-6 tokens (some cross
    a shard border), one 40-token document spanning three shards among them, or a
    ``single`` document spanning every shard."""
    if kind == "single":
        return np.zeros((B, S), np.int32)
    rng = np.random.default_rng(seed)
    rows = []
    for b in range(B):
        lens = []
        while sum(lens) < S:
            lens.append(40 if len(lens) == 3 + b else int(rng.integers(1, 7)))
        rows.append(np.repeat(np.arange(len(lens)), lens)[:S])
    return np.stack(rows).astype(np.int32)


def _expected(layout, seg):
    """Kernel calls by shape that the ring must make: a pair of devices runs only where the
    causal mask lets it and the parts' id ranges overlap in some batch row."""
    shards = seg[:, permutation(layout, S, G)].reshape(B, G, T)

    def shares(qi, qs, kj, ks):
        a, b = shards[:, qi, qs], shards[:, kj, ks]
        return bool(np.any((a.min(1) <= b.max(1)) & (b.min(1) <= a.max(1))))

    h, lo, hi, al = T // 2, slice(0, T // 2), slice(T // 2, T), slice(None)
    want = collections.Counter()
    for i in range(G):
        want[(T, T)] += 1  # the own block: one call (with segment ids)
        for j in range(G):
            if j == i:
                continue
            if layout == "contiguous":
                want[(T, T)] += j < i and shares(i, al, j, al)
            elif j < i:  # both query chunks, the first key chunk: tested chunk by chunk
                want[(T, h)] += shares(i, lo, j, lo) or shares(i, hi, j, lo)
            else:
                want[(h, T)] += shares(i, hi, j, lo) or shares(i, hi, j, hi)
    return want


@functools.lru_cache(maxsize=None)
def _fn(layout, backward):
    mesh = helpers.make_mesh(G)

    def f(q, k, v, do, seg):
        out, vjp = jax.vjp(lambda q, k, v: jsp.attention(
            q, k, v, mesh=mesh, causal=True, layout=layout, backward=backward,
            segment_ids=seg, kernel=CountingKernel(block_q=8, block_k=8)), q, k, v)
        return out, vjp(do)
    return jax.jit(f)


@pytest.mark.parametrize("layout,backward", [("contiguous", "kv"), ("zigzag", "q")])
def test_ring_skips_pairs_that_share_no_document(layout, backward):
    q, k, v = helpers.make_qkv(27, B=B, S=S, Hq=4, Hkv=2, D=16)
    do = helpers.make_cotangent(27, q.shape)
    fn = _fn(layout, backward)
    n_pairs = {}
    for kind in ("short", "single"):
        seg = _docs(kind, 27)
        CALLS.clear()
        out, grads = jax.block_until_ready(fn(q, k, v, do, jnp.asarray(seg)))
        jax.effects_barrier()
        want = _expected(layout, seg)
        for phase in ("fwd", "bwd"):
            got = collections.Counter({(tq, tk): n for (p, tq, tk), n in CALLS.items()
                                       if p == phase})
            assert got == +want, f"{kind} {phase}: ran {dict(got)}, expected {dict(want)}"
        n_pairs[kind] = sum(want.values()) - G
        ref_out, _, ref_grads = helpers.reference_fwd_bwd(q, k, v, do, jnp.asarray(seg),
                                                          causal=True)
        helpers.assert_close(out, ref_out, 1e-5, f"{kind} out")
        for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
            helpers.assert_close(g, r, 1e-5, f"{kind} {name}")
    # one document over every shard: every causal pair runs; short ones: most are skipped
    assert n_pairs["single"] == (G * (G - 1) // 2 if layout == "contiguous" else G * (G - 1))
    assert n_pairs["short"] < n_pairs["single"] // 2, n_pairs


# --------------------------------------------------------------------------- layout
def _lognormal_docs(mean, S, seed=0):
    rng = np.random.default_rng(seed)
    lens = (rng.lognormal(np.log(mean), 0.8, size=4 * S // mean + 8)).astype(int) + 1
    return lens[np.cumsum(lens) < S]


def test_choose_layout_from_document_lengths():
    """Documents of equal length, much shorter than a shard: contiguous (balanced, and it
    computes on the fewest device pairs); one document per row: zigzag (the causal
    triangle); heavy-tailed lengths: striped, which spreads each long document over every
    device (a contiguous or zigzag shard holding one is the busiest)."""
    S, G = 1 << 18, 8
    short = choose_layout(num_devices=G, seq_len=S, doc_lengths=[1000] * (S // 1000))
    assert short.layout == "contiguous", short.reason
    assert short.pairs["contiguous"] < short.pairs["zigzag"] < short.pairs["striped"] == 56
    assert "layout='contiguous'" in short.reason and "263 documents" in short.reason
    one = choose_layout(num_devices=G, seq_len=S)
    assert one.layout == "zigzag" and "one document per row" in one.reason
    assert one.costs["contiguous"] > 1.8 * one.costs["zigzag"]  # the triangle's imbalance
    tail = choose_layout(num_devices=G, seq_len=S, doc_lengths=_lognormal_docs(16384, S))
    assert tail.layout == "striped", tail.reason
    assert choose_layout(num_devices=G, seq_len=S, causal=False).layout == "contiguous"
    lens = [3, 5, 8]  # lengths and ids agree; the rest of the row is one more document
    np.testing.assert_array_equal(segments_from_lengths(lens, 20)[0],
                                  np.repeat(np.arange(4), [3, 5, 8, 4]))
    a = choose_layout(segments_from_lengths(lens, 64), num_devices=4)
    b = choose_layout(num_devices=4, seq_len=64, doc_lengths=lens)
    assert a.costs == b.costs and a.layout == b.layout
    with pytest.raises(ValueError, match="sum to"):
        segments_from_lengths([30, 40], 64)


def test_attention_layout_auto():
    """``layout="auto"`` resolves from concrete ids (and refuses what it cannot model);
    the answer is the reference's."""
    seg = np.repeat(np.arange(16), 4)[None].repeat(2, 0).astype(np.int32)  # 4-token docs
    assert auto_layout(seg, S=64, G=4, causal=True).layout == "contiguous"
    assert auto_layout(None, S=64, G=4, causal=True).layout == "zigzag"
    with pytest.raises(ValueError, match="permuted"):
        auto_layout(seg, S=64, G=4, causal=True, permuted=True)
    with pytest.raises(ValueError, match="block_mask"):
        auto_layout(seg, S=64, G=4, causal=True, block_mask=np.eye(4, dtype=bool))
    q, k, v = helpers.make_qkv(5, B=2, S=64, Hq=2, Hkv=2, D=16)
    out = jsp.attention(q, k, v, mesh=helpers.make_mesh(4), causal=True, layout="auto",
                        segment_ids=jnp.asarray(seg), kernel="xla")
    ref, _, _ = helpers.reference_fwd_bwd(q, k, v, q, jnp.asarray(seg), causal=True)
    helpers.assert_close(out, ref, 1e-5, "out")


def test_a_window_of_the_longest_document_cuts_the_hops():
    """``ring.py``: documents of at most L tokens make ``window=(L - 1, 0)`` (causal) a
    no-op on the answer, and the contiguous schedule then stops after
    ``ceil((L - 1) / T)`` hops instead of ``G - 1``."""
    T, L = 1024, 1500
    for G in (4, 8):
        sched = ring_schedule("contiguous", MaskSpec(causal=True, window=(L - 1, 0)), T, G)
        assert (sched.forward, sched.backward) == (-(-(L - 1) // T), 0)
