"""The arguments of a parallelized step: which leaves are the batch, what a compiled step
depends on of each leaf (its cache key), the specs a stage compiles them with."""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxreshard._jax_compat import axis_type_names, plain_array_types
from jaxreshard.comm._layout import normalized_spec
from jaxreshard.frontend._trace import is_array
from jaxreshard.runtime.step._specs import batch_spec, spec_of, transplant_spec


def _check_argnums(argnums: Any, name: str = "batch_argnums") -> tuple[int, ...]:
    """`batch_argnums` (or `donate_argnums`) as a tuple of ints (an int alone is one; None is
    none)."""
    what = {
        "batch_argnums": "the arguments that hold the batch, e.g. batch_argnums=(2,)",
        "donate_argnums": "the arguments whose buffers the step may reuse, e.g. "
        "donate_argnums=(0, 1)",
    }[name]
    if argnums is None:
        return ()
    items = (argnums,) if _is_int(argnums) else argnums
    if isinstance(items, (str, bytes)) or not isinstance(items, (tuple, list)):
        raise TypeError(
            f"parallelize({name}={argnums!r}) takes an int or a tuple of ints: the positions of "
            f"{what}"
        )
    bad = [i for i in items if not _is_int(i)]
    if bad:
        raise TypeError(
            f"parallelize({name}={argnums!r}): {bad[0]!r} is not an argument position; give "
            f"ints: the positions of {what}"
        )
    if len(set(items)) != len(items):
        raise ValueError(f"parallelize({name}={argnums!r}) repeats a position")
    return tuple(int(i) for i in items)


def _jax_dtype(dtype: np.dtype) -> bool:
    try:
        jax.dtypes.canonicalize_dtype(dtype)
        return jax.numpy.issubdtype(dtype, jax.numpy.number) or dtype == np.bool_
    except (TypeError, ValueError):
        return False


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_mesh_list(meshes: Any) -> list[Mesh] | None:
    """`meshes` as a list of `jax.sharding.Mesh`es (None: the config's stage meshes)."""
    if meshes is None:
        return None
    if isinstance(meshes, Mesh):
        raise TypeError(
            "parallelize(meshes=...) takes one Mesh per stage (a list), not one Mesh: e.g. "
            "meshes=[mesh0, mesh1]"
        )
    if isinstance(meshes, (str, bytes)) or not isinstance(meshes, (list, tuple)):
        raise TypeError(
            f"parallelize(meshes={meshes!r}) takes a list of jax.sharding.Mesh, one per stage"
        )
    if not meshes:
        raise ValueError("parallelize(meshes=[]) gives no mesh; give one Mesh per stage, or None")
    for i, mesh in enumerate(meshes):
        if not isinstance(mesh, Mesh):
            raise TypeError(
                f"parallelize(meshes=...): meshes[{i}] is {type(mesh).__name__} ({mesh!r}), not a "
                "jax.sharding.Mesh; build one with jax.make_mesh(shape, names, devices=...)"
            )
    return list(meshes)


def likely_batch_argnum(args: tuple[Any, ...], num_micro_batches: int) -> int | None:
    """The argument that looks like a batch: the last one whose array leaves all share one
    dim 0 size that `num_micro_batches` divides, a size that no other such argument has (the
    parameters' leaves seldom all share a dim 0; a parameter argument that does, with the
    batch's size, leaves no answer). None if there is none."""
    rows: dict[int, int] = {}
    for i, arg in enumerate(args):
        leaves = [x for x in jax.tree.leaves(arg) if is_array(x)]
        if not leaves or any(x.ndim == 0 for x in leaves):
            continue
        sizes = {int(x.shape[0]) for x in leaves}
        n = sizes.pop()
        if not sizes and n >= num_micro_batches and n % num_micro_batches == 0:
            rows[i] = n
    for i in sorted(rows, reverse=True):
        if list(rows.values()).count(rows[i]) == 1:
            return i
    return None


def _arg_name(fun: Callable[..., Any], i: int) -> str:
    """` (`name`)` for positional parameter `i` of `fun`, if its signature tells."""
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return ""
    if i < len(params) and params[i].kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        return f" (`{params[i].name}`)"
    return ""


def _batch_leaf_indices(args: tuple[Any, ...], batch_argnums: Sequence[int]) -> list[int]:
    out, at = [], 0
    norm = {i % len(args) for i in batch_argnums} if args else set()
    for i, arg in enumerate(args):
        n = len(jax.tree.leaves(arg))
        if i in norm:
            out.extend(range(at, at + n))
        at += n
    return out


_STATIC = object()  # marks a static leaf in a cache key


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def _leaf_paths(args: tuple[Any, ...]) -> list[str]:
    paths, _ = jax.tree_util.tree_flatten_with_path(args)
    return [f"args{jax.tree_util.keystr(path)}" for path, _ in paths]


@functools.lru_cache(maxsize=1024)
def _normalized_leaf_spec(sharding: Any, unit_axes: frozenset[str]) -> tuple[Any, ...]:
    mesh = getattr(sharding, "mesh", None)
    sizes = dict(getattr(mesh, "shape", None) or {})
    ones = {a: 1 for a in unit_axes if sizes.get(a) == 1}
    return normalized_spec(spec_of(sharding), ones)


def signature(leaves: Sequence[Any], unit_axes: frozenset[str]) -> tuple[list[Any], list[Any]]:
    """Each leaf's part of a compiled step's key (`_leaf_key` for an array, the value for a
    static leaf), and the array leaves: one pass, asked at every call."""
    key: list[Any] = []
    arrays: list[Any] = []
    plain = _PLAIN_ARRAYS
    for x in leaves:
        if type(x) in plain or is_array(x):
            sharding = getattr(x, "sharding", None)
            key.append((x.shape, x.dtype, _normalized_leaf_spec(sharding, unit_axes)))
            arrays.append(x)
        else:
            key.append((_STATIC, x))
    return key, arrays


