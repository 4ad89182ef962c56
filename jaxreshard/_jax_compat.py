"""The one place that reaches into JAX internals.

Everything version-sensitive sits here so that a JAX upgrade touches one file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

Slices = tuple[slice, ...]

# [Note: mesh axis types]
# JAX meshes have per-axis types: `Auto` (the compiler propagates shardings; the long-standing
# behaviour) and `Explicit` (shardings are part of array types, "sharding in types"). Defaults
# differ between constructors and releases: `Mesh(devices, names)` makes `Auto` axes,
# `jax.make_mesh` `Explicit` ones, and `AbstractMesh(shape, names)` made `Auto` axes up to jax
# 0.10 and makes `Explicit` ones since 0.11. A step must be traced under an abstract mesh with
# the same axis types as the concrete meshes its stages compile on, or JAX refuses the mismatch.
# So this library never relies on a default: every mesh it makes names its axis types.
AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


def axis_types(names: str | Sequence[str], num_axes: int) -> tuple[Any, ...]:
    """`AxisType`s from config names: one name for every axis, or one per axis."""
    names = (names,) * num_axes if isinstance(names, str) else tuple(names)
    return tuple(AXIS_TYPES[n] for n in names)


def axis_type_names(mesh: Any) -> tuple[str, ...]:
    """A mesh's axis types as config names (`auto` / `explicit`); `Manual` is refused."""
    types = getattr(mesh, "axis_types", None) or (AxisType.Auto,) * len(mesh.axis_names)
    by_type = {t: n for n, t in AXIS_TYPES.items()}
    out = []
    for name, t in zip(mesh.axis_names, types):
        if t not in by_type:
            raise ValueError(
                f"mesh axis {name!r} has axis type {t}; stage meshes take Auto or Explicit axes "
                "(Manual axes belong inside shard_map)"
            )
        out.append(by_type[t])
    return tuple(out)


def make_mesh(devices: Any, names: Sequence[str], types: str | Sequence[str] = "auto") -> Mesh:
    """`Mesh(devices, names)` with the axis types named by `types` (see `axis_types`)."""
    return Mesh(devices, tuple(names), axis_types=axis_types(types, len(names)))


def abstract_mesh(
    shape: Sequence[int], names: Sequence[str], types: str | Sequence[str] = "auto"
) -> Any:
    """`AbstractMesh(shape, names)` with the axis types named by `types`."""
    return AbstractMesh(tuple(shape), tuple(names), axis_types=axis_types(types, len(names)))


def named_sharding_indices(
    mesh_shape: Sequence[int],
    axis_names: Sequence[str],
    spec: PartitionSpec,
    shape: Sequence[int],
) -> tuple[Slices, ...]:
    """Return each mesh position's index into an array of `shape`, in row-major mesh order.

    This is exactly what `NamedSharding(mesh, spec).devices_indices_map(shape)` returns for a
    concrete mesh of that shape, computed without devices: JAX builds the HLO sharding from an
    abstract mesh and converts it to per-device indices. Shardings over devices that are not in
    this process (remote hosts, benchmark clusters) use it so that JAX stays the source of truth.
    """
    mesh = abstract_mesh(mesh_shape, axis_names)
    hlo = NamedSharding(mesh, spec)._to_xla_hlo_sharding(len(shape))
    from jax._src import op_shardings

    num_devices = int(np.prod(mesh_shape, dtype=np.int64))
    return tuple(op_shardings.op_sharding_to_indices(hlo, tuple(shape), num_devices))


def new_jaxpr(
    constvars: Sequence[Any],
    invars: Sequence[Any],
    outvars: Sequence[Any],
    eqns: Sequence[Any],
    name: str = "jaxreshard",
) -> Any:
    """A `jax.extend.core.Jaxpr` with its effects and a DebugInfo (JAX warns without one)."""
    from jax.extend import core as jc

    effects = frozenset().union(*(e.effects for e in eqns)) if eqns else frozenset()
    info = jc.DebugInfo("jaxreshard", name, tuple("" for _ in invars), tuple("" for _ in outvars))
    return jc.Jaxpr(list(constvars), list(invars), list(outvars), list(eqns), effects, info)


def source_location(eqn: Any) -> str:
    """`file:line (function)` of the user code an equation came from, or `?`."""
    try:
        from jax._src import source_info_util

        return source_info_util.summarize(eqn.source_info)
    except Exception:  # older or newer JAX: the location is a nicety
        return "?"
