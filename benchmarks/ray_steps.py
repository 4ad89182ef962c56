"""Plain training steps on the Ray runtime against the local runtime, and where Ray's extra
time goes.

The tiny GPT of `examples/configs/gpt_tiny.toml` (2 stages on 1x2 meshes, eager-1F1B with
weight delay, 4 micro-batches, Adam; or `--model`, `--config`, `--schedule`, `--optimizer`)
runs in one process on the local runtime (this process's fake CPU devices) and on a local
Ray cluster of 2 hosts (one host actor per stage, `distributed=False`: no stage spans hosts),
the two taking turns round by round so that the machine's noise hits both alike. Per backend:
- **async step**: `--chain` plain calls back to back, each feeding the next its parameters and
  optimizer state, waited for at the end (`wait()`), divided by the chain's length: the
  steady training step when the host does not wait for the device;
- **sync step**: one call waited for (`jax.block_until_ready` and the loss read) after the
  last step was done: what a step costs when nothing overlaps it;
- **returns after**: that call's return, before waiting.
Medians over `--rounds`. For Ray it also measures what a step's driver pays outside the
hosts' work: the round trip of an empty actor call (`ping`), and the driver's own share of a
synchronous step (`driver`: its time in `PipelineDriver.run` minus the wait for the hosts'
answers), and for both, from recorded steps (`profile_call`, each action timed apart), each
stage's compute and its time blocked in receives.

Prints a table; writes JSON with --out.

    python benchmarks/ray_steps.py --out benchmarks/results/ray_steps.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax
import numpy as np

import jaxreshard as jr
from jaxreshard.profiler._config import load_profile_config
from jaxreshard.profiler._run import Session

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "configs" / "gpt_tiny.toml"


class Runner:
    """One backend's session, stepped plainly (not profiled)."""

    def __init__(self, backend: str, runtime=None, model="gpt", config=CONFIG, overrides=None):
        pc = load_profile_config(model, config, overrides).replace_pipeline(backend=backend)
        self.session = Session(pc, backend, runtime=runtime)
        self.state = (self.session.params, self.session.opt)
        self.losses: list[float] = []

    def call(self):
        s = self.session
        params, opt, loss = s.pstep(*self.state, s._batch())
        self.state = (params, opt)
        return loss

    def wait(self, loss) -> None:
        jax.block_until_ready(self.state)
        self.losses.append(float(np.asarray(loss)))

    def chain(self, n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            loss = self.call()
        self.session.pstep.wait()
        self.wait(loss)
        return (time.perf_counter() - start) / n

    def sync(self) -> tuple[float, float]:
        start = time.perf_counter()
        loss = self.call()
        returned = time.perf_counter() - start
        self.wait(loss)
        return time.perf_counter() - start, returned


COMPUTE = ("F", "B", "W", "FB", "A")


def recorded(runner: Runner, steps: int) -> dict[str, float]:
    """Medians over `steps` recorded steps (`profile_call`, each action timed apart): the
    step, and per stage the sum of its actions' times and its time blocked in receives."""
    s = runner.session
    per: dict[str, list[float]] = {}
    for _ in range(steps):
        start = time.perf_counter()
        (params, opt, loss), events = s.pstep.profile_call(*runner.state, s._batch())
        runner.state = (params, opt)
        runner.losses.append(float(np.asarray(loss)))
        per.setdefault("step", []).append(time.perf_counter() - start)
        for stage in sorted({e.stage for e in events}):
            mine = [e for e in events if e.stage == stage]
            busy = sum(e.end - e.start for e in mine if e.kind in COMPUTE)
            blocked = sum(e.end - e.start for e in mine if e.kind == "wait")
            per.setdefault(f"s{stage} compute", []).append(busy)
            per.setdefault(f"s{stage} blocked", []).append(blocked)
    return {k: statistics.median(v) * 1e3 for k, v in per.items()}


def driver_share(runner: Runner, steps: int) -> list[float]:
    """The driver's own time in synchronous Ray steps: `PipelineDriver.run` minus its wait for
    the hosts' answers (wrapped for the measurement)."""
    from jaxreshard.runtime.ray import _hosts

    waited = []
    original = _hosts.RayHosts._wait_step

    def timed(self, refs, step_id):
        start = time.perf_counter()
        try:
            return original(self, refs, step_id)
        finally:
            waited.append(time.perf_counter() - start)

    _hosts.RayHosts._wait_step = timed
    (entry,) = runner.session.pstep._cache.values()
    hosts = entry.pipeline.processes
    stable = hosts._stable
    hosts._stable = False  # synchronous: the driver waits for the answers in the call
    try:
        out = []
        for _ in range(steps):
            waited.clear()
            start = time.perf_counter()
            loss = runner.call()
            total = time.perf_counter() - start
            runner.wait(loss)
            out.append(total - sum(waited))
            hosts._stable = False
    finally:
        _hosts.RayHosts._wait_step = original
        hosts._stable = stable
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--chain", type=int, default=10)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--model", default="gpt", help="gpt or utransformer")
    parser.add_argument("--config", type=Path, default=CONFIG, help="a profile TOML")
    parser.add_argument("--schedule", default=None, help="override the config's schedule")
    parser.add_argument("--optimizer", default=None, help="override the config's optimizer")
    args = parser.parse_args()
    overrides: dict = {"pipeline": {}, "run": {}}
    if args.schedule:
        overrides["pipeline"].update(schedule=args.schedule, weight_delay=False)
    if args.optimizer:
        overrides["run"]["optimizer"] = args.optimizer
    setup = dict(model=args.model, config=args.config, overrides=overrides)

    runtime = jr.init(backend="ray", num_hosts=2, devices_per_host=2, distributed=False)
    import ray

    try:
        runners = {"local": Runner("local", **setup), "ray": Runner("ray", runtime, **setup)}
        for r in runners.values():  # compile, and the synchronous first steps
            for _ in range(3):
                r.wait(r.call())
        rows: dict[str, dict[str, list[float]]] = {
            b: {"async": [], "sync": [], "returns": []} for b in runners
        }
        for _ in range(args.rounds):
            for backend, r in runners.items():
                rows[backend]["async"].append(r.chain(args.chain))
                ready, returned = r.sync()
                rows[backend]["sync"].append(ready)
                rows[backend]["returns"].append(returned)
        actor = runtime.actors[0]
        pings = []
        for _ in range(50):
            start = time.perf_counter()
            ray.get(actor.ping.remote())
            pings.append(time.perf_counter() - start)
        timed = {b: recorded(r, 5) for b, r in runners.items()}
        driver = driver_share(runners["ray"], args.rounds)
        losses = {b: r.losses for b, r in runners.items()}
    finally:
        jr.shutdown()

    med = {b: {k: statistics.median(v) * 1e3 for k, v in row.items()} for b, row in rows.items()}
    what = f"{args.model} ({args.config.name}"
    what += f", schedule {args.schedule}" if args.schedule else ""
    what += f", {args.optimizer}" if args.optimizer else ""
    print(f"{what}), {args.rounds} rounds, chains of {args.chain}; medians (ms)")
    print(f"{'backend':8} {'async step':>11} {'sync step':>10} {'returns after':>14}")
    for b, m in med.items():
        print(f"{b:8} {m['async']:11.1f} {m['sync']:10.1f} {m['returns']:14.2f}")
    ratio_async = med["ray"]["async"] / med["local"]["async"]
    ratio_sync = med["ray"]["sync"] / med["local"]["sync"]
    print(f"Ray / local: async {ratio_async:.2f}x, sync {ratio_sync:.2f}x")
    ping_ms = statistics.median(pings) * 1e3
    driver_ms = statistics.median(driver) * 1e3
    print(
        f"Ray: empty actor call {ping_ms:.2f} ms; "
        f"the driver's share of a sync step {driver_ms:.1f} ms"
    )
    print("recorded steps (each action timed apart), medians (ms):")
    for b, t in timed.items():
        print(f"  {b:6} " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()))
    n = len(losses["local"])  # (Ray ran more steps: the driver's share)
    same = np.allclose(losses["local"], losses["ray"][:n], rtol=1e-5)
    print(f"losses equal (rtol 1e-5) step for step: {same}")
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "benchmark": "ray_steps",
                    "date": time.strftime("%Y-%m-%d"),
                    "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                    "jax": jax.__version__,
                    "ray": ray.__version__,
                    "model": args.model,
                    "config": str(args.config),
                    "overrides": overrides,
                    "rounds": args.rounds,
                    "chain": args.chain,
                    "median_ms": med,
                    "ray_over_local": {"async": ratio_async, "sync": ratio_sync},
                    "ping_ms": ping_ms,
                    "driver_share_ms": driver_ms,
                    "recorded_ms": timed,
                    "losses_equal": bool(same),
                    "samples_s": rows,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
