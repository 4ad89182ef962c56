"""Random draws per micro-batch that equal the whole batch's draw.

[Note: random draws]
Under `jax.jit`, `jax.random.bernoulli(key, p, (B, d))` draws B rows. A pipelined step traces the
loss per micro-batch, where the same call draws (B/m, d): left alone, every micro-batch would
get the same rows (the first B/m of a smaller draw), and dropout masks would repeat. So the step
is traced twice, at the whole batch and per micro-batch (`frontend._trace`), the k-th draw
(`random_bits` or `random_split`, in program order, nested jaxprs included) of one trace is
paired with the k-th of the other, and the one dim whose size is m times smaller per
micro-batch is the draw's batch dim. Each such draw is rewritten to give micro-batch i exactly
rows [i * B/m, (i + 1) * B/m) of the whole draw along that dim, reading the micro-batch index
from an extra int32 input (`Ref(MB)`) of the stages that draw.

With JAX's partitionable threefry (the default since jax 0.5), every element's bits are the
threefry hash of the key and the element's index in the whole draw's shape, so a micro-batch
hashes only the indices its own rows have in the whole draw: no micro-batch computes more bits
than it uses. Another PRNG implementation, or partitionable threefry switched off, draws the
whole shape and slices the micro-batch's rows out: exact, at m times the bits.

A draw whose shape has no batch dim (a key split into two, a draw sized by the model) is the same
in every micro-batch, as under `jax.jit`. A draw whose shapes differ in several dims, or by another
factor, or whose keys are themselves batched along with a batched shape, raises
`PipelineSplitError` naming it: it is never repeated silently. A draw shaped with the batch dim
merged into another (`(B * T,)`) is taken with the batch dim major, as `x.reshape(B * T)` lays
it out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jc
from jax.extend.random import threefry2x32_p

from jaxreshard._jax_compat import (
    bind_equation,
    scan_counts,
    source_location,
    threefry_partitionable,
)
from jaxreshard.frontend._jaxprs import CALLS, PipelineSplitError, open_jaxpr

DRAWS = ("random_bits", "random_split")


@dataclasses.dataclass(frozen=True)
class Draw:
    """How one draw of the micro-batch trace relates to the whole batch's: its batch dim and
    the whole draw's shape."""

    dim: int
    full_shape: tuple[int, ...]


def draw_equations(jaxpr: Any) -> list[Any]:
    """Every draw equation of `jaxpr`, nested jaxprs included, in program order."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in DRAWS:
            out.append(eqn)
        for sub in jc.jaxprs_in_params(eqn.params):
            out.extend(draw_equations(open_jaxpr(sub)))
    return out


def plan_draws(micro: Any, full: Any, num_micro_batches: int) -> dict[int, Draw]:
    """Pair the draws of a micro-batch trace with the whole batch's (open jaxprs); return the
    batched ones by equation id. Raises `PipelineSplitError` for a draw that cannot be matched."""
    mine, theirs = draw_equations(micro), draw_equations(full)
    fix = (
        "draw with the batch as the leading dim of the shape, e.g. "
        "jax.random.bernoulli(key, p, x.shape) for activations x of shape (batch, ...), or "
        "split one key per example (jax.random.split(key, x.shape[0])) and vmap the draw"
    )
    if len(mine) != len(theirs):
        raise PipelineSplitError(
            f"the step draws random numbers {len(theirs)} times at the whole batch but "
            f"{len(mine)} times per micro-batch; its random code depends on the batch size, so "
            f"the micro-batches' draws cannot be matched to the whole batch's; {fix}"
        )
    plan: dict[int, Draw] = {}
    m = num_micro_batches
    for eqn, ref in zip(mine, theirs):
        name = eqn.primitive.name
        shape, full_shape = tuple(eqn.params["shape"]), tuple(ref.params["shape"])
        where = source_location(eqn)
        if ref.primitive.name != name or len(shape) != len(full_shape):
            raise PipelineSplitError(
                f"`{name}` at {where} draws shape {shape} per micro-batch, but the whole "
                f"batch's trace draws `{ref.primitive.name}` of shape {full_shape} in its place; "
                f"the step's random code depends on the batch size; {fix}"
            )
        dims = [d for d, (a, b) in enumerate(zip(shape, full_shape)) if a != b]
        if not dims:
            continue
        if len(dims) > 1 or full_shape[dims[0]] != m * shape[dims[0]]:
            raise PipelineSplitError(
                f"`{name}` at {where} draws shape {shape} per micro-batch and {full_shape} for the "
                f"whole batch: no single dim is {m} (num_micro_batches) times smaller, so the "
                f"micro-batch's share of the draw is unknown; {fix}"
            )
        if eqn.invars[0].aval.shape:
            raise PipelineSplitError(
                f"`{name}` at {where} draws with a batch of keys {eqn.invars[0].aval.str_short()} "
                f"and a shape {shape} that also grows with the batch; {fix}"
            )
        draw = Draw(dims[0], full_shape)
        if plan.setdefault(id(eqn), draw) != draw:
            raise PipelineSplitError(
                f"`{name}` at {where} is one traced function called with different batch shapes; "
                f"{fix}"
            )
    return plan


def with_micro_batch_index(closed: Any, plan: dict[int, Draw], structs: Sequence[Any]) -> Any:
    """`closed` with one more input, the micro-batch index (int32), and each planned draw
    replaced by micro-batch i's share of the whole draw (see [Note: random draws]). `structs`
    describe `closed`'s inputs for tracing."""
    holders = _holders(closed.jaxpr, plan)

    def run(*args: Any) -> list[Any]:
        *inputs, mb = args
        return _eval(closed.jaxpr, closed.consts, inputs, mb, plan, holders)

    return jax.make_jaxpr(run)(*structs, jax.ShapeDtypeStruct((), np.int32))


