"""PartitionSpecs of stage inputs and outputs, and the stage meshes."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxreshard._jax_compat import make_mesh
from jaxreshard.comm._layout import spec_axes
from jaxreshard.runtime._config import PipelineConfig


def transplant_spec(
    spec: Any, mesh_shape: dict[str, int], shape: Sequence[int], what: str | None = None
) -> P:
    """`spec` when it fits a mesh of `mesh_shape` and an array of `shape`, else replicated.

    With `what` (the tensor, for the message), replicating a sharded spec is a warning: the
    tensor then takes the whole mesh's memory and bandwidth where the user asked for a shard.
    """
    reason = _misfit(spec, mesh_shape, shape)
    if reason is None:
        return P(*spec) if spec is not None else P()
    if what is not None and any(entry is not None for entry in spec):
        warnings.warn(
            f"{what}: {P(*spec)} does not fit mesh {mesh_shape} ({reason}); it is replicated "
            "on that mesh instead. Give the stages mesh shapes that fit, or another spec.",
            stacklevel=2,
        )
    return P()


def _misfit(spec: Any, mesh_shape: dict[str, int], shape: Sequence[int]) -> str | None:
    if spec is None:
        return "no spec"
    if len(spec) > len(shape):
        return f"it names {len(spec)} dims of a rank-{len(shape)} array"
    for dim, entry in enumerate(spec):
        axes = spec_axes(entry)
        missing = [a for a in axes if a not in mesh_shape]
        if missing:
            return f"the mesh has no axis {missing[0]!r}"
        size = int(np.prod([mesh_shape[a] for a in axes], dtype=np.int64))
        if shape[dim] % size:
            return f"dim {dim} (size {shape[dim]}) is not a multiple of {size}"
    return None


def batch_spec(
    mesh_shape: dict[str, int], shape: Sequence[int], batch_axis: str | None, dim: int = 0
) -> P:
    """A micro-batch's spec on a stage mesh: its batch dim `dim` sharded over `batch_axis` when
    the mesh has that axis and it divides the micro-batch, else replicated."""
    if (
        batch_axis
        and batch_axis in mesh_shape
        and len(shape) > dim
        and shape[dim] % mesh_shape[batch_axis] == 0
    ):
        return P(*([None] * dim), batch_axis)
    return P()


def spec_of(sharding: Any) -> P:
    spec = getattr(sharding, "spec", None)
    return P(*spec) if spec is not None else P()


def stage_meshes(config: PipelineConfig, num_meshes: int, devices: Sequence[Any]) -> list[Mesh]:
    """Consecutive groups of `devices`, one mesh per rank (per stage, without virtual
    stages)."""
    shapes = config.mesh_shapes(num_meshes)
    num_stages = num_meshes * config.chunks_per_mesh
    need = sum(int(np.prod(s)) for s in shapes)
    if need > len(devices):
        platform = devices[0].platform if len(devices) else "no"
        hint = (
            "; or try the pipeline on fake CPU devices: JAX_PLATFORMS=cpu with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N (jaxreshard profile sets the "
            "count itself)"
            if platform != "cpu"
            else " (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)"
        )
        raise ValueError(
            f"the step has {num_stages} stages on meshes {list(shapes)}: {need} devices, but "
            f"this process has {len(devices)} {platform} device(s); use fewer stages or a "
            f"smaller stage_mesh_shape, or more devices{hint}"
        )
    meshes, at = [], 0
    for shape in shapes:
        n = int(np.prod(shape))
        grid = np.array(devices[at : at + n]).reshape(shape)
        meshes.append(make_mesh(grid, config.mesh_axis_names, config.axis_types))
        at += n
    return meshes


def check_meshes(meshes: Sequence[Any], num_meshes: int) -> None:
    if len(meshes) != num_meshes:
        raise ValueError(
            f"parallelize(meshes=...) gives {len(meshes)} meshes for a step that runs on "
            f"{num_meshes} (one per stage, or per rank with virtual stages)"
        )
    seen: dict[Any, int] = {}
    for s, mesh in enumerate(meshes):
        for d in mesh.devices.flat:
            if d in seen:
                raise ValueError(
                    f"stage meshes {seen[d]} and {s} share device {d}; every stage needs its "
                    "own devices (cross-mesh pipelines move data between disjoint meshes)"
                )
            seen[d] = s
