"""The local runtime as a long-running job needs it: a hung stage fails the step in time and
names itself, the next step is right, and pipelines leave no threads or growing caches behind."""

import gc
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_parallelize import assert_same, config, make_batch, make_params, make_step, reference

import jaxreshard as jr
from jaxreshard import _parallelize
from jaxreshard.runtime._executor import PipelineError

TIMEOUT_S = 2.0


def hanging_step(release: threading.Event, hang: list[bool]):
    """`make_step(2)` whose stage 1 forward calls back into Python; while `hang[0]` is set,
    the callback blocks until `release` (as a stuck data source or a hung device would)."""

    def callback(x):
        if hang[0]:
            release.wait(60)
        return np.zeros((), np.float32)

    def step(params, batch):
        def loss_fn(p):
            h = jnp.tanh(batch["x"] @ p["emb"])
            h = jr.stage_boundary(h)
            h = h + jax.pure_callback(
                callback, jax.ShapeDtypeStruct((), jnp.float32), jax.lax.stop_gradient(p["b1"][0])
            )
            h = jnp.tanh(h @ p["w1"] + p["b1"])
            return jnp.mean((h @ p["out"] - batch["y"]) ** 2)

        loss, grads = jr.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    return step


def test_a_hung_stage_fails_the_step_in_time_naming_it_and_the_next_step_is_right():
    release, hang = threading.Event(), [False]
    step = jr.parallelize(
        hanging_step(release, hang),
        config=config(num_micro_batches=2, timeout_s=TIMEOUT_S),
        batch_argnums=(1,),
    )
    params, batch = make_params(2), make_batch()
    ref_step = jax.jit(hanging_step(release, hang))
    ref_params, ref_loss = ref_step(params, batch)
    step(params, batch)  # compiled, and one healthy step
    hang[0] = True
    start = time.monotonic()
    with pytest.raises(PipelineError, match="stage 1") as info:
        step(params, batch)
    took = time.monotonic() - start
    assert took < TIMEOUT_S + 10, took
    assert "timeout_s" in str(info.value)
    hang[0] = False
    release.set()
    new_params, loss = step(params, batch)  # the inputs of the failed step are intact
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for k in ref_params:
        np.testing.assert_allclose(
            np.asarray(new_params[k]), np.asarray(ref_params[k]), rtol=1e-5, atol=1e-6
        )


def _jaxreshard_threads() -> list[str]:
    return sorted(
        t.name
        for t in threading.enumerate()
        if t.name.startswith("jaxreshard-") and not t.name.startswith("jaxreshard-copy")
    )


@pytest.mark.parametrize("record", [False, True], ids=["steps", "profiled"])
def test_dropped_pipelines_leave_no_threads(record):
    before = _jaxreshard_threads()
    ref_params, ref_losses = reference(3, True, True)
    for schedule in ("1f1b", "eager_1f1b", "gpipe"):
        for m in (2, 4):
            step = jr.parallelize(
                make_step(3, skip=True, shared=True),
                config=config(schedule=schedule, num_micro_batches=m),
                batch_argnums=(1,),
            )
            params, losses = make_params(3), []
            for _ in range(3):
                if record:
                    (params, loss), _ = step.profile_call(params, make_batch())
                else:
                    params, loss = step(params, make_batch())
                losses.append(float(loss))
            assert_same(params, losses, ref_params, ref_losses)
            del step, params, loss
    gc.collect()
    deadline = time.monotonic() + 10
    while not set(_jaxreshard_threads()) <= set(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(_jaxreshard_threads()) <= set(before)


def test_close_and_shutdown_free_threads_and_the_step_compiles_again():
    step = jr.parallelize(
        make_step(3), config=config(num_micro_batches=2, emulate_network_gbps=50.0),
        batch_argnums=(1,),
    )  # fmt: skip
    params = make_params(3)
    before = set(_jaxreshard_threads())
    step(params, make_batch())  # network emulation moves transfers in sender threads
    assert any(name.startswith("jaxreshard-send") for name in _jaxreshard_threads())
    step.close()
    deadline = time.monotonic() + 10
    while not set(_jaxreshard_threads()) <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(_jaxreshard_threads()) <= before
    _ref_params, ref_losses = reference(3, False, False)
    _new, loss = step(params, make_batch())  # compiles again
    np.testing.assert_allclose(float(loss), ref_losses[0], rtol=1e-5)
    jr.shutdown()  # closes it too
    assert all(e.pipeline.closed for e in step._cache.values())


def test_compiled_signatures_are_bounded(monkeypatch):
    monkeypatch.setattr(_parallelize, "MAX_COMPILED", 2)
    step = jr.parallelize(make_step(2), config=config(num_micro_batches=2), batch_argnums=(1,))
    params = make_params(2)
    pipelines = []
    for rows in (8, 16, 24):
        step(params, make_batch(rows=rows))
        pipelines.append(next(reversed(step._cache.values())).pipeline)
    assert len(step._cache) == 2
    assert pipelines[0].closed and not pipelines[2].closed
    step(params, make_batch(rows=8))  # dropped, so compiled again: still right
    assert len(step._cache) == 2