def _holders(jaxpr: Any, plan: dict[int, Draw]) -> set[int]:
    """Ids of equations with a planned draw somewhere inside them."""
    out: set[int] = set()

    def visit(j: Any) -> bool:
        found = False
        for eqn in j.eqns:
            inside = any([visit(open_jaxpr(sub)) for sub in jc.jaxprs_in_params(eqn.params)])
            if inside:
                out.add(id(eqn))
            found |= inside or id(eqn) in plan
        return found

    visit(jaxpr)
    return out


def _eval(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    mb: Any,
    plan: dict[int, Draw],
    holders: set[int],
) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jc.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        values = [read(v) for v in eqn.invars]
        if id(eqn) in plan:
            outs = [_draw(eqn, values[0], mb, plan[id(eqn)])]
        elif id(eqn) in holders:
            outs = _call(eqn, values, mb, plan, holders)
        else:
            outs = bind_equation(eqn, values)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _call(
    eqn: Any, values: list[Any], mb: Any, plan: dict[int, Draw], holders: set[int]
) -> list[Any]:
    """Re-trace a higher-order equation whose body draws with the batch dim."""
    name, params = eqn.primitive.name, eqn.params

    def run(closed: Any, *args: Any) -> list[Any]:
        body = open_jaxpr(closed)
        consts = closed.consts if isinstance(closed, jc.ClosedJaxpr) else []
        return _eval(body, consts, args, mb, plan, holders)

    if name in CALLS:
        return run(params.get("jaxpr") or params["call_jaxpr"], *values)
    if name in ("checkpoint", "remat", "remat2"):
        body = params["jaxpr"]
        fn = jax.checkpoint(
            lambda *a: run(body, *a), prevent_cse=params["prevent_cse"], policy=params["policy"]
        )
        return list(fn(*values))
    if name == "scan":
        nc, ncarry = scan_counts(params)
        consts, init, xs = values[:nc], values[nc : nc + ncarry], values[nc + ncarry :]

        def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
            outs = run(params["jaxpr"], *consts, *carry, *x)
            return outs[:ncarry], outs[ncarry:]

        carry, ys = lax.scan(
            step,
            list(init),
            list(xs),
            length=params["length"],
            reverse=params["reverse"],
            unroll=params["unroll"],
        )
        return [*carry, *ys]
    if name == "while":
        cn, bn = params["cond_nconsts"], params["body_nconsts"]
        cconsts, bconsts, init = values[:cn], values[cn : cn + bn], values[cn + bn :]
        out = lax.while_loop(
            lambda c: run(params["cond_jaxpr"], *cconsts, *c)[0],
            lambda c: run(params["body_jaxpr"], *bconsts, *c),
            list(init),
        )
        return list(out)
    if name == "cond":
        index, *ops = values
        branches = [lambda *o, b=b: run(b, *o) for b in params["branches"]]
        return list(lax.switch(index, branches, *ops))
    raise PipelineSplitError(
        f"a random draw with the batch dim runs inside `{name}` at {source_location(eqn)}, "
        "which parallelize cannot re-trace per micro-batch; draw the random numbers outside it "
        "(before a custom_vjp / shard_map) and pass them in"
    )


