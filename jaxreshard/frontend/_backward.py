"""Each stage's backward, and its split into input-gradient (B) and weight-gradient (W) parts.

[Note: backward split]
A stage's forward is run under `jax.vjp` over its differentiable inputs (its float parameters and
float activations from earlier stages); the VJP function is a pytree whose leaves are the
residuals, so the forward returns them and they stay on the stage until its backward. The
backward is the VJP applied to the output cotangents, traced once to a jaxpr J(residuals,
cotangents) -> (cotangent of every differentiable input). Splitting J by data dependence gives:
- B: the equations the activation cotangents need (they go to earlier stages at once), plus
  "exports", the values B computed that W also needs;
- W: the remaining equations the parameter cotangents need, reading the residuals, the output
  cotangents and B's exports.
No equation runs twice. Without weight delay, J runs whole as one B.
A stage's aux outputs (`Ref(OUT)`) are returned by its forward but not differentiated (as
`has_aux` outputs are not). A forward-only step's stages have no backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jc
from jax.sharding import PartitionSpec as P

from jaxreshard._jax_compat import bind_equation, new_jaxpr
from jaxreshard.frontend._split import ACT, BATCH, OUT, PARAM, Stage
from jaxreshard.frontend._typed_contract import dot_split_on_one_side, on_refusal
from jaxreshard.frontend._typed_ops import (
    conv_with_reduced_weight,
    custom_jvp_retyped,
    plain,
    typed_spec,
)


@dataclasses.dataclass(frozen=True)
class StageBackward:
    """The traced pieces of one stage's forward and backward.

    Attributes:
        stage: the forward stage.
        diff: positions in `stage.inputs` that are differentiated (float params/activations).
        float_outputs: positions in `stage.outputs` with float values that are differentiated
            (activations and the loss; they get cotangents).
        residuals: avals of the residuals the forward returns.
        full: J(residuals..., cotangents...) -> cotangent per `diff` entry.
        b: B(residuals..., cotangents...) -> (activation cotangents..., exports...).
        w: W(residuals..., cotangents..., exports...) -> parameter cotangents.
        act_grads: positions in `diff` whose cotangents B returns (activation inputs).
        param_grads: positions in `diff` whose cotangents W returns (parameter inputs).
        num_exports: how many exports B hands to W.
        reduced: mesh axes the parameters at `reduced_inputs` (positions in `stage.inputs`)
            are cast to `reduced` over before differentiating (see [Note: gradients reduced
            once] in `runtime/step/_reduction.py`): their gradients then come out `unreduced`
            over those axes. Empty: plain gradients.
        forwarded: per residual, the position in `stage.inputs` of the input it is unchanged
            (a weight the backward reads, a received activation), else None (see
            [Note: residuals kept by reference]).
    """

    stage: Stage
    diff: tuple[int, ...]
    float_outputs: tuple[int, ...]
    residuals: tuple[Any, ...]
    full: Any
    b: Any
    w: Any
    act_grads: tuple[int, ...]
    param_grads: tuple[int, ...]
    num_exports: int
    _treedef: Any = dataclasses.field(repr=False, compare=False, default=None)
    reduced: tuple[str, ...] = ()
    reduced_inputs: tuple[int, ...] = ()
    forwarded: tuple[int | None, ...] = ()

    def forward(self, *inputs: Any) -> tuple[list[Any], list[Any]]:
        """The stage forward: (outputs, residuals). Traceable; run it under `jax.jit`."""
        if self.full is None:  # forward only
            return list(jc.jaxpr_as_fun(self.stage.jaxpr)(*inputs)), []
        outputs, leaves, _ = _forward(
            self.stage, self.diff, inputs, self.reduced, self.reduced_inputs
        )
        return outputs, leaves


def _is_float(aval: Any) -> bool:
    return bool(jax.numpy.issubdtype(aval.dtype, jax.numpy.inexact))


def _differentiated(stage: Stage) -> list[int]:
    """Positions of the outputs a stage's backward starts from (all but aux outputs)."""
    return [i for i, ref in enumerate(stage.outputs) if ref.kind != OUT]


def _split_over(spec: Any) -> set[str]:
    """The mesh axes a PartitionSpec splits some dimension over."""
    return {a for e in spec.partitions for a in ((e,) if isinstance(e, str) else e or ())}


