"""The schedules, by name: `gpipe`, `1f1b`, `eager_1f1b` (each with optional weight delay), `zb_h1`.

[Note: weight placement]
With the backward split, `B` computes only the input gradient (sent to the previous stage at once)
and `W`, the weight gradient, can run later. Every `W` is placed by one policy, simulating the
stages in time order under the cost model: a stage that is free runs its next `F`/`B` when its
input has arrived; while it waits, it runs the oldest pending `W` if that `W` surely ends before
the input can arrive (so it never delays the `F`/`B`); it must run a pending `W` first when more
than `max_pending` are pending, or when the next `F` would hold more micro-batches alive than a
memory cap allows; the rest run at the end of the step, before the apply-gradient step.
- weight delay (`gpipe`/`1f1b`/`eager_1f1b` with `weight_delay=True`): the memory cap is the
  schedule's peak bound (`PEAK_BOUNDS`) plus k, for the smallest k in 0..max(1, ceil(C / F))
  whose simulated makespan is the best: `W`s are delayed only as much as the cost model says
  pays off ("never more than needed"), and peak memory grows by at most max(1, ceil(C / F)).
- `zb_h1` (Qi et al., ICLR 2024): 1F1B's order of `F`/`B` with no cap on pending `W`s but 1F1B's
  peak memory, min(m, p) micro-batches (stage 0's), as every stage's memory cap: later stages
  defer their `W`s so that the gradients run down the pipeline at input-gradient speed, and the
  `W`s fill the cool-down bubbles. The peak over stages stays 1F1B's.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

from jaxreshard.pipeline._action import BACKWARD, FORWARD, WEIGHT, Action
from jaxreshard.pipeline._costs import Costs
from jaxreshard.pipeline._schedule import Schedule, Transfer, transfer_from, transfer_into
from jaxreshard.pipeline._simulate import ScheduleError, simulate

Order = Callable[[int, int, int], list[Action]]


def gpipe_order(stage: int, num_stages: int, num_micro_batches: int) -> list[Action]:
    """All forwards, then all backwards."""
    m = num_micro_batches
    return [Action(stage, FORWARD, j) for j in range(m)] + [
        Action(stage, BACKWARD, j) for j in range(m)
    ]


def _interleaved(stage: int, warmup: int, num_micro_batches: int) -> list[Action]:
    """`warmup` forwards, then one backward and one forward until forwards run out, then the
    remaining backwards."""
    m = num_micro_batches
    order = [Action(stage, FORWARD, j) for j in range(warmup)]
    for j in range(m):
        order.append(Action(stage, BACKWARD, j))
        if warmup + j < m:
            order.append(Action(stage, FORWARD, warmup + j))
    return order


def one_f_one_b_order(stage: int, num_stages: int, num_micro_batches: int) -> list[Action]:
    """1F1B (PipeDream-flush): min(m, p - i) forwards before stage i's first backward."""
    return _interleaved(stage, min(num_micro_batches, num_stages - stage), num_micro_batches)


def eager_1f1b_order(stage: int, num_stages: int, num_micro_batches: int) -> list[Action]:
    """Eager-1F1B (the paper): min(m, 2(p - i) - 1) forwards before stage i's first backward.

    The extra in-flight micro-batches give a stage forward work to do while a transfer is in
    flight; stage i keeps at most min(m, 2(p - i)) micro-batches alive.
    """
    return _interleaved(
        stage, min(num_micro_batches, 2 * (num_stages - stage) - 1), num_micro_batches
    )


ORDERS: dict[str, Order] = {
    "gpipe": gpipe_order,
    "1f1b": one_f_one_b_order,
    "eager_1f1b": eager_1f1b_order,
}
SCHEDULE_NAMES = (*ORDERS, "zb_h1")

PEAK_BOUNDS: dict[str, Callable[[int, int, int], int]] = {
    "gpipe": lambda s, p, m: m,
    "1f1b": lambda s, p, m: min(m, p - s),
    "eager_1f1b": lambda s, p, m: min(m, 2 * (p - s)),
    "zb_h1": lambda s, p, m: min(m, p),
}
"""Peak micro-batches alive on stage s (p stages, m micro-batches) without weight delay; weight
delay adds at most max(1, ceil(C / F)) on top."""


def check_schedule_name(name: str, what: str = "schedule") -> str:
    if name not in SCHEDULE_NAMES:
        raise ValueError(
            f"{what}={name!r} is not a schedule; choose one of {', '.join(SCHEDULE_NAMES)}."
        )
    return name


