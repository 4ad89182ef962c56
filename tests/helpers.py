"""Shared test helpers: random meshes and specs, brute-force references."""

from __future__ import annotations

import itertools
import math

from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from jaxreshard.comm import Cluster, VirtualMesh, VirtualSharding

AXES = ("a", "b", "c")


@st.composite
def mesh_shapes(draw, max_devices=8, max_axes=3):
    num_axes = draw(st.integers(1, max_axes))
    shape = []
    for _ in range(num_axes):
        budget = max_devices // math.prod(shape or [1])
        shape.append(draw(st.integers(1, max(1, min(4, budget)))))
    return tuple(shape)


@st.composite
def specs(draw, mesh_shape, rank):
    """A PartitionSpec over axes AXES[:len(mesh_shape)]: each axis used at most once."""
    axes = draw(st.permutations(AXES[: len(mesh_shape)]))
    entries = [None] * rank
    for axis in axes:
        if rank and draw(st.booleans()):
            dim = draw(st.integers(0, rank - 1))
            entries[dim] = (entries[dim] or ()) + (axis,)
    entries = [e[0] if e and len(e) == 1 else e for e in entries]
    return P(*entries)


def shape_for(mesh_shapes_and_specs, rank, draw):
    """A shape divisible by every sharding factor of the given (mesh_shape, spec) pairs."""
    factors = [1] * rank
    for mesh_shape, spec in mesh_shapes_and_specs:
        sizes = dict(zip(AXES, mesh_shape))
        for dim, entry in enumerate(spec):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
            f = math.prod(sizes[a] for a in axes)
            factors[dim] = math.lcm(factors[dim], f)
    return tuple(f * draw(st.integers(1, 3)) for f in factors)


def virtual(mesh_shape, spec, first_id, devices_per_host):
    ids = list(range(first_id, first_id + math.prod(mesh_shape)))
    host_of = {d: d // devices_per_host for d in ids}
    mesh = VirtualMesh.from_ids(mesh_shape, AXES[: len(mesh_shape)], ids, host_of)
    return VirtualSharding(mesh, spec)


def cluster_over(num_devices, devices_per_host, **links):
    hosts = [
        tuple(range(i, min(i + devices_per_host, num_devices)))
        for i in range(0, num_devices, devices_per_host)
    ]
    return Cluster(tuple(hosts), **links)


def owners(sharding, shape):
    """Brute force: for every element, the set of device ids whose shard contains it."""
    cells = {idx: set() for idx in itertools.product(*(range(n) for n in shape))}
    for device, slices in sharding.devices_indices_map(shape).items():
        ranges = [range(*s.indices(n)[:2]) for s, n in zip(slices, shape)]
        for idx in itertools.product(*ranges):
            cells[idx].add(device.id)
    return cells


def step_layout(schedule, *transfers: tuple[str, int, int]):
    """What the profiler's measured costs read of a pipeline layout: its schedule and its
    runtime transfers (name, src chunk, dst chunk)."""
    import types

    named = {n: types.SimpleNamespace(name=n, src_stage=s, dst_stage=d) for n, s, d in transfers}
    return types.SimpleNamespace(schedule=schedule, transfers=named)
