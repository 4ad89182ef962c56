"""Typed-trace rules JAX lacks, for gradients reduced once (see [Note: gradients reduced once] in
`runtime/step/_reduction.py`).

[Note: convolutions with reduced weights]
A stage whose gradients stay unreduced is traced on an Explicit mesh with its parameters cast to
`reduced` over the batch axes. JAX has no reduced/unreduced rule for `conv_general_dilated`
(jax 0.10.2 and 0.12: "unreduced/reduced rule for conv_general_dilated is not implemented"), so
a convolution's weight would make the whole stage fall back to a reduction per micro-batch.
`conv_with_reduced_weight` is that rule, for the convolutions data- and tensor-parallel stages
have: the input split over exactly the reduced axes along its batch dimension (an input whole
over one of them would make every device's term the whole gradient, counted once per device:
JAX refuses that case for its own ops, and so do we); the weight whole, or
split over other (model) axes by its output channels, or by its input channels with the input's
feature dimension split the same way (JAX asks for an `out_sharding` there even in the forward).
The convolution runs inside a `shard_map` over the mesh. Forward: each device convolves its rows
with its part of the weight, and a split of the input channels adds the devices' terms (`psum`
over those axes, as the Auto program's all-reduce does). Backward: each device transposes its
convolution; a split of the output channels adds the input cotangent's terms; the weight's
cotangent is each device's term over its own rows, typed `unreduced` over the reduced axes,
which is exactly what a reduced weight's cotangent is. No weight-gradient all-reduce is
compiled; the accumulator sums the terms and the stage's `reduce` executable sums them across
devices once a step. Anything else (split spatial dimensions, `batch_group_count > 1`, a
grouped convolution with a split weight) is left to JAX, whose refusal the plan reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jaxreshard._jax_compat import on_abstract_mesh


def typed_spec(x: Any) -> Any:
    """`x`'s PartitionSpec in a typed trace; None for a Python or NumPy scalar."""
    try:
        return jax.typeof(x).sharding.spec
    except (AttributeError, TypeError):
        return None


def _entry_axes(entry: Any) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def plain(spec: P) -> P:
    """A PartitionSpec without `reduced`/`unreduced` axes (nor, on jax >= 0.12, their kind)."""
    return P(*spec.partitions)


def without_size_one_axes(x: Any) -> Any:
    """`x` typed with no dim split over a mesh axis of size 1 (a stage mesh's (2, 1) `model`,
    say). The layout is the same; only the type changes. JAX (0.10-0.12) keeps such an axis on
    a dim that slicing leaves of size 1 (`qkv[:, :, 0]` of a `model`-split projection), then
    types the cotangent of a `squeeze` or `broadcast_in_dim` of it without the split and
    refuses its own gradient as the wrong cotangent type; it refuses a `cumsum`, `tile` or
    `take` along that dim outright, and a `dynamic_update_slice` of an update typed one way
    into an operand typed the other. The typed trace reshards every operand so first (and the
    operands of control flow, whose bodies it evaluates: a scan's carry must come out typed as
    it went in): the ops see no size-1 axis at all, and the reshard's transpose types each
    cotangent back."""
    spec, aval = typed_spec(x), getattr(x, "aval", None)
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if spec is None or mesh is None or not spec.partitions:
        return x
    sizes = dict(mesh.shape)
    kept, changed = [], False
    for entry in spec.partitions:
        axes = _entry_axes(entry)
        wide = tuple(a for a in axes if sizes.get(a, 1) > 1)
        changed |= wide != axes
        kept.append(None if not wide else wide[0] if len(wide) == 1 else wide)
    return jax.reshard(x, spec.update(partitions=tuple(kept))) if changed else x


