"""Asynchronous steps on the Ray runtime (see [Note: asynchronous steps on Ray]): a call returns
before its step is done, with handles the driver made itself; the hosts run steps in order; a
failure or a hung stage surfaces at the next call or at `wait()`, the steps sent after it are
cancelled, and the next step is right."""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ray
from test_parallelize import make_batch, make_params

import jaxreshard as jr
from jaxreshard.runtime.driver._deferred import StepValue
from jaxreshard.runtime.engine._events import PipelineError

pytestmark = pytest.mark.ray

TIMEOUT_S = 3.0


def file_step(hold: str, fail: str):
    """`make_step(2)` whose stage 1 forward calls back into Python on its host: while the file
    `hold` exists the callback waits (a slow or hung stage), while `fail` exists it raises
    (files, since the callback runs in the host actors' processes)."""

    def callback(x):
        start = time.monotonic()
        while os.path.exists(hold) and time.monotonic() - start < 60:
            time.sleep(0.02)
        if os.path.exists(fail):
            raise RuntimeError("the data source broke")
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


def ray_config(**overrides):
    base = dict(
        stage_mesh_shape=(1, 2),
        mesh_axis_names=("data", "model"),
        num_micro_batches=2,
        backend="ray",
        timeout_s=TIMEOUT_S,
    )
    return jr.PipelineConfig(**{**base, **overrides})


@pytest.fixture
def files(tmp_path):
    hold, fail = tmp_path / "hold", tmp_path / "fail"
    yield hold, fail
    hold.unlink(missing_ok=True)
    fail.unlink(missing_ok=True)


@pytest.fixture
def driver_segments(monkeypatch):
    """The post-gradient segments the driver runs after a step (by index), as they run."""
    from jaxreshard.runtime.ray import _hosts

    ran = []
    original = _hosts.RayHosts.segment
    monkeypatch.setattr(
        _hosts.RayHosts, "segment", lambda self, *a: ran.append(a[1]) or original(self, *a)
    )
    return ran


def fetched(tree):
    return jax.tree.map(lambda x: x.fetch() if isinstance(x, jr.RemoteArray) else x, tree)


def test_ray_calls_return_before_their_steps_finish_and_equal_jax_jit(ray_runtime, files):
    hold, fail = files
    fun = file_step(str(hold), str(fail))
    step = jr.parallelize(fun, config=ray_config(steps_in_flight=2), batch_argnums=(1,))
    params, batch = make_params(2), make_batch()
    ref_params, ref_losses = params, []
    for _ in range(6):
        ref_params, loss = jax.jit(fun)(ref_params, batch)
        ref_losses.append(float(loss))
    p, losses = params, []
    for _ in range(2):  # the first steps run synchronously: they tell what the outputs are
        p, loss = step(p, batch)
        losses.append(loss)
    hold.touch()
    start = time.monotonic()
    outs = [step(p, batch)]
    outs.append(step(outs[0][0], batch))  # a second step in flight, on handles of the first
    returned = time.monotonic() - start
    try:
        assert returned < 1.0, f"the calls waited for their steps ({returned:.2f} s)"
        for new_params, loss in outs:
            assert isinstance(loss, StepValue) and not loss.is_ready()
            assert all(not x.is_ready() for x in jax.tree.leaves(new_params))
        (entry,) = step._cache.values()
        assert entry.pipeline.processes.watch.in_flight == 2
    finally:
        hold.unlink()
    p, loss = outs[1]
    losses += [outs[0][1], loss]
    for _ in range(2):
        p, loss = step(p, batch)
        losses.append(loss)
    step.wait()
    np.testing.assert_allclose([float(x) for x in losses], ref_losses, rtol=1e-5)
    for k, v in fetched(p).items():
        np.testing.assert_allclose(v, np.asarray(ref_params[k]), rtol=1e-5, atol=1e-6)
    assert f"{np.float32(float(loss)):.4f}" == f"{loss:.4f}"  # it reads like the number


