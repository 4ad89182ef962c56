"""The interpreter of stage programs: one rank's instructions, step by step.

[Note: pipeline execution]
Compilation goes stage by stage, forward then backward, and exchanges only `PartitionSpec`s, so
that a stage can compile in the process that owns its devices (this one, or a host actor):
- `StageCompiler` (`step/_compile.py`) compiles one stage on its mesh for given input specs: its
  forward (returning outputs and residuals), and its backward (whole, or B and W), with gradient
  accumulators updated in place; it reports the specs XLA chose for every output.
- `layout_pipeline` (`step/_layout.py`) chains those specs, plans every transfer once (reused every
  micro-batch and step), and turns the schedule into per-stage instruction lists.
- `StageProgram` (here) steps through one stage's instructions (see [Note: instructions]) and
  is the only interpreter: the local runtime drives every rank's program from the calling
  thread (see [Note: one dispatching thread]), a Ray host actor one thread per stage it holds.
  Compute is dispatched to JAX asynchronously.
- `Channels` (here) is everything that happens to a boundary tensor; the runtimes differ only
  in its `_move` / `_post_receives` (see [Note: boundary tensors]).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

import jax

from jaxreshard.frontend._split import ACT, BATCH, CONST, LOSS, MB, OUT, PARAM, StepGraph
from jaxreshard.pipeline._action import BACKWARD
from jaxreshard.pipeline._emit import (
    ACTIVATION,
    GRADIENT,
    RECV_OP,
    RUN,
    SEND_OP,
    Instruction,
)
from jaxreshard.pipeline._emit import PARAM as PARAM_COPY
from jaxreshard.runtime.engine._channels import MISSING, Channels
from jaxreshard.runtime.engine._events import (
    APPLY_EVENT,
    WAIT,
    Event,
    PipelineError,
    Stopped,
    transfer_name,
)
from jaxreshard.runtime.step._compile import StageCompiler
from jaxreshard.runtime.step._layout import PipelineLayout, Transfer
from jaxreshard.runtime.step._programs import (
    Call,
    base_name,
    program_calls,
    program_fusion,
    starts_from_zero,
)


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
        fused = [c for c, comp in compilers.items() if comp.fused]
        # What each RUN calls, in a plain step and in a recorded one (which fuses nothing).
        self._calls = {
            recorded: program_calls(
                self.program, list(compilers), layout.num_stages - 1, split, fused, recorded
            )
            for recorded in (False, True)
        }
        self.last_backward, _ = program_fusion(
            self.program, list(compilers), layout.num_stages - 1, split
        )

    @property
    def calls(self) -> dict[int, Call]:
        """What each RUN position calls in this step (`program_calls`)."""
        return self._calls[self.record is not None]

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
        action, call = ins.action, self.calls[position]
        c, mb, kind = action.stage_index, action.microbatch_index, action.kind
        ch = chunks[c]
        comp = ch.c
        if not call.name:  # computed by an earlier call (a fused forward-backward, a scan)
            if kind == BACKWARD:
                keep_act_grads(ch, mb, ch.early.pop(mb))
            return
        name = comp.variant(call.name)
        base, extra = base_name(name), apply_inputs.get(c)
        start = time.perf_counter()
        acc: list[Any] = []
        if (
            call.backward >= 0
            and comp.acc_params
            and not starts_from_zero(name)
            and base != "b_part"
        ):
            if ch.acc is None:
                ch.acc = comp.call("zeros")
            acc = ch.acc
        applies = base in ("apply", "fb_apply", "fb_scan_apply")
        with_acc = [] if starts_from_zero(name) else [acc]
        if base == "fb_scan" or base == "fb_scan_apply":  # several micro-batches at once
            varying = comp.varying()
            shared = [x for x, v in zip(forward_inputs(ch, mb), varying) if not v]
            pieces = [
                [x for x, v in zip(forward_inputs(ch, j), varying) if v] for j in call.micro_batches
            ]
            outs, act_grads, result = comp.call(name, *with_acc, shared, pieces,
                                                *([extra] if applies else []))  # fmt: skip
            for j, o, a in zip(call.micro_batches, outs, act_grads):
                keep_outputs(ch, j, o)
                ch.early[j] = a
            done: Any = (outs, act_grads, result)
        elif base in ("fb", "fb_apply"):  # the last chunk's forward and backward at once
            outs, act_grads, result = comp.call(
                name, *with_acc, forward_inputs(ch, mb), *([extra] if applies else [])
            )
            keep_outputs(ch, mb, outs)
            ch.early[mb] = act_grads
            done = (outs, act_grads, result)
        elif base == "forward":  # (see [Note: residuals kept by reference])
            inputs = forward_inputs(ch, mb)
            outs, computed = comp.call(name, *inputs)
            ch.residuals[mb] = comp.residuals_of(inputs, computed)
            keep_outputs(ch, mb, outs)
            done = outs
        elif base == "b_part":
            act_grads, ch.exports[mb] = comp.call(name, ch.residuals[mb], cotangents(ch, mb))
            keep_act_grads(ch, mb, act_grads)
            done, result = (act_grads, ch.exports[mb]), None
        elif kind == BACKWARD:  # backward, or apply (the optimizer too)
            res, cts = ch.residuals[mb], cotangents(ch, mb)
            act_grads, result = comp.call(name, *with_acc, res, cts,
                                          *([extra] if applies else []))  # fmt: skip
            keep_act_grads(ch, mb, act_grads)
            done = (act_grads, result)
        else:  # WEIGHT: w_part, or apply (the optimizer too)
            res, cts, exports = ch.residuals[mb], cotangents(ch, mb), ch.exports.pop(mb)
            result = comp.call(name, *with_acc, res, cts, exports,
                               *([extra] if applies else []))  # fmt: skip
            done = result
        if call.backward >= 0 and base != "b_part":
            if applies:
                ch.applied, ch.acc = result, []
            else:
                ch.acc = result
        reduced_at = None
        if comp.reduced and ch.acc and call.backward == self.last_backward[c]:
            # The step's one reduction of this chunk's gradients over its batch axes (see
            # [Note: gradients reduced once] in `step/_reduction.py`). A recorded step times it
            # apart: it runs once a step, after the chunk's last backward, as the optimizer does.
            if self.record is not None:
                jax.block_until_ready((done, ch.acc))
                reduced_at = time.perf_counter()
            ch.acc = comp.call("reduce", ch.acc)  # (donates the unreduced ones)
            kept = [
                x for x in jax.tree.leaves(done) if isinstance(x, jax.Array) and not x.is_deleted()
            ]
            done = (kept, ch.acc)
        fb = base.startswith("fb")
        if log is not None:
            what = f"{'FB' if fb else kind}{mb}"
            if len(call.micro_batches) > 1:
                what = f"FB{mb}..{call.micro_batches[-1]} (one scan)"
            log.append((f"stage {c}'s {what}", done))
        if self.record is not None:
            jax.block_until_ready(done)
            label = f"{c}FB{mb}" if fb else str(action)
            end = time.perf_counter()
            self.record(Event(c, "FB" if fb else kind, mb, start, reduced_at or end, label))
            if reduced_at is not None:
                self.record(Event(c, APPLY_EVENT, -1, reduced_at, end, f"{c}R"))
