import json

from jaxreshard.cli import main
from jaxreshard.comm import STRATEGY_NAMES


def test_bench_reshard_writes_results_and_plans(tmp_path, capsys):
    out, plans = tmp_path / "r.json", tmp_path / "plans"
    assert (
        main(
            [
                "bench",
                "reshard",
                "--only",
                "case3",
                "1to2x2",
                "--out",
                str(out),
                "--dump-plans",
                str(plans),
            ]
        )
        == 0
    )
    results = json.loads(out.read_text())
    assert results["format"] == "jaxreshard-reshard-results/1"
    assert results["cluster"]["devices_per_host"] == 4
    assert [c["name"] for c in results["cases"]] == ["case3", "1to2x2"]
    for case in results["cases"]:
        assert {"name", "bytes", "lower_bound_s", "results"} <= set(case)
        assert set(case["results"]) == set(STRATEGY_NAMES)
        for r in case["results"].values():
            assert r["seconds"] > 0 and r["plan_ms"] >= 0 and r["valid"]
        assert case["results"]["auto"]["chosen"] in STRATEGY_NAMES
        assert "finished" in case["results"]["broadcast_dfs"]
    dump = json.loads((plans / "case3.auto.json").read_text())
    assert dump["format"] == "jaxreshard-plan/1" and dump["case"] == "case3"
    assert dump["hosts"]["0"] == [0, 1, 2, 3] and dump["hosts"]["2"] == [8, 9, 10, 11]
    for op in dump["ops"]:
        assert op["kind"] in ("send", "broadcast", "allgather")
        assert {"index", "bytes", "start_s", "end_s"} <= set(op)
    assert len(list(plans.iterdir())) == 2 * len(STRATEGY_NAMES)
    assert "case3" in capsys.readouterr().out


def test_bench_reshard_bad_input(tmp_path, capsys):
    assert main(["bench", "reshard", "--strategies", "magic"]) == 2
    assert "--strategies='magic' is not a resharding strategy" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something/2", "cases": []}))
    assert main(["bench", "reshard", "--cases", str(bad)]) == 2
    assert "expected 'jaxreshard-reshard-cases/1'" in capsys.readouterr().err
