"""Reading, checking and simulating large schedules: each step should be near-linear in actions.

Two 100,000-action schedules: 8 ranks x 12,500 actions (1F1B, 6,250 micro-batches) and 10,000
ranks x 10 actions (a 10,000-row CSV). For each: write the CSV, read and check it
(`read_csv`), simulate with and without overlap, write the `jaxreshard-schedule/2` JSON and read
it back (`schedule_from_json`, which checks too). With `--memory`, also the peak traced memory
per action (tracemalloc; slower), which sets `BYTES_PER_ACTION` in `pipeline/_limits.py`.
Prints a table; writes JSON with --out.

    python benchmarks/schedule_scale.py --out schedule_scale.json
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
import tracemalloc
from pathlib import Path

from jaxreshard.pipeline import (
    Costs,
    build_schedule,
    read_csv,
    schedule_from_json,
    schedule_to_csv,
    simulate,
)

CASES = {"8 ranks x 12,500 actions": (8, 6250), "10,000 ranks x 10 actions": (10_000, 5)}


def run_case(p: int, m: int, folder: Path, memory: bool) -> dict:
    times: dict[str, float] = {}

    def timed(label, fn):
        start = time.perf_counter()
        out = fn()
        times[label] = time.perf_counter() - start
        return out

    schedule = timed("build", lambda: build_schedule("1f1b", p, m))
    num_actions = sum(map(len, schedule.actions))
    csv_path = folder / f"s{p}x{m}.csv"
    csv_path.write_text(schedule_to_csv(schedule))
    if memory:
        tracemalloc.start()
    schedule = timed("read_csv + check", lambda: read_csv(csv_path))
    costs = Costs.make(schedule.num_chunks, comm=0.5)
    timeline = timed("simulate", lambda: simulate(schedule, costs))
    data = timed("to_json", timeline.to_json)
    peak = tracemalloc.get_traced_memory()[1] if memory else None
    if memory:
        tracemalloc.stop()
    timed("simulate blocking", lambda: simulate(schedule, costs, overlap=False))
    text = json.dumps(data, indent=1)
    timed("schedule_from_json", lambda: schedule_from_json(json.loads(text)))
    return {
        "num_stages": p,
        "num_micro_batches": m,
        "num_actions": num_actions,
        "csv_bytes": csv_path.stat().st_size,
        "json_bytes": len(text),
        "seconds": times,
        "peak_bytes_per_action": None if peak is None else peak / num_actions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the results as JSON")
    parser.add_argument("--memory", action="store_true", help="trace peak memory (slower)")
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for label, (p, m) in CASES.items():
            results[label] = run_case(p, m, Path(folder), args.memory)
    steps = list(next(iter(results.values()))["seconds"])
    table = Table(title="Large schedules, seconds (near-linear: ~1e-5 s per action per step)")
    table.add_column("schedule")
    table.add_column("actions", justify="right")
    for step in steps:
        table.add_column(step, justify="right")
    if args.memory:
        table.add_column("peak B/action", justify="right")
    for label, r in results.items():
        row = [label, f"{r['num_actions']:,}", *(f"{r['seconds'][s]:.2f}" for s in steps)]
        if args.memory:
            row.append(f"{r['peak_bytes_per_action']:.0f}")
        table.add_row(*row)
    Console(width=160).print(table)
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "format": "jaxreshard-schedule-scale/1",
                    "machine": platform.node(),
                    "python": platform.python_version(),
                    "when": time.strftime("%Y-%m-%d"),
                    "cases": results,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
