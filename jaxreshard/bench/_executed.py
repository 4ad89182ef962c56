"""`jaxreshard bench reshard --execute {local,ray}`: run the cases for real and check them.

Each case is scaled down (every dim divided by `scale`, kept divisible by its shardings), run
with the `auto` plan on the chosen runtime, compared element-wise with the source, and timed side
by side with a baseline: `jax.device_put(x, dst_sharding)` in the same process for `local`, and
"every receiving host pulls the whole tensor" for `ray`. The machine's memory-copy bandwidth is
measured once as the physical limit.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxreshard.bench._cases import Case
from jaxreshard.comm import Layout, Op, VirtualSharding, simulate
from jaxreshard.comm._layout import spec_axes


def scale_case(case: Case, scale: int) -> Case:
    """Divide every dim by `scale`, rounded down to a multiple of what its shardings need."""
    if scale < 1:
        raise ValueError(f"--scale {scale}: must be an int >= 1")
    factors = [1] * len(case.shape)
    for sharding in (case.src, case.dst):
        sizes = sharding.mesh.shape
        for dim, entry in enumerate(sharding.spec):
            factors[dim] = math.lcm(factors[dim], math.prod(sizes[a] for a in spec_axes(entry)))
    shape = tuple(max(f, (n // scale) // f * f) for n, f in zip(case.shape, factors))
    return dataclasses.replace(case, shape=shape)


def memcpy_gbytes_per_s(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Best rate of copying `nbytes` into a warm buffer on this machine, with the copy threads
    the local runtime uses (GB/s, 1e9 bytes): the physical limit of a host-memory resharding."""
    from jaxreshard.comm._local import _copy_pool

    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    pool = _copy_pool()
    pieces = np.array_split(np.arange(src.size), pool._max_workers * 4)
    bounds = [(p[0], p[-1] + 1) for p in pieces if p.size]

    def copy_all() -> None:
        futures = [pool.submit(np.copyto, dst[a:b], src[a:b]) for a, b in bounds]
        for future in futures:
            future.result()

    copy_all()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        copy_all()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def source_data(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """Deterministic, position-dependent data (so a misplaced slice shows up)."""
    n = math.prod(shape)
    return (np.arange(n, dtype=np.int64) % 65_521).astype(dtype).reshape(tuple(shape))


def dst_bytes(case: Case) -> int:
    layout = Layout.from_sharding(case.dst, case.shape)
    itemsize = np.dtype(_dtype(case.dtype)).itemsize
    return sum(math.prod(b - a for a, b in index) for index in layout.indices) * itemsize


def _dtype(name: str) -> Any:
    import jax.numpy as jnp

    return jnp.dtype(name)


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[list[float], Any]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return times, out


def devices_needed(cases: Sequence[Case]) -> int:
    return max(d for c in cases for d in (*_ids(c.src), *_ids(c.dst))) + 1


def _ids(sharding: VirtualSharding) -> list[int]:
    return [d.id for d in sharding.mesh.devices.flat]


def run_local(case: Case, repeats: int) -> dict[str, Any]:
    """Execute the case's `auto` plan with the local runtime, next to `jax.device_put`."""
    import jax
    from jax.sharding import Mesh, NamedSharding

    from jaxreshard.comm import plan_reshard
    from jaxreshard.comm._local import execute_local

    devices = {d.id: d for d in jax.devices()}

    def real(sharding: VirtualSharding) -> NamedSharding:
        grid = np.vectorize(lambda d: devices[d.id], otypes=[object])(sharding.mesh.devices)
        return NamedSharding(Mesh(grid, sharding.mesh.axis_names), sharding.spec)

    src, dst = real(case.src), real(case.dst)
    data = source_data(case.shape, _dtype(case.dtype))
    x = jax.device_put(data, src)
    x.block_until_ready()
    plan = plan_reshard(case.shape, case.dtype, src, dst, cluster=case.cluster, strategy="auto")
    ours, theirs = [], []
    y = None
    for _ in range(repeats):  # alternate, so both see the same machine state
        t, y = _timed(lambda: execute_local(plan, x, dst).block_until_ready(), 1)
        ours += t
        del y
        t, z = _timed(lambda: jax.device_put(x, dst).block_until_ready(), 1)
        theirs += t
        del z
    stats: dict[str, int] = {}
    y = execute_local(plan, x, dst, stats=stats)
    correct = y.sharding == dst and all(
        np.array_equal(np.asarray(s.data), data[s.index]) for s in y.addressable_shards
    )
    return {
        "runtime": "local",
        "strategy": plan.chosen,
        "seconds": statistics.median(ours),
        "predicted_seconds": plan.seconds,
        "baseline": "jax.device_put",
        "baseline_seconds": statistics.median(theirs),
        "baseline_predicted_seconds": None,  # the cluster model does not describe device_put
        "correct": bool(correct),
        "all_seconds": ours,
        "all_baseline_seconds": theirs,
        "copied_bytes": stats.get("copied_bytes"),
        "adopted_bytes": stats.get("adopted_bytes"),
    }


def run_ray(runtime: Any, case: Case, repeats: int) -> dict[str, Any]:
    """Execute the case's `auto` plan on the Ray runtime, next to the naive every-host-pulls."""
    mapping = map_devices(case, runtime)

    def remote(sharding: VirtualSharding) -> VirtualSharding:
        ids = [mapping[d.id] for d in sharding.mesh.devices.flat]
        mesh = runtime.mesh(sharding.mesh.devices.shape, sharding.mesh.axis_names, ids)
        return VirtualSharding(mesh, sharding.spec)

    src, dst = remote(case.src), remote(case.dst)
    data = source_data(case.shape, _dtype(case.dtype))
    x = runtime.put(data, src)
    ours, theirs = [], []
    plan = runtime.plan(x, dst)
    naive = naive_ops(src, dst, case.shape, plan.itemsize, runtime.cluster)
    for _ in range(repeats):
        t, y = _timed(lambda: runtime.reshard(x, dst), 1)
        ours += t
        y.free()
        t, z = _timed(lambda: runtime.reshard_naive(x, dst), 1)
        theirs += t
        z.free()
    y = runtime.reshard(x, dst)
    correct = bool(np.array_equal(y.fetch(), data))
    y.free()
    x.free()
    return {
        "runtime": "ray",
        "transport": runtime.transport,
        "strategy": plan.chosen,
        "seconds": statistics.median(ours),
        "predicted_seconds": plan.seconds,
        "baseline": "naive: every receiving host pulls the whole tensor",
        "baseline_seconds": statistics.median(theirs),
        "baseline_predicted_seconds": simulate(naive, runtime.cluster)[1],
        "correct": correct,
        "all_seconds": ours,
        "all_baseline_seconds": theirs,
    }


def naive_ops(
    src: VirtualSharding, dst: VirtualSharding, shape: Sequence[int], itemsize: int, cluster: Any
) -> list[Op]:
    """The naive baseline (`RayRuntime.reshard_naive`) as plan ops, for the simulator: every
    host with destination devices receives every distinct source region from its first holder
    (one send to one of its devices), region by region."""
    src_layout = Layout.from_sharding(src, tuple(shape))
    dst_layout = Layout.from_sharding(dst, tuple(shape))
    first: dict[Any, int] = {}
    for device, index in zip(src_layout.devices, src_layout.indices):
        first.setdefault(index, device)
    receiver: dict[int, int] = {}
    for device in dst_layout.devices:
        receiver.setdefault(cluster.host_of(device), device)
    ops = []
    for index, holder in first.items():
        nbytes = math.prod(b - a for a, b in index) * itemsize
        for device in receiver.values():
            if device != holder:
                ops.append(Op("send", index, nbytes, src_device=holder, dst_devices=(device,)))
    return ops


def map_devices(case: Case, runtime: Any) -> dict[int, int]:
    """Case device -> runtime device, keeping hosts: the k-th device of case host h becomes the
    k-th device of runtime host h."""
    mapping = {}
    for h, devices in enumerate(case.cluster.hosts):
        if h >= len(runtime.hosts) or len(devices) > len(runtime.hosts[h]):
            raise ValueError(
                f"case {case.name} needs host {h} with {len(devices)} devices; the runtime has "
                f"{runtime.cluster.describe()}"
            )
        for k, d in enumerate(devices):
            mapping[d] = runtime.hosts[h][k]
    return mapping


def ray_shape(cases: Sequence[Case]) -> tuple[int, int]:
    """Hosts and devices per host a Ray runtime needs to run every case."""
    return (
        max(c.cluster.num_hosts for c in cases),
        max(len(h) for c in cases for h in c.cluster.hosts),
    )


def executed_table(results: dict[str, Any]) -> Any:
    """The executed results as a rich table; on Ray, measured beside the simulator's
    prediction for the same plan (and for the naive baseline) on the runtime's cluster model."""
    from rich.table import Table

    limit = results["memcpy_gbytes_per_s"]
    runtime = results["cases"][0]["executed"]["runtime"] if results["cases"] else "?"
    emulated = results.get("emulate_network_gbps")
    network = f"; emulated NICs {emulated:g} GB/s" if emulated else ""
    model = results.get("cluster_model")
    if model:
        network += (
            f"; model {model['inter_host_gbytes_per_s']:g} GB/s NICs, "
            f"{model['latency_s'] * 1e3:g} ms latency"
        )
    if results.get("address"):
        network += f"; cluster {results['address']}"
    transport = results["cases"][0]["executed"].get("transport") if results["cases"] else None
    if transport:
        network += f"; transport {transport}"
    table = Table(
        title=f"Executed resharding ({runtime} runtime, scale 1/{results['scale']} per "
        f"dim{network}); memcpy limit {limit:.2f} GB/s"
    )
    local = runtime == "local"
    columns = ["case", "shape", "MiB to dst", "plan", "seconds"]
    if local:
        columns += ["baseline s", "speedup", "MiB copied", "MiB adopted", "copy GB/s", "of memcpy"]
    else:
        columns += ["predicted", "meas/pred", "naive s", "naive pred", "meas/pred", "speedup"]
        columns += ["pred speedup", "GB/s"]
    for column in (*columns, "correct"):
        table.add_column(column, justify="left" if column in ("case", "plan") else "right")
    ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"
    for c in results["cases"]:
        e = c["executed"]
        row = [
            c["name"],
            "x".join(map(str, e["shape"])),
            f"{e['bytes'] / 2**20:.0f}",
            e["strategy"],
            f"{e['seconds']:.4f}",
        ]
        if local:
            copied = e.get("copied_bytes") or 0
            rate = copied / e["seconds"] / 1e9 if copied and e["seconds"] else None
            row += [
                f"{e['baseline_seconds']:.4f}",
                ratio(e["baseline_seconds"], e["seconds"]),
                f"{copied / 2**20:.0f}",
                f"{(e.get('adopted_bytes') or 0) / 2**20:.0f}",
                f"{rate:.2f}" if rate else "-",
                f"{rate / limit:.0%}" if rate else "-",
            ]
        else:
            predicted, naive_predicted = e["predicted_seconds"], e["baseline_predicted_seconds"]
            row += [
                f"{predicted:.4f}",
                ratio(e["seconds"], predicted),
                f"{e['baseline_seconds']:.4f}",
                f"{naive_predicted:.4f}",
                ratio(e["baseline_seconds"], naive_predicted),
                ratio(e["baseline_seconds"], e["seconds"]),
                ratio(naive_predicted, predicted),
                f"{e['bytes'] / e['seconds'] / 1e9:.2f}" if e["seconds"] else "-",
            ]
        table.add_row(*row, "yes" if e["correct"] else "[red]NO")
    return table
