"""Channels of the stages one host runs: boundary tensors within the host and to other hosts.

A host (a Ray host actor, or a test's stand-in for one) runs some stages of a pipeline. For a
transfer to a stage of the same host, the sender thread runs the transfer's plan (all its ops are
local copies) and delivers. For a transfer between hosts, each side runs its part of the plan's
host programs (`comm._order.host_programs`) over the host's transport: TCP streams to the other
host actors (on CPU; the plan's broadcast chain relayed chunk by chunk), Ray's object store, or
NCCL (one broadcast per op, on the channel's own streams and communicators). Receives from
other hosts are started when the step begins, one job per channel (source stage -> this stage)
in program order, off the compute threads (see [Note: boundary tensors]). Nothing here imports
Ray: the transports and `signal` carry it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
from jax.sharding import NamedSharding

from jaxreshard.comm._order import LOCAL, OrderError, host_programs
from jaxreshard.comm._transport import HostData, HostWork, Transport, run_host_work
from jaxreshard.pipeline._emit import RECV_OP, SEND_OP, Instruction
from jaxreshard.runtime._executor import (
    ARRIVE,
    Channels,
    Event,
    PipelineError,
    check_source,
    transfer_key,
)
from jaxreshard.runtime._layout import PipelineLayout, Transfer

# Receiving jobs wait for a sender that may legitimately be a whole step away; a failure
# anywhere aborts them, and the consumer's RECV has the real deadline (timeout_s).
_FAR = 7 * 24 * 3600.0


def nccl_channel(src_stage: int, dst_stage: int) -> str:
    """The NCCL channel (communicators and streams) of transfers from one stage to another."""
    return f"s{src_stage}->s{dst_stage}"


def nccl_programs(
    layout: PipelineLayout, host_of_stage: Mapping[int, int]
) -> list[tuple[str, dict[int, list[Any]]]]:
    """Per NCCL channel (stage -> stage), the host programs of its cross-host transfers: what
    its communicators are made from."""
    out: dict[str, dict[int, list[Any]]] = {}
    for (_, _, src, dst), t in sorted(layout.transfers.items()):
        if host_of_stage[src] == host_of_stage[dst]:
            continue
        merged = out.setdefault(nccl_channel(src, dst), {})
        for h, steps in host_programs(t.plan, collectives=True).items():
            merged.setdefault(h, []).extend(steps)
    return sorted(out.items())


def check_channel_order(layout: PipelineLayout) -> None:
    """On NCCL a channel's transfers meet in issue order: a stage's SENDs to another stage must
    come in the order of that stage's RECVs (see [Note: NCCL transport])."""
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


