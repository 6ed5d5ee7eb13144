"""What each device runs during generation (``models.generate``): the cache plan, the
prefill passes and one decode step, inside ``shard_map``.

``make_plan`` sizes the cache and the prefill passes; ``_prefill_local`` runs the passes
(ring attention, then tree attention's gathered-query form against the cache) and
``_decode_local`` one token per row (the new key/value into the shard that owns it, then
``parallel.tree_attention``, or a baseline).  ``models/generate.py``'s module docstring
says why each is so; ``Generator`` there wraps these into the compiled programs.  Both
take the parameters in either form (``models.stacking``): blocks ``layer_0`` ... or
stacked along a leading layer axis (``LlamaConfig.scan_layers``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax.numpy as jnp
from jax import lax

from jax_seqpar.layouts import permutation
from jax_seqpar.models.llama import LAYERS
from jax_seqpar.models.stacking import is_scanned, layer_params
from jax_seqpar.models.tensor_split import TensorSplit
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
              prefill_chunk: Optional[int] = None, batch_shards: int = 1) -> GenerationPlan:
    """Check the sizes and choose the prefill passes and the cache length.

    ``max_prompt_len`` is the longest row's prompt (``max(prompt_lengths)``).  The cache
    must hold every prefilled position (the prompt padded to whole passes) and the
    positions of the ``max_new_tokens - 1`` tokens that are fed back (the last one is
    returned, never attended to).  ``batch_shards``: the devices that split the batch
    (each prefills ``batch / batch_shards`` rows: the default pass budget counts those).
    """
    G = num_shards
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
    if prefill_chunk is None:
        rows = max(batch // max(batch_shards, 1), 1)
        budget = max(G, PREFILL_TOKENS_PER_DEVICE * G // rows // G * G)
        prefill_chunk = min(_round_up(prompt_len, G), budget)
    elif isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) \
            or prefill_chunk < 1 or prefill_chunk % G:
        raise ValueError(f"prefill_chunk={prefill_chunk!r} must be a positive multiple of "
                         f"the number of devices the cache is striped over ({G}: the sequence axis, "
                         f"times the tensor axis when it cannot split the heads)")
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
                             f"the cache is striped over (each holds cache_len / {G} slots); "
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

def _prefill_local(tp: TensorSplit, plan: GenerationPlan, axis, kernel, params, tokens,
                   last_pos):
    """Per device: ``tokens`` ``[b, P_pad / G]`` (this device's striped share of its
    rows' prompts), ``last_pos`` ``[b]`` (each row's last prompt position).  Returns the
    logits ``[b, V]`` after each row's last prompt token and this device's cache shards
    (``[b, cache_len / G, Hc / T, D]`` each).  ``axis``: the attention's axes, ``G``
    devices (with ``tp.heads`` False the sequence and tensor axes together; the cache
    shards are then ``[b, cache_len / G, Hkv, D]``).

    The loops, by the parameters' form (``models.stacking``):

    * **unrolled** (``layer_0`` ...): pass-major -- for each prefill pass (the first in
      Python, the others in a ``fori_loop``) the ``L`` blocks in a Python loop, each
      writing its keys/values into its own cache array.  Live: one pass's rows.
    * **stacked** (``layers``, ``LlamaConfig.scan_layers``): layer-major -- one
      ``lax.scan`` over the layers (the program holds one block, whatever the depth:
      the 7B prefill compiled for 150 s unrolled), whose body runs every pass of its
      layer (a layer's pass reads only that layer's cache, so the order of the two loops
      is free) on the residual stream of the whole prompt, kept between layers.  The
      layer's keys/values are written into a fresh ``[b, cache_len / G, Hc / T, D]``
      pair, which a ``lax.switch`` on the layer index (``L`` branches of one copy each)
      stores into that layer's own array of the carried tuple: the cache stays one
      array per layer, as decoding needs.  A scan's stacked output would be one
      ``[L, ...]`` buffer, and splitting it into per-layer arrays copies the whole cache
      (XLA cannot hand out parts of a buffer as separate arrays); a switch of a tuple of
      loop-carried arrays updates them in place.  Cost against the unrolled loop: one
      layer's cache pair and the prompt's residual stream (``[b, P_pad / G, d]``) live
      at once, and one extra write of each layer's cache shard (the copy into its
      array); each layer's weights are a dynamic slice of the stack (read in place or
      copied, one layer at a time).
    """
    p = _params(params)
    parts = tp.local_parts(p)
    c = parts.config                     # this device's heads (the whole model's without T)
    G, cl, n = plan.num_shards, plan.chunk // plan.num_shards, plan.num_chunks
    L = c.num_layers
    B = tokens.shape[0]
    slots = plan.cache_len // G
    idx = lax.axis_index(axis)
    dt = jnp.dtype(c.dtype)
    kv_pos = (jnp.arange(slots, dtype=jnp.int32) * G + idx).astype(jnp.int32)
    chunk_perm = jnp.asarray(permutation("striped", plan.chunk, G), jnp.int32)
    zeros = jnp.zeros((B, slots, c.num_kv_heads, c.head_dim), dt)

    def block_pass(lp, x, i, kc, vc, first: bool):
        """One block (parameters ``lp``) on pass ``i``'s rows ``x`` ``[b, cl, d]``: their
        keys/values written into the layer's cache shards ``kc``, ``vc`` at the pass's
        slots, then attention -- ring attention over the pass's own tokens (``first``),
        else the gathered queries against the layer's cache.  ``-> (x, kc, vc)``."""
        start = i * cl
        pos = ((start + jnp.arange(cl)) * G + idx).astype(jnp.int32)     # [cl]
        written = []

        def attend(q, k, v):
            kw = lax.dynamic_update_slice_in_dim(kc, k, start, axis=1)
            vw = lax.dynamic_update_slice_in_dim(vc, v, start, axis=1)
            written.append((kw, vw))
            cfg = make_config(q, k, axis_name=axis, causal=True, window=c.window,
                              segment_ids=None, scale=None, layout="striped",
                              backward="kv", kernel=kernel)
            if first:
                return ring_attention_with_config(cfg, q, k, v)
            o, _ = gathered_query_attention(cfg, q, kw, vw, i * plan.chunk + chunk_perm,
                                            kv_pos)
            return o
        x = tp.block(parts, lp, x, pos, attend, own_rows=tp.rows_split)
        return (x,) + written[0]

    def last_rows(x, first_row, h_last):
        """``h_last`` with each row's last prompt position taken from ``x`` (local slots
        ``first_row ..``) where this device holds it there."""
        r = last_pos // G - first_row
        own = (last_pos % G == idx) & (r >= 0) & (r < x.shape[1])
        h = x[jnp.arange(B), jnp.clip(r, 0, x.shape[1] - 1)].astype(F32)  # [B, d]
        return jnp.where(own[:, None], h, h_last)

    h_last = jnp.zeros((B, c.d_model), F32)
    cache = (tuple(zeros for _ in range(L)), tuple(zeros for _ in range(L)))
    if is_scanned(p):
        cache, h_last = _prefill_layer_major(tp, parts, p, tokens, cl, n, cache,
                                             block_pass, last_rows, h_last)
    else:
        def run_pass(i, cache, h_last, first: bool):
            ks, vs = list(cache[0]), list(cache[1])
            toks = lax.dynamic_slice_in_dim(tokens, i * cl, cl, axis=1)
            x = tp.embed(parts, p, toks, own_rows=tp.rows_split)
            for layer in range(L):
                x, ks[layer], vs[layer] = block_pass(layer_params(p, layer), x, i, ks[layer],
                                                     vs[layer], first)
            return (tuple(ks), tuple(vs)), last_rows(x, i * cl, h_last)

        cache, h_last = run_pass(0, cache, h_last, first=True)
        if n > 1:
            cache, h_last = lax.fori_loop(
                1, n, lambda i, s: run_pass(i, *s, first=False), (cache, h_last))
    h_last = lax.psum(h_last, axis)       # one device holds each row's: exact
    return tp.logits(parts, p, h_last.astype(dt)[:, None])[:, 0], cache


