"""Choosing cuts among more ways than the partitioner can predict one by one.

[Note: cut search]
`partition="auto"` predicts every way to place its free boundaries among the candidates while
there are at most `MAX_CHOICES`. A deep stack with a candidate after every layer (a `jr.scan`
of 48 layers cut into 8 stages: 62 million ways) has far more, so there it searches:
1. **A shortlist by dynamic programming** (Alpa's inter-operator pass): a pipeline of M
   micro-batches takes about the sum of its chunks' times plus M - 1 times the slowest chunk's.
   For each bound t on a chunk's time (a geometric grid between the slowest single segment and
   the whole model), a dynamic program over (chunk, last segment) finds the cuts of least total
   time whose every chunk takes at most t; a chunk's time is its segments' F + B + W on its
   mesh and the transfer across its end. Each bound gives one choice.
2. **The simulator decides.** Each shortlisted choice is predicted as any other (the configured
   schedule, shared parameters, gradient sums, memory under the cap).
3. **Local moves.** From the `STARTS` best predictions: one free boundary moved to any
   candidate between its neighbours, or two moved a candidate each; the best move that
   predicts a faster step (or fits where the choice did not) is taken, until none does. Then
   `KICKS` times, two boundaries of the best found are moved at random (seeded: the same
   search every time) and the moves start again from there. At most `BUDGET` predictions
   besides the shortlist's.
Every prediction made is a tried choice in the report. The result is the best choice found,
not always the best there is: the shortlist's proxy ignores the schedule's order and where its
transfers overlap compute, and local moves can stop at a local optimum. On random problems
whose every choice could be predicted (2026-11-30), it found the best in every one tried: of
455 choices with 39-62% of the predictions, of 5,985 with 15%; without the kicks, 3 of 75
problems of 1,365 stopped 0.4-6.6% short (tests/test_cut_search.py has one). With at most
`MAX_CHOICES` ways the partitioner still predicts every one.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

THRESHOLDS = 48  # bounds on a chunk's time the dynamic program is solved for
STARTS = 4  # best shortlisted choices that local moves start from
BUDGET = 3000  # distinct predictions local moves make at most (besides the shortlist)
KICKS = 6  # random perturbations of the best found that local moves start from again


def shortlist(
    compute: Sequence[Sequence[float]],
    crossing: dict[int, Sequence[float]],
    allowed: Sequence[int],
    forced: Sequence[int],
    mesh_of: Sequence[int],
    micro_batches: int,
    thresholds: int = THRESHOLDS,
) -> list[tuple[int, ...]]:
    """Boundary positions (after segment p) for `len(mesh_of)` chunks, best by the proxy first.

    `compute[m][i]`: segment i's F + B + W seconds per micro-batch on mesh m; `crossing[p][k]`:
    the transfer across position p between chunks k and k + 1; `allowed`: positions that may
    be boundaries (candidates and forced ones); `forced`: positions that must be.
    """
    n = len(compute[0])
    chunks = len(mesh_of)
    prefix = [np.concatenate([[0.0], np.cumsum(np.asarray(c, float))]) for c in compute]
    ok = sorted(set(allowed) | set(forced))
    forced_set = set(forced)
    # The last forced position before p (-1: none): a chunk ending at p starts after it.
    last_forced = {}
    for p in [*ok, n - 1]:
        last_forced[p] = max((f for f in forced_set if f < p), default=-1)
    ends = {c: (ok if c < chunks - 1 else [n - 1]) for c in range(chunks)}
    single = max(max(c) for c in compute)
    whole = max(float(p[-1]) for p in prefix) + max(
        (max(v) for v in crossing.values() if len(v)), default=0.0
    )
    lo = max(single, min(float(p[-1]) for p in prefix) / chunks, 1e-12)
    grid = np.geomspace(lo, max(whole, lo * 1.0001), thresholds)
    found: dict[tuple[int, ...], float] = {}
    for t in grid:
        bounds = _solve(prefix, crossing, ends, last_forced, mesh_of, float(t))
        if bounds is None:
            continue
        times = _chunk_times(prefix, crossing, bounds, mesh_of, n)
        found.setdefault(bounds, sum(times) + (micro_batches - 1) * max(times))
    return sorted(found, key=found.__getitem__)


def _solve(
    prefix: Sequence[np.ndarray],
    crossing: dict[int, Sequence[float]],
    ends: dict[int, Sequence[int]],
    last_forced: dict[int, int],
    mesh_of: Sequence[int],
    t: float,
) -> tuple[int, ...] | None:
    """The least total time of chunks each at most `t`: their boundaries, or None."""
    chunks = len(mesh_of)
    best: dict[int, float] = {-1: 0.0}  # end position of the chunks so far -> least total
    back: list[dict[int, int]] = []
    for c in range(chunks):
        pre = prefix[mesh_of[c]]
        starts = np.array(sorted(best), dtype=int)  # previous ends e: this chunk is e+1..b
        totals = np.array([best[e] for e in starts])
        new: dict[int, float] = {}
        came: dict[int, int] = {}
        for b in ends[c]:
            usable = (starts < b) & (starts >= last_forced[b])
            if not usable.any():
                continue
            across = crossing[b][c] if c < chunks - 1 else 0.0
            own = pre[b + 1] - pre[starts[usable] + 1] + across
            within = own <= t
            if not within.any():
                continue
            cost = np.where(within, totals[usable] + own, np.inf)
            k = int(np.argmin(cost))
            new[b] = float(cost[k])
            came[b] = int(starts[usable][k])
        if not new:
            return None
        best = new
        back.append(came)
    end = next(iter(best))  # (the last chunk ends at the last segment)
    bounds = []
    for c in range(chunks - 1, 0, -1):
        end = back[c][end]
        bounds.append(end)
    return tuple(reversed(bounds))


def _chunk_times(
    prefix: Sequence[np.ndarray],
    crossing: dict[int, Sequence[float]],
    bounds: Sequence[int],
    mesh_of: Sequence[int],
    n: int,
) -> list[float]:
    edges = [-1, *bounds, n - 1]
    return [
        float(prefix[mesh_of[c]][edges[c + 1] + 1] - prefix[mesh_of[c]][edges[c] + 1])
        + (crossing[edges[c + 1]][c] if c < len(mesh_of) - 1 else 0.0)
        for c in range(len(mesh_of))
    ]


def improve(
    starts: Sequence[tuple[int, ...]],
    movable: Sequence[int],
    evaluate: Callable[[tuple[int, ...]], Any],
    key: Callable[[Any], Any],
    budget: int = BUDGET,
    kicks: int = KICKS,
) -> None:
    """Local moves from each of `starts` (boundary positions), then from `kicks` random
    perturbations of the best found: see [Note: cut search]. A boundary at a position in
    `movable` (a candidate's) may move, one at a time anywhere between its neighbours, or two
    at once a candidate each; the best move that lowers `key(evaluate(bounds))` is taken
    until none does. `evaluate` caches and records; at most `budget` distinct predictions."""
    positions = sorted(movable)
    index = {p: i for i, p in enumerate(positions)}
    seen: set[tuple[int, ...]] = set()

    def score(bounds: tuple[int, ...]) -> Any:
        seen.add(bounds)
        return key(evaluate(bounds))

    def descend(bounds: tuple[int, ...]) -> tuple[Any, tuple[int, ...]]:
        current = score(bounds)
        while len(seen) < budget:
            moves = [m for m in _moves(bounds, positions, index) if m not in seen]
            moves = moves[: max(0, budget - len(seen))]
            if not moves:
                break
            value, move = min((score(m), m) for m in moves)
            if not value < current:
                break
            current, bounds = value, move
        return current, bounds

    found = [descend(b) for b in starts]
    rng = random.Random(0)  # (the same search every time)
    for _ in range(kicks):
        if len(seen) >= budget or not found:
            break
        _, best = min(found)
        free = [k for k, p in enumerate(best) if p in index]
        if len(free) < 1 or len(positions) <= len(free):
            break
        kicked = list(best)
        for k in rng.sample(free, min(2, len(free))):
            lo = kicked[k - 1] if k else -math.inf
            hi = kicked[k + 1] if k + 1 < len(kicked) else math.inf
            room = [q for q in positions if lo < q < hi]
            kicked[k] = rng.choice(room)
        found.append(descend(tuple(kicked)))


def _moves(
    bounds: tuple[int, ...], positions: Sequence[int], index: dict[int, int]
) -> list[tuple[int, ...]]:
    """The neighbours of `bounds` that local moves try (see `improve`)."""
    moves = []
    free = [k for k, p in enumerate(bounds) if p in index]  # (a forced boundary stays)
    for k in free:
        lo = bounds[k - 1] if k else -math.inf
        hi = bounds[k + 1] if k + 1 < len(bounds) else math.inf
        moves.extend((*bounds[:k], q, *bounds[k + 1 :]) for q in positions
                     if lo < q < hi and q != bounds[k])  # fmt: skip
    for a, b in itertools.combinations(free, 2):
        for da, db in itertools.product((-1, 1), repeat=2):
            ia, ib = index[bounds[a]] + da, index[bounds[b]] + db
            if 0 <= ia < len(positions) and 0 <= ib < len(positions):
                move = list(bounds)
                move[a], move[b] = positions[ia], positions[ib]
                if move == sorted(set(move)):
                    moves.append(tuple(move))
    return moves
