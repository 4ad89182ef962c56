"""The local runtime's channels: boundary tensors between stages of this process."""

from __future__ import annotations

import itertools
import time
from typing import Any

import jax

from jaxreshard._jax_compat import copy_shards, shard_for_shard
from jaxreshard.comm import Cluster, Plan
from jaxreshard.comm._emulate import LinkEmulator
from jaxreshard.comm._local import execute_local
from jaxreshard.pipeline._emit import Instruction
from jaxreshard.runtime.engine._channels import Channels, is_ready
from jaxreshard.runtime.engine._events import Event, transfer_key
from jaxreshard.runtime.engine._program import check_source
from jaxreshard.runtime.engine._threads import wait_ready
from jaxreshard.runtime.local._compiled import CompiledPipeline
from jaxreshard.runtime.step._layout import Transfer


class LocalChannels(Channels):
    """Boundary tensors between stages of this process (see [Note: boundary tensors]).

    A transfer moves in the sending stage's thread, asynchronously, where JAX can make the copy
    without waiting for the value (see [Note: one dispatching thread]): a copy shard for shard
    (`copy_shards`), or a small plan run by device copies; a large plan whose value does not
    exist yet goes to a sender thread, which runs it by the CPU fast path
    (`comm._local.execute_local`) once the value exists. Profiles (`record`) and network
    emulation move everything in sender threads, where a transfer can be timed or delayed."""

    # A plan of at most this many bytes runs by asynchronous device copies when its value is not
    # ready yet (the CPU fast path would wait for it).
    async_bytes = 4 << 20

    def __init__(self, compiled: CompiledPipeline):
        super().__init__(compiled.layout, compiled.config.timeout_s)
        self.c = compiled
        gbps = compiled.config.emulate_network_gbps
        if gbps is None:
            self.inline_bytes = 1 << 20
        self._emulator = (
            LinkEmulator(gbps, compiled.cluster.latency_s) if gbps is not None else None
        )
        self._shardings = {
            key: (
                compiled.sharding(t.src_stage, t.src_spec),
                compiled.sharding(t.dst_stage, t.dst_spec),
            )
            for key, t in compiled.transfers.items()
        }
        self._whole = {
            key: t.plan is not None and shard_for_shard(*self._shardings[key], t.shape)
            for key, t in compiled.transfers.items()
        }

    @property
    def threaded(self) -> bool:
        """Whether transfers (and so the stages) need threads of their own this step."""
        return self.record is not None or self._emulator is not None

    def moves_inline(self, ins: Instruction, transfer: Transfer, value: Any) -> bool:
        if transfer.plan is None:
            return True
        if self.threaded:
            return super().moves_inline(ins, transfer, value)
        return (
            self.signal_only
            or self._whole[transfer_key(ins)]
            or transfer.nbytes <= self.async_bytes
            or (transfer.nbytes <= self.inline_bytes and is_ready(value))
        )

    def _move(self, ins: Instruction, transfer: Transfer, value: Any) -> None:
        src, dst = self._shardings[transfer_key(ins)]
        check_source(transfer, value, src)
        if transfer.plan is None:  # between two chunks of one rank: it stays on the mesh
            self.deliver(ins.key, value if src == dst else jax.device_put(value, dst))
            return
        if not self.threaded:
            if self.signal_only:
                moved = self.placeholder(transfer, dst)
            elif self._whole[transfer_key(ins)]:
                moved = (
                    copy_shards(value, dst) if value.sharding == src else jax.device_put(value, dst)
                )
            elif is_ready(value) or transfer.nbytes > self.async_bytes:
                moved = execute_local(transfer.plan, value, dst)
            else:
                moved = execute_local(transfer.plan, value, dst, path="devices")
            self.deliver(ins.key, moved)
            return
        if not wait_ready(value, self.abandoned):  # (polling: see [Note: threads at exit])
            return
        start = time.perf_counter()
        ready = 0.0
        if self.signal_only:
            moved = self.placeholder(transfer, dst)
        else:
            moved = execute_local(transfer.plan, value, dst)
            if self._emulator is not None:
                # The receiver, not this thread, sleeps until the emulated hops end.
                ready = emulated_end(self._emulator, self.c.cluster, transfer.plan)
        if self.record is not None:
            jax.block_until_ready(moved)  # (our own copy: it ends; a poll would blur its time)
            end = time.perf_counter() + max(0.0, ready - time.monotonic())
            nbytes = 0 if self.signal_only else None
            self.record(Event.send(transfer, ins.mb, start, end, nbytes))
        self.deliver(ins.key, moved, ready)


def emulated_end(emulator: LinkEmulator, cluster: Cluster, plan: Plan) -> float:
    """When a plan's cross-host hops would end on the emulated NICs (see
    [Note: network emulation])."""
    host = cluster.host_of
    end = 0.0
    for op in plan.ops:
        if op.kind == "allgather":
            continue
        chain = (op.src_device, *op.dst_devices)
        for a, b in itertools.pairwise(chain):
            if host(a) != host(b):
                end = max(end, emulator.reserve(host(a), host(b), op.nbytes)[1])
    return end
