"""Nothing silent: every fallback is an error, or a warning that names the value and the fix."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxreshard as jr
from jaxreshard.runtime.step._specs import ReplicatedSpecWarning, batch_spec, transplant_spec

# -- specs that do not fit their mesh ------------------------------------------------------------


def test_a_spec_that_does_not_fit_its_mesh_warns_naming_shape_spec_axes_and_fix():
    mesh = {"data": 2, "model": 3}
    with pytest.warns(
        ReplicatedSpecWarning,
        match=r"an array of shape \(4, 8\): P\(None, 'model'\) does not fit mesh \{'data': 2, "
        r"'model': 3\} \(dim 1 \(size 8\) is not a multiple of 3\); it is replicated on that "
        r"mesh instead\. To shard it, give the stages mesh shapes whose axes \('data', "
        r"'model'\) divide its dims",
    ):
        assert transplant_spec(P(None, "model"), mesh, (4, 8)) == P()
    with pytest.warns(ReplicatedSpecWarning, match=r"the mesh has no axis 'tensor'"):
        assert transplant_spec(P("tensor"), mesh, (4, 8), what="params['w']") == P()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # What fits stays; what shards nothing replicates without a word.
        assert transplant_spec(P("data", "model"), mesh, (4, 9)) == P("data", "model")
        assert transplant_spec(None, mesh, (4, 8)) == P()
        assert transplant_spec(P(None, None), mesh, (3,)) == P()  # too many dims, none sharded


def test_a_micro_batch_the_batch_axis_does_not_divide_warns():
    with pytest.warns(
        ReplicatedSpecWarning,
        match=r"a micro-batch of shape \(3, 6\): its batch dim 0 \(size 3\) is not a multiple "
        r"of mesh axis 'data' \(size 2\) of mesh \{'data': 2\}; it is replicated instead of "
        r"sharded over 'data'.*make the micro-batch \(batch size / num_micro_batches\) a "
        r"multiple of 2, or pass PipelineConfig\(batch_axis=None\)",
    ):
        assert batch_spec({"data": 2}, (3, 6), "data") == P()
    with pytest.warns(ReplicatedSpecWarning, match=r"mesh \{'model': 2\} has no axis 'data'"):
        assert batch_spec({"model": 2}, (4, 6), "data") == P()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert batch_spec({"data": 2}, (4, 6), "data") == P("data")
        assert batch_spec({"data": 2}, (3, 4, 6), "data", dim=1) == P(None, "data")
        assert batch_spec({"data": 2}, (3, 6), None) == P()  # asked for no sharding
        assert batch_spec({"data": 2}, (), "data") == P()  # no batch dim to shard


def test_parallelize_warns_when_the_data_axis_cannot_shard_the_micro_batch(cpu_devices):
    def step(w, batch):
        def loss_fn(w):
            h = jr.stage_boundary(jnp.tanh(batch @ w))
            return jnp.mean(h**2)

        loss, g = jr.value_and_grad(loss_fn)(w)
        return w - 0.1 * g, loss

    # Micro-batches of 3 rows on stage meshes with a data axis of 2.
    config = jr.PipelineConfig(num_micro_batches=2, stage_mesh_shape=(2,), backend="local")
    pstep = jr.parallelize(step, config=config, batch_argnums=(1,))
    w = np.ones((4, 4), np.float32) * 0.1
    batch = np.arange(24, dtype=np.float32).reshape(6, 4) / 24
    with pytest.warns(ReplicatedSpecWarning, match=r"not a multiple of mesh axis 'data' \(size 2"):
        new_w, loss = pstep(w, batch)
    want_w, want_loss = jax.jit(step)(w, batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(new_w), np.asarray(want_w), rtol=1e-5, atol=1e-6)


# -- the step's trip to the Ray hosts ------------------------------------------------------------


def _module(name, code, monkeypatch):
    import sys
    import textwrap
    import types

    module = types.ModuleType(name)
    exec(textwrap.dedent(code), module.__dict__)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_a_step_in_a_module_named_like_jax_still_travels_by_value(monkeypatch):
    import pickle
    import sys

    from jaxreshard.runtime.ray._pipeline import _by_value

    # Only jaxreshard, jax, jaxlib and numpy themselves are left to the hosts' own imports
    # (a name that merely starts with "jax" was, and then the hosts could not load the step).
    module = _module("jaxish_user_steps", "def step(x):\n    return x + 1\n", monkeypatch)
    payload = _by_value(module.step, {})
    monkeypatch.delitem(sys.modules, "jaxish_user_steps")  # a host that cannot import it
    step, static, tree = pickle.loads(payload)
    assert tree is None  # (no arguments' structure given)
    assert step(1) == 2 and static == {}


def test_a_module_that_cannot_travel_by_value_warns(monkeypatch):
    from ray import cloudpickle

    from jaxreshard.runtime.ray._pipeline import _by_value

    module = _module("user_steps_unregistrable", "def step(x):\n    return x\n", monkeypatch)

    register = cloudpickle.register_pickle_by_value

    def refuse(module):  # (this module only: model files other tests loaded still register)
        if module.__name__ != "user_steps_unregistrable":
            return register(module)
        raise ValueError(f"{module} was not imported correctly")

    monkeypatch.setattr(cloudpickle, "register_pickle_by_value", refuse)
    with pytest.warns(
        UserWarning,
        match=r"the step's module 'user_steps_unregistrable' cannot travel to the Ray hosts by "
        r"value \(ValueError: .*\); it is pickled by reference, so every host must be able to "
        r"import 'user_steps_unregistrable'",
    ):
        _by_value(module.step, {})


def test_a_host_that_cannot_load_the_step_says_which_module_it_misses(monkeypatch):
    import pickle
    import sys

    from jaxreshard.runtime.ray._actor import load_step

    code = "def double(x):\n    return 2 * x\n"
    helpers = _module("user_helpers_not_on_hosts", code, monkeypatch)
    payload = pickle.dumps((helpers.double, {}))  # by reference, as imported modules travel
    monkeypatch.delitem(sys.modules, "user_helpers_not_on_hosts")
    with pytest.raises(
        RuntimeError,
        match=r"host 3 \(.*\) cannot load the step it was sent: ModuleNotFoundError: .*"
        r"make module 'user_helpers_not_on_hosts' importable on every host",
    ):
        load_step(3, payload)


# -- the Ray runtime's devices -------------------------------------------------------------------


def _must_not_start(*args, **kwargs):
    raise AssertionError("ray.init called: the arguments should have been refused first")


def test_a_local_ray_runtime_with_too_few_gpus_is_an_error_not_cpu_devices(monkeypatch):
    import ray

    from jaxreshard.runtime.ray import _runtime as _ray
    from jaxreshard.runtime.ray._runtime import RayRuntime
    from jaxreshard.runtime.ray._start import local_platform

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(
        ValueError,
        match=r"init\(backend='ray', num_hosts=2, devices_per_host=2\) asks for 4 GPUs "
        r"\(num_hosts x devices_per_host\), but this machine has 1; ask for at most 1, or pass "
        r"platform='cpu' for fake CPU devices",
    ):
        local_platform("auto", 2, 2, "single", gpus=1)
    with pytest.raises(ValueError, match=r"nodes='per_host' .* emulates hosts with fake CPU "):
        local_platform("auto", 2, 2, "per_host", gpus=8)
    with pytest.raises(ValueError, match=r"platform='gpu'\) asks for 2 GPUs .* has 0"):
        local_platform("gpu", 2, None, "single", gpus=0)
    assert local_platform("auto", 2, 2, "single", gpus=4) == "gpu"
    # CPU devices where they were asked for, or where the machine has no GPUs.
    assert local_platform("cpu", 2, 2, "per_host", gpus=1) == "cpu"
    assert local_platform("auto", 2, 2, "per_host", gpus=0) == "cpu"
    monkeypatch.setenv("JAX_PLATFORMS", "cpu,cuda")  # this process asked JAX for CPU first
    assert local_platform("auto", 2, 2, "single", gpus=1) == "cpu"
    monkeypatch.delenv("JAX_PLATFORMS")
    # The runtime refuses before Ray starts.
    monkeypatch.setattr(_ray, "_machine_gpus", lambda: 1)
    monkeypatch.setattr(ray, "init", _must_not_start)
    with pytest.raises(ValueError, match=r"asks for 4 GPUs .* but this machine has 1"):
        RayRuntime(num_hosts=2, devices_per_host=2, nodes="single")
    with pytest.raises(ValueError, match=r"init\(platform='tpu'\): choose 'auto', 'cpu', 'gpu'"):
        RayRuntime(num_hosts=2, platform="tpu")


def test_gpus_the_machine_shows_are_counted_as_cuda_visible_devices_says(monkeypatch):
    from jaxreshard.runtime.ray._start import _machine_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    assert _machine_gpus() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert _machine_gpus() == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert _machine_gpus() == 0


def test_devices_a_host_actor_reports_must_be_the_planned_ones():
    from jaxreshard.runtime.ray._start import check_reported_devices

    planned = [(0, 1), (2, 3)]
    infos = [
        {"hostname": "a", "devices": {0: "cuda:0", 1: "cuda:1"}},
        {"hostname": "b", "devices": {2: "cuda:0", 3: "cuda:1"}},
    ]
    check_reported_devices(planned, infos, "gpu")  # as planned: fine
    # Host 0's JAX sees 3 GPUs where Ray gave it 2: its ids run into host 1's.
    infos[0]["devices"] = {0: "cuda:0", 1: "cuda:1", 2: "cuda:2"}
    with pytest.raises(
        RuntimeError,
        match=r"host actors see other gpu devices than the runtime planned for them \(host 0 "
        r"\(a\): planned \[0, 1\], reports \[0, 1, 2\]\)\. Each actor's JAX must see exactly "
        r"the devices Ray gave it",
    ):
        check_reported_devices(planned, infos, "gpu")


def test_step_progress_counts_actions_once_their_outputs_are_ready():
    from jaxreshard.runtime.ray._host_pipeline import StepProgress

    progress = StepProgress()
    progress.begin("s:0")
    assert progress.report("s:0")[0] == 0
    outputs = (jnp.ones(3) * 2, [jax.random.key(0)], None)  # a typed key cannot say it is ready
    progress.dispatched("stage 0's forward", outputs)
    jax.block_until_ready(outputs[0])
    count, last, idle = progress.report("s:0")
    assert (count, last) == (1, "stage 0's forward") and idle >= 0
    progress.finished("receiving activation 0")
    assert progress.report("s:0")[:2] == (2, "receiving activation 0")
    assert progress.report("s:1") == (0, "nothing", 0.0)  # another step: nothing of it yet


def test_an_output_with_a_gspmd_sharding_becomes_named_on_its_mesh(cpu_devices):
    """XLA gives some outputs of big programs a GSPMD sharding (tiles in a transposed device
    order: seen on the U-Transformer's optimizer segments); read as a spec it was P(), so a Ray
    host described a sharded parameter as replicated and the next step could not put it
    together. The engine hands such outputs back as NamedShardings of their stage mesh (the
    same buffers), and a stage's output specs are read the same way."""
    from jax._src.sharding_impls import GSPMDSharding
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxreshard._jax_compat import named_sharding_on
    from jaxreshard.runtime.engine._placing import as_named

    mesh = Mesh(np.array(cpu_devices[:4]).reshape(2, 2), ("data", "model"))
    named = NamedSharding(mesh, P("model", None))
    gspmd = GSPMDSharding(tuple(mesh.devices.flat), named._to_xla_hlo_sharding(2))
    x = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), gspmd)
    assert not isinstance(x.sharding, NamedSharding)
    y = as_named(x, mesh)
    assert isinstance(y.sharding, NamedSharding) and y.sharding.is_equivalent_to(named, 2)
    assert {s.data.unsafe_buffer_pointer() for s in y.addressable_shards} == {
        s.data.unsafe_buffer_pointer() for s in x.addressable_shards
    }
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    other = Mesh(np.array(cpu_devices[4:8]).reshape(2, 2), ("data", "model"))
    assert named_sharding_on(gspmd, other, 2) is None  # not over that mesh's devices


def test_a_single_device_output_is_named_on_its_one_device_mesh(cpu_devices):
    import warnings

    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxreshard.runtime.engine._placing import as_named

    mesh = Mesh(np.array(cpu_devices[:1]).reshape(1, 1), ("data", "model"))
    x = jax.device_put(np.ones((8, 8), np.float32), cpu_devices[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = as_named(x, mesh)
    assert y.sharding == NamedSharding(mesh, P())
