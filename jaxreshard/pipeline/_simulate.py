"""Simulation of a schedule under a cost model: timeline, makespan, bubbles, memory.

[Note: transfer semantics]
With overlap (the default), a transfer starts when its producer finishes and the link (one per
boundary and direction) is free, links serve transfers in the producing stage's order, and the
stages keep computing meanwhile: only the consumer waits for the arrival.
Without overlap, transfers are blocking: after each F/B a stage posts one batch of point-to-point
calls, the sends of that action and the receive the next F/B needs (as Megatron-LM batches
`send_forward_recv_backward`); `W` and `A` run after the batch. A transfer runs once both its
sender and its receiver have posted it, and a stage leaves its batch only when every transfer in
it is done, so both ends are blocked for its duration. A set of stages that all wait in batches
whose peers never post is a deadlock.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxreshard.pipeline._action import APPLY, BACKWARD, FORWARD, WEIGHT, Action
from jaxreshard.pipeline._costs import Costs
from jaxreshard.pipeline._schedule import Schedule, Transfer, transfer_from, transfer_into

SCHEDULE_FORMAT = "jaxreshard-schedule/1"


class ScheduleError(ValueError):
    """A schedule is invalid; the message holds the per-stage grid with the culprits marked."""


@dataclasses.dataclass(frozen=True, slots=True)
class TimedAction:
    action: Action
    start: float
    end: float


@dataclasses.dataclass(frozen=True, slots=True)
class TimedTransfer:
    transfer: Transfer
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Timeline:
    """A simulated (or measured) run of a schedule."""

    schedule: Schedule
    costs: Costs | None
    overlap: bool
    stages: tuple[tuple[TimedAction, ...], ...]
    transfers: tuple[TimedTransfer, ...]

    @property
    def makespan(self) -> float:
        ends = [t.end for stage in self.stages for t in stage]
        ends += [t.end for t in self.transfers]
        starts = [t.start for stage in self.stages for t in stage]
        return max(ends, default=0.0) - min(starts, default=0.0)

    def compute_time(self, stage: int) -> float:
        return sum(t.end - t.start for t in self.stages[stage])

    @property
    def bubble_fraction(self) -> float:
        """Share of stage-time not spent computing: 1 - sum(compute) / (p * makespan)."""
        total = self.makespan * len(self.stages)
        if total <= 0:
            return 0.0
        return 1.0 - sum(self.compute_time(s) for s in range(len(self.stages))) / total

    @property
    def peak_activations(self) -> tuple[int, ...]:
        return peak_activations(self.schedule)

    def to_json(self) -> dict[str, Any]:
        """The `jaxreshard-schedule/1` JSON object (see DESIGN.md, "Formats")."""
        origin = min((t.start for stage in self.stages for t in stage), default=0.0)
        return {
            "format": SCHEDULE_FORMAT,
            "schedule": self.schedule.name,
            "weight_delay": self.schedule.weight_delay,
            "num_stages": self.schedule.num_stages,
            "num_micro_batches": self.schedule.num_micro_batches,
            "costs": self.costs.to_json() if self.costs else None,
            "overlap": self.overlap,
            "makespan": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "peak_activations": list(self.peak_activations),
            "stages": [
                [
                    {
                        "kind": t.action.kind,
                        "mb": None if t.action.kind == APPLY else t.action.microbatch_index,
                        "start": t.start - origin,
                        "end": t.end - origin,
                    }
                    for t in stage
                ]
                for stage in self.stages
            ],
            "transfers": [
                {
                    "kind": t.transfer.kind,
                    "mb": t.transfer.mb,
                    "src": t.transfer.src,
                    "dst": t.transfer.dst,
                    "start": t.start - origin,
                    "end": t.end - origin,
                }
                for t in self.transfers
            ],
        }


def peak_activations(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most micro-batches alive at once: from F until the last backward part."""
    last = WEIGHT if schedule.split_backward else BACKWARD
    peaks = []
    for stage in schedule.actions:
        live = peak = 0
        for a in stage:
            if a.kind == FORWARD:
                live += 1
                peak = max(peak, live)
            elif a.kind == last:
                live -= 1
        peaks.append(peak)
    return tuple(peaks)


def simulate(schedule: Schedule, costs: Costs, *, overlap: bool = True) -> Timeline:
    """Run `schedule` on the cost model; see [Note: transfer semantics].

    Raises:
        ScheduleError: the schedule cannot finish (a dependency cycle, or a deadlock of blocking
            transfers), with the grid and the stuck actions marked.
    """
    if costs.num_stages != schedule.num_stages:
        raise ValueError(
            f"costs are for {costs.num_stages} stages but the schedule has {schedule.num_stages}"
        )
    engine = _simulate_overlapped if overlap else _simulate_blocking
    stages, transfers = engine(schedule, costs)
    return Timeline(schedule, costs, overlap, stages, transfers)


