"""Plain data parallelism on the emulated cluster: the baseline a pipelined layout must beat.

What a user would run instead of a pipeline: the same model and optimizer as a `jaxreshard
profile` config, trained by `jax.jit` over every device of every host, as one multi-controller
JAX program (each host a process of one `jax.distributed` runtime, its devices in one global
`data` mesh; the parameters and the optimizer state replicated, the batch split over `data`;
gradients all-reduced by XLA, over gloo between hosts). Each host process is a Ray actor on
its emulated host's node (a network namespace with a shaped NIC), so the all-reduce crosses
the same links as the pipeline's traffic.

For each config it runs, on one emulated cluster (`jaxreshard.cluster.emulated`; root only):
1. the data-parallel baseline: `--steps` timed steps after `--warmup`, each waited for; the
   step time is the slowest host's, median over the steps;
2. the pipeline: `jaxreshard profile MODEL --config FILE --address ... --json` (its median
   step, each waited for), in a process of its own as a real job's driver would be; with
   `--auto TOP`, `profile --auto --auto-top TOP` instead (mesh layouts, schedules and
   micro-batch counts searched on the cluster), and its winner's step;
and prints both and their ratio, and writes JSON with --out.

    sudo python benchmarks/data_parallel_emulated.py \\
        --configs examples/configs/gpt_wide_multihost.toml --hosts 4 --devices 2 --gbps 0.01 \\
        --out benchmarks/results/data_parallel_emulated.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

import jaxreshard.cluster
from jaxreshard.cluster._describe import HOST_RESOURCE, ray_auth, ray_token_for


@ray.remote(num_cpus=0)
class DataParallelHost:
    """One host's process of the data-parallel program."""

    def __init__(self, host: int, num_hosts: int):
        self.host, self.num_hosts = host, num_hosts

    def coordinator(self) -> str:
        """Host 0's node address and a free port: where the jax.distributed runtime is served."""
        import socket

        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((ip, 0))
            return f"{ip}:{probe.getsockname()[1]}"

    def setup(self, coordinator: str, model: str, config: str) -> dict[str, Any]:
        import jax
        import numpy as np
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from jaxreshard._jax_compat import cpu_collectives_on
        from jaxreshard.profiler._config import load_profile_config

        cpu_collectives_on(ray.util.get_node_ip_address())
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=self.num_hosts,
            process_id=self.host,
            cluster_detection_method="deactivate",
            initialization_timeout=120,
            coordinator_bind_address=coordinator,
        )
        pc = load_profile_config(model, config)
        self.pc, module = pc, pc.spec.module
        cfg, optimizer = pc.model_config, pc.run.make_optimizer()
        devices = jax.devices()
        mesh = jax.sharding.Mesh(np.array(devices), ("data",))
        replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        params = jax.device_put(module.init_params(cfg, pc.run.seed), replicated)
        opt_state = jax.jit(optimizer.init, out_shardings=replicated)(params)
        self.state = (params, opt_state)
        step = module.train_step(cfg, 1, optimizer)
        self.step = jax.jit(
            step,
            in_shardings=(replicated, replicated, split),
            out_shardings=(replicated, replicated, replicated),
            donate_argnums=(0, 1),
        )
        self.split, self.cfg, self.module = split, cfg, module
        rows = pc.run.batch_size
        if rows % len(devices):
            raise ValueError(f"batch_size {rows} does not split over {len(devices)} devices")
        self._next = 0
        return {"devices": len(devices), "local_devices": jax.local_device_count()}

    def _batch(self) -> Any:
        import jax

        whole = self.module.synthetic_batch(
            self.cfg, self.pc.run.batch_size, self._next, self.pc.run.seed
        )
        self._next += 1
        n, rows = self.num_hosts, self.pc.run.batch_size // self.num_hosts
        mine = {k: v[self.host * rows : (self.host + 1) * rows] for k, v in whole.items()}
        return {
            k: jax.make_array_from_process_local_data(self.split, v, (rows * n, *v.shape[1:]))
            for k, v in mine.items()
        }

    def run(self, steps: int) -> list[float]:
        """`steps` steps, each waited for; their seconds."""
        import jax

        times = []
        for _ in range(steps):
            batch = self._batch()
            start = time.perf_counter()
            params, opt_state, loss = self.step(*self.state, batch)
            jax.block_until_ready(loss)
            jax.block_until_ready((params, opt_state))
            times.append(time.perf_counter() - start)
            self.state = (params, opt_state)
            self.loss = float(loss)
        return times

    def last_loss(self) -> float:
        return self.loss


def data_parallel(address: str, model: str, config: str, hosts: int, devices: int,
                  warmup: int, steps: int) -> dict[str, Any]:  # fmt: skip
    """The driver's part (in a process of its own): the baseline's step times."""
    with ray_auth(ray_token_for(address), connecting=True):  # the cluster's Ray token
        ray.init(address=address, logging_level="ERROR")
    env = {
        "env_vars": {
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
            "JAX_PLATFORMS": "cpu",
        }
    }
    workers = [
        DataParallelHost.options(resources={f"{HOST_RESOURCE}{h}": 1}, runtime_env=env).remote(
            h, hosts
        )
        for h in range(hosts)
    ]
    coordinator = ray.get(workers[0].coordinator.remote(), timeout=120)
    info = ray.get([w.setup.remote(coordinator, model, config) for w in workers], timeout=600)
    ray.get([w.run.remote(warmup) for w in workers], timeout=1200)
    per_host = ray.get([w.run.remote(steps) for w in workers], timeout=3600)
    slowest = [max(host[i] for host in per_host) for i in range(steps)]
    loss = ray.get(workers[0].last_loss.remote(), timeout=60)
    ray.shutdown()
    return {
        "step_seconds": statistics.median(slowest),
        "steps": slowest,
        "devices": info[0]["devices"],
        "loss": loss,
    }


