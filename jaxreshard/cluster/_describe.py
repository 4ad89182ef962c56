"""An emulated cluster's description (`jaxreshard-cluster/1`) and where a driver finds it.

[Note: cluster description]
`cluster up` writes the description twice: to a state file keyed by the cluster's name
(`<state dir>/<name>/cluster.json`, for `down` and `status` on this machine), and into the Ray
cluster's own key-value store (namespace `jaxreshard`, key `cluster`), so that a driver that only
has the head's address learns the NIC model when it joins: `RayRuntime` reads it and builds the
planner's `Cluster` with the shaped NIC rate and latency (unless `cluster_links` says otherwise),
and places host actor i on the node that carries the resource `jaxreshard_host_<i>`. Anyone can
describe a real cluster the same way (`publish`), and the planner then uses its numbers.

[Note: private state]
The state directory (`JAXRESHARD_CLUSTER_DIR`, default /tmp/jrs) says which processes `down`
stops and holds the Ray token of each cluster (`<name>/ray-token`, see [Note: Ray token]), so
only its user may write there: `state_dir` makes it 0700 and refuses one that is a symbolic link,
belongs to another user or is writable by group or others (in /tmp, anyone could have made it
first), naming the path, what is wrong and the fix. Inside it, files are opened with O_NOFOLLOW
(a planted link is an error, never followed), created 0600 without truncating what a link points
to, and the description is replaced atomically (a temporary file, then `os.replace`), so a
reader never sees half of one.

[Note: Ray token]
Every Ray node of an emulated cluster runs with Ray's token authentication (`RAY_AUTH_MODE=token`,
the token in `<state dir>/<name>/ray-token`, 0600): Ray's servers listen on every interface of
their namespace, the drivers' node on every interface of this machine (Ray has no setting to
bind them to one address; `--node-ip-address` only says which address to advertise), and
without a token anything that reaches them may run code in the cluster. A process of this
machine that joins the cluster at that address finds the token here (`ray_token_for`) and holds
it in Ray's settings only while it connects (`ray_auth`): Ray reads `RAY_AUTH_*` from the
environment, and a setting left behind would send the token to, or demand one from, the next
Ray this process starts or joins. Ray reads them once per process, though, and every
connection of the process sends what it read: `ray_auth` therefore refuses to hold another
token while this process is connected to Ray (its own connection would be refused from then
on; a test that did so broke the local runtime of the tests after it, InvalidAuthToken).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import socket
import stat
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

CLUSTER_FORMAT = "jaxreshard-cluster/1"
KV_NAMESPACE = b"jaxreshard"
KV_KEY = b"cluster"
HOST_RESOURCE = "jaxreshard_host_"  # the same custom resource the local runtime uses
STATE_DIR_ENV = "JAXRESHARD_CLUSTER_DIR"
DEFAULT_STATE_DIR = "/tmp/jrs"
TOKEN_FILE = "ray-token"
_RAY_AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")


@dataclasses.dataclass(frozen=True, slots=True)
class HostInfo:
    """One emulated host (or the head node): its namespace, address and pinned CPUs."""

    name: str
    netns: str
    ip: str
    cpus: tuple[int, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "netns": self.netns,
            "ip": self.ip,
            "cpus": list(self.cpus) if self.cpus is not None else None,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> HostInfo:
        cpus = data.get("cpus")
        return cls(data["name"], data["netns"], data["ip"], tuple(cpus) if cpus else None)


@dataclasses.dataclass(frozen=True, slots=True)
class EmulatedCluster:
    """What `cluster up` made: hosts with shaped NICs, one Ray node each, and the head.

    Attributes:
        name: the cluster's name (every namespace and link is `jrs-<name>-...`).
        address: the Ray head, `IP:PORT`, for `jaxreshard.init(backend="ray", address=...)`.
        nic_gbps: every host NIC's rate per direction, GB/s (1e9 bytes); None if unshaped.
        latency_ms: one-way delay added to every packet a host sends.
        hosts: the emulated hosts, in host-id order.
        devices_per_host: fake CPU devices each host actor makes.
        head: the head node's namespace (it runs no host actor).
        subnet: the bridge's /24; the root namespace (the driver) holds its `.1`.
    """

    name: str
    address: str
    nic_gbps: float | None
    latency_ms: float
    hosts: tuple[HostInfo, ...]
    devices_per_host: int
    head: HostInfo
    subnet: str
    driver_ip: str
    object_store_mib: int

    def to_json(self) -> dict[str, Any]:
        return {
            "format": CLUSTER_FORMAT,
            "name": self.name,
            "address": self.address,
            "nic_gbps": self.nic_gbps,
            "latency_ms": self.latency_ms,
            "hosts": [h.to_json() for h in self.hosts],
            "devices_per_host": self.devices_per_host,
            "head": self.head.to_json(),
            "subnet": self.subnet,
            "driver_ip": self.driver_ip,
            "object_store_mib": self.object_store_mib,
        }

    @classmethod
    def from_json(
        cls, data: Mapping[str, Any], where: str = "cluster description"
    ) -> EmulatedCluster:
        if data.get("format") != CLUSTER_FORMAT:
            raise ValueError(
                f"{where}: format is {data.get('format')!r}, expected {CLUSTER_FORMAT!r}"
            )
        return cls(
            name=data["name"],
            address=data["address"],
            nic_gbps=data.get("nic_gbps"),
            latency_ms=float(data.get("latency_ms", 0.0)),
            hosts=tuple(HostInfo.from_json(h) for h in data["hosts"]),
            devices_per_host=int(data.get("devices_per_host", 1)),
            head=HostInfo.from_json(data["head"]),
            subnet=data.get("subnet", ""),
            driver_ip=data.get("driver_ip", ""),
            object_store_mib=int(data.get("object_store_mib", 0)),
        )

    def links(self) -> dict[str, float]:
        """The planner's link model of this cluster (`Cluster` keyword arguments)."""
        return links_of(self.to_json())

    def describe(self) -> str:
        rate = f"{self.nic_gbps:g} GB/s" if self.nic_gbps is not None else "unshaped"
        return (
            f"{len(self.hosts)} hosts x {self.devices_per_host} devices, NIC {rate} per "
            f"direction, +{self.latency_ms:g} ms one way, head {self.address}"
        )


