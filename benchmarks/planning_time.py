"""Planning time of `auto` (and the search strategies) on large reshardings.

The issue's target: under 2 s for a 64-host x 8-device resharding with three sharded dims.
Both meshes here have 64 hosts of 8 devices (128 hosts, 1024 devices in all), which is harder
than splitting 64 hosts between the two meshes. Prints a table; writes JSON with --out.

    python benchmarks/planning_time.py --out planning_time.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from rich.console import Console
from rich.table import Table

from jaxreshard.bench._cases import case_from_json, paper_cluster
from jaxreshard.bench._simulated import plan_case
from jaxreshard.comm import PlannerOptions

CLUSTER = paper_cluster(8)


def mesh(shape, names="xyz"):
    return {"shape": list(shape), "axis_names": list(names[: len(shape)])}


CASES = [
    # name, src mesh, src spec, dst mesh, dst spec
    ("3 dims permuted", mesh((8, 8, 8)), ["x", "y", "z"], mesh((8, 8, 8)), ["z", "x", "y"]),
    (
        "3 dims, 16/8/4-way cuts",
        mesh((4, 16, 8)),
        ["x", "y", "z"],
        mesh((16, 8, 4)),
        ["x", "y", "z"],
    ),
    ("partial replication", mesh((8, 8, 8)), ["x", None, "z"], mesh((8, 8, 8)), [None, "y", "x"]),
    ("replicated -> 3 dims", mesh((8, 8, 8)), [None, None, None], mesh((8, 8, 8)), ["x", "y", "z"]),
]
STRATEGIES = ("broadcast_greedy", "broadcast_match", "broadcast_dfs", "auto")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--repeat", type=int, default=3, help="report the fastest of N runs")
    args = parser.parse_args()
    table = Table(title="Planning time, 64 + 64 hosts x 8 devices, (1024, 1024, 1024) float32")
    for column in (
        "case",
        "unit tasks",
        *(f"{s} ms" for s in STRATEGIES),
        "auto picks",
        "auto/bound",
    ):
        table.add_column(column, justify="right")
    records = []
    for name, src_mesh, src_spec, dst_mesh, dst_spec in CASES:
        case = case_from_json(
            {
                "name": name,
                "shape": [1024, 1024, 1024],
                "dtype": "float32",
                "src_mesh": src_mesh,
                "src_spec": src_spec,
                "dst_mesh": dst_mesh,
                "dst_spec": dst_spec,
            },
            CLUSTER,
            max_mesh_devices=512,  # (a case file's meshes stop at MAX_MESH_DEVICES)
        )
        record = {"name": name, "num_hosts": case.cluster.num_hosts, "results": {}}
        for strategy in STRATEGIES:
            best, plan = float("inf"), None
            for _ in range(args.repeat):
                plan, seconds = plan_case(case, strategy, PlannerOptions())
                best = min(best, seconds)
            record["num_unit_tasks"] = len(plan.tasks)
            record["lower_bound_s"] = plan.lower_bound_s
            record["results"][strategy] = {
                "plan_ms": best * 1e3,
                "seconds": plan.seconds,
                "chosen": plan.chosen,
            }
        records.append(record)
        r = record["results"]
        table.add_row(
            name,
            str(record["num_unit_tasks"]),
            *(f"{r[s]['plan_ms']:.0f}" for s in STRATEGIES),
            r["auto"]["chosen"],
            f"{r['auto']['seconds'] / record['lower_bound_s']:.3f}",
        )
    Console(width=200).print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "format": "jaxreshard-planning-time/1",
                    "machine": platform.node(),
                    "python": platform.python_version(),
                    "when": time.strftime("%Y-%m-%d"),
                    "cases": records,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
