"""Automatic partitioning against every hand-placed cut, predicted beside measured.

The default model (`--model mlp`): a 6-layer MLP with equal compute per layer whose layer
outputs alternate 1024 and 256 wide (the input is 256 wide), trained by SGD. `--model gpt` or
`--model utransformer` take a shipped model (`--preset`, `--set FIELD=VALUE` to change its
sizes; Adam) with a `jr.stage_candidate` after every layer (`train_step(candidates=True)`).
Each is trained as 2 stages, `--micro-batches` micro-batches, `--schedule`, on an emulated
cluster (`jaxreshard.cluster.emulated`: 2 hosts, one pinned core and one device each,
`--nic-gbps` NICs; root only). For each candidate as the hand-placed cut, and for
`partition="auto"` with the prediction alone (`partition_trials=0`) and then with
`partition_trials=--trials` (the default, 1: the predicted fastest measured and the prediction
refitted to it), the steady step is measured beside the partitioner's prediction for that cut:
every configuration is built and warmed up (2 steps), then timed in `--rounds` rounds, each
running every configuration in turn for `--steps` steps (the median step of all is kept), so
that the machine's drift falls on all alike. The table marks the equal-layer-count cut and
the compute-balanced one (the partitioner's measured segment times: the cut whose slower side
computes least).

    sudo python benchmarks/auto_partition.py --out benchmarks/results/auto_partition.json
    sudo python benchmarks/auto_partition.py --model utransformer --preset tiny --batch 8
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


def mlp_problem():
    """The MLP: its step, parameters, optimizer state, batch and layer count."""
    rng = np.random.default_rng(1)
    batch = {"x": rng.normal(size=(ROWS, IN)).astype(np.float32),
             "y": rng.normal(size=(ROWS, WIDTHS[-1])).astype(np.float32)}  # fmt: skip
    params = init_params()
    return step, params, OPT.init(params), batch, len(WIDTHS)


def model_problem(name, preset, sets, batch_size):
    """A shipped model with a candidate after every layer: step, parameters, state, batch,
    layer count."""
    import dataclasses

    from jaxreshard.models import get_model

    spec = get_model(name)
    cfg = spec.presets[preset]
    types = {f.name: f.type for f in dataclasses.fields(cfg)}
    changes = {}
    for item in sets:
        key, value = item.split("=", 1)
        changes[key] = type(getattr(cfg, key))(value) if key in types else value
    cfg = dataclasses.replace(cfg, **changes)
    opt = optax.adam(1e-3)
    params = spec.module.init_params(cfg, 0)
    batch = spec.module.synthetic_batch(cfg, batch_size, 0)
    fn = spec.module.train_step(cfg, 2, opt, candidates=True)
    return fn, params, opt.init(params), batch, spec.num_units(cfg)


class Timed:
    """One configuration of the step, trained on its own copy of the state: warmed up when
    made, then timed step by step in rounds beside the others (`timed_rounds`)."""

    def __init__(self, problem, config):
        fn, self.params, self.state, self.batch, _ = problem
        self.train = jr.parallelize(fn, config=config, batch_argnums=2)
        self.plan = self.train.plan(self.params, self.state, self.batch)
        self.times, self.losses = [], []
        self.steps(2, timed=False)  # (the first compiles)

    def steps(self, n, timed=True):
        for _ in range(n):
            start = time.perf_counter()
            self.params, self.state, loss = self.train(self.params, self.state, self.batch)
            self.losses.append(float(loss))
            if timed:
                self.times.append(time.perf_counter() - start)

    @property
    def step_s(self):
        return statistics.median(self.times)


def timed_rounds(runs, rounds, steps):
    """Every configuration in turn, `steps` steps each, `rounds` times over: the machine's
    drift falls on all alike (measured one after another, the same cut's step differed by 15%
    within a run on this shared 2-core machine)."""
    for _ in range(rounds):
        for run in runs:
            run.steps(steps)
    for run in runs:
        run.train.close()


def jit_losses(problem, steps):
    """The same steps under `jax.jit` on this process (candidates are the identity there)."""
    fn, params, state, batch, _ = problem
    step, losses = jax.jit(fn), []
    for _ in range(steps):
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return losses


def prediction_errors(rows, report, trial):
    """Median relative errors over the hand cuts of the prediction alone and refitted (by the
    trials of `trial`); `drift`, the trials' cuts timed in the rounds over timed while choosing
    (median: the machine's drift between the two, and the trials' bursts of 2 steps against
    the rounds' one step at a time); and the refitted predictions times `drift`, over the cuts
    no trial ran (on a trial's own cut that error is 0 by construction). None where no trial
    ran."""
    if not trial.trials:
        return None
    measured = {(r["cut_after_layer"],): r["measured_s"] for r in rows}
    refitted = dict(trial.refitted) or {c.cuts: c.step for c in trial.tried}  # (no refit)
    drift = statistics.median(measured[t.cuts] / t.measured for t in trial.trials)
    untried = [c for c in measured if c not in {t.cuts for t in trial.trials}]

    def median_error(predicted, cuts, scale=1.0):
        return statistics.median(abs(predicted[c] * scale - measured[c]) / measured[c]
                                 for c in cuts)  # fmt: skip

    return {"alone": median_error({c.cuts: c.step for c in report.tried}, measured),
            "refitted": median_error(refitted, measured), "drift": drift,
            "refitted_times_drift_untried": median_error(refitted, untried, drift)
            if untried else None}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp", choices=("mlp", "gpt", "utransformer"))
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="change a field of the model's config")  # fmt: skip
    parser.add_argument("--batch", type=int, default=16, help="shipped models' batch")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--nic-gbps", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds, each timing every configuration in turn")  # fmt: skip
    parser.add_argument("--trials", type=int, default=1,
                        help="partition_trials of a second auto run, after one with the "
                             "prediction alone (partition_trials=0); 0: no second run")  # fmt: skip
    parser.add_argument("--name", default="apart")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from jaxreshard.models._common import split_evenly

    base = dict(stage_mesh_shape=(1,), num_micro_batches=args.micro_batches,
                schedule=args.schedule, backend="ray", num_stages=2)  # fmt: skip
    if args.model == "mlp":
        problem = mlp_problem()
    else:
        problem = model_problem(args.model, args.preset, args.set, args.batch)
    units = problem[-1]
    even = min(split_evenly(units, 2))
    rows = []
    with jaxreshard.cluster.emulated(
        hosts=2, nic_gbps=args.nic_gbps, cpus_per_host=1, devices_per_host=1, name=args.name
    ) as cluster:
        jr.init(backend="ray", address=cluster.address, timeout_s=300, distributed=False)
        predicted_only = jr.PipelineConfig(partition="auto", partition_trials=0, **base)
        auto = Timed(problem, predicted_only)
        report = auto.plan.partition
        runs = [auto]
        trial = None
        if args.trials > 0:
            config = jr.PipelineConfig(partition="auto", partition_trials=args.trials, **base)
            trial_run = Timed(problem, config)
            trial = trial_run.plan.partition
            runs.append(trial_run)
        cuts = [Timed(problem, jr.PipelineConfig(cuts=(c,), **base)) for c in range(units - 1)]
        timed_rounds(runs + cuts, args.rounds, args.steps)
        jr.shutdown()
    auto_s, auto_losses = auto.step_s, auto.losses
    trial_s = trial_run.step_s if trial is not None else None
    predicted = {c.cuts: c.step for c in report.tried}
    for c, run in enumerate(cuts):
        crossing = sum(t["bytes"] for t in run.plan.boundary_tensors() if t["kind"] == "act")
        rows.append({"cut_after_layer": c, "crossing_bytes": crossing,
                     "measured_s": run.step_s, "predicted_s": predicted[(c,)]})  # fmt: skip
    want = jit_losses(problem, len(auto_losses))
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(auto_losses, want))
    compute = [s.forward + s.backward for s in report.segments]
    balanced = min(range(units - 1),
                   key=lambda c: max(sum(compute[: c + 1]), sum(compute[c + 1 :])))  # fmt: skip
    best = min(rows, key=lambda r: r["measured_s"])
    by_cut = {r["cut_after_layer"]: r for r in rows}
    print(f"{'cut after layer':>15} {'crossing':>10} {'measured':>10} {'predicted':>10}")
    for r in rows:
        c = r["cut_after_layer"]
        marks = [m for m, k in (("auto", report.chosen[0]), ("equal count", even),
                                ("compute-balanced", balanced), ("best", best["cut_after_layer"]))
                 if k == c]  # fmt: skip
        mark = "  <- " + ", ".join(marks) if marks else ""
        print(f"{c:15d} {r['crossing_bytes'] / 2**20:7.2f} MiB {r['measured_s'] * 1e3:8.1f} ms "
              f"{r['predicted_s'] * 1e3:8.1f} ms{mark}")  # fmt: skip
    print(f"auto chose candidates {list(report.chosen)}: measured {auto_s * 1e3:.1f} ms; the "
          f"best hand cut {best['measured_s'] * 1e3:.1f} ms (after layer "
          f"{best['cut_after_layer']}): auto / best {auto_s / best['measured_s']:.3f}; the "
          f"equal-count cut / auto {by_cut[even]['measured_s'] / auto_s:.2f}x; the "
          f"compute-balanced cut / auto {by_cut[balanced]['measured_s'] / auto_s:.2f}x; "
          f"choosing took {report.seconds:.1f} s; auto's losses against jax.jit's: largest "
          f"relative difference {loss_diff:.1e} over {len(want)} steps")  # fmt: skip
    trial_json = None
    if trial is not None:
        trial_json = {"chosen": list(trial.chosen), "measured_s": trial_s,
                      "choose_seconds": trial.seconds, "report": trial.to_json()}  # fmt: skip
        tried = [(list(t.cuts), round(t.measured * 1e3, 1)) for t in trial.trials]
        print(
            f"auto with partition_trials={args.trials}: measured {tried} ms, chose "
            f"{list(trial.chosen)}: measured {trial_s * 1e3:.1f} ms, / best "
            f"{trial_s / best['measured_s']:.3f}; choosing took {trial.seconds:.1f} s"
        )
        trial_json["errors"] = errors = prediction_errors(rows, report, trial)
        if errors is not None:
            scaled = errors["refitted_times_drift_untried"]
            print(
                f"median error over every hand cut: prediction alone {errors['alone']:.1%}, "
                f"refitted {errors['refitted']:.1%}; the trials' cuts took {errors['drift']:.3f}x "
                "in the rounds what they took while choosing; the refitted predictions times "
                "that, over the cuts no trial ran: " + ("-" if scaled is None else f"{scaled:.1%}")
            )
    if args.out:
        Path(args.out).write_text(json.dumps({
            "benchmark": "auto_partition", "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.node()} ({os.cpu_count()} cores)", "nic_gbps": args.nic_gbps,
            "jax": jax.__version__, "model": args.model, "preset": args.preset,
            "set": args.set, "batch": args.batch, "micro_batches": args.micro_batches,
            "schedule": args.schedule, "rounds": args.rounds, "steps_per_round": args.steps,
            "equal_count_cut": even, "compute_balanced_cut": balanced,
            "rows": rows, "auto": {"chosen": list(report.chosen),
            "measured_s": auto_s, "choose_seconds": report.seconds,
            "loss_max_relative_difference_to_jit": loss_diff,
            "report": report.to_json()}, "auto_trials": trial_json,
        }, indent=1))  # fmt: skip
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
