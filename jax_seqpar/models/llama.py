"""A small Llama-style decoder on the sequence-parallel attention layer (Flax Linen).

Pre-norm blocks ``x + Attn(RMSNorm(x))``, ``h + SwiGLU(RMSNorm(h))`` (Llama: RMSNorm,
SwiGLU feed-forward, rotary embeddings, grouped-query attention), token embedding and an
untied (by default) LM head.

Sequence parallelism: ``Llama(config, mesh=mesh, layout="zigzag")`` permutes the tokens
into the layout **once**, at the input (a gather of the integer token ids); every layer
then works on rows in layout order (RoPE from each row's global position, attention with
``permuted=True``), and the logits come out in layout order.  ``next_token_loss`` shifts
the targets in *natural* order before permuting them the same way, so every token
``t + 1`` is the target of row ``t`` exactly once whichever device holds either -- no
target is lost or duplicated at shard boundaries.  With ``mesh=None`` the same
parameters run as a plain single-device model.

``config.fused_loss`` (default True) makes ``next_token_loss`` use the fused LM head +
cross-entropy of ``jax_seqpar.layers.lm_head`` (BurstEngine Alg. 3): the ``[B, S, vocab]``
logits are never stored, and the head's gradients are made in the forward.  It is the
default on every platform for now; the GPU benchmark (``benchmarks/lm_head.py``) decides
whether it stays the default where it would be slower than the plain logits.

``config.scan_layers`` runs the blocks as one ``nn.scan`` over parameters stacked along a
leading layer axis (``params["layers"]``, every leaf ``[num_layers, ...]``) instead of
``num_layers`` copies of the block in the program (``params["layer_0"]``, ...): XLA then
compiles one block, whatever the depth.  ``models.stacking`` converts between the two
forms (and reads one layer of either).

``config.remat`` checkpoints every block (``jax_seqpar.layers.remat``): ``"full"`` keeps the
block inputs only, ``"attention"`` also keeps the attention output and lse (DistFlashAttn
§3.3), ``"seq_selective"`` keeps them for the later half of each shard (BurstEngine §3.2),
``"attention_mlp"`` also the MLP's gate and up projections; ``config.remat_offload``
moves what the policy keeps (and each block's input) to host memory until the backward.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from jax.ad_checkpoint import checkpoint_name

from jax_seqpar.layers.core import SeqParallelOptions
from jax_seqpar.layers.linen import SeqParallelAttention, logical_specs
from jax_seqpar.sharding.parallelism import Parallelism
from jax_seqpar.models.hf_config import config_fields_from_hf, config_to_hf
from jax_seqpar.models.hf_config import replace as replace_fields
from jax_seqpar.layers.rope import RopeScaling, apply_rope, as_rope_scaling
from jax_seqpar.layers.lm_head import fused_lm_head_loss
from jax_seqpar.masks import WindowArg, normalize_window
from jax_seqpar.layers.remat import BLOCK_INPUT, MLP_GATE, MLP_UP, REMAT_MODES, policy_for

F32 = jnp.float32
#: The parameter subtree (and logical axis name) of the stacked blocks with ``scan_layers``.
LAYERS = "layers"


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Model hyperparameters (frozen, validated).

    ``head_dim`` defaults to ``d_model // num_heads``; ``ffn_dim`` to Llama's
    ``8/3 * d_model`` rounded up to a multiple of 16.  ``dtype`` is the activation dtype,
    ``param_dtype`` the parameters'.  ``window`` adds a sliding window to the causal mask.
    ``fused_loss``: ``next_token_loss`` computes the head and the loss tile by tile
    (``jax_seqpar.layers.lm_head.fused_lm_head_loss``, with row / vocabulary tiles of
    ``loss_block_s`` / ``loss_block_v``; None picks its defaults) instead of materialising
    the logits.

    What pretrained checkpoints need (``models.hf``; defaults keep the plain model):
    ``rope_scaling`` (a ``layers.rope.RopeScaling`` or its dict: linear, dynamic, yarn,
    llama3); ``attention_bias``: biases on the q/k/v projections (Qwen2), and
    ``attention_out_bias`` on the output projection (Llama's ``attention_bias=True`` sets
    both); ``mlp_bias``: biases on the SwiGLU projections (Llama's ``mlp_bias``);
    ``max_position_embeddings``: the length the checkpoint states it was trained for
    (metadata: the model never reads it; ``to_hf`` writes it back).  ``from_hf`` /
    ``to_hf`` convert transformers' ``config.json`` dicts (``models.hf``).

    ``scan_layers``: the decoder blocks as one loop over stacked parameters (the module
    docstring; ``models.stacking``); the same model, compiled once per block instead of
    once per layer.

    Token ids of the checkpoint (metadata: they never change what the model computes):
    ``bos_token_id``, ``eos_token_ids`` and ``pad_token_id``, each a token id in ``[0,
    vocab_size)`` or None / ``()`` (``eos_token_ids`` also takes one int or a list,
    normalised to a tuple).  ``from_hf`` fills them from config.json (and
    generation_config.json's, which win), ``to_hf`` writes them back, and
    ``models.generate`` stops a row at any of ``eos_token_ids`` unless told otherwise.
    """

    vocab_size: int
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: Optional[int] = None
    ffn_dim: Optional[int] = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    window: WindowArg = None
    tie_embeddings: bool = False
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    remat_offload: bool = False
    fused_loss: bool = True
    loss_block_s: Optional[int] = None
    loss_block_v: Optional[int] = None
    rope_scaling: Optional[RopeScaling] = None
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: Optional[int] = None
    scan_layers: bool = False
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple = ()
    pad_token_id: Optional[int] = None

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name}={val!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads} (GQA)")
        if self.head_dim is None:
            if self.d_model % self.num_heads:
                raise ValueError(f"d_model={self.d_model} must be divisible by "
                                 f"num_heads={self.num_heads}, or set head_dim")
            object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
        if self.ffn_dim is None:
            object.__setattr__(self, "ffn_dim", -(-8 * self.d_model // 3 // 16) * 16)
        for name in ("head_dim", "ffn_dim"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name}={val!r} must be a positive int")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if not (self.rope_theta > 0 and self.norm_eps > 0):
            raise ValueError(f"rope_theta={self.rope_theta} and norm_eps={self.norm_eps} "
                             f"must be positive")
        object.__setattr__(self, "window", normalize_window(self.window))
        for name in ("dtype", "param_dtype"):
            try:
                jnp.dtype(getattr(self, name))
            except TypeError:
                raise ValueError(f"{name}={getattr(self, name)!r} is not a dtype name") from None
        if self.remat not in REMAT_MODES:
            raise ValueError(f"unknown remat={self.remat!r}; choose one of {REMAT_MODES}")
        if not isinstance(self.remat_offload, bool):
            raise TypeError(f"remat_offload={self.remat_offload!r} must be a bool")
        if self.remat_offload and self.remat == "none":
            raise ValueError("remat_offload=True offloads what the remat policy saves; set "
                             f"remat to one of {REMAT_MODES[1:]}")
        if not isinstance(self.fused_loss, bool):
            raise TypeError(f"fused_loss={self.fused_loss!r} must be a bool")
        for name in ("loss_block_s", "loss_block_v", "max_position_embeddings"):
            val = getattr(self, name)
            if val is not None and (isinstance(val, bool) or not isinstance(val, int)
                                    or val < 1):
                raise ValueError(f"{name}={val!r} must be a positive int or None")
        object.__setattr__(self, "rope_scaling", as_rope_scaling(self.rope_scaling))
        for name in ("attention_bias", "attention_out_bias", "mlp_bias", "scan_layers"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be a bool")
        eos = self.eos_token_ids
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        for name, ids in (("bos_token_id", (self.bos_token_id,)), ("eos_token_ids", eos),
                          ("pad_token_id", (self.pad_token_id,))):
            for i in ids:
                if i is not None and (isinstance(i, (bool, np.bool_))
                                      or not isinstance(i, (int, np.integer))
                                      or not 0 <= i < self.vocab_size):
                    raise ValueError(f"{name}={getattr(self, name)!r} must hold token ids in "
                                     f"[0, {self.vocab_size}) (vocab_size)")
        if None in eos:
            raise ValueError(f"eos_token_ids={self.eos_token_ids!r} must hold token ids in "
                             f"[0, {self.vocab_size}) (vocab_size), not None")
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in eos))
        for name in ("bos_token_id", "pad_token_id"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))

    @classmethod
    def from_hf(cls, hf_config, *, ignore=(), generation_config=None,
                **overrides) -> "LlamaConfig":
        """From a transformers ``config.json`` dict (Llama, Mistral, Qwen2); ``overrides``
        replace fields afterwards (e.g. ``dtype``, ``rope_theta``, ``remat``).  Unsupported
        fields raise a ``ValueError`` naming them (``hf_config.config_fields_from_hf``,
        whose docstring says which fields are read, accepted unread or refused);
        ``ignore`` names fields known not to change the model, accepted unread.
        ``generation_config``: the checkpoint's ``generation_config.json`` dict
        (``hf_config.read_generation_config``) or None; its token ids win."""
        return replace_fields(cls(**config_fields_from_hf(
            hf_config, ignore=ignore, generation_config=generation_config)), **overrides)

    def to_hf(self, architecture: Optional[str] = None) -> dict:
        """The transformers ``config.json`` dict of this model (``hf_config.config_to_hf``):
        Llama, or Mistral for a window, Qwen2 for q/k/v-only biases, or ``architecture``."""
        return config_to_hf(self, architecture)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * scale``, computed in float32."""

    eps: float = 1e-5
    dtype: Any = F32
    param_dtype: Any = F32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        xf = x.astype(F32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * scale.astype(F32)).astype(self.dtype)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` (Shazeer 2020, as in Llama); biases if ``use_bias``."""

    hidden: int
    dtype: Any = F32
    param_dtype: Any = F32
    use_bias: bool = False
    mesh: Optional[Mesh] = None
    parallelism: Optional[Parallelism] = None

    @nn.compact
    def __call__(self, x):
        def split(h):  # the hidden units over the tensor axis (and its cotangent alike)
            if self.mesh is None or self.parallelism is None:
                return h
            return self.parallelism.constrain(h, ("batch", "length", "mlp"), self.mesh)

        def dense(n, names, name):  # gate, up split by output; down by input (Megatron)
            return nn.Dense(n, use_bias=self.use_bias, dtype=self.dtype,
                            param_dtype=self.param_dtype, name=name,
                            kernel_init=nn.with_logical_partitioning(
                                nn.initializers.lecun_normal(), names),
                            bias_init=nn.with_logical_partitioning(
                                nn.initializers.zeros_init(), names[1:]))
        gate = checkpoint_name(split(dense(self.hidden, ("embed", "mlp"), "gate_proj")(x)),
                               MLP_GATE)
        up = checkpoint_name(split(dense(self.hidden, ("embed", "mlp"), "up_proj")(x)), MLP_UP)
        return dense(x.shape[-1], ("mlp", "embed"), "down_proj")(nn.silu(gate) * up)


