"""Host time per call of `jr.parallelize` on the local runtime, where compute is too small to
hide it: small MLPs (width 32, 8 rows), Adam, many leaves, 1 or 2 stages.

The step is called back to back (`--calls` times, each feeding the next its state, the
donated parameters and optimizer state), and "per call" is the time to issue them divided by
their number; on this CPU the tiny computations run as they are dispatched, so it is the
host's time per step. Minimum over `--rounds`. Beside it, `jax.jit` of the same step with a
hand-written `lax.scan` over the micro-batches (what a user writes by hand).

With `--against DIR` (another checkout of jaxreshard, e.g. a `git worktree` of an older
commit) each configuration runs in subprocesses alternating between DIR's code and this one,
`--repeats` times each, so that the machine's noise hits both alike; the table then shows
both minima and their ratio.

    python benchmarks/host_time.py --out benchmarks/results/host_time.json
    git worktree add /tmp/base COMMIT
    python benchmarks/host_time.py --against /tmp/base --repeats 3 --out F
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

# (depth, micro-batches, stages)
CONFIGS = [(4, 1, 1), (4, 4, 1), (64, 4, 1), (4, 4, 2), (64, 4, 2)]
HERE = Path(__file__).resolve()


def measure(depth: int, m: int, stages: int, calls: int, rounds: int) -> dict[str, float]:
    """Host ms per call of the pipelined step and of `jax.jit` with a scan, in this process."""
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxreshard as jr

    width, rows = 32, 8
    rng = np.random.default_rng(0)
    params = [
        {
            "w": (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32),
            "b": np.zeros(width, np.float32),
        }
        for _ in range(depth)
    ]

    def loss(params, batch, boundary):
        h = batch["x"]
        for i, layer in enumerate(params):
            h = jax.nn.relu(h @ layer["w"] + layer["b"])
            if i == depth // 2 - 1:
                h = boundary(h)
        return jnp.mean((h - batch["y"]) ** 2)

    tx = optax.adam(1e-3)

    def pipe_step(params, opt, batch):
        cut = jr.stage_boundary if stages > 1 else (lambda h: h)
        value, grads = jr.value_and_grad(lambda p: loss(p, batch, cut))(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value

    def scan_step(params, opt, batch):
        pieces = jax.tree.map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), batch)

        def body(acc, piece):
            value, grads = jax.value_and_grad(lambda p: loss(p, piece, lambda h: h))(params)
            return jax.tree.map(jnp.add, acc, (value, grads)), None

        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (value, grads), _ = jax.lax.scan(body, zero, pieces)
        updates, opt = tx.update(jax.tree.map(lambda g: g / m, grads), opt, params)
        return optax.apply_updates(params, updates), opt, value / m

    config = jr.PipelineConfig(
        num_stages=stages,
        num_micro_batches=m,
        stage_mesh_shape=(1,),
        mesh_axis_names=("data",),
        backend="local",
    )
    steps = {
        "parallelize": jr.parallelize(
            pipe_step, config=config, batch_argnums=(2,), donate_argnums=(0, 1)
        ),
        "jax.jit + scan": jax.jit(scan_step, donate_argnums=(0, 1)),
    }
    batches = [
        jax.device_put(
            {
                "x": rng.standard_normal((rows, width)).astype(np.float32),
                "y": rng.standard_normal((rows, width)).astype(np.float32),
            }
        )
        for _ in range(calls)
    ]
    out = {}
    for name, fn in steps.items():
        p = jax.tree.map(jnp.asarray, params)
        o = tx.init(p)
        for _ in range(3):  # compile and warm up
            for b in batches:
                p, o, _ = fn(p, o, b)
        jax.block_until_ready((p, o))
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            for b in batches:
                p, o, value = fn(p, o, b)
            best = min(best, (time.perf_counter() - start) / calls)
            jax.block_until_ready((p, o, value))
        out[name] = best * 1e3
    return out


def in_subprocess(tree: Path, depth: int, m: int, stages: int, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, str(HERE), "--one", f"{depth},{m},{stages}"]
    command += ["--calls", str(args.calls), "--rounds", str(args.rounds)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd="/")
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} with PYTHONPATH={tree} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", type=Path, help="another checkout to compare with")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # depth,m,stages: print JSON, exit
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.one:
        depth, m, stages = map(int, args.one.split(","))
        print(json.dumps(measure(depth, m, stages, args.calls, args.rounds)))
        return
    this = HERE.parents[1]
    trees = {"this": this} if args.against is None else {"against": args.against, "this": this}
    rows = []
    for depth, m, stages in CONFIGS:
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(args.repeats if args.against else 1):
            for name, tree in trees.items():
                runs[name].append(in_subprocess(tree, depth, m, stages, args))
        row = {"depth": depth, "state_leaves": 6 * depth + 1, "micro_batches": m, "stages": stages}
        for name, results in runs.items():
            row[f"{name}_ms"] = min(r["parallelize"] for r in results)
            row[f"{name}_jit_scan_ms"] = min(r["jax.jit + scan"] for r in results)
            row[f"{name}_runs_ms"] = [r["parallelize"] for r in results]
        if args.against:
            row["speedup"] = row["against_ms"] / row["this_ms"]
        rows.append(row)
        cells = "  ".join(
            f"{name} {row[f'{name}_ms']:7.3f} ms (jit+scan {row[f'{name}_jit_scan_ms']:.3f})"
            for name in trees
        )
        extra = f"  {row['speedup']:.2f}x" if args.against else ""
        where = f"depth {depth:>2} M{m} stages {stages} ({row['state_leaves']} state leaves)"
        print(f"{where}: {cells}{extra}")
    if args.out:
        record = {
            "benchmark": "host_time",
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "against": str(args.against) if args.against else None,
            "args": {k: v for k, v in vars(args).items() if k != "one"},
            "rows": rows,
        }
        record["args"]["against"] = str(args.against) if args.against else None
        Path(args.out).write_text(json.dumps(record, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
