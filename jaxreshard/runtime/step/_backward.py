"""A stage's backward as jit-able functions: cotangents summed per output, gradients
accumulated; and which parameters a stage accumulates the gradients of."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jc

from jaxreshard.frontend._backward import StageBackward
from jaxreshard.frontend._split import ACT, PARAM, StepGraph

# The message of a compiled executable called with inputs laid out otherwise than it was compiled
# for (it checks before running, so nothing was donated yet).
_MISMATCH = "Computation was compiled for input shardings that disagree"


def fan_in(graph: StepGraph, s: int) -> list[int]:
    """Per output of stage s: how many cotangents come back (one per consuming stage)."""
    by_id = {a.id: a for a in graph.loss.activations}
    return [
        len(by_id[r.index].consumers) if r.kind == ACT else 1 for r in graph.loss.stages[s].outputs
    ]


def backward_functions(
    bw: StageBackward, fans: Sequence[int], loss_scale: float | None
) -> dict[str, Callable[..., Any]]:
    """The jit-able backward functions of a stage: cotangents summed per output; the last
    stage's loss cotangent is the constant `loss_scale`."""

    def cotangents(ct_lists: Sequence[Any]) -> list[Any]:
        if loss_scale is not None:
            aval = bw.stage.jaxpr.out_avals[0]
            return [jax.numpy.full(aval.shape, loss_scale, aval.dtype)]
        out, at = [], 0
        for i in bw.float_outputs:
            parts = ct_lists[at : at + fans[i]]
            at += fans[i]
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            out.append(total)
        return out

    def full_first(res: Sequence[Any], ct_lists: Sequence[Any]):
        grads = jc.jaxpr_as_fun(bw.full)(*res, *cotangents(ct_lists))
        return [grads[k] for k in bw.act_grads], [grads[k] for k in bw.param_grads]

    def full(acc: Sequence[Any], res: Sequence[Any], ct_lists: Sequence[Any]):
        acts, grads = full_first(res, ct_lists)
        return acts, [a + g for a, g in zip(acc, grads)]

    def b(res: Sequence[Any], ct_lists: Sequence[Any]):
        out = jc.jaxpr_as_fun(bw.b)(*res, *cotangents(ct_lists))
        return out[: len(bw.act_grads)], out[len(bw.act_grads) :]

    def w_first(res: Sequence[Any], ct_lists: Sequence[Any], exports: Sequence[Any]):
        return jc.jaxpr_as_fun(bw.w)(*res, *cotangents(ct_lists), *exports)

    def w(acc: Sequence[Any], res: Sequence[Any], ct_lists: Sequence[Any], exports: Sequence[Any]):
        return [a + g for a, g in zip(acc, w_first(res, ct_lists, exports))]

    return {"full": full, "full_first": full_first, "b": b, "w": w, "w_first": w_first}


def stage_acc_params(graph: StepGraph, s: int) -> list[int]:
    """The parameters whose gradients stage s accumulates, in its inputs' order (the float
    parameters it reads; none in a forward-only step)."""
    if graph.forward_only:
        return []
    stage = graph.loss.stages[s]
    return [
        r.index
        for r, a in zip(stage.inputs, stage.jaxpr.in_avals)
        if r.kind == PARAM and jax.numpy.issubdtype(a.dtype, jax.numpy.inexact)
    ]
