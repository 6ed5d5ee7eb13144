"""Checkpoint policies: the attention forward runs once per layer under the remat-aware
policy (DistFlashAttn §3.3) and twice under plain per-layer checkpointing; the
sequence-selective policy (BurstEngine §3.2) re-runs only the earlier rows' ring pass.

Ring forward passes are counted by their transfers (every pass makes the same number),
in the jaxpr of ``value_and_grad`` (``remat.ring_transfer_counts``) and, after XLA, in
the compiled HLO (``op_name`` metadata carries the ring's ``named_scope``).
"""

import dataclasses
import functools
import re

import jax
import pytest
from jax.sharding import AxisType

from helpers import (assert_close, assert_trees_close, make_cotangent, make_mesh, make_qkv, reference_fwd_bwd,
                     sorted_segments)
from jax_seqpar.models import Llama, LlamaConfig, next_token_loss
from jax_seqpar.parallel.common import FWD_SCOPE
from jax_seqpar.parallel.selective import EARLY_SCOPE, LATE_SCOPE
from jax_seqpar.layers.remat import policy_for, ring_transfer_counts, seq_selective_attention

L, G, S = 2, 2, 64  # two devices: one hop per ring pass is enough to count passes
CFG = LlamaConfig(vocab_size=61, d_model=32, num_layers=L, num_heads=4, num_kv_heads=2)
MODES = ("none", "full", "attention", "seq_selective", "attention_mlp")


@pytest.fixture(autouse=True, scope="module")
def _full_tracebacks_in_locations():
    """JAX's default for this module: tests/conftest.py turns the full Python stacks in the
    MLIR locations off for speed, and without them XLA's ``op_name`` of an operation inside
    a nested ``jit`` loses the ``named_scope`` that these tests count (JAX 0.11.2)."""
    before = jax.config.jax_include_full_tracebacks_in_locations
    jax.config.update("jax_include_full_tracebacks_in_locations", True)
    yield
    jax.config.update("jax_include_full_tracebacks_in_locations", before)


@functools.lru_cache(maxsize=None)
def setup(mode):
    """``mode``: a ``REMAT_MODES`` name, ``+offload`` appended for ``remat_offload``."""
    mesh = jax.make_mesh((G,), ("sp",), devices=jax.devices()[:G], axis_types=(AxisType.Auto,))
    name, _, extra = mode.partition("+")
    model = Llama(dataclasses.replace(CFG, remat=name, remat_offload=extra == "offload"),
                  mesh=mesh, layout="zigzag", backward="kv")
    toks, params = inputs()
    loss = lambda p: next_token_loss(model, p, toks)[0]  # noqa: E731
    return loss, params


@functools.lru_cache(maxsize=None)
def inputs():
    """The tokens and the parameters, the same for every mode (initialised once, jitted)."""
    toks = jax.random.randint(jax.random.key(0), (1, S), 0, CFG.vocab_size)
    return toks, jax.jit(Llama(CFG).init)(jax.random.key(1), toks)


@functools.lru_cache(maxsize=None)
def compiled(mode):
    """``(executable, its HLO text)``: the tests run the executable they read, so each
    mode compiles once (a jitted function called after ``.lower().compile()`` would
    compile again)."""
    loss, params = setup(mode)
    exe = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
    return exe, exe.as_text()


def per_pass():
    """Transfers of one ring forward pass (one layer's attention forward)."""
    loss, params = setup("none")
    c = ring_transfer_counts(loss, params)
    assert set(c) == {("fwd", "forward")} and c[("fwd", "forward")] % L == 0
    return c[("fwd", "forward")] // L


def hlo_forward_transfers(hlo, scope=FWD_SCOPE):
    """(in the forward, in the backward) collective-permutes of ``scope`` in compiled HLO."""
    ops = [ln for ln in hlo.splitlines()
           if re.search(r"= \S+ collective-permute(-start)?\(", ln) and scope in ln]
    back = sum("transpose(" in ln for ln in ops)
    return len(ops) - back, back


@pytest.mark.parametrize("mode", MODES)
def test_attention_forwards_per_layer(mode):
    c = per_pass()
    assert c > 0
    loss, params = setup(mode)
    n = ring_transfer_counts(jax.value_and_grad(loss), params)
    bwd = n[("bwd", "forward")] + n[("bwd", "backward")]
    assert bwd == ring_transfer_counts(jax.value_and_grad(setup("none")[0]), params)[
        ("bwd", "backward")] > 0
    fwd, remat = n[("fwd", "forward")], n[("fwd", "backward")]
    if mode in ("none", "attention", "attention_mlp"):  # once per layer, never again
        assert (fwd, remat) == (L * c, 0), dict(n)
    elif mode == "full":  # once in the forward and once more in the backward, per layer
        assert (fwd, remat) == (L * c, L * c), dict(n)
    else:  # both row groups once in the forward; only the earlier rows again
        assert (fwd, remat) == (0, 0)
        assert n[("fwd_early", "forward")] == n[("fwd_late", "forward")] == L * c, dict(n)
        assert n[("fwd_early", "backward")] == L * c and n[("fwd_late", "backward")] == 0


@pytest.mark.parametrize("mode", ["full", "attention", "seq_selective"])
def test_compiled_program_reruns_only_what_the_policy_drops(mode):
    c = per_pass()
    _, hlo = compiled(mode)
    fwd, back = hlo_forward_transfers(hlo)
    if mode == "attention":
        assert (fwd, back) == (L * c, 0)
    elif mode == "full":
        # XLA may merge the last layer's recomputation with its forward (nothing runs in
        # between); every other layer's attention forward runs again in the backward.
        assert back >= (L - 1) * c and fwd + back >= (2 * L - 1) * c, (fwd, back)
    else:
        assert hlo_forward_transfers(hlo, LATE_SCOPE)[1] == 0
        assert hlo_forward_transfers(hlo, EARLY_SCOPE)[1] >= (L - 1) * c > 0