def conv_with_reduced_weight(eqn: Any, values: Sequence[Any], mesh: Any) -> list[Any] | None:
    """`eqn` (a `conv_general_dilated`) bound to `values` with the weight's cotangent left
    `unreduced` (see [Note: convolutions with reduced weights]); None where the rule does not
    apply (the caller binds the primitive as JAX would)."""
    if eqn.primitive.name != "conv_general_dilated" or len(values) != 2:
        return None
    lhs, rhs = values
    lspec, rspec = typed_spec(lhs), typed_spec(rhs)
    if lspec is None or rspec is None or not rspec.reduced or lspec.reduced or lspec.unreduced:
        return None
    params = dict(eqn.params)
    if params.get("batch_group_count", 1) != 1 or rspec.unreduced:
        return None
    dn = params["dimension_numbers"]
    axes = frozenset(rspec.reduced)
    lsplit = _dim_axes(lspec, len(jax.typeof(lhs).shape))
    rsplit = _dim_axes(rspec, len(jax.typeof(rhs).shape))
    batch, feature, *spatial = dn.lhs_spec
    out_f, in_f, *kernel = dn.rhs_spec
    model_in, model_out = rsplit[in_f], rsplit[out_f]
    if (
        lsplit[batch] != axes  # (rows whole over a reduced axis: each device's term is all)
        or any(lsplit[d] or rsplit[k] for d, k in zip(spatial, kernel))
        or lsplit[feature] != model_in
        or (model_in | model_out) & axes
        or model_in & model_out
        or ((model_in or model_out) and params.get("feature_group_count", 1) != 1)
    ):
        return None
    out_spec = [None] * len(dn.out_spec)
    out_spec[dn.out_spec[0]] = _entry(lspec.partitions[batch] if lsplit[batch] else None)
    out_spec[dn.out_spec[1]] = _entry(rspec.partitions[out_f] if model_out else None)
    x_in, w_in, y_out = plain(lspec), plain(rspec), P(*out_spec)
    conv = jax.lax.conv_general_dilated_p

    def bind(x: Any, w: Any) -> Any:
        return conv.bind(x, w, **params)

    def local_forward(x: Any, w: Any) -> Any:
        y = bind(*_varying(x, w))
        return jax.lax.psum(y, tuple(sorted(model_in))) if model_in else y

    def local_backward(x: Any, w: Any, g: Any) -> tuple[Any, Any]:
        x, w, g = _varying(x, w, g)
        _, vjp = jax.vjp(bind, x, w)
        dx, dw = vjp(g)
        if model_out:  # (each device's output channels add a term to the input's cotangent)
            dx = jax.lax.psum(dx, tuple(sorted(model_out)))
        return dx, jax.lax.pcast(dw, tuple(sorted(axes)), to="unreduced")

    def spread(fn: Any, ins: tuple[Any, ...], outs: Any) -> Any:
        return jax.shard_map(fn, mesh=mesh, in_specs=ins, out_specs=outs)

    @jax.custom_vjp
    def convolve(x: Any, w: Any) -> Any:
        return spread(local_forward, (x_in, w_in), y_out)(x, jax.reshard(w, w_in))

    def forward(x: Any, w: Any) -> tuple[Any, tuple[Any, Any]]:
        return convolve(x, w), (x, w)

    def backward(res: tuple[Any, Any], g: Any) -> tuple[Any, Any]:
        x, w = res
        dw_spec = P(*w_in.partitions, unreduced=axes)
        args = (x, jax.reshard(w, w_in), jax.reshard(g, y_out))
        # Two programs, not one: a split backward (ZB-H1, weight delay) keeps the input's
        # cotangent in B and can hold the weight's back to W (each drops the other's half).
        ins = (x_in, w_in, y_out)
        dx = spread(lambda *a: local_backward(*a)[0], ins, x_in)(*args)
        dw = spread(lambda *a: local_backward(*a)[1], ins, dw_spec)(*args)
        return dx, dw

    convolve.defvjp(forward, backward)
    return [convolve(lhs, rhs)]


def _mesh_size(mesh: Any, axes: frozenset[str]) -> int:
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    return size


def _varying(*xs: Any) -> list[Any]:
    """`xs` (inside a `shard_map`) cast to vary over the same mesh axes, as JAX's convolution
    wants its operands."""
    vma = [_varying_axes(x) for x in xs]
    every = frozenset().union(*vma)
    return [
        jax.lax.pcast(x, tuple(sorted(every - v)), to="varying") if every - v else x
        for x, v in zip(xs, vma)
    ]


def _varying_axes(x: Any) -> frozenset[str]:
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # (jax 0.10: ManualAxisType(varying=...))
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def _dim_axes(spec: P, rank: int) -> list[frozenset[str]]:
    """The mesh axes `spec` splits each of `rank` dims over."""
    parts = list(spec.partitions) + [None] * (rank - len(spec.partitions))
    return [frozenset(_entry_axes(e)) for e in parts]


def _entry(entry: Any) -> Any:
    return tuple(entry) if isinstance(entry, list) else entry