@pytest.mark.parametrize("surfaces_at", ["wait", "next call"])
def test_a_failed_ray_step_cancels_the_next_and_surfaces_later(ray_runtime, files, surfaces_at):
    """The step fails on its host after the call returned: its error (naming the stage's
    host and the callback's message) comes at `wait()` or at the next call; the step sent
    after it never completes (still queued, it is cancelled; already started on the first
    stage's host, it is stopped there); reading either's outputs raises; the step after the
    error is right."""
    hold, fail = files
    fun = file_step(str(hold), str(fail))
    # One device per stage: a callback that raises on one device of a larger mesh leaves the
    # others in a collective for good on CPU (see [Note: threads at exit]).
    step = jr.parallelize(fun, config=ray_config(stage_mesh_shape=(1, 1)), batch_argnums=(1,))
    params, batch = make_params(2), make_batch()
    ref_params, ref_loss = jax.jit(fun)(params, batch)
    step(params, batch)
    step(params, batch)
    step.wait()
    hold.touch()
    fail.touch()
    bad = step(params, batch)
    cancelled = step(params, batch)  # sent while the first is held: it is queued on the hosts
    hold.unlink()
    with pytest.raises(PipelineError, match="the data source broke") as info:
        if surfaces_at == "wait":
            step.wait()
        else:
            time.sleep(2.0)
            step(params, batch)
    assert "stage 1" in str(info.value)
    fail.unlink()
    # (or it failed on its own: with two steps in flight, stage 1's host may have started its
    # forward beside the held one's, and its callback then raised too)
    cancelled_or_stopped = (
        r"did not run|was cancelled: step .* failed before"
        r"|stopped: step .*, called before it, failed"
        r"|the data source broke \(during running step"
    )
    with pytest.raises(PipelineError, match=cancelled_or_stopped):
        float(cancelled[1])
    with pytest.raises(PipelineError, match="the data source broke"):
        bad[0]["w1"].fetch()
    (entry,) = step._cache.values()
    runtime = entry.pipeline.runtime
    held = [ray.get(runtime.actors[h].held.remote(), timeout=60) for h in entry.pipeline.hosts]
    never = cancelled[0]["w1"].step_id
    assert never and not [a for h in held for a in h["arrays"] if a.startswith(f"{never}:")]
    new_params, loss = step(params, batch)  # the step after the error is right
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for k, v in fetched(new_params).items():
        np.testing.assert_allclose(v, np.asarray(ref_params[k]), rtol=1e-5, atol=1e-6)
    step.wait()


