"""The one order in which a host issues its NCCL transfers.

[Note: NCCL issue order]
Each stage-to-stage channel has its own communicators and streams, and a GPU shares its devices
among them; NCCL then needs every rank to issue the collectives of all communicators it is in
in one consistent order (see [Note: one issue order] in `comm/_order.py`): ranks that issue two
communicators' ops in different orders can deadlock. Free-running per-channel receive jobs and
per-stage sender threads issue in whatever order the host's threads get there, so on NCCL:
- `nccl_issue_order` derives, from the layout alone (so every host derives the same), one total
  order of the step's cross-host transfers (each a SEND/RECV pair of one micro-batch): it runs
  every rank's instruction program (`layout.programs`), a RECV waiting for its transfer, and
  whenever no rank can go on, takes the SEND that has been reached whose consumer starts first
  in the simulated schedule (`PipelineLayout.need`; ties by instruction key). Every transfer a
  rank receives before it sends another is so ordered before that one.
- `nccl_issue_plan` expands it into what each host issues (its side of each transfer, in that
  order; a transfer's collectives in its plan's op order) and each device's sequence of
  collectives, and checks both before anything runs (`comm._order.check_issue_order`: one
  relative order for any two collectives that share two ranks, no cycle across devices; and a
  simulation of the issuers with the rank programs that shows every transfer completes).
  `HostChannels` builds it when it is made, that is, when the pipeline is built.
- A host's issuer (one thread per step) walks its list: for its side of a SEND it waits until
  the stage has handed the value over (`send` does no more for NCCL transfers), for a RECV it
  allocates the receive buffers then and there, at the receive's turn (not when the step
  starts), with at most `nccl_recv_window` receives in flight, and issues the broadcasts
  (queued on the GPU: the issuer never waits for them). Received values are handed to JAX and
  delivered off the issuer; a work's kept buffers (sources, staging buffers) are let go as soon
  as its broadcasts have finished, not at the end of the step.
- Before a step, every communicator of the host's list must exist: after an abort they are all
  gone, and the driver makes them again before the next step (`RayPipeline.run`); a missing one
  is an error naming it, not a hang.
"""

from __future__ import annotations

import dataclasses
import heapq
import threading
from collections.abc import Callable, Mapping, Sequence
from numbers import Integral
from typing import Any

from jaxreshard.comm._order import (
    COLLECTIVE,
    RECV,
    SEND,
    Collective,
    OrderError,
    Step,
    check_issue_order,
    host_programs,
)
from jaxreshard.comm._transport import HostWork
from jaxreshard.pipeline._emit import RECV_OP, SEND_OP, Instruction
from jaxreshard.runtime.engine._events import transfer_key
from jaxreshard.runtime.step._layout import PipelineLayout

HostsOfStage = Mapping[int, "int | Sequence[int]"]


def hosts_of(host_of_stage: HostsOfStage) -> dict[int, tuple[int, ...]]:
    """Every stage's hosts as a tuple (a stage whose mesh spans hosts has several; see
    [Note: multi-host stages] in `ray/_pipeline.py`)."""
    return {s: (int(h),) if isinstance(h, Integral) else tuple(h) for s, h in host_of_stage.items()}


def nccl_channel(src_stage: int, dst_stage: int) -> str:
    """The NCCL channel (communicators and streams) of transfers from one stage to another."""
    return f"s{src_stage}->s{dst_stage}"


def nccl_programs(
    layout: PipelineLayout, host_of_stage: HostsOfStage
) -> list[tuple[str, dict[int, list[Any]]]]:
    """Per NCCL channel (stage -> stage), the host programs of its cross-host transfers: what
    its communicators are made from."""
    hosts = hosts_of(host_of_stage)
    out: dict[str, dict[int, list[Any]]] = {}
    for (_, _, src, dst), t in sorted(layout.transfers.items()):
        if t.plan is None or hosts[src] == hosts[dst] == hosts[src][:1]:
            continue
        merged = out.setdefault(nccl_channel(src, dst), {})
        for h, steps in host_programs(t.plan, collectives=True).items():
            merged.setdefault(h, []).extend(steps)
    return sorted(out.items())


def check_channel_order(layout: PipelineLayout) -> None:
    """A stage's SENDs to another stage must come in the order of that stage's RECVs (see
    [Note: NCCL transport]). The order across channels, which NCCL needs too, is
    `nccl_issue_plan`'s (checked when `HostChannels` is made)."""
    sends: dict[tuple[int, int], list[Any]] = {}
    recvs: dict[tuple[int, int], list[Any]] = {}
    for program in layout.programs:
        for ins in program:
            if ins.op in (SEND_OP, RECV_OP):
                table = sends if ins.op == SEND_OP else recvs
                table.setdefault((ins.src, ins.dst), []).append(ins.key)
    for (src, dst), order in sends.items():
        if order != recvs.get((src, dst)):
            raise OrderError(
                f"channel s{src}->s{dst}: stage {src} sends {order} but stage {dst} receives "
                f"{recvs.get((src, dst))}; NCCL would match them in the wrong order"
            )


