"""What a step reports: its events (for profiles) and its errors."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxreshard.pipeline._emit import Instruction


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
    (an optimizer segment run after the pipeline, or a stage's once-a-step gradient reduction,
    named `{stage}R`), `send` (a transfer, on the sender's lane,
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
