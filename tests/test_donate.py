"""parallelize(donate_argnums=...) as jax.jit's: the optimizer overwrites the donated
parameters and state in place, results stay equal to jax.jit, bad values are named."""

import jax
import numpy as np
import optax
import pytest
from test_parallelize import adam_step, make_batch, make_params, mlp_loss

import jaxreshard as jr

ROWS = 16


def _leaves_deleted(tree) -> list[bool]:
    return [x.is_deleted() for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]


@pytest.mark.parametrize(
    "m, stages",
    [(1, 1), (4, 1), (1, 2), (4, 2)],
    ids=["fused-1stage", "segment-1stage", "fused-2stages", "segment-2stages"],
)
def test_donated_parameters_and_state_are_reused_and_the_step_equals_jit(cpu_devices, m, stages):
    """With one micro-batch the optimizer runs fused into the last backward, with four as a
    segment after the pipeline: either way, the previous step's parameters and optimizer
    state (this step's donated inputs) are gone after the call, as under jax.jit."""
    optimizer = optax.adam(1e-2)
    train = adam_step(mlp_loss if stages == 2 else _one_stage_loss, optimizer)
    config = jr.PipelineConfig(
        backend="local", num_stages=stages, num_micro_batches=m, stage_mesh_shape=(1,)
    )
    step = jr.parallelize(train, config=config, batch_argnums=(2,), donate_argnums=(0, 1))
    jitted = jax.jit(train, donate_argnums=(0, 1))
    params = make_params(2)
    ours = (params, optimizer.init(params))
    ref = (jax.tree.map(jax.numpy.asarray, params), optimizer.init(params))
    for seed in range(3):
        batch = make_batch(ROWS, seed=seed)
        before = ours
        *ours, loss = step(*ours, batch)
        *ref, ref_loss = jitted(*ref, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
        if seed:  # (the first step's inputs were NumPy arrays: placed, not donated)
            gone = _leaves_deleted(before)
            assert sum(gone) >= len(gone) // 2, gone
    for k in params:
        np.testing.assert_allclose(np.asarray(ours[0][k]), np.asarray(ref[0][k]), atol=1e-6)


def _one_stage_loss(p, batch):
    h = jax.numpy.tanh(batch["x"] @ p["emb"])
    h = jax.numpy.tanh(h @ p["w1"] + p["b1"])
    return jax.numpy.mean((h @ p["out"] - batch["y"]) ** 2)


def _three_stage_loss(p, batch):
    h = jax.numpy.tanh(batch["x"] @ p["emb"])
    h = jr.stage_boundary(h)
    h = jax.numpy.tanh(h @ p["w1"] + p["b1"])
    h = jr.stage_boundary(h)
    h = jax.numpy.tanh(h @ p["w2"] + p["b2"])
    return jax.numpy.mean((h @ p["out"] - batch["y"]) ** 2)


@pytest.mark.parametrize("schedule, weight_delay", [("1f1b", False), ("eager_1f1b", True)])
def test_a_middle_stage_donates_into_its_fused_optimizer(cpu_devices, schedule, weight_delay):
    """A middle stage's backward keeps its weight as a residual (for the input gradient) and
    runs the optimizer fused (one micro-batch), donating that weight: still equal."""
    optimizer = optax.adam(1e-2)
    train = adam_step(_three_stage_loss, optimizer)
    config = jr.PipelineConfig(
        backend="local",
        num_stages=3,
        stage_mesh_shape=(1,),
        schedule=schedule,
        weight_delay=weight_delay,
    )
    step = jr.parallelize(train, config=config, batch_argnums=(2,), donate_argnums=(0, 1))
    params = make_params(3)
    ours, ref = (params, optimizer.init(params)), (params, optimizer.init(params))
    for seed in range(3):
        batch = make_batch(ROWS, seed=seed)
        *ours, loss = step(*ours, batch)
        *ref, ref_loss = jax.jit(train)(*ref, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)


def test_a_donated_argument_the_step_returns_unchanged_is_kept(cpu_devices):
    """A leaf that comes back as it went in (a frozen table) cannot be overwritten."""

    def train(params, frozen, batch):
        loss, grads = jr.value_and_grad(mlp_loss)(params, batch)
        new = jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)
        return new, frozen, loss

    config = jr.PipelineConfig(backend="local", num_micro_batches=2, stage_mesh_shape=(1,))
    step = jr.parallelize(train, config=config, batch_argnums=(2,), donate_argnums=(0, 1))
    params = jax.tree.map(jax.numpy.asarray, make_params(2))
    frozen = jax.numpy.arange(4.0)
    params, frozen2, _ = step(params, frozen, make_batch(ROWS))
    params, frozen3, _ = step(params, frozen2, make_batch(ROWS))
    np.testing.assert_array_equal(np.asarray(frozen3), np.arange(4.0))
    assert not frozen2.is_deleted()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"donate_argnums": "0"}, TypeError, r"donate_argnums='0'\) takes an int or a tuple"),
        ({"donate_argnums": (0, 0)}, ValueError, r"donate_argnums=\(0, 0\)\) repeats"),
        ({"donate_argnums": (1.5,)}, TypeError, r"1\.5 is not an argument position"),
        (
            {"donate_argnums": (2,), "batch_argnums": (2,)},
            ValueError,
            r"argument 2 is in both; a batch is split into micro-batches, not reused",
        ),
    ],
)
def test_bad_donate_argnums_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        jr.parallelize(lambda p, s, b: None, **kwargs)