def links_of(description: Mapping[str, Any]) -> dict[str, float]:
    """`Cluster` keyword arguments from a description: the NIC rate and the one-way latency."""
    out: dict[str, float] = {"latency_s": float(description.get("latency_ms") or 0.0) / 1e3}
    if description.get("nic_gbps") is not None:
        out["inter_host_gbytes_per_s"] = float(description["nic_gbps"])
    return out


def state_dir(create: bool = False) -> Path:
    """This machine's folder of cluster states (`JAXRESHARD_CLUSTER_DIR`, default /tmp/jrs),
    made 0700 if missing and `create`.

    Raises:
        PermissionError: it is a symbolic link, another user's, or writable by group or
            others (see [Note: private state]).
    """
    path = Path(os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR)
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    _check_private(path, "the cluster state directory")
    return path


def cluster_dir(name: str, create: bool = False) -> Path:
    """Cluster `name`'s folder in the state directory (made 0700 if missing and `create`)."""
    path = state_dir(create) / name
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    _check_private(path, f"the state directory of cluster {name!r}")
    return path


def state_file(name: str) -> Path:
    return cluster_dir(name) / "cluster.json"


def token_file(name: str) -> Path:
    """Where cluster `name`'s Ray token is (see [Note: Ray token])."""
    return cluster_dir(name) / TOKEN_FILE


def _check_private(path: Path, what: str) -> None:
    """Refuse `path` (if it exists) unless it is a directory of this user that only this user
    may write to (see [Note: private state])."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    elsewhere = f"or point {STATE_DIR_ENV} at a directory of your own"
    if stat.S_ISLNK(info.st_mode):
        problem = f"is a symbolic link (to {os.readlink(path)})"
        fix = f"remove the link (`rm {path}`) {elsewhere}"
    elif not stat.S_ISDIR(info.st_mode):
        problem, fix = "is not a directory", f"remove it {elsewhere}"
    elif info.st_uid != os.getuid():
        problem = f"belongs to uid {info.st_uid}, not to this user (uid {os.getuid()})"
        fix = f"remove it as its owner (`rm -r {path}`) {elsewhere}"
    elif info.st_mode & 0o022:
        problem = f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})"
        fix = f"`chmod 700 {path}` {elsewhere}"
    else:
        return
    raise PermissionError(
        f"{what} {path} {problem}; it must be a real directory that only this user can write "
        f"to, since it decides what `cluster down` stops and holds the clusters' Ray tokens: "
        f"{fix}"
    )


def open_private(path: Path, flags: int, mode: int = 0o600) -> int:
    """`os.open` a file in the state directory without following a link (see [Note: private
    state]); a link there is a `PermissionError` that names it."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise PermissionError(
            f"{path} is a symbolic link (to {os.readlink(path)}); files in the cluster state "
            f"directory must be plain files: remove the link (`rm {path}`)"
        ) from None


