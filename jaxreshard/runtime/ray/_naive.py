"""The executed resharding benchmark's naive baseline, on the host actors (`HostActor`'s
part that only `RayRuntime.reshard_naive` uses): every receiving host pulls the whole tensor
from the object store, with no plan."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np


class NaiveBaseline:
    """The benchmark baseline's methods of `HostActor` (which gives `_emulator`, `host`,
    `devices`, `arrays` and `_lock`; `_array` comes from `HostArrays`)."""

    host: int
    devices: dict[int, Any]
    arrays: dict[str, dict[int, Any]]
    _assembled: dict[str, Any]
    _emulator: Any
    _lock: Any

    def _array(self, array_id: str) -> dict[int, Any]:
        raise NotImplementedError

    def publish(self, array_id: str, devices: list[int]) -> dict[int, list[Any]]:
        """Put these source shards into the object store once; return their references."""
        import ray

        shards = self._array(array_id)
        return {d: [ray.put(np.asarray(shards[d]))] for d in devices}

    def pull_whole(
        self,
        array_id: str,
        dtype: str,
        refs: list[tuple[Any, list[Any]]],
        regions: Mapping[int, Any],
        timeout_s: float = 120.0,
    ) -> None:
        """Fetch every source region (the whole tensor) and keep this host's regions of it."""
        import jax
        import ray

        from jaxreshard.comm._emulate import sleep_until
        from jaxreshard.comm._local import POOL, aligned_empty, relative_slices
        from jaxreshard.comm._transport import book_link

        deadline = time.monotonic() + timeout_s  # for the whole pull
        buffers = {  # from the same pool as the planned reshardings' (HostData), to be fair
            d: aligned_empty([b - a for a, b in r], jax.numpy.dtype(dtype), pool=POOL)
            for d, r in regions.items()
        }
        for src_index, (ref,), src_host in refs:
            if self._emulator is not None and src_host != self.host:
                nbytes = math.prod(b - a for a, b in src_index) * jax.numpy.dtype(dtype).itemsize
                sleep_until(book_link(self._emulator, src_host, self.host, nbytes))
            try:
                data = ray.get(ref, timeout=max(0.001, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(
                    f"host {self.host}: pulling {array_id}'s region {list(src_index)} from host "
                    f"{src_host} did not finish within timeout_s={timeout_s:g} s of the pull's "
                    "start"
                ) from None
            for d, region in regions.items():
                part = tuple((max(a, c), min(b, e)) for (a, b), (c, e) in zip(src_index, region))
                if all(b > a for a, b in part):
                    np.copyto(
                        buffers[d][relative_slices(part, region)],
                        data[relative_slices(part, src_index)],
                    )
        result = {d: jax.device_put(buffers[d], self.devices[d], may_alias=True) for d in buffers}
        with self._lock:
            self.arrays[array_id] = result
            self._assembled.pop(array_id, None)
