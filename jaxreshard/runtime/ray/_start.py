"""Starting the Ray runtime's host actors: nodes, platforms, devices, the distributed runtime.

`HostStartup._start_actors` is the part of `RayRuntime` that brings the host actors up: a local
Ray instance of one node per host (`_start_local_nodes`) or a cluster's nodes (`_host_nodes`), the
platform each host's JAX uses (`local_platform`: never fake CPU devices in place of missing GPUs),
one `HostActor` per host with its device ids checked (`check_reported_devices`), the hosts'
jax.distributed runtime (see [Note: multi-host stages] in `ray/_pipeline.py`), the emulated NICs
and the TCP transport's listeners with the runtime's secret (see [Note: stream authentication]
in `comm/_stream.py`). A driver joins a cluster with `join_ray`.
"""

from __future__ import annotations

import glob
import logging
import os
import secrets
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from jaxreshard._machine import available_memory_bytes, format_bytes
from jaxreshard.cluster._describe import (
    HOST_RESOURCE,
    driver_ip_for,
    ray_auth,
    ray_token_for,
    reset_ray_auth,
)
from jaxreshard.comm import VirtualDevice

_HOST_RESOURCE = HOST_RESOURCE


class HostStartup:
    """`RayRuntime`'s start-up (a mixin: it uses the runtime's `_wait`)."""

    _local_cluster: Any
    emulate_network_gbps: float | None
    gpu_memory_fraction: float
    enable_x64: bool
    compile_cache: dict[str, Any] | None
    distributed: bool

    _wait: Callable[..., dict[int, Any]]  # (HostWaits._wait)

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

        from jaxreshard.runtime.ray._actor import HostActor

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
                    self.compile_cache,
                )
            )
            hosts.append(tuple(range(first, first + count)))
            first += count
        if joining:  # see [Note: multi-host stages] in `ray/_pipeline.py`
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
        _warn_without_cache(self.compile_cache, self.infos)
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
            # This runtime's own: a host reads a connection only once it proved it knows it
            # (see [Note: stream authentication] in `comm/_stream.py`).
            secret = secrets.token_bytes(32)
            addresses = self._wait(
                {h: a.open_stream.remote(secret) for h, a in handles.items()},
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


class LocalRayToken:
    """Ray token authentication for a local Ray instance this runtime starts: a fresh token in
    a private file, in this process's environment from before the nodes start until `close`
    (Ray's nodes and workers inherit it; Ray reads it when it connects, so it must stay set
    while the runtime lives). A process that does not know the token cannot join the instance,
    whose servers listen on every interface (see docs/ray-and-gpus.md)."""

    _KEYS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")

    def __init__(self) -> None:
        import secrets
        import tempfile

        self._folder = tempfile.mkdtemp(prefix="jaxreshard-ray-")  # 0700
        path = os.path.join(self._folder, "token")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        self._before = {k: os.environ.get(k) for k in self._KEYS}
        os.environ.pop("RAY_AUTH_TOKEN", None)  # it would win over the file
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=path)
        reset_ray_auth()

    def close(self) -> None:
        """Restore the environment (after Ray is shut down) and remove the token."""
        import shutil

        for key, value in self._before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        reset_ray_auth()
        shutil.rmtree(self._folder, ignore_errors=True)


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


def join_ray(address: str | None) -> None:
    """Connect this process's Ray to the cluster at `address` (as `ray.init` reads it); an
    emulated cluster of this machine through its drivers' node and with its token (see [Note:
    Ray token] in `cluster/_describe.py`)."""
    import ray

    ip = driver_ip_for(address)
    extra: dict[str, Any] = {"_node_ip_address": ip} if ip else {}
    with ray_auth(ray_token_for(address), connecting=True):
        ray.init(address=address, logging_level=logging.WARNING, namespace="jaxreshard", **extra)


def _described_cluster() -> dict[str, Any] | None:
    from jaxreshard.cluster._describe import lookup

    try:
        return lookup()
    except Exception as e:  # a malformed entry must not stop the runtime; say so
        logging.getLogger(__name__).warning("ignoring the cluster description in Ray: %s", e)
        return None


# What one local host costs before it holds any array: a Ray node (raylet, object store) and a
# host actor process with JAX loaded (measured here: about 300 MiB resident per actor).
LOCAL_HOST_BYTES = 400 * 2**20


def check_local_memory(num_hosts: int, object_store_memory: int | None, nodes: str) -> None:
    """Refuse, before Ray starts, a local cluster this machine cannot hold (one Ray node and host
    actor per host, each node with its own object store)."""
    available = available_memory_bytes()
    if available is None:
        return
    store = (object_store_memory or 512 * 2**20) if nodes == "per_host" else 0
    need = num_hosts * (LOCAL_HOST_BYTES + store)
    if need > available:
        raise ValueError(
            f"init(backend='ray', num_hosts={num_hosts}) starts {num_hosts} local host actors"
            + (f" and Ray nodes ({store // 2**20} MiB object store each)" if store else "")
            + f", about {format_bytes(need)}, but this machine has "
            f"{format_bytes(available)} available; use fewer hosts, or join a cluster with "
            "address='HOST:PORT'"
        )


def compile_cache_settings() -> dict[str, Any] | None:
    """The driver's JAX persistent compilation cache (`jaxreshard profile --compile-cache`, or
    the user's own `jax.config`), for the hosts to use too: a program the driver or another
    host compiled before, in this run or an earlier one, then loads instead of compiling. None
    where the driver has none."""
    import jax

    where = jax.config.jax_compilation_cache_dir
    if not where or not jax.config.jax_enable_compilation_cache:
        return None
    if "://" not in where:  # (the driver's folder, wherever the hosts' working folder is)
        where = os.path.abspath(os.path.expanduser(where))
    return {
        "jax_compilation_cache_dir": where,
        "jax_persistent_cache_min_compile_time_secs": (
            jax.config.jax_persistent_cache_min_compile_time_secs
        ),
        "jax_persistent_cache_min_entry_size_bytes": (
            jax.config.jax_persistent_cache_min_entry_size_bytes
        ),
        "jax_compilation_cache_max_size": jax.config.jax_compilation_cache_max_size,
    }


def _warn_without_cache(settings: dict[str, Any] | None, infos: Sequence[dict[str, Any]]) -> None:
    """Say which hosts compile without the driver's cache (they could not write its folder)."""
    if not settings:
        return
    where = settings["jax_compilation_cache_dir"]
    missing = [str(info["host"]) for info in infos if info.get("compile_cache") != where]
    if missing:
        warnings.warn(
            f"host(s) {', '.join(missing)} cannot make or write the compilation cache folder "
            f"{where} and compile without it (each run compiles their programs again); give a "
            "folder every host can write (--compile-cache DIR, or jax_compilation_cache_dir)",
            stacklevel=4,
        )


def use_compile_cache(settings: dict[str, Any] | None) -> None:
    """On a host: take the driver's compilation cache settings, where its folder can be made
    and written here (on another machine the driver's path may not be; a host without the
    cache compiles as before, and the driver says so: `_warn_without_cache`)."""
    if not settings:
        return
    import jax

    where = settings["jax_compilation_cache_dir"]
    if "://" not in where:  # (a local path; JAX also takes gs:// and the like)
        try:
            os.makedirs(where, exist_ok=True)
        except OSError:
            return
        if not os.access(where, os.W_OK | os.X_OK):
            return
    for key, value in settings.items():
        jax.config.update(key, value)
