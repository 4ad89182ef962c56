"""Candidate cuts and automatic partitioning: `jr.stage_candidate` marks where a stage may end;
`cuts=` chooses among them by hand, `partition="auto"` by the simulated step (measured segment
compute, the planner's transfer time of every cut); either way the step equals jax.jit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr

# Layer output widths: a cut after a 32-wide layer moves 16x fewer bytes than after a 512-wide.
WIDTHS = [512, 32, 512, 32, 512, 32]
OPT = optax.sgd(1e-2)


def init_params():
    rng = np.random.default_rng(0)
    params, fan_in = {}, 32
    for i, w in enumerate(WIDTHS):
        params[f"l{i}"] = (rng.normal(size=(fan_in, w)) / np.sqrt(fan_in)).astype(np.float32)
        fan_in = w
    return params


def make_step(pipelined=True, forced=()):
    def step(params, state, batch):
        def loss_fn(p):
            h = batch["x"]
            for i in range(len(WIDTHS)):
                h = jnp.tanh(h @ p[f"l{i}"])
                if pipelined and i in forced:
                    h = jr.stage_boundary(h)
                elif pipelined and i < len(WIDTHS) - 1:
                    h = jr.stage_candidate(h)
            return jnp.mean((h - batch["y"]) ** 2)

        grad = jr.value_and_grad if pipelined else jax.value_and_grad
        loss, g = grad(loss_fn)(params)
        updates, state = OPT.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step


def make_batch():
    rng = np.random.default_rng(1)
    return {
        "x": rng.normal(size=(64, 32)).astype(np.float32),
        "y": rng.normal(size=(64, 32)).astype(np.float32),
    }


def config(**overrides):
    base = dict(stage_mesh_shape=(1,), num_micro_batches=4, backend="local", devices_per_host=1)
    return jr.PipelineConfig(**{**base, **overrides})


def run(step, steps=2):
    params, batch = init_params(), make_batch()
    state, losses = OPT.init(params), []
    for _ in range(steps):
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return params, losses


def assert_equal_to_jit(step):
    got, losses = run(step)
    want, want_losses = run(jax.jit(make_step(pipelined=False)))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6)


def test_candidates_are_the_identity_outside_a_choice():
    """Without cuts or partition, a step with candidates is one stage (num_stages=1), and
    under jax.jit and jax.grad the markers do nothing."""
    step = jr.parallelize(make_step(), config=config(num_stages=1), batch_argnums=2)
    assert step.plan(init_params(), OPT.init(init_params()), make_batch()).graph.num_stages == 1
    assert_equal_to_jit(step)
    assert_equal_to_jit(jax.jit(make_step()))


def test_cuts_choose_candidates_by_number():
    step = jr.parallelize(make_step(), config=config(cuts=(1, 3)), batch_argnums=2)
    plan = step.plan(init_params(), OPT.init(init_params()), make_batch())
    assert plan.graph.num_stages == 3
    shapes = {t["shape"] for t in plan.boundary_tensors() if t["kind"] == "act"}
    assert shapes == {(16, 32)}  # the 32-wide outputs of layers 1 and 3, per micro-batch
    assert_equal_to_jit(step)
    with pytest.raises(ValueError, match=r"has 5 jr.stage_candidate markers \(numbered 0 to 4\)"):
        jr.parallelize(make_step(), config=config(cuts=(7,)), batch_argnums=2).plan(
            init_params(), OPT.init(init_params()), make_batch()
        )


def test_auto_charges_the_transfer_of_every_cut():
    """On 1 MB/s links a cut's transfer dominates its segments' compute: the partitioner
    cuts where the least crosses (after a 32-wide layer), its report gives every choice's
    predicted step, and the step equals jax.jit."""
    cfg = config(partition="auto", num_stages=2, emulate_network_gbps=0.001)
    step = jr.parallelize(make_step(), config=cfg, batch_argnums=2)
    plan = step.plan(init_params(), OPT.init(init_params()), make_batch())
    report = plan.partition
    assert report.chosen in ((1,), (3,))
    assert len(report.tried) == 5 and report.tried[0][0] == report.chosen
    narrow = [report.crossing[i][0] for i in (1, 3)]
    wide = [report.crossing[i][0] for i in (0, 2, 4)]
    assert max(narrow) * 8 < min(wide)
    assert "automatic partition: 6 segments between 5 markers" in str(plan)
    assert plan.graph.num_stages == 2
    assert_equal_to_jit(step)


def test_auto_keeps_forced_boundaries():
    cfg = config(partition="auto", num_stages=3, emulate_network_gbps=0.001)
    step = jr.parallelize(make_step(forced=(2,)), config=cfg, batch_argnums=2)
    plan = step.plan(init_params(), OPT.init(init_params()), make_batch())
    assert plan.partition.markers.count("forced") == 1
    assert len(plan.partition.chosen) == 1 and plan.graph.num_stages == 3
    assert_equal_to_jit(step)


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="say how many stages"):
        jr.PipelineConfig(partition="auto")
    with pytest.raises(ValueError, match="distinct candidate numbers"):
        jr.PipelineConfig(cuts=(1, 1))
    with pytest.raises(ValueError, match=r"a tuple of jr.stage_candidate numbers"):
        jr.PipelineConfig(cuts="1,3")
    cfg = config(partition="auto", num_stages=8)
    with pytest.raises(ValueError, match="so it can have 1 to 6 stages"):
        jr.parallelize(make_step(), config=cfg, batch_argnums=2).plan(
            init_params(), OPT.init(init_params()), make_batch()
        )
    cfg = config(partition="auto", num_stages=2, schedule="interleaved_1f1b", stage_mesh_shape=(1,))
    with pytest.raises(ValueError, match="one stage per mesh so far"):
        jr.parallelize(make_step(), config=cfg, batch_argnums=2).plan(
            init_params(), OPT.init(init_params()), make_batch()
        )