def _broadcasts(shape: Sequence[int], target: Sequence[int]) -> bool:
    """Whether an elementwise op broadcasts `shape` to `target` (same rank, 1s widen)."""
    return len(shape) == len(target) and all(a in (b, 1) for a, b in zip(shape, target))


# The n-ary elementwise primitives, whose operands broadcast against each other (`_reconciled`
# applies to them only: a weight of a split activation's shape is not its bias in a matmul).
_ELEMENTWISE = frozenset({
    "add", "add_any", "sub", "mul", "div", "rem", "pow", "max", "min", "atan2", "nextafter",
    "and", "or", "xor", "eq", "ne", "lt", "le", "gt", "ge", "select_n", "clamp", "complex",
})  # fmt: skip


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
            target = jax.typeof(u).shape
            if _broadcasts(shape, target):
                wide = v if shape == target else jax.numpy.broadcast_to(v, target)
                out[i] = jax.reshard(wide, plain(other))
                break
    return out


def typed_eval(closed: Any) -> Any:
    """`jaxpr_as_fun(closed)` for typed (Explicit-mesh) tracing with `reduced` parameters: an
    elementwise equation's operands go through `_reconciled` first, a convolution of a reduced weight takes
    the rule JAX lacks (see [Note: convolutions with reduced weights]), a matmul whose contracted
    dim is split on one side only slices the other, ops JAX refuses only on an Explicit mesh
    (split contractions, gathers by split indices, unaligned reshapes) take the rules of [Note:
    refusals an Explicit mesh adds], and plain calls (`jit`:
    `jax.nn.silu`, say) are evaluated in place, since a call's body was typed on the step's own
    mesh and would return its outputs unsplit. A `custom_jvp` (`jax.nn.relu`) is bound again
    with its body and rule evaluated here (`custom_jvp_retyped`): its rule is what the gradient
    must follow. Other custom derivatives are bound as they are."""

    def run(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], mesh: Any) -> list[Any]:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, map(_untyped, consts)))
        env.update(zip(jaxpr.invars, args))

        def read(v: Any) -> Any:
            return _untyped(v.val) if isinstance(v, jc.Literal) else env[v]

        for eqn in jaxpr.eqns:
            values = [read(v) for v in eqn.invars]
            if eqn.primitive.name in _ELEMENTWISE:
                values = _reconciled(values)
            if eqn.primitive.name == "select_n":
                values = _select_like_cases(values)
            body = eqn.params.get(_PLAIN_CALLS.get(eqn.primitive.name, ""))
            if body is not None:
                inner = getattr(body, "jaxpr", body)
                outs = run(inner, getattr(body, "consts", ()), values, mesh)
            elif _meshless_reshard(eqn, mesh):
                outs = values
            elif eqn.primitive.name == "custom_jvp_call":
                outs = custom_jvp_retyped(eqn, values, lambda j, c, a: run(j, c, a, mesh))
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
                            raise
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    def fn(*args: Any) -> list[Any]:
        mesh = jax.sharding.get_abstract_mesh()  # the Explicit one the caller traces under
        return run(closed.jaxpr, closed.consts, args, mesh)

    return fn


def _select_like_cases(values: Sequence[Any]) -> list[Any]:
    """A `select_n`'s operands laid out alike: each dimension split as the first operand that
    splits it (JAX asks for one sharding on an Explicit mesh; the user's trace, made on no
    mesh, had no reason to)."""
    shape = jax.typeof(values[-1]).shape
    specs = [typed_spec(v) if jax.typeof(v).shape else None for v in values]
    if any(s is not None and (s.reduced or s.unreduced) for s in specs):
        return list(values)
    known = [s for s in specs if s is not None]
    if len({tuple(s) for s in known}) < 2:
        return list(values)
    merged: list[Any] = []
    used: set[str] = set()
    for d in range(len(shape)):
        entry = next((s[d] for s in known if d < len(s) and s[d] is not None), None)
        axes = {entry} if isinstance(entry, str) else set(entry or ())
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


def _untyped(x: Any) -> Any:
    """A constant of the user's trace (typed on the step's own mesh) as plain host data."""
    typed = isinstance(x, jax.Array) or hasattr(x, "aval")  # (or a TypedNdArray)
    return np.asarray(x) if typed else x


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
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, map(_untyped, consts)))
        env.update(zip(jaxpr.invars, args))

        def read(v: Any) -> Any:
            return _untyped(v.val) if isinstance(v, jc.Literal) else env[v]

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


