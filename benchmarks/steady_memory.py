"""Resident memory and threads over a long run: does a pipeline leak?

Two checks on the local runtime, with the tiny NNX LM of `action_overhead.py` (2 stages x 4
micro-batches, 1F1B, 1x1 meshes of fake CPU devices):
1. Steady state: after a warm-up, 150 (``--steps``) training steps; the process's resident
   memory (``/proc/self/statm``) is sampled every 10 steps. Reports its growth from the end of
   the warm-up, and the number of live ``jaxreshard-*`` threads. The same step under
   ``jax.jit`` runs the same way first, in the same process, as the baseline: JAX and the
   allocator grow the resident set a little by themselves.
2. Build, run and drop: 6 parallelized steps (different schedules and micro-batch counts), each
   compiled, run 3 steps and dropped; then the ``jaxreshard-*`` threads still alive.

Prints a table; writes JSON with --out.

    python benchmarks/steady_memory.py --out benchmarks/results/steady_memory.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
from action_overhead import ROWS, SEQ, VOCAB, make

import jaxreshard as jr


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def our_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("jaxreshard-"))


def config(schedule: str = "1f1b", m: int = 4) -> jr.PipelineConfig:
    return jr.PipelineConfig(
        num_micro_batches=m, schedule=schedule, num_stages=2, stage_mesh_shape=(1,),
        mesh_axis_names=("data",), backend="local",
    )  # fmt: skip


def steady(fn, state, batches, args) -> tuple[list[tuple[int, float]], float]:
    """Warm up, then run ``args.steps`` steps sampling the resident set every 10."""
    for i in range(args.warmup):
        *state, loss = fn(*state, batches[i % len(batches)])
        float(loss)
    gc.collect()
    samples = [(0, rss_mib())]
    start = time.perf_counter()
    for i in range(1, args.steps + 1):
        *state, loss = fn(*state, batches[i % len(batches)])
        float(loss)
        if i % 10 == 0:
            gc.collect()
            samples.append((i, rss_mib()))
    return samples, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--out")
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    rng = np.random.default_rng(0)
    batches = [rng.integers(0, VOCAB, size=(ROWS, SEQ + 1)).astype(np.int32) for _ in range(8)]
    step, params, opt = make(2)
    jit_samples, jit_seconds = steady(jax.jit(step), (params, opt), batches, args)
    fn = jr.parallelize(step, config=config(), batch_argnums=(2,))
    samples, seconds = steady(fn, (params, opt), batches, args)
    steady_threads = our_threads()
    del fn
    gc.collect()

    before = set(our_threads())
    for schedule in ("1f1b", "eager_1f1b", "gpipe"):
        for m in (2, 4):
            step, params, opt = make(2)
            built = jr.parallelize(step, config=config(schedule, m), batch_argnums=(2,))
            state = (params, opt)
            for i in range(3):
                *state, loss = built(*state, batches[i])
            float(loss)
            del built, state, loss
    gc.collect()
    deadline = time.monotonic() + 10
    while not set(our_threads()) <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    left = sorted(set(our_threads()) - before)

    base = samples[0][1]
    growth = samples[-1][1] - base
    jit_growth = jit_samples[-1][1] - jit_samples[0][1]
    table = Table(title="resident memory and threads, NNX LM, 2 stages x 4 micro-batches")
    table.add_column("check")
    table.add_column("result")
    table.add_row("RSS after warm-up (MiB)", f"{base:.1f}")
    table.add_row(f"RSS after {args.steps} more steps (MiB)", f"{samples[-1][1]:.1f}")
    table.add_row("growth (MiB)", f"{growth:+.1f}")
    table.add_row("largest sample (MiB)", f"{max(r for _, r in samples):.1f}")
    table.add_row("growth under jax.jit, same steps (MiB)", f"{jit_growth:+.1f}")
    table.add_row(
        "ms per step (jax.jit)",
        f"{seconds / args.steps * 1e3:.1f} ({jit_seconds / args.steps * 1e3:.1f})",
    )
    table.add_row("jaxreshard threads while running", str(len(steady_threads)))
    table.add_row(
        "threads left by 6 built-run-dropped steps", str(len(left)) + (f" {left}" if left else "")
    )
    Console().print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "format": "jaxreshard-steady-memory/1",
                    "date": time.strftime("%Y-%m-%d"),
                    "machine": f"{platform.machine()} {os.cpu_count()} cores, "
                    f"{platform.python_version()}, jax {jax.__version__}",
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "rss_mib": samples,
                    "growth_mib": growth,
                    "jit_rss_mib": jit_samples,
                    "jit_growth_mib": jit_growth,
                    "threads_running": steady_threads,
                    "threads_left_after_drop": left,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
