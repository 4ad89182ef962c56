"""Placing a step's inputs: splitting the batch into micro-batches and moving values onto meshes."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jc
from jax.sharding import Mesh, NamedSharding

from jaxreshard._jax_compat import named_sharding_on, on_another_grid
from jaxreshard.runtime.step._specs import place, spec_of, transplant_spec

# -- placing inputs -----------------------------------------------------------------------------


class FeedSplitter:
    """The batch inputs of every chunk, per micro-batch: each chunk gets each whole feed it
    reads once (moved as a whole, a copy per device where the layouts allow), and one
    executable per chunk cuts all its micro-batches out of them on its mesh. (Cutting first
    and placing each piece cost two JAX calls per piece: most of a tiny pipeline's step.) On
    a mesh that spans processes, each process builds its own shards of each piece from the
    feed instead (`place`): cutting a batch sharded over processes would move rows between
    them.

    Args:
        m: micro-batches per step.
        dims: per feed, the dimension its micro-batches are cut along.
        refs: per chunk, the feed of each of its batch inputs, in input order.
        shardings: per chunk, the sharding of each of its batch inputs (of a micro-batch's
            piece; the whole feed takes the same).
    """

    def __init__(
        self,
        m: int,
        dims: Sequence[int],
        refs: Mapping[int, Sequence[int]],
        shardings: Mapping[int, Sequence[NamedSharding]],
    ):
        self.m, self.dims, self.refs, self.shardings = m, list(dims), dict(refs), shardings
        self._cut = {s: self._cutter(s) for s in self.refs}

    def _cutter(self, s: int) -> Any:
        if not self.refs[s] or not all(sh.is_fully_addressable for sh in self.shardings[s]):
            return None
        m, dims = self.m, [self.dims[f] for f in self.refs[s]]

        def cut(*wholes: Any) -> list[list[Any]]:
            return [
                [
                    jax.lax.slice_in_dim(
                        x, j * (x.shape[d] // m), (j + 1) * (x.shape[d] // m), 1, d
                    )
                    for x, d in zip(wholes, dims)
                ]
                for j in range(m)
            ]

        out = [list(self.shardings[s]) for _ in range(m)]
        return jax.jit(cut, in_shardings=list(self.shardings[s]), out_shardings=out)

    def split(self, values: Mapping[int, Any]) -> dict[int, list[list[Any]]]:
        """Per chunk, per micro-batch, its batch inputs, from the feeds' whole values (by feed
        index)."""
        batches: dict[int, list[list[Any]]] = {}
        for s, refs in self.refs.items():
            if not refs:
                batches[s] = [[] for _ in range(self.m)]
                continue
            if self._cut[s] is None:  # a mesh of several processes: each places its shards
                batches[s] = [
                    [
                        place(_rows(values[f], self.m, j, self.dims[f]), sh)
                        for f, sh in zip(refs, self.shardings[s])
                    ]
                    for j in range(self.m)
                ]
                continue
            placing = Placement()
            wholes = placing.done(
                [_whole_on(values[f], sh, placing) for f, sh in zip(refs, self.shardings[s])]
            )
            # (One micro-batch is the whole feed: nothing to cut.)
            batches[s] = [wholes] if self.m == 1 else self._cut[s](*wholes)
        return batches


def _rows(x: Any, m: int, j: int, dim: int) -> np.ndarray:
    """Micro-batch j of a feed (host data), cut along `dim`."""
    x = np.asarray(x)
    rows = x.shape[dim] // m
    return np.take(x, np.arange(j * rows, (j + 1) * rows), axis=dim)


def _whole_on(x: Any, sharding: NamedSharding, placing: Placement) -> Any:
    """`x` on `sharding`, or where the cutting executable can take it: as it is (a host array
    goes in with the call, which places it faster than `jax.device_put`), by a copy per device
    where each holds what it must, else by `placing` (the batched `jax.device_put`)."""
    from jaxreshard._jax_compat import copy_shards

    if isinstance(x, np.ndarray):
        # (Not where this process is one of several of a distributed runtime, a Ray host of
        # stages spanning hosts: jit refuses host arrays with a non-trivial sharding there,
        # even for a mesh of this process's devices alone.)
        return x if jax.process_count() == 1 else placing.put(x, sharding)
    if isinstance(x, jax.Array):
        if x.sharding == sharding or x.sharding.is_equivalent_to(sharding, x.ndim):
            return x  # (a one-device array on that device: the cutter reads it in place)
        if len(x.sharding.device_set) == 1 == len(sharding.device_set):
            return copy_shards(x, sharding)
    return placing.put(x, sharding)


class Placement:
    """Values placed on shardings with one `jax.device_put` for all that must move (a call per
    value costs about 150 us on a small CPU box): `put` each, then `done` on the tree of what
    `put` returned. A value for a sharding that spans processes is placed at once (`place`)."""

    def __init__(self) -> None:
        self._values: list[Any] = []
        self._shardings: list[Any] = []

    def put(self, x: Any, sharding: Any) -> Any:
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x
        if not sharding.is_fully_addressable:
            return place(x, sharding)
        self._values.append(x)
        self._shardings.append(sharding)
        return _Pending(len(self._values) - 1)

    def done(self, tree: Any) -> Any:
        if not self._values:
            return tree
        placed = jax.device_put(self._values, self._shardings)
        return jax.tree.map(
            lambda x: placed[x.index] if isinstance(x, _Pending) else x,
            tree,
            is_leaf=lambda x: isinstance(x, _Pending),
        )


@dataclasses.dataclass(frozen=True)
class _Pending:
    index: int


def on_mesh(x: Any, mesh: Mesh, devices: frozenset[Any] | None = None, aval: Any = None) -> Any:
    """`x` on `mesh`'s devices (`devices`, when the caller has them): as it is if it is there
    already, else moved (same spec if it fits, else replicated). Host data becomes an array of
    `aval`'s dtype, when given."""
    if isinstance(x, jax.Array):
        sharding = x.sharding
        if getattr(sharding, "mesh", None) is mesh:  # (meshes are interned: the common case)
            return x
        if sharding.device_set == (devices if devices is not None else mesh_devices(mesh)):
            return x
    if not hasattr(x, "shape"):
        if aval is None:
            return x
        x = np.asarray(x, aval.dtype)
    if aval is not None and isinstance(x, np.ndarray) and x.dtype != aval.dtype:
        x = x.astype(aval.dtype)
    spec = transplant_spec(spec_of(getattr(x, "sharding", None)), dict(mesh.shape), x.shape)
    return place(x, NamedSharding(mesh, spec))


