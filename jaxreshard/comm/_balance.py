"""Sender choice and ordering of cross-host transfers, at host granularity (paper §1).

Each `Job` is the cross-host part of one unit task: it must be sent by one of its candidate
sender hosts and, while it runs, it holds that host's NIC-out plus a fixed set of links (the
receiving hosts' NIC-ins, and the NIC-outs of receiving hosts that forward a broadcast). A
balancer returns the sender of every job and the order in which to issue them; the plan's
simulator then starts each job as early as its links allow, in that order.

A job's time is its op's on free links (`op_cost`), and it holds its links for all of it: the
balancers weigh jobs as if a chain held every link to its end, while the simulator lets each hop
go as soon as it is done ([Note: chained hops] in `_simulate.py`). So they place and order by a
close but coarser model, and `broadcast_dfs`'s "finished" (proved optimal) is optimal for that
model; `auto` compares the strategies' plans by the simulator.
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
import time
from collections.abc import Sequence

from jaxreshard.comm._simulate import Resource


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    candidates: tuple[int, ...]
    fixed: tuple[Resource, ...]
    seconds: float

    def __post_init__(self) -> None:
        assert self.candidates, "a job needs a candidate sender"


@dataclasses.dataclass(frozen=True, slots=True)
class Assignment:
    order: tuple[int, ...]
    senders: tuple[int, ...]
    finished: bool = True


def balance_naive(jobs: Sequence[Job]) -> Assignment:
    """Lowest-index replica sends; jobs go in task order (the paper's baseline)."""
    return Assignment(tuple(range(len(jobs))), tuple(job.candidates[0] for job in jobs))


def balance_size(jobs: Sequence[Job]) -> Assignment:
    """Longest job first, each to the least-loaded candidate sender (greedy makespan balance)."""
    order = sorted(range(len(jobs)), key=lambda j: (-jobs[j].seconds, j))
    load: dict[int, float] = {}
    senders = [0] * len(jobs)
    for j in order:
        sender = min(jobs[j].candidates, key=lambda h: (load.get(h, 0.0), h))
        senders[j] = sender
        load[sender] = load.get(sender, 0.0) + jobs[j].seconds
    return Assignment(tuple(order), tuple(senders))


def host_makespan(jobs: Sequence[Job], assignment: Assignment) -> float:
    """Completion time of `assignment` when each job starts once its links are free."""
    free: dict[Resource, float] = {}
    makespan = 0.0
    for j in assignment.order:
        links = (("out", assignment.senders[j]), *jobs[j].fixed)
        start = max(free.get(r, 0.0) for r in links)
        end = start + jobs[j].seconds
        for r in links:
            free[r] = end
        makespan = max(makespan, end)
    return makespan


def balance_greedy(
    jobs: Sequence[Job], *, seed: int = 0, num_scans: int | None = None
) -> Assignment:
    """Randomised greedy: issue, round after round, a largest set of jobs that share no link.

    A set is found by scanning the remaining jobs in a random order and keeping every job (with
    a randomly ordered choice of its candidate senders) that conflicts with none kept so far; the
    scan is repeated `num_scans` times and the largest set (then the longest) wins. Deterministic
    for a given `seed`.
    """
    n = len(jobs)
    if num_scans is None:
        num_scans = max(4, min(64, 100_000 // max(1, n)))
    rng = random.Random(seed)
    bits: dict[Resource, int] = {}

    def mask(links: Sequence[Resource]) -> int:
        m = 0
        for r in links:
            m |= 1 << bits.setdefault(r, len(bits))
        return m

    fixed = [mask(job.fixed) for job in jobs]
    sender_mask = {h: mask([("out", h)]) for job in jobs for h in job.candidates}
    remaining = list(range(n))
    order: list[int] = []
    senders = [0] * n
    while remaining:
        # No set can hold more jobs than there are distinct senders, nor distinct receiving links.
        limit = min(
            len({h for j in remaining for h in jobs[j].candidates}),
            len({r for j in remaining for r in jobs[j].fixed}) or n,
        )
        best: list[tuple[int, int]] = []
        best_seconds = -1.0
        for _ in range(num_scans):
            scan = remaining[:]
            rng.shuffle(scan)
            used = 0
            kept: list[tuple[int, int]] = []
            for j in scan:
                if fixed[j] & used:
                    continue
                candidates = list(jobs[j].candidates)
                rng.shuffle(candidates)
                for h in candidates:
                    if not sender_mask[h] & used:
                        used |= fixed[j] | sender_mask[h]
                        kept.append((j, h))
                        break
            seconds = sum(jobs[j].seconds for j, _ in kept)
            if (len(kept), seconds) > (len(best), best_seconds):
                best, best_seconds = kept, seconds
            if len(best) >= limit:
                break
        best.sort(key=lambda jh: (-jobs[jh[0]].seconds, jh[0]))
        for j, h in best:
            order.append(j)
            senders[j] = h
        chosen = {j for j, _ in best}
        remaining = [j for j in remaining if j not in chosen]
    return Assignment(tuple(order), tuple(senders))


def balance_dfs(
    jobs: Sequence[Job],
    *,
    max_nodes: int = 20_000,
    time_budget_s: float = 1.0,
    initial: Assignment | None = None,
) -> Assignment:
    """Depth-first search over (next job, its sender) with lower-bound pruning.

    Each node issues one more job at the earliest time its links allow. Identical jobs (same
    candidates, links and duration) are interchangeable, so only one of each kind is branched
    on. A branch is cut when a lower bound on its completion (the busiest link's finish plus its
    remaining mandatory work, or all remaining sender work spread evenly over the senders)
    reaches the best complete schedule found. The search stops early once the best schedule
    meets the root lower bound (it is then optimal). `finished` says whether the search
    completed or proved optimality within `max_nodes` nodes (the deterministic budget) and
    `time_budget_s` seconds (a safety net).

    Args:
        initial: a known schedule that seeds the incumbent (default: `balance_size`'s); the
            result is never worse than it.
    """
    n = len(jobs)
    if n == 0:
        return Assignment((), ())
    kinds: dict[tuple, list[int]] = {}
    for j, job in enumerate(jobs):
        kinds.setdefault((job.candidates, job.fixed, job.seconds), []).append(j)
    kind_list = list(kinds.values())
    counts = [len(ids) for ids in kind_list]
    links: dict[Resource, int] = {}
    for job in jobs:
        for r in (*(("out", h) for h in job.candidates), *job.fixed):
            links.setdefault(r, len(links))
    free = [0.0] * len(links)
    kind_fixed = [tuple(links[r] for r in jobs[ids[0]].fixed) for ids in kind_list]
    kind_senders = [tuple(links[("out", h)] for h in jobs[ids[0]].candidates) for ids in kind_list]
    kind_seconds = [jobs[ids[0]].seconds for ids in kind_list]
    # Remaining work that is bound to a link whatever the choices.
    mandatory = [0.0] * len(links)
    for k, ids in enumerate(kind_list):
        for r in kind_fixed[k]:
            mandatory[r] += kind_seconds[k] * len(ids)
        if len(kind_senders[k]) == 1:
            mandatory[kind_senders[k][0]] += kind_seconds[k] * len(ids)
    sender_links = sorted({r for s in kind_senders for r in s})
    remaining_work = sum(job.seconds for job in jobs)

    def bound(makespan: float) -> float:
        b = makespan
        for r in range(len(links)):
            b = max(b, free[r] + mandatory[r])
        spread = (sum(free[r] for r in sender_links) + remaining_work) / len(sender_links)
        return max(b, spread)

    root_bound = bound(0.0)
    best_makespan = math.inf
    best: list[tuple[int, int]] = []  # (kind, sender link) per issued job
    if initial is None:
        initial = balance_size(jobs)  # an incumbent, so a stopped search still has an answer
    if initial is not None:
        kind_of = {j: k for k, ids in enumerate(kind_list) for j in ids}
        best_makespan = host_makespan(jobs, initial)
        best = [(kind_of[j], links[("out", initial.senders[j])]) for j in initial.order]
    path: list[tuple[int, int]] = []  # (kind, sender link)
    nodes = 0
    deadline = time.perf_counter() + time_budget_s
    stopped = False
    eps = 1e-12 * max(1.0, root_bound)

    def visit(makespan: float, depth: int) -> None:
        nonlocal best_makespan, best, nodes, stopped, remaining_work
        if depth == n:
            if makespan < best_makespan - eps:
                best_makespan = makespan
                best = list(path)
            return
        children = []
        for k, count in enumerate(counts):
            if not count:
                continue
            ready = max((free[r] for r in kind_fixed[k]), default=0.0)
            for s in kind_senders[k]:
                start = max(ready, free[s])
                children.append((start + kind_seconds[k], start, k, s))
        children.sort()
        for end, _start, k, s in children:
            if stopped or best_makespan <= root_bound + eps:
                return
            nodes += 1
            if nodes >= max_nodes or (nodes % 512 == 0 and time.perf_counter() > deadline):
                stopped = True
            touched = (s, *kind_fixed[k])
            saved = [free[r] for r in touched]
            for r in touched:
                free[r] = end
            counts[k] -= 1
            seconds = kind_seconds[k]
            remaining_work -= seconds
            for r in kind_fixed[k]:
                mandatory[r] -= seconds
            single = len(kind_senders[k]) == 1
            if single:
                mandatory[s] -= seconds
            path.append((k, s))
            new_makespan = max(makespan, end)
            if bound(new_makespan) < best_makespan - eps:
                visit(new_makespan, depth + 1)
            path.pop()
            if single:
                mandatory[s] += seconds
            for r in kind_fixed[k]:
                mandatory[r] += seconds
            remaining_work += seconds
            counts[k] += 1
            for r, value in zip(touched, saved):
                free[r] = value

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, n + 200))
    try:
        visit(0.0, 0)
    finally:
        sys.setrecursionlimit(limit)
    finished = not stopped or best_makespan <= root_bound + eps
    host_of_link = {index: r[1] for r, index in links.items()}
    next_of_kind = [0] * len(kind_list)
    order, senders = [], [0] * n
    for k, s in best:
        j = kind_list[k][next_of_kind[k]]
        next_of_kind[k] += 1
        order.append(j)
        senders[j] = host_of_link[s]
    return Assignment(tuple(order), tuple(senders), finished)


def balance_match(jobs: Sequence[Job]) -> Assignment:
    """Rounds of maximum matchings between free senders and free receivers.

    The randomised greedy finds a *maximal* set of non-conflicting jobs per round; when the jobs
    are uniform and each goes to one receiving host, the best schedule needs every round to be
    a *maximum* matching of sender hosts to receiving hosts (then the number of rounds meets the
    busiest host's load, by Konig's edge-colouring theorem). Each round first places the jobs
    that hold several fixed links (broadcasts to several hosts), most loaded first, then finds
    a maximum matching (augmenting paths) among the single-receiver jobs, trying the receivers
    with the most remaining work first so that they are always in the matching when possible.
    """
    n = len(jobs)
    remaining = set(range(n))
    order: list[int] = []
    senders = [0] * n
    load: dict[Resource, float] = {}
    for job in jobs:
        for r in job.fixed:
            load[r] = load.get(r, 0.0) + job.seconds
    while remaining:
        used: set[Resource] = set()
        picked: list[tuple[int, int]] = []
        multi = sorted(
            (j for j in remaining if len(jobs[j].fixed) != 1),
            key=lambda j: (-max((load[r] for r in jobs[j].fixed), default=0.0), j),
        )
        for j in multi:
            if used.isdisjoint(jobs[j].fixed):
                free = [h for h in jobs[j].candidates if ("out", h) not in used]
                if free:
                    h = free[0]
                    used.update(jobs[j].fixed)
                    used.add(("out", h))
                    picked.append((j, h))
        # Single-receiver jobs: bipartite graph sender host -> receiving link.
        by_edge: dict[tuple[int, Resource], list[int]] = {}
        for j in remaining:
            if len(jobs[j].fixed) == 1 and jobs[j].fixed[0] not in used:
                for h in jobs[j].candidates:
                    if ("out", h) not in used:
                        by_edge.setdefault((h, jobs[j].fixed[0]), []).append(j)
        adjacency: dict[Resource, list[int]] = {}
        for h, r in by_edge:
            adjacency.setdefault(r, []).append(h)
        match_of_sender = _max_matching(adjacency, sorted(adjacency, key=lambda r: (-load[r], r)))
        for h, r in sorted(match_of_sender.items()):
            # Of the jobs on this edge, send the longest, then the least flexible, first.
            j = min(by_edge[(h, r)], key=lambda j: (-jobs[j].seconds, len(jobs[j].candidates), j))
            picked.append((j, h))
        assert picked, "every round places at least one job"
        picked.sort(key=lambda jh: (-jobs[jh[0]].seconds, jh[0]))
        for j, h in picked:
            order.append(j)
            senders[j] = h
            remaining.discard(j)
            for r in jobs[j].fixed:
                load[r] -= jobs[j].seconds
    return Assignment(tuple(order), tuple(senders))


def _max_matching(
    adjacency: dict[Resource, list[int]], receivers: Sequence[Resource]
) -> dict[int, Resource]:
    """Maximum bipartite matching by augmenting paths (Kuhn), receivers tried in the given order.

    A receiver once matched stays matched as later paths augment, so receivers early in the
    order are in the matching whenever some maximum matching can include them greedily.
    """
    match_of_sender: dict[int, Resource] = {}

    def augment(r: Resource, seen: set[int]) -> bool:
        for h in adjacency[r]:
            if h in seen:
                continue
            seen.add(h)
            if h not in match_of_sender or augment(match_of_sender[h], seen):
                match_of_sender[h] = r
                return True
        return False

    for r in receivers:
        augment(r, set())
    return match_of_sender
