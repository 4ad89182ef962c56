"""Tracing a train step for `parallelize` (the same way in the driver and in host actors)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

from jaxreshard.frontend._markers import tracing_pipeline
from jaxreshard.frontend._split import StepGraph, split_step


def trace_step(
    fun: Callable[..., Any],
    in_tree: Any,
    avals: Sequence[Any],
    batch_leaves: Sequence[int],
    num_micro_batches: int,
    mesh: Any,
    expected_stages: int | None,
    input_specs: Sequence[Any] | None = None,
) -> tuple[StepGraph, Any]:
    """Trace `fun` per micro-batch and cut it (see [Note: stage cutting]).

    The batch leaves are traced with dim 0 divided by `num_micro_batches`, so the loss, and with
    it every stage, sees one micro-batch. Tracing happens under `mesh` (an abstract mesh with the
    stages' axis names, sizes and types; see [Note: mesh axis types]), so sharding constraints in
    the step work; each stage later compiles them on its own mesh. With `Explicit` axes the
    shardings are part of the traced types: `input_specs` gives each leaf's `PartitionSpec`
    (which must be the one it gets when its stage compiles), and `mesh` must be the stage
    meshes' own abstract mesh (`mesh.abstract_mesh`), since JAX records it in every equation.
    A fresh wrapper function is traced every time, so that JAX's tracing cache never hands back
    a trace made outside `parallelize`.

    Returns:
        The cut step and the output pytree structure.
    """
    m = num_micro_batches
    batch = set(batch_leaves)
    shapes = [
        (a.shape[0] // m, *a.shape[1:]) if i in batch else tuple(a.shape)
        for i, a in enumerate(avals)
    ]
    if input_specs is None:
        structs = [jax.ShapeDtypeStruct(s, a.dtype) for s, a in zip(shapes, avals)]
    else:
        structs = [
            jax.ShapeDtypeStruct(s, a.dtype, sharding=NamedSharding(mesh, spec))
            for s, a, spec in zip(shapes, avals, input_specs)
        ]
    wrapped = lambda *flat: fun(*jax.tree.unflatten(in_tree, flat))
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
