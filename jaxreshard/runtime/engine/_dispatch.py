"""Driving rank programs from one thread, and waiting for a step's work to finish.

[Note: one dispatching thread]
A rank's program is a generator (`StageProgram.steps`) that runs until a RECV whose value has not
arrived and yields it. On the local runtime `dispatch` drives all of them from the calling
thread, round robin: JAX dispatches executables and copies asynchronously, so the thread only
enqueues work, and the devices run it in parallel. A transfer moves in the sending rank's turn
without waiting for its value where JAX can copy asynchronously (`LocalChannels.moves_inline`:
a copy shard for shard, or a small plan by device copies); a large plan whose value does not
exist yet goes to a sender thread and the RECV waits for it. So a step costs a JAX call per
action and per transfer, not a thread hand-off (measured on a 2-core CPU box: a 2-stage,
4-micro-batch step of a tiny LM went from 16.5 ms to about 8 ms; `benchmarks/action_overhead.py`).
Since nothing in the dispatching thread waits for compute, a stage that hangs (a host callback
that never returns) would go unnoticed until someone reads a result; so the step ends with
`Completion.wait`: it waits for the step's outputs, and fails (naming the first action that has
not finished) only when no action of the step has finished for `timeout_s` — a long healthy
step is never cut short. Profiles (`record`) and network emulation keep a thread per rank: an
action's time must be its own, and an emulated link delays its receiver.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import TimeoutError as FuturesTimeout
from concurrent.futures import wait as futures_wait
from typing import Any

import jax

from jaxreshard.pipeline._emit import Instruction
from jaxreshard.runtime.engine._channels import Channels, is_ready
from jaxreshard.runtime.engine._events import PipelineError, Stopped
from jaxreshard.runtime.engine._threads import JOIN_S, DaemonPool


def wait_for_stages(
    stages: Sequence[Any], channels: Sequence[Channels], timeout_s: float, what: str
) -> None:
    """Wait until every stage's runner (a `Future` or a `Thread`) has returned. Their own waits
    have deadlines, so a healthy runner ends; one stuck in a device call (a host callback that
    never returns) cannot be interrupted, so once the step has failed the others get
    `STOP_GRACE_S` to notice it, and then the step's failure is raised without them."""
    deadline: float | None = None
    for stage in stages:
        while not (stage.done() if hasattr(stage, "done") else not stage.is_alive()):
            if hasattr(stage, "join"):
                stage.join(0.2)
            else:
                futures_wait([stage], timeout=0.2)
            failed = next((c.failure for c in channels if c.failure is not None), None)
            if failed is not None and deadline is None:
                deadline = time.monotonic() + min(timeout_s, STOP_GRACE_S)
            if deadline is not None and time.monotonic() > deadline:
                raise PipelineError(
                    f"{what}: {failed} (a stage is still stuck in its work; its thread is left "
                    "to finish on its own)"
                ) from failed


STOP_GRACE_S = 5.0  # how long stages get to notice that their step has failed


def stage_failure(error: BaseException, what: str) -> PipelineError:
    """The step's error for an exception raised while running `what` (`stage 2`); a stage that
    stopped because of an earlier failure gives that failure."""
    if isinstance(error, Stopped) and isinstance(error.failure, PipelineError):
        return error.failure
    if isinstance(error, PipelineError):
        return error
    wrapped = PipelineError(f"{what} failed: {type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped


def dispatch(
    programs: dict[int, Generator[Instruction, None, Any]],
    channels: Channels,
    what: Callable[[int], str],
) -> dict[int, Any]:
    """Drive every rank's program (`StageProgram.steps`) in this thread: each runs until a RECV
    whose value has not arrived, then the next; when none can go on, wait (at most `timeout_s`
    from the start of that wait) until a value arrives. Compute and local transfers are
    dispatched to JAX asynchronously, so one thread keeps every device busy without a thread
    hand-off per action (see [Note: one dispatching thread]). Returns each program's result."""
    done: dict[int, Any] = {}
    waiting: dict[int, Instruction | None] = dict.fromkeys(programs)
    while waiting:
        progressed = False
        for r, ins in list(waiting.items()):
            if ins is not None and not channels.arrived(ins):
                continue
            progressed = True
            try:
                waiting[r] = programs[r].send(None)
            except StopIteration as stop:
                done[r] = stop.value
                del waiting[r]
            except BaseException as e:
                error = stage_failure(e, what(r))
                channels.fail(error)
                raise error from e
        if not progressed:
            blocked = [ins for ins in waiting.values() if ins is not None]
            try:
                channels.wait_any(blocked, time.monotonic() + channels.timeout_s)
            except PipelineError as e:
                channels.fail(e)
                raise
    return done


class Completion:
    """Waits until a step's dispatched work has finished, with a deadline that moves with
    progress: the step fails only when none of its actions finishes for `timeout_s`, and the
    error names the first unfinished action (see [Note: one dispatching thread]). The waiting
    thread is a daemon, so one left blocked by a hung step does not hold the process at exit
    (see [Note: threads at exit])."""

    def __init__(self) -> None:
        self._pool: DaemonPool | None = None

    def wait(self, outputs: Any, log: Sequence[tuple[str, Any]], timeout_s: float) -> None:
        if self._pool is None:
            self._pool = DaemonPool(1, "jaxreshard-wait")
        pool = self._pool
        finished = pool.submit(_block_until_ready, outputs)
        deadline = time.monotonic() + timeout_s
        progress = -1
        while True:
            left = deadline - time.monotonic()
            try:
                finished.result(timeout=max(0.0, min(left, 1.0)))
                return
            except FuturesTimeout:
                pass
            except BaseException as e:
                raise stage_failure(e, "a step's computation") from e
            now = _count_finished(log)
            if now > progress:
                progress, deadline = now, time.monotonic() + timeout_s
            elif time.monotonic() >= deadline:
                # The waiting thread stays blocked until the computation ends: a new one
                # serves the next step.
                self._pool = None
                pool.shutdown(join_s=None)
                stuck = next(
                    (what for what, outs in log if not _finished(outs)), "the step's outputs"
                )
                raise PipelineError(
                    f"{stuck} did not finish within timeout_s={timeout_s:g} s, and nothing else "
                    "of the step did meanwhile (a host callback that never returns, or a hung "
                    "device?); raise PipelineConfig.timeout_s if one action legitimately takes "
                    "longer"
                )

    def close(self, join_s: float | None = JOIN_S) -> None:
        if self._pool is not None:
            self._pool.shutdown(join_s)
            self._pool = None


def _block_until_ready(outputs: Any) -> None:
    # A blocking wait, not `wait_ready`'s polls: this is every local step's last wait, and a
    # poll's pause would add to the step (see [Note: threads at exit]). An array a later step
    # donated (and so deleted) was computed by then (see [Note: asynchronous steps]).
    for x in jax.tree.leaves(outputs):
        if not isinstance(x, jax.Array) or x.is_deleted():
            continue
        try:
            jax.block_until_ready(x)
        except RuntimeError:
            if not x.is_deleted():
                raise


def _finished(tree: Any) -> bool:
    return all(
        x.is_deleted() or is_ready(x) for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)
    )


def _count_finished(log: Sequence[tuple[str, Any]]) -> int:
    return sum(_finished(outs) for _, outs in log)
