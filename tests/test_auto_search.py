"""`jaxreshard profile MODEL --auto`: the calibrated simulator ranks schedules and micro-batch
counts, the best few run beside plain data parallelism, and the measured fastest wins (never a
layout slower than data parallelism); its config is written as a profile TOML."""

import dataclasses
import itertools
import json
from math import comb

import jax
import numpy as np
import optax
import pytest

import jaxreshard as jr
from jaxreshard.cli import main
from jaxreshard.models import get_model
from jaxreshard.models._common import split_evenly
from jaxreshard.profiler import load_profile_config

BASE = ["profile", "gpt", "--no-progress", "--compile-cache", "off", "--steps", "1",
        "--warmup-steps", "1"]  # fmt: skip


def test_auto_measures_the_best_predictions_beside_data_parallelism(tmp_path, capsys, monkeypatch):
    toml, out = tmp_path / "winner.toml", tmp_path / "auto.json"
    flags = ["--auto", "--auto-top", "1", "--auto-toml", str(toml), "--json", str(out),
             "--auto-cuts", "keep", "--auto-virtual", "keep", "--layers", "2",
             "--auto-mixed", "1", "--auto-refine", "0"]  # fmt: skip
    assert main([*BASE, *flags]) == 0
    record = json.loads(out.read_text())
    labels = [row["label"] for row in record["measured"]]
    assert len(labels) == 2 and labels[-1] == "data parallel"
    # Every uniform stage mesh over the 4 devices, each calibrated: the configured 1x2 first;
    # then the mix of two of those meshes their calibrations estimate fastest.
    layouts = [entry["layout"] for entry in record["layouts"]]
    assert layouts[:3] == ["2 x 1x2", "2 x 1x1", "2 x 2x1"] and len(layouts) == 4
    assert all(len(entry["micro_batch_rows"]) == 2 for entry in record["layouts"])
    mixes = record["mixed_layouts"]
    assert len(mixes) == 6  # every ordered pair of the 3 shapes on 2 meshes, fastest first
    estimates = [m["estimate_seconds"] for m in mixes]
    assert estimates == sorted(estimates) and all(m["same_cut"] for m in mixes)
    assert [m["calibrated"] for m in mixes] == [True] + [False] * 5
    mixed = ", ".join("x".join(map(str, s)) for s in mixes[0]["stage_mesh_shape"])
    assert layouts[3] == mixed
    assert record["layouts"][3]["changes"]["stage_mesh_shape"] == mixes[0]["stage_mesh_shape"]
    assert any(p["label"].endswith(f"meshes {mixed}") for p in record["predicted"])
    configured = [p for p in record["predicted"] if "stage_mesh_shape" not in p["changes"]]
    assert len(configured) == 20  # 4 schedules x 1, 2, 4, 8, 16 micro-batches of 16 rows
    # The 2x1 meshes split a micro-batch over 2 devices: no one-row micro-batches there.
    wide = [p for p in record["predicted"] if p["changes"].get("stage_mesh_shape") == [2, 1]]
    assert wide and all(p["changes"]["num_micro_batches"] <= 8 for p in wide)
    assert all(p["label"].endswith("meshes " + e) for e in ["2 x 2x1"] for p in wide)
    # Ranked by plain steps (a training loop's), timed beside the recorded ones.
    assert record["ranked_by"] == "plain_step_seconds"
    assert all(r["plain_step_seconds"] > 0 for r in record["measured"])
    fastest = min(record["measured"], key=lambda r: r["plain_step_seconds"])
    assert record["winner"] == fastest["label"]
    dp = record["measured"][-1]["plain_step_seconds"]
    assert record["speedup_over_data_parallel"] == dp / fastest["plain_step_seconds"] >= 1.0
    assert len(record["calibration"]["micro_batch_rows"]) == 2  # 4 and 8 micro-batches
    assert record["refinements"] == []  # (--auto-refine 0)
    written = load_profile_config("gpt", toml).pipeline.to_dict()
    for key in ("schedule", "weight_delay", "num_micro_batches", "num_stages", "stage_mesh_shape"):
        assert json.loads(json.dumps(written[key])) == record["winner_pipeline"][key], key
    assert "winner:" in capsys.readouterr().out
    # Every prediction has a memory estimate; the measured rows carry theirs (data parallelism,
    # not calibrated, has none).
    peaks = [p["estimated_peak_bytes"] for p in configured]
    assert all(isinstance(b, int) and b > 0 for b in peaks)
    assert all(r["estimated_peak_bytes"] for r in record["measured"][:-1])
    assert record["measured"][-1]["estimated_peak_bytes"] is None and not record["over_memory_cap"]

    # Under a cap between the configured layout's least and most, the search measures only
    # what fits, and lists the others. Without plain steps, the timed ones rank them. A
    # finalist that fails (here data parallelism, out of memory as it compiles) is dropped
    # with its error, and the others are ranked.
    from jaxreshard import profiler

    warm_up = profiler.Session.warm_up

    def failing_warm_up(self):
        if self.label == "data parallel":
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while allocating")
        return warm_up(self)

    monkeypatch.setattr(profiler.Session, "warm_up", failing_warm_up)
    cap = (min(peaks) + max(peaks)) / 2
    config = tmp_path / "capped.toml"
    config.write_text(f"[pipeline]\nmemory_cap_gib = {cap / (1 << 30)!r}\n")
    flags = ["--auto", "--auto-meshes", "keep", "--auto-top", "1", "--json", str(out),
             "--auto-cuts", "keep", "--auto-virtual", "keep", "--layers", "2",
             "--plain-steps", "0", "--auto-refine", "0"]  # fmt: skip
    assert main([*BASE, "--config", str(config), *flags]) == 0
    capped = json.loads(out.read_text())
    assert capped["ranked_by"] == "step_seconds"
    assert all(r["plain_step_seconds"] is None for r in capped["measured"])
    fastest = min(capped["measured"], key=lambda r: r["step_seconds"])
    assert capped["winner"] == fastest["label"]
    assert capped["over_memory_cap"] and capped["predicted"]
    assert all(p["estimated_peak_bytes"] <= cap for p in capped["predicted"])
    assert all(o["estimated_peak_bytes"] > cap for o in capped["over_memory_cap"])
    assert [f["label"] for f in capped["failed"]] == ["data parallel"]
    assert "out of memory" in capped["failed"][0]["error"]
    assert [r["label"] for r in capped["measured"]] == [capped["winner"]]
    assert capped["speedup_over_data_parallel"] is None
    printed = capsys.readouterr().out
    assert "predictions over memory_cap_gib=" in printed
    assert "failed, not ranked" in printed and "no data-parallel baseline: it failed" in printed


