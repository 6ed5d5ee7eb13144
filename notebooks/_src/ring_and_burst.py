# %% [markdown]
# # Ring attention and the BurstAttention backward
#
# Sequence parallelism for *training*: $S$ tokens are split over $G$ devices ($T = S/G$ each), every
# device keeps its queries, and blocks circulate around a ring of devices until every query has met
# every key. This notebook derives the pieces `jax_seqpar`'s ring is built from and checks each one
# numerically, against plain JAX and against the library itself:
#
# 1. the online-softmax **merge** of partial results $(o, \operatorname{lse})$, as
#    `jax_seqpar/parallel/merge.py` does it, and why it is safe for fully masked rows;
# 2. the attention **backward** $dS = P\circ(dP - D)$, $D = \operatorname{rowsum}(dO\circ O)$
#    (BurstEngine Eq. 7-8), and why it lets the ring carry $Q, dQ, dO, D, \operatorname{lse}$ instead of
#    $K, V, dK, dV$ (BurstAttention Alg. 2): $3Nd + 2N$ instead of $4Nd$ elements, and what grouped-query
#    attention does to that, checked against the bytes in the compiled program;
# 3. the **chunk-size rule** $C \ge F/B$ (communication hidden when one step's compute outlasts
#    its transfer), evaluated with the H200 measurements in `benchmarks/RESULTS.md`;
# 4. **causal load balance**: the work per device of the contiguous, zigzag and striped layouts.
#
# Papers: BurstEngine (Sun et al., §3.1 Eq. 4-8, Alg. 1-2; §3.4 Eq. 11-13), BurstAttention
# (Sun et al.), DistFlashAttn (Li et al., §3.2), and notes on Ring Attention (chunk size).
# Eight CPU devices are simulated; the flag must be set before JAX is imported.

# %%
import os

_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import inspect
import json
from fractions import Fraction
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
from matplotlib.patches import Patch
import numpy as np

jax.config.update("jax_enable_x64", True)  # derivations in float64; library calls in float32

import jax_seqpar as jsp
from jax_seqpar import layouts
from jax_seqpar.runtime.comm import collective_bytes
from jax_seqpar.kernels.xla import XlaKernel, attention_delta
from jax_seqpar.masks import MaskSpec
from jax_seqpar.parallel import costs
from jax_seqpar.parallel.merge import merge
from jax_seqpar.parallel.schedule import tile_counts

plt.rcParams.update({"figure.dpi": 80, "savefig.dpi": 80, "font.size": 9})
assert jax.device_count() >= 8, "set XLA_FLAGS before jax is imported (restart the kernel)"
print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices")

rng = np.random.default_rng(0)
F32 = jnp.float32


