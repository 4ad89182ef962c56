"""The TCP stream transport without Ray: hosts in threads of this process, over loopback."""

import contextlib
import dataclasses
import json
import logging
import re
import socket
import struct
import threading
import time

import jax
import numpy as np
import pytest
from helpers import cluster_over, virtual
from jax.sharding import PartitionSpec as P
from test_host_work import run_plan_on_threads

from jaxreshard.comm import _stream, plan_reshard
from jaxreshard.comm._order import RECV, SEND, Step
from jaxreshard.comm._plan import Op
from jaxreshard.comm._stream import (
    _CHALLENGE,
    _HELLO,
    _PREFIX,
    _WELCOME,
    StreamTransport,
    _proof,
)
from jaxreshard.comm._transport import HostWork

SECRET = b"s" * 32


def transports(num_hosts, secret=SECRET):
    ts = {h: StreamTransport(h, "127.0.0.1", secret=secret) for h in range(num_hosts)}
    addresses = {h: t.address for h, t in ts.items()}
    for t in ts.values():
        t.connect(addresses, None)
    return ts


def connect_as(host, listener, listening_host, secret=SECRET):
    """A raw connection to `listener` that passed the handshake as `host` (knowing `secret`)."""
    conn = socket.create_connection(listener.address, timeout=10)
    _, nonce = _CHALLENGE.unpack(conn.recv(_CHALLENGE.size, socket.MSG_WAITALL))
    mine = bytes(32)
    proof = _proof(secret, b"connect", nonce, mine, host, listening_host)
    conn.sendall(_HELLO.pack(host, mine, proof))
    (welcome,) = _WELCOME.unpack(conn.recv(_WELCOME.size, socket.MSG_WAITALL))
    assert welcome == _proof(secret, b"accept", nonce, mine, host, listening_host)
    return conn


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
    sender = StreamTransport(0, "127.0.0.1", secret=SECRET)
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
            with connect_as(0, ts[1], 1) as conn:
                conn.sendall(_PREFIX.pack(len(header), 16) + header.encode())
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
    sender = StreamTransport(0, "127.0.0.1", secret=SECRET)
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
            hellos = []

            def listen_as_host_1():  # the listener's half of the handshake
                conn, _ = peer.accept()
                conn.settimeout(30)
                nonce = bytes(range(32))
                conn.sendall(_CHALLENGE.pack(b"jrs-tcp1", nonce))
                host, theirs, _ = _HELLO.unpack(conn.recv(_HELLO.size, socket.MSG_WAITALL))
                conn.sendall(_WELCOME.pack(_proof(SECRET, b"accept", nonce, theirs, host, 1)))
                hellos.append((host, conn))

            listener = threading.Thread(target=listen_as_host_1)
            listener.start()
            later = _pair_work("w2", 0, SEND, 1, timeout_s=30)
            sender.send(later, later.steps[0], np.arange(4, dtype=np.float32))
            sender.complete(later, time.monotonic() + 30)  # written: it connected
            listener.join(30)
            ((host, conn),) = hellos
            conn.close()
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


def test_an_unknown_transport_is_refused_before_ray_starts(no_runtime):
    import ray

    from jaxreshard.runtime.ray._runtime import RayRuntime

    with pytest.raises(ValueError, match="init\\(transport='udp'\\): choose 'auto', 'tcp', "):
        RayRuntime(num_hosts=1, transport="udp")
    assert not ray.is_initialized()


# -- hostile peers (issue 25): see [Note: stream authentication] --------------------------------


def _header(work="w", op=0, region=((0, 4),), src=0, ready=0.0):
    return json.dumps(
        {"work": work, "op": op, "region": [list(r) for r in region], "src": src, "ready": ready}
    ).encode()


def _wait_for(predicate, what, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.01)


def _refusals(caplog):
    return [r.getMessage() for r in caplog.records if "refused a connection from" in r.getMessage()]


def _old_hello(listener):  # what a connection started with before: a bare host id
    with socket.create_connection(listener.address, timeout=10) as conn:
        message = _PREFIX.pack(len(_header()), 16) + _header() + bytes(16)
        conn.sendall(struct.pack("!q", 0) + message)
        _until_closed(conn)


def _claiming(host, secret):
    """Answer the challenge as `host` with `secret`, then send a message."""

    def forge(listener):
        with socket.create_connection(listener.address, timeout=10) as conn:
            _, nonce = _CHALLENGE.unpack(conn.recv(_CHALLENGE.size, socket.MSG_WAITALL))
            proof = _proof(secret, b"connect", nonce, bytes(32), host, 1)
            conn.sendall(_HELLO.pack(host, bytes(32), proof))
            with contextlib.suppress(OSError):  # closed already
                conn.sendall(_PREFIX.pack(len(_header()), 16) + _header() + bytes(16))
            _until_closed(conn)

    return forge


