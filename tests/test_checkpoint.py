"""Checkpoints restore into any layout: saved from one pipeline layout, restored into another
(stage count, mesh shapes, schedule, virtual stages), into `jax.jit`, or onto Ray hosts, the
training goes on exactly as an uninterrupted `jax.jit` run. A save is complete or absent; bad
directories and wrong targets get errors that name them."""

import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxreshard as jr
from jaxreshard.storage import _orbax

LAYERS, WIDTH, ROWS = 6, 16, 8
OPT = optax.adamw(1e-2, weight_decay=0.01)


def init_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        f"l{i}": {
            "w": (rng.normal(size=(WIDTH, WIDTH)) * 0.3).astype(np.float32),
            "b": np.zeros(WIDTH, np.float32),
        }
        for i in range(LAYERS)
    }


def make_step(cuts=(), pipelined=True):
    """A 6-layer MLP trained by AdamW; `cuts`: the layers a new stage starts at."""

    def step(params, state, batch):
        def loss_fn(p):
            h = batch["x"]
            for i in range(LAYERS):
                if pipelined and i in cuts:
                    h = jr.stage_boundary(h)
                h = jnp.tanh(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
            return jnp.mean((h - batch["y"]) ** 2)

        grad = jr.value_and_grad if pipelined else jax.value_and_grad
        loss, g = grad(loss_fn)(params)
        updates, state = OPT.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step


def batches(n=4):
    rng = np.random.default_rng(1)
    return [
        {
            "x": rng.normal(size=(ROWS, WIDTH)).astype(np.float32),
            "y": rng.normal(size=(ROWS, WIDTH)).astype(np.float32),
        }
        for _ in range(n)
    ]


REF = jax.jit(make_step(pipelined=False))


def reference_losses():
    params = init_params()
    state = OPT.init(params)
    losses = []
    for b in batches():
        params, state, loss = REF(params, state, b)
        losses.append(float(loss))
    return losses


def config(**overrides):
    base = dict(mesh_axis_names=("data", "model"), backend="local")
    return jr.PipelineConfig(**{**base, **overrides})


TWO_STAGES = dict(stage_mesh_shape=(1, 2), schedule="eager_1f1b", weight_delay=True,
                  num_micro_batches=2)  # fmt: skip


def train(step, params, state, data):
    losses = []
    for b in data:
        params, state, loss = step(params, state, b)
        losses.append(float(loss))
    return params, state, losses


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two steps on 2 stages (1x2 meshes, eager-1F1B + weight delay), saved."""
    step = jr.parallelize(make_step((3,)), config=config(**TWO_STAGES), batch_argnums=2)
    params = init_params()
    params, state, losses = train(step, params, OPT.init(params), batches()[:2])
    directory = tmp_path_factory.mktemp("ckpt") / "step2"
    jr.save_checkpoint(directory, (params, state), metadata={"step": 2})
    step.close()
    return directory, losses


def on_shardings(tree, target):
    for x, t in zip(jax.tree.leaves(tree), jax.tree.leaves(target)):
        assert x.sharding == t.sharding, (x.sharding, t.sharding)


LAYOUTS = {
    "3 stages 1x1, 1f1b, 4 micro-batches": (
        (2, 4), dict(stage_mesh_shape=(1, 1), schedule="1f1b", num_micro_batches=4)
    ),
    "2 stages 2x1, zb_h1": ((3,), dict(stage_mesh_shape=(2, 1), schedule="zb_h1",
                                        num_micro_batches=2)),
    "4 chunks on 2 meshes, interleaved": (
        (2, 3, 5), dict(stage_mesh_shape=(1, 2), schedule="interleaved_1f1b",
                        num_micro_batches=2)
    ),
}  # fmt: skip


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_restored_into_another_layout_trains_as_jax_jit(saved, layout):
    directory, losses = saved
    cuts, overrides = LAYOUTS[layout]
    step = jr.parallelize(make_step(cuts), config=config(**overrides), batch_argnums=2)
    params = init_params(seed=5)  # other values: the restore must replace them all
    target = step.placement(params, OPT.init(params), batches()[0])[:2]
    restored = jr.restore_checkpoint(directory, target)
    on_shardings(restored, target)
    _, _, more = train(step, *restored, batches()[2:])
    np.testing.assert_allclose(losses + more, reference_losses(), rtol=1e-5)
    step.close()


def test_restored_into_jax_jit_shardings(saved):
    directory, losses = saved
    mesh = jax.make_mesh(
        (4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4]
    )

    def where(x):
        spec = P("x") if x.ndim and x.shape[0] % 4 == 0 else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    params = init_params()
    target = jax.tree.map(where, (params, OPT.init(params)))
    restored = jr.restore_checkpoint(directory, target)
    on_shardings(restored, target)
    _, _, more = train(REF, *restored, batches()[2:])
    np.testing.assert_allclose(losses + more, reference_losses(), rtol=1e-5)
    # Without shardings, on one device.
    plain = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), target)
    one = jr.restore_checkpoint(directory, plain)
    assert all(x.sharding.device_set == {jax.devices()[0]} for x in jax.tree.leaves(one))


def test_orbax_reads_it_and_metadata_round_trips(saved):
    import orbax.checkpoint as ocp

    directory, _ = saved
    restored = ocp.StandardCheckpointer().restore(directory)
    want = jr.restore_checkpoint(
        directory, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                (init_params(), OPT.init(init_params())))
    )  # fmt: skip
    for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    info = jr.checkpoint_metadata(directory)
    assert info["step"] == 2
    assert info["leaves"][0] == {"path": "[0]['l0']['b']", "shape": [WIDTH], "dtype": "float32"}


def structs(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def test_a_wrong_target_is_named(saved):
    directory, _ = saved
    params = init_params()
    target = structs((params, OPT.init(params)))
    target[0]["l1"]["w"] = jax.ShapeDtypeStruct((WIDTH, 8), jnp.float32)
    with pytest.raises(jr.CheckpointError, match=r"\[0\]\['l1'\]\['w'\] was saved as "
                       r"float32\[16, 16\] but the target wants float32\[16, 8\]"):  # fmt: skip
        jr.restore_checkpoint(directory, target)
    target[0]["l1"]["w"] = jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.bfloat16)
    with pytest.raises(jr.CheckpointError, match=r"saved as float32.*wants bfloat16"):
        jr.restore_checkpoint(directory, target)
    del target[0]["l1"]
    with pytest.raises(jr.CheckpointError, match=r"saved leaves \[0\]\['l1'\]\['b'\]"):
        jr.restore_checkpoint(directory, target)
    target[0]["extra"] = jax.ShapeDtypeStruct((3,), jnp.float32)
    with pytest.raises(jr.CheckpointError, match=r"target leaves \[0\]\['extra'\] are not"):
        jr.restore_checkpoint(directory, target)
    with pytest.raises(TypeError, match=r"leaf .* is a str"):
        jr.restore_checkpoint(directory, {"a": "nope"})


def test_missing_partial_and_corrupt_directories_are_refused(tmp_path, saved):
    _directory, _ = saved
    with pytest.raises(jr.CheckpointError, match="does not exist"):
        jr.restore_checkpoint(tmp_path / "none", {})
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "_METADATA").write_text("{}")
    with pytest.raises(jr.CheckpointError, match="not a complete jaxreshard checkpoint"):
        jr.restore_checkpoint(partial, {})
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "jaxreshard.json").write_text('{"format": "jaxreshard-checkpoint", "version"')
    with pytest.raises(jr.CheckpointError, match="corrupt"):
        jr.checkpoint_metadata(corrupt)
    (corrupt / "jaxreshard.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(jr.CheckpointError, match=r"corrupt.*format"):
        jr.checkpoint_metadata(corrupt)


def test_a_crash_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    """A process killed while it writes (after the arrays are copied, before the commit)
    leaves the old checkpoint complete and restorable, and no new directory."""
    directory = tmp_path / "ckpt"
    jr.save_checkpoint(directory, {"w": np.arange(6.0, dtype=np.float32)})
    script = textwrap.dedent(f"""
        import os
        import numpy as np
        import jaxreshard as jr
        from jaxreshard.storage import _orbax
        real = _orbax.finish_write
        def die(checkpointer):
            real(checkpointer)   # the arrays are on disk, the index and the rename are not
            os._exit(9)
        _orbax.finish_write = die
        jr.save_checkpoint({str(directory)!r}, {{"w": np.zeros(6, np.float32)}}, overwrite=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert done.returncode == 9, done.stderr.decode()[-2000:]
    got = jr.restore_checkpoint(directory, {"w": jax.ShapeDtypeStruct((6,), jnp.float32)})
    np.testing.assert_array_equal(np.asarray(got["w"]), np.arange(6.0))
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "ckpt"]
    assert leftovers and all(".jaxreshard-tmp-" in name for name in leftovers)
    # An error inside this process cleans up after itself.
    with pytest.raises(FileExistsError, match="overwrite=True"):
        jr.save_checkpoint(directory, {"w": np.zeros(6, np.float32)})


def test_overwrite_and_refusals(tmp_path, monkeypatch):
    directory = tmp_path / "ckpt"
    jr.save_checkpoint(directory, {"w": np.ones(3, np.float32)}, metadata={"step": 1})
    jr.save_checkpoint(directory, {"w": np.full(3, 2.0, np.float32)}, metadata={"step": 2},
                       overwrite=True)  # fmt: skip
    assert jr.checkpoint_metadata(directory)["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]

    def fail(checkpointer):
        checkpointer.close()
        raise OSError("disk full")

    monkeypatch.setattr(_orbax, "finish_write", fail)
    with pytest.raises(OSError, match="disk full"):
        jr.save_checkpoint(directory, {"w": np.zeros(3, np.float32)}, overwrite=True)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # the staging dir is gone
    got = jr.restore_checkpoint(directory, {"w": jax.ShapeDtypeStruct((3,), jnp.float32)})
    np.testing.assert_array_equal(np.asarray(got["w"]), 2.0)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "a.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not a jaxreshard checkpoint"):
        jr.save_checkpoint(other, {"w": np.ones(3)}, overwrite=True)
    with pytest.raises(TypeError, match="metadata holds JSON values"):
        jr.save_checkpoint(tmp_path / "m", {"w": np.ones(3)}, metadata={"step": object()})
    with pytest.raises(TypeError, match="not an array or a number"):
        jr.save_checkpoint(tmp_path / "s", {"name": "abc"})
    with pytest.raises(ValueError, match="no leaves"):
        jr.save_checkpoint(tmp_path / "e", {})


def test_an_asynchronous_save_survives_donation(tmp_path):
    """`wait=False` returns once the arrays are copied off the devices: the next step may
    donate them while the files are written."""
    step = jax.jit(lambda x: x * 2.0, donate_argnums=0)
    x = jnp.arange(1024.0)
    pending = jr.save_checkpoint(tmp_path / "a", {"x": x}, wait=False)
    y = step(x)  # donates x's buffer
    assert pending.wait() == tmp_path / "a" and pending.done()
    got = jr.restore_checkpoint(tmp_path / "a", {"x": jax.ShapeDtypeStruct((1024,), x.dtype)})
    np.testing.assert_array_equal(np.asarray(got["x"]), np.arange(1024.0))
    np.testing.assert_array_equal(np.asarray(y), np.arange(1024.0) * 2)
    with pytest.raises(ValueError, match="was deleted"):
        jr.save_checkpoint(tmp_path / "b", {"x": x})


def test_a_script_that_exits_right_after_an_asynchronous_save_leaves_its_checkpoint(tmp_path):
    """The write finishes at interpreter exit (before the thread pools it needs stop)."""
    directory = tmp_path / "last"
    script = (
        "import numpy as np, jaxreshard as jr\n"
        f"jr.save_checkpoint({str(directory)!r}, {{'w': np.arange(4, dtype=np.float32)}}, "
        "wait=False)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    got = jr.restore_checkpoint(directory, {"w": jax.ShapeDtypeStruct((4,), jnp.float32)})
    np.testing.assert_array_equal(np.asarray(got["w"]), np.arange(4.0))


def test_live_relayout_moves_state_between_pipelines(saved):
    """`reshard` of a whole training state into another pipeline's placement (no disk)."""
    directory, losses = saved
    step2 = jr.parallelize(make_step((3,)), config=config(**TWO_STAGES), batch_argnums=2)
    params = init_params()
    state = jr.restore_checkpoint(directory, step2.placement(params, OPT.init(params),
                                                             batches()[0])[:2])  # fmt: skip
    cuts, overrides = LAYOUTS["3 stages 1x1, 1f1b, 4 micro-batches"]
    step3 = jr.parallelize(make_step(cuts), config=config(**overrides), batch_argnums=2)
    target = step3.placement(params, OPT.init(params), batches()[0])[:2]
    moved = jr.reshard(state, target)
    on_shardings(moved, target)
    _, _, more = train(step3, *moved, batches()[2:])
    np.testing.assert_allclose(losses + more, reference_losses(), rtol=1e-5)
    with pytest.raises(ValueError, match="does not match x's"):
        jr.reshard(state, target[0])
    step2.close()
    step3.close()


def test_library_trees_round_trip(tmp_path):
    """A Flax NNX state and an Equinox module's arrays save and restore as they are."""
    nnx = pytest.importorskip("flax.nnx")
    eqx = pytest.importorskip("equinox")
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    jr.save_checkpoint(tmp_path / "nnx", state)
    back = jr.restore_checkpoint(tmp_path / "nnx", jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state))  # fmt: skip
    assert jax.tree.structure(back) == jax.tree.structure(state)
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    mlp = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))
    arrays = eqx.filter(mlp, eqx.is_array)
    jr.save_checkpoint(tmp_path / "eqx", arrays)
    back = jr.restore_checkpoint(tmp_path / "eqx", jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), arrays))  # fmt: skip
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(arrays)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_profile_resumes_in_another_layout_as_an_uninterrupted_run(tmp_path, capsys):
    """`jaxreshard profile --checkpoint DIR --checkpoint-every 1`, then `--resume` with another
    schedule and micro-batch count: the resumed run's loss is the uninterrupted run's."""
    from jaxreshard.cli import main

    base = ["profile", "gpt", "--no-progress", "--compile-cache", "off", "--warmup-steps", "1"]
    root = tmp_path / "run"

    def losses(name, *flags):
        out = tmp_path / f"{name}.json"
        assert main([*base, *flags, "--json", str(out)]) == 0
        data = json.loads(out.read_text())
        return [s["loss"] for s in data["steps"]], data

    whole, _ = losses("whole", "--steps", "4")  # steps 2-5
    first, data = losses("first", "--steps", "2", "--checkpoint", str(root),
                         "--checkpoint-every", "1")  # fmt: skip
    np.testing.assert_allclose(first, whole[:2], rtol=1e-6)
    assert [s["step"] for s in data["checkpoints"]["saved"]] == [1, 2, 3]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000003"]
    resumed, data = losses("resumed", "--steps", "1", "--checkpoint", str(root), "--resume",
                           "--schedule", "1f1b", "--num-micro-batches", "2")  # fmt: skip
    assert data["checkpoints"]["resumed_from_step"] == 3
    np.testing.assert_allclose(resumed, whole[3:], rtol=1e-5)  # step 5 (step 4: warm-up)
    capsys.readouterr()
    assert main([*base, "--resume"]) == 2
    assert "--resume needs --checkpoint DIR" in capsys.readouterr().err
    other = ["--checkpoint", str(root), "--resume", "--seed", "7", "--steps", "1"]
    assert main([*base, *other]) == 2
    assert "is of another run: seed 0 (this run: 7)" in capsys.readouterr().err
