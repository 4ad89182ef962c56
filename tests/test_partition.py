"""Candidate cuts and automatic partitioning: `jr.stage_candidate` marks where a stage may end;
`cuts=` chooses among them by hand, `partition="auto"` by the simulated step (measured segment
compute, the planner's transfer time of every cut); either way the step equals jax.jit."""

import dataclasses
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr

# Layer output widths: a cut after a 32-wide layer moves 16x fewer bytes than after a 512-wide.
WIDTHS = [512, 32, 512, 32, 512, 32]
OPT = optax.sgd(1e-2)


def init_params():
    rng = np.random.default_rng(0)
    params, fan_in = {}, 32
    for i, w in enumerate(WIDTHS):
        params[f"l{i}"] = (rng.normal(size=(fan_in, w)) / np.sqrt(fan_in)).astype(np.float32)
        fan_in = w
    return params


def make_step(pipelined=True, forced=(), tied=False, layer=None):
    """The step; `tied`: the last segment reads the first layer's weight again (as a tied
    embedding's output head does); `layer(i, h, w)`: layer i and its marker, if not the
    default's (a candidate after every layer but the last, a boundary after those `forced`)."""

    def default(i, h, w):
        h = jnp.tanh(h @ w)
        if i in forced:
            return jr.stage_boundary(h)
        return jr.stage_candidate(h) if i < len(WIDTHS) - 1 else h

    def step(params, state, batch):
        def loss_fn(p):
            h = batch["x"]
            for i in range(len(WIDTHS)):
                w = p[f"l{i}"]
                h = (layer or default)(i, h, w) if pipelined else jnp.tanh(h @ w)
            if tied:
                h = h + 0.1 * jnp.tanh(h @ p["l0"]) @ p["l0"].T
            return jnp.mean((h - batch["y"]) ** 2)

        grad = jr.value_and_grad if pipelined else jax.value_and_grad
        loss, g = grad(loss_fn)(params)
        updates, state = OPT.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step


def make_batch():
    rng = np.random.default_rng(1)
    return {
        "x": rng.normal(size=(64, 32)).astype(np.float32),
        "y": rng.normal(size=(64, 32)).astype(np.float32),
    }


BASE = dict(stage_mesh_shape=(1,), num_micro_batches=4, backend="local", devices_per_host=1)


def config(**overrides):
    """The tests' config; `partition="auto"` by its prediction alone (`partition_trials=0`)
    unless a test measures choices."""
    trials = {"partition_trials": 0} if overrides.get("partition") == "auto" else {}
    return jr.PipelineConfig(**{**BASE, **trials, **overrides})


def run(step, steps=2):
    params, batch = init_params(), make_batch()
    state, losses = OPT.init(params), []
    for _ in range(steps):
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return params, losses


def assert_equal_to_jit(step):
    got, losses = run(step)
    want, want_losses = run(jax.jit(make_step(pipelined=False)))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6)


def test_candidates_are_the_identity_outside_a_choice():
    """Without cuts or partition, a step with candidates is one stage (num_stages=1), and
    under jax.jit and jax.grad the markers do nothing."""
    step = jr.parallelize(make_step(), config=config(num_stages=1), batch_argnums=2)
    assert step.plan(init_params(), OPT.init(init_params()), make_batch()).graph.num_stages == 1
    assert_equal_to_jit(step)
    assert_equal_to_jit(jax.jit(make_step()))


def test_cuts_choose_candidates_by_number():
    step = jr.parallelize(make_step(), config=config(cuts=(1, 3)), batch_argnums=2)
    plan = step.plan(init_params(), OPT.init(init_params()), make_batch())
    assert plan.graph.num_stages == 3
    shapes = {t["shape"] for t in plan.boundary_tensors() if t["kind"] == "act"}
    assert shapes == {(16, 32)}  # the 32-wide outputs of layers 1 and 3, per micro-batch
    assert_equal_to_jit(step)
    with pytest.raises(ValueError, match=r"has 5 jr.stage_candidate markers \(numbered 0 to 4\)"):
        jr.parallelize(make_step(), config=config(cuts=(7,)), batch_argnums=2).plan(
            init_params(), OPT.init(init_params()), make_batch()
        )


def test_auto_charges_the_transfer_of_every_cut():
    """On 1 MB/s links a cut's transfer dominates its segments' compute: the partitioner
    cuts where the least crosses (after a 32-wide layer), its report gives every choice's
    predicted step, and the step equals jax.jit (the prediction alone: `partition_trials=0`)."""
    cfg = config(partition="auto", num_stages=2, emulate_network_gbps=0.001, partition_trials=0)
    step = jr.parallelize(make_step(), config=cfg, batch_argnums=2)
    plan = step.plan(init_params(), OPT.init(init_params()), make_batch())
    report = plan.partition
    assert report.chosen in ((1,), (3,))
    assert len(report.tried) == 5 and report.tried[0][0] == report.chosen
    narrow = [report.crossing[i][0] for i in (1, 3)]
    wide = [report.crossing[i][0] for i in (0, 2, 4)]
    assert max(narrow) * 8 < min(wide)
    assert "automatic partition: 6 segments between 5 markers" in str(plan)
    assert "predicted only, partition_trials=0: 1, the default, runs the fastest" in str(plan)
    assert not report.trials and report.compute_scale is None
    assert plan.graph.num_stages == 2
    assert_equal_to_jit(step)


