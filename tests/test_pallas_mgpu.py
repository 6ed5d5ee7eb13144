"""Issue 20: the Hopper (Mosaic GPU) kernels, what can be checked without a GPU.

Mosaic GPU kernels neither run nor interpret on CPU, but JAX lowers them for CUDA on any
machine: tracing the kernel bodies, checking every ref, layout, barrier and wgmma shape,
and emitting the Mosaic GPU module.  So these tests lower the forward and both backward
kernels (alone and inside a ring) for ``cuda``, and check the configuration, the
shared-memory budget, the launch order and the refusals.  Their numerics are checked on
an H200 by ``benchmarks/kernels.py --phases check`` (RESULTS.md has each run's cases).
"""

import contextlib
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import jax_seqpar as jsp
from jax_seqpar.runtime import _compat
from jax_seqpar.kernels import pallas_mgpu, pallas_mgpu_fwd
from jax_seqpar.kernels.base import (TILE_ALIGNED, TILE_DENSE, TILE_GENERAL, KernelRequest,
                                     get_kernel)
from jax_seqpar.kernels.pallas_common import tile_lists
from jax_seqpar.kernels import pallas_mgpu_common as mgpu_common
from jax_seqpar.kernels.pallas_mgpu import PallasMgpuKernel
from jax_seqpar.kernels.pallas_mgpu_common import (DEFAULT_MGPU_CONFIGS, SMEM_LIMIT,
                                                   MgpuConfig, backward_smem_bytes,
                                                   cta_order, forward_smem_bytes)
from jax_seqpar.kernels.pallas_mgpu_fwd import causal_blocks, index_kind, mgpu_fwd
from jax_seqpar.kernels.pallas_mgpu_bwd import mgpu_bwd
from jax_seqpar.kernels.tiles import TileKernels
from jax_seqpar.masks import BlockMask, MaskSpec

SDS = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16


def _request(**kw):
    base = dict(platform="gpu", dtype="bfloat16", head_dim=128, mask=MaskSpec(causal=True))
    return KernelRequest(**{**base, **kw})


# --------------------------------------------------------------------------- config
@pytest.mark.parametrize("kw,match", [
    (dict(block_q=96), "multiple of 64"),
    (dict(block_kv_bwd=32), "multiple of 64"),
    (dict(num_stages=1), ">= 2"),
    (dict(block_kv=True), "positive int"),
    (dict(atomic_dq=1), "must be a bool"),
    (dict(segment_skip=0), "must be a bool"),
    (dict(index_tiles=1), "must be a bool"),
    (dict(named_sched=None), "must be a bool"),
    (dict(named_free="yes"), "must be a bool"),
    (dict(split_dq=True), "needs atomic_dq=True"),
    (dict(atomic_dq=True, row_scores=True), "needs atomic_dq=True and split_dq=True"),
    (dict(dv_with_dp=1), "must be a bool"),
])
def test_config_is_validated(kw, match):
    with pytest.raises(ValueError, match=match):
        MgpuConfig(**kw)


