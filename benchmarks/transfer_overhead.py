"""What a boundary tensor costs on the local runtime beyond its copy.

For each tensor, in one process with nothing else running: `jax.device_put` between the two
stage meshes (JAX's own floor), the transfer's plan executed alone (`execute_local`), and the
full path a pipeline takes (`Channels.send` then `Channels.recv`). The difference between the
last two is the runtime's per-transfer overhead. Prints a table; writes JSON with --out.

    python benchmarks/transfer_overhead.py --out transfer_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table

import jaxreshard as jr
from jaxreshard.comm._local import execute_local
from jaxreshard.runtime.engine._events import transfer_key

SHAPES = {"64 KiB": (4, 64, 64), "256 KiB": (2, 128, 256), "4 MiB": (8, 256, 512)}


def two_stage_step(shape):
    """A 2-stage step whose boundary tensor has `shape` (batch rows x features)."""

    def step(params, batch):
        def loss_fn(p):
            h = jnp.tanh(batch["x"] @ p["a"])
            h = jr.stage_boundary(h)
            return jnp.mean((h @ p["b"]) ** 2)

        loss, grads = jr.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), loss

    rows, width = shape[0] * int(np.prod(shape[1:-1])), shape[-1]
    params = {"a": np.ones((width, width), np.float32), "b": np.ones((width, 1), np.float32)}
    return step, params, {"x": np.ones((rows, width), np.float32)}


def timed(fn, repeats):
    for _ in range(20):
        jax.block_until_ready(fn())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure(label, shape, repeats):
    step, params, batch = two_stage_step(shape)
    config = jr.PipelineConfig(stage_mesh_shape=(1, 2), mesh_axis_names=("data", "model"),
                               backend="local")  # fmt: skip
    pipeline = jr.parallelize(step, config=config, batch_argnums=(1,)).pipeline(params, batch)
    channels = pipeline.channels_of[0]
    ins = next(i for i in pipeline.layout.programs[0] if i.op == "SEND")
    transfer = pipeline.layout.transfers[transfer_key(ins)]
    src, dst = channels._shardings[transfer_key(ins)]
    value = jax.device_put(np.ones(transfer.shape, transfer.dtype), src)
    channels.begin([0, 1])

    def through_channels():
        channels.send(ins, value)
        return channels.recv(ins)

    out = {
        "tensor": label,
        "shape": list(transfer.shape),
        "bytes": transfer.nbytes,
        "device_put_us": timed(lambda: jax.device_put(value, dst), repeats) * 1e6,
        "plan_us": timed(lambda: execute_local(transfer.plan, value, dst), repeats) * 1e6,
        "channels_us": timed(through_channels, repeats) * 1e6,
    }
    channels.end()
    out["overhead_us"] = out["channels_us"] - out["plan_us"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--repeats", type=int, default=500)
    args = parser.parse_args()
    rows = [measure(label, shape, args.repeats) for label, shape in SHAPES.items()]
    table = Table(title="a boundary tensor between two 1x2 CPU meshes (medians, microseconds)")
    for col in ("tensor", "jax.device_put", "plan alone", "send -> recv", "overhead"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["tensor"], f"{r['device_put_us']:.0f}", f"{r['plan_us']:.0f}",
                      f"{r['channels_us']:.0f}", f"{r['overhead_us']:.0f}")  # fmt: skip
    Console(width=120).print(table)
    if args.out:
        with open(args.out, "w") as f:
            record = {
                "format": "jaxreshard-transfer-overhead/1",
                "when": time.strftime("%Y-%m-%d"),
                "machine": platform.node(),
                "jax": jax.__version__,
                "results": rows,
            }
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
