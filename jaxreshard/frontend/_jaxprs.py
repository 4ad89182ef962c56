"""Small jaxpr utilities the frontend passes share (pure: jaxprs in, jaxprs out)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from jax.extend import core as jc

from jaxreshard._jax_compat import new_jaxpr

CALLS = ("jit", "pjit", "closed_call", "core_call")


class PipelineSplitError(ValueError):
    """The step cannot be cut into pipeline stages as written."""


def is_var(v: Any) -> bool:
    return not isinstance(v, jc.Literal)


def open_jaxpr(j: Any) -> Any:
    """The open jaxpr of a closed or open one."""
    return j.jaxpr if isinstance(j, jc.ClosedJaxpr) else j


def make_closed(invars: Sequence[Any], outvars: Sequence[Any], eqns: Sequence[Any]) -> Any:
    return jc.ClosedJaxpr(new_jaxpr([], invars, outvars, eqns, "pipeline stage"), [])


def free_inputs(eqns: Sequence[Any]) -> list[Any]:
    """The variables `eqns` read before (or without) defining them, in order of first use."""
    defined: set[Any] = set()
    inputs: list[Any] = []
    for eqn in eqns:
        for v in eqn.invars:
            if is_var(v) and v not in defined and v not in inputs:
                inputs.append(v)
        defined.update(eqn.outvars)
    return inputs


def needed_positions(eqns: Sequence[Any], targets: Iterable[Any]) -> list[int]:
    """Positions of the equations that compute `targets` (walking backwards), in order."""
    want = {v for v in targets if is_var(v)}
    keep = []
    for position in reversed(range(len(eqns))):
        eqn = eqns[position]
        if any(o in want for o in eqn.outvars):
            keep.append(position)
            want.update(v for v in eqn.invars if is_var(v))
    keep.reverse()
    return keep


def dependents(jaxpr: Any, seeds: Iterable[Any]) -> set[Any]:
    """The variables of `jaxpr` (top level) that depend on `seeds`: an equation's outputs depend
    on anything any of its inputs depends on (nested jaxprs count as one equation), except that
    a stage boundary passes each value through on its own."""
    out = set(seeds)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "stage_boundary":
            out.update(o for i, o in zip(eqn.invars, eqn.outvars) if is_var(i) and i in out)
        elif any(is_var(v) and v in out for v in eqn.invars):
            out.update(eqn.outvars)
    return out


def inline_calls(
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
            return rename.get(v, v) if is_var(v) else v

        for original in body_eqns:
            outs = original.outvars if top else [jc.Var(o.aval) for o in original.outvars]
            invars = [read(v) for v in original.invars]
            eqn = original
            if not top or any(a is not b for a, b in zip(invars, original.invars)):
                eqn = original.replace(invars=invars, outvars=outs)
            if not inline(eqn) or eqn.primitive.name not in CALLS:
                if not top:
                    rename.update(zip(original.outvars, outs))
                eqns.append(eqn)
                continue
            changed = True
            closed = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
            body = open_jaxpr(closed)
            inner: dict[Any, Any] = dict(zip(body.invars, eqn.invars))
            for v, c in zip(body.constvars, getattr(closed, "consts", [])):
                inner[v] = fresh = jc.Var(v.aval)
                constvars.append(fresh)
                new_consts.append(c)
            emit(body.eqns, inner, top=False)
            for call_out, body_out in zip(original.outvars, body.outvars):
                rename[call_out] = inner.get(body_out, body_out) if is_var(body_out) else body_out

    top_rename: dict[Any, Any] = {}
    emit(jaxpr.eqns, top_rename, top=True)
    if not changed:
        return jaxpr, list(consts)
    outvars = [top_rename.get(v, v) if is_var(v) else v for v in jaxpr.outvars]
    return new_jaxpr(constvars, jaxpr.invars, outvars, eqns, "inlined"), new_consts


def inline_all(closed: Any) -> Any:
    """`closed` (a ClosedJaxpr) with every `jit`-like call inlined, recursively (for
    analyses that look at every equation)."""
    jaxpr, consts = inline_calls(closed.jaxpr, closed.consts, lambda eqn: True)
    return jc.ClosedJaxpr(jaxpr, consts)
