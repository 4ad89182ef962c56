"""Stages whose meshes span hosts on the Ray runtime (see [Note: multi-host stages]): one SPMD
program per stage run jointly by its hosts' actors, boundary tensors moved by the planner's
cross-host plans; the same numbers as jax.jit."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_parallelize import (
    adam_step,
    assert_same,
    make_batch,
    make_params,
    make_step,
    mlp_loss,
    reference,
    run_steps,
)

import jaxreshard as jr

pytestmark = pytest.mark.ray


def ray_config(**overrides):
    base = dict(
        stage_mesh_shape=(2, 2),
        mesh_axis_names=("data", "model"),
        num_micro_batches=2,
        backend="ray",
    )
    return jr.PipelineConfig(**{**base, **overrides})


def stage_hosts(pipe):
    return {s: list(hs) for s, hs in pipe.hosts_of_stage.items()}


def train_against_jit(pstep, step, params, state, steps=3):
    """`steps` steps of the parallelized and the jitted step side by side, each loss equal;
    both final (params, state)."""
    p, s, rp, rs = params, state, params, state
    for _ in range(steps):
        p, s, loss = pstep(p, s, make_batch())
        rp, rs, ref_loss = jax.jit(step)(rp, rs, make_batch())
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    return (p, s), (rp, rs)


def test_two_stages_that_each_span_two_hosts_equal_jax_jit(ray_runtime):
    assert ray_runtime.distributed  # the host actors joined one jax.distributed runtime
    step = jr.parallelize(make_step(2), config=ray_config(), batch_argnums=(1,))
    params, losses = run_steps(step, make_params(2), make_batch())
    pipe = step.pipeline(params, make_batch())
    assert stage_hosts(pipe) == {0: [0, 1], 1: [2, 3]}
    # The boundary crosses from hosts 0-1 to hosts 2-3 by a plan between hosts.
    plan = step.plan(params, make_batch())
    (act,) = [t for t in plan.boundary_tensors() if t["kind"] == "act"]
    assert act["strategy"] != "local"
    assert isinstance(params["w1"], jr.RemoteArray)
    assert {d.process_index for d in params["w1"].sharding.mesh.devices.flat} == {2, 3}
    assert_same(params, losses, *reference(2, False, False))


def test_a_layout_change_between_multi_host_meshes_with_skip_and_tied_parameters(ray_runtime):
    """Stage 0 on a (1, 4) mesh over hosts 0-1, stage 1 on (2, 2) over hosts 2-3: the boundary
    changes layout, the skip connection and the tied embedding's copy and gradient cross too;
    eager-1F1B with weight delay over 4 micro-batches."""
    cfg = ray_config(
        stage_mesh_shape=[(1, 4), (2, 2)],
        num_micro_batches=4,
        schedule="eager_1f1b",
        weight_delay=True,
    )
    step = jr.parallelize(make_step(2, skip=True, shared=True), config=cfg, batch_argnums=(1,))
    params, losses = run_steps(step, make_params(2), make_batch(rows=16))
    pipe = step.pipeline(params, make_batch(rows=16))
    assert stage_hosts(pipe) == {0: [0, 1], 1: [2, 3]}
    kinds = {t["kind"] for t in step.plan(params, make_batch(rows=16)).boundary_tensors()}
    assert {"act", "param", "param_grad"} <= kinds
    ref_step = jax.jit(make_step(2, skip=True, shared=True))
    assert_same(params, losses, *run_steps(ref_step, make_params(2), make_batch(rows=16)))


def test_single_host_and_multi_host_stages_in_one_pipeline(ray_runtime):
    """Stage 0 on host 0, stage 1 across hosts 1-2, stage 2 on host 3; 1F1B, an Optax
    optimizer whose state stays on each stage's hosts."""
    import optax

    optimizer = optax.adam(1e-2)

    def loss_fn(p, batch):
        h = jnp.tanh(batch["x"] @ p["emb"])
        h = jr.stage_boundary(h)
        h = jnp.tanh(h @ p["w1"] + p["b1"]) + h
        h = jr.stage_boundary(h)
        return jnp.mean((h @ p["out"] - batch["y"]) ** 2)

    step = adam_step(loss_fn, optimizer)
    cfg = ray_config(stage_mesh_shape=[(1, 2), (2, 2), (1, 2)], num_micro_batches=4)
    pstep = jr.parallelize(step, config=cfg, batch_argnums=(2,))
    params = make_params(2)
    (p, s), (rp, _) = train_against_jit(pstep, step, params, optimizer.init(params))
    for k in params:
        np.testing.assert_allclose(np.asarray(p[k]), np.asarray(rp[k]), rtol=1e-5, atol=1e-6)
    pipe = pstep.pipeline(p, s, make_batch())
    assert stage_hosts(pipe) == {0: [0], 1: [1, 2], 2: [3]}
    # Adam's moments of the middle stage's weights stay on its two hosts.
    mu_w1 = s[0].mu["w1"]
    assert {d.process_index for d in mu_w1.sharding.mesh.devices.flat} == {1, 2}


