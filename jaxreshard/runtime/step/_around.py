"""What a step does around its pipeline, the same on every runtime.

Before the stages run: the `pre` part computes what the loss needs from the whole batch, once;
with the batch it gives the feeds (split into micro-batches by each host's engine) and the
per-step constants. After them: the micro-batch losses and aux outputs are combined (see
[Note: micro-batch semantics]), and the post-gradient segments (the optimizer) run on the stage
that holds their inputs, each compiled once, overwriting gradients that die in it.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jc

from jaxreshard.frontend._batch import CONCAT, REDUCE
from jaxreshard.frontend._split import Result, StepGraph


@functools.lru_cache(maxsize=256)
def segment_function(jaxpr: Any, donate: tuple[int, ...] = ()) -> Callable[..., Any]:
    """The `pre` part (code before the loss on the whole batch), jitted once per step shape."""
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


@contextlib.contextmanager
def quiet_donation() -> Iterator[None]:
    """Compile without JAX's "Some donated buffers were not usable" warning: a post segment
    donates both the gradients that die in it and the caller's donated arguments, more buffers
    of a shape than it has outputs to put there, and which ones XLA reuses is its choice."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        yield


def donated(g: StepGraph, index: int) -> tuple[int, ...]:
    """The inputs of segment `index` it may overwrite: gradients that die in it (see
    `dead_gradients`), and arguments the caller donated (`StepGraph.donated`) that it reads
    last and the step does not return."""
    dead = dict(dead_gradients(g))
    for v, last in donated_arguments(g).items():
        dead.setdefault(v, last)
    inputs = g.segments[index].inputs
    return tuple(i for i, v in enumerate(inputs) if dead.get(v) == index and inputs.count(v) == 1)


def donated_arguments(g: StepGraph) -> dict[Any, int]:
    """Donated argument var -> the segment that may overwrite it (the last that reads it),
    for those the step does not return as they are and no later part reads."""
    if not g.donated:
        return {}
    last_use: dict[Any, int] = {}
    for index, segment in enumerate(g.segments):
        for v in segment.inputs:
            last_use[v] = index
    returned = {v for v in g.outer.jaxpr.outvars if not isinstance(v, jc.Literal)}
    invars = g.outer.jaxpr.invars
    return {
        invars[i]: last_use[invars[i]]
        for i in g.donated
        if invars[i] in last_use and invars[i] not in returned
    }


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


def step_value(
    index: Mapping[Any, int], leaves: Sequence[Any], pre: Mapping[Any, Any], v: Any
) -> Any:
    """The value of a variable of the step's outer jaxpr before the loss: an argument leaf (by
    `index`), a `pre` output, or a literal."""
    if isinstance(v, jc.Literal):
        return np.asarray(v.val)
    return leaves[index[v]] if v in index else pre[v]


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
    """The step's loss from its micro-batches' (`mean` or `sum`): added in micro-batch order,
    then divided. Device arrays are combined by one jitted call (the same operations in the
    same order, so the same bits; four eager operations cost four dispatches each step)."""
    if len(losses) == 1:  # x / 1 == x exactly: no dispatch at all
        return losses[0]
    if all(isinstance(x, jax.Array) for x in losses):
        return _combine_jitted(tuple(losses), reduction)
    return _combine(losses, reduction)


def _combine(losses: Sequence[Any], reduction: str) -> Any:
    total = losses[0]
    for value in losses[1:]:
        total = total + value
    return total / len(losses) if reduction == "mean" else total


_combine_jitted = jax.jit(_combine, static_argnums=1)
