"""The executor core: one interpreter of stage programs, and the channels boundary tensors take.

[Note: pipeline execution]
Compilation goes stage by stage, forward then backward, and exchanges only `PartitionSpec`s, so
that a stage can compile in the process that owns its devices (this one, or a host actor):
- `StageCompiler` (`_compile.py`) compiles one stage on its mesh for given input specs: its
  forward (returning outputs and residuals), and its backward (whole, or B and W), with gradient
  accumulators updated in place; it reports the specs XLA chose for every output.
- `layout_pipeline` (`_layout.py`) chains those specs, plans every transfer once (reused every
  micro-batch and step), and turns the schedule into per-stage instruction lists.
- `StageProgram` (here) steps through one stage's instructions (see [Note: instructions]) and
  is the only interpreter: the local runtime drives every rank's program from the calling
  thread (see [Note: one dispatching thread]), a Ray host actor one thread per stage it holds.
  Compute is dispatched to JAX asynchronously.
- `Channels` (here) is everything that happens to a boundary tensor; the runtimes differ only
  in its `_move` / `_post_receives` (see [Note: boundary tensors]).

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

[Note: signal-only bound]
The paper's upper bound on what hiding transfers can buy: every cross-mesh transfer becomes a
signal that keeps the dependency (the receiver still waits for the sender's value to exist) but
carries no data; the receiver computes on zeros placed on its mesh once. A step run so is as fast
as the same schedule with free communication; its losses are meaningless.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import TimeoutError as FuturesTimeout
from concurrent.futures import wait as futures_wait
from typing import Any

import jax
import numpy as np

from jaxreshard.comm._emulate import sleep_until
from jaxreshard.frontend._split import ACT, BATCH, CONST, LOSS, MB, OUT, PARAM, StepGraph
from jaxreshard.pipeline._action import BACKWARD, FORWARD
from jaxreshard.pipeline._emit import (
    ACTIVATION,
    GRADIENT,
    RECV_OP,
    RUN,
    SEND_OP,
    Instruction,
)
from jaxreshard.pipeline._emit import PARAM as PARAM_COPY
from jaxreshard.runtime._compile import StageCompiler
from jaxreshard.runtime._layout import PipelineLayout, Transfer
from jaxreshard.runtime._programs import program_fusion
from jaxreshard.runtime._specs import place
from jaxreshard.runtime._threads import JOIN_S, DaemonPool, join_all


class PipelineError(RuntimeError):
    """A stage failed, or a transfer did not arrive in time."""


class Stopped(PipelineError):
    """What a stage raises when it stops because the step already failed elsewhere; `failure`
    is that first failure (the one to report: `stage_failure` returns it)."""

    def __init__(self, failure: BaseException | None):
        super().__init__(f"stopped: another stage failed ({failure})")
        self.failure = failure


@dataclasses.dataclass
class Event:
    """A timed thing that happened during a step (for profiles).

    Kinds: `F`, `B`, `W` (compute; `FB` is a forward and backward run as one executable), `A`
    (an optimizer segment run after the pipeline), `send` (a transfer, on the sender's lane,
    `dst` its receiver), `arrive` (the same transfer complete at its receiver, where receiving
    is a job of its own: on Ray) and `wait` (a stage blocked in a RECV). Times are
    `time.perf_counter()` seconds of the process that ran the stage.
    """

    stage: int
    kind: str
    mb: int
    start: float
    end: float
    name: str
    nbytes: int = 0
    dst: int = -1

    @classmethod
    def send(cls, transfer: Any, mb: int, start: float, end: float, nbytes: int | None = None):
        """A `send` event of one micro-batch's `transfer` (its bytes unless `nbytes` says)."""
        size = transfer.nbytes if nbytes is None else nbytes
        return cls(
            transfer.src_stage, SEND, mb, start, end, transfer.name, size, transfer.dst_stage
        )


SEND, WAIT, APPLY_EVENT = "send", "wait", "A"
ARRIVE = "arrive"  # a transfer reached its receiver (recorded where receiving is a job of its own)


def transfer_key(ins: Instruction) -> tuple[str, int, int, int]:
    """The `PipelineLayout.transfers` key of the transfer an instruction moves."""
    return (ins.kind, ins.tensor, ins.src, ins.dst)


def transfer_name(ins: Instruction) -> str:
    """The name of the `Transfer` an instruction moves (`act3 s0->s1`)."""
    return f"{ins.kind}{ins.tensor} s{ins.src}->s{ins.dst}"


