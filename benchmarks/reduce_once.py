"""Gradients summed over a data-parallel stage's batch axis once a step against every micro-batch.

A 2-stage MLP (default 4 x 1024 per stage, biases, Adam) whose stages each split their
micro-batch over a `data` axis of 2 devices, with M micro-batches: the same step with
`PipelineConfig(reduce_gradients="once")` and `"every_micro_batch"`. For each:
- **step**: the steady step, `--chain` steps back to back waited for at the end, divided by the
  chain's length; median over rounds, the two variants taking turns round by round (noise on
  this shared machine hits both alike);
- **all-reduced MiB a step**: per stage, read off the compiled programs the step runs (the
  per-micro-batch ones times M, plus the step's `reduce`): what crosses the stage's devices;
- **equal**: the parameters after one step of each against `jax.jit` of the whole batch.

With `--address HOST:PORT` the stages run on that Ray cluster (e.g. `jaxreshard cluster up
--hosts 4 --devices-per-host 1`): each stage's mesh then spans 2 hosts and every all-reduce
crosses their links, which is where summing once pays.

    python benchmarks/reduce_once.py --out benchmarks/results/reduce_once.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxreshard as jr


def model(width: int, depth: int, seed: int = 0):
    rng = np.random.default_rng(seed)

    def layer():
        w = rng.standard_normal((width, width)) / np.sqrt(width)
        return {"w": w.astype(np.float32), "b": np.zeros(width, np.float32)}

    params = {"first": [layer() for _ in range(depth)], "second": [layer() for _ in range(depth)]}

    def loss(params, batch):
        h = batch["x"]
        for lay in params["first"]:
            h = jnp.tanh(h @ lay["w"] + lay["b"])
        h = jr.stage_boundary(h)
        for lay in params["second"]:
            h = jnp.tanh(h @ lay["w"] + lay["b"])
        return jnp.mean((h - batch["y"]) ** 2)

    def batch(rows: int, step: int):
        r = np.random.default_rng((seed, step))
        return {
            "x": r.standard_normal((rows, width)).astype(np.float32),
            "y": r.standard_normal((rows, width)).astype(np.float32),
        }

    return params, loss, batch


def train_step(loss, tx):
    def step(params, opt, batch):
        value, grads = jr.value_and_grad(lambda p: loss(p, batch))(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value

    return step


_ALL_REDUCE = re.compile(r"= (\(.*?\)|\S+) all-reduce(?:-start)?\(")
_ARRAY = re.compile(r"([a-z]+)(\d+)\[([\d,]*)\]")


def _all_reduced_bytes(hlo: str) -> int:
    """Bytes all-reduced by one run of a compiled program (its all-reduce results' sizes)."""
    total = 0
    for result in _ALL_REDUCE.findall(hlo):
        for _, bits, dims in _ARRAY.findall(result):
            total += (
                int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
                * int(bits)
                // 8
            )
    return total


def all_reduced_per_step(step, args, m: int) -> dict[int, int]:
    """Per stage, the bytes its programs all-reduce in one step (the per-micro-batch ones M
    times, the step's `reduce` once; local runtime only)."""
    engine = getattr(getattr(step.pipeline(*args), "compiled", None), "engine", None)
    if engine is None:
        return {}
    out = {}
    for s, c in engine.compilers.items():
        n = 0
        for (name, _), exe in c._ready.items():
            moved = _all_reduced_bytes(exe.as_text())
            n += moved * m if name in ("forward", "backward", "b_part", "w_part", "fb") else moved
        out[s] = n
    return out


def chain(fn, state, batches):
    params, opt = state
    start = time.perf_counter()
    for b in batches:
        params, opt, loss = fn(params, opt, b)
    jax.block_until_ready((params, opt, loss))
    return (time.perf_counter() - start) / len(batches), (params, opt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--chain", type=int, default=4)
    parser.add_argument("--address", help="a Ray cluster to run the stages on")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()

    backend = "local"
    if args.address:
        jr.init(backend="ray", address=args.address)
        backend = "ray"
    params, loss, make_batch = model(args.width, args.depth)
    tx = optax.adam(1e-3)
    rows = []
    for m in args.micro_batches:
        batches = [make_batch(args.batch, i) for i in range(args.chain)]
        fns = {}
        for how in ("every_micro_batch", "once"):
            config = jr.PipelineConfig(
                num_stages=2,
                num_micro_batches=m,
                stage_mesh_shape=(2,),
                mesh_axis_names=("data",),
                reduce_gradients=how,
                backend=backend,
            )
            fns[how] = jr.parallelize(train_step(loss, tx), config=config, batch_argnums=(2,))
        states = {k: (params, tx.init(params)) for k in fns}
        for k, fn in fns.items():  # compile and warm up
            _, states[k] = chain(fn, states[k], batches[:2])
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, fn in fns.items():
                seconds, states[k] = chain(fn, states[k], batches)
                times[k].append(seconds)
        jitted = jax.jit(train_step(loss, tx))
        ref = jitted(params, tx.init(params), batches[0])[0]
        base = statistics.median(times["every_micro_batch"])
        for k, fn in fns.items():
            out = fn(params, tx.init(params), batches[0])[0]
            fetch = (lambda x: x.fetch()) if backend == "ray" else np.asarray
            diff = max(
                float(np.max(np.abs(fetch(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref))
            )
            plan = fn.pipeline(params, tx.init(params), batches[0]).layout.reductions
            step = statistics.median(times[k])
            rows.append(
                {
                    "micro_batches": m,
                    "reduce_gradients": k,
                    "step_ms": step * 1e3,
                    "x_every_micro_batch": step / base,
                    "all_reduced_bytes_per_step": all_reduced_per_step(
                        fn, (params, tx.init(params), batches[0]), m
                    ),
                    "max_abs_diff_vs_jit": diff,
                    "plan": plan,
                }
            )
    head = f"{'M':>3} {'reduce_gradients':<18} {'step ms':>9} {'x every':>8}"
    print(f"{head} {'all-reduced MiB':>16} {'|diff| vs jit':>13}")
    for r in rows:
        moved = r["all_reduced_bytes_per_step"].values()
        counts = "+".join(f"{v / 2**20:.2f}" for v in moved) or "n/a"
        print(
            f"{r['micro_batches']:>3} {r['reduce_gradients']:<18} {r['step_ms']:>9.2f} "
            f"{r['x_every_micro_batch']:>8.3f} {counts:>16} {r['max_abs_diff_vs_jit']:>13.2e}"
        )
    if args.out:
        record = {
            "benchmark": "reduce_once",
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {jax.devices()[0].platform}",
            "jax": jax.__version__,
            "backend": backend,
            "args": vars(args),
            "rows": rows,
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
