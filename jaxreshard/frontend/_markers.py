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
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from jaxreshard._jax_compat import new_jaxpr

# -- stage_boundary -----------------------------------------------------------------------------

stage_boundary_p = jex_core.Primitive("stage_boundary")
stage_boundary_p.multiple_results = True
stage_boundary_p.def_impl(lambda *xs: list(xs))
stage_boundary_p.def_abstract_eval(lambda *avals: list(avals))
mlir.register_lowering(stage_boundary_p, lambda ctx, *xs: list(xs))


def _mark_nonzero(values: Sequence[Any]) -> list[Any]:
    """Apply the marker to the values that are not symbolic zeros; keep the zeros."""
    present = [v for v in values if not isinstance(v, ad.Zero)]
    marked = iter(stage_boundary_p.bind(*present) if present else [])
    return [v if isinstance(v, ad.Zero) else next(marked) for v in values]


def _boundary_jvp(primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    return stage_boundary_p.bind(*primals), _mark_nonzero(tangents)


def _boundary_transpose(cts: Sequence[Any], *args: Any) -> list[Any]:
    return _mark_nonzero(cts)


ad.primitive_jvps[stage_boundary_p] = _boundary_jvp
ad.primitive_transposes[stage_boundary_p] = _boundary_transpose
batching.primitive_batchers[stage_boundary_p] = lambda args, dims: (
    stage_boundary_p.bind(*args),
    dims,
)


def stage_boundary(x: Any) -> Any:
    """Mark the end of a pipeline stage: return `x` (any pytree of arrays) unchanged.

    Everything the loss computes before the first boundary is stage 0, between the first and
    the second stage 1, and so on. Outside `jaxreshard.parallelize` this is the identity (also
    under `jax.jit`, `jax.grad` and `jax.vmap`).
    """
    leaves, treedef = jax.tree.flatten(x)
    if not leaves:
        return x
    return jax.tree.unflatten(treedef, stage_boundary_p.bind(*leaves))


# -- pipeline_grad ------------------------------------------------------------------------------

pipeline_grad_p = jex_core.Primitive("pipeline_grad")
pipeline_grad_p.multiple_results = True


def _pipeline_grad_impl(*args: Any, jaxpr: Any, num_diff: int) -> list[Any]:
    loss_fn = jex_core.jaxpr_as_fun(jaxpr)

    def loss(diff: list[Any]) -> Any:
        (value,) = loss_fn(*diff, *args[num_diff:])
        return value

    value, grads = jax.value_and_grad(loss)(list(args[:num_diff]))
    return [value, *grads]


def _pipeline_grad_abstract_eval(*avals: Any, jaxpr: Any, num_diff: int) -> list[Any]:
    return [jaxpr.out_avals[0], *avals[:num_diff]]


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
    (the loss, a scalar mean over the batch) is pipelined over the micro-batches and the
    gradients are accumulated before the rest of the step sees them.
    """
    plain = jax.value_and_grad(fun, argnums, has_aux, holomorphic, allow_int, **kwargs)

    @functools.wraps(fun)
    def wrapped(*args: Any) -> tuple[Any, Any]:
        if not _is_tracing_pipeline():
            return plain(*args)
        if has_aux or holomorphic or allow_int or kwargs:
            raise NotImplementedError(
                "inside jaxreshard.parallelize, jr.value_and_grad supports the plain form only "
                "(no has_aux, holomorphic, allow_int or other options); return extra metrics "
                "from the step instead"
            )
        value, grads = _bind_pipeline_grad(fun, _argnums(argnums), args)
        return value, (grads[0] if isinstance(argnums, int) else grads)

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
        return both(*args)[1]

    return wrapped


def _bind_pipeline_grad(
    fun: Callable[..., Any], argnums: tuple[int, ...], args: tuple[Any, ...]
) -> tuple[Any, tuple[Any, ...]]:
    """Bind `pipeline_grad` for `fun` at `args`; return the loss and a tuple of gradients."""
    for i in argnums:
        if not 0 <= i < len(args):
            raise ValueError(
                f"jr.value_and_grad(argnums={argnums}) but the loss was called with "
                f"{len(args)} arguments"
            )
    diff = tuple(args[i] for i in argnums)
    rest = tuple(a for i, a in enumerate(args) if i not in argnums)
    diff_leaves, diff_tree = jax.tree.flatten(diff)
    rest_leaves, rest_tree = jax.tree.flatten(rest)

    def loss_of_leaves(*leaves: Any) -> Any:
        d = jax.tree.unflatten(diff_tree, leaves[: len(diff_leaves)])
        r = jax.tree.unflatten(rest_tree, leaves[len(diff_leaves) :])
        it_d, it_r = iter(d), iter(r)
        full = [next(it_d) if i in argnums else next(it_r) for i in range(len(args))]
        return fun(*full)

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
    out = jaxpr.out_avals
    if (
        len(out) != 1
        or out[0].shape != ()
        or not jax.numpy.issubdtype(out[0].dtype, jax.numpy.floating)
    ):
        raise ValueError(f"the differentiated loss must return one real scalar; it returns {out}")
    results = pipeline_grad_p.bind(
        *diff_leaves, *rest_leaves, *consts, jaxpr=jaxpr, num_diff=len(diff_leaves)
    )
    return results[0], jax.tree.unflatten(diff_tree, results[1:])
