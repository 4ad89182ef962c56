"""GPU transport: cross-host ops as NCCL broadcasts, through CuPy.

[Note: NCCL transport]
- Communicators: one per (channel, device group), the group being an op's sender and receivers.
  They are created before any op runs, group by group in one fixed global order (sorted device
  ids) on every host, with the NCCL unique id made by the group's first host and passed to the
  others through Ray; after an abort they are gone, and the driver creates them again before the
  next resharding or pipeline step that uses them.
- Streams: every device has one stream per channel (a `reshard`, or one direction between two
  pipeline stages), so transfers of different channels never queue behind each other on a GPU.
  Ops of one channel are issued in the plan's order on every member (checked by
  `_order.check_programs`); a host that holds several members of a group issues their calls
  inside one `groupStart`/`groupEnd`. NCCL's ring broadcast pipelines chunks through the
  receivers: the paper's broadcast strategy.
- Order across communicators: a device blocked in one communicator's collective does not get to
  another's (see [Note: one issue order] in `_order.py`), so a pipeline's channels, which share
  devices, issue all their collectives in one order derived from the schedule, one issuer per
  host (see [Note: NCCL issue order] in `runtime/ray/_nccl_order.py`), checked before anything
  runs. Each broadcast carries a label naming its op, for the test stand-in's messages.
- Ordering with JAX, both ways, without host waits: a source shard is taken through DLPack with
  the channel's stream current, so the DLPack protocol makes that stream wait for the JAX
  computation that produces the shard; a received buffer is handed back to JAX through DLPack
  with the same stream current, so JAX waits for the broadcast. (Taken on another stream, the
  broadcast reads stale data, and JAX can read a buffer before NCCL has filled it: both seen on
  an H100.) A slice that is contiguous in its shard is sent from, or received into, the shard's
  memory itself; other slices go through one contiguous buffer, copied on the same stream.
- Completion: ops are only enqueued; a work completes when an event recorded after its last op
  on every stream has fired. The wait polls the events and NCCL's asynchronous errors against the
  work's deadline; on timeout it aborts the communicators and names the op and the devices it
  waited for. `finished` asks the same without waiting, so that a work's kept buffers (its
  sources, staging buffers) go as soon as its broadcasts are done.
- Before any NCCL call, each side checks the buffer it brings against the op's shape and dtype:
  a mismatch there would hang the collective instead of raising. Every dtype moves as raw bytes.
The GPU calls go through a small backend (`CupyBackend`); tests run the same transport against
an in-process stand-in with NCCL's blocking semantics. Importing this module needs neither CuPy
nor a GPU; using the real backend needs both.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from jaxreshard.comm._layout import Index, format_index
from jaxreshard.comm._local import contains, relative_slices
from jaxreshard.comm._order import Step
from jaxreshard.comm._plan import Op
from jaxreshard.comm._transport import HostWork, Transport, aborted_reason

RESHARD_CHANNEL = "reshard"


def cupy_modules() -> tuple[Any, Any]:
    """Import CuPy and its NCCL bindings, or explain how to get them."""
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as e:
        raise RuntimeError(
            "the NCCL transport needs CuPy with NCCL: pip install 'jaxreshard[gpu]' (CUDA 12: "
            "cupy-cuda12x, nvidia-nccl-cu12) or 'jaxreshard[gpu-cuda13]' (CUDA 13: "
            f"cupy-cuda13x, nvidia-nccl-cu13); import failed: {e}"
        ) from None
    return cupy, nccl


def group_ranks(group: Sequence[int], local: Sequence[int]) -> list[tuple[int, int]]:
    """(device, rank) of this host's members of a communicator over `group` (sorted ids)."""
    ranks = {d: r for r, d in enumerate(sorted(group))}
    return [(d, ranks[d]) for d in sorted(local) if d in ranks]