@functools.lru_cache(maxsize=256)
def mesh_devices(mesh: Mesh) -> frozenset[Any]:
    """`mesh`'s devices as a set (asked for every placed value of every step)."""
    return frozenset(mesh.devices.flat)


def as_named(x: Any, mesh: Mesh) -> Any:
    """`x` with a NamedSharding on `mesh` (the same buffers): XLA hands some outputs back with
    a GSPMD sharding, which has no `PartitionSpec` to plan with, compare or describe, and a
    stage of a mixed layout some with a NamedSharding over another grid of its devices, whose
    spec names that grid's axes (see `named_sharding_on`)."""
    if not isinstance(x, jax.Array):
        return x
    if isinstance(x.sharding, NamedSharding) and not on_another_grid(x.sharding, mesh):
        return x
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x
    named = named_sharding_on(x.sharding, mesh, x.ndim)
    if named is None:
        warnings.warn(
            f"an output of shape {x.shape} has a sharding no PartitionSpec of its stage mesh "
            f"{dict(mesh.shape)} expresses ({x.sharding}); it is kept as it is, and may be "
            "moved again at the next step (please report it to jaxreshard)",
            stacklevel=2,
        )
        return x
    shards = [s.data for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, named, shards)


def _deleted(x: Any) -> bool:
    return isinstance(x, jax.Array) and x.is_deleted()


def literal_or(values: Mapping[Any, Any], v: Any) -> Any:
    """A step output: its value, or a literal's."""
    return v.val if isinstance(v, jc.Literal) else values[v]
