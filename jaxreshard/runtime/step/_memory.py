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
  input of its shape and dtype on the same stage, else it counts whole. A choice of cuts that
  puts a parameter's readers in several chunks adds, for each other chunk, its gradient
  accumulator and, on another mesh than the owner's, its copy (`borrowed_bytes`, since
  2026-11-30: a stack cut inside its `jr.scan` is read whole on both sides);
- **residuals**: what the segment's forward keeps for its backward (the VJP's residuals, traced
  with `jax.vjp`, less the parameters it keeps as they are, see [Note: residuals kept by
  reference] in `_compile.py`; on a mesh that splits the batch with `reduce_gradients="once"`,
  the parameters too, as the forward keeps their `reduced` casts), per micro-batch, divided by
  the stage mesh's batch axis where a residual's leading dim is the micro-batch's rows;
- **pending** (a split backward): what its B hands its W (B's exports), per micro-batch, the
  cotangents of a stage's outputs, which its W reads too, and the gradients of its inputs,
  which the runtime releases with the micro-batch's whole backward;
- **scratch**: XLA's temporary bytes of the segment's forward and backward executables
  (`memory_analysis()` of the ones the partitioner compiles to time them), the larger of the
  two, divided by the batch axis.
A mesh then needs its chunks' state, plus the most bytes their micro-batches keep at once as
the configured schedule runs them (`live_peak`: a micro-batch's residuals from its F to its
last backward part, its pending bytes from its B to its W), plus its largest scratch. Not
counted: received activations before their forward, the micro-batches of the batch, the
runtime's transfer buffers, compiled code; and XLA's scratch is its own estimate. So it is an
estimate, not a bound: measured within 13% of the live arrays either way
(`benchmarks/stage_memory.py`), so a cap a little below the device's memory leaves room.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxreshard.comm._layout import spec_axes
from jaxreshard.frontend._backward import derive_backward, residual_inputs
from jaxreshard.frontend._graph import BATCH, PARAM
from jaxreshard.frontend._split import StepGraph
from jaxreshard.pipeline._action import BACKWARD, FORWARD, WEIGHT
from jaxreshard.pipeline._schedule import Schedule
from jaxreshard.runtime.step._specs import transplant_spec

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class SegmentMemory:
    """Bytes per device of one segment on one stage mesh (see [Note: stage memory estimate])."""

    state: int  # parameters, gradients, optimizer state, the step's outputs
    residuals: int  # per micro-batch, kept from its forward to its last backward part
    pending: int  # per micro-batch, B's exports for W, from B to W (a split backward)
    scratch: int  # XLA temporaries of its largest executable


def live_peak(schedule: Schedule, held: Sequence[int], pending: Sequence[int]) -> tuple[int, ...]:
    """Per rank of `schedule`, the most bytes its micro-batches keep at once: chunk c's
    `held[c]` from a micro-batch's F to its last backward part, and (a split backward)
    `pending[c]` from its B to its W."""
    peaks = []
    for actions in schedule.actions:
        live = peak = 0
        for a in actions:
            c = a.stage_index
            if a.kind == FORWARD:
                live += held[c]
            elif a.kind == BACKWARD:
                live += pending[c] if schedule.split_backward else -held[c]
            elif a.kind == WEIGHT:
                live -= held[c] + pending[c]
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)


def rows_dim(shape: Sequence[int], rows: int) -> int | None:
    """The dim of a per-micro-batch value that holds the micro-batch's `rows`, as a stage
    splits it over its batch axis: the first of that size (a scan's stacked outputs, (layers,
    rows), hold them in dim 1), or None."""
    return next((d for d, n in enumerate(shape) if n == rows), None) if rows else None


def per_micro_batch(avals: Sequence[Any], rows: int, split: int) -> int:
    """Bytes per device of per-micro-batch values: those with a dim of the micro-batch's
    `rows` (`rows_dim`) are split over the batch axis (`split` ways), the others whole."""
    return sum(
        nbytes(a) // split if rows_dim(a.shape, rows) is not None and rows % split == 0
        else nbytes(a)
        for a in avals
    )  # fmt: skip


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


def borrowed_bytes(
    aval: Any, spec: Any, mesh_shape: dict[str, int], differentiable: bool, same_mesh: bool
) -> int:
    """Bytes per device a chunk holds of a parameter another chunk owns, on a mesh of
    `mesh_shape`: its copy for the step (none on the owner's mesh, which shares the owner's
    array) and, where it is differentiated, its gradient accumulator (every chunk that reads a
    parameter accumulates its own contribution)."""
    held = per_device(aval, spec, mesh_shape)
    return held * (int(not same_mesh) + int(differentiable))


