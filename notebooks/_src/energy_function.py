# %% [markdown]
# # The energy function of attention
#
# Softmax attention of one query is an *expectation*: the query's scores define a probability
# distribution over the keys, and the output is the mean of the values under it. Tree Attention
# (Shyam et al., *Tree Attention: topology-aware decoding for long-context attention on GPU
# clusters*, §4-5 and App. C-F) builds a scalar
# function whose gradient is exactly that mean, and draws the parallel algorithm from it: the
# function is a log-sum-exp, log-sum-exp is associative, so the sum over a sharded sequence is an
# all-reduce.
#
# This notebook goes through the argument step by step. Every claim is followed by a numerical
# check written as an `assert`, first against plain JAX (`jax.grad`,
# `jax.nn.dot_product_attention`) and then against `jax_seqpar` itself, so if the derivation or
# the library changes, the notebook fails in CI (`tests/test_notebooks.py`).
#
# | section | paper |
# |---|---|
# | 1. attention = ∂F/∂ζ | §4, Eq. 4-6, App. C.1 Eq. 15-24 |
# | 2. causal multi-head attention, one source per query and head | App. C.1 Eq. 25-28 |
# | 3. second derivative = covariance; higher cumulants | App. C.1 Eq. 19-21 |
# | 4. associativity, tree reduction, safe softmax | §5.1, Theorem 1, Alg. 1-3, App. E-F |
# | 5. the Bayesian / MAP reading | App. C.2 Eq. 30-34 |
# | 6. communication and memory of ring vs tree decoding; `jax_seqpar.tree_decode` | §6.2-6.3 Eq. 8-14 |
#
# It runs on a CPU in under a minute. Eight devices are simulated, so the flag that creates
# them has to be set before JAX is imported. The derivations are checked in float64.

# %%
import os

_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

jax.config.update("jax_enable_x64", True)  # the derivation is checked in float64

import jax_seqpar as jsp
from jax_seqpar.runtime.comm import collective_bytes
from jax_seqpar.parallel.tree import tree_reduce

plt.rcParams.update({"figure.dpi": 80, "savefig.dpi": 80, "font.size": 9})
assert jax.device_count() >= 8, "set XLA_FLAGS before jax is imported (restart the kernel)"
print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices")

rng = np.random.default_rng(0)


