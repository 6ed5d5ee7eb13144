"""Generation with a sequence-sharded KV cache: ring-attention prefill, tree-attention decode.

``generate(model, params, prompts, max_new_tokens=...)`` runs a ``models.Llama`` forward
over the prompt, then one token at a time, with the key/value cache of every layer split
along the sequence over ``mesh[axis_name]`` for its whole life (never gathered):

* **Cache placement: striped.**  Token ``t`` lives on device ``t mod G`` at local slot
  ``t // G`` (``layouts``' ``"striped"`` layout of the cache).  Decoding appends one token
  per step per row; under striping consecutive tokens go to consecutive devices, so every
  shard fills evenly whatever the prompt lengths, and every device reads the same share
  of the cache per step (a contiguous cache would put all new tokens, and the whole
  attention of short prompts, on one device).  The same placement makes the prefill
  free of data movement: the prompt is permuted into the striped layout once, and each
  device's rows of a prefill pass are exactly the cache slots it owns.
* **Prefill** (``prefill_chunk`` tokens per pass, all of the prompt by default when it
  fits the per-device budget): the first pass is the library's ring attention
  (``parallel.ring_attention``, causal, striped layout) over the pass's tokens; each
  later pass writes its keys/values into the cache and attends its queries to the whole
  cache with tree attention's gathered-query form (``parallel.tree
  .gathered_query_attention``: the pass's queries are all-gathered, each device attends
  them to its own cache shard, and one ``pmax`` and one ``psum_scatter`` return its
  rows -- traffic independent of the cache length; a ring here would circulate the cache
  itself, once per pass).  Cache slots not written yet hold positions after every query,
  so the causal mask hides them.
* **Decode**: per step and layer, the new key/value is written into the one shard that
  owns its position (an in-place scatter, guarded by ``pos mod G == device``), then the
  replicated query attends to every shard with ``parallel.tree_attention`` (the local
  decode kernel, one ``pmax``, one fused ``psum``: Tree Attention Alg. 3, Eq. 10-14).
  The loop over new tokens is one ``lax.while_loop`` inside one ``jax.jit``; the host
  sees tokens only at the end, unless ``callback`` streams them.

Ragged prompts: ``prompts [B, P]`` is right-padded and row ``b``'s prompt is
``prompts[b, :prompt_lengths[b]]``.  Every row prefills ``P`` positions; the padding's
keys sit at positions after the row's prompt, where the causal mask hides them from the
prompt, and decoding overwrites them one by one (row ``b``'s first new token goes to
position ``prompt_lengths[b]``), always attending only to positions ``<=`` its own.

The cache of each layer is its own array (a tuple of ``num_layers`` ``[B, cache_len,
Hkv, D]`` buffers for keys and one for values), not slices of one stacked
``[layers, ...]`` array: the decode kernel then reads each layer's buffer in place,
where a slice of a stacked buffer would be copied for the kernel call every step.

Parameters are used replicated (every device computes the projections and the MLP of
the few new tokens, as tree decoding requires); FSDP-sharded parameters are gathered
once, before the loop.  ``mesh=None`` uses ``model.mesh``, or one device.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_seqpar.runtime import _compat
from jax_seqpar.decode import decode_kernel_name
from jax_seqpar.layouts import permutation
from jax_seqpar.models.llama import Llama, LlamaConfig, LlamaParts
from jax_seqpar.models.sampling import check_sampling, sample_logits
from jax_seqpar.parallel.common import make_config, ring_shift
from jax_seqpar.parallel.merge import merge
from jax_seqpar.parallel.ring import ring_attention_with_config
from jax_seqpar.parallel.tree import gathered_query_attention, tree_attention

F32 = jnp.float32
#: Default prefill pass: at most this many tokens per device (times the batch).
PREFILL_TOKENS_PER_DEVICE = 16384
#: The default cache holds a multiple of this many slots per device (the decode kernels'
#: key blocks divide it); shards shorter than that are rounded to 8 slots.
CACHE_ALIGN = 128


# ----------------------------------------------------------------------------- the plan

@dataclasses.dataclass(frozen=True)
class GenerationPlan:
    """Static shapes of one ``generate`` call (hashable: one compiled program each)."""

    batch: int
    prompt_len: int      # P, the prompts' padded width
    chunk: int           # tokens per prefill pass (a multiple of num_shards)
    num_chunks: int
    cache_len: int       # a multiple of num_shards, >= num_chunks * chunk
    num_shards: int
    max_new_tokens: int

    @property
    def padded_len(self) -> int:
        return self.chunk * self.num_chunks


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def make_plan(batch: int, prompt_len: int, max_new_tokens: int, num_shards: int, *,
              max_prompt_len: int, cache_len: Optional[int] = None,
              prefill_chunk: Optional[int] = None) -> GenerationPlan:
    """Check the sizes and choose the prefill passes and the cache length.

    ``max_prompt_len`` is the longest row's prompt (``max(prompt_lengths)``).  The cache
    must hold every prefilled position (the prompt padded to whole passes) and the
    positions of the ``max_new_tokens - 1`` tokens that are fed back (the last one is
    returned, never attended to).
    """
    G = num_shards
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
    if prefill_chunk is None:
        budget = max(G, PREFILL_TOKENS_PER_DEVICE * G // max(batch, 1) // G * G)
        prefill_chunk = min(_round_up(prompt_len, G), budget)
    elif isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) \
            or prefill_chunk < 1 or prefill_chunk % G:
        raise ValueError(f"prefill_chunk={prefill_chunk!r} must be a positive multiple of "
                         f"the number of devices along the sequence axis ({G})")
    num_chunks = -(-prompt_len // prefill_chunk)
    padded = num_chunks * prefill_chunk
    need = max(padded, max_prompt_len + max_new_tokens - 1)
    if cache_len is None:
        # Whole key blocks per device: a decode kernel pads a shard whose length is not a
        # multiple of its key block, i.e. copies the layer's cache at every step (on an
        # H200, 7B at 128k: 19.2 ms per token with 131135 slots).
        per_device = -(-need // G)
        cache_len = G * _round_up(per_device, CACHE_ALIGN if per_device > CACHE_ALIGN else 8)
    else:
        if isinstance(cache_len, bool) or not isinstance(cache_len, int) or cache_len < 1:
            raise ValueError(f"cache_len={cache_len!r} must be a positive int or None")
        if cache_len % G:
            raise ValueError(f"cache_len={cache_len} must be divisible by the {G} devices "
                             f"along the sequence axis (each holds cache_len / {G} slots); "
                             f"try cache_len={_round_up(cache_len, G)}")
        if prompt_len > cache_len:
            raise ValueError(f"the prompts ({prompt_len} tokens wide) are longer than "
                             f"cache_len={cache_len}")
        if max_prompt_len + max_new_tokens - 1 > cache_len:
            raise ValueError(f"cache_len={cache_len} has no room for max_new_tokens="
                             f"{max_new_tokens} after the longest prompt "
                             f"({max_prompt_len} tokens): it needs "
                             f"{max_prompt_len + max_new_tokens - 1}")
        if padded > cache_len:
            raise ValueError(f"the prompt padded to whole prefill passes ({num_chunks} x "
                             f"{prefill_chunk} = {padded} tokens) exceeds cache_len="
                             f"{cache_len}; raise cache_len or choose a prefill_chunk "
                             f"that divides the prompt width more tightly")
    return GenerationPlan(batch=batch, prompt_len=prompt_len, chunk=prefill_chunk,
                          num_chunks=num_chunks, cache_len=cache_len, num_shards=G,
                          max_new_tokens=max_new_tokens)


def _params(params):
    return params["params"] if "params" in params else params


# ------------------------------------------------------------------ per-device programs

def _prefill_local(parts: LlamaParts, plan: GenerationPlan, axis, kernel, params, tokens,
                   last_pos):
    """Per device: ``tokens`` ``[B, P_pad / G]`` (this device's striped share of the
    prompt), ``last_pos`` ``[B]`` (each row's last prompt position).  Returns the logits
    ``[B, V]`` after each row's last prompt token and this device's cache shards."""
    c, p = parts.config, _params(params)
    G, B, cl = plan.num_shards, plan.batch, plan.chunk // plan.num_shards
    slots = plan.cache_len // G
    idx = lax.axis_index(axis)
    dt = jnp.dtype(c.dtype)
    kv_pos = (jnp.arange(slots, dtype=jnp.int32) * G + idx).astype(jnp.int32)
    chunk_perm = jnp.asarray(permutation("striped", plan.chunk, G), jnp.int32)
    zeros = jnp.zeros((B, slots, c.num_kv_heads, c.head_dim), dt)
    cache = (tuple(zeros for _ in range(c.num_layers)),
             tuple(zeros for _ in range(c.num_layers)))

    def cfg_for(q, k):
        return make_config(q, k, axis_name=axis, causal=True, window=c.window,
                           segment_ids=None, scale=None, layout="striped", backward="kv",
                           kernel=kernel)

    def run_chunk(i, cache, h_last, first: bool):
        ks, vs = list(cache[0]), list(cache[1])
        start = i * cl
        toks = lax.dynamic_slice_in_dim(tokens, start, cl, axis=1)
        pos = ((start + jnp.arange(cl)) * G + idx).astype(jnp.int32)   # [cl]
        x = parts.embed(p, toks)
        for layer in range(c.num_layers):
            def attend(q, k, v, layer=layer):
                ks[layer] = lax.dynamic_update_slice_in_dim(ks[layer], k, start, axis=1)
                vs[layer] = lax.dynamic_update_slice_in_dim(vs[layer], v, start, axis=1)
                cfg = cfg_for(q, k)
                if first:          # the pass's own tokens: ring attention
                    return ring_attention_with_config(cfg, q, k, v)
                q_pos_all = i * plan.chunk + chunk_perm
                o, _ = gathered_query_attention(cfg, q, ks[layer], vs[layer], q_pos_all,
                                                kv_pos)
                return o
            x = parts.block(p[f"layer_{layer}"], x, pos, attend)
        own = (last_pos % G == idx) & (last_pos // plan.chunk == i)
        j = jnp.clip(last_pos // G - start, 0, cl - 1)
        h = x[jnp.arange(B), j].astype(F32)                            # [B, d]
        h_last = jnp.where(own[:, None], h, h_last)
        return (tuple(ks), tuple(vs)), h_last

    h_last = jnp.zeros((B, c.d_model), F32)
    cache, h_last = run_chunk(0, cache, h_last, first=True)
    if plan.num_chunks > 1:
        cache, h_last = lax.fori_loop(
            1, plan.num_chunks, lambda i, s: run_chunk(i, *s, first=False), (cache, h_last))
    h_last = lax.psum(h_last, axis)       # one device holds each row's: exact
    return parts.logits(p, h_last.astype(dt)[:, None])[:, 0], cache


DECODE_STRATEGIES = ("tree", "ring", "allgather")


def _cache_attention(strategy, cfg, axis, G, q, k, v, q_pos, shard_positions):
    """Replicated queries against the cache shards: ``tree`` (Tree Attention Alg. 3: local
    kernel, one ``pmax``, one fused ``psum``) or, as baselines of the same step, ``ring``
    (the shards circulate, G - 1 hops) and ``allgather`` (every device gathers the
    cache).  ``shard_positions(j)``: the positions held by device ``j``'s shard."""
    idx = lax.axis_index(axis)
    if strategy == "tree":
        return tree_attention(cfg, q, k, v, q_pos, shard_positions(idx))
    if strategy == "allgather":
        k_all = lax.all_gather(k, axis, axis=1, tiled=True)
        v_all = lax.all_gather(v, axis, axis=1, tiled=True)
        pos_all = jnp.concatenate([shard_positions(j) for j in range(G)])
        return cfg.kernel.fwd(q, k_all, v_all, q_pos, pos_all, cfg.mask,
                              cfg.scale)[0].astype(q.dtype)
    o = jnp.zeros(q.shape, F32)
    lse = jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf, F32)
    block = (k, v)
    for step in range(G):
        nxt = ring_shift(block, axis, G) if step < G - 1 else None
        o_s, lse_s = cfg.kernel.fwd(q, block[0], block[1], q_pos,
                                    shard_positions((idx - step) % G), cfg.mask, cfg.scale)
        o, lse = merge(o, lse, o_s.astype(F32), lse_s)
        block = nxt
    return o.astype(q.dtype)


