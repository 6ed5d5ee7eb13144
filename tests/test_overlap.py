"""Issue 19 item 4: which instructions the compiled schedule puts inside each collective.

The CPU backend emits synchronous collectives (no ``-start``/``-done`` pairs), so on CPU
the window of a collective is the scheduled code between it and its first user; the
asynchronous form (what GPUs emit) is tested on hand-written HLO.
"""

import functools

import jax
import pytest

import helpers
import jax_seqpar as jsp
from jax_seqpar.parallel import ring_common
from jax_seqpar.runtime.overlap import overlap_report, overlap_windows

ASYNC_HLO = """HloModule m, is_scheduled=true

%fused_dot (p0: f32[4,4], p1: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  %p1 = f32[4,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[4,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_copy (p0.1: f32[4,4]) -> f32[4,4] {
  %p0.1 = f32[4,4]{1,0} parameter(0)
  ROOT %copy.1 = f32[4,4]{1,0} copy(%p0.1)
}

%a2a (p.2: f32[4,4]) -> f32[4,4] {
  %p.2 = f32[4,4]{1,0} parameter(0)
  ROOT %all-to-all.9 = f32[4,4]{1,0} all-to-all(%p.2), replica_groups={{0,1}}, dimensions={0}
}

ENTRY %main (a: f32[4,4], b: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %b = f32[4,4]{1,0} parameter(1)
  %cp-start = (f32[4,4]{1,0}, f32[4,4]{1,0}) collective-permute-start(%a), source_target_pairs={{0,1},{1,0}}
  %kernel = f32[4,4]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_dot
  %cp-done = f32[4,4]{1,0} collective-permute-done(%cp-start)
  %grad-start = (f32[4,4]{1,0}, f32[4,4]{1,0}) collective-permute-start(%kernel), source_target_pairs={{0,1},{1,0}}
  %copy = f32[4,4]{1,0} fusion(%b), kind=kLoop, calls=%fused_copy
  %grad-done = f32[4,4]{1,0} collective-permute-done(%grad-start)
  %a2a-start = ((f32[4,4]{1,0}), f32[4,4]{1,0}) async-start(%cp-done), calls=%a2a
  %a2a-done = f32[4,4]{1,0} async-done(%a2a-start)
  ROOT %out = f32[4,4]{1,0} add(%a2a-done, %grad-done)
}
"""


LOOP_HLO = """HloModule m, is_scheduled=true

%body (p: (f32[4,4], f32[4,4])) -> (f32[4,4], f32[4,4]) {
  %p = (f32[4,4]{1,0}, f32[4,4]{1,0}) parameter(0)
  %blk = f32[4,4]{1,0} get-tuple-element(%p), index=0
  %acc = f32[4,4]{1,0} get-tuple-element(%p), index=1
  %fwd = f32[4,4]{1,0} collective-permute(%blk), source_target_pairs={{0,1},{1,0}}
  %tile = f32[4,4]{1,0} dot(%blk, %blk), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %sum = f32[4,4]{1,0} add(%acc, %tile)
  ROOT %out = (f32[4,4]{1,0}, f32[4,4]{1,0}) tuple(%fwd, %sum)
}

%cond (c: (f32[4,4], f32[4,4])) -> pred[] {
  %c = (f32[4,4]{1,0}, f32[4,4]{1,0}) parameter(0)
  ROOT %t = pred[] constant(true)
}

ENTRY %main (a: f32[4,4], z: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %z = f32[4,4]{1,0} parameter(1)
  %init = (f32[4,4]{1,0}, f32[4,4]{1,0}) tuple(%a, %z)
  %loop = (f32[4,4]{1,0}, f32[4,4]{1,0}) while(%init), condition=%cond, body=%body
  %blk.out = f32[4,4]{1,0} get-tuple-element(%loop), index=0
  %acc.out = f32[4,4]{1,0} get-tuple-element(%loop), index=1
  %send.blk = f32[4,4]{1,0} collective-permute(%blk.out), source_target_pairs={{0,1},{1,0}}
  %send.acc = f32[4,4]{1,0} collective-permute(%acc.out), source_target_pairs={{0,1},{1,0}}
  ROOT %r = f32[4,4]{1,0} add(%send.blk, %send.acc)
}
"""


def test_a_loops_forwarded_block_is_an_activation():
    """After a rolled chain's loop, the block it only forwarded is an activation and the
    accumulator a tile added to is a gradient, though both come out of a loop that
    holds a tile (``overlap._loop_carry_depends``)."""
    w = {x.collective: x for x in overlap_windows(LOOP_HLO)}
    assert not w["send.blk"].gradient
    assert w["send.acc"].gradient
    assert not w["fwd"].gradient  # inside the body: the carried block, read before the tile
    # a block that enters the loop already computed on carries that compute out
    computed = LOOP_HLO.replace(
        "  %init = (f32[4,4]{1,0}, f32[4,4]{1,0}) tuple(%a, %z)",
        "  %pre = f32[4,4]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}\n"
        "  %init = (f32[4,4]{1,0}, f32[4,4]{1,0}) tuple(%pre, %z)")
    assert computed != LOOP_HLO
    w = {x.collective: x for x in overlap_windows(computed)}
    assert w["send.blk"].gradient and w["send.acc"].gradient