def rel_err(a, b):
    """Norm-wise relative error ||a - b|| / ||b||, computed in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm((a - b).ravel()) / np.linalg.norm(b.ravel()))


def softmax_attention64(q, k, v, causal=False):
    """Textbook attention in float64, [B, T, H, D] layout (MHA): softmax(q k^T / sqrt(D)) v."""
    s = jnp.einsum("bihd,bahd->bhia", q, k) * q.shape[-1] ** -0.5
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jnp.einsum("bhia,bahd->bihd", jax.nn.softmax(s, axis=-1), v)


# jax.nn.dot_product_attention always runs its softmax in float32, whatever the input dtype, so
# it is compared at float32 accuracy; the float64 checks use softmax_attention64.
TOL_JAX_NN = 1e-6

# %% [markdown]
# ## 1. Attention is the gradient of an energy
#
# The derivative of log-sum-exp is softmax (Eq. 4):
# $\partial_{z_j} \log \sum_a e^{z_a} = e^{z_j} / \sum_a e^{z_a}$.
# Take one query $q$, keys $k_1, \dots, k_N$ and values $v_1, \dots, v_N \in \mathbb{R}^{d}$, and add
# to each score a term that is linear in an auxiliary **source** vector $\zeta \in \mathbb{R}^{d}$
# (Eq. 6, 19, 24):
#
# $$F(\zeta) = \log \sum_{a=1}^{N} \exp\left(q\cdot k_a + \zeta\cdot v_a\right).$$
#
# Differentiating under the sum,
#
# $$\frac{\partial F}{\partial \zeta} = \frac{\sum_a e^{q\cdot k_a + \zeta\cdot v_a}\, v_a}{\sum_b e^{q\cdot k_b + \zeta\cdot v_b}}
# \quad\Longrightarrow\quad
# \left.\frac{\partial F}{\partial \zeta}\right|_{\zeta=0} = \sum_a \operatorname{softmax}_a(q\cdot k)\, v_a,$$
#
# which is attention (Observation 1, Eq. 5 and 15-23). The paper writes the score as $q \cdot k_a$;
# the usual $1/\sqrt{d}$ factor is a rescaling of $q$ and changes nothing below. At $\zeta \neq 0$ the
# gradient is still an attention output, with every score tilted by $\zeta \cdot v_a$.

# %%
N, d = 48, 16
scale = d ** -0.5
q = jnp.asarray(rng.normal(size=d))
K = jnp.asarray(rng.normal(size=(N, d)))
V = jnp.asarray(rng.normal(size=(N, d)))


def energy(zeta, q, K, V, scale):
    """F(zeta) = log sum_a exp(scale * q.k_a + zeta.v_a)   (Tree Attention Eq. 6)."""
    return jax.nn.logsumexp(scale * (K @ q) + V @ zeta)


# Eq. 4: the gradient of log-sum-exp is softmax
s = scale * (K @ q)
assert rel_err(jax.grad(jax.nn.logsumexp)(s), jax.nn.softmax(s)) < 1e-14

# Eq. 5: the gradient of F at zeta = 0 is attention, computed here by jax.grad ...
out_energy = jax.jit(jax.grad(energy))(jnp.zeros(d), q, K, V, scale)
assert out_energy.dtype == jnp.float64
# ... and independently as softmax-weighted values, in float64 ...
out_64 = softmax_attention64(q[None, None, None], K[None, :, None], V[None, :, None])[0, 0, 0]
assert rel_err(out_energy, out_64) < 1e-13, rel_err(out_energy, out_64)
# ... and by JAX's attention ([batch, seq, heads, dim] layout; float32 softmax)
out_jax = jax.nn.dot_product_attention(q[None, None, None], K[None, :, None], V[None, :, None],
                                       scale=scale)[0, 0, 0]
assert rel_err(out_energy, out_jax) < TOL_JAX_NN, rel_err(out_energy, out_jax)

# away from zeta = 0 the gradient is attention with tilted scores s_a + zeta.v_a
zeta = jnp.asarray(0.3 * rng.normal(size=d))
tilted = jax.nn.softmax(s + V @ zeta) @ V
assert rel_err(jax.grad(energy)(zeta, q, K, V, scale), tilted) < 1e-13
print(f"grad F(0) vs float64 attention {rel_err(out_energy, out_64):.1e}, "
      f"vs jax.nn.dot_product_attention {rel_err(out_energy, out_jax):.1e}")

# %% [markdown]
# ## 2. Causal multi-head attention: one source per query and head
#
# A sequence of $T$ queries needs $T$ outputs, so it needs $T$ sources. With causal masking, query
# $i$ sees keys $a \le i$, and with several heads every (query, head) pair gets its own source
# $\zeta_{i,h}$ (Eq. 25-28):
#
# $$F_{\text{tot}}(\zeta) = \sum_{i=1}^{T} \sum_{h=1}^{n_h} \log \sum_{a=1}^{i}
#   \exp\left(q_{i,h}\cdot k_{a,h} + \zeta_{i,h}\cdot v_{a,h}\right).$$
#
# Each $\zeta_{i,h}$ appears in exactly one term of the sum, so $\partial F_{\text{tot}} / \partial \zeta_{i,h}$ at
# $\zeta = 0$ is the output of query $i$ in head $h$ (Eq. 26): **one** call to `jax.grad` returns
# the whole `[B, T, H, D]` output of causal multi-head attention. Grouped-query attention (several
# query heads sharing one key/value head) only changes which $k, v$ a head reads.
#
# Why one source per query? With a single source shared by all queries, the gradient would be the
# *sum* of their outputs: the sources are what keeps the queries apart.

# %%
B, T, Hq, Hkv, D = 2, 12, 4, 2, 8
scale = D ** -0.5
Q = jnp.asarray(rng.normal(size=(B, T, Hq, D)))
Kc = jnp.asarray(rng.normal(size=(B, T, Hkv, D)))
Vc = jnp.asarray(rng.normal(size=(B, T, Hkv, D)))


def energy_total(Z, Q, K, V):
    """F_tot = sum_{b,i,h} log sum_{a<=i} exp(q_ih.k_ah / sqrt(D) + zeta_ih.v_ah)  (Eq. 25-28).

    Z: [B, T, Hq, D], one source per (batch, query, head).  Query head h reads key/value
    head h // (Hq // Hkv) (grouped-query attention; Hq == Hkv is multi-head attention).
    """
    T, Hq, D = Q.shape[1:]
    g = Hq // K.shape[2]
    Kh, Vh = jnp.repeat(K, g, axis=2), jnp.repeat(V, g, axis=2)
    s = D ** -0.5 * jnp.einsum("bihd,bahd->bhia", Q, Kh) + jnp.einsum("bihd,bahd->bhia", Z, Vh)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)   # causal: key a <= query i
    return jax.nn.logsumexp(s, axis=-1).sum()


out_energy = jax.jit(jax.grad(energy_total))(jnp.zeros_like(Q), Q, Kc, Vc)
assert out_energy.shape == (B, T, Hq, D)
out_64 = softmax_attention64(Q, jnp.repeat(Kc, Hq // Hkv, 2), jnp.repeat(Vc, Hq // Hkv, 2), causal=True)
assert rel_err(out_energy, out_64) < 1e-13, rel_err(out_energy, out_64)
out_jax = jax.nn.dot_product_attention(Q, Kc, Vc, is_causal=True, scale=scale)  # GQA natively
assert rel_err(out_energy, out_jax) < TOL_JAX_NN, rel_err(out_energy, out_jax)

# the library's dense oracle agrees too (it computes in float32)
out_ref, _ = jsp.reference_attention(Q.astype(jnp.float32), Kc.astype(jnp.float32),
                                     Vc.astype(jnp.float32), causal=True)
assert rel_err(out_ref, out_energy) < 1e-6


# a single source per head, shared by every query: the gradient sums the outputs over queries
def energy_shared(z, Q, K, V):  # z: [Hq, D]
    return energy_total(jnp.broadcast_to(z, Q.shape), Q, K, V)


shared = jax.jit(jax.grad(energy_shared))(jnp.zeros((Hq, D)), Q, Kc, Vc)
assert rel_err(shared, out_64.sum(axis=(0, 1))) < 1e-13
print(f"causal GQA attention from one jax.grad: vs float64 {rel_err(out_energy, out_64):.1e}, "
      f"vs jax.nn {rel_err(out_energy, out_jax):.1e}")

# %% [markdown]
# ## 3. The second derivative is the covariance of the values
#
# Normalise the partition function of Eq. 19 by its value at $\zeta = 0$:
#
# $$\frac{Z(\zeta)}{Z(0)} = \sum_a P_a\, e^{\zeta\cdot v_a} = \mathbb{E}_P\left[e^{\zeta\cdot v}\right],
# \qquad P_a = \operatorname{softmax}_a(q\cdot k).$$
#
# That is the moment-generating function of $v$ under the attention distribution: its Taylor
# coefficients are the moments (Eq. 20-21), e.g.
# $\frac{1}{Z}\partial_{A}\partial_{B} Z|_0 = \mathbb{E}[v_A v_B]$. Its logarithm,
# $F(\zeta) - F(0)$, is therefore the **cumulant**-generating function, so
#
# $$\nabla F(0) = \mathbb{E}[v] = \mu \;\;(\text{attention}),\qquad
#   \nabla^2 F(0) = \mathbb{E}[(v-\mu)(v-\mu)^\top] = \Sigma \;\;(\text{covariance}),\qquad
#   \nabla^3 F(0) = \mathbb{E}[(v-\mu)^{\otimes 3}],$$
#
# and the fourth derivative is the fourth cumulant: with $c = v - \mu$,
# $\partial^4_{ijkl} F(0) = \mathbb{E}[c_i c_j c_k c_l] - \Sigma_{ij}\Sigma_{kl} - \Sigma_{ik}\Sigma_{jl} - \Sigma_{il}\Sigma_{jk}$.
# A covariance is positive semi-definite, so $F$ is **convex** in $\zeta$, which section 5 uses.

# %%
d = 5  # small, so that the 4th-order tensor stays readable
q = q3 = jnp.asarray(rng.normal(size=d))
K = K3 = jnp.asarray(rng.normal(size=(N, d)))
V = V3 = jnp.asarray(rng.normal(size=(N, d)))
scale = scale3 = d ** -0.5
zero = jnp.zeros(d)

P = jax.nn.softmax(scale * (K @ q))
mu = P @ V
C = V - mu
Sigma = jnp.einsum("a,ai,aj->ij", P, C, C)

# Eq. 20: raw moments are the Taylor coefficients of Z(zeta) / Z(0)
def Z(zeta):
    return jnp.exp(scale * (K @ q) + V @ zeta).sum()

raw2 = jax.jit(jax.hessian(Z))(zero) / Z(zero)
assert rel_err(raw2, jnp.einsum("a,ai,aj->ij", P, V, V)) < 1e-13

# cumulants: derivatives of log Z = F
hess = jax.jit(jax.hessian(energy))(zero, q, K, V, scale)
assert rel_err(hess, Sigma) < 1e-13, rel_err(hess, Sigma)
eig = np.linalg.eigvalsh(np.asarray(hess))
assert eig.min() > 0, eig  # positive definite here (N > d values in general position): F is convex

third = jax.jit(jax.jacfwd(jax.hessian(energy)))(zero, q, K, V, scale)
assert rel_err(third, jnp.einsum("a,ai,aj,ak->ijk", P, C, C, C)) < 1e-12

fourth = jax.jit(jax.hessian(jax.hessian(energy)))(zero, q, K, V, scale)
m4 = jnp.einsum("a,ai,aj,ak,al->ijkl", P, C, C, C, C)
pairings = (jnp.einsum("ij,kl->ijkl", Sigma, Sigma) + jnp.einsum("ik,jl->ijkl", Sigma, Sigma)
            + jnp.einsum("il,jk->ijkl", Sigma, Sigma))
assert rel_err(fourth, m4 - pairings) < 1e-11

# the Taylor series of Eq. 21 in one direction u: the cubic term is what remains
u = jnp.asarray(rng.normal(size=d))
u = u / jnp.linalg.norm(u)
k3 = jnp.einsum("ijk,i,j,k->", third, u, u, u)
for eps in (1e-2, 1e-3):
    remainder = energy(eps * u, q, K, V, scale) - energy(zero, q, K, V, scale) - eps * mu @ u - 0.5 * eps**2 * u @ Sigma @ u
    assert abs(remainder / eps**3 - k3 / 6) < 0.05 * abs(k3 / 6) + 1e-6, (eps, remainder / eps**3, k3 / 6)
print("Hessian == covariance, eigenvalues", np.round(eig, 4))

# %%
t = np.linspace(-3, 3, 121)
F0 = float(energy(zero, q, K, V, scale))
fig, ax = plt.subplots(figsize=(5.2, 2.8))
ax.plot(t, jax.vmap(lambda x: energy(x * u, q, K, V, scale))(t) - F0, "k", lw=2, label=r"$F(t u) - F(0)$")
ax.plot(t, t * float(mu @ u), "--", label=r"$t\, \mu\cdot u$ (attention)")
ax.plot(t, t * float(mu @ u) + 0.5 * t**2 * float(u @ Sigma @ u), ":",
        label=r"$+\frac{t^2}{2} u^\top \Sigma u$ (covariance)")
ax.set_xlabel("t (source along a unit direction u)")
ax.set_title("F is convex; its Taylor coefficients are the cumulants of v")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 4. Associativity, the tree reduction, and safe softmax
#
# $F$ is a log-sum-exp over the keys, and log-sum-exp is associative (§5.1):
# $\operatorname{lse}(A \cup B) = \log\left(e^{\operatorname{lse}(A)} + e^{\operatorname{lse}(B)}\right)$ for disjoint
# key sets, so the sum can be bracketed in any way; so can $\max$. With the keys split over $p$
# devices, each device reduces its $N/p$ keys locally and the $p$ partial results are combined in
# $\lceil\log_2 p\rceil$ rounds of a tree: $O(N/p + \log p)$ steps instead of $O(N)$ (Theorem 1,
# App. E).
#
# Attention needs more than the log-sum-exp, but by section 1 it is its gradient, and the partial
# results that combine are $(o_i, \operatorname{lse}_i)$ per device: with $m = \max_i \operatorname{lse}_i$,
#
# $$n = \sum_i o_i\, e^{\operatorname{lse}_i - m},\qquad d = \sum_i e^{\operatorname{lse}_i - m},\qquad
#   o = n / d,\qquad \operatorname{lse} = m + \log d,$$
#
# which is one max all-reduce and one sum all-reduce of the packed $[n, d]$ (Alg. 3, lines 3-6; the
# paper's two sum all-reduces fused into one). `jax_seqpar.parallel.tree.tree_reduce` is exactly this.
#
# First the scalar statement, with a random bracketing and a binary tree over 8 simulated devices:

# %%
scores = jnp.asarray(rng.normal(scale=3.0, size=4096))
p = 8
chunks = scores.reshape(p, -1)


def sequential(parts, op):
    """Left to right: ((x0 op x1) op x2) op ... -- one combine after another."""
    acc = parts[0]
    for y in parts[1:]:
        acc = op(acc, y)
    return acc


def tree(parts, op):
    """Combine partial results pairwise; returns the result and the number of rounds."""
    rounds = 0
    while len(parts) > 1:
        parts = [op(parts[i], parts[i + 1]) if i + 1 < len(parts) else parts[i]
                 for i in range(0, len(parts), 2)]
        rounds += 1
    return parts[0], rounds


def random_bracketing(parts, op, rng):
    parts = list(parts)
    while len(parts) > 1:
        i = int(rng.integers(len(parts) - 1))
        parts[i:i + 2] = [op(parts[i], parts[i + 1])]
    return parts[0]


local = [jax.nn.logsumexp(c) for c in chunks]             # N/p steps on each device
lse_tree, rounds = tree(local, jnp.logaddexp)             # log2(p) rounds across devices
lse_seq = sequential(np.asarray(scores), np.logaddexp)    # N - 1 combines, one after another
assert rounds == int(np.log2(p)) == 3
assert abs(lse_tree - lse_seq) < 1e-12 and abs(lse_tree - jax.nn.logsumexp(scores)) < 1e-12
assert abs(random_bracketing(local, jnp.logaddexp, rng) - lse_seq) < 1e-12
maxes = list(chunks.max(axis=1))
assert sequential(maxes, jnp.maximum) == tree(maxes, jnp.maximum)[0] == scores.max()  # max: exact
print(f"log-sum-exp over {scores.size} scores: sequential {float(lse_seq):.12f}, "
      f"tree over {p} devices {float(lse_tree):.12f} in {rounds} rounds")

# %% [markdown]
# Now on 8 simulated devices, with the library's reduction: every device attends a batch of
# queries (replicated) to its shard of the keys, producing a local $(o_i, \operatorname{lse}_i)$, and
# `tree_reduce` combines them with `pmax` and one fused `psum`. The compiled program contains exactly
# those two all-reduces.

# %%
from jax.sharding import PartitionSpec as P_

mesh = jax.make_mesh((8,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
B, Tq, H, D, S = 2, 3, 4, 16, 8 * 64
scale = D ** -0.5
q = jnp.asarray(rng.normal(size=(B, Tq, H, D)))
k = jnp.asarray(rng.normal(size=(B, S, H, D)))
v = jnp.asarray(rng.normal(size=(B, S, H, D)))


def local_attention(q, k, v):
    """Dense (o, lse) of the replicated queries over this device's keys (float64)."""
    s = scale * jnp.einsum("bqhd,bkhd->bhqk", q, k)
    lse = jax.nn.logsumexp(s, axis=-1)                                  # [B, H, Tq]
    o = jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(s - lse[..., None]), v)   # [B, Tq, H, D]
    return o, lse