def _decode_local(parts: LlamaParts, plan: GenerationPlan, axis, kernel, strategy, params,
                  tok, pos, cache):
    """Per device, one decode step: ``tok``, ``pos`` ``[B]`` (replicated) -> logits
    ``[B, V]`` (replicated) and the cache shards with the new keys/values written."""
    c, p = parts.config, _params(params)
    G, B = plan.num_shards, plan.batch
    slots = plan.cache_len // G
    idx = lax.axis_index(axis)
    own = (pos % G) == idx
    slot = jnp.clip(pos // G, 0, slots - 1)
    rows = jnp.arange(B)
    ks, vs = list(cache[0]), list(cache[1])

    def shard_positions(j):                      # striped: slot s of device j is s*G + j
        return (jnp.arange(slots, dtype=jnp.int32) * G + j).astype(jnp.int32)

    x = parts.embed(p, tok[:, None])                                    # [B, 1, d]
    for layer in range(c.num_layers):
        def attend(q, k, v, layer=layer):
            for buf, new in ((ks, k), (vs, v)):
                old = buf[layer][rows, slot]                            # [B, Hkv, D]
                buf[layer] = buf[layer].at[rows, slot].set(
                    jnp.where(own[:, None, None], new[:, 0], old))
            cfg = make_config(q, k, axis_name=axis, causal=True, window=c.window,
                              segment_ids=None, scale=None, layout="contiguous",
                              backward="kv", kernel=kernel)
            return _cache_attention(strategy, cfg, axis, G, q, ks[layer], vs[layer],
                                    pos[:, None], shard_positions)
        x = parts.block(p[f"layer_{layer}"], x, pos[:, None], attend)
    return parts.logits(p, x)[:, 0], (tuple(ks), tuple(vs))


# ------------------------------------------------------------------- compiled programs

@dataclasses.dataclass(frozen=True)
class Generator:
    """The compiled prefill and decode programs of one (model, mesh, plan, sampling).

    ``prefill(params, prompts, prompt_lengths) -> (logits [B, V], cache)`` and
    ``decode(callback)(params, first_logits, prompt_lengths, cache, rng) -> (tokens
    [B, N], cache)``; the
    cache is ``(keys, values)``, tuples of one ``[B, cache_len, Hkv, D]`` array per layer,
    sharded along the sequence (striped placement).  ``generate`` runs both; benchmarks
    time them apart.
    """

    config: LlamaConfig
    mesh: Mesh
    axis_name: str
    plan: GenerationPlan
    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    eos_id: Optional[int] = None
    kernel: str = "auto"
    decode_kernel: str = "auto"
    decode_strategy: str = "tree"

    @property
    def parts(self) -> LlamaParts:
        return LlamaParts(self.config)

    def cache_spec(self):
        seq = NamedSharding(self.mesh, P(None, self.axis_name))
        return tuple((seq,) * self.config.num_layers for _ in range(2))

    def replicate(self, params):
        """``params`` replicated on every device of the mesh (a no-op when they are)."""
        return jax.device_put(params, NamedSharding(self.mesh, P()))

    @functools.cached_property
    def prefill(self):
        plan, axis, mesh = self.plan, self.axis_name, self.mesh
        perm = jnp.asarray(permutation("striped", plan.padded_len, plan.num_shards))
        seq, rep = P(None, axis), P()
        L = self.config.num_layers
        local = functools.partial(_prefill_local, self.parts, plan, axis, self.kernel)

        def run(params, prompts, lengths):
            pad = plan.padded_len - prompts.shape[1]
            toks = jnp.pad(prompts.astype(jnp.int32), ((0, 0), (0, pad)))
            toks = jnp.take(toks, perm, axis=1)                         # striped order
            smap = _compat.shard_map(
                local, mesh=mesh, check_vma=False,
                in_specs=(jax.tree.map(lambda _: rep, params), seq, rep),
                out_specs=(rep, ((seq,) * L, (seq,) * L)))
            return smap(params, _compat.place(toks, mesh, seq),
                        lengths.astype(jnp.int32) - 1)
        return jax.jit(run)

    def decode(self, callback=None):
        """The decode program (jitted once per ``callback``): ``(params, first_logits,
        prompt_lengths, cache, rng) -> (tokens [B, N], cache)``; the cache is donated and
        updated in place."""
        return _decode_program(self, callback)

    @functools.cached_property
    def step(self):
        """One decode step over the whole mesh (``shard_map`` of ``_decode_local``):
        ``(params, tokens [B], positions [B], cache) -> (logits [B, V], cache)``.  Jit it
        to read its program (``comm.collective_bytes``: per layer one ``pmax`` and one
        ``psum``)."""
        plan, axis, cfg = self.plan, self.axis_name, self.config
        seq, rep = P(None, axis), P()
        L = cfg.num_layers
        kernel = self.decode_kernel
        if kernel == "auto":
            probe = jnp.zeros((1, 1, cfg.num_heads, cfg.head_dim), cfg.dtype)
            kernel = decode_kernel_name("auto", probe)
        local = functools.partial(_decode_local, self.parts, plan, axis, kernel,
                                  self.decode_strategy)

        def step(params, tok, pos, cache):
            smap = _compat.shard_map(
                local, mesh=self.mesh, check_vma=False,
                in_specs=(jax.tree.map(lambda _: rep, params), rep, rep,
                          ((seq,) * L, (seq,) * L)),
                out_specs=(rep, ((seq,) * L, (seq,) * L)))
            return smap(params, tok, pos, cache)
        return step

    def _decode_program(self, callback):
        plan = self.plan
        N, B = plan.max_new_tokens, plan.batch
        eos = -1 if self.eos_id is None else int(self.eos_id)
        fill = 0 if self.eos_id is None else eos
        sample = functools.partial(sample_logits, temperature=self.temperature,
                                   top_k=self.top_k, top_p=self.top_p)
        step_fn = self.step

        def run(params, first_logits, lengths, cache, rng, callback_token):
            lengths = lengths.astype(jnp.int32)
            first = sample(first_logits, jax.random.fold_in(rng, 0))
            out = jnp.full((B, N), fill, jnp.int32).at[:, 0].set(first)
            done = first == eos
            if callback_token is not None:
                callback_token(jnp.int32(0), first)

            def cond(state):
                step, _, done, _, _ = state
                return (step < N) & ~jnp.all(done)

            def body(state):
                step, tok, done, out, cache = state
                logits, cache = step_fn(params, tok, lengths + step - 1, cache)
                new = sample(logits, jax.random.fold_in(rng, step))
                new = jnp.where(done, fill, new)
                out = lax.dynamic_update_slice_in_dim(out, new[:, None], step, axis=1)
                if callback_token is not None:
                    callback_token(step, new)
                return step + 1, new, done | (new == eos), out, cache

            state = (jnp.int32(1), first, done, out, cache)
            _, _, _, out, cache = lax.while_loop(cond, body, state)
            return out, cache

        def stream(step, toks):      # once per step, in order, on the host
            io_callback(lambda s, t: callback(int(s), np.asarray(t)), None, step, toks,
                        ordered=True)
        return jax.jit(lambda *a: run(*a, None if callback is None else stream),
                       donate_argnums=(3,))


@functools.lru_cache(maxsize=32)
def _decode_program(gen: Generator, callback):
    return gen._decode_program(callback)


@functools.lru_cache(maxsize=32)
def _generator(*args) -> Generator:
    return Generator(*args)


# ----------------------------------------------------------------------------- the API

def _check_prompts(prompts, prompt_lengths):
    prompts = jnp.asarray(prompts)
    if prompts.ndim != 2 or not jnp.issubdtype(prompts.dtype, jnp.integer):
        raise ValueError(f"prompts must be integer token ids [batch, prompt_len]; got "
                         f"{prompts.dtype} {prompts.shape}")
    B, P_ = prompts.shape
    if B < 1 or P_ < 1:
        raise ValueError(f"prompts.shape={prompts.shape} must have at least one row and "
                         f"one token")
    if prompt_lengths is None:
        return prompts, np.full((B,), P_, np.int32)
    lengths = np.asarray(prompt_lengths)
    if lengths.shape != (B,):
        raise ValueError(f"prompt_lengths must have shape [batch] = {(B,)} like prompts; "
                         f"got {lengths.shape}")
    if not np.issubdtype(lengths.dtype, np.integer):
        raise TypeError(f"prompt_lengths.dtype={lengths.dtype} must be an integer dtype")
    bad = np.flatnonzero((lengths < 1) | (lengths > P_))
    if bad.size:
        raise ValueError(f"prompt_lengths={lengths.tolist()} must lie in [1, {P_}] (the "
                         f"prompts' width); rows {bad.tolist()} do not")
    return prompts, lengths.astype(np.int32)


def _resolve_mesh(model, mesh, axis_name):
    if mesh is None:
        mesh = model.mesh
    if mesh is None:
        return Mesh(np.asarray(jax.devices()[:1]), (axis_name,))
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got "
                        f"{type(mesh).__name__}")
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh "
                         f"(mesh.axis_names={mesh.axis_names})")
    return mesh


