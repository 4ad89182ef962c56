"""The local runtime: every stage on this process's devices, one thread per stage."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
from jax.extend import core as jc
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxreshard.comm import Cluster, Plan
from jaxreshard.comm._emulate import LinkEmulator
from jaxreshard.comm._local import execute_local
from jaxreshard.frontend._backward import derive_backward, derive_forward
from jaxreshard.frontend._split import BATCH, CONST, StepGraph
from jaxreshard.pipeline import Schedule
from jaxreshard.pipeline._emit import Instruction
from jaxreshard.runtime._compile import StageCompiler, fusable_segments
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime._executor import (
    APPLY_EVENT,
    Channels,
    Event,
    PipelineError,
    StageProgram,
    check_source,
    transfer_key,
    wait_for_stages,
)
from jaxreshard.runtime._layout import (
    PipelineLayout,
    Transfer,
    layout_pipeline,
    parameter_specs,
    pipeline_schedule,
)
from jaxreshard.runtime._segments import SegmentExecutables
from jaxreshard.runtime._specs import spec_of, transplant_spec
from jaxreshard.runtime._step import (
    combine_losses,
    combine_results,
    donated,
    pre_values,
    segment_function,
    stage_feeds,
)


@dataclasses.dataclass
class CompiledPipeline:
    """A step compiled for this process's devices."""

    graph: StepGraph
    layout: PipelineLayout
    meshes: list[Mesh]
    cluster: Cluster
    compilers: list[StageCompiler]
    fused: dict[int, int] = dataclasses.field(default_factory=dict)  # stage -> post segment
    segments: SegmentExecutables | None = None

    @property
    def config(self) -> PipelineConfig:
        return self.layout.config

    @property
    def num_stages(self) -> int:
        return self.layout.num_stages

    @property
    def transfers(self) -> dict[tuple[str, int, int, int], Transfer]:
        return self.layout.transfers

    @property
    def schedule(self) -> Schedule:
        return self.layout.schedule

    @property
    def programs(self) -> tuple[tuple[Instruction, ...], ...]:
        return self.layout.programs

    def sharding(self, s: int, spec: P) -> NamedSharding:
        return NamedSharding(self.meshes[s], spec)


def compile_local(
    graph: StepGraph,
    config: PipelineConfig,
    meshes: list[Mesh],
    leaves: Sequence[Any],
    cluster: Cluster,
    recorded: bool = False,
) -> CompiledPipeline:
    """Compile a cut step for this process's devices: `meshes` has one mesh per rank; every
    stage (chunk) compiles on the mesh the schedule places it on (up front, the executables
    a step calls; a `recorded` one's for a profile)."""
    schedule = pipeline_schedule(config, graph.num_stages, graph.forward_only)
    meshes = [meshes[schedule.rank_of(c)] for c in range(graph.num_stages)]
    compilers = [
        StageCompiler(graph, stage_backward(graph, s, config), meshes[s], config)
        for s in range(graph.num_stages)
    ]
    fused = fusable_segments(graph, range(graph.num_stages), config.num_micro_batches)
    grad_of = {v: k for k, v in enumerate(graph.grad_outputs[1:])}
    for s, j in fused.items():
        seg = graph.segments[j]
        compilers[s].set_apply(seg.jaxpr, [grad_of.get(v) for v in seg.inputs])
    # The optimizer segments compile beside the stages (see [Note: segment executables]).
    segments = SegmentExecutables(graph)
    specs = parameter_specs(graph, leaves, [dict(mesh.shape) for mesh in meshes])
    post = threading.Thread(
        target=segments.warm,
        args=(meshes, specs, leaves, set(fused.values())),
        name="jaxreshard-compile-post",
        daemon=True,
    )
    post.start()
    try:
        layout = layout_pipeline(
            graph, config, schedule, meshes, leaves, cluster, compilers, fused, recorded
        )
    finally:
        post.join()
    return CompiledPipeline(graph, layout, meshes, cluster, compilers, fused, segments)


def stage_backward(graph: StepGraph, s: int, config: PipelineConfig) -> Any:
    """Stage s's traced forward and backward (forward only, for a forward-only step)."""
    stage = graph.loss.stages[s]
    if graph.forward_only:
        return derive_forward(stage)
    return derive_backward(stage, split=config.split_backward)


