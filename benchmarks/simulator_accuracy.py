"""The simulator's predictions against measured steps, on an emulated cluster.

For each configuration below (models, schedules, virtual stages and micro-batch counts nobody
tuned for this), `jaxreshard profile MODEL ... --address HEAD --json` runs in a process of its
own, as a job's driver would, on one emulated cluster (`jaxreshard.cluster.emulated`; root
only): its timed steps (median) beside the simulator's prediction from the run's own measured
actions (`predicted_step`). With `--auto`, one `profile --auto` too: every configuration it
measured, its search's prediction (from other runs' calibrations) beside the measured step.
Prints a table and the median error of each kind, and writes JSON with --out.

    sudo python benchmarks/simulator_accuracy.py --hosts 2 --devices 1 --cpus-per-host 1 \\
        --gbps 0.01 --auto gpt --out benchmarks/results/simulator_accuracy.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jaxreshard.cluster

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
USER_MODEL = str(EXAMPLES / "profile_model.py")
# name: (model, flags): two meshes of one device each (one per host on a cluster of one device
# per host), each with one model stage, or two with a virtual-stage schedule.
CONFIGS: dict[str, tuple[str, str]] = {
    "gpt 1f1b m4": ("gpt", "--preset tiny --schedule 1f1b --num-micro-batches 4"),
    "gpt zb_h1 m8": ("gpt", "--preset tiny --schedule zb_h1 --num-micro-batches 8"),
    "gpt eager+wd m8": ("gpt", "--preset tiny --schedule eager_1f1b --weight-delay "
                        "--num-micro-batches 8"),
    "gpt interleaved v2 m4": ("gpt", "--preset tiny --schedule interleaved_1f1b "
                              "--virtual-stages 2 --num-micro-batches 4 --num-stages 4"),
    "gpt dualpipev m4": ("gpt", "--preset tiny --schedule dualpipev --num-micro-batches 4 "
                         "--num-stages 4"),
    "utransformer 1f1b m4": ("utransformer", "--preset tiny --schedule 1f1b "
                             "--num-micro-batches 4"),
    "utransformer gpipe sgd m4": ("utransformer", "--preset tiny --schedule gpipe "
                                  "--optimizer sgd --num-micro-batches 4"),
    "user mlp 1f1b m4": (USER_MODEL, "--schedule 1f1b --num-micro-batches 4"),
    "user mlp deep zbv m4": (USER_MODEL, "--preset deep --schedule zbv --num-micro-batches 4 "
                             "--num-stages 4"),
    "user mlp deep eager+wd m2": (USER_MODEL, "--preset deep --schedule eager_1f1b "
                                  "--weight-delay --num-micro-batches 2"),
}  # fmt: skip


def profile(address: str, model: str, flags: str, steps: int, extra: str = "") -> dict[str, Any]:
    """One `jaxreshard profile` run on the cluster at `address`: its JSON record."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "profile.json"
        command = [sys.executable, "-m", "jaxreshard", "profile", model, *shlex.split(flags),
                   *([] if "--num-stages" in flags else ["--num-stages", "2"]),
                   "--stage-mesh-shape", "1,1;1,1", "--backend", "ray",
                   "--address", address, "--steps", str(steps),
                   "--warmup-steps", "2", "--plain-steps", "0", "--no-progress",
                   "--json", str(out), *shlex.split(extra)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n"
                               f"{done.stderr[-3000:]}")  # fmt: skip
        return json.loads(out.read_text())


def error(measured: float, predicted: float) -> float:
    """|measured - predicted| / measured."""
    return abs(measured - predicted) / measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--devices", type=int, default=1, help="CPU devices per host")
    parser.add_argument("--cpus-per-host", type=int, default=None, help="pin each host")
    parser.add_argument("--gbps", type=float, default=0.01, help="each host's NIC, GB/s")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", nargs="*", default=None, help="configuration names")
    parser.add_argument("--auto", default=None, metavar="MODEL",
                        help="also run `profile MODEL --auto` (preset tiny)")  # fmt: skip
    parser.add_argument("--auto-top", type=int, default=4)
    parser.add_argument("--name", default="jrsim")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    names = args.only if args.only is not None else list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"--only {unknown[0]!r}: the configurations are {list(CONFIGS)}")
    rows: list[dict[str, Any]] = []
    searched: list[dict[str, Any]] = []
    refinements: list[dict[str, Any]] = []  # (the points --auto calibrated where it extrapolated)
    auto_record: dict[str, Any] | None = None
    with jaxreshard.cluster.emulated(
        hosts=args.hosts,
        nic_gbps=args.gbps,
        devices_per_host=args.devices,
        cpus_per_host=args.cpus_per_host,
        name=args.name,
    ) as cluster:
        for name in names:
            model, flags = CONFIGS[name]
            record = profile(cluster.address, model, flags, args.steps)
            measured, predicted = record["step_seconds"], record["predicted_step_seconds"]
            rows.append({"config": name, "model": model, "flags": flags,
                         "measured_seconds": measured, "predicted_seconds": predicted,
                         "measured_over_predicted": measured / predicted,
                         "error": error(measured, predicted),
                         "step_seconds": [s["seconds"] for s in record["steps"]]})  # fmt: skip
            print(f"{name:<28} measured {measured * 1e3:8.1f} ms  predicted "
                  f"{predicted * 1e3:8.1f} ms  measured/predicted {measured / predicted:.3f}",
                  flush=True)  # fmt: skip
        if args.auto:
            flags = "--preset tiny --auto --auto-top " + str(args.auto_top)
            record = profile(cluster.address, args.auto, flags, args.steps)
            refinements, auto_record = record.get("refinements", []), record
            for row in record["measured"]:
                guess = row.get("search_predicted_seconds")
                if guess is None:
                    continue  # (the data-parallel baseline: not predicted by the search)
                measured = row["step_seconds"]
                searched.append({"config": row["label"], "measured_seconds": measured,
                                 "search_predicted_seconds": guess,
                                 "own_predicted_seconds": row.get("predicted_seconds"),
                                 "measured_over_predicted": measured / guess,
                                 "extrapolated": row.get("search_extrapolated"),
                                 "calibration_step_seconds": row.get("calibration_step_seconds"),
                                 "error": error(measured, guess)})  # fmt: skip
                before = row.get("calibration_step_seconds")
                drift = f"  (calibrated at {before * 1e3:.1f} ms)" if before else ""
                print(f"--auto {row['label'][:60]:<60} measured {measured * 1e3:8.1f} ms  "
                      f"search predicted {guess * 1e3:8.1f} ms  {measured / guess:.3f}{drift}",
                      flush=True)  # fmt: skip
    own = statistics.median(r["error"] for r in rows) if rows else None
    search = statistics.median(r["error"] for r in searched) if searched else None
    if own is not None:
        print(f"median error, each run's own prediction: {own:.1%} over {len(rows)} runs")
    if search is not None:
        print(f"median error, --auto's search predictions: {search:.1%} over {len(searched)}")
    if args.out:
        record = {
            "benchmark": "simulator_accuracy",
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "hosts": args.hosts,
            "devices_per_host": args.devices,
            "cpus_per_host": args.cpus_per_host,
            "nic_gbps": args.gbps,
            "steps": args.steps,
            "rows": rows,
            "median_error": own,
            "auto_model": args.auto,
            "auto_rows": searched,
            "auto_median_error": search,
            "auto_refinements": refinements,
            "auto_record": auto_record,  # (the whole `profile --auto --json` record)
        }
        Path(args.out).write_text(json.dumps(record, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
