"""An independent check of a plan: data provenance, coverage and timing.

It shares no code with the planner's decomposition or simulator, so a bug there shows up here.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

from jaxreshard.comm._cluster import Cluster
from jaxreshard.comm._layout import Index, Layout, format_index

_EPS = 1e-9


def validate_plan(plan: Any) -> list[str]:
    """Return the problems of a `Plan` (empty when it is valid). See `validate_ops`."""
    return validate_ops(
        plan.src,
        plan.dst,
        plan.cluster,
        plan.ops,
        plan.timeline,
        plan.itemsize,
        plan.hops or None,
    )


def validate_ops(
    src: Layout,
    dst: Layout,
    cluster: Cluster,
    ops: Sequence[Any],
    timeline: Sequence[tuple[float, float]],
    itemsize: int,
    hops: Sequence[Sequence[tuple[float, float]]] | None = None,
) -> list[str]:
    """Check that the ops, run at their (start, end) times, deliver `dst` from `src`.

    `hops`: per op, the (start, end) of each hop of a send's or broadcast's chain, if the plan
    times them apart; else each hop holds its links for the op's whole span.

    Rules:
    1. A sender (or each allgather participant, for its part) holds what it sends when the op
       starts: from the source layout, or delivered by an op that ended by then.
    2. Every destination device holds its whole region once all ops have ended.
    3. Every op lasts at least its bytes over the slowest link it crosses, plus the latency.
       With `hops`, each hop lasts at least its bytes over its own link plus the latency, the
       chain's hops start and end in chain order, and they span the op.
    4. No two hops (of any ops) use the same host NIC direction at the same time.
    Elements are compared on the grid of every boundary in the layouts and ops, so that every
    region involved is a union of grid cells and the checks are exact.
    """
    problems: list[str] = []
    shape = src.shape
    cuts = _grid(
        shape, [*src.indices, *dst.indices, *(r for op in ops for r in (op.index, *op.parts))]
    )
    held: dict[int, list[tuple[float, Index]]] = {}
    for device, index in zip(src.devices, src.indices):
        held.setdefault(device, []).append((-1.0, index))
    for op, (_start, end) in zip(ops, timeline):
        for device in op.receivers:  # allgather: every participant ends with the whole index
            held.setdefault(device, []).append((end, op.index))

    def holds(device: int, index: Index, at: float) -> bool:
        regions = [r for t, r in held.get(device, []) if t <= at + _EPS]
        return all(any(_contains(r, cell) for r in regions) for cell in _cells(index, cuts))

    for i, (op, (start, _end)) in enumerate(zip(ops, timeline)):
        if op.kind == "allgather":
            for device, part in zip(op.devices, op.parts):
                if not holds(device, part, start):
                    problems.append(
                        f"op {i} ({op}): participant {device} lacks its part "
                        f"{format_index(part)} at {start:.6g} s"
                    )
        elif not holds(op.src_device, op.index, start):
            problems.append(
                f"op {i} ({op}): sender {op.src_device} does not hold {format_index(op.index)} "
                f"at {start:.6g} s"
            )
    last = max((end for _, end in timeline), default=0.0)
    for device, index in zip(dst.devices, dst.indices):
        if not holds(device, index, last):
            problems.append(
                f"destination device {device} never receives all of {format_index(index)}"
            )

    problems += _check_timing(cluster, ops, timeline, itemsize, hops)
    return problems


def _check_timing(cluster, ops, timeline, itemsize, hops=None) -> list[str]:
    problems = []
    busy: dict[tuple[str, int], list[tuple[float, float, int]]] = {}
    if hops is not None and len(hops) != len(ops):
        return [f"{len(hops)} ops' hops given for {len(ops)} ops"]
    for i, (op, (start, end)) in enumerate(zip(ops, timeline)):
        if end < start:
            problems.append(f"op {i} ends before it starts")
            continue
        if op.kind == "allgather":
            k = len(op.devices)
            largest = max(_volume(p) for p in op.parts) * itemsize
            need = (k - 1) * largest / cluster.intra_host_bytes_per_s
            hosts = {cluster.host_of(d) for d in op.devices}
            if len(hosts) > 1:
                problems.append(f"op {i}: allgather spans hosts {sorted(hosts)}")
        else:
            chain = list(itertools.pairwise((op.src_device, *op.dst_devices)))
            if hops is None:  # (each hop holds its links for the op's whole span)
                spans = [(start, end)] * len(chain)
            else:
                spans = list(hops[i])
                problems += _check_hops(cluster, i, op, chain, spans, (start, end))
            slowest = cluster.intra_host_bytes_per_s
            for (a, b), (s, e) in zip(chain, spans):
                ha, hb = cluster.host_of(a), cluster.host_of(b)
                if ha != hb:
                    slowest = min(slowest, cluster.inter_host_bytes_per_s)
                    busy.setdefault(("out", ha), []).append((s, e, i))
                    busy.setdefault(("in", hb), []).append((s, e, i))
            need = op.nbytes / slowest + cluster.latency_s
        if end - start < need * (1 - 1e-9) - 1e-12:
            problems.append(
                f"op {i} ({op}) lasts {end - start:.6g} s, less than the {need:.6g} s its bytes "
                "need on its slowest link"
            )
    for (direction, host), spans in busy.items():
        spans.sort()
        for (s1, e1, i1), (s2, _e2, i2) in itertools.pairwise(spans):
            if s2 < e1 - _EPS:
                problems.append(
                    f"ops {i1} and {i2} overlap on host {host}'s NIC-{direction} "
                    f"({s1:.6g}-{e1:.6g} s vs from {s2:.6g} s)"
                )
    return problems


def _check_hops(cluster, i, op, chain, spans, whole) -> list[str]:
    """Rule 3 for each hop of a chain timed apart: a hop moves all of its bytes, the first chunk
    must cross a hop before the next hop can start, and the last chunk crosses a hop only after
    it has crossed the hop before (a relay forwards what it has received)."""
    if len(spans) != len(chain):
        return [f"op {i} ({op}) has {len(chain)} hops but {len(spans)} hop times"]
    problems = []
    if abs(spans[0][0] - whole[0]) > _EPS or abs(spans[-1][1] - whole[1]) > _EPS:
        problems.append(f"op {i} ({op}): its hops do not span it ({spans} vs {whole})")
    chunk = min(cluster.chunk_bytes, op.nbytes)
    before = None  # the last hop's bandwidth
    for k, ((a, b), (s, e)) in enumerate(zip(chain, spans)):
        across = cluster.host_of(a) != cluster.host_of(b)
        bandwidth = cluster.inter_host_bytes_per_s if across else cluster.intra_host_bytes_per_s
        need = op.nbytes / bandwidth + cluster.latency_s
        if e - s < need * (1 - 1e-9) - 1e-12:
            problems.append(
                f"op {i} ({op}): hop {k} ({a}->{b}) lasts {e - s:.6g} s, less than the "
                f"{need:.6g} s its bytes need"
            )
        if before is not None:
            (s0, e0) = spans[k - 1]
            first = s0 + cluster.latency_s + chunk / before  # the first chunk is across
            last = e0 + cluster.latency_s + chunk / bandwidth  # the last chunk, relayed
            if s < first * (1 - 1e-9) - 1e-12 or e < last * (1 - 1e-9) - 1e-12:
                problems.append(
                    f"op {i} ({op}): hop {k} ({a}->{b}) runs {s:.6g}-{e:.6g} s, ahead of the "
                    f"hop before it ({s0:.6g}-{e0:.6g} s): it can start at {first:.6g} s and "
                    f"end at {last:.6g} s at the earliest"
                )
        before = bandwidth
    return problems


def _grid(shape: tuple[int, ...], regions: Iterable[Index]) -> tuple[tuple[int, ...], ...]:
    points = [{0, n} for n in shape]
    for region in regions:
        for dim, (a, b) in enumerate(region):
            points[dim].update((a, b))
    return tuple(tuple(sorted(p)) for p in points)


def _cells(index: Index, cuts: tuple[tuple[int, ...], ...]) -> Iterable[Index]:
    ranges = []
    for (a, b), c in zip(index, cuts):
        lo, hi = bisect.bisect_left(c, a), bisect.bisect_left(c, b)
        ranges.append([(c[k], c[k + 1]) for k in range(lo, hi)])
    return itertools.product(*ranges)


def _contains(outer: Index, inner: Index) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))


def _volume(index: Index) -> int:
    n = 1
    for a, b in index:
        n *= b - a
    return n
