"""Collective accounting (jax_seqpar.runtime.comm) and the ring forward's exact volume."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import helpers
import jax_seqpar as jsp
from jax_seqpar.runtime._compat import shard_map
from jax_seqpar.runtime.comm import analyze_hlo, collective_bytes
from jax_seqpar.parallel.costs import RingShape, forward_bytes


def _toy(G, body):
    devs = np.array(jax.devices()[:G])
    mesh = Mesh(devs, ("sp",))  # auto axes: shard_map lays the input out itself
    return jax.jit(shard_map(body, mesh=mesh, in_specs=P("sp"), out_specs=P("sp")))


@pytest.mark.parametrize("G", [2, 4])
def test_volumes_of_each_collective_kind(G):
    n = 32  # f32 elements per device
    x = jnp.arange(G * n, dtype=jnp.float32)

    def body(x):
        a = lax.ppermute(x, "sp", [(i, (i + 1) % G) for i in range(G)])
        b = lax.all_gather(x, "sp", tiled=True)[:n]
        c = lax.psum(x * 3.0, "sp")
        d = lax.psum_scatter(jnp.tile(x, G) * 5.0, "sp", tiled=True)
        return a + b + c + d

    rep = collective_bytes(_toy(G, body), x)
    by = rep.bytes_by_kind()
    assert by["collective-permute"] == n * 4
    assert by["all-gather"] == (G - 1) * n * 4
    assert by["all-reduce"] == round(2 * (G - 1) / G * n * 4)
    assert by["reduce-scatter"] == round((G - 1) / G * G * n * 4)


def test_loop_trip_counts_multiply():
    G, n, steps = 4, 16, 5
    x = jnp.ones((G * n,), jnp.float32) * 1.5

    def body(x):
        def step(c, _):
            return lax.ppermute(c, "sp", [(i, (i + 1) % G) for i in range(G)]) * 1.01, None
        return lax.scan(step, x, None, length=steps)[0]

    rep = collective_bytes(_toy(G, body), x)
    assert rep.count_by_kind() == {"collective-permute": steps}
    assert rep.total_bytes == steps * n * 4
    assert not rep.warnings


def test_parser_on_hand_written_hlo():
    hlo = """HloModule m, num_partitions=4

%body (p: (s32[], bf16[8,2])) -> (s32[], bf16[8,2]) {
  %p = (s32[], bf16[8,2]{1,0}) parameter(0)
  %x = bf16[8,2]{1,0} get-tuple-element(%p), index=1
  %cp = (bf16[8,2]{1,0}, f32[3]{0}) collective-permute(%x, %y), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %y = f32[3]{0} constant({1,2,3})
  ROOT %t = (s32[], bf16[8,2]{1,0}) tuple(%i, %x)
}

%cond (p: (s32[], bf16[8,2])) -> pred[] {
  %p = (s32[], bf16[8,2]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: bf16[8,2]) -> bf16[8,2] {
  %a = bf16[8,2]{1,0} parameter(0)
  %w = (s32[], bf16[8,2]{1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}
  %ag = bf16[32,2]{1,0} all-gather(%a), channel_id=2, replica_groups=[2,2]<=[4], dimensions={0}
  ROOT %r = bf16[8,2]{1,0} copy(%a)
}
"""
    rep = analyze_hlo(hlo, 4)
    assert rep.count_by_kind() == {"collective-permute": 7, "all-gather": 1}
    # permute: a combined tuple of bf16[8,2] (32 B) and f32[3] (12 B), 7 times
    assert rep.bytes_by_kind()["collective-permute"] == 7 * (32 + 12)
    # all-gather in groups of 2 (iota replica groups): (2 - 1) * 32 B
    assert rep.bytes_by_kind()["all-gather"] == 32


@pytest.mark.parametrize("G", [1, 2, 4, 8])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 1)])
def test_ring_forward_sends_exact_bytes(G, Hq, Hkv):
    """Issue 2: (G-1) * 2 * B * (S/G) * Hkv * D * itemsize per device (non-causal)."""
    B, S, D = 2, 64, 16
    q, k, v = helpers.make_qkv(1, B=B, S=S, Hq=Hq, Hkv=Hkv, D=D)
    mesh = helpers.make_mesh(G)
    rep = collective_bytes(lambda q, k, v: jsp.attention(q, k, v, mesh=mesh), q, k, v)
    want = (G - 1) * 2 * B * (S // G) * Hkv * D * 4
    assert rep.total_bytes == want
    assert rep.bytes_by_kind().get("collective-permute", 0) == want
    assert want == forward_bytes(RingShape(G, B, S // G, Hq, Hkv, D, 4))


def test_allgather_forward_bytes():
    G, B, S, Hkv, D = 4, 2, 64, 2, 16
    q, k, v = helpers.make_qkv(2, B=B, S=S, Hq=4, Hkv=Hkv, D=D)
    mesh = helpers.make_mesh(G)
    rep = collective_bytes(
        lambda q, k, v: jsp.attention(q, k, v, mesh=mesh, strategy="allgather"), q, k, v)
    assert rep.bytes_by_kind() == {"all-gather": (G - 1) * 2 * B * (S // G) * Hkv * D * 4}


@pytest.mark.parametrize("G", [2, 4, 8])
def test_tree_strategy_bytes(G):
    """``strategy="tree"``: the forward gathers the queries ((G-1) T Hq D per device), takes
    one pmax of lse (an all-reduce of B Hq S floats) and reduce-scatters numerator and
    denominator together (B S Hq (D+1) floats); nothing else moves."""
    B, S, Hq, Hkv, D = 2, 64, 4, 2, 16
    T = S // G
    q, k, v = helpers.make_qkv(3, B=B, S=S, Hq=Hq, Hkv=Hkv, D=D)
    mesh = helpers.make_mesh(G)
    rep = collective_bytes(
        lambda q, k, v: jsp.attention(q, k, v, mesh=mesh, strategy="tree"), q, k, v)
    assert rep.bytes_by_kind() == {
        "all-gather": (G - 1) * B * T * Hq * D * 4,
        "all-reduce": round(2 * (G - 1) / G * B * Hq * S * 4),
        "reduce-scatter": round((G - 1) / G * B * S * Hq * (D + 1) * 4),
    }
    assert rep.count_by_kind() == {"all-gather": 1, "all-reduce": 1, "reduce-scatter": 1}
