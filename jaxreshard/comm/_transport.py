"""One host's part of a resharding, and the transports that move its bytes between hosts.

A host runs its `HostWork` (its steps of the plan, see `_order.host_programs`) in order:
`local` steps copy between its own devices, `send`/`recv` steps go through a point-to-point
transport (TCP streams, `_stream.py`, or Ray's object store), `collective` steps through NCCL.
Every wait has a deadline that names what it waited for. This module imports neither Ray nor
CuPy at import time.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from jaxreshard.comm._emulate import sleep_until
from jaxreshard.comm._layout import Index, format_index, index_size
from jaxreshard.comm._local import POOL, aligned_empty, contains, relative_slices, split_region
from jaxreshard.comm._order import COLLECTIVE, LOCAL, RECV, SEND, Step
from jaxreshard.comm._plan import Op


@dataclasses.dataclass(frozen=True)
class HostWork:
    """What one host needs to know of a resharding: only its part of the plan."""

    work_id: str
    host: int
    shape: tuple[int, ...]
    dtype: str
    steps: tuple[Step, ...]
    ops: Mapping[int, Op]
    src_regions: Mapping[int, Index]  # this host's source devices
    dst_regions: Mapping[int, Index]  # this host's destination devices
    src_array: str
    dst_array: str
    timeout_s: float
    describe: str = ""  # the tensor, for messages
    chunk_bytes: int = 8 * 2**20  # larger slices travel in chunks of about this size
    batch_bytes: int = 8 * 2**20  # smaller sends to one peer share one object up to this size

    def where(self, i: int) -> str:
        op = self.ops[i]
        return f"op {i} ({op.kind} {format_index(op.index)}) of {self.describe or self.work_id}"


class Transport:
    """Moves one op's slice between hosts; implementations: object store (CPU), NCCL (GPU).

    A transport implements `send`/`recv` (point to point) or `collective`; the defaults raise.
    """

    name: str

    def send(self, work: HostWork, step: Step, data: Any) -> None:
        raise NotImplementedError(f"{self.name} transport has no point-to-point sends")

    def recv(
        self,
        work: HostWork,
        step: Step,
        deadline: float,
        write: Callable[[Index, Any], None],
        forward_to: tuple[int, ...] = (),
    ) -> None:
        """Receive op `step.op`'s slice (in pieces), `write` each piece, forward to `forward_to`."""
        raise NotImplementedError(f"{self.name} transport has no point-to-point receives")

    def flush(self, work: HostWork) -> None:
        """Deliver what `send` may have held back to batch."""

    def complete(self, work: HostWork, deadline: float) -> None:
        """End this host's part of `work`: deliver what is held back, and wait (until
        `deadline`) for whatever the transport still has in flight for it."""
        self.flush(work)

    def collective(self, work: HostWork, step: Step, data: Any, deadline: float) -> None:
        """Issue op `step.op`'s collective; it may still be in flight when this returns."""
        raise NotImplementedError(f"{self.name} transport has no collectives")

    def abort(self, work_id: str, reason: str = "a peer failed") -> None:
        """Wake every wait of `work_id` with an error (called when a peer failed)."""
        raise NotImplementedError


