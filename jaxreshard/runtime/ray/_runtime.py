"""The Ray runtime's driver: remote arrays, multi-host plan execution and NCCL communicators
(starting the host actors: `ray/_start.py`; waiting for them: `ray/_wait.py`; pipelines'
lifetime: `ray/_drops.py`).

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

import itertools
import logging
import math
import os
import queue
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from jaxreshard.cluster._describe import links_of
from jaxreshard.comm import Cluster, Layout, VirtualMesh, VirtualSharding
from jaxreshard.comm._cluster import PAPER_LATENCY_S
from jaxreshard.runtime.ray._drops import PipelineDrops
from jaxreshard.runtime.ray._remote import SMALL_BYTES, RemoteArray
from jaxreshard.runtime.ray._resharding import HostResharding
from jaxreshard.runtime.ray._start import (
    PLATFORMS,
    TRANSPORTS,
    HostStartup,
    LocalRayToken,
    _auto_transport,
    _described_cluster,
    _machine_gpus,
    _start_local_nodes,
    check_local_memory,
    compile_cache_settings,
    join_ray,
    local_platform,
)
from jaxreshard.runtime.ray._wait import HostWaits, RuntimeBroken

PUT_BATCH_BYTES = 1 << 30  # host data that `put_many` sends to the hosts per call

DEFAULT_TIMEOUT_S = 120.0
MAX_HOSTS = 4096
MAX_DEVICES_PER_HOST = 1024


class RayRuntime(HostStartup, HostWaits, HostResharding, PipelineDrops):
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

        if not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
            raise ValueError(
                f"init(timeout_s={timeout_s!r}): must be a finite number of seconds > 0 (every "
                "wait on the hosts needs a bound)"
            )
        for name, value, high in (
            ("num_hosts", num_hosts, MAX_HOSTS),
            ("devices_per_host", devices_per_host, MAX_DEVICES_PER_HOST),
        ):
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high
            ):
                raise ValueError(
                    f"init(backend='ray', {name}={value!r}): must be an int from 1 to {high:,}"
                )
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
            check_local_memory(num_hosts, object_store_memory, nodes)
            # Before Ray starts: too few GPUs is an error, not fake CPU devices.
            platform = local_platform(platform, num_hosts, devices_per_host, nodes, _machine_gpus())
        if ray.is_initialized():
            raise RuntimeError(
                "Ray is already initialised in this process; jaxreshard.init(backend='ray') "
                "starts or joins the cluster itself. Call ray.shutdown() first."
            )
        import jax

        self.timeout_s = timeout_s
        self._to_free: dict[int, list[tuple[str, Any]]] = {}  # host -> dropped (id, pending)
        self._free_lock = threading.Lock()
        # Per pipeline, the watch of its last asynchronous step sent (`RayHosts.call`), weakly.
        self.steps_sent: dict[str, Callable[[], Future[Any] | None]] = {}
        self.enable_x64 = bool(jax.config.jax_enable_x64)
        self.compile_cache = compile_cache_settings()
        self._broken: str | None = None
        self._closed = False
        self._ids = itertools.count()
        # Pipelines the driver dropped, for the hosts to drop (see `drop_pipeline`); a thread
        # of their own sends them, made with the first pipeline.
        self._drops: queue.SimpleQueue[tuple[str, tuple[int, ...]] | None] = queue.SimpleQueue()
        self._dropper: threading.Thread | None = None
        self._dropper_lock = threading.Lock()
        self._local_cluster: Any = None
        self._token: LocalRayToken | None = None
        if local:
            self._token = LocalRayToken()
            try:
                self._start_local_ray(num_hosts, nodes, object_store_memory)
            except BaseException:
                self._token.close()
                raise
        else:  # (an emulated cluster of this machine: through its own node, with its token)
            join_ray(address)
        # A cluster that describes itself (e.g. `jaxreshard cluster up`) gives the planner its
        # NIC model and the devices per host; see [Note: cluster description].
        self.description = None if local else _described_cluster()
        if self.description is not None:
            links = links_of(self.description)
            # The shaped links' added delay comes on top of what every message costs anyway
            # (the model's per-message latency): with none, a plan of many small messages (an
            # all-gather's scatter) looked as fast as one broadcast chain, and measured 1.4x
            # slower per transfer (docs/benchmarks.md, stages that span hosts).
            links["latency_s"] = links.get("latency_s", 0.0) + PAPER_LATENCY_S
            cluster_links = {**links, **(cluster_links or {})}
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
            if self._token is not None:
                self._token.close()
            self._closed = True
            raise
        self.cluster = Cluster(self.hosts, **(cluster_links or {}))
        platform = self.infos[0]["platform"]
        self.transport = transport if transport != "auto" else _auto_transport(platform)
        self._communicators: set[tuple[str, tuple[int, ...]]] = set()

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
        return self.put_many([(value, sharding)])[0]

    def put_many(self, items: Sequence[tuple[Any, VirtualSharding]]) -> list[RemoteArray]:
        """Place numpy arrays on the hosts, each with its sharding: one call per host for up to
        `PUT_BATCH_BYTES` of them (a step given host data for every parameter would otherwise
        pay a round trip per parameter)."""
        self._check_usable()
        wide = (np.float64, np.int64, np.uint64, np.complex128)
        out: list[RemoteArray] = []
        per_host: dict[int, dict[tuple[str, str], dict[int, Any]]] = {}
        batch = [0, 0]  # bytes, arrays in `per_host`
        for value, sharding in items:
            value = np.asarray(value)
            if value.dtype in wide and not self.enable_x64:
                raise ValueError(
                    f"put: {value.dtype} needs 64-bit JAX on the hosts, but jax_enable_x64 was "
                    "off when the runtime started; call jax.config.update('jax_enable_x64', "
                    "True) before jaxreshard.init, or cast to a 32-bit type first"
                )
            self._check_sharding(sharding, "sharding")
            layout = Layout.from_sharding(sharding, value.shape, what="sharding")
            array_id = self._new_id("put")
            for device, index in zip(layout.devices, layout.indices):
                region = value[tuple(slice(a, b) for a, b in index)]
                shards = per_host.setdefault(self.cluster.host_of(device), {})
                shards.setdefault((array_id, value.dtype.name), {})[device] = region
            # A small one keeps its value here too, as a step's small output does: a step whose
            # hosts do not hold it (an optimizer's step count, read by every stage) gets it with
            # the call, not by the driver running that stage's segment after the step.
            small = value.copy() if value.nbytes <= SMALL_BYTES else None
            out.append(RemoteArray(self, array_id, value.shape, value.dtype, sharding, small))
            batch[0] += value.nbytes
            batch[1] += 1
            if batch[0] >= PUT_BATCH_BYTES:
                self._put_batch(per_host, out[-batch[1] :])
                per_host, batch = {}, [0, 0]
        if per_host:
            self._put_batch(per_host, out[-batch[1] :])
        return out

    def _put_batch(self, per_host: dict[int, Any], arrays: Sequence[RemoteArray]) -> None:
        calls = {
            h: self.actors[h].put_many_shards.remote(
                [(array_id, dtype, regions) for (array_id, dtype), regions in shards.items()]
            )
            for h, shards in per_host.items()
        }
        first = arrays[0]
        what = (
            f"putting {first.dtype}{list(first.shape)}"
            if len(arrays) == 1
            else f"putting {len(arrays)} arrays"
        )
        self._wait(calls, what)

    def fetch(self, array: RemoteArray) -> np.ndarray:
        """Gather a remote array into one numpy array on the driver."""
        return self.fetch_many([array])[0]

    def fetch_many(self, arrays: Sequence[RemoteArray]) -> list[np.ndarray]:
        """`fetch` of several arrays, every host's calls sent before any is waited for (a
        restored checkpoint reads back its small leaves so: a tiny GPT with Adam has 103)."""
        sent = []
        for array in arrays:
            self._check_array(array)
            layout = Layout.from_sharding(array.sharding, array.shape)
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
            sent.append((array, needed, calls))
        outs = []
        for array, needed, calls in sent:
            shards = self._wait(calls, f"fetching {array!r}")
            out = np.empty(array.shape, dtype=array.dtype)
            for h, items in needed.items():
                for device, index in items:
                    out[tuple(slice(a, b) for a, b in index)] = shards[h][device]
            outs.append(out)
        return outs

    def free(self, array: RemoteArray, *, wait: bool = True, pending: Any = None) -> None:
        """Drop an array's shards on the hosts that hold them. Without `wait` (a handle going
        away), the id joins a batch that goes out with the next call: a training step drops a
        few hundred handles, and one message per host beats one per array. `pending`: the
        watch of the asynchronous step that makes the array. The free goes out once that step
        and every step sent before the handle went have finished: before, a host may not have
        made the array yet, or not yet read it (see [Note: asynchronous steps on Ray])."""
        if self._closed or self._broken:
            return
        hosts = sorted({d.process_index for d in array.sharding.mesh.devices.flat})
        sent = [ref() for ref in list(self.steps_sent.values())]
        running = [f for f in (pending, *sent) if f is not None]
        if not wait:
            after = _AllDone([f for f in running if not f.done()])
            with self._free_lock:
                for h in hosts:
                    self._to_free.setdefault(h, []).append((array.array_id, after))
            return
        futures_wait(running)  # (each has its step's progress deadline)
        calls = {h: self.actors[h].free_many.remote([array.array_id]) for h in hosts}
        self._wait(calls, f"freeing {array.array_id}")

    def flush_frees(self) -> None:
        """Send the batched frees (one message per host; nothing waits for them). Those of
        arrays whose step is still running stay for a later flush."""
        with self._free_lock:
            batches, self._to_free = self._to_free, {}
            later: dict[int, list[tuple[str, Any]]] = {}
            for h, items in batches.items():
                kept = [item for item in items if not item[1].done()]
                if kept:
                    later[h] = kept
                    batches[h] = [item for item in items if item[1].done()]
            for h, kept in later.items():
                self._to_free.setdefault(h, []).extend(kept)
        if self._closed or self._broken:
            return
        for h, items in batches.items():
            if items:
                self.actors[h].free_many.remote([array_id for array_id, _ in items])

    # -- waiting, failures, shutdown -------------------------------------------------------------

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
        array.settle()  # (an asynchronous step's output: once its step has made it)

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

    def _start_local_ray(self, num_hosts: int, nodes: str, object_store_memory: int | None) -> None:
        import ray

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
            _shutdown_cluster(self._local_cluster)
        if self._token is not None:
            self._token.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "running")
        return f"RayRuntime({state}, {self.cluster.describe() if hasattr(self, 'cluster') else ''})"


def _shutdown_cluster(cluster: Any, tries: int = 3) -> None:
    """Stop the local cluster this runtime started. A thread of ours still finishing (a step's
    watch reading its answer, a drop) may call Ray after `ray.shutdown()`, and Ray's auto-init
    then connects this process to the cluster again; Ray refuses to remove a head this process
    is connected to (it disconnects it first, then raises). So disconnect and try again (the
    nodes already removed stay removed)."""
    import ray

    for attempt in range(tries):
        try:
            cluster.shutdown()
            return
        except ValueError as e:
            if "connected to this Ray client" not in str(e) or attempt == tries - 1:
                raise
            ray.shutdown()


class _AllDone:
    """Done once all these futures are."""

    def __init__(self, futures: list[Future[Any]]):
        self.futures = futures

    def done(self) -> bool:
        self.futures = [f for f in self.futures if not f.done()]
        return not self.futures
