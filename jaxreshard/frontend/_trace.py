"""Tracing a train step for `parallelize` (the same way in the driver and in host actors).

[Note: static leaves]
As with `equinox.filter_jit`, the leaves of the step's arguments that are not arrays (functions,
Python numbers and strings, a Flax graphdef's contents, an Equinox module's activation function)
are static: they are part of the compiled step's signature (a new value compiles the step
again) and the traced function sees them as they are. Outputs that are not arrays are returned
as the trace made them. Arrays are numpy and JAX arrays (and JAX's scalar types).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxreshard.frontend._jaxprs import PipelineSplitError
from jaxreshard.frontend._markers import (
    candidate_count,
    candidate_cuts,
    restart_candidates,
    tracing_pipeline,
)
from jaxreshard.frontend._split import StepGraph, split_step


def is_array(x: Any) -> bool:
    """Whether a leaf is traced (an array) rather than static (see [Note: static leaves])."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) or (
        hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, type)
    )


@dataclasses.dataclass(frozen=True)
class StepOutputs:
    """The step's output pytree: its structure and its static leaves by position."""

    tree: Any
    static: dict[int, Any]

    def assemble(self, arrays: Sequence[Any]) -> Any:
        """The output pytree from the step's array outputs (in order)."""
        it = iter(arrays)
        leaves = [
            self.static[i] if i in self.static else next(it) for i in range(self.tree.num_leaves)
        ]
        return jax.tree.unflatten(self.tree, leaves)

    def names(self) -> list[str]:
        """Paths of the array outputs, for messages (`[2]['acc']`)."""
        dummy = jax.tree.unflatten(self.tree, list(range(self.tree.num_leaves)))
        paths = jax.tree_util.tree_flatten_with_path(dummy)[0]
        return [f"output {jax.tree_util.keystr(p)}" for p, i in paths if i not in self.static]


