"""A cut train step compiled for concrete meshes, and the interpreter of stage programs.

[Note: pipeline execution]
Compilation goes stage by stage, forward then backward, and exchanges only `PartitionSpec`s, so
that a stage can compile in the process that owns its devices (this one, or a host actor):
- `StageCompiler` compiles one stage on its mesh for given input specs: its forward (returning
  outputs and residuals), and its backward (whole, or B and W), with gradient accumulators
  updated in place; it reports the specs XLA chose for every output.
- `layout_pipeline` chains those specs: a boundary tensor leaves its producer with the spec the
  producer's executable gives it, and enters its consumer with the same spec on the consumer's
  mesh when that fits (same axes, divisible), else replicated. Every boundary tensor, gradient and
  parameter copy gets one resharding plan (over the runtime's device ids), reused every
  micro-batch and step, and the schedule becomes per-stage instruction lists.
- `StageRunner` steps through one stage's instructions (see [Note: instructions]) with the
  runtime's `send`/`recv`; compute is dispatched to JAX asynchronously.
The local executor runs one runner thread per stage; a SEND hands the value to a transfer thread
that moves it by its plan while the stage goes on, and a RECV waits, with a deadline, for it. The
first failure stops every runner.

[Note: signal-only bound]
The paper's upper bound on what hiding transfers can buy: every cross-mesh transfer becomes a
signal that keeps the dependency (the receiver still waits for the sender's value to exist) but
carries no data; the receiver computes on zeros placed on its mesh once. A step run so is as fast
as the same schedule with free communication; its losses are meaningless.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxreshard.frontend._split import BATCH, CONST, PARAM, StepGraph
from jaxreshard.pipeline._action import BACKWARD, FORWARD, WEIGHT
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
from jaxreshard.runtime._layout import PipelineLayout


class PipelineError(RuntimeError):
    """A stage failed, or a transfer did not arrive in time."""


@dataclasses.dataclass
class Event:
    """A timed thing that happened during a step (for profiles).

    Kinds: `F`, `B`, `W` (compute), `A` (an optimizer segment run after the pipeline), `send`
    (a transfer, on the sender's lane, `dst` its receiver) and `wait` (a stage blocked in a
    RECV). Times are `time.perf_counter()` seconds of the process that ran the stage.
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


def transfer_name(ins: Instruction) -> str:
    """The name of the `Transfer` an instruction moves (`act3 s0->s1`)."""
    return f"{ins.kind}{ins.tensor} s{ins.src}->s{ins.dst}"


