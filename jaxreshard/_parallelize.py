"""`parallelize`: run a JAX train step as a pipeline over several device meshes."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jc
from jax.sharding import Mesh, NamedSharding

from jaxreshard._jax_compat import abstract_mesh, axis_type_names, make_mesh
from jaxreshard.comm import Cluster, describe_sharding
from jaxreshard.frontend._split import ACT, BATCH, CONST, PARAM, StepGraph
from jaxreshard.frontend._trace import trace_step
from jaxreshard.pipeline._emit import format_programs
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime._executor import APPLY_EVENT, Event
from jaxreshard.runtime._local import CompiledPipeline, LocalExecutor, compile_local
from jaxreshard.runtime._specs import (
    batch_spec,
    check_meshes,
    spec_of,
    stage_meshes,
    transplant_spec,
)


def parallelize(
    fun: Callable[..., Any] | None = None,
    *,
    config: PipelineConfig | None = None,
    batch_argnums: int | Sequence[int] = (),
    meshes: Sequence[Mesh] | None = None,
) -> Any:
    """Run a train step as a pipeline of stages, each on its own device mesh.

    The step computes a loss with `jr.value_and_grad` (or `jr.grad`) over a loss function in
    which `jr.stage_boundary(h)` marks where each stage ends, then updates the parameters. It
    returns the same values as `jax.jit(fun)` would, computed as a pipeline: the batch is split
    into `config.num_micro_batches` micro-batches along dim 0, every stage runs on its own mesh
    (consecutive groups of devices, shaped `config.stage_mesh_shape`, or `meshes`), every value
    that crosses stages is resharded by a planned transfer that overlaps compute, gradients are
    accumulated over the micro-batches, and each parameter is updated on the mesh that holds it.
    Returned parameters stay there, so the next call moves no parameters.

    Use it like `jax.jit`: `@parallelize(config=..., batch_argnums=(1,))` or
    `parallelize(fun, config=..., batch_argnums=(1,))`. The wrapped step is compiled once per
    input signature; `step.plan(*args)` shows the stages, boundary tensors and schedule.

    Args:
        fun: the train step.
        config: how to cut, place and schedule it (default: `PipelineConfig()`).
        batch_argnums: the positions of the arguments that hold the batch (every leaf is split
            along dim 0).
        meshes: explicit stage meshes (disjoint), instead of consecutive groups of devices.
    """
    if fun is None:
        return functools.partial(
            parallelize, config=config, batch_argnums=batch_argnums, meshes=meshes
        )
    return Parallelized(fun, config or PipelineConfig(), batch_argnums, meshes)


@dataclasses.dataclass
class _Entry:
    graph: StepGraph
    pipeline: Any  # LocalPipeline or RayPipeline
    in_tree: Any
    out_tree: Any


class Parallelized:
    """A train step wrapped by `parallelize` (call it like the step)."""

    def __init__(
        self,
        fun: Callable[..., Any],
        config: PipelineConfig,
        batch_argnums: int | Sequence[int],
        meshes: Sequence[Mesh] | None,
    ):
        if not callable(fun):
            raise TypeError(f"parallelize(fun=...) needs a callable, got {type(fun).__name__}")
        if not isinstance(config, PipelineConfig):
            raise TypeError(f"parallelize(config=...) takes a PipelineConfig, got {config!r}")
        self.fun = fun
        self.config = config
        self.batch_argnums = (
            (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
        )
        self.meshes = list(meshes) if meshes is not None else None
        self._cache: dict[Any, _Entry] = {}
        functools.update_wrapper(self, fun)

    def __repr__(self) -> str:
        name = getattr(self.fun, "__name__", "step")
        return (
            f"parallelize({name}, schedule={self.config.schedule}, "
            f"num_micro_batches={self.config.num_micro_batches}, "
            f"weight_delay={self.config.weight_delay}, compiled for {len(self._cache)} "
            "signature(s))"
        )

    # Compilation ---------------------------------------------------------------------------------

    def _entry(self, args: tuple[Any, ...]) -> tuple[_Entry, list[Any]]:
        for i in self.batch_argnums:
            if not -len(args) <= i < len(args):
                raise ValueError(
                    f"batch_argnums={self.batch_argnums} but the step got {len(args)} arguments"
                )
        leaves, in_tree = jax.tree.flatten(args)
        batch_leaves = _batch_leaf_indices(args, self.batch_argnums)
        for i, leaf in enumerate(leaves):
            if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
                where = "a batch leaf" if i in batch_leaves else "an argument leaf"
                raise TypeError(
                    f"{where} of the step is {type(leaf).__name__} ({leaf!r}); pass arrays (numpy "
                    "or jax) so the step can be traced and the batch split"
                )
        self._check_batch(leaves, batch_leaves, args)
        key = (
            in_tree,
            tuple((tuple(x.shape), np.dtype(x.dtype)) for x in leaves),
            tuple(_sharding_key(x) for x in leaves),
        )
        entry = self._cache.get(key)
        if entry is None:
            entry = self._compile(args, leaves, in_tree, batch_leaves)
            self._cache[key] = entry
        return entry, leaves

    def _check_batch(self, leaves: list[Any], batch_leaves: list[int], args: tuple[Any, ...]):
        m = self.config.num_micro_batches
        paths = _leaf_paths(args)
        for i in batch_leaves:
            shape = leaves[i].shape
            if not shape:
                raise ValueError(
                    f"batch leaf {paths[i]} is a scalar; every batch leaf needs a batch dim 0 "
                    "to split into micro-batches"
                )
            if shape[0] % m:
                raise ValueError(
                    f"batch leaf {paths[i]} has {shape[0]} rows along dim 0, which "
                    f"num_micro_batches={m} does not divide; use a batch size that is a "
                    f"multiple of {m} (e.g. {shape[0] // m * m or m}) or another micro-batch count"
                )
        rows = {leaves[i].shape[0] for i in batch_leaves}
        if len(rows) > 1:
            raise ValueError(
                f"batch leaves have different sizes along dim 0 ({sorted(rows)}); they must "
                "agree to be split into the same micro-batches"
            )

    def _compile(
        self, args: tuple[Any, ...], leaves: list[Any], in_tree: Any, batch_leaves: list[int]
    ) -> _Entry:
        from jaxreshard.runtime import current_runtime

        runtime = current_runtime() if self.config.backend != "local" else None
        on_ray = runtime is not None and runtime.backend == "ray"
        trace_mesh, input_specs = self._trace_mesh(leaves, batch_leaves, on_ray)
        graph, out_tree = trace_step(
            self.fun,
            in_tree,
            leaves,
            batch_leaves,
            self.config.num_micro_batches,
            trace_mesh,
            self.config.num_stages,
            input_specs,
        )
        if self.config.backend == "ray" and (runtime is None or runtime.backend != "ray"):
            raise RuntimeError(
                "PipelineConfig(backend='ray') but no Ray runtime is running; call "
                "jaxreshard.init(backend='ray', ...) first"
            )
        if on_ray:
            if self.meshes is not None:
                raise ValueError(
                    "parallelize(meshes=...) is for the local runtime; on Ray the "
                    "stages take the runtime's devices in order"
                )
            from jaxreshard.runtime._pipeline_ray import RayPipeline

            pipeline = RayPipeline(
                runtime,
                self.fun,
                self.config,
                graph,
                in_tree,
                leaves,
                batch_leaves,
                input_specs,
            )
            return _Entry(graph, pipeline, in_tree, out_tree)
        if self.meshes is not None:
            check_meshes(self.meshes, graph.num_stages)
            meshes = self.meshes
        else:
            self.config.mesh_shapes(graph.num_stages)  # checks the per-stage list's length
            meshes = stage_meshes(self.config, graph.num_stages, jax.devices())
        devices = [d for mesh in meshes for d in mesh.devices.flat]
        cluster = Cluster.from_devices(devices, devices_per_host=self.config.devices_per_host)
        compiled = compile_local(graph, self.config, list(meshes), leaves, cluster)
        return _Entry(graph, LocalPipeline(compiled), in_tree, out_tree)

    def _trace_mesh(
        self, leaves: list[Any], batch_leaves: list[int], on_ray: bool
    ) -> tuple[Any, list[Any] | None]:
        """The mesh to trace the step under, and (for `Explicit` axes) every leaf's
        PartitionSpec in the traced types (see [Note: mesh axis types])."""
        if self.meshes is None:
            shapes = self.config.mesh_shapes(None)
            names, types = self.config.mesh_axis_names, self.config.axis_types
        else:
            shapes = tuple(tuple(m.devices.shape) for m in self.meshes)
            names, types = tuple(self.meshes[0].axis_names), mesh_axis_types(self.meshes)
        if "explicit" not in types:
            return abstract_mesh(shapes[0], names, types), None
        if len(set(shapes)) > 1:
            raise ValueError(
                f"stage meshes of shapes {list(shapes)} with Explicit axes {names}: a step is "
                "traced once, and with Explicit axes the trace's types name one mesh shape; give "
                "every stage the same mesh shape, or use mesh_axis_types='auto'"
            )
        if self.meshes is not None:
            mesh = self.meshes[0].abstract_mesh
        elif on_ray:  # the hosts trace under their own meshes; the driver needs no devices
            mesh = abstract_mesh(shapes[0], names, types)
        else:
            n = math.prod(shapes[0])
            devices = np.array(jax.devices()[:n]).reshape(shapes[0])
            mesh = make_mesh(devices, names, types).abstract_mesh
        return mesh, typed_specs(leaves, batch_leaves, dict(zip(names, shapes[0])), self.config)

    # Running ------------------------------------------------------------------------------------

    def __call__(self, *args: Any) -> Any:
        entry, leaves = self._entry(args)
        outputs = entry.pipeline.run(leaves)
        return jax.tree.unflatten(entry.out_tree, outputs)

    def profile_call(self, *args: Any, signal_only: bool = False) -> tuple[Any, list[Event]]:
        """Call the step and time everything it does: returns the outputs and the step's
        `Event`s (each action, transfer, blocked receive and post-gradient segment), with
        times in this process's `time.perf_counter()` seconds. Timing blocks on every action's
        results, which costs a little overlap of dispatch with compute.

        With `signal_only` (the local runtime only), transfers carry no data, only the
        dependency: the step runs as fast as it would with free communication, and its outputs
        are wrong (see [Note: signal-only bound]); the next ordinary call is correct again.
        """
        entry, leaves = self._entry(args)
        if signal_only and not isinstance(entry.pipeline, LocalPipeline):
            raise ValueError(
                "profile_call(signal_only=True) runs on the local runtime only; the Ray runtime "
                "has no signal-only transfers"
            )
        kwargs = {"signal_only": True} if signal_only else {}
        outputs = entry.pipeline.run(leaves, record=True, **kwargs)
        out = jax.tree.unflatten(entry.out_tree, outputs)
        jax.block_until_ready(out)
        return out, list(entry.pipeline.last_events)

    def plan(self, *args: Any) -> PipelinePlan:
        """What the step will do for these arguments, without running it."""
        entry, _ = self._entry(args)
        return PipelinePlan(entry.graph, entry.pipeline)

    def pipeline(self, *args: Any) -> Any:
        """The compiled pipeline for these arguments (compiling it if needed)."""
        return self._entry(args)[0].pipeline


class LocalPipeline:
    """A step compiled for this process's devices (the local runtime)."""

    def __init__(self, compiled: CompiledPipeline):
        self.compiled = compiled
        self.executor = LocalExecutor(compiled)  # its threads live as long as the pipeline
        self.last_events: list[Any] = []

    @property
    def layout(self) -> Any:
        return self.compiled.layout

    def sharding(self, s: int, spec: Any) -> Any:
        return self.compiled.sharding(s, spec)

    def run(
        self, leaves: list[Any], *, record: bool = False, signal_only: bool = False
    ) -> list[Any]:
        outputs, _ = run_step(
            self.compiled, leaves, record=record, signal_only=signal_only, executor=self.executor
        )
        self.last_events = self.executor.events
        return outputs


