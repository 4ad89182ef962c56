"""`SegmentClock`: how a recorded step times its post-gradient segments (see [Note: recorded
segments] in `runtime/engine/_events.py`), on stand-in outputs whose readiness the test holds."""

import threading
import time

import pytest

from jaxreshard.runtime.engine._events import APPLY_EVENT, PipelineError, SegmentClock


class Output:
    """A stand-in output that is ready once the test releases it (then raises `error`, if
    given, as a failed computation would)."""

    def __init__(self, error: BaseException | None = None):
        self.released = threading.Event()
        self.error = error


def wait(outs, stop):
    """`wait_ready` for stand-ins: poll until every one is released, or `stop()`."""
    for out in outs:
        while not out.released.wait(0.001):
            if stop():
                return False
        if out.error is not None:
            raise out.error
    return True


def clock(timeout_s=10.0, where=""):
    return SegmentClock(timeout_s, where, wait=wait)


def test_segments_on_different_devices_are_timed_as_running_together():
    c = clock()
    a, b = Output(), Output()
    c.started(0, stage=0, lane=(0, 1), start=time.perf_counter(), outs=[a])
    c.started(1, stage=1, lane=(2, 3), start=time.perf_counter(), outs=[b])
    time.sleep(0.05)
    b.released.set()
    time.sleep(0.05)
    a.released.set()
    first, second = c.events()
    assert (first.stage, second.stage) == (0, 1)
    assert first.kind == second.kind == APPLY_EVENT
    # Stage 1's segment ran beside stage 0's: it began before stage 0's ended, and ended first.
    assert second.start < first.end and second.end < first.end
    assert second.end - second.start >= 0.04 and first.end - first.start >= 0.09


@pytest.mark.parametrize("stages", [(1, 1), (0, 2)], ids=["one_stage", "virtual_stages"])
def test_segments_on_the_same_devices_run_one_after_the_other(stages):
    """Two segments of one stage, or of two virtual stages of one rank (one mesh)."""
    c = clock()
    a, b = Output(), Output()
    dispatched = time.perf_counter()
    c.started(0, stage=stages[0], lane=(0, 1), start=dispatched, outs=[a])
    c.started(1, stage=stages[1], lane=(0, 1), start=dispatched, outs=[b])
    time.sleep(0.05)
    a.released.set()
    time.sleep(0.05)
    b.released.set()
    first, second = c.events()
    # Both were dispatched at once, but the devices ran the second after the first.
    assert first.start == dispatched and second.start == first.end
    assert second.end - second.start >= 0.04


def test_a_segment_starts_after_the_segments_it_reads():
    c = clock()
    a, b = Output(), Output()
    dispatched = time.perf_counter()
    c.started(0, stage=0, lane=(0,), start=dispatched, outs=[a])
    c.started(1, stage=1, lane=(1,), start=dispatched, outs=[b], after=[0])
    time.sleep(0.05)
    a.released.set()
    time.sleep(0.01)
    b.released.set()
    first, second = c.events()
    assert second.start == first.end >= dispatched + 0.04


def test_a_segment_that_fails_fails_the_step_and_one_that_hangs_is_named():
    c = clock()
    bad, later = Output(ValueError("segment exploded")), Output()
    bad.released.set()
    c.started(3, stage=0, lane=(0,), start=time.perf_counter(), outs=[bad])
    c.started(4, stage=1, lane=(1,), start=time.perf_counter(), outs=[later])
    with pytest.raises(ValueError, match="segment exploded"):
        c.events()
    # The other segment's clock was told to stop: no thread is left waiting.
    time.sleep(0.05)
    assert not any(t.name == "segment-4-clock" for t in threading.enumerate())

    c = clock(timeout_s=0.1, where="host 3: ")
    stuck = Output()
    c.started(2, stage=1, lane=(0,), start=time.perf_counter(), outs=[stuck])
    with pytest.raises(PipelineError, match=r"host 3: stage 1's post-gradient segment 2.*=0.1 s"):
        c.events()
    time.sleep(0.05)
    assert not any(t.name == "segment-2-clock" for t in threading.enumerate())


def test_a_recorded_step_runs_the_stages_optimizers_side_by_side():
    """Each stage's optimizer (a post-gradient segment, made slow here) runs on its own mesh
    while the other's runs, as in a plain step: their `A` events overlap. Timed one at a time,
    as before, stage 1's waited for stage 0's."""
    import jax
    import jax.numpy as jnp
    from test_parallelize import config, make_batch, make_params, mlp_loss

    import jaxreshard as jr

    def slow_update(w, g):
        work = jnp.full((384, 384), 1e-3) * jnp.sum(w)
        for _ in range(6):
            work = jnp.tanh(work @ work)
        return w - 0.05 * g + 1e-30 * jnp.sum(work)

    def step(params, batch):
        loss, grads = jr.value_and_grad(mlp_loss)(params, batch)
        return jax.tree.map(slow_update, params, grads), loss

    pstep = jr.parallelize(step, config=config(num_micro_batches=2), batch_argnums=(1,))
    params = make_params(2)
    for _ in range(2):  # (the first compiles)
        _, events = pstep.profile_call(params, make_batch())
    applies = [e for e in events if e.kind == APPLY_EVENT]
    assert {e.stage for e in applies} == {0, 1}
    assert max(e.start for e in applies) < min(e.end for e in applies)