@pytest.mark.parametrize("D", sorted(DEFAULT_MGPU_CONFIGS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_default_configs_fit_shared_memory(D, dtype):
    """Every default forward fits an H100/H200 CTA (227 KiB); the backward fits too,
    except at D = 256, where the backend hands the backward to the Triton kernel."""
    cfg = DEFAULT_MGPU_CONFIGS[D]
    assert forward_smem_bytes(cfg, D, dtype) <= SMEM_LIMIT
    assert (backward_smem_bytes(cfg, D, dtype) <= SMEM_LIMIT) == (D != 256)


@pytest.mark.parametrize("D", [64, 128])
def test_atomic_dq_shared_memory(D):
    """The atomic-dQ dK/dV CTA adds each consumer's dS^T tile and float32 dQ block to the
    two-kernel one's (split: both consumers' dS^T twice, half-width dQ blocks), and
    still fits at D = 64 and 128."""
    two = dataclasses.replace(DEFAULT_MGPU_CONFIGS[D], atomic_dq=False)
    one = dataclasses.replace(two, atomic_dq=True)
    kv_ring = 2 * 2 * 64 * D * 2 + 2 * 64 * (2 * D * 2 + 8)
    extra = 2 * 64 * (64 * 2 + D * 4)
    assert backward_smem_bytes(one, D, "bfloat16") == kv_ring + extra <= SMEM_LIMIT
    split = dataclasses.replace(one, split_dq=True)
    extra = 2 * 2 * 64 * 64 * 2 + 2 * 64 * (D // 2) * 4
    assert backward_smem_bytes(split, D, "bfloat16") == kv_ring + extra <= SMEM_LIMIT
    rows = dataclasses.replace(split, row_scores=True)  # and each consumer's P block
    extra += 2 * 64 * 64 * 2
    assert backward_smem_bytes(rows, D, "bfloat16") == kv_ring + extra <= SMEM_LIMIT


@pytest.mark.parametrize("kw,name", [(dict(), "split_dq"), (dict(row_scores=True), "row_scores")])
def test_split_dq_needs_head_dim_128(kw, name):
    cfg = MgpuConfig(atomic_dq=True, split_dq=True, **kw)
    pos = jnp.arange(256)

    def bwd(q, lse):
        return mgpu_bwd(q, q, q, q, lse, q, pos, pos, MaskSpec(causal=True), 0.1, config=cfg)
    with pytest.raises(ValueError, match=f"{name} needs a head dim of 128"):
        _lowered(bwd, SDS((1, 256, 2, 64), BF16), SDS((1, 2, 256), jnp.float32))



@pytest.mark.parametrize("kw", [dict(), dict(split_dq=True, row_scores=True)])
@pytest.mark.parametrize("tma", [False, True])
def test_each_call_zeroes_its_own_dq_after_its_delta(kw, tma):
    """The float32 dQ that an atomic-dQ backward adds into is zeroed once per call, after
    and from that call's delta: a broadcast of a zero tied to the delta by an
    ``optimization_barrier`` (``pallas_mgpu_bwd.zeroed_dq``), or (``tma_zero_dq``) a
    kernel of TMA stores that takes the delta as an operand (``tma_zeros``).  A zero
    broadcast from a constant let XLA merge the zeros of every call into one
    multi-output broadcast that allocated all of them at once."""
    import re
    cfg = MgpuConfig(atomic_dq=True, tma_zero_dq=tma, **kw)
    T = 256
    pos = jnp.arange(T)

    def two_calls(q, k, v, o, lse, do):
        dq, _, _ = mgpu_bwd(q, k, v, o, lse, do, pos, pos, MaskSpec(causal=True), 0.1,
                            config=cfg)
        return mgpu_bwd(q, k, v, o, lse, dq.astype(BF16), pos, pos, MaskSpec(causal=True),
                        0.1, config=cfg)
    x = SDS((1, T, 2, 128), BF16)
    txt = _lowered(two_calls, x, x, x, x, SDS((1, 2, T), jnp.float32), x)
    defs = {m.group(1): m.group(2) for m in re.finditer(r"(%[\w]+)(?::\d+)? = (.*)", txt)}
    calls = re.findall(r"custom_call @mosaic_gpu_v2\(([^)]*)\)", txt)
    # the fused kernel (no separate dQ kernel), and with tma its zeros, per call
    assert len(calls) == 2 * (1 + tma), calls
    calls = [c for c in calls if len(c.split(", ")) > 1]  # the backward kernels
    assert len(calls) == 2, calls
    tied = set()
    for operands in calls:
        acc = operands.split(", ")[-1]  # the dQ Ref is the last operand
        init = defs[acc]
        if tma:
            assert init.startswith("stablehlo.reshape"), init
            src = defs[re.match(r"stablehlo.reshape (%\w+)", init).group(1)]
            zeros = re.match(r"stablehlo.custom_call @mosaic_gpu_v2\((%\w+)\)", src)
            # [B * L * H, D] zeros from the [B, H, L] delta
            assert zeros and src.endswith("(tensor<1x2x256xf32>) -> tensor<512x128xf32>"), \
                src[-80:]
            tied.add(zeros.group(1))  # its one operand: this call's delta
            continue
        assert init.startswith("stablehlo.broadcast_in_dim") and "1x256x2x128xf32" in init, init
        zero = re.match(r"stablehlo.broadcast_in_dim (%\w+)#0", init)
        assert zero, init  # not a constant: the first result of a tuple-valued op
        assert defs[zero.group(1)].startswith("stablehlo.optimization_barrier"), defs[zero.group(1)]
        tied.add(zero.group(1))
    assert len(tied) == 2


def test_step_index_is_the_index_for_every_list_entry():
    """``step_index`` (the fused kernel) must give back the consumer's own index for every
    tile-list entry (never negative); only its opacity to the compiler differs."""
    from jax_seqpar.kernels.pallas_mgpu_common import step_index
    for wg in (0, 1):
        for token in (0, 1, 7, 2 ** 30):
            assert int(step_index(jnp.int32(wg), jnp.int32(token))) == wg


def test_launch_order_puts_the_longest_rows_first():
    counts = jnp.array([[1, 4, 2, 4, 0], [3, 3, 3, 3, 3]], jnp.int32)
    tbl = jnp.concatenate([counts[..., None], jnp.zeros((2, 5, 3), jnp.int32)], -1)
    order = np.asarray(cta_order(tbl))
    np.testing.assert_array_equal(order[0], [1, 3, 2, 0, 4])  # stable among equals
    np.testing.assert_array_equal(order[1], np.arange(5))


def _packed_lists(lens, T, rows=128, classes=False, transpose=False):
    ids = np.repeat(np.arange(len(lens)), lens).astype(np.int32)[None]
    pos = jnp.arange(T, dtype=jnp.int32)
    seg = jnp.asarray(ids)
    return ids, np.asarray(tile_lists(MaskSpec(causal=True), pos[None], pos, T, rows, rows,
                                      True, transpose=transpose, q_seg=seg, kv_seg=seg,
                                      classes=classes))


@pytest.mark.parametrize("classes", [False, True])
def test_doc_launch_order_of_key_blocks(classes):
    """``doc_cta_order(last=True)`` (``MgpuConfig.doc_order_bwd``) on transposed lists: a
    permutation of the key blocks in which each document's blocks are contiguous (a
    block that straddles two documents goes with the later one, whose queries it sees
    to their end), the documents longest first, each one's blocks most tiles first."""
    from jax_seqpar.kernels.pallas_mgpu_common import doc_cta_order
    lens = [640, 1536, 300, 1492, 1536, 1664]
    T = sum(lens)
    ids, tbl = _packed_lists(lens, T, classes=classes, transpose=True)
    order = np.asarray(doc_cta_order(jnp.asarray(tbl), last=True, classes=classes))[0]
    assert sorted(order) == list(range(T // 128))
    doc = ids[0, order * 128 + 127]  # the document of each launched block's last key
    changes = np.flatnonzero(np.diff(doc)) + 1
    runs = np.split(doc, changes)
    assert len({r[0] for r in runs}) == len(runs)  # each document in one run
    assert [r[0] for r in runs][:1] == [5]  # the longest first
    for chunk in np.split(tbl[0, order, 0], changes):
        assert (np.diff(chunk) <= 0).all()
    mixed = ids[0, np.asarray(cta_order(jnp.asarray(tbl)))[0] * 128 + 127]
    assert (np.diff(mixed) != 0).sum() > len(runs)  # most tiles first interleaves them


@pytest.mark.parametrize("classes", [False, True])
def test_doc_launch_order_keeps_documents_together(classes):
    """``doc_cta_order`` (``MgpuConfig.doc_order``): a permutation of the query blocks in
    which each document's blocks are contiguous, the documents longest first, each
    one's blocks most tiles first; blocks that straddle two documents go with the
    earlier one (the first key block they see)."""
    from jax_seqpar.kernels.pallas_mgpu_common import doc_cta_order
    # documents 1, 3 and 4 have equally long blocks at most (12 tiles), 2 and 3 start
    # inside a block of 128
    lens = [640, 1536, 300, 1492, 1536, 1664]
    T = sum(lens)
    ids, tbl = _packed_lists(lens, T, classes=classes)
    order = np.asarray(doc_cta_order(jnp.asarray(tbl), classes=classes))[0]
    assert sorted(order) == list(range(T // 128))
    doc = ids[0, order * 128]  # the document of each launched block's first query
    changes = np.flatnonzero(np.diff(doc)) + 1
    runs = np.split(doc, changes)
    assert len({r[0] for r in runs}) == len(runs)  # each document in one run
    assert [r[0] for r in runs] == [5, 1, 3, 4, 0, 2]  # longest first, then in place
    counts = tbl[0, order, 0]
    for chunk in np.split(counts, changes):
        assert (np.diff(chunk) <= 0).all()
    # a cta_order of the same lists interleaves the documents
    mixed = ids[0, np.asarray(cta_order(jnp.asarray(tbl)))[0] * 128]
    assert (np.diff(mixed) != 0).sum() > len(runs)


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("classes", [False, True])
def test_doc_launch_order_reads_the_groups_ends(transpose, classes):
    """``doc_cta_order`` reads a row's smallest (largest) entry from its groups' first
    (last) entries; the order equals one from the smallest (largest) of all of the
    row's live entries, rows with nothing to see included, with and without mask
    classes."""
    from jax_seqpar.kernels.pallas_mgpu_common import doc_cta_order
    lens = [640, 1536, 300, 1492, 1536, 1664]
    _, tbl = _packed_lists(lens, sum(lens), classes=classes, transpose=transpose)
    tbl = tbl.copy()
    tbl[0, 3, :2] = 0  # a row with nothing to see
    if classes:
        tbl[0, 3, -3:] = 0
    n, width = tbl.shape[1:]
    count = tbl[0, :, 0]
    live = np.arange(width - 2)[None] < count[:, None]
    entries = tbl[0, :, 2:]
    ref = (np.where(live, width - 1 - entries, 2 ** 31 - 1) if transpose
           else np.where(live, entries, 2 ** 31 - 1)).min(-1)
    ref = np.where(count > 0, ref, width + np.arange(n))
    longest = np.zeros(width + n, np.int64)
    np.maximum.at(longest, ref, count)
    want = np.lexsort((-count, ref, -longest[ref]))
    got = np.asarray(doc_cta_order(jnp.asarray(tbl), last=transpose, classes=classes))[0]
    np.testing.assert_array_equal(got, want)


def test_doc_launch_order_of_one_row_and_empty_rows():
    """Without documents (one causal row) the order is ``cta_order``'s; rows that see no
    key block launch last, each as a document of its own."""
    from jax_seqpar.kernels.pallas_mgpu_common import doc_cta_order
    T = 1024
    pos = jnp.arange(T, dtype=jnp.int32)
    tbl = tile_lists(MaskSpec(causal=True), pos[None], pos, T, 128, 128, False)
    np.testing.assert_array_equal(doc_cta_order(tbl), cta_order(tbl))
    tbl = np.asarray(tbl).copy()
    tbl[0, 2, 0] = tbl[0, 5, 0] = 0  # two rows with nothing to see
    order = np.asarray(doc_cta_order(jnp.asarray(tbl)))[0]
    assert sorted(order) == list(range(T // 128)) and set(order[-2:]) == {2, 5}


@pytest.mark.parametrize("doc_order", [True, False])
def test_forward_and_dq_launch_documents_together(doc_order, monkeypatch):
    """With segment ids the forward and the dQ kernel take ``doc_cta_order`` (the dK/dV
    kernel keeps ``cta_order``: RESULTS.md); without them, or with ``doc_order=False``,
    none does."""
    from jax_seqpar.kernels import pallas_mgpu_bwd
    calls = []
    for mod in (pallas_mgpu_fwd, pallas_mgpu_bwd):
        real = mod.doc_cta_order
        monkeypatch.setattr(mod, "doc_cta_order",
                            lambda tbl, _r=real, _m=mod.__name__, **kw:
                            calls.append(_m) or _r(tbl, **kw))
    cfg = dataclasses.replace(DEFAULT_MGPU_CONFIGS[128], doc_order=doc_order)
    T, mask = 512, MaskSpec(causal=True)
    q, kv = SDS((1, T, 2, 128), BF16), SDS((1, T, 2, 128), BF16)
    pos = [SDS((T,), jnp.int32)] * 2
    for segs in ([SDS((1, T), jnp.int32)] * 2, []):
        calls.clear()
        _traced(lambda q, k, v, a, b, *s: mgpu_fwd(q, k, v, a, b, mask, 0.1, *s,
                                                   config=cfg, tile=TILE_ALIGNED),
                q, kv, kv, *pos, *segs)
        _traced(lambda q, k, v, o, lse, do, a, b, *s: mgpu_bwd(
            q, k, v, o, lse, do, a, b, mask, 0.1, *s, config=cfg),
            q, kv, kv, q, SDS((1, 2, T), jnp.float32), q, *pos, *segs)
        want = ["jax_seqpar.kernels.pallas_mgpu_fwd", "jax_seqpar.kernels.pallas_mgpu_bwd"]
        assert calls == (want if segs and doc_order else [])
    # doc_order_bwd: the key-stationary kernel's launch order too
    cfg = dataclasses.replace(cfg, doc_order_bwd=True)
    calls.clear()
    _traced(lambda q, k, v, o, lse, do, a, b, *s: mgpu_bwd(
        q, k, v, o, lse, do, a, b, mask, 0.1, *s, config=cfg),
        q, kv, kv, q, SDS((1, 2, T), jnp.float32), q, *pos, SDS((1, T), jnp.int32),
        SDS((1, T), jnp.int32))
    assert calls == ["jax_seqpar.kernels.pallas_mgpu_bwd"] * (2 if doc_order else 1)


# --------------------------------------------------------------------------- refusals
def test_refused_off_hopper_with_the_reason():
    with pytest.raises(NotImplementedError, match="Hopper"):
        PallasMgpuKernel().check(_request())
    with pytest.raises(NotImplementedError, match="Hopper"):
        get_kernel("pallas_mgpu", _request(platform="cpu"))


@pytest.mark.parametrize("kw,match", [
    (dict(dtype="float32"), "float32"),
    (dict(head_dim=96), "head_dim=96"),
    (dict(mask=MaskSpec(block_mask=BlockMask(np.ones((2, 2), bool), 8))), "block_mask"),
])
def test_refuses_what_it_cannot_honour(kw, match, monkeypatch):
    monkeypatch.setattr(pallas_mgpu, "is_hopper", lambda: True)
    with pytest.raises(NotImplementedError, match=match):
        PallasMgpuKernel().check(_request(**kw))


def test_config_type_is_checked():
    with pytest.raises(TypeError, match="MgpuConfig"):
        PallasMgpuKernel(config=object())


@pytest.mark.parametrize("kw,want", [
    (dict(), {TILE_DENSE: "cudnn", TILE_ALIGNED: "cudnn", TILE_GENERAL: "pallas_mgpu"}),
    (dict(has_segments=True), {TILE_DENSE: "pallas_mgpu", TILE_ALIGNED: "pallas_mgpu",
                               TILE_GENERAL: "pallas_mgpu"}),
    (dict(dtype="float32"), {TILE_DENSE: "pallas", TILE_ALIGNED: "pallas",
                             TILE_GENERAL: "pallas"}),
    (dict(head_dim=64), {TILE_DENSE: "cudnn", TILE_ALIGNED: "pallas_mgpu",
                         TILE_GENERAL: "pallas_mgpu"}),
    (dict(head_dim=64, dtype="float32"), {TILE_DENSE: "pallas", TILE_ALIGNED: "pallas",
                                          TILE_GENERAL: "pallas"}),
])
def test_auto_on_hopper(kw, want, monkeypatch):
    """On Hopper ``auto`` keeps cuDNN for the tiles it serves where its forward + backward
    is faster (dense tiles; aligned ones at D 128) and gives every other bf16/f16 tile to
    the Mosaic GPU kernel (base.AUTO_ORDER)."""
    monkeypatch.setattr(pallas_mgpu, "is_hopper", lambda: True)
    monkeypatch.setattr(_compat, "cudnn_module", lambda: None)
    assert TileKernels("auto", _request(**kw)).choices == want


@pytest.mark.parametrize("kw,want", [
    (dict(), {TILE_ALIGNED: (8192, "pallas_mgpu"),   # D 128: cuDNN above 8k rows,
              TILE_DENSE: (2048, "pallas_mgpu")}),     # and above 2k without a mask
    (dict(head_dim=64), {}),          # D 64: aligned on pallas_mgpu, dense on cuDNN, any length
    (dict(has_segments=True), {}),                     # pallas_mgpu already everywhere
    (dict(dtype="float32"), {}),                       # neither serves float32 here
])
def test_auto_on_hopper_gives_short_tiles_to_the_hopper_kernel(kw, want, monkeypatch):
    """base.AUTO_ORDER_SHORT_ROWS: at D 128 aligned tiles of up to 8k rows and dense ones
    of up to 2k go to ``pallas_mgpu`` (forward + backward 1.03-1.33x cuDNN's on one H100),
    longer ones to cuDNN; the call's name says both."""
    monkeypatch.setattr(pallas_mgpu, "is_hopper", lambda: True)
    monkeypatch.setattr(_compat, "cudnn_module", lambda: None)
    tk = TileKernels("auto", _request(**kw))
    assert tk.short_rows == want
    if want:
        assert tk.name == ("dense=cudnn, aligned=cudnn, general=pallas_mgpu, "
                           "dense<=2048=pallas_mgpu, aligned<=8192=pallas_mgpu")
        assert tk.skips_masked_blocks and tk.needs_o
        short = KernelRequest(platform="gpu", dtype="bfloat16", head_dim=128,
                              mask=MaskSpec(causal=True), tile=TILE_ALIGNED, rows=8192)
        tk.check(short)  # routed to pallas_mgpu, which accepts it


# --------------------------------------------------------------------------- lowering
def _lowered(f, *args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _traced(f, *args):
    """``f`` traced, kernel bodies included, without the Mosaic GPU lowering (most of
    ``_lowered``'s time): for tests of what the wrappers call, whose kernels
    ``test_kernels_lower_for_cuda`` lowers."""
    return jax.jit(f).trace(*args).jaxpr


def _module_spy():
    """``(modules, spy)``: a list, and a stand-in for Mosaic GPU's serde pass that appends
    the text of each module it sees (the kernel's own MLIR, before it is serialised into
    the custom call) to it and then runs the pass."""
    import jax.experimental.mosaic.gpu.core as mcore
    modules, serde = [], mcore._run_serde_pass

    def spy(module, *a, **k):
        modules.append(module.operation.get_asm(enable_debug_info=False))
        return serde(module, *a, **k)
    return modules, spy


def _mosaic_modules(monkeypatch):
    """A list that collects the text of every Mosaic GPU module lowered from now on."""
    import jax.experimental.mosaic.gpu.core as mcore
    modules, spy = _module_spy()
    monkeypatch.setattr(mcore, "_run_serde_pass", spy)
    return modules


@contextlib.contextmanager
def _collecting_mosaic_modules():
    """``_mosaic_modules`` for one block, without a test's ``monkeypatch`` (for the cached
    lowerings below, which outlive the test that made them)."""
    import jax.experimental.mosaic.gpu.core as mcore
    serde = mcore._run_serde_pass
    modules, mcore._run_serde_pass = _module_spy()
    try:
        yield modules
    finally:
        mcore._run_serde_pass = serde


#: The backward variants that ``test_kernels_lower_for_cuda`` and
#: ``test_backward_variant_lowers_on_packed_documents`` lower: fields replaced in the
#: per-dim default; the split-dQ ones need D 128.
_BWD_VARIANTS = [
    dict(atomic_dq=False, overlap_bwd=False),
    dict(atomic_dq=False, overlap_bwd=True), dict(atomic_dq=False, dv_with_dp=True),
    dict(atomic_dq=True),
    dict(atomic_dq=False, dv_with_dp=True, warp_producer_bwd=True),
    dict(atomic_dq=False, mask_classes=False),
    dict(atomic_dq=True, warp_producer_bwd=True),
    dict(atomic_dq=False, dv_with_dp=False, overlap_bwd=True)]
_SPLIT_DQ_VARIANTS = [
    dict(atomic_dq=True, split_dq=True),
    dict(atomic_dq=True, split_dq=True, row_scores=True),
    dict(atomic_dq=True, split_dq=True, row_scores=True, mask_classes=False),
    dict(atomic_dq=True, split_dq=True, row_scores=True, dv_with_dp=False),
    dict(atomic_dq=True, split_dq=True, row_scores=True, early_dq=False),
    dict(atomic_dq=True, split_dq=True, row_scores=True, early_dq=False, dv_with_dp=False),
    dict(atomic_dq=True, split_dq=True, row_scores=True, dv_with_dp=False,
         doc_order_bwd=True),
    dict(atomic_dq=True, split_dq=True, row_scores=True, tma_zero_dq=False)]


def _distinct_configs(D, variants):
    """``{config: its variant}`` for the ``variants`` of ``DEFAULT_MGPU_CONFIGS[D]``, in
    order; a variant equal to an earlier one (or the default to a variant) once."""
    out = {}
    for kw in variants:
        out.setdefault(dataclasses.replace(DEFAULT_MGPU_CONFIGS[D], **kw), kw)
    return out


def _assert_backward_kernels(txt, c):
    """dK/dV and dQ, or dK/dV with dQ added in place (a Ref operand), zeroed by XLA or
    (tma_zero_dq) by a kernel of its own."""
    want = (1 + c.tma_zero_dq) if c.atomic_dq else 2
    assert len(re.findall(r"custom_call @mosaic_gpu", txt)) == want


#: Packed documents at D 128: GQA (4 query heads, 2 KV), more queries than keys, causal,
#: segment ids (segment-range tile lists), so every variant runs its masked code.
_PACKED = dict(B=2, Tq=512, Tk=384, Hq=4, Hkv=2, D=128)
_PACKED_CONFIGS = _distinct_configs(128, _BWD_VARIANTS + _SPLIT_DQ_VARIANTS)


def _packed_bwd(c, seg=True):
    """``(HLO text, Mosaic GPU module texts)`` of the backward of config ``c`` lowered for
    CUDA on the ``_PACKED`` shapes (with segment ids unless ``seg=False``).  Cached: the
    variant sweep and the tests that read one config's kernel text (early_dq,
    early_exit) lower the same programs, once per process."""
    return _packed_bwd_cached(c, bool(seg))  # one cache key however ``seg`` is passed


@functools.lru_cache(maxsize=None)
def _packed_bwd_cached(c, seg):
    B, Tq, Tk, Hq, Hkv, D = (_PACKED[k] for k in ("B", "Tq", "Tk", "Hq", "Hkv", "D"))
    q, kv = SDS((B, Tq, Hq, D), BF16), SDS((B, Tk, Hkv, D), BF16)
    pos = [SDS((Tq,), jnp.int32), SDS((Tk,), jnp.int32)]
    segs = [SDS((B, Tq), jnp.int32), SDS((B, Tk), jnp.int32)] if seg else []
    lse = SDS((B, Hq, Tq), jnp.float32)
    with _collecting_mosaic_modules() as modules:
        txt = _lowered(lambda q, k, v, o, l, do, qp, kp, *s: mgpu_bwd(
            q, k, v, o, l, do, qp, kp, MaskSpec(causal=True), 0.1, *s, config=c),
            q, kv, kv, q, lse, q, *pos, *segs)
    return txt, tuple(modules)


@functools.lru_cache(maxsize=None)
def _packed_fwd(c):
    """The HLO text of the forward of config ``c`` (general tiles) lowered for CUDA on the
    ``_PACKED`` shapes with segment ids; cached like ``_packed_bwd``, for
    ``test_kernels_lower_for_cuda`` and ``test_forward_overlap_within_a_consumer``."""
    B, Tq, Tk, Hq, Hkv, D = (_PACKED[k] for k in ("B", "Tq", "Tk", "Hq", "Hkv", "D"))
    q, kv = SDS((B, Tq, Hq, D), BF16), SDS((B, Tk, Hkv, D), BF16)
    pos = [SDS((Tq,), jnp.int32), SDS((Tk,), jnp.int32)]
    segs = [SDS((B, Tq), jnp.int32), SDS((B, Tk), jnp.int32)]
    return _lowered(lambda q, k, v, qp, kp, *s: mgpu_fwd(
        q, k, v, qp, kp, MaskSpec(causal=True), 0.1, *s, config=c), q, kv, kv, *pos, *segs)


@pytest.mark.parametrize("D,Tq,Tk,causal,window,seg", [
    (128, 512, 512, False, None, False),
    (64, 300, 200, True, None, False),     # ragged, GQA
    (256, 256, 384, True, (70, 0), True),  # window, segments
    (128, 512, 384, True, None, True),     # packed documents: segment-range tile lists
])
def test_kernels_lower_for_cuda(D, Tq, Tk, causal, window, seg):
    """The forward and both backward kernels trace and lower to Mosaic GPU custom calls:
    the tables' picks on the first two cases; on packed documents every backward
    variant, one test each (``test_backward_variant_lowers_on_packed_documents``, split
    from this one so that the two workers share its ~20 lowerings)."""
    mask = MaskSpec(causal=causal, window=window)
    cfg = DEFAULT_MGPU_CONFIGS[D]
    q, kv = SDS((2, Tq, 4, D), BF16), SDS((2, Tk, 2, D), BF16)
    pos = [SDS((Tq,), jnp.int32), SDS((Tk,), jnp.int32)]
    segs = [SDS((2, Tq), jnp.int32), SDS((2, Tk), jnp.int32)] if seg else []
    fwd_cfgs = ([cfg, dataclasses.replace(cfg, overlap_fwd=True)]
                + ([dataclasses.replace(cfg, mask_classes_fwd=True)] if seg else []))
    # (a variant equal to the default, or to another, is lowered once)
    packed = (D, Tq, Tk, causal, window, seg) == (128, 512, 384, True, None, True)
    for fcfg in dict.fromkeys(fwd_cfgs):
        fwd = _packed_fwd(fcfg) if packed else _lowered(
            lambda q, k, v, qp, kp, *s: mgpu_fwd(q, k, v, qp, kp, mask, 0.1, *s, config=fcfg),
            q, kv, kv, *pos, *segs)
        assert fwd.count("mosaic_gpu") >= 1
    if D == 256:
        return  # the backend's backward is the Triton kernel's there
    if packed:  # its backwards: test_backward_variant_lowers_on_packed_documents
        return
    lse = SDS((2, 4, Tq), jnp.float32)
    # every variant's masked code lowers in the packed case; here the tables' picks
    # (mgpu_tuned.json: H100, H200, D 64) and the default
    picks = [kw for kw in _BWD_VARIANTS + (_SPLIT_DQ_VARIANTS if D >= 128 else []) if kw in (
        dict(atomic_dq=False, overlap_bwd=True), dict(atomic_dq=True),
        dict(atomic_dq=True, split_dq=True, row_scores=True),
        dict(atomic_dq=True, split_dq=True, row_scores=True, dv_with_dp=False))]
    for c in _distinct_configs(D, picks + [dict(atomic_dq=cfg.atomic_dq)]):
        bwd = _lowered(lambda q, k, v, o, l, do, qp, kp, *s: mgpu_bwd(
            q, k, v, o, l, do, qp, kp, mask, 0.1, *s, config=c), q, kv, kv, q, lse, q,
            *pos, *segs)
        _assert_backward_kernels(bwd, c)


@pytest.mark.parametrize("c", list(_PACKED_CONFIGS), ids=[
    ",".join(f"{k}={int(v)}" for k, v in kw.items()) for kw in _PACKED_CONFIGS.values()])
def test_backward_variant_lowers_on_packed_documents(c):
    """Every backward variant (``_BWD_VARIANTS`` and, at D 128, ``_SPLIT_DQ_VARIANTS``;
    each distinct config once) lowers on packed documents, where each runs its masked
    code: the kernels ``_assert_backward_kernels`` names."""
    _assert_backward_kernels(_packed_bwd(c)[0], c)


@pytest.mark.parametrize("shape,rows", [((1, 1024, 4, 128), 128), ((2, 640, 3, 128), 128),
                                        ((1, 192, 5, 64), 64), ((1, 256, 4, 64), 256)])
def test_tma_zeros_lower_to_one_loop_of_stores(shape, rows, monkeypatch):
    """``MgpuConfig.tma_zero_dq``'s zeros: one Mosaic GPU kernel whose CTAs store a zeroed
    shared-memory block with TMA in a loop (a smaller block where the rows do not divide
    into 64 KiB ones), and shapes it cannot cover refused, naming the shape.  Its values
    are checked on a GPU (``benchmarks/zeros_gpu.py``: every element 0 where the
    allocator last held NaNs)."""
    from jax_seqpar.kernels import pallas_mgpu_bwd
    modules = _mosaic_modules(monkeypatch)
    blocks = []
    real = pallas_mgpu_bwd._plgpu

    class Spy:  # the scratch block's shape, as the kernel asks for it
        def __getattr__(self, name):
            attr = getattr(real(), name)
            if name != "SMEM":
                return attr
            return lambda shape, *a, **k: blocks.append(shape) or attr(shape, *a, **k)
    monkeypatch.setattr(pallas_mgpu_bwd, "_plgpu", Spy)
    after = SDS((shape[0], shape[2], shape[1]), jnp.float32)
    txt = _lowered(lambda a: pallas_mgpu_bwd.tma_zeros(shape, a), after)
    assert txt.count("custom_call @mosaic_gpu") == 1 and len(modules) == 1
    assert blocks == [(rows, shape[-1])]
    mod = modules[0]
    assert mod.count("scf.for") == 1
    assert "nvvm.cp.async.bulk.tensor.global.shared" in mod
    assert "nvvm.cp.async.bulk.wait_group" in mod
    with pytest.raises(ValueError, match=r"shape \(1, 3, 7, 128\)"):
        _lowered(lambda a: pallas_mgpu_bwd.tma_zeros((1, 3, 7, 128), a), after)


@pytest.mark.parametrize("D,kw", [
    (128, dict(atomic_dq=True, split_dq=True, row_scores=True)),  # fused (H200, D 128)
    (64, dict(atomic_dq=True)),                                   # dK/dV adding dQ
    (64, dict(atomic_dq=False))])                                 # dK/dV, then dQ
@pytest.mark.parametrize("causal", [True, False])
def test_backward_masks_keys_padded_past_tk(D, kw, causal, monkeypatch):
    """Keys padded past ``Tk`` (200, not a multiple of a CTA's 128 keys) are tested
    against ``Tk`` in every kernel that adds dQ from them, with and without a mask (a
    dense call runs its masked loop then); with 256 keys none is.  The test's absence
    put NaN into dQ on an H200 for rows whose lse was below -88
    (``benchmarks/pad_keys_probe.py`` checks the values on a GPU).  Traced, not
    lowered: ``test_kernels_lower_for_cuda`` lowers these kernels."""
    from jax_seqpar.kernels import pallas_mgpu_bwd, pallas_mgpu_fused
    cfg = dataclasses.replace(DEFAULT_MGPU_CONFIGS[D], **kw)
    assert 2 * cfg.block_kv_bwd == 128 and cfg.block_kv_dq == 128
    seen = []  # (shape, whether a padded-key test came) of each tile test
    for module in (pallas_mgpu_bwd, pallas_mgpu_fused):
        def spy(*a, extra=None, real=module.tile_visible, **k):
            seen.append((a[6], extra is not None))
            return real(*a, extra=extra, **k)
        monkeypatch.setattr(module, "tile_visible", spy)
    bq, bk = cfg.block_q_bwd, cfg.block_kv_bwd
    # the key-stationary kernel's tiles: [queries, keys] fused, [keys, queries] not
    kv_shape = (bq, bk) if cfg.row_scores else (bk, bq)
    for T in (200, 256):
        seen.clear()
        q = SDS((1, T, 2, D), BF16)
        _traced(lambda q, k, v, o, l, do, qp, kp: mgpu_bwd(
            q, k, v, o, l, do, qp, kp, MaskSpec(causal=causal), 0.1, config=cfg),
            q, q, q, q, SDS((1, 2, T), jnp.float32), q, *[SDS((T,), jnp.int32)] * 2)
        kv_tests = {pad for shape, pad in seen if shape == kv_shape}
        dq_tests = {pad for shape, pad in seen if shape == (bq, cfg.block_kv_dq)}
        # the kernels that add dQ: with 200 keys each tile test has it, with 256 none
        adds_dq = kv_tests if cfg.atomic_dq else dq_tests
        assert adds_dq == ({True} if T == 200 else {False} if causal else set())
        if not cfg.atomic_dq:  # the dK/dV kernel's own padded rows are cut off
            assert kv_tests == ({False} if causal else set())


def _spy_on_lists(module, monkeypatch, kw, seg: bool):
    """Record the ``classes=`` of every ``tile_lists`` call ``module`` makes; returns
    ``(seen, config, T, q, positions, segment ids)`` for a D 128 causal call of 512
    tokens, the default config with ``kw`` replaced, segment ids if ``seg``."""
    seen = []
    real = module.tile_lists

    def spy(*a, **k):
        seen.append(k.get("classes", False))
        return real(*a, **k)
    monkeypatch.setattr(module, "tile_lists", spy)
    T = 512
    segs = [SDS((1, T), jnp.int32)] * 2 if seg else []
    return (seen, dataclasses.replace(DEFAULT_MGPU_CONFIGS[128], **kw), T,
            SDS((1, T, 2, 128), BF16), [SDS((T,), jnp.int32)] * 2, segs)


@pytest.mark.parametrize("kw,seg,tile,want", [
    (dict(mask_classes_fwd=True), True, TILE_GENERAL, [True]),
    (dict(mask_classes_fwd=True), True, TILE_ALIGNED, [True]),   # masks from indices
    (dict(mask_classes_fwd=False), True, TILE_GENERAL, [False]),
    (dict(mask_classes_fwd=True, segment_skip=False), True, TILE_GENERAL, [False]),
    (dict(mask_classes_fwd=True), False, TILE_GENERAL, [False]),
    (dict(mask_classes_fwd=True), False, TILE_ALIGNED, [])])      # no lists at all
def test_forward_lists_carry_mask_classes(kw, seg, tile, want, monkeypatch):
    """``MgpuConfig.mask_classes_fwd``: the forward gets class-sorted lists with segment
    ids and ``segment_skip``, on general and aligned tiles alike."""
    seen, cfg, T, q, pos, segs = _spy_on_lists(pallas_mgpu_fwd, monkeypatch, kw, seg)
    _traced(lambda q, k, v, qp, kp, *s: mgpu_fwd(
        q, k, v, qp, kp, MaskSpec(causal=True), 0.1, *s, config=cfg, tile=tile),
        q, q, q, *pos, *segs)
    assert seen == want


@pytest.mark.parametrize("n_full", [0, 2])
@pytest.mark.parametrize("fold", [False, True])
def test_softmax_update_folds_rows_of_another_document(n_full, fold):
    """``softmax_update`` run over key blocks as the forward's loops run them (``n_full``
    fully visible blocks first, unmasked; then masked ones: a test per pair, or a whole
    document of keys that some rows cannot see, folded into ``row_ok`` or, without
    ``fold``, masked per score) gives the masked softmax's output and lse, also for rows
    that saw nothing in the first blocks (running max still ``-inf``) or at all, and
    rows whose folded-out keys score far above their own."""
    rng = np.random.default_rng(n_full)
    rows, bk, nb, D, scale = 16, 8, 6, 4, 0.3
    c = scale * np.log2(np.e)
    s = rng.standard_normal((rows, nb * bk)).astype(np.float32) * 3
    v = rng.standard_normal((nb * bk, D)).astype(np.float32)
    kinds = ["full"] * n_full + ["fold", "pair", "fold", "pair", "fold", "fold"][n_full:]
    vis = rng.random((rows, nb * bk)) < 0.7
    row_ok = rng.random((nb, rows)) < 0.5
    late = 0 if n_full else 3  # rows 0-2 see nothing until the last block (row 0 only)
    for b, kind in enumerate(kinds):
        blk = slice(b * bk, (b + 1) * bk)
        if kind == "full":
            vis[:, blk] = True
        elif kind == "fold":
            row_ok[b, :late] = b == nb - 1 and np.arange(late) == 0
            vis[:, blk] = row_ok[b][:, None]
            s[~row_ok[b], blk] += 2000.0  # another document's scores, far larger: a
            # running max that took them would flush the row's own terms to 0
        else:
            vis[:late, blk] = False
    m = jnp.full((rows,), -jnp.inf)
    l = jnp.zeros((rows,))
    acc = jnp.zeros((rows, D))
    for b, kind in enumerate(kinds):
        blk = slice(b * bk, (b + 1) * bk)
        sb = jnp.asarray(s[:, blk])
        folded = kind == "fold" and fold
        if kind != "full" and not folded:
            sb = jnp.where(vis[:, blk], sb, -jnp.inf)
        m, alpha, p = mgpu_common.softmax_update(
            sb, m, c, masked=kind != "full",
            row_ok=jnp.asarray(row_ok[b]) if folded else None)
        acc = acc * alpha[:, None] + p @ v[blk]
        l = l * alpha + p.sum(1)
    has = vis.any(1)
    assert not has[1:late].any() and (has[0] if late else True)
    sm = np.where(vis, s * scale, -np.inf)
    mx = np.where(has, sm.max(1), 0.0)
    e = np.exp(sm - mx[:, None])
    tot = np.where(has, e.sum(1), 1.0)
    l_ = np.asarray(l)
    got_o = np.asarray(acc) / np.where(l_ > 0, l_, 1.0)[:, None]
    np.testing.assert_allclose(got_o, (e @ v) / tot[:, None], rtol=2e-5, atol=2e-6)
    got_lse = np.where(l_ > 0, np.asarray(m) * np.log(2) + np.log(np.where(l_ > 0, l_, 1)),
                       -np.inf)
    np.testing.assert_allclose(got_lse, np.where(has, mx + np.log(tot), -np.inf), rtol=2e-5)
    assert (l_[~has] == 0).all() and np.isfinite(got_o).all()


@pytest.mark.parametrize("kw,seg,want", [
    (dict(), True, [False, True]), (dict(mask_classes=False), True, [False, False]),
    (dict(segment_skip=False), True, [False, False]), (dict(), False, [False, False]),
    (dict(atomic_dq=True), True, [False]),
    (dict(atomic_dq=True, split_dq=True, row_scores=True), True, [True]),
    (dict(atomic_dq=True, split_dq=True, row_scores=True, mask_classes=False), True, [False]),
    (dict(atomic_dq=True, split_dq=True, row_scores=True), False, [False])])
def test_backward_lists_carry_mask_classes(kw, seg, want, monkeypatch):
    """``MgpuConfig.mask_classes``: the dQ kernel gets class-sorted lists (three more
    entries per row) with segment ids and ``segment_skip``; the two-kernel path's dK/dV
    kernel and the atomic-dQ kernel, which do not read classes, plain ones; the fused
    kernel with scores by row (``row_scores``) as the dQ kernel's."""
    from jax_seqpar.kernels import pallas_mgpu_bwd
    seen, cfg, T, q, pos, segs = _spy_on_lists(pallas_mgpu_bwd, monkeypatch, kw, seg)
    _traced(lambda q, k, v, o, l, do, qp, kp, *s: mgpu_bwd(
        q, k, v, o, l, do, qp, kp, MaskSpec(causal=True), 0.1, *s, config=cfg),
        q, q, q, q, SDS((1, 2, T), jnp.float32), q, *pos, *segs)
    assert seen == want  # dK/dV's (transposed) list first, then dQ's


# --------------------------------------------------------------------------- tile masks
@pytest.mark.parametrize("mask", [MaskSpec(causal=True), MaskSpec(window=(5, 3)),
                                  MaskSpec(causal=True, window=(7, 0)),
                                  MaskSpec(window=(2 ** 31 - 1, 2 ** 31 - 1)),
                                  MaskSpec(causal=True, window=(2 ** 31 - 1, 0))])
@pytest.mark.parametrize("q_axis", [0, 1])
def test_tile_visible_is_the_contract_mask(mask, q_axis):
    """The kernels' in-tile mask (shifted positions, or differences for window sides of
    2**30 and more) against the contract's, written directly: positions of a ring step
    far from 0, segment ids."""
    rng = np.random.default_rng(3)
    qp = (10_000 + np.arange(48)).astype(np.int32)
    kp = (9_980 + np.arange(40)).astype(np.int32)
    qs, ks = (np.sort(rng.integers(0, 3, n)).astype(np.int32) for n in (48, 40))
    shape = (48, 40) if q_axis == 0 else (40, 48)
    got = np.asarray(mgpu_common.tile_visible(mask, jnp.asarray(qp), jnp.asarray(kp),
                                              jnp.asarray(qs), jnp.asarray(ks), q_axis,
                                              shape))
    d = kp[None, :].astype(np.int64) - qp[:, None]
    want = qs[:, None] == ks[None, :]
    if mask.right_limit is not None:
        want &= d <= mask.right_limit
    if mask.left_limit is not None:
        want &= d >= -mask.left_limit
    np.testing.assert_array_equal(got, want if q_axis == 0 else want.T)


# --------------------------------------------------------------------------- index tiles
@pytest.mark.parametrize("T,rows,bk", [(512, 128, 128), (300, 128, 128), (640, 128, 64),
                                       (200, 256, 192), (1000, 128, 256)])
def test_causal_blocks_equal_the_tile_lists(T, rows, bk):
    """The key blocks an aligned causal CTA computes from its index (no tile list) are
    the tile list's, in the same order, with the same fully visible prefix, for every
    query block (padded rows and keys included), and the launch order is the lists'."""
    Lq, Lk = -(-T // rows) * rows, -(-T // bk) * bk
    nq, nk = Lq // rows, Lk // bk
    edge = lambda L: jnp.asarray(np.minimum(np.arange(L), T - 1), jnp.int32)  # noqa: E731
    tbl = np.asarray(tile_lists(MaskSpec(causal=True), edge(Lq)[None], edge(Lk), T, rows,
                                bk, False))
    for cta in range(nq):
        count, n_full = causal_blocks(cta, rows, bk, nk, T % bk != 0, lambda a, b: a // b,
                                      min)
        assert (count, n_full) == tuple(tbl[0, cta, :2])
        assert list(tbl[0, cta, 2:2 + count]) == list(range(count))
    # the kernel launches query block nq - 1 - j as its j-th: most tiles first, as the
    # lists' order does (ties may come in another order)
    launched = tbl[0, ::-1, 0]
    assert (np.diff(launched) <= 0).all()
    lists_order = np.asarray(cta_order(jnp.asarray(tbl)))[0]
    np.testing.assert_array_equal(launched, tbl[0, lists_order, 0])


def test_index_kind():
    """Which tiles take their masks and blocks from indices: only what the caller
    states (dense, aligned), without segment ids for the computed block ranges."""
    cfg = DEFAULT_MGPU_CONFIGS[128]
    causal, dense, window = MaskSpec(causal=True), MaskSpec(), MaskSpec(causal=True,
                                                                       window=(64, 0))
    assert index_kind(dense, TILE_DENSE, False, 256, 256, cfg) == "dense"
    assert index_kind(dense, TILE_DENSE, False, 128, 256, cfg) == "dense"
    assert index_kind(causal, TILE_ALIGNED, False, 256, 256, cfg) == "causal"
    assert index_kind(causal, TILE_ALIGNED, True, 256, 256, cfg) == "aligned"
    assert index_kind(window, TILE_ALIGNED, False, 256, 256, cfg) == "aligned"
    assert index_kind(causal, TILE_ALIGNED, False, 128, 256, cfg) is None  # not aligned
    assert index_kind(causal, TILE_GENERAL, False, 256, 256, cfg) is None
    assert index_kind(causal, TILE_DENSE, False, 256, 256, cfg) is None  # not dense
    assert index_kind(dense, TILE_DENSE, True, 128, 256, cfg) == "aligned"  # lists
    off = dataclasses.replace(cfg, index_tiles=False)
    assert index_kind(causal, TILE_ALIGNED, False, 256, 256, off) is None


@pytest.mark.parametrize("tile,causal,seg,lists", [
    (TILE_DENSE, False, False, False), (TILE_ALIGNED, True, False, False),
    (TILE_ALIGNED, True, True, True)])
def test_forward_lowers_on_stated_tiles(tile, causal, seg, lists):
    """Dense and aligned causal tiles lower without tile lists (no launch-order sort in
    the program); with segment ids the lists stay (masks still from indices)."""
    T, D = 300, 64
    q, kv = SDS((2, T, 4, D), BF16), SDS((2, T, 2, D), BF16)
    pos = [SDS((T,), jnp.int32)] * 2
    segs = [SDS((2, T), jnp.int32)] * 2 if seg else []
    txt = _lowered(lambda q, k, v, qp, kp, *s: mgpu_fwd(
        q, k, v, qp, kp, MaskSpec(causal=causal), 0.1, *s, config=DEFAULT_MGPU_CONFIGS[D],
        tile=tile), q, kv, kv, *pos, *segs)
    assert txt.count("mosaic_gpu") >= 1
    assert ("sort" in txt) == lists


def test_forward_ping_pong_on_named_barriers():
    """``named_sched``: the consumers hand the tensor cores to each other with
    ``bar.arrive`` / ``bar.sync`` on named barriers 4 and 5 (FA3's schedule), or meet on
    a shared-memory barrier; on a JAX without inline PTX the latter, always."""
    q = SDS((1, 512, 2, 128), BF16)
    pos = jnp.arange(512)
    texts = {}
    for named in (True, False):
        cfg = dataclasses.replace(DEFAULT_MGPU_CONFIGS[128], named_sched=named)
        texts[named] = _lowered(lambda q, k, v: mgpu_fwd(
            q, k, v, pos, pos, MaskSpec(causal=True), 0.1, config=cfg, tile=TILE_ALIGNED),
            q, q, q)
    if not mgpu_common.named_barriers_supported():
        assert "bar.arrive" not in texts[True]
        return
    for op in ("bar.arrive 4, 256", "bar.arrive 5, 256", "bar.sync 4, 256",
               "bar.sync 5, 256"):
        assert op in texts[True] and op not in texts[False]
    with pytest.raises(ValueError, match="op="):
        mgpu_common.named_barrier("wait", 4)


@pytest.mark.parametrize("tile,causal,seg,D", [
    (TILE_DENSE, False, False, 128), (TILE_ALIGNED, True, False, 64),
    (TILE_GENERAL, True, True, 128), (TILE_ALIGNED, True, True, 128)])
def test_forward_overlap_within_a_consumer(tile, causal, seg, D):
    """``overlap_fwd``: a step issues ``S`` and the previous ``P V`` and waits for all but
    the last group (``wait_group 1``); the default forward always waits for all.  Each
    issue is one ping-pong turn, so both named barriers are synced and arrived on.  The
    general tiles with segment ids are the ``_PACKED`` shapes (512 queries, 384 keys),
    whose two lowerings ``test_kernels_lower_for_cuda`` makes too (``_packed_fwd``);
    the other cases 384 of each."""
    T = 384
    q, kv = SDS((2, T, 4, D), BF16), SDS((2, T, 2, D), BF16)
    pos = [SDS((T,), jnp.int32)] * 2
    segs = [SDS((2, T), jnp.int32)] * 2 if seg else []
    texts = {}
    for ov in (False, True):
        cfg = dataclasses.replace(DEFAULT_MGPU_CONFIGS[D], overlap_fwd=ov)
        if (tile, causal, seg, D) == (TILE_GENERAL, True, True, 128):
            texts[ov] = _packed_fwd(cfg)
            continue
        texts[ov] = _lowered(lambda q, k, v, qp, kp, *s: mgpu_fwd(
            q, k, v, qp, kp, MaskSpec(causal=causal), 0.1, *s, config=cfg, tile=tile),
            q, kv, kv, *pos, *segs)
    wait_one = "wgmma.wait_group.sync.aligned 1;"
    assert wait_one not in texts[False]
    if not mgpu_common.named_barriers_supported():
        assert texts[True] == texts[False]  # no named barriers: the unpipelined forward
        return
    assert wait_one in texts[True]
    for op in ("bar.arrive 4, 256", "bar.arrive 5, 256", "bar.sync 4, 256",
               "bar.sync 5, 256"):
        assert op in texts[True]


@pytest.mark.parametrize("stages", [2, 4])
def test_forward_frees_ring_slots_on_named_barriers(stages):
    """``named_free``: the consumers arrive (256 threads) and the producer syncs (128)
    on one named barrier per ring slot and operand, above the ping-pong's two."""
    if not mgpu_common.named_barriers_supported():
        pytest.skip("this JAX has no inline PTX in Mosaic GPU kernels")
    q = SDS((1, 512, 2, 64), BF16)
    pos = jnp.arange(512)
    cfg = dataclasses.replace(DEFAULT_MGPU_CONFIGS[64], num_stages=stages, named_free=True)
    txt = _lowered(lambda q, k, v: mgpu_fwd(q, k, v, pos, pos, MaskSpec(causal=True), 0.1,
                                            config=cfg, tile=TILE_ALIGNED), q, q, q)
    ids = [mgpu_common.free_barrier(w, s, stages) for w in "kv" for s in range(stages)]
    assert sorted(ids) == list(range(6, 6 + 2 * stages))
    for i in ids:
        assert f"bar.arrive {i}, 384" in txt and f"bar.sync {i}, 384" in txt
    assert "bar.sync 4, 256" in txt  # the ping-pong's, unchanged
    # the backward's kernels keep their shared-memory barriers (RESULTS.md)
    lse = SDS((1, 2, 512), jnp.float32)
    for atomic in (False, True):
        bcfg = dataclasses.replace(cfg, atomic_dq=atomic, num_stages_bwd=stages)
        btxt = _lowered(lambda q, k, v, o, l, do: mgpu_bwd(
            q, k, v, o, l, do, pos, pos, MaskSpec(causal=True), 0.1, config=bcfg), q, q,
            q, q, lse, q)
        assert "bar.arrive" not in btxt
    with pytest.raises(ValueError, match="named barrier"):
        mgpu_common.free_barrier("v", 5, 6)


@pytest.mark.parametrize("named_free", [True, False])
def test_forward_with_one_producer_warp_lowers(named_free):
    """``warp_producer``: the K/V loads run in one warp of the producer warpgroup
    (``plgpu.warp_map``), and with ``named_free`` the slot barriers count 2 x 128 + 32."""
    q = SDS((1, 512, 2, 128), BF16)
    pos = jnp.arange(512)
    cfg = dataclasses.replace(DEFAULT_MGPU_CONFIGS[128], named_free=named_free,
                              warp_producer=True)
    txt = _lowered(lambda q, k, v: mgpu_fwd(q, k, v, pos, pos, MaskSpec(causal=True), 0.1,
                                            config=cfg), q, q, q)
    assert txt.count("mosaic_gpu") >= 1
    if named_free and mgpu_common.named_barriers_supported():
        i = mgpu_common.free_barrier("k", 0, cfg.num_stages)
        assert f"bar.arrive {i}, 288" in txt and f"bar.sync {i}, 288" in txt
        assert f"{i}, 384" not in txt


@pytest.mark.parametrize("layout,backward", [("zigzag", "q"), ("striped", "kv")])
def test_ring_with_the_kernel_lowers_for_cuda(layout, backward):
    """Inside a ring (shard_map, ppermute, custom_vjp) the kernel serves every tile."""
    mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,))
    q, kv = SDS((1, 1024, 4, 64), BF16), SDS((1, 1024, 2, 64), BF16)

    def loss(q, k, v):
        return jsp.attention(q, k, v, mesh=mesh, causal=True, layout=layout,
                             backward=backward, kernel=PallasMgpuKernel()
                             ).astype(jnp.float32).sum()
    txt = _lowered(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
    assert txt.count("mosaic_gpu") >= 3


def test_benchmark_variants_replace_fields_of_the_per_dim_default(monkeypatch):
    """``benchmarks/kernels.py --mgpu-variant NAME:field=value``: the comparison the
    atomic-dQ default was chosen by (RESULTS.md) keeps every other field per head dim."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import kernels as kb
    name, kern = kb.parse_mgpu_variant("two:atomic_dq=false,block_kv_dq=64")
    assert name == kern.name == "two"
    for D in (64, 128):
        assert kern.config_for(D) == dataclasses.replace(
            DEFAULT_MGPU_CONFIGS[D], atomic_dq=False, block_kv_dq=64)
    for bad in ("two:nope=1", "two", "two:block_q=x"):
        with pytest.raises(ValueError):
            kb.parse_mgpu_variant(bad)
    # a variant that no phase calls is refused, not silently left out of the run
    un = kb.unused_variants
    assert un(["two"], ["pair"], None, "tokamax_direct,pallas_mgpu") == ["two"]
    assert un(["two"], ["pair"], None, None) == ["two"]
    assert un(["two"], ["pair"], None, "pallas_mgpu,two") == []
    assert un(["two", "b"], ["check"], None, None) == []
    assert un(["two", "b"], ["check"], "pallas_mgpu,b", None) == ["two"]
    assert un(["two"], ["bench"], None, None) == []
    assert un(["two"], ["breakdown"], "two", "pallas_mgpu") == ["two"]
    # with the call's dtype and mask, the fields replace the tuned table's pick
    tuned = dataclasses.replace(DEFAULT_MGPU_CONFIGS[64], block_kv=256, num_stages=3)
    monkeypatch.setattr(PallasMgpuKernel, "config_for", lambda self, *a, **k: tuned)
    assert kern.config_for(64, "bfloat16", MaskSpec(), False, TILE_DENSE) == \
        dataclasses.replace(tuned, atomic_dq=False, block_kv_dq=64)


def test_benchmark_check_kernels_refuses_names_it_cannot_run():
    """``benchmarks/kernels.py --check-kernels``: a backend missing here (tokamax not
    installed, cuDNN off a GPU, a typo) stops the run with the names that exist, where
    it used to drop out of the check silently."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import kernels as kb
    avail = {"xla": "X", "pallas": "P", "flash_attn": "F", "tokamax_direct": None}
    assert kb.check_kernels_for(avail, None, on_gpu=False) == {"xla": "X", "pallas": "P"}
    assert kb.check_kernels_for(avail, None, on_gpu=True) == {"pallas": "P",
                                                              "flash_attn": "F"}
    assert list(kb.check_kernels_for(avail, "pallas,xla")) == ["pallas", "xla"]
    for bad, named in (("pallas,cudnn", "cudnn"), ("tokamax_direct", "tokamax_direct"),
                       ("palas", "palas")):
        with pytest.raises(ValueError, match=f"--check-kernels: {named} not available") \
                as e:
            kb.check_kernels_for(avail, bad)
        assert "available: flash_attn, pallas, xla" in str(e.value)


@pytest.mark.parametrize("seg", [False, True])
def test_fused_backward_early_dq_reduces_beside_dk(seg):
    """``early_dq``: the fused kernel issues its dQ half before dK and waits for the dQ
    products alone (``wgmma.wait_group 1``: dK still in flight) before each step's TMA
    reduce-add; without it the step waits for both products (``wait_group 0``).  On the
    ``_PACKED`` shapes, with and without segment ids: with them both configs are
    variants of ``test_backward_variant_lowers_on_packed_documents``, whose lowerings
    (``_packed_bwd``) this test reads."""
    last_wait = {}
    for early in (False, True):
        c = dataclasses.replace(DEFAULT_MGPU_CONFIGS[128], atomic_dq=True, split_dq=True,
                                row_scores=True, early_dq=early)
        text = _packed_bwd(c, seg)[1][-1]
        marks = re.findall(r"wgmma\.wait[._]group\.sync\.aligned (\d)|(cp\.reduce\.async\.bulk)",
                           text)
        waits = []  # the wgmma wait right before each reduce-add
        for i, (n, red) in enumerate(marks):
            if red:
                waits.append(next(m[0] for m in reversed(marks[:i]) if m[0]))
        assert len(waits) >= 2  # one step body per mask class at least
        last_wait[early] = set(waits)
    assert last_wait == {False: {"0"}, True: {"1"}}


@pytest.mark.parametrize("kw", [dict(atomic_dq=True, split_dq=True, row_scores=True),
                                dict(atomic_dq=False)])
def test_early_exit_ends_on_the_reads(kw):
    """``early_exit`` (the default): the key-stationary backward's CTAs end waiting for
    the reads of their dK/dV stores alone (``wait_group ... read``), not for the writes;
    off, for the writes.  On packed documents (``_packed_bwd``: the lowering with
    ``early_exit`` on is a variant of ``test_backward_variant_lowers_on_packed_documents``)."""
    assert DEFAULT_MGPU_CONFIGS[128].early_exit and DEFAULT_MGPU_CONFIGS[64].early_exit
    for on in (False, True):
        c = dataclasses.replace(DEFAULT_MGPU_CONFIGS[128], early_exit=on, **kw)
        modules = _packed_bwd(c)[1]
        dkdv = modules[-1] if kw["atomic_dq"] else modules[-2]  # (then the dQ kernel)
        # (" read" in the module's text; " {read}" with JAX 0.10's MLIR)
        last = re.findall(r"cp\.async\.bulk\.wait_group \d+( \{?read\}?)?", dkdv)[-1]
        assert bool(last) == on
