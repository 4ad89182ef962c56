"""NCCL transport: its multi-rank logic against an in-process stand-in with NCCL's blocking
semantics (everywhere), and the real CuPy/NCCL calls where a GPU is (tests/test_gpu.py)."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cluster_over, virtual
from jax.sharding import PartitionSpec as P
from nccl_standin import StandinBackend, World

from jaxreshard.comm import plan_reshard
from jaxreshard.comm._nccl import DeviceData, NcclTransport, expected_bytes, group_ranks
from jaxreshard.comm._order import COLLECTIVE, check_programs, host_programs
from jaxreshard.comm._transport import HostWork, run_host_work


def test_group_ranks_follow_sorted_device_ids():
    assert group_ranks((9, 2, 5, 7), [5, 7, 8]) == [(5, 1), (7, 2)]
    assert group_ranks((3,), [3]) == [(3, 0)]


def test_collective_steps_name_their_communicator():
    plan = plan_reshard(
        (8, 4),
        "bfloat16",
        virtual((2,), P("a"), 0, 2),
        virtual((2,), P(), 2, 1),
        cluster=cluster_over(4, 2),
    )
    programs = host_programs(plan, collectives=True)
    groups = {s.group for steps in programs.values() for s in steps if s.role == COLLECTIVE}
    assert groups and all(set(g) <= set(range(4)) and g == tuple(sorted(g)) for g in groups)
    step = next(s for steps in programs.values() for s in steps if s.role == COLLECTIVE)
    work = HostWork(
        "w", 0, plan.shape, plan.dtype, (step,), {step.op: plan.ops[step.op]}, {}, {}, "a", "b", 1.0
    )
    shape, nbytes = expected_bytes(work, step.op)
    assert nbytes == int(np.prod(shape)) * 2


# -- the multi-rank logic, against the stand-in -------------------------------------------------


class Hosts:
    """Every host of a plan's cluster as an `NcclTransport` over the stand-in, in one process;
    plan device d is CPU device d."""

    def __init__(self, plan, cpu_devices, timeout_s=20.0, programs=None):
        self.plan, self.timeout_s = plan, timeout_s
        self.world = World()
        self.programs = programs or host_programs(plan, collectives=True)
        self.devices = {
            h: {d: cpu_devices[d] for d in ids} for h, ids in enumerate(plan.cluster.hosts)
        }
        self.backends = {h: StandinBackend(self.world) for h in self.devices}
        self.transports = {
            h: NcclTransport(self.devices[h], self.backends[h]) for h in self.devices
        }
        self.create()

    def create(self):
        groups = sorted({s.group for steps in self.programs.values() for s in steps if s.group})
        for group in groups:
            uid = self.world.unique_id()
            for h in sorted({self.plan.cluster.host_of(d) for d in group}):
                self.transports[h].create(group, uid)

    def work(self, h, work_id="w"):
        plan, steps = self.plan, tuple(self.programs.get(h, ()))
        own = set(self.devices[h])
        return HostWork(
            work_id,
            h,
            plan.shape,
            plan.dtype,
            steps,
            {s.op: plan.ops[s.op] for s in steps},
            {d: i for d, i in zip(plan.src.devices, plan.src.indices) if d in own},
            {d: i for d, i in zip(plan.dst.devices, plan.dst.indices) if d in own},
            "",
            "",
            self.timeout_s,
            describe=f"test tensor ({work_id})",
        )

    def data(self, h, x, work_id="w"):
        work = self.work(h, work_id)
        src = {
            d: jax.device_put(x[tuple(slice(a, b) for a, b in i)], self.devices[h][d])
            for d, i in work.src_regions.items()
        }
        return work, DeviceData(work, src, self.devices[h], self.transports[h])

    def run(self, x, work_id="w"):
        """Every host's part in its own thread; the destination shards by device."""
        results, errors = {}, []

        def host(h):
            try:
                work, data = self.data(h, x, work_id)
                run_host_work(work, data, self.transports[h])
                results.update(data.finish())
            except BaseException as e:
                errors.append((h, e))

        threads = [threading.Thread(target=host, args=(h,)) for h in self.devices]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout_s + 30)
        return results, errors