def generator_for(model: Llama, prompts_shape, max_new_tokens: int, *, mesh=None,
                  axis_name: str = "sp", max_prompt_len: Optional[int] = None,
                  temperature: float = 0.0, top_k=None, top_p=None, eos_id=None,
                  cache_len=None, prefill_chunk=None, kernel="auto",
                  decode_kernel="auto", decode_strategy="tree") -> Generator:
    """The ``Generator`` (compiled programs) that ``generate`` would use;
    ``decode_strategy="ring"`` / ``"allgather"`` decode with the baselines instead of
    tree attention (for comparisons: the same cache, the same step otherwise)."""
    if decode_strategy not in DECODE_STRATEGIES:
        raise ValueError(f"unknown decode_strategy={decode_strategy!r}; choose one of "
                         f"{DECODE_STRATEGIES}")
    if not isinstance(model, Llama):
        raise TypeError(f"model must be a jax_seqpar.models.Llama, got "
                        f"{type(model).__name__}")
    check_sampling(temperature, top_k, top_p)
    if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(eos_id, int)
                               or not 0 <= eos_id < model.config.vocab_size):
        raise ValueError(f"eos_id={eos_id!r} must be a token id in [0, "
                         f"{model.config.vocab_size}) or None")
    mesh = _resolve_mesh(model, mesh, axis_name)
    B, P_ = prompts_shape
    plan = make_plan(B, P_, max_new_tokens, mesh.shape[axis_name],
                     max_prompt_len=P_ if max_prompt_len is None else max_prompt_len,
                     cache_len=cache_len, prefill_chunk=prefill_chunk)
    return _generator(model.config, mesh, axis_name, plan, float(temperature), top_k,
                      None if top_p is None else float(top_p), eos_id, kernel,
                      decode_kernel, decode_strategy)


