"""`cluster up / down / status` and `emulated(...)`: a Ray cluster of network namespaces.

Each emulated host is a network namespace with a shaped NIC (see [Note: emulated network]) and
runs one Ray node (`ip netns exec <ns> ray start ...`); the head runs in a namespace of its own
with no CPUs, so no host actor lands there, and a CPU-less node at the root namespace's bridge
address serves the drivers of this machine. The description is written where a driver finds it
(see [Note: cluster description]). `down` stops every process in the cluster's namespaces (they
are all ours: everything started in one stays in it) and the root node's Ray processes (found
by the node's temp dir in their command lines, and their children), then removes the namespaces
and links; it is idempotent and works after a crashed `up` or a killed driver, from the names
alone. Every node runs with Ray's token authentication (see [Note: Ray token] in `_describe.py`)
and its state stays private (see [Note: private state]).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxreshard.cluster import _netns
from jaxreshard.cluster._describe import (
    HOST_RESOURCE,
    EmulatedCluster,
    HostInfo,
    cluster_dir,
    known_names,
    open_private,
    publish,
    read_private,
    read_state,
    state_dir,
    token_file,
    write_state,
)

DEFAULT_NAME = "emu"
HEAD_PORT = 6379
MAX_HOSTS = 64
START_TIMEOUT_S = 120.0
_FIRST_HOST = 10  # host i has address .(10 + i) of the subnet; the head .2, the driver .1


def up(
    hosts: int,
    nic_gbps: float,
    *,
    latency_ms: float = 0.0,
    cpus_per_host: int | None = None,
    devices_per_host: int = 1,
    name: str = DEFAULT_NAME,
    object_store_mib: int = 1024,
    start_timeout_s: float = START_TIMEOUT_S,
) -> EmulatedCluster:
    """Build an emulated cluster and start its Ray nodes; return its description.

    Args:
        hosts: how many emulated hosts (network namespaces, one Ray node each).
        nic_gbps: every host NIC's rate per direction, GB/s (1e9 bytes; 10 Gbit/s is 1.25).
        latency_ms: one-way delay of every packet a host sends (netem), in ms.
        cpus_per_host: pin each host's Ray node to this many CPUs (taskset; hosts share CPUs
            round-robin when there are fewer CPUs than hosts x this).
        devices_per_host: fake CPU devices each host actor makes.
        name: the cluster's name; every namespace and link is `jrs-<name>-...`.
        object_store_mib: each Ray node's object store.
        start_timeout_s: how long each `ray start` may take.

    Raises:
        ClusterUnavailable: no root / CAP_NET_ADMIN / CAP_SYS_ADMIN, or no `ip` / `tc`.
        ValueError: bad arguments, or a cluster of this name exists already.
        RuntimeError: a step failed; everything made so far is removed again.
    """
    _netns.check_name(name)
    _check_int("--hosts", hosts, 1, MAX_HOSTS)
    _check_int("--devices-per-host", devices_per_host, 1, 1024)
    _check_int("--object-store-mib", object_store_mib, 64, 1 << 20)
    if nic_gbps is None:
        raise ValueError("--nic-gbps is required: the NIC rate per direction in GB/s, e.g. 0.1")
    shaping = _netns.Shaping(nic_gbps, latency_ms)
    cpus = _cpu_sets(hosts, cpus_per_host)
    _netns.require()
    with _lock():
        _check_free(name)
        subnet = _netns.pick_subnet()
        ip = lambda k: str(subnet.network_address + k)
        head = HostInfo("head", _netns.host_names(name, "head")[0], ip(2))
        members = tuple(
            HostInfo(f"h{i}", _netns.host_names(name, f"h{i}")[0], ip(_FIRST_HOST + i), cpus[i])
            for i in range(hosts)
        )
        cluster = EmulatedCluster(
            name=name,
            address=f"{head.ip}:{HEAD_PORT}",
            nic_gbps=float(nic_gbps),
            latency_ms=float(latency_ms),
            hosts=members,
            devices_per_host=devices_per_host,
            head=head,
            subnet=str(subnet),
            driver_ip=ip(1),
            object_store_mib=object_store_mib,
        )
        try:
            cluster_dir(name, create=True)
            write_state(cluster)
            _make_token(name)
            _netns.make_bridge(name, f"{ip(1)}/{subnet.prefixlen}")
            _netns.make_host(name, "head", f"{head.ip}/{subnet.prefixlen}", _netns.Shaping(None))
            for host in members:
                _netns.make_host(name, host.name, f"{host.ip}/{subnet.prefixlen}", shaping)
        except BaseException:
            _teardown(name)
            raise
    try:
        _start_ray(cluster, start_timeout_s)
        publish(cluster.address, cluster.to_json(), token=token_file(name))
    except BaseException:
        _teardown(name)
        raise
    return cluster


def down(name: str = DEFAULT_NAME) -> dict[str, Any]:
    """Stop the cluster's Ray nodes, remove its namespaces, links (and their qdiscs) and state.

    Idempotent; also cleans up after a crashed `up` or a killed driver. Touches only names that
    start with `jrs-<name>-`. Returns what was removed.
    """
    _netns.check_name(name)
    _netns.require()
    return _teardown(name)


def down_all() -> dict[str, dict[str, Any]]:
    """`down` every jaxreshard cluster on this machine (state files, namespaces and links)."""
    _netns.require()
    found = set(known_names())
    for item in (*_netns.namespaces(_netns.PREFIX), *_netns.links(_netns.PREFIX)):
        rest = item[len(_netns.PREFIX) :]
        cluster = rest.split("-", 1)[0]
        if "-" in rest and _netns.NAME_RULE.fullmatch(cluster):
            found.add(cluster)
    return {name: _teardown(name) for name in sorted(found)}


def _teardown(name: str) -> dict[str, Any]:
    folder = cluster_dir(name)
    driver_node = str(folder / "driver") + os.sep
    stuck = _netns.stop_processes(lambda: _netns.processes_under(driver_node))
    removed: dict[str, Any] = dict(_netns.teardown(name))
    removed["stuck_pids"] += [str(p) for p in stuck]
    if folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
        removed["state"] = str(folder)
    return removed


@contextlib.contextmanager
def emulated(
    hosts: int = 2,
    nic_gbps: float = 0.1,
    *,
    latency_ms: float = 0.0,
    cpus_per_host: int | None = None,
    devices_per_host: int = 1,
    name: str = DEFAULT_NAME,
    object_store_mib: int = 1024,
) -> Iterator[EmulatedCluster]:
    """`up` on entry, `down` on exit (also on errors): an emulated cluster for a `with` block.

    Example:
        with jaxreshard.cluster.emulated(hosts=3, nic_gbps=0.1, devices_per_host=2) as c:
            runtime = jaxreshard.init(backend="ray", address=c.address)
    """
    cluster = up(
        hosts,
        nic_gbps,
        latency_ms=latency_ms,
        cpus_per_host=cpus_per_host,
        devices_per_host=devices_per_host,
        name=name,
        object_store_mib=object_store_mib,
    )
    try:
        yield cluster
    finally:
        down(name)


def kill_host(host: int, name: str = DEFAULT_NAME) -> list[int]:
    """Kill every process of emulated host `host` at once with SIGKILL (its Ray node, its host
    actor, their children), as a machine that loses power: nothing of it says goodbye, and Ray
    learns of it by its missed health checks. The namespace and links stay until `down`.
    Returns the pids killed."""
    _netns.require()
    name = _netns.check_name(name)
    if not isinstance(host, int) or host < 0:
        raise ValueError(f"kill_host(host={host!r}): a host number (0, 1, ...)")
    namespace = _netns.host_names(name, f"h{host}")[0]
    if namespace not in _netns.namespaces(_netns.names(name)[1]):
        raise ValueError(f"kill_host: cluster {name!r} has no host {host} ({namespace})")
    pids = _netns.pids_in(namespace)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    return pids


def status(name: str | None = None) -> list[dict[str, Any]]:
    """Every known cluster (or `name`): its description, and per node whether its namespace and
    raylet are up and what its NIC has carried (`tc` counters)."""
    names = [_netns.check_name(name)] if name is not None else known_names()
    out = []
    for cluster_name in names:
        cluster = read_state(cluster_name)
        if cluster is None:
            leftovers = _netns.namespaces(_netns.names(cluster_name)[1])
            out.append({"name": cluster_name, "state": "unknown", "namespaces": leftovers})
            continue
        nodes = []
        for host in (cluster.head, *cluster.hosts):
            present = host.netns in _netns.namespaces(host.netns)
            commands = [_command(p) for p in _netns.pids_in(host.netns)] if present else []
            node = {**host.to_json(), "netns_up": present, "raylet": "raylet" in commands}
            if present and host.name != "head":
                node.update(_netns.qdisc_stats(cluster_name, host.name))
            nodes.append(node)
        driver_node = str(cluster_dir(cluster_name) / "driver") + os.sep
        commands = [_command(p) for p in _netns.processes_under(driver_node)]
        nodes.append(
            {
                **HostInfo("driver", "(root)", cluster.driver_ip).to_json(),
                "netns_up": True,
                "raylet": "raylet" in commands,
            }
        )
        healthy = all(n["netns_up"] and n["raylet"] for n in nodes)
        out.append(
            {
                **cluster.to_json(),
                "state": "up" if healthy else "degraded",
                "planner_links": cluster.links(),
                "nodes": nodes,
            }
        )
    return out


# -- Ray ---------------------------------------------------------------------------------------


def _start_ray(cluster: EmulatedCluster, timeout_s: float) -> None:
    """`ray start` the head, then the drivers' node and the hosts (each host inside its
    namespace), a few at a time."""
    store = str(cluster.object_store_mib * 2**20)
    common = ["--num-gpus=0", f"--object-store-memory={store}", "--disable-usage-stats"]
    # Ray re-requests an object it has not received within `object_manager_pull_timeout_ms`
    # (10 s), and the holder pushes it again: on slow NICs a large object shared by several
    # pullers takes longer than that, and the duplicate pushes then fill the sender's link long
    # after the pulls returned (measured: 6x the bytes at 0.1 GB/s). Keep Ray's margin as it is
    # for a 10 Gbit/s NIC (1.25 GB/s): scale the timeout up for slower ones.
    slower = max(1.0, 1.25 / cluster.nic_gbps) if cluster.nic_gbps else 1.0
    config = {"object_manager_pull_timeout_ms": int(10_000 * slower)}
    head = [
        "--head",
        f"--node-ip-address={cluster.head.ip}",
        f"--port={HEAD_PORT}",
        "--num-cpus=0",
        "--include-dashboard=false",
        f"--system-config={json.dumps(config)}",
        *common,
    ]
    _wait_all([_ray_start(cluster, cluster.head, head)], timeout_s)
    # The driver's node: a driver owns the objects it puts, and peers fetch them from its node's
    # address, so drivers of the root namespace need a node at the root's bridge address
    # (`jaxreshard.init` joins it: see `driver_ip_for`). No CPUs, so no work lands on it.
    driver = HostInfo("driver", "", cluster.driver_ip)
    driver_args = [
        f"--address={cluster.address}",
        f"--node-ip-address={cluster.driver_ip}",
        "--num-cpus=0",
        *common,
    ]
    nodes = [(driver, driver_args)]
    for i, host in enumerate(cluster.hosts):
        args = [
            f"--address={cluster.address}",
            f"--node-ip-address={host.ip}",
            f"--num-cpus={len(host.cpus) if host.cpus else 1}",
            f"--resources={json.dumps({f'{HOST_RESOURCE}{i}': 1})}",
            *common,
        ]
        nodes.append((host, args))
    # A few at a time: each start runs several Python processes, and Ray gives a new raylet a
    # fixed 30 s to register, which many starts at once on a loaded 2-core machine exceeded.
    batch = max(1, len(os.sched_getaffinity(0)))
    for first in range(0, len(nodes), batch):
        _wait_all([_ray_start(cluster, *node) for node in nodes[first : first + batch]], timeout_s)


def _ray_start(cluster: EmulatedCluster, node: HostInfo, args: list[str]) -> tuple[Any, Path, str]:
    folder = cluster_dir(cluster.name) / node.name
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    log = folder / "ray-start.log"
    pin = ["taskset", "-c", ",".join(map(str, node.cpus))] if node.cpus else []
    ray = [sys.executable, "-m", "ray.scripts.scripts", "start", f"--temp-dir={folder}"]
    inside = ["ip", "netns", "exec", node.netns] if node.netns else []
    command = [*inside, *pin, *ray, *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # Ray runs its workers at nice 15 (so its own daemons win a contended CPU); here each host's
    # CPU is shared with the other emulated hosts and the driver, so its work runs at the
    # normal priority, as on a machine of its own.
    env["RAY_worker_niceness"] = "0"
    # Every node demands the cluster's own token (see [Note: Ray token]); said for each node,
    # since Ray would otherwise pick a head's mode from ~/.ray/auth_token alone.
    env.pop("RAY_AUTH_TOKEN", None)  # it would win over the file
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN_PATH"] = str(token_file(cluster.name))
    out = open_private(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    finally:
        os.close(out)
    return process, log, node.name


def _make_token(name: str) -> None:
    """Cluster `name`'s Ray token: 256 random bits, as `ray get-auth-token --generate` makes
    them, in a file only this user may read (see [Note: Ray token])."""
    path = token_file(name)
    with contextlib.suppress(FileNotFoundError):  # a crashed `up`'s (a link goes, not its target)
        os.unlink(path)
    fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


def _wait_all(starts: list[tuple[Any, Path, str]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    failed = []
    for process, log, node in starts:
        try:
            code = process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            code = None
        if code != 0:
            tail = read_private(log).strip().splitlines()[-3:] if log.exists() else []
            why = "timed out" if code is None else f"exited with {code}"
            failed.append(
                f"{node}: `ray start` {why} after up to {timeout_s:g} s: " + " | ".join(tail)
            )
    if failed:
        raise RuntimeError("starting the emulated cluster's Ray nodes failed: " + "; ".join(failed))


# -- helpers -----------------------------------------------------------------------------------


def _check_int(flag: str, value: Any, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{flag} {value!r}: must be an int in [{low}, {high}]")


def _cpu_sets(hosts: int, per_host: int | None) -> list[tuple[int, ...] | None]:
    if per_host is None:
        return [None] * hosts
    available = sorted(os.sched_getaffinity(0))
    _check_int("--cpus-per-host", per_host, 1, len(available))
    return [
        tuple(sorted({available[(i * per_host + k) % len(available)] for k in range(per_host)}))
        for i in range(hosts)
    ]


def _check_free(name: str) -> None:
    prefix = _netns.names(name)[1]
    existing = read_state(name)
    leftovers = _netns.namespaces(prefix) + _netns.links(prefix)
    if existing is not None or leftovers:
        what = f"is up ({existing.describe()})" if existing else f"left {leftovers} behind"
        raise ValueError(
            f"cluster {name!r} {what}; run `jaxreshard cluster down --name {name}` first, or "
            "pick another --name"
        )


@contextlib.contextmanager
def _lock(timeout_s: float = 120.0) -> Iterator[None]:
    """One `up` at a time on this machine picks a subnet and makes names."""
    path = state_dir(create=True) / ".lock"
    fd = open_private(path, os.O_RDWR | os.O_CREAT)  # (never truncates what a link points to)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"another `jaxreshard cluster up` held {path} for {timeout_s:g} s; "
                        "wait for it to finish (or end it) and try again"
                    ) from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