class HostChannels(Channels):
    """Channels of the stages this host runs (see the module docstring).

    Args:
        layout: the step.
        host: this host's index.
        host_of_stage: every stage's host.
        devices: this host's devices by global id.
        meshes: the meshes of this host's stages.
        transport: an `ObjectStoreTransport` or an `NcclTransport` of this host.
        signal: `signal(host, step_id, key)` calls `signalled(step_id, key)` on that host's
            channels (signal-only steps).
        timeout_s: the longest wait for any transfer.
    """

    def __init__(
        self,
        layout: PipelineLayout,
        *,
        host: int,
        host_of_stage: Mapping[int, int],
        devices: Mapping[int, Any],
        meshes: Mapping[int, Any],
        transport: Transport,
        signal: Callable[[int, str, tuple[Any, ...]], None],
        timeout_s: float,
    ):
        super().__init__(layout, timeout_s)
        self.host, self.host_of_stage = host, dict(host_of_stage)
        self.devices, self.meshes = dict(devices), dict(meshes)
        self.transport, self.signal = transport, signal
        self.nccl = transport.name == "nccl"
        self.step_id = "idle"
        self._gid = {d: g for g, d in self.devices.items()}
        self._steps: dict[tuple[str, int, int, int], tuple[Any, ...]] = {}
        self._signals: set[tuple[str, tuple[Any, ...]]] = set()
        self._nccl_works: list[HostWork] = []
        self._receivers = ThreadPoolExecutor(max_workers=16, thread_name_prefix="jaxreshard-recv")

    def where(self, stage: int) -> str:
        return f"stage {stage} (host {self.host_of_stage[stage]})"

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
        super().begin(stages, step_id=step_id, record=record, signal_only=signal_only)

    def end(self) -> None:
        try:
            super().end()
            deadline = time.monotonic() + self.timeout_s
            for work in self._nccl_works:  # NCCL transfers queued this step, to completion
                self.transport.complete(work, deadline)
        except PipelineError:
            raise
        except BaseException as e:
            error = PipelineError(f"host {self.host}: {type(e).__name__}: {e}")
            error.__cause__ = e
            self.fail(error)
            raise error from e

    def signalled(self, step_id: str, key: tuple[Any, ...]) -> None:
        """A peer's signal-only transfer `key` of step `step_id` has been sent."""
        with self._cond:
            self._signals.add((step_id, tuple(key)))
            self._cond.notify_all()

    def _on_failure(self, error: BaseException) -> None:
        self.transport.abort(self.step_id, f"host {self.host}: {error}")

    # Work descriptions ----------------------------------------------------------------------------

    def _work(self, ins: Instruction, transfer: Transfer) -> HostWork:
        key = transfer_key(ins)
        steps = self._steps.get(key)
        if steps is None:
            programs = host_programs(transfer.plan, collectives=self.nccl)
            steps = self._steps[key] = tuple(programs.get(self.host, ()))
        plan = transfer.plan
        own = self.devices
        kind, tensor, mb, src, dst = ins.key
        return HostWork(
            work_id=f"{self.step_id}:{kind}{tensor}:mb{mb}:s{src}->s{dst}",
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
            describe=f"{ins} of step {self.step_id}",
        )

    def _data(self, work: HostWork, shards: Mapping[int, Any], ins: Instruction) -> Any:
        if self.nccl:
            from jaxreshard.comm._nccl import DeviceData

            channel = nccl_channel(ins.src, ins.dst)
            return DeviceData(work, shards, self.devices, self.transport, channel)  # type: ignore[arg-type]
        return HostData(work, shards, self.devices)

    def _assemble(self, transfer: Transfer, data: Any) -> jax.Array:
        sharding = NamedSharding(self.meshes[transfer.dst_stage], transfer.dst_spec)
        shards = data.finish()
        arrays = [shards[self._gid[d]] for d in sharding.mesh.devices.flat]
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
        peer = self.host_of_stage[ins.dst]
        if self.signal_only:
            if peer == self.host:
                dst = NamedSharding(self.meshes[ins.dst], transfer.dst_spec)
                self.deliver(ins.key, self.placeholder(transfer, dst))
            else:
                self.signal(peer, self.step_id, ins.key)
            self._record_send(transfer, ins, start, 0)
            return
        work = self._work(ins, transfer)
        shards = {self._gid[s.device]: s.data for s in value.addressable_shards}
        data = self._data(work, shards, ins)
        if peer == self.host:  # every op is a copy between this host's devices
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
            with self._cond:
                self._nccl_works.append(work)
        self._record_send(transfer, ins, start)

    def _record_send(
        self, transfer: Transfer, ins: Instruction, start: float, nbytes: int | None = None
    ) -> None:
        if self.record is not None:
            self.record(Event.send(transfer, ins.mb, start, time.perf_counter(), nbytes))

    # Receiving (jobs started when the step begins) ------------------------------------------------

    def _post_receives(self, stages: Sequence[int]) -> None:
        jobs: dict[tuple[int, int], list[Instruction]] = {}
        mine = set(stages)
        schedule = self.layout.schedule
        for r in sorted({schedule.rank_of(s) for s in mine}):
            for ins in self.layout.programs[r]:
                if (
                    ins.op == RECV_OP
                    and ins.dst in mine
                    and self.host_of_stage[ins.src] != self.host
                ):
                    jobs.setdefault((ins.src, ins.dst), []).append(ins)
        for items in jobs.values():
            self._receivers.submit(self._receive_in_order, items)

    def _receive_in_order(self, items: Sequence[Instruction]) -> None:
        for ins in items:
            if self.stopped:
                return
            try:
                self.deliver(ins.key, self._receive(ins))
                if self.record is not None:
                    now = time.perf_counter()
                    name = f"{ins.kind}{ins.tensor} s{ins.src}->s{ins.dst}"
                    self.record(Event(ins.dst, ARRIVE, ins.mb, now, now, name, dst=ins.dst))
            except BaseException as e:
                if self.stopped:  # woken by the failure that stopped the step
                    return
                error = PipelineError(
                    f"{self.where(ins.dst)}: receiving {ins}: {type(e).__name__}: {e}"
                )
                error.__cause__ = e
                self.fail(error)
                return

    def _receive(self, ins: Instruction) -> Any:
        transfer = self.layout.transfers[transfer_key(ins)]
        if self.signal_only:
            with self._cond:
                while (self.step_id, tuple(ins.key)) not in self._signals:
                    self._check_failure()
                    self._cond.wait(1.0)
            dst = NamedSharding(self.meshes[ins.dst], transfer.dst_spec)
            return self.placeholder(transfer, dst)
        work = self._work(ins, transfer)
        data = self._data(work, {}, ins)
        deadline = time.monotonic() + _FAR
        run_host_work(work, data, self.transport, deadline=deadline, complete=not self.nccl)
        if self.nccl:  # queued: JAX's reads of the result wait for the channel's stream
            with self._cond:
                self._nccl_works.append(work)
        else:
            self.transport.forget(work.work_id)
        return self._assemble(transfer, data)

    def close(self) -> None:
        super().close()
        self._receivers.shutdown(wait=False, cancel_futures=True)


class ThreadSignal:
    """`signal` for hosts of one process (tests): deliver to the other `HostChannels` directly."""

    def __init__(self) -> None:
        self.hosts: dict[int, HostChannels] = {}

    def __call__(self, host: int, step_id: str, key: tuple[Any, ...]) -> None:
        self.hosts[host].signalled(step_id, key)