def test_auto_charges_a_parameter_shared_across_the_cut():
    """The first layer's weight, read by the first and the last segment, sits on both sides of
    every cut: each choice's prediction carries its copy out and its gradient back
    (`Costs.shared`, the planner's time at 1 MB/s), which lengthens every predicted step."""
    from jaxreshard.pipeline import simulate
    from jaxreshard.runtime.step._partition import _schedule

    cfg = config(partition="auto", num_stages=2, emulate_network_gbps=0.001)
    step = jr.parallelize(make_step(tied=True), config=cfg, batch_argnums=2)
    plan = step.plan(init_params(), OPT.init(init_params()), make_batch())
    report = plan.partition
    held = 32 * 512 * 4
    assert report.shared == [(0, held, (0, 5))]
    assert "parameter 0 (0.06 MiB) is read by segments [0, 5]" in str(plan)
    for choice in report.tried:
        ((shared),) = choice.costs.shared
        assert (shared.owner, shared.user, shared.grad) == (0, 1, True)
        assert shared.seconds >= held / 1e6  # (1 MB/s)
        alone = dataclasses.replace(choice.costs, shared=())
        without = simulate(_schedule(cfg, alone).with_apply(), alone).makespan
        assert choice.step >= without + shared.seconds
    # Untied, nothing is shared.
    untied = jr.parallelize(make_step(), config=cfg, batch_argnums=2)
    report = untied.plan(init_params(), OPT.init(init_params()), make_batch()).partition
    assert report.shared == [] and all(c.costs.shared == () for c in report.tried)


def test_by_default_the_predicted_fastest_runs_and_the_prediction_is_refitted_to_it():
    """`partition_trials=1` (the default) measures the predicted fastest choice, fits the
    factor on compute to its step, and measures the refitted prediction's fastest too if that
    is another choice; the fastest measured is chosen, and the step equals jax.jit."""
    cfg = jr.PipelineConfig(partition="auto", num_stages=2, emulate_network_gbps=0.001, **BASE)
    assert cfg.partition_trials == 1
    step = jr.parallelize(make_step(), config=cfg, batch_argnums=2)
    plan = step.plan(init_params(), OPT.init(init_params()), make_batch())
    report = plan.partition
    assert report.trials and report.trials[0].cuts == report.tried[0].cuts
    assert report.compute_scale is not None and report.refitted
    # One more trial where the refit preferred another choice (the factor is then fitted to
    # both again, so `refitted` is that second fit's).
    assert len(report.trials) in (1, 2)
    if len(report.trials) == 1:
        assert report.refitted[0][0] == report.trials[0].cuts
    else:
        assert report.trials[1].cuts != report.trials[0].cuts
    assert report.chosen == min(report.trials, key=lambda t: t.measured).cuts
    assert "the fastest measured is chosen" in str(plan)
    # The refit: each action's cost fitted to the trial's recorded step.
    assert report.action_points >= 4 and report.action_cost is not None
    assert "fits the recorded steps' actions best" in str(plan)
    assert_equal_to_jit(step)


def test_a_recorded_trial_step_that_fails_leaves_the_step_times_to_fit(monkeypatch):
    """Where a trial's recorded step fails, the plan says so and one factor on compute is
    fitted to the trials' step times instead (as before action costs were fitted)."""
    from jaxreshard.runtime.driver._driver import PipelineDriver

    real = PipelineDriver.run

    def no_recording(self, leaves, *, record=False, signal_only=False):
        if record:
            raise RuntimeError("no recording here")
        return real(self, leaves, record=record, signal_only=signal_only)

    monkeypatch.setattr(PipelineDriver, "run", no_recording)
    cfg = jr.PipelineConfig(partition="auto", num_stages=2, emulate_network_gbps=0.001, **BASE)
    step = jr.parallelize(make_step(), config=cfg, batch_argnums=2)
    report = step.plan(init_params(), OPT.init(init_params()), make_batch()).partition
    assert report.trials and report.compute_scale is not None
    assert report.action_points == 0 and report.action_cost is None
    failed = [n for n in report.trials_note if "a recorded step failed" in n]
    assert failed and "no recording here" in failed[0]
    assert len(failed) == len(report.trials)  # (each tried once)
    assert "fits the measured steps best" in report.summary()


def test_auto_keeps_forced_boundaries():
    cfg = config(partition="auto", num_stages=3, emulate_network_gbps=0.001)
    step = jr.parallelize(make_step(forced=(2,)), config=cfg, batch_argnums=2)
    plan = step.plan(init_params(), OPT.init(init_params()), make_batch())
    assert plan.partition.markers.count("forced") == 1
    assert len(plan.partition.chosen) == 1 and plan.graph.num_stages == 3
    assert_equal_to_jit(step)


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="say how many stages"):
        jr.PipelineConfig(partition="auto")
    with pytest.raises(ValueError, match="distinct candidate numbers"):
        jr.PipelineConfig(cuts=(1, 1))
    with pytest.raises(ValueError, match=r"a tuple of jr.stage_candidate numbers"):
        jr.PipelineConfig(cuts="1,3")
    cfg = config(partition="auto", num_stages=8)
    with pytest.raises(ValueError, match="so it can have 1 to 6 stages"):
        jr.parallelize(make_step(), config=cfg, batch_argnums=2).plan(
            init_params(), OPT.init(init_params()), make_batch()
        )
    with pytest.raises(ValueError, match=r"memory_cap_gib=-1\): must be a number of GiB"):
        jr.PipelineConfig(memory_cap_gib=-1)
    cfg = config(partition="auto", num_stages=2, memory_cap_gib=1e-4)
    with pytest.raises(ValueError, match=r"no choice of cuts fits in 0.10 MiB per device"):
        jr.parallelize(make_step(), config=cfg, batch_argnums=2).plan(
            init_params(), OPT.init(init_params()), make_batch()
        )


