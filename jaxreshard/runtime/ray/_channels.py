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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

from jaxreshard.comm._order import LOCAL, SEND, host_programs
from jaxreshard.comm._transport import HostData, HostWork, Transport, run_host_work
from jaxreshard.pipeline._emit import RECV_OP, RUN, SEND_OP, Instruction
from jaxreshard.runtime.engine._channels import Channels
from jaxreshard.runtime.engine._events import ARRIVE, Event, PipelineError, transfer_key
from jaxreshard.runtime.engine._program import check_source
from jaxreshard.runtime.engine._threads import JOIN_S, DaemonPool
from jaxreshard.runtime.ray._issuing import NcclIssuing
from jaxreshard.runtime.ray._nccl_order import (
    HostsOfStage,
    Issuer,
    Key,
    hosts_of,
    nccl_channel,
    nccl_issue_plan,
)
from jaxreshard.runtime.step._layout import PipelineLayout, Transfer


class HostChannels(NcclIssuing, Channels):
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
        # Daemons that hold nothing while idle (see [Note: threads at exit], `engine/_threads.py`).
        self._receivers = DaemonPool(max(1, workers), "jaxreshard-recv")
        # Every action of a step finishes within timeout_s of the one before it or the step
        # fails (the progress deadline), so no transfer of a step arrives later than this
        # after the step began: the bound on a receiving job's wait (`_step_deadline`).
        self._step_bound_s = timeout_s * (
            1 + sum(ins.op == RUN for p in layout.programs for ins in p)
        )
        self._begun_at = time.monotonic()
        self._issuer: Issuer | None = None
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

    def close(self) -> None:
        super().close()
        issuer = self._issuer
        thread = issuer.thread if issuer is not None else None
        if thread is not None and thread is not threading.current_thread():
            thread.join(JOIN_S)
        self._receivers.shutdown(JOIN_S)


class ThreadSignal:
    """`signal` for hosts of one process (tests): deliver to the other `HostChannels` directly."""

    def __init__(self) -> None:
        self.hosts: dict[int, HostChannels] = {}

    def __call__(self, hosts: Sequence[int], step_id: str, key: tuple[Any, ...]) -> None:
        for host in hosts:
            self.hosts[host].signalled(step_id, key)
