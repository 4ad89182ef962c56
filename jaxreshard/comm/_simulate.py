"""Simulation of a plan on the cluster model, and a lower bound valid for any plan.

[Note: simulation model]
Every op holds a set of links exclusively while it runs: a hop between hosts holds the sending
host's NIC-out and the receiving host's NIC-in; a hop inside a host holds the sending device's
link-out and the receiving device's link-in. Ops are issued in plan order and each starts as soon
as all its links are free and the ops it depends on (`Op.after`) have finished; a link serves ops
in plan order (no op overtakes an earlier one on the same link). This is the paper's model
("tasks sharing a sender or a receiver host do not overlap") extended with intra-host links.
Durations:
- send: latency + bytes / bandwidth of its link.
- broadcast along the chain sender -> dst_devices[0] -> dst_devices[1] ...: pipelined in chunks,
  so it takes one latency per hop, plus bytes / the slowest hop's bandwidth, plus one chunk's time
  on each other hop (the pipeline fill). Across A hosts with K chunks that is the paper's
  t * (K + A - 1) / K.
- allgather among the devices of one host (ring): (k - 1) steps, each moving the largest part
  over the device links, plus one latency per step.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from jaxreshard.comm._cluster import Cluster
from jaxreshard.comm._layout import index_size
from jaxreshard.comm._plan import Op
from jaxreshard.comm._tasks import UnitTask

Resource = tuple[str, int]
"""("out", host) / ("in", host): a host NIC direction; ("dout", device) / ("din", device): a
device's intra-host link direction."""


def hop_links(cluster: Cluster, a: int, b: int) -> tuple[Resource, Resource, float]:
    """The two links one hop from device `a` to device `b` holds, and its bandwidth (bytes/s)."""
    ha, hb = cluster.host_of(a), cluster.host_of(b)
    if ha != hb:
        return ("out", ha), ("in", hb), cluster.inter_host_bytes_per_s
    return ("dout", a), ("din", b), cluster.intra_host_bytes_per_s


def op_cost(op: Op, cluster: Cluster) -> tuple[tuple[Resource, ...], float]:
    """Return the links `op` holds and how long it runs (see [Note: simulation model])."""
    if op.kind == "allgather":
        hosts = {cluster.host_of(d) for d in op.devices}
        if len(hosts) != 1:
            raise ValueError(
                f"allgather over devices {list(op.devices)} spans hosts {sorted(hosts)}; the "
                "planner only emits allgathers inside one host."
            )
        k = len(op.devices)
        largest = max(index_size(p) for p in op.parts) * (op.nbytes // max(1, index_size(op.index)))
        seconds = (k - 1) * (cluster.latency_s + largest / cluster.intra_host_bytes_per_s)
        links = tuple(r for d in op.devices for r in (("dout", d), ("din", d)))
        return links, seconds
    chain = (op.src_device, *op.dst_devices)
    links: list[Resource] = []
    bandwidths = []
    for a, b in itertools.pairwise(chain):
        out_link, in_link, bandwidth = hop_links(cluster, a, b)
        links += [out_link, in_link]
        bandwidths.append(bandwidth)
    slowest = min(bandwidths)
    chunk = min(cluster.chunk_bytes, op.nbytes)
    fill = sum(chunk / bw for bw in bandwidths) - chunk / slowest
    seconds = len(bandwidths) * cluster.latency_s + op.nbytes / slowest + fill
    return tuple(dict.fromkeys(links)), seconds


def simulate(ops: Sequence[Op], cluster: Cluster) -> tuple[tuple[tuple[float, float], ...], float]:
    """List-schedule `ops` in order; return each op's (start, end) and the completion time."""
    free: dict[Resource, float] = {}
    timeline: list[tuple[float, float]] = []
    for op in ops:
        links, seconds = op_cost(op, cluster)
        start = max((free.get(r, 0.0) for r in links), default=0.0)
        for j in op.after:
            start = max(start, timeline[j][1])
        end = start + seconds
        for r in links:
            free[r] = end
        timeline.append((start, end))
    makespan = max((end for _, end in timeline), default=0.0)
    return tuple(timeline), makespan


def lower_bound(tasks: Sequence[UnitTask], cluster: Cluster) -> float:
    """A lower bound on the completion time of any plan for `tasks` on `cluster`.

    Under [Note: cluster model], only data that leaves or enters a host costs NIC time, and a
    NIC serves one op at a time, each paying the latency once:
    1. Receiving: every host must get, through its NIC-in, each element its destination devices
       need that no source device on that host holds: bytes_in(h) / bandwidth.
    2. Sending: the first time an element leaves any host it leaves a host that held it from the
       start. So for a group S of hosts, the elements held only inside S and needed by a host
       outside S cross S's NICs at least once: bytes_out(S) / (|S| * bandwidth). Evaluated for
       each single source host and for the group of all source hosts.
    Each term adds one latency if it moves any bytes. Intra-host copies are ignored (a valid
    relaxation), so the bound is reachable only when they are cheap.
    """
    bandwidth = cluster.inter_host_bytes_per_s
    hosts = [
        ({cluster.host_of(d) for d in t.senders}, {cluster.host_of(d) for d in t.receivers})
        for t in tasks
    ]
    source_hosts = set().union(*(holders for holders, _ in hosts))
    bytes_in: dict[int, int] = {}
    bytes_out_single: dict[int, int] = {}
    bytes_out_all = 0
    for task, (holders, needers) in zip(tasks, hosts):
        for host in needers - holders:
            bytes_in[host] = bytes_in.get(host, 0) + task.nbytes
        if len(holders) == 1 and needers - holders:
            (only,) = holders
            bytes_out_single[only] = bytes_out_single.get(only, 0) + task.nbytes
        if needers - source_hosts:
            bytes_out_all += task.nbytes
    terms = [b / bandwidth for b in bytes_in.values()]
    terms += [b / bandwidth for b in bytes_out_single.values()]
    if source_hosts:
        terms.append(bytes_out_all / (len(source_hosts) * bandwidth))
    bound = max(terms, default=0.0)
    return bound + cluster.latency_s if bound > 0 else 0.0