class HostData:
    """The source shards and destination buffers of one resharding on one host.

    Sources are zero-copy numpy views and destinations 64-byte-aligned numpy buffers that JAX
    adopts without a copy (see [Note: local execution]). GPU data lives in `_nccl.DeviceData`.
    """

    def __init__(self, work: HostWork, src: Mapping[int, jax.Array], devices: Mapping[int, Any]):
        self.work, self.devices = work, devices
        self.views = {d: (work.src_regions[d], np.asarray(src[d])) for d in work.src_regions}
        dtype = jax.numpy.dtype(work.dtype)
        self.buffers: dict[int, tuple[Index, Any]] = {
            d: (region, aligned_empty([b - a for a, b in region], dtype, pool=POOL))
            for d, region in work.dst_regions.items()
        }

    def read(self, device: int, index: Index) -> Any:
        """The slice `index` as `device` holds it now (its source shard, or delivered data)."""
        if device in self.views and contains(self.views[device][0], index):
            region, array = self.views[device]
        else:
            region, array = self.buffers[device]
        return array[relative_slices(index, region)]

    def write(self, device: int, index: Index, data: Any) -> None:
        region, buffer = self.buffers[device]
        target = buffer[relative_slices(index, region)]
        if tuple(target.shape) != tuple(data.shape) or target.dtype != data.dtype:
            raise ValueError(
                f"{self.work.describe}: device {device} expects {target.dtype}{list(target.shape)} "
                f"for {format_index(index)} but got {data.dtype}{list(data.shape)}"
            )
        np.copyto(target, data)

    def local(self, op: Op) -> None:
        """Run an op whose devices are all on this host (copies)."""
        if op.kind == "allgather":
            for device in op.devices:
                for owner, part in zip(op.devices, op.parts):
                    if owner != device and all(b > a for a, b in part):
                        self.write(device, part, self.read(owner, part))
            return
        data = self.read(op.src_device, op.index)
        for device in op.dst_devices:
            if device in self.buffers:
                self.write(device, op.index, data)

    def finish(self) -> dict[int, jax.Array]:
        """The destination shards as JAX arrays on their devices (zero-copy on CPU)."""
        return {
            d: jax.device_put(buffer, self.devices[d], may_alias=True)
            for d, (_, buffer) in self.buffers.items()
        }


def run_host_work(
    work: HostWork,
    data: Any,
    transport: Transport,
    *,
    deadline: float | None = None,
    complete: bool = True,
) -> dict[str, float]:
    """Run a host's steps in order; return byte and time counters.

    A `recv` directly followed by a `send` of the same op is a relay: each chunk is written to
    this host's receivers and forwarded as soon as it arrives, so a broadcast chain pipelines.
    Before any wait, the host flushes the sends it has batched, so no peer waits on them.

    Args:
        deadline: when every wait gives up (monotonic clock; default: `work.timeout_s` from
            now).
        complete: end with `transport.complete`; without it, what a transport queued (NCCL's
            broadcasts) may still be in flight, and the caller completes the work later.
    """
    deadline = time.monotonic() + work.timeout_s if deadline is None else deadline
    stats = {"sent_bytes": 0.0, "received_bytes": 0.0, "seconds": 0.0}
    start = time.perf_counter()
    steps = work.steps
    position = 0
    while position < len(steps):
        step = steps[position]
        op = work.ops[step.op]
        if step.role == LOCAL:
            data.local(op)
        elif step.role == SEND:
            transport.send(work, step, data.read(op.src_device, op.index))
            stats["sent_bytes"] += op.nbytes
        elif step.role == RECV:
            transport.flush(work)
            following = steps[position + 1] if position + 1 < len(steps) else None
            relay = (
                following
                if following is not None and following.role == SEND and following.op == step.op
                else None
            )

            def write(region: Index, array: Any, op: Op = op) -> None:
                for device in op.receivers:
                    if device in data.buffers:
                        data.write(device, region, array)

            transport.recv(work, step, deadline, write, relay.peers if relay else ())
            stats["received_bytes"] += op.nbytes
            if relay is not None:
                stats["sent_bytes"] += op.nbytes
                position += 1
        elif step.role == COLLECTIVE:
            transport.collective(work, step, data, deadline)
        else:  # pragma: no cover
            raise AssertionError(step)
        position += 1
    if complete:
        transport.complete(work, deadline)
    else:
        transport.flush(work)
    stats["seconds"] = time.perf_counter() - start
    return stats


def aborted_reason(aborted: Mapping[str, str], work_id: str) -> str | None:
    """Why `work_id` was aborted: it, or a work it belongs to (`step:...`), was; else None."""
    if work_id in aborted:
        return aborted[work_id]
    parts = work_id.split(":")
    for i in range(len(parts) - 1, 0, -1):
        reason = aborted.get(":".join(parts[:i]))
        if reason is not None:
            return reason
    return None