def test_a_candidate_inside_a_jitted_layer_is_refused_not_cut_where_nobody_chose():
    """jax.jit reuses its cached trace of a layer without running its Python, so candidates
    inside it would be counted once and cut where the cache has them: with cuts=(1,) this step
    had 4 stages. Both ways of choosing now raise, naming the fix."""
    from jaxreshard.frontend._jaxprs import PipelineSplitError

    @jax.jit
    def layer(w, h):
        return jr.stage_candidate(jnp.tanh(h @ w))

    step_fn = make_step(layer=lambda i, h, w: layer(w, h))
    fix = r"cached trace of a jitted function.*call jr.stage_candidate .*outside it"
    for choice in (dict(cuts=(1,)), dict(partition="auto", num_stages=2)):
        step = jr.parallelize(step_fn, config=config(**choice), batch_argnums=2)
        with pytest.raises(PipelineSplitError, match=fix):
            step.plan(init_params(), OPT.init(init_params()), make_batch())


def test_a_forced_boundary_in_a_jitted_block_called_twice_is_two_cuts_beside_candidates():
    """A jitted block that ends in jr.stage_boundary, called twice with the same shapes, runs
    its Python once (jit reuses the trace): both calls are boundaries all the same, with
    candidates chosen by hand or by the partitioner, and the step equals jax.jit."""

    @jax.jit
    def block(w, h):
        return jr.stage_boundary(jnp.tanh(h @ w))

    def layer(i, h, w):
        if i in (0, 2):  # (the same shapes: the second call reuses the trace)
            return block(w, h)
        h = jnp.tanh(h @ w)
        return jr.stage_candidate(h) if i < len(WIDTHS) - 1 else h

    for choice in (dict(cuts=(1,)), dict(partition="auto", num_stages=4)):
        step = jr.parallelize(make_step(layer=layer), config=config(**choice), batch_argnums=2)
        plan = step.plan(init_params(), OPT.init(init_params()), make_batch())
        assert plan.graph.num_stages == 4, choice
        assert_equal_to_jit(step)


@pytest.mark.parametrize("given", ["config", "meshes"])
def test_auto_chooses_cuts_on_explicit_axes_from_a_trace_on_auto_axes(given):
    """A step of Explicit axes (named by the config, or by the meshes given) has its cuts
    chosen from a trace on Auto axes, whose segments run on one device: the cut where the least
    crosses, as on Auto axes; the step itself runs on its Explicit axes and equals jax.jit."""
    if given == "config":
        cfg = config(partition="auto", num_stages=2, emulate_network_gbps=0.001,
                     stage_mesh_shape=(2,), mesh_axis_types="explicit")  # fmt: skip
        step = jr.parallelize(make_step(), config=cfg, batch_argnums=2)
    else:
        explicit = (jax.sharding.AxisType.Explicit,)
        meshes = [
            jax.make_mesh((2,), ("data",), axis_types=explicit, devices=jax.devices()[i : i + 2])
            for i in (0, 2)
        ]
        cfg = config(partition="auto", num_stages=2, emulate_network_gbps=0.001,
                     stage_mesh_shape=(2,))  # fmt: skip
        step = jr.parallelize(make_step(), config=cfg, batch_argnums=2, meshes=meshes)
    plan = step.plan(init_params(), OPT.init(init_params()), make_batch())
    assert plan.partition.chosen in ((1,), (3,)) and plan.graph.num_stages == 2
    mesh = plan.meshes[0]
    assert set(mesh.axis_types) == {jax.sharding.AxisType.Explicit}, mesh.axis_types
    assert_equal_to_jit(step)


def test_a_step_of_explicit_axes_that_auto_axes_refuse_gets_the_manual_fix():
    """`jax.sharding.reshard` names an Explicit axis: on Auto axes JAX refuses it, so the cuts
    cannot be chosen there; the error says so, with JAX's reason and the fix (`cuts=`), and
    the same step with its cuts given equals jax.jit."""
    from jax.sharding import PartitionSpec as P

    from jaxreshard.frontend._jaxprs import PipelineSplitError

    def layer(i, h, w):
        h = jax.sharding.reshard(jnp.tanh(h @ w), P("data"))
        return jr.stage_candidate(h) if i < len(WIDTHS) - 1 else h

    step_fn = make_step(layer=layer)

    explicit = dict(stage_mesh_shape=(2,), mesh_axis_types="explicit")
    step = jr.parallelize(step_fn, config=config(partition="auto", num_stages=2, **explicit),
                          batch_argnums=2)  # fmt: skip
    refused = r"on Explicit axes.*pass cuts=\(\.\.\.\) with partition='manual'.*on Auto axes"
    with pytest.raises(ValueError, match=refused + r".*reshard"):
        step.plan(init_params(), OPT.init(init_params()), make_batch())
    by_hand = jr.parallelize(step_fn, config=config(cuts=(1,), **explicit), batch_argnums=2)
    assert_equal_to_jit(by_hand)

    def scanned(params, state, batch):  # (an error of the step itself stays as it is)
        def loss_fn(p):
            def body(h, _):
                return jr.stage_candidate(jnp.tanh(h @ p["l1"][:32])), None

            h, _ = jax.lax.scan(body, batch["x"], None, length=2)
            return jnp.mean((h - batch["y"]) ** 2)

        loss, _ = jr.value_and_grad(loss_fn)(params)
        return params, state, loss

    step = jr.parallelize(scanned, config=config(partition="auto", num_stages=2, **explicit),
                          batch_argnums=2)  # fmt: skip
    with pytest.raises(PipelineSplitError, match=r"inside `scan`"):
        step.plan(init_params(), OPT.init(init_params()), make_batch())