def check_result(plan, x, results):
    assert sorted(results) == sorted(plan.dst.devices)
    for d, index in zip(plan.dst.devices, plan.dst.indices):
        want = np.asarray(x)[tuple(slice(a, b) for a, b in index)]
        np.testing.assert_array_equal(np.asarray(results[d]), want)


CASES = {  # name: (src mesh, src spec, dst mesh, dst spec, shape, dtype)
    "one_to_many": ((1,), P(), (2, 2), P(), (8, 6), "float32"),
    "transpose": ((2, 2), P(None, ("a", "b")), (4,), P("a"), (8, 8), "bfloat16"),
    "partial_replicas": ((2, 2), P("a"), (2, 2), P(None, "b"), (4, 6), "int32"),
    "many_to_many": ((4,), P("a"), (2, 2), P(("a", "b")), (12, 2), "float32"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_broadcasts_deliver_every_slice_across_hosts(cpu_devices, case):
    src_mesh, src_spec, dst_mesh, dst_spec, shape, dtype = CASES[case]
    n = int(np.prod(src_mesh))
    plan = plan_reshard(
        shape,
        dtype,
        virtual(src_mesh, src_spec, 0, 2),
        virtual(dst_mesh, dst_spec, n + n % 2, 2),
        cluster=cluster_over(n + n % 2 + int(np.prod(dst_mesh)), 2),
    )
    x = jnp.arange(np.prod(shape), dtype=dtype).reshape(shape)
    hosts = Hosts(plan, cpu_devices)
    check_programs(hosts.programs, plan.cluster)
    results, errors = hosts.run(x)
    assert not errors, errors
    check_result(plan, x, results)
    # Every op crossing hosts was one broadcast on each member.
    issued = sum(b.broadcasts for b in hosts.backends.values())
    assert issued == sum(
        1 for steps in hosts.programs.values() for s in steps if s.role == COLLECTIVE
    ) + sum(
        len(set(s.group) & set(hosts.devices[h])) - 1
        for h, steps in hosts.programs.items()
        for s in steps
        if s.role == COLLECTIVE
    )


def test_contiguous_slices_are_received_in_place(cpu_devices):
    """A slice that is a contiguous block of its destination shard is received straight into it:
    no copies queued on the receiving host."""
    plan = plan_reshard(
        (8, 6),
        "float32",
        virtual((2,), P("a"), 0, 2),
        virtual((2,), P("a"), 2, 1),
        cluster=cluster_over(4, 2),
    )
    x = jnp.arange(48.0).reshape(8, 6)
    hosts = Hosts(plan, cpu_devices)
    results, errors = hosts.run(x)
    assert not errors
    check_result(plan, x, results)
    assert hosts.backends[1].copies == 0


def test_ops_are_queued_without_waiting_for_peers(cpu_devices):
    """`collective` only enqueues: one host issues all its broadcasts while its peers have not
    started (NCCL would block the GPU stream, not the host); completion waits on events."""
    plan = plan_reshard(
        (16, 4),
        "float32",
        virtual((2,), P("a"), 0, 2),
        virtual((2, 2), P(None, "b"), 2, 2),
        cluster=cluster_over(6, 2),
    )
    x = jnp.arange(64.0).reshape(16, 4)
    hosts = Hosts(plan, cpu_devices)
    work, data = hosts.data(0, x)
    deadline = time.monotonic() + 20
    for step in work.steps:
        hosts.transports[0].collective(work, step, data, deadline)  # returns: nothing waits
    assert hosts.transports[0]._pending["w"]["ops"]
    results, errors = {}, []

    def receiver(h):
        try:
            w, d = hosts.data(h, x)
            run_host_work(w, d, hosts.transports[h])
            results.update(d.finish())
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=receiver, args=(h,)) for h in (1, 2)]
    for t in threads:
        t.start()
    hosts.transports[0].complete(work, deadline)
    for t in threads:
        t.join(30)
    assert not errors
    check_result(plan, x, results)


