"""The Ray runtime's driver: host actors, remote arrays, and multi-host plan execution.

[Note: Ray runtime]
One `HostActor` per host owns that host's devices. The driver plans (the planner sees the
runtime's devices as `VirtualDevice`s with their host), derives each host's program from the plan
(`_order.host_programs`), proves the programs cannot hang (`_order.check_programs`), and sends
each host only its part. Hosts then exchange slices among themselves (object store or NCCL),
without the driver. The driver waits with a deadline (from the start of the wait; for a pipeline
step, one that moves with the hosts' progress, see [Note: progress deadline]), notices a failed
or dead host at once, tells the others to stop waiting, and raises an error that names the host
and the op.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import logging
import math
import os
import queue
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from jaxreshard.cluster._describe import HOST_RESOURCE, driver_ip_for, links_of
from jaxreshard.comm import Cluster, Layout, VirtualDevice, VirtualMesh, VirtualSharding
from jaxreshard.comm import plan_reshard as _plan_reshard
from jaxreshard.comm._order import check_programs, host_programs
from jaxreshard.comm._plan import Plan
from jaxreshard.comm._transport import HostWork
from jaxreshard.runtime._remote import RemoteArray

DEFAULT_TIMEOUT_S = 120.0
PROBE_EVERY_S = 1.0  # how often a wait with a progress deadline asks the busy hosts


class RuntimeBroken(RuntimeError):
    """A host actor died (`host`, where known), or hosts of a stage that spans hosts may be
    stuck in its collectives; the runtime must be shut down and started again."""

    host: int | None = None


class RayRuntime:
    """Host actors on a Ray cluster (or a local Ray instance that emulates one)."""

    backend = "ray"

    def __init__(
        self,
        *,
        address: str | None = None,
        num_hosts: int | None = None,
        devices_per_host: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        transport: str = "auto",
        object_store_memory: int | None = None,
        cluster_links: dict[str, float] | None = None,
        start_timeout_s: float = 180.0,
        nodes: str = "per_host",
        emulate_network_gbps: float | None = None,
        gpu_memory_fraction: float = 0.6,
        platform: str = "auto",
        distributed: bool | None = None,
    ):
        import ray

        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0 seconds")
        for name, value in (("num_hosts", num_hosts), ("devices_per_host", devices_per_host)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"init(backend='ray', {name}={value!r}): must be an int >= 1")
        if transport not in ("auto", *TRANSPORTS):
            raise ValueError(
                f"init(transport={transport!r}): choose 'auto', {', '.join(map(repr, TRANSPORTS))}"
            )
        if platform not in PLATFORMS:
            choices = ", ".join(map(repr, PLATFORMS))
            raise ValueError(f"init(platform={platform!r}): choose {choices}")
        if distributed not in (None, True, False):
            raise ValueError(
                f"init(distributed={distributed!r}): True, False, or None (the default: the "
                "host actors join one jax.distributed runtime when there are two or more)"
            )
        local = address is None
        if nodes not in ("per_host", "single"):
            raise ValueError(f"init(nodes={nodes!r}): choose 'per_host' or 'single'")
        if local:
            if num_hosts is None:
                raise ValueError(
                    "init(backend='ray') without an address starts a local Ray instance and needs "
                    "num_hosts (and devices_per_host): e.g. init(backend='ray', num_hosts=4, "
                    "devices_per_host=2). To join a cluster, pass address='HOST:PORT' or 'auto'."
                )
            # Before Ray starts: too few GPUs is an error, not fake CPU devices.
            platform = local_platform(platform, num_hosts, devices_per_host, nodes, _machine_gpus())
        if ray.is_initialized():
            raise RuntimeError(
                "Ray is already initialised in this process; jaxreshard.init(backend='ray') "
                "starts or joins the cluster itself. Call ray.shutdown() first."
            )
        import jax

        self.timeout_s = timeout_s
        self._to_free: dict[int, list[str]] = {}  # host -> ids of dropped handles
        self._free_lock = threading.Lock()
        self.enable_x64 = bool(jax.config.jax_enable_x64)
        self._broken: str | None = None
        self._closed = False
        self._ids = itertools.count()
        # Pipelines the driver dropped, for the hosts to drop (see `drop_pipeline`); a thread
        # of their own sends them, made with the first pipeline.
        self._drops: queue.SimpleQueue[tuple[str, tuple[int, ...]] | None] = queue.SimpleQueue()
        self._dropper: threading.Thread | None = None
        self._dropper_lock = threading.Lock()
        self._local_cluster: Any = None
        if local:
            if nodes == "per_host":
                self._local_cluster = _start_local_nodes(num_hosts, object_store_memory)
                ray.init(
                    address=self._local_cluster.address,
                    logging_level=logging.WARNING,
                    namespace="jaxreshard",
                )
            else:
                ray.init(
                    num_cpus=max(num_hosts, os.cpu_count() or 1),
                    include_dashboard=False,
                    object_store_memory=object_store_memory,
                    logging_level=logging.WARNING,
                    namespace="jaxreshard",
                )
        else:
            # A driver joins an emulated cluster of this machine through its own node.
            ip = driver_ip_for(address)
            extra = {"_node_ip_address": ip} if ip else {}
            ray.init(
                address=address, logging_level=logging.WARNING, namespace="jaxreshard", **extra
            )
        # A cluster that describes itself (e.g. `jaxreshard cluster up`) gives the planner its
        # NIC model and the devices per host; see [Note: cluster description].
        self.description = None if local else _described_cluster()
        if self.description is not None:
            cluster_links = {**links_of(self.description), **(cluster_links or {})}
            if devices_per_host is None:
                devices_per_host = int(self.description.get("devices_per_host", 1))
        self.emulate_network_gbps = emulate_network_gbps
        if not 0 < gpu_memory_fraction <= 1:
            raise ValueError(
                f"init(gpu_memory_fraction={gpu_memory_fraction!r}): a fraction in (0, 1]"
            )
        self.gpu_memory_fraction = gpu_memory_fraction
        self.distributed = False  # whether the host actors joined one jax.distributed runtime
        try:
            self._start_actors(
                local, num_hosts, devices_per_host, start_timeout_s, transport, platform,
                distributed,
            )  # fmt: skip
        except BaseException:
            self._kill_all()
            ray.shutdown()
            if self._local_cluster is not None:
                self._local_cluster.shutdown()
            self._closed = True
            raise
        self.cluster = Cluster(self.hosts, **(cluster_links or {}))
        platform = self.infos[0]["platform"]
        self.transport = transport if transport != "auto" else _auto_transport(platform)
        self._communicators: set[tuple[str, tuple[int, ...]]] = set()

    def _start_actors(
        self,
        local: bool,
        num_hosts: int | None,
        devices_per_host: int | None,
        start_timeout_s: float,
        transport: str = "auto",
        platform: str = "auto",
        distributed: bool | None = None,
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from jaxreshard.runtime._host import HostActor

        nodes = _host_nodes([n for n in ray.nodes() if n["Alive"]])
        gpus_per_node = [int(n["Resources"].get("GPU", 0)) for n in nodes]
        if local:
            # `local_platform` decided; Ray's own count of the GPUs must agree.
            use_gpu = platform == "gpu"
            want = (devices_per_host or 1) * num_hosts  # type: ignore[operator]
            if use_gpu and (not gpus_per_node or gpus_per_node[0] < want):
                raise RuntimeError(
                    f"init(backend='ray', num_hosts={num_hosts}, devices_per_host="
                    f"{devices_per_host}) asks for {want} GPUs, but Ray found "
                    f"{gpus_per_node[0] if gpus_per_node else 0} on this machine; ask for fewer, "
                    "or pass platform='cpu' for fake CPU devices"
                )
            placements: list[Any] = [None] * num_hosts  # type: ignore[operator]
            counts = [devices_per_host or 1] * num_hosts  # type: ignore[operator]
            gpus = [counts[0] if use_gpu else 0] * num_hosts  # type: ignore[operator]
        else:
            if platform == "cpu":  # asked for: the nodes' GPUs stay unused
                gpus_per_node = [0] * len(nodes)
            elif platform == "gpu" and not any(gpus_per_node):
                raise RuntimeError(
                    f"init(backend='ray', platform='gpu'): none of the cluster's {len(nodes)} "
                    "live nodes has GPUs in Ray's resources (start them with `ray start "
                    "--num-gpus=N`), or pass platform='cpu'"
                )
            with_gpus = [n for n, g in zip(nodes, gpus_per_node) if g > 0]
            if with_gpus and len(with_gpus) < len(nodes):
                # A head node without GPUs must not turn the cluster into CPU devices.
                skipped = [n["NodeManagerAddress"] for n, g in zip(nodes, gpus_per_node) if not g]
                warnings.warn(
                    f"the Ray cluster has {len(with_gpus)} nodes with GPUs and nodes without "
                    f"({skipped}, e.g. a head node for the driver): host actors start on the GPU "
                    "nodes only, so the stages run on GPUs",
                    stacklevel=3,
                )
                nodes = with_gpus
                gpus_per_node = [g for g in gpus_per_node if g > 0]
            if num_hosts is not None and num_hosts > len(nodes):
                raise ValueError(
                    f"init(num_hosts={num_hosts}): the cluster has only {len(nodes)} live nodes"
                )
            nodes = nodes[: num_hosts or len(nodes)]
            gpus_per_node = gpus_per_node[: len(nodes)]
            placements = [NodeAffinitySchedulingStrategy(n["NodeID"], soft=False) for n in nodes]
            use_gpu = all(g > 0 for g in gpus_per_node[: len(nodes)])
            counts = [
                gpus_per_node[i] if use_gpu else (devices_per_host or 1) for i in range(len(nodes))
            ]
            if use_gpu and devices_per_host is not None:
                short = {
                    n["NodeManagerAddress"]: c
                    for n, c in zip(nodes, counts)
                    if c < devices_per_host
                }
                if short:
                    raise RuntimeError(
                        f"init(devices_per_host={devices_per_host}): nodes {short} have fewer "
                        "GPUs (address: GPUs in Ray's resources); pass devices_per_host="
                        f"{min(short.values())} or less, or start those nodes with more GPUs"
                    )
                counts = [devices_per_host] * len(counts)
            gpus = counts if use_gpu else [0] * len(nodes)
        platform = "gpu" if use_gpu else "cpu"
        joining = len(counts) > 1 if distributed is None else distributed
        remote_cls = ray.remote(HostActor)
        self.actors: list[Any] = []
        hosts, first = [], 0
        for h, (count, placement) in enumerate(zip(counts, placements)):
            env = {"JAX_PLATFORMS": "cuda" if use_gpu else "cpu"}
            if use_gpu:
                # XLA preallocates 75% of a GPU by default; keep it to the fraction, so that
                # CuPy (receive buffers) and NCCL have room (see [Note: NCCL transport]).
                env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{self.gpu_memory_fraction:g}"
            else:
                env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={count}"
            options: dict[str, Any] = dict(
                max_concurrency=16, num_cpus=0, num_gpus=gpus[h], runtime_env={"env_vars": env}
            )
            if placement is not None:
                options["scheduling_strategy"] = placement
            elif self._local_cluster is not None:
                options["resources"] = {f"{_HOST_RESOURCE}{h}": 1}
            self.actors.append(
                remote_cls.options(**options).remote(
                    h,
                    first,
                    count if not use_gpu else None,
                    platform if not use_gpu else "auto",
                    self.enable_x64,
                    joining,
                )
            )
            hosts.append(tuple(range(first, first + count)))
            first += count
        if joining:  # see [Note: multi-host stages] in `_pipeline_ray.py`
            coordinator = self._wait(
                {0: self.actors[0].coordinator_address.remote()},
                "choosing the jax.distributed coordinator",
                start_timeout_s,
            )[0]
            self._wait(
                {
                    h: a.join.remote(coordinator, len(self.actors), start_timeout_s)
                    for h, a in enumerate(self.actors)
                },
                f"joining the host actors' jax.distributed runtime (coordinator {coordinator})",
                start_timeout_s,
            )
            self.distributed = True
        infos = self._wait(
            {h: a.info.remote() for h, a in enumerate(self.actors)},
            "starting the host actors",
            start_timeout_s,
        )
        self.infos: list[dict[str, Any]] = [infos[h] for h in range(len(self.actors))]
        check_reported_devices(hosts, self.infos, "gpu" if use_gpu else "cpu")
        self.hosts = tuple(hosts)
        handles = dict(enumerate(self.actors))
        self.emulator = None
        if self.emulate_network_gbps is not None:
            from jaxreshard.comm._emulate import LinkEmulator

            self.emulator = (
                ray.remote(LinkEmulator).options(num_cpus=0).remote(self.emulate_network_gbps)
            )
        addresses = None
        if (transport if transport != "auto" else _auto_transport(platform)) == "tcp":
            addresses = self._wait(
                {h: a.open_stream.remote() for h, a in handles.items()},
                "opening the hosts' TCP listeners",
                start_timeout_s,
            )
        self._wait(
            {h: a.set_peers.remote(handles, self.emulator, addresses) for h, a in handles.items()},
            "introducing the host actors",
            start_timeout_s,
        )
        self.devices = tuple(
            VirtualDevice(d, h, self.infos[h]["platform"])
            for h, ds in enumerate(self.hosts)
            for d in ds
        )

    # -- meshes and arrays ---------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return not self._closed

    def mesh(
        self, shape: Sequence[int], axis_names: Sequence[str], devices: Sequence[int] | None = None
    ) -> VirtualMesh:
        """A mesh over the runtime's devices (global ids; default: the first ones)."""
        self._check_usable()
        size = math.prod(shape)
        ids = list(devices) if devices is not None else [d.id for d in self.devices[:size]]
        unknown = sorted(set(ids) - {d.id for d in self.devices})
        if unknown:
            raise ValueError(
                f"mesh devices {unknown} do not exist; this runtime has devices "
                f"{[d.id for d in self.devices]} ({self.cluster.describe()})"
            )
        if len(ids) != size:
            raise ValueError(f"mesh shape {tuple(shape)} needs {size} devices, got {len(ids)}")
        return VirtualMesh.from_ids(
            shape, axis_names, ids, {d.id: d.process_index for d in self.devices}
        )

    def sharding(self, mesh: VirtualMesh, spec: PartitionSpec) -> VirtualSharding:
        return VirtualSharding(mesh, spec)

    def put(self, value: Any, sharding: VirtualSharding) -> RemoteArray:
        """Place a numpy array on the hosts with `sharding`."""
        self._check_usable()
        value = np.asarray(value)
        wide = (np.float64, np.int64, np.uint64, np.complex128)
        if value.dtype in wide and not self.enable_x64:
            raise ValueError(
                f"put: {value.dtype} needs 64-bit JAX on the hosts, but jax_enable_x64 was off "
                "when the runtime started; call jax.config.update('jax_enable_x64', True) "
                "before jaxreshard.init, or cast to a 32-bit type first"
            )
        self._check_sharding(sharding, "sharding")
        layout = Layout.from_sharding(sharding, value.shape, what="sharding")
        array_id = self._new_id("put")
        per_host: dict[int, dict[int, np.ndarray]] = {}
        for device, index in zip(layout.devices, layout.indices):
            region = value[tuple(slice(a, b) for a, b in index)]
            per_host.setdefault(self.cluster.host_of(device), {})[device] = region
        calls = {
            h: self.actors[h].put_shards.remote(array_id, value.dtype.name, shards)
            for h, shards in per_host.items()
        }
        self._wait(calls, f"putting {value.dtype}{list(value.shape)}")
        return RemoteArray(self, array_id, value.shape, value.dtype, sharding)

    def fetch(self, array: RemoteArray) -> np.ndarray:
        """Gather a remote array into one numpy array on the driver."""
        self._check_array(array)
        layout = Layout.from_sharding(array.sharding, array.shape)
        out = np.empty(array.shape, dtype=array.dtype)
        needed: dict[int, list[tuple[int, Any]]] = {}
        seen = set()
        for device, index in zip(layout.devices, layout.indices):
            if index not in seen:  # one replica per region
                seen.add(index)
                needed.setdefault(self.cluster.host_of(device), []).append((device, index))
        calls = {
            h: self.actors[h].fetch_shards.remote(array.array_id, [d for d, _ in items])
            for h, items in needed.items()
        }
        shards = self._wait(calls, f"fetching {array!r}")
        for h, items in needed.items():
            for device, index in items:
                out[tuple(slice(a, b) for a, b in index)] = shards[h][device]
        return out

    def free(self, array: RemoteArray, *, wait: bool = True) -> None:
        """Drop an array's shards on the hosts that hold them. Without `wait` (a handle going
        away), the id joins a batch that goes out with the next call: a training step drops a
        few hundred handles, and one message per host beats one per array."""
        if self._closed or self._broken:
            return
        hosts = sorted({d.process_index for d in array.sharding.mesh.devices.flat})
        if not wait:
            with self._free_lock:
                for h in hosts:
                    self._to_free.setdefault(h, []).append(array.array_id)
            return
        calls = {h: self.actors[h].free_many.remote([array.array_id]) for h in hosts}
        self._wait(calls, f"freeing {array.array_id}")

    def flush_frees(self) -> None:
        """Send the batched frees (one message per host; nothing waits for them)."""
        with self._free_lock:
            batches, self._to_free = self._to_free, {}
        if self._closed or self._broken:
            return
        for h, ids in batches.items():
            self.actors[h].free_many.remote(ids)

    # -- resharding ----------------------------------------------------------------------------

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
        return RemoteArray(self, dst_id, array.shape, array.dtype, dst_sharding)

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
        return RemoteArray(self, dst_id, array.shape, array.dtype, dst_sharding)

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

    # -- pipelines' lifetime -----------------------------------------------------------------------

    def start_dropper(self) -> None:
        """Start the thread that sends the drops of pipelines the driver let go (before the
        first one can be: a finalizer must not start threads)."""
        with self._dropper_lock:
            if self._dropper is None and not self._closed:
                self._dropper = threading.Thread(
                    target=_send_drops,
                    args=(weakref.ref(self), self._drops),
                    name="jaxreshard-drops",
                    daemon=True,
                )
                self._dropper.start()

    def drop_pipeline(self, key: str, hosts: Sequence[int], wait_s: float | None = None) -> None:
        """Have `hosts` drop pipeline `key` (`HostActor.pipeline_drop`: its threads end, its
        executables and buffers go). Without `wait_s`, return at once: the messages go from the
        drop thread (`start_dropper`), so this is safe in a finalizer. With it, send them now and
        wait at most `wait_s` for the hosts to have dropped it. Never raises; nothing to do once
        the runtime is shut down (the actors are gone with their pipelines)."""
        if self._closed:
            return
        if wait_s is None:
            self._drops.put((key, tuple(hosts)))  # (SimpleQueue.put: safe in a finalizer)
            return
        refs = _tell_drop(self, key, hosts)
        if not refs:
            return
        try:
            import ray

            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
            for ref in ready:  # an error (a dead actor) is read, so that Ray does not log it
                with contextlib.suppress(Exception):
                    ray.get(ref, timeout=0)
        except Exception:  # Ray is going down
            logging.getLogger(__name__).debug("waiting for the drop of %s failed", key)

    # -- waiting, failures, shutdown -------------------------------------------------------------

    def _wait(
        self,
        calls: dict[int, Any],
        what: str,
        timeout_s: float | None = None,
        *,
        work_id: str | None = None,
        progress: Callable[[int], Any] | None = None,
    ) -> dict[int, Any]:
        """Wait for every host's call; raise at once, naming the host, if one fails or dies.

        Without `progress`, the wait ends `timeout_s` (default: the runtime's) after it starts.
        With it (`progress(h)` calls host h for a report `(count, last, idle_s)` of what its
        part has done so far), it ends only when no host still busy has made progress for
        `timeout_s`: a long, healthy call never times out (see [Note: progress deadline]).
        """
        if self._to_free:
            self.flush_frees()
        import ray

        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        deadline = start + timeout_s
        pending = {ref: h for h, ref in calls.items()}
        results: dict[int, Any] = {}
        probes: dict[Any, int] = {}  # progress calls in flight -> host
        reports: dict[int, tuple[int, str, float]] = {}  # host -> its last report
        asked = start
        while pending:
            now = time.monotonic()
            if progress is not None:
                if now - asked >= PROBE_EVERY_S:
                    asked = now
                    busy = set(pending.values()) - set(probes.values())
                    probes.update({progress(h): h for h in sorted(busy)})
                if probes:
                    answered, _ = ray.wait(list(probes), num_returns=len(probes), timeout=0)
                    for ref in answered:
                        h = probes.pop(ref)
                        try:
                            report = ray.get(ref, timeout=PROBE_EVERY_S)  # ready: at once
                        except Exception:  # a dead or failed host: its own call says so
                            continue
                        if report[0] != reports.get(h, (0,))[0]:
                            deadline = now + timeout_s  # it made progress
                        reports[h] = report
            left = deadline - now
            if left <= 0:
                busy_hosts = sorted(pending.values())
                self._abort(work_id, f"{what} timed out")
                if progress is None:
                    raise TimeoutError(
                        f"{what} did not finish within {timeout_s:g} s; hosts "
                        f"{self._named_hosts(busy_hosts)} are still busy (raise "
                        "init(timeout_s=...) for bigger arrays)"
                    )
                states = [self._progress_of(h, reports.get(h), now - start) for h in busy_hosts]
                raise TimeoutError(
                    f"{what} made no progress for {timeout_s:g} s (after {now - start:.0f} s in "
                    f"all): {'; '.join(states)} (a hung device, or a host callback that never "
                    "returns?); raise PipelineConfig.timeout_s if one action legitimately takes "
                    "longer"
                )
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(left, PROBE_EVERY_S))
            for ref in ready:
                h = pending.pop(ref)
                try:
                    results[h] = ray.get(ref, timeout=max(1.0, left))  # ready: at once
                except ray.exceptions.GetTimeoutError:  # (never, for a ready result)
                    self._abort(work_id, f"{what} timed out")
                    raise TimeoutError(
                        f"{what}: host {h} ({self._hostname(h)}) finished, but its result did "
                        f"not reach the driver within {max(1.0, left):.0f} s"
                    ) from None
                except ray.exceptions.RayActorError as e:
                    self._broken = f"host actor {h} died during {what}"
                    self._abort(work_id, self._broken)
                    broken = RuntimeBroken(
                        f"host actor {h} ({self._hostname(h)}) died during {what}: "
                        f"{_first_line(e)}. Call jaxreshard.shutdown() and jaxreshard.init() again."
                    )
                    broken.host = h
                    raise broken from None
                except ray.exceptions.RayTaskError as e:
                    self._abort(work_id, f"host {h} failed during {what}")
                    raise _named(e, h, what) from None
        return results

    def _named_hosts(self, hosts: Sequence[int]) -> str:
        return ", ".join(f"{h} ({self._hostname(h)})" for h in hosts)

    def _progress_of(self, h: int, report: tuple[int, str, float] | None, waited: float) -> str:
        """A busy host's last progress report, for a timeout's message."""
        where = f"host {h} ({self._hostname(h)})"
        if report is None:
            return f"{where} answered no progress probe in {waited:.0f} s"
        count, last, idle = report
        if not count:
            return f"{where} finished nothing of it yet"
        return f"{where} last finished {last} {idle:.0f} s before its last report"

    def _abort(self, work_id: str | None, reason: str) -> None:
        if work_id is None:
            return
        # An abort ends every NCCL communicator on every host: they are made anew on next use.
        self._communicators.clear()
        for h, actor in enumerate(self.actors):
            try:
                actor.abort.remote(work_id, reason)
            except Exception:  # the dead one cannot be told
                logging.getLogger(__name__).debug("could not abort host %d", h)

    def _hostname(self, h: int) -> str:
        return self.infos[h].get("hostname", "?") if h < len(getattr(self, "infos", [])) else "?"

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this Ray runtime was shut down; call jaxreshard.init() again")
        if self._broken:
            raise RuntimeBroken(
                f"{self._broken}; call jaxreshard.shutdown() and jaxreshard.init() again"
            )

    def _check_array(self, array: RemoteArray) -> None:
        self._check_usable()
        if array.runtime is not self:
            raise ValueError(f"{array!r} belongs to another (closed) runtime")
        if array.is_freed:
            raise ValueError(f"{array!r} was freed")

    def _check_sharding(self, sharding: Any, what: str) -> None:
        if not isinstance(sharding, VirtualSharding):
            raise TypeError(
                f"{what} must be a VirtualSharding over this runtime's devices "
                f"(runtime.sharding(runtime.mesh(shape, axis_names), P(...))); got "
                f"{type(sharding).__name__}"
            )
        known = {d.id: d.process_index for d in self.devices}
        bad = sorted(d.id for d in sharding.device_set if known.get(d.id) != d.process_index)
        if bad:
            raise ValueError(
                f"{what}: devices {bad} are not devices of this runtime (or sit on another host); "
                f"the runtime has {self.cluster.describe()}. Build meshes with runtime.mesh()."
            )

    def _new_id(self, kind: str) -> str:
        return f"{kind}-{next(self._ids)}-{uuid.uuid4().hex[:6]}"

    def _kill_all(self) -> None:
        import ray

        for actor in getattr(self, "actors", []):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                logging.getLogger(__name__).debug("actor already gone")

    def shutdown(self) -> None:
        """Stop the host actors and Ray (if this runtime started or joined it)."""
        import ray

        if self._closed:
            return
        self._closed = True
        self._drops.put(None)  # the drop thread ends (pipelines die with the actors)
        self._kill_all()
        ray.shutdown()
        if self._local_cluster is not None:
            self._local_cluster.shutdown()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "running")
        return f"RayRuntime({state}, {self.cluster.describe() if hasattr(self, 'cluster') else ''})"