def test_auto_measures_the_fastest_predicted_choices(monkeypatch):
    """With `partition_trials=3` the three fastest predictions are each compiled and run (not
    donating the caller's arguments: the donated step that follows still equals jax.jit), and
    the fastest measured is chosen. A delay made to slow the predicted best's runs (the first
    trial to run) makes the choice another; the report and the plan show every trial."""
    from jaxreshard.runtime.local._pipeline import LocalPipeline

    first: list = []  # (the prediction itself is timed: the plan's own, not another run's)
    run_pipeline = LocalPipeline.run

    def delayed(self, leaves, **kwargs):
        if not first:
            first.append(self.compiled.config.cuts)
        if self.compiled.config.cuts == first[0]:
            time.sleep(0.1)
        return run_pipeline(self, leaves, **kwargs)

    monkeypatch.setattr(LocalPipeline, "run", delayed)
    cfg = config(partition="auto", num_stages=2, emulate_network_gbps=0.001, partition_trials=3)
    step = jr.parallelize(make_step(), config=cfg, batch_argnums=2, donate_argnums=(0, 1))
    plan = step.plan(init_params(), OPT.init(init_params()), make_batch())
    report = plan.partition
    assert [t.cuts for t in report.trials[:3]] == [c.cuts for c in report.tried[:3]]
    assert report.trials[0].cuts == report.tried[0].cuts == first[0]
    assert report.trials[0].measured >= 0.1
    assert report.chosen != report.tried[0].cuts
    assert report.chosen == min(report.trials, key=lambda t: t.measured).cuts
    assert all(t.predicted == c.step for t, c in zip(report.trials, report.tried))
    assert len(report.trials) in (3, 4)  # (4: the refitted prediction's fastest joined)
    assert all(t.cuts not in [c.cuts for c in report.tried[:3]] for t in report.trials[3:])
    assert "measured (side by side, median of 5 rounds of 2 steps" in str(plan)
    assert len(report.to_json()["trials"]) == len(report.trials)
    assert_equal_to_jit(step)
    with pytest.raises(ValueError, match=r"partition_trials=-1\): must be an int from 0"):
        jr.PipelineConfig(partition_trials=-1)
    assert jr.PipelineConfig(partition_trials=0).partition_trials == 0  # (the prediction alone)
    with pytest.raises(ValueError, match=r"partition_trials=2\): trials measure the choices"):
        jr.PipelineConfig(partition_trials=2)


def test_a_trial_that_fails_is_left_out_and_every_trial_is_closed(monkeypatch):
    """The second fastest prediction (the second trial built) fails in its warm-up: a warning
    names it, the others decide, and every trial pipeline is closed (with donation none serves
    the step)."""
    import jaxreshard._parallelize as parallelize_module

    built = []
    real = parallelize_module.LocalPipeline

    class Failing(real):
        def run(self, leaves, **kwargs):
            if len(built) > 1 and self is built[1]:
                raise RuntimeError("a stand-in for an out-of-memory error")
            return super().run(leaves, **kwargs)

    def counted(compiled):
        built.append(Failing(compiled))
        return built[-1]

    monkeypatch.setattr(parallelize_module, "LocalPipeline", counted)
    cfg = config(partition="auto", num_stages=2, emulate_network_gbps=0.001, partition_trials=3)
    step = jr.parallelize(make_step(), config=cfg, batch_argnums=2, donate_argnums=(0, 1))
    with pytest.warns(UserWarning, match=r"candidates \[\d\] failed to run") as warned:
        report = step.plan(init_params(), OPT.init(init_params()), make_batch()).partition
    broken = built[1].compiled.config.cuts
    assert broken == report.tried[1].cuts  # (trials are built fastest predicted first)
    assert f"candidates [{broken[0]}] failed to run" in str(warned[0].message)
    assert broken not in [t.cuts for t in report.trials] and len(report.trials) >= 2
    assert "a stand-in for an out-of-memory error" in report.summary()
    assert all(p.closed for p in built[:-1]) and not built[-1].closed  # (the step's own)
    assert built[-1].compiled.config.cuts == report.chosen


def test_the_default_trial_failing_leaves_the_choice_to_the_prediction(monkeypatch):
    """The default's one trial runs without donation, with a copy of the state; where it fails
    (an out-of-memory error the donating step might not meet), a warning says so and the
    prediction's choice stands, instead of the call failing."""
    import jaxreshard._parallelize as parallelize_module

    real, built = parallelize_module.LocalPipeline, []

    class Failing(real):
        def run(self, leaves, **kwargs):
            raise RuntimeError("a stand-in for an out-of-memory error")

    def counted(compiled):
        built.append(Failing(compiled))
        return built[-1]

    monkeypatch.setattr(parallelize_module, "LocalPipeline", counted)
    cfg = jr.PipelineConfig(partition="auto", num_stages=2, emulate_network_gbps=0.001, **BASE)
    step = jr.parallelize(make_step(), config=cfg, batch_argnums=2, donate_argnums=(0, 1))
    with pytest.warns(UserWarning, match=r"failed to run .*; the prediction decides"):
        report = step.plan(init_params(), OPT.init(init_params()), make_batch()).partition
    assert report.chosen == report.tried[0].cuts and not report.trials
    assert "a stand-in for an out-of-memory error" in report.summary()
    assert len(built) == 2 and built[0].closed and not built[1].closed  # (the trial; the step's)


