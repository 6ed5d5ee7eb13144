"""Choosing the next token from logits: pure functions of the logits and a PRNG key.

``sample_logits(logits, key, temperature=0.0, top_k=None, top_p=None)`` takes float
logits ``[B, V]`` and returns int32 tokens ``[B]``:

* ``temperature == 0``: greedy, ``argmax`` (the key is not used);
* otherwise the logits are divided by ``temperature``, then restricted to the ``top_k``
  largest (ties at the k-th value are kept) and to the smallest set of the most likely
  tokens whose probabilities add up to at least ``top_p`` (nucleus sampling, Holtzman
  et al. 2020; the most likely token always stays), and one token per row is drawn with
  ``jax.random.categorical`` (rows independent, the same key gives the same tokens).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

F32 = jnp.float32


def check_sampling(temperature, top_k, top_p) -> None:
    """Raise a ``ValueError`` naming the argument for settings that mean nothing."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not temperature >= 0:
        raise ValueError(f"temperature={temperature!r} must be a float >= 0 (0: greedy)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                              or top_k < 1):
        raise ValueError(f"top_k={top_k!r} must be a positive int or None")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r} must lie in (0, 1] or be None")


def top_k_mask(logits, k: int):
    """``logits`` with everything below the ``k``-th largest of each row set to -inf."""
    if k >= logits.shape[-1]:
        return logits
    kth = jax.lax.top_k(logits, k)[0][..., -1:]
    return jnp.where(logits < kth, -jnp.inf, logits)


def top_p_mask(logits, p: float):
    """``logits`` restricted to each row's nucleus: the most likely tokens, in order, until
    their probabilities reach ``p`` (the token that crosses ``p`` is kept)."""
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs        # mass of the more likely tokens
    keep_sorted = before < p                           # the first token always: before = 0
    keep = jnp.zeros_like(keep_sorted).at[
        jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    return jnp.where(keep, logits, -jnp.inf)


def sample_logits(logits, key, temperature: float = 0.0, top_k: Optional[int] = None,
                  top_p: Optional[float] = None):
    """Next tokens ``[B]`` (int32) from ``logits`` ``[B, V]`` (see the module docstring)."""
    check_sampling(temperature, top_k, top_p)
    logits = logits.astype(F32)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        logits = top_k_mask(logits, top_k)
    if top_p is not None and top_p < 1:
        logits = top_p_mask(logits, top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


__all__ = ["check_sampling", "sample_logits", "top_k_mask", "top_p_mask"]