def _batch_leaf_indices(args: tuple[Any, ...], batch_argnums: Sequence[int]) -> list[int]:
    out, at = [], 0
    norm = {i % len(args) for i in batch_argnums} if args else set()
    for i, arg in enumerate(args):
        n = len(jax.tree.leaves(arg))
        if i in norm:
            out.extend(range(at, at + n))
        at += n
    return out


def _leaf_paths(args: tuple[Any, ...]) -> list[str]:
    paths, _ = jax.tree_util.tree_flatten_with_path(args)
    return [f"args{jax.tree_util.keystr(path)}" for path, _ in paths]


def _sharding_key(x: Any) -> Any:
    """What of a leaf's placement the compiled step depends on: its PartitionSpec (an unsharded
    leaf counts as replicated, so host arrays and the step's own outputs share one compile)."""
    return tuple(spec_of(getattr(x, "sharding", None)))


def run_step(
    c: CompiledPipeline,
    leaves: list[Any],
    *,
    record: bool = False,
    signal_only: bool = False,
    executor: LocalExecutor | None = None,
) -> tuple[list[Any], LocalExecutor]:
    """Run one step of a compiled pipeline on the local runtime; return the flat outputs.

    With `record`, the executor's `events` also get the post-gradient segments (kind `A`)."""
    g, layout = c.graph, c.layout
    m = c.config.num_micro_batches
    # Parameters, where their owners keep them.
    params = [
        _place(leaves[i], c.sharding(g.owner[k], layout.param_specs[k]))
        for k, i in enumerate(g.params)
    ]
    # Per-step constants: the pre part, computed once.
    const_values = _consts(g, leaves)
    batches: list[list[list[Any]]] = []
    consts: list[list[Any]] = []
    for s, stage in enumerate(g.loss.stages):
        per_mb: list[list[Any]] = [[] for _ in range(m)]
        stage_consts = []
        for ref, spec in zip(stage.inputs, layout.input_specs[s]):
            sharding = c.sharding(s, spec)
            if ref.kind == BATCH:
                for mb, piece in enumerate(_split_rows(leaves[ref.index], m)):
                    per_mb[mb].append(jax.device_put(piece, sharding))
            elif ref.kind == CONST:
                stage_consts.append(_place(const_values[ref.index], sharding))
        batches.append(per_mb)
        consts.append(stage_consts)
    executor = executor or LocalExecutor(c)
    values: dict[Any, Any] = dict(zip(g.outer.jaxpr.invars, leaves))
    for k, i in enumerate(g.params):
        values[g.outer.jaxpr.invars[i]] = params[k]
    for v, value in zip(g.pre_outputs, _pre_values(g, leaves)):
        values[v] = value
    grad_vars = set(g.grad_outputs[1:])
    apply_inputs = {
        s: [_on_mesh(values[v], c.meshes[s]) for v in g.segments[j].inputs if v not in grad_vars]
        for s, j in c.fused.items()
    }
    losses, grads, applied = executor.run(
        params, batches, consts, record=record, signal_only=signal_only, apply_inputs=apply_inputs
    )
    loss = _combine_losses(losses, c.config.loss_reduction)
    values[g.grad_outputs[0]] = loss
    fused = set(c.fused.values())
    for k, v in enumerate(g.grad_outputs[1:]):
        if grads[k] is not None:
            values[v] = grads[k]
        elif g.owner[k] not in c.fused:  # the loss does not use this parameter
            values[v] = jax.numpy.zeros_like(params[k])
    for s, j in c.fused.items():
        values.update(zip(g.segments[j].outputs, applied[s]))
    dead = _dead_gradients(g)
    for index, segment in enumerate(g.segments):
        if index in fused:
            continue
        mesh = c.meshes[segment.stage]
        inputs = [_on_mesh(values[v], mesh) for v in segment.inputs]
        donate = tuple(i for i, v in enumerate(segment.inputs) if dead.get(v) == index)
        start = time.perf_counter()
        outs = _segment_fn(segment.jaxpr, donate)(*inputs)
        if record:
            jax.block_until_ready(outs)
            executor.events.append(
                Event(segment.stage, APPLY_EVENT, -1, start, time.perf_counter(), "apply")
            )
        values.update(zip(segment.outputs, outs))
    outputs = [values[v] if not isinstance(v, jc.Literal) else v.val for v in g.outer.jaxpr.outvars]
    return outputs, executor


