"""End-to-end profiles: GPT and U-Transformer trained by `jaxreshard profile`.

Each test trains a tiny model for real (local runtime, or the shared Ray runtime) and checks
what a user relies on: the loss falls, every schedule computes the same losses, local and Ray
agree, and the JSON, the Chrome trace and the PNG are what they claim to be.
"""

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxreshard import profiler
from jaxreshard.cli import main
from jaxreshard.profiler import load_profile_config

SCHEDULES = [
    ("1f1b", {"schedule": "1f1b", "weight_delay": False}),
    ("1f1b+wd", {"schedule": "1f1b", "weight_delay": True}),
    ("gpipe", {"schedule": "gpipe", "weight_delay": False}),
    ("eager", {"schedule": "eager_1f1b", "weight_delay": False}),
    ("eager+wd", {"schedule": "eager_1f1b", "weight_delay": True}),
    ("zb_h1", {"schedule": "zb_h1", "weight_delay": False}),
]


def gpt_config(**pipeline):
    # GPT `tiny` with a layer per stage (the fewest to compile).
    layers = max(2, pipeline.get("num_stages", 2))
    return load_profile_config(
        "gpt",
        None,
        {
            "model": {"layers": layers},
            "run": {"steps": 4, "batch_size": 8},
            "pipeline": {"num_micro_batches": 4, **pipeline},
        },
    )


def test_gpt_profile_cli_writes_json_trace_and_png(tmp_path, capsys, monkeypatch):
    out, trace, png = tmp_path / "p.json", tmp_path / "t.json", tmp_path / "p.png"
    compiles = []  # the warm-up's compile time, and the untimed first plain call's
    warm_up, plain_step = profiler.Session.warm_up, profiler.Session.plain_step

    def timed_warm_up(self):
        warm_up(self)
        compiles.append(self.compile_seconds)

    def plain_step_seen(self, *, timed=True):
        record = plain_step(self, timed=timed)
        if not timed:
            compiles.append(record.seconds)
        return record

    monkeypatch.setattr(profiler.Session, "warm_up", timed_warm_up)
    monkeypatch.setattr(profiler.Session, "plain_step", plain_step_seen)
    code = main(
        [
            "profile", "gpt", "--steps", "20", "--compile-cache", "off", "--no-progress",
            "--json", str(out), "--trace", str(trace), "--plot", str(png),
        ]
    )  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    for word in ("tokens/s", "model TFLOP/s", "blocked in receives", "boundary tensors", "act"):
        assert word in text
    result = json.loads(out.read_text())
    assert result["format"] == "jaxreshard-profile/1"
    assert result["model"] == "gpt" and result["schedule"] == "eager_1f1b"
    losses = [s["loss"] for s in result["steps"]]
    assert len(losses) == 20 and all(s["seconds"] > 0 for s in result["steps"])
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.1  # it learns
    # Plain steps took turns with the timed ones and trained nothing: each computed the loss
    # of the next timed step (the same state and batch), and the table shows their median.
    plain = result["plain_steps"]
    assert len(plain) == 20 and result["plain_step_seconds"] > 0 and "plain step" in text
    # The compile time includes the first plain call's, which compiles what only it runs.
    assert len(compiles) == 2 and result["compile_seconds"] == pytest.approx(sum(compiles))
    np.testing.assert_allclose([s["loss"] for s in plain[:-1]], losses[1:], rtol=1e-5)
    assert result["samples_per_second"] > 0 and result["units_per_second"] > 0
    assert result["flops_per_step"] > 1e6
    assert len(result["stages"]) == 2
    for stage in result["stages"]:
        assert stage["compute_seconds"] > 0
        assert 0 <= stage["bubble_fraction"] < 1 and stage["blocked_seconds"] >= 0
    tensors = {t["name"]: t for t in result["boundary_tensors"]}
    act = [t for t in tensors.values() if t["kind"] == "act"]
    assert act and all(t["measured_seconds"] > 0 and t["per_step"] == 4 for t in act)
    # The token batch's targets are sliced on the last stage, not sent.
    assert all(t["dtype"] == "float32" for t in act)
    # The tied embedding is copied to the last stage and its gradient sent back.
    assert any(t["kind"] == "param" for t in tensors.values())
    assert any(t["kind"] == "param_grad" for t in tensors.values())

    events = json.loads(trace.read_text())["traceEvents"]
    processes = {e["pid"] for e in events if e.get("name") == "process_name"}
    assert processes == {0, 1}
    names = {e["name"] for e in events if e.get("ph") == "X"}
    assert {"F3", "B3", "W3", "send act mb3 s0->s1", "send grad mb3 s1->s0"} <= names
    lanes = {(e["pid"], e["args"]["name"]) for e in events if e.get("name") == "thread_name"}
    assert {(0, "compute"), (0, "transfers out"), (1, "blocked")} <= lanes
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "flags",
    [[], ["--optimizer", "adamw", "--weight-decay", "0.01", "--clip-norm", "1.0"]],
    ids=["default_adam", "adamw_clipped"],
)
def test_gpt_profile_trains_with_optax(tmp_path, flags):
    out = tmp_path / "p.json"
    args = ["profile", "gpt", "--steps", "3", "--no-progress", "--json", str(out)]
    assert main([*args, "--compile-cache", "off", *flags]) == 0
    result = json.loads(out.read_text())
    losses = [s["loss"] for s in result["steps"]]
    assert len(losses) == 3 and losses[-1] < losses[0]
    run = result["config"]["run"]
    assert run["optimizer"] == ("adamw" if flags else "adam")
    assert run["clip_norm"] == (1.0 if flags else None)