# -- channels ------------------------------------------------------------------------------------


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


def check_source(transfer: Transfer, value: Any, planned: Any) -> None:
    """A transfer's plan says which device holds which slice: moving a value laid out otherwise
    would deliver wrong data, so refuse it (an internal error, never silent)."""
    if value.sharding != planned and not value.sharding.is_equivalent_to(
        planned, len(transfer.shape)
    ):
        raise PipelineError(
            f"{transfer.name}: the value leaves stage {transfer.src_stage} as {value.sharding} but "
            f"its transfer was planned for {planned}; this is a jaxreshard bug, please report it"
        )


# -- the interpreter -----------------------------------------------------------------------------


@dataclasses.dataclass
class _Chunk:
    """What a rank's program keeps of one of its chunks during a step."""

    c: StageCompiler
    last: bool  # the model's last stage (its backward starts from the loss)
    params: dict[int, Any]  # the parameters it computes with: its own and copies received
    acc: list[Any] | None = None  # gradient accumulators (the first backward starts them)
    applied: list[Any] | None = None  # a fused optimizer's outputs
    inbox: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)
    outbox: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)
    grads_in: dict[tuple[int, int, int], Any] = dataclasses.field(default_factory=dict)
    grads_out: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)
    residuals: dict[int, Any] = dataclasses.field(default_factory=dict)
    exports: dict[int, Any] = dataclasses.field(default_factory=dict)
    early: dict[int, Any] = dataclasses.field(default_factory=dict)  # fused forward-backward


