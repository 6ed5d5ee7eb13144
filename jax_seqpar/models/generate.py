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

Stopping (``models.stopping``): by default at the model's ``config.eos_token_ids``, as
transformers does; the token loop ends once every row has stopped.

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

**Scanned parameters** (``LlamaConfig(scan_layers=True)``, issue 39): the blocks may come
in either form (``models.stacking``: ``layer_0`` ... or one ``layers`` subtree stacked
along a leading layer axis that no mesh axis splits), whatever the model's
``scan_layers``; the same numbers give the same tokens, and the cache is one array per
layer in both.  Over stacked blocks the prefill is one ``lax.scan`` over the layers
(compiled once, whatever the depth; ``generate_local._prefill_local`` says how each
layer's cache gets its own array, and what it costs).  The decode loop runs on the
blocks unstacked (``Generator.decode_params``: one copy of the block weights, made once,
after the prefill, and held for the call): read as static slices of the stack inside the
``while_loop``, XLA copied every layer's weights at every token (7B, 128k prompt, one
H200: 14.45 ms per token against 8.67 unrolled, 62% and 95% of the HBM floor;
``benchmarks/compile_time.py``), and the stack cannot be handed out as per-layer arrays
without a copy.  The prefill over the stack compiled in 9.6 s against 117.8 s unrolled,
at the same speed (13.48k vs 13.54k tokens/s).

**N-D meshes** (``Llama(config, mesh=mesh, parallelism=par)``, issue 38): ``generate``
runs on the model's mesh with every role at work, all of it in one ``shard_map`` over
the whole mesh whose collectives name one role each:

* **batch** (``par.batch_axes``: data, then fsdp): each device holds and computes only
  its own prompt rows; no collective names these axes.
* **sequence**: as above -- the prompt and the cache striped over it, ring attention in
  the prefill's first pass, the gathered-query passes after it and the tree reduction
  (one ``pmax``, one ``psum``) at every decode step, all over the sequence axes only
  (per device the same code as ``api.attention`` / ``decode.tree_decode`` with
  ``batch_axis`` and ``head_axis``).