def test_trials_run_side_by_side_only_as_many_as_fit_under_the_cap():
    """Each trial holds its own copy of the state: under a cap that each choice fits alone but
    no two together, one is measured and the plan says why the others were not."""
    _, free = auto_report()
    cap = max(max(c.memory) for c in free.tried) * 1.01
    _, report = auto_report(memory_cap_gib=cap / 2**30, partition_trials=3)
    assert all(c.fits for c in report.tried)
    assert [t.cuts for t in report.trials] == [report.tried[0].cuts] == [report.chosen]
    assert "not measured: beside the others they would need" in report.summary()


def test_trials_keep_the_chosen_pipeline_when_nothing_is_donated(monkeypatch):
    """Without donation the chosen trial's pipeline serves the step (no compile after the
    trials); with donation (above) the step compiles its own."""
    import jaxreshard._parallelize as parallelize_module

    built = []
    real = parallelize_module.LocalPipeline

    def counted(compiled):
        built.append(compiled.config.cuts)
        return real(compiled)

    monkeypatch.setattr(parallelize_module, "LocalPipeline", counted)
    cfg = config(partition="auto", num_stages=2, emulate_network_gbps=0.001, partition_trials=2)
    step = jr.parallelize(make_step(), config=cfg, batch_argnums=2)
    report = step.plan(init_params(), OPT.init(init_params()), make_batch()).partition
    assert built == [t.cuts for t in report.trials]  # (no build after the trials)
    assert report.chosen in built
    assert_equal_to_jit(step)


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_compute_scale_is_fitted_to_measured_steps(schedule):
    """Trials that measure every choice's simulated step with its compute doubled give back a
    factor of 2 (within the grid's 5%), and the choices are predicted again with it: fastest
    first, as the doubled costs simulate."""
    from jaxreshard.runtime.step._partition import Trial, _simulated, fit_compute_scale

    cfg = config(partition="auto", num_stages=2, emulate_network_gbps=0.001, schedule=schedule)
    _, report = auto_report(schedule=schedule)
    doubled = {c.cuts: _simulated(cfg, c.costs, 2.0) for c in report.tried}
    report.trials = [Trial(c.cuts, c.step, doubled[c.cuts]) for c in report.tried[:3]]
    fit_compute_scale(report, cfg)
    assert report.compute_scale == pytest.approx(2.0, rel=0.05)
    assert report.compute_scale != pytest.approx(1.0, rel=0.05)
    # Fastest first, as the doubled costs simulate; two choices within the fitted factor's
    # grid step of each other (segments timed here) may come in either order.
    order = [c for c, _ in report.refitted]
    assert sorted(order) == sorted(doubled)
    for a, b in itertools.pairwise(order):
        assert doubled[a] <= doubled[b] * 1.05, (order, doubled)
    assert "compute x 2.0" in report.summary() or "compute x 1.9" in report.summary()


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
@pytest.mark.parametrize("summed", [False, True])
def test_action_costs_are_fitted_to_a_recorded_step(schedule, summed):
    """A recorded step whose actions each take 2x their predicted compute plus 0.5 ms (a
    simulated one) gives back k = 2 and c = 0.5 ms, and every choice is predicted again with
    them: fastest first, as those costs simulate. Gradient sums (`summed`: once a step, a
    `reduce` event apart from the apply, and per micro-batch, inside W) are the links' time:
    neither scaled nor fitted. Actions that show one predicted time only give no fit (the step
    times then fit the factor alone)."""
    from jaxreshard.pipeline import simulate
    from jaxreshard.runtime.engine._events import Event
    from jaxreshard.runtime.step._collectives import Sums, with_sums
    from jaxreshard.runtime.step._partition import Trial, _schedule
    from jaxreshard.runtime.step._refit import _simulated, calibrated, fit_actions

    cfg = config(partition="auto", num_stages=2, emulate_network_gbps=0.001, schedule=schedule)
    _, report = auto_report(schedule=schedule)
    if summed:
        report.tried = [c._replace(sums=Sums((3e-3, 1e-3), (2e-3, 4e-4))) for c in report.tried]
    choice = report.tried[0]
    sched = _schedule(cfg, with_sums(choice.costs, choice.sums)).with_apply()
    scaled = calibrated(choice.costs, 2.0, 5e-4, sched.split_backward)
    # (a sum once a step is a `reduce` call of its own, after the apply: its seconds and c)
    reduce = [t + 5e-4 if t > 0 else 0.0 for t in choice.sums.once] if summed else [0.0, 0.0]
    scaled = dataclasses.replace(scaled, apply=tuple(a + r for a, r in zip(scaled.apply, reduce)))
    timed = simulate(sched, with_sums(scaled, choice.sums._replace(once=(0.0, 0.0))))
    events = [
        Event(t.action.stage_index, t.action.kind, t.action.microbatch_index, t.start,
              t.end - (reduce[t.action.stage_index] if t.action.kind == "A" else 0.0),
              "apply" if t.action.kind == "A" else str(t.action))
        for stage in timed.stages for t in stage
    ]  # fmt: skip
    # The trial's plain step measured 10% over its recorded actions' simulation: every
    # refitted step is 1.1x its simulation.
    report.trials = [Trial(choice.cuts, choice.step, 1.1 * timed.makespan)]
    assert fit_actions(report, cfg, {choice.cuts: events})
    assert report.compute_scale == pytest.approx(2.0, rel=1e-3)
    assert report.action_cost == pytest.approx(5e-4, rel=1e-2)
    assert report.step_scale == pytest.approx(1.1, rel=1e-2)
    want = {c.cuts: 1.1 * _simulated(cfg, c.costs, 2.0, 5e-4, c.sums) for c in report.tried}
    assert [c for c, _ in report.refitted] == sorted(want, key=want.get)
    for cuts, predicted in report.refitted:
        assert predicted == pytest.approx(want[cuts], rel=2e-2)
    assert "each action as compute x 2.00 + 0.50 ms fits the recorded steps' actions" in (
        report.summary()
    )
    assert "and the step x 1.10 the measured ones" in report.summary()
    one_kind = [e for e in events if e.kind == "F" and e.stage == 0]
    assert not fit_actions(report, cfg, {choice.cuts: one_kind})