def test_mixed_meshes_are_estimated_from_the_uniform_calibrations():
    """Stage 0 is fast on meshes of shape A, stage 1 on B: the mix (A, B) is estimated
    fastest, from each stage's costs on its own mesh; mixes the hosts cannot hold (a mesh
    across a host's edge, more devices than there are) are not considered."""
    from jaxreshard.pipeline import Costs
    from jaxreshard.profiler._auto_fit import CostModel
    from jaxreshard.profiler._auto_mixed import mixed_layouts, placeable

    def model(f0, f1, comm=0.001):
        costs = Costs(forward=(f0, f1), backward=(2 * f0, 2 * f1), weight_grad=(f0, f1),
                      comm=(comm,), apply=(0.0, 0.0))  # fmt: skip
        return CostModel([(4, costs)], 0.002)

    a, b = (2, 1), (1, 2)
    sources = [(a, model(0.010, 0.040), None), (b, model(0.040, 0.010), None)]
    mixes = mixed_layouts(sources, 2, 4, 2, "1f1b", False, 4, 4)
    assert [m["stage_mesh_shape"] for m in mixes] == [[[2, 1], [1, 2]], [[1, 2], [2, 1]]]
    fast, slow = (m["estimate_seconds"] for m in mixes)
    assert fast < 0.5 * slow  # every stage 10 ms against 40 ms a forward
    # A third shape of one device: (1x1, 2x1) would cross the first host's edge.
    one = (1, 1)
    sources.append((one, model(0.020, 0.020), None))
    shapes = [m["stage_mesh_shape"] for m in mixed_layouts(sources, 2, 4, 2, "1f1b", False, 4, 4)]
    assert [[1, 1], [2, 1]] not in shapes and [[2, 1], [1, 1]] in shapes
    assert not placeable([(1, 1), (1, 2)], 4, 2) and placeable([(1, 2), (1, 1)], 4, 2)
    assert placeable([(1, 2), (2, 2)], 8, 2) and not placeable([(2, 2), (2, 2)], 6, 2)
    assert not placeable([(1, 1), (2, 2)], 8, 2)  # 4 devices from the middle of a host
    assert mixed_layouts(sources[:1], 2, 4, 2, "1f1b", False, 4, 4) == []  # nothing to mix
    # An interleaved schedule configured with one model stage per mesh estimates as such.
    assert mixed_layouts(sources, 2, 4, 2, "interleaved_1f1b", False, 4, 4)
    # Many shapes on many meshes: the mixes the hosts hold are found, not capped away.
    four = CostModel([(4, Costs.make(4, forward=0.01, backward=0.02, comm=0.001))], 0.002)
    many = [((1, n), four, None) for n in (1, 2, 4, 8)]
    found = mixed_layouts(many, 4, 32, 8, "1f1b", False, 8, 4)
    shapes = [(1, n) for n in (1, 2, 4, 8)]
    held = [m for m in itertools.product(shapes, repeat=4) if placeable(m, 32, 8)]
    assert len(found) == sum(len(set(m)) > 1 for m in held) == 90


