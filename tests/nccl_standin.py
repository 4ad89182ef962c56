"""An in-process stand-in for CuPy + NCCL with NCCL's blocking semantics (a test double).

It implements `jaxreshard.comm._nccl.CupyBackend`'s interface over numpy buffers, so that the
real `NcclTransport` runs its multi-rank logic in CI, where no GPU is:
- a stream is a worker thread that runs what is queued on it in order; an event fires when its
  stream reaches it; `wait_event` queues a wait for another stream's event;
- a broadcast is queued on the calling rank's stream. A device runs its collectives one at a
  time in the order they were issued on it, whatever their communicator or stream (as a GPU
  whose NCCL kernel spins until every rank has joined: the next collective on that device waits
  behind it): when its stream reaches it and every collective issued before it on the device
  has finished, the rank joins it, and it finishes once every rank of the communicator has
  joined the collective of the same sequence number. Ranks that disagree on root or size never
  meet (NCCL's behaviour is undefined there; in practice it hangs), so they block until aborted;
- so ranks that issue two communicators' ops in different orders deadlock, as on GPUs: a rank
  that has waited `World.detect_s` looks for a cycle of devices, each blocked in a collective
  that waits for the next one's device, which is blocked in another; if there is one it is a
  deadlock for good, and every communicator in it is aborted with an error that names each
  device, the op it is blocked in (the transport's label) and the device it waits for
  (`World.deadlocks` keeps the messages). A collective still waiting after `World.hang_s` is
  aborted too, naming the ranks that never joined;
- `to_jax` returns once the stream has drained what was queued before it (the DLPack stream
  handshake, seen from the consumer);
- `abort` wakes every blocked rank of the communicator with an error, as `ncclCommAbort` does
  (its collectives leave their devices' queues), and `check` reports it.
Buffers are numpy arrays; a "device" is whatever the transport passes (CPU JAX devices here).
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
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


class Call:
    """One rank's collective, from its issue on a device until it finishes there."""

    def __init__(self, rendezvous: Rendezvous, seq: int, rank: int, device: Any, label: str):
        self.rendezvous, self.seq, self.rank, self.device = rendezvous, seq, rank, device
        self.label = label or f"broadcast #{seq}"
        self.joined = False  # its stream reached it and it is first on its device

    def describe(self) -> str:
        r = self.rendezvous
        return f"{self.label} (communicator #{r.uid}, rank {self.rank} of {r.num_ranks})"


class Rendezvous:
    """What all ranks of one communicator share (guarded by the world's lock)."""

    def __init__(self, world: World, uid: int, num_ranks: int):
        self.world, self.uid, self.num_ranks = world, uid, num_ranks
        self.devices: dict[int, Any] = {}  # rank -> device
        self.joined: dict[int, dict[int, tuple[int, int, Any, Any]]] = {}  # seq -> rank -> call
        self.finished: set[int] = set()
        self.error: str | None = None
        self.issued = [itertools.count() for _ in range(num_ranks)]

    def abort(self, reason: str) -> None:
        self.world.abort(self, reason)


def device_name(device: Any) -> str:
    return f"device {getattr(device, 'id', device)}"