* **tensor** (Megatron-LM, Shoeybi et al. 2019 §3): the weights stay split as the
  model's ``param_shardings`` split them over the tensor axes (the fsdp / sequence
  splits of their ``embed`` dimension are gathered once, before the loop, as above):
  q / k / v, gate and up by output, o and down by input, the embedding and the LM head
  by vocabulary.  Each device reads only its slice at every token: its query heads
  (``Hq / T``), its kv heads, ``ffn / T`` MLP units and ``V / T`` vocabulary rows.
  The row-split projections (o, down) end in one ``psum`` over the tensor axes each
  (their biases added after it, once); the vocab-split embedding looks up the ids in
  its range and one ``psum`` assembles the rows; the LM head's ``V / T`` logits are
  ``all_gather``-ed (what sampling needs; Megatron's inference gathers them too).
  Dimensions the tensor axes do not divide stay whole (the model's rule), and the
  device computes them whole, without a collective.
* **The cache** of each layer is ``[B, cache_len, Hc, D]``, sharded
  ``P(batch axes, sequence, tensor, None)``: each device holds ``B / Db`` rows, a
  ``1 / G`` stripe of the positions and ``Hc / T`` kv heads -- those of its own query
  heads.  ``Hc = Hkv`` when the tensor axes divide the kv heads; when they do not, the
  kv heads are *stored repeated*, ``Hc = Hkv * r`` with ``r = T / gcd(Hkv, T)``
  (``sharding.specs.kv_head_repeats``: only as far as needed), each device computing
  only its own ``Hc / T = Hkv / gcd(Hkv, T)`` heads of k and v (the k / v weights are
  whole on every device then, and it slices the heads it needs before projecting).
  The other choice, the original ``Hkv`` heads replicated over the tensor axes, holds
  ``Hkv`` heads per device: ``gcd(Hkv, T)`` times the bytes of the repeated layout
  (equal only when ``gcd = 1``, e.g. MQA), and decoding, which reads the whole local
  cache at every token, would read that much more too (or gather its heads out of
  it).  Per device and layer the cache takes ``2 * (B / Db) * (cache_len / G) *
  (Hc / T) * D`` elements; over the mesh ``Hc / T <= Hkv`` heads a device, never more
  than the model has.

Bytes per decode step (one new token per row; ``collective_bytes`` conventions: an
all-reduce of ``n`` bytes sends ``2 (N - 1) / N * n``, an all-gather ``(N - 1) * n``),
per device, with ``b = B / Db`` local rows, ``s`` the activation dtype's bytes, ``L``
layers, ``G`` / ``T`` devices along the sequence / tensor axes:

* sequence, per layer: ``2 (G - 1) / G * 4 * b * (Hq / T) * (D + 2)`` (the ``pmax`` of
  ``lse`` ``[b, Hq / T, 1]`` and the fused ``psum`` of ``[b, 1, Hq / T, D + 1]``, float32:
  Tree Attention Eq. 10-14 on the local heads);
* tensor, per layer: ``2 * 2 (T - 1) / T * b * d * s`` (the o and down ``psum`` of
  ``[b, 1, d]``); per token on top: ``2 (T - 1) / T * b * d * s`` (the embedding's
  ``psum``) and ``(T - 1) / T * b * V * 4`` (the float32 logits' ``all_gather``).  The
  down ``psum`` is there when the tensor axes split the MLP, the embedding's and the
  logits' when they split the vocabulary (else those weights are whole on each device);
* batch axes: nothing in the step.  Around it, the loop's stop test with end-of-sequence
  ids (every row done?) is one all-reduce of one byte over the batch axes per token;
  without them (``eos_id=None``, or a model with no ``eos_token_ids``) there is none.

**Heads the tensor axes cannot split** (``Llama.heads_split`` False: ``Hq % T != 0``,
e.g. SmolLM2's 9 query / 3 kv heads on a tensor axis of 2).  As the training model does
(``Llama.attention_par``, ``Parallelism.tensor_as_sequence``), attention runs with the
tensor axes joined to the sequence axes, sequence major, ``A = (sequence..., tensor...)``
of ``N = G * T`` devices, every head whole; the MLP, the embedding and the LM head keep
the tensor split (column / row as above).  No device repeats another's attention work
and none holds the whole cache:

* **the cache** of each layer is ``[B, cache_len, Hkv, D]`` sharded ``P(batch axes, A,
  None, None)``: striped over the ``N`` devices of ``A`` (token ``t`` on device ``t mod
  N`` of ``A``, slot ``t // N``), ``2 * (B / Db) * (cache_len / N) * Hkv * D`` elements
  per device and layer (no repeated heads: ``Hc = Hkv``);
* **prefill**: the prompt is striped over ``A``, so each device projects its own rows
  with the whole attention weights (which the tensor axes leave whole, by the model's
  divisibility rule) and writes exactly its cache slots; ring attention (first pass) and
  the gathered-query passes run over ``A``.  The tensor devices then hold different
  rows, so the split MLP gathers the normed rows over the tensor axes, runs its
  ``ffn / T`` units on all ``T`` devices' rows and one ``psum_scatter`` hands each its
  own rows back (Megatron's sequence-parallel form, Korthikanti et al. 2022 §4.2.2: the
  bytes of one all-reduce); the vocab-split embedding gathers the ids (ints) and
  ``psum_scatter``-s the looked-up rows the same way;
* **decode**: the step's rows are replicated over ``A`` as over the sequence above; each
  device projects the new token's q / k / v whole (a few rows), writes k / v only where
  it owns the position, and the tree reduction (one ``pmax``, one ``psum``) runs over
  ``A`` -- one collective whose groups span the sequence and the tensor axes.  Bytes
  per device and step (``bytes_by_axis`` keys ``A`` as the tuple of its names):

  - ``A``, per layer: ``2 (N - 1) / N * 4 * b * Hq * (D + 2)`` (``lse`` ``[b, Hq, 1]``
    and ``[b, 1, Hq, D + 1]``, float32, all heads);
  - tensor, per layer: ``2 (T - 1) / T * b * d * s`` (the down ``psum`` only: o is
    whole); per token on top the embedding's ``psum`` and the logits' ``all_gather`` as
    above (each when the tensor axes split what it sums / gathers).

``tests/test_nd_generate.py`` reads these bytes off the compiled step, to the byte.
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
from jax_seqpar.models.stacking import is_scanned, num_layers, unstack_layers
from jax_seqpar.models.generate_local import (  # noqa: F401  (CACHE_ALIGN re-exported)
    CACHE_ALIGN, DECODE_STRATEGIES, GenerationPlan, _decode_local, _prefill_local, make_plan)
from jax_seqpar.models.tensor_split import TensorSplit
from jax_seqpar.models.stopping import (EOS_FROM_MODEL, EosArg, eos_ids_for,  # noqa: F401
                                        without_token_ids)
from jax_seqpar.models.generate_specs import (_attention_axis, _path_keys, _split_axes,
                                              _tensor_param_specs)
from jax_seqpar.sharding.specs import AxisRole, kv_head_repeats, role_size

# ------------------------------------------------------------------- compiled programs

@dataclasses.dataclass(frozen=True)
class Generator:
    """The compiled prefill and decode programs of one (model, mesh, plan, sampling).

    ``prefill(params, prompts, prompt_lengths) -> (logits [B, V], cache)`` and
    ``decode(callback)(params, first_logits, prompt_lengths, cache, rng) -> (tokens
    [B, N], cache)``; the
    cache is ``(keys, values)``, tuples of one ``[B, cache_len, Hc, D]`` array per layer
    (``Hc``: ``cache_heads``), sharded ``P(batch_axis, axis_name, head_axis, None)``
    (``cache_spec``; striped placement along the sequence).  ``generate`` runs both;
    benchmarks time them apart.

    ``batch_axis`` / ``head_axis``: the mesh axes (of more than one device) that split
    the prompts' rows and the heads (an N-D model's batch and tensor axes; None for the
    one-axis model); ``param_specs``: ``((path, PartitionSpec), ...)``, the tensor-axes
    part of the model's ``param_shardings`` (``()``: every parameter replicated).

    ``heads_split=False`` (``Llama.heads_split``: the tensor axes do not divide the query
    heads): the heads stay whole and the cache is split along its length over the
    sequence and the tensor axes together (``attention_axis``), ``P(batch_axis,
    (sequence..., tensor...), None, None)`` with ``Hc = Hkv``; the MLP, the embedding and
    the LM head keep the tensor split (module docstring, "Heads the tensor axes cannot
    split").

    ``eos_id``: what ``generate`` takes (``"model"``: the config's ``eos_token_ids``; an
    int or a sequence of ints; None), stored resolved as a tuple of ids (``()``: no row
    stops; ``eos_ids_for``).  ``config`` is stored without its token ids (metadata the
    programs never read), so models that differ only in those share their programs.
    """

    config: LlamaConfig
    mesh: Mesh
    axis_name: AxisRole
    plan: GenerationPlan
    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    eos_id: EosArg = EOS_FROM_MODEL
    kernel: str = "auto"
    decode_kernel: str = "auto"
    decode_strategy: str = "tree"
    batch_axis: AxisRole = None
    head_axis: AxisRole = None
    param_specs: tuple = ()
    heads_split: bool = True

    def __post_init__(self):
        object.__setattr__(self, "eos_id", eos_ids_for(self.eos_id, self.config))
        object.__setattr__(self, "config", without_token_ids(self.config))

    @property
    def parts(self) -> LlamaParts:
        return LlamaParts(self.config)

    @property
    def attention_axis(self) -> AxisRole:
        """The axes that split the cache's length and reduce attention: the sequence
        axes, joined by the tensor axes (sequence major) when the heads are whole."""
        return _attention_axis(self.axis_name, self.head_axis, self.heads_split)

    @property
    def tensor_split(self) -> TensorSplit:
        """The per-device ``LlamaParts`` on this generator's tensor axes."""
        c, T = self.config, role_size(self.mesh, self.head_axis)
        if self.head_axis is None:
            return TensorSplit(c)
        if not self.heads_split:
            return TensorSplit(c, self.head_axis, T, heads=False)
        return TensorSplit(c, self.head_axis, T,
                           kv_head_repeats(c.num_heads, c.num_kv_heads, T,
                                           head_axis=self.head_axis))

    @property
    def cache_heads(self) -> int:
        """kv heads of each cache array: ``Hkv``, or ``Hkv * r`` repeated for the tensor
        axes (module docstring)."""
        return self.tensor_split.cache_heads

    def _spec(self, kind: str) -> P:
        b, s = self.batch_axis, self.attention_axis
        h = self.head_axis if self.heads_split else None
        return {"tokens": P(b, s), "rows": P(b), "logits": P(b, None),
                "cache": P(b, s, h, None)}[kind]

    def cache_spec(self):
        """``NamedSharding`` of every cache array: ``P(batch_axis, axis_name, head_axis,
        None)``; ``P(batch_axis, attention_axis, None, None)`` with the heads whole."""
        sh = NamedSharding(self.mesh, self._spec("cache"))
        return tuple((sh,) * self.config.num_layers for _ in range(2))

    def param_partition_specs(self, params):
        """``PartitionSpec`` of every leaf of ``params`` (with or without the
        ``{"params": ...}`` level, blocks in either form): its ``param_specs`` entry, else
        replicated."""
        table = dict(self.param_specs)
        return jax.tree_util.tree_map_with_path(
            lambda path, _: table.get(_path_keys(path), P()), params)

    def replicate(self, params):
        """``params`` placed for generation: split over the tensor axes as the model's
        ``param_shardings`` split them, replicated over every other axis (FSDP splits
        gathered once); on the one-axis model replicated on every device.  A no-op when
        they already are."""
        self.check_params(params)
        specs = self.param_partition_specs(params)
        return jax.device_put(params, jax.tree.map(
            lambda sp: NamedSharding(self.mesh, sp), specs,
            is_leaf=lambda x: isinstance(x, P)))

    def decode_params(self, params):
        """The parameters the decode loop reads: ``params`` (placed by ``replicate``) as
        they are when unrolled; stacked blocks (``scan_layers``) unstacked into per-layer
        arrays on the same shardings, one copy of the block weights made once (module
        docstring, "Scanned parameters": a static slice of the stack inside the loop is
        copied at every token)."""
        if not is_scanned(params):
            return params
        target = jax.eval_shape(unstack_layers, params)
        shardings = jax.tree.map(lambda sp: NamedSharding(self.mesh, sp),
                                 self.param_partition_specs(target),
                                 is_leaf=lambda x: isinstance(x, P))
        return _unstack_onto(shardings)(params)

    def check_params(self, params):
        """``params`` must hold the config's number of blocks (in either form)."""
        found = num_layers(params)
        if found != self.config.num_layers:
            raise ValueError(f"params hold {found} decoder blocks but the model's config "
                             f"has num_layers={self.config.num_layers}")

    @functools.cached_property
    def prefill(self):
        if self.eos_id:   # the prefill never reads eos_id: share the one compiled without
            return _generator(*(() if f.name == "eos_id" else getattr(self, f.name)
                                 for f in dataclasses.fields(self))).prefill
        plan, axis, mesh = self.plan, self.attention_axis, self.mesh
        perm = jnp.asarray(permutation("striped", plan.padded_len, plan.num_shards))
        toks_spec, rows, logits = (self._spec(k) for k in ("tokens", "rows", "logits"))
        cache = self._spec("cache")
        L = self.config.num_layers
        local = functools.partial(_prefill_local, self.tensor_split, plan, axis,
                                  self.kernel)

        def run(params, prompts, lengths):
            self.check_params(params)
            pad = plan.padded_len - prompts.shape[1]
            toks = jnp.pad(prompts.astype(jnp.int32), ((0, 0), (0, pad)))
            toks = jnp.take(toks, perm, axis=1)                         # striped order
            smap = _compat.shard_map(
                local, mesh=mesh, check_vma=False,
                in_specs=(self.param_partition_specs(params), toks_spec, rows),
                out_specs=(logits, ((cache,) * L, (cache,) * L)))
            return smap(params, _compat.place(toks, mesh, toks_spec),
                        _compat.place(lengths.astype(jnp.int32) - 1, mesh, rows))
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
        ``psum`` over the sequence axes -- over the sequence and tensor axes together when
        the heads are whole; with tensor axes the bytes of the module docstring on
        them)."""
        plan, axis, cfg = self.plan, self.attention_axis, self.config
        rows, logits, cache = (self._spec(k) for k in ("rows", "logits", "cache"))
        L = cfg.num_layers
        kernel = self.decode_kernel
        if kernel == "auto":
            probe = jnp.zeros((1, 1, cfg.num_heads, cfg.head_dim), cfg.dtype)
            kernel = decode_kernel_name("auto", probe)
        local = functools.partial(_decode_local, self.tensor_split, plan, axis, kernel,
                                  self.decode_strategy)
        caches = ((cache,) * L, (cache,) * L)

        def step(params, tok, pos, kv):
            self.check_params(params)
            smap = _compat.shard_map(
                local, mesh=self.mesh, check_vma=False,
                in_specs=(self.param_partition_specs(params), rows, rows, caches),
                out_specs=(logits, caches))
            return smap(params, tok, pos, kv)
        return step

    def _decode_program(self, callback):
        plan = self.plan
        N, B = plan.max_new_tokens, plan.batch
        stops = bool(self.eos_id)          # a tuple of ids; () never stops
        fill = self.eos_id[0] if stops else 0
        eos = jnp.asarray(self.eos_id if stops else (-1,), jnp.int32)

        def is_eos(tok):             # [B] -> [B] bool: any of the ids
            return jnp.any(tok[:, None] == eos[None, :], axis=-1)
        sample = functools.partial(sample_logits, temperature=self.temperature,
                                   top_k=self.top_k, top_p=self.top_p)
        step_fn = self.step

        def run(params, first_logits, lengths, cache, rng, callback_token):
            lengths = lengths.astype(jnp.int32)
            first = sample(first_logits, jax.random.fold_in(rng, 0))
            out = jnp.full((B, N), fill, jnp.int32).at[:, 0].set(first)
            done = is_eos(first)
            if callback_token is not None:
                callback_token(jnp.int32(0), first)

            def cond(state):
                step, _, done, _, _ = state
                if not stops:   # no row stops early: no test across the rows
                    return step < N
                return (step < N) & ~jnp.all(done)

            def body(state):
                step, tok, done, out, cache = state
                logits, cache = step_fn(params, tok, lengths + step - 1, cache)
                new = sample(logits, jax.random.fold_in(rng, step))
                new = jnp.where(done, fill, new)
                out = lax.dynamic_update_slice_in_dim(out, new[:, None], step, axis=1)
                if callback_token is not None:
                    callback_token(step, new)
                return step + 1, new, done | is_eos(new), out, cache

            state = (jnp.int32(1), first, done, out, cache)
            _, _, _, out, cache = lax.while_loop(cond, body, state)
            return out, cache

        def stream(step, toks):      # once per step, in order, on the host
            io_callback(lambda s, t: callback(int(s), np.asarray(t)), None, step, toks,
                        ordered=True)
        return jax.jit(lambda *a: run(*a, None if callback is None else stream),
                       donate_argnums=(3,))


def _unstack_onto(shardings):
    """Jitted ``stacking.unstack_layers`` placing each block's leaves on ``shardings``."""
    return jax.jit(unstack_layers, out_shardings=shardings)


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
    """``(mesh, sequence axes, parallelism or None)`` of one ``generate`` call."""
    par = model.parallelism
    if mesh is None:
        mesh = model.mesh
    if mesh is None:
        return Mesh(np.asarray(jax.devices()[:1]), (axis_name,)), axis_name, None
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got "
                        f"{type(mesh).__name__}")
    if par is not None:
        par.check(mesh)
        if axis_name not in ("sp", par.sequence):
            raise ValueError(f"axis_name={axis_name!r} and the model's parallelism.sequence="
                             f"{par.sequence!r} disagree; with a parallelism leave "
                             f"axis_name out")
        return mesh, par.sequence, par
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh "
                         f"(mesh.axis_names={mesh.axis_names})")
    return mesh, axis_name, None


def generator_for(model: Llama, prompts_shape, max_new_tokens: int, *, mesh=None,
                  axis_name: str = "sp", max_prompt_len: Optional[int] = None,
                  temperature: float = 0.0, top_k=None, top_p=None,
                  eos_id: EosArg = EOS_FROM_MODEL, cache_len=None, prefill_chunk=None,
                  kernel="auto", decode_kernel="auto", decode_strategy="tree") -> Generator:
    """The ``Generator`` (compiled programs) that ``generate`` would use (the same
    arguments; ``eos_id`` defaults to the model's ``eos_token_ids`` as there);
    ``decode_strategy="ring"`` / ``"allgather"`` decode with the baselines instead of
    tree attention (for comparisons: the same cache, the same step otherwise)."""
    if decode_strategy not in DECODE_STRATEGIES:
        raise ValueError(f"unknown decode_strategy={decode_strategy!r}; choose one of "
                         f"{DECODE_STRATEGIES}")
    if not isinstance(model, Llama):
        raise TypeError(f"model must be a jax_seqpar.models.Llama, got "
                        f"{type(model).__name__}")
    check_sampling(temperature, top_k, top_p)
    eos_ids = eos_ids_for(eos_id, model.config)
    config = without_token_ids(model.config)   # one program whatever the token ids
    mesh, axis_name, par = _resolve_mesh(model, mesh, axis_name)
    B, P_ = prompts_shape
    batch_axis = head_axis = None
    specs = ()
    heads_split = True
    if par is not None:
        batch_axis = _split_axes(mesh, par.batch_axes)
        head_axis = _split_axes(mesh, par.tensor_axes)
        specs = _tensor_param_specs(config, mesh, par, head_axis)
        # Llama.heads_split on this mesh: the tensor axes divide the query heads
        heads_split = model.config.num_heads % role_size(mesh, head_axis) == 0
    rows = role_size(mesh, batch_axis)
    if B % rows:
        raise ValueError(f"the batch axes {batch_axis!r} split the prompts over {rows} "
                         f"devices, but the batch of {B} prompts does not divide by {rows}")
    attention_axis = _attention_axis(axis_name, head_axis, heads_split)
    plan = make_plan(B, P_, max_new_tokens, role_size(mesh, attention_axis),
                     max_prompt_len=P_ if max_prompt_len is None else max_prompt_len,
                     cache_len=cache_len, prefill_chunk=prefill_chunk, batch_shards=rows)
    return _generator(config, mesh, axis_name, plan, float(temperature), top_k,
                      None if top_p is None else float(top_p), eos_ids, kernel,
                      decode_kernel, decode_strategy, batch_axis, head_axis, specs,
                      heads_split)


def generate(model: Llama, params, prompts, *, max_new_tokens: int, mesh: Optional[Mesh] = None,
             axis_name: str = "sp", prompt_lengths=None, temperature: float = 0.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None,
             eos_id: EosArg = EOS_FROM_MODEL, rng=None, cache_len: Optional[int] = None,
             callback: Optional[Callable] = None, prefill_chunk: Optional[int] = None,
             kernel="auto", decode_kernel="auto"):
    """Generate ``max_new_tokens`` tokens after each prompt; returns int32 ``[B, N]``.

    Args:
      model, params: a ``models.Llama`` and its parameters (``model.init`` or
        ``models.hf.load_pretrained``, placed anyhow; the blocks unrolled or stacked,
        ``models.stacking``, whatever ``model.config.scan_layers`` says); the model's
        own layout is not used.  A model with a ``parallelism`` generates on its mesh
        with every role at work (module docstring, "N-D meshes"): the prompts' rows
        over the batch axes,
        the cache over the sequence and (its kv heads) the tensor axes -- its length
        over both when the tensor axes do not divide the query heads --, the weights
        split over the tensor axes as its ``param_shardings`` split them.
      prompts: int ``[B, P]``, right-padded; ``prompt_lengths`` ``[B]`` (default: all
        ``P``) says where each row's prompt ends.  Row ``b``'s first new token follows
        ``prompts[b, prompt_lengths[b] - 1]``.
      mesh, axis_name: the KV cache is sharded over ``mesh[axis_name]`` (module
        docstring); ``mesh=None``: ``model.mesh``, or one device.  With a
        ``parallelism`` the sequence axes are its own (leave ``axis_name`` out), and the
        batch must divide by the devices of its batch axes.
      temperature, top_k, top_p, rng: sampling (``models.sampling``); ``temperature=0``
        is greedy.  The same ``rng`` gives the same tokens.
      eos_id: the tokens that end a row.  ``"model"`` (the default): the model's
        ``config.eos_token_ids`` (a checkpoint's ``eos_token_id``, as transformers'
        ``generate`` stops; none: never stop); an int or a sequence of ints, each in
        ``[0, vocab_size)``: any of those; None: never stop.  A stopped row's later
        positions are filled with the first of the ids (the loop ends when every row
        has stopped).
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
    params = gen.decode_params(params)   # stacked blocks: unstacked once, for the loop
    return gen.decode(callback)(params, logits, lengths, cache, rng)[0]


__all__ = ["DECODE_STRATEGIES", "EOS_FROM_MODEL", "GenerationPlan", "Generator", "LlamaParts",
           "TensorSplit", "eos_ids_for", "generate", "generator_for", "make_plan"]
