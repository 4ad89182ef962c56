"""Pieces the example models share: normalisation, the default optimizer, and where stage
boundaries go."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxreshard.frontend import stage_boundary, stage_candidate


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


def stage_marker(
    num_layers: int, num_stages: int, candidates: bool = False
) -> Callable[[Any, int], Any]:
    """The marker a model puts after its layer `i`: `jr.stage_boundary` after the layers that
    end `num_stages` equal stages (`split_evenly`), or, with `candidates`, `jr.stage_candidate`
    after every layer but the last (`PipelineConfig(partition="auto")` or `cuts=...` choose
    which of them cut; `num_stages` is then not used)."""
    if candidates:
        return lambda x, i: stage_candidate(x) if i < num_layers - 1 else x
    ends = split_evenly(num_layers, num_stages)
    return lambda x, i: stage_boundary(x) if i in ends else x


def scan_boundaries(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """`jr.scan(..., boundaries=...)` for `num_stages` equal stages of a scanned stack of
    `num_layers` layers (the layers run before each boundary): `stage_marker`'s counterpart
    for a model that scans its layers."""
    return tuple(sorted(i + 1 for i in split_evenly(num_layers, num_stages)))


def default_optimizer() -> optax.GradientTransformation:
    """The models' optimizer unless told otherwise: Adam with Optax's defaults."""
    return optax.adam(1e-3)


# A layer count or width past these is a typo, not a model (and counting its parameters, or
# building it abstractly, would itself take minutes): refused before anything is built.
MAX_DIM = 2**20
MAX_LAYERS = 4096


def check_sizes(owner: str, values: dict[str, Any], limits: dict[str, int]) -> None:
    """Every size in `values` is an int in [1, its limit]; the error names the field."""
    for name, value in values.items():
        high = limits.get(name, MAX_DIM)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:
            raise ValueError(
                f"{owner}: {name}={value!r} must be an integer from 1 to {high:,}"
                + (" (a larger model would not fit any machine)" if _over(value, high) else "")
            )


def _over(value: Any, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > high