def _prefill_layer_major(tp: TensorSplit, parts, p, tokens, cl, n, cache, block_pass,
                         last_rows, h_last):
    """``_prefill_local``'s loops over stacked blocks: one ``lax.scan`` over the layers,
    every pass of a layer inside it, each layer's cache stored into its own array by a
    ``lax.switch`` (``_prefill_local``'s docstring says why)."""
    L = parts.config.num_layers
    x = tp.embed(parts, p, tokens, own_rows=tp.rows_split)              # [b, P_pad / G, d]

    def store(j, ks, vs, kc, vc):       # layer j's shards into the j-th arrays
        return ks[:j] + (kc,) + ks[j + 1:], vs[:j] + (vc,) + vs[j + 1:]

    def one_layer(carry, xs):
        x, ks, vs = carry
        lp, layer = xs
        fresh = jnp.zeros_like(ks[0])
        out, kc, vc = block_pass(lp, x[:, :cl], 0, fresh, fresh, first=True)
        x = lax.dynamic_update_slice_in_dim(x, out, 0, axis=1)
        if n > 1:
            def later(i, s):
                x, kc, vc = s
                out, kc, vc = block_pass(lp, lax.dynamic_slice_in_dim(x, i * cl, cl, axis=1),
                                         i, kc, vc, first=False)
                return lax.dynamic_update_slice_in_dim(x, out, i * cl, axis=1), kc, vc
            x, kc, vc = lax.fori_loop(1, n, later, (x, kc, vc))
        ks, vs = lax.switch(layer, [functools.partial(store, j) for j in range(L)],
                            ks, vs, kc, vc)
        return (x, ks, vs), None

    (x, ks, vs), _ = lax.scan(one_layer, (x, *cache),
                              (p[LAYERS], jnp.arange(L, dtype=jnp.int32)))
    return (ks, vs), last_rows(x, 0, h_last)


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