class Embed(nn.Embed):
    """``nn.Embed`` whose table is laid out for the lookup first: gathered over the
    parameter (fsdp) axes, still split by vocabulary over the tensor axis.  Looking rows
    up in a table whose ``embed`` dimension is split over the sequence axis, into rows
    that the same axis splits, made XLA replicate the result (its partitioner: "involuntary
    full rematerialization"); gathering the table first is FSDP's own rule (weights are
    gathered where they are used)."""

    mesh: Optional[Mesh] = None
    parallelism: Optional[Parallelism] = None

    def __call__(self, inputs):
        if self.mesh is None or self.parallelism is None:
            return super().__call__(inputs)
        table = self.parallelism.constrain(self.embedding, ("vocab", None), self.mesh)
        return jnp.take(table.astype(self.dtype or table.dtype), inputs, axis=0)


class LlamaBlock(nn.Module):
    """One pre-norm decoder block on rows in the options' order."""

    config: LlamaConfig
    options: SeqParallelOptions
    parallelism: Optional[Parallelism] = None
    scanned: bool = False   # the body of ``nn.scan``: returns ``(carry, None)``

    def residual(self, x):
        """The residual stream between the two halves of a block: rows over the sequence
        axes, whole on the tensor axis, so each side ends with one all-reduce over it
        (``sharding.parallelism`` says why not Megatron's reduce-scatter form)."""
        if self.options.mesh is None or self.parallelism is None:
            return self.options.shard(x)
        return self.parallelism.constrain(x, ("batch", "residual", "embed"),
                                          self.options.mesh)

    @nn.compact
    def __call__(self, x, segment_ids, positions):
        c, o = self.config, self.options
        x = checkpoint_name(x, BLOCK_INPUT)  # what remat_offload moves to the host
        dt, pdt = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
        attn = SeqParallelAttention(
            num_heads=c.num_heads, head_dim=c.head_dim, num_kv_heads=c.num_kv_heads,
            mesh=o.mesh, axis_name=o.axis_name, batch_axis=o.batch_axis,
            head_axis=o.head_axis, layout=o.layout, permuted=o.permuted,
            strategy=o.strategy, backward=o.backward, kernel=o.kernel, causal=True,
            window=c.window, seq_selective=o.seq_selective, rope_theta=c.rope_theta,
            rope_scaling=c.rope_scaling, use_bias=c.attention_bias,
            out_bias=c.attention_out_bias, dtype=dt, param_dtype=pdt, name="attn")
        a = RMSNorm(c.norm_eps, dt, pdt, name="attn_norm")(x)
        if self.parallelism is not None and o.mesh is not None and o.head_axis is None \
                and self.parallelism.tensor is not None:
            # heads not split: attention's rows over sequence x tensor (Llama.heads_split)
            a = self.parallelism.tensor_as_sequence().constrain(
                a, ("batch", "length", "embed"), o.mesh)
        h = x + attn(a, segment_ids, positions)
        h = self.residual(h)
        out = h + SwiGLU(c.ffn_dim, dt, pdt, c.mlp_bias, o.mesh, self.parallelism, name="mlp")(
            RMSNorm(c.norm_eps, dt, pdt, name="mlp_norm")(h))
        out = self.residual(out)
        return (out, None) if self.scanned else out


