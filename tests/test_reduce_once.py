"""Gradients summed over a stage's batch axes once per step (see [Note: gradients reduced once]):
equal to jax.jit, no all-reduce in the per-micro-batch backwards, one in the step's reduction,
and the plan names the stages that keep the per-micro-batch reduction and why."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_parallelize import (
    adam_step,
    assert_same,
    make_batch,
    make_params,
    make_step,
    mlp_loss,
    run_steps,
)

import jaxreshard as jr

ONCE = "once per step, over data"
ROWS = 16


def _compilers(step, *args):
    return step.pipeline(*args).compiled.engine.compilers


def _all_reduces(compiled) -> int:
    return len(re.findall(r"all-reduce(-start)?\(", compiled.as_text()))


def _run(config, stages=2, shared=False, steps=3):
    step = jr.parallelize(make_step(stages, shared=shared), config=config, batch_argnums=(1,))
    ref = run_steps(
        jax.jit(make_step(stages, shared=shared)), make_params(stages), make_batch(ROWS), steps
    )
    out = run_steps(step, make_params(stages), make_batch(ROWS), steps)
    return step, out, ref


@pytest.mark.parametrize(
    "stages, mesh, schedule, weight_delay, m",
    [
        (1, (4,), "1f1b", False, 4),
        (2, (2,), "1f1b", False, 4),
        (2, (2,), "eager_1f1b", True, 4),
        (3, (2,), "gpipe", False, 2),
        (2, (2, 1), "zb_h1", True, 8),
        (2, [(2,), (1,)], "1f1b", False, 4),  # the second stage has no batch axis to sum over
    ],
)
def test_reduced_once_equals_jit(cpu_devices, stages, mesh, schedule, weight_delay, m):
    names = ("data", "model") if isinstance(mesh, tuple) and len(mesh) == 2 else ("data",)
    config = jr.PipelineConfig(
        backend="local",
        num_stages=stages,
        num_micro_batches=m,
        stage_mesh_shape=mesh,
        mesh_axis_names=names,
        schedule=schedule,
        weight_delay=weight_delay,
    )
    step, out, ref = _run(config, stages)
    assert_same(*out, *ref, tol=2e-5)
    reductions = step.pipeline(make_params(stages), make_batch(ROWS)).layout.reductions
    if isinstance(mesh, list):
        assert reductions[0] == ONCE
        assert reductions[1].startswith("every micro-batch (no mesh axis splits"), reductions
    else:
        assert set(reductions.values()) == {ONCE}, reductions


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_the_backwards_all_reduce_nothing_and_the_step_reduces_once(cpu_devices, split):
    """The compiled programs: a per-micro-batch backward of a data-parallel stage has no
    all-reduce (it had one per micro-batch before), the step's one reduction has it."""
    counts = {}
    for how in ("once", "every_micro_batch"):
        config = jr.PipelineConfig(
            backend="local",
            num_stages=2,
            num_micro_batches=4,
            stage_mesh_shape=(2,),
            schedule="eager_1f1b" if split else "1f1b",
            weight_delay=split,
            reduce_gradients=how,
        )
        step, out, ref = _run(config, steps=1)
        assert_same(*out, *ref, tol=2e-5)
        first = _compilers(step, make_params(2), make_batch(ROWS))[0]
        counts[how] = {name: _all_reduces(c) for (name, _), c in first._ready.items()}
    backwards = ["b_part", "w_part"] if split else ["backward"]
    assert [counts["once"][b] for b in backwards] == [0] * len(backwards), counts
    assert counts["once"]["reduce"] >= 1, counts
    assert sum(counts["every_micro_batch"][b] for b in backwards) >= 1, counts
    assert "reduce" not in counts["every_micro_batch"], counts


def _loop_bodies(hlo: str) -> str:
    """The text of the computations `while` loops run as their bodies."""
    names = set(re.findall(r"while\(.*?body=%?([\w.\-]+)", hlo))
    blocks = re.split(r"\n(?=\S)", hlo)
    return "\n".join(b for b in blocks if b.lstrip("%").split(" ")[0] in names)