def _silent(listener):
    with socket.create_connection(listener.address, timeout=10) as conn:
        _until_closed(conn)


def _until_closed(conn):
    with contextlib.suppress(OSError):
        while conn.recv(1 << 16):
            pass


@pytest.mark.parametrize(
    "forge, why",
    [
        (_old_hello, "it claims to be host 0, but its proof does not match this runtime's secret"),
        (_claiming(0, b"x" * 32), "it claims to be host 0, but its proof does not match"),
        (_claiming(42, SECRET), r"it claims to be host 42, which is not one of this runtime's "),
        (_silent, "it sent no proof within 0.3 s"),
    ],
    ids=["old-hello", "wrong-secret", "host-42", "silent"],
)
def test_a_forged_connection_is_refused_and_reaches_no_mailbox(forge, why, caplog, monkeypatch):
    monkeypatch.setattr(_stream, "HANDSHAKE_TIMEOUT_S", 0.3)
    caplog.set_level(logging.WARNING, logger=_stream.__name__)
    ts = transports(2)
    try:
        forge(ts[1])  # returns once host 1 closed the connection
        _wait_for(lambda: _refusals(caplog), "the refusal's warning")
        (message,) = _refusals(caplog)  # one warning, with the address and why
        assert re.search(r"host 1: refused a connection from 127\.0\.0\.1:\d+: " + why, message)
        assert ts[1]._mailbox == {} and ts[1]._breaks == {}
        # The real host 0 still gets its slice through.
        send = _pair_work("w", 0, SEND, 1)
        ts[0].send(send, send.steps[0], np.arange(4, dtype=np.float32))
        recv = _pair_work("w", 1, RECV, 0, timeout_s=30)
        got = {}
        ts[1].recv(recv, recv.steps[0], time.monotonic() + 30, got.__setitem__)
        assert np.array_equal(got[((0, 4),)], np.arange(4, dtype=np.float32))
    finally:
        for t in ts.values():
            t.close()


@pytest.mark.parametrize(
    "prefix, header, why",
    [
        (
            _PREFIX.pack(2**20, 16),
            b"",
            r"a header of 1048576 bytes; headers are at most 65536",
        ),
        (
            None,
            _header(region=((0, 4),)),
            r"op 0 \[0:4\] of w: 20 payload bytes, but the region holds 4 x float32 = 16 bytes",
        ),
        (
            None,
            _header(region=((0, 1 << 40),)),
            r"op 0 \[0:1099511627776\] of w: not a piece this receive waits for \(\[0:4\]\)",
        ),
        (None, _header(src=2), "a header from host 2, on host 0's connection"),
        (None, b'{"work": "w"}', "a header without work, op, region, src and ready"),
        (None, _header(ready=float("inf")).replace(b"Infinity", b"1e999"), "arrival time inf"),
    ],
)
def test_a_bad_message_drops_the_connection_and_fails_the_receive(prefix, header, why, caplog):
    caplog.set_level(logging.WARNING, logger=_stream.__name__)
    ts = transports(2)
    try:
        work = _pair_work("w", 1, RECV, 0, timeout_s=30)
        taken = []
        take = ts[1]._spare.take
        ts[1]._spare.take = lambda nbytes: taken.append(nbytes) or take(nbytes)
        failure = []

        def receive():
            try:
                ts[1].recv(work, work.steps[0], time.monotonic() + 30, lambda r, a: None)
            except RuntimeError as e:
                failure.append(str(e))

        waiting = threading.Thread(target=receive)
        waiting.start()
        _wait_for(lambda: ("w", 0) in ts[1]._expected, "the receive to wait")
        with connect_as(0, ts[1], 1) as conn:  # authenticated: host 0 itself misbehaves
            conn.sendall((prefix or _PREFIX.pack(len(header), 20)) + header)
            with contextlib.suppress(OSError):
                assert conn.recv(1) == b""  # dropped
        waiting.join(30)
        (error,) = failure
        assert error.startswith("host 1: op 0 (send [0:4]) of x:f32[4]: host 0 sent a message ")
        assert re.search(why, error), error
        assert "dropped the connection" in error
        assert ts[1]._mailbox == {} and taken == []  # nothing read into a buffer
        assert any(re.search(why, r.getMessage()) for r in caplog.records)
    finally:
        for t in ts.values():
            t.close()


def test_a_message_that_came_before_its_receive_is_checked_when_taken():
    ts = transports(2)
    try:
        with connect_as(0, ts[1], 1) as conn:  # 4 float64 where the receive wants 4 float32
            conn.sendall(_PREFIX.pack(len(_header()), 32) + _header() + bytes(32))
            _wait_for(lambda: ts[1]._mailbox, "the message")
        work = _pair_work("w", 1, RECV, 0, timeout_s=30)
        with pytest.raises(
            RuntimeError,
            match=r"host 1: op 0 \(send \[0:4\]\) of x:f32\[4\]: host 0 sent \[0:4\] of it: 32 "
            r"payload bytes, but the region holds 4 x float32 = 16 bytes",
        ):
            ts[1].recv(work, work.steps[0], time.monotonic() + 30, lambda r, a: None)
    finally:
        for t in ts.values():
            t.close()


