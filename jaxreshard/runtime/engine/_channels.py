"""The channels boundary tensors take between stages, the same on every runtime.

[Note: boundary tensors]
What happens to a boundary tensor (an activation, its gradient, a shared parameter or its
gradient contribution), on every runtime:
1. At the start of a step, `Channels.begin` posts every receive of the stages this process
   runs: a runtime whose transfers need the receiving side to act (Ray's object store, NCCL)
   starts it now, off the compute threads, in each channel's program order.
2. The producing stage's `SEND` calls `Channels.send`, which never blocks: the value joins its
   stage's outgoing queue, ordered by when the consumer needs it (the consumer action's start in
   the simulated schedule: `PipelineLayout.need`), and the stage computes on.
3. A sender thread per stage checks that the value is laid out as planned, waits for it to
   exist, and moves it by the transfer's plan (`_move`): in this process (the local runtime, or
   stages of one Ray host) by `comm._local.execute_local`; to another host by the sending side
   of the plan's host programs over the host's transport: TCP streams between host actors on
   CPU (`comm._stream`, the default), Ray's object store (`ObjectStoreTransport`), or NCCL.
4. The value arrives in the consumer's mailbox (`deliver`); with network emulation, with the
   time it may be used. The consumer's `RECV` takes it, waiting only if it is not there yet,
   with a deadline that names the silent stage.
5. `Channels.end` waits (with a deadline) until this process's sends have been delivered; the
   first failure anywhere (`fail`) wakes every wait, and the transports abort their transfers.
In signal-only mode (see [Note: signal-only bound]) step 3 moves no data: the receiver gets
zeros placed on its mesh once, and only the dependency remains.

[Note: signal-only bound]
The paper's upper bound on what hiding transfers can buy: every cross-mesh transfer becomes a
signal that keeps the dependency (the receiver still waits for the sender's value to exist) but
carries no data; the receiver computes on zeros placed on its mesh once. A step run so is as fast
as the same schedule with free communication; its losses are meaningless.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxreshard.comm._emulate import sleep_until
from jaxreshard.pipeline._emit import Instruction
from jaxreshard.runtime.engine._events import Event, PipelineError, Stopped, transfer_key
from jaxreshard.runtime.engine._threads import JOIN_S, join_all
from jaxreshard.runtime.step._layout import PipelineLayout, Transfer
from jaxreshard.runtime.step._specs import place


class Channels:
    """How boundary tensors move between stages (see [Note: boundary tensors]).

    One object per process that runs stages, reused step after step. Subclasses implement
    `_move` (and `_post_receives` where receiving takes work of its own); `where(stage)` may name
    the host a stage runs on, for messages.

    Every step is an epoch: `begin` starts a new one, the mailbox is keyed by it, and a value
    moved for an earlier epoch (a transfer still in flight when its step failed) is dropped when
    it arrives instead of being taken by a later step's RECV. Sender threads that were busy when
    a step failed are left to finish on their own; the next step gets fresh ones.
    """

    def __init__(self, layout: PipelineLayout, timeout_s: float):
        self.layout, self.timeout_s = layout, timeout_s
        self.record: Callable[[Event], None] | None = None
        self.signal_only = False
        self.epoch = 0
        self._cond = threading.Condition()
        self._arrived: dict[tuple[Any, ...], tuple[Any, float]] = {}
        self._failure: BaseException | None = None
        self._queues: dict[int, list[Any]] = {}
        self._senders: dict[int, threading.Thread] = {}
        self._threads: list[threading.Thread] = []  # every sender started, for `close`
        self._generation = 0  # sender threads of an older generation exit
        self._in_flight = 0
        self._order = itertools.count()
        self._closed = False
        self._placeholders: dict[tuple[str, Any], Any] = {}
        self._local = threading.local()  # the epoch a sender thread is moving a value for

    # A step ------------------------------------------------------------------------------------

    def begin(
        self,
        stages: Sequence[int],
        *,
        step_id: str = "",
        record: Callable[[Event], None] | None = None,
        signal_only: bool = False,
    ) -> None:
        """Start step `step_id` of `stages` (the ones this process runs): post their
        receives."""
        with self._cond:
            if self._closed:
                raise PipelineError("these channels were closed (the pipeline was shut down)")
            if self._failure is not None or self._in_flight:
                # The last step failed: its senders may be stuck in a move; start new ones.
                self._generation += 1
                self._senders.clear()
                self._queues.clear()
                self._cond.notify_all()
            self.epoch += 1
            self._arrived.clear()
            self._failure = None
            self._in_flight = 0
        self.record, self.signal_only = record, signal_only
        self._post_receives(stages)

    # A small transfer of a value that already exists moves in the sending stage's thread when
    # nothing else waits to go out (0: never): cheaper than waking a sender thread for it.
    inline_bytes = 0

    def moves_inline(self, ins: Instruction, transfer: Transfer, value: Any) -> bool:
        """Whether `send` moves this value in the calling thread (see `inline_bytes`)."""
        return transfer.nbytes <= self.inline_bytes and is_ready(value)

    def send(self, ins: Instruction, value: Any) -> None:
        """Hand a value over for moving; returns at once (or after moving it in this thread, if
        `moves_inline` says so and nothing else of its stage waits to go out)."""
        transfer = self.layout.transfers[transfer_key(ins)]
        if not self._queues.get(ins.src) and self.moves_inline(ins, transfer, value):
            self._check_failure()
            self._local.epoch = self.epoch
            self._move(ins, transfer, value)
            return
        need = self.layout.need.get(ins.key, 0.0)
        with self._cond:
            self._check_failure()
            heapq.heappush(
                self._queues.setdefault(ins.src, []),
                (need, next(self._order), self.epoch, ins, transfer, value),
            )
            self._in_flight += 1
            if ins.src not in self._senders:
                thread = threading.Thread(
                    target=self._send_loop,
                    args=(ins.src, self._generation),
                    name=f"jaxreshard-send-s{ins.src}",
                    daemon=True,
                )
                self._senders[ins.src] = thread
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
                thread.start()
            self._cond.notify_all()

    def arrived(self, ins: Instruction) -> bool:
        """Whether a RECV's value is here (never blocks)."""
        return ins.key in self._arrived or self._failure is not None

    def take(self, ins: Instruction) -> Any:
        """A RECV's value if it has arrived, else `MISSING` (never blocks)."""
        with self._cond:
            self._check_failure()
            item = self._arrived.pop(ins.key, None)
        if item is None:
            return MISSING
        value, ready = item
        sleep_until(ready)  # an emulated link's end (0: now)
        return value

    def recv(self, ins: Instruction) -> Any:
        """The value of a RECV, waiting (at most `timeout_s` from now) until it has arrived."""
        self.wait_any([ins], time.monotonic() + self.timeout_s)
        return self.take(ins)

    def wait_any(self, waiting: Sequence[Instruction], deadline: float) -> None:
        """Wait until one of these RECVs' values has arrived, or the step failed; past
        `deadline`, raise an error naming who waits for what."""
        with self._cond:
            while not any(ins.key in self._arrived for ins in waiting):
                self._check_failure()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PipelineError(self._silent(waiting))
                self._cond.wait(min(left, 1.0))

    def deliver(
        self, key: tuple[Any, ...], value: Any, ready: float = 0.0, epoch: int | None = None
    ) -> None:
        """A moved value has arrived (usable from `ready` on the monotonic clock). `epoch` is
        the step it was moved for (default: the one the calling sender thread moves for, else
        the current one); a value of an earlier step is dropped."""
        if epoch is None:
            epoch = getattr(self._local, "epoch", self.epoch)
        with self._cond:
            if epoch != self.epoch:
                return
            self._arrived[key] = (value, ready)
            self._cond.notify_all()

    def end(self) -> None:
        """Wait until this process's sends are delivered; raise the step's first failure."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while self._in_flight and self._failure is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._failure = PipelineError(
                        f"{self._in_flight} transfer(s) of this step did not finish within "
                        f"timeout_s={self.timeout_s:g} s after the stages did; a receiving host "
                        "may be stuck or dead (raise PipelineConfig.timeout_s if transfers are "
                        "slow)"
                    )
                    break
                self._cond.wait(min(left, 1.0))
            failure = self._failure
        if failure is not None:
            self._on_failure(failure)
            raise failure

    def fail(self, error: BaseException) -> None:
        """Record the step's first failure and wake every wait."""
        while isinstance(error, Stopped) and error.failure is not None:
            error = error.failure  # (the failure that stopped a stage is the step's)
        with self._cond:
            first = self._failure is None
            if first:
                self._failure = error
            self._cond.notify_all()
        if first:
            self._on_failure(error)

    @property
    def stopped(self) -> bool:
        return self._failure is not None

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def close(self) -> None:
        """End the sender threads, waiting at most `JOIN_S` for those not stuck in a move (see
        [Note: threads at exit]). Idempotent; the channels cannot run steps after this."""
        with self._cond:
            self._closed = True
            self._queues.clear()
            self._cond.notify_all()
            threads = list(self._threads)
        join_all(threads, JOIN_S)

    # Helpers for subclasses --------------------------------------------------------------------

    def abandoned(self) -> bool:
        """Whether the move a sender thread is making no longer matters: its step failed or
        ended, or the channels closed (its waits give up: see [Note: threads at exit])."""
        return (
            self._closed
            or self._failure is not None
            or getattr(self._local, "epoch", self.epoch) != self.epoch
        )

    def placeholder(self, transfer: Transfer, sharding: Any) -> Any:
        """Signal-only mode's stand-in for a transfer's result: zeros already in place, made
        once (see [Note: signal-only bound])."""
        key = (transfer.name, transfer.dst_spec)
        with self._cond:
            value = self._placeholders.get(key)
        if value is None:
            value = place(np.zeros(transfer.shape, transfer.dtype), sharding)
            with self._cond:
                value = self._placeholders.setdefault(key, value)
        return value

    def where(self, stage: int) -> str:
        """How messages name a stage (`stage 2`, or `stage 2 (host 1)`)."""
        return f"stage {stage}"

    # To implement -------------------------------------------------------------------------------

    def _move(self, ins: Instruction, transfer: Transfer, value: Any) -> None:
        """Move one value by its transfer's plan and `deliver` it (or have the receiver do so)."""
        raise NotImplementedError

    def _post_receives(self, stages: Sequence[int]) -> None:
        """Start receiving what these stages' programs RECV (if receiving takes work)."""

    def _on_failure(self, error: BaseException) -> None:
        """Abort transfers in flight (transports' waits end with an error)."""

    # Internals ----------------------------------------------------------------------------------

    def _send_loop(self, stage: int, generation: int) -> None:
        while True:
            with self._cond:
                while (
                    not self._queues.get(stage)
                    and not self._closed
                    and generation == self._generation
                ):
                    self._cond.wait()
                if self._closed or generation != self._generation:
                    return
                item = heapq.heappop(self._queues[stage])
            self._send_one(*item[2:])
            # An idle sender holds no array: one that ends at interpreter exit must not free
            # the last reference to one (see [Note: threads at exit]).
            del item

    def _send_one(self, epoch: int, ins: Instruction, transfer: Transfer, value: Any) -> None:
        """Move one queued value (a sender thread's work), failing the step if that fails."""
        try:
            if self._failure is None and epoch == self.epoch:
                self._local.epoch = epoch
                self._move(ins, transfer, value)
        except BaseException as e:
            error = (
                e
                if isinstance(e, PipelineError)
                else PipelineError(f"{self.where(ins.src)}: sending {ins}: {type(e).__name__}: {e}")
            )
            error.__cause__ = e
            if epoch == self.epoch:
                self.fail(error)
        finally:
            with self._cond:
                if epoch == self.epoch:
                    self._in_flight -= 1
                self._cond.notify_all()

    def _check_failure(self) -> None:
        if self._failure is not None:
            raise Stopped(self._failure) from None

    def _silent(self, waiting: Sequence[Instruction]) -> str:
        ins = waiting[0]
        more = f" (and {len(waiting) - 1} more RECV(s) of other stages)" if len(waiting) > 1 else ""
        return (
            f"{self.where(ins.dst)} waited timeout_s={self.timeout_s:g} s for {ins}{more}; "
            f"{self.where(ins.src)} never sent it (it is stuck, dead, or slower than timeout_s)"
        )


MISSING = object()  # `Channels.take`: not arrived yet


def is_ready(value: Any) -> bool:
    """Whether a JAX array (typed PRNG keys too) has been computed."""
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        value = jax.random.key_data(value)
    return value.is_ready()