def test_async_pairs_on_handwritten_hlo():
    w = {x.collective: x for x in overlap_windows(ASYNC_HLO)}
    assert set(w) == {"cp-start", "grad-start", "a2a-start"}
    assert w["cp-start"].is_async and w["cp-start"].compute == ("kernel",)
    assert not w["cp-start"].gradient and w["cp-start"].operand_ops == ("parameter",)
    # a copy is not kernel compute; this permute sends data the kernel produced
    assert [b[:2] for b in w["grad-start"].between] == [("copy", "fusion")]
    assert not w["grad-start"].overlapped and w["grad-start"].gradient
    assert w["a2a-start"].kind == "all-to-all" and w["a2a-start"].between == ()


@functools.lru_cache(maxsize=None)
def _ring_windows(causal, backward, rolled=True):
    G, S = 4, 64
    q, k, v = helpers.make_qkv(7, B=1, S=S, Hq=4, Hkv=4, D=16)
    do = helpers.make_cotangent(7, q.shape)
    mesh = helpers.make_mesh(G)
    layout = "zigzag" if causal else "contiguous"

    def f(q, k, v):
        return jsp.attention(q, k, v, mesh=mesh, causal=causal, layout=layout,
                             permuted=True, backward=backward)

    # read when the ring is traced
    saved, ring_common.ROLL_HOPS = ring_common.ROLL_HOPS, rolled
    try:
        fwd = overlap_report(f, q, k, v)
        _, vjp = jax.vjp(f, q, k, v)
        bwd = overlap_report(jax.jit(lambda vjp, do: vjp(do)), vjp, do)
    finally:
        ring_common.ROLL_HOPS = saved
    return fwd, bwd


@pytest.mark.parametrize("rolled", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_forward_prefetch_overlaps_the_kernel(causal, rolled):
    """Forward, G=4 (3 hops of K and V, one buffer: ``ring_common.Parcel``):
    the CPU emits synchronous collective-permutes; every hop that forwards a received
    block (the prefetch of the next block) has the kernel's tile computation scheduled
    before its block is used.

    Unrolled, the program holds all three permutes: the first hop's from the inputs
    (stacked), two forwarding received blocks (hops 2 and 3).  Rolled (``ROLL_HOPS``),
    hops 1 and 2 are one loop whose body forwards the block it received (one permute, run
    twice), and the last hop, which forwards nothing, follows the loop: two in all."""
    fwd, _ = _ring_windows(causal, "kv", rolled)
    assert len(fwd) == (2 if rolled else 3)
    assert all(w.kind == "collective-permute" for w in fwd)
    assert not any(w.is_async for w in fwd)  # CPU: synchronous collectives
    assert not any(w.gradient for w in fwd)  # K and V only travel
    # K and V of this device, stacked: an operand that is neither a received block nor a
    # loop's carry
    first = [w for w in fwd if w.operand_ops not in (("collective-permute",), ("copy",))]
    forwarded = [w for w in fwd if w not in first]
    assert (len(first), len(forwarded)) == (1, 1 if rolled else 2)
    if rolled:  # in the loop's body, not the entry computation
        assert len({w.computation for w in forwarded} | {first[0].computation}) == 2
    for w in forwarded:
        assert w.overlapped, (w.collective, w.between)


@pytest.mark.parametrize("backward,activations,gradients", [
    # one buffer per hop (ring_common.Parcel): K, V x 3 hops; dK and dV together: 2
    # accumulator hops + 1 hop home
    ("kv", 3, 3),
    ("q", 3, 3),    # Q, dO, D, lse x 3 hops; dQ: 2 accumulator hops + 1 hop home
])
def test_ring_backward_activation_and_gradient_hops(backward, activations, gradients):
    """Backward, G=4: the windows tell activation hops (data that only travels) from
    gradient hops (accumulators that wait for their own tile, BurstEngine Fig. 5), and
    most activation hops have kernel compute in their window on CPU's schedule."""
    _, bwd = _ring_windows(False, backward)
    act = [w for w in bwd if not w.gradient]
    grad = [w for w in bwd if w.gradient]
    assert (len(act), len(grad)) == (activations, gradients)
    assert all(w.kind == "collective-permute" and not w.is_async for w in bwd)
    # CPU's schedule leaves up to two first-hop sends without a tile in their window
    assert sum(w.overlapped for w in act) >= len(act) - 2, \
        [(w.collective, w.compute) for w in act]
