"""Example models for end-to-end pipeline training: GPT and U-Transformer.

Plain JAX (pytrees of arrays and pure functions) with `jr.stage_boundary` markers placed by the
number of stages, so `jaxreshard profile` and user scripts can train them on any pipeline shape.
Each model module has `PRESETS`, `init_params`, `init_state`, `train_step` (which takes any
Optax optimizer, Adam by default), `synthetic_batch` and `param_specs`; `get_model` describes them
for the profiler, and a model of the user's own that follows the same conventions too (see
[Note: user models] in `_user.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxreshard.models._user import accepts_candidates, load_model

_COUNTED: dict[tuple[str, str], int | None] = {}  # (model, config) -> parameters, user models


def _np_shape(x: Any) -> tuple[int, ...]:
    return tuple(getattr(x, "shape", ()))


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
        builtin: one of the models shipped here (False: the user's own, see
            [Note: user models]).
    """

    name: str
    config_type: type
    presets: dict[str, Any]
    module: Any
    unit: str
    units_per_sample: Callable[[Any], int]
    num_units: Callable[[Any], int]
    builtin: bool = True

    @property
    def default_preset(self) -> str:
        return "tiny" if "tiny" in self.presets else next(iter(self.presets))

    def train_step(self, cfg: Any, num_stages: int, optimizer: Any, candidates: bool) -> Any:
        """The model's step; `candidates` is passed only when asked for (a model of the user's
        without `jr.stage_candidate`s still profiles with its even stages)."""
        if not candidates:
            return self._step(self.module.train_step(cfg, num_stages, optimizer))
        if not self.builtin and not accepts_candidates(self.module.train_step):
            raise ValueError(
                f"model {self.name!r}: partition='auto', cuts= and --auto's cut search need "
                "train_step(cfg, num_stages, optimizer, *, candidates=False) to mark a "
                "jr.stage_candidate after every layer when candidates=True "
                "(jaxreshard.models.stage_marker does it); add the keyword, or keep the "
                "model's even stages (partition='manual' without cuts, --auto-cuts keep)"
            )
        return self._step(self.module.train_step(cfg, num_stages, optimizer, candidates=True))

    def _step(self, step: Any) -> Any:
        """A user model's step as `parallelize` takes it: a callable, not a `jax.jit` of one
        (`parallelize` compiles it: a jitted step is taken unwrapped, which computes the same)."""
        if self.builtin:
            return step
        if not callable(step):
            raise ValueError(
                f"model {self.name!r}: train_step(cfg, num_stages, optimizer) returned "
                f"{type(step).__name__}, not the step function "
                "(params, opt_state, batch) -> (params, opt_state, loss); return it"
            )
        inner = getattr(step, "__wrapped__", None)
        return inner if callable(inner) and hasattr(step, "lower") else step

    def param_specs(self, cfg: Any, axis: str, params: Any) -> Any:
        """The parameters' PartitionSpecs over mesh axis `axis` (replicated if the model gives
        none)."""
        from jax.sharding import PartitionSpec

        make = getattr(self.module, "param_specs", None)
        if make is None:
            import jax

            return jax.tree.map(lambda _: PartitionSpec(), params)
        return make(cfg, axis)

    def num_params(self, cfg: Any) -> int | None:
        """The parameter count: the config's (built-in models), the model's `num_params(cfg)`,
        or counted from `init_params` under `jax.eval_shape` (None if that fails; a NumPy
        initialisation runs in full there)."""
        if self.builtin:
            return cfg.num_params
        count = getattr(self.module, "num_params", None)
        if callable(count):
            return int(count(cfg))
        key = (self.name, repr(cfg))
        if key not in _COUNTED:  # (tracing `init_params` may take a while: once per config)
            import math

            import jax

            try:
                shapes = jax.eval_shape(lambda: self.module.init_params(cfg, 0))
                _COUNTED[key] = sum(math.prod(_np_shape(x)) for x in jax.tree.leaves(shapes))
            except Exception:
                _COUNTED[key] = None
        return _COUNTED[key]

    def activation_bytes(self, cfg: Any, batch_size: int) -> int | None:
        """An estimate of a whole batch's activation bytes (None: the model gives none)."""
        if self.builtin:
            return cfg.activation_bytes(batch_size)
        estimate = getattr(self.module, "activation_bytes", None)
        return int(estimate(cfg, batch_size)) if callable(estimate) else None


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
    """The built-in model `name`, or the user's model it refers to (`path/to/model.py` or
    `package.module`, optionally `:NAME`; see [Note: user models])."""
    specs = _specs()
    if name in specs:
        return specs[name]
    return load_model(name)


MODEL_NAMES = ("gpt", "utransformer")

__all__ = ["MODEL_NAMES", "ModelSpec", "get_model", "load_model", "scan_boundaries",
           "stage_marker"]  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in ("stage_marker", "scan_boundaries"):  # (imported on use: it brings JAX in)
        from jaxreshard.models import _common

        return getattr(_common, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
