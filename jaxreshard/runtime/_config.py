"""`PipelineConfig`: how `parallelize` cuts, places and schedules a train step."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import tomllib
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxreshard._files import InputError, read_text, show
from jaxreshard.pipeline import SCHEDULE_NAMES as SCHEDULES
from jaxreshard.pipeline._schedules import FIXED_SPLIT, check_virtual_stages

RESHARDING = (
    "send_recv",
    "allgather",
    "broadcast_naive",
    "broadcast_size",
    "broadcast_dfs",
    "broadcast_greedy",
    "broadcast_match",
    "auto",
)
AXIS_TYPES = ("auto", "explicit")
# When a step of Explicit axes cannot be traced on Auto ones to choose its cuts, the fix.
EXPLICIT_PARTITION = (
    "the partitioner chooses the cuts of a step of Explicit axes from a trace of it on Auto "
    "axes (each segment is timed on one device, where types over the stage mesh cannot run), "
    "and this step does not trace on Auto axes. Choose the cuts by hand: pass cuts=(...) with "
    "partition='manual' (train_step.plan(...) shows the boundary tensors of a choice)"
)
# Counts past these are typos, not pipelines: the schedule alone would need more memory and time
# than a machine has (a step of p stages and m micro-batches runs about 3 p m actions).
MAX_STAGES = 1024
MAX_MICRO_BATCHES = 100_000
MAX_MESH_DEVICES = 2**16
MAX_PARTITION_TRIALS = 64
LOSS_REDUCTIONS = ("mean", "sum")
BACKENDS = ("auto", "local", "ray")
FUSE_OPTIMIZER = ("auto", "always", "never")
REDUCE_GRADIENTS = ("once", "every_micro_batch")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """How to run a train step as a pipeline.

    Attributes:
        num_micro_batches: micro-batches per step; must divide the batch (dim 0 of every leaf of
            the `batch_argnums` arguments).
        schedule: `gpipe`, `1f1b`, `eager_1f1b`, `zb_h1`, or a virtual-stage schedule
            (`interleaved_1f1b`, `eager_interleaved_1f1b`, `zbv`, `dualpipev`).
        weight_delay: split each backward into input-gradient and weight-gradient parts and
            delay the latter to hide the gradient transfers (backward weight delaying).
        virtual_stages: model stages (chunks) per mesh, for the virtual-stage schedules: the
            step has meshes x virtual_stages stages, and chunk c runs on the mesh the schedule
            places it on (interleaved: c mod meshes; zbv/dualpipev: a V). None: the
            schedule's default (1; 2 for the virtual-stage schedules).
        stage_mesh_shape: the device mesh of every stage, e.g. `(1, 2)`; or one shape per stage
            (per mesh, with virtual stages).
        mesh_axis_names: names of the mesh axes (for `PartitionSpec`s inside the step).
        mesh_axis_types: `auto` (the compiler propagates shardings; `with_sharding_constraint`
            steers it) or `explicit` (shardings are part of array types, JAX's "sharding in
            types"), for every axis or one per axis. `parallelize(meshes=...)` takes the
            meshes' own axis types instead.
        resharding: the strategy for boundary tensors (any of `jaxreshard.comm.STRATEGY_NAMES`).
        num_stages: the number of stages the step must have (boundaries + 1); None: whatever
            the markers say, at least two. Set 1 to run an unmarked step as one stage.
        batch_axis: mesh axis to shard the batch's dim 0 over inside a stage, when the stage
            mesh has it and it divides the micro-batch; None: replicate the batch.
        loss_reduction: `mean` (the loss is a mean over the batch; micro-batch losses are
            averaged) or `sum` (micro-batch losses and gradients are summed).
        devices_per_host: group devices into hosts of this size for the resharding planner's
            cost model (default: by process).
        timeout_s: longest wait for any transfer before the step fails with an error.
        emulate_network_gbps: delay every transfer between stages on different hosts as a NIC of
            this speed would (the cluster model), to see transfer effects on one machine.
        cost_forward, cost_backward, cost_weight_grad, cost_comm: per micro-batch, the
            relative times the schedule builder uses to place delayed weight gradients: one
            number for every stage (boundary, for `cost_comm`), or one per model stage (chunk)
            and per boundary, e.g. a profile's measured `measured_costs` (`jaxreshard profile
            --compare-schedules` places with those). Default: the paper's F=1, B=2 (B includes
            W), W=1, transfer=1.
        backend: `local` (this process's devices), `ray` (the running Ray runtime's host
            actors; see `jaxreshard.init`), or `auto` (whichever runtime is running).
        steps_in_flight: how many steps a call may leave running on the devices before the
            next call waits for the oldest: a call returns once its step is dispatched, as
            `jax.jit`'s does, and the host runs ahead by up to this many steps (each holds its
            batch and activations meanwhile). Errors of a step surface at a later call or at
            `train_step.wait()`. On Ray, at most 8.
        fuse_optimizer: where the optimizer (the step's code after the gradients) runs inside
            each stage's last backward: `auto` (where it costs no extra executable: with one
            micro-batch, or in a one-stage pipeline, whose micro-batches run as one scan),
            `always` (with any micro-batch count: faster steps, but a second backward variant
            to compile before the first), or `never`.
        partition: `manual` (the stages are what `jr.stage_boundary` and `cuts` say) or `auto`
            (choose `num_stages - 1` of the step's `jr.stage_candidate` markers as boundaries
            by the simulated step time: each segment's measured compute and each cut's transfer
            time under the cluster model; `train_step.plan(...)` shows the choice and why).
        cuts: the `jr.stage_candidate` markers that are stage boundaries, by number (from 0,
            in the order the loss reaches them); None: none (`manual`), or the partitioner's
            choice (`auto`).
        memory_cap_gib: with `partition="auto"`, the GiB each device may hold: cuts whose
            estimated peak (parameters, gradients, optimizer state, the activations the
            schedule keeps alive, XLA scratch) is over it are not chosen. None: the device's
            own limit where JAX reports one (the local runtime's GPUs), else no cap.
        partition_trials: with `partition="auto"`, how many of the fastest predicted choices
            (under the memory cap) to measure before choosing: each is compiled, warmed by 2
            steps, then timed side by side with the others (the median of 5 rounds of 2 steps
            each) on the first call's own arguments (nothing donated, the outputs dropped). A
            factor on compute fitted to those steps predicts every choice again, and the fastest
            of that joins them if it was not measured; the fastest measured wins. 1 (the
            default): the predicted fastest is measured, and the factor fitted to it decides
            whether another joins (where the prediction is right, one trial, and without
            donation or recording no other compile; if that one trial fails to run, the
            prediction decides, with a warning). 0: the prediction alone decides. Measuring
            costs a compile and a few steps per choice, keeps every measured choice's pipeline
            (with a copy of the state) alive until the choice is made (under a memory cap, only
            as many run as fit together), and
            corrects what the prediction leaves out (each action's fixed cost on the host,
            contention).
        reduce_gradients: how often a stage whose mesh splits its batch (a `data` axis) sums
            its parameter gradients over that axis: `once` a step, after its last backward
            (the gradients of the micro-batches stay per device until then), where JAX can
            type them so (the plan says which stages do, and why not the others), or
            `every_micro_batch`, inside each backward.
    """

    num_micro_batches: int = 1
    schedule: str = "1f1b"
    weight_delay: bool = False
    virtual_stages: int | None = None
    stage_mesh_shape: tuple[Any, ...] = (1,)
    mesh_axis_names: tuple[str, ...] = ("data",)
    mesh_axis_types: str | tuple[str, ...] = "auto"
    resharding: str = "auto"
    num_stages: int | None = None
    batch_axis: str | None = "data"
    loss_reduction: str = "mean"
    devices_per_host: int | None = None
    timeout_s: float = 120.0
    emulate_network_gbps: float | None = None
    cost_forward: float | tuple[float, ...] = 1.0
    cost_backward: float | tuple[float, ...] = 2.0
    cost_weight_grad: float | tuple[float, ...] = 1.0
    cost_comm: float | tuple[float, ...] = 1.0
    backend: str = "auto"
    steps_in_flight: int = 2
    fuse_optimizer: str = "auto"
    reduce_gradients: str = "once"
    partition: str = "manual"
    cuts: tuple[int, ...] | None = None
    memory_cap_gib: float | None = None
    partition_trials: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_mesh_shape", _shape_or_shapes(self.stage_mesh_shape))
        object.__setattr__(self, "mesh_axis_names", _axis_names(self.mesh_axis_names))
        _choice("schedule", self.schedule, SCHEDULES)
        check_virtual_stages(
            self.schedule,
            self.virtual_stages,
            f"PipelineConfig(schedule={self.schedule!r}): virtual_stages",
        )
        _choice("resharding", self.resharding, RESHARDING)
        _choice("loss_reduction", self.loss_reduction, LOSS_REDUCTIONS)
        _choice("backend", self.backend, BACKENDS)
        _choice("fuse_optimizer", self.fuse_optimizer, FUSE_OPTIMIZER)
        _choice("reduce_gradients", self.reduce_gradients, REDUCE_GRADIENTS)
        _choice("partition", self.partition, ("manual", "auto"))
        if self.cuts is not None:
            cuts = self.cuts
            if isinstance(cuts, (str, bytes)) or not isinstance(cuts, (tuple, list)):
                raise ValueError(
                    f"PipelineConfig(cuts={cuts!r}): a tuple of jr.stage_candidate numbers, "
                    "e.g. (1, 3)"
                )
            if not all(_is_index(c) for c in cuts) or len(set(cuts)) != len(cuts):
                raise ValueError(
                    f"PipelineConfig(cuts={cuts!r}): distinct candidate numbers (ints >= 0)"
                )
            object.__setattr__(self, "cuts", tuple(sorted(int(c) for c in cuts)))
        cap = self.memory_cap_gib
        if cap is not None and not (_finite_number(cap) and cap > 0):
            raise ValueError(
                f"PipelineConfig(memory_cap_gib={cap!r}): must be a number of GiB per device "
                "> 0, or None for the device's own limit"
            )
        if self.partition == "auto" and (self.num_stages is None or self.num_stages < 2):
            raise ValueError(
                f"PipelineConfig(partition='auto', num_stages={self.num_stages!r}): say how many "
                "stages to cut the step into (num_stages >= 2)"
            )
        _int_in_range("num_micro_batches", self.num_micro_batches, MAX_MICRO_BATCHES)
        _int_in_range("steps_in_flight", self.steps_in_flight, 64)
        _int_in_range("partition_trials", self.partition_trials, MAX_PARTITION_TRIALS, low=0)
        if self.partition_trials > 1 and self.partition != "auto":
            raise ValueError(
                f"PipelineConfig(partition_trials={self.partition_trials}): trials measure the "
                "choices of partition='auto'; set partition='auto' (with num_stages), or leave "
                "partition_trials at 0 or 1 (the default)"
            )
        if self.num_stages is not None:
            _int_in_range("num_stages", self.num_stages, MAX_STAGES)
        if self.devices_per_host is not None:
            _int_in_range("devices_per_host", self.devices_per_host, MAX_MESH_DEVICES)
        for name in ("num_micro_batches", "steps_in_flight", "num_stages", "devices_per_host"):
            value = getattr(self, name)
            if value is not None:  # (a numpy integer is taken as the int it is)
                object.__setattr__(self, name, int(value))
        if not isinstance(self.weight_delay, bool):
            raise ValueError(
                f"PipelineConfig(weight_delay={self.weight_delay!r}): use True or False"
            )
        for shape in self.mesh_shapes(None):
            if len(shape) != len(self.mesh_axis_names):
                raise ValueError(
                    f"PipelineConfig: stage_mesh_shape {shape} has {len(shape)} axes but "
                    f"mesh_axis_names={self.mesh_axis_names} names {len(self.mesh_axis_names)}; "
                    "give one name per mesh axis"
                )
        types = self.mesh_axis_types
        if not isinstance(types, (str, list, tuple)):
            raise ValueError(
                f"PipelineConfig(mesh_axis_types={types!r}): give 'auto' or 'explicit', or a "
                "tuple of them, one per mesh axis"
            )
        if not isinstance(types, str):
            types = tuple(types)
            object.__setattr__(self, "mesh_axis_types", types)
            if len(types) != len(self.mesh_axis_names):
                raise ValueError(
                    f"PipelineConfig(mesh_axis_types={types}): gives {len(types)} types for "
                    f"mesh_axis_names={self.mesh_axis_names}; give one per axis or one for all"
                )
        for t in (types,) if isinstance(types, str) else types:
            _choice("mesh_axis_types", t, AXIS_TYPES)
        if len(set(self.mesh_axis_names)) != len(self.mesh_axis_names):
            raise ValueError(
                f"PipelineConfig: mesh_axis_names={self.mesh_axis_names} repeats a name"
            )
        if self.batch_axis is not None and self.batch_axis not in self.mesh_axis_names:
            raise ValueError(
                f"PipelineConfig(batch_axis={self.batch_axis!r}): not one of mesh_axis_names="
                f"{self.mesh_axis_names}; name one of them or pass None"
            )
        if not _finite_number(self.timeout_s) or not self.timeout_s > 0:
            raise ValueError(
                f"PipelineConfig(timeout_s={self.timeout_s!r}): must be a finite number of "
                "seconds > 0 (every wait needs a bound, so a hang is named instead of lasting "
                "forever)"
            )
        for name, positive in (("cost_forward", True), ("cost_backward", True),
                               ("cost_weight_grad", False), ("cost_comm", False)):  # fmt: skip
            value = _costs(name, getattr(self, name), positive)
            object.__setattr__(self, name, value)
        w, b = self.cost_weight_grad, self.cost_backward
        n = max((len(v) for v in (w, b) if isinstance(v, tuple)), default=1)
        pairs = zip(*(v if isinstance(v, tuple) else (v,) * n for v in (w, b)))
        if any(wi > bi for wi, bi in pairs):
            raise ValueError(
                f"PipelineConfig: cost_weight_grad={w} exceeds cost_backward={b}, of which it "
                "is a part (per stage)"
            )
        gbps = self.emulate_network_gbps
        if gbps is not None and not (_finite_number(gbps) and 1e-6 <= gbps <= 1e6):
            raise ValueError(
                f"PipelineConfig(emulate_network_gbps={gbps!r}): must be a number of GB/s from "
                "1e-06 (1 kB/s) to 1e+06, or None for no emulation"
            )

    @property
    def axis_types(self) -> tuple[str, ...]:
        """`mesh_axis_types` as one name per mesh axis."""
        types = self.mesh_axis_types
        return (types,) * len(self.mesh_axis_names) if isinstance(types, str) else tuple(types)

    @property
    def split_backward(self) -> bool:
        """Whether each backward is split into input-gradient (B) and weight-gradient (W)."""
        return self.weight_delay or self.schedule in FIXED_SPLIT

    @property
    def chunks_per_mesh(self) -> int:
        """v: model stages per mesh (`virtual_stages`, or the schedule's default)."""
        return check_virtual_stages(self.schedule, self.virtual_stages)

    def num_meshes(self, num_stages: int) -> int:
        """How many meshes a step of `num_stages` model stages runs on."""
        v = self.chunks_per_mesh
        if num_stages % v:
            raise ValueError(
                f"the step has {num_stages} stages ({num_stages - 1} jr.stage_boundary markers) "
                f"but schedule {self.schedule!r} puts {v} on each mesh "
                f"(virtual_stages={v}); cut the model into a multiple of {v} stages"
            )
        return num_stages // v

    def mesh_shapes(self, num_meshes: int | None) -> tuple[tuple[int, ...], ...]:
        """The shape of every mesh (one shape repeated, or the per-mesh list)."""
        shapes = self.stage_mesh_shape
        v = self.chunks_per_mesh
        if shapes and isinstance(shapes[0], tuple):
            if num_meshes is not None and len(shapes) != num_meshes:
                chunks = "" if v == 1 else f", {v} model stages each"
                raise ValueError(
                    f"PipelineConfig(stage_mesh_shape=...) gives {len(shapes)} stage meshes but "
                    f"the step runs on {num_meshes} meshes ({num_meshes * v} stages, "
                    f"{num_meshes * v - 1} jr.stage_boundary markers{chunks}); give one shape "
                    "per mesh, or one shape for all"
                )
            return shapes  # type: ignore[return-value]
        return (shapes,) * (num_meshes or 1)  # type: ignore[return-value]

    def devices_per_mesh(self, num_stages: int) -> list[int]:
        """The device count of every mesh of a step of `num_stages` model stages."""
        return [math.prod(shape) for shape in self.mesh_shapes(self.num_meshes(num_stages))]

    def replace(self, **changes: Any) -> PipelineConfig:
        """A copy with some fields changed (validated); unknown field names are an error."""
        _check_keys(changes, "PipelineConfig.replace")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "config") -> PipelineConfig:
        _check_keys(data, where)
        values = {k: (_tuples(v) if isinstance(v, list) else v) for k, v in data.items()}
        for k, v in values.items():
            if k in _HINTS and means_none(v, _HINTS[k]):
                values[k] = None
        try:
            return cls(**values)
        except TypeError as e:
            raise ValueError(f"{where}: {e}") from None

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> PipelineConfig:
        """Load the `[pipeline]` table of a TOML file (or its top level), then apply overrides."""
        if not isinstance(path, (str, Path)):
            raise TypeError(
                f"PipelineConfig.from_toml({show(path)}): give the TOML file's path (a str or "
                "pathlib.Path)"
            )
        path = Path(path)
        data = read_toml(path, what="pipeline config")
        table = data.get("pipeline", data)
        if not isinstance(table, dict):
            raise InputError(
                f"pipeline config {path}: 'pipeline' must be a table ([pipeline]), not "
                f"{show(table)}"
            )
        if not table:
            raise InputError(
                f"pipeline config {path}: no [pipeline] table and no keys; give the pipeline's "
                "keys (e.g. num_micro_batches = 4) or use PipelineConfig() for the defaults"
            )
        return cls.from_dict({**table, **overrides}, where=f"{path} [pipeline]")


def _checked_init(init: Any) -> Any:
    """`PipelineConfig(...)` that names an unknown field with the valid ones (the dataclass's
    own error names only the argument)."""

    @functools.wraps(init)
    def __init__(self: PipelineConfig, *args: Any, **kwargs: Any) -> None:
        _check_keys(kwargs, "PipelineConfig(...)")
        init(self, *args, **kwargs)

    return __init__


PipelineConfig.__init__ = _checked_init(PipelineConfig.__init__)  # type: ignore[method-assign]

_HINTS = typing.get_type_hints(PipelineConfig)


def means_none(value: Any, hint: Any) -> bool:
    """Whether a config file's `value` for a field of type `hint` means None. TOML has no
    null: a file says "none" (any case) as a flag does, and `--auto-toml` writes it so, for a
    field that takes None, unless a Literal of the field allows the text "none" itself."""
    args = typing.get_args(hint)
    if type(None) not in args:
        return False
    if value is None:
        return True
    if not isinstance(value, str) or value.lower() != "none":
        return False
    return not any(
        typing.get_origin(a) is typing.Literal and value in typing.get_args(a) for a in args
    )


def _check_keys(data: Mapping[str, Any], where: str) -> None:
    fields = [f.name for f in dataclasses.fields(PipelineConfig)]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; valid keys: {', '.join(fields)}")


def _choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"PipelineConfig({name}={value!r}): choose one of {', '.join(choices)}")


def _costs(name: str, value: Any, positive: bool) -> float | tuple[float, ...]:
    """A cost field as a float or a tuple of floats (per stage or boundary), checked."""
    listed = isinstance(value, (list, tuple, np.ndarray))
    if isinstance(value, np.ndarray) and value.ndim != 1:
        listed, values = True, ()  # refused below: one number per stage, not a grid
    elif listed:
        values = tuple(value)
    else:
        values = (value,)
    ok = bool(values) and all(_finite_number(v) and (v > 0 if positive else v >= 0) for v in values)
    if not ok:
        rule = "> 0" if positive else ">= 0"
        per = "boundary between model stages" if name == "cost_comm" else "model stage"
        raise ValueError(
            f"PipelineConfig({name}={value!r}): must be a finite number {rule}, or a non-empty "
            f"list of such numbers (one per {per})"
        )
    floats = tuple(float(v) for v in values)
    return floats if listed else floats[0]


def _int_in_range(name: str, value: Any, high: int, low: int = 1) -> None:
    integral = isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))
    if not integral or not low <= value <= high:
        raise ValueError(f"PipelineConfig({name}={value!r}): must be an int from {low} to {high:,}")


def _is_index(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0


def _finite_number(value: Any) -> bool:
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, (bool, np.bool_))
        and math.isfinite(value)
    )


def _axis_names(value: Any) -> tuple[str, ...]:
    """Mesh axis names as a tuple of names; a bare string is refused, not read letter by
    letter (`"dm"` is not `("d", "m")`)."""
    if isinstance(value, str):
        raise ValueError(
            f"PipelineConfig(mesh_axis_names={value!r}): give a tuple of names, one per mesh "
            f"axis, e.g. ({value!r},) for one axis or ('data', 'model') for two"
        )
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(
            f"PipelineConfig(mesh_axis_names={value!r}): give a non-empty tuple of names, one "
            "per mesh axis, e.g. ('data', 'model')"
        )
    for name in value:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(
                f"PipelineConfig(mesh_axis_names={tuple(value)!r}): {name!r} is not a name; "
                "each axis name is a string like 'data' (letters, digits, _)"
            )
    return tuple(value)


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def _shape_or_shapes(value: Any) -> tuple[Any, ...]:
    if isinstance(value, str):
        raise ValueError(
            f"PipelineConfig(stage_mesh_shape={value!r}): a mesh shape is a tuple of ints, "
            "e.g. (1, 2), not a string; or give one such tuple per stage"
        )
    value = _tuples(value if isinstance(value, (list, tuple)) else (value,))
    flat = [value] if not (value and isinstance(value[0], tuple)) else list(value)
    if len(flat) > MAX_STAGES:
        raise ValueError(
            f"PipelineConfig(stage_mesh_shape=...): {len(flat):,} per-stage shapes; at most "
            f"{MAX_STAGES:,} stages"
        )
    for shape in flat:
        if not shape or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape
        ):
            raise ValueError(
                f"PipelineConfig(stage_mesh_shape={value!r}): a mesh shape is a tuple of ints "
                ">= 1, e.g. (1, 2); or give one such tuple per stage"
            )
        if math.prod(shape) > MAX_MESH_DEVICES:
            raise ValueError(
                f"PipelineConfig(stage_mesh_shape={value!r}): the mesh {shape} has "
                f"{math.prod(shape):,} devices; a stage mesh has at most {MAX_MESH_DEVICES:,}"
            )
    return value


MAX_CONFIG_BYTES = 1 << 20  # a config is a few hundred bytes; a megabyte is not one


def read_toml(path: str | Path, *, what: str) -> dict[str, Any]:
    """Parse a TOML file; errors (`InputError`, a ValueError) name `what` (how the user gave
    the file) and the path: missing, a directory or pipe, binary, empty, too big, not TOML, or
    nested too deeply (see [Note: hostile input] in `_files.py`)."""
    if not isinstance(path, (str, Path)):
        raise TypeError(f"{what}: {show(path)} is not a path; give the TOML file's path")
    text = read_text(
        path,
        what=what,
        max_bytes=MAX_CONFIG_BYTES,
        expected="TOML tables such as [pipeline]",
        label=f"{what} {path}",
    )
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"{what} {path}: not valid TOML ({e})") from None
    except RecursionError:
        raise InputError(
            f"{what} {path}: nested too deeply to read; a config nests two levels at most"
        ) from None