def test_a_mesh_that_takes_part_of_a_host_is_an_error(ray_runtime):
    cfg = ray_config(stage_mesh_shape=[(1, 3), (1, 2)])
    step = jr.parallelize(make_step(2), config=cfg, batch_argnums=(1,))
    with pytest.raises(ValueError, match=r"mesh 0 \(1, 3\) would take devices \[0, 1, 2\]: part "
                       r"of host 1's \[2, 3\]; a stage mesh either fits in one host or takes "
                       r"whole hosts"):  # fmt: skip
        step(make_params(2), make_batch())


def _sleep(x):
    time.sleep(0.2)
    return x


@jax.custom_jvp
def slow(x):  # an identity that takes 0.2 s on the host
    return jax.pure_callback(_sleep, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


slow.defjvp(lambda primals, tangents: (slow(primals[0]), tangents[0]))


def slow_step(params, batch):
    """make_step(2) with a 0.2 s host callback in stage 1 (8 micro-batches: 1.6 s of forwards)."""

    def loss_fn(p):
        h = jnp.tanh(batch["x"] @ p["emb"])
        h = jr.stage_boundary(h)
        h = slow(jnp.tanh(h @ p["w1"] + p["b1"]))
        return jnp.mean((h @ p["out"] - batch["y"]) ** 2)

    loss, grads = jr.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda w, g: w - 0.05 * g, params, grads), loss


def kill_when_under_way(rt, pipe, host, after_step, wait_s=60.0):
    """Kill `host`'s actor once it reports an action of a step after `after_step` finished (the
    step is running on the hosts, past the parameters' puts); False if none did in `wait_s`."""
    import ray

    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        step_id = pipe.last_step_id
        if step_id != after_step:
            done, _, _ = ray.get(rt.actors[host].pipeline_progress.remote(pipe.key, step_id))
            if done:
                ray.kill(rt.actors[host], no_restart=True)
                return True
        time.sleep(0.02)
    return False


def restart_ray():
    from conftest import RAY_CONFIG

    jr.shutdown()
    jr.init(**RAY_CONFIG)  # the next tests use this one


def test_a_killed_host_of_a_multi_host_stage_is_named_and_init_works_again(ray_runtime):
    """Host 3 (of stage 1, which spans hosts 2-3) dies in the middle of a step: the error names
    it long before timeout_s, and after shutdown() + init() the step trains as jax.jit.

    The kill waits for host 3 to report a finished action of the step: a timer (as this test
    once had) could land, on a loaded machine, while the parameters were still being put, which
    fails differently (see the next test)."""
    from jaxreshard.runtime.ray._wait import RuntimeBroken

    cfg = ray_config(num_micro_batches=8, timeout_s=60)
    pstep = jr.parallelize(slow_step, config=cfg, batch_argnums=(1,))
    params, batch = make_params(2), make_batch(rows=16)
    pstep(params, batch)  # compiled, and one step run
    pipe = pstep.pipeline(params, batch)
    rt, killed = ray_runtime, []
    killer = threading.Thread(
        target=lambda: killed.append(kill_when_under_way(rt, pipe, 3, pipe.last_step_id))
    )
    start = time.monotonic()
    killer.start()
    with pytest.raises(
        RuntimeBroken,
        match=r"host actor 3 \(.*\) died during running step .*\(host 3 runs stage 1 with "
        r"hosts 2, 3\)",
    ):
        pstep(params, batch)
    assert time.monotonic() - start < cfg.timeout_s / 2
    killer.join()
    assert killed == [True]
    restart_ray()
    got = run_steps(pstep, params, batch)
    assert_same(*got, *run_steps(jax.jit(slow_step), params, batch))


def test_a_host_killed_before_a_step_puts_its_parameters_is_named(ray_runtime):
    """Host 3 dies between steps: the next step's first act, putting the parameters it was given
    as host data on their stages' hosts, names the host, the parameter and the host's stage."""
    import ray

    from jaxreshard.runtime.ray._wait import RuntimeBroken

    cfg = ray_config(num_micro_batches=2, timeout_s=60)
    pstep = jr.parallelize(make_step(2), config=cfg, batch_argnums=(1,))
    params, batch = make_params(2), make_batch()
    pstep(params, batch)
    try:
        _kill_host_3_and_step(ray, ray_runtime, pstep, params, batch, cfg, RuntimeBroken)
    finally:  # (the next tests need whole hosts, whatever happened here)
        restart_ray()


