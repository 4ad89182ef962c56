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
A rank stays busy `Costs.host` seconds after each F, B or W of a chunk (the host posting its
sends and dispatching the next action; a fused run pays its actions' at its end), while that
action's outputs are already on their way.
A parameter that chunk o keeps and chunk u also reads (`Costs.shared`) is sent at the start, on
the link from o to u before anything else on it, and u's first action waits for it; u's
gradient contribution goes back after the last action of u's rank, and o's apply waits for it
(overlap only).
With virtual stages (see [Note: chunks and ranks] in `_schedule.py`) "stage" above means rank,
a link serves one chunk boundary and direction, and a transfer between two chunks of one rank is
local: it arrives when its producer ends, takes no time, and is in no batch.

[Note: fused actions]
A fused run of actions (`Schedule.fused`: DualPipeV's forward/backward pair, or an imported
whole backward written as `B` then `W`) runs as one unit: it starts when its rank is free and
every input its actions take from outside the run has arrived, runs its actions back to back,
and sends what they produce when the run ends (as torch's `OVERLAP_F_B` does). Without overlap,
its batch before holds the receives of all its actions. Fusing only ever adds waits in this
cost model (nothing overlaps inside the unit); it records what a runtime may overlap.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

from jaxreshard.pipeline._action import APPLY, BACKWARD, FORWARD, WEIGHT, Action
from jaxreshard.pipeline._costs import Costs
from jaxreshard.pipeline._schedule import (
    PARAM_COPY,
    PARAM_GRAD,
    Schedule,
    Transfer,
    transfer_from,
    transfer_into,
)

SCHEDULE_FORMAT = "jaxreshard-schedule/2"


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
        """The `jaxreshard-schedule/2` JSON object (see DESIGN.md, "Formats", and the README).

        /2 is /1 plus `virtual_stages`, `placement` (the rank of each chunk),
        `split_backward`, `chunk` and `fused` on every action, and `src_chunk`/`dst_chunk` and
        `local` (both chunks on one rank: it takes no time) on every transfer; `stages`,
        `peak_activations` and a transfer's `src`/`dst` stay indexed by rank.
        """
        sched = self.schedule
        origin = min((t.start for stage in self.stages for t in stage), default=0.0)
        return {
            "format": SCHEDULE_FORMAT,
            "schedule": sched.name,
            "weight_delay": sched.weight_delay,
            "num_stages": sched.num_stages,
            "virtual_stages": sched.virtual_stages,
            "placement": list(sched.placement),
            "num_micro_batches": sched.num_micro_batches,
            "split_backward": sched.split_backward,
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
                        "chunk": t.action.stage_index,
                        "start": t.start - origin,
                        "end": t.end - origin,
                        "fused": t.action in sched.fused,
                    }
                    for t in stage
                ]
                for stage in self.stages
            ],
            "transfers": [
                {
                    "kind": t.transfer.kind,
                    "mb": t.transfer.mb,
                    "src": _rank(sched, t.transfer.src),
                    "dst": _rank(sched, t.transfer.dst),
                    "src_chunk": t.transfer.src,
                    "dst_chunk": t.transfer.dst,
                    "local": _rank(sched, t.transfer.src) == _rank(sched, t.transfer.dst),
                    "start": t.start - origin,
                    "end": t.end - origin,
                }
                for t in self.transfers
            ],
        }


def _rank(schedule: Schedule, chunk: int) -> int:
    # Measured timelines may carry transfers to stages outside the placement (never today).
    return schedule.rank_of(chunk) if 0 <= chunk < schedule.num_chunks else chunk


