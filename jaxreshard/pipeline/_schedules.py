"""The schedules, by name: `gpipe`, `1f1b`, `eager_1f1b` (each with optional weight delay), `zb_h1`,
and the virtual-stage ones of `_virtual.py`: `interleaved_1f1b`, `eager_interleaved_1f1b` (each
with optional weight delay), `zbv` and `dualpipev`.

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
With virtual stages, "stage" above means rank, and memory counts chunk-micro-batches;
`zbv` and `dualpipev` place their `W`s themselves (fixed orders).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence

from jaxreshard.pipeline._action import BACKWARD, FORWARD, WEIGHT, Action
from jaxreshard.pipeline._costs import Costs
from jaxreshard.pipeline._limits import MAX_ACTIONS, check_counts
from jaxreshard.pipeline._schedule import (
    GRADIENT,
    Schedule,
    Transfer,
    transfer_from,
    transfer_into,
)
from jaxreshard.pipeline._simulate import ScheduleError, simulate
from jaxreshard.pipeline._virtual import (
    DEFAULT_VIRTUAL_STAGES,
    PLACEMENTS,
    VIRTUAL_ORDERS,
    dualpipev_order,
    interleaved_warmup,
)

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
SCHEDULE_NAMES = (*ORDERS, "zb_h1", *VIRTUAL_ORDERS, "dualpipev")
FIXED_SPLIT = ("zb_h1", "zbv", "dualpipev")
"""Schedules that always split the backward and place their `W`s themselves."""

MAX_WEIGHT_PLACEMENTS = 2 * MAX_ACTIONS
"""Weight delay tries memory caps until one never binds (at most max(1, ceil(C / F)) + 2 of
them; usually two or three); each places and simulates every action. Past five tries and this
many action placements in all (minutes) it stops with an error rather than run for hours."""

PEAK_BOUNDS: dict[str, Callable[..., int]] = {
    "gpipe": lambda s, p, m, v=1: m,
    "1f1b": lambda s, p, m, v=1: min(m, p - s),
    "eager_1f1b": lambda s, p, m, v=1: min(m, 2 * (p - s)),
    "zb_h1": lambda s, p, m, v=1: min(m, p),
    "interleaved_1f1b": lambda s, p, m, v=2: min(m * v, interleaved_warmup(s, p, m, v, p) + 1),
    "eager_interleaved_1f1b": lambda s, p, m, v=2: min(
        m * v, interleaved_warmup(s, p, m, v, 2 * p) + 1
    ),
    "zbv": lambda s, p, m, v=2: min(2 * m, 2 * p),
}
"""Peak micro-batches alive on stage (rank) s (p stages, m micro-batches, v chunks per rank:
chunk-micro-batches) without weight delay; weight delay adds at most max(1, ceil(C / F)) on
top. `zbv`'s holds for m >= 2p (checked up to p = 8)."""


def check_schedule_name(name: str, what: str = "schedule") -> str:
    if name not in SCHEDULE_NAMES:
        raise ValueError(
            f"{what}={name!r} is not a schedule; choose one of {', '.join(SCHEDULE_NAMES)}."
        )
    return name


def check_virtual_stages(
    name: str, virtual_stages: int | None, what: str = "virtual_stages"
) -> int:
    """The number of chunks per rank for `name`: its default when None, else checked."""
    default = DEFAULT_VIRTUAL_STAGES.get(name, 1)
    v = default if virtual_stages is None else virtual_stages
    if not isinstance(v, int) or v < 1:
        raise ValueError(f"{what}={v!r} must be an int >= 1")
    if name not in PLACEMENTS and v != 1:
        raise ValueError(
            f"{what}={v}: {name} runs one stage per rank; use 1, or interleaved_1f1b, "
            "eager_interleaved_1f1b, zbv or dualpipev for several chunks per rank"
        )
    if name in ("zbv", "dualpipev") and v != 2:
        raise ValueError(
            f"{what}={v}: {name} places exactly two chunks per rank (a V); use 2, or "
            "interleaved_1f1b for other counts"
        )
    return v