class World:
    """The process-wide registry of communicators (what NCCL's unique ids name), and every
    device's queue of issued collectives (see the module docstring)."""

    def __init__(self, detect_s: float = 0.2, hang_s: float | None = 60.0) -> None:
        self.detect_s, self.hang_s = detect_s, hang_s
        self._ids = itertools.count()
        self.rendezvous: dict[int, Rendezvous] = {}
        self.cond = threading.Condition()
        self.queues: dict[Any, list[Call]] = {}  # device -> its unfinished collectives
        self.issued: dict[Any, list[str]] = {}  # device -> every collective's label, in order
        self.deadlocks: list[str] = []

    @property
    def lock(self) -> threading.Condition:
        return self.cond

    def unique_id(self) -> int:
        return next(self._ids)

    def join(self, uid: int, num_ranks: int) -> Rendezvous:
        with self.cond:
            return self.rendezvous.setdefault(uid, Rendezvous(self, uid, num_ranks))

    def issue(self, comm: Comm, device: Any, label: str) -> Call:
        """A rank issues a collective on its device (the host call, not its execution)."""
        r = comm.rendezvous
        with self.cond:
            call = Call(r, next(r.issued[comm.rank]), comm.rank, device, label)
            if r.error is None:
                self.queues.setdefault(device, []).append(call)
            self.issued.setdefault(device, []).append(call.label)
            return call

    def run(self, call: Call, nbytes: int, root: int, send: Any, recv: Any) -> None:
        """The collective on its stream: join it when it is first on its device, wait until
        every rank has joined, move the bytes."""
        r = call.rendezvous
        start = time.monotonic()
        with self.cond:
            try:
                while True:
                    if r.error is not None:
                        raise RuntimeError(f"NCCL stand-in: communicator aborted ({r.error})")
                    if call.seq in r.finished:
                        return
                    queue_ = self.queues.get(call.device, [])
                    if not call.joined and queue_ and queue_[0] is call:
                        call.joined = True
                        r.joined.setdefault(call.seq, {})[call.rank] = (nbytes, root, send, recv)
                        self.cond.notify_all()
                    calls = r.joined.get(call.seq, {})
                    if (
                        call.joined
                        and len(calls) == r.num_ranks
                        and len({c[:2] for c in calls.values()}) == 1
                    ):
                        data = calls[root][2].reshape(-1).view(np.uint8)
                        for rank, (_, _, _, buffer) in calls.items():
                            if rank != root:
                                np.copyto(buffer.reshape(-1).view(np.uint8), data)
                        r.finished.add(call.seq)
                        del r.joined[call.seq]
                        self.cond.notify_all()
                        return
                    waited = time.monotonic() - start
                    if waited >= self.detect_s:
                        cycle = self._cycle(call.device)
                        if cycle:
                            self._deadlock(cycle)
                            continue
                    if self.hang_s is not None and waited >= self.hang_s:
                        missing = sorted(set(range(r.num_ranks)) - set(calls))
                        self.abort(
                            r,
                            f"{call.describe()} on {device_name(call.device)} waited "
                            f"{self.hang_s:g} s for ranks {missing} "
                            f"({', '.join(device_name(r.devices.get(k)) for k in missing)})",
                        )
                        continue
                    self.cond.wait(0.05)
            finally:
                queue_ = self.queues.get(call.device, [])
                if call in queue_:
                    queue_.remove(call)
                self.cond.notify_all()

    def _blocked(self, device: Any) -> Call | None:
        """The collective `device` is blocked in (joined, waiting for other ranks), if any."""
        queue_ = self.queues.get(device)
        head = queue_[0] if queue_ else None
        if head is None or not head.joined or head.rendezvous.error is not None:
            return None
        if head.seq in head.rendezvous.finished:  # finished; its thread has not left it yet
            return None
        return head

    def _cycle(self, device: Any) -> list[tuple[Call, Any]]:
        """A cycle of devices reachable from `device`, each blocked in a collective that waits
        for the next one's device, blocked in another collective: [(call, waits for device)]."""
        path: list[tuple[Call, Any]] = []
        on_path: dict[Any, int] = {}
        seen: set[Any] = set()

        def visit(d: Any) -> list[tuple[Call, Any]] | None:
            if d in on_path:
                return path[on_path[d] :]
            if d in seen:
                return None
            seen.add(d)
            call = self._blocked(d)
            if call is None:
                return None
            r = call.rendezvous
            on_path[d] = len(path)
            for rank in sorted(set(range(r.num_ranks)) - set(r.joined.get(call.seq, {}))):
                e = r.devices.get(rank)
                other = self._blocked(e) if e is not None else None
                if other is None or other is call:
                    continue
                path.append((call, e))
                found = visit(e)
                if found:
                    return found
                path.pop()
            del on_path[d]
            return None

        return visit(device) or []

    def _deadlock(self, cycle: list[tuple[Call, Any]]) -> None:
        message = (
            "deadlock across communicators: "
            + "; ".join(
                f"{device_name(call.device)} is blocked in {call.describe()}, waiting for "
                f"{device_name(waits_for)}"
                for call, waits_for in cycle
            )
            + " (its ranks issued these collectives in different orders)"
        )
        self.deadlocks.append(message)
        for call, _ in cycle:
            self.abort(call.rendezvous, message)

    def abort(self, r: Rendezvous, reason: str) -> None:
        with self.cond:
            if r.error is None:
                r.error = reason
            for queue_ in self.queues.values():
                queue_[:] = [c for c in queue_ if c.rendezvous is not r]
            self.cond.notify_all()


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
        rendezvous = self.world.join(uid, num_ranks)
        with self.world.cond:
            rendezvous.devices[rank] = device
        return Comm(rendezvous, rank)

    def broadcast(self, comm, send, recv, nbytes, root, stream, device, label="") -> None:
        self.broadcasts += 1
        call = self.world.issue(comm, device, label)
        stream.enqueue(lambda: self.world.run(call, nbytes, root, send, recv))

    def check(self, comm: Comm) -> None:
        if comm.rendezvous.error is not None:
            raise RuntimeError(f"NCCL stand-in: async error: {comm.rendezvous.error}")

    def abort(self, comm: Comm) -> None:
        comm.rendezvous.abort("ncclCommAbort")