def _combine_losses(losses: list[Any], reduction: str) -> Any:
    total = losses[0]
    for value in losses[1:]:
        total = total + value
    return total / len(losses) if reduction == "mean" else total


@functools.lru_cache(maxsize=256)
def _segment_fn(jaxpr: Any, donate: tuple[int, ...] = ()) -> Callable[..., Any]:
    return jax.jit(jc.jaxpr_as_fun(jaxpr), donate_argnums=donate)


def _dead_gradients(g: StepGraph) -> dict[Any, int]:
    """Accumulated gradients that die in a post segment: gradient var -> that segment's index.

    They are the pipeline's own buffers, so the optimizer may overwrite them (XLA writes the new
    parameters there instead of into fresh memory)."""
    last_use: dict[Any, int] = {}
    for index, segment in enumerate(g.segments):
        for v in segment.inputs:
            last_use[v] = index
    returned = {v for v in g.outer.jaxpr.outvars if not isinstance(v, jc.Literal)}
    return {v: last_use[v] for v in g.grad_outputs[1:] if v in last_use and v not in returned}


def _pre_values(g: StepGraph, leaves: list[Any]) -> list[Any]:
    if g.pre is None:
        return []
    index = {v: i for i, v in enumerate(g.outer.jaxpr.invars)}
    return list(_segment_fn(g.pre)(*(leaves[index[v]] for v in g.pre_inputs)))