def test_without_plain_steps_a_profile_runs_only_timed_ones():
    pc = load_profile_config(
        "gpt", None, {"model": {"layers": 2}, "run": {"steps": 2, "plain_steps": 0}}
    )
    result = profiler.run_profile(pc)
    assert result["plain_steps"] == [] and result["plain_step_seconds"] is None
    assert len(result["steps"]) == 2


def test_a_plain_step_that_fails_says_so_and_how_to_skip_them(monkeypatch):
    def fail(self, *, timed=True):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while allocating")

    monkeypatch.setattr(profiler.Session, "plain_step", fail)
    pc = load_profile_config("gpt", None, {"model": {"layers": 2}, "run": {"steps": 2}})
    with pytest.raises(RuntimeError, match=r"a plain step .* failed: .*out of memory.*--plain-s"):
        profiler.run_profile(pc)


def test_profile_state_is_sharded_like_the_parameters_and_compiles_once():
    """Optax makes the state from the placed parameters, so every moment has its parameter's
    sharding (same mesh, same spec) after each step, and no step after the first recompiles."""
    session = profiler.Session(gpt_config())
    session.warm_up()
    for _ in range(2):
        session.step()
    assert len(session.pstep._cache) == 1
    params = dict(jax.tree_util.tree_flatten_with_path(session.params)[0])
    adam = session.opt[0]  # optax.adam: (ScaleByAdamState, EmptyState)
    for moments in (adam.mu, adam.nu):
        for path, leaf in jax.tree_util.tree_flatten_with_path(moments)[0]:
            param = params[path]
            assert leaf.sharding.device_set == param.sharding.device_set, path
            assert leaf.sharding.is_equivalent_to(param.sharding, leaf.ndim), path


def test_timed_steps_compile_nothing_after_the_warm_up():
    """Warm-up steps run the way timed steps do (recorded, the last stage's forward and backward
    apart): a timed step that compiled would put seconds of compile into a step time."""
    compiles = []

    def listen(event, seconds, **kwargs):
        if event.startswith("/jax/core/compile/"):
            compiles.append(event)

    session = profiler.Session(gpt_config(schedule="1f1b"))  # the last stage fuses F and B
    session.warm_up()
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        session.step()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []


