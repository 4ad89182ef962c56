"""Per-device memory of a pipelined step: the partitioner's estimate against the arrays alive.

An MLP (``--layers`` layers of ``--width``, a ``jr.stage_candidate`` after each, Adam or
SGD (``--optimizer``), the parameters and optimizer state donated) is cut by
``partition="auto"`` (or by hand: ``--cuts``) into 2 stages on 1x1 meshes of fake CPU devices,
with each schedule of ``--schedules`` and 4 micro-batches. For each:
- **estimated**: the partitioner's peak per device of the chosen cuts, per mesh, without XLA's
  scratch (which no array shows): parameters, gradients, optimizer state, the new ones, the
  residuals times the micro-batches the schedule keeps alive ([Note: stage memory estimate]);
- **measured**: the most bytes of live JAX arrays on the mesh's device while a recorded step
  runs (``profile_call`` runs one action at a time; a thread sums ``jax.live_arrays()`` per
  device every 0.2 ms). It includes what the estimate leaves out: received activations, the
  micro-batches of the batch, the loss;
- **step**: the median of ``--steps`` plain steps.

Prints a table; writes JSON with --out. Run it from two checkouts to compare runtimes.

    python benchmarks/stage_memory.py --out benchmarks/results/stage_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxreshard as jr

SCHEDULES = {
    "1f1b": dict(schedule="1f1b"),
    "eager_1f1b+wd": dict(schedule="eager_1f1b", weight_delay=True),
    "zbv": dict(schedule="zbv", num_stages=4),
}


def make(layers: int, width: int, opt):
    def step(params, state, batch):
        def loss_fn(p):
            h = batch["x"]
            for i in range(layers):
                h = jnp.tanh(h @ p[i])
                if i < layers - 1:
                    h = jr.stage_candidate(h)
            return jnp.mean((h - batch["y"]) ** 2)

        loss, g = jr.value_and_grad(loss_fn)(params)
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step


class Sampler:
    """Peak bytes of live JAX arrays per device, sampled in a thread."""

    def __init__(self, interval_s: float = 2e-4):
        self.peak: dict[int, int] = {}
        self.interval_s, self._stop = interval_s, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            now: dict[int, int] = {}
            for a in jax.live_arrays():
                try:
                    for shard in a.addressable_shards:
                        d = shard.device.id
                        now[d] = now.get(d, 0) + shard.data.nbytes
                except Exception:
                    continue
            for d, n in now.items():
                self.peak[d] = max(self.peak.get(d, 0), n)
            time.sleep(self.interval_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run(name: str, args, opt) -> dict:
    rng = np.random.default_rng(0)
    params = [
        (rng.normal(size=(args.width, args.width)) / np.sqrt(args.width)).astype(np.float32)
        for _ in range(args.layers)
    ]
    batch = {
        "x": rng.normal(size=(args.batch, args.width)).astype(np.float32),
        "y": rng.normal(size=(args.batch, args.width)).astype(np.float32),
    }
    base = dict(partition="auto", num_stages=2, num_micro_batches=4, stage_mesh_shape=(1,),
                backend="local", devices_per_host=1)  # fmt: skip
    fixed = args.fixed.get(name)
    if fixed is not None:  # by hand: no partitioner, so no estimate
        base = {**base, "partition": "manual", "cuts": fixed}
    config = jr.PipelineConfig(**{**base, **SCHEDULES[name]})
    step = jr.parallelize(make(args.layers, args.width, opt), config=config, batch_argnums=2,
                          donate_argnums=(0, 1))  # fmt: skip
    state = opt.init(params)
    report = step.plan(params, state, batch).partition
    for _ in range(2):  # compile and settle the layouts
        params, state, loss = step(params, state, batch)
    float(loss)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        params, state, loss = step(params, state, batch)
        float(loss)
        times.append(time.perf_counter() - start)
    with Sampler() as sampler:
        (params, state, loss), _ = step.profile_call(params, state, batch)
    devices = sorted(sampler.peak)
    row = {
        "schedule": name,
        "cuts": list(fixed if fixed is not None else report.chosen),
        "measured_live_bytes": {str(d): sampler.peak[d] for d in devices},
        "step_ms": statistics.median(times) * 1e3,
    }
    if report is not None:
        chosen = next(c for c in report.tried if c.cuts == report.chosen)
        row["estimated_bytes"] = [int(n) for n in chosen.memory]
        row["estimated_without_scratch_bytes"] = [
            int(n - s) for n, s in zip(chosen.memory, chosen.scratch)
        ]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument(
        "--cuts",
        default="",
        help="fixed cuts instead of partition='auto', per schedule: '1f1b=2;zbv=1,3,4'",
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    args.fixed = {
        name: tuple(int(c) for c in cuts.split(","))
        for name, cuts in (item.split("=") for item in args.cuts.split(";") if item)
    }
    opt = optax.adam(1e-3) if args.optimizer == "adam" else optax.sgd(1e-3)
    rows = [run(name, args, opt) for name in args.schedules.split(",")]
    mib = 1 << 20
    print(f"MLP {args.layers}x{args.width}, batch {args.batch}, 4 micro-batches, "
          f"{args.optimizer}, donated")  # fmt: skip
    print(f"{'schedule':>14} {'cuts':>10} {'estimate/mesh (no scratch)':>30} "
          f"{'measured live/device':>24} {'step':>9}")  # fmt: skip
    for r in rows:
        est = ", ".join(f"{n / mib:.1f}" for n in r.get("estimated_without_scratch_bytes", []))
        est = est + " MiB" if est else "-"
        live = ", ".join(f"{n / mib:.1f}" for n in r["measured_live_bytes"].values())
        print(f"{r['schedule']:>14} {r['cuts']!s:>10} {est:>30} {live + ' MiB':>24} "
              f"{r['step_ms']:7.1f} ms")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": platform.node(), "jax": jax.__version__, "args": vars(args),
                       "rows": rows}, f, indent=2, default=list)  # fmt: skip


if __name__ == "__main__":
    main()
