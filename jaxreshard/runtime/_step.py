"""What a step does around its pipeline, the same on every runtime.

Before the stages run: the step's inputs become per-stage feeds (the batch, and what the `pre`
part computes from it per example, split into micro-batches; the per-step constants computed
once by the `pre` part). After them: the micro-batch losses and aux outputs are combined (see
[Note: micro-batch semantics]), and the post-gradient segments (the optimizer) run on the stage
that holds their inputs, each compiled once, overwriting gradients that die in it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jc

from jaxreshard.frontend._batch import CONCAT, REDUCE
from jaxreshard.frontend._split import BATCH, CONST, Result, StepGraph


@functools.lru_cache(maxsize=256)
def segment_function(jaxpr: Any, donate: tuple[int, ...] = ()) -> Callable[..., Any]:
    """A post-gradient segment (or the `pre` part), jitted once."""
    return jax.jit(jc.jaxpr_as_fun(jaxpr), donate_argnums=donate)


def dead_gradients(g: StepGraph) -> dict[Any, int]:
    """Accumulated gradients that die in a post segment: gradient var -> that segment's index.

    They are the pipeline's own buffers, so the optimizer may overwrite them (XLA writes the new
    parameters there instead of into fresh memory)."""
    last_use: dict[Any, int] = {}
    for index, segment in enumerate(g.segments):
        for v in segment.inputs:
            last_use[v] = index
    returned = {v for v in g.outer.jaxpr.outvars if not isinstance(v, jc.Literal)}
    return {v: last_use[v] for v in g.grad_outputs[1:] if v in last_use and v not in returned}


def donated(g: StepGraph, index: int) -> tuple[int, ...]:
    """The inputs of segment `index` it may overwrite (see `dead_gradients`)."""
    dead = dead_gradients(g)
    return tuple(i for i, v in enumerate(g.segments[index].inputs) if dead.get(v) == index)


def pre_values(
    g: StepGraph, leaves: Sequence[Any], place: Callable[[list[Any]], list[Any]] | None = None
) -> dict[Any, Any]:
    """The `pre` part's outputs (values the step computes from its inputs before the loss, on
    the whole batch) by variable; computed once per step. `place` may move its inputs first
    (onto one device set)."""
    if g.pre is None:
        return {}
    index = {v: i for i, v in enumerate(g.outer.jaxpr.invars)}
    inputs = [leaves[index[v]] for v in g.pre_inputs]
    if place is not None:
        inputs = place(inputs)
    outs = segment_function(g.pre)(*inputs)
    return dict(zip(g.pre_outputs, outs))


def _value(index: dict[Any, int], leaves: Sequence[Any], pre: dict[Any, Any], v: Any) -> Any:
    if isinstance(v, jc.Literal):
        return np.asarray(v.val)
    return leaves[index[v]] if v in index else pre[v]


def feed_values(g: StepGraph, leaves: Sequence[Any], pre: dict[Any, Any]) -> list[Any]:
    """Every feed's whole value for the step (a batch leaf, or a `pre` output)."""
    index = {v: i for i, v in enumerate(g.outer.jaxpr.invars)}
    return [_value(index, leaves, pre, f.var) for f in g.feeds]


def stage_feeds(
    g: StepGraph,
    leaves: Sequence[Any],
    pre: dict[Any, Any],
    num_micro_batches: int,
    split: bool = True,
) -> tuple[list[list[list[Any]]], list[list[Any]]]:
    """Per stage: its batch inputs per micro-batch (none without `split`), and its per-step
    constants (host or device arrays, not yet placed)."""
    index = {v: i for i, v in enumerate(g.outer.jaxpr.invars)}
    pieces = [
        split_rows(value, num_micro_batches if split else 1, f.dim)
        for f, value in zip(g.feeds, feed_values(g, leaves, pre))
    ]
    consts_all = [_value(index, leaves, pre, v) for v in g.consts]
    batches, consts = [], []
    for stage in g.loss.stages:
        per_mb: list[list[Any]] = [[] for _ in range(num_micro_batches)]
        for ref in stage.inputs:
            if ref.kind == BATCH and split:
                for mb, piece in enumerate(pieces[ref.index]):
                    per_mb[mb].append(piece)
        batches.append(per_mb)
        consts.append([consts_all[r.index] for r in stage.inputs if r.kind == CONST])
    return batches, consts


def split_rows(x: Any, m: int, dim: int = 0) -> list[Any]:
    """`x` cut into `m` micro-batches along `dim` (views for numpy, slices for JAX)."""
    if isinstance(x, jax.Array):
        rows = x.shape[dim] // m
        return [jax.lax.slice_in_dim(x, j * rows, (j + 1) * rows, axis=dim) for j in range(m)]
    return np.split(np.asarray(x), m, axis=dim)


def combine_results(
    per_mb: Sequence[Sequence[Any]], results: Sequence[Result], reduction: str
) -> list[Any]:
    """Each result's value for the step, from its micro-batches' values (see
    [Note: micro-batch semantics]): concatenated along the batch dim, reduced like the loss, or
    the one value every micro-batch computed."""
    out = []
    for values, result in zip(per_mb, results):
        rule = result.combine
        if rule.how == CONCAT:
            numpy = all(isinstance(v, np.ndarray) for v in values)
            out.append((np if numpy else jax.numpy).concatenate(list(values), axis=rule.dim))
        elif rule.how == REDUCE:
            total = combine_losses(values, reduction)
            out.append(total.astype(result.aval.dtype) if hasattr(total, "astype") else total)
        else:
            out.append(values[-1])
    return out


def combine_losses(losses: Sequence[Any], reduction: str) -> Any:
    """The step's loss from its micro-batches' (`mean` or `sum`)."""
    total = losses[0]
    for value in losses[1:]:
        total = total + value
    return total / len(losses) if reduction == "mean" else total
