"""Elastic training on the emulated cluster: a host loses power mid-run, training goes on.

Builds an emulated cluster (`jaxreshard.cluster.emulated`: 4 hosts x 2 CPU devices in network
namespaces, shaped NICs; root only), and trains a 6-layer MLP (AdamW) with
`jaxreshard.train_elastic`:
- on 4 hosts: 2 stages whose 1x4 meshes span 2 hosts each (1F1B, 2 micro-batches);
- a checkpoint every 2 steps (asynchronous);
- a timer started after step 5 kills every process of host 3 (`cluster.kill_host`: its Ray node
  and host actor, SIGKILL) while step 6 runs;
- the loop waits until Ray has dropped the node, starts again on the 3 live hosts as 3 stages of
  1x2 (eager-1F1B + weight delay, 4 micro-batches), restores the newest checkpoint into that
  layout and trains to step 10.

It prints the timeline (kill, error seen, node dropped, runtime up, restored) and every step's
loss beside an uninterrupted `jax.jit` run's, and writes JSON. Then it measures a checkpoint's
save and restore on the same cluster (the per-host bytes, as `checkpoint_io.py` does).

    sudo python benchmarks/elastic_emulated.py --out benchmarks/results/elastic_emulated.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxreshard as jr
import jaxreshard.cluster
from jaxreshard.checkpoint import _ray

LAYERS, WIDTH, ROWS = 6, 256, 64
OPT = optax.adamw(1e-3, weight_decay=0.01)


def init_params():
    rng = np.random.default_rng(0)
    return {
        f"l{i}": {
            "w": (rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32),
            "b": np.zeros(WIDTH, np.float32),
        }
        for i in range(LAYERS)
    }


def make_step(cuts=(), pipelined=True):
    def step(params, state, batch):
        def loss_fn(p):
            h = batch["x"]
            for i in range(LAYERS):
                if pipelined and i in cuts:
                    h = jr.stage_boundary(h)
                h = jnp.tanh(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
            return jnp.mean((h - batch["y"]) ** 2)

        grad = jr.value_and_grad if pipelined else jax.value_and_grad
        loss, g = grad(loss_fn)(params)
        updates, state = OPT.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step


def batch(step):
    rng = np.random.default_rng(100 + step)
    return {
        "x": rng.normal(size=(ROWS, WIDTH)).astype(np.float32),
        "y": rng.normal(size=(ROWS, WIDTH)).astype(np.float32),
    }


def child(address: str, name: str, steps: int, out: Path) -> None:
    """The driver's part, in a process of its own: train_elastic on the cluster at `address`,
    then a checkpoint's per-host shares; the results go to `out` as JSON. (A driver whose Ray
    connection outlived a host's death aborts inside Ray when the cluster's head later goes
    down; so the driver exits before `down`, as a training job does.)"""
    folder = Path(tempfile.mkdtemp(prefix="jaxreshard-elastic-"))
    events: dict[str, float] = {}
    layouts: list[int] = []

    def layout(num_hosts):
        layouts.append(num_hosts)
        events.setdefault(f"runtime_up_{num_hosts}", time.perf_counter())
        common = dict(mesh_axis_names=("data", "model"), backend="ray")
        if num_hosts == 4:
            cfg = jr.PipelineConfig(stage_mesh_shape=(1, 4), schedule="1f1b",
                                    num_micro_batches=2, **common)  # fmt: skip
            return jr.parallelize(make_step((3,)), config=cfg, batch_argnums=2)
        cfg = jr.PipelineConfig(stage_mesh_shape=(1, 2), schedule="eager_1f1b", weight_delay=True,
                                num_micro_batches=4, **common)  # fmt: skip
        return jr.parallelize(make_step((2, 4)), config=cfg, batch_argnums=2)

    def on_step(step, loss, runtime):
        if step == 5 and "kill" not in events:
            index = folder / "ckpt" / "step_00000004" / "jaxreshard.json"
            deadline = time.monotonic() + 120
            while not index.exists():
                assert time.monotonic() < deadline, "the step-4 checkpoint was never committed"
                time.sleep(0.05)

            def kill():
                time.sleep(0.05)  # into step 6
                events["kill"] = time.perf_counter()
                jaxreshard.cluster.kill_host(3, name)

            threading.Thread(target=kill, daemon=True).start()

    params = init_params()
    ref = jax.jit(make_step(pipelined=False))
    p, s, want = params, OPT.init(params), []
    for i in range(steps):
        p, s, loss = ref(p, s, batch(i))
        want.append(float(loss))
    options = {"backend": "ray", "address": address, "num_hosts": 4, "timeout_s": 120}
    start = time.perf_counter()
    _, history = jr.train_elastic(
        layout, lambda: (params, OPT.init(params)), batch, num_steps=steps,
        checkpoint_dir=folder / "ckpt", checkpoint_every=2, init_options=options,
        on_step=on_step,
    )  # fmt: skip
    total = time.perf_counter() - start
    # A checkpoint's shares on this cluster: 48 MiB over the 3 live hosts' 6 devices.
    rt = jr.current_runtime()
    n = 6 * 2**21
    value = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    sharding = rt.sharding(rt.mesh((6,), ("x",)), jax.sharding.PartitionSpec("x"))
    big = rt.put(value, sharding)
    t0 = time.perf_counter()
    jr.save_checkpoint(folder / "big", {"big": big})
    save_s = time.perf_counter() - t0
    saved_io = dict(_ray.last_io["save"])
    backwards = rt.sharding(rt.mesh((6,), ("x",), devices=[d.id for d in rt.devices][::-1]),
                            jax.sharding.PartitionSpec("x"))  # fmt: skip
    t0 = time.perf_counter()
    back = jr.restore_checkpoint(
        folder / "big", {"big": jr.RemoteStruct((n,), np.float32, backwards)}
    )
    restore_s = time.perf_counter() - t0
    assert np.array_equal(back["big"].fetch(), value)
    read_io = dict(_ray.last_io["restore"])
    jr.shutdown()
    kill = events.get("kill", float("nan"))
    out.write_text(json.dumps({
        "layouts": layouts, "seconds": total,
        "kill_to_runtime_up_s": events.get("runtime_up_3", float("nan")) - kill,
        "history": history, "jit_losses": want,
        "checkpoint": {"mib": 4 * n / 2**20, "save_s": save_s, "restore_s": restore_s,
                       "written_bytes": {str(h): v["written_bytes"] for h, v in saved_io.items()},
                       "read_bytes": {str(h): v["read_bytes"] for h, v in read_io.items()}},
    }))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nic-gbps", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--name", default="elast")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.name, args.steps, Path(args.child_json))
        return
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "child.json"
        with jaxreshard.cluster.emulated(
            hosts=4, nic_gbps=args.nic_gbps, devices_per_host=2, name=args.name
        ) as cluster:
            command = [sys.executable, __file__, "--child", cluster.address, "--name", args.name,
                       "--steps", str(args.steps), "--child-json", str(result)]  # fmt: skip
            done = subprocess.run(command, timeout=1800)
            if done.returncode != 0:
                raise SystemExit(f"the driver process failed (exit {done.returncode})")
        data = json.loads(result.read_text())
    print(f"layouts: {data['layouts']} hosts; {data['seconds']:.1f} s in all; host 3 killed, "
          f"runtime on 3 hosts {data['kill_to_runtime_up_s']:.1f} s later")  # fmt: skip
    print(f"{'step':>4} {'hosts':>5} {'loss':>12} {'jax.jit':>12} {'rel diff':>9}")
    worst = 0.0
    for step, loss, hosts in data["history"]:
        ref_loss = data["jit_losses"][step - 1]
        diff = abs(loss - ref_loss) / abs(ref_loss)
        worst = max(worst, diff)
        print(f"{step:4d} {hosts:5d} {loss:12.6f} {ref_loss:12.6f} {diff:9.2e}")
    c = data["checkpoint"]
    print(f"checkpoint of {c['mib']:.0f} MiB on 3 hosts: save {c['save_s']:.2f} s, restore "
          f"{c['restore_s']:.2f} s")  # fmt: skip
    for h in sorted(c["written_bytes"]):
        print(f"  host {h}: wrote {c['written_bytes'][h] / 2**20:.1f} MiB, read "
              f"{c['read_bytes'].get(h, 0) / 2**20:.1f} MiB")  # fmt: skip
    if args.out:
        data.update(benchmark="elastic_emulated", date=time.strftime("%Y-%m-%d"),
                    machine=f"{platform.node()} ({os.cpu_count()} cores)",
                    nic_gbps=args.nic_gbps, max_rel_diff=worst)  # fmt: skip
        Path(args.out).write_text(json.dumps(data, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
