"""What a step reports: its events (for profiles) and its errors.

[Note: recorded segments]
A plain step dispatches its post-gradient segments (the optimizer) one after the other without
waiting, so each stage's runs on its own devices while the others' run on theirs (and with
`fuse_optimizer`, right after its last backward). A recorded step used to run them one at a time,
each timed by blocking on it: stage 1's optimizer then waited for stage 0's, which the simulator
(each stage's `A` after its own last action) never saw, and the profile's step came out longer
than the plain one (the tiny GPT: stage 1's optimizer started 9 ms after its last action, 6% of
the step). Now a recorded step dispatches the segments of its stages' hosts one after the
other without waiting, as a plain one does, and a thread per segment stamps when its outputs
are ready (`SegmentClock`). A segment starts at the latest of its dispatch, the end of the
previous one on its devices (they run their programs in order; with virtual stages several
stages share them) and the ends of the segments whose outputs it reads, so a stage's `A` time
is its own. Still run apart: segments the driver runs after the step (inputs from several
stages' hosts), and the optimizer a plain step fuses into the last backward (a recorded step
fuses nothing, to time each action).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
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


@dataclasses.dataclass
class _SegmentRun:
    stage: int
    lane: Any  # its devices: stages of one rank (virtual stages) share them
    start: float  # when it was dispatched
    after: tuple[int, ...]  # the segments whose outputs it reads
    thread: threading.Thread


class SegmentClock:
    """Times a recorded step's post-gradient segments, dispatched without waiting (see
    [Note: recorded segments]): `started` after each dispatch, `events` once all are
    dispatched. The segments must be ready within `timeout_s` of `events` being called, or
    the step fails naming the first that is not (`where` prefixes the message: the host).
    `wait(outs, stop)` waits for a segment's outputs (polling, so that a thread given up on
    is never left inside JAX: see [Note: threads at exit]); False if `stop()` came first."""

    def __init__(
        self,
        timeout_s: float,
        where: str = "",
        wait: Callable[[Any, Callable[[], bool]], bool] | None = None,
    ) -> None:
        from jaxreshard.runtime.engine._threads import wait_ready

        self.timeout_s, self.where = timeout_s, where
        self._wait = wait or wait_ready
        self._runs: dict[int, _SegmentRun] = {}
        self._ready: dict[int, float] = {}  # (each written by its own thread, read after it)
        self._errors: dict[int, BaseException] = {}
        self._stopped = False

    def started(
        self, index: int, stage: int, lane: Any, start: float, outs: Any, after: Sequence[int] = ()
    ) -> None:
        def stamp() -> None:
            try:
                if not self._wait(outs, lambda: self._stopped):
                    return
            except BaseException as e:  # (raised by `events`, in the step's thread)
                self._errors[index] = e
            self._ready[index] = time.perf_counter()

        thread = threading.Thread(target=stamp, name=f"segment-{index}-clock", daemon=True)
        thread.start()
        self._runs[index] = _SegmentRun(stage, lane, start, tuple(after), thread)

    def stop(self) -> None:
        """Have every clock stop waiting (the step failed)."""
        self._stopped = True

    def events(self) -> list[Event]:
        """One `A` event per segment, in dispatch order, once every one is ready. A segment
        starts at the latest of its dispatch, the end of the previous one on its devices (they
        run their programs in order) and the ends of those whose outputs it reads."""
        deadline = time.monotonic() + self.timeout_s
        for index, run in self._runs.items():
            run.thread.join(max(0.0, deadline - time.monotonic()))
            if run.thread.is_alive() or self._errors:
                self.stop()
                if self._errors:  # (a segment that failed says more than one still running)
                    raise next(iter(self._errors.values()))
                raise PipelineError(
                    f"{self.where}stage {run.stage}'s post-gradient segment {index} (the "
                    f"optimizer) was not done after timeout_s={self.timeout_s:g} s; raise "
                    "PipelineConfig.timeout_s if it is only slow"
                )
        out: list[Event] = []
        free: dict[Any, float] = {}  # lane -> when its devices finished their previous segment
        for index, run in self._runs.items():
            end = self._ready[index]
            inputs = [self._ready.get(j, run.start) for j in run.after]
            begin = max(run.start, free.get(run.lane, run.start), *inputs)
            free[run.lane] = end
            out.append(Event(run.stage, APPLY_EVENT, -1, min(begin, end), end, "apply"))
        return out
