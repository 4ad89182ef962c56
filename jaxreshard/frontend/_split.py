"""Cutting a traced train step into pipeline stages (pure: jaxprs in, dataclasses out).

[Note: two traces]
A step is traced twice (`frontend._trace`): at the whole batch, exactly as `jax.jit` traces it,
and per micro-batch (batch leaves with dim 0 divided by m). The whole-batch trace is the step:
its equations before `jr.value_and_grad` that the loss needs ("pre": targets sliced off tokens,
masks, token counts, any preprocessing) run once per step on the whole batch, and its
equations after ("post", the optimizer) run once after the micro-batches. The micro-batch trace
gives the loss that the stages run per micro-batch. The loss's operands pair up between the
traces: an operand whose shape is m times smaller along one dim per micro-batch is per example
and is split into micro-batches along that dim with the batch (a `Feed`); any other is a
per-step constant. Pre runs once, as `jax.jit` runs it, because per micro-batch it could compute
other numbers (`x.shape[0]`, `jnp.arange(B)` and batch means all change with the rows it sees).
The traces also pair the loss's random draws (see [Note: random draws]) and tell how to combine
its aux outputs and whether it uses batch statistics (see [Note: micro-batch semantics]).

[Note: stage cutting]
The loss's jaxpr is cut at its `stage_boundary` equations, in program order: boundary k ends
stage k, and every equation belongs to the stage it is written in (the number of boundaries
before it), as a user reads the code. Equations nothing needs are dropped. A value used by a
later stage than the one that computes it is a boundary tensor: the marked activations, skip
connections that jump stages, a transposed embedding computed early, anything. A stage never
uses values of later stages, since the loss is traced in program order. Values computed from
the batch, constants and the micro-batch index alone (targets sliced off a token batch, a mask,
a dropout key) are the exception: each stage that needs one computes its own copy rather than
receiving it. A parameter used by several stages (tied embeddings) belongs to the first; the
others get a copy each step and send their gradient contributions back to be summed. The loss
is an output of the last stage; an aux output (`has_aux=True`) is an output of the stage that
computes it (the last, for one computed from inputs alone), collected per micro-batch.

The step around the loss is split at the `pipeline_grad` equation (see [Note: markers]): what it
depends on runs first, once per step ("pre"); the rest ("post", the optimizer) runs once per step
after the micro-batches, each equation on the stage that holds its inputs (a parameter's update
where the parameter lives), grouped into as few per-stage segments as the data dependencies allow.
See [Note: where the optimizer runs] in `frontend/_post.py`.

A step with stage boundaries and no gradient (evaluation, inference) is pipelined forward only:
the whole function is cut as a loss would be, every floating-point argument is kept by the stage
that first uses it (as a training step with the same boundaries keeps its parameters), other
arguments (counters, keys) are per-step constants, and its outputs are combined from the
micro-batches like aux outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.extend import core as jc

from jaxreshard._jax_compat import for_stages, new_jaxpr
from jaxreshard.frontend._batch import (
    REDUCE,
    batch_dim,
    check_integer_statistics,
    combine_rules,
    find_statistics,
    warn_statistics,
)
from jaxreshard.frontend._graph import (  # noqa: F401  (the graph's names, as imported from here)
    ACT,
    BATCH,
    CONST,
    LOSS,
    MB,
    OUT,
    PARAM,
    Activation,
    Feed,
    LossSplit,
    Ref,
    Result,
    Segment,
    Stage,
    StepGraph,
)
from jaxreshard.frontend._jaxprs import (
    CALLS,
    PipelineSplitError,
    free_inputs,
    inline_calls,
    is_var,
    make_closed,
    needed_positions,
)
from jaxreshard.frontend._marked import (
    _markers,
    _where,
    check_gradient_api,
    inline_marked_calls,
)
from jaxreshard.frontend._markers import pipeline_grad_p, stage_boundary_p
from jaxreshard.frontend._post import _busiest, _check_post, _held_bytes, _segments
from jaxreshard.frontend._random import plan_draws, with_micro_batch_index

__all__ = ["PipelineSplitError"]


# -- the loss --------------------------------------------------------------------------------


def split_loss(
    closed: Any,
    kinds: Sequence[Ref],
    *,
    expected_stages: int | None,
    has_loss: bool = True,
) -> LossSplit:
    """Cut the loss jaxpr (inputs described by `kinds`) into stages; see [Note: stage cutting].

    Its outputs are the loss (with `has_loss`) and then the results (aux outputs; every output of
    a forward-only step)."""
    jaxpr, consts = inline_marked_calls(closed.jaxpr, closed.consts)
    jaxpr = for_stages(jaxpr)
    const_of = dict(zip(jaxpr.constvars, consts))  # e.g. masks built inside jitted helpers
    markers = [e for e in jaxpr.eqns if e.primitive is stage_boundary_p]
    num_stages = len(markers) + 1
    if expected_stages is not None and expected_stages != num_stages:
        raise PipelineSplitError(
            f"PipelineConfig(num_stages={expected_stages}) but the "
            f"{'loss' if has_loss else 'step'} has {len(markers)} jr.stage_boundary markers, "
            f"i.e. {num_stages} stages"
        )
    if expected_stages is None and num_stages == 1:
        raise PipelineSplitError(
            f"the {'loss' if has_loss else 'step'} has no jr.stage_boundary, so the step would "
            "run as one stage; mark where stages end with h = jr.stage_boundary(h), or set "
            "PipelineConfig(num_stages=1) to run it as a single stage on purpose"
        )
    invar_kind = dict(zip(jaxpr.invars, kinds))
    alias: dict[Any, Any] = {}  # marker outputs -> what they mark
    stage_of: dict[int, int] = {}  # equation position -> the stage it is written in
    defined_by: dict[Any, int] = {}
    k = 0
    for position, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive is stage_boundary_p:
            for i, o in zip(eqn.invars, eqn.outvars):
                alias[o] = _root(alias, i) if is_var(i) else i
            k += 1
            continue
        stage_of[position] = k
        for o in eqn.outvars:
            defined_by[o] = position
    last = num_stages - 1
    outs = [_root(alias, v) if is_var(v) else v for v in jaxpr.outvars]
    loss_root = outs[0] if has_loss else None
    result_roots = outs[1:] if has_loss else outs
    if has_loss and not is_var(loss_root):
        raise PipelineSplitError("the loss is a constant; nothing depends on the parameters")

    # Values computed from the batch, constants and the micro-batch index alone (slicing targets
    # off a token batch, masks, dropout keys): every stage that needs one computes it, as those
    # inputs are on every stage anyway.
    input_only = {v for v, ref in invar_kind.items() if ref.kind in (BATCH, CONST, MB)}
    input_only |= set(const_of)
    for eqn in jaxpr.eqns:
        reads = [_root(alias, v) for v in eqn.invars if is_var(v)]
        if eqn.primitive is not stage_boundary_p and all(v in input_only for v in reads):
            input_only.update(eqn.outvars)

    def home_of(v: Any) -> int:
        if is_var(v) and v in defined_by and v not in input_only:
            return stage_of[defined_by[v]]
        return last

    # Which stages need each value (walking backwards; dead code is dropped).
    need: dict[Any, set[int]] = {}
    if loss_root is not None:
        need[loss_root] = {last}
    homes = tuple(home_of(v) for v in result_roots)
    for v, home in zip(result_roots, homes):
        if is_var(v):
            need.setdefault(v, set()).add(home)
    eqn_stages: dict[int, set[int]] = {}
    for position in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[position]
        if eqn.primitive is stage_boundary_p:
            continue
        if not any(o in need for o in eqn.outvars):
            continue
        if all(o in input_only for o in eqn.outvars):
            eqn_stages[position] = set().union(*(need.get(o, set()) for o in eqn.outvars))
        else:
            eqn_stages[position] = {stage_of[position]}
        for v in eqn.invars:
            if is_var(v):
                need.setdefault(_root(alias, v), set()).update(eqn_stages[position])

    # Boundary tensors: values computed in one stage and needed by later ones.
    activations: dict[Any, Activation] = {}
    for var, stages in need.items():
        position = defined_by.get(var)
        if position is None or var in input_only:
            continue  # a step input, or computed where it is needed
        home = stage_of[position]
        earlier = sorted(s for s in stages if s < home)
        if earlier:
            raise PipelineSplitError(
                f"stage {earlier[0]} uses {var.aval.str_short()} computed at "
                f"{_where(jaxpr.eqns[position])} in stage {home}: a stage can only use values of "
                "earlier stages; check the order of the jr.stage_boundary calls"
            )
        later = tuple(sorted(s for s in stages if s > home))
        if later:
            activations[var] = Activation(
                len(activations), var.aval, home, later, _where(jaxpr.eqns[position])
            )

    stages = []
    for s in range(num_stages):
        eqns = []
        defined: set[Any] = set()
        inputs: list[Any] = []
        for position, eqn in enumerate(jaxpr.eqns):
            if s not in eqn_stages.get(position, ()):
                continue
            invars = [_root(alias, v) if is_var(v) else v for v in eqn.invars]
            for v in invars:
                if is_var(v) and v not in defined and v not in inputs:
                    inputs.append(v)
            eqns.append(eqn.replace(invars=invars))
            defined.update(eqn.outvars)
        outvars: list[Any] = []
        outputs: list[Ref] = []
        if s == last and loss_root is not None:
            if loss_root not in defined and loss_root not in invar_kind:
                raise PipelineSplitError(
                    "the loss is computed before the last jr.stage_boundary: the last stage would "
                    "have no work; remove the last boundary"
                )
            outvars.append(loss_root)
            outputs.append(Ref(LOSS))
        for v, a in activations.items():
            if a.home == s:
                outvars.append(v)
                outputs.append(Ref(ACT, a.id))
        for j, (v, home) in enumerate(zip(result_roots, homes)):
            if home == s:
                outvars.append(v)
                outputs.append(Ref(OUT, j))
        if not outputs:
            raise PipelineSplitError(
                f"stage {s} has no outputs that later stages use: its work does not reach the "
                f"{'loss' if has_loss else 'outputs'} (or two jr.stage_boundary calls have "
                "nothing between them); remove a boundary or use the stage's results"
            )
        for v in outvars:  # an output that is an input (an aux leaf returned as it came)
            if is_var(v) and v not in defined and v not in inputs:
                inputs.append(v)
        stage_consts = [v for v in inputs if v in const_of]
        inputs = [v for v in inputs if v not in const_of]
        refs = []
        for v in inputs:
            if v in invar_kind:
                refs.append(invar_kind[v])
            elif v in activations:
                refs.append(Ref(ACT, activations[v].id))
            else:  # pragma: no cover - every other value is defined in the stage
                raise AssertionError(f"stage {s} input {v} has no source")
        closed_stage = jc.ClosedJaxpr(
            new_jaxpr(stage_consts, inputs, outvars, eqns, "pipeline stage"),
            [const_of[v] for v in stage_consts],
        )
        stages.append(Stage(s, closed_stage, tuple(refs), tuple(outputs)))
    ordered = sorted(activations.values(), key=lambda a: a.id)
    return LossSplit(tuple(stages), tuple(ordered), homes)


def _root(alias: dict[Any, Any], v: Any) -> Any:
    while v in alias:
        v = alias[v]
    return v


def _per_micro_batch(
    micro: Any, full: Any, kinds: list[Ref], num_micro_batches: int
) -> tuple[Any, list[Ref]]:
    """The loss with its batched random draws rewritten per micro-batch (see
    [Note: random draws]), and its input kinds (`Ref(MB)` appended when it draws so)."""
    if num_micro_batches == 1:
        return micro, kinds
    plan = plan_draws(micro.jaxpr, full.jaxpr, num_micro_batches)
    if not plan:
        return micro, kinds
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in micro.in_avals]
    return with_micro_batch_index(micro, plan, structs), [*kinds, Ref(MB)]


def _results(
    loss: Any,
    full_loss: Any,
    kinds: Sequence[Ref],
    first: int,
    names: Sequence[str],
    num_micro_batches: int,
    reduction: str,
) -> tuple[Result, ...]:
    """How each output of `loss` from position `first` on combines over micro-batches."""
    seeds = [v for v, r in zip(loss.jaxpr.invars, kinds) if r.kind in (BATCH, MB)]
    positions = range(first, len(loss.jaxpr.outvars))
    full_avals = full_loss.out_avals[first:]
    try:
        rules = combine_rules(loss, full_avals, positions, seeds, num_micro_batches, names)
    except ValueError as e:
        raise PipelineSplitError(str(e)) from None
    avals = [loss.out_avals[p] for p in positions]
    check_integer_statistics(rules, avals, names, reduction)
    return tuple(Result(n, a, r) for n, a, r in zip(names, avals, rules))


def _check_statistics(
    micro: Any,
    full: Any,
    kinds: Sequence[Ref],
    results: Sequence[Result],
    has_loss: bool,
    num_micro_batches: int,
    reduction: str,
) -> None:
    """Warn about uses of batch statistics that micro-batching changes (see
    [Note: micro-batch semantics])."""
    if num_micro_batches == 1:
        return
    batch_inputs = [i for i, r in enumerate(kinds) if r.kind == BATCH]
    first = 1 if has_loss else 0
    roots = [0] * has_loss + [first + j for j, r in enumerate(results) if r.combine.how == REDUCE]
    findings = find_statistics(micro, full, batch_inputs, roots, num_micro_batches)
    warn_statistics(findings, reduction)


# -- the step ---------------------------------------------------------------------------------


def split_step(
    full: Any,
    micro: Any,
    batch: Sequence[int],
    num_micro_batches: int,
    *,
    expected_stages: int | None,
    loss_reduction: str = "mean",
    output_names: Sequence[str] = (),
) -> StepGraph:
    """Cut a step traced at the whole batch (`full`) and per micro-batch (`micro`); `batch`
    lists the invar indices of batch leaves (see [Note: two traces]); `output_names` name the
    step's outputs for messages."""
    jaxpr = full.jaxpr
    if full.consts:
        raise PipelineSplitError(
            "the step closes over array constants; pass them as arguments instead"
        )
    grads = [i for i, e in enumerate(jaxpr.eqns) if e.primitive is pipeline_grad_p]
    if not grads:
        return _split_forward(
            full, micro, batch, num_micro_batches, expected_stages, loss_reduction, output_names
        )
    if len(grads) > 1:
        raise PipelineSplitError(
            f"the step calls jr.value_and_grad/jr.grad {len(grads)} times; a pipelined step "
            "differentiates one loss once"
        )
    check_gradient_api(jaxpr)
    g = grads[0]
    grad_eqn = jaxpr.eqns[g]
    micro_eqn = next(e for e in micro.jaxpr.eqns if e.primitive is pipeline_grad_p)
    loss_micro, loss_full = micro_eqn.params["jaxpr"], grad_eqn.params["jaxpr"]
    if len(micro_eqn.invars) != len(grad_eqn.invars):
        raise PipelineSplitError(
            "the loss given to jr.value_and_grad takes different inputs at the whole batch and "
            "per micro-batch; its arguments must not depend on the batch size"
        )
    invar_index = {v: i for i, v in enumerate(jaxpr.invars)}
    batch_set = set(batch)
    m = num_micro_batches

    num_diff = grad_eqn.params["num_diff"]
    num_aux = grad_eqn.params["num_aux"]
    params: list[int] = []
    kinds: list[Ref] = []
    consts: list[Any] = []
    feeds: list[Feed] = []
    for k, (v, mv) in enumerate(zip(grad_eqn.invars, loss_micro.jaxpr.invars)):
        if k < num_diff:
            if not is_var(v) or v not in invar_index:
                raise PipelineSplitError(
                    "jr.value_and_grad must differentiate arguments of the step directly (the "
                    f"parameter {k} is computed inside the step); pass it in as an argument"
                )
            if invar_index[v] in batch_set:
                raise PipelineSplitError(
                    f"argument leaf {invar_index[v]} is both a batch leaf (batch_argnums) and "
                    "differentiated; parameters cannot be micro-batched"
                )
            params.append(invar_index[v])
            kinds.append(Ref(PARAM, k))
            continue
        if is_var(v) and invar_index.get(v) in batch_set:
            dim: int | None = 0
        else:
            try:
                dim = batch_dim(v.aval.shape, mv.aval.shape, m)
            except ValueError as e:
                raise PipelineSplitError(
                    f"an input of the loss ({v.aval.str_short()}) computed before "
                    f"jr.value_and_grad has {e}; compute per-example values with the batch dim "
                    "kept, or pass them into the loss as arguments"
                ) from None
        if dim is None:
            kinds.append(Ref(CONST, len(consts)))
            consts.append(v)
        else:
            kinds.append(Ref(BATCH, len(feeds)))
            feeds.append(Feed(v, dim))

    loss_jaxpr, kinds = _per_micro_batch(loss_micro, loss_full, kinds, m)
    names = [f"aux leaf {j}" for j in range(num_aux)]
    results = _results(loss_jaxpr, loss_full, kinds, 1, names, m, loss_reduction)
    _check_statistics(loss_micro, loss_full, kinds, results, True, m, loss_reduction)
    loss = split_loss(loss_jaxpr, kinds, expected_stages=expected_stages)
    owner = []
    for k in range(num_diff):
        users = loss.users(PARAM, k)
        owner.append(users[0] if users else 0)

    # Pre: what the loss's operands need, once per step on the whole batch.
    wanted = [v for v in consts if is_var(v)] + [f.var for f in feeds]
    pre_positions = needed_positions(jaxpr.eqns[:g], wanted)
    pre_eqns = [jaxpr.eqns[p] for p in pre_positions]
    pre_inputs = free_inputs(pre_eqns)
    defined_pre = {o for e in pre_eqns for o in e.outvars}
    pre_outputs = list(dict.fromkeys(v for v in wanted if v in defined_pre))
    pre = make_closed(pre_inputs, pre_outputs, pre_eqns) if pre_eqns else None

    # Post: every other equation, placed on the stage of its inputs.
    skip = set(pre_positions) | {g}
    post_eqns = [e for i, e in enumerate(jaxpr.eqns) if i not in skip]
    grad_outputs = tuple(grad_eqn.outvars[: 1 + num_diff])
    aux_outputs = tuple(grad_eqn.outvars[1 + num_diff :])
    _check_post(jaxpr, post_eqns, batch_set, params, grad_outputs)
    placement: dict[Any, int | None] = {v: None for v in jaxpr.invars}
    for k, i in enumerate(params):
        placement[jaxpr.invars[i]] = owner[k]
    placement[grad_outputs[0]] = loss.num_stages - 1
    for k, v in enumerate(grad_outputs[1:]):
        placement[v] = owner[k]
    for v, home in zip(aux_outputs, loss.result_homes):
        placement[v] = home
    for v in pre_outputs:
        placement[v] = None
    post_ids = {id(e) for e in post_eqns}
    keep = {id(e) for e in jaxpr.eqns if id(e) not in post_ids}

    def spans_stages(eqn: Any) -> bool:
        """Inline a post call (an optimizer's jitted helper, e.g. optax's bias correction over
        the whole tree) whose inputs live on several stages, so that each of its equations runs
        where its own inputs are instead of the call moving them all to one stage."""
        if id(eqn) in keep:
            return False
        held = _held_bytes(eqn, placement)
        body = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
        if eqn.primitive.name in CALLS and len(held) > 1 and not getattr(body, "consts", None):
            return True
        if held:
            stage = _busiest(held)
            placement.update((o, stage) for o in eqn.outvars)
        return False

    inlined, _ = inline_calls(jaxpr, [], spans_stages)
    outer = full
    if inlined is not jaxpr:
        outer = jc.ClosedJaxpr(inlined, [])
        post_eqns = [e for e in inlined.eqns if id(e) not in keep]
    segments = _segments(post_eqns, placement, outer.jaxpr.outvars)
    return StepGraph(
        outer=outer,
        params=tuple(params),
        batch=tuple(sorted(batch_set)),
        loss_inputs=tuple(kinds),
        feeds=tuple(feeds),
        consts=tuple(consts),
        loss=loss,
        owner=tuple(owner),
        pre=pre,
        pre_inputs=tuple(pre_inputs),
        pre_outputs=tuple(pre_outputs),
        grad_outputs=grad_outputs,
        results=results,
        result_outputs=aux_outputs,
        segments=tuple(segments),
        placement=placement,
    )