def expected_chunks(work: HostWork, op: Op) -> list[Index]:
    """The pieces an op's slice travels in; sender and receiver compute the same ones."""
    itemsize = op.nbytes // max(1, index_size(op.index))
    return split_region(op.index, itemsize, work.chunk_bytes)


class ObjectStoreTransport(Transport):
    """CPU transport over Ray's object store (`transport="object_store"`; the default CPU
    transport streams over TCP instead, see [Note: stream transport]).

    A slice is put into the object store once, and its reference travels to the next host of
    the op's chain, which fetches it (Ray moves it between nodes; processes of one node share it
    in shared memory), writes it into its receivers and, for a broadcast, puts it into its own
    store and hands that reference on (so the next host pulls from it, not from the source).
    Slices larger than `chunk_bytes` go in chunks, so the chain pipelines; smaller ones to one
    peer share one object (and one message) until `batch_bytes`. Receivers on the sender's own
    host never touch the store: they copy from the source view.
    """

    name = "object_store"

    def __init__(self, peers: Callable[[int], Any], host: int = -1, emulator: Any = None):
        self._peers = peers  # host -> actor handle
        self._host = host
        self._emulator = emulator  # a LinkEmulator actor, see [Note: network emulation]
        self._mailbox: dict[tuple[str, int], list[tuple[Index, Any, int | None, float]]] = {}
        self._pending: dict[tuple[str, int], list[tuple[int, Index, Any]]] = {}
        self._fetched: dict[str, dict[Any, Any]] = {}  # work id -> fetched batch objects
        self._aborted: dict[str, str] = {}
        self._cond = threading.Condition()

    def send(self, work: HostWork, step: Step, data: Any) -> None:
        import ray

        op = work.ops[step.op]
        (peer,) = step.peers
        chunks = expected_chunks(work, op)
        relayed = op.kind == "broadcast" and len({*op.dst_devices}) > 1
        if len(chunks) > 1 or relayed or op.nbytes >= work.batch_bytes:
            for region in chunks:
                piece = np.ascontiguousarray(data[relative_slices(region, op.index)])
                ref = ray.put(piece)
                ready = self._book(peer, piece.nbytes)
                self._peers(peer).deliver.remote(
                    work.work_id, [(step.op, region, None)], [ref], ready
                )
            return
        piece = np.ascontiguousarray(data)
        with self._cond:  # works of several threads (a pipeline's transfers) batch here
            batch = self._pending.setdefault((work.work_id, peer), [])
            batch.append((step.op, op.index, piece))
            full = sum(a.nbytes for _, _, a in batch) >= work.batch_bytes
        if full:
            self._flush_peer(work.work_id, peer)

    def flush(self, work: HostWork) -> None:
        with self._cond:
            keys = [k for k in self._pending if k[0] == work.work_id]
        for work_id, peer in keys:
            self._flush_peer(work_id, peer)

    def _flush_peer(self, work_id: str, peer: int) -> None:
        import ray

        with self._cond:
            batch = self._pending.pop((work_id, peer), [])
        if batch:
            ref = ray.put([array for _, _, array in batch])
            items = [(op, region, k) for k, (op, region, _) in enumerate(batch)]
            ready = self._book(peer, sum(array.nbytes for _, _, array in batch))
            self._peers(peer).deliver.remote(work_id, items, [ref], ready)

    def _book(self, peer: int, nbytes: int) -> float:
        return book_link(self._emulator, self._host, peer, nbytes)

    def deliver(
        self,
        work_id: str,
        items: list[tuple[int, Index, int | None]],
        boxed: list[Any],
        ready: float = 0.0,
    ) -> None:
        (ref,) = boxed
        with self._cond:
            for op, region, position in items:
                self._mailbox.setdefault((work_id, op), []).append((region, ref, position, ready))
            self._cond.notify_all()

    def recv(
        self,
        work: HostWork,
        step: Step,
        deadline: float,
        write: Callable[[Index, Any], None],
        forward_to: tuple[int, ...] = (),
    ) -> None:
        import ray

        op = work.ops[step.op]
        missing = set(expected_chunks(work, op))
        while missing:
            arrived = take_arrived(self._cond, self._mailbox, work, step, deadline, self._aborted)
            for region, ref, position, ready in arrived:
                sleep_until(ready)  # the emulated transfer has ended (0: no emulation)
                fetched = self._fetched.setdefault(work.work_id, {})
                try:
                    value = fetched.get(ref)
                    if value is None:
                        # The slice was announced, so it exists: fetching it gets timeout_s.
                        left = min(deadline - time.monotonic(), work.timeout_s)
                        value = ray.get(ref, timeout=max(0.001, left))
                        if position is not None:
                            fetched[ref] = value
                except ray.exceptions.GetTimeoutError:
                    raise TimeoutError(
                        f"host {work.host}: {work.where(step.op)} could not fetch a slice from "
                        f"host {step.peers[0]} within {work.timeout_s:g} s"
                    ) from None
                piece = value if position is None else value[position]
                if forward_to:
                    # Hand on a copy in this host's store: the next host then pulls from here,
                    # not from the source (whose NIC a chain exists to spare).
                    mine = ray.put(piece)
                    for peer in forward_to:
                        self._peers(peer).deliver.remote(
                            work.work_id,
                            [(step.op, region, None)],
                            [mine],
                            self._book(peer, piece.nbytes),
                        )
                write(region, piece)
                missing.discard(region)

    def abort(self, work_id: str, reason: str = "a peer failed") -> None:
        """Wake the waits of `work_id` and of every work under it (`work_id:...`: a pipeline
        step's transfers) with an error."""
        with self._cond:
            self._aborted[work_id] = reason
            self._cond.notify_all()

    def forget(self, work_id: str) -> None:
        """Drop what is left of `work_id` and of the works under it."""

        def mine(w: str) -> bool:
            return w == work_id or w.startswith(work_id + ":")

        with self._cond:
            for table in (self._aborted, self._fetched):
                for key in [k for k in table if mine(k)]:
                    del table[key]
            for table in (self._mailbox, self._pending):
                for key in [k for k in table if mine(k[0])]:
                    del table[key]


