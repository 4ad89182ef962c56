"""Choosing stage cuts among `jr.stage_candidate` markers by the simulated step time.

[Note: automatic partitioning]
`PipelineConfig(partition="auto", num_stages=S)`: the step is traced once with every candidate a
boundary, which cuts the loss into segments (between consecutive markers, forced ones included).
For each segment:
- its compute is measured: its forward, the backward to its inputs (B) and to its parameters
  (W), each compiled on one device of stage 0's mesh and timed (best of a few runs, the
  forward's time taken off the two backwards, which recompute it). A stage whose mesh splits
  the batch (`batch_axis`) divides the times by that axis's size;
- for each candidate, the tensors that cross it (made at or before it, used after it) get a
  transfer time from the resharding planner under the cluster model, for each pair of adjacent
  stage meshes it could sit between (stage k's mesh to stage k + 1's, batch-sharded as the
  pipeline lays micro-batches out).
Every choice of S - 1 boundaries (the forced ones plus candidates) is then a `Costs` (each
stage the sum of its segments, each boundary its crossing tensors' time) for the configured
schedule, and `pipeline._simulate` predicts its step; the fastest wins. The choice and every
tried one's prediction are in `train_step.plan(...)`. Choices are enumerated (up to
`MAX_CHOICES`); one mesh per stage (no virtual stages) so far. On Ray the meshes and links are
the hosts' (`stage_placement`, the runtime's cluster model), and the segments are timed on the
driver's first device: like the hosts' on a CPU cluster, not on a GPU one.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jc
from jax.sharding import NamedSharding

from jaxreshard.comm import VirtualSharding, plan_reshard
from jaxreshard.frontend._split import ACT, PARAM, StepGraph
from jaxreshard.pipeline import Costs, build_schedule, simulate
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime.step._specs import batch_spec

MAX_CHOICES = 20_000
TIMING_RUNS = 3


@dataclasses.dataclass(frozen=True)
class SegmentCost:
    """Measured seconds of one segment, per micro-batch."""

    forward: float
    backward: float  # B + W
    weight_grad: float  # W


@dataclasses.dataclass
class PartitionReport:
    """What the partitioner measured and chose (see [Note: automatic partitioning])."""

    markers: list[Any]  # per boundary of the all-candidates trace: "forced" or a candidate
    segments: list[SegmentCost]
    crossing: dict[int, list[float]]  # boundary position -> seconds, per adjacent mesh pair
    tried: list[tuple[tuple[int, ...], float]]  # (candidate cuts, predicted step s), fastest first
    chosen: tuple[int, ...]
    seconds: float  # spent measuring and choosing

    def summary(self) -> str:
        lines = [
            f"automatic partition: {len(self.segments)} segments between "
            f"{len(self.markers)} markers ({sum(m != 'forced' for m in self.markers)} "
            f"candidates); chose candidates {list(self.chosen)} in {self.seconds:.1f} s",
            "  segment   forward    backward   (W)       crossing after it (per mesh pair)",
        ]
        for i, seg in enumerate(self.segments):
            after = ""
            if i < len(self.markers):
                kind = self.markers[i]
                label = "forced" if kind == "forced" else f"candidate {kind}"
                times = ", ".join(f"{t * 1e3:.2f} ms" for t in self.crossing.get(i, []))
                after = f"{label}: {times}"
            lines.append(
                f"  {i:7d} {seg.forward * 1e3:8.2f} ms {seg.backward * 1e3:8.2f} ms "
                f"{seg.weight_grad * 1e3:7.2f} ms  {after}"
            )
        lines.append("  fastest choices (predicted step):")
        for cuts, step in self.tried[:5]:
            lines.append(f"    candidates {list(cuts)}: {step * 1e3:.2f} ms")
        if len(self.tried) > 5:
            slowest = self.tried[-1]
            lines.append(
                f"    ... {len(self.tried) - 5} more; slowest {list(slowest[0])}: "
                f"{slowest[1] * 1e3:.2f} ms"
            )
        return "\n".join(lines)


def choose_cuts(
    graph: StepGraph,
    markers: Sequence[Any],
    config: PipelineConfig,
    meshes: Sequence[Any],
    cluster: Any,
) -> PartitionReport:
    """Choose `config.num_stages - 1` boundaries among `markers` for `graph` (traced with every
    candidate a boundary); see [Note: automatic partitioning]."""
    start = time.perf_counter()
    num_stages = config.num_stages
    assert num_stages is not None
    if config.chunks_per_mesh != 1:
        raise ValueError(
            f"PipelineConfig(partition='auto', schedule={config.schedule!r}): the automatic "
            "partitioner places one stage per mesh so far; use a schedule without virtual "
            "stages, or choose the cuts yourself with cuts=(...)"
        )
    candidates = [m for m in markers if m != "forced"]
    forced = sum(m == "forced" for m in markers)
    if not candidates:
        raise ValueError(
            "PipelineConfig(partition='auto'): the step has no jr.stage_candidate markers; mark "
            "where a stage may end with jr.stage_candidate(h)"
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
    mesh0 = meshes[0]
    split = _batch_split(config, dict(mesh0.shape))
    device = mesh0.devices.flat[0]
    if not isinstance(mesh0, jax.sharding.Mesh):  # Ray hosts' devices: time on this process's
        device = jax.devices()[0]
    segments = [_segment_cost(graph, s, device, split) for s in range(graph.loss.num_stages)]
    crossing = {
        i: [
            _crossing_seconds(graph, i, meshes[k], meshes[k + 1], config, cluster)
            for k in range(num_stages - 1)
        ]
        for i in range(len(markers))
    }
    tried = []
    positions = {m: i for i, m in enumerate(markers) if m != "forced"}
    forced_at = [i for i, m in enumerate(markers) if m == "forced"]
    for cuts in itertools.combinations(candidates, free):
        bounds = sorted(forced_at + [positions[c] for c in cuts])
        tried.append((tuple(cuts), _predict(config, segments, crossing, bounds)))
    tried.sort(key=lambda t: t[1])
    return PartitionReport(
        list(markers), segments, crossing, tried, tried[0][0], time.perf_counter() - start
    )


def _predict(
    config: PipelineConfig,
    segments: Sequence[SegmentCost],
    crossing: dict[int, list[float]],
    bounds: Sequence[int],
) -> float:
    """The simulated step of the stages that `bounds` (boundary positions) make."""
    edges = [-1, *bounds, len(segments) - 1]
    stages = [range(a + 1, b + 1) for a, b in itertools.pairwise(edges)]
    forward = tuple(sum(segments[i].forward for i in r) for r in stages)
    backward = tuple(sum(segments[i].backward for i in r) for r in stages)
    weight = tuple(sum(segments[i].weight_grad for i in r) for r in stages)
    comm = tuple(crossing[b][k] for k, b in enumerate(bounds))
    tiny = 1e-9  # (the simulator wants positive compute)
    costs = Costs(
        forward=tuple(max(f, tiny) for f in forward),
        backward=tuple(max(b, 2 * tiny) for b in backward),
        weight_grad=tuple(min(max(w, 0.0), max(b, 2 * tiny)) for w, b in zip(weight, backward)),
        comm=comm,
        apply=(0.0,) * len(stages),
    )
    schedule = build_schedule(
        config.schedule,
        len(stages),
        config.num_micro_batches,
        weight_delay=config.weight_delay,
        costs=costs,
    )
    return simulate(schedule, costs).makespan


def _batch_split(config: PipelineConfig, mesh_shape: dict[str, int]) -> int:
    return mesh_shape.get(config.batch_axis, 1) if config.batch_axis else 1


def _segment_cost(graph: StepGraph, s: int, device: Any, split: int) -> SegmentCost:
    """Forward, whole backward and weight-gradient seconds of segment `s` (see the Note)."""
    stage = graph.loss.stages[s]
    closed = stage.jaxpr
    fun = jc.jaxpr_as_fun(closed)
    args = [
        jax.device_put(np.zeros(a.shape, a.dtype) if hasattr(a, "shape") else a, device)
        for a in closed.in_avals
    ]
    forward = _best(jax.jit(fun), args)
    if graph.forward_only:
        return SegmentCost(forward / split, 0.0, 0.0)
    inexact = [jax.numpy.issubdtype(a.dtype, jax.numpy.inexact) for a in closed.in_avals]
    acts = [i for i, r in enumerate(stage.inputs) if r.kind == ACT and inexact[i]]
    params = [i for i, r in enumerate(stage.inputs) if r.kind == PARAM and inexact[i]]
    times = []
    for wrt in (acts, params):
        if not wrt:
            times.append(0.0)
            continue
        times.append(max(_best(jax.jit(_vjp_of(fun, wrt, closed)), args) - forward, 0.0))
    b, w = times
    return SegmentCost(forward / split, (b + w) / split, w / split)


def _vjp_of(fun: Any, wrt: Sequence[int], closed: Any) -> Any:
    """The gradient of the sum of `fun`'s inexact outputs with respect to inputs `wrt`."""
    out_inexact = [jax.numpy.issubdtype(a.dtype, jax.numpy.inexact) for a in closed.out_avals]

    def grads(*args: Any) -> Any:
        def part(*chosen: Any) -> Any:
            full = list(args)
            for i, x in zip(wrt, chosen):
                full[i] = x
            outs = fun(*full)
            return sum(jax.numpy.sum(o) for o, f in zip(outs, out_inexact) if f)

        return jax.grad(part, argnums=tuple(range(len(wrt))))(*[args[i] for i in wrt])

    return grads


