"""Bad inputs raise the documented error, and the message names the argument at fault."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import jax_seqpar as jsp
from helpers import make_mesh, make_qkv
from jax_seqpar.kernels import XlaKernel

B, S, H, D = 2, 16, 4, 16


@functools.lru_cache(maxsize=None)
def mesh4():
    return make_mesh(4)


@pytest.fixture
def qkv():
    return make_qkv(0, B=B, S=S, Hq=H, Hkv=2, D=D)


def call(q, k, v, **kw):
    kw.setdefault("mesh", mesh4())
    return jsp.attention(q, k, v, **kw)


def test_valid_call_does_not_raise(qkv):
    """Baseline: the arguments the other tests start from are accepted."""
    out = call(*qkv, causal=True, window=(2, 0),
               segment_ids=jnp.zeros((B, S), jnp.int32))
    assert out.shape == qkv[0].shape


# ---------------------------------------------------------------------- shapes, dtypes
#: "sequence length seq_len=18 must be divisible ..." (or "S=18"): names the sequence
#: length argument and its value.
SEQ_18 = r"(?i)(seq\w*|\bS)\s*=\s*18\b.*divisible"


def test_seq_not_divisible_by_devices():
    q, k, v = make_qkv(0, B=B, S=18, Hq=H, Hkv=2, D=D)
    with pytest.raises(ValueError, match=SEQ_18):
        call(q, k, v)


def test_seq_not_divisible_under_jit():
    q, k, v = make_qkv(0, B=B, S=18, Hq=H, Hkv=2, D=D)
    with pytest.raises(ValueError, match=SEQ_18):
        jax.jit(functools.partial(call, mesh=mesh4()))(q, k, v)


def test_seq_divisibility_counts_every_axis_of_a_tuple_axis_name():
    q, k, v = make_qkv(0, B=B, S=12, Hq=H, Hkv=2, D=D)  # 12 % 4 == 0, 12 % 8 != 0
    mesh = jax.make_mesh((2, 4), ("dp", "sp"), devices=jax.devices()[:8])
    with pytest.raises(ValueError, match=SEQ_18.replace("18", "12")):
        call(q, k, v, mesh=mesh, axis_name=("dp", "sp"))


def test_heads_not_multiple():
    q, k, v = make_qkv(0, B=B, S=S, Hq=4, Hkv=3, D=D)
    with pytest.raises(ValueError, match=r"Hq=4.*Hkv=3"):
        call(q, k, v)


def test_k_v_shape_mismatch(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"k\.shape.*v\.shape"):
        call(q, k, v[:, :, :1])


@pytest.mark.parametrize("which,bad", [("batch", (1, S, 2, D)), ("seq", (B, 8, 2, D)),
                                       ("head_dim", (B, S, 2, 8))])
def test_k_q_shape_mismatch(qkv, which, bad):
    q = qkv[0]
    k = v = jnp.ones(bad, q.dtype)
    with pytest.raises(ValueError, match=r"k/v shape"):
        call(q, k, v)


def test_dtype_mismatch(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match=r"q, k, v must share one dtype"):
        call(q, k.astype(jnp.bfloat16), v)
    with pytest.raises(TypeError, match=r"q, k, v must share one dtype"):
        call(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_integer_inputs(qkv, name):
    args = dict(zip("qkv", qkv))
    args[name] = args[name].astype(jnp.int32)
    with pytest.raises(TypeError, match=rf"{name}\.dtype=int32"):
        call(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("ndim", [3, 5])
def test_wrong_ndim(qkv, name, ndim):
    args = dict(zip("qkv", qkv))
    x = args[name]
    args[name] = x[..., 0] if ndim == 3 else x[..., None]
    with pytest.raises(ValueError, match=rf"{name} must have shape \[batch, seq, heads"):
        call(args["q"], args["k"], args["v"])


def test_not_an_array(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"q must have shape"):
        call(np.asarray(q).tolist(), k, v)


# ---------------------------------------------------------------------- segment ids
@pytest.mark.parametrize("shape", [(B, S - 1), (B,), (1, S), (B, S, 1)])
def test_segment_ids_wrong_shape(qkv, shape):
    with pytest.raises(ValueError, match=r"segment_ids must have shape"):
        call(*qkv, segment_ids=jnp.zeros(shape, jnp.int32))


def test_segment_ids_float(qkv):
    with pytest.raises(TypeError, match=r"segment_ids\.dtype=float32"):
        call(*qkv, segment_ids=jnp.zeros((B, S), jnp.float32))


# ---------------------------------------------------------------------- mask options
@pytest.mark.parametrize("window", [-1, (-1, 2), (3, -2)])
def test_window_negative(qkv, window):
    with pytest.raises(ValueError, match=r"window"):
        call(*qkv, window=window)


@pytest.mark.parametrize("window", [1.5, "ab", True, (1, 2, 3), (1.0, 2), (1, None), [1]])
def test_window_wrong_type(qkv, window):
    with pytest.raises(TypeError, match=r"window"):
        call(*qkv, window=window)


@pytest.mark.parametrize("causal", [1, "yes", None])
def test_causal_not_bool(qkv, causal):
    with pytest.raises(TypeError, match=r"causal"):
        call(*qkv, causal=causal)


@pytest.mark.parametrize("scale", ["0.1", jnp.float32(0.1), True])
def test_scale_wrong_type(qkv, scale):
    with pytest.raises(TypeError, match=r"scale"):
        call(*qkv, scale=scale)


def test_permuted_not_bool(qkv):
    with pytest.raises(TypeError, match=r"permuted"):
        call(*qkv, permuted=1)


# ---------------------------------------------------------------------- mesh, axis
@pytest.mark.parametrize("mesh", [None, "sp", 4, "device_list"])
def test_mesh_not_a_mesh(qkv, mesh):
    bad = jax.devices()[:4] if mesh == "device_list" else mesh
    with pytest.raises(TypeError, match=r"mesh must be a jax\.sharding\.Mesh"):
        call(*qkv, mesh=bad)


@pytest.mark.parametrize("axis_name", ["tp", ("sp", "tp")])
def test_axis_name_not_in_mesh(qkv, axis_name):
    with pytest.raises(ValueError, match=r"axis_name=.*'tp' is not an axis of the mesh"):
        call(*qkv, axis_name=axis_name)


# ---------------------------------------------------------------------- options
@pytest.mark.parametrize("arg,value,exc,pattern", [
    ("strategy", "rings", ValueError, r"unknown strategy='rings'"),
    ("backward", "dq", ValueError, r"unknown backward='dq'"),
    ("layout", "blocked", ValueError, r"unknown layout='blocked'"),
    ("kernel", "cuda", ValueError, r"unknown kernel='cuda'"),
    ("kernel", "flash_attn", NotImplementedError, r"kernel='flash_attn'"),  # float32 inputs
])
@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_bad_or_planned_options(qkv, arg, value, exc, pattern, strategy):
    kw = {"strategy": strategy, arg: value}
    with pytest.raises(exc, match=pattern):
        call(*qkv, **kw)


@pytest.mark.parametrize("backward", ["kv", "q", "auto"])
def test_every_backward_scheme_is_accepted(qkv, backward):
    out = call(*qkv, strategy="ring", backward=backward, causal=True)
    assert out.shape == qkv[0].shape


@pytest.mark.parametrize("kernel", [3, None, object()], ids=["int", "None", "object"])
def test_kernel_not_a_name_nor_a_kernel(qkv, kernel):
    """A non-string ``kernel`` must be a kernel object; anything else is rejected by name."""
    with pytest.raises(TypeError, match=r"kernel"):
        call(*qkv, kernel=kernel)


@pytest.mark.parametrize("field", ["block_q", "block_k"])
@pytest.mark.parametrize("value", [0, -3, 2.0, None])
def test_xla_kernel_bad_block(field, value):
    with pytest.raises(ValueError, match=field):
        XlaKernel(**{field: value})


# ------------------------------------------------------------- issue 15: empty / ragged
def test_zero_length_sequences_are_refused_clearly():
    mesh = helpers.make_mesh(2)
    empty = jnp.ones((1, 0, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match=r"q.shape=\(1, 0, 2, 16\) has seq=0"):
        jsp.attention(empty, empty, empty, mesh=mesh)
    q = helpers.make_qkv(1, B=1, S=2, Hq=2, Hkv=2, D=16)[0][:, :1]
    with pytest.raises(ValueError, match="k_cache.shape=.* has seq=0"):
        jsp.tree_decode(q, empty, empty, mesh=mesh)


@pytest.mark.parametrize("lengths,bad", [([3, 9], [1]), ([-1, 4], [0])])
def test_kv_lengths_outside_the_cache_are_refused(lengths, bad):
    mesh = helpers.make_mesh(2)
    q, k, v = helpers.make_qkv(2, B=2, S=8, Hq=2, Hkv=2, D=16)
    with pytest.raises(ValueError, match=rf"kv_lengths=.* must lie in \[0, 8\].*{bad}"):
        jsp.tree_decode(q[:, :1], k, v, mesh=mesh, kv_lengths=jnp.array(lengths))


def test_traced_kv_lengths_are_clamped_to_the_cache():
    """Under jit the lengths cannot be checked: they are clamped into [0, S]."""
    mesh = helpers.make_mesh(2)
    q, k, v = helpers.make_qkv(3, B=2, S=8, Hq=2, Hkv=2, D=16)
    run = jax.jit(lambda L: jsp.tree_decode(q[:, :1], k, v, mesh=mesh, kv_lengths=L))
    out = run(jnp.array([-3, 12]))
    ref = jsp.tree_decode(q[:, :1], k, v, mesh=mesh, kv_lengths=jnp.array([0, 8]))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    assert np.abs(np.asarray(out[1])).sum() > 0 and not np.asarray(out[0]).any()
