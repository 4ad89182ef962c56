"""Time to the first step: `jr.parallelize` against `jax.jit` on a Flax NNX language model.

The model is a small GPT written as Flax NNX's docs write one (`nnx.Embed`,
`nnx.MultiHeadAttention`, `nnx.LayerNorm`, `nnx.Linear`, `nnx.Dropout`), trained by the functional
recipe of "Bring your model" (split, `jr.value_and_grad` with `has_aux` for the RNG state, Optax
AdamW), cut into two stages by one `jr.stage_boundary` in the middle of its blocks. Each
measurement runs in a fresh Python process (nothing cached in memory, no persistent compilation
cache) and times, from the first call to the results being ready: `jax.jit` of the step, and
`jr.parallelize` of the same step (2 stages on 1x2 meshes of fake CPU devices, 4 micro-batches,
1F1B), split into tracing and compiling (`step.pipeline(...)`) and the first run. Runs alternate
between the two (`--repeats` each) so that the machine's noise hits both alike; the table reports
medians and the ratio. The issue's goal: at most 1.3x `jax.jit` (requirement: 2x). Prints a table;
writes JSON with --out.

    python benchmarks/first_step.py --out benchmarks/results/first_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
mode, layers, dim, seq, rows = sys.argv[1], *map(int, sys.argv[2:6])
MESH = tuple(map(int, sys.argv[6].split("x")))
SCHEDULE, WEIGHT_DELAY, STEADY = sys.argv[7], sys.argv[8] == "1", int(sys.argv[9])
start = time.perf_counter()
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
import jaxreshard as jr
imported = time.perf_counter()

class Block(nnx.Module):
    def __init__(self, dim, *, rngs):
        self.ln1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=4, in_features=dim, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.drop(self.attn(self.ln1(x), mask=mask))
        return x + self.drop(self.down(nnx.gelu(self.up(self.ln2(x)))))

class GPT(nnx.Module):
    def __init__(self, vocab, dim, layers, seq, *, rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (seq, dim)) * 0.02)
        self.blocks = nnx.List([Block(dim, rngs=rngs) for _ in range(layers)])
        self.ln = nnx.LayerNorm(dim, rngs=rngs)

    def __call__(self, tokens):
        mask = nnx.make_causal_mask(tokens)
        x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
        for i, block in enumerate(self.blocks):
            if i == len(self.blocks) // 2:
                x = jr.stage_boundary(x)
            x = block(x, mask)
        return self.embed.attend(self.ln(x))

VOCAB = 512
model = GPT(VOCAB, dim, layers, seq, rngs=nnx.Rngs(0, dropout=1))
graphdef, params, rest = nnx.split(model, nnx.Param, ...)
tx = optax.adamw(1e-3)

def train_step(params, rest, opt_state, batch):
    def loss_fn(params):
        model = nnx.merge(graphdef, params, rest, copy=True)
        logits = model(batch[:, :-1])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
        return loss, nnx.state(model, nnx.Not(nnx.Param))
    (loss, rest), grads = jr.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), rest, opt_state, loss

opt_state = tx.init(params)
batch = np.random.default_rng(0).integers(0, VOCAB, size=(rows, seq + 1)).astype(np.int32)
args = (params, rest, opt_state, batch)
ready = time.perf_counter()
out = {"mode": mode, "import_s": imported - start, "setup_s": ready - imported}
if mode == "jit":
    step = jax.jit(train_step)
    t0 = time.perf_counter()
    jax.block_until_ready(step(*args))
    out["first_step_s"] = time.perf_counter() - t0
else:
    config = jr.PipelineConfig(
        num_micro_batches=4, schedule=SCHEDULE, weight_delay=WEIGHT_DELAY,
        stage_mesh_shape=MESH, mesh_axis_names=("data", "model"), backend="local",
    )
    step = jr.parallelize(train_step, config=config, batch_argnums=(3,))
    t0 = time.perf_counter()
    step.pipeline(*args)
    t1 = time.perf_counter()
    jax.block_until_ready(step(*args))
    t2 = time.perf_counter()
    out.update(first_step_s=t2 - t0, compile_s=t1 - t0, first_run_s=t2 - t1)
t3 = time.perf_counter()
jax.block_until_ready(step(*args))
out["second_step_s"] = time.perf_counter() - t3
if STEADY:  # steady steps, each fed the last one's state, waited for one by one
    times = []
    state = args
    for _ in range(STEADY):
        t = time.perf_counter()
        params2, rest2, opt2, loss = step(*state)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t)
        state = (params2, rest2, opt2, batch)
    out["steady_step_s"] = sorted(times)[len(times) // 2]
print("RESULT " + json.dumps(out))
"""


def measure(mode: str, layers: int, dim: int, seq: int, rows: int, mesh: str, args) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            mode,
            str(layers),
            str(dim),
            str(seq),
            str(rows),
            mesh,
            args.schedule,
            "1" if args.weight_delay else "0",
            str(args.steady),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=900,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument(
        "--mesh", default="1x2", help="each stage's mesh, as (data)x(model): 1x2, 1x1"
    )
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--weight-delay", action="store_true")
    parser.add_argument(
        "--steady", type=int, default=0, help="also time this many steady steps (median)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    runs: dict[str, list[dict]] = {"jit": [], "parallelize": []}
    for _ in range(args.repeats):
        for mode in runs:
            runs[mode].append(
                measure(mode, args.layers, args.dim, args.seq, args.rows, args.mesh, args)
            )
    med = {
        mode: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k.endswith("_s")}
        for mode, rs in runs.items()
    }
    ratio = med["parallelize"]["first_step_s"] / med["jit"]["first_step_s"]
    table = Table(title=f"first step, NNX GPT {args.layers} blocks d={args.dim}, median of "
                  f"{args.repeats} fresh processes")  # fmt: skip
    for column in ("run", "first step (s)", "trace+compile (s)", "first run (s)", "2nd step (s)"):
        table.add_column(column)
    for mode, m in med.items():
        table.add_row(
            mode,
            f"{m['first_step_s']:.2f}",
            f"{m.get('compile_s', float('nan')):.2f}",
            f"{m.get('first_run_s', float('nan')):.2f}",
            f"{m['second_step_s'] * 1e3:.1f} ms",
        )
    console = Console()
    console.print(table)
    console.print(f"parallelize / jax.jit, first step: {ratio:.2f}x")
    if args.steady:
        steady = med["parallelize"]["steady_step_s"] / med["jit"]["steady_step_s"]
        console.print(
            f"steady step: jax.jit {med['jit']['steady_step_s'] * 1e3:.2f} ms, parallelize "
            f"{med['parallelize']['steady_step_s'] * 1e3:.2f} ms: {steady:.2f}x"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "format": "jaxreshard-first-step/1",
                    "date": time.strftime("%Y-%m-%d"),
                    "machine": f"{platform.machine()} {os.cpu_count()} cores, "
                    f"{platform.python_version()}",
                    "model": vars(args),
                    "runs": runs,
                    "median": med,
                    "ratio": ratio,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
