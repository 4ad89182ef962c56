"""What a host has finished of each recent step, for the driver's progress deadline (see
[Note: progress deadline] in `ray/_pipeline.py`)."""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import jax


class StepProgress:
    """What a host's part of each recent step has finished, for the driver's progress deadline
    (see [Note: progress deadline]): a step's outputs may still be computed while the next step
    is dispatched. Thread-safe; it holds only weak references to outputs."""

    KEEP = 16  # steps remembered (at most 8 are in flight: `RAY_STEPS_IN_FLIGHT`)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: dict[str, _Progress] = {}
        self._current: _Progress | None = None

    def begin(self, step_id: str) -> None:
        with self._lock:
            self._current = self._steps[step_id] = _Progress()
            while len(self._steps) > self.KEEP:
                del self._steps[next(iter(self._steps))]

    def finished(self, what: str) -> None:
        """Something of the step being dispatched finished now."""
        with self._lock:
            if self._current is not None:
                self._current.finished(what)

    def dispatched(self, what: str, outputs: Any) -> None:
        """An action was dispatched: it has finished once `outputs` are ready (or gone)."""
        refs = [  # (typed PRNG key arrays cannot say: their key data comes with other outputs)
            weakref.ref(x)
            for x in jax.tree.leaves(outputs)
            if isinstance(x, jax.Array) and hasattr(x, "is_ready")
        ]
        with self._lock:
            if self._current is not None:
                self._current.pending.append((what, refs))
                self._current.sweep()

    def report(self, step_id: str) -> tuple[int, str, float]:
        """(how many things step `step_id` finished here, the last one, seconds since)."""
        with self._lock:
            progress = self._steps.get(step_id)
            if progress is None:
                return (0, "nothing", 0.0)
            progress.sweep()
            return (progress.count, progress.last, time.monotonic() - progress.when)


class _Progress:
    """One step's `StepProgress`."""

    def __init__(self) -> None:
        self.count, self.last, self.when = 0, "nothing", time.monotonic()
        self.pending: list[tuple[str, list[Any]]] = []  # dispatched: (what, weakrefs of outputs)

    def finished(self, what: str) -> None:
        self.count += 1
        self.last, self.when = what, time.monotonic()

    def sweep(self) -> None:
        pending = []
        for what, refs in self.pending:
            if all(_done(ref()) for ref in refs):
                self.finished(what)
            else:
                pending.append((what, refs))
        self.pending = pending


def _done(x: Any) -> bool:
    return x is None or x.is_deleted() or x.is_ready()