def per_device(q, k, v):
    o, lse = local_attention(q, k, v)
    return tree_reduce(o, lse, "sp")


sharded = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P_(), P_(None, "sp"), P_(None, "sp")),
                                out_specs=(P_(), P_())))
o_tree, lse_tree = sharded(q, k, v)
o_full, lse_full = local_attention(q, k, v)  # one device holding every key
assert rel_err(o_tree, o_full) < 1e-13 and rel_err(lse_tree, lse_full) < 1e-13
report = collective_bytes(sharded, q, k, v)
assert report.count_by_kind() == {"all-reduce": 2}, report.count_by_kind()
print("tree_reduce over 8 devices == one device:", f"{rel_err(o_tree, o_full):.1e};",
      "collectives:", report.count_by_kind())

# %% [markdown]
# **Safe softmax (App. F).** Subtracting a constant $m$ from every score changes $F$ by $-m$ and
# leaves its gradient unchanged (Eq. 35-38):
#
# $$F'(\zeta) = \log \sum_a \exp(q\cdot k_a + \zeta\cdot v_a - m) = F(\zeta) - m
#   \quad\Rightarrow\quad \nabla F' = \nabla F.$$
#
# Choosing $m = \max_a q\cdot k_a$ makes every exponent $\le 0$, so nothing overflows. That freedom is
# what the tree uses: each device shifts by its own local max inside the kernel, and the global
# `pmax` above is one more shift. In float32, scores of a few hundred overflow the naive formula
# ($e^{89} > 3.4\cdot 10^{38}$) while the shifted one is exact up to rounding.

