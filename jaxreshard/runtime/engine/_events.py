"""What a step reports: its events (for profiles) and its errors.

[Note: recorded segments]
A plain step dispatches its post-gradient segments (the optimizer) one after the other without
waiting, so each stage's runs on its own devices while the others' run on theirs (and with
`fuse_optimizer`, right after its last backward). A recorded step used to run them one at a time,
each timed by blocking on it: stage 1's optimizer then waited for stage 0's, which the simulator
(each stage's `A` after its own last action) never saw, and the profile's step came out longer
than the plain one (the tiny GPT: stage 1's optimizer started 9 ms after its last action, 6% of
the step). Now a recorded step dispatches them as a plain one does, and a thread per segment
stamps when its outputs are ready (`SegmentClock`). A segment starts at the later of its
dispatch and the end of the previous one on its stage (a device runs its programs in order), so
a stage's `A` time is its own. One that reads another's outputs waits for them to be stamped
first, since it may donate them.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import jax

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


class SegmentClock:
    """Times a recorded step's post-gradient segments, dispatched without waiting (see
    [Note: recorded segments]): `started` after each dispatch, `join` before a segment reads
    another's outputs, `events` once all are dispatched. A segment not ready within
    `timeout_s` fails the step, as a stage's action would."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._runs: dict[int, tuple[int, float, threading.Thread]] = {}
        self._ready: dict[int, float] = {}
        self._errors: dict[int, BaseException] = {}

    def started(self, index: int, stage: int, start: float, outs: Any) -> None:
        def stamp() -> None:
            try:
                jax.block_until_ready(outs)
            except BaseException as e:  # (raised by `join`, in the step's thread)
                self._errors[index] = e
            self._ready[index] = time.perf_counter()

        thread = threading.Thread(target=stamp, name=f"segment-{index}-clock", daemon=True)
        thread.start()
        self._runs[index] = (stage, start, thread)

    def join(self, index: int) -> None:
        """Wait until segment `index` is ready (raise what it raised)."""
        if index not in self._runs:
            return
        stage, _, thread = self._runs[index]
        thread.join(self.timeout_s)
        if thread.is_alive():
            raise PipelineError(
                f"stage {stage}'s post-gradient segment {index} (the optimizer) was not done "
                f"after timeout_s={self.timeout_s:g} s; raise PipelineConfig.timeout_s if it "
                "is only slow"
            )
        if index in self._errors:
            raise self._errors[index]

    def events(self) -> list[Event]:
        """One `A` event per segment, in dispatch order, once every one is ready."""
        out, free = [], {}  # stage -> when its devices finished its previous segment
        for index, (stage, start, _) in self._runs.items():
            self.join(index)
            end = self._ready[index]
            begin = min(end, max(start, free.get(stage, start)))
            free[stage] = end
            out.append(Event(stage, APPLY_EVENT, -1, begin, end, "apply"))
        return out
