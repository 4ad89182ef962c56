"""Pieces the example models share: normalisation, Adam, and where stage boundaries go."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def layer_norm(x: jax.Array, p: dict[str, Any], eps: float = 1e-5) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["g"] + p["b"]


def group_norm(x: jax.Array, p: dict[str, Any], groups: int, eps: float = 1e-5) -> jax.Array:
    """GroupNorm over an NHWC tensor."""
    n, h, w, c = x.shape
    g = x.reshape(n, h, w, groups, c // groups)
    mean = jnp.mean(g, axis=(1, 2, 4), keepdims=True)
    var = jnp.mean((g - mean) ** 2, axis=(1, 2, 4), keepdims=True)
    g = (g - mean) * jax.lax.rsqrt(var + eps)
    return g.reshape(n, h, w, c) * p["g"] + p["b"]


def split_evenly(num_layers: int, num_stages: int) -> set[int]:
    """The layer indices after which a boundary goes, for `num_stages` stages of equal size."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(
            f"cannot cut {num_layers} layers into {num_stages} stages; use 1 to {num_layers} stages"
        )
    return {round((k + 1) * num_layers / num_stages) - 1 for k in range(num_stages - 1)}


def adam_init(params: Any) -> dict[str, Any]:
    zeros = jax.tree.map(lambda p: np.zeros_like(np.asarray(p)), params)
    return {"m": zeros, "v": jax.tree.map(np.copy, zeros), "count": np.zeros((), np.int32)}


def adam_update(
    params: Any,
    grads: Any,
    state: dict[str, Any],
    learning_rate: float,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> tuple[Any, Any]:
    count = state["count"] + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
    c1 = 1 - b1 ** count.astype(jnp.float32)
    c2 = 1 - b2 ** count.astype(jnp.float32)
    new = jax.tree.map(
        lambda p, m, v: p - learning_rate * (m / c1) / (jnp.sqrt(v / c2) + eps), params, m, v
    )
    return new, {"m": m, "v": v, "count": count}
