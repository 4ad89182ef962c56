"""Gradients reduced once per step instead of once per micro-batch.

[Note: gradients reduced once]
A stage whose mesh has a batch axis (its micro-batch is split over `data`, its parameters are
replicated over it) computes, in every backward, each device's part of a parameter's gradient
and then all-reduces it over `data`; with M micro-batches that is M all-reduces a step, each
crossing the NIC when the stage spans hosts. Summing the parts first and reducing once gives
the same gradient (up to float reassociation) for one all-reduce.

JAX expresses "the parts, not yet summed" as a sharding type: an array `unreduced` over an axis
holds on each device a term of the sum. A gradient comes out `unreduced` over `data` when the
parameter was typed `reduced` over `data` (a free cast) as it entered the differentiation, on a
mesh whose `data` axis is Explicit. So for such a stage the compiler (`StageCompiler.prepare`):
1. derives the stage's forward and backward again, on an all-Explicit copy of its mesh, with its
   inputs typed by their planned specs and its parameters cast to `reduced` over the batch axes
   (`derive_backward(..., in_shardings=, reduced=)`);
2. types the gradient accumulators `unreduced` over those axes: the zeros, every backward's
   `acc + grad`, and the split backward's W all stay unreduced, and compile with no all-reduce
   of a parameter gradient;
3. adds a `reduce` executable (`jax.reshard` to the parameter's own spec: the one all-reduce),
   which the rank's program runs right after the chunk's last backward of the step.
Every output other than the accumulators is laid out on the stage's own (Auto) mesh, so the
rest of the runtime sees the same arrays as before.

An optimizer fused into the stage's last backward reads the gradients reduced, in the same
program (the fused variants reduce before they update; no `reduce` executable runs then).

A stage keeps the per-micro-batch reduction, and the plan says why, when: the step has one
micro-batch (nothing to save); a parameter is shared with another stage (its gradient
contribution arrives as a reduced value); no mesh axis splits the stage's inputs while leaving
its parameters whole; `PipelineConfig.reduce_gradients="every_micro_batch"`; or JAX refuses the
typed trace and no rule of ours takes the op (a sort along the split rows, a sharding
constraint of the step's own mesh): the error is kept in the plan. A convolution, which JAX has
no reduced rule for, takes ours (see [Note: convolutions with reduced weights] in
`frontend/_typed_ops.py`), and so do contracted matmuls and gathers JAX refuses on an Explicit
mesh (see [Note: refusals an Explicit mesh adds] in `frontend/_typed_contract.py`), and so
does a squeeze of a dim split over a size-1 axis, whose cotangent JAX types wrong (the
typed trace drops size-1 axes from its operands' types: `without_size_one_axes` in
`frontend/_typed_ops.py`).
Measured on jax 0.10.2 (see docs/design.md): the backward derived once at trace time cannot
simply be evaluated on an Explicit mesh (its transposed matmul contracts two `data`-sharded
operands, which JAX refuses as ambiguous), hence the second derivation.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxreshard.comm._layout import spec_axes
from jaxreshard.frontend._split import ACT, BATCH, PARAM, StepGraph
from jaxreshard.runtime._config import PipelineConfig

EVERY_MICRO_BATCH = "every micro-batch"


def explicit_copy(mesh: Mesh) -> Mesh:
    """`mesh` with every axis Explicit (the same devices, in the same order)."""
    explicit = jax.sharding.AxisType.Explicit
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(explicit,) * len(mesh.axis_names))


def unreduced(spec: P, axes: Sequence[str]) -> P:
    """`spec`, its value `unreduced` over `axes` (each device holds a term of the sum)."""
    return spec.update(unreduced=frozenset(axes))


def _jax_supports() -> str | None:
    if not hasattr(jax, "reshard") or not hasattr(P(), "update"):
        return f"jax {jax.__version__} has no `jax.reshard` or unreduced shardings"
    try:
        P(None, unreduced={"x"})
    except TypeError:
        return f"jax {jax.__version__} has no unreduced shardings"
    return None


def reduction_axes(
    graph: StepGraph,
    s: int,
    mesh: Mesh,
    input_specs: Sequence[P],
    config: PipelineConfig,
    acc_params: Sequence[int],
) -> tuple[tuple[str, ...], frozenset[int], str]:
    """The mesh axes stage `s` can keep gradient accumulators unreduced over, the parameters
    (graph indices) whose accumulators it keeps so, and why where there are none (see
    [Note: gradients reduced once]). A parameter that another stage also reads keeps the
    per-micro-batch reduction: its contributions arrive as reduced values."""
    none: frozenset[int] = frozenset()
    if config.reduce_gradients == "every_micro_batch":
        return (), none, 'PipelineConfig.reduce_gradients="every_micro_batch"'
    if not acc_params:
        return (), none, "the stage has no parameter gradients"
    if config.num_micro_batches == 1:
        return (), none, "one micro-batch"
    shared = {
        r.index
        for t, other in enumerate(graph.loss.stages)
        if t != s
        for r in other.inputs
        if r.kind == PARAM
    }
    params = frozenset(acc_params) - shared
    if not params:
        return (), none, "every parameter is shared with another stage"
    stage = graph.loss.stages[s]
    split: set[str] = set()
    whole: set[str] = set()
    for ref, spec in zip(stage.inputs, input_specs):
        axes_of = {a for entry in spec for a in spec_axes(entry)}
        if ref.kind == PARAM:
            whole |= axes_of
        elif ref.kind in (BATCH, ACT):
            split |= axes_of
    axes = tuple(a for a in mesh.axis_names if a in split - whole and mesh.shape[a] > 1)
    if not axes:
        return (), none, "no mesh axis splits the stage's inputs and leaves its parameters whole"
    missing = _jax_supports()
    if missing:
        return (), none, missing
    return axes, params, ""


def describe(axes: Sequence[str], why: str, kept: int = 0) -> str:
    """How a stage reduces its parameter gradients, for the plan (`kept`: how many of its
    parameters, shared with other stages, keep the per-micro-batch reduction)."""
    if axes:
        rest = f" (the {kept} shared with other stages: every micro-batch)" if kept else ""
        return f"once per step, over {', '.join(axes)}{rest}"
    return f"{EVERY_MICRO_BATCH} ({why})"
