"""Values on the wire between the driver and the host actors: ids, small values, shards."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

# -- values on the wire -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KeyData:
    """A typed PRNG key array on its way between the driver and a host (numpy cannot hold one):
    its key data and implementation."""

    data: Any
    impl: str


@dataclasses.dataclass(frozen=True)
class Shards:
    """One host's pieces of an array sharded over several hosts' devices, on its way to the
    driver: (global index, data) of each shard it holds a first replica of."""

    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[tuple[tuple[tuple[int, int], ...], np.ndarray], ...]


def is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def local_value(x: Any, required: bool = True) -> Any:
    """A jax.Array's value as numpy, read in this process: whole if this process holds all of
    it (every device, or a replica on one of its own); else None, or an error if `required`."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    if required:
        raise ValueError(
            f"an array of shape {x.shape} is sharded over other processes' devices too; "
            "this process holds only its part of it (this is a jaxreshard bug, please report it)"
        )
    return None


def to_wire(x: Any) -> Any:
    """A value as a step call carries it: numpy, `KeyData` for typed keys, `Shards` for this
    process's part of an array spread over several processes."""
    if is_key(x):
        return KeyData(to_wire(jax.random.key_data(x)), str(jax.random.key_impl(x)))
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        pieces = tuple(
            (
                tuple(_bounds(s.index, x.shape)),
                np.asarray(s.data),
            )
            for s in x.addressable_shards
            if s.replica_id == 0
        )
        return Shards(tuple(x.shape), np.dtype(x.dtype).name, pieces)
    return local_value(x)


def from_wire(x: Any) -> Any:
    """The inverse of `to_wire` (`Shards` are merged by `merge_wire` first)."""
    if isinstance(x, KeyData):
        return jax.random.wrap_key_data(from_wire(x.data), impl=x.impl)
    return x


def merge_wire(parts: Sequence[Any]) -> Any:
    """One value from the `to_wire` forms that each host of a stage sent (the same value from
    each, or its `Shards`)."""
    first = parts[0]
    if isinstance(first, KeyData):
        return KeyData(merge_wire([p.data for p in parts]), first.impl)
    if not isinstance(first, Shards):
        return first
    out = np.empty(first.shape, first.dtype)
    for part in parts:
        for index, data in part.pieces:
            out[tuple(slice(a, b) for a, b in index)] = data
    return out


def _bounds(index: Sequence[slice], shape: Sequence[int]) -> list[tuple[int, int]]:
    return [(s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape)]
