"""Elastic training on Ray: a host dies mid-run, and `train_elastic` goes on on the survivors,
in another layout, from the last checkpoint, with the loss of an uninterrupted run."""

import time

import jax
import numpy as np
import pytest
from test_checkpoint import OPT, REF, batches, config, init_params, make_step

import jaxreshard as jr


@pytest.mark.ray
@pytest.mark.slow
def test_a_dead_host_resumes_on_the_survivors_from_the_last_checkpoint(ray_runtime, tmp_path):
    import ray
    from conftest import RAY_CONFIG

    rng = np.random.default_rng(3)
    data = [
        {k: rng.normal(size=v.shape).astype(np.float32) for k, v in batches(1)[0].items()}
        for _ in range(8)
    ]
    layouts = []

    def layout(num_hosts):
        """4 hosts: 2 stages whose 1x4 meshes span 2 hosts each; 3 hosts: 3 stages of 1x2."""
        layouts.append(num_hosts)
        if num_hosts == 4:
            return jr.parallelize(
                make_step((3,)),
                batch_argnums=2,
                config=config(
                    stage_mesh_shape=(1, 4), schedule="1f1b", num_micro_batches=2, backend="ray"
                ),
            )
        return jr.parallelize(make_step((2, 4)), batch_argnums=2, config=config(
            stage_mesh_shape=(1, 2), schedule="eager_1f1b", weight_delay=True,
            num_micro_batches=4, backend="ray"))  # fmt: skip

    killed = []

    def on_step(step, loss, runtime):
        if step == 5 and not killed:  # once the checkpoint of step 4 is committed
            index = tmp_path / "ckpt" / "step_00000004" / "jaxreshard.json"
            deadline = time.monotonic() + 120
            while not index.exists():
                assert time.monotonic() < deadline, "the step-4 checkpoint was never committed"
                time.sleep(0.05)
            killed.append(step)
            ray.kill(runtime.actors[3], no_restart=True)

    params = init_params()
    jr.shutdown()  # train_elastic starts (and restarts) its own runtime
    try:
        state, history = jr.train_elastic(
            layout,
            lambda: (params, OPT.init(params)),
            lambda step: data[step],
            num_steps=8,
            checkpoint_dir=tmp_path / "ckpt",
            checkpoint_every=2,
            init_options=RAY_CONFIG,
            on_step=on_step,
        )
    finally:
        jr.shutdown()
        jr.init(**RAY_CONFIG)  # the next tests use this one
    assert layouts == [4, 3]
    steps = [s for s, _, _ in history]
    assert steps == [1, 2, 3, 4, 5, 5, 6, 7, 8]  # step 5 done again, on 3 hosts
    assert [h for _, _, h in history][5:] == [3, 3, 3, 3]
    ref_p, ref_s, want = params, OPT.init(params), []
    for b in data:
        ref_p, ref_s, loss = REF(ref_p, ref_s, b)
        want.append(float(loss))
    got = [loss for _, loss, _ in history]
    np.testing.assert_allclose(got, want[:5] + want[4:], rtol=1e-5)
    final = jr.restore_checkpoint(
        tmp_path / "ckpt" / "step_00000008",
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), (ref_p, ref_s)),
    )
    for x, y in zip(jax.tree.leaves(final), jax.tree.leaves((ref_p, ref_s))):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    del state
