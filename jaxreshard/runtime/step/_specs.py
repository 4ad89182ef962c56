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
from jaxreshard.frontend._graph import BATCH
from jaxreshard.runtime._config import PipelineConfig


class ReplicatedSpecWarning(UserWarning):
    """A tensor asked to be sharded is replicated instead: its spec does not fit the mesh it is
    placed on (an axis the mesh lacks, or a dim the axes do not divide). It then takes the
    whole mesh's memory and bandwidth where a shard was asked for; the message names the
    tensor, the spec, the mesh and the fix."""


def transplant_spec(
    spec: Any, mesh_shape: dict[str, int], shape: Sequence[int], what: str | None = None
) -> P:
    """`spec` when it fits a mesh of `mesh_shape` and an array of `shape`, else replicated.

    Replicating a sharded spec warns (`ReplicatedSpecWarning`, naming `what`, the tensor, or
    its shape); a spec that shards nothing (None, `P()`, `P(None, ...)`) replicates silently.
    """
    reason = _misfit(spec, mesh_shape, shape)
    if reason is None:
        return P(*spec) if spec is not None else P()
    if spec is not None and any(entry is not None for entry in spec):
        tensor = what if what is not None else f"an array of shape {tuple(shape)}"
        warnings.warn(
            f"{tensor}: {P(*spec)} does not fit mesh {mesh_shape} ({reason}); it is replicated "
            f"on that mesh instead. To shard it, give the stages mesh shapes whose axes "
            f"({', '.join(map(repr, mesh_shape)) or 'none'}) divide its dims "
            "(PipelineConfig.stage_mesh_shape, mesh_axis_names), or another spec; P() "
            "replicates it without this warning.",
            ReplicatedSpecWarning,
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


def micro_batch_rows(graph: Any) -> int | None:
    """The rows of one micro-batch (its batch inputs' size along their batch dims), or None
    when they disagree or the loss reads no batch."""
    rows = {
        aval.shape[graph.feeds[ref.index].dim]
        for stage in graph.loss.stages
        for ref, aval in zip(stage.inputs, stage.jaxpr.in_avals)
        if ref.kind == BATCH and len(aval.shape) > graph.feeds[ref.index].dim
    }
    return rows.pop() if len(rows) == 1 else None


def split_rows(
    spec: P,
    mesh_shape: dict[str, int],
    shape: Sequence[int],
    batch_axis: str | None,
    rows: int | None,
) -> P:
    """A boundary tensor's spec on the stage that receives it: `spec` (its producer's,
    transplanted), with dim 0 split over `batch_axis` too when the receiving mesh has that axis
    (size > 1) and `spec` neither splits dim 0 nor uses the axis, and dim 0 has the micro-batch's
    `rows`, a multiple of the axis. A producer whose mesh has no batch axis (a tensor-parallel
    stage) hands over tensors whole along the rows; kept so, the receiving stage would compute
    its whole micro-batch on every device of its batch axis and could not sum its gradients
    once (see [Note: gradients reduced once]). A spec is a layout, not a value: a dim 0 that is
    not the rows after all costs a reshard inside the stage, never a different result."""
    size = mesh_shape.get(batch_axis or "", 1)
    if size <= 1 or rows is None or not shape or shape[0] != rows or rows % size:
        return spec
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if entries[0] is not None or any(batch_axis in spec_axes(e) for e in entries):
        return spec
    return P(batch_axis, *entries[1:])


def batch_spec(
    mesh_shape: dict[str, int],
    shape: Sequence[int],
    batch_axis: str | None,
    dim: int = 0,
    what: str | None = None,
) -> P:
    """A micro-batch's spec on a stage mesh: its batch dim `dim` sharded over `batch_axis`.

    Without a `batch_axis`, or for an array without that dim, it is replicated. When the mesh
    lacks the axis or the axis does not divide the dim, it is replicated too, with a
    `ReplicatedSpecWarning` naming the micro-batch (`what`, or its shape), the axis, the mesh
    and the fix: every device of the axis then computes the whole micro-batch.
    """
    if not batch_axis or len(shape) <= dim:
        return P()
    size = mesh_shape.get(batch_axis)
    if size is not None and shape[dim] % size == 0:
        return P(*([None] * dim), batch_axis)
    tensor = what if what is not None else f"a micro-batch of shape {tuple(shape)}"
    if size is None:
        reason = f"mesh {mesh_shape} has no axis {batch_axis!r}"
        fix = f"name a mesh axis {batch_axis!r} or pass PipelineConfig(batch_axis=None)"
    else:
        reason = (
            f"its batch dim {dim} (size {shape[dim]}) is not a multiple of mesh axis "
            f"{batch_axis!r} (size {size}) of mesh {mesh_shape}"
        )
        fix = (
            f"make the micro-batch (batch size / num_micro_batches) a multiple of {size}, or "
            "pass PipelineConfig(batch_axis=None) to replicate it without this warning"
        )
    warnings.warn(
        f"{tensor}: {reason}; it is replicated instead of sharded over {batch_axis!r}, so "
        f"every device of that axis computes all of it. To shard it, {fix}.",
        ReplicatedSpecWarning,
        stacklevel=2,
    )
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


def place(x: Any, sharding: Any) -> Any:
    """`x` (host data or a jax.Array) on `sharding`. A sharding over devices of several
    processes (a stage that spans hosts, see [Note: multi-host stages] in `ray/_pipeline.py`)
    takes host data as every process's own shards of it (each process holds the same value);
    an array of this process alone goes there through host memory."""
    import jax

    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array):
        if not x.is_fully_addressable:  # already global: a collective reshard among them
            return jax.device_put(x, sharding)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            impl = jax.random.key_impl(x)
            data = place(np.asarray(jax.random.key_data(x)), sharding)
            return jax.random.wrap_key_data(data, impl=impl)
        x = np.asarray(x)
    data = np.asarray(x)
    return jax.make_array_from_callback(data.shape, sharding, lambda index: data[index])
