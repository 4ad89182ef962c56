"""Values a step returns before they exist: the loss and aux outputs of an asynchronous step on
hosts of other processes (see [Note: asynchronous steps on Ray] in `ray/_hosts.py`).

`jax.jit` returns arrays still being computed; a step on the Ray runtime returns `RemoteArray`
handles for what its hosts keep, and for what comes back to the driver as host data (the loss,
aux outputs) a `StepValue`: it reads like the numpy value it stands for (`np.asarray`, `float`,
`.item()`, indexing, arithmetic, `jax.block_until_ready`) and waits for its step only when read.
JAX functions take it once converted (`jnp.asarray(loss)`): JAX no longer converts foreign
objects itself while tracing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import Any

import numpy as np

from jaxreshard.runtime.engine._events import PipelineError
from jaxreshard.runtime.engine._watch import anew


class Deferred:
    """What `read()` gives once `future` (the step's watch) has finished; the step's error if
    it failed. Read once, then kept."""

    def __init__(self, future: Future[Any], read: Callable[[], Any], step_id: str):
        self._future, self._read, self.step_id = future, read, step_id
        self._lock = threading.Lock()
        self._done = False
        self._value: Any = None

    @classmethod
    def of(cls, other: Deferred, read: Callable[[], Any]) -> Deferred:
        """What `read()` gives once `other`'s step has finished."""
        return cls(other._future, read, other.step_id)

    def done(self) -> bool:
        """Whether the step has finished (reading then does not wait)."""
        return self._done or self._future.done()

    def result(self) -> Any:
        with self._lock:
            if not self._done:
                settle(self._future, self.step_id)
                self._value = self._read()
                self._read = _gone
                self._done = True
            return self._value


def _gone() -> Any:
    raise AssertionError("read twice")


def settle(future: Future[Any], step_id: str) -> None:
    """Wait for a step's watch (it has its own progress deadline); raise the step's error, or
    say that the step never ran because one before it failed."""
    error = None
    try:
        error = future.exception()
    except CancelledError:
        raise PipelineError(
            f"step {step_id} did not run: a step called before it failed (its error was raised "
            "at the call or wait() after it), or the pipeline was closed"
        ) from None
    if error is not None:
        raise anew(error) from error.__cause__


class StepValue:
    """A value a step returns as host data, read when asked for (see the module docstring).

    Args:
        deferred: gives the value (a numpy array, or a scalar) once its step has finished.
        shape, dtype: what it will be.
    """

    def __init__(self, deferred: Deferred, shape: tuple[int, ...], dtype: Any):
        self._deferred = deferred
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def is_ready(self) -> bool:
        """Whether its step has finished (reading it then does not wait)."""
        return self._deferred.done()

    def block_until_ready(self) -> StepValue:
        """Wait until its step has finished; raise the step's error if it failed."""
        self._deferred.result()
        return self

    def value(self) -> np.ndarray:
        """The value, as numpy (waits for the step)."""
        return np.asarray(self._deferred.result())

    def item(self) -> Any:
        return self.value().item()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.value()
        return out.astype(dtype) if dtype is not None else out

    def __getitem__(self, index: Any) -> Any:
        return self.value()[index]

    def __len__(self) -> int:
        return len(self.value())

    def __iter__(self) -> Any:
        return iter(self.value())

    def __float__(self) -> float:
        return float(self.value())

    def __int__(self) -> int:
        return int(self.value())

    def __bool__(self) -> bool:
        return bool(self.value())

    def __format__(self, spec: str) -> str:
        return format(self.value(), spec)

    def __repr__(self) -> str:
        return f"StepValue({self.value()!r})"

    def __str__(self) -> str:
        return str(self.value())

    __hash__ = None  # type: ignore[assignment]  # (it compares by value, as numpy does)


def _delegate(name: str) -> Callable[..., Any]:
    def op(self: StepValue, *args: Any) -> Any:
        out = getattr(self.value(), name)(*args)
        if out is NotImplemented:  # (numpy defers to a JAX array, which takes no StepValue)
            out = getattr(self.value(), name)(*(np.asarray(a) for a in args))
        return out

    op.__name__ = name
    return op


# Arithmetic and comparisons on the value, as on the numpy value it stands for (a loss summed
# over steps, compared with a threshold).
_OPERATORS = (
    "add radd sub rsub mul rmul truediv rtruediv floordiv rfloordiv mod rmod pow rpow "
    "lt le gt ge eq ne neg pos abs"
)
for _name in _OPERATORS.split():
    setattr(StepValue, f"__{_name}__", _delegate(f"__{_name}__"))