# %%
d = 16
q_int = jnp.asarray(rng.integers(-6, 7, size=d), jnp.float32)      # integer q, k: the float32
K_int = jnp.asarray(rng.integers(-6, 7, size=(N, d)), jnp.float32)  # scores are exact (|s| < 600)
V32 = jnp.asarray(rng.normal(size=(N, d)), jnp.float32)
zero32 = jnp.zeros(d, jnp.float32)


def energy_naive(zeta, q, K, V):
    return jnp.log(jnp.exp(K @ q + V @ zeta).sum())


def energy_shifted(zeta, q, K, V, m):
    return jnp.log(jnp.exp(K @ q + V @ zeta - m).sum())


s32 = K_int @ q_int
m = jax.lax.stop_gradient(s32.max())
exact = jax.grad(energy_shifted)(zero32.astype(jnp.float64), q_int.astype(jnp.float64),
                                 K_int.astype(jnp.float64), V32.astype(jnp.float64), float(m))
naive = jax.grad(energy_naive)(zero32, q_int, K_int, V32)
safe = jax.grad(energy_shifted)(zero32, q_int, K_int, V32, m)
print(f"max score {float(s32.max()):.0f}; naive float32 value {float(energy_naive(zero32, q_int, K_int, V32))}, "
      f"gradient finite: {bool(jnp.isfinite(naive).all())}")