def _consts(g: StepGraph, leaves: list[Any]) -> list[Any]:
    index = {v: i for i, v in enumerate(g.outer.jaxpr.invars)}
    pre = dict(zip(g.pre_outputs, _pre_values(g, leaves))) if g.pre is not None else {}
    return [leaves[index[v]] if v in index else pre[v] for v in g.consts]


def _split_rows(x: Any, m: int) -> list[Any]:
    if isinstance(x, jax.Array):
        rows = x.shape[0] // m
        return [x[j * rows : (j + 1) * rows] for j in range(m)]
    return np.split(np.asarray(x), m, axis=0)


def _place(x: Any, sharding: Any) -> Any:
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    return jax.device_put(x, sharding)


def _on_mesh(x: Any, mesh: Mesh) -> Any:
    """`x` on `mesh`'s devices: as it is if it is there already, else moved (same spec if it
    fits, else replicated)."""
    devices = set(mesh.devices.flat)
    if isinstance(x, jax.Array) and set(x.sharding.device_set) == devices:
        return x
    if not hasattr(x, "shape"):
        return x
    spec = transplant_spec(spec_of(getattr(x, "sharding", None)), dict(mesh.shape), x.shape)
    return jax.device_put(x, NamedSharding(mesh, spec))


@dataclasses.dataclass
class PipelinePlan:
    """What a parallelized step does: stages, meshes, boundary tensors, schedule, programs."""

    graph: StepGraph
    pipeline: Any  # LocalPipeline or RayPipeline

    @property
    def layout(self) -> Any:
        return self.pipeline.layout

    @property
    def meshes(self) -> list[Any]:
        p = self.pipeline
        return p.compiled.meshes if isinstance(p, LocalPipeline) else p.meshes

    def boundary_tensors(self) -> list[dict[str, Any]]:
        """One record per transfer kind and edge: what moves where, how, and how many bytes."""
        out = []
        for (kind, tensor, src, dst), t in sorted(
            self.layout.transfers.items(), key=lambda kv: (kv[0][0] != "act", kv[0])
        ):
            out.append(
                {
                    "kind": kind,
                    "tensor": tensor,
                    "src_stage": src,
                    "dst_stage": dst,
                    "shape": t.shape,
                    "dtype": str(np.dtype(t.dtype)),
                    "src_sharding": describe_sharding(self.pipeline.sharding(src, t.src_spec)),
                    "dst_sharding": describe_sharding(self.pipeline.sharding(dst, t.dst_spec)),
                    "strategy": t.plan.chosen,
                    "bytes": t.nbytes,
                    "per": "step" if kind in ("param", "param_grad") else "micro-batch",
                }
            )
        return out

    def __str__(self) -> str:
        g, layout = self.graph, self.layout
        lines = [
            f"pipeline: {g.num_stages} stages, {layout.config.num_micro_batches} "
            f"micro-batches of {layout.micro_batch_rows} rows, schedule "
            f"{layout.schedule.describe()}"
        ]
        for s, mesh in enumerate(self.meshes):
            stage = g.loss.stages[s]
            ids = [d.id for d in mesh.devices.flat]
            kinds = {k: sum(r.kind == k for r in stage.inputs) for k in (PARAM, BATCH, CONST, ACT)}
            lines.append(
                f"  stage {s}: mesh {dict(mesh.shape)} devices {ids}; "
                f"{len(stage.jaxpr.jaxpr.eqns)} equations; inputs: {kinds[PARAM]} params, "
                f"{kinds[BATCH]} batch, {kinds[CONST]} consts, {kinds[ACT]} activations"
            )
        lines.append("boundary tensors:")
        for t in self.boundary_tensors():
            lines.append(
                f"  {t['kind']}{t['tensor']} s{t['src_stage']}->s{t['dst_stage']} "
                f"{t['dtype']}{list(t['shape'])} {t['bytes']} B per {t['per']}: "
                f"{t['src_sharding']} -> {t['dst_sharding']} by {t['strategy']}"
            )
        for a in g.loss.activations:
            lines.append(f"  act{a.id} is computed at {a.where}")
        lines.append(f"post-gradient segments on stages: {[seg.stage for seg in g.segments]}")
        lines.append("schedule:")
        lines.append(layout.schedule.grid())
        lines.append("instructions (first ones):")
        lines.append(format_programs(layout.programs, limit=12))
        return "\n".join(lines)


