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
  is the only interpreter: the local runtime runs one per stage in threads of this process, a
  Ray host actor one per stage it holds. Compute is dispatched to JAX asynchronously.
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
from collections.abc import Callable, Sequence
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


class PipelineError(RuntimeError):
    """A stage failed, or a transfer did not arrive in time."""


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
    """

    def __init__(self, layout: PipelineLayout, timeout_s: float):
        self.layout, self.timeout_s = layout, timeout_s
        self.record: Callable[[Event], None] | None = None
        self.signal_only = False
        self._cond = threading.Condition()
        self._arrived: dict[tuple[Any, ...], tuple[Any, float]] = {}
        self._failure: BaseException | None = None
        self._queues: dict[int, list[Any]] = {}
        self._senders: dict[int, threading.Thread] = {}
        self._in_flight = 0
        self._order = itertools.count()
        self._closed = False
        self._placeholders: dict[tuple[str, Any], Any] = {}

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
            self._arrived.clear()
            self._failure = None
            self._in_flight = 0
        self.record, self.signal_only = record, signal_only
        self._post_receives(stages)

    # A small transfer of a value that already exists moves in the sending stage's thread when
    # nothing else waits to go out (0: never): cheaper than waking a sender thread for it.
    inline_bytes = 0

    def send(self, ins: Instruction, value: Any) -> None:
        """Hand a value over for moving; returns at once (or after moving a small, ready value:
        see `inline_bytes`)."""
        transfer = self.layout.transfers[transfer_key(ins)]
        if (
            transfer.nbytes <= self.inline_bytes
            and not self._queues.get(ins.src)
            and value.is_ready()
        ):
            self._check_failure()
            self._move(ins, transfer, value)
            return
        need = self.layout.need.get(ins.key, 0.0)
        with self._cond:
            self._check_failure()
            heapq.heappush(
                self._queues.setdefault(ins.src, []),
                (need, next(self._order), ins, transfer, value),
            )
            self._in_flight += 1
            if ins.src not in self._senders:
                thread = threading.Thread(
                    target=self._send_loop,
                    args=(ins.src,),
                    name=f"jaxreshard-send-s{ins.src}",
                    daemon=True,
                )
                self._senders[ins.src] = thread
                thread.start()
            self._cond.notify_all()

    def recv(self, ins: Instruction) -> Any:
        """The value of a RECV, waiting (at most `timeout_s`) until it has arrived."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while ins.key not in self._arrived:
                self._check_failure()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PipelineError(self._silent(ins))
                self._cond.wait(min(left, 1.0))
            value, ready = self._arrived.pop(ins.key)
        sleep_until(ready)  # an emulated link's end (0: now)
        return value

    def deliver(self, key: tuple[Any, ...], value: Any, ready: float = 0.0) -> None:
        """A moved value has arrived (usable from `ready` on the monotonic clock)."""
        with self._cond:
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

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # Helpers for subclasses --------------------------------------------------------------------

    def placeholder(self, transfer: Transfer, sharding: Any) -> Any:
        """Signal-only mode's stand-in for a transfer's result: zeros already in place, made
        once (see [Note: signal-only bound])."""
        key = (transfer.name, transfer.dst_spec)
        with self._cond:
            value = self._placeholders.get(key)
        if value is None:
            value = jax.device_put(np.zeros(transfer.shape, transfer.dtype), sharding)
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

    def _send_loop(self, stage: int) -> None:
        queue = self._queues[stage]
        while True:
            with self._cond:
                while not queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                _, _, ins, transfer, value = heapq.heappop(queue)
            try:
                if self._failure is None:
                    self._move(ins, transfer, value)
            except BaseException as e:
                error = (
                    e
                    if isinstance(e, PipelineError)
                    else PipelineError(
                        f"{self.where(ins.src)}: sending {ins}: {type(e).__name__}: {e}"
                    )
                )
                error.__cause__ = e
                self.fail(error)
            finally:
                with self._cond:
                    self._in_flight -= 1
                    self._cond.notify_all()

    def _check_failure(self) -> None:
        if self._failure is not None:
            raise PipelineError("stopped: another stage failed") from None

    def _silent(self, ins: Instruction) -> str:
        return (
            f"{self.where(ins.dst)} waited timeout_s={self.timeout_s:g} s for {ins}; "
            f"{self.where(ins.src)} never sent it (it is stuck, dead, or slower than timeout_s)"
        )


def wait_for_stages(
    stages: Sequence[Any], channels: Sequence[Channels], timeout_s: float, what: str
) -> None:
    """Wait until every stage's runner (a `Future` or a `Thread`) has returned. Each of their
    waits has a deadline, so they end; once the step has failed, they get `timeout_s` more to
    notice it before the step gives up on them (a stuck device)."""
    deadline: float | None = None
    for stage in stages:
        while not (stage.done() if hasattr(stage, "done") else not stage.is_alive()):
            if hasattr(stage, "join"):
                stage.join(0.5)
            else:
                futures_wait([stage], timeout=0.5)
            if deadline is None and any(c.stopped for c in channels):
                deadline = time.monotonic() + timeout_s
            if deadline is not None and time.monotonic() > deadline:
                raise PipelineError(
                    f"{what}: a stage did not stop within {timeout_s:g} s after the step failed "
                    "(a device or a transfer is stuck); restart the runtime "
                    "(jaxreshard.shutdown(); jaxreshard.init())"
                )


def check_source(transfer: Transfer, value: Any, planned: Any) -> None:
    """A transfer's plan says which device holds which slice: moving a value laid out otherwise
    would deliver wrong data, so refuse it (an internal error, never silent)."""
    if not value.sharding.is_equivalent_to(planned, len(transfer.shape)):
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
        self,
        params: dict[int, Any],
        batches: dict[int, list[list[Any]]],
        consts: dict[int, list[Any]],
        losses: list[Any],
        apply_inputs: dict[int, Sequence[Any]] | None = None,
        results: dict[tuple[int, int], Any] | None = None,
    ) -> tuple[dict[int, dict[int, Any]], dict[int, list[Any]]]:
        """Run the rank's program.

        Args:
            params: the parameters its chunks keep (owners), by index.
            batches: per chunk, per micro-batch, the chunk's batch inputs in input order.
            consts: per chunk, its per-step constants in input order.
            losses: filled per micro-batch by the last chunk.
            results: filled with the chunks' aux / forward outputs, by (result, micro-batch).
            apply_inputs: per chunk with a fused optimizer segment (`StageCompiler.set_apply`),
                that segment's inputs other than the gradients.

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
                raise PipelineError("stopped: another stage failed")
            if ins.op == RECV_OP:
                ch = chunks[ins.dst]
                start = time.perf_counter()
                value = channels.recv(ins)
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
                    k = ch.c.acc_params.index(ins.tensor)
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
                    channels.send(ins, ch.acc[ch.c.acc_params.index(ins.tensor)])  # type: ignore[index]
            elif ins.op == RUN:
                self._run(ins, position, chunks, forward_inputs, cotangents, keep_act_grads,
                          keep_outputs, apply_inputs)  # fmt: skip
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
        if self.record is not None:
            jax.block_until_ready(done)
            label = f"{c}FB{mb}" if kind == "FB" else str(action)
            self.record(Event(c, kind, mb, start, time.perf_counter(), label))