def build_schedule(
    name: str,
    num_stages: int,
    num_micro_batches: int,
    *,
    weight_delay: bool = False,
    costs: Costs | None = None,
    overlap: bool = True,
) -> Schedule:
    """Build the schedule `name` for p stages and m micro-batches.

    Args:
        name: one of `SCHEDULE_NAMES`.
        num_stages: p >= 1.
        num_micro_batches: m >= 1 (m < p is fine).
        weight_delay: split each backward into B and W and delay the Ws (see
            [Note: weight placement]); `zb_h1` always splits.
        costs: the cost model that places the Ws (default: forward 1, backward 2, weight_grad 1,
            transfers 1, per stage and boundary). Ignored when nothing is split.
        overlap: whether transfers overlap compute (picks the best W delay for that mode).

    Returns:
        A `Schedule` (without the apply-gradient step; see `Schedule.with_apply`).
    """
    check_schedule_name(name)
    for arg, value in (("num_stages", num_stages), ("num_micro_batches", num_micro_batches)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg}={value!r} must be an int >= 1")
    p, m = num_stages, num_micro_batches
    base_order = ORDERS["1f1b" if name == "zb_h1" else name]
    base = [base_order(s, p, m) for s in range(p)]
    if name != "zb_h1" and not weight_delay:
        return Schedule(name, p, m, False, False, base)
    if costs is None:
        costs = Costs.make(p, forward=1.0, backward=2.0, weight_grad=1.0, comm=1.0)
    elif costs.num_stages != p:
        raise ValueError(f"costs are for {costs.num_stages} stages, the schedule has {p}")
    if name == "zb_h1":
        caps = [PEAK_BOUNDS["zb_h1"](s, p, m) for s in range(p)]
        actions = place_weights(base, costs, max_pending=[m] * p, memory_cap=caps)
        return Schedule(name, p, m, True, weight_delay, actions)

    # Weight delay: a W may stay pending while its stage holds at most k micro-batches more than
    # the schedule's documented bound; take the smallest k in 0..max(1, ceil(C / F)) with the
    # best simulated makespan.
    bounds = [PEAK_BOUNDS[name](s, p, m) for s in range(p)]
    limit = max(_delay_limit(costs, s) for s in range(p))
    # The first candidate runs each W right after its B: it only sends gradients earlier than
    # the unsplit schedule, so it is never slower, and neither is the pick.
    candidates = [place_weights(base, costs, max_pending=[0] * p)]
    for k in range(limit + 1):
        caps = [bound + min(k, _delay_limit(costs, s)) for s, bound in enumerate(bounds)]
        candidates.append(place_weights(base, costs, max_pending=[m] * p, memory_cap=caps))
    best: tuple[float, Schedule] | None = None
    for actions in candidates:
        schedule = Schedule(name, p, m, True, True, actions)
        makespan = simulate(schedule, costs, overlap=overlap).makespan
        if best is None or makespan < best[0] - 1e-9 * max(1.0, makespan):
            best = (makespan, schedule)
    assert best is not None
    return best[1]


def _delay_limit(costs: Costs, stage: int) -> int:
    """max(1, ceil(C / F)): the micro-batches of forward work that cover stage's gradient send."""
    comm = costs.comm[stage - 1] if stage > 0 else 0.0
    if costs.forward[stage] <= 0:
        return 1
    return max(1, math.ceil(comm / costs.forward[stage]))


def place_weights(
    base: Sequence[Sequence[Action]],
    costs: Costs,
    *,
    max_pending: Sequence[int],
    memory_cap: Sequence[int] | None = None,
) -> list[list[Action]]:
    """Insert a `W` after each `B` of the unsplit orders `base`, by [Note: weight placement]."""
    p = len(base)
    queues = [deque(stage) for stage in base]
    pending: list[deque[Action]] = [deque() for _ in range(p)]
    out: list[list[Action]] = [[] for _ in range(p)]
    free, live = [0.0] * p, [0] * p
    arrival: dict[Transfer, float] = {}
    link_free: dict[tuple[int, int], float] = {}
    finished = [False] * p
    eps = 1e-12

    def duration(s: int, kind: str) -> float:
        return costs.duration(s, kind, split=True)

    def earliest_arrival(needed: Transfer) -> float:
        """A lower bound on when `needed` arrives, from its producer's stage as it is now."""
        ps = needed.src
        ahead = 0.0
        for action in queues[ps]:
            ahead += duration(ps, action.kind)
            if action == needed.producer:
                break
        return free[ps] + ahead + costs.comm[needed.boundary]

    def run(s: int, action: Action, start: float) -> None:
        end = start + duration(s, action.kind)
        out[s].append(action)
        free[s] = end
        if action.kind == FORWARD:
            live[s] += 1
        elif action.kind == WEIGHT:
            live[s] -= 1
        elif action.kind == BACKWARD:
            pending[s].append(Action(s, WEIGHT, action.microbatch_index))
        sent = transfer_from(action, p)
        if sent is not None:
            link = (sent.src, sent.dst)
            t0 = max(end, link_free.get(link, 0.0))
            link_free[link] = arrival[sent] = t0 + costs.comm[sent.boundary]

    def step(s: int) -> bool:
        """Decide stage s's next action at its free time; False when it must wait."""
        t = free[s]
        if not queues[s]:
            if pending[s]:
                run(s, pending[s].popleft(), t)
            else:
                finished[s] = True
            return True
        action = queues[s][0]
        must_weigh = len(pending[s]) > max_pending[s] or (
            memory_cap is not None and action.kind == FORWARD and live[s] + 1 > memory_cap[s]
        )
        if must_weigh and pending[s]:
            run(s, pending[s].popleft(), t)
            return True
        needed = transfer_into(action, p)
        ready = arrival.get(needed) if needed is not None else t
        if ready is not None and ready <= t + eps:
            run(s, queues[s].popleft(), t)
            return True
        if pending[s]:
            bound = ready if ready is not None else earliest_arrival(needed)  # type: ignore[arg-type]
            if t + duration(s, WEIGHT) <= bound + eps:
                run(s, pending[s].popleft(), t)
                return True
        if ready is not None:
            run(s, queues[s].popleft(), ready)
            return True
        return False

    while not all(finished):
        for s in sorted((s for s in range(p) if not finished[s]), key=lambda s: (free[s], s)):
            if step(s):
                break
        else:
            stuck = {queues[s][0]: "waits forever" for s in range(p) if queues[s]}
            raise ScheduleError("base order cannot finish:\n" + _grid(base, stuck))
    return out


def _grid(base: Sequence[Sequence[Action]], mark: dict[Action, str]) -> str:
    from jaxreshard.pipeline._schedule import format_grid

    return format_grid(base, mark)
