"""Example models for end-to-end pipeline training: GPT and U-Transformer.

Plain JAX (pytrees of arrays and pure functions) with `jr.stage_boundary` markers placed by the
number of stages, so `jaxreshard profile` and user scripts can train them on any pipeline shape.
Each model module has `PRESETS`, `init_params`, `init_state`, `train_step` (which takes any
Optax optimizer, Adam by default), `synthetic_batch` and `param_specs`; `get_model` describes them
for the profiler.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the profiler needs to know about a model.

    Attributes:
        name: as on the command line.
        config_type: the model's config dataclass.
        presets: named configs.
        module: the model module (`init_params`, `init_state`, `train_step`,
            `synthetic_batch`, `param_specs`).
        unit: what throughput counts (`tokens` or `images`).
        units_per_sample: how many units one sample of the batch is.
        num_units: how many layers (blocks) the stages share; at most that many stages.
    """

    name: str
    config_type: type
    presets: dict[str, Any]
    module: Any
    unit: str
    units_per_sample: Callable[[Any], int]
    num_units: Callable[[Any], int]


def _specs() -> dict[str, ModelSpec]:
    from jaxreshard.models import gpt, utransformer

    return {
        "gpt": ModelSpec(
            "gpt",
            gpt.GPTConfig,
            gpt.PRESETS,
            gpt,
            "tokens",
            lambda cfg: cfg.seq,
            lambda cfg: cfg.layers,
        ),
        "utransformer": ModelSpec(
            "utransformer",
            utransformer.UTransformerConfig,
            utransformer.PRESETS,
            utransformer,
            "images",
            lambda cfg: 1,
            lambda cfg: cfg.num_units,
        ),
    }


def get_model(name: str) -> ModelSpec:
    specs = _specs()
    if name not in specs:
        raise ValueError(f"model {name!r}: choose one of {', '.join(specs)}")
    return specs[name]


MODEL_NAMES = ("gpt", "utransformer")