def auto_report(step_fn=None, params=None, **overrides):
    base = dict(partition="auto", num_stages=2, emulate_network_gbps=0.001)
    cfg = config(**{**base, **overrides})
    step = jr.parallelize(step_fn or make_step(), config=cfg, batch_argnums=2)
    params = init_params() if params is None else params
    return step, step.plan(params, OPT.init(params), make_batch()).partition


def test_auto_respects_the_memory_cap():
    """Under a cap that only the cut after layer 2 fits (1F1B keeps two micro-batches alive on
    stage 0, one on stage 1, so the middle cut balances memory best), that cut is chosen though
    its 512-wide crossing is 15x slower; the step still equals jax.jit."""
    _, free = auto_report()
    need = {c.cuts: max(c.memory) for c in free.tried}
    assert all(c.fits for c in free.tried) and free.chosen in ((1,), (3,))
    assert min(need, key=need.get) == (2,)
    others = min(v for k, v in need.items() if k != (2,))
    cap = (need[(2,)] + others) / 2
    step, capped = auto_report(memory_cap_gib=cap / (1 << 30))
    assert capped.chosen == (2,) and capped.cap == int(cap)
    assert [c.fits for c in capped.tried] == [True, False, False, False, False]
    assert "over the memory cap: 4 choices" in capped.summary()
    assert_equal_to_jit(step)


def adam_step(donate):
    opt = optax.adam(1e-3)

    def step(params, state, batch):
        def loss_fn(p):
            h = batch["x"]
            for i in range(len(WIDTHS)):
                h = jr.stage_candidate(jnp.tanh(h @ p[f"l{i}"])) if i < 5 else h @ p[f"l{i}"]
            return jnp.mean((h - batch["y"]) ** 2)

        loss, g = jr.value_and_grad(loss_fn)(params)
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss

    cfg = config(partition="auto", num_stages=2)
    return jr.parallelize(step, config=cfg, batch_argnums=2, donate_argnums=donate), opt


@pytest.mark.parametrize("donate", [(), (0, 1)])
def test_memory_estimate_counts_optimizer_state_and_donation(donate):
    """Segment 0 holds layer 0's weight (P bytes), its gradient (P), Adam's two moments (2P)
    and Adam's step count; it writes the new weight and moments (3P more) unless the step
    donates the old ones, whose buffers they then reuse."""
    step, opt = adam_step(donate)
    params = init_params()
    report = step.plan(params, opt.init(params), make_batch()).partition
    p = params["l0"].nbytes
    state = report.memory[0][0].state
    want = (4 if donate else 7) * p
    assert want <= state <= want + 16, (state, want)  # (+ the step counts, 4 bytes each)


def test_memory_estimate_splits_residuals_over_the_batch_axis():
    """On a mesh whose `data` axis splits each micro-batch in two, a segment keeps half the
    residuals per device, and the same parameters. Summing the gradients once a step (the
    default there) keeps each micro-batch's `reduced` casts of the weights too."""
    _, one = auto_report()
    _, every = auto_report(stage_mesh_shape=(2,), reduce_gradients="every_micro_batch")
    for a, b in zip(one.memory, every.memory):
        assert b[0].residuals * 2 == a[0].residuals > 0
        assert b[0].state == a[0].state
    _, once = auto_report(stage_mesh_shape=(2,))
    weights = [c[0].residuals - b[0].residuals for c, b in zip(once.memory, every.memory)]
    assert min(weights) >= 0 and max(weights) > 0


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv"])
def test_auto_with_virtual_stages(schedule):
    """Four chunks on two meshes: interleaved places them round robin, ZB-V as a V whose turn
    (chunks 1 and 2, on mesh 1) moves nothing, so ZB-V cuts there freely."""
    step, report = auto_report(num_stages=4, schedule=schedule)
    assert len(report.chosen) == 3
    turn = [report.crossing[i][1] for i in range(5)]
    if schedule == "zbv":
        assert turn == [0.0] * 5
        assert report.chosen == (1, 2, 3)
    else:
        assert min(turn) > 0
    assert_equal_to_jit(step)


def test_auto_places_weight_gradients_as_it_predicted():
    """With a split backward and the cost fields left alone, the chosen cut's measured costs
    (ms per micro-batch) become the config's, which place the delayed Ws as the prediction
    did; costs the user gave stay, and a backward that is not split places nothing."""
    cfg = dict(schedule="eager_1f1b", weight_delay=True)
    _, report = auto_report(**cfg)
    chosen = next(c for c in report.tried if c.cuts == report.chosen)
    costs = report.placement_costs(config(partition="auto", num_stages=2, **cfg))
    assert costs["cost_forward"] == tuple(f * 1e3 for f in chosen.costs.forward)
    assert len(costs["cost_comm"]) == 1 and set(costs) == {
        "cost_forward", "cost_backward", "cost_weight_grad", "cost_comm"
    }  # fmt: skip
    mine = config(partition="auto", num_stages=2, cost_backward=3.0, **cfg)
    assert report.placement_costs(mine) == {}
    assert report.placement_costs(config(partition="auto", num_stages=2)) == {}


