"""`jaxreshard profile MODEL --auto`: the calibrated simulator ranks schedules and micro-batch
counts, the best few run beside plain data parallelism, and the measured fastest wins (never a
layout slower than data parallelism); its config is written as a profile TOML."""

import json

from jaxreshard.cli import main
from jaxreshard.profiler import load_profile_config

BASE = ["profile", "gpt", "--no-progress", "--compile-cache", "off", "--steps", "1",
        "--warmup-steps", "1"]  # fmt: skip


def test_auto_measures_the_best_predictions_beside_data_parallelism(tmp_path, capsys):
    toml, out = tmp_path / "winner.toml", tmp_path / "auto.json"
    flags = ["--auto", "--auto-top", "1", "--auto-toml", str(toml), "--json", str(out)]
    assert main([*BASE, *flags]) == 0
    record = json.loads(out.read_text())
    labels = [row["label"] for row in record["measured"]]
    assert len(labels) == 2 and labels[-1] == "data parallel"
    # Every uniform stage mesh over the 4 devices, each calibrated: the configured 1x2 first.
    layouts = [entry["layout"] for entry in record["layouts"]]
    assert layouts == ["2 x 1x2", "2 x 1x1", "2 x 2x1"]
    assert all(len(entry["micro_batch_rows"]) == 2 for entry in record["layouts"])
    configured = [p for p in record["predicted"] if "stage_mesh_shape" not in p["changes"]]
    assert len(configured) == 20  # 4 schedules x 1, 2, 4, 8, 16 micro-batches of 16 rows
    # The 2x1 meshes split a micro-batch over 2 devices: no one-row micro-batches there.
    wide = [p for p in record["predicted"] if p["changes"].get("stage_mesh_shape") == [2, 1]]
    assert wide and all(p["changes"]["num_micro_batches"] <= 8 for p in wide)
    assert all(p["label"].endswith("meshes " + e) for e in ["2 x 2x1"] for p in wide)
    fastest = min(record["measured"], key=lambda r: r["step_seconds"])
    assert record["winner"] == fastest["label"]
    dp = record["measured"][-1]["step_seconds"]
    assert record["speedup_over_data_parallel"] == dp / fastest["step_seconds"] >= 1.0
    assert len(record["calibration"]["micro_batch_rows"]) == 2  # 4 and 8 micro-batches
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
    # what fits, and lists the others.
    cap = (min(peaks) + max(peaks)) / 2
    config = tmp_path / "capped.toml"
    config.write_text(f"[pipeline]\nmemory_cap_gib = {cap / (1 << 30)!r}\n")
    flags = ["--auto", "--auto-meshes", "keep", "--auto-top", "1", "--json", str(out)]
    assert main([*BASE, "--config", str(config), *flags]) == 0
    capped = json.loads(out.read_text())
    assert capped["over_memory_cap"] and capped["predicted"]
    assert all(p["estimated_peak_bytes"] <= cap for p in capped["predicted"])
    assert all(o["estimated_peak_bytes"] > cap for o in capped["over_memory_cap"])
    assert "predictions over memory_cap_gib=" in capsys.readouterr().out


def test_auto_refuses_what_it_does_not_go_with(capsys):
    assert main([*BASE, "--auto", "--compare-schedules"]) == 2
    assert "--auto searches layouts on its own" in capsys.readouterr().err
    assert main([*BASE, "--auto-toml", "x.toml"]) == 2
    assert "--auto-toml FILE writes the winner of --auto; add --auto" in capsys.readouterr().err


def test_the_cost_fit_predicts_its_calibration_points_as_measured():
    """Two calibration points give a line where its fixed and per-row parts are >= 0; where
    noise makes one negative, the fit still predicts each point as measured (it once put a
    2-row point at 2.4x its measurement, from a clamped line through a 4-row point)."""
    from jaxreshard.profiler._auto import _fit

    assert _fit(2, 10.0, 4, 14.0, 1) == 8.0  # a line: 6 ms fixed + 2 ms a row
    assert _fit(2, 11.0, 4, 37.5, 2) == 11.0 and _fit(2, 11.0, 4, 37.5, 4) == 37.5
    assert _fit(2, 11.0, 4, 37.5, 1) == 5.5 and _fit(2, 11.0, 4, 37.5, 8) == 75.0
    assert _fit(2, 10.0, 4, 8.0, 3) == 9.0 and _fit(2, 10.0, 4, 8.0, 1) == 10.0