def reshape_unaligned(eqn: Any, values: Sequence[Any]) -> list[Any] | None:
    """A `reshape` JAX refuses on an Explicit mesh ("This reshape is not supported"): each
    split input dimension keeps its split on the output dimension it becomes the major part
    of, where that dimension's size divides by it; an unaligned one is gathered (the Auto
    program moves the same data) and split again on the first dimension of its group that
    divides by it (not the minor one), a slice of what each device holds. That is where XLA's
    propagation puts it on the Auto mesh (a fused qkv projection split over `model`, reshaped
    to (3, heads, head_dim): the heads); left whole, every device would compute every head.
    None where `eqn` is not such a reshape."""
    if eqn.primitive.name != "reshape" or eqn.params.get("dimensions") is not None:
        return None
    (x,) = values[:1]
    spec = typed_spec(x)
    if spec is None or spec.reduced or spec.unreduced:  # (the reshard below would drop them)
        return None
    shape = tuple(jax.typeof(x).shape)
    new = tuple(eqn.params["new_sizes"])
    parts = list(spec.partitions) + [None] * (len(shape) - len(spec.partitions))
    out: list[Any] = [None] * len(new)
    moved: list[Any] = [None] * len(new)  # (splits placed after the gather)
    if 0 in shape:
        return None
    # Walk both shapes, pairing groups of dims whose products agree.
    i = j = 0
    while i < len(shape) and j < len(new):
        gi, gj = [i], [j]
        pi, pj = shape[i], new[j]
        while pi != pj:
            if pi < pj:
                i += 1
                gi.append(i)
                pi *= shape[i]
            else:
                j += 1
                gj.append(j)
                pj *= new[j]
        split = [(d, parts[d]) for d in gi if parts[d] is not None]
        if len(split) == 1 and split[0][0] == gi[0]:
            entry = split[0][1]
            size = _axes_size(entry)
            if new[gj[0]] % size == 0 and (len(gi) == 1 or len(gj) == 1):
                out[gj[0]] = entry
            elif len(gi) == 1:  # (gathered, then split again where it divides; not the
                # group's minor dim, a head's own features, which a matmul would contract)
                d = next((d for d in gj[:-1] if new[d] % size == 0), None)
                if d is not None:
                    moved[d] = entry
        i += 1
        j += 1
    y = jax.lax.reshape(x, new, out_sharding=P(*out))
    if any(e is not None for e in moved):
        y = jax.reshard(y, P(*[o if m is None else m for o, m in zip(out, moved)]))
    return [y]


def reshape_of_reduced(eqn: Any, values: Sequence[Any]) -> list[Any] | None:
    """A `reshape` that only adds or drops size-1 dims of an operand typed `reduced` or
    `unreduced` (Flax's `Linear` shapes its bias so, to add it over the batch dims): JAX's
    rule reads such a spec as a plain one and fails ("Using *pspec is dangerous", jax 0.10.2).
    Each dim keeps its split, and the value keeps its type. None for any other equation."""
    if eqn.primitive.name != "reshape" or eqn.params.get("dimensions") is not None:
        return None
    (x,) = values[:1]
    spec = typed_spec(x)
    if spec is None or not (spec.reduced or spec.unreduced):
        return None
    shape, new = tuple(jax.typeof(x).shape), tuple(eqn.params["new_sizes"])
    if [n for n in shape if n != 1] != [n for n in new if n != 1]:
        return None
    parts = list(spec.partitions) + [None] * (len(shape) - len(spec.partitions))
    kept = iter(p for n, p in zip(shape, parts) if n != 1)
    out = [None if n == 1 else next(kept) for n in new]
    return [jax.lax.reshape(x, new, out_sharding=spec.update(partitions=tuple(out)))]


def _axes_size(entry: Any) -> int:
    mesh = jax.sharding.get_abstract_mesh()
    size = 1
    for a in _entry_axes(entry):
        size *= mesh.shape[a]
    return size