@pytest.mark.parametrize("split", [True, False])
def test_auto_traces_each_segments_residuals_once(monkeypatch, split):
    """The memory estimate needs each segment's residuals and, with a split backward, B's
    exports (a trace of its VJP): one per segment for both, not one per segment and mesh, nor
    one for each; the report is JSON."""
    import json

    from jaxreshard.runtime.step import _memory, _partition

    calls = []
    for name in ("derive_backward", "residual_inputs"):
        real = getattr(_memory, name)
        monkeypatch.setattr(
            _memory, name, lambda s, real=real, name=name, **k: calls.append(name) or real(s, **k)
        )
    _, report = auto_report(num_stages=3, weight_delay=split)
    assert calls == ["derive_backward" if split else "residual_inputs"] * len(WIDTHS)
    assert len(report.segments) == len(WIDTHS)
    record = json.loads(json.dumps(report.to_json()))
    assert record["chosen"] == list(report.chosen) and len(record["segments"]) == len(WIDTHS)
    assert len(record["tried"]) == len(report.tried) == 10  # 2 cuts among 5 candidates
    assert record["markers"] == [0, 1, 2, 3, 4]
    # Each segment's share of the optimizer is timed and simulated after its last backward.
    from dataclasses import replace

    assert all(s.apply > 0 for s in report.segments)
    cfg = config(partition="auto", num_stages=3, emulate_network_gbps=0.001)
    bounds = [p for p, kind in enumerate(report.markers) if kind in report.chosen]
    base, _, _ = _partition._predict(cfg, report.segments, report.crossing, bounds)
    slower = [replace(s, apply=s.apply + 1.0) for s in report.segments]
    longer, _, _ = _partition._predict(cfg, slower, report.crossing, bounds)
    assert longer >= base + 1.0


@pytest.mark.parametrize("reduce", ["once", "every_micro_batch"])
def test_auto_charges_each_chunks_gradient_sum_over_the_batch_axis(reduce):
    """On stage meshes that split the batch, each chunk sums its weight gradients over that
    axis: one ring of its gradient bytes per device (the cluster model: within one host on the
    local runtime, whatever links the boundary tensors get), once a step (in the chunk's
    apply) or in every W when summed per micro-batch. Every choice carries its chunks' sums
    apart from their compute and is simulated with both. On meshes that do not split the
    batch nothing is summed."""
    from jaxreshard.pipeline import simulate
    from jaxreshard.runtime.step._collectives import with_sums
    from jaxreshard.runtime.step._partition import _schedule

    _, report = auto_report(stage_mesh_shape=(2,), reduce_gradients=reduce)
    held = 32 * 512 * 4  # (every layer's weight: 32 x 512 or 512 x 32 float32)
    assert report.gradient_bytes == [[held, held]] * len(WIDTHS)
    assert "gradient bytes per device each segment sums over the batch axis" in report.summary()
    cfg = config(partition="auto", num_stages=2, stage_mesh_shape=(2,), reduce_gradients=reduce)
    for choice in report.tried:
        (cut,) = [p for p, kind in enumerate(report.markers) if kind in choice.cuts]
        for c, segments in enumerate((cut + 1, len(WIDTHS) - cut - 1)):
            ring = segments * held / 50e9 + 2 * 2e-5  # (2 devices: each sends all it holds)
            once, every = (ring, 0.0) if reduce == "once" else (0.0, ring)
            assert choice.sums.once[c] == pytest.approx(once)
            assert choice.sums.every[c] == pytest.approx(every)
        assert (
            choice.costs.apply
            == tuple(  # (compute alone: the sums are apart)
                sum(s.apply for s in report.segments[a:b])
                for a, b in ((0, cut + 1), (cut + 1, len(WIDTHS)))
            )
        )
        summed = with_sums(choice.costs, choice.sums)
        assert choice.step == simulate(_schedule(cfg, summed).with_apply(), summed).makespan
    # The runtime places delayed W's by the costs the choice was simulated with, sums included.
    split = config(num_stages=2, schedule="zb_h1")
    chosen = next(c for c in report.tried if c.cuts == report.chosen)
    want = with_sums(chosen.costs, chosen.sums).weight_grad
    assert report.placement_costs(split)["cost_weight_grad"] == pytest.approx(
        tuple(w * 1e3 for w in want)
    )
    _, whole = auto_report(reduce_gradients=reduce)  # ((1,) meshes)
    assert whole.gradient_bytes == [[0, 0]] * len(WIDTHS)
    assert all(not any(c.sums.once + c.sums.every) for c in whole.tried)
    assert "gradient bytes per device" not in whole.summary()