def take_arrived(
    cond: threading.Condition,
    mailbox: dict[tuple[str, int], list[Any]],
    work: HostWork,
    step: Step,
    deadline: float,
    aborted: Mapping[str, str],
    broken: Callable[[], str | None] | None = None,
) -> list[Any]:
    """Wait on `cond` until `mailbox` holds pieces of op `step.op` of `work`; take them.

    Raises (naming the host, op, tensor and peer) if the work (or one it belongs to, see
    `aborted_reason`) was aborted, `broken()` (asked under `cond` at every wake-up) says why
    the slice cannot come any more, or `deadline` passes first.
    """
    key = (work.work_id, step.op)
    with cond:
        while not mailbox.get(key):
            where = f"host {work.host}: {work.where(step.op)}"
            why = broken() if broken is not None else None
            if why is not None:
                raise RuntimeError(f"{where}: {why}")
            reason = aborted_reason(aborted, work.work_id)
            if reason is not None:
                raise RuntimeError(
                    f"{where} aborted while waiting for host {step.peers[0]}: {reason}"
                )
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{where} waited {work.timeout_s:g} s for the slice from host "
                    f"{step.peers[0]}, which never sent it"
                )
            cond.wait(min(max(deadline - time.monotonic(), 0.001), 1.0))
        return mailbox.pop(key)


def book_link(emulator: Any, host: int, peer: int, nbytes: int) -> float:
    """When a transfer of `nbytes` from `host` to `peer` may be used: at once (no emulator), or
    when the emulated NICs are done with it (see [Note: network emulation])."""
    if emulator is None:
        return 0.0
    import ray

    try:
        _, end = ray.get(emulator.reserve.remote(host, peer, nbytes), timeout=BOOK_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(
            f"host {host}: the link emulator did not book {nbytes} bytes to host {peer} within "
            f"{BOOK_TIMEOUT_S:g} s (it is a small call: the emulator actor is stuck or gone)"
        ) from None
    return end


BOOK_TIMEOUT_S = 60.0  # booking an emulated link: a small call to a live actor
