"""The command line's one error path: every bad input ends as one line naming what is wrong,
with a non-zero exit code, no traceback, and nothing written outside the paths given."""

import os
import subprocess
import sys

import pytest

from jaxreshard.cli import main
from jaxreshard.cli._console import describe


def run_cli(argv, capsys, cwd):
    before = set(os.listdir(cwd))
    code = main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0, f"{argv}: exit 0\n{out}"
    assert "Traceback" not in err, err
    assert len(lines) == 1, f"{argv}: not one line:\n{err}"
    words = argv[:2] if argv[0] in ("profile", "bench", "cluster") else argv[:1]
    assert lines[0].startswith(f"jaxreshard {' '.join(words)}: error: "), lines[0]
    assert set(os.listdir(cwd)) == before, f"{argv} wrote {set(os.listdir(cwd)) - before}"
    return code, lines[0]


@pytest.fixture
def files(tmp_path, monkeypatch):
    """Hostile files in a folder of their own (also the working directory)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dir.toml").mkdir()
    (tmp_path / "binary.toml").write_bytes(bytes(range(256)))
    (tmp_path / "nested.toml").write_text("a = " + "[" * 5000 + "]" * 5000)
    (tmp_path / "huge.toml").write_text("# " + "x" * (2 << 20))
    (tmp_path / "pipeline_list.toml").write_text("pipeline = [1]\n")
    (tmp_path / "axis_string.toml").write_text('[pipeline]\nmesh_axis_names = "dm"\n')
    (tmp_path / "lr_inf.toml").write_text("[run]\nlearning_rate = inf\n")
    (tmp_path / "quoted.toml").write_text('[run]\nsteps = "10"\n')
    (tmp_path / "layers.toml").write_text("[model]\nlayers = 1000000000000\n")
    (tmp_path / "table.toml").write_text("[optimizer]\nname = 'adam'\n")
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00garbage")
    (tmp_path / "empty.toml").write_text("")
    (tmp_path / "gbps.toml").write_text("[pipeline]\nemulate_network_gbps = 1e-300\n")
    (tmp_path / "nested_cost.toml").write_text("[pipeline]\ncost_forward = [[1, 2], [3]]\n")
    os.mkfifo(tmp_path / "fifo.toml")
    (tmp_path / "out").mkdir()
    (tmp_path / "a_file").write_text("x")
    return tmp_path


PROFILE = ["profile", "gpt", "--no-progress", "--compile-cache", "off"]

# (argv, fragments the one line must hold)
CASES = [
    ([*PROFILE, "--config", "missing.toml"], ["missing.toml", "no such file"]),
    ([*PROFILE, "--config", "dir.toml"], ["dir.toml", "directory"]),
    ([*PROFILE, "--config", "binary.toml"], ["binary.toml", "binary"]),
    ([*PROFILE, "--config", "nested.toml"], ["nested.toml", "nested too deeply"]),
    ([*PROFILE, "--config", "huge.toml"], ["huge.toml", "at most 1 MiB"]),
    ([*PROFILE, "--config", "pipeline_list.toml"], ["'pipeline' must be a table"]),
    ([*PROFILE, "--config", "axis_string.toml"], ["mesh_axis_names='dm'", "must be a list"]),
    ([*PROFILE, "--config", "lr_inf.toml"], ["learning_rate=inf", "finite"]),
    ([*PROFILE, "--config", "quoted.toml"], ["steps='10'", "without quotes"]),
    ([*PROFILE, "--config", "layers.toml"], ["layers=1000000000000", "layers.toml"]),
    ([*PROFILE, "--config", "table.toml"], ["'optimizer'", "[model], [run], [pipeline]"]),
    ([*PROFILE, "--learning-rate", "nan"], ["learning_rate=nan", "finite"]),
    ([*PROFILE, "--hidden", "100000", "--layers", "4000"], ["hidden=100000", "available"]),
    ([*PROFILE, "--batch-size", "100000000"], ["batch_size=100000000", "activations"]),
    ([*PROFILE, "--steps", "1000000000000"], ["steps=1000000000000", "1,000"]),
    ([*PROFILE, "--num-micro-batches", "1000000000"], ["num_micro_batches=1000000000"]),
    ([*PROFILE, "--stage-mesh-shape", "100000x100000"], ["(100000, 100000)", "at most"]),
    ([*PROFILE, "--stage-mesh-shape", "32x32"], ["2,048 devices", "fake"]),
    ([*PROFILE, "--timeout-s", "inf"], ["timeout_s=inf", "finite"]),
    ([*PROFILE, "--schedule", "1F1B"], ["schedule='1F1B'", "choose one of"]),
    ([*PROFILE, "--heads", "x"], ["heads='x'", "integer"]),
    ([*PROFILE, "--config", "empty.toml"], ["empty.toml", "empty"]),
    ([*PROFILE, "--config", "fifo.toml"], ["fifo.toml", "not a regular file"]),
    ([*PROFILE, "--config", "gbps.toml"], ["emulate_network_gbps=1e-300", "1e-06"]),
    ([*PROFILE, "--config", "nested_cost.toml"], ["cost_forward", "per model stage"]),
    ([*PROFILE, "--plot", "out"], ["--plot out", "is a directory"]),
    ([*PROFILE, "--plot", "timeline.txt"], ["--plot timeline.txt", ".png"]),
    ([*PROFILE, "--json", "a_file/x.json"], ["a_file", "not a folder"]),
    ([*PROFILE, "--json", "p.json", "--trace", "p.json"], ["--trace p.json", "same path"]),
    ([*PROFILE, "--compile-cache", "a_file"], ["--compile-cache a_file", "folder"]),
    ([*PROFILE, "--address", "1.2.3.4:5"], ["--address", "--backend ray"]),
    (  # (crashed as "internal error" in the model's first gather or matmul)
        [*PROFILE, "--mesh-axis-types", "explicit"],
        ["mesh_axis_types='explicit' (from --mesh-axis-types)", "written for Auto", "'auto'"],
    ),
    (
        ["schedule", "1f1b", "--stages", "2", "--micro-batches", "2", "--plot", "out"],
        ["is a directory"],
    ),
    (["schedule", "1f1b", "--stages", "2", "--micro-batches", "2", "--plot", "x"], [".png"]),
    (
        [
            "schedule",
            "1f1b",
            "--stages",
            "2",
            "--micro-batches",
            "2",
            "--json",
            "o.json",
            "--csv",
            "a_file/x.csv",
        ],
        ["--csv a_file/x.csv", "not a folder"],
    ),
    (
        ["schedule", "gpipe", "--stages", "2", "--micro-batches", "20000", "--plot", "w.png"],
        ["80,000 actions", "--trace"],
    ),
    (
        ["schedule", "eager_1f1b", "--stages", str(10**9), "--micro-batches", str(10**9)],
        ["2e+18 actions", "at most 200,000"],
    ),
    (["schedule", "compare", "--stages", "100000", "--micro-batches", "100"], ["at most 200,000"]),
    (["schedule", "import", "missing.csv"], ["missing.csv"]),
    (["schedule", "import", "dir.toml"], ["dir.toml"]),
    (["schedule", "import", "bad.json"], ["bad.json"]),
    (["schedule", "import", "list.json"], ["list.json"]),
    (["schedule", "import", "binary.json"], ["binary.json"]),
    (["schedule", "1f1b", "--stages", "4"], ["--micro-batches", "required"]),
    (["bench", "reshard", "--cases", "missing.json"], ["missing.json"]),
    (["bench", "reshard", "--cases", "dir.toml"], ["dir.toml"]),
    (["bench", "reshard", "--cases", "bad.json"], ["bad.json"]),
    (["bench", "reshard", "--cases", "list.json"], ["list.json"]),
    (["bench", "reshard", "--cases", "binary.json"], ["binary.json"]),
    (["bench", "reshard", "--only", "nope"], ["--only", "nope", "no such case"]),
    (["bench", "reshard", "--address", "1.2.3.4:1"], ["--address", "--execute ray"]),
    (["bench", "reshard", "--emulate-network", "5"], ["--emulate-network", "--execute"]),
    (["bench", "reshard", "--execute", "local", "--timeout", "5"], ["--timeout", "ray"]),
    (["bench", "reshard", "--dump-plans", "a_file"], ["--dump-plans a_file", "not a folder"]),
]


@pytest.mark.parametrize(("argv", "fragments"), CASES, ids=lambda a: " ".join(map(str, a)))
def test_a_bad_input_is_one_line_naming_it(files, capsys, argv, fragments):
    code, line = run_cli(argv, capsys, files)
    assert code == 2, line
    for fragment in fragments:
        assert fragment in line, f"{fragment!r} not in {line!r}"


def test_argparse_refusals_are_its_usage_line_and_exit_2(files, capsys):
    for argv in (
        ["cluster", "up", "--hosts", "100000", "--nic-gbps", "1"],
        ["cluster", "up", "--hosts", "2", "--nic-gbps", "inf"],
        ["bench", "reshard", "--scale", "0"],
        ["schedule", "1f1b", "--stages", "2", "--micro-batches", "2", "--forward", "nan"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.count("\n") == 1, err
        assert err.startswith(f"jaxreshard {argv[0]}") and "error: argument" in err, err


def test_an_unexpected_exception_is_one_line_saying_it_is_ours(monkeypatch, capsys, tmp_path):
    import jaxreshard.cli._schedule as schedule

    def broken(args):
        raise KeyError("stages")

    monkeypatch.setattr(schedule, "_build", broken)
    code, line = run_cli(["schedule", "1f1b", "--stages", "2", "--micro-batches", "2"], capsys,
                         tmp_path)  # fmt: skip
    assert code == 1
    assert "internal error (KeyError: 'stages')" in line and "JAXRESHARD_TRACEBACK" in line


def test_describe_names_operating_system_errors_and_limits():
    assert describe(IsADirectoryError(21, "Is a directory", "x.toml")) == (
        "x.toml: is a directory; give a file",
        2,
    )
    assert describe(PermissionError(13, "Permission denied", "/root/x"))[0].startswith(
        "/root/x: permission denied"
    )
    assert "nested too deeply" in describe(RecursionError("maximum recursion depth"))[0]
    assert (
        describe(RuntimeError("stage 1 hung\nat action 1F3"))[0] == "stage 1 hung | at action 1F3"
    )
    assert describe(TimeoutError("waited 5 s for h1"))[1] == 1
    long = describe(ValueError("x" * 10_000))[0]
    assert len(long) < 2100 and long.endswith("more characters)")


def test_the_installed_command_prints_no_traceback(tmp_path):
    """The real entry point (`python -m jaxreshard`), in a process of its own."""
    (tmp_path / "dir.toml").mkdir()
    for argv in (
        ["profile", "gpt", "--config", "dir.toml"],
        ["schedule", "import", "nope.csv"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "jaxreshard", *argv],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done
        assert "Traceback" not in done.stderr
        assert done.stderr.strip().count("\n") == 0, done.stderr
        assert set(os.listdir(tmp_path)) == {"dir.toml"}


def test_outputs_are_written_through_devices_links_and_kept_permissions(tmp_path, capsys):
    """A FIFO (as /dev/stdout or /dev/null would be) is written through, not replaced; a
    symbolic link's target is written; an existing file keeps its permissions; a long name
    that the file system takes is fine (the temporary file's name is short)."""
    import stat
    import threading

    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    argv = ["schedule", "1f1b", "--stages", "2", "--micro-batches", "2"]
    assert main([*argv, "--json", str(fifo)]) == 0
    reader.join(10)
    assert got and '"format"' in got[0] and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    target = tmp_path / "target.json"
    target.write_text("old")
    os.chmod(target, 0o600)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert main([*argv, "--json", str(link)]) == 0
    assert link.is_symlink() and '"format"' in target.read_text()
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    long = tmp_path / ("a" * 250 + ".json")
    assert main([*argv, "--json", str(long)]) == 0 and long.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []
    capsys.readouterr()


def test_a_json_timeline_keeps_its_costs_and_bad_costs_are_named(tmp_path, capsys):
    import json

    out = tmp_path / "f5.json"
    argv = ["schedule", "1f1b", "--stages", "2", "--micro-batches", "2", "--forward", "5"]
    assert main([*argv, "--json", str(out)]) == 0
    made = json.loads(out.read_text())["makespan"]
    capsys.readouterr()
    assert main(["schedule", "import", str(out), "--json", str(tmp_path / "again.json")]) == 0
    assert json.loads((tmp_path / "again.json").read_text())["makespan"] == made
    data = json.loads(out.read_text())
    data["costs"]["forward"] = "x"
    (tmp_path / "bad.json").write_text(json.dumps(data))
    capsys.readouterr()
    code, line = run_cli(["schedule", "import", str(tmp_path / "bad.json")], capsys, tmp_path)
    assert code == 2 and "costs" in line and "forward='x'" in line


@pytest.mark.parametrize("iproute2", [True, False])
def test_cluster_measure_and_status_name_a_missing_cluster(tmp_path, capsys, monkeypatch, iproute2):
    import shutil

    from jaxreshard.cluster import _netns

    monkeypatch.setenv("JAXRESHARD_CLUSTER_DIR", str(tmp_path / "state"))
    if not iproute2:  # (CI's newest-JAX root has no `ip`)
        monkeypatch.setattr(_netns.shutil, "which", lambda tool: None)
    elif shutil.which("ip") is None:
        pytest.skip("iproute2 is not installed here")
    _, line = run_cli(["cluster", "measure", "--name", "nosuch"], capsys, tmp_path)
    assert "no such cluster" in line
    assert main(["cluster", "status", "--name", "nosuch"]) == 0
    assert "no jaxreshard cluster named 'nosuch'" in capsys.readouterr().out


def test_bench_names_a_bad_address_before_planning(tmp_path, capsys):
    _, line = run_cli(
        ["bench", "reshard", "--execute", "ray", "--address", "../x"], capsys, tmp_path
    )
    assert "--address ('../x')" in line and "HOST:PORT" in line
