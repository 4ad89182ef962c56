"""parallelize: same numbers as jax.jit, the boundary tensors the model implies, clear errors."""

import functools
import re
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxreshard as jr
from jaxreshard.frontend._split import PipelineSplitError

HIDDEN, FEATURES, ROWS = 8, 6, 8


def make_step(num_stages, *, skip=False, shared=False):
    """An MLP cut into `num_stages` stages; `skip` adds stage 0's output to the last stage's,
    `shared` ties the first and last layer (the last multiplies by emb.T)."""

    def step(params, batch):
        def loss_fn(p):
            h = jnp.tanh(batch["x"] @ p["emb"])
            first = h
            for s in range(1, num_stages):
                h = jr.stage_boundary(h)
                h = jnp.tanh(h @ p[f"w{s}"] + p[f"b{s}"])
            if skip:
                h = h + first
            out = h @ p["emb"].T if shared else h @ p["out"]
            return jnp.mean((out - batch["y"]) ** 2)

        loss, grads = jr.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda w, g: w - 0.05 * g, params, grads), loss

    return step


def mlp_loss(p, batch):
    """`make_step(2)`'s loss, for steps that write their own post-gradient code."""
    h = jnp.tanh(batch["x"] @ p["emb"])
    h = jr.stage_boundary(h)
    h = jnp.tanh(h @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["out"] - batch["y"]) ** 2)


def adam_step(loss_fn, optimizer):
    """A train step: `loss_fn(params, batch)`'s gradient through Optax's `optimizer` (defined
    here, with `mlp_loss`, so that a step of it travels to Ray hosts whole)."""
    import optax

    def step(params, opt_state, batch):
        loss, grads = jr.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def make_params(num_stages, seed=0):
    rng = np.random.default_rng(seed)
    p = {
        "emb": rng.normal(size=(FEATURES, HIDDEN)).astype(np.float32) * 0.4,
        "out": rng.normal(size=(HIDDEN, FEATURES)).astype(np.float32) * 0.4,
    }
    for s in range(1, num_stages):
        p[f"w{s}"] = rng.normal(size=(HIDDEN, HIDDEN)).astype(np.float32) * 0.4
        p[f"b{s}"] = rng.normal(size=(HIDDEN,)).astype(np.float32) * 0.1
    return p


def make_batch(rows=ROWS, seed=1):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(rows, FEATURES)).astype(np.float32),
        "y": rng.normal(size=(rows, FEATURES)).astype(np.float32),
    }


def run_steps(step, params, batch, steps=3):
    losses = []
    for _ in range(steps):
        params, loss = step(params, batch)
        losses.append(float(loss))
    return params, losses


def fetch(x):
    return x.fetch() if isinstance(x, jr.RemoteArray) else np.asarray(x)


def assert_same(params, losses, ref_params, ref_losses, tol=1e-5):
    np.testing.assert_allclose(losses, ref_losses, rtol=tol)
    for k in ref_params:
        np.testing.assert_allclose(fetch(params[k]), np.asarray(ref_params[k]), rtol=tol, atol=1e-6)


REFERENCE = {}


def reference(num_stages, skip, shared):
    key = (num_stages, skip, shared)
    if key not in REFERENCE:
        step = jax.jit(make_step(num_stages, skip=skip, shared=shared))
        REFERENCE[key] = run_steps(step, make_params(num_stages), make_batch())
    return REFERENCE[key]


SCHEDULES = ["gpipe", "1f1b", "eager_1f1b", "zb_h1"]
MODELS = {
    "mlp2": (2, False, False),
    "mlp3": (3, False, False),
    "mlp4": (4, False, False),
    "skip3": (3, True, False),
    "shared4": (4, False, True),
    "skip_shared3": (3, True, True),
}


def config(**overrides):
    base = dict(stage_mesh_shape=(1, 2), mesh_axis_names=("data", "model"), backend="local")
    return jr.PipelineConfig(**{**base, **overrides})


GRID = [
    ("skip_shared3", schedule, weight_delay, m)  # every combination on the richest model
    for schedule in SCHEDULES
    for weight_delay in (False, True)
    for m in (1, 2, 4)
]
GRID += [
    (model, schedule, weight_delay, 4)  # every schedule on 2, 3 and 4 stages
    for model in ("mlp2", "mlp3", "mlp4", "skip3", "shared4")
    for schedule in SCHEDULES
    for weight_delay in (False, True)
]


@pytest.mark.parametrize("model, schedule, weight_delay, num_micro_batches", GRID)
def test_matches_jax_jit(model, schedule, weight_delay, num_micro_batches):
    num_stages, skip, shared = MODELS[model]
    cfg = config(num_micro_batches=num_micro_batches, schedule=schedule, weight_delay=weight_delay)
    step = jr.parallelize(
        make_step(num_stages, skip=skip, shared=shared), config=cfg, batch_argnums=(1,)
    )
    params, losses = run_steps(step, make_params(num_stages), make_batch())
    assert_same(params, losses, *reference(num_stages, skip, shared))


