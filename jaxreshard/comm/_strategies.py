"""Turning unit tasks into ops: the three primitives and the sender choice/ordering.

[Note: local receivers]
A receiver on a host that holds a replica of its slice is served inside that host, from that
replica, whatever the strategy: crossing a NIC for data the host already has can only be slower
under [Note: cluster model]. Only the remaining receivers form the cross-host "job" that the load
balancers place. On a single host (the local runtime's usual cluster) every op is intra-host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxreshard.comm._balance import (
    Assignment,
    Job,
    balance_dfs,
    balance_greedy,
    balance_match,
    balance_naive,
    balance_size,
    host_makespan,
)
from jaxreshard.comm._cluster import Cluster
from jaxreshard.comm._layout import Index, index_size
from jaxreshard.comm._plan import Op
from jaxreshard.comm._simulate import op_cost
from jaxreshard.comm._tasks import UnitTask

PRIMITIVES = ("send_recv", "allgather", "broadcast")
BALANCERS = ("naive", "size", "dfs", "greedy", "match")


@dataclasses.dataclass(frozen=True, slots=True)
class PlannerOptions:
    """Knobs of the search-based balancers.

    Attributes:
        seed: seed of the randomised greedy balancer.
        greedy_scans: random scans per round of the greedy balancer (default: by problem size).
        dfs_max_work: the DFS stops after evaluating this many (job, sender) children; this
            deterministic budget makes the same inputs give the same plan.
        dfs_time_budget_s: safety net on the DFS's wall time.
    """

    seed: int = 0
    greedy_scans: int | None = None
    dfs_max_work: int = 400_000
    dfs_time_budget_s: float = 2.0

    def __post_init__(self) -> None:
        if self.dfs_max_work < 1 or self.dfs_time_budget_s <= 0:
            raise ValueError(f"{self}: DFS budgets must be positive")
        if self.greedy_scans is not None and self.greedy_scans < 1:
            raise ValueError(f"PlannerOptions(greedy_scans={self.greedy_scans}): must be >= 1")


@dataclasses.dataclass(slots=True)
class _Emitter:
    cluster: Cluster
    ops: list[Op] = dataclasses.field(default_factory=list)
    sent: dict[int, int] = dataclasses.field(default_factory=dict)  # device -> bytes sent

    def pick(self, devices: Sequence[int]) -> int:
        """The replica that has sent the fewest bytes so far (spreads device-link load)."""
        return min(devices, key=lambda d: (self.sent.get(d, 0), d))

    def emit(self, op: Op) -> int:
        if op.kind != "allgather":
            self.sent[op.src_device] = self.sent.get(op.src_device, 0) + op.nbytes
        self.ops.append(op)
        return len(self.ops) - 1

    def send_each(self, task: int, t: UnitTask, src: int, receivers: Sequence[int]) -> None:
        for r in receivers:
            self.emit(Op("send", t.index, t.nbytes, src, (r,), task=task))

    def fan_out(
        self,
        task: int,
        t: UnitTask,
        src: int,
        receivers: Sequence[int],
        after: tuple[int, ...] = (),
    ) -> int:
        """One send, or one broadcast along `receivers` in order."""
        kind = "send" if len(receivers) == 1 else "broadcast"
        return self.emit(Op(kind, t.index, t.nbytes, src, tuple(receivers), after=after, task=task))


def split_index(index: Index, num_parts: int) -> list[Index]:
    """Cut `index` into `num_parts` contiguous parts along its longest dim (some may be empty).

    A 0-d index (one element) cannot be cut and comes back whole, as a single part.
    """
    if not index:
        return [index]
    dim = max(range(len(index)), key=lambda d: (index[d][1] - index[d][0], -d))
    start, stop = index[dim]
    base, extra = divmod(stop - start, num_parts)
    parts, at = [], start
    for i in range(num_parts):
        size = base + (i < extra)
        parts.append((*index[:dim], (at, at + size), *index[dim + 1 :]))
        at += size
    return parts


def _group_by_host(cluster: Cluster, devices: Sequence[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in sorted(devices):
        out.setdefault(cluster.host_of(d), []).append(d)
    return dict(sorted(out.items()))


def build_ops(
    tasks: Sequence[UnitTask],
    cluster: Cluster,
    primitive: str,
    balancer: str,
    options: PlannerOptions,
    *,
    greedy_assignment: Assignment | None = None,
) -> tuple[tuple[Op, ...], bool | None, Assignment]:
    """Return the ops of one concrete strategy, whether its search finished, and its assignment.

    `greedy_assignment`, when given, is the greedy balancer's answer for the same tasks, so that
    `auto` need not compute it twice. The DFS starts from the better of the greedy and the
    matching balancers' schedules, so it is never worse than either.
    """
    assert primitive in PRIMITIVES and balancer in BALANCERS
    em = _Emitter(cluster)
    jobs: list[Job] = []
    remote: list[tuple[int, dict[int, list[int]], dict[int, list[int]]]] = []
    for i, t in enumerate(tasks):
        senders_by_host = _group_by_host(cluster, t.senders)
        receivers_by_host = _group_by_host(cluster, t.receivers)
        away: dict[int, list[int]] = {}
        for host, receivers in receivers_by_host.items():
            if host in senders_by_host:  # [Note: local receivers]
                src = em.pick(senders_by_host[host])
                if primitive == "broadcast":
                    em.fan_out(i, t, src, receivers)
                else:
                    em.send_each(i, t, src, receivers)
            else:
                away[host] = receivers
        if away:
            remote.append((i, senders_by_host, away))
            jobs.append(_job(t, cluster, primitive, senders_by_host, away))

    finished: bool | None = None
    if balancer == "naive":
        assignment = balance_naive(jobs)
    elif balancer == "size":
        assignment = balance_size(jobs)
    elif balancer == "match":
        assignment = balance_match(jobs)
    else:
        if greedy_assignment is None:
            greedy_assignment = balance_greedy(
                jobs, seed=options.seed, num_scans=options.greedy_scans
            )
        assignment = greedy_assignment
        if balancer == "dfs":
            # Branch and bound from the best heuristic schedule: never worse than either.
            incumbent = min(
                (greedy_assignment, balance_match(jobs)), key=lambda a: host_makespan(jobs, a)
            )
            kinds = len({(j.candidates, j.fixed, j.seconds) for j in jobs})
            width = max(1, kinds * max((len(j.candidates) for j in jobs), default=1))
            assignment = balance_dfs(
                jobs,
                max_nodes=max(1, options.dfs_max_work // width),
                time_budget_s=options.dfs_time_budget_s,
                initial=incumbent,
            )
            finished = assignment.finished

    for j in assignment.order:
        i, senders_by_host, away = remote[j]
        t = tasks[i]
        src = em.pick(senders_by_host[assignment.senders[j]])
        if primitive == "broadcast":
            em.fan_out(i, t, src, [d for receivers in away.values() for d in receivers])
        elif primitive == "send_recv":
            em.send_each(i, t, src, [d for receivers in away.values() for d in receivers])
        else:
            for receivers in away.values():
                _allgather_into_host(em, i, t, src, receivers)
    return tuple(em.ops), finished, greedy_assignment or assignment


def _allgather_into_host(em: _Emitter, i: int, t: UnitTask, src: int, receivers: list[int]) -> None:
    """Send part j of the slice to receiver j, then all-gather inside the host (Alpa's way)."""
    parts = split_index(t.index, len(receivers))
    itemsize = t.nbytes // max(1, index_size(t.index))
    nonempty = [(d, p) for d, p in zip(receivers, parts) if index_size(p)]
    if len(nonempty) < 2:  # nothing to split (tiny or 0-d slice): send once, fan out locally
        first = em.fan_out(i, t, src, receivers[:1])
        if len(receivers) > 1:
            em.fan_out(i, t, receivers[0], receivers[1:], after=(first,))
        return
    sends = tuple(
        em.emit(Op("send", p, index_size(p) * itemsize, src, (d,), task=i)) for d, p in nonempty
    )
    em.emit(
        Op(
            "allgather",
            t.index,
            t.nbytes,
            devices=tuple(receivers),
            parts=tuple(parts),
            after=sends,
            task=i,
        )
    )


def _job(
    t: UnitTask,
    cluster: Cluster,
    primitive: str,
    senders_by_host: dict[int, list[int]],
    away: dict[int, list[int]],
) -> Job:
    """The balancer's view of a task's cross-host part (see `_balance`)."""
    candidates = tuple(sorted(senders_by_host, key=lambda h: senders_by_host[h][0]))
    hosts = list(away)
    receivers = [d for devices in away.values() for d in devices]
    representative = senders_by_host[candidates[0]][0]
    if primitive == "broadcast":
        # Every receiving host but the chain's last forwards the data on.
        fixed = tuple(("in", h) for h in hosts) + tuple(("out", h) for h in hosts[:-1])
        kind = "send" if len(receivers) == 1 else "broadcast"
        _, seconds = op_cost(Op(kind, t.index, t.nbytes, representative, tuple(receivers)), cluster)
    else:
        fixed = tuple(("in", h) for h in hosts)
        per_message = cluster.latency_s
        copies = len(receivers) if primitive == "send_recv" else len(hosts)
        messages = len(receivers)
        seconds = messages * per_message + copies * t.nbytes / cluster.inter_host_bytes_per_s
    return Job(candidates, fixed, seconds)
