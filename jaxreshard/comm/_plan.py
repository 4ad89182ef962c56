"""Plan records: what moves from which device to which, with which primitive, in what order.

A `Plan` is frozen and made of ints, strings and tuples, so it pickles and ships to remote hosts
cheaply; runtimes execute it and never re-plan.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

from jaxreshard.comm._cluster import Cluster
from jaxreshard.comm._layout import Index, Layout, format_index, index_size
from jaxreshard.comm._tasks import UnitTask

OP_KINDS = ("send", "broadcast", "allgather")

PLAN_FORMAT = "jaxreshard-plan/1"


@dataclasses.dataclass(frozen=True, slots=True)
class Op:
    """One transfer of a plan.

    Attributes:
        kind: `send` (one device to one), `broadcast` (one device to several, pipelined along
            `dst_devices` in order), or `allgather` (every device of `devices` contributes its
            region of `parts` and afterwards all hold `index`).
        index: the global region the op delivers (for allgather: what every participant holds
            afterwards).
        nbytes: bytes of `index`.
        src_device: sender (send, broadcast).
        dst_devices: receivers (send: exactly one; broadcast: one or more, in chain order).
        devices: allgather participants.
        parts: allgather: the region each participant contributes (same order as `devices`);
            the parts tile `index`, and may be empty.
        after: positions of ops in the plan that must finish before this one starts.
        task: the unit task this op serves (position in `Plan.tasks`).
    """

    kind: str
    index: Index
    nbytes: int
    src_device: int = -1
    dst_devices: tuple[int, ...] = ()
    devices: tuple[int, ...] = ()
    parts: tuple[Index, ...] = ()
    after: tuple[int, ...] = ()
    task: int = -1

    def __post_init__(self) -> None:
        if self.kind not in OP_KINDS:
            raise ValueError(f"Op(kind={self.kind!r}): must be one of {OP_KINDS}.")
        if self.kind == "allgather":
            if len(self.devices) < 2 or len(self.parts) != len(self.devices):
                raise ValueError(
                    f"allgather op needs >= 2 devices and one part per device; got devices="
                    f"{self.devices}, {len(self.parts)} parts"
                )
            if sum(index_size(p) for p in self.parts) != index_size(self.index):
                raise ValueError(f"allgather parts {self.parts} do not tile {self.index}")
        else:
            if self.src_device < 0 or not self.dst_devices:
                raise ValueError(f"{self.kind} op needs src_device and dst_devices")
            if self.kind == "send" and len(self.dst_devices) != 1:
                raise ValueError(f"send op has {len(self.dst_devices)} receivers; use broadcast")
            if self.src_device in self.dst_devices:
                raise ValueError(f"{self.kind} op sends device {self.src_device} to itself")

    @property
    def receivers(self) -> tuple[int, ...]:
        """Devices that hold `index` after the op and did not necessarily before."""
        return self.devices if self.kind == "allgather" else self.dst_devices

    @property
    def participants(self) -> tuple[int, ...]:
        if self.kind == "allgather":
            return self.devices
        return (self.src_device, *self.dst_devices)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.kind == "allgather":
            out["devices"] = list(self.devices)
            out["parts"] = [[list(r) for r in p] for p in self.parts]
        else:
            out["src_device"] = self.src_device
            out["dst_devices"] = list(self.dst_devices)
        out["index"] = [list(r) for r in self.index]
        out["bytes"] = self.nbytes
        if self.after:
            out["after"] = list(self.after)
        return out

    def __str__(self) -> str:
        where = format_index(self.index)
        if self.kind == "allgather":
            return f"allgather {list(self.devices)} {where} {self.nbytes} B"
        arrow = ",".join(map(str, self.dst_devices))
        return f"{self.kind} {self.src_device}->{arrow} {where} {self.nbytes} B"


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """A planned cross-mesh resharding and its simulated timeline on `cluster`.

    Attributes:
        shape, dtype, itemsize: the array.
        src, dst: the layouts (device -> global region).
        cluster: the cost model the plan was made and simulated for.
        strategy: the strategy asked for (e.g. `auto`).
        chosen: the concrete strategy used (differs from `strategy` only for `auto`).
        tasks: the unit tasks.
        ops: the transfers, in issue order.
        timeline: simulated (start_s, end_s) of each op.
        seconds: simulated completion time.
        lower_bound_s: a lower bound on the completion time of any plan on this cluster.
        search_finished: for `broadcast_dfs`, whether the search completed (or proved its result
            optimal) within its budget; None for the other strategies.
        hops: per op, the simulated (start_s, end_s) of each hop of its chain (sender to first
            receiver, and on): a hop holds its links only for its own span (see [Note: chained
            hops] in `_simulate.py`); none for an allgather.
    """

    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    src: Layout
    dst: Layout
    cluster: Cluster
    strategy: str
    chosen: str
    tasks: tuple[UnitTask, ...]
    ops: tuple[Op, ...]
    timeline: tuple[tuple[float, float], ...]
    seconds: float
    lower_bound_s: float
    search_finished: bool | None = None
    hops: tuple[tuple[tuple[float, float], ...], ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes of the whole array."""
        return math.prod(self.shape) * self.itemsize

    def ops_for_device(self, device: int) -> tuple[int, ...]:
        """Positions of the ops `device` takes part in, in issue order."""
        return tuple(i for i, op in enumerate(self.ops) if device in op.participants)

    def ops_for_host(self, host: int) -> tuple[int, ...]:
        """Positions of the ops that any device of `host` takes part in, in issue order."""
        devices = set(self.cluster.hosts[host])
        return tuple(i for i, op in enumerate(self.ops) if devices & set(op.participants))

    def cross_host_bytes(self) -> int:
        """Bytes that cross a host boundary (counting every hop of a broadcast chain)."""
        host = self.cluster.host_of
        total = 0
        for op in self.ops:
            if op.kind == "allgather":
                continue
            chain = (op.src_device, *op.dst_devices)
            hops = sum(host(a) != host(b) for a, b in itertools.pairwise(chain))
            total += hops * op.nbytes
        return total

    def to_json(self, case: str | None = None) -> dict[str, Any]:
        """The `jaxreshard-plan/1` JSON object (see DESIGN.md, "Formats")."""
        ops = []
        hops = self.hops or ((),) * len(self.ops)
        for op, (start, end), spans in zip(self.ops, self.timeline, hops):
            record = op.to_json()
            record["start_s"] = start
            record["end_s"] = end
            if spans:
                record["hops"] = [list(span) for span in spans]
            ops.append(record)
        out: dict[str, Any] = {"format": PLAN_FORMAT}
        if case is not None:
            out["case"] = case
        out.update(
            strategy=self.strategy,
            chosen=self.chosen,
            shape=list(self.shape),
            dtype=self.dtype,
            hosts={str(h): list(d) for h, d in enumerate(self.cluster.hosts)},
            cluster=self.cluster.link_summary(),
            seconds=self.seconds,
            lower_bound_s=self.lower_bound_s,
            ops=ops,
        )
        return out

    def __str__(self) -> str:
        name = self.chosen if self.chosen == self.strategy else f"{self.strategy} -> {self.chosen}"
        head = (
            f"Plan {name} for {self.dtype}{list(self.shape)}: {len(self.tasks)} unit "
            f"tasks, {len(self.ops)} ops, simulated {self.seconds * 1e3:.3f} ms "
            f"(lower bound {self.lower_bound_s * 1e3:.3f} ms)"
        )
        lines = [head]
        for op, (start, end) in zip(self.ops, self.timeline):
            lines.append(f"  {start * 1e3:9.3f}-{end * 1e3:9.3f} ms  {op}")
        return "\n".join(lines)
