"""Resharding arrays across the Ray runtime's hosts: planning, the hosts' programs, NCCL
communicators (a part of `RayRuntime`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxreshard.comm import Layout, VirtualSharding
from jaxreshard.comm import plan_reshard as _plan_reshard
from jaxreshard.comm._order import check_programs, host_programs
from jaxreshard.comm._plan import Plan
from jaxreshard.comm._transport import HostWork
from jaxreshard.runtime.ray._remote import RemoteArray

DEFAULT_TIMEOUT_S = 120.0
MAX_HOSTS = 4096
MAX_DEVICES_PER_HOST = 1024


class HostResharding:
    """`RayRuntime`'s resharding (a mixin over its `actors`, `cluster`, `transport`)."""

    actors: list[Any]
    cluster: Any
    hosts: Any
    transport: str
    timeout_s: float
    last_stats: Any
    _communicators: set[tuple[str, tuple[int, ...]]]
    _wait: Callable[..., Any]  # (HostWaits._wait)
    _new_id: Callable[[str], str]
    _check_array: Callable[[Any], None]
    _check_sharding: Callable[[Any, str], None]

    def plan(
        self, array: RemoteArray, dst_sharding: VirtualSharding, *, strategy: str = "auto"
    ) -> Plan:
        self._check_array(array)
        self._check_sharding(dst_sharding, "dst_sharding")
        return _plan_reshard(
            array.shape,
            array.dtype,
            array.sharding,
            dst_sharding,
            cluster=self.cluster,
            strategy=strategy,
        )

    def reshard(
        self, array: RemoteArray, dst_sharding: VirtualSharding, *, strategy: str = "auto"
    ) -> RemoteArray:
        """Move `array` to `dst_sharding` by plan, host to host (see [Note: Ray runtime])."""
        plan = self.plan(array, dst_sharding, strategy=strategy)
        collectives = self.transport == "nccl"
        programs = host_programs(plan, collectives=collectives)
        check_programs(programs, plan.cluster)
        if collectives:
            self._ensure_communicators(programs)
        dst_id = self._new_id("reshard")
        what = f"resharding {array!r} to {dst_sharding.spec}"
        works = self._host_works(plan, programs, array.array_id, dst_id, what)
        calls = {h: self.actors[h].run.remote(work, self.transport) for h, work in works.items()}
        self.last_stats = self._wait(calls, what, self.timeout_s + 10.0, work_id=dst_id)
        # (a small array's value, where the driver has it, is the same in any layout)
        return RemoteArray(self, dst_id, array.shape, array.dtype, dst_sharding, array.value)

    def reshard_naive(self, array: RemoteArray, dst_sharding: VirtualSharding) -> RemoteArray:
        """The executed benchmark's baseline: every receiving host pulls the whole tensor.

        Each source region is put into the object store once (one replica); every host with
        destination devices fetches all of them and cuts out its devices' regions. No plan.
        """
        self._check_array(array)
        self._check_sharding(dst_sharding, "dst_sharding")
        src = Layout.from_sharding(array.sharding, array.shape)
        dst = Layout.from_sharding(dst_sharding, array.shape, what="dst_sharding")
        first: dict[Any, int] = {}
        for device, index in zip(src.devices, src.indices):
            first.setdefault(index, device)
        by_host: dict[int, list[int]] = {}
        for device in first.values():
            by_host.setdefault(self.cluster.host_of(device), []).append(device)
        what = f"naively resharding {array!r}"
        published = self._wait(
            {
                h: self.actors[h].publish.remote(array.array_id, devices)
                for h, devices in by_host.items()
            },
            what,
        )
        refs = [
            (index, published[self.cluster.host_of(d)][d], self.cluster.host_of(d))
            for index, d in first.items()
        ]
        dst_id = self._new_id("naive")
        receivers: dict[int, dict[int, Any]] = {}
        for device, index in zip(dst.devices, dst.indices):
            receivers.setdefault(self.cluster.host_of(device), {})[device] = index
        self._wait(
            {
                h: self.actors[h].pull_whole.remote(
                    dst_id, array.dtype.name, refs, regions, self.timeout_s
                )
                for h, regions in receivers.items()
            },
            what,
        )
        return RemoteArray(self, dst_id, array.shape, array.dtype, dst_sharding, array.value)

    def _host_works(
        self, plan: Plan, programs: dict[int, list[Any]], src_id: str, dst_id: str, what: str
    ) -> dict[int, HostWork]:
        works = {}
        involved = set(programs) | {self.cluster.host_of(d) for d in plan.dst.devices}
        for h in sorted(involved):
            steps = tuple(programs.get(h, ()))
            own = set(self.hosts[h])
            works[h] = HostWork(
                work_id=dst_id,
                host=h,
                shape=plan.shape,
                dtype=plan.dtype,
                steps=steps,
                ops={s.op: plan.ops[s.op] for s in steps},
                src_regions={d: i for d, i in zip(plan.src.devices, plan.src.indices) if d in own},
                dst_regions={d: i for d, i in zip(plan.dst.devices, plan.dst.indices) if d in own},
                src_array=src_id,
                dst_array=dst_id,
                timeout_s=self.timeout_s,
                describe=what,
                **self._chunking(plan),
            )
        return works

    def _chunking(self, plan: Plan) -> dict[str, int]:
        """The TCP transport moves slices in the cluster model's chunks (cheap per message, and
        what the simulator assumes); the object store keeps its larger default chunks, as every
        chunk costs it an object and an actor call."""
        return {"chunk_bytes": plan.cluster.chunk_bytes} if self.transport == "tcp" else {}

    def _ensure_communicators(
        self, programs: dict[int, list[Any]], channel: str = "reshard"
    ) -> None:
        """Create the communicators the programs use that do not exist yet (see
        [Note: NCCL transport]), one group at a time in sorted order."""
        groups = sorted({s.group for steps in programs.values() for s in steps if s.group})
        for group in groups:  # one fixed global order, the same on every host
            if (channel, group) in self._communicators:
                continue
            members = sorted({self.cluster.host_of(d) for d in group})
            uid = self._wait(
                {members[0]: self.actors[members[0]].nccl_unique_id.remote()},
                f"making the NCCL id of {list(group)}",
            )[members[0]]
            self._wait(
                {h: self.actors[h].nccl_create.remote(group, uid, channel) for h in members},
                f"creating the NCCL communicator {list(group)} ({channel})",
            )
            self._communicators.add((channel, group))
