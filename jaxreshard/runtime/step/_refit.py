"""Refitting `partition="auto"`'s predictions to measured trials (see [Note: automatic
partitioning] in `_partition.py`).

[Note: action costs fitted to a recorded step]
The segments are timed alone, on an idle device. In a running pipeline each action also pays a
fixed cost on its host (the interpreter's dispatch, its receives and the host's other threads),
and its compute runs slower beside them. So after the trials, each measured choice runs one
recorded step, and its actions' durations (median per chunk and kind: F, B, W, the
optimizer's A; a recorded step fuses none) are fitted, least squares weighted by how many
there are, as

    measured = k * predicted + c

with `k` the factor on compute and `c` each action's fixed cost. Every choice is then simulated
again with each action lasting `k * its compute + c` (`calibrated`), and the step times so
predicted are scaled by one factor `s`, the median of the trials' measured steps over their
predictions: a recorded step's actions leave out what a plain step does around them (the
call, the batch's way to the hosts, sends on a busy core). A step's time alone cannot tell a
factor on compute from a fixed cost per action; the actions can, and they set how a cut's
imbalance weighs against its transfers and action count, which is where the choices differ.
Measured on 2 emulated hosts against every hand cut (docs/partitioning.md, "Action costs"):
the median error was 11.5% (untuned GPT, 8 micro-batches) and 9.9% (U-Transformer `tiny`),
where one factor on compute fitted to the step times gave 15.2% and 10.6%, and the actions
alone (s = 1) 4.4% and 30.8%; both refits with `s` put the best hand cut first. Where no
recorded step gives a fit (it failed, or its actions show one predicted time only), the factor
alone is fitted to the trials' step times (`fit_compute_scale`).
A choice's gradient sums ([Note: gradient sums in the partitioner] in `_collectives.py`) and
tensor-parallel collectives ([Note: tensor-parallel stages in the partitioner]) are the links'
time, not compute: an action is fitted less the predicted seconds of the collectives in it (a
W, or an unsplit B, its gradient sum every micro-batch), a sum once a step is a `reduce`
event apart from the apply (and pays its own `c`), and both are added to the simulated step
unscaled.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxreshard.pipeline import Costs, build_schedule, simulate
from jaxreshard.pipeline._costs import FIRST
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime.step._collectives import Sums, with_sums

# The factors on every choice's compute that `fit_compute_scale` tries: 1/4 to 8, 5% apart.
COMPUTE_SCALES = tuple(0.25 * 1.05**i for i in range(72))
_ACTION_KINDS = ("F", "B", "W", "A")


def _schedule(config: PipelineConfig, costs: Costs | None) -> Any:
    """The schedule a pipeline of these costs runs: built as the runtime builds it, from the
    per-chunk costs without shared parameters (`placement_costs` does not carry them)."""
    assert config.num_stages is not None
    return build_schedule(
        config.schedule,
        config.num_meshes(config.num_stages),
        config.num_micro_batches,
        virtual_stages=config.chunks_per_mesh,
        weight_delay=config.weight_delay,
        costs=None if costs is None else dataclasses.replace(costs, shared=()),
    )


def calibrated(costs: Costs, k: float, c: float = 0.0, split: bool = False) -> Costs:
    """`costs` with every action lasting `k` times its compute plus `c` (transfers as they
    are): a forward, each part of the backward (B and W apart when `split`), and an optimizer
    segment where the chunk has one."""
    return dataclasses.replace(
        costs,
        forward=tuple(k * f + c for f in costs.forward),
        backward=tuple(k * b + (2 * c if split else c) for b in costs.backward),
        weight_grad=tuple(k * w + (c if split else 0.0) for w in costs.weight_grad),
        apply=tuple(k * a + c if a > 0 else 0.0 for a in costs.apply),
        **{name: tuple(k * x for x in getattr(costs, name)) for name in FIRST},
    )


def _simulated(
    config: PipelineConfig, costs: Costs, k: float = 1.0, c: float = 0.0, sums: Sums | None = None
) -> float:
    """The step of the schedule `costs` and their gradient sums place (as the runtime is given
    them: unscaled), simulated with each action `k` times its compute plus `c`, the sums as
    they are (links, not compute: see [Note: gradient sums in the partitioner])."""
    schedule = _schedule(config, with_sums(costs, sums))
    scaled = calibrated(costs, k, c, schedule.split_backward)
    if sums is not None and c:  # (a sum once a step is a `reduce` call of its own)
        called = tuple(a + c if t > 0 else a for a, t in zip(scaled.apply, sums.once))
        scaled = dataclasses.replace(scaled, apply=called)
    return simulate(schedule.with_apply(), with_sums(scaled, sums)).makespan


def _refit(report: Any, config: PipelineConfig, k: float, c: float, step: float = 1.0) -> None:
    report.compute_scale, report.action_cost, report.step_scale = k, c, step
    report.refitted = sorted(
        ((ch.cuts, step * _simulated(config, ch.costs, k, c, ch.sums)) for ch in report.tried
         if ch.fits and ch.costs is not None),
        key=lambda item: item[1],
    )  # fmt: skip


def action_points(
    costs: Costs, split: bool, events: Sequence[Any], sums: Sums | None = None
) -> list[tuple[float, float, int]]:
    """(predicted compute, measured median, count) per chunk and action kind of a recorded
    step's `events`; the measured backward part that holds a per-micro-batch gradient sum (W,
    or B unsplit) less that sum's predicted seconds (the `reduce` of a sum once a step is an
    event of its own, not an apply)."""
    by: dict[tuple[int, str], list[float]] = {}
    for e in events:
        if e.kind in _ACTION_KINDS and (e.kind != "A" or e.name == "apply"):
            by.setdefault((e.stage, e.kind), []).append(e.end - e.start)
    points = []
    for (s, kind), times in sorted(by.items()):
        if not 0 <= s < costs.num_stages:
            continue
        f, b, w, a = costs.forward[s], costs.backward[s], costs.weight_grad[s], costs.apply[s]
        predicted = {"F": f, "B": b - (w if split else 0.0), "W": w, "A": a}[kind]
        summed = 0.0
        if sums is not None:  # (the collectives priced in this action: links, not compute)
            w = sums.in_weight_grad(s)
            summed = {"F": sums.in_forward(s), "B": sums.in_input_grad(s) + (0.0 if split else w),
                      "W": w, "A": 0.0}[kind]  # fmt: skip
        measured = statistics.median(times) - summed
        if predicted > 0 and measured > 0:  # (a sum priced over what was measured: no point)
            points.append((predicted, measured, len(times)))
    return points


def fit_actions(report: Any, config: PipelineConfig, recorded: Mapping[Any, Sequence[Any]]) -> bool:
    """Fit each action's cost, `k` x compute + `c` (see [Note: action costs fitted to a
    recorded step]), to the recorded steps' events of the measured choices (`recorded`: cuts
    -> events), and the step's level `s` to the trials' measured steps; predict every choice
    under the cap again with them (`report.compute_scale`, `report.action_cost`,
    `report.step_scale`, `report.action_points`: the medians fitted, `report.refitted`).
    False, changing nothing, where the events show fewer than two different predicted
    times."""
    by_cuts = {ch.cuts: ch for ch in report.tried if ch.costs is not None}
    points = []
    for cuts, events in recorded.items():
        if cuts in by_cuts:
            ch = by_cuts[cuts]
            split = _schedule(config, with_sums(ch.costs, ch.sums)).split_backward
            points += action_points(ch.costs, split, events, ch.sums)
    if len({round(p, 9) for p, _, _ in points}) < 2:
        return False
    predicted, measured, counts = (np.array(x, dtype=float) for x in zip(*points))
    weights = np.sqrt(counts)
    design = np.stack([predicted, np.ones_like(predicted)], axis=1) * weights[:, None]
    k, c = np.linalg.lstsq(design, measured * weights, rcond=None)[0]
    if c < 0:  # (no negative fixed cost: the factor alone)
        k, c = float(np.sum(counts * predicted * measured) / np.sum(counts * predicted**2)), 0.0
    k, c = min(max(float(k), COMPUTE_SCALES[0]), COMPUTE_SCALES[-1]), float(c)
    # The step's level: the trials' measured steps over their predictions with these costs.
    ratios = [
        t.measured / _simulated(config, by_cuts[t.cuts].costs, k, c, by_cuts[t.cuts].sums)
        for t in report.trials
        if t.cuts in by_cuts and t.measured > 0
    ]
    report.action_points = len(points)
    _refit(report, config, k, c, statistics.median(ratios) if ratios else 1.0)
    return True


def fit_compute_scale(report: Any, config: PipelineConfig) -> None:
    """Fit one factor on the compute of every choice to the measured trials' step times
    (least squares of the log error, over `COMPUTE_SCALES`), and predict every choice under
    the cap again with it (`report.compute_scale`, `report.refitted`, fastest first): where
    no recorded step gives `fit_actions` its points. Transfers are the planner's, under the
    cluster's measured or shaped links; a factor on compute changes how a cut's imbalance
    weighs against its transfers, which is where the choices differ."""
    by_cuts = {ch.cuts: ch for ch in report.tried if ch.costs is not None}
    trials = [t for t in report.trials if t.cuts in by_cuts and t.measured > 0]
    if not trials:
        return
    # (each choice's schedule is the one its pipeline runs: placed by the unscaled costs)
    schedules = {
        t.cuts: _schedule(
            config, with_sums(by_cuts[t.cuts].costs, by_cuts[t.cuts].sums)
        ).with_apply()
        for t in trials
    }

    def step(t: Any, k: float) -> float:
        ch = by_cuts[t.cuts]
        return simulate(schedules[t.cuts], with_sums(calibrated(ch.costs, k), ch.sums)).makespan

    def error(k: float) -> float:
        return sum(math.log(step(t, k) / t.measured) ** 2 for t in trials)

    _refit(report, config, min(COMPUTE_SCALES, key=error), 0.0)
    report.action_points, report.action_cost, report.step_scale = 0, None, None
