"""The host engine: one process's part of a pipelined step, the same on every runtime.

[Note: host engine]
A pipeline runs its stages (chunks) in the processes that hold their devices: the local runtime
runs every stage in the calling process, the Ray runtime the stages of each host in that host's
actor, and a stage whose mesh spans several hosts in every one of their actors at once (one
multi-controller SPMD program; see [Note: multi-host stages] in `_pipeline_ray.py`). Whatever
the process, the same `HostEngine` does its part of a step:
1. Compile: a `StageCompiler` per chunk it holds, with the optimizer fused into the last
   backward where it can be (`fusable_segments`), and its post-gradient segments compiled ahead
   (`SegmentExecutables`): nothing compiles inside a step whose peers wait with deadlines.
2. Place the step's inputs: the whole feeds cut into micro-batches on each chunk's mesh by one
   jitted call (`FeedSplitter`; on a mesh of several processes each process builds its own
   shards of each piece from the feed), the constants, a fused optimizer's other inputs.
3. Run its ranks' `StageProgram`s (`RankRunner`): from the calling thread (`dispatch`), or one
   pooled thread per rank where a channel needs it; the channels move boundary tensors.
4. Run the post-gradient segments the driver placed here, in order, on their stage's mesh.
5. Hand back what the step made here (`StepOutputs`): losses, its parameters' gradients, fused
   and placed segments' outputs, aux outputs; the caller describes them (the Ray actor keeps
   them as arrays and returns ids; the local driver takes them as they are).
The driver side of a step, one for both runtimes, is `PipelineDriver` in `_driver.py`.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jc
from jax.sharding import Mesh, NamedSharding

from jaxreshard._jax_compat import named_sharding_on
from jaxreshard.frontend._backward import derive_backward, derive_forward
from jaxreshard.frontend._split import BATCH, CONST, StepGraph
from jaxreshard.pipeline._emit import Instruction
from jaxreshard.runtime._compile import StageCompiler, fusable_segments
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime._executor import (
    APPLY_EVENT,
    Channels,
    Completion,
    Event,
    PipelineError,
    StageProgram,
    dispatch,
    stage_failure,
    wait_for_stages,
)
from jaxreshard.runtime._layout import PipelineLayout
from jaxreshard.runtime._programs import program_variants
from jaxreshard.runtime._segments import SegmentExecutables
from jaxreshard.runtime._specs import place, spec_of, transplant_spec
from jaxreshard.runtime._threads import JOIN_S, DaemonPool
from jaxreshard.runtime._watch import StepWatch


def stage_backward(graph: StepGraph, s: int, config: PipelineConfig) -> Any:
    """Stage s's traced forward and backward (forward only, for a forward-only step)."""
    stage = graph.loss.stages[s]
    if graph.forward_only:
        return derive_forward(stage)
    return derive_backward(stage, split=config.split_backward)


@dataclasses.dataclass
class StepInputs:
    """What a process's part of a step takes, every value on (or for) this process.

    Attributes:
        step_id: the step's id (channels and transports key their messages by it).
        params: the parameters its chunks own, by index, on their owner's mesh as planned.
        feeds: the whole (not yet cut) batch inputs its chunks read, by feed index.
        consts: the per-step constants its chunks read, by constant index.
        apply_inputs: per chunk with a fused optimizer, that segment's inputs other than the
            gradients (placed on the chunk's mesh here).
        segments: post-gradient segments to run here after the stages, in order.
        record: time every action (a profile).
        signal_only: transfers carry no data (see [Note: signal-only bound]).
    """

    step_id: str
    params: dict[int, Any]
    feeds: dict[int, Any]
    consts: dict[int, Any]
    apply_inputs: dict[int, list[Any]] = dataclasses.field(default_factory=dict)
    segments: list[SegmentCall] = dataclasses.field(default_factory=list)
    record: bool = False
    signal_only: bool = False


@dataclasses.dataclass
class SegmentCall:
    """A post-gradient segment to run on this process: each input is ("grad", k) (this
    process's gradient of parameter k), ("out", (j, n)) (output n of segment j, run here before
    it), or ("value", x) (placed on the segment's mesh here)."""

    index: int
    inputs: list[tuple[str, Any]]