_HOST_RESOURCE = HOST_RESOURCE


def _tell_drop(runtime: RayRuntime, key: str, hosts: Sequence[int]) -> list[Any]:
    """Send pipeline `key`'s drop to `hosts`; the calls' references (none that cannot go)."""
    refs = []
    for h in hosts:
        try:
            refs.append(runtime.actors[h].pipeline_drop.remote(key))
        except Exception:  # a dead actor, or Ray going down: nothing left to drop there
            logging.getLogger(__name__).debug("could not tell host %d to drop %s", h, key)
    return refs


def _send_drops(runtime_ref: Any, drops: queue.SimpleQueue[Any]) -> None:
    """The drop thread: send each dropped pipeline's drop to its hosts, without waiting for
    them; ends when the runtime shuts down (or is dropped)."""
    while True:
        item = drops.get()
        runtime = runtime_ref()
        if item is None or runtime is None or runtime._closed:
            return
        key, hosts = item
        refs = _tell_drop(runtime, key, hosts)
        del runtime, refs


TRANSPORTS = ("tcp", "object_store", "nccl")
PLATFORMS = ("auto", "cpu", "gpu")


def _machine_gpus() -> int:
    """The NVIDIA GPUs a local Ray instance would see: those CUDA_VISIBLE_DEVICES names, else
    the machine's (/dev/nvidiaN)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([v for v in visible.split(",") if v.strip() and v.strip() != "-1"])
    return len(glob.glob("/dev/nvidia[0-9]*"))


def local_platform(
    platform: str,
    num_hosts: int,
    devices_per_host: int | None,
    nodes: str,
    gpus: int,
) -> str:
    """The platform of a local Ray instance's host actors ('cpu' or 'gpu') on a machine with
    `gpus` GPUs; an error where they cannot have what was asked.

    CPU is the choice when asked for (`platform='cpu'`, or `JAX_PLATFORMS` naming cpu first in
    this process) or when the machine has no GPUs. On a machine with GPUs, fake CPU devices are
    never a silent stand-in for too few of them."""
    jax_platforms = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip()
    if platform == "cpu" or (platform == "auto" and (gpus == 0 or jax_platforms == "cpu")):
        return "cpu"
    want = num_hosts * (devices_per_host or 1)
    asked = f"init(backend='ray', num_hosts={num_hosts}, devices_per_host={devices_per_host}"
    asked += ", platform='gpu')" if platform == "gpu" else ")"
    if gpus < want:
        raise ValueError(
            f"{asked} asks for {want} GPUs (num_hosts x devices_per_host), but this machine has "
            f"{gpus}{' (CUDA_VISIBLE_DEVICES)' if 'CUDA_VISIBLE_DEVICES' in os.environ else ''}; "
            f"ask for at most {gpus}, or pass platform='cpu' for fake CPU devices"
        )
    if nodes == "per_host":
        raise ValueError(
            f"{asked} on a machine with {gpus} GPUs: nodes='per_host' (one Ray node per host) "
            "emulates hosts with fake CPU devices only; pass nodes='single' to give the host "
            "actors the GPUs, or platform='cpu' for fake CPU devices"
        )
    return "gpu"


def check_reported_devices(
    planned: Sequence[Sequence[int]], infos: Sequence[dict[str, Any]], platform: str
) -> None:
    """The device ids the host actors report must be the ones the runtime planned for them
    (global ids are `first + local index`: a host with more or fewer devices than planned would
    take its neighbour's ids or leave holes)."""
    wrong = [
        f"host {h} ({info.get('hostname', '?')}): planned {list(planned[h])}, reports "
        f"{sorted(info['devices'])}"
        for h, info in enumerate(infos)
        if sorted(info["devices"]) != list(planned[h])
    ]
    if wrong:
        raise RuntimeError(
            f"host actors see other {platform} devices than the runtime planned for them ("
            + "; ".join(wrong)
            + "). Each actor's JAX must see exactly the devices Ray gave it: on GPUs, Ray's "
            "num_gpus and CUDA_VISIBLE_DEVICES on that node (nothing may override it); pass "
            "devices_per_host to use fewer"
        )


def _auto_transport(platform: str) -> str:
    """CPU hosts stream slices over TCP (see [Note: stream transport]); GPUs use NCCL."""
    return "tcp" if platform == "cpu" else "nccl"


def _start_local_nodes(num_hosts: int, object_store_memory: int | None) -> Any:
    """One Ray node per host on this machine, each with its own object store.

    Slices between hosts then really travel through Ray's object manager, as between the nodes
    of a cluster, instead of being shared in one node's memory. Node h carries the custom
    resource `jaxreshard_host_h`, which pins host actor h to it.
    """
    from ray.cluster_utils import Cluster as LocalNodes

    per_node = object_store_memory or 512 * 2**20
    nodes = LocalNodes(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "num_gpus": 0,
            "object_store_memory": per_node,
            "resources": {f"{_HOST_RESOURCE}0": 1},
            "include_dashboard": False,
        },
    )
    try:
        for h in range(1, num_hosts):
            nodes.add_node(
                num_cpus=1,
                num_gpus=0,
                object_store_memory=per_node,
                resources={f"{_HOST_RESOURCE}{h}": 1},
            )
        nodes.wait_for_nodes()
    except BaseException:
        nodes.shutdown()
        raise
    return nodes


