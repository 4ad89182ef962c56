"""The host engine: one process's part of a pipelined step, the same on every runtime.

[Note: host engine]
A pipeline runs its stages (chunks) in the processes that hold their devices: the local runtime
runs every stage in the calling process, the Ray runtime the stages of each host in that host's
actor, and a stage whose mesh spans several hosts in every one of their actors at once (one
multi-controller SPMD program; see [Note: multi-host stages] in `ray/_pipeline.py`). Whatever
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
The driver side of a step, one for both runtimes, is `PipelineDriver` in `driver/_driver.py`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jax.sharding import Mesh, NamedSharding

from jaxreshard.frontend._backward import derive_backward, derive_forward
from jaxreshard.frontend._jaxprs import is_var
from jaxreshard.frontend._split import BATCH, CONST, PARAM, StepGraph
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime.engine._channels import Channels
from jaxreshard.runtime.engine._dispatch import stage_failure
from jaxreshard.runtime.engine._events import Event, PipelineError, SegmentClock
from jaxreshard.runtime.engine._placing import FeedSplitter, Placement, _deleted, as_named, on_mesh
from jaxreshard.runtime.engine._program import StageProgram
from jaxreshard.runtime.engine._ranks import RankRunner
from jaxreshard.runtime.engine._watch import StepWatch
from jaxreshard.runtime.step._around import donated_arguments
from jaxreshard.runtime.step._compile import StageCompiler
from jaxreshard.runtime.step._fusion import fusable_segments
from jaxreshard.runtime.step._layout import PipelineLayout
from jaxreshard.runtime.step._programs import program_variants
from jaxreshard.runtime.step._segments import SegmentExecutables


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
        self.fused = fusable_segments(graph, list(self.compilers), config)
        grad_of = {v: k for k, v in enumerate(graph.grad_outputs[1:])}
        grad_vars = set(graph.grad_outputs[1:])
        given = donated_arguments(graph)
        for s, j in self.fused.items():
            seg = graph.segments[j]
            extra = [v for v in seg.inputs if v not in grad_vars]
            invars = graph.outer.jaxpr.invars
            # What the stage's forward reads too (a parameter, a per-step constant), by its
            # position among the stage's inputs.
            params = {}
            for i, r in enumerate(graph.loss.stages[s].inputs):
                if r.kind == PARAM:
                    params[invars[graph.params[r.index]]] = i
                elif r.kind == CONST and is_var(graph.consts[r.index]):
                    params[graph.consts[r.index]] = i
            self.compilers[s].set_apply(
                seg.jaxpr,
                [grad_of.get(v) for v in seg.inputs],
                given=[given.get(v) == j and seg.inputs.count(v) == 1 for v in extra],
                read=[params.get(v) for v in extra],
            )
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
        # The step's log of action outputs: the watch's until the step is done, if there is
        # one; else nobody's (a Ray host's step is watched by its answer, not by the log).
        log, runner.last_log = runner.last_log, []
        if watched:
            assert watch is not None
            watch.track(
                inputs.step_id,
                (losses, grads, applied, produced, results),
                log,
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
        """Post-gradient segments run here, after the ranks' programs, in order (a recorded
        step times them as a plain one runs them: see [Note: recorded segments])."""
        produced: dict[int, list[Any]] = {}
        clock = SegmentClock(self.config.timeout_s, self.where) if record is not None else None
        try:
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
                if clock is not None:
                    after = [value[0] for kind, value in call.inputs if kind == "out"]
                    lane = frozenset(d.id for d in mesh.devices.flat)
                    clock.started(call.index, seg.stage, lane, start, outs, after)
                if on_segment is not None:
                    on_segment(f"post segment {call.index}", outs)
                produced[call.index] = outs
        except BaseException:
            if clock is not None:
                clock.stop()  # (no clock goes on polling after the step failed)
            raise
        if clock is not None and record is not None:
            for event in clock.events():
                record(event)
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
