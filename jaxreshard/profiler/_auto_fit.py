"""The calibrated cost model of `jaxreshard profile --auto`: each measured action's time as a
fixed cost plus a cost per micro-batch row, fitted through the calibration points."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxreshard.pipeline import Costs


@dataclasses.dataclass
class CostModel:
    """Per stage and action kind, seconds = fixed + per_row * micro-batch rows (fitted through
    the calibration points; with one point, proportional to the rows); the optimizer and the
    shared parameters' once-a-step transfers as the first point measured them."""

    points: list[tuple[int, Costs]]
    overhead: float

    @classmethod
    def fit(cls, measured: list[tuple[int, Costs, float]]) -> CostModel:
        overhead = sum(o for _, _, o in measured) / len(measured)
        return cls([(rows, costs) for rows, costs, _ in measured], overhead)

    def at(self, rows: int) -> Costs:
        def line(get: Any) -> tuple[float, ...]:
            if len(self.points) == 1:
                ((r0, c0),) = self.points
                return tuple(v * rows / r0 for v in get(c0))
            (r0, c0), (r1, c1) = sorted(self.points, key=lambda p: p[0])[:2]
            return tuple(_fit(r0, v0, r1, v1, rows) for v0, v1 in zip(get(c0), get(c1)))

        def back(c: Costs) -> tuple[float, ...]:
            return c.comm if c.comm_back is None else c.comm_back

        forward = line(lambda c: c.forward)
        backward = line(lambda c: c.backward)
        weight = tuple(min(w, b) for w, b in zip(line(lambda c: c.weight_grad), backward))
        return Costs(forward=forward, backward=backward, weight_grad=weight,
                     comm=line(lambda c: c.comm), apply=self.points[0][1].apply,
                     host=line(lambda c: c.host),
                     comm_back=line(back), comm_first=self.points[0][1].comm_first,
                     shared=self.points[0][1].shared)  # fmt: skip


def _fit(r0: int, v0: float, r1: int, v1: float, rows: int) -> float:
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
