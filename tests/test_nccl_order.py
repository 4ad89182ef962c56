"""One NCCL issue order across communicators (issue 19), against the stand-in, which now holds
a device to its collectives' issue order as a GPU does (tests/nccl_standin.py): ranks that issue
two communicators' ops in different orders deadlock there, and it says so.

- the stand-in: an order-violating issue deadlocks and is named, a consistent one runs;
- the static check (`comm._order.check_issue_order`, `check_nccl_items`): what it refuses;
- the pipeline: the order the emitter's programs give runs, every device issues exactly it, the
  order the old free-running receive jobs gave is refused and deadlocks, receive buffers are
  allocated at their turn, and after an abort mid-step the communicators are made again (by the
  Ray driver's own code) and the next step runs.
"""

import re
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cluster_over, virtual
from jax.sharding import PartitionSpec as P
from nccl_standin import StandinBackend, World
from test_executor import compiled_step, run
from test_parallelize import make_batch, make_params, make_step, reference

import jaxreshard as jr
from jaxreshard.comm import plan_reshard
from jaxreshard.comm._layout import device_key
from jaxreshard.comm._nccl import DeviceData, NcclTransport
from jaxreshard.comm._order import Collective, OrderError, check_issue_order, host_programs
from jaxreshard.comm._transport import HostWork
from jaxreshard.runtime.engine._events import PipelineError
from jaxreshard.runtime.local._pipeline import LocalPipeline
from jaxreshard.runtime.ray._channels import HostChannels, ThreadSignal
from jaxreshard.runtime.ray._nccl_order import (
    RECV,
    SEND,
    check_nccl_items,
    nccl_issue_plan,
    nccl_programs,
)
from jaxreshard.runtime.ray._runtime import RayRuntime

# -- the stand-in -------------------------------------------------------------------------------


def two_hosts(cpu_devices, world):
    """Device 0 on host 0, device 1 on host 1, and two communicators over both: channels 'x'
    and 'y' (as two pipeline channels between the same devices)."""
    plan = plan_reshard(
        (8, 4), "float32", virtual((1,), P(), 0, 1), virtual((1,), P(), 1, 1),
        cluster=cluster_over(2, 1),
    )  # fmt: skip
    transports = {h: NcclTransport({h: cpu_devices[h]}, StandinBackend(world)) for h in range(2)}
    for channel in "xy":
        uid = world.unique_id()
        for t in transports.values():
            t.create((0, 1), uid, channel)
    programs = host_programs(plan, collectives=True)
    x = jnp.arange(32.0).reshape(8, 4)

    def issue(h, channel):
        """Host h's side of a transfer of x on `channel`: queued, not waited for."""
        steps = tuple(programs[h])
        work = HostWork(
            f"w{channel}", h, plan.shape, plan.dtype, steps, {s.op: plan.ops[s.op] for s in steps},
            {0: plan.src.indices[0]} if h == 0 else {}, {1: plan.dst.indices[0]} if h == 1 else {},
            "", "", 5.0, describe=f"tensor {channel}",
        )  # fmt: skip
        src = {0: jax.device_put(x, cpu_devices[0])} if h == 0 else {}
        data = DeviceData(work, src, {h: cpu_devices[h]}, transports[h], channel)
        for step in steps:
            transports[h].collective(work, step, data, time.monotonic() + 5)
        return work, data

    return transports, issue, x


def test_the_standin_deadlocks_on_two_communicators_issued_in_different_orders(cpu_devices):
    """Host 0 issues x then y, host 1 y then x: on a GPU each device spins in its first
    collective, waiting for the other, which spins in its own. The stand-in finds the cycle
    (within a second, not a hang) and aborts both communicators with an error naming each device,
    the op it is blocked in and the one it waits for."""
    world = World()
    transports, issue, _ = two_hosts(cpu_devices, world)
    works, errors = {}, []

    def host(h, order):
        works[h] = [issue(h, channel)[0] for channel in order]

    host(0, "xy")
    host(1, "yx")
    start = time.monotonic()
    for h, ws in works.items():
        for work in ws:
            try:
                transports[h].complete(work, time.monotonic() + 10)
            except RuntimeError as e:
                errors.append(str(e))
    assert time.monotonic() - start < 5
    assert errors and world.deadlocks, "the stand-in let an order violation through"
    message = world.deadlocks[0]
    assert "deadlock across communicators" in message
    assert "device 0 is blocked in op 0 (send [0:8, 0:4]) of tensor x" in message
    assert "device 1 is blocked in op 0 (send [0:8, 0:4]) of tensor y" in message
    assert "(x)" in message and "(y)" in message  # the communicators' channels
    assert any("NCCL reported an error on communicator [0, 1]" in e for e in errors), errors


