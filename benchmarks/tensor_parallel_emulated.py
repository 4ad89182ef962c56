"""A model axis that crosses hosts: `partition="auto"` with its tensor-parallel work priced, with
its compute divided alone, and with neither, against every hand-placed cut, on an emulated
cluster.

The model is `--blocks` Megatron-style MLP blocks (`h + tanh(h @ w1) @ w2`, `w1` split over
`model` by columns, `w2` by rows: one all-reduce of the block's output rows in its forward, one
of its input gradient in its backward), a `jr.stage_candidate` after each, trained by SGD as 2
stages on an emulated cluster of 3 hosts with one device each (root only): stage 0 is a (1, 2)
mesh whose `model` axis spans hosts 0 and 1, stage 1 one device on host 2. So each block on
stage 0 computes half as much per device as on stage 1, but sends its activations over the
`--nic-gbps` NIC twice per micro-batch. The blocks are narrow inside (`--hidden`), so that the
links decide rather than compute: the 3 emulated hosts share this machine's 2 cores, where the
step's compute is much the same whichever cut (with `--hidden 2048` every cut measured within
the noise, 436-499 ms a step).

`partition="auto"` runs three times, by prediction alone (`partition_trials=0`): as it is
([Note: tensor-parallel stages in the partitioner]); with the compute divided but the
collectives left out; and with neither (as before 2026-11-29: every segment at one device's
time on every mesh). All three, and every hand-placed cut, are built, warmed up (2 steps) and
timed side by side in `--rounds` rounds of `--steps` steps (medians); each row prints the
predictions beside the measured step.

    sudo python benchmarks/tensor_parallel_emulated.py --out benchmarks/results/tp.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

# (the driver compiles stage 0's model slice, 2 devices, to read its collectives)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from auto_partition import Timed, jit_losses, timed_rounds
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxreshard as jr
import jaxreshard.cluster
from jaxreshard.runtime.step import _tensor_parallel

OPT = optax.sgd(1e-3)
NAMES = ("data", "model")


def problem(blocks: int, width: int, hidden: int, rows: int):
    """The model's step, parameters (split over a 2-device `model` axis on this process),
    optimizer state, batch and block count."""
    rng = np.random.default_rng(0)
    mesh = Mesh(np.asarray(jax.devices()[:2]).reshape(1, 2), NAMES)
    params = {}
    for i in range(blocks):
        w1 = (rng.normal(size=(width, hidden)) / np.sqrt(width)).astype(np.float32)
        w2 = (rng.normal(size=(hidden, width)) / np.sqrt(hidden)).astype(np.float32)
        params[f"w1_{i}"] = jax.device_put(w1, NamedSharding(mesh, P(None, "model")))
        params[f"w2_{i}"] = jax.device_put(w2, NamedSharding(mesh, P("model", None)))

    def step(params, state, batch):
        def loss_fn(p):
            h = batch["x"]
            for i in range(blocks):
                h = h + jnp.tanh(h @ p[f"w1_{i}"]) @ p[f"w2_{i}"]
                if i < blocks - 1:
                    h = jr.stage_candidate(h)
            return jnp.mean((h - batch["y"]) ** 2)

        loss, g = jr.value_and_grad(loss_fn)(params)
        updates, state = OPT.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss

    batch = {"x": rng.normal(size=(rows, width)).astype(np.float32),
             "y": rng.normal(size=(rows, width)).astype(np.float32)}  # fmt: skip
    return step, params, OPT.init(params), batch, blocks


def _without(collectives: bool, compute: bool):
    """`_tensor_parallel._priced` leaving out the collectives and/or the divided compute."""
    real = _tensor_parallel._priced

    def priced(c, ratio, rings, split, cluster):
        work = real(c, ratio, rings, split, cluster)
        if collectives:
            work.seconds = (0.0, 0.0, 0.0)
        if compute:
            work.factors = (ratio,) * 3
        return work

    return priced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rows", type=int, default=128, help="batch rows")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--nic-gbps", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--name", default="tpar")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    prob = problem(args.blocks, args.width, args.hidden, args.rows)
    base = dict(stage_mesh_shape=((1, 2), (1, 1)), mesh_axis_names=NAMES, num_stages=2,
                num_micro_batches=args.micro_batches, schedule=args.schedule, backend="ray",
                partition_trials=0)  # fmt: skip
    real = _tensor_parallel._priced
    variants = {"priced": (False, False), "compute only": (True, False), "neither": (True, True)}
    autos = {}
    with jaxreshard.cluster.emulated(
        hosts=3, nic_gbps=args.nic_gbps, cpus_per_host=1, devices_per_host=1, name=args.name
    ) as cluster:
        jr.init(backend="ray", address=cluster.address, timeout_s=600)
        for label, (collectives, compute) in variants.items():
            _tensor_parallel._priced = _without(collectives, compute)
            try:
                autos[label] = Timed(prob, jr.PipelineConfig(partition="auto", **base))
            finally:
                _tensor_parallel._priced = real
        cut_base = {k: v for k, v in base.items() if k != "partition_trials"}
        cuts = [Timed(prob, jr.PipelineConfig(cuts=(c,), **cut_base))
                for c in range(args.blocks - 1)]  # fmt: skip
        timed_rounds([*autos.values(), *cuts], args.rounds, args.steps)
        jr.shutdown()
    reports = {label: run.plan.partition for label, run in autos.items()}
    predicted = {label: {c.cuts[0]: c.step for c in r.tried} for label, r in reports.items()}
    rows = [{"cut_after_block": c, "measured_s": run.step_s,
             **{f"predicted_{k.replace(' ', '_')}_s": predicted[k][c] for k in variants}}
            for c, run in enumerate(cuts)]  # fmt: skip
    best = min(rows, key=lambda r: r["measured_s"])
    want = jit_losses(prob, len(autos["priced"].losses))
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(autos["priced"].losses, want))
    head = "".join(f" {'predicted, ' + k:>24}" for k in variants)
    print(f"{'cut after block':>15} {'measured':>10}{head}")
    for r in rows:
        c = r["cut_after_block"]
        marks = [f"auto ({k})" for k, rep in reports.items() if rep.chosen[0] == c]
        marks += ["best"] if c == best["cut_after_block"] else []
        print(f"{c:15d} {r['measured_s'] * 1e3:8.1f} ms"
              + "".join(f" {predicted[k][c] * 1e3:21.1f} ms" for k in variants)
              + ("  <- " + ", ".join(marks) if marks else ""))  # fmt: skip
    print("\n".join(reports["priced"].tensor_parallel))
    for label, run in autos.items():
        best_ms, after = best["measured_s"] * 1e3, best["cut_after_block"]
        print(f"auto ({label}) chose {list(reports[label].chosen)}: {run.step_s * 1e3:.1f} ms, "
              f"{run.step_s / best['measured_s']:.2f}x the best hand cut "
              f"({best_ms:.1f} ms, after block {after})")  # fmt: skip
    print(f"losses against jax.jit's: largest relative difference {loss_diff:.1e}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "benchmark": "tensor_parallel_emulated", "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.node()} ({os.cpu_count()} cores)", "nic_gbps": args.nic_gbps,
            "jax": jax.__version__, "blocks": args.blocks, "width": args.width,
            "hidden": args.hidden, "rows": args.rows, "micro_batches": args.micro_batches,
            "schedule": args.schedule, "rounds": args.rounds, "steps_per_round": args.steps,
            "rows_by_cut": rows,
            "auto": {label: {"chosen": list(reports[label].chosen), "measured_s": run.step_s,
                             "report": reports[label].to_json()}
                     for label, run in autos.items()},
            "loss_max_relative_difference_to_jit": loss_diff,
        }, indent=1))  # fmt: skip
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
