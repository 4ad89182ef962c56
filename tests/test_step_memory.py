"""What a pipelined step keeps in device memory.

- Residuals kept by reference (see [Note: residuals kept by reference] in
  `runtime/step/_compile.py`): a stage's forward returns only the residuals it computes; the
  weights and inputs its backward reads are the arrays themselves, not a copy per micro-batch.
  The fused optimizer that overwrites a donated weight takes that residual from its donated
  input.
- Nothing of a finished step stays alive but its outputs (its activations, residuals and
  gradients are released), so a step never holds the last one's too."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr
from jaxreshard.frontend._split import PARAM

WIDTH, ROWS = 16, 8


def init_params():
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(WIDTH, WIDTH)) / 4).astype(np.float32) for _ in range(4)]


def make_step(opt, pipelined=True):
    def step(params, state, batch):
        def loss_fn(p):
            h = batch["x"]
            for i, w in enumerate(p):
                h = jnp.tanh(h @ w)
                if pipelined and i == 1:
                    h = jr.stage_boundary(h)
            return jnp.mean((h - batch["y"]) ** 2)

        grad = jr.value_and_grad if pipelined else jax.value_and_grad
        loss, g = grad(loss_fn)(params)
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step


def batch(seed):
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=(ROWS, WIDTH)).astype(np.float32) for k in "xy"}


@pytest.mark.parametrize(
    "schedule, weight_delay, micro_batches, donate, fuse",
    [
        ("1f1b", False, 4, (), "auto"),
        ("1f1b", False, 1, (0, 1), "auto"),  # the optimizer fused into the last backward
        ("eager_1f1b", True, 4, (0, 1), "always"),  # fused into the last W, donated
        ("zb_h1", True, 2, (), "never"),
    ],
)
def test_forward_returns_only_what_it_computes(
    cpu_devices, schedule, weight_delay, micro_batches, donate, fuse
):
    opt = optax.adam(1e-2)
    config = jr.PipelineConfig(
        backend="local", stage_mesh_shape=(1,), num_micro_batches=micro_batches,
        schedule=schedule, weight_delay=weight_delay, fuse_optimizer=fuse,
    )  # fmt: skip
    step = jr.parallelize(make_step(opt), config=config, batch_argnums=2, donate_argnums=donate)
    ours = ref = (init_params(), opt.init(init_params()))
    for seed in range(3):
        given = jax.tree.map(jnp.array, ours)  # (donated arrays are fresh each step)
        *ours, loss = step(*given, batch(seed))
        *ref, want = jax.jit(make_step(opt, pipelined=False))(*ref, batch(seed))
        np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

    compiler = step.pipeline(*ours, batch(0)).compiled.engine.compilers[1]
    forwarded = compiler.bw.forwarded
    kinds = [compiler.bw.stage.inputs[i].kind for i in forwarded if i is not None]
    assert kinds.count(PARAM) == 2  # both weights of stage 1: its input gradient reads them
    _, computed = compiler.executable("forward").output_shardings
    assert len(computed) == sum(i is None for i in forwarded) < len(forwarded)
    inputs = [object() for _ in compiler.bw.stage.inputs]
    kept = compiler.residuals_of(inputs, ["computed"] * len(computed))
    by_reference = [x is inputs[i] for x, i in zip(kept, forwarded) if i is not None]
    assert by_reference == [True] * len(kinds)


def live_activations():
    """Live arrays of an activation's shape (a micro-batch of the hidden layer), per device."""
    found = {}
    for a in jax.live_arrays():
        if a.shape == (ROWS // 4, WIDTH):
            for shard in a.addressable_shards:
                found[shard.device.id] = found.get(shard.device.id, 0) + 1
    return found


@pytest.mark.parametrize("steps_in_flight", [1, 2])
def test_a_finished_step_keeps_only_its_outputs(cpu_devices, steps_in_flight):
    """Before, the runner kept every action's outputs of the last step (for the hung-action
    watch) until the next step ended: 12 activation-sized arrays here, the last step's
    residuals, exports and gradients."""
    import gc

    opt = optax.sgd(1e-2)
    config = jr.PipelineConfig(
        backend="local", stage_mesh_shape=(1,), num_micro_batches=4, schedule="eager_1f1b",
        weight_delay=True, steps_in_flight=steps_in_flight,
    )  # fmt: skip
    step = jr.parallelize(make_step(opt), config=config, batch_argnums=2, donate_argnums=(0, 1))
    state = (jax.tree.map(jnp.array, init_params()), opt.init(init_params()))
    for seed in range(3):
        *state, loss = step(*state, batch(seed))
    step.wait()
    float(loss)
    gc.collect()
    assert live_activations() == {}
    (*state, loss), _ = step.profile_call(*state, batch(3))
    gc.collect()
    assert live_activations() == {}


def test_a_step_run_as_a_ray_host_runs_it_keeps_only_its_outputs(cpu_devices, monkeypatch):
    """A Ray host calls `HostEngine.step` with `wait=False` and no watch (its answer waits for
    the values): nothing may keep the step's log of action outputs then either (a review found
    16 activation-sized arrays kept that way)."""
    import gc

    from jaxreshard.runtime.engine._host import HostEngine

    step_of = HostEngine.step

    def as_a_ray_host(self, inputs, *, wait=True, watch=None, on_segment=None):
        return step_of(self, inputs, wait=False, watch=None, on_segment=on_segment)

    monkeypatch.setattr(HostEngine, "step", as_a_ray_host)
    opt = optax.sgd(1e-2)
    config = jr.PipelineConfig(
        backend="local", stage_mesh_shape=(1,), num_micro_batches=4, schedule="eager_1f1b",
        weight_delay=True,
    )  # fmt: skip
    step = jr.parallelize(make_step(opt), config=config, batch_argnums=2, donate_argnums=(0, 1))
    state = (jax.tree.map(jnp.array, init_params()), opt.init(init_params()))
    for seed in range(3):
        *state, loss = step(*state, batch(seed))
    jax.block_until_ready(state)
    float(loss)
    gc.collect()
    assert live_activations() == {}