def test_a_claimed_size_nobody_waits_for_allocates_only_what_arrives():
    ts = transports(2)
    try:
        taken = []
        take = ts[1]._spare.take
        ts[1]._spare.take = lambda nbytes: taken.append(nbytes) or take(nbytes)
        claim = 4 << 40  # 1 Ti float32 elements: a consistent, absurd size
        header = _header(region=((0, 1 << 40),))
        with connect_as(0, ts[1], 1) as conn:
            conn.sendall(_PREFIX.pack(len(header), claim) + header + bytes(1000))
        _wait_for(lambda: 0 in ts[1]._breaks, "the cut message")
        assert taken == [] and ts[1]._mailbox == {}
        assert "expected 4398046511104 bytes, got 1000" in ts[1]._breaks[0][1]
    finally:
        for t in ts.values():
            t.close()


def test_a_large_payload_nobody_waits_for_yet_arrives_whole(monkeypatch):
    monkeypatch.setattr(_stream, "_EAGER_BYTES", 64)  # read in pieces of 64 bytes
    ts = transports(2)
    try:
        value = np.arange(1000, dtype=np.float32)
        op = Op("send", ((0, 1000),), value.nbytes, src_device=0, dst_devices=(1,))
        works = [
            dataclasses.replace(
                _pair_work("w", h, role, peer), shape=(1000,), ops={0: op}, timeout_s=30
            )
            for h, role, peer in ((0, SEND, 1), (1, RECV, 0))
        ]
        ts[0].send(works[0], works[0].steps[0], value)
        _wait_for(lambda: ts[1]._mailbox, "the message")  # before the receive
        got = {}
        ts[1].recv(works[1], works[1].steps[0], time.monotonic() + 30, got.__setitem__)
        assert np.array_equal(got[((0, 1000),)], value)
    finally:
        for t in ts.values():
            t.close()


@pytest.mark.parametrize(
    "opening, welcome, why",
    [
        (b"HTTP/1.1 400 Bad Request\r\n\r\n" + bytes(20), b"", "no jaxreshard stream listener"),
        (None, bytes(32), "its proof does not match this runtime's secret: whatever listens at"),
    ],
)
def test_a_host_sends_nothing_to_a_listener_that_cannot_prove_itself(opening, welcome, why):
    server = socket.create_server(("127.0.0.1", 0))
    received = []

    def serve():
        conn, _ = server.accept()
        with conn:
            conn.settimeout(5)
            conn.sendall(opening or _CHALLENGE.pack(b"jrs-tcp1", bytes(32)))
            with contextlib.suppress(OSError):  # the host may have hung up already
                conn.recv(_HELLO.size, socket.MSG_WAITALL)
                conn.sendall(welcome)
                received.append(conn.recv(1 << 16))

    threading.Thread(target=serve, daemon=True).start()
    sender = StreamTransport(0, "127.0.0.1", secret=SECRET)
    try:
        sender.connect({1: server.getsockname()}, None)
        work = _pair_work("w", 0, SEND, 1, timeout_s=30)
        with pytest.raises(RuntimeError, match=r"host 0: .*cannot connect to host 1 at .*" + why):
            sender.send(work, work.steps[0], np.zeros(4, np.float32))
            sender.complete(work, time.monotonic() + 30)
        assert received in ([], [b""])  # not one byte of the message
    finally:
        sender.close()
        server.close()


def test_hosts_of_different_runtimes_cannot_talk():
    ts = {0: StreamTransport(0, "127.0.0.1", secret=b"a" * 32)}
    ts[1] = StreamTransport(1, "127.0.0.1", secret=b"b" * 32)
    try:
        addresses = {h: t.address for h, t in ts.items()}
        for t in ts.values():
            t.connect(addresses, None)
        work = _pair_work("w", 0, SEND, 1, timeout_s=30)
        with pytest.raises(RuntimeError, match="closed the connection during the handshake"):
            ts[0].send(work, work.steps[0], np.zeros(4, np.float32))
            ts[0].complete(work, time.monotonic() + 30)
        assert ts[1]._mailbox == {}
    finally:
        for t in ts.values():
            t.close()


@pytest.mark.parametrize("secret", [b"", b"short", "a string of 32 characters......."])
def test_a_stream_transport_needs_the_runtimes_secret(secret):
    with pytest.raises(ValueError, match=r"secret must be at least 16 random bytes, got "):
        StreamTransport(0, "127.0.0.1", secret=secret)
