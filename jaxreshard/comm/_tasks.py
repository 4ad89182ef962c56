"""Decomposition of one resharding into unit tasks (the paper's appendix B).

Per dim, the cut points are {0, size} plus every shard boundary of the source and of the
destination layout; the cartesian product of the intervals between consecutive cut points gives
data slices, each of which lies whole inside one shard of every device that holds or needs any of
it. One unit task per slice that some destination device needs: all its source replicas are
candidate senders, all destination devices that need it are receivers.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools

from jaxreshard.comm._layout import Index, Layout, format_index, index_size


@dataclasses.dataclass(frozen=True, slots=True)
class UnitTask:
    """One data slice of a resharding: who holds it and who needs it."""

    index: Index
    senders: tuple[int, ...]
    receivers: tuple[int, ...]
    nbytes: int

    def __post_init__(self) -> None:
        if not self.senders:
            raise ValueError(f"unit task {format_index(self.index)} has no sender")
        if not self.receivers:
            raise ValueError(f"unit task {format_index(self.index)} has no receiver")
        if set(self.senders) & set(self.receivers):
            raise ValueError(f"unit task {format_index(self.index)}: a sender is also a receiver")


def cut_points(src: Layout, dst: Layout) -> tuple[tuple[int, ...], ...]:
    """Per dim, the sorted cut points of both layouts (including 0 and the dim size)."""
    cuts = []
    for dim, n in enumerate(src.shape):
        points = {0, n}
        for layout in (src, dst):
            for index in layout.indices:
                points.update(index[dim])
        cuts.append(tuple(sorted(points)))
    return tuple(cuts)


def decompose(src: Layout, dst: Layout, itemsize: int) -> tuple[UnitTask, ...]:
    """Return the unit tasks of resharding `src` into `dst`, in row-major slice order."""
    if src.shape != dst.shape:
        raise ValueError(f"source shape {src.shape} != destination shape {dst.shape}")
    cuts = cut_points(src, dst)
    holders = _slices_by_device(src, cuts)
    needers = _slices_by_device(dst, cuts)
    tasks = []
    for key in sorted(needers):
        if key not in holders:  # a JAX sharding always covers the whole array
            raise ValueError(
                f"no source device holds slice {format_index(_slice(cuts, key))} "
                "that a destination device needs: the source layout does not cover the array"
            )
        index = _slice(cuts, key)
        tasks.append(
            UnitTask(
                index=index,
                senders=tuple(sorted(holders[key])),
                receivers=tuple(sorted(needers[key])),
                nbytes=index_size(index) * itemsize,
            )
        )
    return tuple(tasks)


def _slice(cuts: tuple[tuple[int, ...], ...], key: tuple[int, ...]) -> Index:
    return tuple((c[k], c[k + 1]) for c, k in zip(cuts, key))


def _slices_by_device(
    layout: Layout, cuts: tuple[tuple[int, ...], ...]
) -> dict[tuple[int, ...], list[int]]:
    """Map each slice (as a tuple of interval numbers) to the devices whose region contains it."""
    out: dict[tuple[int, ...], list[int]] = {}
    for device, index in zip(layout.devices, layout.indices):
        ranges = []
        for (start, stop), c in zip(index, cuts):
            # Region boundaries are cut points, so these are exact interval numbers.
            ranges.append(range(bisect.bisect_left(c, start), bisect.bisect_left(c, stop)))
        for key in itertools.product(*ranges):
            out.setdefault(key, []).append(device)
    return out