def mesh_axis_types(meshes: Sequence[Mesh]) -> tuple[str, ...]:
    """The axis types (`auto` / `explicit`) the stage meshes share (tracing needs one set)."""
    first = axis_type_names(meshes[0])
    for s, mesh in enumerate(meshes):
        if tuple(mesh.axis_names) != tuple(meshes[0].axis_names) or axis_type_names(mesh) != first:
            raise ValueError(
                f"parallelize(meshes=...): stage mesh {s} has axes {tuple(mesh.axis_names)} of "
                f"types {axis_type_names(mesh)} but stage mesh 0 has {tuple(meshes[0].axis_names)}"
                f" of types {first}; every stage mesh needs the same axis names and types"
            )
    return first


def typed_specs(
    leaves: Sequence[Any], batch_leaves: Sequence[int], sizes: dict[str, int], config: Any
) -> list[Any]:
    """Every leaf's PartitionSpec as a stage will compile it: the batch over `batch_axis` (per
    micro-batch), other leaves as they are sharded, where that fits (else replicated)."""
    batch = set(batch_leaves)
    m = config.num_micro_batches
    out = []
    for i, leaf in enumerate(leaves):
        shape = tuple(leaf.shape)
        if i in batch:
            out.append(batch_spec(sizes, (shape[0] // m, *shape[1:]), config.batch_axis))
        else:
            out.append(transplant_spec(spec_of(getattr(leaf, "sharding", None)), sizes, shape))
    return out