def test_the_standin_runs_two_communicators_issued_in_one_order(cpu_devices):
    world = World()
    transports, issue, x = two_hosts(cpu_devices, world)
    issued = {h: [issue(h, channel) for channel in "xy"] for h in range(2)}
    for h, pairs in issued.items():
        for work, _ in pairs:
            transports[h].complete(work, time.monotonic() + 10)
    for _, data in issued[1]:
        np.testing.assert_array_equal(np.asarray(data.finish()[1]), np.asarray(x))
    assert not world.deadlocks


# -- the static check ---------------------------------------------------------------------------


def c(name, channel, *ranks):
    return Collective(name, f"{list(ranks)} ({channel})", ranks)


def test_check_issue_order_names_the_two_ops_communicators_and_devices():
    x = c("op 0 of act0 mb0 s0->s1", "s0->s1", 0, 1)
    y = c("op 0 of grad0 mb0 s1->s0", "s1->s0", 0, 1)
    check_issue_order({0: [x, y], 1: [x, y]})
    with pytest.raises(OrderError) as info:
        check_issue_order({0: [x, y], 1: [y, x]}, host_of=lambda d: d)
    assert str(info.value) == (
        "inconsistent NCCL issue order: device 0 (host 0) issues op 0 of act0 mb0 s0->s1 "
        "(communicator [0, 1] (s0->s1)) before op 0 of grad0 mb0 s1->s0 (communicator [0, 1] "
        "(s1->s0)), but device 1 (host 1), a member of both, issues them the other way round; the "
        "two communicators would deadlock; this is a jaxreshard bug, please report it"
    )


def test_check_issue_order_finds_cycles_and_missing_members():
    # Every pair of collectives shares one device only, and still: a waits in z for c, c in y
    # for b, b in x for a.
    x, y, z = c("x", "p", 0, 1), c("y", "q", 1, 2), c("z", "r", 2, 0)
    check_issue_order({0: [x, z], 1: [x, y], 2: [y, z]})
    with pytest.raises(
        OrderError,
        match=r"would deadlock across communicators: device 0 waits "
        r"in z .*device 1 waits in x .*device 2 waits in y .*jaxreshard bug",
    ):
        check_issue_order({0: [z, x], 1: [x, y], 2: [y, z]})
    with pytest.raises(
        OrderError,
        match=r"x on communicator \[0, 1\] \(p\) is issued by device 0 "
        r"but never by its member\(s\) device 1 \(it would hang\)",
    ):
        check_issue_order({0: [x], 1: []})


# -- the pipeline -------------------------------------------------------------------------------


def nccl_hosts(entry, world=None):
    """`HostChannels` of one emulated host per mesh over the NCCL stand-in (as
    tests/test_executor.py's `emulated_hosts`), and a stand-in for the Ray driver: the real
    `RayRuntime._ensure_communicators` / `_abort` over fake host actors."""
    compiled = entry.pipeline.compiled
    layout, meshes = compiled.layout, compiled.meshes
    host_of_stage = {s: layout.schedule.rank_of(s) for s in range(layout.num_stages)}
    stages_of = {
        h: [s for s, hh in host_of_stage.items() if hh == h] for h in set(host_of_stage.values())
    }
    devices = {
        h: {device_key(d): d for d in meshes[ss[0]].devices.flat} for h, ss in stages_of.items()
    }
    world = world or World()
    transports = {h: NcclTransport(devices[h], StandinBackend(world)) for h in devices}

    def remote(fn):
        return types.SimpleNamespace(remote=fn)

    actors = [
        types.SimpleNamespace(
            nccl_unique_id=remote(t.unique_id),
            nccl_create=remote(t.create),
            abort=remote(t.abort),
        )
        for _, t in sorted(transports.items())
    ]
    driver = types.SimpleNamespace(
        _communicators=set(),
        cluster=compiled.cluster,
        actors=actors,
        _wait=lambda calls, what, *args, **kwargs: dict(calls),
    )

    def ensure():  # what `RayPipeline.run` does before every step
        for channel, programs in nccl_programs(layout, host_of_stage):
            RayRuntime._ensure_communicators(driver, programs, channel)

    ensure()  # (RayPipeline.__init__)
    signal = ThreadSignal()
    channels = {
        h: HostChannels(
            layout,
            host=h,
            host_of_stage=host_of_stage,
            devices=devices[h],
            meshes={s: meshes[s] for s in stages_of[h]},
            transport=transports[h],
            signal=signal,
            timeout_s=compiled.config.timeout_s,
        )
        for h in devices
    }
    signal.hosts.update(channels)
    pipeline = LocalPipeline(compiled, {s: channels[h] for s, h in host_of_stage.items()})
    return types.SimpleNamespace(
        pipeline=pipeline,
        channels=channels,
        transports=transports,
        world=world,
        layout=layout,
        host_of_stage=host_of_stage,
        ensure=ensure,
        abort=lambda step_id, reason: RayRuntime._abort(driver, step_id, reason),
    )