def trace_step(
    fun: Callable[..., Any],
    in_tree: Any,
    avals: Sequence[Any],
    batch_leaves: Sequence[int],
    num_micro_batches: int,
    mesh: Any,
    expected_stages: int | None,
    input_specs: Sequence[Any] | None = None,
    *,
    static: dict[int, Any] | None = None,
    loss_reduction: str = "mean",
    donated: Sequence[int] = (),
    cuts: Any = None,
    candidates: list[Any] | None = None,
) -> tuple[StepGraph, StepOutputs]:
    """Trace `fun` at the whole batch and per micro-batch, and cut it (see [Note: two traces]).

    `avals` describe the array leaves of the arguments (flattened by `in_tree`), `static` gives
    the other leaves by their position among all leaves (see [Note: static leaves]), and
    `batch_leaves` and `donated` (leaves whose buffers the step may reuse) index `avals`. The
    per-micro-batch trace has the batch leaves' dim 0 divided
    by `num_micro_batches`. Tracing happens under `mesh` (an abstract mesh with the stages' axis
    names, sizes and types; see [Note: mesh axis types]), so sharding constraints in the step
    work; each stage later compiles them on its own mesh. With `Explicit` axes the shardings
    are part of the traced types: `input_specs` gives each array leaf's `PartitionSpec` (which
    must be the one it gets when its stage compiles), and `mesh` must be the stage meshes' own
    abstract mesh (`mesh.abstract_mesh`), since JAX records it in every equation. A fresh wrapper
    function is traced every time, so that JAX's tracing cache never hands back a trace made
    outside `parallelize`. `cuts` chooses which `stage_candidate` markers are boundaries (see
    [Note: candidate cuts]); `candidates`, if given, receives `[count, order]`: how many
    candidates the loss reached, and the boundaries of the whole-batch trace in order ("forced" or a
    candidate's number).

    Returns:
        The cut step and its outputs' structure.
    """
    m = num_micro_batches
    static = dict(static or {})
    batch = set(batch_leaves)
    num_leaves = len(avals) + len(static)
    dynamic = [i for i in range(num_leaves) if i not in static]
    made: list[StepOutputs] = []

    def flat(*arrays: Any) -> list[Any]:
        restart_candidates()
        leaves: list[Any] = [None] * num_leaves
        for i, value in static.items():
            leaves[i] = value
        for i, value in zip(dynamic, arrays):
            leaves[i] = value
        out_leaves, out_tree = jax.tree.flatten(fun(*jax.tree.unflatten(in_tree, leaves)))
        kept = {i: x for i, x in enumerate(out_leaves) if not is_array(x)}
        made.append(StepOutputs(out_tree, kept))
        return [x for x in out_leaves if is_array(x)]

    def structs(micro: bool) -> list[jax.ShapeDtypeStruct]:
        out = []
        for i, a in enumerate(avals):
            shape = (a.shape[0] // m, *a.shape[1:]) if micro and i in batch else tuple(a.shape)
            sharding = None if input_specs is None else NamedSharding(mesh, input_specs[i])
            out.append(jax.ShapeDtypeStruct(shape, a.dtype, sharding=sharding))
        return out

    with tracing_pipeline(), jax.sharding.use_abstract_mesh(mesh), candidate_cuts(cuts):
        full = jax.make_jaxpr(flat)(*structs(False))
        outputs = made[-1]
        found = candidate_count()
        if cuts is not None and cuts != "all" and any(c >= found for c in cuts):
            raise ValueError(
                f"PipelineConfig(cuts={tuple(sorted(cuts))}): the step has {found} "
                f"jr.stage_candidate markers (numbered 0 to {found - 1}); choose among them. "
                + CACHED_CANDIDATES
            )
        order = _marker_order(full)
        if cuts is not None:
            _check_candidates_traced(order, cuts, found)
        if candidates is not None:
            candidates[:] = [found, order]
        micro = jax.make_jaxpr(flat)(*structs(True)) if m > 1 else full
        if m > 1 and cuts is not None and candidate_count() != found:
            raise PipelineSplitError(
                f"the step reached {found} jr.stage_candidate markers traced at the whole batch "
                f"and {candidate_count()} at a micro-batch: how many candidates there are must "
                "not depend on the batch size (a jr.scan over the batch's rows, or a Python loop "
                "over them, does); scan a stack of layers with jr.scan, and rows with lax.scan. "
                + CACHED_CANDIDATES
            )
        graph = split_step(
            full,
            micro,
            sorted(batch),
            m,
            expected_stages=expected_stages,
            loss_reduction=loss_reduction,
            output_names=outputs.names(),
        )
    return dataclasses.replace(graph, donated=tuple(sorted(set(donated)))), outputs


# Why a candidate inside a jitted function goes unseen, and the fix (see
# `_check_candidates_traced`).
CACHED_CANDIDATES = (
    "If a jr.stage_candidate is inside a jax.jit-compiled function: jit runs it from its cached "
    "trace without counting it, so call jr.stage_candidate outside it, e.g. "
    "h = jr.stage_candidate(layer(p, h))"
)


def _marker_order(jaxpr: Any) -> list[Any]:
    """The step's boundaries in program order (nested calls included): "forced" for a
    `stage_boundary`, else the number of the `stage_candidate` that made it."""
    from jaxreshard.frontend._marked import _markers

    marks = [e.params["candidate"] for e in _markers(jaxpr.jaxpr) if not e.params["transposed"]]
    return ["forced" if n < 0 else n for n in marks]


def _check_candidates_traced(order: Sequence[Any], cuts: Any, found: int) -> None:
    """The traced step's candidate boundaries must be the chosen ones, each once and in order.
    jax.jit reuses its cached trace of a function without running its Python, so a candidate
    inside a jitted function is counted only when jit traces it, and its boundary stands
    wherever the cached trace has one (a step asked for cuts=(1,) got 4 stages)."""
    chosen = list(range(found)) if cuts == "all" else sorted(cuts)
    traced = [n for n in order if n != "forced"]
    if traced != chosen:
        raise PipelineSplitError(
            f"the step's traced boundaries are the jr.stage_candidate markers {traced}, but "
            f"the choice was {chosen} of the {found} the step's code reached while traced: "
            f"some come from a cached trace of a jitted function. {CACHED_CANDIDATES}"
        )


def fingerprint(graph: StepGraph) -> tuple[Any, ...]:
    """What two traces of the same step must agree on (checked between driver and hosts)."""
    return (
        graph.num_stages,
        graph.params,
        graph.batch,
        graph.forward_only,
        graph.donated,
        tuple((f.dim, f.var.aval.str_short()) for f in graph.feeds),
        tuple((r.combine, r.aval.str_short()) for r in graph.results),
        tuple((a.id, a.home, a.consumers, a.aval.str_short()) for a in graph.loss.activations),
        tuple((tuple(map(str, s.inputs)), tuple(map(str, s.outputs))) for s in graph.loss.stages),
        tuple((seg.stage, len(seg.inputs), len(seg.outputs)) for seg in graph.segments),
    )