class LocalChannels(Channels):
    """Boundary tensors between stages of this process: the sender thread runs the transfer's
    plan (`comm._local.execute_local`) and delivers the result (see [Note: boundary tensors])."""

    def __init__(self, compiled: CompiledPipeline):
        super().__init__(compiled.layout, compiled.config.timeout_s)
        self.c = compiled
        gbps = compiled.config.emulate_network_gbps
        if gbps is None:
            self.inline_bytes = 1 << 20
        self._emulator = (
            LinkEmulator(gbps, compiled.cluster.latency_s) if gbps is not None else None
        )
        self._shardings = {
            key: (
                compiled.sharding(t.src_stage, t.src_spec),
                compiled.sharding(t.dst_stage, t.dst_spec),
            )
            for key, t in compiled.transfers.items()
        }

    def _move(self, ins: Instruction, transfer: Transfer, value: Any) -> None:
        src, dst = self._shardings[transfer_key(ins)]
        check_source(transfer, value, src)
        if transfer.plan is None:  # between two chunks of one rank: it stays on the mesh
            self.deliver(ins.key, value if src == dst else jax.device_put(value, dst))
            return
        jax.block_until_ready(value)
        start = time.perf_counter()
        ready = 0.0
        if self.signal_only:
            moved = self.placeholder(transfer, dst)
        else:
            moved = execute_local(transfer.plan, value, dst)
            if self._emulator is not None:
                # The receiver, not this thread, sleeps until the emulated hops end.
                ready = emulated_end(self._emulator, self.c.cluster, transfer.plan)
        if self.record is not None:
            jax.block_until_ready(moved)
            end = time.perf_counter() + max(0.0, ready - time.monotonic())
            nbytes = 0 if self.signal_only else None
            self.record(Event.send(transfer, ins.mb, start, end, nbytes))
        self.deliver(ins.key, moved, ready)


class LocalExecutor:
    """Runs a compiled pipeline on this process's devices: one `StageProgram` per stage, each in
    its own long-lived thread, over `LocalChannels` (see [Note: pipeline execution]).

    `channels` may give each stage other channels instead (tests run `HostChannels` of several
    emulated hosts in one process this way).
    """

    def __init__(self, compiled: CompiledPipeline, channels: dict[int, Channels] | None = None):
        self.c = compiled
        self.events: list[Event] = []
        self.channels_of = channels or dict.fromkeys(
            range(compiled.num_stages), LocalChannels(compiled)
        )
        self._channels = list({id(c): c for c in self.channels_of.values()}.values())
        schedule = compiled.schedule
        self.ranks = [schedule.chunks_of(r) for r in range(schedule.num_stages)]
        self.programs = [
            StageProgram(
                {c: compiled.compilers[c] for c in chunks},
                compiled.graph,
                compiled.layout,
                self.channels_of[chunks[0]],
                r,
            )
            for r, chunks in enumerate(self.ranks)
        ]
        self._steps = itertools.count()
        self._stages = ThreadPoolExecutor(
            max_workers=len(self.ranks), thread_name_prefix="jaxreshard-stage"
        )

    def close(self) -> None:
        for channels in self._channels:
            channels.close()
        self._stages.shutdown(wait=False, cancel_futures=True)

    def run(
        self,
        params: list[Any],
        batches: list[list[list[Any]]],
        consts: list[list[Any]],
        *,
        record: bool = False,
        signal_only: bool = False,
        apply_inputs: dict[int, list[Any]] | None = None,
    ) -> tuple[list[Any], list[Any], dict[int, list[Any]], dict[tuple[int, int], Any]]:
        """Run every stage's program; return the loss per micro-batch, the gradient per parameter
        (None where an optimizer segment was fused), the fused segments' outputs by stage and
        the aux / forward outputs by (result, micro-batch).

        With `record`, every action and transfer is timed into `self.events` (which blocks on
        each action's results, so use it for profiles). With `signal_only`, transfers carry no
        data (see [Note: signal-only bound]): the results are wrong, the timing is the bound.
        """
        self.events = []
        recorder = self.events.append if record else None
        p = self.c.num_stages
        step_id = f"local:{next(self._steps)}"
        for channels in self._channels:
            stages = [s for s in range(p) if self.channels_of[s] is channels]
            channels.begin(stages, step_id=step_id, record=recorder, signal_only=signal_only)
        owner = self.c.graph.owner
        accumulators: dict[int, dict[int, Any]] = {}
        applied: dict[int, list[Any]] = {}
        losses: list[Any] = [None] * self.c.config.num_micro_batches
        results: dict[tuple[int, int], Any] = {}

        def worker(r: int) -> None:
            program, chunks = self.programs[r], self.ranks[r]
            program.record = recorder
            mine = {k: v for k, v in enumerate(params) if owner[k] in chunks}
            try:
                with jax.set_mesh(self.c.meshes[chunks[0]]):
                    accs, out = program.run(
                        mine,
                        {c: batches[c] for c in chunks},
                        {c: consts[c] for c in chunks},
                        losses,
                        {c: v for c, v in (apply_inputs or {}).items() if c in chunks},
                        results,
                    )
                accumulators.update(accs)
                applied.update(out)
            except BaseException as e:
                what = f"stage {chunks[0]}" if len(chunks) == 1 else f"rank {r} {list(chunks)}"
                error = (
                    e
                    if isinstance(e, PipelineError)
                    else PipelineError(f"{what} failed: {type(e).__name__}: {e}")
                )
                error.__cause__ = e
                for channels in self._channels:
                    channels.fail(error)

        if len(self.ranks) == 1:
            worker(0)  # nothing to overlap with: no thread
        else:
            futures = [self._stages.submit(worker, r) for r in range(len(self.ranks))]
            wait_for_stages(futures, self._channels, self.c.config.timeout_s, "local runtime")
        for channels in self._channels:
            channels.end()
        grads = [accumulators.get(owner[k], {}).get(k) for k in range(len(params))]
        return losses, grads, applied, results


