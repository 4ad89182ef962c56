"""The TCP stream transport without Ray: hosts in threads of this process, over loopback."""

import json
import socket
import threading
import time

import jax
import numpy as np
import pytest
from helpers import cluster_over, virtual
from jax.sharding import PartitionSpec as P
from test_host_work import run_plan_on_threads

from jaxreshard.comm import plan_reshard
from jaxreshard.comm._order import RECV, SEND, Step
from jaxreshard.comm._plan import Op
from jaxreshard.comm._stream import _HELLO, _PREFIX, StreamTransport
from jaxreshard.comm._transport import HostWork


def transports(num_hosts):
    ts = {h: StreamTransport(h, "127.0.0.1") for h in range(num_hosts)}
    addresses = {h: t.address for h, t in ts.items()}
    for t in ts.values():
        t.connect(addresses, None)
    return ts


@pytest.mark.parametrize("strategy", ["broadcast_greedy", "send_recv", "allgather"])
@pytest.mark.parametrize("chunk_bytes", [64, 1 << 20])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bool"])
def test_stream_transport_delivers_every_shard(cpu_devices, strategy, chunk_bytes, dtype):
    # Source on hosts 0-1, replicated destination on hosts 2-4: broadcast chains with relays.
    src = virtual((2, 2), P(None, "a"), 0, 2)
    dst = virtual((3, 2), P(None, "b"), 4, 2)
    plan = plan_reshard((6, 8), dtype, src, dst, cluster=cluster_over(10, 2), strategy=strategy)
    reference = (np.arange(48) % 7).astype(jax.numpy.dtype(dtype)).reshape(6, 8)
    devices = {d: cpu_devices[d] for d in range(10)}
    src_arrays = {
        d: jax.device_put(reference[tuple(slice(a, b) for a, b in i)], devices[d])
        for d, i in zip(plan.src.devices, plan.src.indices)
    }
    ts = transports(5)
    try:
        results = run_plan_on_threads(plan, src_arrays, devices, chunk_bytes, ts)
    finally:
        for t in ts.values():
            t.close()
    for d, index in zip(plan.dst.devices, plan.dst.indices):
        want = reference[tuple(slice(a, b) for a, b in index)]
        assert np.array_equal(np.asarray(results[d]), want)


def _pair_work(work_id, host, role, peer, timeout_s=0.5):
    op = Op("send", ((0, 4),), 16, src_device=0, dst_devices=(1,))
    return HostWork(
        work_id=work_id,
        host=host,
        shape=(4,),
        dtype="float32",
        steps=(Step(0, role, peers=(peer,)),),
        ops={0: op},
        src_regions={0: ((0, 4),)} if role == SEND else {},
        dst_regions={1: ((0, 4),)} if role == RECV else {},
        src_array="a",
        dst_array="b",
        timeout_s=timeout_s,
        describe="x:f32[4]",
    )


def test_a_missing_slice_times_out_naming_the_op_and_peer():
    ts = transports(2)
    try:
        work = _pair_work("w", 1, RECV, 0)
        with pytest.raises(
            TimeoutError,
            match=r"host 1: op 0 \(send \[0:4\]\) of x:f32\[4\].*"
            r"waited 0.5 s for the slice from host 0",
        ):
            ts[1].recv(work, work.steps[0], time.monotonic() + 0.5, lambda r, a: None)
    finally:
        for t in ts.values():
            t.close()


def test_abort_wakes_a_waiting_receive_of_the_work_or_of_one_under_it():
    ts = transports(2)
    try:
        # A pipeline step's transfers are works under the step's id: aborting the step aborts them.
        work = _pair_work("step3:act0:mb1", 1, RECV, 0, timeout_s=30)
        threading.Timer(0.2, ts[1].abort, args=("step3", "host 0 failed")).start()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="aborted while waiting for host 0: host 0 failed"):
            ts[1].recv(work, work.steps[0], time.monotonic() + 30, lambda r, a: None)
        assert time.monotonic() - start < 20
    finally:
        for t in ts.values():
            t.close()


def test_sending_to_a_host_that_does_not_listen_fails_with_its_address():
    sender = StreamTransport(0, "127.0.0.1")
    with socket.socket() as bound:  # a port that is taken but where nobody listens
        bound.bind(("127.0.0.1", 0))
        sender.connect({0: sender.address, 1: bound.getsockname()}, None)
        work = _pair_work("w", 0, SEND, 1, timeout_s=30)
        try:
            with pytest.raises(RuntimeError, match=r"host 0: .*cannot connect to host 1 at"):
                sender.send(work, work.steps[0], np.zeros(4, np.float32))
                sender.complete(work, time.monotonic() + 30)
        finally:
            sender.close()