@dataclasses.dataclass
class StepOutputs:
    """What a process's part of a step made.

    Attributes:
        losses: per micro-batch, where this process runs the last stage (else None).
        grads: the accumulated gradients of the parameters its chunks own, by index (none for a
            parameter whose optimizer was fused, or whose gradient a segment here overwrote).
        applied: per chunk with a fused optimizer, that segment's outputs.
        segments: the outputs of the segments it ran, by segment index.
        results: the aux / forward outputs its chunks computed, by (result, micro-batch).
        events: the step's timed events (with `record`).
    """

    losses: list[Any] | None
    grads: dict[int, Any]
    applied: dict[int, list[Any]]
    segments: dict[int, list[Any]]
    results: dict[tuple[int, int], Any]
    events: list[Event]


class HostEngine:
    """One process's part of a pipelined step (see [Note: host engine]).

    Args:
        graph: the traced, cut step.
        config: the pipeline's config.
        meshes: the meshes of the chunks (model stages) this process runs, by chunk; a mesh may
            include other processes' devices (a stage that spans hosts).
        compiler: the `StageCompiler` class to compile with (the Ray actor's reports progress).
        where: what this process's errors start with ("host 2: "; nothing locally).
    """

    def __init__(
        self,
        graph: StepGraph,
        config: PipelineConfig,
        meshes: Mapping[int, Mesh],
        *,
        compiler: type[StageCompiler] = StageCompiler,
        where: str = "",
    ):
        self.graph, self.config, self.where = graph, config, where
        self.meshes = dict(meshes)
        self.compilers: dict[int, StageCompiler] = {
            s: compiler(graph, stage_backward(graph, s, config), mesh, config)
            for s, mesh in sorted(self.meshes.items())
        }
        # The optimizer runs inside its stage's last backward where it can (the driver finds
        # the same ones: `fusable_segments` is a function of the step and the stages).
        self.fused = fusable_segments(
            graph, list(self.compilers), config.num_micro_batches, config.fuse_optimizer
        )
        grad_of = {v: k for k, v in enumerate(graph.grad_outputs[1:])}
        for s, j in self.fused.items():
            seg = graph.segments[j]
            self.compilers[s].set_apply(seg.jaxpr, [grad_of.get(v) for v in seg.inputs])
        grad_vars = set(graph.grad_outputs[1:])
        self._apply_avals = {  # a fused segment's inputs other than the gradients
            s: [v.aval for v in graph.segments[j].inputs if v not in grad_vars]
            for s, j in self.fused.items()
        }
        self.segments = SegmentExecutables(graph)
        self.layout: PipelineLayout | None = None
        self.runner: RankRunner | None = None
        self._recorded_ready = False
        # Where this process's steps run asynchronously (the local runtime), their watch.
        self.watch = StepWatch()

    # Setting up ------------------------------------------------------------------------------

    def warm_segments(self, param_specs: Sequence[Any], leaf_specs: Sequence[Any]) -> None:
        """Compile the post-gradient segments of this process's stages (not fused into a
        backward) for the specs their inputs will have at the first step: `param_specs` by
        parameter, `leaf_specs` by argument leaf (None for host data). The local runtime runs
        it in a thread beside the stages' compiles; a Ray host when it takes the layout."""
        fused = set(self.fused.values())
        only = {
            j
            for j, seg in enumerate(self.graph.segments)
            if seg.stage in self.meshes and j not in fused
        }
        self.segments.warm(self.meshes, param_specs, leaf_specs, only)

    def start(self, layout: PipelineLayout, channels_of: Mapping[int, Channels]) -> None:
        """Take the layout: make the ranks' programs over `channels_of` (by chunk) and the feed
        splitter."""
        g, config = self.graph, self.config
        self.layout = layout
        schedule = layout.schedule
        ranks = {
            r: schedule.chunks_of(r)
            for r in range(schedule.num_stages)
            if schedule.chunks_of(r)[0] in self.compilers
        }
        programs = {
            r: StageProgram(
                {c: self.compilers[c] for c in chunks}, g, layout, channels_of[chunks[0]], r
            )
            for r, chunks in ranks.items()
        }
        self.runner = RankRunner(
            programs,
            ranks,
            {c: channels_of[c] for c in self.compilers},
            self.meshes,
            g.owner,
            config.timeout_s,
            self.where,
        )
        shardings = {s: self._input_shardings(s) for s in self.compilers}
        self._batch = {s: [sh for kind, sh, _ in shardings[s] if kind == BATCH] for s in shardings}
        self._const = {
            s: [(i, sh) for kind, sh, i in shardings[s] if kind == CONST] for s in shardings
        }
        self._feeds = FeedSplitter(
            config.num_micro_batches,
            [f.dim for f in g.feeds],
            {s: [r.index for r in g.loss.stages[s].inputs if r.kind == BATCH] for s in shardings},
            self._batch,
        )

    def _input_shardings(self, s: int) -> list[tuple[str, NamedSharding, int]]:
        assert self.layout is not None
        stage = self.graph.loss.stages[s]
        mesh = self.meshes[s]
        return [
            (r.kind, NamedSharding(mesh, sp), r.index)
            for r, sp in zip(stage.inputs, self.layout.input_specs[s])
            if r.kind in (BATCH, CONST)
        ]

    def compile_recorded(self) -> None:
        """Compile what a recorded step (a profile) calls that a plain one does not (the last
        stage's forward and backward apart), before the step's programs start (locally before
        anything of the step; on Ray at the start of the host's step call, so the first
        recorded step's peers may wait for it: a profile's warm-up step, not a timed one)."""
        if self._recorded_ready or self.layout is None or self.runner is None:
            return
        layout = self.layout
        p = layout.num_stages
        split = self.config.split_backward and not self.graph.forward_only
        accumulates = {s for s, c in self.compilers.items() if c.acc_params}
        for r, chunks in self.runner.ranks.items():
            names = program_variants(
                layout.programs[r], chunks, p - 1, split, self.fused, accumulates, recorded=True
            )
            for chunk, variants in names.items():
                self.compilers[chunk].compile_variants(sorted(variants))
        self._recorded_ready = True

    # A step ----------------------------------------------------------------------------------

    def step(
        self,
        inputs: StepInputs,
        *,
        wait: bool = True,
        watch: StepWatch | None = None,
        on_segment: Callable[[str, Any], None] | None = None,
    ) -> StepOutputs:
        """Run this process's part of a step: place its inputs, run its ranks, then the
        segments placed here. With `watch`, return once everything is dispatched and have the
        watch see it finish (see [Note: asynchronous steps]); else with `wait`, return once its
        outputs are computed (or a `PipelineError` after `timeout_s` without any action
        finishing); without either, the caller watches progress (the Ray driver's progress
        deadline). A recorded step waits for every action whatever is asked. `on_segment(what,
        outputs)` hears of each segment dispatched."""
        runner, g = self.runner, self.graph
        if runner is None:
            raise PipelineError(f"{self.where}the engine was closed or never started")
        if inputs.record and not self._recorded_ready:
            self.compile_recorded()
        events: list[Event] = []
        recorder = events.append if inputs.record else None
        m = self.config.num_micro_batches
        losses: list[Any] = [None] * m
        results: dict[tuple[int, int], Any] = {}
        runner.begin(inputs.step_id, record=recorder, signal_only=inputs.signal_only)
        try:
            batches = self._feeds.split(inputs.feeds)
            placing = Placement()
            consts = {
                s: [placing.put(inputs.consts[i], sh) for i, sh in self._const[s]]
                for s in self.compilers
            }
            consts = placing.done(consts)
            apply_inputs = {
                s: [
                    on_mesh(x, self.meshes[s], aval=aval)
                    for x, aval in zip(values, self._apply_avals[s])
                ]
                for s, values in inputs.apply_inputs.items()
            }
        except BaseException as e:
            error = stage_failure(e, f"{self.where}placing the step's inputs")
            runner.fail(error)
            raise error from e
        watched = watch is not None and not inputs.record
        accumulators, applied = runner.run(
            inputs.params, batches, consts, apply_inputs, losses, results,
            wait=wait and not watched,
        )  # fmt: skip
        grads = {
            k: value
            for s, accs in accumulators.items()
            for k, value in accs.items()
            if g.owner[k] == s
        }
        produced = self._run_segments(inputs.segments, grads, recorder, on_segment)
        # A gradient a segment here overwrote (it died there: `dead_gradients`) is gone.
        grads = {k: v for k, v in grads.items() if not _deleted(v)}
        last = self.layout.num_stages - 1 if self.layout is not None else -1
        applied = {s: [as_named(x, self.meshes[s]) for x in xs] for s, xs in applied.items()}
        if watched:
            assert watch is not None
            watch.track(
                inputs.step_id,
                (losses, grads, applied, produced, results),
                runner.last_log,
                self.config.timeout_s,
                runner.fail,
            )
        return StepOutputs(
            losses if last in self.compilers and not g.forward_only else None,
            grads,
            applied,
            produced,
            results,
            events,
        )

    def _run_segments(
        self,
        calls: Sequence[SegmentCall],
        grads: Mapping[int, Any],
        record: Callable[[Event], None] | None,
        on_segment: Callable[[str, Any], None] | None,
    ) -> dict[int, list[Any]]:
        """Post-gradient segments run here, after the ranks' programs, in order."""
        produced: dict[int, list[Any]] = {}
        for call in calls:
            seg = self.graph.segments[call.index]
            mesh = self.meshes[seg.stage]
            values = []
            for (kind, value), var in zip(call.inputs, seg.inputs):
                if kind == "grad":
                    x = grads[value]
                elif kind == "out":
                    j, n = value
                    x = produced[j][n]
                else:
                    x = value
                values.append(on_mesh(x, mesh, aval=var.aval))
            start = time.perf_counter()
            outs = [as_named(x, mesh) for x in self.segments.run(call.index, values)]
            if record is not None:
                jax.block_until_ready(outs)
                record(Event(seg.stage, APPLY_EVENT, -1, start, time.perf_counter(), "apply"))
            if on_segment is not None:
                on_segment(f"post segment {call.index}", outs)
            produced[call.index] = outs
        return produced

    def segment(self, index: int, inputs: Sequence[Any]) -> list[Any]:
        """Run post-gradient segment `index` now, on `inputs` (placed on its mesh here): one
        the driver runs after the step, its inputs gathered from several stages."""
        seg = self.graph.segments[index]
        mesh = self.meshes[seg.stage]
        values = [on_mesh(x, mesh, aval=v.aval) for x, v in zip(inputs, seg.inputs)]
        return [as_named(x, mesh) for x in self.segments.run(index, values)]

    def close(self) -> None:
        """Free the threads, the channels and the executables (idempotent)."""
        self.watch.close()
        if self.runner is not None:
            self.runner.close()
            self.runner = None
        self.compilers = {}
        self.segments = SegmentExecutables(self.graph)
        self.layout = None


