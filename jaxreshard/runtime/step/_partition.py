"""Choosing stage cuts among `jr.stage_candidate` markers by the simulated step time.

[Note: automatic partitioning]
`PipelineConfig(partition="auto", num_stages=S)`: the step is traced once with every candidate a
boundary, which cuts the loss into segments (between consecutive markers, forced ones included).
For each segment:
- its compute is measured as the runtime runs it, each part compiled on one device of stage
  0's mesh and timed (best of a few runs): the forward that makes its outputs and the
  residuals; the whole backward, from those residuals and an output cotangent, adding the
  parameter gradients to accumulators; and, of that, what the input gradients alone take (B of
  a split backward; W is the rest). A stage whose mesh splits the batch (`batch_axis`) divides
  the times by that axis's size; on a mesh with a model axis, each part is scaled by XLA's
  flops per device there over one device's, and the collectives XLA adds over the model axes
  are priced by the cluster model ([Note: tensor-parallel stages in the partitioner] in
  `_tensor_parallel.py`). The post-gradient code (the
  optimizer) that the trace places on the segment is timed too, undivided: its part of the
  step's update, once a step, simulated as the chunk's apply after its last backward;
- for each candidate, the tensors that cross it (made at or before it, used after it) get a
  transfer time from the resharding planner under the cluster model, for each pair of adjacent
  chunks it could sit between: chunk k's mesh to chunk k + 1's, where the configured schedule
  places them (with virtual stages, several chunks share a mesh: round robin, or a V), the
  tensors batch-sharded as the pipeline lays micro-batches out;
- each parameter that several segments read (a tied embedding) gets a copy time per pair of
  meshes (`_cut_transfers.py`): where a choice puts its readers in several chunks, the first
  keeps it, and its copies out at the step's start and the gradient contributions back before
  that chunk's optimizer are simulated (`Costs.shared`; a tiny GPT's tied embedding at 0.01
  GB/s was a fifth of its measured step, and left out it made every prediction ~50% short);
- its memory per device on each mesh ([Note: stage memory estimate] in `_memory.py`);
- on each mesh whose batch axis splits the micro-batch, its weight gradients' bytes per
  device, which each choice's chunks sum over that axis ([Note: gradient sums in the
  partitioner] in `_collectives.py`): once a step in the chunk's apply, or in every W.
Every choice of S - 1 boundaries (the forced ones plus candidates) is then a `Costs` (each
chunk the sum of its segments, each boundary its crossing tensors' time) for the configured
schedule, and `pipeline._simulate` predicts its step; each mesh's memory is its chunks' state,
plus their residuals times the micro-batches the schedule keeps alive there, plus scratch. The
fastest choice under the memory cap (`memory_cap_gib`, else the local device's own limit where
JAX reports one) wins; if none fits, the error says what the least needs and what to change.
With `partition_trials=N` (1 by default; where more than one choice fits), the N fastest that
fit are compiled and run on the first call's arguments (`measure_choices` in `_trials.py`),
and each runs one recorded step; each action's cost, a factor on compute plus a fixed cost,
fitted to those steps' actions ([Note: action costs fitted to a recorded step] in
`_refit.py`), predicts every choice again, its fastest is run too if it was not, and the
fastest measured wins (so by default a right prediction costs one trial, and a wrong one two):
the segments are timed alone, and a running pipeline's actions also pay their host's
dispatch, receives and other threads. The choice, every tried one's prediction and
memory, and the trials are in `train_step.plan(...)`. Choices are
enumerated (up to `MAX_CHOICES`). On Ray the meshes and links are the hosts'
(`stage_placement`, the runtime's cluster model), and the segments are timed on the first host
of the first mesh ([Note: segments timed on the hosts] in `runtime/ray/_segments.py`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxreshard.frontend._backward import residual_inputs
from jaxreshard.frontend._split import StepGraph
from jaxreshard.frontend._trace import CACHED_CANDIDATES
from jaxreshard.pipeline import Costs, simulate
from jaxreshard.pipeline._costs import SharedCost
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime.step._collectives import GradientSums, Sums, with_sums
from jaxreshard.runtime.step._cut_transfers import SharedParams, crossing_seconds
from jaxreshard.runtime.step._memory import (
    GIB,
    SegmentMemory,
    chunks_of,
    crossing_bytes,
    device_limit,
    exports_of,
    mesh_bytes,
    micro_batch_rows,
    segment_memory,
    size,
)
from jaxreshard.runtime.step._refit import (  # noqa: F401 (re-exported for the trials and tests)
    COMPUTE_SCALES,
    _schedule,
    _simulated,
    fit_actions,
    fit_compute_scale,
)
from jaxreshard.runtime.step._segment_cost import SegmentCost, segment_cost
from jaxreshard.runtime.step._tensor_parallel import TensorParallel

MAX_CHOICES = 20_000
TRIAL_WARMUP = 2  # steps run before a measured choice (`partition_trials`) is timed
TRIAL_ROUNDS = 5  # rounds that time every measured choice in turn (the median is kept)
TRIAL_BURST = 2  # steps per choice and round, called back to back


class NoCutFits(ValueError):
    """No choice of cuts fits under the memory cap (the message says what the least needs)."""


class Trial(NamedTuple):
    """One of the fastest predicted choices, measured (`partition_trials`)."""

    cuts: tuple[int, ...]
    predicted: float  # seconds
    measured: float  # seconds per step: the median of `TRIAL_ROUNDS` rounds (see `Trial`'s use)


class Choice(NamedTuple):
    """One way to cut the step: its candidate cuts, predicted step and memory per device."""

    cuts: tuple[int, ...]
    step: float  # predicted seconds
    memory: tuple[int, ...]  # estimated peak bytes per device, per mesh
    fits: bool  # under the memory cap (or no cap)
    costs: Costs | None = None  # per chunk, seconds per micro-batch: compute and transfers
    scratch: tuple[int, ...] = ()  # of `memory`, per mesh: XLA scratch (no array shows it)
    sums: Sums | None = None  # per chunk: its gradient sums (simulated with `costs`)


@dataclasses.dataclass
class PartitionReport:
    """What the partitioner measured and chose (see [Note: automatic partitioning])."""

    markers: list[Any]  # per boundary of the all-candidates trace: "forced" or a candidate
    segments: list[SegmentCost]
    crossing: dict[int, list[float]]  # boundary position -> seconds, per adjacent chunk pair
    tried: list[Choice]  # those under the cap fastest first, then those over it
    chosen: tuple[int, ...]
    seconds: float  # spent measuring and choosing
    memory: list[list[SegmentMemory]] = dataclasses.field(default_factory=list)  # [seg][mesh]
    cap: int | None = None  # bytes per device; None: no cap
    trials: list[Trial] = dataclasses.field(default_factory=list)  # `partition_trials` >= 1
    compute_scale: float | None = None  # fitted to the trials (see `_refit.py`)
    action_cost: float | None = None  # seconds each action adds, fitted with it
    step_scale: float | None = None  # the factor on those predicted steps, from the trials
    action_points: int = 0  # (chunk, action kind) medians `fit_actions` fitted; 0: step times
    trials_note: list[str] = dataclasses.field(default_factory=list)  # choices left out
    refitted: list[tuple[tuple[int, ...], float]] = dataclasses.field(default_factory=list)
    # Parameters read by more than one segment: (index, bytes, segments reading it)
    shared: list[tuple[int, int, tuple[int, ...]]] = dataclasses.field(default_factory=list)
    # Gradient bytes per device each segment sums over each mesh's batch axis: [seg][mesh]
    gradient_bytes: list[list[int]] = dataclasses.field(default_factory=list)
    # Per mesh, its tensor-parallel work: the plan's lines and the JSON (see `_tensor_parallel`)
    tensor_parallel: list[str] = dataclasses.field(default_factory=list)
    tensor_parallel_json: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def placement_costs(self, config: PipelineConfig, cuts: Any = None) -> dict[str, Any]:
        """The `PipelineConfig` cost fields that make the runtime place delayed weight
        gradients as the chosen prediction (or that of `cuts`) did (its measured per-chunk
        costs, in ms), when the config splits the backward and leaves those fields at their
        defaults; else none."""
        cuts = self.chosen if cuts is None else tuple(cuts)
        chosen = next(c for c in self.tried if c.cuts == cuts)
        defaults = {f.name: f.default for f in dataclasses.fields(PipelineConfig)}
        names = ("cost_forward", "cost_backward", "cost_weight_grad", "cost_comm")
        if not config.split_backward or chosen.costs is None:
            return {}
        if any(getattr(config, n) != defaults[n] for n in names):
            return {}  # the user's own
        c = with_sums(chosen.costs, chosen.sums)
        ms = [tuple(x * 1e3 for x in v) for v in (c.forward, c.backward, c.weight_grad, c.comm)]
        return dict(zip(names, ms))

    def to_json(self) -> dict[str, Any]:
        """The report as JSON: each segment's measured seconds per micro-batch, each cut's
        transfer seconds, every choice's predicted step and peak bytes per device."""
        return {
            "chosen": list(self.chosen),
            "seconds": self.seconds,
            "markers": [m if m == "forced" else int(m) for m in self.markers],
            "segments": [dataclasses.asdict(s) for s in self.segments],
            "crossing_seconds": {str(k): list(v) for k, v in self.crossing.items()},
            "gradient_bytes_per_device": [list(v) for v in self.gradient_bytes],
            "tensor_parallel": self.tensor_parallel_json,
            "shared_params": [
                {"param": k, "bytes": held, "segments": list(segs)} for k, held, segs in self.shared
            ],
            "memory_cap_bytes": self.cap,
            "tried": [
                {
                    "cuts": list(c.cuts),
                    "predicted_seconds": c.step,
                    "peak_bytes": list(c.memory),
                    "fits": c.fits,
                    **(
                        {
                            "gradient_sum_seconds": {
                                "once": list(c.sums.once),
                                "every_micro_batch": list(c.sums.every),
                            }
                        }
                        if c.sums is not None and any(c.sums.once + c.sums.every)
                        else {}
                    ),
                    **(
                        {
                            "tensor_parallel_seconds": {
                                "forward": list(c.sums.forward),
                                "input_grad": list(c.sums.input_grad),
                                "weight_grad": list(c.sums.weight),
                            }
                        }
                        if c.sums is not None
                        and any(c.sums.forward + c.sums.input_grad + c.sums.weight)
                        else {}
                    ),
                }
                for c in self.tried
            ],
            "compute_scale": self.compute_scale,
            "action_cost_seconds": self.action_cost,
            "action_points": self.action_points,
            "step_scale": self.step_scale,
            "trials_note": list(self.trials_note),
            "refitted": [
                {"cuts": list(cuts), "predicted_seconds": step} for cuts, step in self.refitted
            ],
            "trials": [
                {
                    "cuts": list(t.cuts),
                    "predicted_seconds": t.predicted,
                    "measured_seconds": t.measured,
                }
                for t in self.trials
            ],
        }

    def summary(self) -> str:
        cap = f"memory cap {size(self.cap)} per device" if self.cap else "no memory cap"
        lines = [
            f"automatic partition: {len(self.segments)} segments between "
            f"{len(self.markers)} markers ({sum(m != 'forced' for m in self.markers)} "
            f"candidates); chose candidates {list(self.chosen)} in {self.seconds:.1f} s; {cap}",
            "  segment   forward    backward   (W)       state      residuals/mb  "
            "crossing after it (per chunk pair)",
        ]
        for i, seg in enumerate(self.segments):
            after = ""
            if i < len(self.markers):
                kind = self.markers[i]
                label = "forced" if kind == "forced" else f"candidate {kind}"
                times = ", ".join(f"{t * 1e3:.2f} ms" for t in self.crossing.get(i, []))
                after = f"{label}: {times}"
            mem = self.memory[i][0] if self.memory else SegmentMemory(0, 0, 0, 0)
            lines.append(
                f"  {i:7d} {seg.forward * 1e3:8.2f} ms {seg.backward * 1e3:8.2f} ms "
                f"{seg.weight_grad * 1e3:7.2f} ms  {size(mem.state):>9} {size(mem.residuals):>9}"
                f"     {after}"
            )
        held = [max(v) for v in self.gradient_bytes]
        chosen = next((c for c in self.tried if c.cuts == self.chosen), None)
        if any(held) and chosen is not None and chosen.sums is not None:
            sums = ", ".join(
                f"{c}: {once * 1e3:.2f} ms once a step, {every * 1e3:.2f} ms per micro-batch"
                for c, (once, every) in enumerate(zip(chosen.sums.once, chosen.sums.every))
            )
            lines.append(
                "  gradient bytes per device each segment sums over the batch axis (a parameter "
                "at its first reader; by each reading chunk where a cut separates them): "
                + ", ".join(size(n) for n in held)
                + f"; the chosen chunks' sums: {sums}"
            )
        lines.extend(f"  {line}" for line in self.tensor_parallel)
        if (
            chosen is not None
            and chosen.sums is not None
            and any(chosen.sums.forward + chosen.sums.input_grad + chosen.sums.weight)
        ):
            lines.append(
                "  the chosen chunks' tensor-parallel collectives per micro-batch (F / B / W): "
                + ", ".join(
                    f"{c}: {f * 1e3:.2f} / {b * 1e3:.2f} / {w * 1e3:.2f} ms"
                    for c, (f, b, w) in enumerate(
                        zip(chosen.sums.forward, chosen.sums.input_grad, chosen.sums.weight)
                    )
                )
            )
        for k, held, segs in self.shared:
            lines.append(
                f"  parameter {k} ({size(held)}) is read by segments {list(segs)}: where a cut "
                "separates them, its copy to the later chunks and their gradients back are "
                "charged"
            )
        fitting = [c for c in self.tried if c.fits]
        lines.append("  fastest choices (predicted step, peak memory per device):")
        for c in fitting[:5]:
            lines.append(
                f"    candidates {list(c.cuts)}: {c.step * 1e3:.2f} ms, {size(max(c.memory))}"
            )
        if len(fitting) > 5:
            slowest = fitting[-1]
            lines.append(
                f"    ... {len(fitting) - 5} more; slowest {list(slowest.cuts)}: "
                f"{slowest.step * 1e3:.2f} ms"
            )
        if not self.trials and len(fitting) > 1:
            lines.append(
                "  (predicted only, partition_trials=0: 1, the default, runs the fastest and "
                "refits the prediction to it; N runs the N fastest)"
            )
        if self.trials:
            lines.append(
                f"  measured (side by side, median of {TRIAL_ROUNDS} rounds of {TRIAL_BURST} steps "
                "on the call's arguments; the fastest measured is chosen):"
            )
            for t in self.trials:
                mark = "  <- chosen" if t.cuts == self.chosen else ""
                lines.append(
                    f"    candidates {list(t.cuts)}: {t.measured * 1e3:.2f} ms measured, "
                    f"{t.predicted * 1e3:.2f} ms predicted ({t.measured / t.predicted:.2f}x){mark}"
                )
        lines.extend(f"  ({note})" for note in self.trials_note)
        if self.compute_scale is not None:
            top = ", ".join(f"{list(c)} {t * 1e3:.2f} ms" for c, t in self.refitted[:3])
            measured_best = bool(self.refitted) and any(
                t.cuts == self.refitted[0][0] for t in self.trials
            )
            if self.compute_scale in (COMPUTE_SCALES[0], COMPUTE_SCALES[-1]):
                lines.append(
                    f"  (the compute factor is at the end of the {COMPUTE_SCALES[0]:.2f}-"
                    f"{COMPUTE_SCALES[-1]:.1f} it tries: the steps are not compute's)"
                )
            if self.action_points:
                fitted = (
                    f"each action as compute x {self.compute_scale:.2f} + "
                    f"{(self.action_cost or 0.0) * 1e3:.2f} ms fits the recorded steps' "
                    f"actions best ({self.action_points} medians), and the step x "
                    f"{self.step_scale or 1.0:.2f} the measured ones"
                )
            else:
                fitted = f"compute x {self.compute_scale:.2f} fits the measured steps best"
            lines.append(
                f"  {fitted}; with it the fastest predictions are {top}"
                + (" (the fastest of them is measured too)" if measured_best else "")
            )
        over = [c for c in self.tried if not c.fits]
        if over:
            best = min(over, key=lambda c: c.step)
            lines.append(
                f"  over the memory cap: {len(over)} choices; the fastest of them, candidates "
                f"{list(best.cuts)}, {best.step * 1e3:.2f} ms, needs {size(max(best.memory))}"
            )
        return "\n".join(lines)


