"""The per-host data plane without Ray: hosts in threads, an in-process transport."""

import threading
import time

import jax
import numpy as np
import pytest
from helpers import cluster_over, virtual
from jax.sharding import PartitionSpec as P

from jaxreshard.comm import plan_reshard
from jaxreshard.comm._emulate import LinkEmulator
from jaxreshard.comm._order import check_programs, host_programs
from jaxreshard.comm._transport import (
    HostData,
    HostWork,
    Transport,
    expected_chunks,
    run_host_work,
)


class ThreadTransport(Transport):
    """Hosts of one process exchange chunks through a shared mailbox (a test double for the
    object store: same contract, no Ray)."""

    name = "threads"

    def __init__(self, host, mailbox, cond):
        self.host, self.mailbox, self.cond = host, mailbox, cond

    def send(self, work, step, data):
        op = work.ops[step.op]
        (peer,) = step.peers
        for region in expected_chunks(work, op):
            rel = tuple(slice(a - r, b - r) for (a, b), (r, _) in zip(region, op.index))
            self._put(peer, step.op, region, np.array(data[rel]))

    def _put(self, peer, op, region, array):
        with self.cond:
            self.mailbox.setdefault((peer, op), []).append((region, array))
            self.cond.notify_all()

    def flush(self, work):
        pass

    def recv(self, work, step, deadline, write, forward_to=()):
        missing = set(expected_chunks(work, work.ops[step.op]))
        while missing:
            with self.cond:
                while not self.mailbox.get((self.host, step.op)):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"host {self.host}: op {step.op} never arrived")
                    self.cond.wait(0.05)
                arrived = self.mailbox.pop((self.host, step.op))
            for region, array in arrived:
                for peer in forward_to:
                    self._put(peer, step.op, region, array)
                write(region, array)
                missing.discard(region)


def run_plan_on_threads(plan, src_arrays, devices, chunk_bytes, transports=None):
    """Run every host's program in a thread of this process; `transports` (host -> transport)
    default to `ThreadTransport`s over one shared mailbox."""
    programs = host_programs(plan)
    check_programs(programs, plan.cluster)
    mailbox, cond = {}, threading.Condition()
    if transports is None:
        transports = {h: ThreadTransport(h, mailbox, cond) for h in range(plan.cluster.num_hosts)}
    results, errors = {}, []

    def host(h):
        own = set(plan.cluster.hosts[h])
        work = HostWork(
            work_id="w",
            host=h,
            shape=plan.shape,
            dtype=plan.dtype,
            steps=tuple(programs.get(h, ())),
            ops={s.op: plan.ops[s.op] for s in programs.get(h, ())},
            src_regions={d: i for d, i in zip(plan.src.devices, plan.src.indices) if d in own},
            dst_regions={d: i for d, i in zip(plan.dst.devices, plan.dst.indices) if d in own},
            src_array="a",
            dst_array="b",
            timeout_s=20,
            chunk_bytes=chunk_bytes,
        )
        try:
            data = HostData(work, src_arrays, devices)
            run_host_work(work, data, transports[h])
            results.update(data.finish())
        except Exception as e:  # surfaced below
            errors.append(e)
        finally:
            if hasattr(transports[h], "forget"):
                transports[h].forget(work.work_id)

    threads = [threading.Thread(target=host, args=(h,)) for h in range(plan.cluster.num_hosts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("strategy", ["broadcast_greedy", "send_recv", "allgather"])
@pytest.mark.parametrize("chunk_bytes", [64, 1 << 20])
def test_host_programs_deliver_every_shard(cpu_devices, strategy, chunk_bytes):
    # Source on hosts 0-1, replicated destination on hosts 2-4: broadcast chains with relays.
    src = virtual((2, 2), P(None, "a"), 0, 2)
    dst = virtual((3, 2), P(None, "b"), 4, 2)
    plan = plan_reshard((6, 8), "float32", src, dst, cluster=cluster_over(10, 2), strategy=strategy)
    reference = np.arange(48, dtype=np.float32).reshape(6, 8)
    devices = {d: cpu_devices[d] for d in range(10)}
    src_arrays = {
        d: jax.device_put(reference[tuple(slice(a, b) for a, b in i)], devices[d])
        for d, i in zip(plan.src.devices, plan.src.indices)
    }
    results = run_plan_on_threads(plan, src_arrays, devices, chunk_bytes)
    for d, index in zip(plan.dst.devices, plan.dst.indices):
        assert np.array_equal(
            np.asarray(results[d]), reference[tuple(slice(a, b) for a, b in index)]
        )
        assert results[d].devices() == {devices[d]}


def test_link_emulator_books_nics():
    emulator = LinkEmulator(gbytes_per_s=1.0)  # 1 byte per ns
    t0 = 100.0
    assert emulator.reserve(0, 1, 1000, not_before=t0) == (t0, t0 + 1e-6)
    # Host 0's NIC-out is busy until t0 + 1us, so a second send from it queues behind.
    start, end = emulator.reserve(0, 2, 1000, not_before=t0)
    assert start == pytest.approx(t0 + 1e-6) and end == pytest.approx(t0 + 2e-6)
    # Full duplex: host 1 may send while receiving; host 3 -> 4 is independent.
    assert emulator.reserve(1, 3, 1000, not_before=t0)[0] == t0
    assert emulator.reserve(3, 4, 1000, not_before=t0)[0] == pytest.approx(t0 + 1e-6)
    with pytest.raises(ValueError, match="must be > 0"):
        LinkEmulator(0)