# -- running a process's ranks ---------------------------------------------------------------


class RankRunner:
    """Runs the ranks a process holds for one step (see [Note: host engine]).

    `begin` starts a step on the ranks' channels; `run` drives every rank's `StageProgram`, from
    this thread (`dispatch`) or, where a channel needs it (profiles, emulated links, several
    channel objects), one pooled thread per rank, ends the step on the channels, and with
    `wait` waits for the step's outputs under a progress deadline (`Completion`). Errors name
    the rank's stage, after `where` ("host 2: ").

    Args:
        programs: the ranks' programs, by rank.
        ranks: each rank's chunks (model stages), by rank.
        channels_of: the channels of each chunk.
        meshes: each chunk's mesh (a threaded rank runs under its first chunk's).
        owner: the stage that owns each parameter.
        timeout_s: `PipelineConfig.timeout_s`.
        where: what the errors start with.
    """

    def __init__(
        self,
        programs: dict[int, StageProgram],
        ranks: dict[int, Sequence[int]],
        channels_of: Mapping[int, Channels],
        meshes: Mapping[int, Any],
        owner: Sequence[int],
        timeout_s: float,
        where: str = "",
    ):
        self.programs, self.ranks, self.channels_of = programs, ranks, dict(channels_of)
        self.meshes, self.owner, self.timeout_s, self.where = meshes, owner, timeout_s, where
        self.channels = list({id(c): c for c in self.channels_of.values()}.values())
        self._pool: DaemonPool | None = None  # made at the first threaded step
        self._completion = Completion()
        self._record: Callable[[Event], None] | None = None
        self.last_log: list[tuple[str, Any]] = []

    def what(self, r: int) -> str:
        chunks = self.ranks[r]
        rank = f"stage {chunks[0]}" if len(chunks) == 1 else f"rank {r} {list(chunks)}"
        return self.where + rank

    @property
    def threaded(self) -> bool:
        """Whether the ranks run in threads of their own (see [Note: one dispatching thread])."""
        return len(self.ranks) > 1 and (
            len(self.channels) > 1 or any(getattr(c, "threaded", True) for c in self.channels)
        )

    def begin(
        self,
        step_id: str,
        *,
        record: Callable[[Event], None] | None = None,
        signal_only: bool = False,
    ) -> None:
        """Start step `step_id` on the ranks' channels (their receives are posted)."""
        chunks_here = [c for r in self.ranks for c in self.ranks[r]]
        for channels in self.channels:
            stages = [c for c in chunks_here if self.channels_of[c] is channels]
            channels.begin(stages, step_id=step_id, record=record, signal_only=signal_only)
        self._record = record

    def fail(self, error: PipelineError) -> None:
        """Fail the step on every channel (every rank, and the hosts they talk to, stop)."""
        for channels in self.channels:
            channels.fail(error)

    def run(
        self,
        params: Mapping[int, Any],
        batches: Mapping[int, list[list[Any]]],
        consts: Mapping[int, list[Any]],
        apply_inputs: Mapping[int, Sequence[Any]],
        losses: list[Any],
        results: dict[tuple[int, int], Any],
        *,
        wait: bool = True,
    ) -> tuple[dict[int, dict[int, Any]], dict[int, list[Any]]]:
        """Run the step `begin` started: `params` by parameter index (each rank takes its
        chunks'), `batches` / `consts` / `apply_inputs` by chunk. Fills `losses` (by
        micro-batch) and `results` (by (result, micro-batch)); returns the gradient
        accumulators and the fused optimizers' outputs, by chunk. A step that fails raises
        `PipelineError` after failing the channels (so every other rank and host stops too)."""
        record = self._record
        log: list[tuple[str, Any]] = []

        def program(r: int) -> Generator[Instruction, None, Any]:
            chunks = self.ranks[r]
            self.programs[r].record = record
            return self.programs[r].steps(
                {k: v for k, v in params.items() if self.owner[k] in chunks},
                {c: batches[c] for c in chunks if c in batches},
                {c: consts[c] for c in chunks if c in consts},
                losses,
                {c: v for c, v in apply_inputs.items() if c in chunks},
                results,
                log,
            )

        if self.threaded:
            done = self._run_threads(program)
        else:
            done = dispatch({r: program(r) for r in self.ranks}, self.channels[0], self.what)
        for channels in self.channels:
            channels.end()  # a step ends when its sends have: their errors and events belong to it
        accumulators: dict[int, dict[int, Any]] = {}
        applied: dict[int, list[Any]] = {}
        for accs, out in done.values():
            accumulators.update(accs)
            applied.update(out)
        self.last_log = log  # (what the step dispatched, for a watch: `HostEngine.step`)
        if wait and record is None:  # a recorded step has waited for every action already
            try:
                self._completion.wait((losses, accumulators, applied, results), log,
                                      self.timeout_s)  # fmt: skip
            except PipelineError as e:
                self.fail(e)
                raise
        return accumulators, applied

    def _run_threads(self, program: Callable[[int], Any]) -> dict[int, Any]:
        """Each rank's program in a (pooled) thread of its own, blocking in its RECVs."""
        if self._pool is None:  # daemons: see [Note: threads at exit]
            self._pool = DaemonPool(len(self.ranks), "jaxreshard-stage")
        done: dict[int, Any] = {}

        def worker(r: int) -> None:
            runner = program(r)
            channels = self.channels_of[self.ranks[r][0]]
            try:
                with jax.set_mesh(self.meshes[self.ranks[r][0]]):
                    while True:
                        try:
                            waiting = next(runner)
                        except StopIteration as stop:
                            done[r] = stop.value
                            return
                        channels.wait_any([waiting], time.monotonic() + channels.timeout_s)
            except BaseException as e:
                error = stage_failure(e, self.what(r))
                for each in self.channels:
                    each.fail(error)

        futures = [self._pool.submit(worker, r) for r in self.ranks]
        name = self.where.removesuffix(": ") or "local runtime"
        wait_for_stages(futures, self.channels, self.timeout_s, name)
        return done

    def close(self, join_s: float = JOIN_S) -> None:
        """Free the threads and the channels (idempotent), waiting at most about `join_s`
        for each kind of thread to end (see [Note: threads at exit])."""
        for channels in self.channels:
            channels.close()  # (it joins its sender threads)
        if self._pool is not None:
            self._pool.shutdown(join_s)
            self._pool = None
        self._completion.close(join_s)