def test_the_search_calibrates_where_its_shortlist_extrapolates(monkeypatch):
    """Calibrated at 4 and 8 micro-batches of a 16-row batch, a layout whose actions cost
    1 ms a row on the line through them is predicted fastest at 16 micro-batches (1 row),
    outside its points. The search calibrates 16: there the actions cost 10 ms, so the
    prediction drops, a calibrated count wins and the refinement stops. One that fails is left
    out of the ranking; with no budget nothing is calibrated."""
    from jaxreshard.pipeline import Costs
    from jaxreshard.profiler import _auto
    from jaxreshard.profiler._auto_fit import CostModel, pair

    def costs(ms):
        return Costs.make(2, forward=ms / 1e3, backward=2 * ms / 1e3, comm=ms / 1e4)

    pc = load_profile_config("gpt")
    assert pc.run.batch_size == 16
    calibrated = [{"layout": "2 x 1x2", "changes": {}, "memory": None,
                   "measured": [(4, costs(4.0), 0.0), (2, costs(2.0), 0.0)]}]  # fmt: skip
    ranked = _auto._ranked(pc, calibrated)
    best = ranked.predictions[0]
    assert (best.micro_batches, best.extrapolated) == (16, True)
    assert all(p.extrapolated == (p.micro_batches not in (4, 8)) for p in ranked.predictions)
    added = []

    def add_point(pc_, entry, m, *args):
        added.append(m)
        entry["measured"].append((16 // m, costs(10.0 * 16 // m if m < 16 else 10.0), 0.0))

    monkeypatch.setattr(_auto, "_add_point", add_point)
    same, none = _auto._refine(pc, calibrated, ranked, 1, 0, None, None, False)
    assert same is ranked and none == [] and added == []
    after, done = _auto._refine(pc, calibrated, ranked, 1, 3, None, None, False)
    assert added == [16] and [r["micro_batches"] for r in done] == [16]
    assert done[0]["predicted_after"] > done[0]["predicted_before"]
    assert after.predictions[0].micro_batches in (4, 8)
    assert len(calibrated[0]["measured"]) == 3
    # The fit between points takes the nearer pair: at 1 row the refined point as measured.
    model = CostModel.fit(calibrated[0]["measured"])
    assert model.at(1).forward == (0.010, 0.010) and model.at(3).forward == (0.003, 0.003)
    assert pair([4, 2, 1], 3) == (1, 0) and pair([4, 2, 1], 8) == (1, 0)
    assert pair([4, 2, 1], 1) == (2, 1)
    # The step's fixed cost is fitted so too: each point's own where it was measured.
    # (It grows with the micro-batch count: 10 ms at 4 micro-batches, 20 at 8, 40 at 16.)
    model = CostModel.fit([(4, costs(4.0), 0.010), (2, costs(2.0), 0.020)])
    assert model.overhead_at(4) == 0.010 and model.overhead_at(2) == 0.020
    assert abs(model.overhead_at(1) - 0.040) < 1e-12
    assert abs(model.overhead_at(3) - 0.040 / 3) < 1e-12
    noisy = CostModel.fit([(4, costs(4.0), 0.020), (2, costs(2.0), 0.010)])  # (fewer with more)
    assert noisy.overhead_at(1) == 0.010 and noisy.overhead_at(8) == 0.020  # (flat outside)
    # The memory estimate takes the same pair: residuals 100 bytes a row from 2 rows up, 300
    # at 1 row (a point the line through 2 and 4 would put at 100).
    from jaxreshard.profiler._auto_memory import LayoutMemory
    from jaxreshard.runtime.step._memory import SegmentMemory

    memory = LayoutMemory([(r, [SegmentMemory(7, b, 0, 0)], [b]) for r, b in
                           ((4, 400), (2, 200), (1, 300))])  # fmt: skip
    assert [m.residuals for m in memory.at(3)[0]] == [300] and memory.at(1)[1] == [300]
    assert memory.at(8)[0][0] == SegmentMemory(7, 800, 0, 0)

    def failing(pc_, entry, m, *args):
        raise RuntimeError(f"no {m}")

    monkeypatch.setattr(_auto, "_add_point", failing)
    calibrated[0]["measured"] = calibrated[0]["measured"][:2]
    after, done = _auto._refine(pc, calibrated, _auto._ranked(pc, calibrated), 1, 3, None,
                                None, False)  # fmt: skip
    assert done[0]["error"].endswith("no 16")
    assert 16 not in {p.micro_batches for p in after.predictions}
    assert calibrated[0]["failed_points"].keys() >= {16}


def test_a_layout_calibrates_its_points_in_turns_and_adds_one_where_asked(monkeypatch):
    """On the local runtime: a layout's two points and its fused-backward run step together
    (a point of each, its memory estimate, the other kind's costs); a refined point runs on
    its own and joins them; the calibration's step is matched to a finalist run as
    calibrated only. Where the second point does not build beside the first, the points run
    one at a time; where the other kind fails in a step, it is left out and the layout kept."""
    from jaxreshard import profiler
    from jaxreshard.profiler import _auto

    pc = load_profile_config("gpt", None, {"run": {"steps": 2, "warmup_steps": 1},
                                           "model": {"layers": 2}})  # fmt: skip
    entry = _auto._calibrated(pc, {}, None, None, False, required=True)
    assert [rows for rows, _, _ in entry["measured"]] == [4, 2]
    assert len(entry["step_seconds"]) == 2 and len(entry["memory"].points) == 2
    assert entry["split"] and entry["other"].backward and "error" not in entry
    _auto._add_point(pc, entry, 2, None, None, False)
    assert [rows for rows, _, _ in entry["measured"]] == [4, 2, 8]
    assert len(entry["step_seconds"]) == 3 and len(entry["memory"].points) == 3
    split = {"schedule": "eager_1f1b", "weight_delay": True}
    run_as_calibrated = _auto.Prediction(0.1, "x", split, 0, 2, False)
    assert _auto._calibration_step(pc, entry, run_as_calibrated) == entry["step_seconds"][2]
    placed = dict(split, cost_forward=[0.01, 0.01])  # (its Ws placed otherwise)
    assert (
        _auto._calibration_step(pc, entry, dataclasses.replace(run_as_calibrated, changes=placed))
        is None
    )
    fused = {"schedule": "eager_1f1b", "weight_delay": False}
    assert (
        _auto._calibration_step(pc, entry, dataclasses.replace(run_as_calibrated, changes=fused))
        is None
    )

    warm_up, step = profiler.Session.warm_up, profiler.Session.step

    def no_second(self):
        if self.pc.pipeline.num_micro_batches == 8 and not hasattr(no_second, "once"):
            no_second.once = True
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
        return warm_up(self)

    def fused_fails(self, **kwargs):
        if not self.pc.pipeline.split_backward:
            raise RuntimeError("a step failed")
        return step(self, **kwargs)

    monkeypatch.setattr(profiler.Session, "warm_up", no_second)
    monkeypatch.setattr(profiler.Session, "step", fused_fails)
    alone = _auto._calibrated(pc, {}, None, None, False, required=True)
    assert no_second.once and [rows for rows, _, _ in alone["measured"]] == [4, 2]
    assert alone["other"] is None and "error" not in alone
    monkeypatch.setattr(profiler.Session, "warm_up", warm_up)
    together = _auto._calibrated(pc, {}, None, None, False, required=True)
    assert together["other"] is None and len(together["measured"]) == 2


def test_the_fit_predicts_the_other_kind_of_backward_from_its_first_point():
    """Calibrated with a split backward (B 6 ms + W 4 ms a micro-batch of 4 rows, half that
    at 2), and once fused at the first point (8 ms: 2 ms less than B + W), a fused schedule's
    backward is the fitted B + W less 2 ms at every row count; calibrated fused, a split
    schedule's is the fused one plus that, its W the split run's share (40%)."""
    from jaxreshard.pipeline import Costs
    from jaxreshard.profiler._auto_fit import CostModel

    def costs(b, w=0.0):
        return Costs.make(1, forward=0.001, backward=b, weight_grad=w or b / 2)

    def parts(c):
        return c.forward, c.backward, c.weight_grad

    split = [(4, costs(0.010, 0.004), 0.0), (2, costs(0.005, 0.002), 0.0)]
    model = CostModel.fit(split, True, costs(0.008))
    assert parts(model.at(4)) == parts(model.at(4, True)) == parts(split[0][1])
    assert model.at(4, False).backward == (0.008,)
    assert abs(model.at(2, False).backward[0] - 0.003) < 1e-12  # 5 ms less the 2 ms
    assert model.at(2, False).forward == model.at(2).forward
    assert parts(CostModel.fit(split).at(4, False)) == parts(split[0][1])  # (no other run)
    fused = [(4, costs(0.008), 0.0), (2, costs(0.004), 0.0)]
    model = CostModel.fit(fused, False, costs(0.010, 0.004))
    at = model.at(2, True)
    assert abs(at.backward[0] - 0.006) < 1e-12 and abs(at.weight_grad[0] - 0.0024) < 1e-12
    assert model.at(2, False) == model.at(2)


def test_auto_refuses_what_it_does_not_go_with(capsys):
    assert main([*BASE, "--auto", "--compare-schedules"]) == 2
    assert "--auto searches layouts on its own" in capsys.readouterr().err
    assert main([*BASE, "--auto-toml", "x.toml"]) == 2
    assert "--auto-toml FILE writes the winner of --auto; add --auto" in capsys.readouterr().err


def test_the_cost_fit_predicts_its_calibration_points_as_measured():
    """Two calibration points give a line where its fixed and per-row parts are >= 0; where
    noise makes one negative, the fit still predicts each point as measured (it once put a
    2-row point at 2.4x its measurement, from a clamped line through a 4-row point)."""
    from jaxreshard.profiler._auto_fit import _fit

    assert _fit(2, 10.0, 4, 14.0, 1) == 8.0  # a line: 6 ms fixed + 2 ms a row
    assert _fit(2, 11.0, 4, 37.5, 2) == 11.0 and _fit(2, 11.0, 4, 37.5, 4) == 37.5
    assert _fit(2, 11.0, 4, 37.5, 1) == 5.5 and _fit(2, 11.0, 4, 37.5, 8) == 75.0
    assert _fit(2, 10.0, 4, 8.0, 3) == 9.0 and _fit(2, 10.0, 4, 8.0, 1) == 10.0


def test_auto_chooses_the_cut_on_each_layout_and_searches_virtual_stages(tmp_path, capsys):
    """By default the search lets `partition="auto"` cut the model (a `jr.stage_candidate`
    after every layer) on each layout, with one and with two model stages per mesh; every
    later run of a layout (its second calibration point, the measured predictions, the written
    winner) takes the cut the first chose, and delayed weight gradients are placed with the
    costs the prediction used."""
    toml, out = tmp_path / "winner.toml", tmp_path / "auto.json"
    flags = ["--auto", "--auto-meshes", "keep", "--auto-top", "1", "--layers", "4",
             "--auto-toml", str(toml), "--json", str(out), "--plain-steps", "0"]  # fmt: skip
    assert main([*BASE, *flags]) == 0
    record = json.loads(out.read_text())
    one, two = record["layouts"]
    assert one["layout"] == two["layout"] == "2 x 1x2"
    assert len(one["cuts"]) == 1 and 0 <= one["cuts"][0] <= 2  # 2 stages of 4 layers
    assert two["cuts"] == [0, 1, 2]  # 4 model stages of 4 layers: the only cut
    assert two["changes"]["virtual_stages"] == 2 and two["changes"]["num_stages"] == 4
    for entry in (one, two):
        assert entry["changes"]["partition"] == "manual"
        assert entry["changes"]["cuts"] == entry["cuts"]
        assert entry["micro_batch_rows"][:2] == [4, 2]  # 4 and 8 micro-batches of 16 rows
        # Split backwards (eager + weight delay), and once with a fused one at 4.
        assert entry["split_backward"] and entry["other_backward_costs"]["backward"]
    # Where the best prediction's micro-batches lay outside its layout's calibration points,
    # the search calibrated that count too (at most 3 times), and re-ranked.
    added = [r for r in record["refinements"] if "error" not in r]
    assert len(one["micro_batch_rows"]) + len(two["micro_batch_rows"]) == 4 + len(added)
    assert len(record["refinements"]) <= 3  # (--auto-refine's default)
    assert len(record["refinements"]) == 3 or not record["predicted"][0]["extrapolated"]
    for r in record["refinements"]:
        assert r["micro_batches"] not in (4, 8) and r["predicted_before"] > 0
    labels = [p["label"] for p in record["predicted"]]
    assert any(label.startswith("zbv (v=2)") for label in labels)
    assert any(label.startswith("eager_1f1b + weight delay,") for label in labels)
    for p in record["predicted"]:
        v2 = p["changes"].get("virtual_stages") == 2
        assert p["changes"]["cuts"] == (two if v2 else one)["cuts"], p
        assert p["label"].endswith(f"cuts {p['changes']['cuts']}"), p
        placed, schedule = p["changes"].get("cost_forward"), p["changes"]["schedule"]
        if schedule == "zb_h1" or (p["changes"]["weight_delay"] and schedule != "zbv"):
            assert placed is not None and len(placed) == (4 if v2 else 2), p
            assert all(0 < x < 1 for x in placed), p  # seconds per micro-batch
        else:  # (no Ws, or ZB-V's and DualPipeV's fixed order: nothing to place)
            assert placed is None, p
    assert "partition='auto' cuts after layers" in capsys.readouterr().out
    winner = load_profile_config("gpt", toml)
    if record["winner"] != "data parallel":
        assert winner.pipeline.cuts is not None and winner.candidates
        assert list(winner.pipeline.cuts) == record["winner_pipeline"]["cuts"]
    else:
        assert winner.pipeline.num_stages == 1 and not winner.candidates


def test_cut_options():
    from jaxreshard.profiler._auto import cut_options

    pc = load_profile_config("gpt", None, {"model": {"layers": 4}})
    auto = {"partition": "auto", "cuts": None, "partition_trials": 0}  # (the prediction alone)
    even = {"partition": "manual", "cuts": None}
    # The other count is calibrated with a split backward, so its Ws are measured.
    v2 = {"num_stages": 4, "virtual_stages": 2, "schedule": "eager_interleaved_1f1b",
          "weight_delay": True}  # fmt: skip
    assert cut_options(pc, True, True) == [auto, {**auto, **v2}]
    assert cut_options(pc, False, True) == [{}, v2]
    assert cut_options(pc, True, False) == [auto]
    # Too few layers for two model stages per mesh: one count only.
    small = load_profile_config("gpt", None, {"model": {"layers": 3}})
    assert cut_options(small, True, True) == [auto]
    # A config of virtual stages tries one stage per mesh too.
    zbv = pc.replace_pipeline(schedule="zbv", num_stages=4)
    one = {"num_stages": 2, "virtual_stages": None, "schedule": "eager_1f1b",
           "weight_delay": True}  # fmt: skip
    assert cut_options(zbv, True, True) == [auto, {**auto, **one}]
    # Configured cuts are kept for the configured stage count; the other count cuts evenly.
    mine = pc.replace_pipeline(cuts=(2,))
    # A config's cuts say how many stages, where num_stages is not given.
    three = load_profile_config("gpt", None, {"model": {"layers": 4},
                                              "pipeline": {"cuts": [0, 2]}})  # fmt: skip
    assert three.num_stages == 3 and three.candidates
    assert cut_options(mine, False, True) == [{}, {**even, **v2}]
    # One stage: nothing to choose (partition='auto' needs two); two per mesh: 2 stages.
    single = pc.replace_pipeline(num_stages=1)
    two = {**v2, "num_stages": 2}
    assert cut_options(single, True, True) == [even, {**auto, **two}]
    # More ways to cut than the partitioner predicts one by one (23 layers into 8 stages): it
    # searches them (until 2026-11-30 such a count was cut evenly).
    deep = load_profile_config("gpt", None, {"model": {"layers": 24},
                                             "pipeline": {"num_stages": 8}})  # fmt: skip
    assert comb(23, 7) > 20_000 and cut_options(deep, True, False) == [auto]


def test_a_layout_whose_cuts_all_exceed_the_cap_is_still_calibrated(tmp_path, capsys):
    """partition='auto' refuses every cut over the memory cap; the search then chooses the cut
    without it and leaves the cap to its predictions (here none fits: the search's error)."""
    config = tmp_path / "capped.toml"
    config.write_text("[pipeline]\nmemory_cap_gib = 1e-05\n")
    flags = ["--auto", "--auto-meshes", "keep", "--auto-virtual", "keep", "--plain-steps", "0"]
    assert main([*BASE, "--config", str(config), *flags]) != 0
    out = capsys.readouterr()
    assert "no cut fits the memory cap at 4 micro-batches" in out.out
    assert "profile --auto: no configuration fits in memory_cap_gib=1e-05" in out.err


def test_a_comparison_runs_one_cut_chosen_once():
    """--compare-schedules with partition='auto': every variant of one model-stage count runs
    the cut the first chose (each session would choose anew, from noisy timings)."""
    from jaxreshard.profiler._compare import pin_cuts

    pc = load_profile_config("gpt", None, {"model": {"layers": 4},
                                           "pipeline": {"partition": "auto"}})  # fmt: skip
    configs = [("a", pc), ("b", pc.replace_pipeline(schedule="1f1b", weight_delay=False)),
               ("c", pc.replace_pipeline(partition="manual", cuts=(0,)))]  # fmt: skip
    pinned = pin_cuts(configs)
    (_, a), (_, b), (_, c) = pinned
    assert a.pipeline.partition == b.pipeline.partition == "manual"
    assert a.pipeline.cuts == b.pipeline.cuts and len(a.pipeline.cuts) == 1
    assert c.pipeline.cuts == (0,) and b.pipeline.schedule == "1f1b"


@pytest.mark.parametrize(
    "name, sizes",
    [("gpt", {}), ("utransformer", {"image": 8, "base": 8, "channel_mult": (1, 2)})],
)
def test_the_models_mark_a_candidate_after_every_layer_and_cut_there_as_configured(name, sizes):
    """`train_step(..., candidates=True)` cuts where `PipelineConfig(cuts=...)` says: the
    even cut chosen by number trains exactly as the model's own even `jr.stage_boundary`
    does, and as `jax.jit`; the last layer is no candidate. (The U-Transformer's skips cross
    the cut.)"""
    spec = get_model(name)
    module, cfg = spec.module, dataclasses.replace(spec.presets["tiny"], **sizes)
    units = spec.num_units(cfg)
    params = module.init_params(cfg, 0)
    sgd = optax.sgd(0.1)  # (Adam's first update, lr * sign(g), magnifies float noise near g = 0)
    opt = sgd.init(params)
    batch = module.synthetic_batch(cfg, 4, 0)
    config = jr.PipelineConfig(num_stages=2, num_micro_batches=2)
    even = jr.parallelize(module.train_step(cfg, 2, sgd), config=config, batch_argnums=(2,))
    by_number = jr.parallelize(
        module.train_step(cfg, 2, sgd, candidates=True),
        config=config.replace(cuts=tuple(sorted(split_evenly(units, 2)))),
        batch_argnums=(2,),
    )
    a, b = even(params, opt, batch), by_number(params, opt, batch)
    c = jax.jit(module.train_step(cfg, 1, sgd))(params, opt, batch)
    for x, y, z in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(c)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        np.testing.assert_allclose(np.asarray(x), np.asarray(z), rtol=2e-5, atol=1e-6)
    past = jr.parallelize(
        module.train_step(cfg, 2, sgd, candidates=True),
        config=config.replace(cuts=(units - 1,)),
        batch_argnums=(2,),
    )
    with pytest.raises(ValueError, match=str(units - 1)):
        past(params, opt, batch)
