"""parallelize with Optax: any GradientTransformation gives jax.jit's numbers, its state is kept
on the stage of the parameter it belongs to, and global reductions move only scalars."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_parallelize import config, fetch, make_batch, make_params

import jaxreshard as jr

OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "sgd_momentum": lambda: optax.sgd(5e-2, momentum=0.9),
    # The gradients' global norm is about 2.6 at the start: the clip is active.
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
    "jitted_helper": lambda: optax.chain(jitted_scale(0.5), optax.adam(1e-2)),
}


def jitted_scale(factor):
    """A transformation whose update is one `jax.jit` call over every stage's gradients, as
    optax's own helpers are on newer JAX (where `jit(inline=True)` no longer inlines)."""

    @jax.jit
    def scale_tree(updates):
        return jax.tree.map(lambda g: g * factor, updates)

    def update(updates, state, params=None):
        del params
        return scale_tree(updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optax_step(optimizer):
    """test_parallelize's 3-stage MLP with a skip connection (stage 0 -> 2) and a tied
    parameter (`emb`, used by stages 0 and 2), trained by `optimizer`."""

    def step(params, opt_state, batch):
        def loss_fn(p):
            h = jnp.tanh(batch["x"] @ p["emb"])
            first = h
            for s in (1, 2):
                h = jr.stage_boundary(h)
                h = jnp.tanh(h @ p[f"w{s}"] + p[f"b{s}"])
            return jnp.mean(((h + first) @ p["emb"].T - batch["y"]) ** 2)

        loss, grads = jr.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def run(step, optimizer, steps=3):
    params = make_params(3)
    state = optimizer.init(params)
    losses = []
    for _ in range(steps):
        params, state, loss = step(params, state, make_batch())
        losses.append(float(loss))
    return params, state, losses


def assert_same(got, want):
    params, state, losses = got
    ref_params, ref_state, ref_losses = want
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_equal(jax.tree.structure(state), jax.tree.structure(ref_state))
    for x, y in zip(jax.tree.leaves((params, state)), jax.tree.leaves((ref_params, ref_state))):
        np.testing.assert_allclose(fetch(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def parallelize(optimizer, **overrides):
    cfg = config(num_micro_batches=2, **overrides)
    return jr.parallelize(make_optax_step(optimizer), config=cfg, batch_argnums=(2,))


def param_of(path):
    """The parameter an optimizer-state leaf belongs to (its last dict key), or None."""
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return keys[-1] if keys else None


def on_devices(x):
    return frozenset(x.sharding.device_set)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("schedule, weight_delay", [("1f1b", False), ("eager_1f1b", True)])
def test_optax_matches_jax_jit(name, schedule, weight_delay):
    optimizer = OPTIMIZERS[name]()
    step = parallelize(optimizer, schedule=schedule, weight_delay=weight_delay)
    assert_same(run(step, optimizer), run(jax.jit(make_optax_step(optimizer)), optimizer))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_is_kept_on_its_parameters_stage_and_not_moved(name, monkeypatch):
    optimizer = OPTIMIZERS[name]()
    step = parallelize(optimizer)
    params, state, _ = run(step, optimizer, steps=1)
    meshes = step.plan(params, state, make_batch()).meshes
    stage_of = {frozenset(m.devices.flat): s for s, m in enumerate(meshes)}
    owner = {k: stage_of[on_devices(x)] for k, x in params.items()}
    assert (owner["emb"], owner["w1"], owner["w2"]) == (0, 1, 2)
    per_param = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        assert on_devices(leaf) in stage_of, f"{jax.tree_util.keystr(path)} is on no stage"
        k = param_of(path)
        if k is not None:
            assert stage_of[on_devices(leaf)] == owner[k], jax.tree_util.keystr(path)
            per_param += 1
    assert per_param >= len(params)  # a momentum (SGD) or two (Adam) per parameter

    # The next step moves no parameter and no state leaf: none reaches jax.device_put (a
    # shared scalar such as Adam's `count` may: it lives on one stage and every stage reads it).
    seen = []
    device_put = jax.device_put
    monkeypatch.setattr(
        jax, "device_put", lambda x, *a, **k: seen.append(x) or device_put(x, *a, **k)
    )
    held = [x for x in jax.tree.leaves((params, state)) if x.ndim]
    step(params, state, make_batch())
    moved = [x.shape for x in held if any(x is y for y in seen)]
    assert not moved, f"the second step moved arrays of shapes {moved}"


@pytest.mark.parametrize("name", ["clip_adam", "jitted_helper"])
def test_only_scalars_cross_stages_in_the_optimizer(name):
    """clip_by_global_norm reduces over every stage's gradients: each stage sums its own
    gradients' squares, one stage adds the sums up, and only scalars cross stages (the parameters'
    updates run where the parameters are). A jitted helper over the whole tree is inlined, so each
    of its equations runs where its inputs are, rather than the call moving them to one stage."""
    optimizer = OPTIMIZERS[name]()
    params = make_params(3)
    state = optimizer.init(params)
    graph = parallelize(optimizer).plan(params, state, make_batch()).graph
    made_on = {v: seg.stage for seg in graph.segments for v in seg.outputs}
    crossing = [
        (made_on[v], seg.stage, v.aval.str_short())
        for seg in graph.segments
        for v in seg.inputs
        if v in made_on and made_on[v] != seg.stage
    ]
    if name == "clip_adam":
        assert crossing, "the norm is global: some value must cross stages"
    assert all(
        math.prod(v.aval.shape) == 1
        for seg in graph.segments
        for v in seg.inputs
        if v in made_on and made_on[v] != seg.stage
    ), crossing
    # Every gradient is read on its parameter's stage only.
    for k, g in enumerate(graph.grad_outputs[1:]):
        readers = {seg.stage for seg in graph.segments if g in seg.inputs}
        assert readers <= {graph.owner[k]}, (k, readers)


@pytest.mark.ray
@pytest.mark.parametrize(
    "stage_mesh_shape", [(1, 2), (1, 1)], ids=["a_host_per_stage", "two_stages_on_a_host"]
)
def test_optax_on_the_ray_runtime_keeps_state_on_the_hosts(
    ray_runtime, monkeypatch, stage_mesh_shape
):
    """Moments stay on their parameter's host and the next steps fetch nothing but scalars;
    with two stages on one host, one of them reads Adam's step count that the other keeps."""
    optimizer = OPTIMIZERS["clip_adam"]()
    step = parallelize(
        optimizer,
        backend="ray",
        schedule="eager_1f1b",
        weight_delay=True,
        stage_mesh_shape=stage_mesh_shape,
    )
    params, state, losses = run(step, optimizer, steps=1)

    def host(x):
        return {d.process_index for d in x.sharding.mesh.devices.flat}

    meshes = step.plan(params, state, make_batch()).meshes
    stage_hosts = [{d.process_index for d in m.devices.flat} for m in meshes]
    assert [host(params[k]) for k in ("emb", "w1", "w2")] == stage_hosts
    assert len({min(h) for h in stage_hosts}) == (3 if stage_mesh_shape == (1, 2) else 2)
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        assert isinstance(leaf, jr.RemoteArray), jax.tree_util.keystr(path)
        k = param_of(path)
        if k is not None:
            assert host(leaf) == host(params[k]), jax.tree_util.keystr(path)
    fetched = []
    fetch_remote = jr.RemoteArray.fetch
    monkeypatch.setattr(
        jr.RemoteArray, "fetch", lambda self: fetched.append(self.shape) or fetch_remote(self)
    )
    for _ in range(2):
        params, state, loss = step(params, state, make_batch())
        losses.append(float(loss))
    assert all(math.prod(shape) == 1 for shape in fetched), fetched  # only scalars cross
    monkeypatch.undo()
    assert_same((params, state, losses), run(jax.jit(make_optax_step(optimizer)), optimizer))


def attention_loss(p, batch):
    """One attention layer on stage 1. Its key bias `bk` adds q . bk to every score of a query,
    the same for every key, which softmax cancels: its gradient is mathematically zero, and in
    floats it is rounding noise (of either sign, different under any other summation order)."""
    h = jnp.tanh(batch["x"] @ p["emb"])
    h = jr.stage_boundary(h)
    q, k = h @ p["wq"], h @ p["wk"] + p["bk"]
    scores = q @ jnp.swapaxes(k, -1, -2) / math.sqrt(k.shape[-1])
    out = jax.nn.softmax(scores, axis=-1) @ h @ p["out"]
    return jnp.mean((out - batch["y"]) ** 2)


def test_adam_turns_a_noise_gradient_into_a_learning_rate_step():
    """docs/models.md, 'What "equal to jax.jit" means': every parameter agrees with jax.jit
    within the tests' tolerance (rtol=1e-5, atol=1e-6), except one whose gradient is pure
    rounding noise: Adam divides it by its own RMS, so each run moves it by up to about the
    learning rate, in a direction the noise picks. Compare such a parameter within lr per step
    (or its gradient, which agrees within the tolerance)."""
    rng = np.random.default_rng(0)
    features, hidden, seq, rows = 6, 8, 4, 8
    shapes = {"emb": (features, hidden), "wq": (hidden, hidden), "wk": (hidden, hidden),
              "bk": (hidden,), "out": (hidden, features)}  # fmt: skip
    params = {k: (rng.normal(size=s) * 0.4).astype(np.float32) for k, s in shapes.items()}
    batch = {
        "x": rng.normal(size=(rows, seq, features)).astype(np.float32),
        "y": rng.normal(size=(rows, seq, features)).astype(np.float32),
    }
    grads = jax.jit(jax.grad(attention_loss))(params, batch)
    assert float(jnp.max(jnp.abs(grads["bk"]))) < 1e-7 < float(jnp.max(jnp.abs(grads["wk"])))

    lr, steps = 1e-2, 4
    optimizer = optax.adamw(lr)

    def step(params, opt_state, batch):
        loss, grads = jr.value_and_grad(attention_loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    pipelined = jr.parallelize(step, config=config(num_micro_batches=4), batch_argnums=(2,))
    got = want = (params, optimizer.init(params))
    for _ in range(steps):
        *got, loss, got_grads = pipelined(*got, batch)
        *want, ref_loss, ref_grads = jax.jit(step)(*want, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
        for k in params:  # the gradients agree, bk's (noise around 0) included
            np.testing.assert_allclose(
                fetch(got_grads[k]), np.asarray(ref_grads[k]), rtol=1e-5, atol=1e-6
            )
    for k in params:
        a, b = fetch(got[0][k]), np.asarray(want[0][k])
        if k == "bk":  # up to lr per step apart (on CPU, jax 0.10: 3e-3 after 4 steps)
            assert np.max(np.abs(a - b)) <= lr * steps
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd_momentum"])
@pytest.mark.parametrize("schedule, weight_delay", [("1f1b", False), ("eager_1f1b", True)])
def test_an_optimizer_fused_into_the_last_of_several_backwards_matches_jax_jit(
    name, schedule, weight_delay
):
    """fuse_optimizer='always': with 2 micro-batches, the stage that owns its parameters alone
    (stage 1; stages 0 and 2 share `emb`) runs its optimizer inside its last backward."""
    optimizer = OPTIMIZERS[name]()
    step = parallelize(
        optimizer, schedule=schedule, weight_delay=weight_delay, fuse_optimizer="always"
    )
    got = run(step, optimizer)
    params, state, _ = got
    fused = step.pipeline(params, state, make_batch()).engine.fused
    assert 1 in fused, fused
    assert_same(got, run(jax.jit(make_optax_step(optimizer)), optimizer))


def test_fuse_optimizer_auto_fuses_one_micro_batch_only_and_never_fuses_nothing():
    optimizer = OPTIMIZERS["adam"]()
    params = make_params(3)
    state = optimizer.init(params)
    for m, mode, fused in ((2, "auto", False), (1, "auto", True), (1, "never", False)):
        cfg = config(num_micro_batches=m, fuse_optimizer=mode)
        step = jr.parallelize(make_optax_step(optimizer), config=cfg, batch_argnums=(2,))
        assert bool(step.pipeline(params, state, make_batch()).engine.fused) == fused, (m, mode)