LABEL = re.compile(r"^op (\d+) \(.*?\) of (?:SEND|RECV) (\S+(?: mb\d+)? s\d+->s\d+) of step ")


@pytest.mark.parametrize(
    "schedule, v", [("1f1b", None), ("interleaved_1f1b", 2)]
)  # (gpipe, zbv, eager-1F1B and zb-h1 run in tests/test_executor.py)
def test_the_emitted_order_runs_and_every_device_issues_it(schedule, v):
    """Skip connections, a shared parameter, virtual stages: the plan passes its checks, a step
    runs over the stand-in (which would stop a violation: `world.deadlocks`), and every device
    issued exactly the collectives of the static plan in its order, on all communicators."""
    num_stages = 4 if v else 3
    _, entry, leaves = compiled_step(
        num_stages, num_micro_batches=4, schedule=schedule, virtual_stages=v
    )
    hosts = nccl_hosts(entry)
    plan = nccl_issue_plan(hosts.layout, hosts.host_of_stage)
    assert len({c.communicator for cs in plan.devices.values() for c in cs}) > 2
    _, losses = run(hosts.pipeline, entry, leaves, steps=1)
    np.testing.assert_allclose(losses, reference(num_stages, True, True)[1][:1], rtol=1e-5)
    assert not hosts.world.deadlocks
    devices = {d: h for h, t in hosts.transports.items() for d in t.devices}
    for d, h in devices.items():
        device = hosts.transports[h].devices[d]
        issued = [
            "op {} of {}".format(*LABEL.match(label).groups())
            for label in hosts.world.issued.get(device, [])
        ]
        assert issued == [col.name for col in plan.devices.get(d, [])], d


def free_running_items(plan):
    """The order the old runtime gave on its hosts' devices: every receive posted when the step
    begins (one job per channel), then the sends as their values came."""
    return {
        h: [item for item in items if item[1] == RECV] + [i for i in items if i[1] != RECV]
        for h, items in plan.items.items()
    }


def test_the_free_running_order_is_refused_and_deadlocks_the_standin():
    _, entry, leaves = compiled_step(2, num_micro_batches=4, schedule="1f1b", timeout_s=30.0)
    hosts = nccl_hosts(entry)
    plan = nccl_issue_plan(hosts.layout, hosts.host_of_stage)
    items = free_running_items(plan)
    with pytest.raises(
        OrderError,
        match=r"inconsistent NCCL issue order: device \d \(host \d\) "
        r"issues op 0 of .* before op 0 of .*jaxreshard bug",
    ):
        check_nccl_items(hosts.layout, hosts.host_of_stage, items)
    for h, ch in hosts.channels.items():  # run it anyway
        ch._items, ch.nccl_recv_window = items[h], 1000
    start = time.monotonic()
    with pytest.raises(PipelineError):
        hosts.pipeline.run(leaves)
    assert time.monotonic() - start < 10  # found, not waited out (timeout_s is 30 s)
    assert hosts.world.deadlocks
    failures = " ".join(str(ch._failure) for ch in hosts.channels.values())
    assert re.search(
        r"NCCL reported an error on communicator \[.*\]: NCCL stand-in: async error: deadlock "
        r"across communicators: device \d+ is blocked in op 0 .* of (SEND|RECV) \w+ mb\d s\d->s\d",
        failures,
    ), failures