def build_schedule(
    name: str,
    num_stages: int,
    num_micro_batches: int,
    *,
    virtual_stages: int | None = None,
    weight_delay: bool = False,
    costs: Costs | None = None,
    overlap: bool = True,
) -> Schedule:
    """Build the schedule `name` for p ranks (stages), m micro-batches and v chunks per rank.

    Args:
        name: one of `SCHEDULE_NAMES`.
        num_stages: p >= 1, the ranks (meshes).
        num_micro_batches: m >= 1 (m < p is fine).
        virtual_stages: v, chunks (model stages) per rank; default 1, and 2 for the
            virtual-stage schedules (`zbv` and `dualpipev` take only 2). The model has p * v
            chunks; see [Note: chunks and ranks].
        weight_delay: split each backward into B and W and delay the Ws (see
            [Note: weight placement]); `zb_h1`, `zbv` and `dualpipev` always split.
        costs: the cost model that places the Ws, per chunk (default: forward 1, backward 2,
            weight_grad 1, transfers 1, per chunk and boundary). Ignored when nothing is
            placed.
        overlap: whether transfers overlap compute (picks the best W delay for that mode;
            virtual-stage schedules need asynchronous transfers and always pick for overlap).

    Returns:
        A `Schedule` (without the apply-gradient step; see `Schedule.with_apply`).
    """
    check_schedule_name(name)
    for arg, value in (("num_stages", num_stages), ("num_micro_batches", num_micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg}={value!r} must be an int >= 1")
    v = check_virtual_stages(name, virtual_stages)
    p, m = num_stages, num_micro_batches
    split = weight_delay or name in FIXED_SPLIT
    check_counts(  # before any list of p or m entries exists
        f"{name} with {p:,} stages x {v} virtual stages and {m:,} micro-batches",
        p * v,
        m,
        3 if split else 2,
        "use fewer stages or micro-batches",
    )
    placement = PLACEMENTS[name](p, v) if name in PLACEMENTS else tuple(range(p))
    if name == "dualpipev":
        orders = [dualpipev_order(r, p, m) for r in range(p)]
        fused = frozenset(a for _, f in orders for a in f)
        actions = [order for order, _ in orders]
        return Schedule(name, p, m, True, weight_delay, actions, placement, fused)
    if name == "zbv":
        actions = [VIRTUAL_ORDERS[name](r, p, m, v) for r in range(p)]
        return Schedule(name, p, m, True, weight_delay, actions, placement)
    if name in VIRTUAL_ORDERS:
        base = [VIRTUAL_ORDERS[name](r, p, m, v) for r in range(p)]
    else:
        base = [ORDERS["1f1b" if name == "zb_h1" else name](s, p, m) for s in range(p)]
    if name != "zb_h1" and not weight_delay:
        return Schedule(name, p, m, False, False, base, placement)
    n = p * v
    if costs is None:
        costs = Costs.make(n, forward=1.0, backward=2.0, weight_grad=1.0, comm=1.0)
    elif costs.num_stages != n:
        what = "stages" if v == 1 else f"chunks ({p} ranks x {v} virtual stages)"
        raise ValueError(
            f"costs are for {costs.num_stages} stages, the schedule has {n} {what}; give one "
            "cost per chunk"
        )
    if name == "zb_h1":
        caps = [PEAK_BOUNDS["zb_h1"](s, p, m) for s in range(p)]
        actions = place_weights(base, costs, max_pending=[m] * p, memory_cap=caps)
        return Schedule(name, p, m, True, weight_delay, actions)

    # Weight delay: a W may stay pending while its rank holds at most k micro-batches more than
    # the schedule's documented bound; take the smallest k in 0..max(1, ceil(C / F)) with the
    # best simulated makespan.
    overlap = overlap or v > 1
    bounds = [PEAK_BOUNDS[name](r, p, m, v) for r in range(p)]
    limits = [
        max(_delay_limit(costs, c, placement) for c in range(n) if placement[c] == r)
        for r in range(p)
    ]
    # The first candidate runs each W right after its B: it only sends gradients earlier than
    # the unsplit schedule, so it is never slower, and neither is the pick.
    candidates = [place_weights(base, costs, max_pending=[0] * p, placement=placement)]
    num_actions = 3 * n * m
    for k in range(max(limits) + 1):
        if k >= 3 and (k + 2) * num_actions > MAX_WEIGHT_PLACEMENTS:
            raise ValueError(
                f"{name} with weight delay, {p} stages x {m} micro-batches: trying memory cap "
                f"+{k} (of up to +{max(limits)} = max(1, ceil(comm / forward))) would place "
                f"{(k + 2) * num_actions:,} actions in all ({k + 2} tries of {num_actions:,}), "
                f"as the caps tried so far still bind; at most {MAX_WEIGHT_PLACEMENTS:,} "
                "(jaxreshard.pipeline._schedules.MAX_WEIGHT_PLACEMENTS): use fewer "
                "micro-batches, a smaller comm / forward ratio, or zb_h1"
            )
        caps = [bound + min(k, limits[r]) for r, bound in enumerate(bounds)]
        actions, capped = _place_weights(
            base, costs, max_pending=[m] * p, memory_cap=caps, placement=placement
        )
        candidates.append(actions)
        if not capped:  # no cap bound: a larger one places every W the same way
            break
    best: tuple[float, Schedule] | None = None
    for actions in candidates:
        schedule = Schedule(name, p, m, True, True, actions, placement)
        makespan = simulate(schedule, costs, overlap=overlap).makespan
        if best is None or makespan < best[0] - 1e-9 * max(1.0, makespan):
            best = (makespan, schedule)
    assert best is not None
    return best[1]


def _delay_limit(costs: Costs, chunk: int, placement: Sequence[int]) -> int:
    """max(1, ceil(C / F)): the micro-batches of forward work that cover chunk's gradient send
    (none when the previous chunk is on the same rank)."""
    remote = chunk > 0 and placement[chunk - 1] != placement[chunk]
    comm = costs.transfer_seconds(GRADIENT, chunk - 1) if remote else 0.0
    if costs.forward[chunk] <= 0:
        return 1
    return max(1, math.ceil(comm / costs.forward[chunk]))


def place_weights(
    base: Sequence[Sequence[Action]],
    costs: Costs,
    *,
    max_pending: Sequence[int],
    memory_cap: Sequence[int] | None = None,
    placement: Sequence[int] | None = None,
) -> list[list[Action]]:
    """Insert a `W` after each `B` of the unsplit per-rank orders `base`, by [Note: weight
    placement]; `placement` gives each chunk's rank (default: chunk c on rank c)."""
    out, _ = _place_weights(
        base, costs, max_pending=max_pending, memory_cap=memory_cap, placement=placement
    )
    return out


def _place_weights(
    base: Sequence[Sequence[Action]],
    costs: Costs,
    *,
    max_pending: Sequence[int],
    memory_cap: Sequence[int] | None = None,
    placement: Sequence[int] | None = None,
) -> tuple[list[list[Action]], bool]:
    """`place_weights`, and whether `memory_cap` ever forced a `W` (if not, a larger cap
    places every `W` the same way).

    The ranks step in time order, (free time, rank): the earliest rank that can step does.
    A rank that cannot (its input has not been sent, and no pending `W` fits before it can
    arrive) waits, parked on the rank that sends that input, until that rank steps: nothing
    else changes its answer. So each step costs O(log p), not a sort of all ranks.
    """
    p = len(base)
    place = tuple(placement) if placement is not None else tuple(range(p))
    n = len(place)
    queues = [deque(rank) for rank in base]
    pending: list[deque[Action]] = [deque() for _ in range(p)]
    out: list[list[Action]] = [[] for _ in range(p)]
    free, live = [0.0] * p, [0] * p
    arrival: dict[Transfer, float] = {}
    link_free: dict[tuple[int, int], float] = {}
    finished = [False] * p
    eps = 1e-12
    capped = False

    def duration(action: Action) -> float:
        return costs.duration(action.stage_index, action.kind, True, action.microbatch_index)

    def earliest_arrival(needed: Transfer) -> float:
        """A lower bound on when `needed` arrives, from its producer's rank as it is now."""
        q = place[needed.src]
        ahead = 0.0
        for action in queues[q]:
            ahead += duration(action)
            if action == needed.producer:
                break
        comm = (
            0.0
            if q == place[needed.dst]
            else costs.transfer_seconds(needed.kind, needed.boundary, needed.mb)
        )
        return free[q] + ahead + comm

    def run(r: int, action: Action, start: float) -> None:
        end = start + duration(action)
        out[r].append(action)
        free[r] = end
        if action.kind == FORWARD:
            live[r] += 1
        elif action.kind == WEIGHT:
            live[r] -= 1
        elif action.kind == BACKWARD:
            pending[r].append(Action(action.stage_index, WEIGHT, action.microbatch_index))
        sent = transfer_from(action, n)
        if sent is not None:
            if place[sent.src] == place[sent.dst]:
                arrival[sent] = end
                return
            link = (sent.src, sent.dst)
            t0 = max(end, link_free.get(link, 0.0))
            link_free[link] = arrival[sent] = t0 + costs.transfer_seconds(
                sent.kind, sent.boundary, sent.mb
            )

    def step(r: int) -> bool:
        """Decide rank r's next action at its free time; False when it must wait."""
        t = free[r]
        if not queues[r]:
            if pending[r]:
                run(r, pending[r].popleft(), t)
            else:
                finished[r] = True
            return True
        nonlocal capped
        action = queues[r][0]
        over_cap = memory_cap is not None and action.kind == FORWARD and live[r] + 1 > memory_cap[r]
        must_weigh = len(pending[r]) > max_pending[r] or over_cap
        if must_weigh and pending[r]:
            capped = capped or len(pending[r]) <= max_pending[r]
            run(r, pending[r].popleft(), t)
            return True
        needed = transfer_into(action, n)
        ready = arrival.get(needed) if needed is not None else t
        if ready is not None and ready <= t + eps:
            run(r, queues[r].popleft(), t)
            return True
        if pending[r]:
            bound = ready if ready is not None else earliest_arrival(needed)  # type: ignore[arg-type]
            if t + duration(pending[r][0]) <= bound + eps:
                run(r, pending[r].popleft(), t)
                return True
        if ready is not None:
            run(r, queues[r].popleft(), ready)
            return True
        return False

    heap = [(0.0, r) for r in range(p)]
    parked: list[list[int]] = [[] for _ in range(p)]  # by the rank that sends their input
    while heap:
        _, r = heapq.heappop(heap)
        if not step(r):
            needed = transfer_into(queues[r][0], n)
            parked[place[needed.src]].append(r)  # type: ignore[union-attr]
            continue
        if not finished[r]:
            heapq.heappush(heap, (free[r], r))
        for q in parked[r]:
            heapq.heappush(heap, (free[q], q))
        parked[r].clear()
    if not all(finished):
        stuck = {queues[r][0]: "waits forever" for r in range(p) if queues[r]}
        raise ScheduleError("base order cannot finish:\n" + _grid(base, stuck))
    return out, capped


def _grid(base: Sequence[Sequence[Action]], mark: dict[Action, str]) -> str:
    from jaxreshard.pipeline._schedule import format_grid

    return format_grid(base, mark)
