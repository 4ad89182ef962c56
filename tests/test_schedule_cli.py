import json

from jaxreshard._cli import main


def test_schedule_cli_writes_json_trace_and_png(tmp_path, capsys):
    out, trace, png = tmp_path / "s.json", tmp_path / "t.json", tmp_path / "s.png"
    argv = [
        "schedule",
        "eager_1f1b",
        "--stages",
        "4",
        "--micro-batches",
        "8",
        "--weight-delay",
        "--forward",
        "1",
        "--backward",
        "2",
        "--weight-grad",
        "1",
        "--comm",
        "1",
        "--json",
        str(out),
        "--plot",
        str(png),
        "--trace",
        str(trace),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "eager_1f1b + weight delay, 4 stages, 8 micro-batches" in printed
    assert "stage 3 |" in printed and "makespan" in printed
    data = json.loads(out.read_text())
    assert data["format"] == "jaxreshard-schedule/2"
    assert data["schedule"] == "eager_1f1b" and data["weight_delay"] is True
    assert data["num_stages"] == 4 and data["num_micro_batches"] == 8
    assert data["costs"]["comm"] == 1.0 and len(data["peak_activations"]) == 4
    assert {a["kind"] for stage in data["stages"] for a in stage} == {"F", "B", "W"}
    assert len(data["transfers"]) == 2 * 3 * 8
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {"stage 0", "stage 1", "stage 2", "stage 3"}
    assert any(e.get("name") == "send act mb3 s0->s1" for e in events)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_schedule_compare(tmp_path, capsys):
    out = tmp_path / "c.json"
    argv = [
        "schedule",
        "compare",
        "--stages",
        "4",
        "--micro-batches",
        "16",
        "--forward",
        "1",
        "--backward",
        "2",
        "--weight-grad",
        "1",
        "--comm",
        "1",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    assert "eager_1f1b + weight delay" in capsys.readouterr().out
    rows = {
        (r["schedule"], r["weight_delay"], r["overlap"]): r
        for r in json.loads(out.read_text())["rows"]
    }
    assert rows["eager_1f1b", True, True]["makespan_reduction_vs_1f1b"] >= 0.25
    assert rows["1f1b", False, False]["makespan"] > rows["1f1b", False, True]["makespan"]


def test_schedule_cli_per_stage_costs_and_no_overlap(tmp_path):
    out = tmp_path / "s.json"
    assert (
        main(
            [
                "schedule",
                "1f1b",
                "--stages",
                "3",
                "--micro-batches",
                "2",
                "--forward",
                "1,2,1",
                "--comm",
                "0.5,1",
                "--no-overlap",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert data["costs"]["forward"] == [1.0, 2.0, 1.0] and data["overlap"] is False


def test_schedule_cli_errors(capsys):
    assert main(["schedule", "pipedream", "--stages", "2", "--micro-batches", "2"]) == 2
    assert (
        "NAME='pipedream' is not a schedule; choose one of gpipe, 1f1b" in capsys.readouterr().err
    )
    assert (
        main(["schedule", "1f1b", "--stages", "2", "--micro-batches", "2", "--forward", "1,2,3"])
        == 2
    )
    assert "forward has 3 entries, expected 2" in capsys.readouterr().err