def test_receive_buffers_are_allocated_at_their_turn():
    """GPipe's last stage receives every micro-batch's activations (two tensors each) before it
    sends anything: the old runtime allocated all of them when the step began; the issuer
    allocates one at its turn, with at most `nccl_recv_window` receives in flight."""
    _, entry, leaves = compiled_step(3, num_micro_batches=4, schedule="gpipe")
    hosts = nccl_hosts(entry)
    last = hosts.channels[2]
    lock, live, peak, total = threading.Lock(), [0], [0], [0]
    real_data, real_deliver = last._data, last.deliver

    def data(work, shards, ins):
        if not shards:  # a receive's buffers
            with lock:
                live[0] += 1
                total[0] += 1
                peak[0] = max(peak[0], live[0])
        return real_data(work, shards, ins)

    def deliver(key, value, *args, **kwargs):
        if hosts.host_of_stage[key[3]] != 2:
            with lock:
                live[0] -= 1
        return real_deliver(key, value, *args, **kwargs)

    last._data, last.deliver = data, deliver
    run(hosts.pipeline, entry, leaves, steps=1)
    assert total[0] == 9  # act0 and act1 of 4 micro-batches, and the shared parameter
    assert live[0] == 0
    assert peak[0] <= HostChannels.nccl_recv_window  # (the old runtime: 3, one per channel)


def test_after_an_abort_mid_step_the_communicators_are_made_again_and_the_next_step_runs():
    _, entry, leaves = compiled_step(3, num_micro_batches=4, schedule="1f1b", timeout_s=30.0)
    hosts = nccl_hosts(entry)
    compiler = hosts.pipeline.engine.runner.programs[1].compilers[1]
    real, calls = compiler.call, []

    def broken(name, *args):
        calls.append(name)
        if name == "forward" and calls.count("forward") == 2:  # micro-batch 1: mid-step
            time.sleep(0.2)  # (transfers of micro-batch 0 are in flight or done)
            raise FloatingPointError("injected")
        return real(name, *args)

    compiler.call = broken
    with pytest.raises(PipelineError, match="injected"):
        hosts.pipeline.run(leaves)
    compiler.call = real
    hosts.abort("local:0", "host 1 failed")  # the driver, on the failed step call
    assert not any(t.comms for t in hosts.transports.values())
    # Without new communicators the next step says so at once (it used to hang or fail mid-step).
    with pytest.raises(
        PipelineError,
        match=r"communicator \[.*\] of channel s\d->s\d .*does not "
        r"exist: .*aborted",
    ):
        hosts.pipeline.run(leaves)
    hosts.ensure()  # `RayPipeline.run`, before the next step
    assert all(t.comms for t in hosts.transports.values())
    _, losses = run(hosts.pipeline, entry, leaves, steps=1)
    np.testing.assert_allclose(losses, reference(3, True, True)[1][:1], rtol=1e-5)
    assert not hosts.world.deadlocks


def test_the_issue_plan_of_stages_that_span_hosts():
    """A stage that spans hosts (see [Note: multi-host stages]): every host of the sending
    stage issues its side of each SEND and every host of the receiving stage its side of each
    RECV, in the one order, and the plan passes its checks (order across communicators, and a
    simulation of every host's issuer)."""
    cfg = jr.PipelineConfig(
        stage_mesh_shape=(1, 2),
        mesh_axis_names=("data", "model"),
        num_micro_batches=4,
        schedule="1f1b",
        devices_per_host=1,  # every device a host: each stage's mesh spans two
        backend="local",
    )
    step = jr.parallelize(make_step(3, skip=True, shared=True), config=cfg, batch_argnums=(1,))
    entry, _ = step._entry((make_params(3), make_batch()))
    compiled = entry.pipeline.compiled
    host_of = compiled.cluster.host_of
    hosts_of_stage = {
        s: tuple(sorted({host_of(device_key(d)) for d in mesh.devices.flat}))
        for s, mesh in enumerate(compiled.meshes)
    }
    assert all(len(hs) == 2 for hs in hosts_of_stage.values())
    plan = nccl_issue_plan(compiled.layout, hosts_of_stage, recv_window=2)
    for kind, tensor, mb, src, dst in plan.order:
        key = (kind, tensor, mb, src, dst)
        for h in hosts_of_stage[src]:
            assert (key, SEND) in plan.items[h]
        for h in hosts_of_stage[dst]:
            assert (key, RECV) in plan.items[h]
    assert set(plan.items) == {h for hs in hosts_of_stage.values() for h in hs}
    # The lead host alone standing for each stage leaves the others' devices out of collectives
    # they are members of: the static check refuses it.
    leads = {s: hs[:1] for s, hs in hosts_of_stage.items()}
    with pytest.raises(OrderError, match=r"is issued by .* but never by its member\(s\) device"):
        nccl_issue_plan(compiled.layout, leads)