def expected_bytes(work: HostWork, op_index: int) -> tuple[tuple[int, ...], int]:
    """Shape and byte count of op `op_index`'s slice: what every member must bring."""
    op = work.ops[op_index]
    shape = tuple(b - a for a, b in op.index)
    itemsize = np.dtype(_np_dtype(work.dtype)).itemsize
    return shape, int(np.prod(shape, dtype=np.int64)) * itemsize


def _np_dtype(name: str) -> Any:
    import jax.numpy as jnp

    return jnp.dtype(name)


# -- the GPU calls -----------------------------------------------------------------------------


class CupyBackend:
    """Streams, buffers, DLPack and NCCL through CuPy (see [Note: NCCL transport])."""

    def __init__(self) -> None:
        self.cupy, self.nccl = cupy_modules()
        self.uint8 = getattr(self.nccl, "NCCL_UINT8", getattr(self.nccl, "NCCL_CHAR", 0))

    def _on(self, device: Any) -> Any:
        return self.cupy.cuda.Device(device.local_hardware_id)

    def unique_id(self) -> Any:
        return self.nccl.get_unique_id()

    def stream(self, device: Any) -> Any:
        with self._on(device):
            return self.cupy.cuda.Stream(non_blocking=True)

    def view(self, array: Any, device: Any, stream: Any) -> Any:
        """A JAX array's memory, readable on `stream` once JAX has produced it."""
        with self._on(device), stream:
            return self.cupy.from_dlpack(array)

    def empty(self, shape: Sequence[int], dtype: Any, device: Any, stream: Any) -> Any:
        with self._on(device), stream:
            return self.cupy.empty(tuple(shape), dtype=dtype)

    def contiguous(self, buffer: Any, device: Any, stream: Any) -> Any:
        if buffer.flags.c_contiguous:
            return buffer
        with self._on(device), stream:
            return self.cupy.ascontiguousarray(buffer)

    def copy(self, dst: Any, src: Any, device: Any, stream: Any) -> None:
        """dst[...] = src on `stream` (of dst's device; src may live on another device)."""
        with self._on(device), stream:
            if src.device.id != dst.device.id:
                src = self.cupy.asarray(src)  # a peer copy onto dst's device, on this stream
            dst[...] = src

    def to_jax(self, buffer: Any, device: Any, stream: Any) -> Any:
        """Hand a buffer to JAX; JAX's reads wait for what `stream` has queued so far."""
        import jax

        with self._on(device), stream:
            return jax.dlpack.from_dlpack(buffer)

    def record(self, stream: Any, device: Any) -> Any:
        with self._on(device):
            return stream.record()

    def wait_event(self, stream: Any, event: Any, device: Any) -> None:
        with self._on(device):
            stream.wait_event(event)

    def done(self, event: Any) -> bool:
        return bool(event.done)

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        self.nccl.groupStart()
        try:
            yield
        finally:
            self.nccl.groupEnd()

    def communicator(self, num_ranks: int, uid: Any, rank: int, device: Any) -> Any:
        with self._on(device):
            return self.nccl.NcclCommunicator(num_ranks, uid, rank)

    def broadcast(
        self,
        comm: Any,
        send: Any,
        recv: Any,
        nbytes: int,
        root: int,
        stream: Any,
        device: Any,
        label: str = "",
    ) -> None:
        """Enqueue a broadcast on `stream`; `label` names the op for messages (NCCL has no use
        for it)."""
        with self._on(device):
            comm.broadcast(send.data.ptr, recv.data.ptr, nbytes, self.uint8, root, stream.ptr)

    def check(self, comm: Any) -> None:
        comm.check_async_error()

    def abort(self, comm: Any) -> None:
        comm.abort()


# -- one resharding's buffers on one host ------------------------------------------------------


