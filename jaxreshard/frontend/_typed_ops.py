"""Typed-trace rules JAX lacks, for gradients reduced once (see [Note: gradients reduced once] in
`runtime/step/_reduction.py`).

[Note: convolutions with reduced weights]
A stage whose gradients stay unreduced is traced on an Explicit mesh with its parameters cast to
`reduced` over the batch axes. JAX has no reduced/unreduced rule for `conv_general_dilated`
(jax 0.10.2 and 0.12: "unreduced/reduced rule for conv_general_dilated is not implemented"), so
a convolution's weight would make the whole stage fall back to a reduction per micro-batch.
`conv_with_reduced_weight` is that rule for the case a data-parallel stage has: the input split
over the reduced axes along its batch dimension only, the weight whole. Its forward is the same
convolution of the weight as a plain replicated value (reduced is a type, not a different
value: no communication). Its backward computes the input's cotangent as JAX does, and the
weight's inside a `shard_map` over the mesh: each device transposes the convolution over its
own rows and returns that term of the sum, typed `unreduced` over the axes, which is exactly
what a reduced weight's cotangent is. No all-reduce is compiled; the accumulator sums the terms
and the stage's `reduce` executable sums them across devices once a step. Anything else (a
split weight, an input split on another dimension, `batch_group_count > 1`) is left to JAX,
whose refusal the plan reports as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def _spec(x: Any) -> Any:
    try:
        return jax.typeof(x).sharding.spec
    except (AttributeError, TypeError):
        return None


def _entry_axes(entry: Any) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _plain(spec: P) -> P:
    return spec.update(reduced=frozenset(), unreduced=frozenset())


def conv_with_reduced_weight(eqn: Any, values: Sequence[Any], mesh: Any) -> list[Any] | None:
    """`eqn` (a `conv_general_dilated`) bound to `values` with the weight's cotangent left
    `unreduced` (see [Note: convolutions with reduced weights]); None where the rule does not
    apply (the caller binds the primitive as JAX would)."""
    if eqn.primitive.name != "conv_general_dilated" or len(values) != 2:
        return None
    lhs, rhs = values
    lspec, rspec = _spec(lhs), _spec(rhs)
    if lspec is None or rspec is None or not rspec.reduced or lspec.reduced or lspec.unreduced:
        return None
    params = dict(eqn.params)
    if params.get("batch_group_count", 1) != 1 or rspec.unreduced:
        return None
    if any(_entry_axes(e) for e in rspec.partitions):
        return None  # (a split weight: model parallelism, not this rule's)
    axes = frozenset(rspec.reduced)
    batch = params["dimension_numbers"].lhs_spec[0]
    for d, entry in enumerate(lspec.partitions):
        split = set(_entry_axes(entry))
        if (d == batch and not split <= axes) or (d != batch and split):
            return None
    rank = len(jax.typeof(rhs).shape)
    conv = jax.lax.conv_general_dilated_p

    def bind(x: Any, w: Any) -> Any:
        return conv.bind(x, w, **params)

    @jax.custom_vjp
    def convolve(x: Any, w: Any) -> Any:
        return bind(x, jax.reshard(w, _plain(rspec)))

    def forward(x: Any, w: Any) -> tuple[Any, tuple[Any, Any]]:
        return convolve(x, w), (x, w)

    def backward(res: tuple[Any, Any], g: Any) -> tuple[Any, Any]:
        x, w = res
        whole = jax.reshard(w, _plain(rspec))
        (dx,) = jax.vjp(lambda x: bind(x, whole), x)[1](g)

        def local(xl: Any, gl: Any) -> Any:
            zero = jax.lax.pcast(jnp.zeros(whole.shape, whole.dtype), tuple(axes), to="varying")
            term = jax.vjp(lambda w: bind(xl, w), zero)[1](gl)[0]
            return jax.lax.pcast(term, tuple(axes), to="unreduced")

        dw = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(_plain(_spec(x)), _plain(_spec(g))),
            out_specs=P(*(None,) * rank, unreduced=axes),
        )(x, g)
        return dx, dw

    convolve.defvjp(forward, backward)
    return [convolve(lhs, rhs)]
