"""Tensor parallelism inside ``shard_map`` for the generation programs (``models.generate``).

``TensorSplit`` runs ``LlamaParts`` on one device's slice of the weights along the tensor
axes, Megatron-LM's column / row split (Shoeybi et al. 2019 §3): q/k/v, gate and up
split by output, o and down by input and summed with one ``psum`` per block side; the
embedding split by vocabulary (each device looks up its own range, one ``psum``); the
LM head's columns gathered for sampling.  ``models/generate.py``'s module docstring has
the bytes per axis.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from jax_seqpar.models.llama import LAYERS, LlamaConfig, LlamaParts
from jax_seqpar.models.stacking import is_scanned, layer_key
from jax_seqpar.sharding.specs import AxisRole


def _block_shape(p, *keys) -> tuple:
    """The local shape of one block's leaf ``keys`` (the first block's; every block's is
    the same), without the layer axis of stacked parameters and without reading them."""
    scanned = is_scanned(p)
    leaf = p[LAYERS] if scanned else p[layer_key(0)]
    for k in keys:
        leaf = leaf[k]
    return tuple(leaf.shape[1:] if scanned else leaf.shape)


@dataclasses.dataclass(frozen=True)
class TensorSplit:
    """``LlamaParts`` on one device's slice of the weights along the tensor axes
    (Megatron-LM's column / row split; see the module docstring).  Use inside
    ``shard_map``.

    ``axis``: the tensor axes (None: no tensor parallelism, and every method is
    ``LlamaParts``' own); ``size``: their devices ``T``; ``repeats``: how often each kv
    head is repeated (``sharding.specs.kv_head_repeats``).  Which weights are split is
    read from their local shapes: a dimension the tensor axes split is ``1 / T`` of the
    config's, one they leave whole is the config's.  The parameters may hold the blocks
    in either form (``models.stacking``): ``block`` gets one block's subtree, however
    the caller read it.

    ``heads=False`` (``Llama.heads_split`` is False: the tensor axes do not divide the
    query heads): attention is whole on every device (all heads, its weights whole, no
    ``psum`` after o) and its rows are split over sequence x tensor instead; the MLP,
    the embedding and the LM head keep the tensor split.  The prefill's rows are then
    each device's own (``rows_split``): ``embed`` and ``block`` with ``own_rows=True``
    gather the rows of the tensor devices before the split MLP / embedding and hand
    each its own back with a ``psum_scatter`` (Megatron's sequence-parallel form,
    Korthikanti et al. 2022 §4.2.2); decode rows are the same on every device and take
    the ``psum``.
    """

    config: LlamaConfig
    axis: AxisRole = None
    size: int = 1
    repeats: int = 1
    heads: bool = True

    @property
    def cache_heads(self) -> int:
        """kv heads of the global cache: ``Hkv * repeats``."""
        return self.config.num_kv_heads * self.repeats

    @property
    def rows_split(self) -> bool:
        """Whether the tensor devices hold different rows in the prefill (heads whole:
        the attention's rows split over sequence x tensor)."""
        return self.axis is not None and not self.heads

    def local_parts(self, p) -> LlamaParts:
        """``LlamaParts`` of this device's heads, MLP units and vocabulary rows."""
        c, T = self.config, self.size
        if self.axis is None:
            return LlamaParts(c)
        vocab = p["embed"]["embedding"].shape[0]
        if not c.tie_embeddings and p["lm_head"]["kernel"].shape[1] != vocab:
            raise ValueError(f"the embedding ({vocab} rows here) and the LM head "
                             f"({p['lm_head']['kernel'].shape[1]} columns) must split the "
                             f"vocabulary alike over the tensor axes")
        mlp = _block_shape(p, "mlp", "gate_proj", "kernel")[1]
        if vocab not in (c.vocab_size, c.vocab_size // T) or mlp not in (c.ffn_dim,
                                                                         c.ffn_dim // T):
            raise ValueError(f"parameters split neither whole nor 1/{T} over the tensor "
                             f"axes {self.axis!r}: vocabulary {vocab} of {c.vocab_size}, "
                             f"MLP {mlp} of {c.ffn_dim}")
        if not self.heads:        # attention whole on every device, its o bias included
            heads = (_block_shape(p, "attn", "q_proj", "kernel")[1],
                     _block_shape(p, "attn", "k_proj", "kernel")[1])
            if heads != (c.num_heads, c.num_kv_heads):
                raise ValueError(f"with heads whole on the tensor axes {self.axis!r} the "
                                 f"q / k projections must be whole: {heads} heads here, "
                                 f"not {(c.num_heads, c.num_kv_heads)}")
            return LlamaParts(dataclasses.replace(c, ffn_dim=mlp, vocab_size=vocab))
        return LlamaParts(dataclasses.replace(
            c, num_heads=c.num_heads // T, num_kv_heads=self.cache_heads // T,
            head_dim=c.head_dim, ffn_dim=mlp, vocab_size=vocab, attention_out_bias=False))

    def embed(self, parts: LlamaParts, p, tokens, own_rows: bool = False):
        """Token embeddings ``[..., d]``; a vocab-split table looks up the ids in its own
        range (zeros elsewhere) and one ``psum`` over the tensor axes assembles them.
        ``own_rows`` (``rows_split``: ``tokens`` differ across the tensor devices): the
        ids of every tensor device are gathered first (ints) and one ``psum_scatter``
        returns each its own rows."""
        V = parts.config.vocab_size
        if self.axis is None or V == self.config.vocab_size:
            return parts.embed(p, tokens)
        if own_rows:
            every = lax.all_gather(tokens, self.axis)                   # [T, ...]
            return lax.psum_scatter(self._lookup(parts, p, every), self.axis,
                                    scatter_dimension=0, tiled=False)
        return lax.psum(self._lookup(parts, p, tokens), self.axis)

    def _lookup(self, parts: LlamaParts, p, tokens):
        """This device's vocabulary rows of the embeddings of ``tokens`` (zeros for ids
        outside its range)."""
        V = parts.config.vocab_size
        ids = tokens - lax.axis_index(self.axis) * V
        inside = (ids >= 0) & (ids < V)
        x = parts.embed(p, jnp.where(inside, ids, 0))
        return jnp.where(inside[..., None], x, jnp.zeros_like(x))

    def _kv_weights(self, parts: LlamaParts, w):
        """This device's kv heads of a k / v projection: its slice already when the
        tensor axes split the kv heads; else (whole weights) the heads of its repeated
        slice, ``(t * Hc/T + i) // repeats``, taken before projecting."""
        hc = parts.config.num_kv_heads
        if self.repeats == 1 and w["kernel"].shape[1] == hc:   # hc = Hkv / T: split
            return w
        if w["kernel"].shape[1] != self.config.num_kv_heads:
            raise ValueError(f"k/v projection with {w['kernel'].shape[1]} heads on this "
                             f"device: neither {hc} (split) nor {self.config.num_kv_heads}")
        idx = (lax.axis_index(self.axis) * hc + jnp.arange(hc)) // self.repeats
        out = {"kernel": jnp.take(w["kernel"], idx, axis=1)}
        if "bias" in w:
            out["bias"] = jnp.take(w["bias"], idx, axis=0)
        return out

    def block(self, parts: LlamaParts, lp, x, positions, attend, own_rows: bool = False):
        """One decoder block on this device's heads and MLP units; ``attend(q, k, v)``
        gets the local heads.  The row-split o / down projections are summed over the
        tensor axes (one ``psum`` each) and their biases added once, after the sum.
        With ``heads=False`` attention is the whole model's (every head, o whole: no
        sum) and ``own_rows`` says whether ``x``'s rows are this device's own (see
        ``mlp``)."""
        if self.axis is None:
            return parts.block(lp, x, positions, attend)
        a = lp["attn"]
        if not self.heads:
            q, k, v = parts.qkv(a, parts.norm(lp["attn_norm"], x), positions)
            h = x + parts.out(a, attend(q, k, v))
            return h + self.mlp(parts, lp, h, own_rows)
        attn = {"q_proj": a["q_proj"], "k_proj": self._kv_weights(parts, a["k_proj"]),
                "v_proj": self._kv_weights(parts, a["v_proj"]),
                "o_proj": {"kernel": a["o_proj"]["kernel"]}}
        q, k, v = parts.qkv(attn, parts.norm(lp["attn_norm"], x), positions)
        o = lax.psum(parts.out(attn, attend(q, k, v)), self.axis)
        if "bias" in a["o_proj"]:
            o = o + a["o_proj"]["bias"].astype(o.dtype)
        h = x + o
        return h + self.mlp(parts, lp, h)

    def mlp(self, parts: LlamaParts, lp, h, own_rows: bool = False):
        """The block's MLP side (its norm, then the MLP) on this device's units: when the
        tensor axes split them, the row-split down projection is summed over the tensor
        axes and its bias added once, after the sum.  ``own_rows`` (``rows_split``):
        ``h``'s rows differ across the tensor devices, so the normed rows are gathered
        over the tensor axes (``[T, ...]``), the split MLP runs on all of them and one
        ``psum_scatter`` returns each device its own rows, summed: the bytes of one
        all-reduce of the gathered rows, no device repeating another's work."""
        m = lp["mlp"]
        x = parts.norm(lp["mlp_norm"], h)
        if parts.config.ffn_dim == self.config.ffn_dim:      # whole: no collective
            return parts.mlp(m, x)
        down = m["down_proj"]
        if "bias" in down:                    # the bias once, after the sum
            m = dict(m, down_proj={"kernel": down["kernel"],
                                   "bias": jnp.zeros_like(down["bias"])})
        if own_rows:
            y = parts.mlp(m, lax.all_gather(x, self.axis))             # [T, ...]
            y = lax.psum_scatter(y, self.axis, scatter_dimension=0, tiled=False)
        else:
            y = lax.psum(parts.mlp(m, x), self.axis)
        if "bias" in down:
            y = y + down["bias"].astype(y.dtype)
        return y

    def logits(self, parts: LlamaParts, p, x):
        """Float32 logits ``[..., V]``: the vocab-split head's ``V / T`` columns are
        gathered over the tensor axes."""
        out = parts.logits(p, x)
        if self.axis is not None and parts.config.vocab_size != self.config.vocab_size:
            out = lax.all_gather(out, self.axis, axis=out.ndim - 1, tiled=True)
        return out


__all__ = ["TensorSplit"]