# -- the one NCCL issue order (see [Note: NCCL issue order]) ---------------------------------------

Key = tuple[str, int, int, int, int]  # an instruction's key: (kind, tensor, micro-batch, src, dst)


def _crosses_hosts(
    layout: PipelineLayout, hosts: Mapping[int, tuple[int, ...]], ins: Instruction
) -> bool:
    transfer = layout.transfers.get(transfer_key(ins))
    return (
        transfer is not None
        and transfer.plan is not None
        and not hosts[ins.src] == hosts[ins.dst] == hosts[ins.src][:1]
    )


def nccl_issue_order(layout: PipelineLayout, host_of_stage: HostsOfStage) -> list[Key]:
    """The step's cross-host transfers (instruction keys) in the one order every host issues
    their collectives in (see [Note: NCCL issue order])."""
    hosts = hosts_of(host_of_stage)
    programs = layout.programs
    position = [0] * len(programs)
    delivered: set[Key] = set()
    reached: list[tuple[float, Key]] = []  # SENDs reached, by need
    order: list[Key] = []
    while True:
        progress = True
        while progress:
            progress = False
            for r, program in enumerate(programs):
                while position[r] < len(program):
                    ins = program[position[r]]
                    if ins.op == RECV_OP and ins.key not in delivered:
                        break
                    if ins.op == SEND_OP:
                        if _crosses_hosts(layout, hosts, ins):
                            heapq.heappush(reached, (layout.need.get(ins.key, 0.0), ins.key))
                        else:
                            delivered.add(ins.key)
                    position[r] += 1
                    progress = True
        if not reached:
            break
        _, key = heapq.heappop(reached)
        order.append(key)
        delivered.add(key)
    stuck = [
        f"rank {r} at {programs[r][position[r]]}"
        for r in range(len(programs))
        if position[r] < len(programs[r])
    ]
    if stuck:
        raise OrderError(
            f"the stage programs cannot run to the end ({', '.join(stuck)}); this is a "
            "jaxreshard bug, please report it"
        )
    return order


@dataclasses.dataclass
class NcclIssuePlan:
    """What every host issues on NCCL in a step, in the one issue order (see
    [Note: NCCL issue order]).

    Attributes:
        order: the cross-host transfers (instruction keys), in issue order.
        items: per host, its side of each of its transfers, in that order: (key, `SEND` or
            `RECV`).
        devices: per device (global id), its collectives in issue order.
        communicators: per host, the (channel, group) of every communicator its items use.
    """

    order: list[Key]
    items: dict[int, list[tuple[Key, str]]]
    devices: dict[int, list[Collective]]
    communicators: dict[int, list[tuple[str, tuple[int, ...]]]]


def nccl_issue_plan(
    layout: PipelineLayout, host_of_stage: HostsOfStage, recv_window: int | None = None
) -> NcclIssuePlan:
    """Derive the step's NCCL issue plan and check it (see [Note: NCCL issue order]); an
    `OrderError` names what would hang. `recv_window`: the issuers' bound on receives in
    flight (None: unbounded), as the check should simulate it. Every host of the sending
    stage issues its side of a SEND, every host of the receiving stage its side of the RECV
    (a stage that spans hosts runs the same programs on each)."""
    hosts = hosts_of(host_of_stage)
    order = nccl_issue_order(layout, hosts)
    items: dict[int, list[tuple[Key, str]]] = {}
    for key in order:
        for h in hosts[key[3]]:
            items.setdefault(h, []).append((key, SEND))
        for h in hosts[key[4]]:
            items.setdefault(h, []).append((key, RECV))
    return check_nccl_items(layout, hosts, items, recv_window, order)


def check_nccl_items(
    layout: PipelineLayout,
    host_of_stage: HostsOfStage,
    items: Mapping[int, Sequence[tuple[Key, str]]],
    recv_window: int | None = None,
    order: Sequence[Key] = (),
) -> NcclIssuePlan:
    """The plan of hosts that issue their sides of the step's cross-host transfers as `items`
    say (host -> [(instruction key, `SEND` or `RECV`)], in issue order), checked: each device's
    collectives over all communicators in one consistent order (`check_issue_order`), and a
    simulation of the issuers and the rank programs that finishes. Raises `OrderError`."""
    devices: dict[int, list[Collective]] = {}
    communicators: dict[int, dict[tuple[str, tuple[int, ...]], None]] = {}
    collectives: dict[Key, list[Collective]] = {}
    programs_of: dict[tuple[str, int, int, int], dict[int, list[Step]]] = {}
    host_of: Callable[[int], int] | None = None
    for h, sequence in items.items():
        for key, _ in sequence:
            kind, tensor, _, src, dst = key
            plan = layout.transfers[(kind, tensor, src, dst)].plan
            assert plan is not None
            host_of = plan.cluster.host_of
            programs = programs_of.get((kind, tensor, src, dst))
            if programs is None:
                programs = host_programs(plan, collectives=True)
                programs_of[(kind, tensor, src, dst)] = programs
            channel = nccl_channel(src, dst)
            for step in programs.get(h, ()):
                if step.role != COLLECTIVE:
                    continue
                communicators.setdefault(h, {})[(channel, step.group)] = None
                c = Collective(
                    f"op {step.op} of {_describe_key(key)}",
                    f"{list(step.group)} ({channel})",
                    step.group,
                )
                if c not in collectives.setdefault(key, []):  # (each member host has it)
                    collectives[key].append(c)
                for d in step.group:
                    if host_of(d) == h:
                        devices.setdefault(d, []).append(c)
    check_issue_order(devices, host_of)
    result = NcclIssuePlan(
        list(order),
        {h: list(sequence) for h, sequence in items.items()},
        devices,
        {h: list(cs) for h, cs in communicators.items()},
    )
    _check_issuers(layout, hosts_of(host_of_stage), result, collectives, host_of, recv_window)
    return result


