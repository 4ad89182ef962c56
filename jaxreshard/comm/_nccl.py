"""GPU transport: one NCCL broadcast per cross-host op, through CuPy.

[Note: NCCL transport]
- One communicator per (sender + receivers) device group, created before any op runs, group by
  group in one fixed global order (sorted device ids) on every host, with the NCCL unique id made
  by the group's first host and passed to the others through Ray.
- Ops are issued in the plan's order (checked by `_order.check_programs`), each as one
  `ncclBroadcast` from the sender's rank, on a dedicated stream per device. NCCL's ring broadcast
  pipelines chunks through the receivers: the paper's broadcast strategy. A host that holds
  several members of a group issues their calls inside one `groupStart`/`groupEnd`.
- JAX arrays and CuPy arrays share memory through DLPack (no copies); a broadcast moves raw
  bytes (`ncclUint8`), so every dtype goes through unchanged.
- Before any NCCL call, each side checks the buffer it brings against the op's shape and dtype:
  a mismatch there would hang the collective instead of raising.
- Completion is polled against the work's deadline; on timeout the communicator is aborted and
  the error names the op, the tensor and the peers.
Importing this module needs neither CuPy nor a GPU; using the transport needs both.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxreshard.comm._order import Step
from jaxreshard.comm._transport import HostData, HostWork, Transport


def cupy_modules() -> tuple[Any, Any]:
    """Import CuPy and its NCCL bindings, or explain how to get them."""
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as e:
        raise RuntimeError(
            "the NCCL transport needs CuPy with NCCL: pip install 'jaxreshard[gpu]' "
            f"(cupy-cuda12x and nvidia-nccl-cu12); import failed: {e}"
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


class NcclTransport(Transport):
    """Cross-host ops as NCCL broadcasts ([Note: NCCL transport])."""

    name = "nccl"

    def __init__(self, devices: Mapping[int, Any]):
        self.cupy, self.nccl = cupy_modules()
        self.devices = dict(devices)  # global id -> jax.Device
        self.comms: dict[tuple[int, ...], dict[int, Any]] = {}
        self.streams = {}
        for gid, device in self.devices.items():
            with self.cupy.cuda.Device(device.local_hardware_id):
                self.streams[gid] = self.cupy.cuda.Stream(non_blocking=True)

    @staticmethod
    def unique_id() -> Any:
        _, nccl = cupy_modules()
        return nccl.get_unique_id()

    def create(self, group: tuple[int, ...], uid: Any) -> None:
        """Create this host's ranks of the communicator over `group` (a collective call)."""
        if group in self.comms:
            return
        members = group_ranks(group, list(self.devices))
        comms = {}
        self.nccl.groupStart()
        try:
            for gid, rank in members:
                with self.cupy.cuda.Device(self.devices[gid].local_hardware_id):
                    comms[gid] = self.nccl.NcclCommunicator(len(group), uid, rank)
        finally:
            self.nccl.groupEnd()
        self.comms[group] = comms

    def collective(self, work: HostWork, step: Step, data: HostData, deadline: float) -> None:
        cupy, nccl = self.cupy, self.nccl
        op = work.ops[step.op]
        group = tuple(sorted(step.group))
        if group not in self.comms:
            raise RuntimeError(
                f"host {work.host}: {work.where(step.op)}: communicator {list(group)} was not "
                "created before the plan ran"
            )
        root = sorted(group).index(op.src_device)
        shape, nbytes = expected_bytes(work, step.op)
        buffers = {}
        for gid, _rank in group_ranks(group, list(self.devices)):
            with cupy.cuda.Device(self.devices[gid].local_hardware_id):
                if gid == op.src_device:
                    buffer = cupy.ascontiguousarray(data.read(gid, op.index))
                else:
                    buffer = cupy.empty(shape, dtype=_np_dtype(work.dtype))
            if tuple(buffer.shape) != shape or buffer.nbytes != nbytes:
                raise ValueError(
                    f"host {work.host}: {work.where(step.op)}: device {gid} brings "
                    f"{buffer.dtype}{list(buffer.shape)} ({buffer.nbytes} B) but the op moves "
                    f"{work.dtype}{list(shape)} ({nbytes} B); refusing to start the broadcast"
                )
            buffers[gid] = buffer
        uint8 = getattr(nccl, "NCCL_UINT8", getattr(nccl, "NCCL_CHAR", 0))
        nccl.groupStart()
        try:
            for gid, buffer in buffers.items():
                with cupy.cuda.Device(self.devices[gid].local_hardware_id):
                    ptr = buffer.data.ptr
                    self.comms[group][gid].broadcast(
                        ptr, ptr, nbytes, uint8, root, self.streams[gid].ptr
                    )
        finally:
            nccl.groupEnd()
        self._wait(work, step, group, deadline)
        for gid, buffer in buffers.items():
            if gid != op.src_device and gid in data.buffers:
                data.write(gid, op.index, buffer)

    def _wait(self, work: HostWork, step: Step, group: tuple[int, ...], deadline: float) -> None:
        events = {}
        for gid in self.comms[group]:
            with self.cupy.cuda.Device(self.devices[gid].local_hardware_id):
                events[gid] = self.streams[gid].record()
        while not all(e.done for e in events.values()):
            for comm in self.comms[group].values():
                comm.check_async_error()
            if time.monotonic() > deadline:
                for comm in self.comms[group].values():
                    comm.abort()
                del self.comms[group]
                peers = sorted({d for d in group} - set(self.devices))
                raise TimeoutError(
                    f"host {work.host}: {work.where(step.op)}: the NCCL broadcast over "
                    f"{list(group)} did not finish within {work.timeout_s:g} s (waiting for "
                    f"devices {peers} on other hosts); the communicator was aborted"
                )
            time.sleep(0.0005)

    def abort(self, work_id: str, reason: str = "a peer failed") -> None:
        for comms in self.comms.values():
            for comm in comms.values():
                comm.abort()
        self.comms.clear()


def cupy_view(array: Any) -> Any:
    """A CuPy array sharing a JAX GPU array's memory (DLPack, no copy)."""
    cupy, _ = cupy_modules()
    return cupy.from_dlpack(array)
