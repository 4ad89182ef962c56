"""The local runtime: every stage on this process's devices, one thread per stage."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jc
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxreshard._jax_compat import copy_shards, shard_for_shard
from jaxreshard.comm import Cluster, Plan
from jaxreshard.comm._emulate import LinkEmulator
from jaxreshard.comm._local import execute_local
from jaxreshard.frontend._backward import derive_backward, derive_forward
from jaxreshard.frontend._split import BATCH, CONST, StepGraph
from jaxreshard.pipeline import Schedule
from jaxreshard.pipeline._emit import Instruction
from jaxreshard.runtime._api import track_pipeline
from jaxreshard.runtime._compile import StageCompiler, fusable_segments
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime._executor import (
    APPLY_EVENT,
    Channels,
    Event,
    RankRunner,
    StageProgram,
    check_source,
    is_ready,
    transfer_key,
)
from jaxreshard.runtime._layout import (
    PipelineLayout,
    Transfer,
    layout_pipeline,
    parameter_specs,
    pipeline_schedule,
)
from jaxreshard.runtime._programs import program_variants
from jaxreshard.runtime._segments import SegmentExecutables
from jaxreshard.runtime._specs import spec_of, transplant_spec
from jaxreshard.runtime._step import (
    combine_losses,
    combine_results,
    donated,
    feed_values,
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
    """Boundary tensors between stages of this process (see [Note: boundary tensors]).

    A transfer moves in the sending stage's thread, asynchronously, where JAX can make the copy
    without waiting for the value (see [Note: one dispatching thread]): a copy shard for shard
    (`copy_shards`), or a small plan run by device copies; a large plan whose value does not
    exist yet goes to a sender thread, which runs it by the CPU fast path
    (`comm._local.execute_local`) once the value exists. Profiles (`record`) and network
    emulation move everything in sender threads, where a transfer can be timed or delayed."""

    # A plan of at most this many bytes runs by asynchronous device copies when its value is not
    # ready yet (the CPU fast path would wait for it).
    async_bytes = 4 << 20

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
        self._whole = {
            key: t.plan is not None and shard_for_shard(*self._shardings[key], t.shape)
            for key, t in compiled.transfers.items()
        }

    @property
    def threaded(self) -> bool:
        """Whether transfers (and so the stages) need threads of their own this step."""
        return self.record is not None or self._emulator is not None

    def moves_inline(self, ins: Instruction, transfer: Transfer, value: Any) -> bool:
        if transfer.plan is None:
            return True
        if self.threaded:
            return super().moves_inline(ins, transfer, value)
        return (
            self.signal_only
            or self._whole[transfer_key(ins)]
            or transfer.nbytes <= self.async_bytes
            or (transfer.nbytes <= self.inline_bytes and is_ready(value))
        )

    def _move(self, ins: Instruction, transfer: Transfer, value: Any) -> None:
        src, dst = self._shardings[transfer_key(ins)]
        check_source(transfer, value, src)
        if transfer.plan is None:  # between two chunks of one rank: it stays on the mesh
            self.deliver(ins.key, value if src == dst else jax.device_put(value, dst))
            return
        if not self.threaded:
            if self.signal_only:
                moved = self.placeholder(transfer, dst)
            elif self._whole[transfer_key(ins)]:
                moved = (
                    copy_shards(value, dst) if value.sharding == src else jax.device_put(value, dst)
                )
            elif is_ready(value) or transfer.nbytes > self.async_bytes:
                moved = execute_local(transfer.plan, value, dst)
            else:
                moved = execute_local(transfer.plan, value, dst, path="devices")
            self.deliver(ins.key, moved)
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
    """Runs a compiled pipeline on this process's devices: one `StageProgram` per rank, all
    driven by the calling thread (`dispatch`), or, for profiles and network emulation, each in
    a thread of its own (see [Note: one dispatching thread]); `RankRunner` is the engine.

    `channels` may give each stage other channels instead (tests run `HostChannels` of several
    emulated hosts in one process this way; their ranks run in threads).
    """

    def __init__(self, compiled: CompiledPipeline, channels: dict[int, Channels] | None = None):
        self.c = compiled
        self.events: list[Event] = []
        self.channels_of = channels or dict.fromkeys(
            range(compiled.num_stages), LocalChannels(compiled)
        )
        schedule = compiled.schedule
        self.ranks = {r: schedule.chunks_of(r) for r in range(schedule.num_stages)}
        programs = {
            r: StageProgram(
                {c: compiled.compilers[c] for c in chunks},
                compiled.graph,
                compiled.layout,
                self.channels_of[chunks[0]],
                r,
            )
            for r, chunks in self.ranks.items()
        }
        self.runner = RankRunner(
            programs,
            self.ranks,
            self.channels_of,
            compiled.meshes,
            compiled.graph.owner,
            compiled.config.timeout_s,
        )
        self._steps = itertools.count()
        self._recorded_ready = False

    @property
    def programs(self) -> list[StageProgram]:
        """Each rank's program, by rank."""
        return [self.runner.programs[r] for r in sorted(self.ranks)]

    def close(self) -> None:
        """Free the threads (idempotent)."""
        self.runner.close()

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
        the aux / forward outputs by (result, micro-batch). Returns when they have been computed
        (at most `timeout_s` without any action finishing, else a `PipelineError` naming the
        stuck one).

        With `record`, every action and transfer is timed into `self.events` (which blocks on
        each action's results, so use it for profiles). With `signal_only`, transfers carry no
        data (see [Note: signal-only bound]): the results are wrong, the timing is the bound.
        """
        if record and not self._recorded_ready:
            self._compile_recorded()
        self.events = []
        losses: list[Any] = [None] * self.c.config.num_micro_batches
        results: dict[tuple[int, int], Any] = {}
        self.runner.begin(
            f"local:{next(self._steps)}",
            record=self.events.append if record else None,
            signal_only=signal_only,
        )
        accumulators, applied = self.runner.run(
            dict(enumerate(params)),
            dict(enumerate(batches)),
            dict(enumerate(consts)),
            apply_inputs or {},
            losses,
            results,
        )
        owner = self.c.graph.owner
        grads = [accumulators.get(owner[k], {}).get(k) for k in range(len(params))]
        return losses, grads, applied, results

    def _compile_recorded(self) -> None:
        """Compile what a recorded step calls that a plain one does not (the last stage's
        forward and backward apart), before the step: nothing compiles while peers wait with
        deadlines."""
        c = self.c
        p = c.num_stages
        split = c.config.split_backward and not c.graph.forward_only
        accumulates = {s for s in range(p) if c.compilers[s].acc_params}
        for r, chunks in self.ranks.items():
            names = program_variants(
                c.programs[r], chunks, p - 1, split, c.fused, accumulates, recorded=True
            )
            for chunk, variants in names.items():
                c.compilers[chunk].compile_variants(sorted(variants))
        self._recorded_ready = True


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
        layout = compiled.layout
        self._param_shardings = [
            compiled.sharding(g.owner[k], layout.param_specs[k]) for k in range(len(g.params))
        ]
        self._batch_shardings: list[list[NamedSharding]] = []
        self._const_shardings: list[list[NamedSharding]] = []
        for s, stage in enumerate(g.loss.stages):
            specs = layout.input_specs[s]
            self._batch_shardings.append(
                [compiled.sharding(s, sp) for r, sp in zip(stage.inputs, specs) if r.kind == BATCH]
            )
            self._const_shardings.append(
                [compiled.sharding(s, sp) for r, sp in zip(stage.inputs, specs) if r.kind == CONST]
            )
        self._feeds = FeedSplitter(
            m=compiled.config.num_micro_batches,
            dims=[f.dim for f in g.feeds],
            refs=[[r.index for r in stage.inputs if r.kind == BATCH] for stage in g.loss.stages],
            shardings=self._batch_shardings,
        )
        # Threads and pools end with the pipeline, or at `close`.
        self._finalizer = weakref.finalize(self, self.executor.close)
        track_pipeline(self)
        grad_vars = set(g.grad_outputs[1:])
        self._apply_vars = {  # a fused segment's inputs other than the gradients
            s: [v for v in g.segments[j].inputs if v not in grad_vars]
            for s, j in compiled.fused.items()
        }

    @property
    def layout(self) -> PipelineLayout:
        return self.compiled.layout

    def close(self) -> None:
        """Free the pipeline's threads now (dropping it, or `jaxreshard.shutdown()`, does
        too); a closed pipeline runs no more steps."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

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
        g, _layout = c.graph, c.layout
        m = c.config.num_micro_batches
        placing = Placement()
        params = [placing.put(leaves[i], self._param_shardings[k]) for k, i in enumerate(g.params)]
        pre = pre_values(g, leaves, self._one_device_set)
        _, raw_consts = stage_feeds(g, leaves, pre, m, split=False)
        consts = [
            [placing.put(x, sh) for x, sh in zip(raw_consts[s], self._const_shardings[s])]
            for s in range(len(g.loss.stages))
        ]
        params, consts = placing.done((params, consts))
        batches = self._feeds.split(feed_values(g, leaves, pre))
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


