"""Asynchronous steps: the call returns once the step is dispatched; a watchdog thread sees it
finish.

[Note: asynchronous steps]
A step of `jax.jit` returns as soon as its work is enqueued; its outputs are arrays still being
computed, and the host goes on to the next step (or the next batch) while the device works. A
pipelined step on this process does the same: the dispatching thread enqueues every stage's
actions (see [Note: one dispatching thread] in `engine/_dispatch.py`), the optimizer segments
and the loss's combination, and returns the outputs as they are. What used to end every step,
the wait for its outputs under the progress deadline (`Completion`), runs in a `StepWatch` thread
instead, which never blocks the caller:
- Steps are watched in order, one thread for the pipeline. A step fails only when none of its
  actions finished for `timeout_s` (the deadline moves with progress), and the error names the
  first unfinished action and its stage, as before; the watch then fails the channels, so that
  every stage still waiting wakes.
- A failure surfaces at the pipeline's next call (before that call does anything) or at
  `train_step.wait()`. The call after the error runs normally.
- At most `PipelineConfig.steps_in_flight` steps are dispatched and not yet finished: a call
  beyond that waits for the oldest (its outputs, under the same deadline) before it dispatches.
  That bounds the memory that steps in flight hold (each holds its batch, activations and
  gradients), as JAX's own dispatch queue does not.
- Recorded steps (`profile_call`) stay synchronous: each action is timed by waiting for it.
The outputs a watch keeps alive are those of its step; an array a later step donated is done
by definition and skipped.
"""

from __future__ import annotations

import collections
import copy
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Any

from jaxreshard.runtime.engine._dispatch import Completion
from jaxreshard.runtime.engine._events import PipelineError
from jaxreshard.runtime.engine._threads import JOIN_S, DaemonPool


class StepWatch:
    """Watches a pipeline's dispatched steps finish, in order, off the caller's thread (see
    [Note: asynchronous steps])."""

    def __init__(self) -> None:
        self._pool: DaemonPool | None = None
        self._completion = Completion()
        self._pending: collections.deque[tuple[str, Future[None]]] = collections.deque()
        self._lock = threading.Lock()

    def track(
        self,
        step_id: str,
        outputs: Any,
        log: list[tuple[str, Any]],
        timeout_s: float,
        on_failure: Any,
    ) -> None:
        """Watch step `step_id` until `outputs` are computed; if it stops progressing for
        `timeout_s`, call `on_failure(error)` and keep the error for the next `check`."""

        def watch() -> None:
            try:
                self._completion.wait(outputs, log, timeout_s)
            except PipelineError as e:
                on_failure(e)
                raise
            log.clear()  # (every action's outputs: see `RankRunner.run`)

        self.track_call(step_id, watch)

    def track_call(self, step_id: str, wait: Callable[[], None]) -> Future[None]:
        """Watch step `step_id` by calling `wait()` in the watch thread, after the steps tracked
        before it: it returns once the step has finished, or raises its error (with its own
        deadline). The future is done when the step is seen finished."""
        with self._lock:
            if self._pool is None:
                self._pool = DaemonPool(1, "jaxreshard-watch")
            future = self._pool.submit(wait)
            self._pending.append((step_id, future))
        return future

    @property
    def in_flight(self) -> int:
        """Steps dispatched and not yet seen finished."""
        with self._lock:
            return sum(not f.done() for _, f in self._pending)

    def check(self) -> None:
        """Raise the error of a watched step that failed (once); forget finished ones. Never
        blocks."""
        while True:
            with self._lock:
                if not self._pending or not self._pending[0][1].done():
                    return
                _, future = self._pending.popleft()
            self._raise(future)

    def admit(self, limit: int) -> None:
        """Before a new step: raise an earlier step's failure, then wait until fewer than
        `limit` steps are in flight."""
        self.check()
        while True:
            with self._lock:
                if len(self._pending) < limit:
                    return
                _, future = self._pending.popleft()
            self._raise(future, wait=True)

    def wait(self) -> None:
        """Wait for every watched step; raise the first failure."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                _, future = self._pending.popleft()
            self._raise(future, wait=True)

    def drain(self, timeout_s: float) -> None:
        """Wait at most `timeout_s` for the watched steps to finish; raise nothing."""
        with self._lock:
            futures = [f for _, f in self._pending]
        futures_wait(futures, timeout=timeout_s)

    def _raise(self, future: Future[None], wait: bool = False) -> None:
        # (the watch itself has the deadline: the result comes, or its error)
        error = future.exception() if wait or future.done() else None
        if error is not None:
            with self._lock:  # the steps after a failed one are failed with it
                later = [f for _, f in self._pending]
                self._pending.clear()
            for f in later:
                f.cancel()
            raise anew(error) from error.__cause__

    def close(self, join_s: float | None = JOIN_S) -> None:
        """End the watch thread (steps in flight are no longer watched)."""
        with self._lock:
            pool, self._pool = self._pool, None
            self._pending.clear()
        if pool is not None:
            pool.shutdown(join_s)
        self._completion.close(join_s)


def anew(error: BaseException) -> BaseException:
    """A copy of a watched step's error to raise in the caller's thread. The original stays in
    its future, which handles of the step's outputs keep; raised itself, it would take the
    caller's frames into its traceback, and with them the pipeline (which could then never be
    dropped)."""
    try:
        new = copy.copy(error)
    except Exception:  # (an exception type that cannot be copied)
        return error
    if str(new) != str(error):  # (a constructor that does not take its own message back)
        return error
    new.__traceback__ = None
    return new