@pytest.mark.parametrize("weight_delay", [False, True])
@pytest.mark.parametrize(
    "shapes", [[(1, 1), (1, 2), (2, 2)], [(2, 2), (1, 1), (1, 2)], [(1, 2), (2, 1), (1, 1)]]
)
def test_stages_of_different_sizes_match_jax_jit(shapes, weight_delay):
    """Meshes of 1, 2 and 4 devices: a gradient leaves every backward variant (first, later,
    fused with the optimizer) with the sharding its transfer was planned for."""
    cfg = config(num_micro_batches=4, stage_mesh_shape=shapes, weight_delay=weight_delay)
    step = jr.parallelize(make_step(3, skip=True, shared=True), config=cfg, batch_argnums=(1,))
    params, losses = run_steps(step, make_params(3), make_batch())
    assert_same(params, losses, *reference(3, True, True))


@pytest.mark.parametrize(
    "schedule, weight_delay", [("1f1b", False), ("eager_1f1b", True), ("zb_h1", False)]
)
def test_explicit_mesh_axes_match_jax_jit(schedule, weight_delay):
    """Stage meshes with Explicit axes (sharding in types): the batch is sharded over `data` in
    the traced types, and the pipeline still computes what jax.jit does."""
    cfg = config(
        num_micro_batches=2,
        schedule=schedule,
        weight_delay=weight_delay,
        stage_mesh_shape=(2, 1),
        mesh_axis_types="explicit",
    )
    step = jr.parallelize(make_step(3, skip=True, shared=True), config=cfg, batch_argnums=(1,))
    params, losses = run_steps(step, make_params(3), make_batch())
    assert_same(params, losses, *reference(3, True, True))
    meshes = step.plan(params, make_batch()).meshes
    assert all(t == jax.sharding.AxisType.Explicit for t in meshes[0].axis_types)


def custom_rule_step(params, batch):
    """Activations with custom derivative rules (`relu`'s JVP, `logaddexp`'s in `softplus`)
    on both sides of a stage boundary."""

    def loss_fn(p):
        h = jax.nn.relu(batch["x"] @ p["emb"])
        h = jr.stage_boundary(h)
        h = jax.nn.softplus(h @ p["w1"] + p["b1"])
        return jnp.mean((jax.nn.relu(h @ p["out"]) - batch["y"]) ** 2)

    loss, grads = jr.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda w, g: w - 0.05 * g, params, grads), loss


@pytest.mark.parametrize(
    "mesh, m, weight_delay, types",
    [
        ((2, 1), 2, False, "explicit"),
        ((1, 2), 1, True, "explicit"),
        ((1, 1), 4, False, "explicit"),
        ((2, 2), 2, False, ("explicit", "auto")),  # (an Explicit batch axis, an Auto model one)
    ],
)
def test_explicit_axes_with_custom_derivative_rules_match_jax_jit(mesh, m, weight_delay, types):
    """A custom rule's JVP was traced at the step's types (the batch over `data`): each stage
    is derived at those types, not on untyped inputs, which JAX refused ("select cases must have
    the same shardings"; see [Note: stages traced with Explicit axes])."""
    cfg = config(
        num_micro_batches=m,
        schedule="eager_1f1b",
        weight_delay=weight_delay,
        stage_mesh_shape=mesh,
        mesh_axis_types=types,
    )
    step = jr.parallelize(custom_rule_step, config=cfg, batch_argnums=(1,))
    params, losses = run_steps(step, make_params(2), make_batch())
    assert_same(params, losses, *run_steps(jax.jit(custom_rule_step), make_params(2), make_batch()))


def test_meshes_from_jax_make_mesh(cpu_devices):
    """`jax.make_mesh` makes Explicit axes: the step is traced under those meshes' own types."""
    meshes = [
        jax.make_mesh((2, 1), ("data", "model"), devices=cpu_devices[2 * i : 2 * i + 2])
        for i in range(3)
    ]
    step = jr.parallelize(
        make_step(3, skip=True, shared=True),
        config=config(num_micro_batches=2),
        batch_argnums=(1,),
        meshes=meshes,
    )
    params, losses = run_steps(step, make_params(3), make_batch())
    assert_same(params, losses, *reference(3, True, True))


def test_explicit_axes_need_one_mesh_shape(cpu_devices):
    cfg = config(stage_mesh_shape=[(1, 2), (2, 2), (1, 2)], mesh_axis_types="explicit")
    step = jr.parallelize(make_step(3), config=cfg, batch_argnums=(1,))
    with pytest.raises(ValueError, match=r"Explicit axes .* same mesh shape"):
        step(make_params(3), make_batch())
    mixed = [
        jax.sharding.Mesh(np.array(cpu_devices[:2]).reshape(1, 2), ("data", "model")),
        jax.make_mesh((1, 2), ("data", "model"), devices=cpu_devices[2:4]),
    ]
    step = jr.parallelize(make_step(2), config=config(), batch_argnums=(1,), meshes=mixed)
    with pytest.raises(ValueError, match=r"stage mesh 1 has axes .* same axis names and types"):
        step(make_params(2), make_batch())


