"""`parallelize`: run a JAX train step as a pipeline over several device meshes."""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxreshard._jax_compat import abstract_mesh, axis_type_names, make_mesh
from jaxreshard._tracebacks import api_boundary
from jaxreshard.comm import Cluster, describe_sharding
from jaxreshard.comm._layout import normalized_spec
from jaxreshard.frontend._split import ACT, BATCH, CONST, PARAM, StepGraph
from jaxreshard.frontend._trace import StepOutputs, is_array, trace_step
from jaxreshard.pipeline._emit import format_programs
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime.engine._events import Event
from jaxreshard.runtime.local._compiled import compile_local
from jaxreshard.runtime.local._pipeline import LocalPipeline
from jaxreshard.runtime.step._specs import (
    batch_spec,
    check_meshes,
    spec_of,
    stage_meshes,
    transplant_spec,
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


def _check_argnums(argnums: Any, name: str = "batch_argnums") -> tuple[int, ...]:
    """`batch_argnums` (or `donate_argnums`) as a tuple of ints (an int alone is one; None is
    none)."""
    what = {
        "batch_argnums": "the arguments that hold the batch, e.g. batch_argnums=(2,)",
        "donate_argnums": "the arguments whose buffers the step may reuse, e.g. "
        "donate_argnums=(0, 1)",
    }[name]
    if argnums is None:
        return ()
    items = (argnums,) if _is_int(argnums) else argnums
    if isinstance(items, (str, bytes)) or not isinstance(items, (tuple, list)):
        raise TypeError(
            f"parallelize({name}={argnums!r}) takes an int or a tuple of ints: the positions of "
            f"{what}"
        )
    bad = [i for i in items if not _is_int(i)]
    if bad:
        raise TypeError(
            f"parallelize({name}={argnums!r}): {bad[0]!r} is not an argument position; give "
            f"ints: the positions of {what}"
        )
    if len(set(items)) != len(items):
        raise ValueError(f"parallelize({name}={argnums!r}) repeats a position")
    return tuple(int(i) for i in items)


def _jax_dtype(dtype: np.dtype) -> bool:
    try:
        jax.dtypes.canonicalize_dtype(dtype)
        return jax.numpy.issubdtype(dtype, jax.numpy.number) or dtype == np.bool_
    except (TypeError, ValueError):
        return False


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_mesh_list(meshes: Any) -> list[Mesh] | None:
    """`meshes` as a list of `jax.sharding.Mesh`es (None: the config's stage meshes)."""
    if meshes is None:
        return None
    if isinstance(meshes, Mesh):
        raise TypeError(
            "parallelize(meshes=...) takes one Mesh per stage (a list), not one Mesh: e.g. "
            "meshes=[mesh0, mesh1]"
        )
    if isinstance(meshes, (str, bytes)) or not isinstance(meshes, (list, tuple)):
        raise TypeError(
            f"parallelize(meshes={meshes!r}) takes a list of jax.sharding.Mesh, one per stage"
        )
    if not meshes:
        raise ValueError("parallelize(meshes=[]) gives no mesh; give one Mesh per stage, or None")
    for i, mesh in enumerate(meshes):
        if not isinstance(mesh, Mesh):
            raise TypeError(
                f"parallelize(meshes=...): meshes[{i}] is {type(mesh).__name__} ({mesh!r}), not a "
                "jax.sharding.Mesh; build one with jax.make_mesh(shape, names, devices=...)"
            )
    return list(meshes)


class BatchArgnumsWarning(UserWarning):
    """`num_micro_batches > 1` but no `batch_argnums`: nothing is split into micro-batches, so
    every micro-batch computes the step on the whole input (the result equals `jax.jit`'s, at
    `num_micro_batches` times the work). The message names the argument that looks like the
    batch and the fix."""


@dataclasses.dataclass
class _Entry:
    graph: StepGraph
    pipeline: Any  # LocalPipeline or RayPipeline
    in_tree: Any
    outputs: StepOutputs
    partition: Any = None  # the PartitionReport of partition="auto"


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
        # Compiled steps by argument signature, least recently used first (see `_remember`).
        self._cache: collections.OrderedDict[Any, _Entry] = collections.OrderedDict()
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
        unit = self._unit_axes
        try:
            key = (in_tree, *(_leaf_key(x, unit) if is_array(x) else (_STATIC, x) for x in leaves))
            entry = self._cache.get(key)
            if entry is not None and getattr(entry.pipeline, "closed", False):
                entry = None  # closed by `close` or `jaxreshard.shutdown()`: compile again
        except TypeError:  # an unhashable static leaf
            bad = next(i for i, x in enumerate(leaves) if not is_array(x) and not _hashable(x))
            raise TypeError(
                f"argument leaf {_leaf_paths(args)[bad]} is a {type(leaves[bad]).__name__}, "
                "which is neither an array nor hashable; parallelize treats non-array leaves as "
                "static (as eqx.filter_jit does) and needs to hash them: pass it as an array, "
                "make it hashable, or close over it in the step"
            ) from None
        arrays = [x for x in leaves if is_array(x)]
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
            self._warn_no_batch(args)
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
        self._check_batch(arrays, batch_leaves, paths)
        self._note_static(key, static, _leaf_paths(args))
        donated = [
            dynamic[i] for i in _batch_leaf_indices(args, self.donate_argnums) if i in dynamic
        ]
        entry = self._compile(arrays, in_tree, batch_leaves, static, recorded, donated)
        self._remember(key, entry)
        return entry, arrays

    def _remember(self, key: Any, entry: _Entry) -> None:
        """Cache a compiled step; past `MAX_COMPILED` signatures the least recently used one is
        dropped and its pipeline closed (its threads end; its buffers go with it)."""
        old = self._cache.pop(key, None)
        if old is not None:
            _close(old)
        self._cache[key] = entry
        while len(self._cache) > MAX_COMPILED:
            _, dropped = self._cache.popitem(last=False)
            _close(dropped)

    def close(self) -> None:
        """Free every compiled pipeline now (threads, pools, device buffers it holds); a later
        call compiles again. Dropping the parallelized step does the same."""
        while self._cache:
            _close(self._cache.popitem()[1])

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
                stacklevel=4,
            )

    def _warn_no_batch(self, args: tuple[Any, ...]) -> None:
        """Warn that without `batch_argnums` every micro-batch takes the whole input, naming
        the argument that looks like the batch (see `likely_batch_argnum`)."""
        m = self.config.num_micro_batches
        name = getattr(self.fun, "__name__", "the step")
        guess = likely_batch_argnum(args, m)
        if guess is None:
            hint = (
                "Pass batch_argnums=(i,) naming the arguments that hold the batch (every leaf "
                f"with a batch dim 0 that {m} divides)"
            )
        else:
            rows = next(x for x in jax.tree.leaves(args[guess]) if is_array(x)).shape[0]
            hint = (
                f"Argument {guess}{_arg_name(self.fun, guess)} looks like the batch (every leaf "
                f"has {rows} rows along dim 0, which no other argument's leaves all share): "
                f"pass batch_argnums=({guess},) to split it"
            )
        warnings.warn(
            f"parallelize({name}) has num_micro_batches={m} but no batch_argnums, so no argument "
            f"is split into micro-batches: each of the {m} micro-batches computes the step on "
            f"the whole input (the result equals jax.jit's, at {m} times the work). {hint}, or "
            "use num_micro_batches=1 if the step has no batch.",
            BatchArgnumsWarning,
            stacklevel=4,
        )

    def _check_batch(self, leaves: list[Any], batch_leaves: list[int], paths: list[str]):
        m = self.config.num_micro_batches
        for i in batch_leaves:
            shape = leaves[i].shape
            if not shape:
                raise ValueError(
                    f"batch leaf {paths[i]} is a scalar; every batch leaf needs a batch dim 0 "
                    "to split into micro-batches"
                )
            if shape[0] == 0:
                raise ValueError(
                    f"batch leaf {paths[i]} has 0 rows along dim 0: an empty batch has no loss "
                    "to compute; give at least num_micro_batches rows"
                )
            if shape[0] % m:
                raise ValueError(
                    f"batch leaf {paths[i]} has {shape[0]} rows along dim 0, which "
                    f"num_micro_batches={m} does not divide; use a batch size that is a "
                    f"multiple of {m} (e.g. {shape[0] // m * m or m}) or another micro-batch count"
                )
        rows: dict[int, str] = {}
        for i in batch_leaves:
            rows.setdefault(leaves[i].shape[0], paths[i])
        if len(rows) > 1:
            sizes = ", ".join(f"{path} has {n}" for n, path in sorted(rows.items()))
            raise ValueError(
                f"batch leaves have different sizes along dim 0 ({sizes}); they must agree to "
                "be split into the same micro-batches: give every batch leaf the same rows, or "
                "pass the odd one in an argument outside batch_argnums"
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
        config, partition = self.config, None

        def trace(cuts: Any, expected: int | None, candidates: Any = None) -> Any:
            return trace_step(
                self.fun,
                in_tree,
                leaves,
                batch_leaves,
                config.num_micro_batches,
                trace_mesh,
                expected,
                input_specs,
                static=static,
                loss_reduction=config.loss_reduction,
                donated=donated,
                cuts=cuts,
                candidates=candidates,
            )

        if config.partition == "auto" and config.cuts is None:
            partition = self._partition(trace, on_ray)
            config = dataclasses.replace(config, cuts=partition.chosen)
        graph, outputs = trace(config.cuts, config.num_stages)
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
            return _Entry(graph, pipeline, in_tree, outputs, partition)
        meshes, cluster = self._local_meshes(graph.num_stages)
        compiled = compile_local(graph, config, list(meshes), leaves, cluster, recorded)
        return _Entry(graph, LocalPipeline(compiled), in_tree, outputs, partition)

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

    def _partition(self, trace: Callable[..., Any], on_ray: bool) -> Any:
        """Choose the `stage_candidate` cuts (see [Note: automatic partitioning])."""
        from jaxreshard.runtime.step._partition import choose_cuts

        found: list[Any] = []
        graph_all, _ = trace("all", None, found)
        assert self.config.num_stages is not None
        if on_ray:  # the hosts' meshes and links; segments are timed on this process's device
            from jaxreshard.runtime import current_runtime
            from jaxreshard.runtime.ray._placement import stage_placement

            runtime = current_runtime()
            meshes = stage_placement(runtime, self.config, self.config.num_stages)[0]
            return choose_cuts(graph_all, found[1], self.config, meshes, runtime.cluster)
        meshes, cluster = self._local_meshes(self.config.num_stages)
        gbps = self.config.emulate_network_gbps
        if gbps is not None:  # the links the steps will see
            devices = [d for mesh in meshes for d in mesh.devices.flat]
            cluster = Cluster.from_devices(
                devices, devices_per_host=self.config.devices_per_host,
                inter_host_gbytes_per_s=gbps,
            )  # fmt: skip
        return choose_cuts(graph_all, found[1], self.config, meshes, cluster)

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
        """What the step will do for these arguments, without running it."""
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


def likely_batch_argnum(args: tuple[Any, ...], num_micro_batches: int) -> int | None:
    """The argument that looks like a batch: the last one whose array leaves all share one
    dim 0 size that `num_micro_batches` divides, a size that no other such argument has (the
    parameters' leaves seldom all share a dim 0; a parameter argument that does, with the
    batch's size, leaves no answer). None if there is none."""
    rows: dict[int, int] = {}
    for i, arg in enumerate(args):
        leaves = [x for x in jax.tree.leaves(arg) if is_array(x)]
        if not leaves or any(x.ndim == 0 for x in leaves):
            continue
        sizes = {int(x.shape[0]) for x in leaves}
        n = sizes.pop()
        if not sizes and n >= num_micro_batches and n % num_micro_batches == 0:
            rows[i] = n
    for i in sorted(rows, reverse=True):
        if list(rows.values()).count(rows[i]) == 1:
            return i
    return None


def _arg_name(fun: Callable[..., Any], i: int) -> str:
    """` (`name`)` for positional parameter `i` of `fun`, if its signature tells."""
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return ""
    if i < len(params) and params[i].kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        return f" (`{params[i].name}`)"
    return ""


def _batch_leaf_indices(args: tuple[Any, ...], batch_argnums: Sequence[int]) -> list[int]:
    out, at = [], 0
    norm = {i % len(args) for i in batch_argnums} if args else set()
    for i, arg in enumerate(args):
        n = len(jax.tree.leaves(arg))
        if i in norm:
            out.extend(range(at, at + n))
        at += n
    return out


_STATIC = object()  # marks a static leaf in a cache key


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def _leaf_paths(args: tuple[Any, ...]) -> list[str]:
    paths, _ = jax.tree_util.tree_flatten_with_path(args)
    return [f"args{jax.tree_util.keystr(path)}" for path, _ in paths]


# How many argument signatures one parallelized step keeps compiled.
MAX_COMPILED = 8


def _close(entry: _Entry) -> None:
    close = getattr(entry.pipeline, "close", None)
    if close is not None:
        close()


@functools.lru_cache(maxsize=1024)
def _normalized_leaf_spec(sharding: Any, unit_axes: frozenset[str]) -> tuple[Any, ...]:
    mesh = getattr(sharding, "mesh", None)
    sizes = dict(getattr(mesh, "shape", None) or {})
    ones = {a: 1 for a in unit_axes if sizes.get(a) == 1}
    return normalized_spec(spec_of(sharding), ones)


def _leaf_key(x: Any, unit_axes: frozenset[str] = frozenset()) -> tuple[Any, ...]:
    """What the compiled step depends on of one leaf: shape, dtype and PartitionSpec (an
    unsharded leaf counts as replicated, so host arrays and the step's own outputs share one
    compile). Shardings are few and hashable: their specs are looked up, not rebuilt.
    Specs are normalised (`normalized_spec`): `P('model', None)` as placed and `P('model')` as
    XLA returns the step's outputs are one sharding, and so are `P('data')` and `P()` when
    'data' has one device on the leaf's mesh and on every stage mesh (`unit_axes`); they must
    not compile the step twice. An axis of one device on the leaf's mesh but more on a stage's
    keeps its name: the step would shard over it."""
    return (x.shape, x.dtype, _normalized_leaf_spec(getattr(x, "sharding", None), unit_axes))


@dataclasses.dataclass
class PipelinePlan:
    """What a parallelized step does: stages, meshes, boundary tensors, schedule, programs."""

    graph: StepGraph
    pipeline: Any  # LocalPipeline or RayPipeline
    # partition="auto": the measured segments and cuts, every choice's predicted step, and the
    # choice (see [Note: automatic partitioning] in runtime/step/_partition.py).
    partition: Any = None

    @property
    def layout(self) -> Any:
        return self.pipeline.layout

    @property
    def meshes(self) -> list[Any]:
        return self.pipeline.meshes

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
                    "strategy": t.plan.chosen if t.plan else "local",
                    "bytes": t.nbytes,
                    "per": "step" if kind in ("param", "param_grad") else "micro-batch",
                }
            )
        return out

    def summary(self) -> str:
        """One line: stages (and ranks), micro-batches and their rows, schedule."""
        g, layout = self.graph, self.layout
        schedule = layout.schedule
        stages = f"{g.num_stages} stages"
        if schedule.virtual_stages > 1 or schedule.num_chunks != schedule.num_stages:
            stages += f" on {schedule.num_stages} ranks"
        m = layout.config.num_micro_batches
        if g.batch:
            batches = f"{m} micro-batch{'es' if m > 1 else ''} of {layout.micro_batch_rows} rows"
        elif m == 1:
            batches = "1 micro-batch, no batch argument"
        else:
            batches = (
                f"{m} micro-batches, no batch argument (batch_argnums=()): each micro-batch "
                "computes the whole step"
            )
        delay = " + weight delay" if schedule.weight_delay else ""
        return f"{stages}, {batches}, schedule {schedule.name}{delay}"

    def __str__(self) -> str:
        g, layout = self.graph, self.layout
        lines = [f"pipeline: {self.summary()}"]
        if self.partition is not None:
            lines.append(self.partition.summary())
        for s, mesh in enumerate(self.meshes):
            stage = g.loss.stages[s]
            ids = [d.id for d in mesh.devices.flat]
            kinds = {k: sum(r.kind == k for r in stage.inputs) for k in (PARAM, BATCH, CONST, ACT)}
            lines.append(
                f"  stage {s}: mesh {dict(mesh.shape)} devices {ids}; "
                f"{len(stage.jaxpr.jaxpr.eqns)} equations; inputs: {kinds[PARAM]} params, "
                f"{kinds[BATCH]} batch, {kinds[CONST]} consts, {kinds[ACT]} activations"
            )
        if layout.reductions:
            lines.append("parameter gradients summed over the batch axes:")
            for s, how in sorted(layout.reductions.items()):
                lines.append(f"  stage {s}: {how}")
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