assert float(s32.max()) > 89 and not bool(jnp.isfinite(naive).all())   # the naive form breaks
assert rel_err(safe, exact) < 1e-6                                     # the shifted one does not

# in float64 any shift gives the same gradient, and the value moves by exactly -m
for shift in (0.0, float(m), -123.25, 400.0):  # any shift that keeps exp() in range
    grad_shift = jax.grad(energy_shifted)(jnp.zeros(d), q_int.astype(jnp.float64),
                                          K_int.astype(jnp.float64), V32.astype(jnp.float64), shift)
    assert rel_err(grad_shift, exact) < 1e-13

# %% [markdown]
# ## 5. The Bayesian / MAP reading
#
# App. C.2 pairs every source $\zeta_i$ with an output variable $z_i$ and writes (Eq. 30)
#
# $$\Gamma(\zeta, z) = \sum_{i} \left(z_i\cdot\zeta_i - F_i(\zeta_i)\right),$$
#
# one term per query, $F_i$ its energy (Eq. 28). Its stationary point (Eq. 31-32) is
#
# $$\frac{\partial\Gamma}{\partial z_i} = \zeta_i = 0,\qquad
#   \frac{\partial\Gamma}{\partial \zeta_i} = z_i - \nabla F_i(\zeta_i) = 0
#   \quad\Longrightarrow\quad \zeta_i^\star = 0,\;\; z_i^\star = \nabla F_i(0) = \text{attention output}\;\;(\text{Eq. 33}).$$
#
# $\Gamma$ is linear in $z$, so this point is a saddle, not a joint maximum; the sharp statement is
# the Legendre duality behind Eq. 34. For fixed $z$, $\zeta \mapsto z\cdot\zeta - F(\zeta)$ is concave
# (section 3: $\nabla^2 F = \Sigma \succ 0$), its maximiser solves $\nabla F(\zeta^\star) = z$, and the maximum
# is the convex conjugate $F^\star(z)$. The attention output is the one $z$ whose maximiser is the
# zero source; any other reachable $z$ is an attention output with scores tilted by
# $\zeta^\star\cdot v_a$.
#
# Two checks. On causal multi-head attention, Newton's method on $\nabla\Gamma = 0$ from a random
# start lands on $(\zeta, z) = (0, \text{attention})$ (in two steps: the first solves the equation
# $\zeta = 0$, which is linear, and the second then gives $z = \nabla F(0)$ exactly). For one query, maximising $z\cdot\zeta - F(\zeta)$
# with $z$ = the attention output gives $\zeta^\star = 0$, and with another $z$ a nonzero source whose
# tilted attention output is that $z$.

