"""Evaluating a stage's jaxpr again under an Explicit mesh: the typed trace of a stage that sums
its gradients once (`typed_eval`, see [Note: gradients reduced once] in
`runtime/step/_reduction.py`), and the inlined trace of a post-gradient segment (`inlined_eval`).
The stage's jaxpr was traced on the step's own mesh (Auto axes) or on none; each equation is bound
again here, among operands typed on the Explicit mesh, with the rules JAX lacks there."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jc
from jax.sharding import PartitionSpec as P

from jaxreshard._jax_compat import bind_equation, scan_counts
from jaxreshard.frontend._typed_contract import dot_split_on_one_side, on_refusal
from jaxreshard.frontend._typed_ops import (
    _entry_axes,
    conv_with_reduced_weight,
    custom_jvp_retyped,
    elementwise_of_reduced,
    plain,
    typed_spec,
    without_size_one_axes,
)


def _split_over(spec: Any) -> set[str]:
    """The mesh axes a PartitionSpec splits some dimension over."""
    return {a for e in spec.partitions for a in ((e,) if isinstance(e, str) else e or ())}


def _broadcast_shape(shape: Sequence[int], other: Sequence[int]) -> tuple[int, ...] | None:
    """The shape an elementwise op broadcasts `shape` and `other` to (same rank, 1s widen on
    either side: a layer norm's (rows, 1) statistic times its (1, features) scale), or None."""
    if len(shape) != len(other) or any(a != b and 1 not in (a, b) for a, b in zip(shape, other)):
        return None
    return tuple(max(a, b) for a, b in zip(shape, other))


# The n-ary elementwise primitives, whose operands broadcast against each other (`_reconciled`
# applies to them only: a weight of a split activation's shape is not its bias in a matmul).
_ELEMENTWISE = frozenset({
    "add", "add_any", "sub", "mul", "div", "rem", "pow", "max", "min", "atan2", "nextafter",
    "and", "or", "xor", "eq", "ne", "lt", "le", "gt", "ge", "select_n", "clamp", "complex",
})  # fmt: skip


def _laid_as(other: Any, own: Any, other_shape: Sequence[int], target: Sequence[int]) -> P:
    """The spec a reduced operand widened to `target` takes beside `other` (of `other_shape`):
    `other`'s split on each dim `other` fills, its own (`own`) where `other` broadcasts (a
    layer norm's scale split over `model`, beside a (rows, 1) statistic: it stays split)."""
    theirs, mine = list(plain(other).partitions), list(plain(own).partitions)
    theirs += [None] * (len(target) - len(theirs))
    mine += [None] * (len(target) - len(mine))
    used = {a for e in theirs for a in _entry_axes(e)}
    out = []
    for d, size in enumerate(target):
        if other_shape[d] == size or mine[d] is None or set(_entry_axes(mine[d])) & used:
            out.append(theirs[d] if other_shape[d] == size else None)
        else:
            out.append(mine[d])
            used |= set(_entry_axes(mine[d]))
    return P(*out)


def _reconciled(values: Sequence[Any]) -> list[Any]:
    """One equation's operands, each typed `reduced` over axes that another operand of its
    (broadcast) shape is split over widened and resharded to that operand's spec: JAX refuses
    to mix the two (a bias added to a batch-split activation), and the slice transposes to the
    partial sum the parameter's gradient wants."""
    specs = [typed_spec(v) for v in values]
    out = list(values)
    for i, (v, spec) in enumerate(zip(values, specs)):
        if spec is None or not spec.reduced:
            continue
        shape = jax.typeof(v).shape
        for u, other in zip(values, specs):
            if u is v or other is None or not _split_over(other) & set(spec.reduced):
                continue
            if not set(spec.reduced) <= _split_over(other):
                # (split over some reduced axes only: the slice would drop the others'
                # reducedness, and that cast's transpose counts the gradient once per device)
                raise ValueError(
                    f"an operand reduced over {sorted(spec.reduced)} meets one split over "
                    f"{sorted(_split_over(other))} only"
                )
            target = _broadcast_shape(shape, jax.typeof(u).shape)
            if target is not None:
                wide = v if tuple(shape) == target else jax.numpy.broadcast_to(v, target)
                out[i] = jax.reshard(wide, _laid_as(other, spec, jax.typeof(u).shape, target))
                break
    kept = [
        i
        for i, spec in enumerate(specs)
        if spec is not None and spec.reduced and out[i] is values[i]
    ]
    if not kept:
        return out
    axes = frozenset(a for i in kept for a in specs[i].reduced)
    if any(isinstance(v, jax.core.Tracer) and i not in kept for i, v in enumerate(values)):
        # A reduced operand beside a whole one (a regulariser added to the data loss) is left
        # to JAX, which refuses it. Casting it plain is not the way: that cast's transpose
        # gives every device the whole cotangent as its term, N times the gradient once the
        # step's `reduce` sums them (measured).
        return out
    # A reduced operand beside constants only (`w * 0.5`): the constants are cast reduced too
    # (free; JAX refuses to mix replicated and reduced), and get no cotangent anyway.
    for i, v in enumerate(values):
        if not isinstance(v, jax.core.Tracer):
            const = jax.numpy.asarray(v)
            out[i] = jax.reshard(const, P(*[None] * const.ndim, reduced=axes))
    return out


def _environment(
    jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]
) -> tuple[dict[Any, Any], Callable[[Any], Any]]:
    """An interpreter's values of `jaxpr`'s variables (its consts and arguments bound), and the
    function that reads one (a literal as host data)."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, map(_untyped, consts)))
    env.update(zip(jaxpr.invars, args))

    def read(v: Any) -> Any:
        return _untyped(v.val) if isinstance(v, jc.Literal) else env[v]

    return env, read


def typed_eval(closed: Any) -> Any:
    """`jaxpr_as_fun(closed)` for typed (Explicit-mesh) tracing with `reduced` parameters.
    An elementwise equation's operands go through `_reconciled` first. A convolution of a
    reduced weight takes the rule JAX lacks (see [Note: convolutions with reduced weights]); a
    matmul whose contracted dim is split on one side only slices the other; ops JAX refuses
    only on an Explicit mesh (split contractions, gathers by split indices, unaligned reshapes)
    take the rules of [Note: refusals an Explicit mesh adds]. Operands lose their splits over
    size-1 mesh axes first (`without_size_one_axes`). Plain calls (`jit`: `jax.nn.silu`, say)
    are evaluated in place, since a call's body was typed on the step's own mesh and would
    return its outputs unsplit. Calls JAX must keep are bound again with their bodies evaluated
    here: a `custom_jvp` (`jax.nn.relu`; `custom_jvp_retyped`: its rule is what the gradient
    must follow), `jax.checkpoint`, `lax.scan` and `lax.cond` (`_CONTROL`). Other custom
    derivatives (`custom_vjp`) are bound as they are."""

    def run(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], mesh: Any) -> list[Any]:
        env, read = _environment(jaxpr, consts, args)
        for eqn in jaxpr.eqns:
            values = [read(v) for v in eqn.invars]
            if eqn.primitive.name not in _KEEP_TYPES:
                values = [without_size_one_axes(v) for v in values]
            if eqn.primitive.name in _ELEMENTWISE:
                values = _reconciled(values)
            if eqn.primitive.name == "select_n":
                values = _select_like_cases(values)
            elif eqn.primitive.name == "concatenate":
                values = _select_like_cases(values, eqn.params["dimension"])
            body = eqn.params.get(_PLAIN_CALLS.get(eqn.primitive.name, ""))
            if body is not None:
                inner = getattr(body, "jaxpr", body)
                outs = run(inner, getattr(body, "consts", ()), values, mesh)
            elif _meshless_reshard(eqn, mesh):
                outs = values
            elif eqn.primitive.name == "custom_jvp_call":
                outs = custom_jvp_retyped(eqn, values, lambda j, c, a: run(j, c, a, mesh))
            elif eqn.primitive.name in _CONTROL:
                outs = _CONTROL[eqn.primitive.name](eqn, values, lambda j, c, a: run(j, c, a, mesh))
            else:
                eqn = _on_stage_mesh(eqn, mesh)
                outs = conv_with_reduced_weight(eqn, values, mesh)
                if outs is None:
                    with jax.sharding.use_abstract_mesh(mesh):
                        outs = dot_split_on_one_side(eqn, values)
                if outs is None:
                    try:
                        outs = bind_equation(eqn, values, mesh)
                    except Exception as e:  # (JAX's ShardingTypeError)
                        with jax.sharding.use_abstract_mesh(mesh):
                            outs = on_refusal(eqn, values, e)
                            if outs is None:
                                outs = elementwise_of_reduced(
                                    eqn, values, lambda v, e=eqn: bind_equation(e, v, mesh)
                                )
                        if outs is None:
                            raise
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    def fn(*args: Any) -> list[Any]:
        mesh = jax.sharding.get_abstract_mesh()  # the Explicit one the caller traces under
        return run(closed.jaxpr, closed.consts, args, mesh)

    return fn


def _remat(eqn: Any, values: Sequence[Any], run: Any) -> list[Any]:
    """`jax.checkpoint` of the body, evaluated by `run`, with the call's own policy."""
    body, p = eqn.params["jaxpr"], eqn.params
    remat = jax.checkpoint(
        lambda *a: run(body, (), a), prevent_cse=p["prevent_cse"], policy=p["policy"]
    )
    return list(remat(*values))