class Llama(nn.Module):
    """Llama-style decoder.  ``apply(params, tokens, segment_ids=None, positions=None)``
    -> logits.

    ``tokens`` ``[B, S]`` ints, ``segment_ids`` ``[B, S]`` (packed documents) and
    ``positions`` ``[B, S]`` ints (transformers' ``position_ids``: the RoPE position of
    each token, e.g. restarting at 0 in every packed document; default: the global
    position ``arange(S)``) are in natural order and are permuted into the layout with
    the tokens.  RoPE rotates by ``positions``; the causal mask and the layout always
    use the global positions.  Logits ``[B, S, vocab]`` are in natural order too, unless
    ``layout_order=True`` (what training uses: ``next_token_loss``), which skips putting
    them back.  ``return_hidden=True`` returns the final-norm hidden states ``[B, S,
    d_model]`` instead of the logits (the fused loss applies the head itself; see
    ``head_weights``).  ``mesh=None``: a plain single-device model with the same parameters.

    ``parallelism`` (``jax_seqpar.sharding.Parallelism``): which mesh axes split the batch
    (data, fsdp), the tokens (sequence) and the heads, MLP units and vocabulary (tensor,
    Megatron-LM's pattern); every parameter and activation carries logical names
    (``logical_specs``) that its rules map onto the mesh.  ``None``: today's one-axis
    model, the sequence over ``axis_name`` (``Parallelism.one_axis(axis_name)``).  With a
    ``parallelism``, ``axis_name`` is its sequence axis.
    """

    config: LlamaConfig
    mesh: Optional[Mesh] = None
    axis_name: Any = "sp"
    layout: str = "zigzag"
    strategy: str = "ring"
    backward: str = "auto"
    kernel: Any = "auto"
    parallelism: Optional[Parallelism] = None

    def __post_init__(self):
        par = self.parallelism
        if par is not None:
            if not isinstance(par, Parallelism):
                raise TypeError(f"parallelism={par!r} must be a jax_seqpar.sharding."
                                f"Parallelism or None")
            if self.mesh is None:
                raise ValueError("parallelism=... places the model on a mesh; pass mesh=...")
            par.check(self.mesh)
            if self.axis_name not in ("sp", par.sequence):
                raise ValueError(f"axis_name={self.axis_name!r} and parallelism.sequence="
                                 f"{par.sequence!r} disagree; with a parallelism leave "
                                 f"axis_name out")
            object.__setattr__(self, "axis_name", par.sequence)
        super().__post_init__()

    @property
    def heads_split(self) -> bool:
        """Whether the tensor axis splits the attention heads: its size divides the query
        heads.  When it does not (SmolLM2's 9 heads on a tensor axis of 2), attention
        runs with the tensor axes joined to the sequence axes instead
        (``Parallelism.tensor_as_sequence``): the token layout is dealt over sequence x
        tensor devices, each attends its own rows with all heads, and the attention
        weights (whose heads the axis cannot split) are whole on the tensor axis; the
        MLP, the embedding and the head still split over it."""
        par = self.parallelism
        if par is None or self.mesh is None:
            return True
        return self.config.num_heads % par.sizes(self.mesh)["tensor"] == 0

    @property
    def attention_par(self) -> Parallelism:
        """The roles attention runs with (``heads_split``)."""
        return self.par if self.heads_split else self.par.tensor_as_sequence()

    @property
    def par(self) -> Parallelism:
        """The model's ``Parallelism`` (``Parallelism.one_axis(axis_name)`` when None)."""
        return self.parallelism or Parallelism.one_axis(self.axis_name)

    def constrain(self, x, names):
        """``x`` laid out by its logical ``names`` (no-op without a mesh; the one-axis
        model keeps today's placement: rows over ``axis_name``)."""
        if self.mesh is None:
            return x
        if self.parallelism is None:
            return self.options().shard(x)
        return self.parallelism.constrain(x, names, self.mesh)

    def init(self, *args, **kwargs):
        """``nn.Module.init`` with plain arrays (``logical_specs`` gives the names)."""
        return nn.meta.unbox(super().init(*args, **kwargs))

    def logical_specs(self, *args, **kwargs):
        """Logical names of every parameter, from ``init``'s arguments (nothing computed)."""
        return logical_specs(self, *args, **kwargs)

    def param_shardings(self, *args, **kwargs):
        """``NamedSharding`` of every parameter on the model's mesh: the logical names
        through ``parallelism``'s rules (largest dividing group of axes per dimension)."""
        if self.mesh is None:
            raise ValueError("the model has no mesh (mesh=None)")
        boxed = jax.eval_shape(lambda: nn.Module.init(self, *args, **kwargs))  # traced once
        specs, shapes = nn.get_partition_spec(boxed), nn.meta.unbox(boxed)
        par = self.par
        def one(spec, s):  # unnamed parameters (norm scales) have P(): never split
            names = tuple(spec) + (None,) * (len(s.shape) - len(spec))
            return par.sharding(self.mesh, names, s.shape)
        return jax.tree.map(one, specs, shapes, is_leaf=lambda x: isinstance(x, P))

    def options(self) -> SeqParallelOptions:
        if self.config.remat in ("attention", "seq_selective", "attention_mlp") and (
                self.mesh is None or self.strategy != "ring"):
            raise ValueError(f"remat={self.config.remat!r} saves the residuals that the "
                             f"ring attention tags, so it needs a mesh (one device is fine) "
                             f"and strategy='ring' (got strategy={self.strategy!r}, "
                             f"mesh={'None' if self.mesh is None else 'given'}); or use "
                             f"remat='full'")
        par = None if self.parallelism is None else self.attention_par
        batch = None if par is None or not par.batch_axes else par.batch_axes
        return SeqParallelOptions(mesh=self.mesh,
                                  axis_name=self.axis_name if par is None else par.sequence,
                                  batch_axis=batch, head_axis=None if par is None else par.tensor,
                                  layout=self.layout, permuted=True, strategy=self.strategy,
                                  backward=self.backward, kernel=self.kernel, causal=True,
                                  window=self.config.window,
                                  seq_selective=self.config.remat == "seq_selective")

    def permutation(self, seq_len: int) -> np.ndarray:
        """Row ``t`` of the model's arrays holds token ``permutation(S)[t]``."""
        return self.options().positions(seq_len)

    def to_layout(self, x):
        """``x`` ``[B, S, ...]`` from natural order into the model's row order."""
        return x if x is None else jnp.take(x, jnp.asarray(self.permutation(x.shape[1])), 1)

    def from_layout(self, x):
        """Inverse of ``to_layout``."""
        inv = np.argsort(self.permutation(x.shape[1]))
        return jnp.take(x, jnp.asarray(inv), axis=1)

    def blocks(self, x, segment_ids, positions, opts):
        """The ``num_layers`` decoder blocks, each under the remat policy; unrolled
        (``layer_0``, ...) or, with ``config.scan_layers``, one ``nn.scan`` (``layers``)
        whose body is the remat'd block, so the policy applies inside the loop."""
        c = self.config
        block = LlamaBlock
        if c.remat != "none":
            # inside a scan the loop already keeps XLA from merging the recomputation
            # into the forward, so prevent_cse is not needed there (flax's advice)
            block = nn.remat(LlamaBlock, policy=policy_for(c.remat, c.remat_offload),
                             prevent_cse=not c.scan_layers)
        if not c.scan_layers:
            for i in range(c.num_layers):
                x = block(c, opts, self.parallelism, name=f"layer_{i}")(
                    x, segment_ids, positions)
            return x
        # Parameters stacked on a new leading axis, named "layers" for the sharding rules,
        # which never split it (sharding.parallelism: a split layer axis would make every
        # step of the loop gather a whole layer from other devices).
        stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                        in_axes=(nn.broadcast, nn.broadcast), length=c.num_layers,
                        metadata_params={nn.PARTITION_NAME: LAYERS})
        x, _ = stack(c, opts, self.parallelism, scanned=True, name=LAYERS)(
            x, segment_ids, positions)
        return x

    @nn.compact
    def __call__(self, tokens, segment_ids=None, positions=None, layout_order: bool = False,
                 return_hidden: bool = False):
        c, opts = self.config, self.options()
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be integer [batch, seq]; got {tokens.dtype} "
                             f"{tokens.shape}")
        S = tokens.shape[1]
        if opts.mesh is not None and S % (2 * opts.num_shards) and opts.seq_selective:
            raise ValueError(f"remat='seq_selective' needs seq_len={S} divisible by "
                             f"2*{opts.num_shards} devices")
        check_positions(positions, tokens.shape)
        rows = ("batch", "length")
        if positions is None:
            positions = jnp.asarray(self.permutation(S))      # each row's global position
        else:
            positions = self.constrain(self.to_layout(jnp.asarray(positions, jnp.int32)), rows)
        tokens = self.constrain(self.to_layout(tokens), rows)  # the one permutation
        segment_ids = (None if segment_ids is None
                       else self.constrain(self.to_layout(segment_ids), rows))
        dt, pdt = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
        embed = Embed(c.vocab_size, c.d_model, dtype=dt, param_dtype=pdt,
                      embedding_init=nn.with_logical_partitioning(
                          nn.initializers.normal(0.02), ("vocab", "embed")),
                      mesh=self.mesh, parallelism=self.parallelism, name="embed")
        x = self.constrain(embed(tokens), ("batch", "residual", "embed"))
        x = self.blocks(x, segment_ids, positions, opts)
        x = RMSNorm(c.norm_eps, dt, pdt, name="final_norm")(x)
        if return_hidden:
            return x if layout_order else self.from_layout(x)
        if c.tie_embeddings:
            logits = embed.attend(x)
        else:
            logits = nn.Dense(c.vocab_size, use_bias=False, dtype=dt, param_dtype=pdt,
                              kernel_init=nn.with_logical_partitioning(
                                  nn.initializers.lecun_normal(), ("embed", "vocab")),
                              name="lm_head")(x)
        return logits if layout_order else self.from_layout(logits)


