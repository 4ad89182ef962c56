"""Runtime overhead of `parallelize` on the local runtime: one stage, one micro-batch.

The same train step (an MLP, `jr.value_and_grad`, SGD) runs under `jax.jit` and under
`jr.parallelize` with `num_stages=1, num_micro_batches=1`; both are timed alternately in one
process after a warm-up, so the machine's noise hits both alike. The target of the issue:
at most 1.2x `jax.jit`. Prints a table; writes JSON with --out.

    python benchmarks/parallelize_overhead.py --out parallelize_overhead.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table

import jaxreshard as jr

SIZES = {  # name: (layers, hidden, batch)
    "tiny": (2, 64, 32),
    "small": (4, 512, 128),
    "medium": (4, 1024, 256),
    "large": (4, 2048, 512),
}


def make_step(layers: int):
    def step(params, batch):
        def loss_fn(p):
            h = batch["x"]
            for i in range(layers):
                h = jnp.tanh(h @ p[f"w{i}"])
            return jnp.mean((h - batch["y"]) ** 2)

        loss, grads = jr.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda w, g: w - 0.01 * g, params, grads), loss

    return step


def measure(name: str, layers: int, hidden: int, rows: int, steps: int) -> dict:
    rng = np.random.default_rng(0)
    params = {
        f"w{i}": rng.normal(size=(hidden, hidden)).astype(np.float32) / hidden**0.5
        for i in range(layers)
    }
    batch = {
        "x": rng.normal(size=(rows, hidden)).astype(np.float32),
        "y": rng.normal(size=(rows, hidden)).astype(np.float32),
    }
    step = make_step(layers)
    jitted = jax.jit(step)
    config = jr.PipelineConfig(
        num_stages=1,
        num_micro_batches=1,
        stage_mesh_shape=(1,),
        mesh_axis_names=("data",),
        backend="local",
    )
    piped = jr.parallelize(step, config=config, batch_argnums=(1,))
    state = {"jit": jax.device_put(params), "parallelize": piped(params, batch)[0]}
    state["jit"] = jitted(state["jit"], batch)[0]
    times: dict[str, list[float]] = {"jit": [], "parallelize": []}
    for _ in range(steps):
        for label, fn in (("jit", jitted), ("parallelize", piped)):
            start = time.perf_counter()
            state[label], loss = fn(state[label], batch)
            jax.block_until_ready((state[label], loss))
            times[label].append(time.perf_counter() - start)
    jit_ms = statistics.median(times["jit"]) * 1e3
    ours_ms = statistics.median(times["parallelize"]) * 1e3
    flops = 6 * layers * rows * hidden * hidden  # forward + backward matmuls
    return {
        "name": name,
        "layers": layers,
        "hidden": hidden,
        "batch": rows,
        "gflop_per_step": flops / 1e9,
        "jit_ms": jit_ms,
        "parallelize_ms": ours_ms,
        "ratio": ours_ms / jit_ms,
        "overhead_ms": ours_ms - jit_ms,
        "best_jit_ms": min(times["jit"]) * 1e3,
        "best_parallelize_ms": min(times["parallelize"]) * 1e3,
        "best_ratio": min(times["parallelize"]) / min(times["jit"]),
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    args = parser.parse_args()
    rows = [measure(n, *SIZES[n], args.steps) for n in args.sizes]
    table = Table(
        title=f"parallelize (1 stage, 1 micro-batch) vs jax.jit, {args.steps} alternating steps"
        f" each: median and best; {jax.devices()[0].platform}"
    )
    for column in (
        "model",
        "layers x hidden",
        "batch",
        "GFLOP/step",
        "jax.jit ms",
        "parallelize ms",
        "ratio",
        "best jit ms",
        "best ours ms",
        "best ratio",
    ):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["name"],
            f"{r['layers']}x{r['hidden']}",
            str(r["batch"]),
            f"{r['gflop_per_step']:.2f}",
            f"{r['jit_ms']:.2f}",
            f"{r['parallelize_ms']:.2f}",
            f"{r['ratio']:.2f}x",
            f"{r['best_jit_ms']:.2f}",
            f"{r['best_parallelize_ms']:.2f}",
            f"{r['best_ratio']:.2f}x",
        )
    Console(width=160).print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "format": "jaxreshard-parallelize-overhead/1",
                    "when": time.strftime("%Y-%m-%d"),
                    "machine": platform.node(),
                    "jax": jax.__version__,
                    "results": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
