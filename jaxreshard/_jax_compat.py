"""The one place that reaches into JAX internals.

Everything version-sensitive sits here so that a JAX upgrade touches one file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

Slices = tuple[slice, ...]


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
    mesh = AbstractMesh(tuple(mesh_shape), tuple(axis_names))
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