def test_a_donate_position_past_the_arguments_is_named(cpu_devices):
    config = jr.PipelineConfig(backend="local", stage_mesh_shape=(1,))
    step = jr.parallelize(adam_step(mlp_loss, optax.sgd(0.1)), config=config, donate_argnums=(5,))
    params = make_params(2)
    with pytest.raises(ValueError, match=r"donate_argnums=\(5,\) but the step got 3 arguments"):
        step(params, optax.sgd(0.1).init(params), make_batch(ROWS))


@pytest.mark.ray
@pytest.mark.parametrize("m", [1, 4], ids=["fused", "segment"])
def test_donation_on_ray_equals_jit(ray_runtime, m):
    """On the host actors the donated arrays are the hosts' own (the driver holds handles):
    the steps equal jax.jit's, each taking the previous step's handles."""
    optimizer = optax.adam(1e-2)
    train = adam_step(mlp_loss, optimizer)
    config = jr.PipelineConfig(backend="ray", num_micro_batches=m, stage_mesh_shape=(2,))
    step = jr.parallelize(train, config=config, batch_argnums=(2,), donate_argnums=(0, 1))
    jitted = jax.jit(train)
    params = make_params(2)
    ours = (params, optimizer.init(params))
    ref = (params, optimizer.init(params))
    for seed in range(3):
        batch = make_batch(ROWS, seed=seed)
        *ours, loss = step(*ours, batch)
        *ref, ref_loss = jitted(*ref, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-5)
    for k in params:
        np.testing.assert_allclose(ours[0][k].fetch(), np.asarray(ref[0][k]), atol=2e-5)


@pytest.mark.parametrize("m, mesh", [(1, (1,)), (4, (1,)), (4, (2,))])
def test_a_donated_constant_read_by_the_loss_and_the_optimizer(cpu_devices, m, mesh):
    """A donated per-step constant (a learning rate) that the loss reads too: the fused
    executable (one micro-batch, or a one-stage pipeline's scan) keeps it rather than donate a
    buffer it also reads (XLA refuses that, or crashes on a data mesh)."""
    import jax.numpy as jnp

    def step(params, batch, lr):
        def loss_fn(p):
            h = jnp.tanh(batch["x"] @ p["emb"]) * lr
            return jnp.mean((h @ p["out"] - batch["y"]) ** 2)

        loss, grads = jr.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda w, g: w - lr * g, params, grads), loss

    params, batch, lr = make_params(1), make_batch(), np.float32(0.05)
    want = jax.jit(step)(params, batch, lr)
    config = jr.PipelineConfig(
        backend="local", num_stages=1, num_micro_batches=m, stage_mesh_shape=mesh
    )
    pstep = jr.parallelize(step, config=config, batch_argnums=(1,), donate_argnums=(0, 2))
    for _ in range(2):
        got = pstep(jax.tree.map(jnp.array, params), batch, jnp.array(lr))
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("schedule, uses", [("interleaved_1f1b", (0, 2)), ("zbv", (0, 3))])
def test_a_donated_constant_two_chunks_on_one_mesh_read(cpu_devices, schedule, uses):
    """Chunks `uses` run on one mesh and both read a per-step constant, which the later one's
    fused optimizer updates (donated). The earlier chunk's backward, after that, still needs
    the constant: it keeps its own copy as a residual, not the placed array that the optimizer
    overwrites (a review found `Array has been deleted` when residuals kept it by reference)."""
    import jax.numpy as jnp

    width = 8

    def make(pipelined):
        def step(params, batch, scale):
            def loss_fn(p):
                h = batch["x"]
                for i, w in enumerate(p):
                    h = jnp.tanh(h @ w)
                    if i in uses:
                        h = h @ scale
                    if pipelined and i < 3:
                        h = jr.stage_boundary(h)
                return jnp.mean((h - batch["y"]) ** 2)

            grad = jr.value_and_grad if pipelined else jax.value_and_grad
            loss, grads = grad(loss_fn)(params)
            new = [w - 0.1 * g for w, g in zip(params, grads)]
            return new, scale * 0.99 + 1e-3 * new[uses[1]], loss

        return step

    rng = np.random.default_rng(0)
    params = [(rng.normal(size=(width, width)) / 3).astype(np.float32) for _ in range(4)]
    batch = {k: rng.normal(size=(8, width)).astype(np.float32) for k in "xy"}
    scale = (np.eye(width) + rng.normal(size=(width, width)) / 10).astype(np.float32)
    config = jr.PipelineConfig(backend="local", num_stages=4, schedule=schedule,
                               virtual_stages=2, num_micro_batches=1,
                               stage_mesh_shape=(1,))  # fmt: skip
    step = jr.parallelize(make(True), config=config, batch_argnums=(1,), donate_argnums=(0, 2))
    ours, ref = (params, scale), (params, scale)
    for _ in range(2):
        *ours, loss = step([jnp.array(p) for p in ours[0]], batch, jnp.array(ours[1]))
        *ref, want = jax.jit(make(False))(*ref[:1], batch, ref[1])
        np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
