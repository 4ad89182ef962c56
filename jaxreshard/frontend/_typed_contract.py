"""Typed-trace rules for contractions and lookups JAX refuses on an Explicit mesh (the shared
helpers are in `_typed_ops`).

[Note: refusals an Explicit mesh adds]
Tracing a stage on an Explicit mesh also meets ops that JAX refuses there but compiles on the
stage's own (Auto) mesh, whatever the parameters' types. Each rule below gives what the Auto
program computes, laid out as it would be:
- a matmul contracting dimensions split over the same axes ("Contracting dimensions are sharded
  ... specify the output sharding": the row-parallel projection of a tensor-parallel layer): a
  `shard_map` in which each device multiplies its parts and the terms are summed over the
  contracted axes (the Auto program's all-reduce); an operand's cotangent sums its terms over
  the axes that split the other operand's rows, or stays `unreduced` over its reduced axes. A
  contracted dimension split on one side only (JAX does not refuse it: it gathers that side,
  GPT's row-parallel weights every micro-batch) takes the same rule with the other side sliced
  alike, free since it is whole there, as XLA's Auto partitioner does;
- a gather whose indices are split ("Use `.at[...].get(out_sharding=)`": an embedding lookup of
  a data-split batch): a `shard_map` in which each device looks up its own rows in its copy of
  the table; its backward scatters the rows' cotangents into a term of the table's gradient.
  The terms are summed over the indices' axes (the Auto program's all-reduce), except those a
  `reduced` table is reduced over: there the term is typed `unreduced`, as the convolution
  rule's is (the indices must be split over every reduced axis, for the same reason). A table
  split along a looked-up dim (vocabulary-parallel) is looked up masked: each device answers
  for its own rows, zero elsewhere, and the answers are summed. Out-of-bounds indices come out
  as JAX's: `clip` and a promise of bounds clamp first (XLA clamps a gather's start index),
  `fill` fills after the sum, and only `clip` sends their gradient to a row (JAX's scatter
  drops the others). Splits over several axes must match in order, not only as sets;
- a reshape that is not aligned with its input's splits (`reshape_unaligned`);
- a reshape that adds size-1 dims to a `reduced` parameter (Flax's `Linear` bias, shaped to
  add over the batch dims), whose spec JAX's rule reads as a plain one and fails on
  (`reshape_of_reduced`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jaxreshard.frontend._typed_ops import (
    _dim_axes,
    _entry,
    _entry_axes,
    _mesh_size,
    _varying,
    plain,
    reshape_of_reduced,
    reshape_unaligned,
    typed_spec,
)


def gather_by_split_indices(eqn: Any, values: Sequence[Any], mesh: Any) -> list[Any] | None:
    """`eqn`, a `gather` JAX refused on an Explicit mesh, bound to `values` in a `shard_map`
    (see [Note: refusals an Explicit mesh adds]); None where the rule does not apply."""
    if eqn.primitive.name != "gather" or len(values) != 2:
        return None
    table, idx = values
    tspec, ispec = typed_spec(table), typed_spec(idx)
    if tspec is None or ispec is None or tspec.unreduced or ispec.reduced or ispec.unreduced:
        return None
    params = dict(eqn.params)
    dn = params["dimension_numbers"]
    mode = params.get("mode")
    mode_name = getattr(mode, "name", str(mode))
    if mode_name not in ("CLIP", "FILL_OR_DROP", "PROMISE_IN_BOUNDS"):
        return None
    shape = tuple(jax.typeof(table).shape)
    trank, irank = len(shape), len(jax.typeof(idx).shape)
    tsplit, isplit = _dim_axes(tspec, trank), _dim_axes(ispec, irank)
    tbatch, ibatch = tuple(dn.operand_batching_dims), tuple(dn.start_indices_batching_dims)
    collapsed, index_map = set(dn.collapsed_slice_dims), tuple(dn.start_index_map)
    sizes = list(params["slice_sizes"])
    by_index = tuple(d for d in index_map if tsplit[d])  # (dims looked up across devices)
    rows = frozenset().union(*(isplit[d] for d in range(irank - 1) if d not in ibatch))
    looked_up = frozenset().union(*(tsplit[d] for d in by_index))
    reduced = frozenset(tspec.reduced)
    if (
        isplit[-1]  # (the index vector itself split)
        or any(_axes_of(tspec, a) != _axes_of(ispec, b) for a, b in zip(tbatch, ibatch))
        or not reduced <= rows  # (rows whole over a reduced axis: each device's term is all)
        or frozenset().union(*tsplit) & rows
        or any(sizes[d] != 1 or d not in collapsed for d in by_index)
        or any(
            tsplit[d] and d not in by_index + tbatch and sizes[d] != shape[d] for d in range(trank)
        )
        or any(d in collapsed and tsplit[d] and d not in by_index for d in range(trank))
    ):
        return None
    offsets = iter(d for d in range(trank) if d not in collapsed and d not in tbatch)
    batch = iter(range(irank - 1))
    out_spec: list[Any] = []
    for o in range(irank - 1 + trank - len(collapsed) - len(tbatch)):
        spec, d = (tspec, next(offsets)) if o in dn.offset_dims else (ispec, next(batch))
        out_spec.append(_entry(spec.partitions[d]) if d < len(spec.partitions) else None)
    local = dict(params)
    if by_index:  # (masked rows all read local row 0: neither unique nor sorted any more)
        local["unique_indices"] = local["indices_are_sorted"] = False
    local["slice_sizes"] = tuple(
        size if d in by_index + tbatch else size // _mesh_size(mesh, tsplit[d])
        for d, size in enumerate(sizes)
    )
    t_in, i_in, y_out = plain(tspec), plain(ispec), P(*out_spec)
    summed = tuple(sorted(rows - reduced))
    fill = params.get("fill_value")

    def core(t: Any, i: Any, clamp: bool) -> tuple[Any, Any]:
        """This device's part of the lookup, and where it holds the rows looked up; `clamp`:
        out-of-bounds indices clamped first (else they are nobody's rows)."""
        mine = jax.numpy.ones(i.shape[:-1], bool)
        columns = []
        for k, d in enumerate(index_map):
            column = i[..., k]
            if d in by_index:
                if clamp:
                    column = jax.numpy.clip(column, 0, shape[d] - 1)
                n = shape[d] // _mesh_size(mesh, tsplit[d])
                first = jax.lax.axis_index(_ordered_axes(tsplit[d], tspec)) * n
                column = column - first.astype(column.dtype)
                here = (column >= 0) & (column < n)
                mine = mine & here
                column = jax.numpy.where(here, column, 0)
            columns.append(column)
        y = eqn.primitive.bind(t, jax.numpy.stack(columns, -1), **local)
        return y, jax.numpy.expand_dims(mine, tuple(dn.offset_dims))

    def in_bounds(i: Any) -> Any:
        ok = jax.numpy.ones(i.shape[:-1], bool)
        for k, d in enumerate(index_map):
            if d in by_index:
                ok = ok & (i[..., k] >= 0) & (i[..., k] < shape[d])
        return jax.numpy.expand_dims(ok, tuple(dn.offset_dims))

    def masked(t: Any, i: Any, clamp: bool) -> Any:
        y, ok = core(t, i, clamp)
        return jax.numpy.where(ok, y, jax.numpy.zeros((), y.dtype))

    def local_forward(t: Any, i: Any) -> Any:
        given = i
        t, i = _varying(t, i)
        if not by_index:
            return eqn.primitive.bind(t, i, **local)
        # (XLA clamps an out-of-bounds start index of a gather, `clip` or promised in bounds)
        y = jax.lax.psum(masked(t, i, mode_name != "FILL_OR_DROP"), tuple(sorted(looked_up)))
        if mode_name == "FILL_OR_DROP":  # (out of bounds: the fill value, as JAX's gather)
            value = _fill_value(y.dtype) if fill is None else fill
            y = jax.numpy.where(in_bounds(given), y, jax.numpy.asarray(value, y.dtype))
        return y

    def local_backward(t: Any, i: Any, g: Any) -> Any:
        t, i, g = _varying(t, i, g)
        if by_index:  # (its scatter drops out-of-bounds updates unless it clips, as JAX's does)
            fn = lambda t: masked(t, i, mode_name == "CLIP")
        else:
            fn = lambda t: eqn.primitive.bind(t, i, **local)
        _, vjp = jax.vjp(fn, t)
        (dt,) = vjp(g)
        dt = jax.lax.psum(dt, summed) if summed else dt
        return jax.lax.pcast(dt, tuple(sorted(reduced)), to="unreduced") if reduced else dt

    def spread(fn: Any, ins: tuple[Any, ...], outs: Any) -> Any:
        return jax.shard_map(fn, mesh=mesh, in_specs=ins, out_specs=outs)

    @jax.custom_vjp
    def look_up(t: Any, i: Any) -> Any:
        return spread(local_forward, (t_in, i_in), y_out)(jax.reshard(t, t_in), i)

    def forward(t: Any, i: Any) -> tuple[Any, tuple[Any, Any]]:
        return look_up(t, i), (t, i)

    def backward(res: tuple[Any, Any], g: Any) -> tuple[Any, None]:
        t, i = res
        dt_spec = P(*t_in.partitions, unreduced=reduced)
        dt = spread(local_backward, (t_in, i_in, y_out), dt_spec)(
            jax.reshard(t, t_in), i, jax.reshard(g, y_out)
        )
        return dt, None

    look_up.defvjp(forward, backward)
    return [look_up(table, idx)]


def _fill_value(dtype: Any) -> Any:
    """What JAX's gather fills out-of-bounds lookups with when given no fill value."""
    if jax.numpy.issubdtype(dtype, jax.numpy.inexact):
        return jax.numpy.nan
    if jax.numpy.issubdtype(dtype, jax.numpy.signedinteger):
        return jax.numpy.iinfo(dtype).min
    if jax.numpy.issubdtype(dtype, jax.numpy.unsignedinteger):
        return jax.numpy.iinfo(dtype).max
    return True


def _ordered_axes(axes: frozenset[str], spec: P) -> Any:
    """`axes` as `spec` names them (a split over several axes is major first)."""
    order = _ordered(axes, spec)
    return order[0] if len(order) == 1 else tuple(order)


def dot_contracting_split(eqn: Any, values: Sequence[Any]) -> list[Any] | None:
    """A `dot_general` JAX refuses on an Explicit mesh because both operands split a contracted
    dimension, bound to `values` in a `shard_map` (see [Note: refusals an Explicit mesh adds]):
    each device multiplies its parts and the terms are summed over the contracted axes, as the
    Auto program does; an operand's cotangent sums its terms over the axes that split the other
    operand's free dimensions, except those the operand is `reduced` over, where it stays
    `unreduced`. None where the rule does not apply. Call under the stage's abstract mesh."""
    if eqn.primitive.name != "dot_general" or len(values) != 2:
        return None
    lhs, rhs = values
    lspec, rspec = typed_spec(lhs), typed_spec(rhs)
    if lspec is None or rspec is None or lspec.unreduced or rspec.unreduced:
        return None
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lrank, rrank = len(jax.typeof(lhs).shape), len(jax.typeof(rhs).shape)
    lsplit, rsplit = _dim_axes(lspec, lrank), _dim_axes(rspec, rrank)
    lfree = [d for d in range(lrank) if d not in set(lc) | set(lb)]
    rfree = [d for d in range(rrank) if d not in set(rc) | set(rb)]
    lred, rred = frozenset(lspec.reduced), frozenset(rspec.reduced)
    # A contracted dim split on one side only: the other side's is sliced alike (it is whole
    # over those axes, so each device takes its part with no transfer), as the Auto program
    # does; JAX on an Explicit mesh gathers the split side instead (a weight, each micro-batch).
    lparts = list(lspec.partitions) + [None] * (lrank - len(lspec.partitions))
    rparts = list(rspec.partitions) + [None] * (rrank - len(rspec.partitions))
    for a, b in zip(lc, rc):
        if bool(lsplit[a]) != bool(rsplit[b]):
            if (lsplit[a] | rsplit[b]) & (lred | rred):
                return None
            lparts[a] = rparts[b] = lparts[a] or rparts[b]  # (the split side's axes, in order)
            lsplit[a] = rsplit[b] = lsplit[a] | rsplit[b]
    lspec = P(*lparts, reduced=lspec.reduced)
    rspec = P(*rparts, reduced=rspec.reduced)
    summed = frozenset().union(*(lsplit[d] for d in lc))
    free_l = frozenset().union(*(lsplit[d] for d in lfree))
    free_r = frozenset().union(*(rsplit[d] for d in rfree))
    batch = frozenset().union(*(lsplit[d] for d in lb))
    groups = [summed, free_l, free_r, batch]
    if (
        not summed
        or any(_axes_of(lspec, a) != _axes_of(rspec, b) for a, b in zip(lc, rc))
        or any(_axes_of(lspec, a) != _axes_of(rspec, b) for a, b in zip(lb, rb))
        or sum(len(g) for g in groups) != len(frozenset().union(*groups))  # (an axis twice)
        or not lred <= free_r  # (a reduced operand's term must be split by the other's rows)
        or not rred <= free_l
    ):
        return None
    out = [_entry(lspec.partitions[d]) if d < len(lspec.partitions) else None for d in lb]
    out += [_entry(lspec.partitions[d]) if d < len(lspec.partitions) else None for d in lfree]
    out += [_entry(rspec.partitions[d]) if d < len(rspec.partitions) else None for d in rfree]
    l_in, r_in, y_out = plain(lspec), plain(rspec), P(*out)
    params = dict(eqn.params)
    params.pop("out_sharding", None)
    contracted = tuple(sorted(summed))

    def bind(x: Any, w: Any) -> Any:
        return jax.lax.dot_general_p.bind(x, w, **params, out_sharding=None)

    def local_forward(x: Any, w: Any) -> Any:
        return jax.lax.psum(bind(*_varying(x, w)), contracted)

    def local_backward(x: Any, w: Any, g: Any) -> tuple[Any, Any]:
        x, w, g = _varying(x, w, g)
        _, vjp = jax.vjp(bind, x, w)
        dx, dw = vjp(g)
        return _term(dx, free_r, lred), _term(dw, free_l, rred)

    def spread(fn: Any, ins: tuple[Any, ...], outs: Any) -> Any:
        mesh = jax.sharding.get_abstract_mesh()
        return jax.shard_map(fn, mesh=mesh, in_specs=ins, out_specs=outs)

    @jax.custom_vjp
    def multiply(x: Any, w: Any) -> Any:
        return spread(local_forward, (l_in, r_in), y_out)(
            jax.reshard(x, l_in), jax.reshard(w, r_in)
        )

    def forward(x: Any, w: Any) -> tuple[Any, tuple[Any, Any]]:
        return multiply(x, w), (x, w)

    def backward(res: tuple[Any, Any], g: Any) -> tuple[Any, Any]:
        x, w = res
        outs = (P(*l_in.partitions, unreduced=lred), P(*r_in.partitions, unreduced=rred))
        args = (jax.reshard(x, l_in), jax.reshard(w, r_in), jax.reshard(g, y_out))
        # (two programs, so that a split backward can hold the weight's cotangent back to W)
        ins = (l_in, r_in, y_out)
        dx = spread(lambda *a: local_backward(*a)[0], ins, outs[0])(*args)
        dw = spread(lambda *a: local_backward(*a)[1], ins, outs[1])(*args)
        # (a side sliced for the product gets its cotangent laid out as the side itself)
        return _laid_as(dx, x, lred), _laid_as(dw, w, rred)

    multiply.defvjp(forward, backward)
    return [multiply(lhs, rhs)]


def dot_split_on_one_side(eqn: Any, values: Sequence[Any]) -> list[Any] | None:
    """`dot_contracting_split` for a `dot_general` whose contracted dims are split on one side
    only (which JAX binds by gathering that side); None for any other equation. Call under the
    stage's abstract mesh."""
    if eqn.primitive.name != "dot_general" or len(values) != 2:
        return None
    specs = [typed_spec(v) for v in values]
    if any(spec is None for spec in specs):
        return None
    (lc, rc), _ = eqn.params["dimension_numbers"]
    lsplit, rsplit = (_dim_axes(sp, len(jax.typeof(v).shape)) for sp, v in zip(specs, values))
    if not any(bool(lsplit[a]) != bool(rsplit[b]) for a, b in zip(lc, rc)):
        return None
    return dot_contracting_split(eqn, values)


def _axes_of(spec: P, d: int) -> tuple[str, ...]:
    """The mesh axes `spec` splits dim `d` over, in order (major first)."""
    return _entry_axes(spec.partitions[d]) if d < len(spec.partitions) else ()


def _laid_as(ct: Any, primal: Any, reduced: frozenset[str]) -> Any:
    want = plain(typed_spec(primal))
    want = P(*want.partitions, unreduced=reduced) if reduced else want
    return ct if typed_spec(ct) == want else jax.reshard(ct, want)


def _term(ct: Any, other_rows: frozenset[str], reduced: frozenset[str]) -> Any:
    """An operand's cotangent from its device's term: summed over the axes the other operand's
    free dimensions are split over, left `unreduced` over the operand's reduced axes."""
    summed = tuple(sorted(other_rows - reduced))
    ct = jax.lax.psum(ct, summed) if summed else ct
    return jax.lax.pcast(ct, tuple(sorted(reduced)), to="unreduced") if reduced else ct


def _ordered(axes: frozenset[str], *specs: P) -> list[str]:
    """`axes` in the order the specs name them (a split over several axes is major first)."""
    order = [a for spec in specs for e in spec.partitions for a in _entry_axes(e)]
    return sorted(axes, key=lambda a: order.index(a) if a in order else len(order))


def on_refusal(eqn: Any, values: Sequence[Any], error: Exception) -> list[Any] | None:
    """The rule for an equation JAX refused on an Explicit mesh with `error`, bound to
    `values` (see [Note: refusals an Explicit mesh adds]); None where none applies. Call under
    the stage's abstract mesh."""
    text = str(error)
    if "reshape is not supported" in text:
        return reshape_unaligned(eqn, values)
    if "Using *pspec is dangerous" in text and eqn.primitive.name == "reshape":
        return reshape_of_reduced(eqn, values)
    if "Contracting dimensions are sharded" in text:
        return dot_contracting_split(eqn, values)
    if eqn.primitive.name == "gather":
        return gather_by_split_indices(eqn, values, jax.sharding.get_abstract_mesh())
    return None