def test_mesh_axis_types_are_checked():
    with pytest.raises(ValueError, match=r"mesh_axis_types='manual'.*auto, explicit"):
        config(mesh_axis_types="manual")
    with pytest.raises(ValueError, match=r"gives 1 types for mesh_axis_names"):
        config(mesh_axis_types=("auto",))
    assert config(mesh_axis_types=["explicit", "auto"]).axis_types == ("explicit", "auto")


def test_params_stay_on_their_stage_and_are_not_moved_again(cpu_devices):
    step = jr.parallelize(
        make_step(3, shared=True, skip=True), config=config(num_micro_batches=2), batch_argnums=(1,)
    )
    params, _ = step(make_params(3), make_batch())
    meshes = step.plan(params, make_batch()).meshes
    assert set(params["emb"].sharding.device_set) == set(meshes[0].devices.flat)
    assert set(params["w1"].sharding.device_set) == set(meshes[1].devices.flat)
    assert set(params["w2"].sharding.device_set) == set(meshes[2].devices.flat)
    again, _ = step(params, make_batch())
    assert again["w1"].sharding == params["w1"].sharding
    assert len(step._cache) == 1  # same signature: compiled once


def test_specs_with_trailing_none_compile_once(cpu_devices):
    """P('model', None) (as a user places an array) and P('model') (as XLA returns it from a
    step) are one sharding: one compiled pipeline serves both."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(cpu_devices[:2]).reshape(1, 2), ("data", "model"))
    step = jr.parallelize(make_step(3), config=config(num_micro_batches=2), batch_argnums=(1,))
    for spec in (P("model", None), P("model")):
        params = {
            k: jax.device_put(v, NamedSharding(mesh, spec if v.ndim == 2 else P()))
            for k, v in make_params(3).items()
        }
        step.plan(params, make_batch())
    assert len(step._cache) == 1


def test_mixed_stage_meshes_compile_once_for_the_placement_the_step_returns(cpu_devices):
    """Stage meshes (1, 2) and (1, 1): parameters placed over the model axis of 2 come back
    from stage 1 replicated on its one device, a new signature that lays out alike on the
    stages; it reuses the compiled step (it compiled the pipeline again, a 4-5 s first timed
    step in a profile). A placement that changes what a stage compiles still compiles."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(cpu_devices[:2]).reshape(1, 2), ("data", "model"))
    cfg = config(num_micro_batches=2, stage_mesh_shape=((1, 2), (1, 1)))
    step = jr.parallelize(make_step(2), config=cfg, batch_argnums=(1,))
    placed = {
        k: jax.device_put(v, NamedSharding(mesh, P(None, "model") if v.ndim == 2 else P()))
        for k, v in make_params(2).items()
    }
    params, expected = placed, make_params(2)
    for _ in range(3):
        params, loss = step(params, make_batch())
        expected, want = jax.jit(make_step(2))(expected, make_batch())
        np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
    assert params["w1"].sharding.spec in (P(), P(None, None))  # stage 1's one device
    assert placed["w1"].sharding.spec == P(None, "model")
    assert len(step._cache) == 2 and len({id(e) for e in step._cache.values()}) == 1
    for k in params:
        np.testing.assert_allclose(params[k], expected[k], rtol=1e-5, atol=1e-6)
    # Stage 0's weight replicated instead of split over its model axis of 2: a new layout.
    other = {**params, "emb": jax.device_put(np.asarray(params["emb"]), NamedSharding(mesh, P()))}
    step.plan(other, make_batch())
    assert len({id(e) for e in step._cache.values()}) == 2
    step.close()


def test_a_mixed_layouts_optimizer_segments_run_as_compiled_ahead_from_the_second_step(
    cpu_devices,
):
    """Stage meshes (2, 1) and (1, 2): the step is traced under the first one's shape, and
    stage 1's optimizer segment laid its outputs out over a (2, 1) grid of its own devices,
    which the next step brought back unlike what the segment was compiled for: it compiled
    again inside the second step (1.1 s in a profile's first timed step of the tiny GPT). Its
    outputs now come out on the stage's own mesh."""
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    optimizer = optax.adam(1e-2)
    step = adam_step(mlp_loss, optimizer)
    mesh = jax.sharding.Mesh(np.array(cpu_devices[:2]).reshape(2, 1), ("data", "model"))
    specs = {"emb": P(None, "model"), "out": P("model", None), "w1": P(None, "model"), "b1": P()}
    params = {
        k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in make_params(2).items()
    }
    cfg = config(num_micro_batches=2, stage_mesh_shape=((2, 1), (1, 2)))
    pstep = jr.parallelize(step, config=cfg, batch_argnums=(2,))
    state = (params, optimizer.init(params))
    expected = (make_params(2), optimizer.init(make_params(2)))
    for _ in range(3):
        *state, loss = pstep(*state, make_batch())
        *expected, want = jax.jit(step)(*expected, make_batch())
        np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
    pipe = pstep.pipeline(*state, make_batch())
    assert [seg.stage for seg in pipe.graph.segments] == [1, 0]
    assert pipe.engine.segments.compiled_in_steps() == []
    # ... and stage 1 keeps its tensor-parallel layout: split over its model axis of 2.
    stage1 = jax.sharding.Mesh(np.array(cpu_devices[2:4]).reshape(1, 2), ("data", "model"))
    for leaf, spec in [(state[0]["w1"], P(None, "model")), (state[1][0].mu["w1"], P(None, "model")),
                       (state[0]["out"], P("model", None))]:  # fmt: skip
        want = NamedSharding(stage1, spec)
        assert leaf.sharding.mesh == stage1, leaf.sharding
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), leaf.sharding
    assert len({id(e) for e in pstep._cache.values()}) == 1  # one compiled step
    pstep.close()


