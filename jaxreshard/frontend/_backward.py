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

from jaxreshard._jax_compat import new_jaxpr, on_abstract_mesh
from jaxreshard.frontend._split import ACT, BATCH, OUT, PARAM, Stage
from jaxreshard.frontend._typed_eval import typed_eval


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
        traced: the forward as traced here, inputs -> (outputs..., residuals...): `forward`
            evaluates it rather than linearizing the stage again.
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
    traced: Any = dataclasses.field(repr=False, compare=False, default=None)

    def forward(self, *inputs: Any) -> tuple[list[Any], list[Any]]:
        """The stage forward: (outputs, residuals). Traceable; run it under `jax.jit`."""
        if self.full is None:  # forward only
            return list(jc.jaxpr_as_fun(self.stage.jaxpr)(*inputs)), []
        flat = jc.jaxpr_as_fun(self.traced)(*inputs)
        n = len(flat) - len(self.residuals)
        assert n == len(self.stage.outputs), (n, len(self.stage.outputs))
        return list(flat[:n]), list(flat[n:])


def _is_float(aval: Any) -> bool:
    return bool(jax.numpy.issubdtype(aval.dtype, jax.numpy.inexact))


def _differentiated(stage: Stage) -> list[int]:
    """Positions of the outputs a stage's backward starts from (all but aux outputs)."""
    return [i for i, ref in enumerate(stage.outputs) if ref.kind != OUT]


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
        if reduced:
            _whole_outputs(stage, outs)
        return [outs[i] for i in kept], list(outs)

    _, vjp, outputs = jax.vjp(on_diff, *[inputs[i] for i in diff], has_aux=True)
    leaves, treedef = jax.tree.flatten(vjp)
    return list(outputs), list(leaves), treedef


def _whole_outputs(stage: Stage, outs: Sequence[Any]) -> None:
    """Refuse a typed stage output that is `reduced` or `unreduced` (a value a `reduced`
    parameter reached with nothing split beside it: `jnp.sum(w)` returned as is). Its cotangent
    would be taken as a term on every device, N times the gradient, and the runtime moves
    stage outputs as plain arrays."""
    for i in _differentiated(stage):  # (an aux output is not differentiated: any type will do)
        ref, out = stage.outputs[i], outs[i]
        spec = getattr(getattr(jax.typeof(out), "sharding", None), "spec", None)
        if spec is not None and (spec.reduced or spec.unreduced):
            raise ValueError(
                f"stage output {ref} is typed {spec}: a value computed from `reduced` "
                "parameters alone leaves the stage; its gradient would be counted once per "
                "device"
            )


def traced_with_forwarding(fn: Any, structs: Sequence[Any]) -> tuple[Any, tuple[Any, ...], Any]:
    """`fn`'s (outputs, residuals) shapes, per residual the position among its arguments of
    the one it returns unchanged, else None (see [Note: residuals kept by reference]), and the
    trace itself (a closed jaxpr, outputs then residuals, flat): one trace."""
    closed, (outs, residuals) = jax.make_jaxpr(fn, return_shape=True)(*structs)
    # (JAX returns no sharding in the shapes of a trace on a mesh of Explicit and Auto axes; the
    # types are in the jaxpr's output avals)
    typed = [_typed(x, a) for x, a in zip([*outs, *residuals], closed.out_avals)]
    outs, residuals = typed[: len(outs)], typed[len(outs) :]
    position = {v: i for i, v in enumerate(closed.jaxpr.invars)}
    forwarded = tuple(
        position.get(v) if isinstance(v, jc.Var) else None
        for v in closed.jaxpr.outvars[len(outs) :]
    )
    return (outs, residuals), forwarded, closed


def _typed(struct: Any, aval: Any) -> Any:
    """`struct` with `aval`'s sharding, where it has none and the aval is typed on a mesh with
    an Explicit axis."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    explicit = mesh is not None and not mesh.empty
    if getattr(struct, "sharding", None) is not None or not explicit:
        return struct
    if jax.sharding.AxisType.Explicit not in mesh.axis_types:
        return struct
    return jax.ShapeDtypeStruct(struct.shape, struct.dtype, sharding=sharding)


def residual_inputs(stage: Stage) -> list[tuple[Any, int | None]]:
    """Each residual of the stage's forward: its aval, and the stage input it is (kept by
    reference, see [Note: residuals kept by reference]), or None for a value the forward
    computes."""
    diff = _diff(stage)
    mesh, shardings = _explicit_types(stage)

    def fn(*inputs: Any) -> tuple[list[Any], list[Any]]:
        outputs, leaves, _ = _forward(stage, diff, inputs)
        return outputs, leaves

    with on_abstract_mesh(mesh):
        (_, residuals), forwarded, _ = traced_with_forwarding(fn, _structs(stage, shardings))
    return list(zip(residuals, _by_reference(stage, forwarded)))


# [Note: stages traced with Explicit axes]
# With Explicit mesh axes the step is traced typed (the batch over `data`, parameters as they
# are sharded), and a custom derivative's rule is traced then, at those types: `jax.nn.relu`'s
# JVP holds a zero typed like its input. A stage derived from its jaxpr on untyped inputs meets
# that zero with an untyped tangent, and JAX refuses the `select` ("select cases must have the
# same shardings"; a cotangent's type assertion elsewhere). So a stage's backward is derived at
# the types its jaxpr was traced with, under the trace's abstract mesh (`_explicit_types`); the
# executables are then compiled on the stage's own mesh of the same shape and axes.


def _explicit_types(stage: Stage) -> tuple[Any, list[Any] | None]:
    """The abstract mesh and input shardings `stage` was traced with, if any of its mesh's axes
    is Explicit; else (None, None) (see [Note: stages traced with Explicit axes])."""
    shardings = [getattr(a, "sharding", None) for a in stage.jaxpr.in_avals]
    for sharding in shardings:
        mesh = getattr(sharding, "mesh", None)
        types = getattr(mesh, "axis_types", ())
        if mesh is not None and not mesh.empty and jax.sharding.AxisType.Explicit in types:
            return mesh, shardings
    return None, None


def _structs(stage: Stage, shardings: Sequence[Any] | None) -> list[Any]:
    """The stage's inputs as `ShapeDtypeStruct`s, typed with `shardings` where given."""
    shardings = shardings or [None] * len(stage.jaxpr.in_avals)
    return [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
        for a, sh in zip(stage.jaxpr.in_avals, shardings)
    ]


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
    out_avals = stage.jaxpr.out_avals
    diff = _diff(stage)
    kept = _differentiated(stage)
    float_outputs = tuple(i for i in kept if _is_float(out_avals[i]))
    holder: dict[str, Any] = {}

    def traced_forward(*inputs: Any) -> tuple[list[Any], list[Any]]:
        outputs, leaves, treedef = _forward(stage, diff, inputs, reduced, reduced_inputs)
        holder["treedef"] = treedef
        return outputs, leaves

    mesh = None
    if in_shardings is None:  # (see [Note: stages traced with Explicit axes])
        mesh, in_shardings = _explicit_types(stage)
    with on_abstract_mesh(mesh):
        (out_structs, residual_structs), forwarded, traced = traced_with_forwarding(
            traced_forward, _structs(stage, in_shardings)
        )
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
    with on_abstract_mesh(mesh):
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
        traced,
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