def residual_avals(
    graph: StepGraph, s: int, copies_weights: bool = False, found: Sequence[Any] | None = None
) -> list[Any]:
    """What segment `s`'s forward keeps for its backward, less the parameters it keeps as they
    are (see [Note: residuals kept by reference]; a parameter counts once, as state). With
    `copies_weights` (a stage that reduces its gradients once a step: it casts its parameters
    to `reduced` before the VJP, so the residuals are the casts, written out per micro-batch),
    the parameters count per micro-batch too. `found`: `residual_inputs` of the segment, where
    the caller has them (they cost a trace of its VJP)."""
    if graph.forward_only:
        return []
    stage = graph.loss.stages[s]
    return [
        aval
        for aval, i in (residual_inputs(stage) if found is None else found)
        if i is None or stage.inputs[i].kind != PARAM or copies_weights
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
    exports: Sequence[Any] = (),
    reduce_gradients: str = "once",
    residuals: Sequence[Any] | None = None,
) -> SegmentMemory:
    """Segment `s`'s bytes per device on a mesh of `mesh_shape`; `specs`: each outer invar's
    PartitionSpec (its argument's sharding); `scratch`: its executables' XLA temporaries on one
    device, for the whole micro-batch; `exports`: the avals B hands W, when the backward is
    split; `reduce_gradients`: the config's; `residuals`: the segment's `residual_inputs`, if
    the caller has them (see [Note: stage memory estimate])."""
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
    rows = micro_batch_rows(graph)
    # A stage whose mesh splits the batch sums its gradients once a step where JAX can type
    # it so; counted as if it did (its weights are then residuals of every micro-batch).
    copies = reduce_gradients == "once" and split > 1
    kept = per_micro_batch(residual_avals(graph, s, copies, residuals), rows, split)
    pending = per_micro_batch(exports, rows, split)
    return SegmentMemory(int(state), int(kept), int(pending), int(scratch) // split)


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


def traced_vjp(
    graph: StepGraph, s: int, split_backward: bool
) -> tuple[list[Any], list[tuple[Any, int | None]]]:
    """What the memory estimate reads off segment `s`'s VJP, from one trace of it: the avals
    its B hands its W (a split backward; none otherwise), and its `residual_inputs` (unsplit,
    the forward's trace alone gives them)."""
    if graph.forward_only:
        return [], []
    if not split_backward:
        return [], residual_inputs(graph.loss.stages[s])
    bw = derive_backward(graph.loss.stages[s], split=True)
    return list(bw.b.out_avals[len(bw.act_grads) :]), list(zip(bw.residuals, bw.forwarded))


def crossing_bytes(
    graph: StepGraph, position: int, mesh_shape: dict[str, int], batch_axis: str | None
) -> int:
    """Bytes per device, on a mesh of `mesh_shape`, of one micro-batch of what crosses boundary
    `position` (a chunk ending there keeps their cotangents from its B to its W)."""
    avals = [
        act.aval for act in graph.loss.activations if act.home <= position < max(act.consumers)
    ]
    split = mesh_shape.get(batch_axis, 1) if batch_axis else 1
    return per_micro_batch(avals, micro_batch_rows(graph), split)


def chunks_of(bounds: Sequence[int], num_segments: int) -> list[range]:
    """The segments of each chunk that boundary positions `bounds` make."""
    edges = [-1, *bounds, num_segments - 1]
    return [range(a + 1, b + 1) for a, b in itertools.pairwise(edges)]


def mesh_bytes(
    memory: Sequence[Sequence[SegmentMemory]],
    cotangents: dict[int, list[int]],
    bounds: Sequence[int],
    schedule: Any,
    mesh_of: Sequence[int],
    num_meshes: int,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each mesh's estimated bytes per device: its chunks' state, what their micro-batches keep
    alive as the schedule runs them, and its largest scratch (see [Note: stage memory
    estimate]); and of those, the scratch."""
    chunks = chunks_of(bounds, len(memory))
    held, pending = [], []
    state, scratch = [0] * num_meshes, [0] * num_meshes
    for k, r in enumerate(chunks):
        mesh = mesh_of[k]
        parts = [memory[s][mesh] for s in r]
        held.append(sum(p.residuals for p in parts))
        # Its output cotangents (W reads them) and its input gradients (sent at B, released
        # with the micro-batch's backward) are kept from B to W too.
        ends = cotangents[bounds[k]][mesh] if k < len(bounds) else 0
        starts = cotangents[bounds[k - 1]][mesh] if k > 0 else 0
        pending.append(sum(p.pending for p in parts) + ends + starts)
        state[mesh] += sum(p.state for p in parts)
        scratch[mesh] = max([scratch[mesh], *(p.scratch for p in parts)])
    live = live_peak(schedule, held, pending)
    return tuple(state[m] + live[m] + scratch[m] for m in range(num_meshes)), tuple(scratch)