class DeviceData:
    """The source shards and destination buffers of one work on this host's GPUs.

    Every device's reads and writes are queued on its stream of the work's channel (the
    transport's `stream_of`); nothing here waits on the host.
    """

    def __init__(
        self,
        work: HostWork,
        src: Mapping[int, Any],
        devices: Mapping[int, Any],
        transport: NcclTransport,
        channel: str = RESHARD_CHANNEL,
    ):
        self.work, self.devices, self.transport, self.channel = work, devices, transport, channel
        self.backend = transport.backend
        self.views = {
            d: (work.src_regions[d], self.backend.view(src[d], devices[d], self.stream(d)))
            for d in work.src_regions
        }
        dtype = _np_dtype(work.dtype)
        self.buffers: dict[int, tuple[Index, Any]] = {
            d: (r, self.backend.empty([b - a for a, b in r], dtype, devices[d], self.stream(d)))
            for d, r in work.dst_regions.items()
        }

    def stream(self, device: int) -> Any:
        return self.transport.stream_of(device, self.channel)

    def read(self, device: int, index: Index) -> Any:
        """The slice `index` as `device` holds it (its source shard, or delivered data)."""
        if device in self.views and contains(self.views[device][0], index):
            region, array = self.views[device]
        else:
            region, array = self.buffers[device]
        return array[relative_slices(index, region)]

    def target(self, device: int, index: Index) -> Any:
        """Where `device` keeps slice `index` of its destination shard."""
        region, buffer = self.buffers[device]
        return buffer[relative_slices(index, region)]

    def write(self, device: int, index: Index, data: Any, from_device: int) -> None:
        """Queue `device`'s copy of `data` (held by `from_device`) into its slice `index`."""
        target = self.target(device, index)
        if tuple(target.shape) != tuple(data.shape) or target.dtype != data.dtype:
            raise ValueError(
                f"{self.work.describe}: device {device} expects {target.dtype}{list(target.shape)} "
                f"for {format_index(index)} but got {data.dtype}{list(data.shape)}"
            )
        stream = self.stream(device)
        if from_device != device:  # wait for what from_device's stream has queued
            event = self.backend.record(self.stream(from_device), self.devices[from_device])
            self.backend.wait_event(stream, event, self.devices[device])
        self.backend.copy(target, data, self.devices[device], stream)

    def local(self, op: Op) -> None:
        """An op whose devices are all on this host: queued copies."""
        if op.kind == "allgather":
            for device in op.devices:
                for owner, part in zip(op.devices, op.parts):
                    if owner != device and all(b > a for a, b in part):
                        self.write(device, part, self.read(owner, part), owner)
            return
        data = self.read(op.src_device, op.index)
        for device in op.dst_devices:
            if device in self.buffers:
                self.write(device, op.index, data, op.src_device)

    def finish(self) -> dict[int, Any]:
        """The destination shards as JAX arrays (ordered after everything queued for them)."""
        return {
            d: self.backend.to_jax(buffer, self.devices[d], self.stream(d))
            for d, (_, buffer) in self.buffers.items()
        }


# -- the transport -----------------------------------------------------------------------------


