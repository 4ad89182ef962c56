"""Tracing a train step for `parallelize` (the same way in the driver and in host actors)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxreshard._jax_compat import abstract_mesh
from jaxreshard.frontend._markers import tracing_pipeline
from jaxreshard.frontend._split import StepGraph, split_step


def trace_step(
    fun: Callable[..., Any],
    in_tree: Any,
    avals: Sequence[Any],
    batch_leaves: Sequence[int],
    num_micro_batches: int,
    mesh_shape: Sequence[int],
    axis_names: Sequence[str],
    expected_stages: int | None,
    mesh_axis_types: Sequence[str] | None = None,
) -> tuple[StepGraph, Any]:
    """Trace `fun` per micro-batch and cut it (see [Note: stage cutting]).

    The batch leaves are traced with dim 0 divided by `num_micro_batches`, so the loss, and with
    it every stage, sees one micro-batch. Tracing happens under an abstract mesh with the stages'
    axes and axis types (`auto` unless `mesh_axis_types` says; see [Note: mesh axis types]), so
    PartitionSpec-based sharding constraints in the step work; each stage later compiles them on
    its own mesh. A fresh wrapper function is traced every time, so that JAX's tracing
    cache never hands back a trace made outside `parallelize`.

    Returns:
        The cut step and the output pytree structure.
    """
    m = num_micro_batches
    batch = set(batch_leaves)
    structs = [
        jax.ShapeDtypeStruct((a.shape[0] // m, *a.shape[1:]) if i in batch else a.shape, a.dtype)
        for i, a in enumerate(avals)
    ]
    wrapped = lambda *flat: fun(*jax.tree.unflatten(in_tree, flat))
    mesh = abstract_mesh(mesh_shape, axis_names, mesh_axis_types or "auto")
    with tracing_pipeline(), jax.sharding.use_abstract_mesh(mesh):
        closed, out_shape = jax.make_jaxpr(wrapped, return_shape=True)(*structs)
    graph = split_step(closed, list(batch_leaves), expected_stages=expected_stages)
    return graph, jax.tree.structure(out_shape)


def fingerprint(graph: StepGraph) -> tuple[Any, ...]:
    """What two traces of the same step must agree on (checked between driver and hosts)."""
    return (
        graph.num_stages,
        graph.params,
        graph.batch,
        tuple((a.id, a.home, a.consumers, a.aval.str_short()) for a in graph.loss.activations),
        tuple((tuple(map(str, s.inputs)), tuple(map(str, s.outputs))) for s in graph.loss.stages),
        tuple((seg.stage, len(seg.inputs), len(seg.outputs)) for seg in graph.segments),
    )
