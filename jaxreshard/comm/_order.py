"""Per-host programs of a plan, and the static check that they cannot hang.

[Note: order safety]
The main failure of multi-host runtimes is a hang: a collective that some member issues in
another order than the others, or a receive whose send never comes. Before a multi-host plan
runs, every host's program is derived from the one plan order, and `check_programs` proves it
safe by simulation: collectives block until every member reaches the same collective (NCCL),
receives block until their send has run, sends never block (the object store). If the
simulation gets stuck, the error names the communicator (or the send/receive pair) and the first
position where the members' sequences diverge.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # this module needs no JAX at run time (the pipeline emitter uses it)
    from jaxreshard.comm._cluster import Cluster
    from jaxreshard.comm._plan import Plan

SEND, RECV, LOCAL, COLLECTIVE = "send", "recv", "local", "collective"


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """One thing a host does for op `op` of a plan.

    Attributes:
        op: position of the op in the plan.
        role: `send` (put the slice once, deliver it to `peers`), `recv` (wait for the slice
            from host `peers[0]`), `local` (copies between this host's devices), or
            `collective` (issue the op's collective on communicator `group`).
        peers: hosts on the other end (send: receiving hosts; recv: the sending host;
            collective: the other hosts of the communicator).
        group: the communicator (global device ids) of a collective.
    """

    op: int
    role: str
    peers: tuple[int, ...] = ()
    group: tuple[int, ...] = ()


def op_hosts(plan: Plan, i: int) -> tuple[int, tuple[int, ...]]:
    """The sending host of op i (-1 for an allgather) and its receiving hosts, sorted."""
    op, host = plan.ops[i], plan.cluster.host_of
    if op.kind == "allgather":
        return -1, tuple(sorted({host(d) for d in op.devices}))
    return host(op.src_device), tuple(sorted({host(d) for d in op.dst_devices}))


def host_programs(plan: Plan, *, collectives: bool = False) -> dict[int, list[Step]]:
    """Each host's steps, in plan order.

    With `collectives`, every op that crosses hosts is one collective over its sender and
    receivers (an NCCL broadcast, which pipelines through the receivers itself). Otherwise a
    `send` goes straight to its receiving host, and a `broadcast` runs as the plan's chain: the
    sender sends to the first receiving host, which receives and then sends on to the next (a
    `recv` directly followed by a `send` of the same op is a relay, forwarded chunk by chunk).
    """
    host = plan.cluster.host_of
    programs: dict[int, list[Step]] = {h: [] for h in range(plan.cluster.num_hosts)}
    for i, op in enumerate(plan.ops):
        src, dst = op_hosts(plan, i)
        if src == -1 or set(dst) <= {src}:
            programs[dst[0] if src == -1 else src].append(Step(i, LOCAL))
            continue
        if collectives:
            group = tuple(sorted(op.participants))
            members = sorted({src, *dst})
            for h in members:
                others = tuple(m for m in members if m != h)
                programs[h].append(Step(i, COLLECTIVE, peers=others, group=group))
            continue
        # Receiving hosts in chain order (the order of dst_devices), the sender's own excluded.
        chain = list(dict.fromkeys(host(d) for d in op.dst_devices if host(d) != src))
        programs[src].append(Step(i, SEND, peers=(chain[0],)))
        if src in dst:
            programs[src].append(Step(i, LOCAL))
        for previous, h, following in zip([src, *chain], chain, [*chain[1:], None]):
            programs[h].append(Step(i, RECV, peers=(previous,)))
            if following is not None:
                programs[h].append(Step(i, SEND, peers=(following,)))
    return {h: steps for h, steps in programs.items() if steps}


class OrderError(RuntimeError):
    """The per-host programs of a plan could hang."""


def check_programs(programs: Mapping[int, Sequence[Step]], cluster: Cluster | None = None) -> None:
    """Raise `OrderError` unless the programs finish under [Note: order safety]."""
    host_of = cluster.host_of if cluster is not None else None
    # Every send needs its receive, and every receive its send.
    sends = {
        (s.op, h, p)
        for h, steps in programs.items()
        for s in steps
        if s.role == SEND
        for p in s.peers
    }
    recvs = {
        (s.op, s.peers[0], h) for h, steps in programs.items() for s in steps if s.role == RECV
    }
    for op, src, dst in sorted(sends - recvs):
        raise OrderError(f"op {op}: host {src} sends to host {dst}, which never receives it")
    for op, src, dst in sorted(recvs - sends):
        raise OrderError(
            f"op {op}: host {dst} waits to receive from host {src}, which never sends it"
        )
    # Members of a collective: the hosts that own its devices.
    members: dict[tuple[tuple[int, ...], int], set[int]] = {}
    for h, steps in programs.items():
        for s in steps:
            if s.role == COLLECTIVE:
                members.setdefault((s.group, s.op), set()).add(h)
    if host_of is not None:
        for (group, op), hosts in members.items():
            owners = {host_of(d) for d in group}
            if hosts != owners:
                raise OrderError(
                    f"communicator {list(group)}: op {op} is issued by hosts {sorted(hosts)} "
                    f"but the communicator spans hosts {sorted(owners)}"
                )
    position = {h: 0 for h in programs}
    delivered: set[tuple[int, int, int]] = set()
    progress = True
    while progress:
        progress = False
        for h, steps in programs.items():
            while position[h] < len(steps):
                s = steps[position[h]]
                if s.role == RECV and (s.op, s.peers[0], h) not in delivered:
                    break
                if s.role == COLLECTIVE:
                    waiting = members[(s.group, s.op)]
                    ready = all(
                        position[m] < len(programs[m])
                        and _same_collective(programs[m][position[m]], s)
                        for m in waiting
                    )
                    if not ready:
                        break
                    for m in waiting:
                        position[m] += 1
                    progress = True
                    continue
                if s.role == SEND:
                    delivered.update((s.op, h, p) for p in s.peers)
                position[h] += 1
                progress = True
    stuck = {h: steps[position[h]] for h, steps in programs.items() if position[h] < len(steps)}
    if stuck:
        raise OrderError(_describe_hang(programs, stuck))


def _same_collective(a: Step, b: Step) -> bool:
    return a.role == b.role == COLLECTIVE and a.op == b.op and a.group == b.group


def _describe_hang(programs: Mapping[int, Sequence[Step]], stuck: Mapping[int, Step]) -> str:
    lines = ["the per-host programs would hang:"]
    for h, s in sorted(stuck.items()):
        if s.role == RECV:
            lines.append(f"  host {h} waits at op {s.op} for host {s.peers[0]}'s send")
            continue
        group = list(s.group)
        sequences = {
            m: [t.op for t in programs[m] if t.role == COLLECTIVE and t.group == s.group]
            for m in programs
            if any(t.group == s.group for t in programs[m])
        }
        first = next(
            (
                i
                for i in range(max(map(len, sequences.values())))
                if len({seq[i] if i < len(seq) else None for seq in sequences.values()}) > 1
            ),
            None,
        )
        if first is None:
            lines.append(
                f"  host {h} waits in communicator {group} at op {s.op} for members "
                "that wait elsewhere (a cycle across communicators)"
            )
        else:
            seen = ", ".join(
                f"host {m}: op {seq[first] if first < len(seq) else 'none'}"
                for m, seq in sorted(sequences.items())
            )
            lines.append(f"  communicator {group} diverges at position {first} ({seen})")
    return "\n".join(lines)


# -- one issue order across communicators ------------------------------------------------------
#
# [Note: one issue order]
# NCCL runs every communicator's kernels on the GPU; a rank blocked in one collective (its kernel
# spinning until every member has joined) does not get to the next collective on the same device
# until it completes, whatever communicator or stream that one is on. So two communicators that
# share two devices must see their ops issued in the same relative order on both, and more
# generally the per-device sequences must not form a cycle (device a waits in X for b, b in Y for
# c, c in Z for a). `check_issue_order` proves, before anything runs, that per-device issue
# sequences finish under that model: every collective is issued on every member, pairs of
# collectives that share two or more ranks come in one relative order on all of them, and a
# simulation of the per-device queues runs them all to completion.


@dataclasses.dataclass(frozen=True, slots=True)
class Collective:
    """One collective as the issue-order check sees it.

    Attributes:
        name: what it moves (unique among the collectives checked together).
        communicator: which communicator it runs on (for messages).
        ranks: its devices (global ids).
    """

    name: str
    communicator: str
    ranks: tuple[int, ...]


def check_issue_order(
    orders: Mapping[int, Sequence[Collective]], host_of: Callable[[int], int] | None = None
) -> None:
    """Raise `OrderError` unless the per-device issue sequences `orders` (device -> its
    collectives in issue order) finish under [Note: one issue order]. `host_of` names hosts."""

    def where(d: int) -> str:
        return f"device {d}" + (f" (host {host_of(d)})" if host_of is not None else "")

    bug = "this is a jaxreshard bug, please report it"
    # Every member issues it, and no one else.
    members: dict[Collective, list[int]] = {}
    for d, sequence in orders.items():
        for c in sequence:
            members.setdefault(c, []).append(d)
    for c, devices in members.items():
        if sorted(devices) != sorted(c.ranks):
            missing = sorted(set(c.ranks) - set(devices))
            extra = sorted(set(devices) - set(c.ranks))
            wrong = [f"never by its member(s) {', '.join(map(where, missing))}"] if missing else []
            wrong += [f"also by non-member(s) {', '.join(map(where, extra))}"] if extra else []
            raise OrderError(
                f"{c.name} on communicator {c.communicator} is issued by "
                f"{', '.join(map(where, sorted(devices)))} but {' and '.join(wrong)} (it would "
                f"hang); {bug}"
            )
    # Two collectives that share two ranks: one relative order on both.
    shared: dict[tuple[int, int], list[Collective]] = {}
    for d, sequence in orders.items():
        for c in sequence:
            for e in c.ranks:
                if e != d:
                    shared.setdefault((d, e), []).append(c)
    for (d, e), mine in sorted(shared.items()):
        if d > e:
            continue
        theirs = shared.get((e, d), [])
        first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        if first is None:
            continue
        x, y = mine[first], theirs[first]
        raise OrderError(
            f"inconsistent NCCL issue order: {where(d)} issues {x.name} (communicator "
            f"{x.communicator}) before {y.name} (communicator {y.communicator}), but {where(e)}, "
            "a member of both, issues them the other way round; the two communicators would "
            f"deadlock; {bug}"
        )
    # The per-device queues run to completion (no cycle over three or more devices).
    at = {d: 0 for d in orders}
    left = sum(len(s) for s in orders.values())
    ready = {d for d in orders if orders[d]}
    while ready:
        d = ready.pop()
        if at[d] >= len(orders[d]):
            continue
        c = orders[d][at[d]]
        if all(at[e] < len(orders[e]) and orders[e][at[e]] == c for e in c.ranks):
            for e in c.ranks:
                at[e] += 1
                left -= 1
                if at[e] < len(orders[e]):
                    ready.update(orders[e][at[e]].ranks)
    if left:
        heads = [
            f"{where(d)} waits in {orders[d][at[d]].name} (communicator "
            f"{orders[d][at[d]].communicator})"
            for d in sorted(orders)
            if at[d] < len(orders[d])
        ]
        raise OrderError(
            "the NCCL issue order would deadlock across communicators: "
            + "; ".join(heads)
            + f"; {bug}"
        )