# -- placing inputs -----------------------------------------------------------------------------


class FeedSplitter:
    """The batch inputs of every chunk, per micro-batch: each chunk gets each whole feed it
    reads once (moved as a whole, a copy per device where the layouts allow), and one
    executable per chunk cuts all its micro-batches out of them on its mesh. (Cutting first
    and placing each piece cost two JAX calls per piece: most of a tiny pipeline's step.) On
    a mesh that spans processes, each process builds its own shards of each piece from the
    feed instead (`place`): cutting a batch sharded over processes would move rows between
    them.

    Args:
        m: micro-batches per step.
        dims: per feed, the dimension its micro-batches are cut along.
        refs: per chunk, the feed of each of its batch inputs, in input order.
        shardings: per chunk, the sharding of each of its batch inputs (of a micro-batch's
            piece; the whole feed takes the same).
    """

    def __init__(
        self,
        m: int,
        dims: Sequence[int],
        refs: Mapping[int, Sequence[int]],
        shardings: Mapping[int, Sequence[NamedSharding]],
    ):
        self.m, self.dims, self.refs, self.shardings = m, list(dims), dict(refs), shardings
        self._cut = {s: self._cutter(s) for s in self.refs}

    def _cutter(self, s: int) -> Any:
        if not self.refs[s] or not all(sh.is_fully_addressable for sh in self.shardings[s]):
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

    def split(self, values: Mapping[int, Any]) -> dict[int, list[list[Any]]]:
        """Per chunk, per micro-batch, its batch inputs, from the feeds' whole values (by feed
        index)."""
        batches: dict[int, list[list[Any]]] = {}
        for s, refs in self.refs.items():
            if not refs:
                batches[s] = [[] for _ in range(self.m)]
                continue
            if self._cut[s] is None:  # a mesh of several processes: each places its shards
                batches[s] = [
                    [
                        place(_rows(values[f], self.m, j, self.dims[f]), sh)
                        for f, sh in zip(refs, self.shardings[s])
                    ]
                    for j in range(self.m)
                ]
                continue
            placing = Placement()
            wholes = placing.done(
                [_whole_on(values[f], sh, placing) for f, sh in zip(refs, self.shardings[s])]
            )
            batches[s] = self._cut[s](*wholes)
        return batches


