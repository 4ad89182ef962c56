"""Timing one segment of a step cut at every candidate, as the runtime runs it (for
`partition="auto"`: see [Note: automatic partitioning] in `_partition.py`).

Each part is compiled for one device and timed on zeros, best of `TIMING_RUNS`: the forward
that makes the segment's outputs and residuals; the whole backward, from those residuals and an
output cotangent, adding the parameter gradients to accumulators; and, of that, the input
gradients alone (B of a split backward; W is the rest). The post-gradient code the trace places
on the segment (its part of the optimizer) is timed once a step. On Ray this runs on a host
(`runtime/ray/_segments.py`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jc

from jaxreshard.frontend._backward import _differentiated
from jaxreshard.frontend._split import ACT, PARAM, StepGraph
from jaxreshard.runtime.step._memory import scratch_bytes

TIMING_RUNS = 3


@dataclasses.dataclass(frozen=True)
class SegmentCost:
    """Measured seconds of one segment, per micro-batch."""

    forward: float
    backward: float  # B + W
    weight_grad: float  # W
    apply: float = 0.0  # the post-gradient code (optimizer) placed on it: seconds per step


def segment_cost(graph: StepGraph, s: int, device: Any, split: int) -> tuple[SegmentCost, int]:
    """Forward, whole backward and weight-gradient seconds of segment `s` per micro-batch, and
    of the post-gradient code placed on it per step (see the Note), and the XLA scratch bytes
    of its larger executable on one device."""
    stage = graph.loss.stages[s]
    closed = stage.jaxpr
    fun = jc.jaxpr_as_fun(closed)
    args = _zeros(closed.in_avals, device)
    scratch = 0

    def timed(program: Any, inputs: Sequence[Any]) -> tuple[float, Any]:
        nonlocal scratch
        compiled = jax.jit(program).lower(*inputs).compile()
        scratch = max(scratch, scratch_bytes(compiled))
        return _best(compiled, inputs), compiled

    apply = 0.0
    for seg in graph.segments:  # (the optimizer's part for this segment's parameters)
        if seg.stage == s:
            seg_args = _zeros(seg.jaxpr.in_avals, device)
            apply += _best(jax.jit(jc.jaxpr_as_fun(seg.jaxpr)).lower(*seg_args).compile(),
                           seg_args)  # fmt: skip
    inexact = [jax.numpy.issubdtype(a.dtype, jax.numpy.inexact) for a in closed.in_avals]
    acts = [i for i, r in enumerate(stage.inputs) if r.kind == ACT and inexact[i]]
    params = [i for i, r in enumerate(stage.inputs) if r.kind == PARAM and inexact[i]]
    if graph.forward_only or not acts + params:
        forward = timed(fun, args)[0]
        return SegmentCost(forward / split, 0.0, 0.0, apply), scratch
    # Each part as the runtime runs it: F makes the outputs and the residuals; the backward
    # reads those residuals and an output cotangent, and adds the parameter gradients to the
    # step's accumulators; B of a split backward is its input gradients alone (XLA drops the
    # rest), W the remainder.
    forward, compiled = timed(_vjp_forward(fun, acts + params, closed, stage), args)
    outputs, backward = compiled(*args)
    cotangents = [jax.numpy.zeros_like(o) for o in outputs]
    accumulators = [jax.numpy.zeros_like(args[i]) for i in params]
    n = len(acts)

    def accumulate(f: Any, cts: Any, acc: Any) -> Any:
        grads = f(cts)
        return grads[:n], [a + g for a, g in zip(acc, grads[n:])]

    inputs = (backward, cotangents, accumulators)
    whole = timed(accumulate, inputs)[0]
    weight = whole
    if acts:
        only = timed(lambda f, cts, acc: f(cts)[:n], inputs)[0] if params else whole
        weight = max(whole - only, 0.0)
    return SegmentCost(forward / split, whole / split, weight / split, apply), scratch


def _zeros(avals: Sequence[Any], device: Any) -> list[Any]:
    """Arguments of these avals to time a program with (zeros; typed PRNG keys too, which
    numpy cannot make)."""
    out = []
    for a in avals:
        if not hasattr(a, "shape"):
            out.append(a)
        elif jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            out.append(jax.device_put(jax.numpy.zeros(a.shape, a.dtype), device))
        else:
            out.append(jax.device_put(np.zeros(a.shape, a.dtype), device))
    return out


def _vjp_forward(fun: Any, wrt: Sequence[int], closed: Any, stage: Any) -> Any:
    """`fun`'s outputs that the backward starts from (inexact, not aux outputs) and its VJP
    with respect to inputs `wrt` (whose residuals are what a forward action keeps for its
    backward)."""
    inexact = [jax.numpy.issubdtype(a.dtype, jax.numpy.inexact) for a in closed.out_avals]
    starts = set(_differentiated(stage))
    chosen_outputs = [i for i, f in enumerate(inexact) if f and i in starts]

    def forward(*args: Any) -> Any:
        def part(*chosen: Any) -> Any:
            full = list(args)
            for i, x in zip(wrt, chosen):
                full[i] = x
            outs = fun(*full)
            return [outs[i] for i in chosen_outputs]

        return jax.vjp(part, *[args[i] for i in wrt])

    return forward


def _best(compiled: Any, args: Sequence[Any]) -> float:
    jax.block_until_ready(compiled(*args))  # compile and warm
    best = math.inf
    for _ in range(TIMING_RUNS):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        best = min(best, time.perf_counter() - start)
    return best
