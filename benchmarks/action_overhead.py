"""The fixed cost of a pipeline action: tiny NNX LMs, where a step is mostly overhead.

A 4-block Flax NNX language model (d=32, batch 16, seq 16; the "Bring your model" recipe, SGD)
runs as `jax.jit` and through `jr.parallelize` on the local runtime as 1 stage x 1 micro-batch,
2 stages x 4 and 4 stages x 8 (1F1B, 1x1 meshes of fake CPU devices). Steady steps of every
variant are timed round-robin in one process after a warm-up, so the machine's noise hits all
alike (median ms). "host CPU" is the CPU time of the calling thread per step (it dispatches
every action; the devices compute on XLA's threads). The fixed cost per action is the host CPU
a pipeline step spends beyond `jax.jit`'s, over its actions: compute actions (F, B, W, FB, A)
and transfers, counted in one recorded step (`profile_call`).

A second table repeats the 2-stage x 4 micro-batch comparison with `jax.jit` on larger widths,
batches and sequences (`--sweep`), to show where the fixed costs stop mattering. Prints the
tables; writes JSON with --out.

    python benchmarks/action_overhead.py --out benchmarks/results/action_overhead.json
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
import numpy as np
import optax
from flax import nnx

import jaxreshard as jr

VOCAB, DIM, SEQ, ROWS, BLOCKS = 64, 32, 16, 16, 4


class Block(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.gelu(self.up(x)))


class LM(nnx.Module):
    def __init__(self, stages: int, dim: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, dim, rngs=rngs)
        self.blocks = nnx.List([Block(dim, rngs=rngs) for _ in range(BLOCKS)])
        self.stages = stages

    def __call__(self, tokens):
        x = self.embed(tokens)
        per = BLOCKS // self.stages
        for i, block in enumerate(self.blocks):
            if i and i % per == 0:
                x = jr.stage_boundary(x)
            x = block(x)
        return self.embed.attend(x)


def make(stages: int, dim: int = DIM):
    model = LM(stages, dim, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.sgd(1e-2)

    def train_step(params, opt_state, tokens):
        def loss_fn(params):
            logits = nnx.merge(graphdef, params)(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jr.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step, params, tx.init(params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument(
        "--sweep", default="64x32x32,128x32x64",
        help="dim x batch x seq sizes for the 2-stage sweep ('' for none)",
    )  # fmt: skip
    parser.add_argument("--out")
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(ROWS, SEQ + 1)).astype(np.int32)
    variants = {}
    step, params, opt = make(1)
    variants["jax.jit"] = (jax.jit(step), (params, opt), None)
    # What micro-batching alone costs: the whole model under jax.jit on a quarter of the batch.
    variants[f"jax.jit, batch {ROWS // 4}"] = (jax.jit(step), (params, opt), None)
    batch_of = {name: tokens[: ROWS // 4] if "batch" in name else tokens for name in variants}
    for stages, m in ((1, 1), (2, 4), (4, 8)):
        step, params, opt = make(stages)
        config = jr.PipelineConfig(
            num_micro_batches=m, schedule="1f1b", num_stages=stages, stage_mesh_shape=(1,),
            mesh_axis_names=("data",), backend="local",
        )  # fmt: skip
        variants[f"{stages} stages x {m} mb"] = (
            jr.parallelize(step, config=config, batch_argnums=(2,)),
            (params, opt),
            (stages, m),
        )
    state = {name: v[1] for name, v in variants.items()}

    def one(name: str) -> tuple[float, float]:
        fn = variants[name][0]
        start, cpu = time.perf_counter(), time.thread_time()
        *new, loss = fn(*state[name], batch_of.get(name, tokens))
        float(loss)
        state[name] = tuple(new)
        return time.perf_counter() - start, time.thread_time() - cpu

    for name in variants:  # compile and warm up
        for _ in range(3):
            one(name)
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpus: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.steps):
        for name in variants:
            wall, cpu = one(name)
            times[name].append(wall)
            cpus[name].append(cpu)
    rows = []
    jit_ms = statistics.median(times["jax.jit"]) * 1e3
    jit_cpu_ms = statistics.median(cpus["jax.jit"]) * 1e3
    for name, (fn, _, shape) in variants.items():
        ms = statistics.median(times[name]) * 1e3
        cpu_ms = statistics.median(cpus[name]) * 1e3
        row = {"variant": name, "step_ms": ms, "vs_jit": ms / jit_ms, "host_cpu_ms": cpu_ms}
        if shape is not None:
            (*_new, _loss), events = fn.profile_call(*state[name], tokens)
            compute = sum(e.kind in ("F", "B", "W", "FB", "A") for e in events)
            sends = sum(e.kind == "send" for e in events)
            row.update(
                compute_actions=compute,
                transfers=sends,
                us_per_action=(cpu_ms - jit_cpu_ms) / (compute + sends) * 1e3,
            )
        rows.append(row)
    table = Table(title=f"steady step, NNX LM {BLOCKS} blocks d={DIM}, batch {ROWS}, median")
    for column in ("variant", "step ms", "x jax.jit", "host CPU ms", "compute actions",
                   "transfers", "us / action"):  # fmt: skip
        table.add_column(column)
    for r in rows:
        table.add_row(
            r["variant"], f"{r['step_ms']:.1f}", f"{r['vs_jit']:.2f}", f"{r['host_cpu_ms']:.2f}",
            *(
                (str(r["compute_actions"]), str(r["transfers"]), f"{r['us_per_action']:.0f}")
                if "us_per_action" in r else ("", "", "")
            ),
        )  # fmt: skip
    Console().print(table)
    piped = [r for r in rows if "us_per_action" in r]
    first, last = piped[-2], piped[-1]  # the two largest pipelines
    slope_us = (last["host_cpu_ms"] - first["host_cpu_ms"]) / (
        last["compute_actions"] + last["transfers"] - first["compute_actions"] - first["transfers"]
    ) * 1e3  # fmt: skip
    print(
        f"marginal host CPU per action ({first['variant']} -> {last['variant']}): {slope_us:.0f} us"
    )
    sweep = [tuple(int(n) for n in size.split("x")) for size in args.sweep.split(",") if size]
    sweep_rows = [sweep_one(dim, rows, seq, max(10, args.steps // 3)) for dim, rows, seq in sweep]
    if sweep_rows:
        table = Table(title="2 stages x 4 micro-batches (1F1B) against jax.jit, by size, median")
        for column in ("d", "batch", "seq", "jax.jit ms", "pipeline ms", "x jax.jit"):
            table.add_column(column)
        for r in sweep_rows:
            table.add_row(
                str(r["dim"]), str(r["rows"]), str(r["seq"]), f"{r['jit_ms']:.1f}",
                f"{r['pipeline_ms']:.1f}", f"{r['vs_jit']:.2f}",
            )  # fmt: skip
        Console().print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "format": "jaxreshard-action-overhead/1",
                    "date": time.strftime("%Y-%m-%d"),
                    "machine": f"{platform.machine()} {os.cpu_count()} cores, "
                    f"{platform.python_version()}, jax {jax.__version__}",
                    "rows": rows,
                    "marginal_us_per_action": slope_us,
                    "sweep": sweep_rows,
                },
                f,
                indent=2,
            )


def sweep_one(dim: int, rows: int, seq: int, steps: int) -> dict[str, float]:
    """`jax.jit` and 2 stages x 4 micro-batches of the LM at one size, timed round-robin."""
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(rows, seq + 1)).astype(np.int32)
    config = jr.PipelineConfig(
        num_micro_batches=4, schedule="1f1b", num_stages=2, stage_mesh_shape=(1,),
        mesh_axis_names=("data",), backend="local",
    )  # fmt: skip
    step, params, opt = make(1, dim)
    piped, piped_params, piped_opt = make(2, dim)
    pipelined = jr.parallelize(piped, config=config, batch_argnums=(2,))
    fns = {
        "jit": [jax.jit(step), (params, opt)],
        "pipeline": [pipelined, (piped_params, piped_opt)],
    }
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(steps + 3):
        for name, entry in fns.items():
            start = time.perf_counter()
            *new, loss = entry[0](*entry[1], tokens)
            float(loss)
            entry[1] = tuple(new)
            if i >= 3:  # compile and warm up
                times[name].append(time.perf_counter() - start)
    jit_ms, pipe_ms = (statistics.median(times[n]) * 1e3 for n in ("jit", "pipeline"))
    return {"dim": dim, "rows": rows, "seq": seq, "jit_ms": jit_ms, "pipeline_ms": pipe_ms,
            "vs_jit": pipe_ms / jit_ms}  # fmt: skip


if __name__ == "__main__":
    main()