def _cond(eqn: Any, values: Sequence[Any], run: Any) -> list[Any]:
    """`lax.switch` over the branches, each evaluated by `run`."""
    index, *operands = values

    def branch(closed: Any) -> Any:
        return lambda *a: run(closed.jaxpr, closed.consts, a)

    return list(jax.lax.switch(index, [branch(b) for b in eqn.params["branches"]], *operands))


def _scan(eqn: Any, values: Sequence[Any], run: Any) -> list[Any]:
    """`lax.scan` of the body, evaluated by `run`, over the same carry and sequences."""
    p = eqn.params
    n, m = scan_counts(p)
    consts, carry, xs = values[:n], values[n : n + m], values[n + m :]
    body = p["jaxpr"]  # (closed up to jax 0.11, open in 0.12)

    def step(c: Sequence[Any], x: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        out = run(getattr(body, "jaxpr", body), getattr(body, "consts", ()), [*consts, *c, *x])
        return out[:m], out[m:]

    last, ys = jax.lax.scan(
        step, list(carry), list(xs), length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
    )
    return [*last, *ys]


# Control flow bound again with its bodies evaluated by the typed trace's interpreter (each body
# was typed on the step's own mesh, and JAX refuses it among operands typed on the Explicit one).
_CONTROL = {"remat2": _remat, "checkpoint": _remat, "cond": _cond, "scan": _scan}


def _select_like_cases(values: Sequence[Any], whole: int | None = None) -> list[Any]:
    """A `select_n`'s operands (or a `concatenate`'s, along dimension `whole`, left unsplit)
    laid out alike: each dimension split as the first operand that splits it (JAX asks for one
    sharding on an Explicit mesh; the user's trace, made on no mesh, had no reason to: a
    vmapped lookup joins batch-split indices to constant zeros)."""
    rank = len(jax.typeof(values[-1]).shape)
    specs = [typed_spec(v) if jax.typeof(v).shape else None for v in values]
    if any(s is not None and (s.reduced or s.unreduced) for s in specs):
        return list(values)
    known = [s for s in specs if s is not None]
    if len({tuple(s.partitions) for s in known}) < 2:
        return list(values)
    merged: list[Any] = []
    used: set[str] = set()
    for d in range(rank):
        entry = next((s[d] for s in known if d < len(s) and s[d] is not None), None)
        axes = {entry} if isinstance(entry, str) else set(entry or ())
        if d == whole:  # (joined along it: whole)
            merged.append(None)
            continue
        merged.append(None if axes & used else entry)
        used |= axes
    want = P(*merged)
    return [v if s is None or s == want else jax.reshard(v, want) for v, s in zip(values, specs)]


def _on_stage_mesh(eqn: Any, mesh: Any) -> Any:
    """`eqn` with the output shardings it names on another mesh than `mesh` (the typed trace's)
    left to the typed trace to infer: on no mesh (a constant broadcast in the user's trace, made
    with no mesh set), as the stage's own mesh leaves them; on the step's own Auto mesh (a
    custom rule's zeros, traced where the rule's operands were typed), whose specs name no Auto
    axis anyway."""

    def foreign(sharding: Any) -> bool:
        on = getattr(sharding, "mesh", None)
        return on is not None and (on.axis_names == () or getattr(on, "abstract_mesh", on) != mesh)

    named = {k: None for k in ("sharding", "out_sharding") if foreign(eqn.params.get(k))}
    return eqn.replace(params={**eqn.params, **named}) if named else eqn


def _meshless_reshard(eqn: Any, mesh: Any) -> bool:
    """A `reshard` the user's trace made with no mesh set (JAX's random draws and `where` make
    them), or on the step's own mesh with only Auto axes (a custom rule's `where`, traced where
    its operands were typed): nothing on the stage's own mesh, and bound on an Explicit one it
    would type its output on another mesh, so the typed trace passes its operand through."""
    if eqn.primitive.name != "reshard":
        return False
    on = getattr(eqn.params.get("dst_sharding"), "mesh", None)
    if on is None:
        return False
    auto = jax.sharding.AxisType.Auto
    return not on.axis_names or (
        getattr(on, "abstract_mesh", on) != mesh and all(t == auto for t in on.axis_types)
    )


# Calls with no rule of their own (their body is what they compute and differentiate as).
_PLAIN_CALLS = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
}