def _check_issuers(
    layout: PipelineLayout,
    hosts: Mapping[int, tuple[int, ...]],
    plan: NcclIssuePlan,
    collectives: Mapping[Key, list[Collective]],
    host_of: Callable[[int], int] | None,
    recv_window: int | None,
) -> None:
    """Simulate the step: rank programs (a RECV waits for its transfer), each host's issuer (a
    SEND's side waits for the stage to hand the value over; a RECV's for room in the window),
    and each device's collectives in issue order (one finishes once every member has issued it
    and has it first). Raise `OrderError` unless everything finishes."""
    programs = layout.programs
    position = [0] * len(programs)
    at_item = dict.fromkeys(plan.items, 0)
    at_device = dict.fromkeys(plan.devices, 0)
    handed: set[Key] = set()
    delivered: set[Key] = set()
    issued: set[tuple[int, Key]] = set()
    left = {key: len(cs) for key, cs in collectives.items()}
    key_of = {c: key for key, cs in collectives.items() for c in cs}
    in_flight = dict.fromkeys(plan.items, 0)
    counted: set[tuple[int, Key]] = set()  # (host, RECV) counted in its window
    nccl = {key for sequence in plan.items.values() for key, _ in sequence}
    progress = True
    while progress:
        progress = False
        for r, program in enumerate(programs):
            while position[r] < len(program):
                ins = program[position[r]]
                if ins.op == RECV_OP and ins.key not in delivered:
                    break
                if ins.op == SEND_OP:
                    (handed if ins.key in nccl else delivered).add(ins.key)
                position[r] += 1
                progress = True
        for h, items in plan.items.items():
            while at_item[h] < len(items):
                key, role = items[at_item[h]]
                if role == SEND and key not in handed:
                    break
                if role == RECV and left.get(key):
                    if recv_window is not None and in_flight[h] >= recv_window:
                        break
                    in_flight[h] += 1
                    counted.add((h, key))
                issued.add((h, key))
                at_item[h] += 1
                progress = True
        for d, sequence in plan.devices.items():
            while at_device[d] < len(sequence):
                c = sequence[at_device[d]]
                key = key_of[c]
                ready = all(
                    at_device[e] < len(plan.devices[e])
                    and plan.devices[e][at_device[e]] == c
                    and (host_of(e) if host_of else 0, key) in issued
                    for e in c.ranks
                )
                if not ready:
                    break
                for e in c.ranks:
                    at_device[e] += 1
                left[key] -= 1
                if not left[key]:
                    delivered.add(key)
                    for receiver in hosts[key[4]]:
                        if (receiver, key) in counted:
                            in_flight[receiver] -= 1
                progress = True
    stuck = [
        f"rank {r} waits at {programs[r][position[r]]}"
        for r in range(len(programs))
        if position[r] < len(programs[r])
    ]
    stuck += [
        f"host {h}'s issuer waits at its {items[at_item[h]][1]} of "
        f"{_describe_key(items[at_item[h]][0])}"
        for h, items in plan.items.items()
        if at_item[h] < len(items)
    ]
    if stuck:
        raise OrderError(
            "the NCCL issue order would hang the step: " + "; ".join(stuck) + "; this is a "
            "jaxreshard bug, please report it"
        )


def _describe_key(key: Key) -> str:
    kind, tensor, mb, src, dst = key
    return f"{kind}{tensor}" + (f" mb{mb}" if mb >= 0 else "") + f" s{src}->s{dst}"


class Issuer:
    """One step's NCCL issuer on this host (see [Note: NCCL issue order])."""

    def __init__(self, step: int, epoch: int | None):
        self.step = step  # which `begin` of the channels it belongs to
        self.epoch = epoch  # the executor's epoch of that step, where it has them
        self.values: dict[Key, Any] = {}  # SENDs' values handed over, not issued yet
        self.works: list[HostWork] = []  # issued, not known to have finished on the GPUs
        self.receives: set[str] = set()  # work ids of the receives among them
        self.undelivered: set[str] = set()  # receives issued, not handed to their RECV yet
        self.at = "nothing yet"  # what it waits for (for messages)
        self.done = False
        self.thread: threading.Thread | None = None