# %%
B, T, Hq, Hkv, D = 1, 6, 2, 2, 4
scale = D ** -0.5
Q = jnp.asarray(rng.normal(size=(B, T, Hq, D)))
Kc = jnp.asarray(rng.normal(size=(B, T, Hkv, D)))
Vc = jnp.asarray(rng.normal(size=(B, T, Hkv, D)))
attn = softmax_attention64(Q, Kc, Vc, causal=True)
n = Q.size


def gamma(x):
    """Gamma(zeta, z) = sum_i z_i.zeta_i - F_i(zeta_i), with x = [zeta, z] flattened (Eq. 30)."""
    zeta, z = x[:n].reshape(Q.shape), x[n:].reshape(Q.shape)
    return jnp.vdot(z, zeta) - energy_total(zeta, Q, Kc, Vc)


grad_gamma, hess_gamma = jax.jit(jax.grad(gamma)), jax.jit(jax.hessian(gamma))
x = jnp.asarray(rng.normal(size=2 * n))
for it in range(20):
    r = grad_gamma(x)
    if float(jnp.abs(r).max()) < 1e-13:
        break
    x = x - jnp.linalg.solve(hess_gamma(x), r)
zeta_star, z_star = x[:n].reshape(Q.shape), x[n:].reshape(Q.shape)
assert float(jnp.abs(grad_gamma(x)).max()) < 1e-13, it
assert float(jnp.abs(zeta_star).max()) < 1e-13                  # Eq. 32: zeta* = 0
assert rel_err(z_star, attn) < 1e-13                             # Eq. 33: z* = attention
print(f"Newton on grad Gamma = 0: {it} iterations, |zeta*| = {float(jnp.abs(zeta_star).max()):.1e}, "
      f"z* vs attention {rel_err(z_star, attn):.1e}")


# The dual view, for one query (section 3's q, K, V: N = 48 values in d = 5 dimensions, so the
# covariance is positive definite and z.zeta - F(zeta) strictly concave).
@jax.jit
def dual_objective(zeta, z, q, K, V, scale):
    return z @ zeta - energy(zeta, q, K, V, scale)


dual_grad, dual_hess = jax.jit(jax.grad(dual_objective)), jax.jit(jax.hessian(dual_objective))


def dual_argmax(z, *args, steps=50):
    """argmax_zeta z.zeta - F(zeta), by damped Newton (the objective is concave)."""
    zeta = jnp.asarray(rng.normal(size=z.shape))
    for _ in range(steps):
        gr = dual_grad(zeta, z, *args)
        if float(jnp.abs(gr).max()) < 1e-13:
            break
        step = jnp.linalg.solve(dual_hess(zeta, z, *args), gr)
        t_ = 1.0  # backtracking: never go downhill
        while dual_objective(zeta - t_ * step, z, *args) < dual_objective(zeta, z, *args) and t_ > 1e-6:
            t_ /= 2
        zeta = zeta - t_ * step
    return zeta


q1, K1, V1, scale1 = q3, K3, V3, scale3
mu1 = jax.grad(energy)(jnp.zeros(q1.shape), q1, K1, V1, scale1)          # the attention output
assert float(jnp.abs(dual_argmax(mu1, q1, K1, V1, scale1)).max()) < 1e-12  # its source is zero
z_other = mu1 + 0.1 * jnp.asarray(rng.normal(size=mu1.shape))
zeta_other = dual_argmax(z_other, q1, K1, V1, scale1)
assert float(jnp.abs(zeta_other).max()) > 1e-3                            # another z: a nonzero source
tilted_out = jax.nn.softmax(scale1 * (K1 @ q1) + V1 @ zeta_other) @ V1    # = attention, tilted scores
assert rel_err(tilted_out, z_other) < 1e-12