def test_boundary_tensors_are_what_the_model_implies():
    step = jr.parallelize(
        make_step(3, skip=True, shared=True), config=config(num_micro_batches=2), batch_argnums=(1,)
    )
    plan = step.plan(make_params(3), make_batch())
    found = {
        (t["kind"], t["tensor"], t["src_stage"], t["dst_stage"]): t for t in plan.boundary_tensors()
    }
    emb = sorted(make_params(3)).index("emb")  # parameters are numbered in flatten order
    assert set(found) == {
        ("act", 0, 0, 1),
        ("act", 0, 0, 2),  # stage 0's output: marked, and the skip
        ("act", 1, 1, 2),
        ("grad", 0, 1, 0),
        ("grad", 0, 2, 0),
        ("grad", 1, 2, 1),
        ("param", emb, 0, 2),
        ("param_grad", emb, 2, 0),  # emb, used by stages 0 and 2
    }
    rows = ROWS // 2
    assert found[("act", 1, 1, 2)]["shape"] == (rows, HIDDEN)
    assert found[("param", emb, 0, 2)]["shape"] == (FEATURES, HIDDEN)
    assert found[("param", emb, 0, 2)]["per"] == "step"
    assert found[("act", 0, 0, 1)]["bytes"] == rows * HIDDEN * 4
    for t in found.values():
        assert t["src_sharding"].endswith("@ {data:1, model:2}")
        assert t["strategy"] in jr.comm.STRATEGY_NAMES
    text = str(plan)
    assert "3 stages, 2 micro-batches of 4 rows" in text and "stage 2 |" in text


def test_sharding_constraints_inside_stages():
    from jax.sharding import PartitionSpec as P

    def step(params, batch):
        def loss_fn(p):
            h = jnp.tanh(batch["x"] @ p["emb"])
            h = jax.lax.with_sharding_constraint(h, P(None, "model"))
            h = jr.stage_boundary(h)
            return jnp.mean((h @ p["out"] - batch["y"]) ** 2)

        loss, grads = jr.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda w, g: w - 0.05 * g, params, grads), loss

    params = make_params(1)
    cfg = config(num_micro_batches=2, stage_mesh_shape=(2, 2))
    pstep = jr.parallelize(step, config=cfg, batch_argnums=(1,))
    got = run_steps(pstep, params, make_batch())
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    with jax.set_mesh(mesh):
        ref = run_steps(jax.jit(step), params, make_batch())
    assert_same(*got, *ref)
    act = next(t for t in pstep.plan(params, make_batch()).boundary_tensors() if t["kind"] == "act")
    assert act["src_sharding"].startswith("P(None, 'model')")


