"""Cutting a traced train step into pipeline stages (pure: jaxpr in, dataclasses out).

[Note: stage cutting]
The loss's jaxpr is cut at its `stage_boundary` equations, in program order: boundary k ends
stage k, and every equation belongs to the stage it is written in (the number of boundaries
before it), as a user reads the code. Equations nothing needs are dropped. A value used by a
later stage than the one that computes it is a boundary tensor: the marked activations, skip
connections that jump stages, a transposed embedding computed early, anything. A stage never
uses values of later stages, since the loss is traced in program order. Values computed from
the batch and constants alone (targets sliced off a token batch, a mask) are the exception: each
stage that needs one computes its own copy rather than receiving it.
A parameter used by several stages (tied embeddings) belongs to the first; the others get a copy
each step and send their gradient contributions back to be summed.

The step around the loss is split at the `pipeline_grad` equation (see [Note: markers]): what it
depends on runs first, once per step ("pre"); the rest ("post", the optimizer) runs once per step
after the micro-batches, each equation on the stage that holds its inputs (a parameter's update
where the parameter lives), grouped into as few per-stage segments as the data dependencies allow.
See [Note: where the optimizer runs].

[Note: where the optimizer runs]
A post equation whose inputs live on several stages runs on the stage that holds most of their
bytes (the latest such stage on a tie), so that only the smaller inputs move. This keeps an
optimizer's state "sharded like the parameters": the moments of a parameter are computed from its
gradient on its stage and stay there, while global reductions move only scalars. Clipping by the
global norm, for instance, sums each gradient's squares where the gradient is, adds those scalars
up on one stage (the latest), and sends the scale back: `g * scale` runs where `g` is, not where
`scale` is. Placing by the latest input alone would run that product, and everything after it
(the moments, the new parameters), on the last stage, moving every gradient there each step.
Equations that read only the step's free inputs (a step counter, a learning-rate schedule) are
copied into every stage that uses them instead.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jc

from jaxreshard._jax_compat import new_jaxpr, source_location
from jaxreshard.frontend._markers import pipeline_grad_p, stage_boundary_p

_CALLS = ("jit", "pjit", "closed_call", "core_call")

PARAM, BATCH, CONST, ACT, LOSS = "param", "batch", "const", "act", "loss"


class PipelineSplitError(ValueError):
    """The step cannot be cut into pipeline stages as written."""


@dataclasses.dataclass(frozen=True)
class Ref:
    """What a stage input or output is: a step parameter, a batch leaf, a per-step constant
    (`index` into the step's inputs), an activation (`index` = activation id), or the loss."""

    kind: str
    index: int = 0

    def __str__(self) -> str:
        return self.kind if self.kind == LOSS else f"{self.kind}{self.index}"


@dataclasses.dataclass(frozen=True)
class Activation:
    """A value of the loss produced by one stage and used by later ones (a boundary tensor)."""

    id: int
    aval: Any
    home: int
    consumers: tuple[int, ...]
    where: str  # the source line that computed it

    @property
    def differentiable(self) -> bool:
        return bool(jax.numpy.issubdtype(self.aval.dtype, jax.numpy.inexact))

    def label(self) -> str:
        return f"act{self.id}:{self.aval.str_short()}"


@dataclasses.dataclass(frozen=True)
class Stage:
    """The forward of one stage: `jaxpr` maps `inputs` to `outputs` (in that order)."""

    index: int
    jaxpr: Any  # ClosedJaxpr
    inputs: tuple[Ref, ...]
    outputs: tuple[Ref, ...]


@dataclasses.dataclass(frozen=True)
class LossSplit:
    stages: tuple[Stage, ...]
    activations: tuple[Activation, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def users(self, kind: str, index: int) -> tuple[int, ...]:
        return tuple(s.index for s in self.stages if Ref(kind, index) in s.inputs)


@dataclasses.dataclass(frozen=True)
class Segment:
    """Post-gradient equations that run together on one stage's mesh."""

    stage: int
    jaxpr: Any  # ClosedJaxpr over `inputs` -> `outputs`
    inputs: tuple[Any, ...]  # outer Vars
    outputs: tuple[Any, ...]  # outer Vars


@dataclasses.dataclass(frozen=True)
class StepGraph:
    """A train step cut for the pipeline.

    Attributes:
        outer: the traced step (its invars are the flattened arguments).
        params: for each differentiated leaf k, the outer invar index it is.
        batch: outer invar indices that are batch leaves (split into micro-batches).
        loss_inputs: for each input of the loss jaxpr, a `Ref` (param k, batch i, const j).
        consts: the outer Vars that feed the loss as per-step constants (const j).
        loss: the loss cut into stages.
        owner: for each parameter k, the stage that keeps it (its first user).
        pre: equations the loss depends on, run once per step before the pipeline (a
            ClosedJaxpr over `pre_inputs` -> `pre_outputs`), or None.
        grad_outputs: the outer Vars the gradient equation defines: the loss, then one gradient
            per parameter.
        segments: the post-gradient equations in run order.
        placement: stage of each outer Var the post part reads or writes (None: free).
    """

    outer: Any
    params: tuple[int, ...]
    batch: tuple[int, ...]
    loss_inputs: tuple[Ref, ...]
    consts: tuple[Any, ...]
    loss: LossSplit
    owner: tuple[int, ...]
    pre: Any
    pre_inputs: tuple[Any, ...]
    pre_outputs: tuple[Any, ...]
    grad_outputs: tuple[Any, ...]
    segments: tuple[Segment, ...]
    placement: dict[Any, int | None]

    @property
    def num_stages(self) -> int:
        return self.loss.num_stages

    @property
    def batch_vars(self) -> tuple[Any, ...]:
        return tuple(self.outer.jaxpr.invars[i] for i in self.batch)


# -- helpers ----------------------------------------------------------------------------------


def _is_var(v: Any) -> bool:
    return not isinstance(v, jc.Literal)


def _where(eqn: Any) -> str:
    return source_location(eqn)


def _contains_marker(jaxpr: Any) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive is stage_boundary_p:
            return True
        if any(_contains_marker(_open(j)) for j in jc.jaxprs_in_params(eqn.params)):
            return True
    return False


def _open(j: Any) -> Any:
    return j.jaxpr if hasattr(j, "jaxpr") and hasattr(j, "consts") else j


def _make_jaxpr(invars: Sequence[Any], outvars: Sequence[Any], eqns: Sequence[Any]) -> Any:
    return jc.ClosedJaxpr(new_jaxpr([], invars, outvars, eqns, "pipeline stage"), [])


def _inline_calls(
    jaxpr: Any, consts: Sequence[Any], inline: Callable[[Any], bool]
) -> tuple[Any, list[Any]]:
    """Replace the `jit`-like call equations that `inline(eqn)` picks by their bodies.

    `inline` sees every equation in program order (and may raise), with its inputs renamed to
    the values the rewritten jaxpr computes them as (an inlined body's equations too, after the
    call), so it may keep per-value state such as a placement. Equations of the top level
    keep their variables; those of an inlined body get fresh ones (a body may be inlined twice).
    Returns the new jaxpr and its consts (a body's consts become constvars).
    """
    new_consts, constvars = list(consts), list(jaxpr.constvars)
    eqns: list[Any] = []
    changed = False

    def emit(body_eqns: Sequence[Any], rename: dict[Any, Any], top: bool) -> None:
        nonlocal changed

        def read(v: Any) -> Any:
            return rename.get(v, v) if _is_var(v) else v

        for original in body_eqns:
            outs = original.outvars if top else [jc.Var(o.aval) for o in original.outvars]
            invars = [read(v) for v in original.invars]
            eqn = original
            if not top or any(a is not b for a, b in zip(invars, original.invars)):
                eqn = original.replace(invars=invars, outvars=outs)
            if not inline(eqn) or eqn.primitive.name not in _CALLS:
                if not top:
                    rename.update(zip(original.outvars, outs))
                eqns.append(eqn)
                continue
            changed = True
            closed = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
            body = _open(closed)
            inner: dict[Any, Any] = dict(zip(body.invars, eqn.invars))
            for v, c in zip(body.constvars, getattr(closed, "consts", [])):
                inner[v] = fresh = jc.Var(v.aval)
                constvars.append(fresh)
                new_consts.append(c)
            emit(body.eqns, inner, top=False)
            for call_out, body_out in zip(original.outvars, body.outvars):
                rename[call_out] = inner.get(body_out, body_out) if _is_var(body_out) else body_out

    top_rename: dict[Any, Any] = {}
    emit(jaxpr.eqns, top_rename, top=True)
    if not changed:
        return jaxpr, list(consts)
    outvars = [top_rename.get(v, v) if _is_var(v) else v for v in jaxpr.outvars]
    return new_jaxpr(constvars, jaxpr.invars, outvars, eqns, "inlined"), new_consts


def inline_marked_calls(jaxpr: Any, consts: Sequence[Any]) -> tuple[Any, list[Any]]:
    """Inline `jit` calls that contain a `stage_boundary`, so markers sit at the top level.

    Returns the new jaxpr and its consts. Markers inside control flow (scan, cond, while) or
    custom derivatives cannot be cut and raise `PipelineSplitError`.
    """

    def marked(eqn: Any) -> bool:
        if not any(_contains_marker(_open(j)) for j in jc.jaxprs_in_params(eqn.params)):
            return False
        if eqn.primitive.name not in _CALLS:
            raise PipelineSplitError(
                f"jr.stage_boundary is called inside `{eqn.primitive.name}` at {_where(eqn)}: a "
                "boundary inside lax.scan/cond/while_loop or a custom derivative cannot be cut; "
                "call jr.stage_boundary at the top level of the loss function"
            )
        return True

    return _inline_calls(jaxpr, consts, marked)


# -- the loss --------------------------------------------------------------------------------


def split_loss(closed: Any, kinds: Sequence[Ref], *, expected_stages: int | None) -> LossSplit:
    """Cut the loss jaxpr (inputs described by `kinds`) into stages; see [Note: stage cutting]."""
    jaxpr, consts = inline_marked_calls(closed.jaxpr, closed.consts)
    const_of = dict(zip(jaxpr.constvars, consts))  # e.g. masks built inside jitted helpers
    markers = [e for e in jaxpr.eqns if e.primitive is stage_boundary_p]
    num_stages = len(markers) + 1
    if expected_stages is not None and expected_stages != num_stages:
        raise PipelineSplitError(
            f"PipelineConfig(num_stages={expected_stages}) but the loss has {len(markers)} "
            f"jr.stage_boundary markers, i.e. {num_stages} stages"
        )
    if expected_stages is None and num_stages == 1:
        raise PipelineSplitError(
            "the loss has no jr.stage_boundary, so the step would run as one stage; mark where "
            "stages end with h = jr.stage_boundary(h), or set PipelineConfig(num_stages=1) to "
            "run it as a single stage on purpose"
        )
    invar_kind = dict(zip(jaxpr.invars, kinds))
    alias: dict[Any, Any] = {}  # marker outputs -> what they mark
    stage_of: dict[int, int] = {}  # equation position -> the stage it is written in
    defined_by: dict[Any, int] = {}
    k = 0
    for position, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive is stage_boundary_p:
            for i, o in zip(eqn.invars, eqn.outvars):
                alias[o] = _root(alias, i) if _is_var(i) else i
            k += 1
            continue
        stage_of[position] = k
        for o in eqn.outvars:
            defined_by[o] = position
    loss_var = jaxpr.outvars[0]
    if not _is_var(loss_var):
        raise PipelineSplitError("the loss is a constant; nothing depends on the parameters")
    loss_root = _root(alias, loss_var)

    # Values computed from the batch and constants alone (slicing targets off a token batch,
    # masks): every stage that needs one computes it, as the batch is on every stage anyway.
    input_only = {v for v, ref in invar_kind.items() if ref.kind in (BATCH, CONST)}
    input_only |= set(const_of)
    for eqn in jaxpr.eqns:
        reads = [_root(alias, v) for v in eqn.invars if _is_var(v)]
        if eqn.primitive is not stage_boundary_p and all(v in input_only for v in reads):
            input_only.update(eqn.outvars)

    # Which stages need each value (walking backwards; dead code is dropped).
    last = num_stages - 1
    need: dict[Any, set[int]] = {loss_root: {last}}
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
            if _is_var(v):
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
            invars = [_root(alias, v) if _is_var(v) else v for v in eqn.invars]
            for v in invars:
                if _is_var(v) and v not in defined and v not in inputs:
                    inputs.append(v)
            eqns.append(eqn.replace(invars=invars))
            defined.update(eqn.outvars)
        if s == last:
            outvars = [loss_root]
            if loss_root not in defined:
                raise PipelineSplitError(
                    "the loss is computed before the last jr.stage_boundary: the last stage would "
                    "have no work; remove the last boundary"
                )
            outputs = (Ref(LOSS),)
        else:
            outvars = [v for v in activations if activations[v].home == s]
            outputs = tuple(Ref(ACT, activations[v].id) for v in outvars)
            if not outvars:
                raise PipelineSplitError(
                    f"stage {s} has no outputs that later stages use: its work does not reach the "
                    "loss (or two jr.stage_boundary calls have nothing between them); remove a "
                    "boundary or use the stage's results"
                )
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
        stages.append(Stage(s, closed_stage, tuple(refs), outputs))
    ordered = sorted(activations.values(), key=lambda a: a.id)
    return LossSplit(tuple(stages), tuple(ordered))


def _root(alias: dict[Any, Any], v: Any) -> Any:
    while v in alias:
        v = alias[v]
    return v


# -- the step ---------------------------------------------------------------------------------


def split_step(closed: Any, batch: Sequence[int], *, expected_stages: int | None) -> StepGraph:
    """Cut a traced train step; `batch` lists the outer invar indices of batch leaves."""
    jaxpr = closed.jaxpr
    if closed.consts:
        raise PipelineSplitError(
            "the step closes over array constants; pass them as arguments instead"
        )
    grads = [i for i, e in enumerate(jaxpr.eqns) if e.primitive is pipeline_grad_p]
    if not grads:
        raise PipelineSplitError(
            "the step computes no gradient with jr.value_and_grad or jr.grad; parallelize needs "
            "one (jax.grad cannot be pipelined: use jr.grad, which has the same signature)"
        )
    if len(grads) > 1:
        raise PipelineSplitError(
            f"the step calls jr.value_and_grad/jr.grad {len(grads)} times; a pipelined step "
            "differentiates one loss once"
        )
    g = grads[0]
    grad_eqn = jaxpr.eqns[g]
    invar_index = {v: i for i, v in enumerate(jaxpr.invars)}
    batch_set = set(batch)

    # Pre: what the gradient equation depends on.
    needed = {v for v in grad_eqn.invars if _is_var(v)}
    pre_positions = []
    for position in reversed(range(g)):
        eqn = jaxpr.eqns[position]
        if any(o in needed for o in eqn.outvars):
            pre_positions.append(position)
            needed.update(v for v in eqn.invars if _is_var(v))
    pre_positions.reverse()
    depends_on_batch = {jaxpr.invars[i] for i in batch_set}
    for position in pre_positions:
        eqn = jaxpr.eqns[position]
        if any(v in depends_on_batch for v in eqn.invars if _is_var(v)):
            raise PipelineSplitError(
                f"the step computes from the batch at {_where(eqn)} before calling "
                "jr.value_and_grad; move that computation into the loss function so it runs per "
                "micro-batch"
            )
    pre_eqns = [jaxpr.eqns[p] for p in pre_positions]

    num_diff = grad_eqn.params["num_diff"]
    params: list[int] = []
    kinds: list[Ref] = []
    consts: list[Any] = []
    for k, v in enumerate(grad_eqn.invars):
        if k < num_diff:
            if not _is_var(v) or v not in invar_index:
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
        elif _is_var(v) and v in invar_index and invar_index[v] in batch_set:
            kinds.append(Ref(BATCH, invar_index[v]))
        else:
            if not _is_var(v):
                raise PipelineSplitError("literal loss inputs are not supported")
            kinds.append(Ref(CONST, len(consts)))
            consts.append(v)
    loss = split_loss(grad_eqn.params["jaxpr"], kinds, expected_stages=expected_stages)
    owner = []
    for k in range(num_diff):
        users = loss.users(PARAM, k)
        owner.append(users[0] if users else 0)

    pre_inputs = _free_inputs(pre_eqns)
    pre_outputs = [v for v in consts if any(v in e.outvars for e in pre_eqns)]
    pre = _make_jaxpr(pre_inputs, pre_outputs, pre_eqns) if pre_eqns else None

    # Post: every other equation, placed on the stage of its inputs.
    post_eqns = [e for i, e in enumerate(jaxpr.eqns) if i != g and i not in set(pre_positions)]
    for eqn in post_eqns:
        if any(v in depends_on_batch for v in eqn.invars if _is_var(v)):
            raise PipelineSplitError(
                f"the step reads the batch at {_where(eqn)}, outside the loss given to "
                "jr.value_and_grad; only the loss runs per micro-batch, so compute batch "
                "statistics inside the loss"
            )
    if any(v in depends_on_batch for v in jaxpr.outvars if _is_var(v)):
        raise PipelineSplitError(
            "the step returns a batch leaf; return only parameters, optimizer state and metrics"
        )
    placement: dict[Any, int | None] = {v: None for v in jaxpr.invars}
    for k, i in enumerate(params):
        placement[jaxpr.invars[i]] = owner[k]
    placement[grad_eqn.outvars[0]] = loss.num_stages - 1
    for k, v in enumerate(grad_eqn.outvars[1:]):
        placement[v] = owner[k]
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
        if eqn.primitive.name in _CALLS and len(held) > 1 and not getattr(body, "consts", None):
            return True
        if held:
            stage = _busiest(held)
            placement.update((o, stage) for o in eqn.outvars)
        return False

    inlined, _ = _inline_calls(jaxpr, [], spans_stages)
    if inlined is not jaxpr:
        jaxpr, closed = inlined, jc.ClosedJaxpr(inlined, [])
        post_eqns = [e for e in jaxpr.eqns if id(e) not in keep]
    segments = _segments(post_eqns, placement, jaxpr.outvars)
    return StepGraph(
        outer=closed,
        params=tuple(params),
        batch=tuple(sorted(batch_set)),
        loss_inputs=tuple(kinds),
        consts=tuple(consts),
        loss=loss,
        owner=tuple(owner),
        pre=pre,
        pre_inputs=tuple(pre_inputs),
        pre_outputs=tuple(pre_outputs),
        grad_outputs=tuple(grad_eqn.outvars),
        segments=tuple(segments),
        placement=placement,
    )


def _nbytes(aval: Any) -> int:
    shape, dtype = getattr(aval, "shape", ()), getattr(aval, "dtype", None)
    return math.prod(shape) * (dtype.itemsize if dtype is not None else 0)


def _held_bytes(eqn: Any, placement: dict[Any, int | None]) -> dict[int, int]:
    """Stage -> bytes of `eqn`'s inputs that the stage holds."""
    held: dict[int, int] = {}
    for v in dict.fromkeys(v for v in eqn.invars if _is_var(v)):
        stage = placement.get(v)
        if stage is not None:
            held[stage] = held.get(stage, 0) + _nbytes(v.aval)
    return held


def _busiest(held: dict[int, int]) -> int:
    """The stage holding most bytes, the latest on a tie; see [Note: where the optimizer runs]."""
    return max(held, key=lambda s: (held[s], s))


def _free_inputs(eqns: Sequence[Any]) -> list[Any]:
    defined: set[Any] = set()
    inputs: list[Any] = []
    for eqn in eqns:
        for v in eqn.invars:
            if _is_var(v) and v not in defined and v not in inputs:
                inputs.append(v)
        defined.update(eqn.outvars)
    return inputs


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
            if _is_var(v):
                wanted.setdefault(v, set()).update(stages[position])
    free = {o for p, e in enumerate(eqns) if placement.get(e.outvars[0]) is None for o in e.outvars}
    defined_at = {o: p for p, e in enumerate(eqns) for o in e.outvars}

    def ready(item: tuple[int, int], produced: set[tuple[Any, int | None]]) -> bool:
        p, stage = item
        for v in eqns[p].invars:
            if _is_var(v) and v in defined_at and (v, stage if v in free else None) not in produced:
                return False
        return True

    # Greedy topological grouping: keep running the current stage while any of its equations is
    # ready, so that each stage gets few segments.
    remaining = [(p, stage) for p in range(len(eqns)) for stage in sorted(stages[p])]
    produced: set[tuple[Any, int | None]] = set()
    groups: list[tuple[int, list[int]]] = []
    current: int | None = None
    while remaining:
        candidates = [item for item in remaining if ready(item, produced)]
        same = [item for item in candidates if item[1] == current]
        pick = same[0] if same else candidates[0]
        if pick[1] != current or not groups:
            current = pick[1]
            groups.append((current, []))
        groups[-1][1].append(pick[0])
        for o in eqns[pick[0]].outvars:
            produced.add((o, pick[1] if o in free else None))
        remaining.remove(pick)
    out = []
    for n, (stage, positions) in enumerate(groups):
        seg_eqns = [eqns[p] for p in positions]
        defined = {o for e in seg_eqns for o in e.outvars}
        needed = {v for v in outvars if _is_var(v)}
        for m, (_, others) in enumerate(groups):
            if m != n:
                other_defined = {o for p in others for o in eqns[p].outvars}
                needed.update(
                    v
                    for p in others
                    for v in eqns[p].invars
                    if _is_var(v) and v not in other_defined
                )
        outputs = [
            v
            for v in dict.fromkeys(o for e in seg_eqns for o in e.outvars)
            if v in needed and v in defined
        ]
        inputs = _free_inputs(seg_eqns)
        out.append(
            Segment(stage, _make_jaxpr(inputs, outputs, seg_eqns), tuple(inputs), tuple(outputs))
        )
    return out