def test_gradient_sums_as_the_runtime_runs_them():
    """bf16 weights count their own bytes; one micro-batch sums in its backward; a weight read
    on both sides of the cut (tied) is summed by both chunks every micro-batch, the rest once;
    weights split over the batch axis (ZeRO-style) are reduce-scattered every micro-batch, and
    their chunk sums nothing once."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    held = 32 * 512 * 4
    ring = held / 50e9 + 2 * 2e-5  # (one weight's ring within a host, 2 devices)
    bf16 = {k: v.astype(jnp.bfloat16) for k, v in init_params().items()}
    _, report = auto_report(stage_mesh_shape=(2,), params=bf16)
    assert report.gradient_bytes == [[held // 2] * 2] * len(WIDTHS)
    _, report = auto_report(stage_mesh_shape=(2,), num_micro_batches=1)
    assert all(c.sums.once == (0.0, 0.0) and min(c.sums.every) > 0 for c in report.tried)
    _, report = auto_report(make_step(tied=True), stage_mesh_shape=(2,))
    for choice in report.tried:
        (cut,) = [p for p, kind in enumerate(report.markers) if kind in choice.cuts]
        once = [(cut + 1 - 1) * held, (len(WIDTHS) - cut - 1) * held]  # (l0 apart)
        assert choice.sums.every == pytest.approx((ring, ring))
        assert choice.sums.once == pytest.approx(
            tuple(0.0 if n == 0 else n / 50e9 + 2 * 2e-5 for n in once)
        )
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    zero = jax.device_put(init_params(), NamedSharding(mesh, P("data")))
    _, report = auto_report(stage_mesh_shape=(2,), params=zero)
    for choice in report.tried:
        (cut,) = [p for p, kind in enumerate(report.markers) if kind in choice.cuts]
        assert choice.sums.once == (0.0, 0.0)
        for c, segments in enumerate((cut + 1, len(WIDTHS) - cut - 1)):
            scatter = segments * held / 2 / 50e9 + 2e-5  # ((d - 1) / d of each whole part)
            assert choice.sums.every[c] == pytest.approx(scatter)
    # Only l0 split: its chunk sums every micro-batch (l0 reduce-scattered), the other once;
    # as the runtime's plan says for the chosen cut.
    one = {**init_params(), "l0": zero["l0"]}
    step, report = auto_report(stage_mesh_shape=(2,), params=one)
    for choice in report.tried:
        (cut,) = [p for p, kind in enumerate(report.markers) if kind in choice.cuts]
        rest = cut * held / 50e9 + 2 * 2e-5 if cut else 0.0
        assert choice.sums.once == pytest.approx((0.0, (len(WIDTHS) - cut - 1) * held / 50e9
                                                  + 2 * 2e-5))  # fmt: skip
        assert choice.sums.every == pytest.approx((rest + held / 2 / 50e9 + 2e-5, 0.0))
    plan = step.plan(one, OPT.init(one), make_batch())
    assert [plan.layout.reductions[s].startswith("once") for s in (0, 1)] == [False, True]
    # A batch axis that does not divide the micro-batch's 16 rows splits nothing: no sums.
    with pytest.warns(jr.ReplicatedSpecWarning, match="not a multiple of mesh axis 'data'"):
        _, report = auto_report(stage_mesh_shape=(3,))
    assert report.gradient_bytes == [[0, 0]] * len(WIDTHS)
    assert all(not any(c.sums.once + c.sums.every) for c in report.tried)


def test_a_gradient_sum_moves_the_cut_compute_alone_would_choose():
    """Six segments of equal compute cut in two balance at the middle; a gradient sum of 6 ms
    per micro-batch in the last chunk (its weights summed over a batch axis that crosses a slow
    link, every micro-batch) makes the later cut the balanced one."""
    from jaxreshard.runtime.step._collectives import Sums
    from jaxreshard.runtime.step._partition import _predict
    from jaxreshard.runtime.step._segment_cost import SegmentCost

    segments = [SegmentCost(1e-3, 2e-3, 1e-3)] * 6
    crossing = {p: [0.0] for p in range(5)}
    cfg = config(num_stages=2, reduce_gradients="every_micro_batch")

    def best(sums):
        return min(range(5), key=lambda p: _predict(cfg, segments, crossing, [p], (), sums)[0])

    assert best(None) == 2
    assert best(Sums((0.0, 0.0), (0.0, 6e-3))) == 3


@pytest.mark.ray
@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_auto_on_ray_times_the_segments_on_a_host(ray_runtime, monkeypatch, axis_types):
    """On Ray the segments are timed on the first stage mesh's host (which traces the step
    itself, and must agree with the driver's trace), not on the driver; the fastest two
    predictions are measured on the hosts (their arguments put there first); the step equals
    jax.jit. With Explicit axes the host traces on Auto ones, as the driver does to choose."""
    from jaxreshard.runtime.ray import _segments

    answers = []
    real = _segments.time_on_host

    def spy(*args, **kwargs):
        assert args[3].axis_types == ("auto",)  # (the host traces on Auto axes to choose)
        timer = real(*args, **kwargs)

        def timed(graph, split):
            answers.append(timer(graph, split))
            return answers[-1]

        return timed

    monkeypatch.setattr(_segments, "time_on_host", spy)
    step, report = auto_report(
        backend="ray",
        emulate_network_gbps=None,
        devices_per_host=None,
        partition_trials=2,
        mesh_axis_types=axis_types,
    )
    assert len(answers) == 1
    assert [t.cuts for t in report.trials[:2]] == [c.cuts for c in report.tried[:2]]
    assert all(t.measured > 0 for t in report.trials) and report.compute_scale is not None
    assert report.chosen == min(report.trials, key=lambda t: t.measured).cuts
    assert [cost for cost, _ in answers[0]] == report.segments
    assert len(report.segments) == len(WIDTHS) and all(c.forward > 0 for c in report.segments)
    assert_equal_to_jit(step)