class StageRunner:
    """Steps through one stage's instructions (see [Note: instructions]).

    Args:
        compiler: the stage's compiled executables.
        graph, layout: the step.
        send: `send(instruction, value)` starts a transfer (must not block).
        recv: `recv(instruction) -> value` waits for one (with a deadline).
        stopped: tells the runner that another stage failed.
        record: if given, called with an `Event` after each action (blocks on its results).
    """

    def __init__(
        self,
        compiler: StageCompiler,
        graph: StepGraph,
        layout: PipelineLayout,
        send: Callable[[Instruction, Any], None],
        recv: Callable[[Instruction], Any],
        stopped: Callable[[], bool],
        record: Callable[[Event], None] | None = None,
    ):
        self.c, self.graph, self.layout = compiler, graph, layout
        self.send, self.recv, self.stopped, self.record = send, recv, stopped, record

    def run(
        self,
        params: dict[int, Any],
        batches: list[list[Any]],
        consts: list[Any],
        losses: list[Any],
        apply_inputs: Sequence[Any] | None = None,
    ) -> tuple[dict[int, Any], list[Any] | None]:
        """Run the stage's program.

        Args:
            params: the parameters this stage keeps (owner), by index.
            batches: per micro-batch, the stage's batch inputs in input order.
            consts: the stage's per-step constants in input order.
            losses: filled per micro-batch by the last stage.
            apply_inputs: with a fused optimizer segment (`StageCompiler.set_apply`), its
                inputs other than the gradients.

        Returns:
            The gradient accumulators by parameter index (none when the optimizer was fused),
            and the fused segment's outputs (or None).
        """
        fused = self.c.fused and apply_inputs is not None
        applied: list[Any] | None = None
        last_backward = max(
            i
            for i, ins in enumerate(self.layout.programs[self.c.s])
            if ins.op == RUN and ins.action.kind in (BACKWARD, WEIGHT)
        )
        c, bw = self.c, self.c.bw
        stage, s = bw.stage, self.c.s
        last = s == self.layout.num_stages - 1
        local_params = dict(params)
        acc: list[Any] | None = None  # the first backward's gradients start the accumulators
        acc_params = c.acc_params
        inbox: dict[tuple[int, int], Any] = {}
        outbox: dict[tuple[int, int], Any] = {}
        grads_in: dict[tuple[int, int, int], Any] = {}
        grads_out: dict[tuple[int, int], Any] = {}
        residuals: dict[int, Any] = {}
        exports: dict[int, Any] = {}
        batch_pos = [i for i, r in enumerate(stage.inputs) if r.kind == BATCH]
        const_pos = [i for i, r in enumerate(stage.inputs) if r.kind == CONST]
        consumers = {a.id: a.consumers for a in self.graph.loss.activations}

        def cotangents(mb: int) -> list[Any]:
            if last:
                return []
            return [
                grads_in[(stage.outputs[i].index, consumer, mb)]
                for i in bw.float_outputs
                for consumer in consumers[stage.outputs[i].index]
            ]

        for position, ins in enumerate(self.layout.programs[s]):
            final = fused and position == last_backward
            if self.stopped():
                raise PipelineError("stopped: another stage failed")
            if ins.op == RECV_OP:
                start = time.perf_counter()
                value = self.recv(ins)
                if self.record is not None:
                    self.record(
                        Event(s, WAIT, ins.mb, start, time.perf_counter(), transfer_name(ins))
                    )
                if ins.kind == ACTIVATION:
                    inbox[(ins.tensor, ins.mb)] = value
                elif ins.kind == GRADIENT:
                    grads_in[(ins.tensor, ins.src, ins.mb)] = value
                elif ins.kind == PARAM_COPY:
                    local_params[ins.tensor] = value
                else:  # a user's gradient contribution to a parameter this stage keeps
                    k = acc_params.index(ins.tensor)
                    acc[k] = acc[k] + value
            elif ins.op == SEND_OP:
                if ins.kind == ACTIVATION:
                    self.send(ins, outbox[(ins.tensor, ins.mb)])
                elif ins.kind == GRADIENT:
                    self.send(ins, grads_out[(ins.tensor, ins.mb)])
                elif ins.kind == PARAM_COPY:
                    self.send(ins, local_params[ins.tensor])
                else:
                    self.send(ins, acc[acc_params.index(ins.tensor)])
            elif ins.op == RUN:
                action = ins.action
                mb = action.microbatch_index
                start = time.perf_counter()
                if action.kind == FORWARD:
                    args = []
                    for i, ref in enumerate(stage.inputs):
                        if ref.kind == PARAM:
                            args.append(local_params[ref.index])
                        elif ref.kind == BATCH:
                            args.append(batches[mb][batch_pos.index(i)])
                        elif ref.kind == CONST:
                            args.append(consts[const_pos.index(i)])
                        else:
                            args.append(inbox[(ref.index, mb)])
                    outs, residuals[mb] = c.forward(*args)
                    if last:
                        losses[mb] = outs[0]
                    else:
                        for ref, value in zip(stage.outputs, outs):
                            outbox[(ref.index, mb)] = value
                    done = outs
                elif action.kind == BACKWARD:
                    if final and acc is None:
                        act_grads, applied = c.apply_first(
                            residuals[mb], cotangents(mb), apply_inputs
                        )
                    elif final:
                        act_grads, applied = c.apply_later(
                            acc, residuals[mb], cotangents(mb), apply_inputs
                        )
                        acc = []
                    elif bw.w is None and acc is None:
                        act_grads, acc = c.backward_first(residuals[mb], cotangents(mb))
                    elif bw.w is None:
                        act_grads, acc = c.backward(acc, residuals[mb], cotangents(mb))
                    else:
                        act_grads, exports[mb] = c.b_part(residuals[mb], cotangents(mb))
                    for k, g in zip(bw.act_grads, act_grads):
                        grads_out[(stage.inputs[bw.diff[k]].index, mb)] = g
                    done = act_grads
                elif final:  # WEIGHT, with the optimizer
                    args = (residuals[mb], cotangents(mb), exports.pop(mb), apply_inputs)
                    applied = c.apply_first(*args) if acc is None else c.apply_later(acc, *args)
                    acc, done = [], applied
                else:  # WEIGHT
                    if acc is None:
                        acc = c.w_first(residuals[mb], cotangents(mb), exports.pop(mb))
                    else:
                        acc = c.w_part(acc, residuals[mb], cotangents(mb), exports.pop(mb))
                    done = acc
                if self.record is not None:
                    jax.block_until_ready(done)
                    self.record(Event(s, action.kind, mb, start, time.perf_counter(), str(action)))
            else:  # FREE: drop what this micro-batch no longer needs
                mb = ins.mb
                if ins.kind == "fwd":
                    for store in (inbox, outbox):
                        for key in [k for k in store if k[1] == mb]:
                            del store[key]
                else:
                    residuals.pop(mb, None)
                    for key in [k for k in grads_in if k[2] == mb]:
                        del grads_in[key]
                    for key in [k for k in grads_out if k[1] == mb]:
                        del grads_out[key]
        return (dict(zip(acc_params, acc)) if acc else {}), applied
