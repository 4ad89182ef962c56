"""Handles to arrays that live on the Ray runtime's host actors."""

from __future__ import annotations

import contextlib
import math
from concurrent.futures import Future
from typing import Any

import numpy as np

from jaxreshard.comm import describe_sharding

# Arrays up to this size keep their value on the driver too: a step's output comes back with
# its step's answer; one put or restored keeps (or reads) it there.
SMALL_BYTES = 1024


class RemoteArray:
    """A sharded array held by host actors; the driver keeps only this handle.

    Its `sharding` is a `VirtualSharding` over the runtime's devices, so the planner sees it as it
    sees a JAX sharding (device -> global region, device -> host).
    """

    def __init__(
        self,
        runtime: Any,
        array_id: str,
        shape: tuple[int, ...],
        dtype: Any,
        sharding: Any,
        value: np.ndarray | None = None,
    ):
        self.runtime = runtime
        self.array_id = array_id
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.sharding = sharding
        # A small array's value (see `SMALL_BYTES`), where the driver has it: put here, read
        # from a checkpoint, resharded from one that had it, or come back with the step that
        # made it. Reading it needs no round trip to its host, and a step whose stage's hosts
        # do not hold it gets it with the call.
        self.value = value
        self._freed = False
        # An asynchronous step's output: the step's watch, until it has finished (see
        # [Note: asynchronous steps on Ray] in `ray/_hosts.py`).
        self.pending: Future[Any] | None = None
        self.step_id = ""
        self.source: Any = None  # (small) the ObjectRef of the answer that will carry its value

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def is_freed(self) -> bool:
        return self._freed

    def is_ready(self) -> bool:
        """Whether the step that makes it has finished (see `block_until_ready`)."""
        return self.pending is None or self.pending.done()

    def block_until_ready(self) -> RemoteArray:
        """Wait until the step that makes it has finished on its hosts; raise that step's
        error if it failed (what `jax.block_until_ready` calls)."""
        self.settle()
        return self

    def settle(self) -> None:
        """`block_until_ready`: anything that reads the array on its hosts waits so first."""
        pending = self.pending
        if pending is not None:
            from jaxreshard.runtime.driver._deferred import settle

            settle(pending, self.step_id)
            self.pending = None

    def fetch(self) -> np.ndarray:
        """Copy the array to the driver as one numpy array."""
        self.settle()
        if self.value is not None and not self._freed:  # (a freed one fails as ever)
            return self.value.copy()
        return self.runtime.fetch(self)

    def reshard(self, dst_sharding: Any, *, strategy: str = "auto") -> RemoteArray:
        return self.runtime.reshard(self, dst_sharding, strategy=strategy)

    def free(self) -> None:
        """Drop the shards on every host (idempotent)."""
        if not self._freed:
            self._freed = True
            # Its step makes it first; if that step failed, what a host kept of it goes all the
            # same.
            with contextlib.suppress(Exception):
                self.settle()
            self.runtime.free(self)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.fetch()
        return out.astype(dtype) if dtype is not None else out

    def __repr__(self) -> str:
        state = ", freed" if self._freed else ""
        return (
            f"RemoteArray({self.dtype}{list(self.shape)}, {describe_sharding(self.sharding)}, "
            f"id={self.array_id}{state})"
        )

    def __del__(self) -> None:
        try:
            if not self._freed and self.runtime.is_alive:
                self._freed = True
                self.runtime.free(self, wait=False, pending=self.pending)
        except Exception:  # interpreter shutdown; nothing left to free
            pass


class RemoteStruct:
    """`jax.ShapeDtypeStruct` for the Ray runtime: a shape, a dtype and a `VirtualSharding`
    over the runtime's devices (what `train_step.placement` gives on Ray, and what
    `restore_checkpoint` reads into: the hosts of that sharding read their regions)."""

    def __init__(self, shape: tuple[int, ...], dtype: Any, sharding: Any):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.sharding = sharding

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, RemoteStruct)
            and (self.shape, self.dtype) == (other.shape, other.dtype)
            and self.sharding == other.sharding
        )

    def __hash__(self) -> int:
        return hash((self.shape, self.dtype))

    def __repr__(self) -> str:
        return f"RemoteStruct({self.dtype}{list(self.shape)}, {describe_sharding(self.sharding)})"
