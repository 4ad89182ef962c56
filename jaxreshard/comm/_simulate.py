"""Simulation of a plan on the cluster model, and a lower bound valid for any plan.

[Note: simulation model]
A hop between hosts holds the sending host's NIC-out and the receiving host's NIC-in; a hop
inside a host holds the sending device's link-out and the receiving device's link-in. Ops are
issued in plan order; a link serves them in that order (no op overtakes an earlier one on the same
link), one at a time. This is the paper's model ("tasks sharing a sender or a receiver host do not
overlap") extended with intra-host links. An op starts once the ops it depends on (`Op.after`)
have finished.
- send: latency + bytes / bandwidth of its link.
- broadcast along the chain sender -> dst_devices[0] -> dst_devices[1] ...: pipelined in chunks.
  On free links it takes one latency per hop, plus bytes / the slowest hop's bandwidth, plus one
  chunk's time on each other hop (the pipeline fill). Across A hosts with K chunks that is the
  paper's t * (K + A - 1) / K.
- allgather among the devices of one host (ring): (k - 1) steps, each moving the largest part
  over the device links, plus one latency per step; it holds all of its links throughout.

[Note: chained hops]
A send or broadcast holds each hop's links only while that hop moves its bytes: hop i starts
once its links are free and the op's first chunk has crossed hop i - 1, and ends no sooner than
one chunk (and a latency) after hop i - 1 ends. On free links that is the duration above (for a
chain that enters each host once, as the planner's chains do). So the next op along the same NIC
starts as soon as this one has left it, not when this one's last receiver has its copy. That is
how the TCP transport moves them: its sender thread per peer writes one op's chunks right behind
the last one's, and a relay forwards each chunk as it arrives (measured, below). NCCL runs each
device's ops of a resharding in order on one stream, but its relays hold a few chunks each, so
there a hop cannot run far ahead of a slow one downstream, which this model does not charge (not
measured: no GPU here). Holding every link of a chain until its end (this simulator until
2026-11-30) charged each op of a fan-out its own pipeline fill and per-hop latencies: 64 MiB in
8 slices from one host to 2 hosts x 8 devices planned 1.13x its bound, and 1.02x with the hops
apart. Executed on the emulated cluster, such slices arrive as fast as one slice of the same
bytes (docs/benchmarks.md, "Fan-out to hosts of 8 devices").
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


Span = tuple[float, float]


def simulate(ops: Sequence[Op], cluster: Cluster) -> tuple[tuple[Span, ...], float]:
    """List-schedule `ops` in order; return each op's (start, end) and the completion time."""
    timeline, _, makespan = simulate_hops(ops, cluster)
    return timeline, makespan


def simulate_hops(
    ops: Sequence[Op], cluster: Cluster
) -> tuple[tuple[Span, ...], tuple[tuple[Span, ...], ...], float]:
    """`simulate`, with each op's hops as well: per op, the (start, end) of each hop of its
    chain (see [Note: chained hops]; none for an allgather, which holds all of its links for
    its whole time)."""
    free: dict[Resource, float] = {}
    timeline: list[Span] = []
    hops: list[tuple[Span, ...]] = []
    for op in ops:
        ready = max((timeline[j][1] for j in op.after), default=0.0)
        if op.kind == "allgather":
            links, seconds = op_cost(op, cluster)
            start = max([ready, *(free.get(r, 0.0) for r in links)])
            for r in links:
                free[r] = start + seconds
            timeline.append((start, start + seconds))
            hops.append(())
            continue
        chunk = min(cluster.chunk_bytes, op.nbytes)
        spans: list[Span] = []
        arrives = ready  # when the op's first chunk can leave this hop's sender
        chain = (op.src_device, *op.dst_devices)
        for a, b in itertools.pairwise(chain):
            out_link, in_link, bandwidth = hop_links(cluster, a, b)
            start = max(arrives, free.get(out_link, 0.0), free.get(in_link, 0.0))
            end = start + cluster.latency_s + op.nbytes / bandwidth
            if spans:  # (its last chunk cannot leave before it has come in)
                end = max(end, spans[-1][1] + cluster.latency_s + chunk / bandwidth)
            free[out_link] = free[in_link] = end
            spans.append((start, end))
            arrives = start + cluster.latency_s + chunk / bandwidth
        timeline.append((spans[0][0], spans[-1][1]))
        hops.append(tuple(spans))
    makespan = max((end for _, end in timeline), default=0.0)
    return tuple(timeline), tuple(hops), makespan


def lower_bound(tasks: Sequence[UnitTask], cluster: Cluster) -> float:
    """A lower bound on the completion time of any plan for `tasks` on `cluster`.

    Under [Note: cluster model], only data that leaves or enters a host costs NIC time, and a
    NIC serves one hop at a time, each paying the latency once:
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
