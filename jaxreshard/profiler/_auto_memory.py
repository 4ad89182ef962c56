"""The memory per device of `--auto`'s candidate configurations (see [Note: configuration
search], step 3): the partitioner's estimate ([Note: stage memory estimate] in
`runtime/step/_memory.py`) of each stage of a calibrated layout, at each calibration point,
fitted linearly in the micro-batch's rows, then walked along each candidate schedule."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxreshard.frontend._graph import PARAM
from jaxreshard.profiler._auto_fit import pair
from jaxreshard.runtime.step._layout import pipeline_schedule
from jaxreshard.runtime.step._memory import (
    SegmentMemory,
    borrowed_bytes,
    crossing_bytes,
    mesh_bytes,
    segment_memory,
    traced_vjp,
)
from jaxreshard.runtime.step._specs import spec_of

Point = tuple[int, list[SegmentMemory], list[int]]  # rows; per stage; per boundary


def memory_point(session: Any) -> Point:
    """The estimate of `session`'s stages at its micro-batch size: each stage's memory on the
    mesh the configured schedule places it on (XLA's scratch left out: the stages compile where
    they run), and each boundary's bytes per micro-batch (its cotangents, kept from B to W)."""
    batch = session._peek_batch()
    graph = session.pstep.plan(session.params, session.opt, batch).graph
    p = session.pc.pipeline
    shapes = p.mesh_shapes(p.num_meshes(graph.num_stages))
    meshes = [dict(zip(p.mesh_axis_names, shape)) for shape in shapes]
    placement = pipeline_schedule(p, graph.num_stages)
    ranks = [placement.rank_of(s) for s in range(graph.num_stages)]
    on = [meshes[r] for r in ranks]
    leaves = jax.tree.leaves((session.params, session.opt, batch))
    specs: list[Any] = [spec_of(getattr(x, "sharding", None)) for x in leaves]
    if len(specs) != len(graph.outer.jaxpr.invars):
        specs = [None] * len(graph.outer.jaxpr.invars)
    stages = []
    for s in range(graph.num_stages):
        exports, residuals = traced_vjp(graph, s, True)  # (one trace of the stage's VJP)
        own = segment_memory(
            graph, s, on[s], specs, p.batch_axis, 0, exports, p.reduce_gradients, residuals
        )
        stages.append(
            dataclasses.replace(own, state=own.state + _borrowed(graph, s, on, ranks, specs))
        )
    boundaries = [
        crossing_bytes(graph, k, on[k], p.batch_axis) for k in range(graph.num_stages - 1)
    ]
    return session.layout.micro_batch_rows, stages, boundaries


def _borrowed(
    graph: Any, s: int, on: list[dict[str, int]], ranks: list[int], specs: list[Any]
) -> int:
    """Bytes per device stage `s` holds of parameters another stage owns (`borrowed_bytes`;
    a copy counted wherever the owner's mesh is another one, as under the configured
    placement, which the candidate schedules keep or change)."""
    total = 0
    avals = graph.outer.in_avals
    for k, owner in enumerate(graph.owner):
        if owner == s or s not in graph.loss.users(PARAM, k):
            continue
        aval = avals[graph.params[k]]
        differentiable = not graph.forward_only and bool(np.issubdtype(aval.dtype, np.inexact))
        same = ranks[owner] == ranks[s]
        total += borrowed_bytes(aval, specs[graph.params[k]], on[s], differentiable, same)
    return total


@dataclasses.dataclass
class LayoutMemory:
    """A layout's stage memory as a function of the micro-batch's rows."""

    points: list[Point]

    def at(self, rows: int) -> tuple[list[SegmentMemory], list[int]]:
        """Each stage's memory and each boundary's bytes at `rows` rows per micro-batch: on
        the line through the calibration points either side of the rows (the two nearest
        outside them: `pair`; the state does not change with the rows), proportional to the
        rows with one point."""
        if len(self.points) == 1:
            ((r0, m0, b0),) = self.points
            scale = rows / r0
            stages = [
                dataclasses.replace(
                    m, residuals=round(m.residuals * scale), pending=round(m.pending * scale)
                )
                for m in m0
            ]
            return stages, [round(b * scale) for b in b0]
        i, j = pair([r for r, _, _ in self.points], rows)
        (r0, m0, b0), (r1, m1, b1) = self.points[i], self.points[j]

        def line(v0: int, v1: int) -> int:
            return max(0, round(v0 + (v1 - v0) * (rows - r0) / (r1 - r0)))

        stages = [
            SegmentMemory(a.state, line(a.residuals, b.residuals), line(a.pending, b.pending), 0)
            for a, b in zip(m0, m1)
        ]
        return stages, [line(x, y) for x, y in zip(b0, b1)]

    def peak(self, schedule: Any, rows: int) -> tuple[int, ...]:
        """Each mesh's estimated bytes per device when `schedule` runs the layout's stages
        (chunks) at `rows` rows per micro-batch."""
        stages, boundaries = self.at(rows)
        n = len(stages)
        mesh_of = [schedule.rank_of(c) for c in range(n)]
        meshes = schedule.num_stages  # (its ranks)
        memory = [[m] * meshes for m in stages]  # (the layout's meshes are all alike)
        cotangents = {k: [b] * meshes for k, b in enumerate(boundaries)}
        need, _ = mesh_bytes(memory, cotangents, list(range(n - 1)), schedule, mesh_of, meshes)
        return need
