"""The cut search past `MAX_CHOICES` against predicting every way to cut, on the same segments.

A stack of `--layers` tanh layers run by `jr.scan` (a candidate between every two layers) is
cut by `partition="auto"` into S stages twice per row: once predicting every way to cut (the
partitioner's limit raised past them), once searching ([Note: cut search]; the limit lowered
to 1), both on the same measured segment times, so only the choosing differs. Local runtime,
one device per stage mesh, links of `--gbps`. Prints a table; writes JSON with --out.

    python benchmarks/cut_search.py --out benchmarks/results/cut_search_DATE.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax.numpy as jnp
import numpy as np
import optax
from rich.console import Console
from rich.table import Table

import jaxreshard as jr
from jaxreshard.runtime.step import _partition, _partition_report

ROWS = [(4, "1f1b"), (5, "zb_h1"), (5, "eager_1f1b")]  # (stages, schedule): each predicted whole
OPT = optax.sgd(1e-2)


def problem(layers: int, width: int):
    rng = np.random.default_rng(0)
    params = {"w": (rng.normal(size=(layers, width, width)) / np.sqrt(width)).astype(np.float32)}
    batch = {
        "x": rng.normal(size=(64, width)).astype(np.float32),
        "y": rng.normal(size=(64, width)).astype(np.float32),
    }

    def step(p, s, batch):
        def loss_fn(p):
            h, _ = jr.scan(lambda h, w: (jnp.tanh(h @ w), None), batch["x"], p["w"])
            return jnp.mean((h - batch["y"]) ** 2)

        loss, g = jr.value_and_grad(loss_fn)(p)
        updates, s = OPT.update(g, s, p)
        return optax.apply_updates(p, updates), s, loss

    return step, params, batch


def choose(step, args, stages, schedule, gbps, limit):
    """`partition="auto"` with the partitioner's limit set to `limit`: its report."""
    _partition.MAX_CHOICES = _partition_report.MAX_CHOICES = limit
    cfg = jr.PipelineConfig(
        stage_mesh_shape=(1,), num_micro_batches=8, backend="local", devices_per_host=1,
        partition="auto", num_stages=stages, partition_trials=0, schedule=schedule,
        emulate_network_gbps=gbps,
    )  # fmt: skip
    return jr.parallelize(step, config=cfg, batch_argnums=2).plan(*args).partition


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--gbps", type=float, default=0.01)
    parser.add_argument("--out", help="write the rows as JSON")
    args = parser.parse_args()
    step, params, batch = problem(args.layers, args.width)
    call = (params, OPT.init(params), batch)
    real, timed = _partition.segment_cost, {}

    def once(graph, s, device, split):  # (both choosers see the same measured segments)
        if s not in timed:
            timed[s] = real(graph, s, device, split)
        return timed[s]

    _partition.segment_cost = once
    table = Table(title=f"cut search: {args.layers} layers, {args.gbps} GB/s links")
    for col in ("stages", "schedule", "ways", "every way: predicted, s, best ms",
                "search: predicted, s, best ms", "search / every"):  # fmt: skip
        table.add_column(col)
    rows = []
    for stages, schedule in ROWS:
        every = choose(step, call, stages, schedule, args.gbps, 10**9)
        found = choose(step, call, stages, schedule, args.gbps, 1)
        row = {"stages": stages, "schedule": schedule, "ways": every.ways}
        for name, r in (("every", every), ("search", found)):
            row[name] = {"predicted": len(r.tried), "seconds": r.seconds,
                         "chosen": list(r.chosen), "step_seconds": r.tried[0].step}  # fmt: skip
        row["ratio"] = found.tried[0].step / every.tried[0].step
        rows.append(row)
        e, s = row["every"], row["search"]
        table.add_row(
            str(stages), schedule, f"{every.ways:,}",
            f"{e['predicted']:,}, {e['seconds']:.1f}, {e['step_seconds'] * 1e3:.2f}",
            f"{s['predicted']:,}, {s['seconds']:.1f}, {s['step_seconds'] * 1e3:.2f}",
            f"{row['ratio']:.4f}",
        )  # fmt: skip
    Console(width=200).print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "format": "jaxreshard-cut-search/1",
                    "machine": platform.node(),
                    "python": platform.python_version(),
                    "when": time.strftime("%Y-%m-%d"),
                    "layers": args.layers,
                    "width": args.width,
                    "gbps": args.gbps,
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