def _rows(x: Any, m: int, j: int, dim: int) -> np.ndarray:
    """Micro-batch j of a feed (host data), cut along `dim`."""
    x = np.asarray(x)
    rows = x.shape[dim] // m
    return np.take(x, np.arange(j * rows, (j + 1) * rows), axis=dim)


def _whole_on(x: Any, sharding: NamedSharding, placing: Placement) -> Any:
    """`x` on `sharding`, or where the cutting executable can take it: as it is (a host array
    goes in with the call, which places it faster than `jax.device_put`), by a copy per device
    where each holds what it must, else by `placing` (the batched `jax.device_put`)."""
    from jaxreshard._jax_compat import copy_shards

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
    `put` returned. A value for a sharding that spans processes is placed at once (`place`)."""

    def __init__(self) -> None:
        self._values: list[Any] = []
        self._shardings: list[Any] = []

    def put(self, x: Any, sharding: Any) -> Any:
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x
        if not sharding.is_fully_addressable:
            return place(x, sharding)
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


def on_mesh(x: Any, mesh: Mesh, devices: frozenset[Any] | None = None, aval: Any = None) -> Any:
    """`x` on `mesh`'s devices (`devices`, when the caller has them): as it is if it is there
    already, else moved (same spec if it fits, else replicated). Host data becomes an array of
    `aval`'s dtype, when given."""
    if devices is None:
        devices = frozenset(mesh.devices.flat)
    if isinstance(x, jax.Array) and x.sharding.device_set == devices:
        return x
    if not hasattr(x, "shape"):
        if aval is None:
            return x
        x = np.asarray(x, aval.dtype)
    if aval is not None and isinstance(x, np.ndarray) and x.dtype != aval.dtype:
        x = x.astype(aval.dtype)
    spec = transplant_spec(spec_of(getattr(x, "sharding", None)), dict(mesh.shape), x.shape)
    return place(x, NamedSharding(mesh, spec))


def as_named(x: Any, mesh: Mesh) -> Any:
    """`x` with a NamedSharding on `mesh` (the same buffers): XLA hands some outputs back with
    a GSPMD sharding, which has no `PartitionSpec` to plan with, compare or describe."""
    if not isinstance(x, jax.Array) or isinstance(x.sharding, NamedSharding):
        return x
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x
    named = named_sharding_on(x.sharding, mesh, x.ndim)
    if named is None:
        warnings.warn(
            f"an output of shape {x.shape} has a sharding no PartitionSpec of its stage mesh "
            f"{dict(mesh.shape)} expresses ({x.sharding}); it is kept as it is, and may be "
            "moved again at the next step (please report it to jaxreshard)",
            stacklevel=2,
        )
        return x
    shards = [s.data for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, named, shards)


def _deleted(x: Any) -> bool:
    return isinstance(x, jax.Array) and x.is_deleted()


def literal_or(values: Mapping[Any, Any], v: Any) -> Any:
    """A step output: its value, or a literal's."""
    return v.val if isinstance(v, jc.Literal) else values[v]