def _tensor_all_reduces(text: str) -> int:
    """All-reduces of anything but a scalar (a micro-batch's loss is summed over `data`)."""
    count = 0
    for line in text.splitlines():
        found = re.search(r"= (.*?) all-reduce(-start)?\(", line)
        count += bool(found and re.search(r"\[\d", found.group(1)))
    return count


@pytest.mark.parametrize("stages, fuse", [(1, "auto"), (2, "always")])
def test_a_fused_optimizer_reads_the_gradients_reduced_once(cpu_devices, stages, fuse):
    """The optimizer inside the last backward (by default in a one-stage pipeline, whose
    micro-batches run as one scan) reads the gradients summed once: the scan's loop sums no
    gradient, the program after it does, and the step equals jax.jit."""
    config = jr.PipelineConfig(
        backend="local",
        num_stages=stages,
        num_micro_batches=4,
        stage_mesh_shape=(2,),
        fuse_optimizer=fuse,
    )
    step, out, ref = _run(config, stages)
    assert_same(*out, *ref, tol=2e-5)
    pipeline = step.pipeline(make_params(stages), make_batch(ROWS))
    assert set(pipeline.layout.reductions.values()) == {ONCE}, pipeline.layout.reductions
    ready = pipeline.compiled.engine.compilers[stages - 1]._ready
    fused = {name: c.as_text() for (name, _), c in ready.items() if "apply" in name}
    assert fused and "reduce" not in {name for name, _ in ready}, list(ready)
    for name, hlo in fused.items():
        assert _tensor_all_reduces(hlo) >= 1, name
        if name.startswith("fb_scan"):
            assert "while(" in hlo and _tensor_all_reduces(_loop_bodies(hlo)) == 0, name


def test_the_reduction_runs_once_a_step_after_the_last_backward(cpu_devices):
    config = jr.PipelineConfig(
        backend="local", num_micro_batches=4, stage_mesh_shape=(2,), num_stages=2
    )
    step = jr.parallelize(make_step(2), config=config, batch_argnums=(1,))
    params, batch = make_params(2), make_batch(ROWS)
    _, events = step.profile_call(params, batch)
    compilers = _compilers(step, params, batch)
    calls = []
    for c in compilers.values():
        original = c.call

        def counting(name, *args, _c=c, _original=original):
            calls.append((_c.s, name))
            return _original(name, *args)

        c.call = counting
    step(params, batch)
    step.wait()
    assert calls.count((0, "reduce")) == 1 and calls.count((1, "reduce")) == 1, calls
    last_backward = max(i for i, (s, n) in enumerate(calls) if s == 0 and n == "backward")
    assert calls.index((0, "reduce")) == last_backward + 1, calls
    # A recorded step times each reduction apart, as the optimizer's (kind "A"), right after
    # the chunk's last backward, so the simulator places it there and not in every backward.
    for s in (0, 1):
        mine = [e for e in events if e.stage == s]
        (reduced,) = [e for e in mine if e.name == f"{s}R"]
        last = max((e for e in mine if e.kind == "B"), key=lambda e: e.end)
        assert reduced.kind == "A" and last.end <= reduced.start <= reduced.end, (last, reduced)


@pytest.mark.parametrize(
    "kwargs, shared, why",
    [
        ({"num_micro_batches": 1}, False, "one micro-batch"),
        ({"reduce_gradients": "every_micro_batch"}, False, "reduce_gradients"),
        ({"stage_mesh_shape": (1,)}, False, "no mesh axis splits"),
        ({"batch_axis": None}, False, "no mesh axis splits"),
    ],
)
def test_stages_that_keep_the_per_micro_batch_reduction_say_why(cpu_devices, kwargs, shared, why):
    settings = {"num_stages": 2, "num_micro_batches": 4, "stage_mesh_shape": (2,)} | kwargs
    step, out, ref = _run(jr.PipelineConfig(backend="local", **settings), 2, shared=shared)
    assert_same(*out, *ref, tol=2e-5)
    plan = str(step.plan(make_params(2), make_batch(ROWS)))
    assert "parameter gradients summed over the batch axes:" in plan
    assert re.search(rf"stage 0: every micro-batch \(.*{re.escape(why)}", plan), plan