def emulated_end(emulator: LinkEmulator, cluster: Cluster, plan: Plan) -> float:
    """When a plan's cross-host hops would end on the emulated NICs (see
    [Note: network emulation])."""
    host = cluster.host_of
    end = 0.0
    for op in plan.ops:
        if op.kind == "allgather":
            continue
        chain = (op.src_device, *op.dst_devices)
        for a, b in itertools.pairwise(chain):
            if host(a) != host(b):
                end = max(end, emulator.reserve(host(a), host(b), op.nbytes)[1])
    return end


class LocalPipeline:
    """A step compiled for this process's devices: runs it (see [Note: pipeline execution])."""

    def __init__(self, compiled: CompiledPipeline, channels: dict[int, Channels] | None = None):
        self.compiled = compiled
        # Its threads live as long as the pipeline.
        self.executor = LocalExecutor(compiled, channels)
        self.last_events: list[Event] = []
        g = compiled.graph
        self._donate = {j: donated(g, j) for j in range(len(g.segments))}
        self._devices = [frozenset(mesh.devices.flat) for mesh in compiled.meshes]
        grad_vars = set(g.grad_outputs[1:])
        self._apply_vars = {  # a fused segment's inputs other than the gradients
            s: [v for v in g.segments[j].inputs if v not in grad_vars]
            for s, j in compiled.fused.items()
        }

    @property
    def layout(self) -> PipelineLayout:
        return self.compiled.layout

    @property
    def meshes(self) -> list[Mesh]:
        return self.compiled.meshes

    def _one_device_set(self, inputs: list[Any]) -> list[Any]:
        """The `pre` part's inputs on one device set: as they are, unless JAX arrays among them
        sit on several (a parameter and an optimizer count on two stages): then all on stage
        0's mesh."""
        sets = {x.sharding.device_set for x in inputs if isinstance(x, jax.Array)}
        if len(sets) <= 1:
            return inputs
        mesh = self.compiled.meshes[0]
        return [on_mesh(x, mesh, self._devices[0]) for x in inputs]

    def sharding(self, s: int, spec: P) -> NamedSharding:
        return self.compiled.sharding(s, spec)

    def run(
        self, leaves: list[Any], *, record: bool = False, signal_only: bool = False
    ) -> list[Any]:
        """Run one step; return the flat outputs. With `record`, `last_events` also gets the
        post-gradient segments (kind `A`)."""
        c, executor = self.compiled, self.executor
        g, layout = c.graph, c.layout
        m = c.config.num_micro_batches
        params = [
            _place(leaves[i], c.sharding(g.owner[k], layout.param_specs[k]))
            for k, i in enumerate(g.params)
        ]
        pre = pre_values(g, leaves, self._one_device_set)
        raw_batches, raw_consts = stage_feeds(g, leaves, pre, m)
        batches: list[list[list[Any]]] = []
        consts: list[list[Any]] = []
        for s, stage in enumerate(g.loss.stages):
            specs = layout.input_specs[s]
            batch_specs = [sp for r, sp in zip(stage.inputs, specs) if r.kind == BATCH]
            const_specs = [sp for r, sp in zip(stage.inputs, specs) if r.kind == CONST]
            batches.append(
                [
                    [_place(x, c.sharding(s, sp)) for x, sp in zip(pieces, batch_specs)]
                    for pieces in raw_batches[s]
                ]
            )
            consts.append(
                [_place(x, c.sharding(s, sp)) for x, sp in zip(raw_consts[s], const_specs)]
            )
        values: dict[Any, Any] = dict(zip(g.outer.jaxpr.invars, leaves))
        for k, i in enumerate(g.params):
            values[g.outer.jaxpr.invars[i]] = params[k]
        values.update(pre)
        apply_inputs = {
            s: [on_mesh(values[v], c.meshes[s], self._devices[s]) for v in inputs]
            for s, inputs in self._apply_vars.items()
        }
        losses, grads, applied, results = executor.run(
            params,
            batches,
            consts,
            record=record,
            signal_only=signal_only,
            apply_inputs=apply_inputs,
        )
        m = c.config.num_micro_batches
        per_mb = [[results[(j, mb)] for mb in range(m)] for j in range(len(g.results))]
        values.update(
            zip(g.result_outputs, combine_results(per_mb, g.results, c.config.loss_reduction))
        )
        if g.forward_only:
            self.last_events = executor.events
            return [
                values[v] if not isinstance(v, jc.Literal) else v.val for v in g.outer.jaxpr.outvars
            ]
        values[g.grad_outputs[0]] = combine_losses(losses, c.config.loss_reduction)
        for k, v in enumerate(g.grad_outputs[1:]):
            if grads[k] is not None:
                values[v] = grads[k]
            elif g.owner[k] not in c.fused:  # the loss does not use this parameter
                values[v] = jax.numpy.zeros_like(params[k])
        for s, j in c.fused.items():
            values.update(zip(g.segments[j].outputs, applied[s]))
        fused = set(c.fused.values())
        for index, segment in enumerate(g.segments):
            if index in fused:
                continue
            s = segment.stage
            inputs = [on_mesh(values[v], c.meshes[s], self._devices[s]) for v in segment.inputs]
            start = time.perf_counter()
            if c.segments is not None:
                outs = c.segments.run(index, inputs)
            else:
                outs = segment_function(segment.jaxpr, self._donate[index])(*inputs)
            if record:
                jax.block_until_ready(outs)
                executor.events.append(
                    Event(segment.stage, APPLY_EVENT, -1, start, time.perf_counter(), "apply")
                )
            values.update(zip(segment.outputs, outs))
        self.last_events = executor.events
        return [
            values[v] if not isinstance(v, jc.Literal) else v.val for v in g.outer.jaxpr.outvars
        ]


def _place(x: Any, sharding: Any) -> Any:
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    return jax.device_put(x, sharding)


def on_mesh(x: Any, mesh: Mesh, devices: frozenset[Any] | None = None) -> Any:
    """`x` on `mesh`'s devices (`devices`, when the caller has them): as it is if it is there
    already, else moved (same spec if it fits, else replicated)."""
    if devices is None:
        devices = frozenset(mesh.devices.flat)
    if isinstance(x, jax.Array) and x.sharding.device_set == devices:
        return x
    if not hasattr(x, "shape"):
        return x
    spec = transplant_spec(spec_of(getattr(x, "sharding", None)), dict(mesh.shape), x.shape)
    return jax.device_put(x, NamedSharding(mesh, spec))
