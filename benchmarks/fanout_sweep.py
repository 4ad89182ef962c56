"""Fan-outs to hosts of 8 devices, planned by `auto`: how close each comes to its lower bound.

Every combination of three sizes (4 MiB, 64 MiB, 1 GiB of float32), six source layouts (one
device; 4 or 8 devices of one host, by rows or columns; 16 devices on two hosts; a 2x4 mesh) and
ten destination layouts on hosts of 8 (replicated on one or two hosts, split by rows, columns or
both) under the paper's cluster model with hosts of 8 devices. Prints, per size, the worst cases
and the median of auto / bound; writes every case's result with --out.

    python benchmarks/fanout_sweep.py --out fanout_sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time

from rich.console import Console
from rich.table import Table

from jaxreshard.bench._cases import case_from_json, paper_cluster
from jaxreshard.bench._simulated import plan_case
from jaxreshard.comm import PlannerOptions

CLUSTER = paper_cluster(8)
SIZES = {"4M": [1024, 1024], "64M": [4096, 4096], "1G": [16384, 16384]}
# name: (mesh shape, devices per host, spec)
SOURCES = {
    "1": ((1, 1), 1, [None, None]),
    "8r": ((1, 8), 8, ["y", None]),
    "8c": ((1, 8), 8, [None, "y"]),
    "16r": ((2, 8), 8, [["x", "y"], None]),
    "4r": ((1, 4), 4, ["y", None]),
    "2x4": ((2, 4), 4, ["x", "y"]),
}
DESTINATIONS = {
    "1x8rep": ((1, 8), [None, None]),
    "1x8r": ((1, 8), ["y", None]),
    "1x8c": ((1, 8), [None, "y"]),
    "2x4r": ((2, 4), ["x", None]),
    "2x4c": ((2, 4), [None, "y"]),
    "2x4rc": ((2, 4), ["x", "y"]),
    "4x2c": ((4, 2), [None, "y"]),
    "2x8rep": ((2, 8), [None, None]),
    "2x8r": ((2, 8), ["x", None]),
    "8x1c": ((8, 1), ["y", "x"]),
}


def mesh(shape, per_host=8):
    return {"shape": list(shape), "axis_names": ["x", "y"], "devices_per_host": per_host}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--worst", type=int, default=3, help="worst cases listed per size")
    args = parser.parse_args()
    records = []
    grid = itertools.product(SIZES.items(), SOURCES.items(), DESTINATIONS.items())
    for (size, shape), (src_name, source), (dst_name, destination) in grid:
        (src_mesh, per_host, src_spec), (dst_mesh, dst_spec) = source, destination
        name = f"{size}_{src_name}_to_{dst_name}"
        case = case_from_json(
            {
                "name": name,
                "shape": shape,
                "dtype": "float32",
                "src_mesh": mesh(src_mesh, per_host),
                "src_spec": src_spec,
                "dst_mesh": mesh(dst_mesh),
                "dst_spec": dst_spec,
            },
            CLUSTER,
        )
        plan, _ = plan_case(case, "auto", PlannerOptions())
        records.append(
            {
                "name": name,
                "size": size,
                "num_unit_tasks": len(plan.tasks),
                "num_ops": len(plan.ops),
                "lower_bound_s": plan.lower_bound_s,
                "seconds": plan.seconds,
                "chosen": plan.chosen,
                "ratio": plan.seconds / plan.lower_bound_s,
            }
        )
    table = Table(title="auto / lower bound, fan-outs to hosts of 8 devices")
    for column in ("size", "cases", "median", "worst cases (auto / bound, ops, picks)"):
        table.add_column(column)
    for size in SIZES:
        rows = sorted((r for r in records if r["size"] == size), key=lambda r: -r["ratio"])
        worst = "; ".join(
            f"{r['name']} {r['ratio']:.3f} ({r['num_ops']} ops, {r['chosen']})"
            for r in rows[: args.worst]
        )
        median = statistics.median(r["ratio"] for r in rows)
        table.add_row(size, str(len(rows)), f"{median:.3f}", worst)
    Console(width=200).print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "format": "jaxreshard-fanout-sweep/1",
                    "machine": platform.node(),
                    "python": platform.python_version(),
                    "when": time.strftime("%Y-%m-%d"),
                    "cluster": CLUSTER,
                    "cases": records,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