def _simulate_overlapped(schedule: Schedule, costs: Costs):
    p, split = schedule.num_stages, schedule.split_backward
    arrival: dict[Transfer, float] = {}
    link_free: dict[tuple[int, int], float] = {}
    timed: list[list[TimedAction]] = [[] for _ in range(p)]
    transfers: list[TimedTransfer] = []
    position, free = [0] * p, [0.0] * p
    progress = True
    while progress:
        progress = False
        for s in range(p):
            stage = schedule.actions[s]
            while position[s] < len(stage):
                action = stage[position[s]]
                needed = transfer_into(action, p)
                if needed is not None and needed not in arrival:
                    break
                start = max(free[s], arrival[needed]) if needed is not None else free[s]
                end = start + costs.duration(s, action.kind, split)
                timed[s].append(TimedAction(action, start, end))
                free[s] = end
                position[s] += 1
                progress = True
                sent = transfer_from(action, p)
                if sent is not None:
                    link = (sent.src, sent.dst)
                    t0 = max(end, link_free.get(link, 0.0))
                    t1 = t0 + costs.comm[sent.boundary]
                    link_free[link] = t1
                    arrival[sent] = t1
                    transfers.append(TimedTransfer(sent, t0, t1))
    stuck = {}
    for s in range(p):
        if position[s] < len(schedule.actions[s]):
            action = schedule.actions[s][position[s]]
            needed = transfer_into(action, p)
            stuck[action] = f"waits for {needed.label() if needed else '?'}"
    if stuck:
        raise ScheduleError(
            f"{schedule.describe()} cannot finish: its stages wait on each other in a cycle.\n"
            + schedule.grid(stuck)
        )
    return tuple(tuple(t) for t in timed), tuple(transfers)


def _program(schedule: Schedule, s: int) -> list[Any]:
    """Stage s as actions with communication batches between them; a batch is [(transfer, role)].

    A batch holds the sends of one F/B and the receive of the next F/B, and sits right after the
    earlier one: `W` and `A` do not communicate, so they never split a batch (they run after
    it), and a split schedule has exactly the batches of the unsplit one.
    """
    p = schedule.num_stages
    items: list[Any] = []
    previous: Action | None = None  # the last F/B
    insert_at = 0
    for action in schedule.actions[s]:
        if action.kind in (FORWARD, BACKWARD):
            batch = []
            if previous is not None and (sent := transfer_from(previous, p)) is not None:
                batch.append((sent, "send"))
            if (needed := transfer_into(action, p)) is not None:
                batch.append((needed, "recv"))
            items.insert(insert_at, batch)
            items.append(action)
            insert_at = len(items)
            previous = action
        else:
            items.append(action)
    last = [(t, "send")] if previous is not None and (t := transfer_from(previous, p)) else []
    items.insert(insert_at, last)
    return items


_PEER = {"send": "recv", "recv": "send"}


def _next_action(program: list[Any], position: int) -> Action:
    """The action a stage blocked at `position` is about to run (else the one it just ran)."""
    following = [item for item in program[position:] if isinstance(item, Action)]
    return following[0] if following else program[position - 1]


def _simulate_blocking(schedule: Schedule, costs: Costs):
    p, split = schedule.num_stages, schedule.split_backward
    programs = [_program(schedule, s) for s in range(p)]
    posted: dict[tuple[Transfer, str], float] = {}
    done: dict[Transfer, TimedTransfer] = {}
    timed: list[list[TimedAction]] = [[] for _ in range(p)]
    position, now = [0] * p, [0.0] * p
    progress = True
    while progress:
        progress = False
        for s in range(p):
            program = programs[s]
            while position[s] < len(program):
                item = program[position[s]]
                if isinstance(item, Action):
                    end = now[s] + costs.duration(s, item.kind, split)
                    timed[s].append(TimedAction(item, now[s], end))
                    now[s] = end
                    position[s] += 1
                    progress = True
                    continue
                for key in item:
                    posted.setdefault(key, now[s])
                if not all((t, _PEER[role]) in posted for t, role in item):
                    break
                end = now[s]
                for t, _ in item:
                    if t not in done:
                        start = max(posted[(t, "send")], posted[(t, "recv")])
                        done[t] = TimedTransfer(t, start, start + costs.comm[t.boundary])
                    end = max(end, done[t].end)
                now[s] = end
                position[s] += 1
                progress = True
    stuck = {}
    for s in range(p):
        if position[s] < len(programs[s]):
            waiting = [t for t, role in programs[s][position[s]] if (t, _PEER[role]) not in posted]
            stuck[_next_action(programs[s], position[s])] = "blocked on " + ", ".join(
                f"{t.label()} (s{t.dst if t.src == s else t.src} has not posted it)"
                for t in waiting
            )
    if stuck:
        raise ScheduleError(
            f"{schedule.describe()} deadlocks with blocking transfers: every stage below waits "
            "for a peer that waits too.\n" + schedule.grid(stuck)
        )
    order = sorted(done.values(), key=lambda t: (t.start, t.transfer.src, t.transfer.mb))
    return tuple(tuple(t) for t in timed), tuple(order)


def ideal_makespan(num_stages: int, num_micro_batches: int, costs: Costs) -> float:
    """(m + p - 1)(F + B): 1F1B's and GPipe's makespan with uniform costs and free transfers."""
    return (num_micro_batches + num_stages - 1) * (costs.forward[0] + costs.backward[0])
