"""The fixed cost of a pipeline action: tiny NNX LMs, where a step is mostly overhead.

A 4-block Flax NNX language model (d=32, batch 16, seq 16; the "Bring your model" recipe, SGD)
runs as `jax.jit` and through `jr.parallelize` on the local runtime as 1 stage x 1 micro-batch,
2 stages x 4 and 4 stages x 8 (1F1B, 1x1 meshes of fake CPU devices). Steady steps of every
variant are timed round-robin in one process after a warm-up, so the machine's noise hits all
alike (median ms). For each pipeline it also times one recorded step (`profile_call`, which
blocks on every action) and sums the compute of the busiest stage: the step minus that is what
the pipeline adds, spread over the busiest stage's actions (`us/action`). Prints a table;
writes JSON with --out.

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
    def __init__(self, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(DIM, 4 * DIM, rngs=rngs)
        self.down = nnx.Linear(4 * DIM, DIM, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.gelu(self.up(x)))


class LM(nnx.Module):
    def __init__(self, stages: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.blocks = nnx.List([Block(rngs=rngs) for _ in range(BLOCKS)])
        self.stages = stages

    def __call__(self, tokens):
        x = self.embed(tokens)
        per = BLOCKS // self.stages
        for i, block in enumerate(self.blocks):
            if i and i % per == 0:
                x = jr.stage_boundary(x)
            x = block(x)
        return self.embed.attend(x)


def make(stages: int):
    model = LM(stages, rngs=nnx.Rngs(0))
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
    parser.add_argument("--out")
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(ROWS, SEQ + 1)).astype(np.int32)
    variants = {}
    step, params, opt = make(1)
    variants["jax.jit"] = (jax.jit(step), (params, opt), None)
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

    def one(name: str) -> float:
        fn = variants[name][0]
        start = time.perf_counter()
        *new, loss = fn(*state[name], tokens)
        float(loss)
        state[name] = tuple(new)
        return time.perf_counter() - start

    for name in variants:  # compile and warm up
        for _ in range(3):
            one(name)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.steps):
        for name in variants:
            times[name].append(one(name))
    rows = []
    jit_ms = statistics.median(times["jax.jit"]) * 1e3
    for name, (fn, _, shape) in variants.items():
        ms = statistics.median(times[name]) * 1e3
        row = {"variant": name, "step_ms": ms, "vs_jit": ms / jit_ms}
        if shape is not None:
            recorded = []
            for _ in range(5):
                (*_new, _loss), events = fn.profile_call(*state[name], tokens)
                recorded.append(events)
            per_stage: dict[int, float] = {}
            actions: dict[int, int] = {}
            for e in recorded[-1]:
                if e.kind in ("F", "B", "W", "FB", "A"):
                    per_stage[e.stage] = per_stage.get(e.stage, 0.0) + (e.end - e.start)
                    actions[e.stage] = actions.get(e.stage, 0) + 1
            busiest = max(per_stage, key=per_stage.get)
            compute_ms = per_stage[busiest] * 1e3
            row.update(
                compute_ms=compute_ms,
                actions=actions[busiest],
                overhead_ms=ms - compute_ms,
                us_per_action=(ms - compute_ms) / actions[busiest] * 1e3,
            )
        rows.append(row)
    table = Table(title=f"steady step, NNX LM {BLOCKS} blocks d={DIM}, batch {ROWS}, median")
    for column in ("variant", "step ms", "x jax.jit", "busiest stage compute ms",
                   "its actions", "overhead ms", "us / action"):  # fmt: skip
        table.add_column(column)
    for r in rows:
        table.add_row(
            r["variant"], f"{r['step_ms']:.1f}", f"{r['vs_jit']:.2f}",
            *(
                (f"{r['compute_ms']:.1f}", str(r["actions"]), f"{r['overhead_ms']:.1f}",
                 f"{r['us_per_action']:.0f}")
                if "compute_ms" in r else ("", "", "", "")
            ),
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
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
