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
A connection starts with a handshake (see [Note: stream authentication]); then every message is
a prefix (header and payload sizes), a JSON header (work id, op, region, sending host, emulated
arrival time) and the payload: the slice's bytes in C order, viewed as the work's dtype on
arrival.

[Note: stream authentication]
Every host listens on its node's address, where anything that reaches that address can connect,
so a connection must prove that it comes from a host of this runtime before anything it sends is
read as a message (a connection that only claimed a host id once got a forged slice into a
step's mailbox). The driver makes a secret of 32 random bytes when the runtime starts and hands
it to every host actor through Ray (`HostActor.open_stream`); it never travels on these
connections. The listener sends a fresh random nonce; the connecting host answers with its host
id, a nonce of its own and HMAC-SHA256(secret, "connect" || both nonces || both host ids); the
listener checks the proof (`hmac.compare_digest`) and that the id is one of the hosts the driver
introduced (`connect`), then answers with its own proof ("accept"), so the connecting host knows
it reached a host of its runtime, not whatever now listens at that address. Fresh nonces make a
recorded handshake worthless. A connection that fails, or says nothing within
`HANDSHAKE_TIMEOUT_S`, is closed and logged once with its address and why. One handshake per
connection (two round trips before the first message, once per pair of hosts), none per
message. After it, a message is checked before its payload is read: the header is at most
`MAX_HEADER_BYTES`, well-formed, from the host that proved itself, and the payload is the size
its region holds (exactly the receive's chunk and dtype once that receive is waiting, else a
whole number of elements of some dtype, checked exactly when the receive takes it). A payload
nobody waits for yet that is larger than `_EAGER_BYTES` is read in pieces as its bytes arrive,
so a header cannot make this host allocate much more than the peer really sends. A violation
drops the connection with a logged reason and fails the receives it affects, naming the peer.

Failures are loud and not sticky. A peer that closes its connection in the middle of a message
fails the receives from it that are under way, and every receive of the work whose message was
cut, with an error naming the peer and the bytes expected and got; receives from other hosts,
and later works' receives, go on. A sender whose connection failed fails the works that had
messages on it; the next work to that peer connects afresh.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import itertools
import json
import logging
import secrets
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxreshard.comm._emulate import sleep_until
from jaxreshard.comm._layout import Index, format_index
from jaxreshard.comm._local import BufferPool, relative_slices
from jaxreshard.comm._order import Step
from jaxreshard.comm._stream_sender import _Sender
from jaxreshard.comm._stream_wire import (  # noqa: F401  (tests read the handshake's fields)
    _CHALLENGE,
    _HELLO,
    _PREFIX,
    _PROTOCOL,
    _WELCOME,
    CONNECT_TIMEOUT_S,
    _BadMessage,
    _not_whole_elements,
    _parse_header,
    _proof,
    _recv_exactly,
    _Refused,
    _Truncated,
    _unexpected,
)
from jaxreshard.comm._transport import (
    HostWork,
    Transport,
    aborted_reason,
    expected_chunks,
    take_arrived,
)

MIN_SECRET_BYTES = 16
HANDSHAKE_TIMEOUT_S = 10.0  # a peer that connects and says nothing is dropped after this
MAX_HEADER_BYTES = 64 * 2**10
_EAGER_BYTES = 64 * 2**20  # larger payloads nobody waits for yet are read in pieces this size
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
        secret: the runtime's secret, the same on every host (at least `MIN_SECRET_BYTES`
            random bytes); a connection is read only once it proved that it knows it (see
            [Note: stream authentication]).

    Raises:
        ValueError: `secret` is not bytes or too short.
    """

    name = "tcp"

    def __init__(
        self,
        host: int,
        ip: str,
        book: Callable[[int, int], float] | None = None,
        *,
        secret: bytes,
    ):
        if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
            got = f"{len(secret)} bytes" if isinstance(secret, bytes) else type(secret).__name__
            raise ValueError(
                f"StreamTransport(host={host}, secret=...): the runtime's secret must be at least "
                f"{MIN_SECRET_BYTES} random bytes, got {got}; make it with secrets.token_bytes(32) "
                "once per runtime and give every host the same"
            )
        self._host = host
        self._secret = secret
        self._book = book
        self._server = socket.create_server((ip, 0), backlog=64)
        self.address: tuple[str, int] = tuple(self._server.getsockname()[:2])  # type: ignore[assignment]
        self._addresses: dict[int, tuple[str, int]] = {}
        self._senders: dict[int, _Sender] = {}
        # (work, op) -> (region, payload, emulated arrival time, sending host)
        self._mailbox: dict[tuple[str, int], list[tuple[Index, np.ndarray, float, int]]] = {}
        # (work, op) -> (dtype, chunks) of the receives under way: their messages are checked
        # exactly on arrival (see [Note: stream authentication])
        self._expected: dict[tuple[str, int], tuple[np.dtype, frozenset[Index]]] = {}
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
        dtype = np.dtype(jax.numpy.dtype(work.dtype))
        chunks = expected_chunks(work, op)
        missing = set(chunks)
        peer = step.peers[0]
        key = (work.work_id, step.op)
        with self._cond:
            breaks = self._breaks.get(peer, (0, ""))[0]  # the peer's breaks before this receive
            self._expected[key] = (dtype, frozenset(chunks))

        def broken() -> str | None:  # (under `_cond`)
            count, why = self._breaks.get(peer, (0, ""))
            return self._lost.get(work.work_id) or (why if count != breaks else None)

        try:
            while missing:
                arrived = take_arrived(
                    self._cond, self._mailbox, work, step, deadline, self._aborted, broken
                )
                for region, raw, ready, src in arrived:
                    # A message that came before this receive was only checked loosely.
                    problem = _unexpected(region, raw.nbytes, dtype, missing)
                    if src != peer:
                        problem = f"the op's slice comes from host {peer}, not host {src}"
                    if problem is not None:
                        why = f"host {src} sent {format_index(region)} of it: {problem}"
                        _log.warning("host %d: %s: %s", self._host, work.where(step.op), why)
                        raise RuntimeError(f"host {work.host}: {work.where(step.op)}: {why}")
                    sleep_until(min(ready, deadline))  # the emulated transfer has ended
                    array = raw.view(dtype).reshape([b - a for a, b in region])
                    for next_host in forward_to:  # hand the chunk on before copying it here
                        self._post(work, step.op, next_host, region, array)
                    write(region, array)
                    missing.discard(region)
        finally:
            with self._cond:
                self._expected.pop(key, None)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, address = self._server.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(
                target=self._read,
                args=(conn, address),
                daemon=True,
                name=f"tcp-read-h{self._host}",
            ).start()

    def _read(self, conn: socket.socket, address: tuple[str, int]) -> None:
        with conn:
            try:
                peer = self._greet(conn)
            except OSError as e:  # (`_Refused`, `_Truncated`, a timeout, a reset)
                if isinstance(e, TimeoutError):
                    e = _Refused(f"it sent no proof within {HANDSHAKE_TIMEOUT_S:g} s")
                elif isinstance(e, _Truncated):
                    e = _Refused(
                        f"it closed the connection during the handshake ({e.what}: expected "
                        f"{e.expected} bytes, got {e.got})"
                    )
                _log.warning(
                    "host %d: refused a connection from %s:%d: %s; nothing it sent was read "
                    "(every host of a runtime must be given the runtime's secret by its driver)",
                    self._host,
                    address[0],
                    address[1],
                    e,
                )
                return
            with self._cond:
                serial = next(self._serials)
                self._connection[peer] = serial
            try:
                self._read_messages(conn, peer)
            except Exception as e:  # the waits for this peer hear it, instead of timing out
                if isinstance(e, _Truncated):
                    why = (
                        f"host {peer} closed its connection to host {self._host} in the middle "
                        f"of a message ({e.what}: expected {e.expected} bytes, got {e.got})"
                    )
                elif isinstance(e, _BadMessage):
                    why = f"host {peer} sent a message this host refuses ({e}), so it dropped "
                    why += "the connection"
                    _log.warning("host %d: %s (from %s:%d)", self._host, why, *address[:2])
                else:
                    why = f"receiving from host {peer} failed: {type(e).__name__}: {e}"
                why += "; what it was sending is lost (its next work connects again)"
                with self._cond:
                    work = getattr(e, "work", None)
                    if work is not None:
                        self._lost[work] = why
                    if self._connection.get(peer) == serial:  # not after a newer connection
                        self._breaks[peer] = (self._breaks.get(peer, (0, ""))[0] + 1, why)
                    self._cond.notify_all()

    def _greet(self, conn: socket.socket) -> int:
        """Challenge a new connection (see [Note: stream authentication]); return the host it
        proved to be, after proving this host to it. Raises `_Refused` (or an `OSError`)."""
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        nonce = secrets.token_bytes(32)
        conn.sendall(_CHALLENGE.pack(_PROTOCOL, nonce))
        hello = _recv_exactly(conn, _HELLO.size, what="its host id and proof", eof=False)
        peer, theirs, proof = _HELLO.unpack(hello)  # type: ignore[arg-type]
        with self._cond:
            known = sorted(self._addresses)
        if peer not in known:
            raise _Refused(
                f"it claims to be host {peer}, which is not one of this runtime's hosts {known}"
            )
        if not hmac.compare_digest(
            proof, _proof(self._secret, b"connect", nonce, theirs, peer, self._host)
        ):
            raise _Refused(
                f"it claims to be host {peer}, but its proof does not match this runtime's "
                "secret (a process of another runtime, or not one of ours)"
            )
        conn.sendall(
            _WELCOME.pack(_proof(self._secret, b"accept", nonce, theirs, peer, self._host))
        )
        conn.settimeout(None)
        return peer

    def _read_messages(self, conn: socket.socket, peer: int) -> None:
        while True:
            prefix = _recv_exactly(conn, _PREFIX.size, what="a message's sizes")
            if prefix is None:
                return  # the peer closed its end between messages
            header_bytes, nbytes = _PREFIX.unpack(prefix)
            if header_bytes > MAX_HEADER_BYTES:
                raise _BadMessage(
                    f"a header of {header_bytes} bytes; headers are at most {MAX_HEADER_BYTES}"
                )
            text = _recv_exactly(
                conn, header_bytes, what=f"the header of a {nbytes}-byte message", eof=False
            )
            work, op, region, ready = _parse_header(bytes(text), peer)  # type: ignore[arg-type]
            message = f"op {op} {format_index(region)} of {work}"
            with self._cond:
                expected = self._expected.get((work, op))
            if expected is not None:
                dtype, chunks = expected
                problem = _unexpected(region, nbytes, dtype, chunks)
            else:
                problem = _not_whole_elements(region, nbytes)
            if problem is not None:
                raise _BadMessage(f"{message}: {problem}", work)
            try:
                raw = self._read_payload(
                    conn, nbytes, expected is not None, f"the payload of {message}"
                )
            except (OSError, _Truncated) as e:
                e.work = work  # type: ignore[attr-defined]
                raise
            with self._cond:
                if self._is_forgotten(work):
                    continue
                self._mailbox.setdefault((work, op), []).append((region, raw, ready, peer))
                self._cond.notify_all()

    def _read_payload(self, conn: socket.socket, nbytes: int, awaited: bool, what: str) -> Any:
        """A message's payload, in a buffer of this transport's pool."""
        if awaited or nbytes <= _EAGER_BYTES:
            raw = self._spare.take(nbytes)
            _recv_exactly(conn, nbytes, into=memoryview(raw), what=what, eof=False)
            return raw
        # Nothing waits for it yet, so nothing vouches for its size: memory follows the bytes
        # that really arrive, not the size the header claims.
        pieces: list[bytearray] = []
        got = 0
        while got < nbytes:
            piece = bytearray(min(_EAGER_BYTES, nbytes - got))
            try:
                _recv_exactly(conn, len(piece), into=memoryview(piece), what=what, eof=False)
            except _Truncated as e:
                raise _Truncated(what, nbytes, got + e.got) from None
            pieces.append(piece)
            got += len(piece)
        raw = self._spare.take(nbytes)
        start = 0
        for piece in pieces:
            raw[start : start + len(piece)] = np.frombuffer(piece, np.uint8)
            start += len(piece)
        return raw

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
            for keyed in (self._mailbox, self._expected):
                for key in [k for k in keyed if mine(k[0])]:
                    del keyed[key]
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
