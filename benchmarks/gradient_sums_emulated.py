"""Gradient sums over a batch axis that crosses hosts: `partition="auto"` with and without
charging them, against every hand-placed cut, on an emulated cluster.

The model puts its parameter bytes where its compute is not: 9 layers of width `--width`, each
a trained `width x width` matmul; the light ones then run `--depth` more matmuls by a fixed
(untrained) matrix, so they hold the compute, and three heavy ones in front (layers 0-2) each
add a trained `width x --hidden x width` bottleneck, so they hold most of the parameters and
little compute (a few rows per micro-batch). It is trained by SGD as 2 stages of
2 devices each, on an emulated cluster of 4 hosts with one device each (root only): each stage's
`data` axis spans two hosts, so each stage sums its gradients over the `--nic-gbps` NICs once a
step (`reduce_gradients="once"`), the two stages at once on their own hosts' NICs.

The compute-balanced cut puts the three heavy layers in one stage, whose sum then takes
longer than both stages' would with a cut that shares them out. `partition="auto"` runs twice,
by prediction alone (`partition_trials=0`): as it is ([Note: gradient sums in the
partitioner]), and with those sums left out (as before 2026-11-29). Both, and every hand-placed
cut, are built, warmed up (2 steps), and timed side by side in `--rounds` rounds of `--steps`
steps (medians); each row prints both predictions beside the measured step.

    sudo python benchmarks/gradient_sums_emulated.py --out benchmarks/results/gradient_sums.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from auto_partition import Timed, jit_losses, timed_rounds

import jaxreshard as jr
import jaxreshard.cluster
from jaxreshard.runtime.step import _collectives

LAYERS = 9
HEAVY = (0, 1, 2)
OPT = optax.sgd(1e-3)


def problem(width: int, hidden: int, depth: int, rows: int):
    """The model's step, parameters, optimizer state, batch and layer count."""
    rng = np.random.default_rng(0)
    fixed = jnp.asarray(rng.normal(size=(width, width)) / np.sqrt(width), jnp.float32)
    params = {}
    for i in range(LAYERS):
        params[f"w{i}"] = (rng.normal(size=(width, width)) / np.sqrt(width)).astype(np.float32)
        if i in HEAVY:
            params[f"u{i}"] = (rng.normal(size=(width, hidden)) / np.sqrt(width)).astype(np.float32)
            params[f"v{i}"] = (rng.normal(size=(hidden, width)) / np.sqrt(hidden)).astype(
                np.float32
            )

    def step(params, state, batch):
        def loss_fn(p):
            h = batch["x"]
            for i in range(LAYERS):
                h = jnp.tanh(h @ p[f"w{i}"])
                if i in HEAVY:
                    h = h + jnp.tanh(h @ p[f"u{i}"]) @ p[f"v{i}"]
                else:
                    for _ in range(depth):
                        h = jnp.tanh(h @ fixed)
                if i < LAYERS - 1:
                    h = jr.stage_candidate(h)
            return jnp.mean((h - batch["y"]) ** 2)

        loss, g = jr.value_and_grad(loss_fn)(params)
        updates, state = OPT.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss

    batch = {"x": rng.normal(size=(rows, width)).astype(np.float32),
             "y": rng.normal(size=(rows, width)).astype(np.float32)}  # fmt: skip
    return step, params, OPT.init(params), batch, LAYERS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=24, help="fixed matmuls per light layer")
    parser.add_argument("--rows", type=int, default=16, help="batch rows")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--nic-gbps", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--name", default="gsum")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    prob = problem(args.width, args.hidden, args.depth, args.rows)
    base = dict(stage_mesh_shape=(2,), mesh_axis_names=("data",), num_stages=2,
                num_micro_batches=args.micro_batches, schedule=args.schedule, backend="ray",
                reduce_gradients="once", partition_trials=0)  # fmt: skip
    real = _collectives.GradientSums.costs
    with jaxreshard.cluster.emulated(
        hosts=4, nic_gbps=args.nic_gbps, cpus_per_host=1, devices_per_host=1, name=args.name
    ) as cluster:
        jr.init(backend="ray", address=cluster.address, timeout_s=600)
        charged = Timed(prob, jr.PipelineConfig(partition="auto", **base))
        # (as before 2026-11-29: no chunk sums anything)
        _collectives.GradientSums.costs = lambda self, bounds: _collectives.Sums(
            (0.0,) * (len(bounds) + 1), (0.0,) * (len(bounds) + 1)
        )
        try:
            uncharged = Timed(prob, jr.PipelineConfig(partition="auto", **base))
        finally:
            _collectives.GradientSums.costs = real
        cut_base = {k: v for k, v in base.items() if k != "partition_trials"}
        cuts = [Timed(prob, jr.PipelineConfig(cuts=(c,), **cut_base)) for c in range(LAYERS - 1)]
        timed_rounds([charged, uncharged, *cuts], args.rounds, args.steps)
        jr.shutdown()
    with_sums, without = charged.plan.partition, uncharged.plan.partition
    predicted = {c.cuts[0]: c.step for c in with_sums.tried}
    before = {c.cuts[0]: c.step for c in without.tried}
    rows = [{"cut_after_layer": c, "measured_s": run.step_s, "predicted_s": predicted[c],
             "predicted_without_sums_s": before[c]} for c, run in enumerate(cuts)]  # fmt: skip
    best = min(rows, key=lambda r: r["measured_s"])
    want = jit_losses(prob, len(charged.losses))
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(charged.losses, want))
    print(f"{'cut after layer':>15} {'measured':>10} {'predicted':>10} {'without sums':>13}")
    for r in rows:
        c = r["cut_after_layer"]
        marks = [m for m, k in (("auto", with_sums.chosen[0]), ("auto without sums",
                 without.chosen[0]), ("best", best["cut_after_layer"])) if k == c]  # fmt: skip
        print(f"{c:15d} {r['measured_s'] * 1e3:8.1f} ms {r['predicted_s'] * 1e3:8.1f} ms "
              f"{r['predicted_without_sums_s'] * 1e3:10.1f} ms"
              + ("  <- " + ", ".join(marks) if marks else ""))  # fmt: skip
    held = [max(v) for v in with_sums.gradient_bytes]
    print("gradient bytes per device, per segment (MiB): "
          + ", ".join(f"{n / 2**20:.1f}" for n in held))  # fmt: skip
    for c in with_sums.tried:
        if c.cuts == with_sums.chosen:
            print("the chosen chunks' sums once a step (ms): "
                  + ", ".join(f"{t * 1e3:.1f}" for t in c.sums.once))  # fmt: skip
    print(
        f"auto (sums charged) chose {list(with_sums.chosen)}: {charged.step_s * 1e3:.1f} ms; "
        f"without sums it chose {list(without.chosen)}: {uncharged.step_s * 1e3:.1f} ms "
        f"({uncharged.step_s / charged.step_s:.2f}x); the best hand cut "
        f"{best['measured_s'] * 1e3:.1f} ms (after layer {best['cut_after_layer']}); "
        f"losses against jax.jit's: largest relative difference {loss_diff:.1e}"
    )
    if args.out:
        Path(args.out).write_text(json.dumps({
            "benchmark": "gradient_sums_emulated", "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.node()} ({os.cpu_count()} cores)", "nic_gbps": args.nic_gbps,
            "jax": jax.__version__, "width": args.width, "hidden": args.hidden,
            "depth": args.depth, "rows": args.rows, "micro_batches": args.micro_batches,
            "schedule": args.schedule, "rounds": args.rounds, "steps_per_round": args.steps,
            "rows_by_cut": rows,
            "auto": {"chosen": list(with_sums.chosen), "measured_s": charged.step_s,
                     "report": with_sums.to_json()},
            "auto_without_sums": {"chosen": list(without.chosen), "measured_s": uncharged.step_s,
                                  "report": without.to_json()},
            "loss_max_relative_difference_to_jit": loss_diff,
        }, indent=1))  # fmt: skip
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
