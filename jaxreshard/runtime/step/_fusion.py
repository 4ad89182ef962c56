"""Which post-gradient segments (the optimizer) run inside their stage's last backward."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from jaxreshard.frontend._split import PARAM, StepGraph
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime.step._backward import stage_acc_params

# The message of a compiled executable called with inputs laid out otherwise than it was compiled
# for (it checks before running, so nothing was donated yet).
_MISMATCH = "Computation was compiled for input shardings that disagree"


def fusable_segments(
    graph: StepGraph, stages: Collection[int], config: PipelineConfig
) -> dict[int, int]:
    """Post segments that run inside their stage's last backward: stage -> segment index, for
    `stages` (all of them locally, a host's own on Ray).

    With one micro-batch the last backward is the only one, and running the optimizer inside
    it costs no executable more (the step is one program per stage, as under `jax.jit`). With
    more (`mode="always"`, `PipelineConfig.fuse_optimizer`), the last backward is a variant of
    its own, compiled beside the plain one: the optimizer then reads the final gradients as
    they are computed, in the same program, instead of an executable of its own after the
    pipeline that reads them back (measured on an MLP 4x1024 on CPU, 1 stage x 4 micro-batches:
    1.16x -> 1.10x a hand-written `lax.scan`); but the extra variant costs compile time before
    the first step (a 2-stage NNX LM: first step 1.76x -> 2.17x `jax.jit`'s), so `auto` fuses
    with one micro-batch only, or where the pipeline is one stage with its backward unsplit:
    then every micro-batch runs in one scanning executable (`scan_groups`), the fused variant
    is the only one, and the step is one program, as a hand-written `lax.scan` accumulation
    under `jax.jit` is (measured on that MLP: 1.17x -> 1.03x the scan). `never` fuses nothing.
    A segment qualifies when it is its stage's only one, reads only that stage's own parameters,
    their gradients (which nothing else needs, not even the step's outputs) and the step's
    inputs, and the stage exchanges no shared parameter's gradient after its last backward.
    """
    mode, one_program = config.fuse_optimizer, len(graph.loss.stages) == 1
    if mode == "never" or (
        mode == "auto"
        and config.num_micro_batches != 1
        and not (one_program and not config.split_backward)
    ):
        return {}
    by_stage: dict[int, list[int]] = {}
    for j, seg in enumerate(graph.segments):
        by_stage.setdefault(seg.stage, []).append(j)
    invars = graph.outer.jaxpr.invars
    param_owner = {invars[i]: graph.owner[k] for k, i in enumerate(graph.params)}
    grad_of = {v: k for k, v in enumerate(graph.grad_outputs[1:])}
    # Stages that exchange shared parameters' gradients after their last backward.
    exchanging = set()
    for k in range(len(graph.params)):
        others = {u for u in graph.loss.users(PARAM, k) if u != graph.owner[k]}
        if others:
            exchanging |= others | {graph.owner[k]}
    uses: dict[Any, int] = {}
    for seg in graph.segments:
        for v in seg.inputs:
            uses[v] = uses.get(v, 0) + 1
    returned = set(graph.outer.jaxpr.outvars)
    inputs_ok = set(invars) | set(graph.pre_outputs)
    fused = {}
    for s, (j, *others) in by_stage.items():
        seg = graph.segments[j]
        if others or s in exchanging or s not in stages:
            continue
        accumulated = stage_acc_params(graph, s)
        grads = [v for v in seg.inputs if v in grad_of]
        ok = bool(grads)
        for v in seg.inputs:
            if v in grad_of:
                k = grad_of[v]
                ok &= (
                    graph.owner[k] == s
                    and k in accumulated
                    and uses.get(v) == 1
                    and v not in returned
                )
            elif v in param_owner:
                ok &= param_owner[v] == s
            else:
                ok &= v in inputs_ok and v not in set(graph.batch_vars)
        if ok:
            fused[s] = j
    return fused