def test_optax_style_state_and_a_single_stage():
    def step(params, opt, batch):
        def loss_fn(p):
            return jnp.mean((jnp.tanh(batch["x"] @ p["emb"]) @ p["out"] - batch["y"]) ** 2)

        loss, grads = jr.value_and_grad(loss_fn)(params)
        momentum = jax.tree.map(lambda m, g: 0.9 * m + g, opt, grads)
        new = jax.tree.map(lambda w, m: w - 0.05 * m, params, momentum)
        return new, momentum, loss

    params = {k: v for k, v in make_params(1).items()}
    opt = jax.tree.map(np.zeros_like, params)
    cfg = config(num_stages=1, num_micro_batches=2)
    pstep = jr.parallelize(step, config=cfg, batch_argnums=(2,))
    p, o, ref_p, ref_o = params, opt, params, opt
    for _ in range(3):
        p, o, loss = pstep(p, o, make_batch())
        ref_p, ref_o, ref_loss = jax.jit(step)(ref_p, ref_o, make_batch())
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for k in params:
        np.testing.assert_allclose(np.asarray(p[k]), np.asarray(ref_p[k]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(o[k]), np.asarray(ref_o[k]), rtol=1e-5, atol=1e-6)


class LossSettings:
    """A config object passed to the loss beside its arrays (not a pytree: a leaf)."""

    def __init__(self, scale):
        self.scale = scale


def settings_loss(p, batch, settings, num_stages, squared, repeats):
    h = jnp.tanh(batch["x"] @ p["emb"])
    for s in range(1, num_stages):  # (a Python int: a loop bound)
        h = jnp.tanh(jr.stage_boundary(h) @ p[f"w{s}"] + p[f"b{s}"])
    err = h @ p["out"] - batch["y"]
    total = 0.0
    for _ in range(repeats):  # (a concrete NumPy array: a loop bound too)
        total = total + jnp.mean(err**2 if squared else jnp.abs(err))  # (a bool: a branch)
    return settings.scale * total


def test_non_array_arguments_of_the_loss_stay_python_values_as_under_jax_grad():
    """jax.value_and_grad passes the loss's other arguments as they are: a config object, an
    int loop bound, a bool branch and a concrete array work inside a pipeline as under
    jax.jit."""

    def step(params, batch):
        loss, grads = jr.value_and_grad(settings_loss)(
            params, batch, LossSettings(0.5), 3, True, np.array(2)
        )
        return jax.tree.map(lambda w, g: w - 0.05 * g, params, grads), loss

    params, batch = make_params(3), make_batch()
    ref = run_steps(jax.jit(step), params, batch)
    pstep = jr.parallelize(step, config=config(num_stages=3), batch_argnums=(1,))
    assert_same(*run_steps(pstep, params, batch), *ref)


def test_markers_work_under_plain_jax():
    f = lambda x: jnp.sum(jnp.sin(jr.stage_boundary({"a": x, "b": 2 * x})["a"]) ** 2)
    g = lambda x: jnp.sum(jnp.sin(x) ** 2)
    x = jnp.linspace(0, 1, 5)
    np.testing.assert_allclose(jax.jit(f)(x), g(x), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(f)(x), jax.grad(g)(x), rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(jax.grad(f))(x[:, None]), jax.vmap(jax.grad(g))(x[:, None]))
    grad_jaxpr = jax.make_jaxpr(jax.grad(f))(x)
    names = [e.primitive.name for e in grad_jaxpr.jaxpr.eqns]
    assert names.count("stage_boundary") == 2  # forward, and the transposed backward boundary
    assert jr.grad(g)(x).shape == (5,)
    value, grad = jr.value_and_grad(lambda a, b: jnp.sum(a * b), argnums=(0, 1))(x, x)
    np.testing.assert_allclose(value, jnp.sum(x * x), rtol=1e-6)
    np.testing.assert_allclose(grad[0], x)


def error(fn, match, exc=ValueError):
    with pytest.raises(exc, match=match):
        fn()


def test_bad_input_is_explained():
    batch = make_batch()
    params = make_params(2)
    no_marker = make_step(1)
    error(
        lambda: jr.parallelize(no_marker, config=config(), batch_argnums=(1,))(
            make_params(1), batch
        ),
        "has no jr.stage_boundary.*num_stages=1",
        PipelineSplitError,
    )
    error(
        lambda: jr.parallelize(
            make_step(2), config=config(num_micro_batches=3), batch_argnums=(1,)
        )(params, batch),
        r"has 8 rows along dim 0, which num_micro_batches=3 does not divide",
    )
    error(
        lambda: jr.parallelize(
            make_step(4),
            config=config(stage_mesh_shape=(8,), mesh_axis_names=("data",)),
            batch_argnums=(1,),
        )(make_params(4), batch),
        r"4 stages on meshes .*32 devices, but this process has 24 cpu device",
    )
    bad_batch = {"x": batch["x"], "y": batch["y"], "n": "ten"}
    error(
        lambda: jr.parallelize(make_step(2), config=config(), batch_argnums=(1,))(
            params, bad_batch
        ),
        r"batch leaf args\[1\]\['n'\] is str \('ten'\); every leaf of the batch arguments "
        "must be an array",
        TypeError,
    )

    def scanned(params, batch):
        def loss_fn(p):
            def body(h, _):
                return jr.stage_boundary(jnp.tanh(h @ p["w1"])), None

            h, _ = jax.lax.scan(body, batch["x"] @ p["emb"], None, length=2)
            return jnp.mean(h)

        return jr.value_and_grad(loss_fn)(params)

    error(
        lambda: jr.parallelize(scanned, config=config(), batch_argnums=(1,))(params, batch),
        "inside `scan`.*top level of the loss.*its own lax.scan",
        PipelineSplitError,
    )

    def conditional(params, batch):
        def loss_fn(p):
            h = jax.lax.cond(
                True, lambda h: jr.stage_boundary(h), lambda h: h, batch["x"] @ p["emb"]
            )
            return jnp.mean(h @ p["w1"])

        return jr.value_and_grad(loss_fn)(params)

    error(
        lambda: jr.parallelize(conditional, config=config(), batch_argnums=(1,))(params, batch),
        "inside `cond`",
        PipelineSplitError,
    )

    def dead_stage(params, batch):
        def loss_fn(p):
            h0 = jnp.tanh(batch["x"] @ p["emb"])
            h = jr.stage_boundary(h0)
            jr.stage_boundary(h @ p["w1"])  # stage 1's work never reaches the loss
            return jnp.mean(h0 @ p["out"])

        return jr.value_and_grad(loss_fn)(params)

    error(
        lambda: jr.parallelize(dead_stage, config=config(), batch_argnums=(1,))(params, batch),
        "stage 1 has no outputs that later stages use",
        PipelineSplitError,
    )

    def plain_grad(params, batch):
        return jax.value_and_grad(lambda p: jnp.mean(batch["x"] @ p["emb"]))(params)

    error(
        lambda: jr.parallelize(plain_grad, config=config(), batch_argnums=(1,))(params, batch),
        "no gradient with jr.value_and_grad",
        PipelineSplitError,
    )

    mesh_a = jax.sharding.Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
    mesh_b = jax.sharding.Mesh(np.array(jax.devices()[1:3]).reshape(1, 2), ("data", "model"))
    error(
        lambda: jr.parallelize(
            make_step(2), config=config(), batch_argnums=(1,), meshes=[mesh_a, mesh_b]
        )(params, batch),
        "stage meshes 0 and 1 share device cpu:1",
    )


def test_config_validation_and_toml(tmp_path):
    error(
        lambda: jr.PipelineConfig(schedule="pipedream"),
        "schedule='pipedream'.*choose one of gpipe, 1f1b, eager_1f1b, zb_h1",
    )
    error(lambda: jr.PipelineConfig(resharding="fast"), "resharding='fast'.*send_recv")
    error(lambda: jr.PipelineConfig(num_micro_batches=0), "num_micro_batches=0.*int from 1 to")
    error(
        lambda: jr.PipelineConfig(stage_mesh_shape=(2, 2), mesh_axis_names=("x",)),
        "has 2 axes but mesh_axis_names",
    )
    error(lambda: jr.PipelineConfig().replace(micro_batches=4), "unknown keys.*micro_batches")
    path = tmp_path / "pipe.toml"
    path.write_text(
        textwrap.dedent("""
        [pipeline]
        num_micro_batches = 4
        schedule = "eager_1f1b"
        weight_delay = true
        stage_mesh_shape = [1, 2]
        mesh_axis_names = ["data", "model"]
    """)
    )
    cfg = jr.PipelineConfig.from_toml(path, resharding="broadcast_greedy")
    assert (
        cfg.stage_mesh_shape == (1, 2) and cfg.weight_delay and cfg.resharding == "broadcast_greedy"
    )
    path.write_text("[pipeline]\nnum_microbatches = 4\n")
    error(lambda: jr.PipelineConfig.from_toml(path), r"unknown keys \['num_microbatches'\]")


@pytest.mark.ray
@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_same_numbers_on_the_ray_runtime(ray_runtime, axis_types):
    cfg = config(
        num_micro_batches=4,
        schedule="eager_1f1b",
        weight_delay=True,
        backend="ray",
        mesh_axis_types=axis_types,
    )
    step = jr.parallelize(make_step(3, skip=True, shared=True), config=cfg, batch_argnums=(1,))
    params, losses = run_steps(step, make_params(3), make_batch())
    assert isinstance(params["w1"], jr.RemoteArray)
    assert_same(params, losses, *reference(3, True, True))


def test_a_spec_that_does_not_fit_the_next_stage_warns_and_replicates():
    from jax.sharding import PartitionSpec as P

    def step(params, batch):
        def loss_fn(p):
            h = jnp.tanh(batch["x"] @ p["emb"])
            h = jax.lax.with_sharding_constraint(h, P(None, "model"))
            h = jr.stage_boundary(h)
            return jnp.mean((h @ p["out"] - batch["y"]) ** 2)

        loss, grads = jr.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda w, g: w - 0.05 * g, params, grads), loss

    cfg = config(num_micro_batches=2, stage_mesh_shape=[(1, 2), (1, 3)])
    pstep = jr.parallelize(step, config=cfg, batch_argnums=(1,))
    with pytest.warns(
        UserWarning,
        match=r"boundary tensor act0 \(float32\[4,8\]\) entering stage 1: P\(None, "
        r"'model'\) does not fit mesh \{'data': 1, 'model': 3\} \(dim 1 \(size 8\) is not a "
        r"multiple of 3\); it is replicated",
    ):
        got = run_steps(pstep, make_params(1), make_batch())
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
    with jax.set_mesh(mesh):
        assert_same(*got, *run_steps(jax.jit(step), make_params(1), make_batch()))


