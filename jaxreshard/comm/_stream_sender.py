"""The stream transport's sending side: one thread per peer writes a host's messages in FIFO
order over one authenticated connection (see [Note: stream transport] in `comm/_stream.py`)."""

from __future__ import annotations

import collections
import hmac
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from jaxreshard.comm._stream_wire import (
    _CHALLENGE,
    _HELLO,
    _PROTOCOL,
    _WELCOME,
    CONNECT_TIMEOUT_S,
    _proof,
    _recv_exactly,
    _Refused,
    _Truncated,
)
from jaxreshard.comm._transport import HostWork

if TYPE_CHECKING:
    from jaxreshard.comm._stream import StreamTransport


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
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._introduce(self._sock)
            self._sock.settimeout(None)
        except OSError as e:  # (`_Refused`, `_Truncated`, a timeout, a reset)
            if isinstance(e, _Truncated):
                e = _Refused(
                    f"it closed the connection during the handshake ({e.what}: expected "
                    f"{e.expected} bytes, got {e.got}): it does not share this runtime's secret, "
                    f"or does not know host {self._owner._host}"
                )
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

    def _introduce(self, sock: socket.socket) -> None:
        """Answer the listener's challenge and check its proof (see [Note: stream
        authentication]); raises `_Refused` (or an `OSError`)."""
        host, secret = self._owner._host, self._owner._secret
        challenge = _recv_exactly(sock, _CHALLENGE.size, what="its challenge", eof=False)
        protocol, nonce = _CHALLENGE.unpack(challenge)  # type: ignore[arg-type]
        if protocol != _PROTOCOL:
            raise _Refused(
                f"it opened with {protocol!r}, not {_PROTOCOL!r}: it is no jaxreshard stream "
                "listener (the address is stale, or taken by another program)"
            )
        mine = secrets.token_bytes(32)
        sock.sendall(
            _HELLO.pack(host, mine, _proof(secret, b"connect", nonce, mine, host, self.peer))
        )
        (welcome,) = _WELCOME.unpack(
            _recv_exactly(sock, _WELCOME.size, what="its proof", eof=False)  # type: ignore[arg-type]
        )
        if not hmac.compare_digest(
            welcome, _proof(secret, b"accept", nonce, mine, host, self.peer)
        ):
            raise _Refused(
                f"its proof does not match this runtime's secret: whatever listens at "
                f"{self.address} is not host {self.peer} of this runtime"
            )

    def _fail(self, error: str) -> None:
        with self._cond:
            self._error = f"{error} (the next work to host {self.peer} connects again)"
            self._lost = set(self._pending)
            # What is still queued never goes out: let its payloads go.
            self._queue = collections.deque(item for item in self._queue if item is None)
            self._cond.notify_all()