@dataclasses.dataclass(frozen=True)
class LlamaParts:
    """The Flax modules of one ``Llama`` block and of its ends, applied one at a time to
    their own parameter subtrees (the same modules, dtypes and biases as ``LlamaBlock``),
    so that code running the model piece by piece -- ``models.generate``'s prefill and
    decode around a KV cache -- brings only its own attention.  Keep it in step with
    ``LlamaBlock`` and ``Llama.__call__`` (``tests/test_generate.py`` compares the two)."""

    config: LlamaConfig

    def _dt(self):
        c = self.config
        return jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)

    def embed(self, p, tokens):
        c = self.config
        dt, pdt = self._dt()
        return nn.Embed(c.vocab_size, c.d_model, dtype=dt, param_dtype=pdt).apply(
            {"params": p["embed"]}, tokens)

    def norm(self, p, x):
        dt, pdt = self._dt()
        return RMSNorm(self.config.norm_eps, dt, pdt).apply({"params": p}, x)

    def qkv(self, p, x, positions):
        """Projections and RoPE: ``q [B, T, Hq, D]``, ``k, v [B, T, Hkv, D]``."""
        c = self.config
        dt, pdt = self._dt()

        def proj(name, heads):
            return nn.DenseGeneral((heads, c.head_dim), use_bias=c.attention_bias, dtype=dt,
                                   param_dtype=pdt).apply({"params": p[name]}, x)
        q, k = proj("q_proj", c.num_heads), proj("k_proj", c.num_kv_heads)
        v = proj("v_proj", c.num_kv_heads)
        rope = functools.partial(apply_rope, positions=positions, theta=c.rope_theta,
                                 scaling=c.rope_scaling)
        return rope(q), rope(k), v

    def out(self, p, o):
        c = self.config
        dt, pdt = self._dt()
        return nn.DenseGeneral(c.d_model, axis=(-2, -1), use_bias=c.attention_out_bias,
                               dtype=dt, param_dtype=pdt).apply({"params": p["o_proj"]}, o)

    def mlp(self, p, x):
        dt, pdt = self._dt()
        return SwiGLU(self.config.ffn_dim, dt, pdt, self.config.mlp_bias).apply(
            {"params": p}, x)

    def block(self, lp, x, positions, attend):
        """One decoder block; ``attend(q, k, v) -> o`` is the attention in between."""
        q, k, v = self.qkv(lp["attn"], self.norm(lp["attn_norm"], x), positions)
        h = x + self.out(lp["attn"], attend(q, k, v))
        return h + self.mlp(lp["mlp"], self.norm(lp["mlp_norm"], h))

    def logits(self, p, x):
        """Final norm and LM head: float32 logits ``[..., vocab]``."""
        c = self.config
        dt, pdt = self._dt()
        x = self.norm(p["final_norm"], x)
        if c.tie_embeddings:
            out = nn.Embed(c.vocab_size, c.d_model, dtype=dt, param_dtype=pdt).apply(
                {"params": p["embed"]}, x, method="attend")
        else:
            out = nn.Dense(c.vocab_size, use_bias=False, dtype=dt, param_dtype=pdt).apply(
                {"params": p["lm_head"]}, x)
        return out.astype(F32)