def choose_cuts(
    graph: StepGraph,
    markers: Sequence[Any],
    config: PipelineConfig,
    meshes: Sequence[Any],
    cluster: Any,
    specs: Sequence[Any] | None = None,
    timer: Callable[[StepGraph, int], list[tuple[SegmentCost, int]]] | None = None,
    collectives: Any = None,
) -> PartitionReport:
    """Choose `config.num_stages - 1` boundaries among `markers` for `graph` (traced with every
    candidate a boundary) on `meshes` (one per rank); `specs`: each step argument's
    PartitionSpec (None: replicated); `timer`: `(graph, batch split) ->` each segment's cost
    and scratch bytes, measured elsewhere (None: here, on the first mesh's first device, or on
    this process's first device for a Ray runtime's meshes); `collectives`: the cluster model
    of the stages' own collectives (None: `cluster`'s); see [Note: automatic partitioning]."""
    start = time.perf_counter()
    num_stages = config.num_stages
    assert num_stages is not None
    candidates = [m for m in markers if m != "forced"]
    forced = sum(m == "forced" for m in markers)
    if not candidates:
        raise ValueError(
            "PipelineConfig(partition='auto'): the step has no jr.stage_candidate markers; mark "
            "where a stage may end with jr.stage_candidate(h). " + CACHED_CANDIDATES
        )
    if graph.loss.num_stages != len(markers) + 1:
        raise ValueError(
            f"PipelineConfig(partition='auto'): the step's {len(markers)} markers cut its loss "
            f"into {graph.loss.num_stages} segments, not {len(markers) + 1}; a marker inside a "
            "nested function (jax.jit, lax.scan, jax.checkpoint) does not cut it: mark "
            "candidates at the loss's top level"
        )
    free = num_stages - 1 - forced
    if free < 0 or free > len(candidates):
        raise ValueError(
            f"PipelineConfig(partition='auto', num_stages={num_stages}): the step has {forced} "
            f"jr.stage_boundary and {len(candidates)} jr.stage_candidate markers, so it can "
            f"have {forced + 1} to {forced + len(candidates) + 1} stages"
        )
    count = math.comb(len(candidates), free)
    if count > MAX_CHOICES:
        raise ValueError(
            f"PipelineConfig(partition='auto'): {count} ways to choose {free} of "
            f"{len(candidates)} candidates, over the {MAX_CHOICES} the partitioner tries; mark "
            "fewer candidates (e.g. every other layer), or fewer stages"
        )
    probe = _schedule(config, None)  # (where each chunk runs does not depend on costs)
    mesh_of = [probe.rank_of(c) for c in range(num_stages)]
    mesh0 = meshes[0]
    rows = micro_batch_rows(graph)
    splits = [_batch_split(config, dict(mesh.shape), rows) for mesh in meshes]
    split = splits[0]
    device = mesh0.devices.flat[0]
    cap = _cap(config, device if isinstance(mesh0, jax.sharding.Mesh) else None)
    if not isinstance(mesh0, jax.sharding.Mesh):  # Ray hosts' devices: time on this process's
        device = jax.devices()[0]
    if timer is not None:  # (on Ray: on a host; see [Note: segments timed on the hosts])
        timed = timer(graph, split)
    else:
        timed = [segment_cost(graph, s, device, split) for s in range(graph.loss.num_stages)]
    exports = [exports_of(graph, s, config.split_backward) for s in range(graph.loss.num_stages)]
    segments = [cost for cost, _ in timed]
    if specs is None or len(specs) != len(graph.outer.jaxpr.invars):
        specs = [None] * len(graph.outer.jaxpr.invars)
    tensor = TensorParallel(graph, specs, config.batch_axis, meshes, splits, collectives or cluster)
    memory = []
    for s, (_, scratch) in enumerate(timed):
        # (a segment's residuals cost a trace of its VJP: once, whatever the meshes)
        found = [] if graph.forward_only else residual_inputs(graph.loss.stages[s])
        memory.append([
            segment_memory(graph, s, dict(mesh.shape), specs, config.batch_axis, scratch,
                           exports[s], config.reduce_gradients, found)
            for mesh in meshes
        ])  # fmt: skip
    cotangents = {  # the output cotangents a chunk ending at i keeps from its B to its W
        i: [crossing_bytes(graph, i, dict(mesh.shape), config.batch_axis) for mesh in meshes]
        for i in range(len(markers))
    }
    crossing = {
        i: [
            crossing_seconds(graph, i, meshes[a], meshes[b], config, cluster)
            if a != b
            else 0.0  # two chunks on one mesh (a V's turn): nothing moves
            for a, b in itertools.pairwise(mesh_of)
        ]
        for i in range(len(markers))
    }
    shared = SharedParams(graph, specs, config, cluster, meshes, mesh_of)
    sums = GradientSums(graph, specs, config, meshes, mesh_of, collectives or cluster)
    tried = []
    positions = {m: i for i, m in enumerate(markers) if m != "forced"}
    forced_at = [i for i, m in enumerate(markers) if m == "forced"]
    for cuts in itertools.combinations(candidates, free):
        bounds = sorted(forced_at + [positions[c] for c in cuts])
        f, b, w = tensor.costs(bounds, mesh_of)
        summed = sums.costs(bounds)._replace(forward=f, input_grad=b, weight=w)
        step, schedule, costs = _predict(
            config, segments, crossing, bounds, shared.costs(bounds), summed, tensor, mesh_of
        )
        need, scratch = mesh_bytes(memory, cotangents, bounds, schedule, mesh_of, len(meshes))
        fits = cap is None or max(need) <= cap
        tried.append(Choice(tuple(cuts), step, need, fits, costs, scratch, summed))
    tried.sort(key=lambda c: (not c.fits, c.step))
    if not tried[0].fits:
        raise NoCutFits(_over_cap_message(config, tried, cap, memory, mesh_of))
    report = PartitionReport(
        list(markers), segments, crossing, tried, tried[0].cuts, time.perf_counter() - start,
        memory, cap,
    )  # fmt: skip
    report.shared = shared.listed()
    report.gradient_bytes = sums.bytes_per_device()
    report.tensor_parallel = tensor.summary()
    report.tensor_parallel_json = tensor.to_json()
    return report