VIRTUAL = [
    ("interleaved_1f1b", 2, False, 4),
    ("interleaved_1f1b", 2, True, 4),
    ("eager_interleaved_1f1b", 2, True, 4),
    ("zbv", 2, False, 4),
    ("dualpipev", 2, False, 4),
    ("interleaved_1f1b", 3, False, 2),
]


@pytest.mark.parametrize("schedule, v, weight_delay, m", VIRTUAL)
def test_virtual_stages_match_jax_jit(schedule, v, weight_delay, m):
    """A model cut into 2v stages on 2 meshes (chunk c on the mesh its schedule places it on):
    tied first/last layer (the same mesh in a V), a skip across chunks."""
    cfg = config(
        num_micro_batches=m, schedule=schedule, virtual_stages=v, weight_delay=weight_delay
    )
    num_stages = 2 * v
    step = jr.parallelize(
        make_step(num_stages, skip=True, shared=True), config=cfg, batch_argnums=(1,)
    )
    params, losses = run_steps(step, make_params(num_stages), make_batch())
    assert_same(params, losses, *reference(num_stages, True, True))
    plan = step.plan(params, make_batch())
    assert len({id(mesh) for mesh in plan.meshes}) == 2  # 2v stages on two meshes


def test_virtual_stages_need_a_multiple_of_their_count():
    cfg = config(schedule="interleaved_1f1b", virtual_stages=2)
    step = jr.parallelize(make_step(3), config=cfg, batch_argnums=(1,))
    with pytest.raises(ValueError, match=r"puts 2 on each mesh .* multiple of 2"):
        step(make_params(3), make_batch())
    with pytest.raises(ValueError, match=r"zbv places exactly two chunks per rank"):
        config(schedule="zbv", virtual_stages=3)