def _decode_local(tp: TensorSplit, plan: GenerationPlan, axis, kernel, strategy, params,
                  tok, pos, cache):
    """Per device, one decode step: ``tok``, ``pos`` ``[b]`` (this device's rows,
    replicated over the sequence and tensor axes) -> logits ``[b, V]`` (the same) and the
    cache shards with the new keys/values written.  ``axis``: the attention's axes (with
    ``tp.heads`` False the sequence and tensor axes together: the query rows, replicated
    over both, attend to the cache split over both).

    The layers are a Python loop, one cache array each, in both parameter forms; stacked
    weights are read as static slices ``w[layer]`` (``stacking.layer_params``).  Whether
    XLA reads those slices in place inside the decode ``while_loop``, copies them at
    every step or hoists them out of the loop (a second copy of the weights) is for a
    GPU to say: ``benchmarks/generate.py --scan-layers both`` times both forms and
    reports each decode program's temporary bytes.  (XLA:CPU, JAX 0.11.2, copies every
    layer's slice at every step: the decode program's temporaries grow by about the
    blocks' weights, against none for the unrolled form.)"""
    p = _params(params)
    parts = tp.local_parts(p)
    c = parts.config
    G, B = plan.num_shards, tok.shape[0]
    slots = plan.cache_len // G
    idx = lax.axis_index(axis)
    own = (pos % G) == idx
    slot = jnp.clip(pos // G, 0, slots - 1)
    rows = jnp.arange(B)
    ks, vs = list(cache[0]), list(cache[1])

    def shard_positions(j):                      # striped: slot s of device j is s*G + j
        return (jnp.arange(slots, dtype=jnp.int32) * G + j).astype(jnp.int32)

    x = tp.embed(parts, p, tok[:, None])                                # [B, 1, d]
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
        x = tp.block(parts, layer_params(p, layer), x, pos[:, None], attend)
    return tp.logits(parts, p, x)[:, 0], (tuple(ks), tuple(vs))
