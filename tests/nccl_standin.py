"""An in-process stand-in for CuPy + NCCL with NCCL's blocking semantics (a test double).

It implements `jaxreshard.comm._nccl.CupyBackend`'s interface over numpy buffers, so that the
real `NcclTransport` runs its multi-rank logic in CI, where no GPU is:
- a stream is a worker thread that runs what is queued on it in order; an event fires when its
  stream reaches it; `wait_event` queues a wait for another stream's event;
- a broadcast is queued on the calling rank's stream and, when the stream reaches it, blocks
  that stream until every rank of the communicator has reached its broadcast of the same
  sequence number (as a GPU kernel spins); ranks that disagree on root or size never meet
  (NCCL's behaviour is undefined there; in practice it hangs), so they block until aborted;
- `to_jax` returns once the stream has drained what was queued before it (the DLPack stream
  handshake, seen from the consumer);
- `abort` wakes every blocked rank of the communicator with an error, as `ncclCommAbort` does,
  and `check` reports it.
Buffers are numpy arrays; a "device" is whatever the transport passes (CPU JAX devices here).
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np


class Stream:
    def __init__(self, name: str):
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def enqueue(self, fn) -> None:
        self.queue.put(fn)

    def _run(self) -> None:
        while True:
            fn = self.queue.get()
            try:
                fn()
            except BaseException as e:  # a failed kernel: later work on the stream still runs
                self.error = e


class Event:
    def __init__(self) -> None:
        self.fired = threading.Event()


class Rendezvous:
    """What all ranks of one communicator share."""

    def __init__(self, num_ranks: int):
        self.num_ranks = num_ranks
        self.cond = threading.Condition()
        self.arrived: dict[int, dict[int, tuple[int, int, Any, Any]]] = {}
        self.error: str | None = None
        self.issued = [itertools.count() for _ in range(num_ranks)]

    def broadcast(self, seq: int, rank: int, nbytes: int, root: int, send: Any, recv: Any):
        with self.cond:
            self.arrived.setdefault(seq, {})[rank] = (nbytes, root, send, recv)
            self.cond.notify_all()
            while True:
                if self.error is not None:
                    raise RuntimeError(f"NCCL stand-in: communicator aborted ({self.error})")
                calls = self.arrived[seq]
                if len(calls) == self.num_ranks and len({c[:2] for c in calls.values()}) == 1:
                    break
                self.cond.wait(0.05)
            data = calls[root][2]
        if rank != root:
            np.copyto(recv.reshape(-1).view(np.uint8), data.reshape(-1).view(np.uint8))

    def abort(self, reason: str) -> None:
        with self.cond:
            self.error = reason
            self.cond.notify_all()


class World:
    """The process-wide registry of communicators (what NCCL's unique ids name)."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self.rendezvous: dict[int, Rendezvous] = {}
        self.lock = threading.Lock()

    def unique_id(self) -> int:
        return next(self._ids)

    def join(self, uid: int, num_ranks: int) -> Rendezvous:
        with self.lock:
            return self.rendezvous.setdefault(uid, Rendezvous(num_ranks))


class Comm:
    def __init__(self, rendezvous: Rendezvous, rank: int):
        self.rendezvous, self.rank = rendezvous, rank


class StandinBackend:
    """`CupyBackend`'s interface, in one process (see the module docstring)."""

    def __init__(self, world: World):
        self.world = world
        self.copies = 0  # copies queued by the transport (to check the zero-copy paths)
        self.broadcasts = 0

    def unique_id(self) -> int:
        return self.world.unique_id()

    def stream(self, device: Any) -> Stream:
        return Stream(f"standin-stream-{device}")

    def view(self, array: Any, device: Any, stream: Stream) -> np.ndarray:
        return np.asarray(array)

    def empty(self, shape, dtype, device, stream) -> np.ndarray:
        return np.empty(tuple(shape), dtype=dtype)

    def contiguous(self, buffer: np.ndarray, device: Any, stream: Stream) -> np.ndarray:
        if buffer.flags.c_contiguous:
            return buffer
        out = np.empty(buffer.shape, buffer.dtype)
        self.copy(out, buffer, device, stream)
        return out

    def copy(self, dst: np.ndarray, src: np.ndarray, device: Any, stream: Stream) -> None:
        self.copies += 1
        stream.enqueue(lambda: np.copyto(dst, src))

    def to_jax(self, buffer: np.ndarray, device: Any, stream: Stream) -> Any:
        event = self.record(stream, device)
        if not event.fired.wait(30):
            raise TimeoutError("NCCL stand-in: the stream never drained")
        return jax.device_put(buffer.copy(), device)

    def record(self, stream: Stream, device: Any) -> Event:
        event = Event()
        stream.enqueue(event.fired.set)
        return event

    def wait_event(self, stream: Stream, event: Event, device: Any) -> None:
        stream.enqueue(lambda: event.fired.wait())

    def done(self, event: Event) -> bool:
        return event.fired.is_set()

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        yield

    def communicator(self, num_ranks: int, uid: int, rank: int, device: Any) -> Comm:
        return Comm(self.world.join(uid, num_ranks), rank)

    def broadcast(self, comm, send, recv, nbytes, root, stream, device) -> None:
        self.broadcasts += 1
        seq = next(comm.rendezvous.issued[comm.rank])
        stream.enqueue(lambda: comm.rendezvous.broadcast(seq, comm.rank, nbytes, root, send, recv))

    def check(self, comm: Comm) -> None:
        if comm.rendezvous.error is not None:
            raise RuntimeError(f"NCCL stand-in: async error: {comm.rendezvous.error}")

    def abort(self, comm: Comm) -> None:
        comm.rendezvous.abort("ncclCommAbort")
