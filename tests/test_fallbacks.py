"""Nothing silent: every fallback is an error, or a warning that names the value and the fix."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxreshard as jr
from jaxreshard.runtime._specs import ReplicatedSpecWarning, batch_spec, transplant_spec

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