def _cap(config: PipelineConfig, device: Any) -> int | None:
    """Bytes per device the stages must fit in: `memory_cap_gib`, else the device's own
    limit where JAX reports one, else none."""
    if config.memory_cap_gib is not None:
        return int(config.memory_cap_gib * GIB)
    return device_limit(device) if device is not None else None


def _over_cap_message(
    config: PipelineConfig,
    tried: Sequence[Choice],
    cap: int | None,
    memory: Sequence[Sequence[SegmentMemory]],
    mesh_of: Sequence[int],
) -> str:
    least = min(tried, key=lambda c: max(c.memory))
    mesh = int(np.argmax(least.memory))
    state = sum(memory[s][mesh].state for s in range(len(memory)))
    where = "memory_cap_gib" if config.memory_cap_gib is not None else "the device's limit"
    assert cap is not None
    return (
        f"PipelineConfig(partition='auto', num_stages={config.num_stages}): no choice of cuts "
        f"fits in {size(cap)} per device ({where}): the least needs {size(max(least.memory))} on "
        f"mesh {mesh} (candidates {list(least.cuts)}; estimated as [Note: stage memory "
        f"estimate] says; the whole model's state alone is {size(state)} per device of such a "
        "mesh). Use more stages (num_stages), more micro-batches (each keeps less), a schedule "
        "that keeps fewer micro-batches alive (1f1b), bigger stage meshes that shard the batch "
        "or the parameters, or raise memory_cap_gib"
    )