def test_a_divergent_order_times_out_names_the_op_and_recovers(cpu_devices):
    """Two transfers on one communicator issued in different orders by its members hang in NCCL
    (the sizes differ, so no member's broadcast meets its peer's): each wait ends at the deadline
    with an error naming the op and the silent peers, the communicators are aborted, and new
    ones work."""

    def plan(rows):
        return plan_reshard(
            (rows, 4),
            "float32",
            virtual((1,), P(), 0, 1),
            virtual((1,), P(), 1, 1),
            cluster=cluster_over(2, 1),
        )

    plans = {"a": plan(8), "b": plan(4)}
    hosts = Hosts(plans["a"], cpu_devices, timeout_s=1.0)
    xs = {k: jnp.arange(p.shape[0] * 4.0).reshape(p.shape) for k, p in plans.items()}
    errors = []

    def host(h, order):
        pieces = []
        for key in order:
            hosts.plan = plans[key]
            work, data = hosts.data(h, xs[key], work_id=key)
            for step in work.steps:
                hosts.transports[h].collective(work, step, data, time.monotonic() + 1.0)
            pieces.append(work)
        for work in pieces:
            try:
                hosts.transports[h].complete(work, time.monotonic() + 1.0)
            except BaseException as e:
                errors.append(e)

    peer = threading.Thread(target=host, args=(1, "ba"))
    peer.start()
    host(0, "ab")
    peer.join(30)
    messages = " ".join(map(str, errors))
    assert any(isinstance(e, TimeoutError) for e in errors)
    assert "did not finish within 1 s; waiting for devices [" in messages
    assert "communicators were aborted" in messages
    assert all("test tensor (" in str(e) for e in errors), messages
    assert not hosts.transports[0].comms
    for transport in hosts.transports.values():  # made anew, one order works
        transport.abort("old", "start over")
    hosts.plan = plans["a"]
    hosts.create()
    results, errors = hosts.run(xs["a"], "again")
    assert not errors
    check_result(plans["a"], xs["a"], results)


def test_abort_wakes_a_blocked_wait(cpu_devices):
    plan = plan_reshard(
        (8, 4),
        "float32",
        virtual((1,), P(), 0, 1),
        virtual((1,), P(), 1, 1),
        cluster=cluster_over(2, 1),
    )
    hosts = Hosts(plan, cpu_devices, timeout_s=30.0)
    x = jnp.ones((8, 4))
    work, data = hosts.data(0, x)
    for step in work.steps:
        hosts.transports[0].collective(work, step, data, time.monotonic() + 30)
    threading.Timer(0.2, hosts.transports[0].abort, args=("w", "host 1 died")).start()
    with pytest.raises(RuntimeError, match="aborted while in flight: host 1 died"):
        hosts.transports[0].complete(work, time.monotonic() + 30)  # not a TimeoutError


def test_mismatched_buffers_are_refused_before_the_broadcast(cpu_devices):
    plan = plan_reshard(
        (8, 4),
        "float32",
        virtual((1,), P(), 0, 1),
        virtual((1,), P(), 1, 1),
        cluster=cluster_over(2, 1),
    )
    hosts = Hosts(plan, cpu_devices)
    work, data = hosts.data(0, jnp.ones((8, 4)))
    region, view = data.views[0]
    data.views[0] = (region, view[:, :2])  # a shard that is too small
    with pytest.raises(ValueError, match="refusing to start the broadcast"):
        hosts.transports[0].collective(work, work.steps[0], data, time.monotonic() + 5)
    assert hosts.backends[0].broadcasts == 0


def test_transport_explains_missing_cupy(monkeypatch):
    import builtins

    from jaxreshard.comm import _nccl

    real_import = builtins.__import__

    def no_cupy(name, *args, **kwargs):
        if name.startswith("cupy"):
            raise ImportError("No module named 'cupy'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    with pytest.raises(RuntimeError, match=r"pip install 'jaxreshard\[gpu\]'.*gpu-cuda13"):
        _nccl.cupy_modules()