def check_positions(positions, shape) -> None:
    """``positions`` must be ``None`` or integer ``[B, S]`` like the tokens."""
    if positions is None:
        return
    if getattr(positions, "shape", None) != tuple(shape):
        raise ValueError(f"positions must have the tokens' shape [batch, seq] = "
                         f"{tuple(shape)}; got {getattr(positions, 'shape', None)}")
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(f"positions.dtype={positions.dtype} must be an integer dtype")


def shift_targets(tokens, loss_mask=None, segment_ids=None):
    """Next-token targets in natural order: ``targets[t] = tokens[t + 1]``.

    Returns ``(targets, weights)``, ``[B, S]`` each; ``weights[t]`` is 0 for the last
    position, where a document ends (``segment_ids[t] != segment_ids[t + 1]``) and where
    ``loss_mask[t + 1]`` is false (``loss_mask`` marks the tokens worth predicting).
    """
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    weights = jnp.ones(tokens.shape, F32).at[:, -1].set(0.0)
    if loss_mask is not None:
        weights = weights.at[:, :-1].multiply(loss_mask[:, 1:].astype(F32))
    if segment_ids is not None:
        weights = weights.at[:, :-1].multiply(
            (segment_ids[:, 1:] == segment_ids[:, :-1]).astype(F32))
    return targets, weights