def peak_activations(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most chunk-micro-batches alive at once: from a chunk's F of a micro-batch
    until its last backward part (with v = 1: micro-batches per stage)."""
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
    """Run `schedule` on the cost model; see [Note: transfer semantics] and [Note: fused
    actions].

    Args:
        schedule: the per-rank action lists.
        costs: per chunk (model stage): `costs.num_stages` must be `schedule.num_chunks`.
        overlap: transfers overlap compute (else they block both ranks).

    Raises:
        ScheduleError: the schedule cannot finish (a dependency cycle, or a deadlock of blocking
            transfers), with the grid and the stuck actions marked.
    """
    if costs.num_stages != schedule.num_chunks:
        what = "stages" if schedule.virtual_stages == 1 else "chunks (model stages, p * v)"
        raise ValueError(
            f"costs are for {costs.num_stages} stages but the schedule has "
            f"{schedule.num_chunks} {what}; give one cost per chunk"
        )
    if costs.shared and not overlap:
        raise ValueError(
            "simulate: costs.shared (parameters shared between chunks) is simulated with "
            "overlapping transfers only; simulate with overlap (overlap=True, or without "
            "--no-overlap), or give costs without shared"
        )
    if any(costs.host) and not overlap:
        raise ValueError(
            "simulate: costs.host (a rank's own time between actions) is simulated with "
            "overlapping transfers only; simulate with overlap (overlap=True), or give costs "
            "without host"
        )
    if overlap:
        engine = _simulate_overlapped
    else:
        from jaxreshard.pipeline._simulate_blocking import simulate_blocking as engine
    stages, transfers = engine(schedule, costs)
    return Timeline(schedule, costs, overlap, stages, transfers)


def _external_inputs(unit: tuple[Action, ...], num_chunks: int) -> list[Transfer]:
    """What a unit's actions receive from outside the unit."""
    if len(unit) == 1:
        needed = transfer_into(unit[0], num_chunks)
        return [] if needed is None else [needed]
    inside = {transfer_from(a, num_chunks) for a in unit}
    needed = [transfer_into(a, num_chunks) for a in unit]
    return [t for t in needed if t is not None and t not in inside]


def _outputs(unit: tuple[Action, ...], num_chunks: int) -> list[Transfer]:
    return [t for a in unit if (t := transfer_from(a, num_chunks)) is not None]


def _units(schedule: Schedule, rank: int) -> list[tuple[tuple[Action, ...], list, list]]:
    """Rank's units with what each receives from outside it and what it sends."""
    n = schedule.num_chunks
    return [(u, _external_inputs(u, n), _outputs(u, n)) for u in schedule.groups(rank)]


def _add_shared(
    schedule: Schedule, costs: Costs, units: list[list[tuple[Any, list, list]]], link_free: dict
) -> tuple[dict[Transfer, float], dict[Transfer, tuple[float, float]]]:
    """Add `costs.shared`'s transfers to the ranks' `units` (in place): each copy is needed by
    the first unit of its user chunk, and sent at the start on the owner's link to it (those
    links are busy until then: `link_free`); each gradient contribution is sent after the
    last F, B or W of the user's rank (a rank's program sends its contributions after all of
    its actions: `pipeline._emit`) and needed by the owner's apply, where the schedule has
    one. Returns the gradients' seconds by transfer, and each copy's (start, arrival)."""
    seconds: dict[Transfer, float] = {}
    copies: dict[Transfer, tuple[float, float]] = {}
    for x in costs.shared:
        o, u = x.owner, x.user
        own, use = units[schedule.rank_of(o)], units[schedule.rank_of(u)]
        of_user = [i for i, (unit, _, _) in enumerate(use)
                   if any(a.stage_index == u and a.kind != APPLY for a in unit)]  # fmt: skip
        copy = Transfer(PARAM_COPY, -1, o, u)
        if of_user:
            use[of_user[0]][1].append(copy)
        t0 = t1 = 0.0
        if not schedule.is_local(copy):
            t0 = link_free.get((o, u), 0.0)
            t1 = link_free[(o, u)] = t0 + x.seconds
        copies[copy] = (t0, t1)
        if x.grad and of_user:
            back = Transfer(PARAM_GRAD, -1, u, o)
            seconds[back] = x.seconds if x.back is None else x.back
            last = max(i for i, (unit, _, _) in enumerate(use)
                       if any(a.kind != APPLY for a in unit))  # fmt: skip
            use[last][2].append(back)
            for unit, needed, _ in own:
                if Action(o, APPLY) in unit:
                    needed.append(back)
                    break
    return seconds, copies


def _run_unit(
    unit: tuple[Action, ...], start: float, costs: Costs, split: bool
) -> list[TimedAction]:
    timed = []
    for action in unit:
        end = start + costs.duration(
            action.stage_index, action.kind, split, action.microbatch_index
        )
        timed.append(TimedAction(action, start, end))
        start = end
    return timed


def _simulate_overlapped(schedule: Schedule, costs: Costs):
    """[Note: event-driven simulation]
    A rank runs its units until one waits for a transfer that has not been sent; it is woken
    when that transfer is sent. Each unit runs once and each wait costs O(1), so a simulation
    is linear in the actions (polling every rank until none progresses was quadratic in the
    ranks: 10,000 ranks took minutes). Times do not depend on the order the ranks run in: a
    link carries the sends of one chunk, in its rank's order. Transfers are listed in the
    order that polling found them: by round (a unit runs in its rank's round, one later if an
    input came from a higher rank), then rank, then position.
    """
    p, split, host = schedule.num_stages, schedule.split_backward, costs.host
    busy = any(host)
    units = [_units(schedule, r) for r in range(p)]
    # [Note: event-driven simulation] keys are ints, round * p + rank (and a count after it
    # for a transfer), not tuples: an int is no object the cyclic GC tracks, and tuples per
    # action made the collector cost as much as the simulation.
    arrival: dict[Transfer, float] = {}
    sent_by: dict[Transfer, int] = {}  # round * p + rank of the sender
    link_free: dict[tuple[int, int], float] = {}
    timed: list[list[TimedAction]] = [[] for _ in range(p)]
    transfers: list[TimedTransfer] = []
    found: list[int] = []  # per transfer: (round * p + rank) * limit + count
    limit = 2 * sum(map(len, schedule.actions)) + 1
    position, free, rounds = [0] * p, [0.0] * p, [0] * p
    waiting: dict[Transfer, int] = {}  # a transfer not sent yet -> the rank waiting for it
    seconds, copies = _add_shared(schedule, costs, units, link_free)
    for copy, (t0, t1) in copies.items():  # (sent at the start, in order)
        rank = schedule.rank_of(copy.src)
        arrival[copy], sent_by[copy] = t1, rank
        found.append(rank * limit + len(transfers))
        transfers.append(TimedTransfer(copy, t0, t1))
    ready = deque(range(p))
    while ready:
        r = ready.popleft()
        rank_units, k = units[r], rounds[r]
        while position[r] < len(rank_units):
            unit, needed, sends = rank_units[position[r]]
            start = free[r]
            for t in needed:
                arrived = arrival.get(t)
                if arrived is None:
                    waiting[t] = r
                    break
                start = max(start, arrived)
                q = sent_by[t]
                k = max(k, q // p + (q % p > r))
            else:
                ran = _run_unit(unit, start, costs, split)
                timed[r] += ran
                end = ran[-1].end
                free[r] = (
                    end + sum(host[a.stage_index] for a in unit if a.kind != APPLY) if busy else end
                )
                order = (k * p + r) * limit + len(transfers)
                position[r] += 1
                for sent in sends:
                    if schedule.is_local(sent):
                        t0 = t1 = end
                    else:
                        link = (sent.src, sent.dst)
                        t0 = max(end, link_free.get(link, 0.0))
                        took = seconds.get(sent)
                        if took is None:
                            took = costs.transfer_seconds(sent.kind, sent.boundary, sent.mb)
                        t1 = link_free[link] = t0 + took
                    arrival[sent], sent_by[sent] = t1, k * p + r
                    transfers.append(TimedTransfer(sent, t0, t1))
                    found.append(order)
                    woken = waiting.pop(sent, None)
                    if woken is not None:
                        ready.append(woken)
                continue
            break
        rounds[r] = k
    heads = {r: units[r][position[r]][0] for r in range(p) if position[r] < len(units[r])}
    if heads:
        waits = {r: next(t for t in units[r][position[r]][1] if t not in arrival) for r in heads}
        raise ScheduleError(
            f"{schedule.describe()} cannot finish: its ranks wait on each other in a cycle.\n"
            + _explain_wait(schedule, heads, waits)
        )
    ordered = sorted(range(len(transfers)), key=found.__getitem__)  # stable: sends in order
    return tuple(tuple(t) for t in timed), tuple(transfers[i] for i in ordered)


_MOST_LINES = 16  # stuck ranks named in an error; the grid marks them all (in its limits)


def _explain_wait(
    schedule: Schedule, heads: dict[int, tuple[Action, ...]], waits: dict[int, Transfer]
) -> str:
    """Name the stuck actions and what each waits for, the cycle first, then the marked grid."""
    word = "stage" if schedule.virtual_stages == 1 else "rank"
    lines: list[str] = []
    marks: dict[Action, str] = {}
    listed: set[Action] | None = None  # every action, built once when needed
    for r, unit in heads.items():
        needed = waits[r]
        marks[unit[0]] = f"waits for {needed.label()}"
        if len(lines) == _MOST_LINES:
            continue
        producer = _producer(schedule, needed)
        q = schedule.rank_of(producer.stage_index)
        if q in heads:
            behind = "" if producer in heads[q] else f", queued behind {heads[q][0]}"
            where = f"{producer} on {word} {q}{behind}"
        else:
            if listed is None:
                listed = {a for rank in schedule.actions for a in rank}
            if producer in listed:
                where = f"{producer} on {word} {q}, which never runs"
            else:
                where = f"{producer}, which no {word} runs"
        lines.append(f"  {unit[0]} ({word} {r}) waits for {where}")
    if len(heads) > len(lines):
        lines.append(f"  and {len(heads) - len(lines)} more {word}s wait")
    cycle = _cycle(schedule, heads, waits)
    if len(cycle) > _MOST_LINES:
        cycle = [*cycle[: _MOST_LINES // 2], f"... ({len(cycle) - 1} in the cycle)", cycle[-1]]
    head = f"  cycle: {' -> '.join(cycle)}\n" if cycle else ""
    return head + "\n".join(lines) + "\n" + schedule.grid(marks)


def _cycle(
    schedule: Schedule, heads: dict[int, tuple[Action, ...]], waits: dict[int, Transfer]
) -> list[str]:
    """The stuck actions that wait on each other in a ring: `1B0 (needs 2B0) -> 2F1 (needs
    1F1) -> 1B0`."""
    r = next(iter(heads))
    seen: dict[int, int] = {}  # rank -> its place on the path
    while r in heads and r not in seen:
        seen[r] = len(seen)
        r = schedule.rank_of(_producer(schedule, waits[r]).stage_index)
    if r not in seen:
        return []
    ring = list(seen)[seen[r] :]
    return [f"{heads[q][0]} (needs {_producer(schedule, waits[q])})" for q in ring] + [
        str(heads[r][0])
    ]


def _producer(schedule: Schedule, transfer: Transfer) -> Action:
    """The action after which `transfer` is sent: a boundary tensor's producer; a shared
    parameter's gradient contribution goes after the last action of its chunk's rank (a copy
    goes at the start: its owner's first)."""
    if transfer.kind not in (PARAM_COPY, PARAM_GRAD):
        return transfer.producer
    rank = [a for a in schedule.actions[schedule.rank_of(transfer.src)] if a.kind != APPLY]
    if transfer.kind == PARAM_GRAD:
        return rank[-1]
    return next(a for a in rank if a.stage_index == transfer.src)


def ideal_makespan(num_stages: int, num_micro_batches: int, costs: Costs) -> float:
    """(m + p - 1)(F + B): 1F1B's and GPipe's makespan with uniform costs and free transfers."""
    return (num_micro_batches + num_stages - 1) * (costs.forward[0] + costs.backward[0])