def _kill_host_3_and_step(ray, ray_runtime, pstep, params, batch, cfg, RuntimeBroken):
    ray.kill(ray_runtime.actors[3], no_restart=True)
    # Dead before the step begins: a call made just after the kill may still be served (Ray
    # kills asynchronously; CI once saw it answer), so ask until the actor is gone.
    deadline = time.monotonic() + 30
    while True:
        try:
            ray.get(ray_runtime.actors[3].pipeline_progress.remote("", ""), timeout=30)
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, "host actor 3 still answers 30 s after ray.kill"
        time.sleep(0.1)
    start = time.monotonic()
    with pytest.raises(
        RuntimeBroken,
        match=r"host actor 3 \(.*\) died during putting \d+ arrays: .* \(putting parameters "
        r"\d+: float32\[[\d, ]*\](, \d+: float32\[[\d, ]*\])*, on stage 1's hosts; host 3 "
        r"runs stage 1 with hosts 2, 3\)",
    ):
        pstep(params, batch)  # numpy parameters: put first
    assert time.monotonic() - start < cfg.timeout_s / 2


def test_optimizer_state_laid_out_by_the_caller_runs_the_segments_compiled_ahead(ray_runtime):
    """Parameters and Adam's state as the caller placed them (sharded jax.Arrays of the
    driver): the hosts lay them out with their specs, as the executables compiled before the
    first step expect, so no optimizer segment compiles inside a step (on a deadline, and in
    a profile's timed steps)."""
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    optimizer = optax.adam(1e-2)
    step = adam_step(mlp_loss, optimizer)
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
    specs = {"emb": P(None, "model"), "out": P("model", None), "w1": P(None, "model"), "b1": P()}
    params = {
        k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in make_params(2).items()
    }
    pstep = jr.parallelize(step, config=ray_config(), batch_argnums=(2,))
    (p, s), _ = train_against_jit(pstep, step, params, optimizer.init(params))
    pipe = pstep.pipeline(p, s, make_batch())
    import ray

    reports = ray.get([ray_runtime.actors[h].held.remote() for h in pipe.hosts], timeout=60)
    assert all(r["segments_compiled_in_steps"][pipe.key] == [] for r in reports), reports


@pytest.mark.parametrize(
    "shape, stages",
    [((2,), 2), ((4,), 2), ((4,), 1)],
    ids=["one-host", "two-hosts", "one-stage-fused"],
)
def test_data_parallel_stages_sum_their_gradients_once_on_ray(ray_runtime, shape, stages):
    """Stages of one host and stages that span two (their gradients' one reduction a step then
    crosses the hosts' link): equal to jax.jit. The one-host case also places a NumPy batch on
    a data-split mesh inside a distributed runtime, which jit refuses to take as it is. One
    stage over two hosts runs its micro-batches as one scan with the optimizer fused, which
    reads the gradients reduced once."""
    cfg = ray_config(
        stage_mesh_shape=shape, mesh_axis_names=("data",), num_micro_batches=4, num_stages=stages
    )
    step = jr.parallelize(make_step(stages), config=cfg, batch_argnums=(1,))
    params, losses = run_steps(step, make_params(stages), make_batch(rows=16))
    reductions = step.pipeline(params, make_batch(rows=16)).layout.reductions
    assert set(reductions.values()) == {"once per step, over data"}, reductions
    ref_step = jax.jit(make_step(stages))
    ref = run_steps(ref_step, make_params(stages), make_batch(rows=16))
    assert_same(params, losses, *ref, tol=2e-5)


def test_a_cpu_runtime_joined_for_nothing_says_what_it_costs(ray_runtime):
    """The shared runtime joined jax.distributed; a pipeline whose stages each fit in a host
    (meshes of 2 devices) gets the warning naming the fix, once; one whose stages span hosts
    does not."""
    import warnings

    from jaxreshard.runtime.ray._placement import DistributedCostWarning

    batch = make_batch(rows=16)
    ray_runtime._warned_cost = False
    with warnings.catch_warnings(record=True) as spanning:
        warnings.simplefilter("always")
        cfg = ray_config(stage_mesh_shape=(4,), mesh_axis_names=("data",), num_micro_batches=2)
        jr.parallelize(make_step(2), config=cfg, batch_argnums=(1,)).plan(make_params(2), batch)
    assert not [w for w in spanning if issubclass(w.category, DistributedCostWarning)]
    cfg = ray_config(stage_mesh_shape=(2,), mesh_axis_names=("data",), num_micro_batches=2)
    with pytest.warns(DistributedCostWarning, match=r"distributed=False"):
        jr.parallelize(make_step(2), config=cfg, batch_argnums=(1,)).plan(make_params(2), batch)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        jr.parallelize(make_step(2), config=cfg, batch_argnums=(1,)).plan(make_params(2), batch)
    assert not [w for w in again if issubclass(w.category, DistributedCostWarning)]


