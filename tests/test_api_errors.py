"""Bad arguments to the API: refused where they enter, with a message naming the argument, the
value, the rule and the fix; the traceback shows the user's code, not ours."""

import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxreshard as jr
from jaxreshard._tracebacks import TRACEBACK_ENV


def step(params, batch):
    def loss_fn(p):
        h = jnp.tanh(batch["x"] @ p["a"])
        h = jr.stage_boundary(h)
        return jnp.mean((h @ p["b"] - batch["y"]) ** 2)

    loss, grads = jr.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


PARAMS = {k: np.full((8, 8), 0.1, np.float32) for k in "ab"}
BATCH = {"x": np.ones((16, 8), np.float32), "y": np.ones((16, 8), np.float32)}
CONFIG = jr.PipelineConfig(num_micro_batches=4)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        (dict(config=0), TypeError, ["config=0", "PipelineConfig"]),
        (dict(config={}), TypeError, ["config={}", "PipelineConfig"]),
        (dict(batch_argnums="1"), TypeError, ["batch_argnums='1'", "batch_argnums=(2,)"]),
        (dict(batch_argnums=2.0), TypeError, ["batch_argnums=2.0"]),
        (dict(batch_argnums=True), TypeError, ["batch_argnums=True"]),
        (dict(batch_argnums=[[1]]), TypeError, ["[1] is not an argument position"]),
        (dict(batch_argnums=(1, 1)), ValueError, ["repeats"]),
        (dict(meshes="ab"), TypeError, ["meshes='ab'", "Mesh"]),
        (dict(meshes=[]), ValueError, ["meshes=[]"]),
        (dict(meshes=[1, 2]), TypeError, ["meshes[0] is int", "jax.make_mesh"]),
    ],
)
def test_parallelize_refuses_bad_arguments_at_once(kwargs, error, words):
    kwargs = {"config": CONFIG, "batch_argnums": (1,), **kwargs}
    with pytest.raises(error) as info:
        jr.parallelize(step, **kwargs)
    for word in words:
        assert word in str(info.value)


def test_batch_argnums_none_is_no_batch():
    assert jr.parallelize(step, batch_argnums=None).batch_argnums == ()


@pytest.mark.parametrize(
    ("batch", "error", "words"),
    [
        (
            {"x": np.ones((0, 8), np.float32), "y": np.ones((0, 8), np.float32)},
            ValueError,
            ["args[1]['x'] has 0 rows"],
        ),
        (
            {"x": np.array([[object()] * 8] * 16), "y": BATCH["y"]},
            TypeError,
            ["args[1]['x']", "dtype object"],
        ),
    ],
)
def test_bad_batches_are_named(batch, error, words):
    with pytest.raises(error) as info:
        jr.parallelize(step, config=CONFIG, batch_argnums=(1,))(PARAMS, batch)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(address=5), ["address=5", "HOST:PORT"]),
        (dict(address="../x"), ["address='../x'"]),
        (dict(num_hosts=2, gpu_memory_fraction=5.0), ["gpu_memory_fraction=5.0"]),
        (dict(num_hosts=2, emulate_network_gbps=float("nan")), ["emulate_network_gbps=nan"]),
        (dict(num_hosts=2, object_store_memory=-1), ["object_store_memory=-1"]),
        (dict(num_hosts=2, bogus_option=1), ["bogus_option", "valid: address"]),
        (dict(num_hosts=2, cluster_links={"x": float("inf")}), ["cluster_links"]),
        (dict(num_hosts=10**6), ["num_hosts=1000000"]),
        (dict(num_hosts=2, timeout_s=float("inf")), ["timeout_s=inf", "finite"]),
    ],
)
def test_init_refuses_bad_arguments_before_ray_starts(kwargs, words, no_runtime):
    import ray

    with pytest.raises((ValueError, TypeError)) as info:
        jr.init("ray", **kwargs)
    for word in words:
        assert word in str(info.value)
    assert not ray.is_initialized()


def _frames(error):
    return [f.filename for f in traceback.extract_tb(error.__traceback__)]


def test_an_api_error_shows_the_users_frames_not_ours(monkeypatch):
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    with pytest.raises(TypeError) as info:
        jr.parallelize(step, batch_argnums="1")
    frames = _frames(info.value)
    ours = [f for f in frames if "/jaxreshard/" in f]
    assert frames[0] == __file__
    assert all(f.endswith("_tracebacks.py") for f in ours), frames
    assert any(TRACEBACK_ENV in note for note in info.value.__notes__)


def test_an_error_inside_the_users_loss_keeps_the_loss_frame(monkeypatch):
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)

    def broken(params, batch):
        def loss_fn(p):
            h = jr.stage_boundary(batch["x"] @ p["a"])
            return jnp.mean(h @ p["b"][:3])  # a shape error in the user's code

        return jr.value_and_grad(loss_fn)(params)

    with pytest.raises(TypeError) as info:
        jr.parallelize(broken, config=CONFIG, batch_argnums=(1,))(PARAMS, BATCH)
    lines = [
        f.line for f in traceback.extract_tb(info.value.__traceback__) if f.filename == __file__
    ]
    assert any('p["b"][:3]' in (line or "") for line in lines), lines


def test_the_environment_variable_keeps_every_frame(monkeypatch):
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(TypeError) as info:
        jr.parallelize(step, batch_argnums="1")
    assert any(f.endswith("_parallelize.py") for f in _frames(info.value))


def _one_stage(loss):
    def step(params, batch):
        return jr.value_and_grad(lambda p: loss(p, batch["x"]))(params)

    return step


@pytest.mark.parametrize(
    ("make_step", "words"),
    [
        (
            lambda: _one_stage(lambda p, x: (jnp.mean(x @ p["a"]), {"m": 1.0})),
            ["returns a tuple", "has_aux=True"],
        ),
        (
            lambda: (
                lambda params, batch: jr.value_and_grad(
                    lambda p: (jnp.mean(batch["x"] @ p["a"]), "hi"), has_aux=True
                )(params)
            ),
            ["aux leaf", "str", "pytree of arrays"],
        ),
    ],
)
def test_a_loss_that_returns_the_wrong_thing_is_named(make_step, words):
    config = jr.PipelineConfig(num_stages=1)
    params, batch = {"a": np.ones((8, 8), np.float32)}, {"x": np.ones((4, 8), np.float32)}
    with pytest.raises(TypeError) as info:
        jr.parallelize(make_step(), config=config, batch_argnums=(1,))(params, batch)
    for word in words:
        assert word in str(info.value)
    assert __file__.split("/")[-1] in str(info.value)  # the user's line


def test_reshard_inside_jit_says_where_it_runs():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[2:4])
    with pytest.raises(TypeError, match=r"outside jax\.jit"):
        jax.jit(lambda a: jr.reshard(a, NamedSharding(mesh, P())))(jnp.ones(4))


def test_numpy_integers_are_ints_and_batch_leaves_of_other_sizes_are_named():
    config = jr.PipelineConfig(devices_per_host=np.int64(2), num_micro_batches=np.int32(2))
    assert type(config.devices_per_host) is int and config.num_micro_batches == 2
    batch = {"x": np.ones((16, 8), np.float32), "y": np.ones((8, 8), np.float32)}
    with pytest.raises(ValueError) as info:
        jr.parallelize(step, config=CONFIG, batch_argnums=(1,))(PARAMS, batch)
    assert "args[1]['x'] has 16" in str(info.value) and "args[1]['y'] has 8" in str(info.value)