@pytest.mark.parametrize("stages", [2, 4])
def test_parameters_shared_between_stages_keep_the_per_micro_batch_reduction(cpu_devices, stages):
    """A tied embedding's gradient contributions arrive reduced from the other stage: it keeps
    today's path, the stage's other parameters are reduced once."""
    config = jr.PipelineConfig(
        backend="local", num_stages=stages, num_micro_batches=4, stage_mesh_shape=(2,)
    )
    step, out, ref = _run(config, stages, shared=True)
    assert_same(*out, *ref, tol=2e-5)
    reductions = step.pipeline(make_params(stages), make_batch(ROWS)).layout.reductions
    assert reductions[0] == "every micro-batch (every parameter is shared with another stage)"
    last = f"{ONCE} (the 1 shared with other stages: every micro-batch)"
    assert reductions[stages - 1] == last, reductions


def test_a_model_parallel_matmul_contracting_a_split_dimension_sums_once(cpu_devices):
    """A matmul that contracts a `model`-split dimension is ambiguous on an Explicit mesh (JAX
    asks for an out_sharding); `dot_contracting_split` gives the Auto program's sum, the stage
    sums over `data` once, and the step equals jax.jit."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    config = jr.PipelineConfig(
        backend="local",
        num_stages=1,
        num_micro_batches=2,
        stage_mesh_shape=(2, 2),
        mesh_axis_names=("data", "model"),
    )
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    params = make_params(1)
    params["emb"] = jax.device_put(params["emb"], NamedSharding(mesh, P(None, "model")))
    params["out"] = jax.device_put(params["out"], NamedSharding(mesh, P("model", None)))
    step = jr.parallelize(make_step(1), config=config, batch_argnums=(1,))
    ref = run_steps(jax.jit(make_step(1)), make_params(1), make_batch(ROWS))
    out = run_steps(step, params, make_batch(ROWS))
    assert_same(*out, *ref, tol=2e-5)
    (how,) = step.pipeline(params, make_batch(ROWS)).layout.reductions.values()
    assert how == ONCE, how


def test_a_stage_jax_cannot_type_keeps_todays_path_and_says_so(cpu_devices):
    """A sort along the split rows: JAX refuses it on an Explicit mesh and no rule of ours
    takes it, so that stage keeps the per-micro-batch sum, the plan keeps JAX's words, and
    the step still equals jax.jit (the loss does not depend on the rows' order, so the
    micro-batches' own sorts give jax.jit's values; the pipeline warns all the same)."""

    def loss(p, x):
        h = jr.stage_boundary(jnp.tanh(x @ p["w1"]))
        return jnp.mean(jnp.sort(h @ p["w2"], axis=0) ** 2)

    def step(p, x):
        value, grads = jr.value_and_grad(loss)(p, x)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, grads), value

    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(size=(4, 8)).astype(np.float32),
        "w2": rng.normal(size=(8, 4)).astype(np.float32),
    }
    x = rng.normal(size=(ROWS, 4)).astype(np.float32)
    config = jr.PipelineConfig(
        backend="local", num_stages=2, num_micro_batches=4, stage_mesh_shape=(2,)
    )
    pstep = jr.parallelize(step, config=config, batch_argnums=(1,))
    with pytest.warns(jr.MicroBatchWarning, match="across examples"):
        reductions = pstep.pipeline(params, x).layout.reductions
    assert reductions[0] == ONCE, reductions
    refusal = "every micro-batch (JAX: ShardingTypeError: Arguments to sort"
    assert reductions[1].startswith(refusal), reductions
    (got, got_loss), (want, want_loss) = pstep(params, x), jax.jit(step)(params, x)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=2e-5)
    for k in params:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=2e-5, atol=1e-6)


def test_adam_with_biases_and_several_steps_equals_jit(cpu_devices):
    """An optimizer after the gradients, biases broadcast against batch-split activations (the
    case JAX refuses without the reshard of `_reconciled`), and steps that reuse the programs."""
    import optax

    optimizer = optax.adam(1e-2)
    train = adam_step(mlp_loss, optimizer)
    params = make_params(2)
    config = jr.PipelineConfig(
        backend="local", num_micro_batches=4, stage_mesh_shape=(2,), num_stages=2
    )
    step = jr.parallelize(train, config=config, batch_argnums=(2,))
    ours = (params, optimizer.init(params))
    ref = (params, optimizer.init(params))
    jitted = jax.jit(train)
    for seed in range(4):
        batch = make_batch(ROWS, seed=seed)
        *ours, loss = step(*ours, batch)
        *ref, ref_loss = jitted(*ref, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-5)
    for k in params:
        np.testing.assert_allclose(np.asarray(ours[0][k]), np.asarray(ref[0][k]), atol=2e-5)
    assert set(step.pipeline(*ours, batch).layout.reductions.values()) == {ONCE}


def test_the_config_refuses_an_unknown_reduction():
    with pytest.raises(ValueError, match="reduce_gradients"):
        jr.PipelineConfig(backend="local", reduce_gradients="sometimes")


def test_a_typed_trace_reshards_a_reduced_bias_against_a_split_activation(cpu_devices):
    """`_reconciled` in isolation: the bias is widened and split like the activation."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxreshard.frontend._typed_eval import _reconciled
    from jaxreshard.frontend._typed_ops import typed_spec

    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,))
    seen = []

    def f(x, b):
        b = jax.reshard(b, P(None, None, reduced={"data"}))
        x2, b2 = _reconciled([x, b])
        seen.extend([(jax.typeof(v).shape, typed_spec(v)) for v in (x2, b2)])
        return x2 + b2

    with jax.set_mesh(mesh):
        args = (
            jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=NamedSharding(mesh, P("data"))),
            jax.ShapeDtypeStruct((1, 8), jnp.float32, sharding=NamedSharding(mesh, P())),
        )
        jax.jit(f).lower(*args)
    assert seen[1][0] == (4, 8) and not seen[1][1].reduced, seen