@functools.lru_cache(maxsize=None)
def reference_loss_and_grads():
    """The loss and gradients without a policy (``compiled("none")``), run once."""
    return compiled("none")[0](setup("none")[1])


@pytest.mark.parametrize("mode", ["full", "attention", "seq_selective", "attention_mlp",
                                  "full+offload", "attention+offload",
                                  "attention_mlp+offload"])
def test_policies_do_not_change_gradients(mode):
    """Each policy's loss and gradients equal those without one.  One test per mode (it
    was one loop over the modes, ~30 s in one test): the reference and each mode's
    program are cached, so in one worker the split compiles nothing more, and
    ``--dist worksteal`` can balance the pieces between the workers."""
    ref_loss, ref = reference_loss_and_grads()
    loss, grads = compiled(mode)[0](setup("none")[1])
    assert_close(loss, ref_loss, 1e-6, f"{mode}: loss")
    assert_trees_close(grads, ref, 1e-5, f"{mode}: dparams")


def test_policy_for_names_the_modes():
    assert policy_for("none") is None
    assert policy_for("full") is jax.checkpoint_policies.nothing_saveable
    with pytest.raises(ValueError, match="remat='layer'"):
        policy_for("layer")
    with pytest.raises(ValueError, match="needs a remat policy"):
        policy_for("none", offload=True)
    with pytest.raises(TypeError, match="offload"):
        policy_for("full", offload="yes")
    with pytest.raises(ValueError, match="remat_offload=True"):
        dataclasses.replace(CFG, remat_offload=True)  # remat="none"


def _host_puts(jaxpr) -> int:
    """``device_put``s into host memory, counted per call site through nested jaxprs."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            n += sum("Host" in str(d) for d in eqn.params.get("devices", ()))
        for val in eqn.params.values():
            for sub in (val if isinstance(val, (list, tuple)) else (val,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += _host_puts(inner)
    return n


@pytest.mark.parametrize("mode,per_layer", [("full", 1), ("attention", 3),
                                            ("attention_mlp", 5), ("attention", 0)])
def test_offload_moves_what_the_policy_saves_to_the_host(mode, per_layer):
    """``remat_offload``: each block's input and the names the mode saves (attention output
    and lse; the MLP's gate and up) go to host memory once per layer; without it,
    nothing does (the last case)."""
    loss, params = setup(mode + ("+offload" if per_layer else ""))
    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(params).jaxpr
    assert _host_puts(jaxpr) == L * per_layer


def _dots(hlo: str) -> int:
    return len(re.findall(r"= \S+ dot\(", hlo))


def test_attention_mlp_recomputes_no_mlp_projection():
    """Saving the gate and up projections removes their two matmuls per layer from the
    backward's recomputation (issue 30: 4.15 -> 3.91 s per 7B step at 32k on an H200)."""
    assert _dots(compiled("attention")[1]) - _dots(compiled("attention_mlp")[1]) == 2 * L


SELECTIVE_CASES = {
    "zigzag_causal_G4_kv": dict(G=4, layout="zigzag", causal=True, backward="kv"),
    "zigzag_causal_segments_G8_q": dict(G=8, layout="zigzag", causal=True, seg=True,
                                        backward="q"),
    "contiguous_causal_gqa_G8": dict(G=8, layout="contiguous", causal=True, Hkv=2),
    "striped_window_G2": dict(G=2, layout="striped", window=(5, 3), backward="q"),
}


@pytest.mark.parametrize("case", list(SELECTIVE_CASES))
def test_seq_selective_attention_matches_reference(case):
    """The two row groups' passes (structured halves or the general path) add up to the
    whole attention: outputs and gradients against the dense reference."""
    kw = dict(SELECTIVE_CASES[case])
    G, Hkv, seg_on = kw.pop("G"), kw.pop("Hkv", 4), kw.pop("seg", False)
    q, k, v = make_qkv(0, B=2, S=64, Hq=4, Hkv=Hkv, D=16)
    do = make_cotangent(0, q.shape)
    seg = sorted_segments(0, 2, 64) if seg_on else None
    mesh = make_mesh(G)

    @jax.jit
    def f(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: seq_selective_attention(
            q, k, v, mesh=mesh, segment_ids=seg, **kw), q, k, v)
        return out, vjp(do)

    out, grads = f(q, k, v, do)
    ro, _, rgrads = reference_fwd_bwd(q, k, v, do, seg, causal=kw.get("causal", False),
                                      window=kw.get("window"))
    assert_close(out, ro, 1e-5, f"{case}: out")
    for name, g, r in zip("qkv", grads, rgrads):
        assert_close(g, r, 1e-5, f"{case}: d{name}")


def test_seq_selective_attention_errors():
    q = jax.numpy.zeros((1, 20, 2, 8))
    with pytest.raises(ValueError, match="2\\*4 devices"):
        seq_selective_attention(q, q, q, mesh=make_mesh(4))


def test_examples_offer_every_remat_mode():
    """The examples parse their flags before importing JAX, so they list the modes
    literally; the lists must stay the library's."""
    import ast
    from pathlib import Path

    from jax_seqpar.layers.remat import REMAT_MODES
    root = Path(__file__).resolve().parents[1] / "examples"
    for name in ("finetune_long_context.py", "train_long_context.py"):
        tree = ast.parse((root / name).read_text())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and n.args
                 and isinstance(n.args[0], ast.Constant) and n.args[0].value == "--remat"]
        (call,) = calls
        choices = next(k.value for k in call.keywords if k.arg == "choices")
        assert tuple(ast.literal_eval(choices)) == REMAT_MODES, name
