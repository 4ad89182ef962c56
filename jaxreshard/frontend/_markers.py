"""The user-facing markers: `stage_boundary`, and `grad` / `value_and_grad`.

[Note: markers]
`stage_boundary(x)` is an identity primitive on any pytree. It has an abstract evaluation, an
identity lowering, a JVP that marks the tangents too, a transpose that marks the cotangents (the
matching backward boundary) and a batching rule, so a step with markers runs unchanged under
`jax.jit`, `jax.grad` and `jax.vmap`. `parallelize` cuts the loss's forward at the markers.

`grad` / `value_and_grad` have `jax.grad`'s signature and behave exactly like it, except while
`parallelize` traces a step: then they bind one `pipeline_grad` primitive that carries the loss
function's jaxpr (closure-converted: the batch and other captured values become explicit
inputs) and returns the loss and the gradients. That primitive marks where gradient computation
ends: everything before it in the loss is pipelined per micro-batch, everything after it (the
optimizer) runs once per step on the gradients accumulated over the micro-batches.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from jaxreshard._jax_compat import new_jaxpr
from jaxreshard.frontend._source import caller_location

# -- stage_boundary -----------------------------------------------------------------------------

stage_boundary_p = jex_core.Primitive("stage_boundary")
stage_boundary_p.multiple_results = True
# `transposed`: a marker that JAX's reverse-mode AD made from a user's marker (the matching
# backward boundary). `parallelize` finds a step differentiated by `jax.grad`, Equinox's or Flax
# NNX's grad by these (see `frontend._marked.check_gradient_api`).
# `candidate`: the number of the `stage_candidate` that made the marker, or -1 for a
# `stage_boundary` (see [Note: candidate cuts]): a traced step's markers say which candidates
# they are, also where jit reused a cached trace without running our Python.
stage_boundary_p.def_impl(lambda *xs, **params: list(xs))
stage_boundary_p.def_abstract_eval(lambda *avals, **params: list(avals))
mlir.register_lowering(stage_boundary_p, lambda ctx, *xs, **params: list(xs))


def _mark_nonzero(values: Sequence[Any], transposed: bool, candidate: int) -> list[Any]:
    """Apply the marker to the values that are not symbolic zeros; keep the zeros."""
    present = [v for v in values if not isinstance(v, ad.Zero)]
    marked = iter(
        stage_boundary_p.bind(*present, transposed=transposed, candidate=candidate)
        if present
        else []
    )
    return [v if isinstance(v, ad.Zero) else next(marked) for v in values]


def _boundary_jvp(
    primals: Sequence[Any], tangents: Sequence[Any], *, transposed: bool, candidate: int
) -> tuple[list[Any], list[Any]]:
    return (
        stage_boundary_p.bind(*primals, transposed=transposed, candidate=candidate),
        _mark_nonzero(tangents, transposed, candidate),
    )


def _boundary_transpose(
    cts: Sequence[Any], *args: Any, transposed: bool, candidate: int
) -> list[Any]:
    return _mark_nonzero(cts, True, candidate)


ad.primitive_jvps[stage_boundary_p] = _boundary_jvp
ad.primitive_transposes[stage_boundary_p] = _boundary_transpose
batching.primitive_batchers[stage_boundary_p] = lambda args, dims, **params: (
    stage_boundary_p.bind(*args, **params),
    dims,
)


def stage_boundary(x: Any) -> Any:
    """Mark the end of a pipeline stage: return `x` (any pytree of arrays) unchanged.

    Everything the loss computes before the first boundary is stage 0, between the first and
    the second stage 1, and so on. Outside `jaxreshard.parallelize` this is the identity (also
    under `jax.jit`, `jax.grad` and `jax.vmap`).
    """
    return _boundary(x, "forced")


def _boundary(x: Any, kind: Any) -> Any:
    """Bind the marker on `x`'s leaves; record `kind` ("forced", or a candidate's number) while
    candidates are being chosen (see [Note: candidate cuts])."""
    leaves, treedef = jax.tree.flatten(x)
    if not leaves:
        return x
    candidate = -1 if kind == "forced" else int(kind)
    marked = stage_boundary_p.bind(*leaves, transposed=False, candidate=candidate)
    return jax.tree.unflatten(treedef, marked)


# -- stage_candidate ----------------------------------------------------------------------------

# [Note: candidate cuts]
# `stage_candidate(x)` marks where a stage *may* end. It is the identity, except while
# `parallelize` traces a step with a choice of cuts (`candidate_cuts`): then the candidates whose
# number (in the order the loss reaches them, from 0, counted afresh in every trace) is chosen
# become `stage_boundary` markers and the others stay the identity. The choice comes from
# `PipelineConfig(cuts=...)`, or from the automatic partitioner (`partition="auto"`), which
# first traces with every candidate chosen to cost each segment and each cut
# (`runtime/step/_partition.py`). A Python-level marker, not a primitive: the loss is traced
# afresh for every choice, so nothing of an unchosen candidate reaches the jaxpr.


def stage_candidate(x: Any) -> Any:
    """Mark where a pipeline stage *may* end: return `x` (any pytree of arrays) unchanged.

    `PipelineConfig(partition="auto", num_stages=S)` chooses S - 1 of the candidates as stage
    boundaries by the simulated step time (each segment's measured compute, each cut's transfer
    under the cluster model); `PipelineConfig(cuts=(i, j))` chooses candidates `i` and `j`
    (numbered from 0 in the order the loss reaches them). `jr.stage_boundary` stays a forced
    cut. Outside such a step this is the identity (also under `jax.jit` and `jax.grad`).
    """
    chosen = getattr(_state, "cuts", None)
    if chosen is None:
        return x
    if getattr(_state, "scan_body", 0) > 0:
        from jaxreshard.frontend._jaxprs import PipelineSplitError

        raise PipelineSplitError(
            f"{caller_location()}: jr.stage_candidate inside the body of a jr.scan: the body is "
            "traced once for all its iterations, so it cannot say after which one a stage ends; "
            "jr.scan's iterations are candidates already (candidate_every= thins them), so drop "
            "this one, or mark it outside the scan"
        )
    n = _state.candidates
    _state.candidates = n + 1
    return _boundary(x, n) if (chosen == "all" or n in chosen) else x


@contextlib.contextmanager
def candidate_cuts(cuts: Any) -> Iterator[None]:
    """While active, the `stage_candidate` markers numbered in `cuts` (a set of ints, or "all")
    are stage boundaries. `None` leaves every candidate the identity."""
    previous = (getattr(_state, "cuts", None), getattr(_state, "candidates", 0))
    _state.cuts = None if cuts is None else (cuts if cuts == "all" else frozenset(cuts))
    _state.candidates = 0
    try:
        yield
    finally:
        _state.cuts, _state.candidates = previous


def restart_candidates() -> None:
    """Number the candidates from 0 again (each trace of the step counts them afresh)."""
    _state.candidates = 0


def candidate_count() -> int:
    """How many `stage_candidate` markers the current trace reached so far."""
    return getattr(_state, "candidates", 0)


# -- pipeline_grad ------------------------------------------------------------------------------

pipeline_grad_p = jex_core.Primitive("pipeline_grad")
pipeline_grad_p.multiple_results = True


def _pipeline_grad_impl(*args: Any, jaxpr: Any, num_diff: int, num_aux: int) -> list[Any]:
    loss_fn = jex_core.jaxpr_as_fun(jaxpr)

    def loss(diff: list[Any]) -> tuple[Any, list[Any]]:
        value, *aux = loss_fn(*diff, *args[num_diff:])
        return value, aux

    (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(list(args[:num_diff]))
    return [value, *grads, *aux]


def _pipeline_grad_abstract_eval(*avals: Any, jaxpr: Any, num_diff: int, num_aux: int):
    return [jaxpr.out_avals[0], *avals[:num_diff], *jaxpr.out_avals[1:]]


pipeline_grad_p.def_impl(_pipeline_grad_impl)
pipeline_grad_p.def_abstract_eval(_pipeline_grad_abstract_eval)
mlir.register_lowering(pipeline_grad_p, mlir.lower_fun(_pipeline_grad_impl, multiple_results=True))

_state = threading.local()


@contextlib.contextmanager
def tracing_pipeline() -> Iterator[None]:
    """While active, `grad`/`value_and_grad` bind `pipeline_grad` instead of differentiating."""
    previous = getattr(_state, "active", False)
    _state.active = True
    try:
        yield
    finally:
        _state.active = previous


def _is_tracing_pipeline() -> bool:
    return getattr(_state, "active", False)


def _argnums(argnums: int | Sequence[int]) -> tuple[int, ...]:
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
    **kwargs: Any,
) -> Callable[..., tuple[Any, Any]]:
    """`jax.value_and_grad`, which also tells `parallelize` where gradients end.

    Same signature and results as `jax.value_and_grad`. Inside a `parallelize`d step, `fun`
    (the loss, a scalar mean over the batch, or a sum with `loss_reduction="sum"`) is pipelined
    over the micro-batches and the gradients are accumulated before the rest of the step sees
    them. With `has_aux=True`, `fun` returns `(loss, aux)` for any pytree `aux` of arrays; each
    micro-batch computes its own, and the step sees them combined as `jax.jit` would compute
    them on the whole batch: leaves with a batch dimension are concatenated along it in batch
    order, leaves that depend on the batch without one (metrics) are reduced the way the loss
    is (averaged, or summed with `loss_reduction="sum"`), and leaves that do not depend on the
    batch (a Flax NNX RNG count) are taken as they are.
    """
    plain = jax.value_and_grad(fun, argnums, has_aux, holomorphic, allow_int, **kwargs)

    @functools.wraps(fun)
    def wrapped(*args: Any) -> tuple[Any, Any]:
        if not _is_tracing_pipeline():
            return plain(*args)
        if holomorphic or allow_int or kwargs:
            options = ["holomorphic"] * holomorphic + ["allow_int"] * allow_int + list(kwargs)
            raise NotImplementedError(
                f"{caller_location()}: inside jaxreshard.parallelize, jr.value_and_grad does not "
                f"take {options}; "
                "differentiate real floating-point parameters (has_aux=True is supported)"
            )
        value, grads, aux = _bind_pipeline_grad(fun, _argnums(argnums), args, has_aux)
        grads = grads[0] if isinstance(argnums, int) else grads
        return ((value, aux) if has_aux else value), grads

    return wrapped


def grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
    **kwargs: Any,
) -> Callable[..., Any]:
    """`jax.grad`, which also tells `parallelize` where gradients end (see `value_and_grad`)."""
    both = value_and_grad(fun, argnums, has_aux, holomorphic, allow_int, **kwargs)

    @functools.wraps(fun)
    def wrapped(*args: Any) -> Any:
        value, grads = both(*args)
        return (grads, value[1]) if has_aux else grads

    return wrapped


def _is_inexact_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) and bool(
        jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)
    )


def filter_value_and_grad(
    fun: Callable[..., Any], *, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """`equinox.filter_value_and_grad` for `parallelize`: differentiate `fun` with respect to the
    floating-point arrays of its first argument (an Equinox module, say); its other leaves
    (functions, ints, non-float arrays) are held fixed.

    Returns `(value, grads)` like Equinox: `grads` has the first argument's structure, with
    `None` where a leaf is not differentiated. It is written with `jr.value_and_grad`, so it
    runs as `jax.value_and_grad` outside `parallelize` and is pipelined inside it.
    """

    @functools.wraps(fun)
    def wrapped(x: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        leaves, treedef = jax.tree.flatten(x)
        diff = [_is_inexact_array(leaf) for leaf in leaves]

        def on_diff(values: list[Any]) -> Any:
            it = iter(values)
            full = [next(it) if d else leaf for leaf, d in zip(leaves, diff)]
            return fun(jax.tree.unflatten(treedef, full), *args, **kwargs)

        chosen = [leaf for leaf, d in zip(leaves, diff) if d]
        value, grads = value_and_grad(on_diff, has_aux=has_aux)(chosen)
        it = iter(grads)
        return value, jax.tree.unflatten(treedef, [next(it) if d else None for d in diff])

    return wrapped


def filter_grad(fun: Callable[..., Any], *, has_aux: bool = False) -> Callable[..., Any]:
    """`equinox.filter_grad` for `parallelize` (see `filter_value_and_grad`)."""
    both = filter_value_and_grad(fun, has_aux=has_aux)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        value, grads = both(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapped


def _is_value(x: Any) -> bool:
    """An array (or tracer) or a Python number: what a traced function may return."""
    return isinstance(x, (jax.Array, jax.core.Tracer, np.ndarray, np.generic, int, float, complex))


def _bind_pipeline_grad(
    fun: Callable[..., Any], argnums: tuple[int, ...], args: tuple[Any, ...], has_aux: bool
) -> tuple[Any, tuple[Any, ...], Any]:
    """Bind `pipeline_grad` for `fun` at `args`; return the loss, a tuple of gradients and the
    aux pytree (None without `has_aux`)."""
    for i in argnums:
        if not 0 <= i < len(args):
            raise ValueError(
                f"{caller_location()}: jr.value_and_grad(argnums={argnums}) but the loss was "
                f"called with {len(args)} arguments; argnums picks the loss's arguments to "
                f"differentiate, from 0 to {len(args) - 1}"
            )
    diff = tuple(args[i] for i in argnums)
    rest = tuple(a for i, a in enumerate(args) if i not in argnums)
    diff_leaves, diff_tree = jax.tree.flatten(diff)
    all_rest, rest_tree = jax.tree.flatten(rest)
    # The other arguments' traced values are operands; their other leaves (a config object, an
    # int that picks a code path, a concrete array) stay as they are, as jax.grad passes them.
    operand = [isinstance(leaf, jax.core.Tracer) for leaf in all_rest]
    rest_leaves = [leaf for leaf, o in zip(all_rest, operand) if o]
    for i, leaf in enumerate(diff_leaves):
        if not _is_inexact_array(leaf):
            paths = [
                jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(diff)[0]
            ]
            raise TypeError(
                f"{caller_location()}: jr.value_and_grad differentiates argument leaf {paths[i]} "
                "of type "
                f"{type(leaf).__name__} ({getattr(leaf, 'dtype', '')}); jax.grad takes "
                "floating-point arrays only. For a model with other leaves (an Equinox module), "
                "use jr.filter_value_and_grad, as eqx.filter_value_and_grad"
            )
    aux_tree: list[Any] = []

    def loss_of_leaves(*leaves: Any) -> list[Any]:
        d = jax.tree.unflatten(diff_tree, leaves[: len(diff_leaves)])
        given = iter(leaves[len(diff_leaves) :])
        r = jax.tree.unflatten(
            rest_tree, [next(given) if o else leaf for leaf, o in zip(all_rest, operand)]
        )
        it_d, it_r = iter(d), iter(r)
        full = [next(it_d) if i in argnums else next(it_r) for i in range(len(args))]
        out = fun(*full)
        if not has_aux:
            if not _is_value(out):
                pair = isinstance(out, tuple) and len(out) == 2
                raise TypeError(
                    f"{caller_location()}: the loss given to jr.value_and_grad returns a "
                    f"{type(out).__name__}, not one real scalar"
                    + (
                        "; for a loss that returns (loss, aux), pass has_aux=True"
                        if pair
                        else "; return a mean or a sum over the batch"
                    )
                )
            return [out]
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                f"{caller_location()}: jr.value_and_grad(..., has_aux=True): the loss must return "
                "a pair "
                f"(loss, aux), not {type(out).__name__}"
            )
        aux_leaves, tree = jax.tree.flatten(out[1])
        for path, leaf in jax.tree_util.tree_flatten_with_path(out[1])[0]:
            if not _is_value(leaf):
                raise TypeError(
                    f"{caller_location()}: jr.value_and_grad(..., has_aux=True): aux leaf "
                    f"{jax.tree_util.keystr(path) or '(the aux)'} is a {type(leaf).__name__}; "
                    "the aux must be a pytree of arrays (return other values outside the loss)"
                )
        aux_tree.append(tree)
        return [out[0], *aux_leaves]

    # Values the loss closes over that belong to the enclosing trace (a batch captured by a
    # lambda, a learning-rate schedule's step) become extra operands, of any dtype; concrete
    # arrays stay constants of the loss. (`jax.closure_convert` hoists only float values.)
    traced = jax.make_jaxpr(loss_of_leaves)(*diff_leaves, *rest_leaves)
    inner = traced.jaxpr
    hoist = [i for i, c in enumerate(traced.consts) if isinstance(c, jax.core.Tracer)]
    keep = [i for i in range(len(traced.consts)) if i not in hoist]
    consts = [traced.consts[i] for i in hoist]
    jaxpr = jex_core.ClosedJaxpr(
        new_jaxpr(
            [inner.constvars[i] for i in keep],
            [*inner.invars, *(inner.constvars[i] for i in hoist)],
            inner.outvars,
            inner.eqns,
            "loss",
        ),
        [traced.consts[i] for i in keep],
    )
    out = jaxpr.out_avals[0]
    if out.shape != () or not jax.numpy.issubdtype(out.dtype, jax.numpy.floating):
        raise ValueError(
            f"{caller_location()}: the loss given to jr.value_and_grad must return one real "
            f"scalar (a mean or a sum over the batch); it returns {out}"
        )
    num_aux = len(jaxpr.out_avals) - 1
    results = pipeline_grad_p.bind(
        *diff_leaves,
        *rest_leaves,
        *consts,
        jaxpr=jaxpr,
        num_diff=len(diff_leaves),
        num_aux=num_aux,
    )
    grads = jax.tree.unflatten(diff_tree, results[1 : 1 + len(diff_leaves)])
    aux = jax.tree.unflatten(aux_tree[0], results[1 + len(diff_leaves) :]) if has_aux else None
    return results[0], grads, aux
