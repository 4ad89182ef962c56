"""Automatic partitioning against every hand-placed cut, predicted beside measured.

A 6-layer MLP with equal compute per layer whose layer outputs alternate 1024 and 256 wide
(the input is 256 wide), trained by SGD as 2 stages, 4 micro-batches, 1F1B, on an emulated
cluster (`jaxreshard.cluster.emulated`: 2 hosts, one pinned core and one device each, 0.01 GB/s
NICs; root only). A `jr.stage_candidate` after each of the first 5 layers; for each candidate as
the hand-placed cut, and for `partition="auto"`, the steady step is measured (median of
`--steps` after 2 warm-up steps), beside the partitioner's prediction for that cut.

    sudo python benchmarks/auto_partition.py --out benchmarks/results/auto_partition.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxreshard as jr
import jaxreshard.cluster

WIDTHS = [1024, 256, 1024, 256, 1024, 256]
IN, ROWS = 256, 256
OPT = optax.sgd(1e-3)


def init_params():
    rng = np.random.default_rng(0)
    params, fan_in = {}, IN
    for i, w in enumerate(WIDTHS):
        params[f"l{i}"] = (rng.normal(size=(fan_in, w)) / np.sqrt(fan_in)).astype(np.float32)
        fan_in = w
    return params


def step(params, state, batch):
    def loss_fn(p):
        h = batch["x"]
        for i in range(len(WIDTHS)):
            h = jnp.tanh(h @ p[f"l{i}"])
            if i < len(WIDTHS) - 1:
                h = jr.stage_candidate(h)
        return jnp.mean((h - batch["y"]) ** 2)

    loss, g = jr.value_and_grad(loss_fn)(params)
    updates, state = OPT.update(g, state, params)
    return optax.apply_updates(params, updates), state, loss


def measure(config, steps):
    train = jr.parallelize(step, config=config, batch_argnums=2)
    rng = np.random.default_rng(1)
    batch = {"x": rng.normal(size=(ROWS, IN)).astype(np.float32),
             "y": rng.normal(size=(ROWS, WIDTHS[-1])).astype(np.float32)}  # fmt: skip
    params = init_params()
    state = OPT.init(params)
    plan = train.plan(params, state, batch)
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        params, state, loss = train(params, state, batch)
        float(loss)
        if i >= 2:
            times.append(time.perf_counter() - start)
    train.close()
    return statistics.median(times), plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nic-gbps", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--name", default="apart")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    base = dict(stage_mesh_shape=(1,), num_micro_batches=4, schedule="1f1b", backend="ray",
                num_stages=2)  # fmt: skip
    rows = []
    with jaxreshard.cluster.emulated(
        hosts=2, nic_gbps=args.nic_gbps, cpus_per_host=1, devices_per_host=1, name=args.name
    ) as cluster:
        jr.init(backend="ray", address=cluster.address, timeout_s=300, distributed=False)
        auto_s, plan = measure(jr.PipelineConfig(partition="auto", **base), args.steps)
        report = plan.partition
        predicted = {c.cuts: c.step for c in report.tried}
        for c in range(len(WIDTHS) - 1):
            measured, _ = measure(jr.PipelineConfig(cuts=(c,), **base), args.steps)
            rows.append({"cut_after_layer": c, "width": WIDTHS[c], "measured_s": measured,
                         "predicted_s": predicted[(c,)]})  # fmt: skip
        jr.shutdown()
    best = min(rows, key=lambda r: r["measured_s"])
    print(f"{'cut after layer':>15} {'width':>6} {'measured':>10} {'predicted':>10}")
    for r in rows:
        mark = " <- auto" if (r["cut_after_layer"],) == report.chosen else ""
        print(f"{r['cut_after_layer']:15d} {r['width']:6d} {r['measured_s'] * 1e3:8.1f} ms "
              f"{r['predicted_s'] * 1e3:8.1f} ms{mark}")  # fmt: skip
    print(f"auto chose candidates {list(report.chosen)}: measured {auto_s * 1e3:.1f} ms; the "
          f"best hand cut {best['measured_s'] * 1e3:.1f} ms (after layer "
          f"{best['cut_after_layer']}); choosing took {report.seconds:.1f} s")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({
            "benchmark": "auto_partition", "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.node()} ({os.cpu_count()} cores)", "nic_gbps": args.nic_gbps,
            "jax": jax.__version__, "rows": rows, "auto": {"chosen": list(report.chosen),
            "measured_s": auto_s, "choose_seconds": report.seconds},
        }, indent=1))  # fmt: skip
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
