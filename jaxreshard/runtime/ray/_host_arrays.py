"""The arrays a host actor keeps (`HostActor`'s part that stores, hands out and frees them):
shards put by the driver or made by a resharding, by global device id, and whole arrays a
pipeline step kept as they are."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


class HostArrays:
    """The array store of `HostActor` (which sets `host`, `devices`, `arrays`, `whole`,
    `_assembled` and `_lock` up)."""

    host: int
    devices: dict[int, Any]
    arrays: dict[str, dict[int, Any]]  # id -> shards by global device id
    whole: dict[str, Any]  # id -> a jax.Array a pipeline step kept as it is
    # id -> (sharding, its shards, the array a step put together from them): see `assembled`
    _assembled: dict[str, tuple[Any, tuple[Any, ...], Any]]
    _lock: Any

    # -- arrays --------------------------------------------------------------------------------

    def put_shards(self, array_id: str, dtype: str, shards: Mapping[int, Any]) -> None:
        """Store `shards` (global device id -> host data) on this host's devices."""
        import jax

        out = {}
        for gid, data in shards.items():
            out[gid] = jax.device_put(
                np.asarray(data, dtype=jax.numpy.dtype(dtype)), self.devices[gid]
            )
        with self._lock:
            self.arrays.setdefault(array_id, {}).update(out)
            self._assembled.pop(array_id, None)

    def put_many_shards(self, arrays: list[tuple[str, str, Mapping[int, Any]]]) -> None:
        """`put_shards` for each `(array_id, dtype, shards)`, in one call."""
        for array_id, dtype, shards in arrays:
            self.put_shards(array_id, dtype, shards)

    def fetch_shards(self, array_id: str, devices: list[int]) -> dict[int, np.ndarray]:
        shards = self._array(array_id)
        return {gid: np.asarray(shards[gid]) for gid in devices}

    def free_many(self, array_ids: list[str]) -> None:
        with self._lock:
            for array_id in array_ids:
                self.arrays.pop(array_id, None)
                self.whole.pop(array_id, None)
                self._assembled.pop(array_id, None)

    def assembled(self, array_id: str, sharding: Any, shape: tuple[int, ...]) -> Any:
        """Array `array_id`, kept here as shards (put by the driver, or a resharding's result),
        as one `jax.Array` of `sharding`: put together once, and again only when its shards
        change (every step that reads an array the driver put would otherwise pay a
        `make_array_from_single_device_arrays` per leaf: a tiny GPT's parameters and Adam
        state, ~230 leaves, cost a one-core host ~20 ms a step)."""
        import jax

        shards = self._array(array_id)
        gid = {d: g for g, d in self.devices.items()}
        arrays = tuple(shards[gid[d]] for d in sharding.mesh.devices.flat if d in gid)
        hit = self._assembled.get(array_id)
        if (
            hit is not None
            and hit[0] == sharding
            and len(hit[1]) == len(arrays)
            and all(a is b for a, b in zip(hit[1], arrays))
            and not hit[2].is_deleted()
        ):
            return hit[2]
        value = jax.make_array_from_single_device_arrays(shape, sharding, list(arrays))
        with self._lock:
            self._assembled[array_id] = (sharding, arrays, value)
        return value

    def array_ids(self) -> list[str]:
        return sorted({*self.arrays, *self.whole})

    def _array(self, array_id: str) -> dict[int, Any]:
        """An array's shards by global device id."""
        whole = self.whole.get(array_id)
        if whole is not None:
            gid = {d: g for g, d in self.devices.items()}
            return {gid[s.device]: s.data for s in whole.addressable_shards}
        try:
            return self.arrays[array_id]
        except KeyError:
            raise KeyError(
                f"host {self.host} holds no array {array_id!r} (freed, or never put here)"
            ) from None