def rel_err(a, b):
    """Norm-wise relative error ||a - b|| / ||b||, computed in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm((a - b).ravel()) / np.linalg.norm(b.ravel()))


def normal(*shape, dtype=jnp.float64):
    return jnp.asarray(rng.normal(size=shape), dtype)

# %% [markdown]
# ## 1. The online-softmax merge
#
# Let $(o_A, \ell_A)$ be attention of one query over a key set $A$: $\ell_A = \log\sum_{a\in A} e^{s_a}$
# and $o_A = \sum_{a\in A} e^{s_a - \ell_A} v_a$. For a disjoint set $B$ the normalisers add,
# $e^{\ell} = e^{\ell_A} + e^{\ell_B}$, and the outputs mix in proportion to them:
#
# $$\ell = \log\left(e^{\ell_A} + e^{\ell_B}\right),\qquad o = e^{\ell_A - \ell}\, o_A + e^{\ell_B - \ell}\, o_B .$$
#
# This is how a ring device folds in the key block it just received (BurstAttention Alg. 1; the
# Ring Attention / blockwise transformer update). `merge.py` evaluates it with two guards:
#
# * it shifts by $m = \max(\ell_A, \ell_B)$ before exponentiating (safe softmax), so the weights are
#   $w = e^{\ell - m} \le 1$ and never overflow;
# * a row that sees **no** key in a block has $\ell = -\infty$, $o = 0$. If both sides are empty the
#   textbook formula computes $e^{-\infty - (-\infty)}$ = NaN. `merge` replaces the shift by 0 when
#   $m = -\infty$ and divides by 1 when the total weight is 0, so the result is $o = 0$,
#   $\ell = -\infty$ again: $(0, -\infty)$ is an exact identity element, which is also how every ring
#   accumulator starts. Both guards are `jnp.where`s on *safe* operands, so gradients stay finite too.
#
# Empty rows are common: with a causal mask an early query sees nothing in a late block, sliding
# windows and packed documents empty whole blocks, and a padded cache row (`kv_lengths = 0`) is empty
# everywhere. The library's function:

# %%
print(inspect.getsource(merge))

# %% [markdown]
# Check: split the keys of a causal attention into $G = 8$ blocks, compute each block's partial
# $(o_j, \ell_j)$ with the library's dense oracle (`reference_attention`, with global positions so that
# the causal mask is right), and fold them in the order a ring device meets them (its own block, then
# $i-1, i-2, \dots$), in reverse, and as a tree. Every order gives full attention. Then the empty rows.

# %%
B, S, H, D, G = 2, 64, 3, 8, 8
T = S // G
q, k, v = normal(B, S, H, D, dtype=F32), normal(B, S, H, D, dtype=F32), normal(B, S, H, D, dtype=F32)
pos = jnp.arange(S, dtype=jnp.int32)
o_full, lse_full = jsp.reference_attention(q, k, v, causal=True)


def partial(j):
    """(o, lse) of all queries over key block j only."""
    sl = slice(j * T, (j + 1) * T)
    return jsp.reference_attention(q, k[:, sl], v[:, sl], causal=True, q_pos=pos, kv_pos=pos[sl])


parts = [partial(j) for j in range(G)]
identity = (jnp.zeros_like(o_full), jnp.full_like(lse_full, -jnp.inf))


def fold(order, start=identity):
    acc = start
    for j in order:
        acc = merge(*acc, *parts[j])
    return acc


def tree_fold(items):
    while len(items) > 1:
        items = [merge(*items[i], *items[i + 1]) for i in range(0, len(items), 2)]
    return items[0]


for i in range(G):  # device i meets block i, then i-1, i-2, ... (mod G)
    o_i, lse_i = fold([(i - s) % G for s in range(G)])
    assert rel_err(o_i, o_full) < 1e-6 and rel_err(lse_i, lse_full) < 1e-6
o_r, lse_r = fold(reversed(range(G)))
o_t, lse_t = tree_fold(list(parts))
assert rel_err(o_r, o_full) < 1e-6 and rel_err(o_t, o_full) < 1e-6 and rel_err(lse_t, lse_full) < 1e-6

# Empty rows.  Queries 0..T-1 see nothing in blocks 1..G-1 (they come later in the sequence).
o_late, lse_late = parts[G - 1]
assert bool(jnp.isneginf(lse_late[:, :, :T]).all()) and float(jnp.abs(o_late[:, :T]).max()) == 0


def merge_textbook(o_a, lse_a, o_b, lse_b):
    lse = jnp.logaddexp(lse_a, lse_b)
    w_a = jnp.swapaxes(jnp.exp(lse_a - lse), 1, 2)[..., None]
    w_b = jnp.swapaxes(jnp.exp(lse_b - lse), 1, 2)[..., None]
    return w_a * o_a + w_b * o_b, lse


o_bad, _ = merge_textbook(*identity, o_late, lse_late)       # the accumulator meets an empty block
o_ok, lse_ok = merge(*identity, o_late, lse_late)
assert bool(jnp.isnan(o_bad[:, :T]).all())                        # textbook: NaN in the empty rows
assert not bool(jnp.isnan(o_ok).any()) and float(jnp.abs(o_ok[:, :T]).max()) == 0
assert bool(jnp.isneginf(lse_ok[:, :, :T]).all())
# (0, -inf) is an exact identity: merging it in changes no bit
for o_j, lse_j in parts:
    o_m, lse_m = merge(o_j, lse_j, *identity)
    assert bool((o_m == o_j).all()) and bool((lse_m == lse_j).all())
# and the gradient through merge stays finite on empty rows
grads = jax.grad(lambda o_a, l_a: merge(o_a, l_a, o_late, lse_late)[0].sum(), argnums=(0, 1))(*identity)
assert all(bool(jnp.isfinite(x).all()) for x in grads)
print(f"{G} blocks folded in ring, reverse and tree order == full causal attention; "
      f"textbook merge NaN rows: {int(jnp.isnan(o_bad).any(axis=(2, 3)).sum())}, library: 0")

# %% [markdown]
# ## 2. The attention backward, and what has to travel
#
# Forward, per head: $S = \sigma QK^\top$ (masked entries $-\infty$, $\sigma = 1/\sqrt{d}$),
# $\ell = \operatorname{rowlogsumexp}(S)$, $P = e^{S - \ell}$, $O = PV$. Given $dO$:
#
# $$dV = P^\top dO,\qquad dP = dO\,V^\top,\qquad dQ = \sigma\, dS\,K,\qquad dK = \sigma\, dS^\top Q,$$
#
# and the softmax Jacobian gives, row by row (BurstEngine Eq. 7),
#
# $$dS_{i} = P_{i}\circ dP_{i} - P_{i}\,(P_{i}\cdot dP_{i}),\qquad
#   P_{i}\cdot dP_{i} = \sum_j P_{ij} \sum_c dO_{ic} V_{jc} = \sum_c dO_{ic} O_{ic},$$
#
# so with $D = \operatorname{rowsum}(dO\circ O)$, one number per query row (Eq. 8),
#
# $$dS = P\circ(dP - D).$$
#
# Checked in float64 against `jax.vjp`, with a causal mask; the library's local kernel (`xla`, float32)
# computes the same gradients from the saved $\ell$ and $D$.

# %%
B, S, H, D = 1, 48, 2, 8
sigma = D ** -0.5
Q, K, V, dO = (normal(B, S, H, D) for _ in range(4))
visible = jnp.tril(jnp.ones((S, S), bool))


def attention64(Q, K, V):
    s = jnp.where(visible, sigma * jnp.einsum("bihd,bjhd->bhij", Q, K), -jnp.inf)
    return jnp.einsum("bhij,bjhd->bihd", jax.nn.softmax(s, axis=-1), V)


O, vjp = jax.vjp(attention64, Q, K, V)
dQ_ref, dK_ref, dV_ref = vjp(dO)

s = jnp.where(visible, sigma * jnp.einsum("bihd,bjhd->bhij", Q, K), -jnp.inf)
lse = jax.nn.logsumexp(s, axis=-1)                              # [B, H, S], saved by the forward
P = jnp.exp(s - lse[..., None])
dP = jnp.einsum("bihd,bjhd->bhij", dO, V)
Dr = jnp.einsum("bihd,bihd->bhi", dO, O)                        # D = rowsum(dO o O)
assert rel_err(Dr, (P * dP).sum(-1)) < 1e-13                    # Eq. 7: P_i . dP_i == rowsum(dO o O)_i
dS = P * (dP - Dr[..., None])                                   # Eq. 8
dQ = sigma * jnp.einsum("bhij,bjhd->bihd", dS, K)
dK = sigma * jnp.einsum("bhij,bihd->bjhd", dS, Q)
dV = jnp.einsum("bhij,bihd->bjhd", P, dO)
for name, mine, ref in (("dQ", dQ, dQ_ref), ("dK", dK, dK_ref), ("dV", dV, dV_ref)):
    assert rel_err(mine, ref) < 1e-13, (name, rel_err(mine, ref))

# the library: attention_delta is D; the xla kernel's backward from (lse, D) gives the gradients
f32 = lambda x: x.astype(F32)  # noqa: E731
assert rel_err(attention_delta(f32(O), f32(dO)), Dr) < 1e-6
kernel = XlaKernel(block_q=16, block_k=16)
posS = jnp.arange(S, dtype=jnp.int32)
grads32 = kernel.bwd(f32(Q), f32(K), f32(V), None, f32(lse), f32(dO), posS, posS,
                     MaskSpec(causal=True), sigma, delta=f32(Dr))
for mine, ref in zip(grads32, (dQ_ref, dK_ref, dV_ref)):
    assert rel_err(mine, ref) < 1e-5
print("dS = P o (dP - D) reproduces jax.vjp:",
      ", ".join(f"{n} {rel_err(a, b):.0e}" for n, a, b in zip(("dQ", "dK", "dV"), (dQ, dK, dV),
                                                             (dQ_ref, dK_ref, dV_ref))))

# %% [markdown]
# ### Which side travels
#
# Cut the queries and the keys into $G$ blocks. The pair (query block $i$, key block $j$) contributes
#
# $$P_{ij} = e^{S_{ij} - \ell_i},\quad dS_{ij} = P_{ij}\circ(dO_i V_j^\top - D_i),\qquad
#   dQ_i \mathrel{+}= \sigma\, dS_{ij} K_j,\quad dK_j \mathrel{+}= \sigma\, dS_{ij}^\top Q_i,\quad dV_j \mathrel{+}= P_{ij}^\top dO_i .$$
#
# Everything it needs is either on the **query side** ($Q_i, dO_i, \ell_i, D_i$, accumulating $dQ_i$) or
# on the **key side** ($K_j, V_j$, accumulating $dK_j, dV_j$), and nothing else: thanks to Eq. 8 the
# output $O_i$ (a $d$-vector per row) enters only through $D_i$ (one number per row), and $\ell_i$
# rebuilds $P_{ij}$ without the other blocks' scores. So either side can stay put while the other
# circulates:
#
# * Ring Attention's backward (BurstEngine Alg. 1, `backward="kv"`) circulates $K, V$ and the
#   accumulators $dK, dV$: $4$ vectors of size $d$ per token;
# * BurstAttention's (Alg. 2, `backward="q"`) circulates $Q, dO$, the accumulator $dQ$ and the two row
#   statistics $D, \ell$: $3$ vectors of size $d$ and 2 scalars per token, i.e. $3Nd + 2N$ against $4Nd$.
#
# Below, both schedules are simulated on $G = 4$ blocks in float64, exactly as the library moves
# data: a travelling block makes $G - 1$ hops; its gradient accumulator is born at the first device it
# visits (the home device keeps its own contribution), rides along for $G - 2$ hops and then takes one
# hop home. Both reproduce `jax.vjp`, and the elements each device sends are counted.

# %%
Gs = 4
Tb = S // Gs
blk = lambda x, i: x[:, i * Tb:(i + 1) * Tb]           # noqa: E731  token block i of [B, S, H, D]
rblk = lambda x, i: x[..., i * Tb:(i + 1) * Tb]        # noqa: E731  row block i of [B, H, S]


def pair(i, j):
    """Contributions of (query block i, key block j): dQ_i, dK_j, dV_j."""
    s = sigma * jnp.einsum("bihd,bjhd->bhij", blk(Q, i), blk(K, j))
    s = jnp.where(visible[i * Tb:(i + 1) * Tb, j * Tb:(j + 1) * Tb], s, -jnp.inf)
    p = jnp.exp(s - rblk(lse, i)[..., None])
    ds = p * (jnp.einsum("bihd,bjhd->bhij", blk(dO, i), blk(V, j)) - rblk(Dr, i)[..., None])
    return (sigma * jnp.einsum("bhij,bjhd->bihd", ds, blk(K, j)),
            sigma * jnp.einsum("bhij,bihd->bjhd", ds, blk(Q, i)),
            jnp.einsum("bhij,bihd->bjhd", p, blk(dO, i)))


def ring_backward(scheme):
    """Simulate the ring; returns (dQ, dK, dV) and the elements each device sends."""
    dq = [0.0] * Gs
    dk = [0.0] * Gs
    dv = [0.0] * Gs
    sent = np.zeros(Gs, np.int64)
    travelling = {"kv": lambda j: (blk(K, j), blk(V, j)),
                  "q": lambda j: (blk(Q, j), blk(dO, j), rblk(Dr, j), rblk(lse, j))}[scheme]
    acc = {}  # block -> accumulator riding with it: (dK, dV) for "kv", dQ for "q"
    for step in range(Gs):
        for dev in range(Gs):
            j = (dev - step) % Gs                # the travelling block device dev holds now
            if scheme == "kv":                   # queries of dev stay; key block j visits
                gq, gk, gv = pair(dev, j)
                dq[dev] = dq[dev] + gq
                if step == 0:
                    dk[j], dv[j] = dk[j] + gk, dv[j] + gv      # home: kept locally
                else:
                    a = acc.get(j, (0.0, 0.0))                  # born at the first visit
                    acc[j] = (a[0] + gk, a[1] + gv)
            else:                                # keys of dev stay; query block j visits
                gq, gk, gv = pair(j, dev)
                dk[dev], dv[dev] = dk[dev] + gk, dv[dev] + gv
                if step == 0:
                    dq[j] = dq[j] + gq
                else:
                    acc[j] = acc.get(j, 0.0) + gq
        if step < Gs - 1:                        # every device forwards what it holds
            for dev in range(Gs):
                j = (dev - step) % Gs
                sent[dev] += sum(x.size for x in travelling(j))
                if step > 0:                     # an accumulator exists from the first visit on
                    sent[dev] += sum(x.size for x in jax.tree.leaves(acc[j]))
    for j in range(Gs):                          # last holder (device j - 1) sends it home
        sent[(j - 1) % Gs] += sum(x.size for x in jax.tree.leaves(acc[j]))
        if scheme == "kv":
            dk[j], dv[j] = dk[j] + acc[j][0], dv[j] + acc[j][1]
        else:
            dq[j] = dq[j] + acc[j]
    cat = lambda xs: jnp.concatenate(xs, axis=1)  # noqa: E731
    return (cat(dq), cat(dk), cat(dv)), sent


for scheme in ("kv", "q"):
    grads, sent = ring_backward(scheme)
    for mine, ref in zip(grads, (dQ_ref, dK_ref, dV_ref)):
        assert rel_err(mine, ref) < 1e-13, scheme
    per_token_head = {"kv": 4 * D, "q": 3 * D + 2}[scheme]   # 4d  vs  3d + 2
    assert (sent == (Gs - 1) * B * Tb * H * per_token_head).all(), (scheme, sent)
    print(f"backward={scheme!r}: gradients == jax.vjp; elements sent per device {sent.tolist()} "
          f"= (G-1) * T * H * {per_token_head}")

# %% [markdown]
# ### The library on 8 devices: gradients and bytes
#
# Now `jsp.attention` on 8 simulated devices, causal, float32, with each backward, for multi-head
# attention ($H_q = H_{kv}$) and grouped-query attention (group $g = H_q/H_{kv} = 4$). The gradients
# are compared with `jax.nn.dot_product_attention`; the bytes each device sends are read from the
# compiled program (`jax_seqpar.runtime.comm.collective_bytes`: forward plus backward) and must equal
# `costs.forward_bytes + costs.backward_bytes`. In float32 the simulation's counts become exact byte
# formulas: per device, with $T = S/G$,
#
# $$\text{kv: } 4\,(G-1)\,T\,H_{kv}\,d \times 4\text{ B},\qquad \text{q: } (G-1)\,T\,H_q\,(3d + 2)\times 4\text{ B},$$
#
# which is the paper's $4Nd$ vs $3Nd + 2N$ (per head) with $N = (G-1)\,T$: the paper counts $G$ ring
# steps, the library skips the one that would bring a block back to where it started. The key side
# has $H_{kv}$ heads, the query side $H_q$: with GQA the KV scheme's traffic shrinks by $g$ and the Burst
# scheme's does not.

# %%
G = 8
mesh = jax.make_mesh((G,), ("sp",))
B, S, D = 1, 256, 16
T = S // G


def make_step(backward):
    """Jitted forward + backward of causal ring attention with the given backward scheme."""
    def fwd_bwd(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: jsp.attention(q, k, v, mesh=mesh, causal=True,
                                                         backward=backward), q, k, v)
        return out, vjp(do)
    return jax.jit(fwd_bwd)


results = {}
for Hq, Hkv in ((4, 4), (4, 1)):
    q, do = normal(B, S, Hq, D, dtype=F32), normal(B, S, Hq, D, dtype=F32)
    k, v = normal(B, S, Hkv, D, dtype=F32), normal(B, S, Hkv, D, dtype=F32)
    out_ref, vjp_ref = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                               q, k, v)
    grads_ref = vjp_ref(do)
    shape = costs.RingShape(num_devices=G, batch=B, tokens=T, q_heads=Hq, kv_heads=Hkv,
                            head_dim=D, itemsize=4)
    for backward in ("kv", "q"):
        step = make_step(backward)
        out, grads = step(q, k, v, do)
        assert rel_err(out, out_ref) < 1e-5
        for name, gr, ref in zip(("dq", "dk", "dv"), grads, grads_ref):
            assert rel_err(gr, ref) < 1e-5, (Hq, Hkv, backward, name, rel_err(gr, ref))
        report = collective_bytes(step, q, k, v, do)        # reuses the compiled program
        fwd_b, bwd_b = costs.forward_bytes(shape), costs.backward_bytes(backward, shape)
        assert set(report.bytes_by_kind()) == {"collective-permute"}
        assert report.total_bytes == fwd_b + bwd_b, (report.total_bytes, fwd_b, bwd_b)
        assert fwd_b == (G - 1) * 2 * B * T * Hkv * D * 4                          # K, V: G-1 hops
        closed = {"kv": 4 * (G - 1) * B * T * Hkv * D * 4, "q": (G - 1) * B * T * Hq * (3 * D + 2) * 4}
        assert bwd_b == closed[backward]
        results[(Hq, Hkv, backward)] = bwd_b
    choice = costs.choose_backward(shape)
    assert choice.scheme == ("q" if Hq == Hkv else "kv")          # "auto" takes the smaller volume
    print(f"Hq={Hq} Hkv={Hkv}: backward bytes per device kv {results[(Hq, Hkv, 'kv')]:,} "
          f"q {results[(Hq, Hkv, 'q')]:,} -> auto picks {choice.scheme!r}")
assert Fraction(results[(4, 4, "q")], results[(4, 4, "kv")]) == Fraction(3 * D + 2, 4 * D)

# %% [markdown]
# The same accounting at a realistic size, from `costs.backward_bytes` (bfloat16 inputs, float32
# accumulators and row statistics; $H_q = 32$, $d = 128$, $S$ = 128k tokens). Left: the volume per device
# against the GQA group: the KV scheme shrinks with $g$, so `backward="auto"` switches to it for
# $g \ge 2$. Right: the Burst/KV ratio for multi-head attention against the number of devices. In
# float32 it is exactly $(3d+2)/4d \approx 0.75$. In bfloat16 the Burst scheme gains more from $G = 3$ on,
# because $Q$ and $dO$ travel in bfloat16 while the KV scheme's two accumulators $dK, dV$ ride in float32
# (at $G = 2$ the only accumulator hop is the one home, in bfloat16, and the float32 row statistics
# $D, \ell$ put the ratio slightly above 0.75). The dots are the bytes measured on 4 H200s
# (`benchmarks/results/backward_comm_gpu.json`; the same formula at other sizes gives the same ratios).

# %%
REPO = Path(jsp.__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
if not (RESULTS / "backward_comm_gpu.json").exists():
    raise FileNotFoundError(f"{RESULTS} not found: run the notebook from a source checkout "
                            f"(pip install -e .), where benchmarks/results/ sits next to jax_seqpar/")
gpu_comm = json.loads((RESULTS / "backward_comm_gpu.json").read_text())

Hq_big, D_big, S_big = 32, 128, 128 * 1024
groups = [1, 2, 4, 8, 16, 32]
fig, axes = plt.subplots(1, 2, figsize=(10, 3.0))
for G_, style in ((8, "-"), (64, "--")):
    vol = {sch: [] for sch in ("kv", "q")}
    for g_ in groups:
        sh = costs.RingShape(G_, 1, S_big // G_, Hq_big, Hq_big // g_, D_big, 2)
        for sch in vol:
            vol[sch].append(costs.backward_bytes(sch, sh))
        assert costs.choose_backward(sh).scheme == ("q" if g_ == 1 else "kv")
    axes[0].plot(groups, np.array(vol["kv"]) / 1e9, "C0" + style + "o", ms=3, label=f"kv, G={G_}")
    axes[0].plot(groups, np.array(vol["q"]) / 1e9, "C3" + style + "o", ms=3, label=f"q (Burst), G={G_}")
axes[0].set(xscale="log", yscale="log", xlabel="GQA group g = Hq / Hkv", ylabel="GB sent per device",
            title="backward traffic, S = 128k, Hq = 32, d = 128, bf16")
axes[0].minorticks_off()
axes[0].set_xticks(groups, [str(x) for x in groups])
axes[0].set_yticks([0.2, 0.5, 1, 2, 5], ["0.2", "0.5", "1", "2", "5"])
axes[0].legend(fontsize=7)

devices = [2, 4, 8, 16, 32, 64]
for itemsize, label in ((4, "float32"), (2, "bfloat16")):
    ratio = [costs.backward_bytes("q", costs.RingShape(G_, 1, 1024, 16, 16, D_big, itemsize))
             / costs.backward_bytes("kv", costs.RingShape(G_, 1, 1024, 16, 16, D_big, itemsize))
             for G_ in devices]
    axes[1].plot(devices, ratio, "o-", ms=3, label=label)
    if itemsize == 4:
        assert np.allclose(ratio, (3 * D_big + 2) / (4 * D_big), rtol=0, atol=1e-12)
    else:
        # from G = 3 on the accumulators make float32 hops, which only the KV scheme pays twice
        assert all(r < (3 * D_big + 2) / (4 * D_big) for G_, r in zip(devices, ratio) if G_ >= 3)
measured = {}
for row in gpu_comm["rows"]:
    if row["q_heads"] == row["kv_heads"] and row["scheme"] in ("kv", "q"):
        measured.setdefault((row["devices"], row["seq"]), {})[row["scheme"]] = row["bytes_per_device"]
pts = sorted({(G_, m["q"] / m["kv"]) for (G_, _), m in measured.items()})
axes[1].plot([p[0] for p in pts], [p[1] for p in pts], "k.", ms=9, label="measured, 4 x H200 (bf16)")
axes[1].set(xscale="log", xlabel="devices G", ylabel="bytes q / bytes kv",
            title="Burst vs KV backward, multi-head", ylim=(0.6, 0.8))
axes[1].minorticks_off()
axes[1].set_xticks(devices, [str(x) for x in devices])
axes[1].legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 3. When is the transfer hidden? The chunk-size rule
#
# A ring step computes on the block in hand while the next one is in flight, so communication costs
# nothing as long as a step's compute takes longer than its transfer. For the forward with chunks of
# $C$ tokens per device and hidden size $d$ (notes on Ring Attention, "Chunk Size"): the step computes
# $QK^\top$ and $PV$, $4dC^2$ FLOPs, and receives $K$ and $V$, $2\cdot 2\cdot Cd$ bytes in bfloat16. On a
# device with $F$ FLOP/s and a link of $B$ bytes/s,
#
# $$\frac{4dC}{B} \le \frac{4dC^2}{F} \iff C \ge \frac{F}{B}.$$
#
# The head dimension cancels; $C^\star = F/B$ is a property of the hardware (and of the kernel, through
# the $F$ it reaches). The same argument for the backward, which computes about $2.5\times$ the forward
# FLOPs per step (5 matmuls instead of 2), with the per-hop bytes of each scheme from `costs`, gives each
# scheme's threshold; with GQA the KV scheme's bytes shrink by $g$ while the FLOPs do not.
#
# **H200 numbers** (`benchmarks/RESULTS.md`, 4 H200s of one host, bf16, $d = 16\times128$): `ppermute` moved
# $B \approx 124$ GB/s per device; the current pure-XLA local kernel reaches $F \approx 140$ TFLOP/s in the
# backward (recomputed below from each measured row); the H200's bf16 matmul rate is about
# 790 TFLOP/s. The benchmark's chunk is $C = S/G$.

# %%
LINK_BYTES_PER_S = 124e9     # RESULTS.md: ppermute bandwidth measured on the 4 x H200 host
PEAK_FLOP_PER_S = 790e12     # RESULTS.md: the H200's bf16 matmul rate


def step_flops(C, Hq, D, backward=True):
    """FLOPs of one ring step on C query x C key tokens: 4 C^2 d forward, 2.5x that backward."""
    return (2.5 if backward else 1.0) * 4 * C * C * Hq * D


def hop_bytes(scheme, C, Hq, Hkv, D, G, itemsize=2):
    """Bytes one device sends per ring hop (the library's exact volume over its G - 1 hops)."""
    shape = costs.RingShape(G, 1, C, Hq, Hkv, D, itemsize)
    total = costs.forward_bytes(shape) if scheme == "fwd" else costs.backward_bytes(scheme, shape)
    return total / (G - 1)


def chunk_threshold(scheme, F, Bw, Hq, Hkv, D, G):
    """C* where compute time == transfer time: bytes and FLOPs per step are ~C and ~C^2."""
    return F * hop_bytes(scheme, 1, Hq, Hkv, D, G) / (Bw * step_flops(1, Hq, D, scheme != "fwd"))


# the notes' rule, recovered from the library's byte counts: forward C* = F / B exactly
for Hd in (64, 128):
    assert np.isclose(chunk_threshold("fwd", 1.0, 1.0, 16, 16, Hd, 4), 1.0)
    assert np.isclose(chunk_threshold("fwd", 1.0, 1.0, 16, 4, Hd, 4), 1 / 4)   # GQA g = 4: F / (g B)

rows = gpu_comm["rows"]
by_key = {(r["devices"], r["seq"], r["kv_heads"], r["scheme"]): r for r in rows}
table = []
for r in rows:
    Gr, Sr, Hq_, Hkv_, Dr_ = r["devices"], r["seq"], r["q_heads"], r["kv_heads"], r["head_dim"]
    C = Sr // Gr
    shape = costs.RingShape(Gr, 1, C, Hq_, Hkv_, Dr_, 2)
    assert r["bytes_per_device"] == r["formula_bytes"] == costs.backward_bytes(r["resolved"], shape)
    F_row = Gr * step_flops(C, Hq_, Dr_) / r["time_s"]                 # achieved FLOP/s
    c_star = chunk_threshold(r["resolved"], F_row, LINK_BYTES_PER_S, Hq_, Hkv_, Dr_, Gr)
    t_ratio = r["time_s"] / by_key[(Gr, Sr, Hkv_, "kv")]["time_s"]
    table.append((Gr, Sr, Hq_, Hkv_, r["scheme"], r["resolved"], C, F_row, c_star, t_ratio))

# Prediction: where C >= 10 C* for both schemes (transfer < 10% of a step even if not overlapped),
# the scheme that sends fewer bytes cannot be faster by more than noise.
checked = 0
for Gr, Sr, Hq_, Hkv_, scheme, resolved, C, F_row, c_star, t_ratio in table:
    c_star_both = max(c for (G2, S2, _, H2, sch, *_x, c, _r) in table
                      if (G2, S2, H2) == (Gr, Sr, Hkv_) and sch in ("kv", "q"))
    if scheme == "q" and C >= 10 * c_star_both:
        assert abs(t_ratio - 1) <= 0.03, (Gr, Sr, Hkv_, t_ratio)
        checked += 1
assert checked >= 4, checked
print(f"{'G':>2} {'S':>7} {'Hq':>3} {'Hkv':>3} {'scheme':>6} {'C':>6} {'TFLOP/s':>8} {'C*':>6} "
      f"{'C/C*':>6} {'t/t_kv':>7}")
for Gr, Sr, Hq_, Hkv_, scheme, resolved, C, F_row, c_star, t_ratio in table:
    if scheme != "auto":
        print(f"{Gr:>2} {Sr:>7} {Hq_:>3} {Hkv_:>3} {scheme:>6} {C:>6} {F_row / 1e12:>8.0f} "
              f"{c_star:>6.0f} {C / c_star:>6.1f} {t_ratio:>7.3f}")

# %%
Cs = np.logspace(np.log10(256), np.log10(131072), 60)
Hq_, Hkv_, Dh, Gp = 16, 16, 128, 4
F_meas = np.median([F for (*_, C, F, _c, _t) in table if C >= 16384])
fig, ax = plt.subplots(figsize=(7, 3.4))
ax.plot(Cs, step_flops(Cs, Hq_, Dh) / F_meas * 1e3, "k", lw=2, label=f"compute, F = {F_meas / 1e12:.0f} TFLOP/s (measured)")
ax.plot(Cs, step_flops(Cs, Hq_, Dh) / PEAK_FLOP_PER_S * 1e3, "k:", lw=2, label="compute, F = 790 TFLOP/s (peak)")
for scheme, color in (("kv", "C0"), ("q", "C3")):
    ax.plot(Cs, np.array([hop_bytes(scheme, int(c), Hq_, Hkv_, Dh, Gp) for c in Cs]) / LINK_BYTES_PER_S * 1e3,
            color, label=f"transfer per hop, backward={scheme!r}, 124 GB/s")
    for F_, mark in ((F_meas, "o"), (PEAK_FLOP_PER_S, "s")):
        c_star = chunk_threshold(scheme, F_, LINK_BYTES_PER_S, Hq_, Hkv_, Dh, Gp)
        ax.plot([c_star], [hop_bytes(scheme, int(round(c_star)), Hq_, Hkv_, Dh, Gp) / LINK_BYTES_PER_S * 1e3],
                color + mark, mfc="none", ms=8)
meas = [(C, by_key[(Gr, Sr, Hkv_r, "kv")]["time_s"] / Gr * 1e3)
        for (Gr, Sr, Hq_r, Hkv_r, sch, _, C, *_r) in table if sch == "kv" and Hkv_r == 16 and Gr == Gp]
ax.plot(*zip(*meas), "kx", ms=8, label="measured backward time per step, 4 x H200")
ax.plot([], [], "ko", mfc="none", label="C*: transfer = compute, measured F")
ax.plot([], [], "ks", mfc="none", label="C*: transfer = compute, peak F")
ax.set(xscale="log", yscale="log", xlabel="chunk C = tokens per device", ylabel="ms per ring step",
       title="backward, Hq = Hkv = 16, d = 128, bf16: hidden where compute > transfer")
ax.legend(fontsize=7, loc="upper left")
fig.tight_layout()
plt.show()

c_kv_meas = chunk_threshold("kv", F_meas, LINK_BYTES_PER_S, Hq_, Hkv_, Dh, Gp)
c_kv_peak = chunk_threshold("kv", PEAK_FLOP_PER_S, LINK_BYTES_PER_S, Hq_, Hkv_, Dh, Gp)
c_q_peak = chunk_threshold("q", PEAK_FLOP_PER_S, LINK_BYTES_PER_S, Hq_, Hkv_, Dh, Gp)
assert c_q_peak < c_kv_peak                     # Burst's fewer bytes lower the threshold for MHA
# every benchmarked chunk is above its measured threshold: the transfers can all hide ...
assert all(C >= c_star for (*_, C, _F, c_star, _t) in table)
# ... and at the peak rate the KV scheme's would not, for the 2k-4k-token chunks of the 8k-token runs
assert all(C < chunk_threshold("kv", PEAK_FLOP_PER_S, LINK_BYTES_PER_S, Hq_r, Hkv_r, 128, Gr)
           for (Gr, Sr, Hq_r, Hkv_r, scheme, _, C, *_r) in table
           if Sr == 8192 and Hq_r == Hkv_r and scheme == "kv")
print(f"backward C* with the measured kernel: kv {c_kv_meas:.0f} tokens; at the 790 TFLOP/s peak: "
      f"kv {c_kv_peak:.0f}, q {c_q_peak:.0f} tokens")

# %% [markdown]
# What the measurements say: with today's kernel $C^\star$ is at most about 1.2k tokens, and every
# benchmarked chunk (2k-64k tokens) is above it. Where it is above by 10x or more (the 32k-128k-token
# runs), the two backward schemes take the same time although they send different volumes: the
# transfers hide. At 8k tokens the margin is only 4-8x and the timings scatter by 5-15% either way, more
# than the volumes explain; the rule is a necessary condition, and latency and per-step overheads
# matter at small chunks. The rule also says when hiding stops: a kernel running at the 790 TFLOP/s
# peak pushes $C^\star$ to about 5-7k tokens, so the KV scheme's transfers in the 8k-token runs
# (2-4k-token chunks) would no longer hide, and the Burst scheme's 25-30% fewer bytes would show in the
# time. A slower link (between nodes) raises $C^\star$ in proportion.
#
# ## 4. Causal load balance: contiguous, zigzag, striped
#
# With a causal mask, query $i$ sees keys $\le i$. In a ring the queries stay put, so the work of a
# device is the number of visible (query, key) pairs among its queries. `layouts.shard_positions`
# says which global positions a device holds:
#
# * **contiguous**: device $i$ holds $[iT, (i+1)T)$ and sees $T^2 i + T(T+1)/2$ pairs: the last device does
#   nearly $2G-1$ times the work of the first;
# * **zigzag** (BurstEngine Eq. 11, DistFlashAttn §3.2): $2G$ chunks, device $i$ holds chunks $i$ and
#   $2G-1-i$, so a light chunk pairs with a heavy one: exactly $S(S+1)/2G$ pairs each;
# * **striped** (BurstEngine Eq. 13): token $t$ on device $t \bmod G$: device $i$ holds $t = mG + i$ and
#   sees $G\,T(T-1)/2 + T(i+1)$ pairs, equal up to one key per query.
#
# The heatmaps colour every visible (query, key) pair by the device that computes it, and give the
# pairs per (query device, key device) block; the row sums are each device's work, which
# `schedule.tile_counts` reports (with 1-token tiles it counts exactly the visible pairs).

# %%
S, G = 64, 4
T = S // G
mask = MaskSpec(causal=True)
fig, axes = plt.subplots(2, 3, figsize=(10.5, 6.6))
cmap = plt.get_cmap("tab10", G)
work = {}
for col, layout in enumerate(layouts.LAYOUTS):
    shards = [np.asarray(layouts.shard_positions(layout, i, T, G, xp=np)) for i in range(G)]
    perm = layouts.permutation(layout, S, G)
    assert np.array_equal(np.concatenate(shards), perm) and np.array_equal(np.sort(perm), np.arange(S))
    owner = np.empty(S, int)
    for i, p in enumerate(shards):
        owner[p] = i
    vis = np.tril(np.ones((S, S), bool))
    picture = np.where(vis, owner[:, None], np.nan)        # pair (query, key) -> device of the query
    axes[0, col].imshow(picture, cmap=cmap, vmin=-0.5, vmax=G - 0.5, interpolation="nearest")
    axes[0, col].set(title=f"{layout}: who computes each pair", xlabel="key position",
                     ylabel="query position" if col == 0 else None)
    blocks = np.array([[vis[np.ix_(shards[i], shards[j])].sum() for j in range(G)] for i in range(G)])
    axes[1, col].imshow(blocks, cmap="viridis", vmin=0, vmax=T * T)
    for i in range(G):
        for j in range(G):
            axes[1, col].text(j, i, str(blocks[i, j]), ha="center", va="center", fontsize=7,
                              color="w" if blocks[i, j] < 0.6 * T * T else "k")
    per_device = blocks.sum(axis=1)
    axes[1, col].set(title=f"per device: {per_device.tolist()}", xlabel="key device",
                     ylabel="query device" if col == 0 else None,
                     xticks=range(G), yticks=range(G))
    # the library's count, with 1-token tiles, is the exact number of visible pairs
    assert np.array_equal(tile_counts(layout, mask, S, G, block_q=1, block_k=1), per_device)
    assert per_device.sum() == S * (S + 1) // 2
    work[layout] = per_device
axes[0, 0].legend(handles=[Patch(color=cmap(i), label=f"device {i}")
                           for i in range(G)], fontsize=7, loc="upper right")
fig.tight_layout()
plt.show()

i = np.arange(G)
assert np.array_equal(work["contiguous"], T * T * i + T * (T + 1) // 2)
assert np.array_equal(work["zigzag"], np.full(G, S * (S + 1) // (2 * G)))
assert np.array_equal(work["striped"], G * T * (T - 1) // 2 + T * (i + 1))
# contiguous: the last device does (2T(G-1) + T + 1) / (T + 1) times the first one's work (-> 2G - 1)
assert Fraction(int(work["contiguous"].max()), int(work["contiguous"].min())) == Fraction(2 * T * (G - 1) + T + 1, T + 1)

# %% [markdown]
# The same counts at the size of the H200 benchmark (`benchmarks/results/balance_gpu.json`:
# $S$ = 128k tokens on 4 devices, 2048 x 2048 tiles; a tile counts unless its positions prove it fully
# masked) and the measured causal forward + backward times. The time follows the busiest device;
# zigzag cuts the maximum from 904 to 520 tiles (1.74x) and ran 1.63x faster. Finally, the library's
# ring gives the same result in every layout (8 simulated devices, float32, against
# `jax.nn.dot_product_attention`).

# %%
balance = json.loads((RESULTS / "balance_gpu.json").read_text())
cfg = balance["config"]
print(f"{'layout':>10}  {'tiles per device':<22} {'max':>4} {'fwd+bwd s':>9} {'speedup':>7}")
base = next(r for r in balance["rows"] if r["layout"] == "contiguous")["time_s"]
for r in balance["rows"]:
    tiles = tile_counts(r["layout"], mask, cfg["seq"], cfg["devices"], cfg["block"], cfg["block"])
    assert tiles.tolist() == r["tiles"], (r["layout"], tiles, r["tiles"])  # the library's count
    print(f"{r['layout']:>10}  {str(tiles.tolist()):<22} {tiles.max():>4} {r['time_s']:>9.3f} "
          f"{base / r['time_s']:>7.2f}")
by_layout = {r["layout"]: r for r in balance["rows"]}
assert by_layout["zigzag"]["time_s"] < by_layout["contiguous"]["time_s"]
assert len(set(by_layout["zigzag"]["tiles"])) == 1

G = 8
mesh = jax.make_mesh((G,), ("sp",))
B, S, Hq, Hkv, D = 1, 256, 4, 2, 16
q, k, v = normal(B, S, Hq, D, dtype=F32), normal(B, S, Hkv, D, dtype=F32), normal(B, S, Hkv, D, dtype=F32)
expected = jax.nn.dot_product_attention(q, k, v, is_causal=True)
for layout in layouts.LAYOUTS:
    out = jax.jit(lambda q, k, v: jsp.attention(q, k, v, mesh=mesh, causal=True, layout=layout))(q, k, v)
    assert rel_err(out, expected) < 1e-5, (layout, rel_err(out, expected))
    print(f"layout={layout!r}: ring attention on {G} devices vs jax.nn: {rel_err(out, expected):.1e}, "
          f"work per device {tile_counts(layout, mask, S, G, 8, 8).tolist()} (8-token tiles)")

# %% [markdown]
# ## Summary
#
# * Partial attention results $(o, \operatorname{lse})$ over disjoint key sets merge associatively;
#   `merge` shifts by the max and treats $(0, -\infty)$ as an exact identity, so fully masked rows never
#   produce NaN (in values or gradients).
# * $dS = P\circ(dP - D)$ with $D = \operatorname{rowsum}(dO\circ O)$ makes every block pair's gradient a
#   function of query-side data ($Q, dO, D, \operatorname{lse}$) and key-side data ($K, V$) only, so either
#   side may circulate: $3d + 2$ against $4d$ values per token and head, exactly the bytes the compiled
#   program sends; with GQA the key side is $g$ times smaller and `backward="auto"` picks it.
# * Communication hides behind compute when the chunk exceeds $C^\star \approx F/B$; on H200s with the
#   current kernel that is about a thousand tokens, at the peak matmul rate several thousand.
# * Zigzag gives every device exactly the same causal work, striped nearly so; contiguous is
#   $2G - 1$ times unbalanced.