def _ut_run(how, steps=1, **kwargs):
    """The shipped U-Transformer (convolutions, a jitted silu, attention, group norms), 2
    data-parallel stages, against jax.jit (with SGD: Adam's first steps amplify the float
    reassociation of micro-batching in gradients near zero, either way of reducing)."""
    import optax

    from jaxreshard.models import utransformer as ut

    # Two levels of the `tiny` preset (attention on the second) keep every kind of layer and
    # take half the compile time of four.
    cfg = dataclasses.replace(ut.PRESETS["tiny"], channel_mult=(1, 2), attention_from=1)
    config = jr.PipelineConfig(
        backend="local",
        num_stages=2,
        num_micro_batches=4,
        reduce_gradients=how,
        **{"stage_mesh_shape": (2,), **kwargs},
    )
    sgd = optax.sgd(0.1)
    step = jr.parallelize(ut.train_step(cfg, 2, sgd), config=config, batch_argnums=(2,))
    ref_step = jax.jit(ut.train_step(cfg, 2, sgd))
    state, ref = ut.init_state(cfg, optimizer=sgd), ut.init_state(cfg, optimizer=sgd)
    losses, ref_losses = [], []
    for i in range(steps):
        batch = ut.synthetic_batch(cfg, 8, i)
        *state, loss = step(*state, batch)
        *ref, ref_loss = ref_step(*ref, batch)
        losses.append(float(loss))
        ref_losses.append(float(ref_loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    for a, b in zip(jax.tree.leaves(state[0]), jax.tree.leaves(ref[0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
    pipeline = step.pipeline(*ut.init_state(cfg, optimizer=sgd), ut.synthetic_batch(cfg, 8, 0))
    return pipeline


def test_a_convolutional_model_sums_its_gradients_once(cpu_devices):
    """Convolutions have no reduced rule in JAX; `conv_with_reduced_weight` supplies it, and
    `jit` calls (jax.nn.silu) are evaluated in place. Both U-Transformer stages then compile
    backwards (here split into B and W, the case with the most programs; the whole backward
    runs in the next test) that sum no weight gradient, and the step still equals jax.jit."""
    pipeline = _ut_run("once", schedule="eager_1f1b", weight_delay=True)
    assert set(pipeline.layout.reductions.values()) == {ONCE}, pipeline.layout.reductions
    for compiler in pipeline.compiled.engine.compilers.values():
        ready = compiler._ready.items()
        # The weight gradients' convolutions stay in W, which the schedule can delay (the
        # rule's backward once computed both cotangents in one program, all of it in B).
        texts = {name: c.as_text() for (name, _), c in ready}
        assert len(re.findall(r" convolution\(", texts["w_part"])) >= 1, compiler.s
        counts = {name: _tensor_all_reduces(c.as_text()) for (name, _), c in ready}
        assert counts.pop("reduce") >= 1, counts
        assert set(counts.values()) == {0}, counts  # (forward, backward / fb, b_part, w_part)


def test_a_stage_after_one_without_a_batch_axis_splits_its_rows_and_sums_once(cpu_devices):
    """Stage 0's mesh (1 x 2) has no batch axis to split, and its U-Transformer activations
    leave it whole along the rows; stage 1 (2 x 1) receives them split over `data`
    (`split_rows`) instead of computing its whole micro-batch on both devices (JAX refused the
    typed trace then: a replicated activation against a reduced weight), so it sums once."""
    from jaxreshard.frontend._split import ACT

    meshes = {"stage_mesh_shape": [(1, 2), (2, 1)], "mesh_axis_names": ("data", "model")}
    pipeline = _ut_run("once", **meshes)
    stage = pipeline.graph.loss.stages[1]
    specs = zip(stage.inputs, pipeline.layout.input_specs[1])
    acts = [spec for ref, spec in specs if ref.kind == ACT]
    assert acts and all(len(spec) and spec[0] == "data" for spec in acts), acts
    assert pipeline.layout.reductions[1] == ONCE, pipeline.layout.reductions


def test_split_rows_splits_only_the_rows_of_a_tensor_whole_along_them():
    from jax.sharding import PartitionSpec as P

    from jaxreshard.runtime.step._specs import split_rows

    mesh = {"data": 2, "model": 2}
    assert split_rows(P(), mesh, (4, 8), "data", 4) == P("data", None)
    assert split_rows(P(None, "model"), mesh, (4, 8), "data", 4) == P("data", "model")
    assert split_rows(P("model"), mesh, (4, 8), "data", 4) == P("model")  # dim 0 already split
    assert split_rows(P(None, "data"), mesh, (4, 8), "data", 4) == P(None, "data")
    assert split_rows(P(), mesh, (8, 4), "data", 4) == P()  # dim 0 is not the rows
    assert split_rows(P(), mesh, (3, 8), "data", 3) == P()  # 2 does not divide 3
    assert split_rows(P(), {"data": 1, "model": 4}, (4, 8), "data", 4) == P()
    assert split_rows(P(), mesh, (4, 8), None, 4) == P()


@pytest.mark.parametrize("shape", [(2, 2), (2, 1)])
def test_tensor_parallel_convolutions_sum_their_gradients_once(cpu_devices, shape):
    """A residual block's convolutions split over `model` as the U-Transformer's are (the first
    by output channels, the second by input channels) on a 2 x 2 mesh (and a 2 x 1 one, where
    `model` has size 1): the typed trace takes our convolution rule (JAX's own asks for an
    out_sharding), the stage sums once, and the step equals jax.jit."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    dn = ("NHWC", "HWIO", "NHWC")

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn)

    def loss(params, batch):
        h = jnp.tanh(conv(batch["x"], params["w1"]) + params["b1"])
        h = jr.stage_boundary(h)
        h = h + conv(jnp.tanh(conv(h, params["w2"])), params["w3"])
        return jnp.mean((h - batch["y"]) ** 2)

    def step(params, batch):
        value, grads = jr.value_and_grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(size=(3, 3, 4, 8)).astype(np.float32) * 0.2,
        "b1": np.zeros(8, np.float32),
        "w2": rng.normal(size=(3, 3, 8, 8)).astype(np.float32) * 0.2,
        "w3": rng.normal(size=(3, 3, 8, 8)).astype(np.float32) * 0.2,
    }
    mesh = jax.make_mesh(shape, ("data", "model"), devices=jax.devices()[: np.prod(shape)])
    specs = {"w1": P(), "b1": P(), "w2": P(None, None, None, "model"), "w3": P(None, None, "model")}
    placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    batch = {
        "x": rng.normal(size=(16, 6, 6, 4)).astype(np.float32),
        "y": rng.normal(size=(16, 6, 6, 8)).astype(np.float32),
    }
    config = jr.PipelineConfig(
        backend="local",
        num_stages=2,
        num_micro_batches=4,
        stage_mesh_shape=shape,
        mesh_axis_names=("data", "model"),
    )
    pstep = jr.parallelize(step, config=config, batch_argnums=(1,))
    pipeline = pstep.pipeline(placed, batch)
    assert pipeline.layout.reductions[1] == ONCE, pipeline.layout.reductions
    got, got_loss = pstep(placed, batch)
    want, want_loss = jax.jit(step)(params, batch)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=2e-5)
    for k in params:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=2e-5, atol=1e-6)


def test_an_unaligned_reshape_of_a_model_split_dimension_is_typed_by_our_rule(cpu_devices):
    """JAX refuses on an Explicit mesh a reshape that splits a model-split dimension into dims
    the split does not align with (the U-Transformer's attention: 384 channels over 2 devices
    into 3 x 2 x 64). `reshape_unaligned` gathers that group and splits it again on its first
    dim the axis divides (the heads, as XLA's propagation does on the plain path: the
    attention then runs split, not once per device whole), and keeps every aligned split; the
    values are the reshape's."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxreshard.frontend._typed_ops import reshape_unaligned

    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    x = np.arange(4 * 4 * 384, dtype=np.float32).reshape(4, 4, 384)
    closed = jax.make_jaxpr(lambda v: v.reshape(4, 4, 3, 2, 64))(x)
    (eqn,) = closed.jaxpr.eqns
    aligned = jax.make_jaxpr(lambda v: v.reshape(4, 4, 2, 192))(x).jaxpr.eqns[0]
    with jax.set_mesh(mesh):
        arg = jax.device_put(x, NamedSharding(mesh, P("data", None, "model")))
        with pytest.raises(Exception, match="reshape is not supported"):
            jax.jit(lambda v: v.reshape(4, 4, 3, 2, 64)).lower(arg)
        specs = []

        def typed(v, e):
            (out,) = reshape_unaligned(e, [v])
            specs.append(jax.typeof(out).sharding.spec)
            return out

        out = jax.jit(lambda v: typed(v, eqn))(arg)
        jax.jit(lambda v: typed(v, aligned))(arg)
    np.testing.assert_array_equal(np.asarray(out), x.reshape(4, 4, 3, 2, 64))
    assert specs[0] == P("data", None, None, "model", None), specs
    assert specs[1] == P("data", None, "model", None), specs


def test_the_convolution_rule_refuses_rows_whole_over_a_reduced_axis(cpu_devices):
    """An input not split over the reduced axis would give every device the whole weight
    gradient as its term, summed once per device: the rule leaves it to JAX (which refuses),
    and takes the split one."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxreshard.frontend._typed_ops import conv_with_reduced_weight

    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,))
    x = np.ones((4, 6, 6, 3), np.float32)
    w = np.ones((3, 3, 3, 5), np.float32)
    fn = lambda a, b: jax.lax.conv_general_dilated(
        a, b, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    (eqn,) = jax.make_jaxpr(fn)(x, w).jaxpr.eqns
    taken = []

    def typed(a, b):
        b = jax.reshard(b, P(reduced={"data"}))
        taken.append(conv_with_reduced_weight(eqn, [a, b], jax.sharding.get_abstract_mesh()))
        return a

    with jax.set_mesh(mesh):
        for spec in (P(), P("data")):
            arg = jax.device_put(x, NamedSharding(mesh, spec))
            jax.jit(typed).lower(arg, jax.device_put(w, NamedSharding(mesh, P())))
    assert taken[0] is None and taken[1] is not None, taken


@pytest.mark.parametrize("shape", [(2, 2), (2, 1)])
def test_a_fused_qkv_projection_split_over_model_keeps_its_attention_split(cpu_devices, shape):
    """Attention whose fused qkv weight is split over `model` by its last dim, reshaped to (3,
    heads, head_dim): the reshape cannot keep that split, so it is gathered. On the plain path
    XLA then splits the heads over `model`; the typed stage (reduced once) must too, else every
    device computes every head (GPT `tiny` on 2 x 2 meshes ran 1.13-1.19x slower summing once).
    The forward's attention scores come out split by heads, and the step equals jax.jit.
    On (2, 1) meshes `model` has size 1, so the reshape keeps it on the `3` dim and `qkv[:, :, i]`
    squeezes a size-1 dim split over it, whose cotangent JAX types without the split and then
    refuses: before `without_size_one_axes`, the stage kept the per-micro-batch sum."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rows, seq, dim, heads = 16, 8, 16, 4

    def attention(params, x):
        qkv = (x @ params["qkv"]).reshape(x.shape[0], seq, 3, heads, dim // heads)
        q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
        scores = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / 2.0, axis=-1)
        out = (scores @ v).transpose(0, 2, 1, 3).reshape(x.shape[0], seq, dim)
        return x + out @ params["proj"]

    def loss(params, x):
        h = jr.stage_boundary(jnp.tanh(x @ params["w0"]))
        return jnp.mean(attention(params, h) ** 2)

    def step(params, x):
        value, grads = jr.value_and_grad(loss)(params, x)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    rng = np.random.default_rng(0)
    params = {
        "w0": rng.normal(size=(dim, dim)).astype(np.float32) * 0.3,
        "qkv": rng.normal(size=(dim, 3 * dim)).astype(np.float32) * 0.3,
        "proj": rng.normal(size=(dim, dim)).astype(np.float32) * 0.3,
    }
    mesh = jax.make_mesh(shape, ("data", "model"), devices=jax.devices()[: np.prod(shape)])
    specs = {"w0": P(), "qkv": P(None, "model"), "proj": P("model", None)}
    placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    x = rng.normal(size=(rows, seq, dim)).astype(np.float32)
    config = jr.PipelineConfig(
        backend="local",
        num_stages=2,
        num_micro_batches=2,
        stage_mesh_shape=shape,
        mesh_axis_names=("data", "model"),
    )
    pstep = jr.parallelize(step, config=config, batch_argnums=(1,))
    pipeline = pstep.pipeline(placed, x)
    assert pipeline.layout.reductions[1] == ONCE, pipeline.layout.reductions
    (got, got_loss), (want, want_loss) = pstep(placed, x), jax.jit(step)(params, x)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=2e-5)
    for k in params:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=2e-5, atol=1e-6)
    second = pipeline.compiled.engine.compilers[1]
    hlo = "\n".join(c.as_text() for (name, _), c in second._ready.items() if name == "fb")
    # per device: 4 of 8 rows (a micro-batch over `data`), 4 / model heads, 8 x 8 scores
    heads_here = heads // shape[1]
    assert re.search(rf"f32\[4,{heads_here},8,8\]", hlo), "the heads are not split over `model`"
    if shape[1] > 1:
        assert not re.search(r"f32\[4,4,8,8\]", hlo), "every device computes every head"
    else:  # (no tensor parallelism: the typed trace's reshards of size-1 axes move nothing)
        assert _tensor_all_reduces(hlo) == 0, hlo
        assert not re.search(r"all-gather|all-to-all|collective-permute", hlo), hlo


def test_a_bare_assertion_in_the_typed_trace_keeps_todays_path(cpu_devices, monkeypatch):
    """JAX's own `assert`s carry no message (on jax 0.10.2, an `unreduced` value on a mesh of
    mixed axis types): the stage keeps the per-micro-batch sum, the plan names the error, and
    the step equals jax.jit (it raised an IndexError reading the empty message)."""
    from jaxreshard.runtime.step._compile import StageCompiler

    def refuse(self, *args):
        raise AssertionError()

    monkeypatch.setattr(StageCompiler, "_reduce_once", refuse)
    config = jr.PipelineConfig(
        backend="local", num_stages=2, num_micro_batches=4, stage_mesh_shape=(2,)
    )
    step, out, ref = _run(config, steps=2)
    assert_same(*out, *ref, tol=2e-5)
    reductions = step.pipeline(make_params(2), make_batch(ROWS)).layout.reductions
    assert set(reductions.values()) == {"every micro-batch (JAX: AssertionError)"}, reductions
