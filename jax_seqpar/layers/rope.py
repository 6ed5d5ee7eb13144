"""Rotary position embeddings (RoPE) from integer *global* token positions, and the RoPE
scaling types used to extend a model's context.

Rotary embeddings (Su et al., "RoFormer", 2021) rotate each pair of channels of a query or
key by an angle proportional to its token's position, so that ``q_i . k_j`` depends on
``i - j`` only.  Under a zigzag or striped layout the ``t``-th row of a shard is not token
``t``: the angle must come from the token's global position, which
``layouts.permutation(layout, S, G)[t]`` gives for row ``t`` of an array in layout order.
Computing the angles from the row index instead would silently give a different model
on every layout.

Channel pairing follows the Llama convention ("rotate half"): channel ``c`` of the first
half pairs with channel ``c + D/2``, with inverse frequency ``theta ** (-2c / D)``.
Angles are computed in float32 from int32 positions.

**Scaling** (``RopeScaling``, ``LlamaConfig.rope_scaling``) changes the inverse
frequencies, and for YaRN multiplies cos and sin by an attention factor.  One function per
type, each equal to transformers' own RoPE initialisation for that type
(``transformers.modeling_rope_utils``; tested against its values to 1e-6 in float32):
``linear_inv_freq`` (Position Interpolation), ``dynamic_ntk_inv_freq`` (NTK-aware, computed
once for a stated length), ``yarn_inv_freq`` / ``yarn_attention_factor`` (YaRN) and
``llama3_inv_freq`` (Llama 3.1).  They are static: computed in float64 NumPy when the
layer is built, rounded once to float32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Tuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

F32 = jnp.float32

#: The RoPE scaling types ``RopeScaling`` implements (transformers' ``rope_type`` names).
ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")

#: The fields each type uses besides ``rope_type`` and ``factor``.
_TYPE_FIELDS = {
    "linear": (),
    "dynamic": ("original_max_position_embeddings", "seq_len"),
    "yarn": ("original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
             "mscale", "mscale_all_dim", "truncate"),
    "llama3": ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}
_REQUIRED = {"linear": (), "dynamic": ("original_max_position_embeddings",),
             "yarn": ("original_max_position_embeddings",),
             "llama3": ("original_max_position_embeddings", "low_freq_factor",
                        "high_freq_factor")}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How RoPE is scaled (frozen, hashable; ``LlamaConfig.rope_scaling``).

    ``rope_type``: one of ``ROPE_TYPES``; ``factor``: the context extension factor (>= 1).
    Per type (the names and meanings of transformers' ``rope_parameters``):

    * ``"linear"``: nothing else (``linear_inv_freq``).
    * ``"dynamic"``: ``original_max_position_embeddings`` (transformers'
      ``max_position_embeddings``: the trained length) and ``seq_len``, the length the
      frequencies are computed for, once (``dynamic_ntk_inv_freq``).  ``seq_len=None``
      means the trained length, which is what transformers' initialisation gives: the
      plain RoPE frequencies.
    * ``"yarn"``: ``original_max_position_embeddings``, ``beta_fast`` (32), ``beta_slow``
      (1), ``truncate`` (True), and the attention factor: ``attention_factor``, or from
      ``mscale`` / ``mscale_all_dim``, or from ``factor`` (``yarn_attention_factor``).
    * ``"llama3"``: ``original_max_position_embeddings``, ``low_freq_factor``,
      ``high_freq_factor`` (``llama3_inv_freq``).

    A field that the type does not use must stay unset; ``from_dict`` reads transformers'
    ``rope_scaling`` / ``rope_parameters`` dicts (``"type"`` is read as ``"rope_type"``).
    """

    rope_type: str
    factor: float
    original_max_position_embeddings: Optional[int] = None
    seq_len: Optional[int] = None
    low_freq_factor: Optional[float] = None
    high_freq_factor: Optional[float] = None
    beta_fast: Optional[float] = None
    beta_slow: Optional[float] = None
    attention_factor: Optional[float] = None
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    truncate: Optional[bool] = None

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling.rope_type={self.rope_type!r} is not supported; "
                             f"supported: {ROPE_TYPES} (or no rope_scaling for plain RoPE)")
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)) \
                or not self.factor >= 1:
            raise ValueError(f"rope_scaling.factor={self.factor!r} must be a number >= 1")
        object.__setattr__(self, "factor", float(self.factor))
        used = _TYPE_FIELDS[self.rope_type]
        for f in dataclasses.fields(self)[2:]:
            val = getattr(self, f.name)
            if val is None:
                if f.name in _REQUIRED[self.rope_type]:
                    raise ValueError(f"rope_scaling.{f.name} is required for "
                                     f"rope_type={self.rope_type!r}")
                continue
            if f.name not in used:
                raise ValueError(f"rope_scaling.{f.name}={val!r} is not used by "
                                 f"rope_type={self.rope_type!r} (it uses {used or 'no field'} "
                                 f"besides factor)")
            if f.name == "truncate":
                if not isinstance(val, bool):
                    raise ValueError(f"rope_scaling.truncate={val!r} must be a bool")
            elif f.name in ("original_max_position_embeddings", "seq_len"):
                if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                    raise ValueError(f"rope_scaling.{f.name}={val!r} must be a positive int")
            elif isinstance(val, bool) or not isinstance(val, (int, float)):
                raise ValueError(f"rope_scaling.{f.name}={val!r} must be a number")
            else:
                object.__setattr__(self, f.name, float(val))
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"rope_scaling.high_freq_factor={self.high_freq_factor} must be "
                             f"greater than low_freq_factor={self.low_freq_factor}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Optional["RopeScaling"]:
        """From a transformers-style dict; ``rope_type="default"`` gives None.  Unknown keys
        raise a ``ValueError`` naming them."""
        d = dict(d)
        if "type" in d:
            t = d.pop("type")
            if d.setdefault("rope_type", t) != t:
                raise ValueError(f"rope_scaling has type={t!r} and "
                                 f"rope_type={d['rope_type']!r}; give one")
        if d.get("rope_type", "default") == "default":
            extra = sorted(set(d) - {"rope_type"})
            if extra:
                raise ValueError(f"rope_scaling fields {extra} given for rope_type='default' "
                                 f"(plain RoPE uses none)")
            return None
        if "rope_theta" in d:
            raise ValueError("rope_scaling.rope_theta: set LlamaConfig.rope_theta instead")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"rope_scaling fields {unknown} are not supported "
                             f"(rope_type={d.get('rope_type')!r}; known fields: "
                             f"{sorted(names)})")
        if "factor" not in d:
            raise ValueError(f"rope_scaling.factor is required for "
                             f"rope_type={d.get('rope_type')!r}")
        return cls(**d)

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items())
        return f"RopeScaling({fields})"

    def to_dict(self) -> dict:
        """The transformers-style dict (unset fields left out)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def as_rope_scaling(value) -> Optional[RopeScaling]:
    """None, a ``RopeScaling`` or a dict (``RopeScaling.from_dict``) -> RopeScaling/None."""
    if value is None or isinstance(value, RopeScaling):
        return value
    if isinstance(value, Mapping):
        return RopeScaling.from_dict(value)
    raise TypeError(f"rope_scaling={value!r} must be None, a RopeScaling or a dict")


# --------------------------------------------------------------------------- frequencies
def _check(head_dim: int, theta: float) -> None:
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim=}")
    if not theta > 0:
        raise ValueError(f"rope_theta={theta!r} must be positive")


def rope_frequencies(head_dim: int, theta: float = 10000.0):
    """``theta ** (-2c / head_dim)`` for ``c = 0 .. head_dim/2 - 1`` (float32, plain RoPE)."""
    _check(head_dim, theta)
    return theta ** (-jnp.arange(0, head_dim, 2, dtype=F32) / head_dim)


def default_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """Plain RoPE's inverse frequencies ``theta ** (-2c / D)`` in float64 (RoFormer Eq. 15)."""
    _check(head_dim, theta)
    return float(theta) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def linear_inv_freq(head_dim: int, theta: float, factor: float) -> np.ndarray:
    """Position Interpolation (Chen et al. 2023, Eq. 3; kaiokendev's "linear" scaling):
    positions are divided by ``factor``, i.e. every inverse frequency is."""
    return default_inv_freq(head_dim, theta) / factor


