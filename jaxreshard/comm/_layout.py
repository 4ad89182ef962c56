"""Layouts: which global region of an array each device holds.

A `Layout` is the planner's only view of a sharding. It is built from anything that answers
`devices_indices_map(shape)` with keys that have an integer `id` (JAX shardings, and the
`VirtualSharding` below for devices outside this process), so `devices_indices_map` stays the
source of truth for who holds what.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from jaxreshard._jax_compat import named_sharding_indices

Index = tuple[tuple[int, int], ...]
"""A global region of an array: one half-open (start, stop) per dim."""


def index_size(index: Index) -> int:
    return math.prod(stop - start for start, stop in index)


def format_index(index: Index) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in index) + "]"


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """The region of a `shape`-d array held by each device (global device ids)."""

    shape: tuple[int, ...]
    devices: tuple[int, ...]
    indices: tuple[Index, ...]

    def __post_init__(self) -> None:
        assert len(self.devices) == len(self.indices)
        assert len(set(self.devices)) == len(self.devices), "a device appears twice"
        for index in self.indices:
            assert len(index) == len(self.shape)
            for (start, stop), n in zip(index, self.shape):
                assert 0 <= start <= stop <= n

    def index_of(self, device: int) -> Index:
        return self.indices[self.devices.index(device)]

    @classmethod
    def from_sharding(
        cls, sharding: Any, shape: Sequence[int], *, what: str = "sharding"
    ) -> Layout:
        """Return the layout that `sharding` gives an array of `shape`.

        Raises:
            TypeError: `sharding` is not a sharding.
            ValueError: the sharding does not fit the shape (rank, divisibility) or has no devices.
        """
        shape = tuple(int(n) for n in shape)
        if not hasattr(sharding, "devices_indices_map"):
            raise TypeError(
                f"{what} must be a jax.sharding.Sharding (e.g. NamedSharding(mesh, P(...))) or a "
                f"jaxreshard VirtualSharding; got {type(sharding).__name__}: {sharding!r}."
            )
        mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
        if mesh is not None and spec is not None and hasattr(mesh, "shape"):
            check_spec_fits(shape, dict(mesh.shape), spec, what)
        try:
            index_map = sharding.devices_indices_map(shape)
        except ValueError as e:
            raise ValueError(f"{what} {sharding} does not fit shape {shape}: {e}") from e
        if not index_map:
            raise ValueError(f"{what} {sharding} has no devices; a mesh needs at least one device.")
        devices, indices = [], []
        for device, slices in index_map.items():
            devices.append(device_key(device))
            indices.append(_normalize(slices, shape))
        return cls(shape, tuple(devices), tuple(indices))


# [Note: device keys]
# Plans, clusters and host programs name devices by integer keys. A JAX device id is unique only
# within its platform: `CudaDevice(id=0)` and `CpuDevice(id=0)` live side by side in one process.
# So a device's key is its id on the process's default platform (the usual, single-platform
# case, where keys are the ids users see), and `PLATFORM_STRIDE * k + id` on another platform
# (k = 1 + its position in `_OTHER_PLATFORMS`), which keeps a CPU stage beside GPU stages
# distinct. `VirtualDevice`s (devices of remote hosts) carry their key as their id.
PLATFORM_STRIDE = 1 << 20
_OTHER_PLATFORMS = ("cpu", "gpu", "cuda", "rocm", "tpu")


def device_key(device: Any) -> int:
    """The integer that plans and clusters use for `device` (see [Note: device keys])."""
    platform = getattr(device, "platform", None)
    if platform in (None, "virtual") or platform == _default_platform():
        return int(device.id)
    if platform not in _OTHER_PLATFORMS:
        raise ValueError(
            f"device {device} is on platform {platform!r}, beside {_default_platform()!r} devices; "
            f"mixing platforms in one plan works for {_OTHER_PLATFORMS} only"
        )
    return PLATFORM_STRIDE * (1 + _OTHER_PLATFORMS.index(platform)) + int(device.id)


def _default_platform() -> str:
    import jax

    return jax.devices()[0].platform


def _normalize(slices: Sequence[slice], shape: tuple[int, ...]) -> Index:
    out = []
    for s, n in zip(slices, shape):
        start, stop, step = s.indices(n)
        assert step == 1, f"strided shard index {s}"
        out.append((start, stop))
    # An index may cover fewer dims than the shape: the rest are whole.
    out.extend((0, n) for n in shape[len(out) :])
    return tuple(out)


def spec_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes one PartitionSpec entry names (major to minor)."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def normalized_spec(
    spec: Any, axis_sizes: Mapping[str, int] | None = None
) -> tuple[tuple[str, ...], ...]:
    """A PartitionSpec as the axes of each dim, without trailing unsharded dims: `P("x")`,
    `P("x", None)` and `P(("x",))` shard alike and normalise alike (XLA reports specs with
    the trailing `None`s that a user's spec leaves out). With the mesh's `axis_sizes`, axes of
    size 1 are dropped too: on a mesh whose "data" axis has one device, `P("data")` is `P()`,
    and XLA reports it so."""
    axes = [
        tuple(a for a in spec_axes(entry) if axis_sizes is None or axis_sizes.get(a) != 1)
        for entry in spec
    ]
    while axes and not axes[-1]:
        axes.pop()
    return tuple(axes)


def check_spec_fits(
    shape: tuple[int, ...], axis_sizes: Mapping[str, int], spec: Any, what: str
) -> None:
    """Raise a `ValueError` naming the rule and the fix if `spec` cannot shard `shape`."""
    entries = tuple(spec)
    if len(entries) > len(shape):
        raise ValueError(
            f"{what}: spec {spec} has {len(entries)} entries but the array has rank "
            f"{len(shape)} (shape {shape}); give at most one entry per dim."
        )
    used: dict[str, int] = {}
    for dim, entry in enumerate(entries):
        axes = spec_axes(entry)
        for axis in axes:
            if axis not in axis_sizes:
                raise ValueError(
                    f"{what}: spec {spec} names mesh axis {axis!r}, which the mesh does not have "
                    f"(axes: {list(axis_sizes)})."
                )
            if axis in used:
                raise ValueError(
                    f"{what}: spec {spec} uses mesh axis {axis!r} for dims {used[axis]} and {dim}; "
                    "a mesh axis can shard at most one dim."
                )
            used[axis] = dim
        factor = math.prod(axis_sizes[a] for a in axes)
        if factor > 1 and shape[dim] % factor:
            raise ValueError(
                f"{what}: spec {spec} shards dim {dim} (size {shape[dim]}) over mesh axes "
                f"{axes} (size {factor}), which does not divide it; make dim {dim} a multiple "
                f"of {factor} or shard it over fewer devices."
            )


# -- devices outside this process ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class VirtualDevice:
    """A device known by global id and host, that need not exist in this process.

    Used for benchmark clusters and for the devices of remote hosts (Ray). It quacks like a
    `jax.Device` where the planner looks: `id` and `process_index`.
    """

    id: int
    process_index: int = 0
    platform: str = "virtual"

    def __repr__(self) -> str:
        return f"VirtualDevice(id={self.id}, host={self.process_index})"


class VirtualMesh:
    """An n-d array of `VirtualDevice`s with named axes, like `jax.sharding.Mesh`."""

    def __init__(self, devices: np.ndarray | Sequence[Any], axis_names: Sequence[str]):
        devices = np.asarray(devices, dtype=object)
        axis_names = tuple(axis_names)
        if devices.ndim != len(axis_names):
            raise ValueError(
                f"VirtualMesh: devices have {devices.ndim} dims {devices.shape} but "
                f"axis_names={axis_names} names {len(axis_names)}; give one name per mesh dim."
            )
        if devices.size == 0:
            raise ValueError(f"VirtualMesh: mesh of shape {devices.shape} has no devices.")
        if len(set(axis_names)) != len(axis_names):
            raise ValueError(f"VirtualMesh: axis_names={axis_names} repeats a name.")
        ids = [d.id for d in devices.flat]
        if len(set(ids)) != len(ids):
            raise ValueError(f"VirtualMesh: device ids {ids} repeat an id.")
        self.devices = devices
        self.axis_names = axis_names

    @classmethod
    def from_ids(
        cls,
        mesh_shape: Sequence[int],
        axis_names: Sequence[str],
        device_ids: Sequence[int],
        host_of: Mapping[int, int] | None = None,
    ) -> VirtualMesh:
        """Lay `device_ids` out row-major over `mesh_shape`; `host_of` maps id -> host."""
        if math.prod(mesh_shape) != len(device_ids):
            raise ValueError(
                f"VirtualMesh.from_ids: mesh shape {tuple(mesh_shape)} needs "
                f"{math.prod(mesh_shape)} devices, got {len(device_ids)}."
            )
        host_of = host_of or {}
        flat = np.empty(len(device_ids), dtype=object)
        for i, d in enumerate(device_ids):
            flat[i] = VirtualDevice(int(d), host_of.get(int(d), 0))
        return cls(flat.reshape(tuple(mesh_shape)), axis_names)

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.devices.shape))

    @property
    def size(self) -> int:
        return int(self.devices.size)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, VirtualMesh)
            and self.axis_names == other.axis_names
            and self.devices.shape == other.devices.shape
            and all(a == b for a, b in zip(self.devices.flat, other.devices.flat))
        )

    def __hash__(self) -> int:
        return hash((self.axis_names, self.devices.shape, tuple(self.devices.flat)))

    def __repr__(self) -> str:
        axes = ", ".join(f"{a!r}: {n}" for a, n in self.shape.items())
        ids = [d.id for d in self.devices.flat]
        return f"VirtualMesh({axes}; devices {ids})"


class VirtualSharding:
    """`NamedSharding` over a `VirtualMesh`: the same indices JAX would compute."""

    def __init__(self, mesh: VirtualMesh, spec: PartitionSpec):
        if not isinstance(spec, PartitionSpec):
            spec = PartitionSpec(*spec)
        self.mesh = mesh
        self.spec = spec

    def devices_indices_map(self, shape: Sequence[int]) -> dict[VirtualDevice, tuple[slice, ...]]:
        shape = tuple(int(n) for n in shape)
        check_spec_fits(shape, self.mesh.shape, self.spec, f"VirtualSharding({self.spec})")
        indices = named_sharding_indices(
            self.mesh.devices.shape, self.mesh.axis_names, self.spec, shape
        )
        return dict(zip(self.mesh.devices.flat, indices))

    @property
    def device_set(self) -> set[VirtualDevice]:
        return set(self.mesh.devices.flat)

    @property
    def num_devices(self) -> int:
        return self.mesh.size

    def shard_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        check_spec_fits(tuple(shape), self.mesh.shape, self.spec, f"VirtualSharding({self.spec})")
        out = list(shape)
        for dim, entry in enumerate(self.spec):
            out[dim] //= math.prod(self.mesh.shape[a] for a in spec_axes(entry))
        return tuple(out)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, VirtualSharding)
            and self.mesh == other.mesh
            and normalized_spec(self.spec, self.mesh.shape)
            == normalized_spec(other.spec, other.mesh.shape)
        )

    def __hash__(self) -> int:
        return hash((self.mesh, normalized_spec(self.spec, self.mesh.shape)))

    def __repr__(self) -> str:
        return f"VirtualSharding({self.mesh!r}, {self.spec})"


def describe_sharding(sharding: Any) -> str:
    """Short text for a sharding: `P('x', None) @ {x:2, y:4}`."""
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is not None and spec is not None:
        axes = ", ".join(f"{a}:{n}" for a, n in dict(mesh.shape).items())
        return f"{spec} @ {{{axes}}}"
    return repr(sharding)