def _best(compiled: Any, args: Sequence[Any]) -> float:
    jax.block_until_ready(compiled(*args))  # compile and warm
    best = math.inf
    for _ in range(TIMING_RUNS):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        best = min(best, time.perf_counter() - start)
    return best


def _sharding(mesh: Any, spec: Any) -> Any:
    if isinstance(mesh, jax.sharding.Mesh):
        return NamedSharding(mesh, spec)
    return VirtualSharding(mesh, spec)  # a Ray runtime's mesh


def _crossing_seconds(
    graph: StepGraph, position: int, src_mesh: Any, dst_mesh: Any, config: PipelineConfig,
    cluster: Any,
) -> float:  # fmt: skip
    """Seconds to move what crosses boundary `position` (made at or before it, used after it)
    from `src_mesh` to `dst_mesh`: one direction, as `Costs.comm` wants it (the simulator
    charges the same for the gradients' way back)."""
    total = 0.0
    for act in graph.loss.activations:
        if act.home <= position < max(act.consumers):
            shape, dtype = tuple(act.aval.shape), act.aval.dtype
            spec_src = batch_spec(dict(src_mesh.shape), shape, config.batch_axis)
            spec_dst = batch_spec(dict(dst_mesh.shape), shape, config.batch_axis)
            plan = plan_reshard(
                shape,
                dtype,
                _sharding(src_mesh, spec_src),
                _sharding(dst_mesh, spec_dst),
                cluster=cluster,
                strategy=config.resharding,
            )
            total += plan.seconds  # (the simulator charges it again for the gradient back)
    return total
