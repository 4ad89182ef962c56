"""`parallelize`: run a JAX train step as a pipeline over several device meshes."""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxreshard._arguments import (
    _STATIC,
    _batch_leaf_indices,
    _check_argnums,
    _check_mesh_list,
    _hashable,
    _jax_dtype,
    _leaf_paths,
    check_batch,
    mesh_axis_types,
    signature,
    typed_specs,
    warn_no_batch,
)
from jaxreshard._jax_compat import abstract_mesh, make_mesh
from jaxreshard._plan import PipelinePlan
from jaxreshard._reuse import StepCache, stage_specs
from jaxreshard._tracebacks import api_boundary
from jaxreshard._trials import measure_choices
from jaxreshard.comm import Cluster
from jaxreshard.frontend._split import StepGraph
from jaxreshard.frontend._trace import StepOutputs, is_array, trace_step
from jaxreshard.runtime._config import EXPLICIT_PARTITION, PipelineConfig
from jaxreshard.runtime.engine._events import Event
from jaxreshard.runtime.local._compiled import compile_local
from jaxreshard.runtime.local._pipeline import LocalPipeline
from jaxreshard.runtime.step._specs import (
    check_meshes,
    stage_meshes,
)


@api_boundary
def parallelize(
    fun: Callable[..., Any] | None = None,
    *,
    config: PipelineConfig | None = None,
    batch_argnums: int | Sequence[int] = (),
    donate_argnums: int | Sequence[int] = (),
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
        donate_argnums: as `jax.jit`'s: the positions of the arguments whose buffers the step
            may reuse for its outputs (typically the parameters and the optimizer state, which
            the optimizer then updates in place); don't use them after the call. An argument
            whose placement differs from its stage's is copied there first, and the copy is
            what is donated.
        meshes: explicit stage meshes (disjoint), instead of consecutive groups of devices.
    """
    if fun is None:
        return functools.partial(
            parallelize,
            config=config,
            batch_argnums=batch_argnums,
            donate_argnums=donate_argnums,
            meshes=meshes,
        )
    config = PipelineConfig() if config is None else config
    return Parallelized(fun, config, batch_argnums, meshes, donate_argnums)


@dataclasses.dataclass
class _Entry:
    graph: StepGraph
    pipeline: Any  # LocalPipeline or RayPipeline
    in_tree: Any
    outputs: StepOutputs
    partition: Any = None  # the PartitionReport of partition="auto"
    stage_specs: Any = None  # what the stages make of the arguments' specs (`_reuse.py`)


# Compiles of one argument structure that differ only in static leaves before a warning.
_STATIC_RECOMPILES = 4


class Parallelized:
    """A train step wrapped by `parallelize` (call it like the step)."""

    def __init__(
        self,
        fun: Callable[..., Any],
        config: PipelineConfig,
        batch_argnums: int | Sequence[int],
        meshes: Sequence[Mesh] | None,
        donate_argnums: int | Sequence[int] = (),
    ):
        if not callable(fun):
            raise TypeError(f"parallelize(fun=...) needs a callable, got {type(fun).__name__}")
        if not isinstance(config, PipelineConfig):
            raise TypeError(
                f"parallelize(config={config!r}) takes a PipelineConfig, e.g. "
                "jr.PipelineConfig(num_micro_batches=4) or PipelineConfig.from_toml(path); None "
                "for the defaults"
            )
        self.fun = fun
        self.config = config
        # Mesh axes of one device on every stage mesh: a leaf's spec over them shards nothing.
        self._unit_axes = frozenset(
            name
            for i, name in enumerate(config.mesh_axis_names)
            if all(shape[i] == 1 for shape in config.mesh_shapes(None))
        )
        self.batch_argnums = _check_argnums(batch_argnums)
        self.donate_argnums = _check_argnums(donate_argnums, "donate_argnums")
        both = {i for i in self.batch_argnums} & {i for i in self.donate_argnums}
        if both:
            raise ValueError(
                f"parallelize(batch_argnums={self.batch_argnums}, donate_argnums="
                f"{self.donate_argnums}): argument {min(both)} is in both; a batch is split "
                "into micro-batches, not reused: drop it from donate_argnums"
            )
        self.meshes = _check_mesh_list(meshes)
        self._cache = StepCache()  # compiled steps by argument signature
        self._static_seen: dict[Any, list[dict[int, Any]]] = {}
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

    def _entry(self, args: tuple[Any, ...], recorded: bool = False) -> tuple[_Entry, list[Any]]:
        """The compiled step for these arguments, and their array leaves. A call with a
        signature seen before costs a flatten and a cache lookup (the checks ran when the
        signature was new). Leaves that are not arrays are static (see [Note: static leaves])."""
        leaves, in_tree = jax.tree.flatten(args)
        signed, arrays = signature(leaves, self._unit_axes)
        try:
            key = (in_tree, *signed)
            entry = self._cache.lookup(key)
        except TypeError:  # an unhashable static leaf
            bad = next(i for i, x in enumerate(leaves) if not is_array(x) and not _hashable(x))
            raise TypeError(
                f"argument leaf {_leaf_paths(args)[bad]} is a {type(leaves[bad]).__name__}, "
                "which is neither an array nor hashable; parallelize treats non-array leaves as "
                "static (as eqx.filter_jit does) and needs to hash them: pass it as an array, "
                "make it hashable, or close over it in the step"
            ) from None
        if entry is not None:
            return entry, arrays
        for name, argnums in (
            ("batch_argnums", self.batch_argnums),
            ("donate_argnums", self.donate_argnums),
        ):
            for i in argnums:
                if not -len(args) <= i < len(args):
                    raise ValueError(f"{name}={argnums} but the step got {len(args)} arguments")
        if not self.batch_argnums and self.config.num_micro_batches > 1:
            warn_no_batch(self.fun, args, self.config.num_micro_batches)
        static = {i: x for i, x in enumerate(leaves) if not is_array(x)}
        dynamic = {i: n for n, i in enumerate(i for i in range(len(leaves)) if i not in static)}
        batch_leaves = []
        for i in _batch_leaf_indices(args, self.batch_argnums):
            if i in static:
                raise TypeError(
                    f"batch leaf {_leaf_paths(args)[i]} is {type(leaves[i]).__name__} "
                    f"({leaves[i]!r}); every leaf of the batch arguments must be an array (numpy "
                    "or jax) with a batch dim 0 to split into micro-batches"
                )
            batch_leaves.append(dynamic[i])
        paths = [p for i, p in enumerate(_leaf_paths(args)) if i not in static]
        for x, path in zip(arrays, paths):
            if isinstance(x, np.ndarray) and x.dtype.kind in "OUSVMm" and not _jax_dtype(x.dtype):
                raise TypeError(
                    f"argument leaf {path} is a numpy array of dtype {x.dtype}, which JAX "
                    "arrays cannot hold; convert it (e.g. np.asarray(x, np.float32)) or "
                    "close over it in the step"
                )
        check_batch(arrays, batch_leaves, paths, self.config.num_micro_batches)
        self._note_static(key, static, _leaf_paths(args))
        donated = [
            dynamic[i] for i in _batch_leaf_indices(args, self.donate_argnums) if i in dynamic
        ]
        # [Note: one compile for equivalent placements]
        entry = self._cache.equivalent(key, arrays, _STATIC)
        if entry is None:
            entry = self._compile(arrays, in_tree, batch_leaves, static, recorded, donated)
            entry.stage_specs = stage_specs(entry.pipeline, arrays)
        self._cache.remember(key, entry, MAX_COMPILED)
        return entry, arrays

    def close(self) -> None:
        """Free every compiled pipeline now (threads, pools, device buffers it holds); a later
        call compiles again. Dropping the parallelized step does the same."""
        self._cache.close_all()

    def _note_static(self, key: tuple[Any, ...], static: dict[int, Any], paths: list[str]) -> None:
        """Warn once when static leaves keep changing (every value compiles the step again)."""
        shape = (key[0], *(k for k in key[1:] if k[0] is not _STATIC))
        seen = self._static_seen.setdefault(shape, [])
        if len(seen) >= _STATIC_RECOMPILES:  # warned already
            return
        seen.append(static)
        if len(seen) == _STATIC_RECOMPILES:
            changing = sorted({paths[i] for s in seen for i, v in s.items() if seen[0].get(i) != v})
            warnings.warn(
                f"parallelize compiled {getattr(self.fun, '__name__', 'the step')} "
                f"{len(seen)} times for arguments that differ only in static (non-array) leaves "
                f"{changing}; non-array leaves are static, as in eqx.filter_jit, and every new "
                "value compiles the step again. Pass values that change between calls as arrays "
                "(jnp.asarray(x)).",
                stacklevel=5,
            )

    def _compile(
        self,
        leaves: list[Any],
        in_tree: Any,
        batch_leaves: list[int],
        static: dict[int, Any],
        recorded: bool = False,
        donated: Sequence[int] = (),
    ) -> _Entry:
        from jaxreshard.runtime import current_runtime

        runtime = current_runtime() if self.config.backend != "local" else None
        on_ray = runtime is not None and runtime.backend == "ray"
        trace_mesh, input_specs = self._trace_mesh(leaves, batch_leaves, on_ray)
        config, partition, kept = self.config, None, None

        def trace(
            cuts: Any,
            expected: int | None,
            candidates: Any = None,
            donated: Any = donated,
            mesh: Any = trace_mesh,
            specs: Any = input_specs,
        ) -> Any:
            return trace_step(
                self.fun,
                in_tree,
                leaves,
                batch_leaves,
                config.num_micro_batches,
                mesh,
                expected,
                specs,
                static=static,
                loss_reduction=config.loss_reduction,
                donated=donated,
                cuts=cuts,
                candidates=candidates,
            )

        def build(config: PipelineConfig, recorded: bool, donated: Sequence[int]) -> _Entry:
            graph, outputs = trace(config.cuts, config.num_stages, donated=donated)
            if on_ray:
                if self.meshes is not None:
                    raise ValueError(
                        "parallelize(meshes=...) is for the local runtime; on Ray the "
                        "stages take the runtime's devices in order"
                    )
                from jaxreshard.runtime.ray._pipeline import RayPipeline

                pipeline = RayPipeline(
                    runtime,
                    self.fun,
                    config,
                    graph,
                    in_tree,
                    leaves,
                    batch_leaves,
                    input_specs,
                    static,
                    recorded,
                )
                return _Entry(graph, pipeline, in_tree, outputs)
            meshes, cluster = self._local_meshes(graph.num_stages)
            compiled = compile_local(graph, config, list(meshes), leaves, cluster, recorded)
            return _Entry(graph, LocalPipeline(compiled), in_tree, outputs)

        if self.config.backend == "ray" and (runtime is None or runtime.backend != "ray"):
            raise RuntimeError(
                "PipelineConfig(backend='ray') but no Ray runtime is running; call "
                "jaxreshard.init(backend='ray', ...) first"
            )
        if config.partition == "auto" and config.cuts is None:
            choosing, choose_trace, choose_specs = config, trace, input_specs
            if input_specs is not None:  # [Note: cuts chosen on Auto axes]
                choosing = dataclasses.replace(config, mesh_axis_types="auto")
                auto = abstract_mesh(trace_mesh.axis_sizes, trace_mesh.axis_names, "auto")
                choose_trace = functools.partial(trace, mesh=auto, specs=None)
                choose_specs = None
            timer = None
            if on_ray:  # (see [Note: segments timed on the hosts])
                from jaxreshard.runtime.ray._segments import time_on_host

                timer = time_on_host(runtime, self.fun, static, choosing, in_tree, leaves,
                                     batch_leaves, choose_specs, donated)  # fmt: skip
            typed = trace if choose_trace is not trace else None
            partition = self._partition(choosing, choose_trace, on_ray, leaves, timer, typed)
            if config.partition_trials and sum(c.fits for c in partition.tried) > 1:
                # (the chosen one's pipeline serves, if it can)
                kept = measure_choices(partition, config, build, leaves, not (donated or recorded))
            config = dataclasses.replace(
                config, cuts=partition.chosen, **partition.placement_costs(config)
            )
        entry = kept if kept is not None else build(config, recorded, donated)
        entry.partition = partition
        return entry

    def _local_meshes(self, num_stages: int) -> tuple[list[Any], Cluster]:
        """The stage meshes of a step of `num_stages` stages on this process's devices, and
        the planner's cluster model of them."""
        if self.meshes is not None:
            check_meshes(self.meshes, self.config.num_meshes(num_stages))
            meshes = list(self.meshes)
        else:
            num_meshes = self.config.num_meshes(num_stages)
            meshes = stage_meshes(self.config, num_meshes, jax.devices())
        devices = [d for mesh in meshes for d in mesh.devices.flat]
        cluster = Cluster.from_devices(devices, devices_per_host=self.config.devices_per_host)
        return meshes, cluster

    # [Note: cuts chosen on Auto axes]
    # `partition="auto"` times each segment on one device (`runtime/step/_segment_cost.py`). A
    # step of Explicit axes is traced with its arrays typed over the whole stage mesh, so its
    # segments cannot run there. Its cuts are chosen from a second trace of the step on Auto
    # axes of the same names and sizes, with untyped inputs (on Ray, the timing host traces it
    # so too): the same program, which XLA lays out itself. The chosen cuts then build the
    # step on its own Explicit axes, and trials (`partition_trials`) run that real step. A step
    # that JAX accepts only on Explicit axes (`reshard` to a spec, an `out_sharding=` naming
    # an axis) does not trace on Auto ones: then the error gives JAX's reason and the fix,
    # choosing the cuts by hand. Until 2026-11-29 Explicit axes refused `partition="auto"`.
    def _partition(
        self,
        config: PipelineConfig,
        trace: Callable[..., Any],
        on_ray: bool,
        leaves: list[Any],
        timer: Any = None,
        typed: Callable[..., Any] | None = None,
    ) -> Any:
        """Choose the `stage_candidate` cuts (see [Note: automatic partitioning]) as `config`
        says, from the step as `trace` traces it; `typed`: the trace on the step's own Explicit
        axes when `trace` is on Auto ones; `timer` times the segments elsewhere (a Ray host)."""
        from jaxreshard.runtime.step._partition import choose_cuts
        from jaxreshard.runtime.step._specs import spec_of

        specs = [spec_of(getattr(x, "sharding", None)) for x in leaves]
        found: list[Any] = []
        try:
            graph_all, _ = trace("all", None, found)
        except Exception as e:
            if typed is None:
                raise
            typed("all", None, [])  # (an error of the step itself is raised as it is)
            raise ValueError(
                f"PipelineConfig(partition='auto') on Explicit axes: {EXPLICIT_PARTITION}; on "
                f"Auto axes it failed with {type(e).__name__}: {e}"
            ) from e
        assert config.num_stages is not None
        if on_ray:  # the hosts' meshes and links; the segments timed by `timer`, on a host
            from jaxreshard.runtime import current_runtime
            from jaxreshard.runtime.ray._placement import stage_placement

            runtime = current_runtime()
            num_meshes = config.num_meshes(config.num_stages)
            meshes = stage_placement(runtime, config, num_meshes)[0]
            return choose_cuts(graph_all, found[1], config, meshes, runtime.cluster, specs, timer)
        meshes, cluster = self._local_meshes(config.num_stages)
        devices = [d for mesh in meshes for d in mesh.devices.flat]
        gbps = config.emulate_network_gbps
        if gbps is not None:  # the links the steps will see
            cluster = Cluster.from_devices(
                devices, devices_per_host=self.config.devices_per_host,
                inter_host_gbytes_per_s=gbps,
            )  # fmt: skip
        # (the stages' own collectives run in this process: see [Note: gradient sums in the
        # partitioner])
        inside = Cluster.from_devices(devices)
        return choose_cuts(graph_all, found[1], config, meshes, cluster, specs, None, inside)

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

    @api_boundary
    def __call__(self, *args: Any) -> Any:
        entry, leaves = self._entry(args)
        return entry.outputs.assemble(entry.pipeline.run(leaves))

    @api_boundary
    def profile_call(self, *args: Any, signal_only: bool = False) -> tuple[Any, list[Event]]:
        """Call the step and time everything it does: returns the outputs and the step's
        `Event`s (each action, transfer, blocked receive and post-gradient segment), with
        times in this process's `time.perf_counter()` seconds. Timing blocks on every action's
        results, which costs a little overlap of dispatch with compute.

        With `signal_only`, transfers carry no data, only the dependency: the step runs as fast
        as it would with free communication, and its outputs are wrong (see
        [Note: signal-only bound]); the next ordinary call is correct again.
        """
        entry, leaves = self._entry(args, recorded=True)
        outputs = entry.pipeline.run(leaves, record=True, signal_only=signal_only)
        out = entry.outputs.assemble(outputs)
        jax.block_until_ready(out)
        return out, list(entry.pipeline.last_events)

    @api_boundary
    def wait(self) -> None:
        """Wait until every step called so far has finished on the devices, and raise the
        first failure among them (a call returns once its step is dispatched, and a step that
        fails later says so here or at the next call; see [Note: asynchronous steps])."""
        for entry in list(self._cache.values()):
            entry.pipeline.wait()

    @api_boundary
    def plan(self, *args: Any) -> PipelinePlan:
        """What the step will do for these arguments, without running it (except that
        `partition="auto"` runs the measured choices' steps, as the first call would, unless
        `partition_trials=0`)."""
        entry, _ = self._entry(args)
        return PipelinePlan(entry.graph, entry.pipeline, entry.partition)

    @api_boundary
    def placement(self, *args: Any) -> tuple[Any, ...]:
        """Where the pipeline keeps each array of these arguments, as a tuple with one pytree
        per argument whose array leaves are `jax.ShapeDtypeStruct`s carrying the sharding (on
        the local runtime: on a stage mesh) or, on Ray, `RemoteStruct`s with the hosts'
        `VirtualSharding`. Leaves the pipeline does not keep (the batch, host data) get no
        sharding; non-array leaves stay as they are.

        A parameter sits on its stage's mesh with its planned spec; optimizer state on the
        mesh of the stage whose optimizer reads it. Use it as `restore_checkpoint`'s target to
        resume in this layout, or as `reshard`'s to move live state into it. Compiles the step
        for these arguments if it is not compiled yet (as `plan` does).
        """
        from jaxreshard.runtime.ray._remote import RemoteStruct

        entry, arrays = self._entry(args)
        shardings = iter(entry.pipeline.placement(arrays))

        def one(x: Any) -> Any:
            if not is_array(x):
                return x
            sharding = next(shardings)
            if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
                return RemoteStruct(x.shape, x.dtype, sharding)
            return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

        return tuple(jax.tree.map(one, arg) for arg in args)

    @api_boundary
    def pipeline(self, *args: Any) -> Any:
        """The compiled pipeline for these arguments (compiling it if needed)."""
        return self._entry(args)[0].pipeline


# How many argument signatures one parallelized step keeps compiled.
MAX_COMPILED = 8