# %% [markdown]
# ## 6. Decoding: communication and memory of ring vs tree
#
# Decoding attends a few new queries to a long KV cache that is sharded over $p$ devices along the
# sequence, $t = N/p$ tokens each. Notation of §6.2-6.3: batch $b$, $n_h$ heads of size $d_h$,
# $d = n_h d_h$.
#
# * **Ring** (K, V travel): every device sends its K and V shard around the ring,
#   $V_{\text{ring}} = 2btd \cdot p$ elements (Eq. 10-11), and holds its own shard, the one in flight,
#   the query and the output: $\text{Mem}_{\text{ring}} = 4btd + 2bd$ (Eq. 8).
# * **Tree** (K, V stay): one all-reduce of the numerator, denominator and max,
#   $\text{numel} = bd + 2bn_h$ (Eq. 13), at $2\frac{p-1}{p}$ of its size per device (Eq. 12):
#   $V_{\text{tree}} = 2\frac{p-1}{p}(bd + 2bn_h)$ (Eq. 14), **independent of the context length**; memory
#   $\text{Mem}_{\text{tree}} = 2btd + 2bd + 2bn_h$ (Eq. 9).
#
# Per device and per decoding step, the ring moves $2btd \cdot p = 2bNd$: the whole cache passes through
# every device, whatever $p$. The tree's volume does not depend on $N$ at all, and its memory saves the
# buffer for the block in flight. Plotted for the paper's example sizes ($d = 2048$: 16 heads of 128,
# bfloat16, $b = 1$):

# %%
def v_ring(b, t, d, p):
    return 2 * b * t * d * p                          # Eq. 10


def v_tree(b, d, n_h, p):
    return 2 * (p - 1) / p * (b * d + 2 * b * n_h)    # Eq. 12-14


def mem_ring(b, t, d):
    return 4 * b * t * d + 2 * b * d                  # Eq. 8


def mem_tree(b, t, d, n_h):
    return 2 * b * t * d + 2 * b * d + 2 * b * n_h    # Eq. 9


b, n_h, d_h = 1, 16, 128
d = n_h * d_h
elem = 2  # bytes, bfloat16
ps = np.array([2, 4, 8, 16, 32, 64, 128])
Ns = np.array([2**k for k in range(14, 24)])  # 16k .. 8M tokens

fig, axes = plt.subplots(1, 3, figsize=(11, 3.0))
for N_ctx, style in ((80_000, "--"), (640_000, "-"), (5_120_000, ":")):
    axes[0].plot(ps, elem * v_ring(b, N_ctx / ps, d, ps), "C0" + style, label=f"ring, N={N_ctx:,}")
axes[0].plot(ps, elem * v_tree(b, d, n_h, ps), "C3", lw=2, label="tree (any N)")
axes[0].set(xscale="log", yscale="log", xlabel="devices p", ylabel="bytes per device",
            title="communication per step (Eq. 10 vs 14)")
axes[0].legend(fontsize=7)
for p_, style in ((8, "-"), (64, "--")):
    axes[1].plot(Ns, elem * v_ring(b, Ns / p_, d, p_), "C0" + style, label=f"ring, p={p_}")
    axes[1].plot(Ns, np.full(len(Ns), elem * v_tree(b, d, n_h, p_)), "C3" + style, label=f"tree, p={p_}")
axes[1].set(xscale="log", yscale="log", xlabel="context length N",
            title="communication vs N (ring: same for every p)")
axes[1].legend(fontsize=7)
for p_, style in ((8, "-"), (64, "--")):
    axes[2].plot(Ns, elem * mem_ring(b, Ns / p_, d), "C0" + style, label=f"ring, p={p_}")
    axes[2].plot(Ns, elem * mem_tree(b, Ns / p_, d, n_h), "C3" + style, label=f"tree, p={p_}")
axes[2].set(xscale="log", yscale="log", xlabel="context length N", ylabel="bytes per device",
            title="peak memory (Eq. 8 vs 9)")
axes[2].legend(fontsize=7)
fig.tight_layout()
plt.show()

for p_ in ps:
    for N_ctx in Ns:
        t_ = N_ctx / p_
        assert v_tree(b, d, n_h, p_) < v_ring(b, t_, d, p_)                  # less traffic ...
        assert (mem_tree(b, t_, d, n_h) < mem_ring(b, t_, d)) == (n_h < t_ * d)  # ... and memory iff 2bn_h < 2btd
print(f"p=8, N=640k, bf16: ring sends {elem * v_ring(b, 640_000 / 8, d, 8) / 1e6:.0f} MB per device, "
      f"tree {elem * v_tree(b, d, n_h, 8) / 1e3:.1f} kB")

# %% [markdown]
# ### `jax_seqpar.tree_decode` on 8 simulated devices
#
# The library's decoder is Alg. 3: local attention on each shard, one `pmax`, one fused `psum`.
# Three checks against the derivation:
#
# 1. its output is the gradient of the energy (section 1) computed in float64 on the whole cache,
#    with ragged cache lengths (the sum over keys stops at each sequence's length, as the causal sum
#    of Eq. 25 stops at $i$), and so is its gradient with respect to the queries;
# 2. the bytes each device sends, read from the compiled program, are exactly Eq. 14 (float32, so
#    4 bytes per element), with the numerator, denominator and max of Eq. 13: $bd + 2bn_h$ values per
#    query; `ring_decode` sends Eq. 10's K and V, for $p - 1$ hops (the paper counts $p$; the last
#    block needs no forwarding);
# 3. the compiled tree decoder needs less memory per device than the ring decoder (Eq. 8 vs 9;
#    XLA's buffers are larger than the idealised counts for both).

