"""How a pipelined step compares with what a user writes by hand, where compute dominates.

One stage of `jr.parallelize` with M micro-batches against `jax.jit` of the whole batch and
against `jax.jit` of a hand-written `lax.scan` that accumulates the gradients of the same M
micro-batches (the same arithmetic as the pipeline), all three donating the parameters and the
optimizer state (`donate_argnums=(0, 1)`), for an MLP (default 4 x 1024, batch 256,
Adam) and optionally a GPT (`--gpt LAYERS` of `jaxreshard.models.gpt`, `--gpt-hidden`, `--gpt-batch`
rows of 256 tokens; `--no-mlp` for the GPT alone).

For each variant:
- **step**: the steady step, `--chain` steps called back to back (each feeds the next its
  parameters and optimizer state, as training does) and waited for at the end, divided by
  the chain's length; median over rounds. The variants take turns round by round, so noise
  on this shared machine hits them alike.
- **returns after** / **ready after**: for one step after everything is idle, the time until
  the call returns and until its outputs are computed (`block_until_ready`); the call returns
  early when the host does not wait for the device.
- **equal**: the pipeline's parameters after one step against the scan's (max |difference|).

Prints the table and writes JSON with --out.

    python benchmarks/async_steps.py --out benchmarks/results/async_steps.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxreshard as jr


def mlp(width: int, depth: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    params = [
        {
            "w": (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32),
            "b": np.zeros(width, np.float32),
        }
        for _ in range(depth)
    ]

    def loss(params, batch):
        h = batch["x"]
        for layer in params:
            h = jax.nn.relu(h @ layer["w"] + layer["b"])
        return jnp.mean((h - batch["y"]) ** 2)

    def batch(rows: int, step: int):
        r = np.random.default_rng((seed, step))
        return {
            "x": r.standard_normal((rows, width)).astype(np.float32),
            "y": r.standard_normal((rows, width)).astype(np.float32),
        }

    return params, loss, batch


def gpt_model(layers: int, hidden: int = 512, seed: int = 0):
    from jaxreshard.models import gpt

    cfg = gpt.GPTConfig(vocab=2048, seq=256, hidden=hidden, layers=layers, heads=8)
    params = gpt.init_params(cfg, seed)

    def loss(params, batch):
        return gpt.loss(params, batch["tokens"], cfg)

    def batch(rows: int, step: int):
        return gpt.synthetic_batch(cfg, rows, step, seed)

    return params, loss, batch


def variants(loss, tx, m: int):
    def jit_step(params, opt, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value

    def scan_step(params, opt, batch):
        pieces = jax.tree.map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), batch)

        def body(acc, piece):
            value, grads = jax.value_and_grad(loss)(params, piece)
            return jax.tree.map(jnp.add, acc, (value, grads)), None

        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (value, grads), _ = jax.lax.scan(body, zero, pieces)
        value, grads = value / m, jax.tree.map(lambda g: g / m, grads)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value

    def pipe_step(params, opt, batch):
        value, grads = jr.value_and_grad(lambda p: loss(p, batch))(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value

    config = jr.PipelineConfig(
        num_stages=1,
        num_micro_batches=m,
        stage_mesh_shape=(1,),
        mesh_axis_names=("data",),
        backend="local",
    )
    return {
        "jax.jit (whole batch)": jax.jit(jit_step, donate_argnums=(0, 1)),
        f"jax.jit + lax.scan over {m}": jax.jit(scan_step, donate_argnums=(0, 1)),
        f"parallelize 1 stage x {m}": jr.parallelize(
            pipe_step, config=config, batch_argnums=(2,), donate_argnums=(0, 1)
        ),
    }


def fresh(params, tx):
    p = jax.tree.map(jnp.asarray, params)
    return p, tx.init(p)


def chain(fn, state, batches):
    params, opt = state
    start = time.perf_counter()
    for b in batches:
        params, opt, loss = fn(params, opt, b)
    jax.block_until_ready((params, opt, loss))
    return (time.perf_counter() - start) / len(batches), (params, opt)


def one_step(fn, state, batch):
    params, opt = state
    jax.block_until_ready((params, opt))
    start = time.perf_counter()
    out = fn(params, opt, batch)
    returned = time.perf_counter() - start
    jax.block_until_ready(out)
    ready = time.perf_counter() - start
    return returned, ready, (out[0], out[1])


def measure(name: str, model, m: int, rounds: int, chain_len: int, lr: float, rows: int) -> dict:
    params, loss, make_batch = model
    tx = optax.adam(lr)
    fns = variants(loss, tx, m)
    batches = [jax.device_put(make_batch(rows, i)) for i in range(chain_len)]
    states = {k: fresh(params, tx) for k in fns}
    for k, fn in fns.items():  # compile and warm up
        _, states[k] = chain(fn, states[k], batches[:2])
    steps = {k: [] for k in fns}
    returns = {k: [] for k in fns}
    readies = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            seconds, states[k] = chain(fn, states[k], batches)
            steps[k].append(seconds)
            returned, ready, states[k] = one_step(fn, states[k], batches[0])
            returns[k].append(returned)
            readies[k].append(ready)
    # Equality: one step of the pipeline against one of the scan, from the same state.
    keys = list(fns)
    outs = [fns[k](*fresh(params, tx), batches[0]) for k in keys[1:]]
    diff = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(outs[0][0]), jax.tree.leaves(outs[1][0]))
    )
    table = []
    base_jit = statistics.median(steps[keys[0]])
    base_scan = statistics.median(steps[keys[1]])
    for k in keys:
        step = statistics.median(steps[k])
        ret, ready = statistics.median(returns[k]), statistics.median(readies[k])
        table.append(
            {
                "model": name,
                "variant": k,
                "micro_batches": m,
                "step_ms": step * 1e3,
                "x_jit": step / base_jit,
                "x_scan": step / base_scan,
                "returns_ms": ret * 1e3,
                "ready_ms": ready * 1e3,
                "returns_fraction": ret / ready,
            }
        )
    table[-1]["max_abs_diff_vs_scan"] = diff
    return {"rows": table}


def print_table(rows: list[dict]) -> None:
    head = f"{'model':<14} {'variant':<28} {'step ms':>9} {'x jit':>7} {'x scan':>7} "
    head += f"{'returns ms':>11} {'ready ms':>9} {'ret/ready':>9}"
    print(head)
    for r in rows:
        print(
            f"{r['model']:<14} {r['variant']:<28} {r['step_ms']:>9.2f} {r['x_jit']:>7.3f} "
            f"{r['x_scan']:>7.3f} {r['returns_ms']:>11.2f} {r['ready_ms']:>9.2f} "
            f"{r['returns_fraction']:>9.2f}"
            + (
                f"  (max |diff| vs scan {r['max_abs_diff_vs_scan']:.2e})"
                if "max_abs_diff_vs_scan" in r
                else ""
            )
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--gpt", type=int, default=0, metavar="LAYERS", help="also a GPT")
    parser.add_argument("--gpt-hidden", type=int, default=512)
    parser.add_argument("--gpt-batch", type=int, default=16, help="the GPT's batch (rows)")
    parser.add_argument("--no-mlp", action="store_true", help="only the GPT")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--chain", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    models = []
    if not args.no_mlp:
        models.append((f"MLP {args.depth}x{args.width}", mlp(args.width, args.depth), args.batch))
    if args.gpt:
        name = f"GPT {args.gpt}L h{args.gpt_hidden}"
        models.append((name, gpt_model(args.gpt, args.gpt_hidden), args.gpt_batch))
    for name, model, batch in models:
        for m in args.micro_batches:
            rows += measure(name, model, m, args.rounds, args.chain, 1e-3, batch)["rows"]
    print_table(rows)
    if args.out:
        record = {
            "benchmark": "async_steps",
            "date": time.strftime("%Y-%m-%d"),
            "machine": (
                f"{platform.machine()}, {os.cpu_count()} cores, {jax.devices()[0].device_kind}"
            ),
            "jax": jax.__version__,
            "args": vars(args),
            "rows": rows,
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {args.out}")
