"""The `stage_boundary` markers in a traced step: found (nested ones too), brought to the top
level (`jit` calls that contain one are inlined), and a gradient taken through them by anything
but `jr.value_and_grad` refused with the replacement named (see [Note: markers] in
`frontend/_markers.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.extend import core as jc

from jaxreshard._jax_compat import source_files, source_location
from jaxreshard.frontend._jaxprs import CALLS, PipelineSplitError, inline_calls, open_jaxpr
from jaxreshard.frontend._markers import stage_boundary_p
from jaxreshard.frontend._source import gradient_call, user_location


def _where(eqn: Any) -> str:
    """The user's line that made `eqn` (not jaxreshard's, Flax's or Equinox's; see
    `frontend._source`)."""
    return user_location(eqn) or source_location(eqn)


def _contains_marker(jaxpr: Any) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive is stage_boundary_p:
            return True
        if any(_contains_marker(open_jaxpr(j)) for j in jc.jaxprs_in_params(eqn.params)):
            return True
    return False


def _markers(jaxpr: Any) -> list[Any]:
    """Every `stage_boundary` equation of `jaxpr`, nested ones included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is stage_boundary_p:
            out.append(eqn)
        for j in jc.jaxprs_in_params(eqn.params):
            out.extend(_markers(open_jaxpr(j)))
    return out


def inline_marked_calls(jaxpr: Any, consts: Sequence[Any]) -> tuple[Any, list[Any]]:
    """Inline `jit` calls that contain a `stage_boundary`, so markers sit at the top level.

    Returns the new jaxpr and its consts. Markers inside control flow (scan, cond, while) or
    custom derivatives cannot be cut and raise `PipelineSplitError`.
    """

    def marked(eqn: Any) -> bool:
        if not any(_contains_marker(open_jaxpr(j)) for j in jc.jaxprs_in_params(eqn.params)):
            return False
        if eqn.primitive.name not in CALLS:
            raise PipelineSplitError(
                f"a jr.stage_boundary (or a jr.stage_candidate chosen as a cut, or a "
                f"jr.scan(boundaries=...)) is inside "
                f"`{eqn.primitive.name}` at {_where(eqn)}: a boundary inside "
                "lax.scan/cond/while_loop or a custom derivative cannot be cut. Call it at the "
                "top level of the loss function; for a scanned stack of layers, scan it with "
                "jr.scan (lax.scan's signature), whose iterations are candidates, or give each "
                "stage its own stacked parameters and its own lax.scan, with the boundary between "
                "the scans (a stack that two stages read is copied whole every step)"
            )
        return True

    return inline_calls(jaxpr, consts, marked)


def check_gradient_api(jaxpr: Any) -> None:
    """Raise, naming the replacement, if the step differentiates through stage boundaries with
    something other than `jr.value_and_grad` (the transposed markers JAX's AD leaves)."""
    transposed = [e for e in _markers(jaxpr) if e.params.get("transposed")]
    if not transposed:
        return
    files = " ".join(source_files(transposed[0]))
    where = _where(transposed[0])
    call = gradient_call(transposed[0])
    if "equinox" in files:
        fix = (
            "replace eqx.filter_value_and_grad(loss_fn) with jr.filter_value_and_grad(loss_fn) "
            "(and eqx.filter_grad with jr.filter_grad): same signature and results"
        )
    elif "flax" in files:
        fix = (
            "replace nnx.value_and_grad(loss_fn)(model) by the functional form: "
            "graphdef, params, rest = nnx.split(model, nnx.Param, ...) outside the step, and "
            "inside it jr.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest)))(params) "
            "(see 'Bring your model' in the README for the whole recipe, with dropout)"
        )
    else:
        fix = (
            "replace jax.value_and_grad / jax.grad with jr.value_and_grad / jr.grad (same "
            "signature)"
        )
    if call is None:
        what = f"the step differentiates through jr.stage_boundary (at {where}) with a gradient "
    else:
        name, at = call
        what = (
            f"{at}: the step differentiates with {name} through jr.stage_boundary (at {where}), "
            "a gradient "
        )
    raise PipelineSplitError(
        f"{what}transform that parallelize cannot pipeline (only jr.value_and_grad / jr.grad "
        f"mark where the pipelined loss ends); {fix}"
    )