def test_a_peer_that_closes_mid_message_fails_its_receives_and_later_works_go_on():
    ts = transports(3)
    try:
        work = _pair_work("w", 1, RECV, 0, timeout_s=30)
        header = json.dumps({"work": "w", "op": 0, "region": [[0, 4]], "src": 0, "ready": 0.0})

        def cut_short():  # host 0 sends 5 of a message's 16 payload bytes, then closes
            with socket.create_connection(ts[1].address) as conn:
                conn.sendall(_HELLO.pack(0) + _PREFIX.pack(len(header), 16) + header.encode())
                conn.sendall(bytes(5))

        threading.Timer(0.2, cut_short).start()
        message = (
            r"host 1: op 0 \(send \[0:4\]\) of x:f32\[4\]: host 0 closed its connection to host 1 "
            r"in the middle of a message \(the payload of op 0 \[0:4\] of w: expected 16 "
            r"bytes, got 5\); what it was sending is lost"
        )
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=message):  # at once, not after 30 s
            ts[1].recv(work, work.steps[0], time.monotonic() + 30, lambda r, a: None)
        assert time.monotonic() - start < 10
        with pytest.raises(RuntimeError, match=message):  # that work's message stays lost
            ts[1].recv(work, work.steps[0], time.monotonic() + 30, lambda r, a: None)
        # Not sticky: the next work of host 0 (a new connection) and host 2's work arrive.
        for src, work_id in ((0, "w2"), (2, "v")):
            send = _pair_work(work_id, src, SEND, 1)
            ts[src].send(send, send.steps[0], np.arange(4, dtype=np.float32))
            recv = _pair_work(work_id, 1, RECV, src, timeout_s=30)
            got = {}
            ts[1].recv(recv, recv.steps[0], time.monotonic() + 30, got.__setitem__)
            assert np.array_equal(got[((0, 4),)], np.arange(4, dtype=np.float32))
    finally:
        for t in ts.values():
            t.close()


def test_a_failed_connection_fails_its_work_and_the_next_work_connects_again():
    sender = StreamTransport(0, "127.0.0.1")
    with socket.socket() as peer:  # host 1's port, where nobody listens yet
        peer.bind(("127.0.0.1", 0))
        sender.connect({1: peer.getsockname()}, None)
        work = _pair_work("w", 0, SEND, 1, timeout_s=30)
        try:
            with pytest.raises(
                RuntimeError,
                match=r"host 0: .*cannot connect to host 1 at .*the next work to host 1 "
                r"connects again",
            ):
                sender.send(work, work.steps[0], np.zeros(4, np.float32))
                sender.complete(work, time.monotonic() + 30)
            peer.listen()
            later = _pair_work("w2", 0, SEND, 1, timeout_s=30)
            sender.send(later, later.steps[0], np.arange(4, dtype=np.float32))
            sender.complete(later, time.monotonic() + 30)  # written: it connected
            conn, _ = peer.accept()
            with conn:
                conn.settimeout(30)
                (host,) = _HELLO.unpack(conn.recv(_HELLO.size, socket.MSG_WAITALL))
                assert host == 0
        finally:
            sender.close()


def test_late_messages_of_a_forgotten_work_are_dropped():
    ts = transports(2)
    try:
        ts[1].forget("step2")  # the step is over: nothing of it (or under it) is kept
        for work_id in ("step2", "step2:grad0:mb3"):
            work = _pair_work(work_id, 0, SEND, 1)
            ts[0].send(work, work.steps[0], np.ones(4, np.float32))
            ts[0].complete(work, time.monotonic() + 10)
        kept = _pair_work("step20:x", 0, SEND, 1)  # not under "step2"
        ts[0].send(kept, kept.steps[0], np.ones(4, np.float32))
        ts[0].complete(kept, time.monotonic() + 10)
        deadline = time.monotonic() + 10
        while not ts[1]._mailbox and time.monotonic() < deadline:
            time.sleep(0.01)
        assert list(ts[1]._mailbox) == [("step20:x", 0)]
    finally:
        for t in ts.values():
            t.close()


def test_an_unknown_transport_is_refused_before_ray_starts():
    import ray

    from jaxreshard.runtime._ray import RayRuntime

    with pytest.raises(ValueError, match="init\\(transport='udp'\\): choose 'auto', 'tcp', "):
        RayRuntime(num_hosts=1, transport="udp")
    assert not ray.is_initialized()