_PLAIN_ARRAYS = plain_array_types()


def _leaf_key(x: Any, unit_axes: frozenset[str] = frozenset()) -> tuple[Any, ...]:
    """What the compiled step depends on of one leaf: shape, dtype and PartitionSpec (an
    unsharded leaf counts as replicated, so host arrays and the step's own outputs share one
    compile). Shardings are few and hashable: their specs are looked up, not rebuilt.
    Specs are normalised (`normalized_spec`): `P('model', None)` as placed and `P('model')` as
    XLA returns the step's outputs are one sharding, and so are `P('data')` and `P()` when
    'data' has one device on the leaf's mesh and on every stage mesh (`unit_axes`); they must
    not compile the step twice. An axis of one device on the leaf's mesh but more on a stage's
    keeps its name: the step would shard over it."""
    return (x.shape, x.dtype, _normalized_leaf_spec(getattr(x, "sharding", None), unit_axes))


def mesh_axis_types(meshes: Sequence[Mesh]) -> tuple[str, ...]:
    """The axis types (`auto` / `explicit`) the stage meshes share (tracing needs one set)."""
    first = axis_type_names(meshes[0])
    for s, mesh in enumerate(meshes):
        if tuple(mesh.axis_names) != tuple(meshes[0].axis_names) or axis_type_names(mesh) != first:
            raise ValueError(
                f"parallelize(meshes=...): stage mesh {s} has axes {tuple(mesh.axis_names)} of "
                f"types {axis_type_names(mesh)} but stage mesh 0 has {tuple(meshes[0].axis_names)}"
                f" of types {first}; every stage mesh needs the same axis names and types"
            )
    return first


def typed_specs(
    leaves: Sequence[Any], batch_leaves: Sequence[int], sizes: dict[str, int], config: Any
) -> list[Any]:
    """Every leaf's PartitionSpec as a stage will compile it: the batch over `batch_axis` (per
    micro-batch), other leaves as they are sharded, where that fits (else replicated)."""
    batch = set(batch_leaves)
    m = config.num_micro_batches
    out = []
    for i, leaf in enumerate(leaves):
        shape = tuple(leaf.shape)
        if i in batch:
            out.append(batch_spec(sizes, (shape[0] // m, *shape[1:]), config.batch_axis))
        else:
            out.append(transplant_spec(spec_of(getattr(leaf, "sharding", None)), sizes, shape))
    return out


class BatchArgnumsWarning(UserWarning):
    """`num_micro_batches > 1` but no `batch_argnums`: nothing is split into micro-batches, so
    every micro-batch computes the step on the whole input (the result equals `jax.jit`'s, at
    `num_micro_batches` times the work). The message names the argument that looks like the
    batch and the fix."""


def warn_no_batch(fun: Callable[..., Any], args: tuple[Any, ...], m: int) -> None:
    """Warn that without `batch_argnums` every micro-batch takes the whole input, naming
    the argument that looks like the batch (see `likely_batch_argnum`)."""
    name = getattr(fun, "__name__", "the step")
    guess = likely_batch_argnum(args, m)
    if guess is None:
        hint = (
            "Pass batch_argnums=(i,) naming the arguments that hold the batch (every leaf "
            f"with a batch dim 0 that {m} divides)"
        )
    else:
        rows = next(x for x in jax.tree.leaves(args[guess]) if is_array(x)).shape[0]
        hint = (
            f"Argument {guess}{_arg_name(fun, guess)} looks like the batch (every leaf "
            f"has {rows} rows along dim 0, which no other argument's leaves all share): "
            f"pass batch_argnums=({guess},) to split it"
        )
    warnings.warn(
        f"parallelize({name}) has num_micro_batches={m} but no batch_argnums, so no argument "
        f"is split into micro-batches: each of the {m} micro-batches computes the step on "
        f"the whole input (the result equals jax.jit's, at {m} times the work). {hint}, or "
        "use num_micro_batches=1 if the step has no batch.",
        BatchArgnumsWarning,
        stacklevel=5,
    )


def check_batch(leaves: list[Any], batch_leaves: list[int], paths: list[str], m: int) -> None:
    """Refuse batch leaves that cannot split into `m` micro-batches alike."""
    for i in batch_leaves:
        shape = leaves[i].shape
        if not shape:
            raise ValueError(
                f"batch leaf {paths[i]} is a scalar; every batch leaf needs a batch dim 0 "
                "to split into micro-batches"
            )
        if shape[0] == 0:
            raise ValueError(
                f"batch leaf {paths[i]} has 0 rows along dim 0: an empty batch has no loss "
                "to compute; give at least num_micro_batches rows"
            )
        if shape[0] % m:
            raise ValueError(
                f"batch leaf {paths[i]} has {shape[0]} rows along dim 0, which "
                f"num_micro_batches={m} does not divide; use a batch size that is a "
                f"multiple of {m} (e.g. {shape[0] // m * m or m}) or another micro-batch count"
            )
    rows: dict[int, str] = {}
    for i in batch_leaves:
        rows.setdefault(leaves[i].shape[0], paths[i])
    if len(rows) > 1:
        sizes = ", ".join(f"{path} has {n}" for n, path in sorted(rows.items()))
        raise ValueError(
            f"batch leaves have different sizes along dim 0 ({sizes}); they must agree to "
            "be split into the same micro-batches: give every batch leaf the same rows, or "
            "pass the odd one in an argument outside batch_argnums"
        )