def read_private(path: Path) -> str:
    with os.fdopen(open_private(path, os.O_RDONLY)) as f:
        return f.read()


def write_private(path: Path, text: str) -> None:
    """Replace `path` with `text` at once (a 0600 temporary file beside it, then renamed)."""
    fd, part = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part)


def write_state(cluster: EmulatedCluster) -> None:
    write_private(state_file(cluster.name), json.dumps(cluster.to_json(), indent=1))


def read_state(name: str) -> EmulatedCluster | None:
    path = state_file(name)
    try:
        text = read_private(path)
    except FileNotFoundError:
        return None
    return EmulatedCluster.from_json(json.loads(text), where=str(path))


def known_names() -> list[str]:
    """Clusters with a state file on this machine."""
    base = state_dir()
    return sorted(p.parent.name for p in base.glob("*/cluster.json")) if base.is_dir() else []


def _cluster_at(address: str | None) -> EmulatedCluster | None:
    """The emulated cluster of this machine whose head is at `address`, if any."""
    if not address:
        return None
    for name in known_names():
        cluster = read_state(name)
        if cluster is not None and cluster.address == address:
            return cluster
    return None


def driver_ip_for(address: str | None) -> str | None:
    """The address a driver of this machine must join `address`'s emulated cluster with (its
    root-namespace node, see `_emulated._start_ray`), or None if `address` is no emulated
    cluster of this machine or this process cannot use that address."""
    cluster = _cluster_at(address)
    if cluster is None or not cluster.driver_ip:
        return None
    with socket.socket() as probe:
        try:
            probe.bind((cluster.driver_ip, 0))  # only works where the address is ours
        except OSError:
            return None
    return cluster.driver_ip


def ray_token_for(address: str | None) -> Path | None:
    """The Ray token file of the emulated cluster of this machine at `address` (see [Note: Ray
    token]), or None if `address` is no such cluster or it runs without one."""
    cluster = _cluster_at(address)
    if cluster is None:
        return None
    path = token_file(cluster.name)
    return path if path.exists() else None


@contextlib.contextmanager
def ray_auth(token: Path | None, *, connecting: bool = False) -> Iterator[None]:
    """Within: this process's Ray authenticates with the token in `token` (None: as the
    environment says). After it the environment is as before, and so are Ray's settings unless
    `connecting` (then the connection made inside keeps its token; see [Note: Ray token])."""
    import ray

    if token is not None and not connecting and ray.is_initialized():
        # Ray reads the token once per process and every connection uses it: switching it for
        # another cluster would fail this process's own connection's calls (InvalidAuthToken).
        raise RuntimeError(
            f"cannot switch this process's Ray token to {str(token)!r} while it is connected "
            "to Ray: its own connection would then send that token and could be refused. "
            "Call it from a process without Ray (e.g. `jaxreshard cluster up`), or call "
            "jaxreshard.shutdown() (or ray.shutdown()) first"
        )
    before = {k: os.environ.get(k) for k in _RAY_AUTH_ENV}
    if token is not None:
        os.environ.pop("RAY_AUTH_TOKEN", None)  # it would win over the file
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
        _read_ray_auth()
    else:
        reset_ray_auth()
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if token is not None and not connecting:
            _read_ray_auth()


def reset_ray_auth() -> None:
    """Make this process's Ray take its authentication from the environment again, unless it is
    connected (that connection keeps its settings). Ray reads them once and caches them: an
    emulated cluster's token mode, kept for a connection (`ray_auth`), would otherwise stay for
    the next Ray this process starts or joins (whose actors then failed to start)."""
    import ray

    if not ray.is_initialized():
        _read_ray_auth()


def _read_ray_auth() -> None:
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def publish(
    address: str,
    description: Mapping[str, Any],
    timeout_s: float = 30.0,
    token: Path | None = None,
) -> None:
    """Store `description` in the Ray cluster's key-value store at `address` (no driver needed);
    `token`: the file of the Ray token the cluster demands, if any."""
    from ray._raylet import GcsClient

    with ray_auth(token):
        client = GcsClient(address=address)
        client.internal_kv_put(
            KV_KEY, json.dumps(dict(description)).encode(), True, KV_NAMESPACE, timeout=timeout_s
        )


def lookup() -> dict[str, Any] | None:
    """The description stored in the cluster this process's Ray is connected to, if any."""
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        return None
    raw = internal_kv._internal_kv_get(KV_KEY, namespace=KV_NAMESPACE)
    return json.loads(raw) if raw else None