def pipeline(address: str, model: str, config: str, steps: int, auto: int = 0) -> dict[str, Any]:
    """`jaxreshard profile` of the config on the cluster: its median plain step (its timed
    one where it ran none); with `auto`, `profile --auto --auto-top AUTO`: its winner's median
    step by the measure the search ranked with, and the search's record."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "profile.json"
        command = [sys.executable, "-m", "jaxreshard", "profile", model, "--config", config,
                   "--address", address, "--steps", str(steps), "--json", str(out),
                   "--no-progress"]  # fmt: skip
        if auto:
            command += ["--auto", "--auto-top", str(auto), "--warmup-steps", "1"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=7200)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n"
                               f"{done.stderr[-3000:]}")  # fmt: skip
        record = json.loads(out.read_text())
    # A plain step (a training loop's) where the profile timed them: what `--auto` ranks by,
    # and what the data-parallel steps above are (each waited for, nothing recorded).
    if auto:
        best = next(r for r in record["measured"] if r["label"] == record["winner"])
        key = record.get("ranked_by", "step_seconds")
        return {"step_seconds": best[key], "measure": key, "timed_step_seconds":
                best["step_seconds"], "winner": record["winner"],
                "winner_pipeline": record["winner_pipeline"], "auto": record,
                "output": done.stdout[-6000:]}  # fmt: skip
    key = "plain_step_seconds" if record.get("plain_step_seconds") else "step_seconds"
    return {"step_seconds": record[key], "measure": key,
            "timed_step_seconds": record["step_seconds"], "schedule": record["schedule"],
            "config": record.get("config")}  # fmt: skip


def model_of(config: str, default: str) -> str:
    """The model a profile TOML names (its [model] table's `name`), else `default`; a model
    file's path made absolute (the host processes run elsewhere)."""
    import tomllib

    from jaxreshard.models._user import absolute

    with open(config, "rb") as f:
        return absolute(str(tomllib.load(f).get("model", {}).get("name", default)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=[], help="jaxreshard profile TOMLs")
    parser.add_argument("--model", default="gpt", help="where a TOML names none")
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--devices", type=int, default=2, help="CPU devices per host")
    parser.add_argument("--gbps", type=float, default=0.01, help="each host's NIC, GB/s")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-pipeline", action="store_true", help="the baseline only")
    parser.add_argument(
        "--auto",
        type=int,
        default=0,
        metavar="TOP",
        help="run `profile --auto --auto-top TOP` as the pipeline (its winner's step)",
    )
    parser.add_argument("--name", default="jrdp")
    parser.add_argument("--child", nargs=2, metavar=("ADDRESS", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.child:
        address, config = args.child
        result = data_parallel(address, model_of(config, args.model), config, args.hosts,
                               args.devices, args.warmup, args.steps)  # fmt: skip
        print("RESULT " + json.dumps(result))
        return
    if not args.configs:
        parser.error("give --configs")
    rows = []
    with jaxreshard.cluster.emulated(
        hosts=args.hosts, nic_gbps=args.gbps, devices_per_host=args.devices, name=args.name
    ) as cluster:
        for config in args.configs:
            command = [sys.executable, __file__, "--child", cluster.address, config,
                       "--model", args.model, "--hosts", str(args.hosts), "--devices",
                       str(args.devices), "--steps", str(args.steps), "--warmup",
                       str(args.warmup)]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, timeout=7200)
            found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not found:
                raise RuntimeError(f"data parallel on {config} failed:\n{done.stdout[-3000:]}\n"
                                   f"{done.stderr[-5000:]}")  # fmt: skip
            dp = json.loads(found[-1][len("RESULT ") :])
            row: dict[str, Any] = {"config": config, "data_parallel": dp}
            if not args.no_pipeline:
                model = model_of(config, args.model)
                row["pipeline"] = pipeline(cluster.address, model, config, args.steps, args.auto)
                row["pipeline_over_data_parallel"] = (
                    row["pipeline"]["step_seconds"] / dp["step_seconds"]
                )
            rows.append(row)
            pipe = row.get("pipeline", {}).get("step_seconds")
            line = f"{config}: data parallel {dp['step_seconds'] * 1e3:.1f} ms/step over "
            line += f"{dp['devices']} devices"
            if pipe:
                line += f"; pipeline {pipe * 1e3:.1f} ms ({pipe / dp['step_seconds']:.2f}x)"
            print(line)
    if args.out:
        record = {
            "benchmark": "data_parallel_emulated",
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "hosts": args.hosts,
            "devices_per_host": args.devices,
            "nic_gbps": args.gbps,
            "rows": rows,
        }
        Path(args.out).write_text(json.dumps(record, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