# Checkpoints on the Ray hosts (here rather than in test_checkpoint.py: the shared Ray runtime
# starts first where the Ray tests have always started it).
import os  # noqa: E402

import test_checkpoint as ck  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from test_checkpoint import saved  # noqa: E402, F401  (the fixture)


@pytest.mark.ray
@pytest.mark.slow
def test_ray_hosts_write_and_read_their_own_shares(ray_runtime, saved, tmp_path):  # noqa: F811
    """On 4 Ray hosts x 2 devices: a local checkpoint restored onto 2 stages that span hosts
    (1x4 meshes), trained, saved by the hosts (each stage's two hosts write their part
    together), and restored as 2x2 stages and into jax.jit; every host reads and writes only
    its share."""
    from jaxreshard.checkpoint import _ray

    directory, losses = saved
    params = ck.init_params()
    wide = jr.parallelize(
        ck.make_step((3,)),
        batch_argnums=2,
        config=ck.config(
            stage_mesh_shape=(1, 4), schedule="1f1b", num_micro_batches=2, backend="ray"
        ),
    )
    target = wide.placement(params, ck.OPT.init(params), ck.batches()[0])[:2]
    assert isinstance(jax.tree.leaves(target)[0], jr.RemoteStruct)
    state = jr.restore_checkpoint(directory, target)
    assert jax.tree.leaves(state)[0].sharding == jax.tree.leaves(target)[0].sharding
    *state, loss = wide(*state, ck.batches()[2])
    ray_dir = tmp_path / "ray"
    jr.save_checkpoint(ray_dir, tuple(state), metadata={"step": 3})
    assert sorted(os.listdir(ray_dir / "parts")) == ["host0-1", "host2-3"]
    wrote = {h: io["written_bytes"] for h, io in _ray.last_io["save"].items()}
    assert sorted(wrote) == [0, 1, 2, 3]
    square = jr.parallelize(
        ck.make_step((3,)),
        batch_argnums=2,
        config=ck.config(
            stage_mesh_shape=(2, 2), schedule="1f1b", num_micro_batches=2, backend="ray"
        ),
    )
    target = square.placement(params, ck.OPT.init(params), ck.batches()[0])[:2]
    restored = jr.restore_checkpoint(ray_dir, target)
    *_, last = square(*restored, ck.batches()[3])
    np.testing.assert_allclose([*losses, float(loss), float(last)], ck.reference_losses(),
                               rtol=1e-5)  # fmt: skip
    assert sorted(_ray.last_io["restore"]) == [0, 1, 2, 3]
    into_jit = jr.restore_checkpoint(ray_dir, ck.structs((params, ck.OPT.init(params))))
    _, _, more = ck.train(ck.REF, *into_jit, ck.batches()[3:])
    np.testing.assert_allclose(more[0], float(last), rtol=1e-5)
    wide.close()
    square.close()
    # Shares, measured: a 4 MiB array over all 8 devices (2 per host) is written about a quarter
    # by each host, and read back a quarter each onto the devices in reverse order.
    rt = ray_runtime
    n = 2**20
    value = np.random.default_rng(0).standard_normal(n).astype(np.float32)  # (incompressible)
    big = rt.put(value, rt.sharding(rt.mesh((8,), ("x",)), P("x")))
    jr.save_checkpoint(tmp_path / "big", {"big": big})
    share = {h: io["written_bytes"] / (4 * n) for h, io in _ray.last_io["save"].items()}
    assert sorted(share) == [0, 1, 2, 3] and all(0.2 < f < 0.4 for f in share.values()), share
    backwards = rt.sharding(rt.mesh((8,), ("x",), devices=list(range(8))[::-1]), P("x"))
    back = jr.restore_checkpoint(
        tmp_path / "big", {"big": jr.RemoteStruct((n,), np.float32, backwards)}
    )
    share = {h: io["read_bytes"] / (4 * n) for h, io in _ray.last_io["restore"].items()}
    assert sorted(share) == [0, 1, 2, 3] and all(0.2 < f < 0.4 for f in share.values()), share
    np.testing.assert_array_equal(back["big"].fetch(), value)
