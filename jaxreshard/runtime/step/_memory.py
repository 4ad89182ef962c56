"""Per-device memory of a candidate stage, for the automatic partitioner's memory cap.

[Note: stage memory estimate]
`PipelineConfig(partition="auto", memory_cap_gib=C)` keeps only the cuts whose every stage fits
in C GiB per device. A stage's bytes per device are estimated, per segment (the loss between two
markers of the all-candidates trace) on the stage's mesh, as:
- **state**: the parameters the segment owns, their gradients (one accumulator each, the
  parameter's size), the other step inputs its post-gradient code reads (optimizer state), and
  the step outputs that code writes (new parameters and state) unless they reuse a donated
  input's buffer. Each is divided over the mesh axes its sharding names there: the input's
  own spec, as the runtime transplants it (`transplant_spec`); an output takes the spec of an
  input of its shape and dtype on the same stage, else it counts whole;
- **residuals**: what the segment's forward keeps for its backward (the VJP's residuals, traced
  with `jax.vjp`, less the parameters and per-step constants it keeps as they are, see [Note:
  residuals kept by reference] in `_compile.py`), per micro-batch, divided by the stage
  mesh's batch axis where a residual's leading dim is the micro-batch's rows;
- **scratch**: XLA's temporary bytes of the segment's forward and backward executables
  (`memory_analysis()` of the ones the partitioner compiles to time them), the larger of the
  two, divided by the batch axis.
A stage then needs its segments' state, plus its residuals times the most micro-batches the
configured schedule keeps alive on its mesh at once (`peak_activations`, per mesh, summed over
the chunks a mesh holds), plus its largest scratch. Not counted: received activations waiting
for their forward, the runtime's transfer buffers, compiled code. So it is a floor: a cut it
rejects does not fit; one it accepts may still not, by those terms.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxreshard.comm._layout import spec_axes
from jaxreshard.frontend._backward import residual_inputs
from jaxreshard.frontend._graph import BATCH, CONST, MB, PARAM
from jaxreshard.frontend._split import StepGraph
from jaxreshard.runtime.step._specs import transplant_spec

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class SegmentMemory:
    """Bytes per device of one segment on one stage mesh (see [Note: stage memory estimate])."""

    state: int  # parameters, gradients, optimizer state, the step's outputs
    residuals: int  # kept from a micro-batch's forward to its backward
    scratch: int  # XLA temporaries of its largest executable


def stage_bytes(parts: Sequence[SegmentMemory], live: int) -> int:
    """A stage of segments `parts` with `live` micro-batches alive at once (see the Note)."""
    return (
        sum(p.state for p in parts)
        + live * sum(p.residuals for p in parts)
        + max((p.scratch for p in parts), default=0)
    )


def nbytes(aval: Any) -> int:
    return int(math.prod(aval.shape)) * np.dtype(aval.dtype).itemsize


def per_device(aval: Any, spec: Any, mesh_shape: dict[str, int]) -> int:
    """`aval`'s bytes on one device of a mesh of `mesh_shape` under `spec`, as the runtime
    places it (a spec that does not fit is replicated)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fitted = transplant_spec(spec, mesh_shape, aval.shape)
    ways = math.prod(mesh_shape[a] for entry in fitted for a in spec_axes(entry))
    return nbytes(aval) // ways


def residual_avals(graph: StepGraph, s: int) -> list[Any]:
    """What segment `s`'s forward keeps for its backward, less the parameters and per-step
    constants it keeps as they are (see [Note: residuals kept by reference]; a parameter counts
    once, as state)."""
    if graph.forward_only:
        return []
    stage = graph.loss.stages[s]
    once = (PARAM, CONST, MB)  # held once a step, whatever the micro-batches
    return [
        aval for aval, i in residual_inputs(stage) if i is None or stage.inputs[i].kind not in once
    ]


def micro_batch_rows(graph: StepGraph) -> int:
    """The rows of one micro-batch, as the loss's stages see a batch feed (0: no feed)."""
    for stage in graph.loss.stages:
        for ref, aval in zip(stage.inputs, stage.jaxpr.in_avals):
            if ref.kind == BATCH:
                dim = graph.feeds[ref.index].dim
                if len(aval.shape) > dim:
                    return int(aval.shape[dim])
    return 0


def state_parts(graph: StepGraph, s: int) -> tuple[list[int], list[Any], list[Any]]:
    """Segment `s`'s state: (outer invar positions it holds: parameters it owns and inputs its
    post-gradient code reads; of those, the parameters again (their gradients); the outer
    outvars its post-gradient code writes)."""
    outer = graph.outer.jaxpr
    position = {v: i for i, v in enumerate(outer.invars)}
    batch = set(graph.batch)
    owned = [graph.params[k] for k, stage in enumerate(graph.owner) if stage == s]
    held = dict.fromkeys(owned)
    outs = set(outer.outvars)
    written = []
    for seg in graph.segments:
        if seg.stage != s:
            continue
        for v in seg.inputs:
            i = position.get(v)
            if i is not None and i not in batch:
                held[i] = None
        written += [v for v in seg.outputs if v in outs]
    grads = [outer.invars[i].aval for i in owned]
    return list(held), grads, written


def segment_memory(
    graph: StepGraph,
    s: int,
    mesh_shape: dict[str, int],
    specs: Sequence[Any],
    batch_axis: str | None,
    scratch: int,
) -> SegmentMemory:
    """Segment `s`'s bytes per device on a mesh of `mesh_shape`; `specs`: each outer invar's
    PartitionSpec (its argument's sharding); `scratch`: its executables' XLA temporaries on one
    device, for the whole micro-batch (see [Note: stage memory estimate])."""
    outer = graph.outer.jaxpr
    split = mesh_shape.get(batch_axis, 1) if batch_axis else 1
    held, grads, written = state_parts(graph, s)
    donated = set(graph.donated)
    state = sum(per_device(outer.invars[i].aval, specs[i], mesh_shape) for i in held)
    state += sum(
        per_device(a, specs[graph.params[k]], mesh_shape)
        for k, a in zip([k for k, o in enumerate(graph.owner) if o == s], grads)
    )
    reusable = [i for i in held if i in donated]
    for v in written:
        alike = [i for i in held if _same_type(outer.invars[i].aval, v.aval)]
        reuse = next((i for i in alike if i in reusable), None)
        if reuse is not None:
            reusable.remove(reuse)  # written into a donated input's buffer
            continue
        spec = specs[alike[0]] if alike else None
        state += per_device(v.aval, spec, mesh_shape)
    residuals, rows = residual_avals(graph, s), micro_batch_rows(graph)
    kept = sum(
        nbytes(r) // split if rows and r.shape and r.shape[0] == rows and rows % split == 0
        else nbytes(r)
        for r in residuals
    )  # fmt: skip
    return SegmentMemory(int(state), int(kept), int(scratch) // split)


def _same_type(a: Any, b: Any) -> bool:
    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype


def scratch_bytes(compiled: Any) -> int:
    """XLA's temporary bytes of a compiled executable (0 where the backend does not say)."""
    try:
        stats = compiled.memory_analysis()
    except Exception:
        return 0
    return int(getattr(stats, "temp_size_in_bytes", 0) or 0) if stats is not None else 0


def device_limit(device: Any) -> int | None:
    """The bytes JAX may allocate on `device`, where the backend reports it (GPUs, TPUs)."""
    try:
        stats = device.memory_stats()
    except Exception:
        return None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


def size(n: int) -> str:
    """Bytes as MiB under a GiB, else GiB."""
    return f"{n / (1 << 20):.2f} MiB" if n < GIB else f"{n / GIB:.2f} GiB"