def _split_forward(
    full: Any,
    micro: Any,
    batch: Sequence[int],
    num_micro_batches: int,
    expected_stages: int | None,
    reduction: str,
    names: Sequence[str],
) -> StepGraph:
    """A step without a gradient, pipelined forward only (see [Note: stage cutting])."""
    check_gradient_api(full.jaxpr)
    if not _markers(full.jaxpr) and expected_stages is None:
        raise PipelineSplitError(
            "the step computes no gradient with jr.value_and_grad or jr.grad and has no "
            "jr.stage_boundary; parallelize pipelines a train step (jr.value_and_grad over a "
            "loss with boundaries) or a forward pass with boundaries (eval, inference)"
        )
    jaxpr = full.jaxpr
    batch_set = set(batch)
    m = num_micro_batches
    params: list[int] = []
    kinds: list[Ref] = []
    feeds: list[Feed] = []
    consts: list[Any] = []
    for i, v in enumerate(jaxpr.invars):
        if i in batch_set:
            kinds.append(Ref(BATCH, len(feeds)))
            feeds.append(Feed(v, 0))
        elif jax.numpy.issubdtype(v.aval.dtype, jax.numpy.inexact):  # kept where first used
            kinds.append(Ref(PARAM, len(params)))
            params.append(i)
        else:  # counters, keys, masks: sent along each step, as a training step's constants
            kinds.append(Ref(CONST, len(consts)))
            consts.append(v)
    # Outputs that are inputs (or literals) need no pipeline: the step returns them as they are.
    inputs = set(micro.jaxpr.invars)
    positions = [j for j, v in enumerate(micro.jaxpr.outvars) if is_var(v) and v not in inputs]
    pick = lambda closed: jc.ClosedJaxpr(
        closed.jaxpr.replace(outvars=[closed.jaxpr.outvars[j] for j in positions]), closed.consts
    )
    loss_micro, loss_full = pick(micro), pick(full)
    loss_jaxpr, kinds = _per_micro_batch(loss_micro, loss_full, kinds, m)
    all_names = list(names) or [f"output leaf {j}" for j in range(len(jaxpr.outvars))]
    results = _results(
        loss_jaxpr, loss_full, kinds, 0, [all_names[j] for j in positions], m, reduction
    )
    _check_statistics(loss_micro, loss_full, kinds, results, False, m, reduction)
    loss = split_loss(loss_jaxpr, kinds, expected_stages=expected_stages, has_loss=False)
    owner = []
    for k in range(len(params)):
        users = loss.users(PARAM, k)
        owner.append(users[0] if users else 0)
    outputs = tuple(jaxpr.outvars[j] for j in positions)
    placement: dict[Any, int | None] = {v: None for v in jaxpr.invars}
    placement.update(zip(outputs, loss.result_homes))
    return StepGraph(
        outer=full,
        params=tuple(params),
        batch=tuple(sorted(batch_set)),
        loss_inputs=tuple(kinds),
        feeds=tuple(feeds),
        consts=tuple(consts),
        loss=loss,
        owner=tuple(owner),
        pre=None,
        pre_inputs=(),
        pre_outputs=(),
        grad_outputs=(),
        results=results,
        result_outputs=outputs,
        segments=(),
        placement=placement,
        forward_only=True,
    )
