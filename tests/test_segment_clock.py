"""`SegmentClock`: how a recorded step times its post-gradient segments (see [Note: recorded
segments] in `runtime/engine/_events.py`), on stand-in outputs whose readiness the test holds."""

import threading
import time

import pytest

from jaxreshard.runtime.engine._events import APPLY_EVENT, PipelineError, SegmentClock


class Output:
    """A stand-in output: `block_until_ready` (what `jax.block_until_ready` calls on a leaf that
    is not a jax.Array) waits until the test releases it, then raises `error` if given."""

    def __init__(self, error: BaseException | None = None):
        self.released = threading.Event()
        self.error = error

    def block_until_ready(self):
        assert self.released.wait(10), "never released"
        if self.error is not None:
            raise self.error
        return self


def test_segments_of_different_stages_are_timed_as_running_together():
    clock = SegmentClock(timeout_s=10)
    a, b = Output(), Output()
    clock.started(0, stage=0, start=time.perf_counter(), outs=[a])
    clock.started(1, stage=1, start=time.perf_counter(), outs=[b])
    time.sleep(0.05)
    b.released.set()
    time.sleep(0.05)
    a.released.set()
    first, second = clock.events()
    assert (first.stage, second.stage) == (0, 1)
    assert first.kind == second.kind == APPLY_EVENT
    # Stage 1's segment ran beside stage 0's: it began before stage 0's ended, and ended first.
    assert second.start < first.end and second.end < first.end
    assert second.end - second.start >= 0.04 and first.end - first.start >= 0.09


def test_a_stage_runs_its_segments_one_after_the_other():
    clock = SegmentClock(timeout_s=10)
    a, b = Output(), Output()
    dispatched = time.perf_counter()
    clock.started(0, stage=1, start=dispatched, outs=[a])
    clock.started(1, stage=1, start=dispatched, outs=[b])
    time.sleep(0.05)
    a.released.set()
    time.sleep(0.05)
    b.released.set()
    first, second = clock.events()
    # Both were dispatched at once, but the stage's devices ran the second after the first.
    assert first.start == dispatched and second.start == first.end
    assert second.end - second.start >= 0.04


def test_a_segment_that_fails_fails_the_step_and_one_that_hangs_is_named():
    clock = SegmentClock(timeout_s=10)
    bad = Output(ValueError("segment exploded"))
    bad.released.set()
    clock.started(3, stage=0, start=time.perf_counter(), outs=[bad])
    with pytest.raises(ValueError, match="segment exploded"):
        clock.events()

    clock = SegmentClock(timeout_s=0.1)
    stuck = Output()
    clock.started(2, stage=1, start=time.perf_counter(), outs=[stuck])
    with pytest.raises(PipelineError, match=r"stage 1's post-gradient segment 2.*timeout_s=0.1"):
        clock.join(2)
    stuck.released.set()
