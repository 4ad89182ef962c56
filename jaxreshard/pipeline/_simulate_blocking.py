"""The simulation of blocking transfers (`simulate(..., overlap=False)`; see [Note: transfer
semantics] in `_simulate.py`): after each F/B a stage posts one batch of point-to-point calls,
and a transfer runs once both its sender and its receiver have posted it."""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

from jaxreshard.pipeline._action import BACKWARD, FORWARD, Action
from jaxreshard.pipeline._costs import Costs
from jaxreshard.pipeline._schedule import Schedule, Transfer
from jaxreshard.pipeline._simulate import (
    ScheduleError,
    TimedAction,
    TimedTransfer,
    _run_unit,
    _units,
)


@dataclasses.dataclass(frozen=True, slots=True)
class _Run:
    """A unit in a blocking program, with the transfers it takes and gives within its rank."""

    actions: tuple[Action, ...]
    local_in: tuple[Transfer, ...]
    local_out: tuple[Transfer, ...]


def _program(schedule: Schedule, r: int) -> list[Any]:
    """Rank r as `_Run`s with communication batches between them; a batch is
    [(transfer, role)].

    A batch holds the sends of one unit with F/B and the receives of the next, and sits right
    after the earlier one: `W` and `A` do not communicate, so they never split a batch (they run
    after it), and a split schedule has exactly the batches of the unsplit one. Local transfers
    are in no batch.
    """
    items: list[Any] = []
    previous: list[Transfer] | None = None  # what the last unit with an F/B sends
    insert_at = 0

    def remote(transfers: list[Transfer], role: str) -> list[tuple[Transfer, str]]:
        return [(t, role) for t in transfers if not schedule.is_local(t)]

    for unit, needs, sends in _units(schedule, r):
        run = _Run(
            unit,
            tuple(t for t in needs if schedule.is_local(t)),
            tuple(t for t in sends if schedule.is_local(t)),
        )
        if any(a.kind in (FORWARD, BACKWARD) for a in unit):
            batch = remote(previous, "send") if previous is not None else []
            batch += remote(needs, "recv")
            items.insert(insert_at, batch)
            items.append(run)
            insert_at = len(items)
            previous = sends
        else:
            items.append(run)
    items.insert(insert_at, remote(previous, "send") if previous else [])
    return items


_SIDE = {"send": 0, "recv": 1}


def _next_action(program: list[Any], position: int) -> Action:
    """The action a rank blocked at `position` is about to run (else the one it just ran)."""
    following = next((item for item in program[position:] if isinstance(item, _Run)), None)
    return following.actions[0] if following else program[position - 1].actions[-1]


def simulate_blocking(schedule: Schedule, costs: Costs):
    """Event-driven as `_simulate_overlapped` (see [Note: event-driven simulation]): a rank
    stops at a batch whose peer has not posted its side, and is woken when it does; a
    transfer is recorded in the round (and by the rank) that polling would have found it."""
    p, split = schedule.num_stages, schedule.split_backward
    programs = [_program(schedule, r) for r in range(p)]
    # A side posted: its time, and the poster's round * p + rank (ints: see the overlapped one).
    posted: tuple[dict[Transfer, float], dict[Transfer, float]] = ({}, {})  # send, recv
    posted_by: tuple[dict[Transfer, int], dict[Transfer, int]] = ({}, {})
    done: dict[Transfer, TimedTransfer] = {}
    found: dict[Transfer, int] = {}  # (round * p + rank) * limit + count of who did it first
    limit = 2 * sum(map(len, schedule.actions)) + 1
    timed: list[list[TimedAction]] = [[] for _ in range(p)]
    position, now, rounds = [0] * p, [0.0] * p, [0] * p
    waiting: dict[Transfer, int] = {}  # a transfer with one side posted -> that side's rank
    ready = deque(range(p))
    while ready:
        r = ready.popleft()
        program = programs[r]
        while position[r] < len(program):
            item = program[position[r]]
            if isinstance(item, _Run):
                if any(t not in done for t in item.local_in):
                    break  # its producer comes later on this rank: never
                ran = _run_unit(item.actions, now[r], costs, split)
                timed[r] += ran
                now[r] = ran[-1].end
                for t in item.local_out:
                    done[t] = TimedTransfer(t, now[r], now[r])
                    found[t] = (rounds[r] * p + r) * limit + len(found)
                position[r] += 1
                continue
            for t, role in item:  # post this rank's side of each (once)
                mine = _SIDE[role]
                if t not in posted[mine]:
                    posted[mine][t], posted_by[mine][t] = now[r], rounds[r] * p + r
                    if t in posted[1 - mine]:
                        woken = waiting.pop(t, None)
                        if woken is not None:
                            ready.append(woken)
            k, blocked = rounds[r], None
            for t, role in item:
                q = posted_by[1 - _SIDE[role]].get(t)
                if q is None:
                    blocked = t
                    break
                k = max(k, q // p + (q % p > r))
            if blocked is not None:
                waiting[blocked] = r
                break
            rounds[r] = k
            end = now[r]
            for t, _ in item:
                first = (k * p + r) * limit + len(found)
                if t in done:  # the peer was first (in this order; keep polling's)
                    found[t] = min(found[t], first)
                else:
                    start = max(posted[0][t], posted[1][t])
                    took = costs.transfer_seconds(t.kind, t.boundary, t.mb)
                    done[t] = TimedTransfer(t, start, start + took)
                    found[t] = first
                end = max(end, done[t].end)
            now[r] = end
            position[r] += 1
    stuck = {}
    word = "stage" if schedule.virtual_stages == 1 else "rank"
    for r in range(p):
        if position[r] >= len(programs[r]):
            continue
        item = programs[r][position[r]]
        if isinstance(item, _Run):
            later = [t for t in item.local_in if t not in done]
            stuck[item.actions[0]] = "waits for " + ", ".join(
                f"{t.producer} (later on this {word})" for t in later
            )
            continue
        blocked = [t for t, role in item if t not in posted[1 - _SIDE[role]]]
        stuck[_next_action(programs[r], position[r])] = "blocked on " + ", ".join(
            f"{t.label()} ({word} {_peer_rank(schedule, t, r)} has not posted it)" for t in blocked
        )
    if stuck:
        raise ScheduleError(
            f"{schedule.describe()} deadlocks with blocking transfers: every {word} below waits "
            "for a peer that waits too.\n"
            + schedule.grid(stuck)
            + (
                "\n(virtual-stage schedules are made for asynchronous transfers: simulate them "
                "with overlap)"
                if schedule.virtual_stages > 1 or schedule.fused
                else ""
            )
        )
    order = sorted(
        done.values(), key=lambda t: (t.start, t.transfer.src, t.transfer.mb, found[t.transfer])
    )
    return tuple(tuple(t) for t in timed), tuple(order)


def _peer_rank(schedule: Schedule, transfer: Transfer, rank: int) -> int:
    src, dst = schedule.rank_of(transfer.src), schedule.rank_of(transfer.dst)
    return dst if src == rank else src