def dynamic_ntk_inv_freq(head_dim: int, theta: float, factor: float,
                         max_position_embeddings: int, seq_len: Optional[int] = None
                         ) -> np.ndarray:
    """NTK-aware scaling, "dynamic" (bloc97 / emozilla; transformers' ``dynamic``): the
    base grows to ``theta * (factor * L / L0 - (factor - 1)) ** (D / (D - 2))`` with
    ``L = max(seq_len, L0)``, ``L0 = max_position_embeddings``.

    transformers recomputes this in every forward call from the longest position it sees
    (so frequencies change with the input length, and its initial frequencies, at
    ``L = L0``, are plain RoPE's).  Here it is **static**: computed once for the stated
    ``seq_len`` (None: ``L0``, which gives transformers' initialisation, plain RoPE).  The
    two agree on every sequence whose largest position + 1 is ``seq_len`` (or, for
    ``seq_len=None``, at most ``L0``); set ``seq_len`` to the training length when
    extending the context, so that training and inference use the same frequencies.
    """
    L0 = max_position_embeddings
    L = L0 if seq_len is None else max(seq_len, L0)
    base = theta * ((factor * L / L0) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return default_inv_freq(head_dim, base)


def yarn_inv_freq(head_dim: int, theta: float, factor: float,
                  original_max_position_embeddings: int, beta_fast: float = 32.0,
                  beta_slow: float = 1.0, truncate: bool = True) -> np.ndarray:
    """YaRN's "NTK-by-parts" frequencies (Peng et al. 2023, §3.2, Eq. 17-18).

    Dimension ``c`` makes ``r(c) = L0 / wavelength(c)`` rotations over the trained length
    ``L0``; the dimension making ``b`` rotations is ``D ln(L0 / (2 pi b)) / (2 ln theta)``.
    Between ``low`` (``b = beta_fast``) and ``high`` (``b = beta_slow``), floored / ceiled
    when ``truncate``, clamped to ``[0, D - 1]``, a linear ramp ``gamma`` blends the
    interpolated ``inv / factor`` (dimensions above ``high``) into the original ``inv``
    (below ``low``): ``inv * (1 - gamma) + inv / factor * gamma``.
    """
    D = head_dim
    inv = default_inv_freq(D, theta)

    def dim_of(rotations):
        return D * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    if low == high:
        high += 0.001  # as transformers: avoid dividing by zero
    gamma = np.clip((np.arange(D // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return inv * (1 - gamma) + inv / factor * gamma


def yarn_attention_factor(factor: float, attention_factor: Optional[float] = None,
                          mscale: Optional[float] = None,
                          mscale_all_dim: Optional[float] = None) -> float:
    """YaRN's attention temperature ``sqrt(1/t) = 0.1 ln(s) + 1`` (Peng et al. 2023,
    Eq. 21-22), which multiplies cos and sin (so the scores by its square), as transformers
    does.  ``attention_factor`` if given; else, with both ``mscale`` and ``mscale_all_dim``
    (DeepSeek's form), ``m(s, mscale) / m(s, mscale_all_dim)`` with ``m(s, a) = 0.1 a
    ln(s) + 1`` (1 for ``s <= 1``); else ``m(factor, 1)``."""
    if attention_factor is not None:
        return float(attention_factor)

    def m(s, a=1.0):
        return 1.0 if s <= 1 else 0.1 * a * math.log(s) + 1.0

    if mscale and mscale_all_dim:
        return float(m(factor, mscale) / m(factor, mscale_all_dim))
    return float(m(factor))


def llama3_inv_freq(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                    high_freq_factor: float, original_max_position_embeddings: int
                    ) -> np.ndarray:
    """Llama 3.1's frequency-dependent scaling (Meta's ``apply_scaling``; transformers'
    ``llama3``): with wavelength ``w = 2 pi / inv`` and ``L0`` the trained length,
    ``w < L0 / high_freq_factor`` keeps ``inv``; ``w > L0 / low_freq_factor`` divides it
    by ``factor``; in between, ``(1 - a) inv / factor + a inv`` with
    ``a = (L0 / w - low_freq_factor) / (high_freq_factor - low_freq_factor)``."""
    inv = default_inv_freq(head_dim, theta)
    L0 = original_max_position_embeddings
    wavelen = 2 * math.pi / inv
    low_wl, high_wl = L0 / low_freq_factor, L0 / high_freq_factor
    a = (L0 / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    out = np.where(wavelen > low_wl, inv / factor, inv)
    medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return np.where(medium, (1 - a) * inv / factor + a * inv, out)


def rope_parameters(head_dim: int, theta: float,
                    scaling: Optional[RopeScaling] = None) -> Tuple[np.ndarray, float]:
    """``(inv_freq [head_dim / 2] float32, attention_scaling)`` for a scaling type, as
    transformers' RoPE initialisation returns them."""
    scaling = as_rope_scaling(scaling)
    if scaling is None:
        return default_inv_freq(head_dim, theta).astype(np.float32), 1.0
    s, t = scaling, scaling.rope_type
    scale = 1.0
    if t == "linear":
        inv = linear_inv_freq(head_dim, theta, s.factor)
    elif t == "dynamic":
        inv = dynamic_ntk_inv_freq(head_dim, theta, s.factor,
                                   s.original_max_position_embeddings, s.seq_len)
    elif t == "yarn":
        inv = yarn_inv_freq(head_dim, theta, s.factor, s.original_max_position_embeddings,
                            32.0 if s.beta_fast is None else s.beta_fast,
                            1.0 if s.beta_slow is None else s.beta_slow,
                            True if s.truncate is None else s.truncate)
        scale = yarn_attention_factor(s.factor, s.attention_factor, s.mscale, s.mscale_all_dim)
    else:
        inv = llama3_inv_freq(head_dim, theta, s.factor, s.low_freq_factor,
                              s.high_freq_factor, s.original_max_position_embeddings)
    return inv.astype(np.float32), scale


# --------------------------------------------------------------------------- rotation
def apply_rope(x: Float[Array, "B S H D"], positions: Int[Array, "*B S"],
               theta: float = 10000.0, scaling: Optional[RopeScaling] = None
               ) -> Float[Array, "B S H D"]:
    """Rotate ``x`` ``[B, S, H, D]`` by the angles of ``positions`` (``[S]`` or ``[B, S]``,
    the global position of each row).  ``scaling`` (a ``RopeScaling`` or its dict) changes
    the frequencies and, for YaRN, multiplies cos and sin by the attention factor.
    Returns ``x.dtype``; the rotation is in float32."""
    B, S, H, D = x.shape
    positions = jnp.asarray(positions)
    if positions.shape not in ((S,), (B, S)):
        raise ValueError(f"positions must have shape [seq]={(S,)} or [batch, seq]={(B, S)}; "
                         f"got {positions.shape}")
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(f"positions.dtype={positions.dtype} must be an integer dtype")
    scaling = as_rope_scaling(scaling)
    if scaling is None:
        inv_freq, scale = rope_frequencies(D, theta), 1.0
    else:
        _check(D, theta)
        inv_freq, scale = rope_parameters(D, theta, scaling)
        inv_freq = jnp.asarray(inv_freq)
    angles = positions.astype(F32)[..., None] * inv_freq  # [*B, S, D/2]
    if angles.ndim == 2:
        angles = angles[None]
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]  # [B|1, S, 1, D/2]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x1, x2 = jnp.split(x.astype(F32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
