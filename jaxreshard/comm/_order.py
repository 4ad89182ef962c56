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
from collections.abc import Mapping, Sequence
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