def _host_nodes(alive: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The nodes that take host actors, in host order: those that carry the resource
    `jaxreshard_host_<i>` (an emulated cluster; its head carries none) by i, else all of them by
    address."""
    marked = {
        int(key[len(_HOST_RESOURCE) :]): n
        for n in alive
        for key in n["Resources"]
        if key.startswith(_HOST_RESOURCE) and key[len(_HOST_RESOURCE) :].isdigit()
    }
    if marked:
        return [marked[i] for i in sorted(marked)]
    return sorted(alive, key=lambda n: n["NodeManagerAddress"])


def _described_cluster() -> dict[str, Any] | None:
    from jaxreshard.cluster._describe import lookup

    try:
        return lookup()
    except Exception as e:  # a malformed entry must not stop the runtime; say so
        logging.getLogger(__name__).warning("ignoring the cluster description in Ray: %s", e)
        return None


def _named(e: Any, h: int, what: str) -> BaseException:
    """A host's error as the driver raises it: its own type where possible, naming the host
    (once) and what the driver was doing."""
    cause = e.cause if isinstance(e.cause, Exception) else RuntimeError(str(e))
    text = str(cause)
    prefix = f"host {h}: "
    message = (text if text.startswith(prefix) else prefix + text) + f" (during {what})"
    try:
        return type(cause)(message)
    except Exception:  # an exception type that cannot be made from a message
        return RuntimeError(f"{type(cause).__name__}: {message}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