def _predict(
    config: PipelineConfig,
    segments: Sequence[SegmentCost],
    crossing: dict[int, list[float]],
    bounds: Sequence[int],
    shared: tuple[SharedCost, ...] = (),
    sums: Sums | None = None,
    tensor: TensorParallel | None = None,
    mesh_of: Sequence[int] = (),
) -> tuple[float, Any, Costs]:
    """The simulated step of the chunks that `bounds` (boundary positions) make, their
    schedule, and their costs of compute and transfers (`shared`: their parameters read by
    several chunks); built and simulated with their own collectives `sums` added (see [Note:
    gradient sums in the partitioner]); `tensor`: each segment's compute per device on each
    mesh (`mesh_of`: each chunk's), where not the timed one's (see [Note: tensor-parallel
    stages in the partitioner])."""
    stages = chunks_of(bounds, len(segments))
    if tensor is not None:
        parts = [[tensor.compute(segments, i, mesh_of[c]) for i in r] for c, r in enumerate(stages)]
    else:
        parts = [[(segments[i].forward, segments[i].backward, segments[i].weight_grad)
                  for i in r] for r in stages]  # fmt: skip
    forward = tuple(sum(p[0] for p in chunk) for chunk in parts)
    backward = tuple(sum(p[1] for p in chunk) for chunk in parts)
    weight = tuple(sum(p[2] for p in chunk) for chunk in parts)
    apply = tuple(sum(segments[i].apply for i in r) for r in stages)
    comm = tuple(crossing[b][k] for k, b in enumerate(bounds))
    tiny = 1e-9  # (the simulator wants positive compute)
    costs = Costs(
        forward=tuple(max(f, tiny) for f in forward),
        backward=tuple(max(b, 2 * tiny) for b in backward),
        weight_grad=tuple(min(max(w, 0.0), max(b, 2 * tiny)) for w, b in zip(weight, backward)),
        comm=comm,
        apply=apply,
        shared=shared,
    )
    summed = with_sums(costs, sums)
    schedule = _schedule(config, summed)
    return simulate(schedule.with_apply(), summed).makespan, schedule, costs


def _batch_split(config: PipelineConfig, mesh_shape: dict[str, int], rows: int) -> int:
    """The ways the batch axis splits a micro-batch of `rows` rows (1 where it does not divide
    them: every device then computes the whole micro-batch)."""
    size = mesh_shape.get(config.batch_axis, 1) if config.batch_axis else 1
    return size if rows and rows % size == 0 else 1
