"""Where the code after the gradient (the optimizer) runs: its equations placed on stages and
grouped into per-stage segments.

[Note: where the optimizer runs]
A post equation whose inputs live on several stages runs on the stage that holds most of their
bytes (the latest such stage on a tie), so that only the smaller inputs move. This keeps an
optimizer's state "sharded like the parameters": the moments of a parameter are computed from its
gradient on its stage and stay there, while global reductions move only scalars. Clipping by the
global norm, for instance, sums each gradient's squares where the gradient is, adds those scalars
up on one stage (the latest), and sends the scale back: `g * scale` runs where `g` is, not where
`scale` is. Placing by the latest input alone would run that product, and everything after it
(the moments, the new parameters), on the last stage, moving every gradient there each step.
Equations that read only the step's free inputs (a step counter, a learning-rate schedule, the
batch) are copied into every stage that uses them instead.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Any

from jaxreshard.frontend._graph import Segment
from jaxreshard.frontend._jaxprs import PipelineSplitError, free_inputs, is_var, make_closed
from jaxreshard.frontend._marked import _where


def _check_post(
    jaxpr: Any,
    post_eqns: Sequence[Any],
    batch: set[int],
    params: Sequence[int],
    grad_outputs: Sequence[Any],
) -> None:
    """Refuse a forward pass over the batch after the gradient (an equation reading per-example
    data together with the model: it would run unpipelined, on one stage, with every parameter
    it needs moved there), pointing to `has_aux`."""
    data = {jaxpr.invars[i] for i in batch}
    model = {jaxpr.invars[i] for i in params} | set(grad_outputs[1:])
    for eqn in post_eqns:
        reads = [v for v in eqn.invars if is_var(v)]
        uses_model = any(v in model for v in reads)
        uses_data = any(v in data and v.aval.shape for v in reads)
        if uses_model and uses_data:
            raise PipelineSplitError(
                f"the step computes with the batch and the model at {_where(eqn)}, after "
                "jr.value_and_grad: only the loss runs pipelined over micro-batches. Compute "
                "metrics (accuracy, logits) inside the loss and return them with "
                "jr.value_and_grad(loss_fn, has_aux=True), which gives (loss, aux), grads"
            )
        if uses_model:
            model.update(eqn.outvars)
        if any(v in data for v in reads):
            data.update(eqn.outvars)


def _nbytes(aval: Any) -> int:
    shape, dtype = getattr(aval, "shape", ()), getattr(aval, "dtype", None)
    return math.prod(shape) * (dtype.itemsize if dtype is not None else 0)


def _held_bytes(eqn: Any, placement: dict[Any, int | None]) -> dict[int, int]:
    """Stage -> bytes of `eqn`'s inputs that the stage holds."""
    held: dict[int, int] = {}
    for v in dict.fromkeys(v for v in eqn.invars if is_var(v)):
        stage = placement.get(v)
        if stage is not None:
            held[stage] = held.get(stage, 0) + _nbytes(v.aval)
    return held


def _busiest(held: dict[int, int]) -> int:
    """The stage holding most bytes, the latest on a tie; see [Note: where the optimizer runs]."""
    return max(held, key=lambda s: (held[s], s))


def _segments(
    eqns: Sequence[Any], placement: dict[Any, int | None], outvars: Sequence[Any]
) -> list[Segment]:
    """Place post-gradient equations on stages and group them into per-stage segments.

    An equation reading values that live on stages runs on the one holding most of their bytes
    (see [Note: where the optimizer runs]). An equation reading only the step's free inputs (a
    step counter, a learning-rate schedule) is copied into every stage that uses its result, as
    cheap scalar work is in data-parallel optimizers, so that no stage waits for another's."""
    stages: dict[int, set[int]] = {}
    for position, eqn in enumerate(eqns):
        held = _held_bytes(eqn, placement)
        if held:
            stage = _busiest(held)
            stages[position] = {stage}
            for o in eqn.outvars:
                placement[o] = stage
    wanted: dict[Any, set[int]] = {}
    for position in reversed(range(len(eqns))):
        eqn = eqns[position]
        if position not in stages:  # free: wherever its results are used
            users = set().union(*(wanted.get(o, set()) for o in eqn.outvars))
            stages[position] = users or {0}
        for v in eqn.invars:
            if is_var(v):
                wanted.setdefault(v, set()).update(stages[position])
    free = {o for p, e in enumerate(eqns) if placement.get(e.outvars[0]) is None for o in e.outvars}
    defined_at = {o: p for p, e in enumerate(eqns) for o in e.outvars}

    def key(v: Any, stage: int) -> tuple[Any, int | None]:
        return (v, stage if v in free else None)

    # Greedy topological grouping: keep running the current stage while any of its equations is
    # ready, so that each stage gets few segments; else the first ready equation (in equation
    # order, then stage). Each equation counts the values it still waits for (linear in the
    # equations: a quadratic scan took 0.6 s of a tiny NNX LM's 5 s first step).
    items = [(p, stage) for p in range(len(eqns)) for stage in sorted(stages[p])]
    waiting: dict[tuple[Any, int | None], list[int]] = {}
    missing = []
    for i, (p, stage) in enumerate(items):
        keys = {key(v, stage) for v in eqns[p].invars if is_var(v) and v in defined_at}
        for k in keys:
            waiting.setdefault(k, []).append(i)
        missing.append(len(keys))
    everywhere = [i for i, n in enumerate(missing) if n == 0]  # ready, by item order
    by_stage: dict[int, list[int]] = {}
    for i in everywhere:
        by_stage.setdefault(items[i][1], []).append(i)
    heapq.heapify(everywhere)
    done = [False] * len(items)
    groups: list[tuple[int, list[int]]] = []
    current: int | None = None

    def first(heap: list[int]) -> int | None:
        while heap and done[heap[0]]:
            heapq.heappop(heap)
        return heap[0] if heap else None

    for _ in range(len(items)):
        i = first(by_stage.get(current, [])) if current is not None else None
        if i is None:
            i = first(everywhere)
        if i is None:
            raise AssertionError("post-gradient equations wait for each other in a cycle")
        done[i] = True
        p, stage = items[i]
        if stage != current or not groups:
            current = stage
            groups.append((current, []))
        groups[-1][1].append(p)
        for o in eqns[p].outvars:
            for j in waiting.pop(key(o, stage), []):
                missing[j] -= 1
                if missing[j] == 0:
                    heapq.heappush(everywhere, j)
                    heapq.heappush(by_stage.setdefault(items[j][1], []), j)
    out = []
    for n, (stage, positions) in enumerate(groups):
        seg_eqns = [eqns[p] for p in positions]
        defined = {o for e in seg_eqns for o in e.outvars}
        needed = {v for v in outvars if is_var(v)}
        for m, (_, others) in enumerate(groups):
            if m != n:
                other_defined = {o for p in others for o in eqns[p].outvars}
                needed.update(
                    v
                    for p in others
                    for v in eqns[p].invars
                    if is_var(v) and v not in other_defined
                )
        outputs = [
            v
            for v in dict.fromkeys(o for e in seg_eqns for o in e.outvars)
            if v in needed and v in defined
        ]
        inputs = free_inputs(seg_eqns)
        out.append(
            Segment(stage, make_closed(inputs, outputs, seg_eqns), tuple(inputs), tuple(outputs))
        )
    return out