def _as_reduced(x: Any, axes: Sequence[str]) -> Any:
    """`x` (typed on an Explicit mesh) as `reduced` over `axes`: free, and its cotangent comes
    out `unreduced` over them."""
    spec = jax.typeof(x).sharding.spec
    return jax.reshard(x, spec.update(reduced=frozenset(axes) | spec.reduced))


def _forward(
    stage: Stage,
    diff: Sequence[int],
    inputs: Sequence[Any],
    reduced: Sequence[str] = (),
    cast: Sequence[int] = (),
):
    fn = typed_eval(stage.jaxpr) if reduced else jc.jaxpr_as_fun(stage.jaxpr)
    kept = _differentiated(stage)
    if reduced:  # cast before the VJP, so the cast's transpose (a reduction) is not in it
        inputs = [_as_reduced(x, reduced) if i in cast else x for i, x in enumerate(inputs)]

    def on_diff(*d: Any) -> tuple[list[Any], list[Any]]:
        full = list(inputs)
        for i, v in zip(diff, d):
            full[i] = v
        outs = fn(*full)
        return [outs[i] for i in kept], list(outs)

    _, vjp, outputs = jax.vjp(on_diff, *[inputs[i] for i in diff], has_aux=True)
    leaves, treedef = jax.tree.flatten(vjp)
    return list(outputs), list(leaves), treedef


def traced_with_forwarding(fn: Any, structs: Sequence[Any]) -> tuple[Any, tuple[Any, ...]]:
    """`fn`'s (outputs, residuals) shapes, and per residual the position among its arguments of
    the one it returns unchanged, else None (see [Note: residuals kept by reference]): one
    trace."""
    closed, (outs, residuals) = jax.make_jaxpr(fn, return_shape=True)(*structs)
    position = {v: i for i, v in enumerate(closed.jaxpr.invars)}
    forwarded = tuple(
        position.get(v) if isinstance(v, jc.Var) else None
        for v in closed.jaxpr.outvars[len(outs) :]
    )
    return (outs, residuals), forwarded


def residual_inputs(stage: Stage) -> list[tuple[Any, int | None]]:
    """Each residual of the stage's forward: its aval, and the stage input it is (kept by
    reference, see [Note: residuals kept by reference]), or None for a value the forward
    computes."""
    diff = _diff(stage)
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in stage.jaxpr.in_avals]

    def fn(*inputs: Any) -> tuple[list[Any], list[Any]]:
        outputs, leaves, _ = _forward(stage, diff, inputs)
        return outputs, leaves

    (_, residuals), forwarded = traced_with_forwarding(fn, structs)
    return list(zip(residuals, _by_reference(stage, forwarded)))


# The inputs a residual may be kept as: each is this chunk's until its backward is done. A per-step
# constant is not (one placed array serves every chunk on a mesh, and one chunk's fused optimizer
# may donate it while another chunk's backward still needs it), nor the micro-batch index.
BY_REFERENCE = (PARAM, ACT, BATCH)


def _by_reference(stage: Stage, positions: Sequence[Any]) -> tuple[Any, ...]:
    """`positions` without the inputs that are not kept by reference (`BY_REFERENCE`)."""
    kinds = [r.kind for r in stage.inputs]
    return tuple(i if i is not None and kinds[i] in BY_REFERENCE else None for i in positions)


def _diff(stage: Stage) -> tuple[int, ...]:
    """Positions of the inputs a stage's backward differentiates (float params, activations)."""
    return tuple(
        i
        for i, (ref, aval) in enumerate(zip(stage.inputs, stage.jaxpr.in_avals))
        if ref.kind in (PARAM, ACT) and _is_float(aval)
    )


def derive_forward(stage: Stage) -> StageBackward:
    """A forward-only stage: its forward returns its outputs and no residuals."""
    return StageBackward(stage, (), (), (), None, None, None, (), (), 0)


