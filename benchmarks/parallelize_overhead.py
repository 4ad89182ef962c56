"""Runtime overhead of `parallelize` on the local runtime: one stage, one micro-batch.

The same train step (an MLP with `jr.value_and_grad` and SGD, or the GPT of
`jaxreshard.models` with Adam) runs under `jax.jit` and under `jr.parallelize` with
`num_stages=1, num_micro_batches=1`; both are timed alternately in one process after a warm-up,
so the machine's noise hits both alike. Targets: at most 1.1x `jax.jit` on the medium and large
MLPs (CPU) and on one GPU. Prints a table; writes JSON with --out.

    python benchmarks/parallelize_overhead.py --out parallelize_overhead.json
    python benchmarks/parallelize_overhead.py --sizes gpt12 xl --dtype bfloat16   # a GPU
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
    "xl": (8, 4096, 4096),  # GPU-sized
}
GPT_SIZES = {  # name: (the GPT of jaxreshard.models (Adam) at this config, batch)
    "gpt12": (dict(vocab=51200, seq=1024, hidden=1024, layers=12, heads=16), 4),
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


def mlp_case(layers: int, hidden: int, rows: int, dtype: str) -> tuple:
    """(step, state, batch, FLOPs per step, batch argnum) of the MLP case."""
    rng = np.random.default_rng(0)
    params = {
        f"w{i}": (rng.normal(size=(hidden, hidden)) / hidden**0.5).astype(dtype)
        for i in range(layers)
    }
    batch = {
        "x": rng.normal(size=(rows, hidden)).astype(dtype),
        "y": rng.normal(size=(rows, hidden)).astype(dtype),
    }
    flops = 6 * layers * rows * hidden * hidden  # forward + backward matmuls
    return make_step(layers), (params,), batch, flops


def gpt_case(dims: dict, rows: int, dtype: str) -> tuple:
    from jaxreshard.models import gpt

    cfg = gpt.GPTConfig(**dims)
    params, opt = gpt.init_state(cfg)
    params = jax.tree.map(lambda x: np.asarray(x).astype(dtype), params)
    opt = jax.tree.map(lambda x: np.asarray(x).astype(dtype) if x.ndim else x, opt)
    step = gpt.train_step(cfg, 1)
    flops = cfg.flops_per_token() * cfg.seq * rows
    return step, (params, opt), gpt.synthetic_batch(cfg, rows, 0), flops


def measure(name: str, steps: int, dtype: str) -> dict:
    if name in GPT_SIZES:
        dims, rows = GPT_SIZES[name]
        step, state0, batch, flops = gpt_case(dims, rows, dtype)
        layers, hidden = dims["layers"], dims["hidden"]
    else:
        layers, hidden, rows = SIZES[name]
        step, state0, batch, flops = mlp_case(layers, hidden, rows, dtype)
    nstate = len(state0)
    jitted = jax.jit(step)
    config = jr.PipelineConfig(
        num_stages=1,
        num_micro_batches=1,
        stage_mesh_shape=(1,),
        mesh_axis_names=("data",),
        backend="local",
    )
    piped = jr.parallelize(step, config=config, batch_argnums=(nstate,))
    state = {
        "jit": jitted(*jax.device_put(state0), batch)[:nstate],
        "parallelize": piped(*state0, batch)[:nstate],
    }
    times: dict[str, list[float]] = {"jit": [], "parallelize": []}
    for _ in range(steps):
        for label, fn in (("jit", jitted), ("parallelize", piped)):
            start = time.perf_counter()
            out = fn(*state[label], batch)
            jax.block_until_ready(out)
            state[label] = out[:nstate]
            times[label].append(time.perf_counter() - start)
    jit_ms = statistics.median(times["jit"]) * 1e3
    ours_ms = statistics.median(times["parallelize"]) * 1e3
    return {
        "name": name,
        "dtype": np.dtype(dtype).name,
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
    parser.add_argument(
        "--sizes",
        nargs="+",
        default=["tiny", "small", "medium", "large"],
        choices=[*SIZES, *GPT_SIZES],
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else np.float32
    rows = [measure(n, args.steps, dtype) for n in args.sizes]
    device = jax.devices()[0]
    table = Table(
        title=f"parallelize (1 stage, 1 micro-batch) vs jax.jit, {args.steps} alternating steps"
        f" each: median and best; {device.platform} ({device.device_kind}), {args.dtype}"
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
                    "device": f"{device.platform} ({device.device_kind})",
                    "jax": jax.__version__,
                    "results": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
