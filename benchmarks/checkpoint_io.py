"""Checkpoint save and restore time, and bytes per host, against the state's size.

A training state of `--sizes` MiB (float32 leaves of 1 MiB rows, sharded over all devices'
first axis: every host holds a quarter) on the Ray runtime's hosts (default 4 hosts x 2 CPU
devices, started here). For each size:
- **save**: `save_checkpoint` (synchronous: from the call until the directory is committed), and
  the bytes each host wrote (its /proc/self/io `wchar` across the save, its helper process
  included, see `storage/_writer.py`);
- **restore**: `restore_checkpoint` onto the same devices in reverse order (every host reads
  another host's quarter), and the bytes each host read;
- **per-host save**: the same leaves each on one host's 2 devices, spread over the hosts (a
  stage per host, the pipeline's usual case): in the `jax.distributed` runtime `init` starts,
  each host's part goes through its helper process (start-up included);
- **local save / restore**: the same state on this process's devices (the local runtime);
- **bound**: the state's bytes over this machine's file-system write rate, measured here by
  writing the same bytes with numpy and fsync; on one machine every host shares that disk, so
  the hosts together cannot beat it.

All hosts are processes of this one machine: the checkpoint's bytes never cross the emulated
links of `jaxreshard cluster up` (its hosts share this file system too), so the per-host share
is the number that carries over to a cluster with a shared file system, and the time bound is
the disk's.

    python benchmarks/checkpoint_io.py --out benchmarks/results/checkpoint_io.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxreshard as jr
from jaxreshard.checkpoint import _ray

ROW = 2**18  # float32 elements: 1 MiB


def state_of(mib: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    leaves = max(1, mib // 8)
    per = mib // leaves
    return {f"w{i}": rng.standard_normal((8 * per, ROW // 8), np.float32) for i in range(leaves)}


def disk_rate(folder: Path, nbytes: int) -> float:
    """Bytes per second this file system takes, fsynced."""
    data = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
    path = folder / "rate.bin"
    start = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data.tobytes())
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return nbytes / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="16,64,256", help="state sizes in MiB")
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--folder", default=None, help="where to write (default: a temp dir)")
    parser.add_argument(
        "--address",
        default=None,
        help="a Ray cluster (e.g. `jaxreshard cluster up`'s) instead of local host actors",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    folder = Path(args.folder or tempfile.mkdtemp(prefix="jaxreshard-ckpt-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    if args.address:
        rt = jr.init(backend="ray", address=args.address, num_hosts=args.hosts, timeout_s=600)
    else:
        rt = jr.init(backend="ray", num_hosts=args.hosts, devices_per_host=2, timeout_s=600)
    nic = rt.cluster.inter_host_gbytes_per_s if args.address else None
    n = 2 * args.hosts
    here = NamedSharding(jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                                       devices=jax.devices()[:n]), P("x"))  # fmt: skip
    there = rt.sharding(rt.mesh((n,), ("x",)), P("x"))
    backwards = rt.sharding(rt.mesh((n,), ("x",), devices=list(range(n))[::-1]), P("x"))
    rows = []
    # (A first save and restore, untimed: Orbax's and TensorStore's imports in every process.)
    warm = {"w": rt.put(np.zeros((n, 8), np.float32), there)}
    jr.save_checkpoint(folder / "warm", warm)
    jr.restore_checkpoint(folder / "warm", {"w": jr.RemoteStruct((n, 8), np.float32, there)})
    for mib in sizes:
        state = state_of(mib, rng)
        nbytes = sum(x.nbytes for x in state.values())
        remote = {k: rt.put(v, there) for k, v in state.items()}
        # The pipeline's usual case: each leaf on one host's devices (a stage per host), the
        # leaves spread over the hosts; in a jax.distributed runtime each host's part is
        # written by its helper process.
        per_host = [rt.sharding(rt.mesh((2,), ("x",), devices=[2 * h, 2 * h + 1]), P("x"))
                    for h in range(args.hosts)]  # fmt: skip
        spread = {k: rt.put(v, per_host[i % args.hosts]) for i, (k, v) in enumerate(state.items())}
        local = {k: jax.device_put(v, here) for k, v in state.items()}
        target = {k: jr.RemoteStruct(v.shape, v.dtype, backwards) for k, v in state.items()}
        local_target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=here)
                        for k, v in state.items()}  # fmt: skip
        times: dict[str, list[float]] = {"save": [], "restore": [], "local_save": [],
                                         "local_restore": [], "per_host_save": []}  # fmt: skip
        wrote: dict[int, list[int]] = {}
        read: dict[int, list[int]] = {}
        for r in range(args.repeats):
            path = folder / f"ray_{mib}_{r}"
            start = time.perf_counter()
            jr.save_checkpoint(path, remote)
            times["save"].append(time.perf_counter() - start)
            for h, io in _ray.last_io["save"].items():
                wrote.setdefault(h, []).append(io["written_bytes"])
            start = time.perf_counter()
            back = jr.restore_checkpoint(path, target)
            times["restore"].append(time.perf_counter() - start)
            for h, io in _ray.last_io["restore"].items():
                read.setdefault(h, []).append(io["read_bytes"])
            if r == 0:
                got = back["w0"].fetch()
                assert np.array_equal(got, state["w0"]), "restored values differ"
            del back
            lpath = folder / f"local_{mib}_{r}"
            start = time.perf_counter()
            jr.save_checkpoint(lpath, local)
            times["local_save"].append(time.perf_counter() - start)
            start = time.perf_counter()
            jax.block_until_ready(jr.restore_checkpoint(lpath, local_target))
            times["local_restore"].append(time.perf_counter() - start)
            ppath = folder / f"per_host_{mib}_{r}"
            start = time.perf_counter()
            jr.save_checkpoint(ppath, spread)
            times["per_host_save"].append(time.perf_counter() - start)
            shutil.rmtree(path)
            shutil.rmtree(lpath)
            shutil.rmtree(ppath)
        rate = disk_rate(folder, nbytes)
        row = {
            "state_mib": nbytes / 2**20,
            **{f"{k}_s": statistics.median(v) for k, v in times.items()},
            "written_mib_per_host": {h: statistics.median(v) / 2**20 for h, v in wrote.items()},
            "read_mib_per_host": {h: statistics.median(v) / 2**20 for h, v in read.items()},
            "disk_gb_s": rate / 1e9,
            "bound_s": nbytes / rate,
            # What a host's share would take through its NIC, were the folder across the links
            # (on one machine it is not: see the docstring).
            "nic_share_s": nbytes / args.hosts / (nic * 1e9) if nic else None,
        }
        rows.append(row)
        for x in [*remote.values(), *spread.values()]:
            x.free()
    jr.shutdown()
    print(f"{'state':>9} {'save':>8} {'restore':>8} {'per-host':>8} {'local save':>10} "
          f"{'local rest':>10} {'bound':>8}  written / read MiB per host")  # fmt: skip
    for row in rows:
        w = " ".join(f"{v:.1f}" for _, v in sorted(row["written_mib_per_host"].items()))
        rd = " ".join(f"{v:.1f}" for _, v in sorted(row["read_mib_per_host"].items()))
        print(f"{row['state_mib']:7.0f}Mi {row['save_s']:7.2f}s {row['restore_s']:7.2f}s "
              f"{row['per_host_save_s']:7.2f}s "
              f"{row['local_save_s']:9.2f}s {row['local_restore_s']:9.2f}s "
              f"{row['bound_s']:7.2f}s  {w} / {rd}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({
            "benchmark": "checkpoint_io", "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.node()} ({os.cpu_count()} cores)", "hosts": args.hosts,
            "address": args.address, "nic_gbytes_per_s": nic,
            "devices_per_host": 2, "jax": jax.__version__, "rows": rows,
        }, indent=1))  # fmt: skip
        print(f"wrote {args.out}")
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