def custom_jvp_retyped(eqn: Any, values: Sequence[Any], run: Any) -> list[Any] | None:
    """A `custom_jvp_call` (`jax.nn.relu`, `jax.nn.softplus`, `logsumexp`, ...) bound again with
    its body and its JVP rule evaluated by `run(jaxpr, consts, args)` (the typed trace's own
    interpreter), or None for any other equation. Both were traced on the step's own mesh, and
    JAX refuses to bind them as they are among operands typed on the Explicit one; evaluating the
    body alone would drop the rule (relu's gradient at 0 would become JAX's 0.5 for `max`). The
    rule's closed-over constants (its first `num_consts` operands) are never differentiated, as
    JAX's own JVP of the call leaves them, and neither are operands that are constants of the
    trace (a literal `0.0`): their tangents are zeros made here, on the typed trace's mesh."""
    if eqn.primitive.name != "custom_jvp_call":
        return None
    body, rule = eqn.params["call_jaxpr"], eqn.params["jvp_jaxpr_fun"]
    consts = list(values[: eqn.params["num_consts"]])
    operands = list(values[len(consts) :])
    traced = [i for i, v in enumerate(operands) if isinstance(v, jax.core.Tracer)]

    def full(args: Sequence[Any], constant: Any = lambda v: v) -> list[Any]:
        """The operands with the traced ones replaced by `args`, and each constant by
        `constant(it)`."""
        given = dict(zip(traced, args))
        return [given[i] if i in given else constant(v) for i, v in enumerate(operands)]

    def zeros(v: Any) -> Any:
        return jax.numpy.zeros(jax.numpy.shape(v), jax.numpy.result_type(v))

    @jax.custom_jvp
    def call(*args: Any) -> list[Any]:
        return run(body.jaxpr, body.consts, [*consts, *full(args)])

    def jvp(primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        with _traced_on(body.in_avals):  # (the rule is traced on its first call)
            jaxpr, rule_consts, zero = rule.call_wrapped(*[False] * len(operands))
        out = run(jaxpr, rule_consts, [*full(primals), *full(tangents, zeros)])
        outs, nonzero = out[: len(zero)], iter(out[len(zero) :])
        return outs, [jax.numpy.zeros_like(o) if z else next(nonzero) for o, z in zip(outs, zero)]

    call.defjvp(jvp)
    return list(call(*[operands[i] for i in traced]))


def _traced_on(avals: Sequence[Any]) -> Any:
    """A context of the mesh `avals` were typed on (the step's own), where JAX traces a custom
    rule for them; no change where they name none."""
    for aval in avals:
        mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty:
            return on_abstract_mesh(mesh)
    return on_abstract_mesh(None)


# Unary elementwise primitives (their derivative is diagonal).
_UNARY = frozenset({
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "sinh",
    "cosh", "asin", "acos", "atan", "asinh", "acosh", "atanh", "sqrt", "rsqrt", "cbrt",
    "integer_pow", "square", "abs", "neg", "sign", "erf", "erfc", "erf_inv", "lgamma",
    "digamma", "floor", "ceil", "round", "reduce_precision", "convert_element_type",
})  # fmt: skip


def elementwise_of_reduced(eqn: Any, values: Sequence[Any], bind: Any) -> list[Any] | None:
    """A unary elementwise op JAX has no reduced rule for ("unreduced/reduced rule for
    integer_pow is not implemented": `w ** 3`, an L2 term's `w ** 2`) applied to a `reduced`
    parameter, or None where `eqn` is not one. The op runs on the
    parameter's plain value and its result is cast `reduced` again (free: the value is whole on
    every device). Its cotangent comes `unreduced` (each device a term), and so must the
    parameter's: each term times the op's derivative, a `reduced` factor, is a term of the
    parameter's cotangent, the sum JAX would all-reduce. `bind(values)`: the equation bound."""
    traced = [i for i, v in enumerate(values) if isinstance(v, jax.core.Tracer)]
    if eqn.primitive.name not in _UNARY or eqn.primitive.multiple_results or len(traced) != 1:
        return None
    (at,) = traced
    spec = typed_spec(values[at])
    shape = jax.typeof(values[at]).shape
    out = eqn.outvars[0].aval
    if spec is None or not spec.reduced or spec.unreduced or tuple(out.shape) != tuple(shape):
        return None
    if not jax.numpy.issubdtype(out.dtype, jax.numpy.inexact):
        return None
    axes = frozenset(spec.reduced)

    def op(x: Any) -> Any:
        return bind([x if i == at else v for i, v in enumerate(values)])[0]

    def whole(x: Any) -> Any:
        return jax.reshard(x, plain(spec))

    def as_reduced(y: Any) -> Any:
        return jax.reshard(y, P(*typed_spec(y).partitions, reduced=axes))

    @jax.custom_vjp
    def apply(x: Any) -> Any:
        return as_reduced(op(whole(x)))

    def forward(x: Any) -> tuple[Any, Any]:
        return apply(x), x

    def backward(x: Any, g: Any) -> tuple[Any]:
        y, vjp = jax.vjp(op, whole(x))
        (slope,) = vjp(jax.numpy.ones_like(y))  # (elementwise: the diagonal of its Jacobian)
        return ((g * as_reduced(slope)).astype(jax.typeof(x).dtype),)

    apply.defvjp(forward, backward)
    return [apply(values[at])]