class FeedSplitter:
    """The batch inputs of every stage, per micro-batch: each stage gets each whole feed it
    reads once (moved as a whole, a copy per device where the layouts allow), and one
    executable per stage cuts all its micro-batches out of them on its mesh. (Cutting first
    and placing each piece cost two JAX calls per piece: most of a tiny pipeline's step.)

    Args:
        m: micro-batches per step.
        dims: per feed, the dimension its micro-batches are cut along.
        refs: per stage, the feed of each of its batch inputs, in input order.
        shardings: per stage, the sharding of each of its batch inputs (of a micro-batch's
            piece; the whole feed takes the same).
    """

    def __init__(
        self,
        m: int,
        dims: Sequence[int],
        refs: Sequence[Sequence[int]],
        shardings: Sequence[Sequence[NamedSharding]],
    ):
        self.m, self.dims, self.refs, self.shardings = m, list(dims), refs, shardings
        self._cut = [self._cutter(s) for s in range(len(refs))]

    def _cutter(self, s: int) -> Any:
        if not self.refs[s]:
            return None
        m, dims = self.m, [self.dims[f] for f in self.refs[s]]

        def cut(*wholes: Any) -> list[list[Any]]:
            return [
                [
                    jax.lax.slice_in_dim(
                        x, j * (x.shape[d] // m), (j + 1) * (x.shape[d] // m), 1, d
                    )
                    for x, d in zip(wholes, dims)
                ]
                for j in range(m)
            ]

        out = [list(self.shardings[s]) for _ in range(m)]
        return jax.jit(cut, in_shardings=list(self.shardings[s]), out_shardings=out)

    def split(self, values: Sequence[Any]) -> list[list[list[Any]]]:
        """Per stage, per micro-batch, its batch inputs, from the feeds' whole values."""
        batches: list[list[list[Any]]] = []
        for s, refs in enumerate(self.refs):
            if not refs:
                batches.append([[] for _ in range(self.m)])
                continue
            placing = Placement()
            wholes = placing.done(
                [_whole_on(values[f], sh, placing) for f, sh in zip(refs, self.shardings[s])]
            )
            batches.append(self._cut[s](*wholes))
        return batches


def _whole_on(x: Any, sharding: NamedSharding, placing: Placement) -> Any:
    """`x` on `sharding`, or where the cutting executable can take it: as it is (a host array
    goes in with the call, which places it faster than `jax.device_put`), by a copy per device
    where each holds what it must, else by `placing` (the batched `jax.device_put`)."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, jax.Array):
        if x.sharding == sharding:
            return x
        if len(x.sharding.device_set) == 1 == len(sharding.device_set):
            return copy_shards(x, sharding)
    return placing.put(x, sharding)


class Placement:
    """Values placed on shardings with one `jax.device_put` for all that must move (a call per
    value costs about 150 us on a small CPU box): `put` each, then `done` on the tree of what
    `put` returned."""

    def __init__(self) -> None:
        self._values: list[Any] = []
        self._shardings: list[Any] = []

    def put(self, x: Any, sharding: Any) -> Any:
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x
        self._values.append(x)
        self._shardings.append(sharding)
        return _Pending(len(self._values) - 1)

    def done(self, tree: Any) -> Any:
        if not self._values:
            return tree
        placed = jax.device_put(self._values, self._shardings)
        return jax.tree.map(
            lambda x: placed[x.index] if isinstance(x, _Pending) else x,
            tree,
            is_leaf=lambda x: isinstance(x, _Pending),
        )


@dataclasses.dataclass(frozen=True)
class _Pending:
    index: int


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
