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
memory, and the trials are in `train_step.plan(...)`. Choices are all predicted while there
are at most `MAX_CHOICES`; past that, a shortlist by dynamic programming and local moves are
([Note: cut search] in `_cut_search.py`). On Ray the meshes and links are the hosts'
(`stage_placement`, the runtime's cluster model), and the segments are timed on the first host
of the first mesh ([Note: segments timed on the hosts] in `runtime/ray/_segments.py`).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxreshard.frontend._split import StepGraph
from jaxreshard.frontend._trace import CACHED_CANDIDATES
from jaxreshard.pipeline import Costs, simulate
from jaxreshard.pipeline._costs import SharedCost
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime.step._collectives import GradientSums, Sums, with_sums
from jaxreshard.runtime.step._cut_search import STARTS, improve, shortlist
from jaxreshard.runtime.step._cut_transfers import SharedParams, crossing_seconds
from jaxreshard.runtime.step._memory import (
    GIB,
    SegmentMemory,
    chunks_of,
    crossing_bytes,
    device_limit,
    mesh_bytes,
    micro_batch_rows,
    segment_memory,
    size,
    traced_vjp,
)
from jaxreshard.runtime.step._partition_report import (  # noqa: F401 (re-exported)
    MAX_CHOICES,
    TRIAL_BURST,
    TRIAL_ROUNDS,
    TRIAL_WARMUP,
    Choice,
    NoCutFits,
    PartitionReport,
    Trial,
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
            "candidates at the loss's top level (a scanned stack of layers: jr.scan)"
        )
    free = num_stages - 1 - forced
    if free < 0 or free > len(candidates):
        raise ValueError(
            f"PipelineConfig(partition='auto', num_stages={num_stages}): the step has {forced} "
            f"jr.stage_boundary and {len(candidates)} jr.stage_candidate markers, so it can "
            f"have {forced + 1} to {forced + len(candidates) + 1} stages"
        )
    count = math.comb(len(candidates), free)
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
    # (a segment's exports and residuals cost a trace of its VJP: once, whatever the meshes)
    traced = [traced_vjp(graph, s, config.split_backward) for s in range(graph.loss.num_stages)]
    segments = [cost for cost, _ in timed]
    if specs is None or len(specs) != len(graph.outer.jaxpr.invars):
        specs = [None] * len(graph.outer.jaxpr.invars)
    tensor = TensorParallel(graph, specs, config.batch_axis, meshes, splits, collectives or cluster)
    memory = []
    for s, (_, scratch) in enumerate(timed):
        exports, found = traced[s]
        memory.append([
            segment_memory(graph, s, dict(mesh.shape), specs, config.batch_axis, scratch,
                           exports, config.reduce_gradients, found)
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
    positions = {m: i for i, m in enumerate(markers) if m != "forced"}
    forced_at = [i for i, m in enumerate(markers) if m == "forced"]
    predicted: dict[tuple[int, ...], Choice] = {}

    def predict(bounds: tuple[int, ...]) -> Choice:
        """The choice whose boundaries sit at `bounds` (positions), predicted once."""
        if bounds not in predicted:
            f, b, w = tensor.costs(bounds, mesh_of)
            summed = sums.costs(bounds)._replace(forward=f, input_grad=b, weight=w)
            step, schedule, costs = _predict(
                config, segments, crossing, bounds, shared.costs(bounds), summed, tensor, mesh_of
            )
            need, scratch = mesh_bytes(memory, cotangents, bounds, schedule, mesh_of, len(meshes))
            need = tuple(n + c for n, c in zip(need, shared.copy_bytes(bounds)))
            fits = cap is None or max(need) <= cap
            cuts = tuple(markers[i] for i in bounds if markers[i] != "forced")
            predicted[bounds] = Choice(cuts, step, need, fits, costs, scratch, summed)
        return predicted[bounds]

    def rank(choice: Choice) -> tuple[bool, float]:
        return (not choice.fits, choice.step)

    if count <= MAX_CHOICES:
        for cuts in itertools.combinations(candidates, free):
            predict(tuple(sorted(forced_at + [positions[c] for c in cuts])))
    else:  # (too many to predict one by one: see [Note: cut search])
        work = [
            [sum(tensor.compute(segments, i, m)[:2]) for i in range(len(segments))]
            for m in range(len(meshes))
        ]
        short = shortlist(work, crossing, list(positions.values()), forced_at, mesh_of,
                          config.num_micro_batches)  # fmt: skip
        for bounds in short:
            predict(bounds)
        starts = sorted(predicted, key=lambda b: rank(predicted[b]))[:STARTS]
        improve(starts, list(positions.values()), predict, rank)
    tried = sorted(predicted.values(), key=rank)
    if not tried[0].fits:
        raise NoCutFits(_over_cap_message(config, tried, cap, memory, mesh_of, count))
    report = PartitionReport(
        list(markers), segments, crossing, tried, tried[0].cuts, time.perf_counter() - start,
        memory, cap,
    )  # fmt: skip
    report.ways, report.limit = count, MAX_CHOICES
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
    ways: int = 0,
) -> str:
    least = min(tried, key=lambda c: max(c.memory))
    mesh = int(np.argmax(least.memory))
    state = sum(memory[s][mesh].state for s in range(len(memory)))
    where = "memory_cap_gib" if config.memory_cap_gib is not None else "the device's limit"
    assert cap is not None
    searched = f"of the {len(tried):,} its search predicted (of {ways:,}) " * (ways > MAX_CHOICES)
    return (
        f"PipelineConfig(partition='auto', num_stages={config.num_stages}): no choice of cuts "
        f"{searched}fits in {size(cap)} per device ({where}): the least needs "
        f"{size(max(least.memory))} on mesh {mesh} (candidates {list(least.cuts)}; estimated "
        "as [Note: stage memory estimate] says; the whole model's state alone is "
        f"{size(state)} per device of such a mesh). Use more stages (num_stages), more "
        "micro-batches (each keeps less), a schedule that keeps fewer micro-batches alive "
        "(1f1b), bigger stage meshes that shard the batch or the parameters, or raise "
        "memory_cap_gib"
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
