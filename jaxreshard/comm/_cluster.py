"""The cluster cost model: hosts, their devices, and the links between them.

[Note: cluster model]
Every host has one NIC, full duplex: it can send at `inter_host_gbytes_per_s` and receive at the
same rate at the same time; all devices of a host share it. Host pairs are fully connected and do
not interfere. Inside a host every device has its own link of `intra_host_gbytes_per_s` per
direction. Every message pays `latency_s` once. A pipelined broadcast moves data in chunks of
`chunk_bytes` (NCCL's ring steps are of that order), which sets its pipeline-fill cost. The defaults
are the paper's cluster (AWS p3.8xlarge: 4 GPUs per host, 10 Gbit/s between hosts, NVLink inside).
The planner, the simulator, the lower bound and the partitioner's gradient sums
(`all_reduce_seconds`) all read this one model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jaxreshard.comm._layout import device_key

PAPER_DEVICES_PER_HOST = 4
PAPER_INTER_HOST_GBYTES_PER_S = 1.25
PAPER_INTRA_HOST_GBYTES_PER_S = 50.0
PAPER_LATENCY_S = 2e-5
DEFAULT_CHUNK_BYTES = 512 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class Cluster:
    """Hosts and the device ids each one owns, plus the link model of [Note: cluster model].

    Attributes:
        hosts: one tuple of global device ids per host; the host id is the position.
        inter_host_gbytes_per_s: NIC bandwidth per host and direction, in GB/s (1e9 bytes).
        intra_host_gbytes_per_s: device link bandwidth inside a host, per direction, in GB/s.
        latency_s: fixed cost of every message, in seconds.
        chunk_bytes: pipelining granularity of a broadcast.
    """

    hosts: tuple[tuple[int, ...], ...]
    inter_host_gbytes_per_s: float = PAPER_INTER_HOST_GBYTES_PER_S
    intra_host_gbytes_per_s: float = PAPER_INTRA_HOST_GBYTES_PER_S
    latency_s: float = PAPER_LATENCY_S
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    _host_of: Mapping[int, int] = dataclasses.field(
        init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        hosts = tuple(tuple(int(d) for d in devices) for devices in self.hosts)
        object.__setattr__(self, "hosts", hosts)
        if not hosts:
            raise ValueError("Cluster(hosts=()): a cluster needs at least one host.")
        host_of: dict[int, int] = {}
        for host, devices in enumerate(hosts):
            if not devices:
                raise ValueError(
                    f"Cluster: host {host} has no devices; drop it or give it device ids."
                )
            for device in devices:
                if device in host_of:
                    raise ValueError(
                        f"Cluster: device {device} is listed on host {host_of[device]} and on "
                        f"host {host}; every device belongs to exactly one host."
                    )
                host_of[device] = host
        for name in ("inter_host_gbytes_per_s", "intra_host_gbytes_per_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"Cluster({name}={value!r}): bandwidths must be > 0 GB/s.")
        if not self.latency_s >= 0:
            raise ValueError(f"Cluster(latency_s={self.latency_s!r}): latency must be >= 0 s.")
        if not self.chunk_bytes >= 1:
            raise ValueError(f"Cluster(chunk_bytes={self.chunk_bytes!r}): must be >= 1 byte.")
        object.__setattr__(self, "_host_of", host_of)

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def uniform(
        cls,
        num_hosts: int,
        devices_per_host: int = PAPER_DEVICES_PER_HOST,
        *,
        first_device: int = 0,
        **links: Any,
    ) -> Cluster:
        """Return `num_hosts` hosts of `devices_per_host` consecutive device ids each."""
        if num_hosts < 1 or devices_per_host < 1:
            raise ValueError(
                f"Cluster.uniform(num_hosts={num_hosts}, devices_per_host={devices_per_host}): "
                "both must be >= 1."
            )
        hosts = tuple(
            tuple(
                range(
                    first_device + h * devices_per_host, first_device + (h + 1) * devices_per_host
                )
            )
            for h in range(num_hosts)
        )
        return cls(hosts, **links)

    @classmethod
    def from_devices(
        cls,
        devices: Iterable[Any],
        *,
        devices_per_host: int | None = None,
        **links: Any,
    ) -> Cluster:
        """Group devices into hosts.

        By default devices are grouped by `process_index` (one JAX process per host, as on a real
        multi-host cluster). Pass `devices_per_host` to instead cut the devices, sorted by id,
        into consecutive hosts of that size: this emulates a multi-host cluster on one machine.

        Args:
            devices: JAX devices, or any objects with `id` and `process_index`.
            devices_per_host: if given, override the grouping as described above.
            **links: bandwidth/latency overrides, as in the constructor.
        """
        devices = sorted(devices, key=device_key)
        if not devices:
            raise ValueError("Cluster.from_devices(devices=[]): need at least one device.")
        if devices_per_host is not None:
            if devices_per_host < 1:
                raise ValueError(
                    f"Cluster.from_devices(devices_per_host={devices_per_host}): must be >= 1."
                )
            ids = [device_key(d) for d in devices]
            hosts = [ids[i : i + devices_per_host] for i in range(0, len(ids), devices_per_host)]
            return cls(tuple(tuple(h) for h in hosts), **links)
        by_process: dict[int, list[int]] = {}
        for d in devices:
            by_process.setdefault(int(getattr(d, "process_index", 0)), []).append(device_key(d))
        return cls(tuple(tuple(by_process[p]) for p in sorted(by_process)), **links)

    # -- queries -----------------------------------------------------------------------------

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    @property
    def inter_host_bytes_per_s(self) -> float:
        return self.inter_host_gbytes_per_s * 1e9

    @property
    def intra_host_bytes_per_s(self) -> float:
        return self.intra_host_gbytes_per_s * 1e9

    def host_of(self, device: int) -> int:
        """Return the host id that owns global device id `device`."""
        try:
            return self._host_of[device]
        except KeyError:
            raise ValueError(
                f"device {device} is on no host of this cluster (hosts: {self.describe()}); "
                "build the Cluster over every device the shardings use."
            ) from None

    def check_covers(self, devices: Iterable[int], what: str) -> None:
        """Raise `ValueError` naming the devices of `what` that no host owns."""
        missing = sorted(set(devices) - self._host_of.keys())
        if missing:
            raise ValueError(
                f"cluster does not cover the {what} devices {missing}; its hosts are "
                f"{self.describe()}. Pass a Cluster that lists every device (e.g. "
                "Cluster.from_devices(jax.devices())), or omit `cluster` to derive one."
            )

    def all_reduce_seconds(
        self, groups: Iterable[Sequence[int]], nbytes: int, *, scatter: bool = False
    ) -> float:
        """Seconds for every group of device ids to all-reduce `nbytes` per device (with
        `scatter`, to reduce-scatter them), all groups at once: the gradient sums over a mesh
        axis, one group per position on the other axes.

        Each group runs a ring in host order: every device sends `2 (d - 1) / d` of its bytes
        to the next (`(d - 1) / d` to reduce-scatter). A ring edge between hosts goes over the
        sender's NIC, which every group crossing that host shares (one edge out of each host a
        group spans, at most); an edge inside a host takes that device's own link. Each of the
        `2 (d - 1)` ring steps (`d - 1`) pays `latency_s`."""
        nic: dict[int, float] = {}  # bytes each host's NIC sends
        inside, steps = 0.0, 0
        for group in groups:
            d = len(group)
            if d < 2 or nbytes <= 0:
                continue
            rounds = d - 1 if scatter else 2 * (d - 1)
            edge = rounds / d * nbytes
            ring = sorted(group, key=lambda g: (self.host_of(g), g))
            for a, b in zip(ring, ring[1:] + ring[:1]):
                src, dst = self.host_of(a), self.host_of(b)
                if src != dst:
                    nic[src] = nic.get(src, 0.0) + edge
                else:
                    inside = max(inside, edge)
            steps = max(steps, rounds)
        if not steps:
            return 0.0
        busiest = max(nic.values(), default=0.0) / self.inter_host_bytes_per_s
        return max(busiest, inside / self.intra_host_bytes_per_s) + steps * self.latency_s

    def describe(self) -> str:
        parts = []
        for host, devices in enumerate(self.hosts):
            span = (
                f"{devices[0]}-{devices[-1]}"
                if list(devices) == list(range(devices[0], devices[-1] + 1)) and len(devices) > 1
                else ",".join(map(str, devices))
            )
            parts.append(f"h{host}:[{span}]")
        return " ".join(parts)

    def link_summary(self) -> dict[str, float | int]:
        """The link model as the benchmark's `cluster` JSON object."""
        sizes = {len(h) for h in self.hosts}
        out: dict[str, float | int] = {}
        if len(sizes) == 1:
            out["devices_per_host"] = sizes.pop()
        out.update(
            inter_host_gbytes_per_s=self.inter_host_gbytes_per_s,
            intra_host_gbytes_per_s=self.intra_host_gbytes_per_s,
            latency_s=self.latency_s,
            chunk_bytes=self.chunk_bytes,
        )
        return out

    def to_json(self) -> dict[str, Any]:
        return {"hosts": [list(h) for h in self.hosts], **self.link_summary()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Cluster:
        keys = ("inter_host_gbytes_per_s", "intra_host_gbytes_per_s", "latency_s", "chunk_bytes")
        return cls(
            tuple(tuple(h) for h in data["hosts"]), **{k: data[k] for k in keys if k in data}
        )


def cluster_for_hosts(host_sizes: Sequence[int], **links: Any) -> Cluster:
    """Return a cluster whose hosts hold `host_sizes[i]` consecutive device ids, from 0."""
    hosts, next_id = [], 0
    for size in host_sizes:
        hosts.append(tuple(range(next_id, next_id + size)))
        next_id += size
    return Cluster(tuple(hosts), **links)