@pytest.mark.ray
@pytest.mark.parametrize("schedule, weight_delay", [("zbv", False), ("interleaved_1f1b", True)])
def test_virtual_stages_on_the_ray_runtime(ray_runtime, schedule, weight_delay):
    cfg = config(
        num_micro_batches=4,
        schedule=schedule,
        virtual_stages=2,
        weight_delay=weight_delay,
        backend="ray",
    )
    step = jr.parallelize(make_step(4, skip=True, shared=True), config=cfg, batch_argnums=(1,))
    params, losses = run_steps(step, make_params(4), make_batch())
    assert_same(params, losses, *reference(4, True, True))


def test_a_gradient_read_after_the_pipeline_and_again_later_equals_jax_jit():
    """Post-gradient code that reads a gradient with the loss (which exists only after the
    pipeline: it runs after the step) and reads the same gradient again later: the later read
    must not run first and overwrite the gradient where it dies."""

    def step(params, batch):
        loss, g = jr.value_and_grad(mlp_loss)(params, batch)
        # On stage 1 (a tie of bytes goes to the later stage), with the loss: after the step.
        mix = g["w1"][:6, :] * g["emb"] * loss
        new = dict(params)
        new["w1"] = params["w1"] - 0.05 * g["w1"] - 0.01 * mix.sum()
        new["emb"] = params["emb"] - 0.05 * g["emb"]  # stage 0: the last read of g["emb"]
        new["b1"] = params["b1"] - 0.05 * g["b1"]
        new["out"] = params["out"] - 0.05 * g["out"]
        return new, loss

    pstep = jr.parallelize(step, config=config(num_micro_batches=2), batch_argnums=(1,))
    got = run_steps(pstep, make_params(2), make_batch())
    assert_same(*got, *run_steps(jax.jit(step), make_params(2), make_batch()))


def labels_first_step(params, batch):
    """A step that computes from the batch (and reads a parameter) before the loss closure: the
    `pre` part, whose inputs are `jax.Array`s from the second step on (the returned parameters
    come back)."""
    labels = jax.nn.one_hot(batch["label"], FEATURES) + batch["y"] * 2
    scale = 1 + jnp.mean(params["b1"]) ** 2  # a stage-1 parameter, read outside the loss

    def loss_fn(p):
        return mlp_loss(p, {"x": batch["x"], "y": labels * scale})

    loss, grads = jr.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda w, g: w - 0.05 * g, params, grads), loss


@pytest.mark.parametrize(
    "mesh_shape, schedule, weight_delay, on_device",
    [((1, 1), "1f1b", False, False), ((1, 2), "eager_1f1b", True, True)],
)
def test_code_before_the_loss_on_jax_arrays_matches_jax_jit(
    mesh_shape, schedule, weight_delay, on_device
):
    """Issue 25: the `pre` part's inputs as `jax.Array`s on several device sets (a parameter
    returned by the last step on stage 1's mesh, a batch on device 0) were an `unhashable type:
    'set'` TypeError from the second step on."""
    batch = make_batch()
    batch["label"] = np.arange(ROWS, dtype=np.int32) % FEATURES
    if on_device:
        batch = jax.tree.map(jnp.asarray, batch)
    cfg = config(
        num_micro_batches=4,
        stage_mesh_shape=mesh_shape,
        schedule=schedule,
        weight_delay=weight_delay,
    )
    pstep = jr.parallelize(labels_first_step, config=cfg, batch_argnums=(1,))
    got = run_steps(pstep, make_params(2), batch, steps=4)
    assert_same(*got, *run_steps(jax.jit(labels_first_step), make_params(2), batch, steps=4))