class StageProgram:
    """Steps through one rank's instructions (see [Note: instructions]) for the chunks (model
    stages) it runs: one, or several with virtual stages.

    The last stage runs a forward and the backward right after it (nothing between them but
    FREEs) as one executable when its backward is not split: nothing crosses stages in between,
    and XLA then keeps the residuals in the program instead of writing them out (with one stage
    and one micro-batch, the step is a single executable, as under `jax.jit`). A recorded step
    (a profile) runs them apart, so that each action has its own time.

    Args:
        compilers: the compiled executables of the rank's chunks, by chunk.
        graph, layout: the step.
        channels: moves boundary tensors (see [Note: boundary tensors]).
        rank: which program of `layout.programs` this is.
        record: if given, called with an `Event` after each action (blocks on its results).
    """

    def __init__(
        self,
        compilers: dict[int, StageCompiler],
        graph: StepGraph,
        layout: PipelineLayout,
        channels: Channels,
        rank: int,
        record: Callable[[Event], None] | None = None,
    ):
        self.compilers, self.graph, self.layout, self.channels = compilers, graph, layout, channels
        self.rank, self.record = rank, record
        self.program = layout.programs[rank]
        split = any(c.bw.w is not None for c in compilers.values())
        self.last_backward, self.fused_fb = program_fusion(
            self.program, list(compilers), layout.num_stages - 1, split
        )

    def run(
        self, *args: Any, **kwargs: Any
    ) -> tuple[dict[int, dict[int, Any]], dict[int, list[Any]]]:
        """Run the rank's program in this thread, blocking in each RECV until its value has
        arrived (at most `timeout_s`); the arguments and result are `steps`'."""
        program = self.steps(*args, **kwargs)
        try:
            while True:
                waiting = next(program)
                self.channels.wait_any([waiting], time.monotonic() + self.channels.timeout_s)
        except StopIteration as done:
            return done.value

    def steps(
        self,
        params: dict[int, Any],
        batches: dict[int, list[list[Any]]],
        consts: dict[int, list[Any]],
        losses: list[Any],
        apply_inputs: dict[int, Sequence[Any]] | None = None,
        results: dict[tuple[int, int], Any] | None = None,
        log: list[tuple[str, Any]] | None = None,
    ) -> Generator[Instruction, None, tuple[dict[int, dict[int, Any]], dict[int, list[Any]]]]:
        """The rank's program as a generator: it runs instructions until a RECV whose value has
        not arrived, yields that RECV, and goes on when resumed (from that RECV). One thread
        can so drive every rank of a process in turn (`dispatch`), or one thread each (`run`).

        Args:
            params: the parameters its chunks keep (owners), by index.
            batches: per chunk, per micro-batch, the chunk's batch inputs in input order.
            consts: per chunk, its per-step constants in input order.
            losses: filled per micro-batch by the last chunk.
            results: filled with the chunks' aux / forward outputs, by (result, micro-batch).
            apply_inputs: per chunk with a fused optimizer segment (`StageCompiler.set_apply`),
                that segment's inputs other than the gradients.
            log: if given, gets (what, outputs) of every compute action as it is dispatched,
                so that a caller can wait for the step with a deadline and name what hangs.

        Returns:
            Per chunk, its gradient accumulators by parameter index (none when its optimizer
            was fused); and per chunk with a fused optimizer, that segment's outputs.
        """
        graph, channels = self.graph, self.channels
        apply_inputs = apply_inputs or {}
        results = results if results is not None else {}
        last_chunk = self.layout.num_stages - 1
        chunks = {
            c: _Chunk(
                compiler,
                c == last_chunk,
                {k: v for k, v in params.items() if graph.owner[k] == c},
            )
            for c, compiler in self.compilers.items()
        }
        consumers = {a.id: a.consumers for a in graph.loss.activations}

        def cotangents(ch: _Chunk, mb: int) -> list[Any]:
            if ch.last:
                return []
            stage = ch.c.bw.stage
            return [
                ch.grads_in[(stage.outputs[i].index, consumer, mb)]
                for i in ch.c.bw.float_outputs
                for consumer in consumers[stage.outputs[i].index]
            ]

        def forward_inputs(ch: _Chunk, mb: int) -> list[Any]:
            stage, c = ch.c.bw.stage, ch.c.s
            args, batch_at, const_at = [], 0, 0
            for ref in stage.inputs:
                if ref.kind == PARAM:
                    args.append(ch.params[ref.index])
                elif ref.kind == BATCH:
                    args.append(batches[c][mb][batch_at])
                    batch_at += 1
                elif ref.kind == CONST:
                    args.append(consts[c][const_at])
                    const_at += 1
                elif ref.kind == MB:
                    args.append(ch.c.mb_index(mb))
                else:
                    args.append(ch.inbox[(ref.index, mb)])
            return args

        def keep_outputs(ch: _Chunk, mb: int, outs: Sequence[Any]) -> None:
            for ref, value in zip(ch.c.bw.stage.outputs, outs):
                if ref.kind == LOSS:
                    losses[mb] = value
                elif ref.kind == ACT:
                    ch.outbox[(ref.index, mb)] = value
                elif ref.kind == OUT:
                    results[(ref.index, mb)] = value

        def keep_act_grads(ch: _Chunk, mb: int, act_grads: Sequence[Any]) -> None:
            bw = ch.c.bw
            for k, g in zip(bw.act_grads, act_grads):
                ch.grads_out[(bw.stage.inputs[bw.diff[k]].index, mb)] = g

        for position, ins in enumerate(self.program):
            if channels.stopped:
                raise Stopped(channels.failure)
            if ins.op == RECV_OP:
                ch = chunks[ins.dst]
                start = time.perf_counter()
                value = channels.take(ins)
                while value is MISSING:
                    yield ins
                    value = channels.take(ins)
                if self.record is not None:
                    end = time.perf_counter()
                    self.record(Event(ins.dst, WAIT, ins.mb, start, end, transfer_name(ins)))
                if ins.kind == ACTIVATION:
                    ch.inbox[(ins.tensor, ins.mb)] = value
                elif ins.kind == GRADIENT:
                    ch.grads_in[(ins.tensor, ins.src, ins.mb)] = value
                elif ins.kind == PARAM_COPY:
                    ch.params[ins.tensor] = value
                else:  # a user's gradient contribution to a parameter this chunk keeps
                    k = ch.c.acc_slot[ins.tensor]
                    ch.acc[k] = ch.acc[k] + value  # type: ignore[index]
            elif ins.op == SEND_OP:
                ch = chunks[ins.src]
                if ins.kind == ACTIVATION:
                    channels.send(ins, ch.outbox[(ins.tensor, ins.mb)])
                elif ins.kind == GRADIENT:
                    channels.send(ins, ch.grads_out[(ins.tensor, ins.mb)])
                elif ins.kind == PARAM_COPY:
                    channels.send(ins, ch.params[ins.tensor])
                else:
                    channels.send(ins, ch.acc[ch.c.acc_slot[ins.tensor]])  # type: ignore[index]
            elif ins.op == RUN:
                self._run(ins, position, chunks, forward_inputs, cotangents, keep_act_grads,
                          keep_outputs, apply_inputs, log)  # fmt: skip
            else:  # FREE: drop what this micro-batch no longer needs
                ch, mb = chunks[ins.src], ins.mb
                if ins.kind == "fwd":
                    for store in (ch.inbox, ch.outbox):
                        for key in [k for k in store if k[1] == mb]:
                            del store[key]
                else:
                    ch.residuals.pop(mb, None)
                    for key in [k for k in ch.grads_in if k[2] == mb]:
                        del ch.grads_in[key]
                    for key in [k for k in ch.grads_out if k[1] == mb]:
                        del ch.grads_out[key]
        accumulators = {
            c: dict(zip(ch.c.acc_params, ch.acc)) if ch.acc else {} for c, ch in chunks.items()
        }
        applied = {c: ch.applied for c, ch in chunks.items() if ch.applied is not None}
        return accumulators, applied

    def _run(
        self,
        ins: Instruction,
        position: int,
        chunks: dict[int, _Chunk],
        forward_inputs: Callable[[_Chunk, int], list[Any]],
        cotangents: Callable[[_Chunk, int], list[Any]],
        keep_act_grads: Callable[[_Chunk, int, Sequence[Any]], None],
        keep_outputs: Callable[[_Chunk, int, Sequence[Any]], None],
        apply_inputs: dict[int, Sequence[Any]],
        log: list[tuple[str, Any]] | None,
    ) -> None:
        action = ins.action
        c, mb, kind = action.stage_index, action.microbatch_index, action.kind
        ch = chunks[c]
        comp, bw = ch.c, ch.c.bw
        extra = apply_inputs.get(c)
        fused = comp.fused and extra is not None
        start = time.perf_counter()
        if kind != FORWARD and ch.acc is None and comp.acc_params:
            ch.acc = comp.call("zeros")  # the step's accumulators start at zero
        if position in self.fused_fb and self.record is None:  # forward and backward at once
            if ch.acc is None and comp.acc_params:
                ch.acc = comp.call("zeros")
            args = forward_inputs(ch, mb)
            if fused and self.fused_fb[position] == self.last_backward[c]:
                outs, act_grads, ch.applied = comp.call("fb_apply", ch.acc or [], args, extra)
                ch.acc = []
            else:
                outs, act_grads, ch.acc = comp.call("fb", ch.acc or [], args)
            keep_outputs(ch, mb, outs)
            ch.early[mb] = act_grads
            done: Any = (outs, act_grads, ch.acc, ch.applied)
            kind = "FB"
        elif kind == BACKWARD and mb in ch.early:
            keep_act_grads(ch, mb, ch.early.pop(mb))
            return
        elif kind == FORWARD:
            outs, ch.residuals[mb] = comp.call("forward", *forward_inputs(ch, mb))
            keep_outputs(ch, mb, outs)
            done = outs
        elif kind == BACKWARD:
            final = fused and position == self.last_backward[c]
            res, cts = ch.residuals[mb], cotangents(ch, mb)
            if final:
                act_grads, ch.applied = comp.call("apply", ch.acc or [], res, cts, extra)
                ch.acc = []
            elif bw.w is None:
                act_grads, ch.acc = comp.call("backward", ch.acc or [], res, cts)
            else:
                act_grads, ch.exports[mb] = comp.call("b_part", res, cts)
            keep_act_grads(ch, mb, act_grads)
            # Everything the executable wrote (a first stage sends nothing back: its backward
            # is all accumulators).
            done = (act_grads, ch.acc, ch.applied, ch.exports.get(mb))
        else:  # WEIGHT
            res, cts, exports = ch.residuals[mb], cotangents(ch, mb), ch.exports.pop(mb)
            if fused and position == self.last_backward[c]:  # with the optimizer
                ch.applied = comp.call("apply", ch.acc or [], res, cts, exports, extra)
                ch.acc, done = [], ch.applied
            else:
                ch.acc = comp.call("w_part", ch.acc or [], res, cts, exports)
                done = ch.acc
        if log is not None:
            log.append((f"stage {c}'s {'FB' if kind == 'FB' else kind}{mb}", done))
        if self.record is not None:
            jax.block_until_ready(done)
            label = f"{c}FB{mb}" if kind == "FB" else str(action)
            self.record(Event(c, kind, mb, start, time.perf_counter(), label))
