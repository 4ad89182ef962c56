"""The cut search past `MAX_CHOICES` ([Note: cut search]): a shortlist by Alpa's dynamic program
and local moves, each choice predicted by the simulator, against every choice predicted."""

import itertools

import numpy as np
import pytest

from jaxreshard.pipeline import Costs, simulate
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime.step._cut_search import STARTS, improve, shortlist
from jaxreshard.runtime.step._refit import _schedule


def problem(seed, n, chunks, micro_batches, schedule, forced=()):
    """Random segments (F, B = 2F, W = B/2), a transfer of 0.05, 0.5 or 2 across each position;
    returns the predicted step of boundary positions, and the search's inputs."""
    r = np.random.default_rng(seed)
    f = r.uniform(0.5, 2.0, n)
    cross = {p: [float(r.choice([0.05, 0.5, 2.0]))] * (chunks - 1) for p in range(n - 1)}
    cfg = PipelineConfig(num_micro_batches=micro_batches, schedule=schedule, num_stages=chunks)

    def step(bounds):
        edges = [-1, *bounds, n - 1]
        fwd = tuple(float(f[edges[c] + 1 : edges[c + 1] + 1].sum()) for c in range(chunks))
        costs = Costs(
            forward=fwd,
            backward=tuple(2 * x for x in fwd),
            weight_grad=fwd,
            comm=tuple(cross[p][0] for p in bounds),
            apply=(0.0,) * chunks,
        )
        return simulate(_schedule(cfg, costs), costs).makespan

    return step, [list(3 * f)], cross


def search(step, work, cross, n, chunks, micro_batches, forced=()):
    seen = {}

    def predict(bounds):
        assert all(p in bounds for p in forced), bounds
        assert list(bounds) == sorted(set(bounds)) and len(bounds) == chunks - 1, bounds
        if bounds not in seen:
            seen[bounds] = step(bounds)
        return seen[bounds]

    free = [p for p in range(n - 1) if p not in forced]
    for bounds in shortlist(work, cross, free, list(forced), [0] * chunks, micro_batches):
        predict(bounds)
    improve(sorted(seen, key=seen.get)[:STARTS], free, predict, lambda v: v)
    return min(seen.values()), len(seen)


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1", "eager_1f1b"])
def test_the_search_finds_the_best_of_every_choice_with_a_few_predictions(schedule):
    """Random problems of 16 segments in 4 chunks (455 choices), each predicted by the simulator
    under the schedule: the search's best is every choice's best, with fewer predictions."""
    ratios, counts = [], []
    for seed in range(4):
        n, chunks, m = 16, 4, 8
        step, work, cross = problem(seed, n, chunks, m, schedule)
        best = min(step(b) for b in itertools.combinations(range(n - 1), chunks - 1))
        found, predictions = search(step, work, cross, n, chunks, m)
        ratios.append(found / best)
        counts.append(predictions)
    assert max(ratios) <= 1.001, ratios
    assert max(counts) < 455, counts


def test_forced_boundaries_stay_and_the_rest_are_searched():
    n, chunks, m = 12, 4, 4
    step, work, cross = problem(7, n, chunks, m, "1f1b")
    forced = (5,)
    every = [b for b in itertools.combinations(range(n - 1), chunks - 1) if 5 in b]
    best = min(step(b) for b in every)
    found, _ = search(step, work, cross, n, chunks, m, forced)
    assert found <= 1.01 * best


def test_a_chunk_time_bound_nothing_meets_gives_no_choice():
    from jaxreshard.runtime.step._cut_search import _solve

    prefix = [np.array([0.0, 1.0, 2.0, 3.0])]
    ends = {0: [0, 1], 1: [2]}
    last = {0: -1, 1: -1, 2: -1}
    cross = {0: [0.0], 1: [0.0]}
    assert _solve(prefix, cross, ends, last, [0, 0], 0.5) is None
    assert _solve(prefix, cross, ends, last, [0, 0], 2.0) in ((0,), (1,))
    assert _solve(prefix, cross, ends, last, [0, 0], 1.5) is None  # (1 + 2 or 2 + 1)


def test_kicks_leave_a_local_optimum_that_moves_alone_stop_at():
    """Eager-1F1B, 16 segments in 5 chunks (seed 14): local moves from the shortlist stop at
    cuts 6.6% slower than the best of all 1,365; random kicks reach the best."""
    n, chunks, m = 16, 5, 8
    step, work, cross = problem(14, n, chunks, m, "eager_1f1b")
    every = {b: step(b) for b in itertools.combinations(range(n - 1), chunks - 1)}
    best = min(every.values())
    found = []
    for kicks in (0, 6):
        seen = {}

        def predict(bounds, seen=seen):
            seen[bounds] = every[bounds]
            return seen[bounds]

        for bounds in shortlist(work, cross, list(range(n - 1)), [], [0] * chunks, m):
            predict(bounds)
        starts = sorted(seen, key=seen.get)[:STARTS]
        improve(starts, list(range(n - 1)), predict, lambda v: v, kicks=kicks)
        found.append(min(seen.values()) / best)
    assert found[0] > 1.05 and found[1] == 1.0, found