# Equations whose operands keep their size-1 axes (`without_size_one_axes`): calls evaluated
# in place (their ops see their operands so typed) and reshards (the typed trace's own, or
# passed through).
_KEEP_TYPES = frozenset({*_PLAIN_CALLS, "reshard"})


def _untyped(x: Any) -> Any:
    """A constant of the user's trace (typed on the step's own mesh) as plain host data, of
    its own dtype (a typed float literal would otherwise become float64). A PRNG key, which
    has no host form, stays as it is."""
    typed = isinstance(x, jax.Array) or hasattr(x, "aval")  # (or a TypedNdArray)
    if not typed:
        return x
    dtype = getattr(x, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return x
    return np.asarray(x, dtype=dtype)


# Calls whose body can be evaluated in place of the call where nothing differentiates it (a
# custom derivative rule only matters under differentiation): name -> its body's parameter.
_CALL_BODIES = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}


def inlined_eval(closed: Any) -> Any:
    """`jaxpr_as_fun(closed)` for tracing on an Explicit mesh a jaxpr that nothing will
    differentiate (a post-gradient segment: the optimizer): every equation binds under the
    caller's abstract mesh, and calls (`jit`, custom derivatives) are evaluated in place, so that
    no inner jaxpr typed on the step's own mesh is bound (JAX refuses mixing the two)."""
    mesh = None

    def run(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env, read = _environment(jaxpr, consts, args)
        for eqn in jaxpr.eqns:
            values = [read(v) for v in eqn.invars]
            body = eqn.params.get(_CALL_BODIES.get(eqn.primitive.name, ""))
            if body is not None:
                inner, inner_consts = getattr(body, "jaxpr", body), getattr(body, "consts", ())
                outs = run(inner, inner_consts, values)
            else:
                outs = bind_equation(eqn, values, mesh)
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    def fn(*args: Any) -> list[Any]:
        nonlocal mesh
        mesh = jax.sharding.get_abstract_mesh()
        return run(closed.jaxpr, closed.consts, args)

    return fn