def generate(model: Llama, params, prompts, *, max_new_tokens: int, mesh: Optional[Mesh] = None,
             axis_name: str = "sp", prompt_lengths=None, temperature: float = 0.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None,
             eos_id: Optional[int] = None, rng=None, cache_len: Optional[int] = None,
             callback: Optional[Callable] = None, prefill_chunk: Optional[int] = None,
             kernel="auto", decode_kernel="auto"):
    """Generate ``max_new_tokens`` tokens after each prompt; returns int32 ``[B, N]``.

    Args:
      model, params: a ``models.Llama`` and its parameters (``model.init`` or
        ``models.hf.load_pretrained``); the model's own mesh and layout are not used.
      prompts: int ``[B, P]``, right-padded; ``prompt_lengths`` ``[B]`` (default: all
        ``P``) says where each row's prompt ends.  Row ``b``'s first new token follows
        ``prompts[b, prompt_lengths[b] - 1]``.
      mesh, axis_name: the KV cache is sharded over ``mesh[axis_name]`` (module
        docstring); ``mesh=None``: ``model.mesh``, or one device.
      temperature, top_k, top_p, rng: sampling (``models.sampling``); ``temperature=0``
        is greedy.  The same ``rng`` gives the same tokens.
      eos_id: a row stops at this token; its later positions are filled with ``eos_id``
        (the loop ends when every row has stopped).
      cache_len: the cache's length (default: the padded prompt plus the new tokens,
        rounded up to whole ``CACHE_ALIGN`` slots per device); must be divisible by the number of
        devices, and should leave each device a multiple of the decode kernel's key block
        (``pallas_decode``: 64), which otherwise copies the cache at every step.
      callback: ``callback(step, tokens)`` (an int and a NumPy ``[B]`` array) on the host
        for every new token, in order, once per step whatever the number of devices
        (streaming costs one host round trip per token).
      prefill_chunk: tokens per prefill pass (a multiple of the devices; default: the
        whole prompt, up to ``PREFILL_TOKENS_PER_DEVICE`` tokens per device and row).
      kernel, decode_kernel: local kernels of the prefill (training kernels, ``"auto"``)
        and of the decode steps (``"auto"``: ``decode.decode_kernel_name``).
    """
    prompts, lengths = _check_prompts(prompts, prompt_lengths)
    gen = generator_for(model, prompts.shape, max_new_tokens, mesh=mesh, axis_name=axis_name,
                        max_prompt_len=int(lengths.max()), temperature=temperature,
                        top_k=top_k, top_p=top_p, eos_id=eos_id, cache_len=cache_len,
                        prefill_chunk=prefill_chunk, kernel=kernel,
                        decode_kernel=decode_kernel)
    if rng is None:
        rng = jax.random.key(0)
    lengths = jnp.asarray(lengths)
    params = gen.replicate(params)
    logits, cache = gen.prefill(params, prompts, lengths)
    return gen.decode(callback)(params, logits, lengths, cache, rng)[0]


__all__ = ["DECODE_STRATEGIES", "GenerationPlan", "Generator", "LlamaParts", "generate", "generator_for",
           "make_plan"]
