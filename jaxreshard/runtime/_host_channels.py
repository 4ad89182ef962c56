"""Channels of the stages one host runs: boundary tensors within the host and to other hosts.

A host (a Ray host actor, or a test's stand-in for one) runs some stages of a pipeline. For a
transfer to a stage of the same host, the sender thread runs the transfer's plan (all its ops are
local copies) and delivers. For a transfer between hosts, each side runs its part of the plan's
host programs (`comm._order.host_programs`) over the host's transport: TCP streams to the other
host actors (on CPU; the plan's broadcast chain relayed chunk by chunk), Ray's object store, or
NCCL (one broadcast per op, on the channel's own streams and communicators). On TCP and the
object store, receives from other hosts are started when the step begins, one job per channel
(source stage -> this stage) in program order, off the compute threads (see
[Note: boundary tensors]); on NCCL, every cross-host transfer goes through the host's issuer in
the pipeline's one issue order (see [Note: NCCL issue order]). Nothing here imports Ray: the
transports and `signal` carry it.

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
import time
from collections.abc import Callable, Mapping, Sequence
from numbers import Integral
from typing import Any

import jax
from jax.sharding import NamedSharding

from jaxreshard.comm._order import (
    COLLECTIVE,
    LOCAL,
    RECV,
    SEND,
    Collective,
    OrderError,
    Step,
    check_issue_order,
    host_programs,
)
from jaxreshard.comm._transport import HostData, HostWork, Transport, run_host_work
from jaxreshard.pipeline._emit import RECV_OP, RUN, SEND_OP, Instruction
from jaxreshard.runtime._executor import (
    ARRIVE,
    Channels,
    Event,
    PipelineError,
    check_source,
    transfer_key,
)
from jaxreshard.runtime._layout import PipelineLayout, Transfer
from jaxreshard.runtime._threads import JOIN_S, DaemonPool

HostsOfStage = Mapping[int, "int | Sequence[int]"]


def hosts_of(host_of_stage: HostsOfStage) -> dict[int, tuple[int, ...]]:
    """Every stage's hosts as a tuple (a stage whose mesh spans hosts has several; see
    [Note: multi-host stages] in `_pipeline_ray.py`)."""
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


class _Issuer:
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


class HostChannels(Channels):
    """Channels of the stages this host runs (see the module docstring).

    Args:
        layout: the step.
        host: this host's index.
        host_of_stage: every stage's host, or hosts (a stage whose mesh spans hosts).
        devices: this host's devices by global id.
        meshes: the meshes of this host's stages (of several hosts' devices, for a stage that
            spans hosts).
        transport: an `ObjectStoreTransport` or an `NcclTransport` of this host.
        signal: `signal(hosts, step_id, key)` calls `signalled(step_id, key)` on those hosts'
            channels (signal-only steps).
        timeout_s: the longest wait for any transfer.
    """

    def __init__(
        self,
        layout: PipelineLayout,
        *,
        host: int,
        host_of_stage: HostsOfStage,
        devices: Mapping[int, Any],
        meshes: Mapping[int, Any],
        transport: Transport,
        signal: Callable[[Sequence[int], str, tuple[Any, ...]], None],
        timeout_s: float,
    ):
        super().__init__(layout, timeout_s)
        self.host, self.hosts_of_stage = host, hosts_of(host_of_stage)
        self.devices, self.meshes = dict(devices), dict(meshes)
        self.transport, self.signal = transport, signal
        self.nccl = transport.name == "nccl"
        self.step_id = "idle"
        self._epoch_steps: dict[int, str] = {}
        self._gid = {d: g for g, d in self.devices.items()}
        self._steps: dict[tuple[str, int, int, int], tuple[Any, ...]] = {}
        self._signals: set[tuple[str, tuple[Any, ...]]] = set()
        self._nccl_works: list[HostWork] = []  # the running step's, not known to be finished
        # One receiving job per channel into this host runs for a whole step (TCP, object
        # store); on NCCL the pool hands received values over, at most a window at a time.
        channels_in = {
            (ins.src, ins.dst)
            for program in layout.programs
            for ins in program
            if ins.op == RECV_OP
            and host in self.hosts_of_stage[ins.dst]
            and host not in self.hosts_of_stage[ins.src]
        }
        workers = len(channels_in) + (self.nccl_recv_window if self.nccl else 0)
        # Daemons that hold nothing while idle (see [Note: threads at exit] in `_threads.py`).
        self._receivers = DaemonPool(max(1, workers), "jaxreshard-recv")
        # Every action of a step finishes within timeout_s of the one before it or the step
        # fails (the progress deadline), so no transfer of a step arrives later than this
        # after the step began: the bound on a receiving job's wait (`_step_deadline`).
        self._step_bound_s = timeout_s * (
            1 + sum(ins.op == RUN for p in layout.programs for ins in p)
        )
        self._begun_at = time.monotonic()
        self._issuer: _Issuer | None = None
        self._begun = 0  # steps begun (an issuer of an older one stops)
        if not hasattr(self, "_local"):
            self._local = threading.local()
        self._items: list[tuple[Key, str]] = []
        self._nccl_sends: set[Key] = set()
        self._communicators: list[tuple[str, tuple[int, ...]]] = []
        self._instructions: dict[Key, Instruction] = {}
        if self.nccl:  # derived and checked now, when the pipeline is built
            plan = nccl_issue_plan(layout, self.hosts_of_stage, self.nccl_recv_window)
            self._items = plan.items.get(host, [])
            self._nccl_sends = {key for key, role in self._items if role == SEND}
            self._communicators = plan.communicators.get(host, [])
            mine = {key for key, _ in self._items}
            self._instructions = {
                ins.key: ins
                for program in layout.programs
                for ins in program
                if ins.op == (SEND_OP if ins.key in self._nccl_sends else RECV_OP)
                and ins.key in mine
            }

    # The most receives this host's NCCL issuer has in flight (issued, not finished on the
    # GPUs): the next one's buffers are allocated only once there is room.
    nccl_recv_window = 2
    # How often the issuer looks whether issued broadcasts have finished, while it waits for
    # room for a receive / for a SEND's value.
    _poll_window_s = 0.0005
    _poll_idle_s = 0.005

    def where(self, stage: int) -> str:
        hosts = self.hosts_of_stage[stage]
        if len(hosts) == 1:
            return f"stage {stage} (host {hosts[0]})"
        return f"stage {stage} (hosts {', '.join(map(str, hosts))})"

    def begin(
        self,
        stages: Sequence[int],
        *,
        step_id: str = "",
        record: Callable[[Event], None] | None = None,
        signal_only: bool = False,
    ) -> None:
        self.transport.forget(self.step_id)
        self.step_id = step_id
        with self._cond:  # signals of this step may have come before it began
            self._signals = {(sid, key) for sid, key in self._signals if sid == step_id}
            self._nccl_works = []
            self._issuer = None  # the last step's ends on its own (it sees the new step)
            self._begun += 1
            self._begun_at = time.monotonic()
        super().begin(stages, step_id=step_id, record=record, signal_only=signal_only)
        # The step each epoch is (a sender still moving a value of an earlier step names that
        # step's work, not the one begun since).
        self._epoch_steps = {**dict(list(self._epoch_steps.items())[-3:]), self.epoch: step_id}

    def end(self) -> None:
        try:
            super().end()
            issuer = self._issuer
            if issuer is not None and issuer.step == self._begun:
                deadline = time.monotonic() + self.timeout_s
                with self._cond:
                    while not issuer.done and self._failure is None:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise PipelineError(
                                f"host {self.host}: the NCCL issuer did not get through this "
                                f"step's transfers within timeout_s={self.timeout_s:g} s after "
                                f"the stages finished; it waits for {issuer.at}; this is a "
                                "jaxreshard bug, please report it"
                            )
                        self._cond.wait(min(left, 1.0))
                    failure = self._failure
                if failure is not None:
                    raise failure
                for work in list(issuer.works):  # NCCL transfers of this step, to completion
                    self.transport.complete(work, deadline)
                issuer.works.clear()
        except PipelineError:
            raise
        except BaseException as e:
            error = PipelineError(f"host {self.host}: {type(e).__name__}: {e}")
            error.__cause__ = e
            self.fail(error)
            raise error from e

    def send(self, ins: Instruction, value: Any) -> None:
        """Hand a value over for moving; on NCCL, a transfer to another host goes to this
        step's issuer, which sends it at its turn (see [Note: NCCL issue order])."""
        issuer = self._issuer
        if issuer is not None and ins.key in self._nccl_sends:
            with self._cond:
                self._check_failure()
                issuer.values[ins.key] = value
                self._cond.notify_all()
            return
        super().send(ins, value)

    def signalled(self, step_id: str, key: tuple[Any, ...]) -> None:
        """A peer's signal-only transfer `key` of step `step_id` has been sent."""
        with self._cond:
            self._signals.add((step_id, tuple(key)))
            self._cond.notify_all()

    def _on_failure(self, error: BaseException) -> None:
        self.transport.abort(self.step_id, f"host {self.host}: {error}")

    # Work descriptions ----------------------------------------------------------------------------

    def _work(self, ins: Instruction, transfer: Transfer, step_id: str | None = None) -> HostWork:
        """The transport's work for `ins` of step `step_id` (default: the current one)."""
        step_id = self.step_id if step_id is None else step_id
        key = transfer_key(ins)
        steps = self._steps.get(key)
        if steps is None:
            programs = host_programs(transfer.plan, collectives=self.nccl)
            steps = self._steps[key] = tuple(programs.get(self.host, ()))
        plan = transfer.plan
        own = self.devices
        kind, tensor, mb, src, dst = ins.key
        return HostWork(
            work_id=f"{step_id}:{kind}{tensor}:mb{mb}:s{src}->s{dst}",
            host=self.host,
            shape=plan.shape,
            dtype=plan.dtype,
            steps=steps,
            ops={s.op: plan.ops[s.op] for s in steps},
            src_regions={d: i for d, i in zip(plan.src.devices, plan.src.indices) if d in own},
            dst_regions={d: i for d, i in zip(plan.dst.devices, plan.dst.indices) if d in own},
            src_array="",
            dst_array="",
            timeout_s=self.timeout_s,
            describe=f"{ins} of step {step_id}",
        )

    def _data(self, work: HostWork, shards: Mapping[int, Any], ins: Instruction) -> Any:
        if self.nccl:
            from jaxreshard.comm._nccl import DeviceData

            channel = nccl_channel(ins.src, ins.dst)
            return DeviceData(work, shards, self.devices, self.transport, channel)  # type: ignore[arg-type]
        return HostData(work, shards, self.devices)

    def _assemble(self, transfer: Transfer, data: Any) -> jax.Array:
        """The received value: this host's shards of it, as the (global) array they make."""
        sharding = NamedSharding(self.meshes[transfer.dst_stage], transfer.dst_spec)
        shards = data.finish()
        arrays = [shards[self._gid[d]] for d in sharding.mesh.devices.flat if d in self._gid]
        return jax.make_array_from_single_device_arrays(transfer.shape, sharding, arrays)

    # Sending (in a sender thread) -----------------------------------------------------------------

    def _move(self, ins: Instruction, transfer: Transfer, value: Any) -> None:
        source = NamedSharding(self.meshes[transfer.src_stage], transfer.src_spec)
        check_source(transfer, value, source)
        if transfer.plan is None:  # between two chunks of one rank: it stays on the mesh
            dst = NamedSharding(self.meshes[ins.dst], transfer.dst_spec)
            self.deliver(ins.key, value if source == dst else jax.device_put(value, dst))
            return
        if not self.nccl:  # NCCL's stream waits for the value; the object store reads it now
            jax.block_until_ready(value)
        start = time.perf_counter()
        peers = self.hosts_of_stage[ins.dst]
        local = peers == (self.host,)
        if self.signal_only:
            if local:
                dst = NamedSharding(self.meshes[ins.dst], transfer.dst_spec)
                self.deliver(ins.key, self.placeholder(transfer, dst))
            elif self.host == self.hosts_of_stage[ins.src][0]:  # (one signal per transfer)
                self.signal(peers, self.step_id, ins.key)
            self._record_send(transfer, ins, start, 0)
            return
        epoch = getattr(self._local, "epoch", self.epoch)
        work = self._work(ins, transfer, self._epoch_steps.get(epoch, self.step_id))
        shards = {self._gid[s.device]: s.data for s in value.addressable_shards}
        data = self._data(work, shards, ins)
        if local:  # every op is a copy between this host's devices
            for step in work.steps:
                assert step.role == LOCAL, step
                data.local(work.ops[step.op])
            moved = self._assemble(transfer, data)
            if self.record is not None:
                jax.block_until_ready(moved)
            self._record_send(transfer, ins, start)
            self.deliver(ins.key, moved)
            return
        run_host_work(work, data, self.transport, complete=not self.nccl)
        if self.nccl:
            self._issued(work)
        self._record_send(transfer, ins, start)

    def _record_send(
        self, transfer: Transfer, ins: Instruction, start: float, nbytes: int | None = None
    ) -> None:
        if self.record is not None:
            self.record(Event.send(transfer, ins.mb, start, time.perf_counter(), nbytes))

    # Receiving (jobs started when the step begins) ------------------------------------------------

    def _post_receives(self, stages: Sequence[int]) -> None:
        if self.nccl and not self.signal_only:
            self._start_issuer()
            return
        jobs: dict[tuple[int, int], list[Instruction]] = {}
        mine = set(stages)
        schedule = self.layout.schedule
        for r in sorted({schedule.rank_of(s) for s in mine}):
            for ins in self.layout.programs[r]:
                if (
                    ins.op == RECV_OP
                    and ins.dst in mine
                    and self.host not in self.hosts_of_stage[ins.src]
                ):
                    jobs.setdefault((ins.src, ins.dst), []).append(ins)
        for items in jobs.values():
            self._receivers.submit(self._receive_in_order, items, self.epoch, self.step_id)

    def _receive_in_order(self, items: Sequence[Instruction], epoch: int, step_id: str) -> None:
        """One channel's receives of one step, in order. The job belongs to its step: once a
        later step has begun, it neither receives (that step's messages are its own job's) nor
        delivers (a late value is dropped) nor fails the new step."""
        for ins in items:
            if self.stopped or self.epoch != epoch:
                return
            try:
                self.deliver(ins.key, self._receive(ins, step_id), epoch=epoch)
                if self.record is not None:
                    now = time.perf_counter()
                    name = f"{ins.kind}{ins.tensor} s{ins.src}->s{ins.dst}"
                    self.record(Event(ins.dst, ARRIVE, ins.mb, now, now, name, dst=ins.dst))
            except BaseException as e:
                if self.stopped or self.epoch != epoch:  # woken by the failure that ended it
                    return
                error = PipelineError(
                    f"{self.where(ins.dst)}: receiving {ins}: {type(e).__name__}: {e}"
                )
                error.__cause__ = e
                self.fail(error)
                return

    def _step_deadline(self, ins: Instruction) -> float:
        """When a receiving job stops waiting for `ins`: the step's bound (its actions times
        timeout_s, from its start; see `__init__`). The consumer's RECV has the tighter, moving
        deadline (timeout_s with no progress) and names the silent stage; this one only makes
        sure no job outlives its step."""
        return self._begun_at + self._step_bound_s

    def _receive(self, ins: Instruction, step_id: str) -> Any:
        transfer = self.layout.transfers[transfer_key(ins)]
        deadline = self._step_deadline(ins)
        if self.signal_only:
            with self._cond:
                while (step_id, tuple(ins.key)) not in self._signals:
                    self._check_failure()
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise PipelineError(
                            f"{self.where(ins.dst)}: the signal of {ins} of step {step_id} "
                            f"did not come within the step's bound ({self._step_bound_s:g} s: "
                            "its actions times timeout_s)"
                        )
                    self._cond.wait(min(left, 1.0))
            dst = NamedSharding(self.meshes[ins.dst], transfer.dst_spec)
            return self.placeholder(transfer, dst)
        work = self._work(ins, transfer, step_id)
        data = self._data(work, {}, ins)
        run_host_work(work, data, self.transport, deadline=deadline)
        self.transport.forget(work.work_id)
        return self._assemble(transfer, data)

    # The NCCL issuer (one thread per step; see [Note: NCCL issue order]) ------------------------

    def _start_issuer(self) -> None:
        missing = [
            (channel, group)
            for channel, group in self._communicators
            if not self.transport.has(group, channel)  # type: ignore[attr-defined]
        ]
        if missing:
            channel, group = missing[0]
            error = PipelineError(
                f"host {self.host}: the NCCL communicator {list(group)} of channel {channel}"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                + " does not exist: it was never created, or an earlier failure aborted it and "
                "it was not created again before this step (the driver creates the "
                "communicators before every step); this is a jaxreshard bug, please report it"
            )
            self.fail(error)
            raise error
        if not self._items:
            return
        issuer = _Issuer(self._begun, getattr(self, "epoch", None))
        with self._cond:
            self._issuer = issuer
            self._nccl_works = issuer.works
        issuer.thread = threading.Thread(
            target=self._issue_loop,
            args=(issuer,),
            name=f"jaxreshard-send-nccl-h{self.host}",
            daemon=True,
        )
        issuer.thread.start()

    def _current(self, issuer: _Issuer) -> bool:
        return self._failure is None and not self._closed and issuer.step == self._begun

    def _issue_loop(self, issuer: _Issuer) -> None:
        self._local.issuer = issuer
        ins: Instruction | None = None
        try:
            for key, role in self._items:
                ins = self._instructions[key]
                transfer = self.layout.transfers[transfer_key(ins)]
                if role == SEND:
                    issuer.at = f"stage {ins.src} to hand over the value of {ins}"
                    value = self._await_value(issuer, key)
                    if value is _STOPPED:
                        return
                    self._move(ins, transfer, value)
                else:
                    issuer.at = f"room for {ins} (receives in flight: {len(issuer.receives)})"
                    if not self._await_room(issuer):
                        return
                    self._issue_receive(issuer, ins, transfer)
                self._reap(issuer)
            issuer.at = "nothing (it issued every transfer)"
        except BaseException as e:
            if self._current(issuer):
                error = PipelineError(
                    f"host {self.host}: issuing the NCCL transfer {ins}: {type(e).__name__}: {e}"
                )
                error.__cause__ = e
                self.fail(error)
        finally:
            with self._cond:
                issuer.done = True
                self._cond.notify_all()

    def _await_value(self, issuer: _Issuer, key: Key) -> Any:
        """The value a stage handed over for SEND `key` (`_STOPPED` if the step ends first);
        meanwhile, let go of what finished."""
        while True:
            with self._cond:
                if key in issuer.values:
                    return issuer.values.pop(key)
                if not self._current(issuer):
                    return _STOPPED
                self._cond.wait(self._poll_idle_s if issuer.works else 1.0)
            self._reap(issuer)

    def _await_room(self, issuer: _Issuer) -> bool:
        """Wait until fewer than `nccl_recv_window` receives are in flight: not finished on the
        GPUs, or not delivered yet (False if the step ends first)."""
        while len(issuer.receives | issuer.undelivered) >= self.nccl_recv_window:
            if not self._current(issuer):
                return False
            self._reap(issuer)
            if len(issuer.receives | issuer.undelivered) >= self.nccl_recv_window:
                time.sleep(self._poll_window_s)
        return self._current(issuer)

    def _issue_receive(self, issuer: _Issuer, ins: Instruction, transfer: Transfer) -> None:
        """Allocate a receive's buffers and issue its broadcasts (now, at its turn); JAX gets
        the result off this thread."""
        work = self._work(ins, transfer)
        data = self._data(work, {}, ins)
        run_host_work(work, data, self.transport, deadline=self._step_deadline(ins), complete=False)
        with self._cond:
            issuer.receives.add(work.work_id)
            issuer.undelivered.add(work.work_id)
        self._issued(work)
        self._receivers.submit(self._hand_over, issuer, work.work_id, ins, transfer, data)

    def _issued(self, work: HostWork) -> None:
        """Keep an issued work until its broadcasts have finished (the issuer's, whose thread
        this is)."""
        issuer = getattr(self._local, "issuer", None)
        if issuer is not None:
            with self._cond:
                issuer.works.append(work)

    def _hand_over(
        self, issuer: _Issuer, work_id: str, ins: Instruction, transfer: Transfer, data: Any
    ) -> None:
        """A received value to JAX (its reads wait for the channel's stream) and its RECV."""
        try:
            value = self._assemble(transfer, data)
            if issuer.epoch is not None:  # the executor drops a value of an earlier step
                self._local.epoch = issuer.epoch
            elif not self._current(issuer):
                return
            self.deliver(ins.key, value)
            with self._cond:
                issuer.undelivered.discard(work_id)
            if self.record is not None:
                now = time.perf_counter()
                name = f"{ins.kind}{ins.tensor} s{ins.src}->s{ins.dst}"
                self.record(Event(ins.dst, ARRIVE, ins.mb, now, now, name, dst=ins.dst))
        except BaseException as e:
            if self._current(issuer):
                error = PipelineError(
                    f"{self.where(ins.dst)}: receiving {ins}: {type(e).__name__}: {e}"
                )
                error.__cause__ = e
                self.fail(error)

    def _reap(self, issuer: _Issuer) -> None:
        """Let go of the works whose broadcasts have all finished (their buffers go now)."""
        for work in list(issuer.works):
            if self.transport.finished(work):  # type: ignore[attr-defined]
                with self._cond:
                    if work in issuer.works:
                        issuer.works.remove(work)
                    issuer.receives.discard(work.work_id)

    def close(self) -> None:
        super().close()
        issuer = self._issuer
        thread = issuer.thread if issuer is not None else None
        if thread is not None and thread is not threading.current_thread():
            thread.join(JOIN_S)
        self._receivers.shutdown(JOIN_S)


_STOPPED = object()  # `_await_value`: the step ended first


class ThreadSignal:
    """`signal` for hosts of one process (tests): deliver to the other `HostChannels` directly."""

    def __init__(self) -> None:
        self.hosts: dict[int, HostChannels] = {}

    def __call__(self, hosts: Sequence[int], step_id: str, key: tuple[Any, ...]) -> None:
        for host in hosts:
            self.hosts[host].signalled(step_id, key)
