import json

import pytest

from jaxreshard.cli import main


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


def test_schedule_cli_virtual_stages_writes_chunks_csv_and_pictures(tmp_path, capsys):
    out, csv, png, trace = (tmp_path / n for n in ("z.json", "z.csv", "z.png", "z.trace.json"))
    argv = ["schedule", "zbv", "--stages", "3", "--micro-batches", "6", "--comm", "0.25"]
    argv += ["--json", str(out), "--csv", str(csv), "--plot", str(png), "--trace", str(trace)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "zbv, 3 ranks x 2 virtual stages, 6 micro-batches" in printed
    assert "rank 2 |" in printed
    data = json.loads(out.read_text())
    assert data["format"] == "jaxreshard-schedule/2" and data["virtual_stages"] == 2
    assert data["placement"] == [0, 1, 2, 2, 1, 0] and data["costs"]["comm"] == 0.25
    assert {a["chunk"] for a in data["stages"][2]} == {2, 3}
    rows = csv.read_text().splitlines()
    assert len(rows) == 3 and rows[2].startswith("2F0,3F0,")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(trace.read_text())["traceEvents"]


def test_schedule_cli_imports_a_csv_and_simulates_it_as_soon_as_possible(tmp_path, capsys):
    path, out = tmp_path / "mine.csv", tmp_path / "mine.json"
    path.write_text("0F0,0F1,,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    argv = ["schedule", "import", str(path), "--forward", "1", "--backward", "2"]
    assert main([*argv, "--comm", "0.5", "--json", str(out)]) == 0
    assert "mine, 2 stages, 2 micro-batches" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["makespan"] == 10 and data["schedule"] == "mine"
    # The JSON it wrote imports too.
    assert main(["schedule", "import", str(out), "--comm", "0.5"]) == 0
    assert "makespan 10," in capsys.readouterr().out


def test_schedule_cli_refuses_a_deadlocking_csv(tmp_path, capsys):
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n2F1,2B1,2F0,2B0\n")
    assert main(["schedule", "import", str(path), "--comm", "1"]) == 2
    err = capsys.readouterr().err
    assert "cannot finish" in err and "cycle: 1B0 (needs 2B0) -> 2F1 (needs 1F1) -> 1B0" in err


def test_schedule_compare_includes_virtual_stage_schedules(tmp_path, capsys):
    out = tmp_path / "c.json"
    argv = ["schedule", "compare", "--stages", "4", "--micro-batches", "8", "--json", str(out)]
    assert main(argv) == 0
    assert "zbv (v=2)" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    by_name = {(r["schedule"], r["weight_delay"]): r for r in rows}
    for name in ("interleaved_1f1b", "eager_interleaved_1f1b", "zbv", "dualpipev"):
        assert by_name[name, False]["virtual_stages"] == 2
    zbv = by_name["zbv", False]
    assert zbv["peak_memory"] == [p / 2 for p in zbv["peak_activations"]]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["gpipe", "--stages", "2", "--micro-batches", "2", "--virtual-stages", "2"],
            "--virtual-stages=2: gpipe runs one stage per rank",
        ),
        (
            ["zbv", "--stages", "2", "--micro-batches", "2", "--virtual-stages", "3"],
            "zbv places exactly two chunks per rank",
        ),
        (["1f1b", "--micro-batches", "2"], "--stages is required with NAME='1f1b'"),
        (["import"], "import needs FILE"),
        (
            ["zbv", "--stages", "2", "--micro-batches", "4", "--no-overlap"],
            "made for asynchronous transfers",
        ),
        (
            ["zbv", "--stages", "2", "--micro-batches", "4", "--forward", "1,2"],
            "forward has 2 entries, expected 4",
        ),
    ],
)
def test_schedule_cli_virtual_stage_errors(argv, message, capsys):
    assert main(["schedule", *argv]) == 2
    assert message in capsys.readouterr().err