def head_weights(model: Llama, params):
    """The LM head as ``[d_model, vocab]``: the ``lm_head`` Dense kernel, or the
    transposed embedding when ``config.tie_embeddings``."""
    p = params["params"] if "params" in params else params
    if model.config.tie_embeddings:
        return p["embed"]["embedding"].T
    return p["lm_head"]["kernel"]


def next_token_loss(model: Llama, params, tokens, loss_mask=None, segment_ids=None,
                    positions=None):
    """Mean next-token cross-entropy and accuracy over the weighted positions.

    ``tokens``, ``loss_mask``, ``segment_ids`` and ``positions`` are ``[B, S]`` in natural
    order (``Llama.__call__`` says what ``positions`` means).

    Targets are shifted in natural order (``shift_targets``), then permuted like the
    tokens, so the hidden states / logits never leave layout order.  With
    ``config.fused_loss`` the head and the loss run fused (``lm_head.fused_lm_head_loss``,
    BurstEngine Alg. 3; sequence-sharded over the model's mesh axis); otherwise the
    ``[B, S, vocab]`` logits are materialised.  Returns ``(loss, metrics)`` with
    ``metrics = {"loss", "accuracy", "tokens"}``.
    """
    c = model.config
    targets, weights = shift_targets(tokens, loss_mask, segment_ids)
    targets, weights = model.to_layout(targets), model.to_layout(weights)
    if c.fused_loss:
        h = model.apply(params, tokens, segment_ids, positions, layout_order=True,
                        return_hidden=True)
        par = model.parallelism
        extra = {} if par is None else dict(
            vocab_axis=par.tensor, batch_axis=par.batch_axes or None)
        loss, m = fused_lm_head_loss(h, head_weights(model, params), targets, weights,
                                     mesh=model.mesh, axis_name=model.axis_name, **extra,
                                     block_s=c.loss_block_s, block_v=c.loss_block_v,
                                     dtype=c.dtype)
        return loss, {"loss": loss, "accuracy": m["accuracy"], "tokens": m["tokens"]}
    logits = model.apply(params, tokens, segment_ids, positions,
                         layout_order=True).astype(F32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    total = jnp.maximum(weights.sum(), 1.0)
    loss = (nll * weights).sum() / total
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(F32)
    return loss, {"loss": loss, "accuracy": (correct * weights).sum() / total,
                  "tokens": weights.sum()}
