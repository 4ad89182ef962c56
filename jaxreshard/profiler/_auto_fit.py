"""The calibrated cost model of `jaxreshard profile --auto`: each measured action's time as a
fixed cost plus a cost per micro-batch row, fitted through the calibration points."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from jaxreshard.pipeline import Costs
from jaxreshard.pipeline._costs import SharedCost


@dataclasses.dataclass
class CostModel:
    """Per stage and action kind, seconds = fixed + per_row * micro-batch rows (fitted through
    the two calibration points either side of the rows, or the two nearest outside them: see
    `pair`; with one point, proportional to the rows); the optimizer as the first point
    measured it. The transfers are fitted so too, also those that move no
    micro-batch's rows (the first activation's delay, the shared parameters'): on a shaped
    link they change with what went before them (the 2-host emulated cluster's tied
    embedding gradient: 13.2 ms behind four 4-row micro-batches, 2.9 ms behind eight 2-row
    ones), and the fit predicts each calibration point as measured.

    The points measure one kind of backward (`split`: B and W apart, or one fused backward);
    `other`, where given, is the other kind's costs at the first point, and `at(rows, split)`
    gives that kind's backward from it (see [Note: the other backward]).

    [Note: the other backward]
    One fused backward takes less than its B and W run apart: one program and one dispatch
    instead of two, nothing kept from B for W. `--auto` calibrates a layout with one kind and
    predicts schedules of both; with the split kind's B + W for a fused backward, its unsplit
    schedules came out 3-11% slower than their split ones against what they measured (the
    tiny GPT on the 2-host emulated cluster, 2026-12-01). So the first calibration point runs
    the other kind too, and per stage its difference, B + W less the fused backward (seconds,
    taken as flat in the rows: it is an action's fixed cost more than a cost per row), moves
    the fitted backward to the other kind's; a fused calibration's W is the split run's share
    of its B + W."""

    points: list[tuple[int, Costs]]
    overhead: float | tuple[float, ...]  # (the step's fixed cost: one, or per point)
    split: bool | None = None
    other: Costs | None = None

    @classmethod
    def fit(
        cls,
        measured: list[tuple[int, Costs, float]],
        split: bool | None = None,
        other: Costs | None = None,
    ) -> CostModel:
        overheads = tuple(o for _, _, o in measured)
        return cls([(rows, costs) for rows, costs, _ in measured], overheads, split, other)

    def overhead_at(self, rows: int) -> float:
        """The step's time outside its actions (`step_overhead`) at `rows` rows a micro-batch:
        fitted through the two points `pair` picks, in the micro-batch count (1 / rows: the
        driver splits the batch and dispatches each micro-batch), as `_fit` fits an action
        in its rows. On the 2-host emulated cluster a tiny GPT's mean over 4 and 8
        micro-batches had put one of them 12% above its own calibration's measured step."""
        if isinstance(self.overhead, float | int):
            return float(self.overhead)
        if len(self.overhead) == 1:
            return self.overhead[0]
        i, j = pair([r for r, _ in self.points], rows)  # (fewer rows second: more batches)
        (ri, _), (rj, _) = self.points[i], self.points[j]
        return _fit(1 / rj, self.overhead[j], 1 / ri, self.overhead[i], 1 / rows)

    def at(self, rows: int, split: bool | None = None) -> Costs:
        """The costs at `rows` rows a micro-batch, with the backward of the kind `split` says
        (None: the kind the points measured)."""
        costs = self._at(rows)
        if split is None or self.other is None or self.split is None or split == self.split:
            return costs
        first = self.points[0][1]
        apart, fused = (first, self.other) if self.split else (self.other, first)
        extra = [b - f for b, f in zip(apart.backward, fused.backward)]
        if not split:
            backward = tuple(max(0.0, b - e) for b, e in zip(costs.backward, extra))
            weight = tuple(min(w, b) for w, b in zip(costs.weight_grad, backward))  # (unused)
            return dataclasses.replace(costs, backward=backward, weight_grad=weight)
        backward = tuple(max(0.0, b + e) for b, e in zip(costs.backward, extra))
        share = [w / b if b > 0 else 0.5 for w, b in zip(apart.weight_grad, apart.backward)]
        weight = tuple(b * x for b, x in zip(backward, share))
        return dataclasses.replace(costs, backward=backward, weight_grad=weight)

    def _at(self, rows: int) -> Costs:
        def line(get: Any, flat: bool = False) -> tuple[float, ...]:
            if len(self.points) == 1:  # (what moves no rows stays as measured)
                ((r0, c0),) = self.points
                return tuple(v if flat else v * rows / r0 for v in get(c0))
            i, j = pair([r for r, _ in self.points], rows)
            (r0, c0), (r1, c1) = self.points[i], self.points[j]
            return tuple(_fit(r0, v0, r1, v1, rows) for v0, v1 in zip(get(c0), get(c1)))

        def back(c: Costs) -> tuple[float, ...]:
            return c.comm if c.comm_back is None else c.comm_back

        def shared(c: Costs) -> tuple[float, ...]:
            return tuple(v for x in c.shared for v in (x.seconds, _back(x)))

        forward = line(lambda c: c.forward)
        backward = line(lambda c: c.backward)
        weight = tuple(min(w, b) for w, b in zip(line(lambda c: c.weight_grad), backward))
        # The first micro-batch's extra compute starts buffers the size of the parameters:
        # with one point it stays as measured.
        backward_first = line(lambda c: c.backward_first, flat=True)
        weight_first = tuple(
            min(w, b)
            for w, b in zip(line(lambda c: c.weight_grad_first, flat=True), backward_first)
        )
        comm = line(lambda c: c.comm)
        if len(self.points) == 1:
            first = line(lambda c: c.comm_first, flat=True)
        else:  # the first transfer's whole time on its own line, less the others'
            whole = line(lambda c: tuple(a + b for a, b in zip(c.comm, c.comm_first)))
            first = tuple(w - c for w, c in zip(whole, comm))
        # (a first transfer sooner than the rest never takes less than no time)
        first = tuple(max(f, -c) for f, c in zip(first, comm))
        return Costs(forward=forward, backward=backward, weight_grad=weight,
                     comm=comm, apply=self.points[0][1].apply,
                     host=line(lambda c: c.host, flat=True),
                     comm_back=line(back), comm_first=first,
                     forward_first=line(lambda c: c.forward_first, flat=True),
                     backward_first=backward_first, weight_grad_first=weight_first,
                     shared=self._shared(line, shared))  # fmt: skip

    def _shared(self, line: Any, seconds: Any) -> tuple[SharedCost, ...]:
        """The first point's shared parameters, their copies' and gradients' seconds fitted
        (kept as the first point's where the points disagree on which are shared)."""
        first = self.points[0][1].shared
        if any(len(c.shared) != len(first) for _, c in self.points):
            return first
        fitted = line(seconds, flat=True)
        return tuple(
            dataclasses.replace(x, seconds=fitted[2 * i], back=fitted[2 * i + 1])
            for i, x in enumerate(first)
        )


def pair(points: list[int], rows: int) -> tuple[int, int]:
    """The indices of the two calibration points (by their rows, all different) whose line
    predicts `rows`: the nearest either side of it, else (outside them all) the two nearest.
    A third point where the search extrapolated replaces the extrapolation (`refine` in
    `_auto.py`); between points the line through the nearer pair holds."""
    order = sorted(range(len(points)), key=points.__getitem__)
    for a, b in itertools.pairwise(order):
        if points[a] <= rows <= points[b]:
            return a, b
    return (order[0], order[1]) if rows < points[order[0]] else (order[-2], order[-1])


def calibrated_range(points: list[int], rows: int) -> bool:
    """Whether `rows` lies between the calibration points' fewest and most rows (inclusive):
    a prediction there interpolates, one outside extrapolates."""
    return min(points) <= rows <= max(points)


def _back(x: SharedCost) -> float:
    return x.seconds if x.back is None else x.back


def _fit(r0: float, v0: float, r1: float, v1: float, rows: float) -> float:
    """A time at `rows` from two calibration points (r0 < r1): on the line through them where
    it has a fixed cost and a cost per row that are both >= 0; else (noise: more rows took
    less time, or more than proportionally more) between the points linearly, and outside them
    proportionally to the nearer point's rows (or flat, where more rows took less). Either way
    a calibration point is predicted as measured."""
    slope = (v1 - v0) / (r1 - r0)
    fixed = v0 - slope * r0
    if slope >= 0 and fixed >= 0:
        return fixed + slope * rows
    if r0 <= rows <= r1:
        return v0 + slope * (rows - r0)
    r, v = (r0, v0) if rows < r0 else (r1, v1)
    return v if slope < 0 else v * rows / r