def _draw(eqn: Any, key: Any, mb: Any, draw: Draw) -> Any:
    """Micro-batch `mb`'s share of a draw of `draw.full_shape` (see [Note: random draws])."""
    name = eqn.primitive.name
    shape = tuple(eqn.params["shape"])
    d, full = draw.dim, draw.full_shape
    impl = jax.random.key_impl(key)
    if threefry_partitionable(eqn) and str(impl) == "threefry2x32":
        data = jax.random.key_data(key)
        hi, lo = iota_2x32_slice(shape, full, d, mb)
        bits1, bits2 = threefry2x32_p.bind(data[0], data[1], hi, lo)
        if name == "random_split":
            return jax.random.wrap_key_data(jnp.stack([bits1, bits2], axis=-1), impl=impl)
        width = eqn.params["bit_width"]
        if width == 64:
            high = lax.convert_element_type(bits1, np.uint64)
            return lax.shift_left(high, np.uint64(32)) | lax.convert_element_type(bits2, np.uint64)
        bits = bits1 ^ bits2
        return bits if width == 32 else lax.convert_element_type(bits, np.dtype(f"uint{width}"))
    params = {**eqn.params, "shape": full}
    whole = bind_equation(eqn.replace(params=params), [key])[0]
    return lax.dynamic_slice_in_dim(whole, mb * shape[d], shape[d], axis=d)


def iota_2x32_slice(shape: Sequence[int], full: Sequence[int], dim: int, mb: Any) -> Any:
    """For every element of micro-batch `mb`'s share (`shape`) of an array of shape `full`, its
    row-major index in `full` (the share is block `mb` along `dim`), as two uint32 arrays (high
    and low words of the 64-bit index), as `jax._src.prng.iota_2x32_shape(full)` numbers the
    whole array."""
    strides = [math.prod(full[j + 1 :]) for j in range(len(full))]
    offset = lax.convert_element_type(mb, np.uint32) * np.uint32(shape[dim])
    index = [lax.broadcasted_iota(np.uint32, tuple(shape), j) for j in range(len(shape))]
    index[dim] = index[dim] + offset
    if math.prod(full) < 2**32:  # every partial sum fits 32 bits: exact
        low = index[0] * np.uint32(strides[0])
        for j in range(1, len(shape)):
            low = low + index[j] * np.uint32(strides[j])
        return jnp.zeros_like(low), low
    hi, lo = _mul_64(index[0], strides[0])
    for j in range(1, len(shape)):
        hi, lo = _add_64((hi, lo), _mul_64(index[j], strides[j]))
    return hi, lo


def _mul_32(a: Any, b: int) -> tuple[Any, Any]:
    """a * b for uint32 `a` and a constant b < 2**32, as (high, low) uint32 words."""
    mask = np.uint32(0xFFFF)
    a0, a1 = a & mask, a >> np.uint32(16)
    b0, b1 = np.uint32(b & 0xFFFF), np.uint32(b >> 16)
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> np.uint32(16)) + (p01 & mask) + (p10 & mask)
    low = (mid << np.uint32(16)) | (p00 & mask)
    high = p11 + (p01 >> np.uint32(16)) + (p10 >> np.uint32(16)) + (mid >> np.uint32(16))
    return high, low


def _mul_64(a: Any, b: int) -> tuple[Any, Any]:
    """a * b mod 2**64 for uint32 `a` and a constant b < 2**64, as (high, low) uint32 words."""
    high, low = _mul_32(a, b & 0xFFFFFFFF)
    return high + a * np.uint32(b >> 32), low


def _add_64(x: tuple[Any, Any], y: tuple[Any, Any]) -> tuple[Any, Any]:
    low = x[1] + y[1]
    carry = lax.convert_element_type(low < x[1], np.uint32)
    return x[0] + y[0] + carry, low