# %%
G = 8
mesh = jax.make_mesh((G,), ("sp",))
B, Tq, H, D, S = 2, 1, 4, 32, 8 * 1024
scale = D ** -0.5
q32 = jnp.asarray(rng.normal(size=(B, Tq, H, D)), jnp.float32)
k32 = jnp.asarray(rng.normal(size=(B, S, H, D)), jnp.float32)
v32 = jnp.asarray(rng.normal(size=(B, S, H, D)), jnp.float32)
lengths = jnp.asarray([S, S - 3000], jnp.int32)


def energy_cache(Z, q, k, v):
    """Sum over batch, query and head of log sum_{a < length_b} exp(q.k_a + zeta.v_a)."""
    s = scale * jnp.einsum("bqhd,bahd->bhqa", q, k) + jnp.einsum("bqhd,bahd->bhqa", Z, v)
    visible = jnp.arange(S)[None, :] < lengths[:, None]
    return jax.nn.logsumexp(jnp.where(visible[:, None, None, :], s, -jnp.inf), axis=-1).sum()


f64 = lambda x: x.astype(jnp.float64)  # noqa: E731
expected = jax.grad(energy_cache)(jnp.zeros((B, Tq, H, D)), f64(q32), f64(k32), f64(v32))

decode = jax.jit(lambda q, k, v: jsp.tree_decode(q, k, v, mesh=mesh, kv_lengths=lengths))
out = decode(q32, k32, v32)
assert out.dtype == jnp.float32 and rel_err(out, expected) < 1e-5, rel_err(out, expected)

# the gradient with respect to the queries (tree_decode's custom_vjp) against float64 autodiff
w = jnp.asarray(rng.normal(size=(B, Tq, H, D)), jnp.float32)
dq = jax.jit(jax.grad(lambda q: (decode(q, k32, v32) * w).sum()))(q32)
dq_expected = jax.grad(lambda q: (jax.grad(energy_cache)(jnp.zeros((B, Tq, H, D)), q, f64(k32), f64(v32))
                                  * f64(w)).sum())(f64(q32))
assert rel_err(dq, dq_expected) < 1e-5, rel_err(dq, dq_expected)

# bytes per device, from the compiled HLO
t = S // G
tree_report = collective_bytes(decode, q32, k32, v32)
ring = jax.jit(lambda q, k, v: jsp.ring_decode(q, k, v, mesh=mesh, kv_lengths=lengths))
ring_report = collective_bytes(ring, q32, k32, v32)
numel = B * Tq * H * D + 2 * B * Tq * H            # Eq. 13 per query: b d + 2 b n_h
assert tree_report.count_by_kind() == {"all-reduce": 2}  # the pmax and the fused psum
assert tree_report.total_bytes == round(2 * (G - 1) / G * numel * 4)        # Eq. 14
assert ring_report.total_bytes == 2 * B * t * H * D * (G - 1) * 4           # Eq. 10, p - 1 hops
assert rel_err(ring(q32, k32, v32), out) < 1e-6

mem = {}
for name, fn in (("tree", decode), ("ring", ring)):
    stats = fn.lower(q32, k32, v32).compile().memory_analysis()
    mem[name] = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
assert mem["tree"] < mem["ring"]
print(f"tree_decode vs float64 energy gradient: {rel_err(out, expected):.1e}, dq {rel_err(dq, dq_expected):.1e}")
print(f"bytes sent per device: tree {tree_report.total_bytes:,} (Eq. 14), ring {ring_report.total_bytes:,} (Eq. 10)")
print(f"compiled memory per device: tree {mem['tree'] / 1e6:.2f} MB (Eq. 9: {4 * mem_tree(B, t, H * D, H) / 1e6:.2f} MB), "
      f"ring {mem['ring'] / 1e6:.2f} MB (Eq. 8: {4 * mem_ring(B, t, H * D) / 1e6:.2f} MB)")

# %% [markdown]
# ## Summary
#
# * Attention is $\nabla_\zeta F$ at $\zeta = 0$ for the log-sum-exp energy $F$; with one source per
#   query and head, one gradient gives causal multi-head (and grouped-query) attention.
# * $F$ is a cumulant-generating function: its Hessian is the covariance of the values under the
#   attention distribution, so $F$ is convex, and the output is the stationary point of the
#   Legendre-type objective $\Gamma$.
# * log-sum-exp and max are associative, and shifting the scores does not change the gradient:
#   a sharded sequence is reduced with one `pmax` and one `psum`, which is what
#   `jax_seqpar.tree_decode` compiles to, with the traffic of Eq. 14 whatever the context length.
#
# The companion notebook `ring_and_burst.ipynb` covers training: the ring forward, the
# BurstAttention backward and causal load balance.
