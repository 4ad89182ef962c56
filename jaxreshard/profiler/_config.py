"""What `jaxreshard profile` runs: a model, a run and a pipeline, from TOML and flags.

A profile config file has three tables, every key optional:

    [model]                 # name = "gpt" (checked against the command), preset, then any
    preset = "tiny"         # field of the model's config to override the preset's
    [run]                   # RunConfig: batch_size, steps, plain_steps, warmup_steps, seed,
    steps = 20              # the optimizer (optimizer, learning_rate, weight_decay, momentum,
    optimizer = "adamw"     # clip_norm), address, placement_costs
    [pipeline]              # PipelineConfig: num_stages, num_micro_batches, schedule, ...
    schedule = "eager_1f1b"

Later sources win: defaults, then the preset, then the file, then command-line flags. Every
error names the key, where it came from, the value and what is allowed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import optax

from jaxreshard._machine import available_memory_bytes, format_bytes
from jaxreshard.models import ModelSpec, get_model
from jaxreshard.models._user import same_model
from jaxreshard.runtime._config import PipelineConfig, means_none, read_toml

TABLES = ("model", "run", "pipeline")
MAX_STEPS = 1_000  # a profile is minutes of steps (1,000 of the tiny GPT: 56 s); more is a typo
OPTIMIZER_NAMES = ("adam", "adamw", "sgd")
PLACEMENT_COSTS = ("auto", "measured", "config")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """How long and on what to run, and the optimizer that trains the model.

    Attributes:
        batch_size: samples per step (split into the pipeline's micro-batches).
        steps: timed steps.
        plain_steps: steps run as a training loop runs them, taking turns with the timed ones:
            nothing recorded, each waited for at its end. A timed step waits for every action
            to time it, which hides less of the host's work behind the devices' (the tiny GPT
            on 2 CPU cores: 1.2x a plain step); the profile reports both. None: as many as
            `steps`; 0: none (no plain-step compile either).
        warmup_steps: untimed steps first (the first one compiles).
        seed: seeds the parameters and the synthetic data.
        optimizer: `adam`, `adamw` or `sgd` (Optax's, see `make_optimizer`).
        learning_rate: the optimizer's.
        weight_decay: `adamw` only: its decoupled weight decay (none: Optax's default).
        momentum: `sgd` only: its momentum (none: plain SGD).
        clip_norm: clip the gradients to this global norm before the optimizer (none: no clip).
        address: Ray only: the cluster to join (`auto` or `HOST:PORT`); none starts a local one
            with one host per stage.
        placement_costs: what places the delayed weight gradients of the schedules compared
            by `--compare-schedules`: `measured` (a calibration run of each weight-placing
            variant first measures its per-stage F, B, W and transfer times, and the variant
            is built with those, as the zero-bubble and weight-delay schedules assume), `config`
            (the [pipeline] `cost_*` fields), or `auto` (measured unless a `cost_*` field is
            set). A single profile always uses the config's.
    """

    batch_size: int = 16
    steps: int = 10
    plain_steps: int | None = None
    warmup_steps: int = 1
    seed: int = 0
    optimizer: str = "adam"
    learning_rate: float = 1e-3
    weight_decay: float | None = None
    momentum: float | None = None
    clip_norm: float | None = None
    address: str | None = None
    placement_costs: str = "auto"

    @property
    def num_plain_steps(self) -> int:
        """How many plain steps a profile times (`plain_steps`, none meaning `steps`)."""
        return self.steps if self.plain_steps is None else self.plain_steps

    def __post_init__(self) -> None:
        for name in ("batch_size", "steps", "plain_steps", "warmup_steps", "seed"):
            value = getattr(self, name)
            if value is None and name == "plain_steps":
                continue
            low = 0 if name in ("plain_steps", "warmup_steps", "seed") else 1
            high = {"steps": MAX_STEPS, "plain_steps": MAX_STEPS, "warmup_steps": 100}.get(
                name, 2**31 - 1
            )
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(
                    f"[run] {name}={value!r}: must be an integer from {low} to {high:,}"
                    + (" (or none: as many as `steps`)" if name == "plain_steps" else "")
                )
        for name in ("learning_rate", "weight_decay", "momentum", "clip_norm"):
            value = getattr(self, name)
            if value is None and name != "learning_rate":
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"[run] {name}={value!r}: must be a number")
            if not math.isfinite(value):
                raise ValueError(
                    f"[run] {name}={value!r}: must be finite (training with it would turn every "
                    "parameter into inf or nan)"
                )
        if self.optimizer not in OPTIMIZER_NAMES:
            raise ValueError(
                f"[run] optimizer={self.optimizer!r}: choose one of {', '.join(OPTIMIZER_NAMES)}"
            )
        if self.placement_costs not in PLACEMENT_COSTS:
            raise ValueError(
                f"[run] placement_costs={self.placement_costs!r}: choose one of "
                f"{', '.join(PLACEMENT_COSTS)}"
            )
        if not self.learning_rate > 0:
            raise ValueError(f"[run] learning_rate={self.learning_rate!r}: must be > 0")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"[run] clip_norm={self.clip_norm!r}: must be > 0, or none")
        # Each optimizer's own hyperparameter: set for another one, it would be ignored.
        for name, owner in (("weight_decay", "adamw"), ("momentum", "sgd")):
            value = getattr(self, name)
            if value is not None and self.optimizer != owner:
                raise ValueError(
                    f"[run] {name}={value!r} applies to optimizer={owner!r} only, but "
                    f"optimizer={self.optimizer!r}; set optimizer = {owner!r} or drop {name}"
                )
        if self.weight_decay is not None and not self.weight_decay >= 0:
            raise ValueError(f"[run] weight_decay={self.weight_decay!r}: must be >= 0")
        if self.momentum is not None and not 0 <= self.momentum < 1:
            raise ValueError(f"[run] momentum={self.momentum!r}: must be >= 0 and < 1")

    def make_optimizer(self) -> optax.GradientTransformation:
        """The Optax optimizer these fields describe (clipping first, when `clip_norm` is set)."""
        if self.optimizer == "adamw":
            extra = {} if self.weight_decay is None else {"weight_decay": self.weight_decay}
            optimizer = optax.adamw(self.learning_rate, **extra)
        elif self.optimizer == "sgd":
            optimizer = optax.sgd(self.learning_rate, momentum=self.momentum)
        else:
            optimizer = optax.adam(self.learning_rate)
        if self.clip_norm is None:
            return optimizer
        return optax.chain(optax.clip_by_global_norm(self.clip_norm), optimizer)


# The pipeline a profile runs unless told otherwise: two stages of a (data, model) mesh.
PROFILE_PIPELINE = {
    "num_stages": 2,
    "num_micro_batches": 4,
    "schedule": "eager_1f1b",
    "weight_delay": True,
    "stage_mesh_shape": (1, 2),
    "mesh_axis_names": ("data", "model"),
    "backend": "local",
}


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    """A model config, a run config and a pipeline config, ready to profile."""

    model: str
    preset: str
    model_config: Any
    run: RunConfig
    pipeline: PipelineConfig
    # Where each (table, key) was set: a file's table or a flag (for error messages).
    origin: Mapping[tuple[str, str], str] = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def spec(self) -> ModelSpec:
        return get_model(self.model)

    @property
    def num_stages(self) -> int:
        return self.pipeline.num_stages or 2

    @property
    def candidates(self) -> bool:
        """Whether the model's layers end in `jr.stage_candidate` markers (for
        `partition = "auto"` or `cuts`) rather than in even `jr.stage_boundary` cuts."""
        return self.pipeline.partition == "auto" or self.pipeline.cuts is not None

    def replace_pipeline(self, **changes: Any) -> ProfileConfig:
        return dataclasses.replace(self, pipeline=self.pipeline.replace(**changes))

    def model_values(self) -> dict[str, Any]:
        """The model config's settable fields and their values (what a [model] table holds)."""
        config = self.model_config
        return {name: getattr(config, name) for name in model_config_fields(type(config))}

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "preset": self.preset,
            "model_config": _jsonable(self.model_values()),
            "run": dataclasses.asdict(self.run),
            "pipeline": _jsonable(self.pipeline.to_dict()),
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value


# -- building one -------------------------------------------------------------------------------


def load_profile_config(
    model: str,
    path: str | Path | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> ProfileConfig:
    """Build the config for `model` from an optional TOML file and flag overrides
    (`{"model": {...}, "run": {...}, "pipeline": {...}}`, the flags' values by field name)."""
    spec = get_model(model)
    check_model_fields(spec)
    data: dict[str, dict[str, Any]] = {t: {} for t in TABLES}
    origin: dict[tuple[str, str], str] = {}
    if path is not None:
        file_data = _read_toml(Path(path))
        for table, values in file_data.items():
            data[table].update(values)
            origin.update({(table, k): f"{path} [{table}]" for k in values})
    for table, values in (overrides or {}).items():
        data[table].update(values)
        origin.update({(table, k): f"--{k.replace('_', '-')}" for k in values})

    model_table = dict(data["model"])
    name = model_table.pop("name", model)
    if not isinstance(name, str) or not same_model(name, model):
        raise ValueError(
            f"{origin[('model', 'name')]}: name={name!r} but the command profiles {model!r}; "
            f"run `jaxreshard profile {name}` or change the name"
        )
    preset = model_table.pop("preset", spec.default_preset)
    if not isinstance(preset, str) or preset not in spec.presets:
        raise ValueError(
            f"{origin.get(('model', 'preset'), '[model]')}: preset={preset!r} is not a {model} "
            f"preset; choose one of {', '.join(spec.presets)}"
        )
    base = spec.presets[preset]
    model_fields = model_config_fields(spec.config_type)
    for key, value in model_table.items():
        where = origin[("model", key)]
        if key not in model_fields:
            raise ValueError(
                f"{where}: unknown key {key!r} for {model}; valid keys: name, preset, "
                f"{', '.join(model_fields)}"
            )
        model_table[key] = coerce(
            value, _hint(spec.config_type, key), f"{where} {key}", text=where.startswith("--")
        )
    model_config = _build(
        lambda: dataclasses.replace(base, **model_table), origin, "model", model_table
    )
    if not spec.builtin:
        _check_writable(model_config, model, origin)

    run_values = _checked(data["run"], RunConfig, "run", origin)
    run = _build(lambda: RunConfig(**run_values), origin, "run", run_values)

    pipe_values = {
        **PROFILE_PIPELINE,
        **_checked(data["pipeline"], PipelineConfig, "pipeline", origin),
    }
    pipeline = _build(lambda: PipelineConfig(**pipe_values), origin, "pipeline", pipe_values)
    if pipeline.cuts is not None and ("pipeline", "num_stages") not in origin:
        pipeline = pipeline.replace(num_stages=len(pipeline.cuts) + 1)  # (as many as the cuts)
    if pipeline.num_stages is None:
        pipeline = pipeline.replace(num_stages=2)
    if run.address is not None and pipeline.backend != "ray":
        raise ValueError(
            f"address={run.address!r}{_from(origin, 'run', 'address')} is the Ray cluster to "
            f"join, but backend={pipeline.backend!r}{_from(origin, 'pipeline', 'backend')}; set "
            "backend = 'ray' (--backend ray) to use it, or drop the address"
        )
    if "explicit" in pipeline.axis_types and spec.builtin:
        raise ValueError(
            f"mesh_axis_types={pipeline.mesh_axis_types!r}"
            f"{_from(origin, 'pipeline', 'mesh_axis_types')}: the shipped {model} model is "
            "written for Auto mesh axes. It lays its weights out tensor-parallel, and on "
            "Explicit axes JAX asks its code for `out_sharding`s of its lookups and matmuls, "
            "which it does not carry. Use mesh_axis_types = 'auto' (XLA lays that layout out); "
            "Explicit axes are for steps written against JAX's explicit sharding "
            "(jaxreshard.parallelize)"
        )
    units = spec.num_units(model_config)
    if pipeline.num_stages > units:
        raise ValueError(
            f"num_stages={pipeline.num_stages}"
            f"{_from(origin, 'pipeline', 'num_stages')}: the {model} {preset} model has "
            f"{units} layers to share, so at most {units} stages; use fewer stages or a bigger "
            "model"
        )
    if run.batch_size % pipeline.num_micro_batches:
        raise ValueError(
            f"batch_size={run.batch_size}{_from(origin, 'run', 'batch_size')} is not a multiple "
            f"of num_micro_batches={pipeline.num_micro_batches}"
            f"{_from(origin, 'pipeline', 'num_micro_batches')}; make it one"
        )
    return ProfileConfig(model, preset, model_config, run, pipeline, origin)


def model_config_fields(config_type: type) -> dict[str, dataclasses.Field]:
    """The fields of a model's config that a file or a flag sets (not `init=False` ones)."""
    return {f.name: f for f in dataclasses.fields(config_type) if f.init}


def check_model_fields(spec: ModelSpec) -> None:
    """Refuse a model (of the user's) whose config fields take a name the profile config
    already gives a meaning: `name`, `preset`, or a [run] or [pipeline] key (one flag each)."""
    if spec.builtin:
        return
    taken = {"name", "preset"} | {f.name for f in dataclasses.fields(RunConfig)}
    taken |= {f.name for f in dataclasses.fields(PipelineConfig)}
    clash = sorted(set(model_config_fields(spec.config_type)) & taken)
    if clash:
        raise ValueError(
            f"model {spec.name!r}: its config {spec.config_type.__name__} has the field(s) "
            f"{', '.join(clash)}, which are names the profile config already uses (name, preset, "
            "and the [run] and [pipeline] keys, each a --flag); rename them in the model (e.g. "
            f"model_{clash[0]})"
        )


def _check_writable(config: Any, model: str, origin: Mapping[tuple[str, str], str]) -> None:
    """Every field of a user model's config must be a value a TOML file and a JSON record can
    hold (bool, int, finite float, str, or a list of them), since the profile writes them."""

    def ok(value: Any, top: bool = True) -> bool:
        if isinstance(value, (list, tuple)):
            return all(ok(v, False) for v in value)
        if isinstance(value, float):
            return math.isfinite(value)
        return (top and value is None) or isinstance(value, (bool, int, str))

    for name in model_config_fields(type(config)):
        value = getattr(config, name)
        if not ok(value):
            where = origin.get(("model", name), "its preset")
            raise ValueError(
                f"model {model!r}: config field {name}={value!r} (from {where}) is not a value "
                "a profile config file holds (bool, int, finite float, str, or a list of them); "
                "make it one (a dtype as the string 'float32', say, turned into the dtype "
                "inside the model)"
            )


def check_fits(pc: ProfileConfig) -> None:
    """Refuse a model and batch whose training state and activations (estimated) need more
    memory than this machine has available, before anything is allocated: for runs whose
    devices are this machine's CPU (fake devices share its memory)."""
    available = available_memory_bytes()
    if available is None:
        return
    cfg = pc.model_config
    slots = {"adam": 2, "adamw": 2, "sgd": 0 if pc.run.momentum is None else 1}[pc.run.optimizer]
    num_params = pc.spec.num_params(cfg)
    if num_params is None:  # (a model of the user's that does not trace abstractly)
        return
    state = num_params * 4 * (2 + slots)  # parameters, gradients, optimizer slots (f32)
    activations = pc.spec.activation_bytes(cfg, pc.run.batch_size) or 0
    if state + activations <= available:
        return
    origin = pc.origin
    set_by = [
        f"{key}={value!r} from {origin[(table, key)]}"
        for table, config in (("model", cfg), ("run", pc.run))
        for key, value in ((f.name, getattr(config, f.name)) for f in dataclasses.fields(config))
        if (table, key) in origin and (table == "model" or key == "batch_size")
    ]
    raise ValueError(
        f"{pc.model} {pc.preset}"
        + (f" with {', '.join(set_by)}" if set_by else "")
        + f": {num_params:.3g} parameters need ~{format_bytes(state)} for parameters, "
        f"gradients and {pc.run.optimizer} state, and a batch of {pc.run.batch_size} needs "
        f"~{format_bytes(activations)} of activations (estimates), but this machine has "
        f"{format_bytes(available)} available; use a smaller preset, fewer layers or a smaller "
        "batch"
    )


def _read_toml(path: Path) -> dict[str, dict[str, Any]]:
    data = read_toml(path, what="--config")
    for key, value in data.items():
        if key not in TABLES:
            raise ValueError(
                f"{path}: unknown table or key {key!r}; a profile config has the tables "
                f"{', '.join(f'[{t}]' for t in TABLES)}"
            )
        if not isinstance(value, dict):
            raise ValueError(f"{path}: {key!r} must be a table ([{key}]), not {value!r}")
    return data


def _checked(
    values: Mapping[str, Any], cls: type, table: str, origin: Mapping[tuple[str, str], str]
) -> dict[str, Any]:
    fields = [f.name for f in dataclasses.fields(cls)]
    out = {}
    for key, value in values.items():
        where = origin[(table, key)]
        if key not in fields:
            raise ValueError(f"{where}: unknown key {key!r}; valid keys: {', '.join(fields)}")
        out[key] = coerce(value, _hint(cls, key), f"{where} {key}", text=where.startswith("--"))
    return out


def _build(make, origin, table, values) -> Any:
    """Call `make`; add to a validation error where the keys it names were set."""
    try:
        return make()
    except (ValueError, TypeError) as e:
        text = str(e)
        sources = [
            f"{key} from {origin[(table, key)]}"
            for key in values
            if (table, key) in origin and key in text
        ]
        raise ValueError(text + (f" ({'; '.join(sources)})" if sources else "")) from None


def _from(origin: Mapping[tuple[str, str], str], table: str, key: str) -> str:
    where = origin.get((table, key))
    return f" (from {where})" if where else ""


def _hint(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


def coerce(value: Any, hint: Any, where: str, *, text: bool = False) -> Any:
    """Check a value against a field's type; with `text` (a flag's value), convert it from the
    flag's string first. A file's value must have the TOML type the field takes: a string where
    a number or a list is meant is an error, not parsed."""
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if means_none(value, hint):  # ("none" in a file, as a flag says it)
            return None
        inner = [a for a in args if a is not type(None)]
        kinds = []
        for a in inner:
            try:
                return coerce(value, a, where, text=text)
            except _WrongType as e:
                kinds.append(e.kind)
            # any other ValueError: the value has this type but is refused; say why
        kinds += ["none"] if type(None) in args else []
        raise _WrongType(where, value, " or ".join(kinds))
    if origin is typing.Literal:  # (a flag gives the text of one of the values)
        for allowed in args:
            if value == allowed or (text and isinstance(value, str) and value == str(allowed)):
                return allowed
        raise _WrongType(where, value, "one of " + ", ".join(map(repr, args)))
    if hint is bool:
        if isinstance(value, bool):
            return value
        if text and isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise _WrongType(where, value, "true or false")
    if hint in (int, float):
        accepted = (int,) if hint is int else (int, float)
        if text and isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = hint(value)
        if isinstance(value, accepted) and not isinstance(value, bool):
            if hint is float and not math.isfinite(value):
                raise ValueError(f"{where}={value!r}: must be a finite number")
            return hint(value)
        raise _WrongType(where, value, "an integer" if hint is int else "a number")
    if hint is str:
        if isinstance(value, str):
            return value
        raise _WrongType(where, value, "a string")
    if origin in (tuple, list):
        kind = origin
        if text and isinstance(value, str):
            return kind(parse_tuple(value, args, where))
        if isinstance(value, (list, tuple)):
            return kind(value)
        example = '["data", "model"]' if args and args[0] is str else "[1, 2]"
        raise _WrongType(where, value, f"a list, e.g. {example}")
    return value


class _WrongType(ValueError):
    """A value of another type than its field takes (a union tries its other types)."""

    def __init__(self, where: str, value: Any, kind: str):
        self.kind = kind
        from_file = not where.startswith("--")
        quoted = (
            " (a TOML number or list is written without quotes)"
            if from_file
            and isinstance(value, str)
            and ("number" in kind or "integer" in kind or "list" in kind)
            else ""
        )
        super().__init__(f"{where}={value!r}: must be {kind}{quoted}")


def parse_tuple(text: str, args: tuple[Any, ...], where: str) -> tuple[Any, ...]:
    """A flag's tuple: `1,2` (or `1x2`) for ints, `data,model` for names; `;` separates
    per-stage shapes (`1,2;2,1`)."""
    if ";" in text:
        return tuple(parse_tuple(part, args, where) for part in text.split(";"))
    if args and args[0] is str:
        return tuple(p.strip() for p in text.split(",") if p.strip())
    if args and args[0] is float:
        try:
            return tuple(float(p) for p in text.split(",") if p.strip())
        except ValueError:
            raise ValueError(
                f"{where}={text!r}: must be a number, or comma-separated numbers (one per stage), "
                "e.g. 0.02,0.018"
            ) from None
    parts = [p.strip() for p in text.replace("x", ",").split(",") if p.strip()]
    if not parts:
        raise ValueError(f"{where}={text!r}: must be comma-separated integers, e.g. 1,2")
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(
            f"{where}={text!r}: must be comma-separated integers, e.g. 1,2 (per stage: 1,2;2,1)"
        ) from None