class NcclTransport(Transport):
    """Cross-host ops as NCCL broadcasts ([Note: NCCL transport])."""

    name = "nccl"

    def __init__(self, devices: Mapping[int, Any], backend: Any = None):
        self.backend = backend if backend is not None else CupyBackend()
        self.devices = dict(devices)  # global id -> jax.Device
        self.comms: dict[tuple[str, tuple[int, ...]], dict[int, Any]] = {}
        self._streams: dict[tuple[int, str], Any] = {}
        # work id -> (channel, streams used, communicators used, buffers kept alive, ops)
        self._pending: dict[str, dict[str, Any]] = {}
        self._aborted: dict[str, str] = {}
        self._lock = threading.Lock()

    def unique_id(self) -> Any:
        return self.backend.unique_id()

    def stream_of(self, device: int, channel: str) -> Any:
        with self._lock:
            stream = self._streams.get((device, channel))
            if stream is None:
                stream = self._streams[(device, channel)] = self.backend.stream(
                    self.devices[device]
                )
            return stream

    def create(self, group: tuple[int, ...], uid: Any, channel: str = RESHARD_CHANNEL) -> None:
        """Create this host's ranks of the communicator over `group` (a collective call: every
        member host makes it with the same `uid`)."""
        key = (channel, tuple(group))
        if key in self.comms:
            return
        members = group_ranks(group, list(self.devices))
        comms = {}
        with self.backend.group():
            for gid, rank in members:
                comms[gid] = self.backend.communicator(len(group), uid, rank, self.devices[gid])
        with self._lock:
            self.comms[key] = comms

    def has(self, group: tuple[int, ...], channel: str = RESHARD_CHANNEL) -> bool:
        return (channel, tuple(group)) in self.comms

    def collective(self, work: HostWork, step: Step, data: Any, deadline: float) -> None:
        """Queue op `step.op`'s broadcast on this host's members; return without waiting."""
        op = work.ops[step.op]
        channel = getattr(data, "channel", RESHARD_CHANNEL)
        group = tuple(sorted(step.group))
        reason = aborted_reason(self._aborted, work.work_id)
        if reason is not None:
            raise RuntimeError(f"host {work.host}: {work.where(step.op)}: aborted: {reason}")
        comms = self.comms.get((channel, group))
        if comms is None:
            raise RuntimeError(
                f"host {work.host}: {work.where(step.op)}: communicator {list(group)} (channel "
                f"{channel}) was not created before the plan ran, or was aborted since"
            )
        root = group.index(op.src_device)
        shape, nbytes = expected_bytes(work, step.op)
        dtype = _np_dtype(work.dtype)
        calls, copies_after = [], []
        for gid, _rank in group_ranks(group, list(self.devices)):
            device, stream = self.devices[gid], data.stream(gid)
            if gid == op.src_device:
                send = recv = self.backend.contiguous(data.read(gid, op.index), device, stream)
            else:
                target = data.target(gid, op.index) if gid in data.buffers else None
                if target is not None and target.flags.c_contiguous:
                    send = recv = target  # straight into the destination shard
                else:
                    send = recv = self.backend.empty(shape, dtype, device, stream)
                    if target is not None:
                        copies_after.append((gid, recv))
            if tuple(recv.shape) != shape or recv.nbytes != nbytes:
                raise ValueError(
                    f"host {work.host}: {work.where(step.op)}: device {gid} brings "
                    f"{recv.dtype}{list(recv.shape)} ({recv.nbytes} B) but the op moves "
                    f"{work.dtype}{list(shape)} ({nbytes} B); refusing to start the broadcast"
                )
            calls.append((gid, send, recv, stream))
        label = f"{work.where(step.op)} on communicator {list(group)} ({channel})"
        with self.backend.group():
            for gid, send, recv, stream in calls:
                self.backend.broadcast(
                    comms[gid], send, recv, nbytes, root, stream, self.devices[gid], label=label
                )
        for gid, buffer in copies_after:
            data.write(gid, op.index, buffer, gid)
        with self._lock:
            pending = self._pending.setdefault(
                work.work_id,
                {"channel": channel, "devices": set(), "groups": set(), "keep": [], "ops": []},
            )
            pending["devices"].update(gid for gid, *_ in calls)
            pending["groups"].add(group)
            pending["keep"].extend(buffer for _, send, recv, _ in calls for buffer in (send, recv))
            events = {gid: self.backend.record(s, self.devices[gid]) for gid, _, _, s in calls}
            pending["ops"].append((step.op, events))

    def complete(self, work: HostWork, deadline: float) -> None:
        """Wait until every op this host queued for `work` has finished on the GPUs."""
        with self._lock:
            pending = self._pending.pop(work.work_id, None)
        if pending is None:
            return
        channel = pending["channel"]
        comms = [
            (g, c) for g in pending["groups"] for c in self.comms.get((channel, g), {}).values()
        ]
        while True:
            # An abort lets the aborted kernels exit, so their events fire: check it first.
            reason = aborted_reason(self._aborted, work.work_id)
            if reason is not None:
                raise RuntimeError(
                    f"host {work.host}: {work.describe or work.work_id} aborted while in flight: "
                    f"{reason}"
                )
            for group, comm in comms:
                try:
                    self.backend.check(comm)
                except Exception as e:
                    self._abort_groups(channel, pending["groups"])  # unusable now
                    raise RuntimeError(
                        f"host {work.host}: {work.describe or work.work_id}: NCCL reported an "
                        f"error on communicator {list(group)}: {e}; its communicators were "
                        "aborted"
                    ) from e
            first_open = next(
                (
                    i
                    for i, events in pending["ops"]
                    if not all(self.backend.done(e) for e in events.values())
                ),
                None,
            )
            if first_open is None:
                return
            if time.monotonic() > deadline:
                group = next(s.group for s in work.steps if s.op == first_open)
                peers = sorted(set(group) - set(self.devices))
                self._abort_groups(channel, pending["groups"])
                raise TimeoutError(
                    f"host {work.host}: {work.where(first_open)}: the NCCL broadcast over "
                    f"{list(group)} did not finish within {work.timeout_s:g} s; waiting for "
                    f"devices {peers} on other hosts (hosts {list(_peers(work, first_open))}); "
                    "its communicators were aborted"
                )
            time.sleep(0.0002)

    def finished(self, work: HostWork) -> bool:
        """Whether every op this host queued for `work` has finished on the GPUs, without
        waiting; if so, the buffers kept for it (sources, staging buffers) are let go. Raises
        as `complete` does when the work was aborted or NCCL reported an error."""
        with self._lock:
            pending = self._pending.get(work.work_id)
        if pending is None:
            return True
        reason = aborted_reason(self._aborted, work.work_id)
        if reason is not None:
            raise RuntimeError(
                f"host {work.host}: {work.describe or work.work_id} aborted while in flight: "
                f"{reason}"
            )
        channel = pending["channel"]
        for group in pending["groups"]:
            for comm in self.comms.get((channel, group), {}).values():
                try:
                    self.backend.check(comm)
                except Exception as e:
                    self._abort_groups(channel, pending["groups"])
                    raise RuntimeError(
                        f"host {work.host}: {work.describe or work.work_id}: NCCL reported an "
                        f"error on communicator {list(group)}: {e}; its communicators were "
                        "aborted"
                    ) from e
        if all(self.backend.done(e) for _, events in pending["ops"] for e in events.values()):
            with self._lock:
                self._pending.pop(work.work_id, None)
            return True
        return False

    def _abort_groups(self, channel: str, groups: set[tuple[int, ...]]) -> None:
        with self._lock:
            dropped = [self.comms.pop((channel, g), {}) for g in groups]
        for comms in dropped:
            for comm in comms.values():
                self.backend.abort(comm)

    def abort(self, work_id: str, reason: str = "a peer failed") -> None:
        """Abort every communicator (NCCL cannot cancel one op); they are created anew on next
        use."""
        with self._lock:
            self._aborted[work_id] = reason
            comms, self.comms = self.comms, {}
        for members in comms.values():
            for comm in members.values():
                self.backend.abort(comm)

    def forget(self, work_id: str) -> None:
        """Drop what is kept of `work_id` and of the works under it (`work_id:...`: a failed
        step's transfers keep their buffers until then)."""
        prefix = work_id + ":"
        with self._lock:
            self._aborted.pop(work_id, None)
            for key in [k for k in self._pending if k == work_id or k.startswith(prefix)]:
                del self._pending[key]


def _peers(work: HostWork, op_index: int) -> tuple[int, ...]:
    return next((s.peers for s in work.steps if s.op == op_index), ())


def cupy_view(array: Any) -> Any:
    """A CuPy array sharing a JAX GPU array's memory (DLPack, no copy)."""
    cupy, _ = cupy_modules()
    return cupy.from_dlpack(array)