def test_a_missing_batch_argnums_warns_naming_the_batch():
    """Issue 25: with num_micro_batches > 1 and no batch_argnums, every micro-batch computed the
    whole batch silently (jax.jit's result at 4 times the work; a plan of '0 rows')."""
    import optax

    optimizer = optax.adam(1e-2)
    params, batch = make_params(2), make_batch()
    step = jr.parallelize(adam_step(mlp_loss, optimizer), config=config(num_micro_batches=4))
    with pytest.warns(
        jr.BatchArgnumsWarning,
        match=r"num_micro_batches=4 but no batch_argnums.* each of the 4 micro-batches computes "
        r"the step on the whole input .*Argument 2 \(`batch`\) looks like the batch \(every leaf "
        r"has 8 rows along dim 0.*pass batch_argnums=\(2,\) to split it, or use "
        r"num_micro_batches=1",
    ):
        plan = step.plan(params, optimizer.init(params), batch)
    with pytest.warns(jr.BatchArgnumsWarning) as caught:  # (a new signature warns again)
        step(params, optimizer.init(params), {k: v[:4] for k, v in batch.items()})
    assert [w.filename for w in caught] == [__file__]  # the user's call, not jaxreshard's
    first = str(plan).splitlines()[0]
    assert first == (
        "pipeline: 2 stages, 4 micro-batches, no batch argument (batch_argnums=()): each "
        "micro-batch computes the whole step, schedule 1f1b"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", jr.BatchArgnumsWarning)
        jr.parallelize(make_step(2), config=config(num_micro_batches=4), batch_argnums=(1,)).plan(
            params, batch
        )
        jr.parallelize(make_step(2), config=config(num_micro_batches=1)).plan(params, batch)


def test_the_batch_argument_guess():
    from jaxreshard._arguments import likely_batch_argnum

    w, rows = np.zeros((8, 8), np.float32), np.zeros((8, 3), np.float32)
    params = make_params(2)  # dims 0 of 6 and 8: not one batch
    assert likely_batch_argnum((params, {"x": rows, "y": rows[:, 0]}), 4) == 1
    assert likely_batch_argnum((params, {"x": rows}, {"n": np.float32(1)}), 4) == 1
    assert likely_batch_argnum((w, rows), 4) is None  # both 8 rows: no way to tell
    assert likely_batch_argnum((params, rows[:6]), 4) is None  # 4 does not divide 6

    def step(w, x):  # a weight and a batch of 8 rows each
        def loss_fn(w):
            return jnp.mean(jr.stage_boundary(jnp.tanh(x @ w.T)) ** 2)

        return jr.value_and_grad(loss_fn)(w)

    pstep = jr.parallelize(step, config=config(num_micro_batches=2))
    with pytest.warns(jr.BatchArgnumsWarning, match=r"Pass batch_argnums=\(i,\) naming"):
        pstep.plan(np.ones((8, FEATURES), np.float32), np.ones((8, FEATURES), np.float32))


@pytest.mark.parametrize(
    "overrides, first",
    [
        ({}, "pipeline: 2 stages, 4 micro-batches of 2 rows, schedule 1f1b"),
        (
            dict(schedule="eager_1f1b", weight_delay=True),
            "pipeline: 2 stages, 4 micro-batches of 2 rows, schedule eager_1f1b + weight delay",
        ),
        (
            dict(schedule="interleaved_1f1b", virtual_stages=2),
            "pipeline: 4 stages on 2 ranks, 4 micro-batches of 2 rows, schedule interleaved_1f1b",
        ),
    ],
)
def test_the_plans_first_line_says_each_thing_once(overrides, first):
    """Issue 25: it repeated '2 stages, 4 micro-batches' (its own words, then the schedule's)."""
    num_stages = 2 * overrides.get("virtual_stages", 1)
    cfg = config(num_micro_batches=4, **overrides)
    step = jr.parallelize(make_step(num_stages), config=cfg, batch_argnums=(1,))
    assert str(step.plan(make_params(num_stages), make_batch())).splitlines()[0] == first


def test_a_jax_grad_in_the_step_is_named_at_the_users_line():
    """Issue 25: the error for jax.grad through a boundary pointed into frontend/_markers.py."""

    def step(params, batch):
        loss_fn = functools.partial(mlp_loss, batch=batch)
        grads = jax.grad(loss_fn)(params)
        return jax.tree.map(lambda w, g: w - 0.05 * g, params, grads)

    pstep = jr.parallelize(step, config=config(), batch_argnums=(1,))
    with pytest.raises(PipelineSplitError) as info:
        pstep(make_params(2), make_batch())
    message, here = str(info.value), re.escape(__file__)
    call = step.__code__.co_firstlineno + 2  # the `jax.grad(loss_fn)(params)` line
    boundary = mlp_loss.__code__.co_firstlineno + 3  # `h = jr.stage_boundary(h)`
    assert re.match(
        rf"{here}:{call} \(.*step\): the step differentiates with jax.grad through "
        rf"jr.stage_boundary \(at {here}:{boundary} \(mlp_loss\)\), a gradient transform that "
        r"parallelize cannot pipeline .*replace jax.value_and_grad / jax.grad with "
        "jr.value_and_grad / jr.grad",
        message,
    ), message
    assert "_markers.py" not in message


def test_a_misused_jr_value_and_grad_is_named_at_the_users_line():
    def step(params, batch):
        return jr.value_and_grad(mlp_loss, has_aux=True)(params, batch)  # returns no pair

    pstep = jr.parallelize(step, config=config(), batch_argnums=(1,))
    line = step.__code__.co_firstlineno + 1
    with pytest.raises(
        TypeError, match=rf"^{re.escape(__file__)}:{line} \(.*step\): .*must return a pair"
    ):
        pstep(make_params(2), make_batch())