def derive_backward(
    stage: Stage,
    *,
    split: bool,
    in_shardings: Sequence[Any] | None = None,
    reduced: Sequence[str] = (),
    reduced_inputs: Sequence[int] = (),
) -> StageBackward:
    """Trace stage `stage`'s forward and backward and (with `split`) cut B from W.

    `in_shardings` (under `jax.set_mesh` of an Explicit mesh) types the inputs, so that the
    traced pieces carry shardings; the gradients of the parameters at `reduced_inputs` then
    come out `unreduced` over the `reduced` axes."""
    in_avals = stage.jaxpr.in_avals
    out_avals = stage.jaxpr.out_avals
    diff = _diff(stage)
    kept = _differentiated(stage)
    float_outputs = tuple(i for i in kept if _is_float(out_avals[i]))
    holder: dict[str, Any] = {}

    def traced_forward(*inputs: Any) -> tuple[list[Any], list[Any]]:
        outputs, leaves, treedef = _forward(stage, diff, inputs, reduced, reduced_inputs)
        holder["treedef"] = treedef
        return outputs, leaves

    shardings = in_shardings or [None] * len(in_avals)
    structs = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh) for a, sh in zip(in_avals, shardings)
    ]
    (out_structs, residual_structs), forwarded = traced_with_forwarding(traced_forward, structs)
    residuals = tuple(residual_structs)
    forwarded = _by_reference(stage, forwarded)
    treedef = holder["treedef"]

    def backward(*args: Any) -> list[Any]:
        leaves = args[: len(residuals)]
        given = iter(args[len(residuals) :])
        cts = [
            next(given) if i in float_outputs else np.zeros(out_avals[i].shape, jax.dtypes.float0)
            for i in kept
        ]
        vjp = jax.tree.unflatten(treedef, leaves)
        return list(vjp(cts))

    if in_shardings is None:
        ct_structs = [
            jax.ShapeDtypeStruct(out_avals[i].shape, out_avals[i].dtype) for i in float_outputs
        ]
    else:  # the outputs' types, their shardings included (the cotangents come with them)
        ct_structs = [out_structs[kept.index(i)] for i in float_outputs]
    full = jax.make_jaxpr(backward)(*residuals, *ct_structs)
    act_grads = tuple(k for k, i in enumerate(diff) if stage.inputs[i].kind == ACT)
    param_grads = tuple(k for k, i in enumerate(diff) if stage.inputs[i].kind == PARAM)
    if split:
        b, w, num_exports = split_backward(full, act_grads, param_grads)
    else:
        b, w, num_exports = full, None, 0
    return StageBackward(
        stage,
        diff,
        float_outputs,
        residuals,
        full,
        b,
        w,
        act_grads,
        param_grads,
        num_exports,
        treedef,
        tuple(reduced),
        tuple(reduced_inputs),
        forwarded,
    )


def split_backward(
    full: Any, b_targets: Sequence[int], w_targets: Sequence[int]
) -> tuple[Any, Any, int]:
    """Cut J into B (outputs `b_targets` + exports) and W (outputs `w_targets`); see
    [Note: backward split]."""
    jaxpr = full.jaxpr

    def needed(targets: Sequence[Any]) -> set[int]:
        want = {v for v in targets if not isinstance(v, jc.Literal)}
        keep = set()
        for position in reversed(range(len(jaxpr.eqns))):
            eqn = jaxpr.eqns[position]
            if any(o in want for o in eqn.outvars):
                keep.add(position)
                want.update(v for v in eqn.invars if not isinstance(v, jc.Literal))
        return keep

    b_out = [jaxpr.outvars[k] for k in b_targets]
    w_out = [jaxpr.outvars[k] for k in w_targets]
    in_b = needed(b_out)
    in_w = needed(w_out) - in_b
    b_eqns = [e for p, e in enumerate(jaxpr.eqns) if p in in_b]
    w_eqns = [e for p, e in enumerate(jaxpr.eqns) if p in in_w]
    made_by_b = {o for e in b_eqns for o in e.outvars}
    exports = list(
        dict.fromkeys(
            [
                v
                for e in w_eqns
                for v in e.invars
                if not isinstance(v, jc.Literal) and v in made_by_b
            ]
            + [v for v in w_out if not isinstance(v, jc.Literal) and v in made_by_b]
        )
    )

    def closed(invars: list[Any], outvars: list[Any], eqns: list[Any], name: str) -> Any:
        return jc.ClosedJaxpr(
            new_jaxpr(jaxpr.constvars, invars, outvars, eqns, name), list(full.consts)
        )

    b = closed(list(jaxpr.invars), b_out + exports, b_eqns, "input gradients (B)")
    w = closed(list(jaxpr.invars) + exports, w_out, w_eqns, "weight gradients (W)")
    return b, w, len(exports)