def test_every_schedule_trains_identically():
    """All schedules (with and without weight delay) compute the same losses, which fall; the
    ones that place delayed weight gradients are built with the costs a calibration run
    measured (one per stage, in seconds), the others have no placement."""
    from jaxreshard.profiler._report import comparison_table

    rows = profiler.compare(gpt_config(), SCHEDULES, bound=False, measure_placement=True)
    assert [r["label"] for r in rows] == [label for label, _ in SCHEDULES]
    # Each variant timed plain steps (a training loop's) beside its timed ones.
    assert [c.header for c in comparison_table(rows, "t").columns][4:6] == [
        "plain step",
        "plain speedup",
    ]
    for row in rows:
        assert row["max_loss_difference"] < 1e-5, row
        assert row["step_seconds"] > 0 and row["plain_step_seconds"] > 0
        assert row["plain_speedup"] == pytest.approx(
            rows[0]["plain_step_seconds"] / row["plain_step_seconds"]
        )
        assert row["predicted_seconds"] > 0
        placed = row["placement_costs"]
        if row["label"] in ("1f1b", "gpipe", "eager"):
            assert placed is None, row["label"]
            continue
        for field in ("forward", "backward", "weight_grad"):
            values = placed[field]
            # Seconds per micro-batch: a compile measured into them would exceed a whole step.
            assert len(values) == 2, (row["label"], placed)
            assert all(0 < v < row["step_seconds"] for v in values), (row["label"], placed)
        assert all(w <= b for w, b in zip(placed["weight_grad"], placed["backward"]))
        assert placed["forward"] != [1.0, 1.0]  # measured seconds, not the default units
    # One calibration for the one model cut: every placing variant has the same costs.
    placed = [r["placement_costs"] for r in rows if r["placement_costs"] is not None]
    assert all(p == placed[0] for p in placed)


def test_which_costs_place_weight_gradients():
    """auto measures unless a cost_* field is set; per-stage costs that do not fit a variant's
    model cut are dropped only where the variant places no W (they would only order sends)."""
    from jaxreshard.profiler import _costs_that_fit

    def pc(run=None, **pipeline):
        return load_profile_config("gpt", None, {"run": run or {}, "pipeline": pipeline})

    assert profiler.measures_placement(pc())
    assert not profiler.measures_placement(pc(cost_forward="2"))
    assert not profiler.measures_placement(pc({"placement_costs": "config"}))
    assert profiler.measures_placement(pc({"placement_costs": "measured"}, cost_forward="2"))

    costs = {"cost_forward": "1,1,1,1", "cost_comm": "1,1,1"}  # for 4 model stages
    plain = pc(num_stages=2, schedule="1f1b", weight_delay=False, **costs)
    assert _costs_that_fit(plain).pipeline.cost_forward == 1.0  # dropped: 1F1B places no W
    placing = pc(num_stages=2, **costs)  # eager-1F1B + weight delay
    assert _costs_that_fit(placing).pipeline.cost_forward == (1.0,) * 4  # kept: the runtime errs


def test_step_overhead_is_the_time_outside_the_actions():
    from jaxreshard.profiler._measured import step_overhead
    from jaxreshard.profiler._run import StepRecord
    from jaxreshard.runtime.engine._events import Event

    def record(seconds, first, last):
        return StepRecord(seconds, 0.0, [Event(0, "F", 0, first, last, "F")])

    steps = [record(1.0, 0.1, 0.8), record(1.0, 0.05, 0.9), record(2.0, 0.2, 1.0)]
    assert step_overhead(steps) == pytest.approx(0.3)  # median of 0.3, 0.15, 1.2


def test_schedule_comparison_with_virtual_stages_runs_every_schedule_on_the_same_meshes():
    """A virtual-stage config compares one-stage-per-mesh schedules with the model cut per mesh
    against the virtual-stage ones with it cut v per mesh: all on 2 meshes, all equal losses."""
    pc = gpt_config(num_stages=4, schedule="zbv", virtual_stages=2)
    pc = dataclasses.replace(pc, run=dataclasses.replace(pc.run, plain_steps=0))
    variants = profiler.schedule_variants(pc)
    labels = [label for label, _ in variants]
    assert labels[0] == "1f1b" and "zbv (v=2)" in labels and "interleaved_1f1b (v=2)" in labels
    for label, changes in variants:
        vpc = pc.replace_pipeline(**changes)
        assert vpc.pipeline.num_meshes(vpc.num_stages) == 2, label
    rows = profiler.compare(pc, variants, bound=False)
    assert [r["label"] for r in rows] == labels
    for row in rows:
        assert row["max_loss_difference"] < 1e-5, row


