"""An emulated cluster's description (`jaxreshard-cluster/1`) and where a driver finds it.

[Note: cluster description]
`cluster up` writes the description twice: to a state file keyed by the cluster's name
(`<state dir>/<name>/cluster.json`, for `down` and `status` on this machine), and into the Ray
cluster's own key-value store (namespace `jaxreshard`, key `cluster`), so that a driver that only
has the head's address learns the NIC model when it joins: `RayRuntime` reads it and builds the
planner's `Cluster` with the shaped NIC rate and latency (unless `cluster_links` says otherwise),
and places host actor i on the node that carries the resource `jaxreshard_host_<i>`. Anyone can
describe a real cluster the same way (`publish`), and the planner then uses its numbers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CLUSTER_FORMAT = "jaxreshard-cluster/1"
KV_NAMESPACE = b"jaxreshard"
KV_KEY = b"cluster"
HOST_RESOURCE = "jaxreshard_host_"  # the same custom resource the local runtime uses
STATE_DIR_ENV = "JAXRESHARD_CLUSTER_DIR"
DEFAULT_STATE_DIR = "/tmp/jrs"


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


def state_dir() -> Path:
    return Path(os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR)


def state_file(name: str) -> Path:
    return state_dir() / name / "cluster.json"


def read_state(name: str) -> EmulatedCluster | None:
    path = state_file(name)
    try:
        return EmulatedCluster.from_json(json.loads(path.read_text()), where=str(path))
    except FileNotFoundError:
        return None


def known_names() -> list[str]:
    """Clusters with a state file on this machine."""
    base = state_dir()
    return sorted(p.parent.name for p in base.glob("*/cluster.json")) if base.is_dir() else []


def driver_ip_for(address: str | None) -> str | None:
    """The address a driver of this machine must join `address`'s emulated cluster with (its
    root-namespace node, see `_emulated._start_ray`), or None if `address` is no emulated
    cluster of this machine or this process cannot use that address."""
    if not address:
        return None
    for name in known_names():
        cluster = read_state(name)
        if cluster is not None and cluster.address == address and cluster.driver_ip:
            with socket.socket() as probe:
                try:
                    probe.bind((cluster.driver_ip, 0))  # only works where the address is ours
                except OSError:
                    return None
            return cluster.driver_ip
    return None


def publish(address: str, description: Mapping[str, Any], timeout_s: float = 30.0) -> None:
    """Store `description` in the Ray cluster's key-value store at `address` (no driver needed)."""
    from ray._raylet import GcsClient

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