def test_a_hung_ray_step_is_named_within_timeout_s_at_wait(ray_runtime, files, monkeypatch):
    from jaxreshard.runtime.ray import _hosts

    hold, fail = files
    fun = file_step(str(hold), str(fail))
    step = jr.parallelize(fun, config=ray_config(), batch_argnums=(1,))
    params, batch = make_params(2), make_batch()
    _, ref_loss = jax.jit(fun)(params, batch)
    step(params, batch)  # compiles, with the driver's usual grace over timeout_s
    step(params, batch)
    step.wait()
    monkeypatch.setattr(_hosts, "STEP_GRACE_S", 0.0)
    hold.touch()
    start = time.monotonic()
    step(params, batch)
    assert time.monotonic() - start < TIMEOUT_S
    try:
        with pytest.raises((PipelineError, TimeoutError), match=r"no progress|timeout_s"):
            step.wait()
        assert time.monotonic() - start < TIMEOUT_S + 10
    finally:
        hold.unlink()
    _, loss = step(params, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    step.wait()


def test_asynchronous_adam_steps_read_the_step_count_across_hosts(ray_runtime, driver_segments):
    """Adam's step count is made by one stage's optimizer segment and read by the other's, on
    another host: while its step runs, that host reads it from the step's answer (no segment
    falls back to the driver, no step waits for the one before), and the steps equal
    jax.jit's."""
    import optax
    from test_parallelize import adam_step, mlp_loss

    fun = adam_step(mlp_loss, optax.adam(1e-2))
    step = jr.parallelize(fun, config=ray_config(), batch_argnums=(2,))
    params, batch = make_params(2), make_batch()
    state = optax.adam(1e-2).init(params)
    p, s, rp, rs = params, state, params, state
    losses, ref_losses = [], []
    for _ in range(6):
        p, s, loss = step(p, s, batch)
        losses.append(loss)
        rp, rs, ref_loss = jax.jit(fun)(rp, rs, batch)
        ref_losses.append(float(ref_loss))
    assert isinstance(losses[-1], StepValue)  # (the last steps ran asynchronously)
    step.wait()
    np.testing.assert_allclose([float(x) for x in losses], ref_losses, rtol=1e-5)
    for k, v in fetched(p).items():
        np.testing.assert_allclose(v, np.asarray(rp[k]), rtol=1e-5, atol=1e-6)
    assert driver_segments == []


@pytest.mark.parametrize("source", ["put", "restored"])
def test_adam_steps_on_state_placed_where_the_step_keeps_it_run_no_segment_on_the_driver(
    ray_runtime, driver_segments, tmp_path, source
):
    """Parameters and Adam state put on the hosts where `placement` says the step keeps them
    (as `partition="auto"`'s trials place them), or restored from a checkpoint into that
    layout: the step count sits on the first stage's host, and the other stage's optimizer
    gets its value with the call (a small put or restored array keeps its value on the
    driver, as a small step output does), so no segment falls back to the driver; each step
    equals jax.jit's on the same state."""
    import optax
    from test_parallelize import adam_step, mlp_loss

    from jaxreshard.runtime import current_runtime

    fun = adam_step(mlp_loss, optax.adam(1e-2))
    step = jr.parallelize(fun, config=ray_config(), batch_argnums=(2,))
    params, batch = make_params(2), make_batch()
    state = optax.adam(1e-2).init(params)
    where = step.placement(params, state, batch)[:2]
    runtime = current_runtime()
    if source == "put":
        put_params, put_state = jax.tree.map(
            lambda x, w: runtime.put(np.asarray(x), w.sharding), (params, state), where
        )
    else:
        jr.save_checkpoint(tmp_path / "ckpt", (params, state))
        put_params, put_state = jr.restore_checkpoint(tmp_path / "ckpt", where)
    (count,) = [x for x in jax.tree.leaves(put_state) if x.shape == ()]
    assert isinstance(count, jr.RemoteArray) and count.value is not None  # (small: kept here too)
    want_params, _, want_loss = jax.jit(fun)(params, state, batch)
    outs = [step(put_params, put_state, batch) for _ in range(4)]
    step.wait()
    for _, _, loss in outs:
        np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    for k, v in fetched(outs[-1][0]).items():
        np.testing.assert_allclose(v, np.asarray(want_params[k]), rtol=1e-5, atol=1e-6)
    assert driver_segments == []


def test_outputs_of_running_steps_outlive_their_dropped_pipeline(ray_runtime, files):
    """Dropping a parallelized step (its pipeline) while steps run lets them finish first: the
    outputs already returned stay valid, as `jax.jit`'s do; then the hosts drop it."""
    import gc

    hold, fail = files
    fun = file_step(str(hold), str(fail))
    step = jr.parallelize(fun, config=ray_config(), batch_argnums=(1,))
    params, batch = make_params(2), make_batch()
    p = params
    ref = params
    for _ in range(4):
        ref, _ = jax.jit(fun)(ref, batch)
    for _ in range(2):
        p, _ = step(p, batch)
    hold.touch()
    for _ in range(2):
        p, loss = step(p, batch)  # running: held on the host
    (entry,) = step._cache.values()
    key, runtime = entry.pipeline.key, entry.pipeline.runtime
    del step, entry
    gc.collect()
    hold.unlink()
    for k, v in fetched(p).items():
        np.testing.assert_allclose(v, np.asarray(ref[k]), rtol=1e-5, atol=1e-6)
    assert np.isfinite(float(loss))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # and the hosts let the pipeline go
        held = [ray.get(a.held.remote(), timeout=60) for a in runtime.actors]
        if all(key not in h["pipelines"] for h in held):
            break
        time.sleep(0.2)
    assert all(key not in h["pipelines"] for h in held)


def test_another_pipeline_waits_for_the_running_step_that_makes_its_input(ray_runtime, files):
    """An evaluation step called on a training step's fresh (still running) parameters: the
    hosts order only one pipeline's steps, so the evaluation waits for the training step."""
    hold, fail = files
    fun = file_step(str(hold), str(fail))
    step = jr.parallelize(fun, config=ray_config(), batch_argnums=(1,))

    def evaluate(params, batch):
        h = jnp.tanh(batch["x"] @ params["emb"])
        h = jr.stage_boundary(h)
        h = jnp.tanh(h @ params["w1"] + params["b1"])
        return jnp.mean((h @ params["out"] - batch["y"]) ** 2)

    ev = jr.parallelize(evaluate, config=ray_config(), batch_argnums=(1,))
    params, batch = make_params(2), make_batch()
    p, rp = params, params
    for _ in range(3):
        rp, _ = jax.jit(fun)(rp, batch)
    for _ in range(2):
        p, _ = step(p, batch)
    ev(p, batch)  # (compiled)
    hold.touch()
    p, _ = step(p, batch)  # asynchronous, held on its host
    threading_timer = __import__("threading").Timer(1.0, hold.unlink)
    threading_timer.start()
    try:
        value = float(ev(p, batch))
    finally:
        threading_timer.join()
    np.testing.assert_allclose(value, float(jax.jit(evaluate)(rp, batch)), rtol=1e-5)


def test_donated_asynchronous_adam_steps_with_both_stages_on_one_host(ray_runtime):
    """Steps in flight back to back with the parameters and Adam's state donated, both stages
    on one host (its transfers never hold a dispatch back), so that the next step may donate a
    small output (the count) before the last step's answer has read it (timing decides whether
    it does here; `_small` gives such an output no value): nothing fails, and the steps equal
    jax.jit's."""
    import optax
    from test_parallelize import adam_step, mlp_loss

    fun = adam_step(mlp_loss, optax.adam(1e-2))
    config = ray_config(stage_mesh_shape=(1, 1), steps_in_flight=4)
    step = jr.parallelize(fun, config=config, batch_argnums=(2,), donate_argnums=(0, 1))
    params, batch = make_params(2), make_batch()
    rp, rs = params, optax.adam(1e-2).init(params)
    p, s = params, optax.adam(1e-2).init(params)
    losses, ref_losses = [], []
    for _ in range(8):
        p, s, loss = step(p, s, batch)
        losses.append(loss)
        rp, rs, ref_loss = jax.jit(fun)(rp, rs, batch)
        ref_losses.append(float(ref_loss))
    step.wait()
    np.testing.assert_allclose([float(x) for x in losses], ref_losses, rtol=1e-5)
    for k, v in fetched(p).items():
        np.testing.assert_allclose(v, np.asarray(rp[k]), rtol=1e-5, atol=1e-6)