def test_utransformer_profile_learns_with_skips_across_stages():
    small = {"base": 8, "channel_mult": (1, 2), "groups": 2}  # 5 units: quick to compile
    pc = load_profile_config(
        "utransformer",
        None,
        {"model": small, "run": {"steps": 6, "batch_size": 8}, "pipeline": {"num_stages": 3}},
    )
    result = profiler.run_profile(pc)
    losses = [s["loss"] for s in result["steps"]]
    assert losses[-1] < losses[0]
    # Skip connections from stage 0 reach stage 2 directly, past stage 1.
    jumps = [
        t
        for t in result["boundary_tensors"]
        if t["kind"] == "act" and t["dst_stage"] - t["src_stage"] > 1
    ]
    assert jumps, [t["name"] for t in result["boundary_tensors"]]


def test_signal_only_bound_leaves_training_alone():
    pc = gpt_config()
    plain = profiler.Session(pc)
    bounded = profiler.Session(pc)
    for s in (plain, bounded):
        s.warm_up()
    plain.step(), plain.step()
    bounded.step()
    bound = bounded.step(signal_only=True)
    bounded.step()
    assert [s.loss for s in plain.steps] == [s.loss for s in bounded.steps]
    assert bound.loss != bounded.steps[-1].loss  # the bound's own loss is meaningless
    sends = [e for e in bound.events if e.kind == "send"]
    assert sends and all(e.nbytes == 0 for e in sends)


def test_emulated_network_delays_transfers():
    gbps = 0.05
    pc = gpt_config(emulate_network_gbps=gbps)
    result = profiler.run_profile(pc)
    assert result["emulate_network_gbps"] == gbps
    big = max(
        (t for t in result["boundary_tensors"] if t["kind"] == "act"), key=lambda t: t["bytes"]
    )
    # One host per stage: each transfer crosses an emulated NIC of `gbps` GB/s.
    assert big["measured_seconds"] >= big["bytes"] / (gbps * 1e9)


@pytest.mark.ray
@pytest.mark.parametrize("mesh", [(1, 2), (1, 1)])
def test_local_and_ray_give_the_same_losses(ray_runtime, mesh):
    """(1, 1): both stages on one host, whose Adam updates read the step count another stage
    of the host keeps."""
    pc = gpt_config(schedule="1f1b", weight_delay=True, stage_mesh_shape=mesh)
    local = profiler.run_profile(pc)
    ray = profiler.run_profile(pc.replace_pipeline(backend="ray"))
    assert ray["backend"] == "ray"
    a = np.array([s["loss"] for s in local["steps"]])
    b = np.array([s["loss"] for s in ray["steps"]])
    np.testing.assert_allclose(b, a, rtol=1e-5)
    sends = [t for t in ray["boundary_tensors"] if t["kind"] == "act"]
    assert sends and all(t["measured_seconds"] and t["measured_seconds"] > 0 for t in sends)


@pytest.mark.ray
def test_a_model_file_of_the_users_trains_on_ray_as_on_the_local_runtime(ray_runtime):
    """The step of a model loaded from a file (a module of its own, not installed on the
    hosts) travels to the Ray hosts by value."""
    example = str(Path(__file__).parent.parent / "examples" / "profile_model.py")
    pc = load_profile_config(
        example,
        None,
        {
            "model": {"layers": 2, "width": 32, "hidden": 64},
            "run": {"steps": 3, "batch_size": 8},
            "pipeline": {"num_micro_batches": 4, "stage_mesh_shape": (1, 2)},
        },
    )
    local = profiler.run_profile(pc, progress=False)
    ray = profiler.run_profile(pc.replace_pipeline(backend="ray"), progress=False)
    assert ray["backend"] == "ray" and ray["model"] == example
    a = np.array([s["loss"] for s in local["steps"]])
    np.testing.assert_allclose(np.array([s["loss"] for s in ray["steps"]]), a, rtol=1e-5)


@pytest.mark.ray
def test_signal_only_steps_on_ray_keep_training_intact(ray_runtime):
    pc = gpt_config(backend="ray")
    plain = profiler.Session(pc, runtime=ray_runtime)
    bounded = profiler.Session(pc, runtime=ray_runtime)
    for session in (plain, bounded):
        session.warm_up()
        session.step()
    bound = bounded.step(signal_only=True)
    plain.step()
    bounded.step()
    assert [s.loss for s in plain.steps] == [s.loss for s in bounded.steps]
    sends = [e for e in bound.events if e.kind == "send"]
    assert sends and all(e.nbytes == 0 for e in sends)
