"""The CPU transport over direct TCP streams between host actors (`transport="tcp"`).

[Note: stream transport]
Measured on the emulated cluster (`jaxreshard cluster up`, 0.1 GB/s NICs, 2026-11-23), moving
32 MiB through a chain of three hosts took 0.56-0.91 s through Ray's object store (every chunk is
an object: a `ray.put`, an actor call that hands its reference on, and a pull that asks the
owner where the object is before the object manager moves it), against 0.336 s of link time,
and the per-object cost grows as chunks shrink, so the chain cannot pipeline finely. A plain TCP
relay of the same bytes took 0.36 s. So slices travel here as length-prefixed messages over one
TCP connection per (sender, receiver) pair:
- every host listens on its node's address; the driver tells every host where the others listen;
- a sender thread per peer writes the messages in FIFO order, so a host's program queues a send
  and goes on (`complete` waits for the queue at the end of the host's part);
- a reader thread per incoming connection always drains it into buffers (reused once nothing
  holds them; mailbox by (work, op)), whatever the receiving program is doing: a send never
  waits for the receiver to reach its `recv`, and two hosts sending to each other cannot
  deadlock;
- a relay hands each chunk to its next host as soon as the chunk is here (cut-through at chunk
  granularity), so a broadcast chain pipelines with one chunk of delay per hop, as the cluster
  model's simulator assumes (`Cluster.chunk_bytes`).
A connection starts with the sending host's id; then every message is a prefix (header and
payload sizes), a JSON header (work id, op, region, sending host, emulated arrival time) and the
payload: the slice's bytes in C order, viewed as the work's dtype on arrival.

Failures are loud and not sticky. A peer that closes its connection in the middle of a message
fails the receives from it that are under way, and every receive of the work whose message was
cut, with an error naming the peer and the bytes expected and got; receives from other hosts,
and later works' receives, go on. A sender whose connection failed fails the works that had
messages on it; the next work to that peer connects afresh.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxreshard.comm._emulate import sleep_until
from jaxreshard.comm._layout import Index, format_index
from jaxreshard.comm._local import BufferPool, relative_slices
from jaxreshard.comm._order import Step
from jaxreshard.comm._transport import (
    HostWork,
    Transport,
    aborted_reason,
    expected_chunks,
    take_arrived,
)

_PREFIX = struct.Struct("!IQ")  # header bytes, payload bytes
_HELLO = struct.Struct("!q")  # what a connection starts with: the sending host's id
CONNECT_TIMEOUT_S = 30.0
_log = logging.getLogger(__name__)
_FORGOTTEN = 4096  # ids of finished works whose late messages are dropped
_SPARE_BYTES = 64 * 2**20  # received chunks' buffers kept for reuse (no page faults per chunk)


class StreamTransport(Transport):
    """Point-to-point slices over TCP between hosts (see [Note: stream transport]).

    Args:
        host: this host's id.
        ip: the address to listen on (the node's address; peers connect to it).
        book: with network emulation, `book(peer, nbytes)` returns when a transfer to `peer`
            may be used (see [Note: network emulation]); None: at once.
    """

    name = "tcp"

    def __init__(self, host: int, ip: str, book: Callable[[int, int], float] | None = None):
        self._host = host
        self._book = book
        self._server = socket.create_server((ip, 0), backlog=64)
        self.address: tuple[str, int] = tuple(self._server.getsockname()[:2])  # type: ignore[assignment]
        self._addresses: dict[int, tuple[str, int]] = {}
        self._senders: dict[int, _Sender] = {}
        self._mailbox: dict[tuple[str, int], list[tuple[Index, np.ndarray, float]]] = {}
        self._aborted: dict[str, str] = {}
        self._forgotten: collections.deque[str] = collections.deque(maxlen=_FORGOTTEN)
        self._forgotten_ids: set[str] = set()  # the same ids, for lookups
        self._spare = BufferPool(_SPARE_BYTES)
        self._cond = threading.Condition()
        self._closed = False
        # How often each peer's connection broke, and why it last did; a receive fails if it
        # breaks while the receive is under way.
        self._breaks: dict[int, tuple[int, str]] = {}
        self._lost: dict[str, str] = {}  # work id -> why a message of it was cut short
        self._connection: dict[int, int] = {}  # peer -> its latest connection's serial number
        self._serials = itertools.count()
        self._retired: list[_Sender] = []  # failed senders, until their works are done
        threading.Thread(target=self._accept, daemon=True, name=f"tcp-accept-h{host}").start()

    def connect(
        self, addresses: Mapping[int, tuple[str, int]], book: Callable[[int, int], float] | None
    ) -> None:
        """Learn where every host listens (host -> (ip, port)); connections open on first use."""
        with self._cond:
            self._addresses = {int(h): (a[0], int(a[1])) for h, a in addresses.items()}
            self._book = book
            moved = [h for h, s in self._senders.items() if s.address != self._addresses.get(h)]
            for h in moved:  # a peer that listens elsewhere now: the next send connects there
                self._retire(self._senders.pop(h))

    # -- sending ---------------------------------------------------------------------------------

    def send(self, work: HostWork, step: Step, data: Any) -> None:
        op = work.ops[step.op]
        (peer,) = step.peers
        for region in expected_chunks(work, op):
            self._post(work, step.op, peer, region, data[relative_slices(region, op.index)])

    def _post(self, work: HostWork, op: int, peer: int, region: Index, piece: np.ndarray) -> None:
        payload = np.ascontiguousarray(piece).reshape(-1).view(np.uint8)
        ready = self._book(peer, payload.nbytes) if self._book is not None else 0.0
        header = json.dumps(
            {"work": work.work_id, "op": op, "region": region, "src": self._host, "ready": ready}
        ).encode()
        try:
            self._sender(peer, work).put(
                work.work_id, _PREFIX.pack(len(header), payload.nbytes) + header, payload
            )
        except ConnectionError as e:  # the connection to `peer` failed earlier
            raise RuntimeError(f"host {self._host}: {work.describe or work.work_id}: {e}") from None

    def _sender(self, peer: int, work: HostWork) -> _Sender:
        with self._cond:
            sender = self._senders.get(peer)
            if sender is not None and sender.failed and not sender.lost(work.work_id):
                # Its connection failed during an earlier work: this one connects afresh.
                self._retire(self._senders.pop(peer))
                sender = None
            if sender is None:
                if peer not in self._addresses:
                    raise RuntimeError(
                        f"host {self._host}: {work.describe or work.work_id} sends to host "
                        f"{peer}, whose listening address this host was never told (known: "
                        f"{sorted(self._addresses)}); the runtime must call connect() first"
                    )
                sender = _Sender(self, peer, self._addresses[peer])
                self._senders[peer] = sender
            return sender

    def _retire(self, sender: _Sender) -> None:
        """Stop using `sender` (under `_cond`); its works still hear how it failed."""
        sender.close()
        self._retired = [s for s in self._retired if s.busy()]
        self._retired.append(sender)

    def complete(self, work: HostWork, deadline: float) -> None:
        """Wait until every message of `work` this host queued is written to its connection."""
        with self._cond:
            senders = [*self._senders.values(), *self._retired]
        for sender in senders:
            sender.wait(work, deadline)

    # -- receiving -------------------------------------------------------------------------------

    def recv(
        self,
        work: HostWork,
        step: Step,
        deadline: float,
        write: Callable[[Index, Any], None],
        forward_to: tuple[int, ...] = (),
    ) -> None:
        import jax

        op = work.ops[step.op]
        dtype = jax.numpy.dtype(work.dtype)
        missing = set(expected_chunks(work, op))
        peer = step.peers[0]
        with self._cond:
            breaks = self._breaks.get(peer, (0, ""))[0]  # the peer's breaks before this receive

        def broken() -> str | None:  # (under `_cond`)
            count, why = self._breaks.get(peer, (0, ""))
            return self._lost.get(work.work_id) or (why if count != breaks else None)

        while missing:
            arrived = take_arrived(
                self._cond, self._mailbox, work, step, deadline, self._aborted, broken
            )
            for region, raw, ready in arrived:
                sleep_until(ready)  # the emulated transfer has ended (0: no emulation)
                array = raw.view(dtype).reshape([b - a for a, b in region])
                for peer in forward_to:  # hand the chunk on before copying it here
                    self._post(work, step.op, peer, region, array)
                write(region, array)
                missing.discard(region)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(
                target=self._read, args=(conn,), daemon=True, name=f"tcp-read-h{self._host}"
            ).start()

    def _read(self, conn: socket.socket) -> None:
        peer: int | None = None
        serial = -1
        with conn:
            try:
                hello = _recv_exactly(conn, _HELLO.size, what="the sending host's id")
                if hello is None:
                    return  # connected and closed at once
                (peer,) = _HELLO.unpack(hello)
                with self._cond:
                    serial = next(self._serials)
                    self._connection[peer] = serial
                self._read_messages(conn)
            except Exception as e:  # the waits for this peer hear it, instead of timing out
                who = f"host {peer}" if peer is not None else "a peer"
                if isinstance(e, _Truncated):
                    why = (
                        f"{who} closed its connection to host {self._host} in the middle of a "
                        f"message ({e.what}: expected {e.expected} bytes, got {e.got})"
                    )
                else:
                    why = f"receiving from {who} failed: {type(e).__name__}: {e}"
                why += "; what it was sending is lost (its next work connects again)"
                if peer is None:  # it carried no message: nobody waits for it
                    _log.warning("host %d: %s", self._host, why)
                    return
                with self._cond:
                    work = getattr(e, "work", None)
                    if work is not None:
                        self._lost[work] = why
                    if self._connection.get(peer) == serial:  # not after a newer connection
                        self._breaks[peer] = (self._breaks.get(peer, (0, ""))[0] + 1, why)
                    self._cond.notify_all()

    def _read_messages(self, conn: socket.socket) -> None:
        while True:
            prefix = _recv_exactly(conn, _PREFIX.size, what="a message's sizes")
            if prefix is None:
                return  # the peer closed its end between messages
            header_bytes, nbytes = _PREFIX.unpack(prefix)
            text = _recv_exactly(
                conn, header_bytes, what=f"the header of a {nbytes}-byte message", eof=False
            )
            header = json.loads(bytes(text))  # type: ignore[arg-type]
            region = tuple(tuple(r) for r in header["region"])
            raw = self._spare.take(nbytes)
            message = f"op {header['op']} {format_index(region)} of {header['work']}"
            try:
                _recv_exactly(
                    conn,
                    nbytes,
                    into=memoryview(raw),
                    what=f"the payload of {message}",
                    eof=False,
                )
            except (OSError, _Truncated) as e:
                e.work = header["work"]  # type: ignore[attr-defined]
                raise
            with self._cond:
                if self._is_forgotten(header["work"]):
                    continue
                self._mailbox.setdefault((header["work"], header["op"]), []).append(
                    (region, raw, header["ready"])
                )
                self._cond.notify_all()

    # -- failures and cleanup --------------------------------------------------------------------

    def abort(self, work_id: str, reason: str = "a peer failed") -> None:
        """Wake the waits of `work_id` and of every work under it (`work_id:...`: a pipeline
        step's transfers) with an error; their queued sends are dropped."""
        with self._cond:
            self._aborted[work_id] = reason
            self._cond.notify_all()
            senders = list(self._senders.values())
        for sender in senders:
            sender.wake()

    def aborted(self, work_id: str) -> str | None:
        return aborted_reason(self._aborted, work_id)

    def forget(self, work_id: str) -> None:
        """Drop what is left of `work_id` and of the works under it; their late messages too."""

        def mine(w: str) -> bool:
            return w == work_id or w.startswith(work_id + ":")

        with self._cond:
            for table in (self._aborted, self._lost):
                for work in [w for w in table if mine(w)]:
                    del table[work]
            for key in [k for k in self._mailbox if mine(k[0])]:
                del self._mailbox[key]
            if len(self._forgotten) == self._forgotten.maxlen:
                self._forgotten_ids.discard(self._forgotten[0])
            self._forgotten.append(work_id)
            self._forgotten_ids.add(work_id)
            retired = list(self._retired)
        for sender in retired:
            sender.forget(mine)

    def _is_forgotten(self, work_id: str) -> bool:
        parts = work_id.split(":")
        return any(":".join(parts[:i]) in self._forgotten_ids for i in range(1, len(parts) + 1))

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):  # wakes the accepting thread; then no one listens
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()
        with self._cond:
            senders = [*self._senders.values(), *self._retired]
            self._senders.clear()
            self._retired.clear()
        for sender in senders:
            sender.close()


class _Sender:
    """One peer's connection and the thread that writes to it, messages in FIFO order."""

    def __init__(self, owner: StreamTransport, peer: int, address: tuple[str, int]):
        self._owner, self.peer, self.address = owner, peer, address
        self._queue: collections.deque[tuple[str, bytes, np.ndarray] | None] = collections.deque()
        self._pending: dict[str, int] = {}  # work id -> messages not yet written
        self._error: str | None = None
        self._lost: set[str] = set()  # works with messages unwritten when the connection failed
        self._cond = threading.Condition()
        self._sock: socket.socket | None = None
        threading.Thread(
            target=self._run, daemon=True, name=f"tcp-send-h{owner._host}-to-h{peer}"
        ).start()

    @property
    def failed(self) -> bool:
        return self._error is not None

    def lost(self, work_id: str) -> bool:
        """Whether messages of `work_id` were lost when the connection failed."""
        with self._cond:
            return work_id in self._lost

    def busy(self) -> bool:
        with self._cond:
            return bool(self._pending)

    def forget(self, mine: Callable[[str], bool]) -> None:
        """Drop the unwritten messages of the works `mine` selects (a failed sender)."""
        with self._cond:
            if self._error is not None:
                for work_id in [w for w in self._pending if mine(w)]:
                    del self._pending[work_id]

    def put(self, work_id: str, head: bytes, payload: np.ndarray) -> None:
        with self._cond:
            if self._error is not None:
                raise ConnectionError(self._error)
            self._queue.append((work_id, head, payload))
            self._pending[work_id] = self._pending.get(work_id, 0) + 1
            self._cond.notify_all()

    def wait(self, work: HostWork, deadline: float) -> None:
        with self._cond:
            while self._pending.get(work.work_id):
                if self._error is not None:
                    raise RuntimeError(f"host {work.host}: {work.describe}: {self._error}")
                if self._owner.aborted(work.work_id) is not None:
                    return  # aborted: the caller hears why from its own wait
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"host {work.host}: sending {work.describe or work.work_id} to host "
                        f"{self.peer} ({self._pending[work.work_id]} messages left) did not "
                        f"finish within {work.timeout_s:g} s"
                    )
                self._cond.wait(min(max(deadline - time.monotonic(), 0.001), 1.0))

    def wake(self) -> None:
        """Let waits re-check (a work was aborted: its queued messages are skipped)."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._queue.append(None)
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            self._sock = socket.create_connection(self.address, timeout=CONNECT_TIMEOUT_S)
            self._sock.settimeout(None)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.sendall(_HELLO.pack(self._owner._host))
        except OSError as e:
            self._fail(f"cannot connect to host {self.peer} at {self.address}: {e}")
            return
        with self._sock:
            while True:
                with self._cond:
                    while not self._queue:
                        self._cond.wait()
                    item = self._queue.popleft()
                if item is None:
                    return
                work_id, head, payload = item
                if self._owner.aborted(work_id) is None:
                    try:
                        self._sock.sendall(head)
                        self._sock.sendall(memoryview(payload))
                    except OSError as e:
                        self._fail(f"sending to host {self.peer} at {self.address} failed: {e}")
                        return
                with self._cond:
                    left = self._pending[work_id] - 1
                    if left:
                        self._pending[work_id] = left
                    else:
                        del self._pending[work_id]
                    self._cond.notify_all()

    def _fail(self, error: str) -> None:
        with self._cond:
            self._error = f"{error} (the next work to host {self.peer} connects again)"
            self._lost = set(self._pending)
            # What is still queued never goes out: let its payloads go.
            self._queue = collections.deque(item for item in self._queue if item is None)
            self._cond.notify_all()


class _Truncated(ConnectionError):
    """The peer closed its connection in the middle of a message."""

    def __init__(self, what: str, expected: int, got: int):
        super().__init__(f"{what}: expected {expected} bytes, got {got}")
        self.what, self.expected, self.got = what, expected, got


def _recv_exactly(
    conn: socket.socket,
    nbytes: int,
    into: memoryview | None = None,
    *,
    what: str,
    eof: bool = True,
) -> bytes | memoryview | None:
    """Read exactly `nbytes` (into `into` if given). A peer that closes before the first byte:
    None where a message may end there (`eof`); a peer that closes after it, or where a message
    may not end: `_Truncated` naming `what` and the bytes expected and got."""
    view = into if into is not None else memoryview(bytearray(nbytes))
    got = 0
    while got < nbytes:
        n = conn.recv_into(view[got:], nbytes - got)  # OSError: the connection failed
        if n == 0:
            if got == 0 and eof:
                return None
            raise _Truncated(what, nbytes, got)
        got += n
    return view if into is not None else bytes(view)
