"""Resharding benchmark cases (`jaxreshard-reshard-cases/1`) as virtual meshes on a cluster.

A case file is user input: `load_cases` refuses a bad one with one `ValueError` naming the file,
the JSON key path (`cases[2].src_mesh.shape[0]`), the value, the rule and the fix (see [Note:
hostile input] in `jaxreshard/_files.py`), and refuses sizes past the limits below with the
estimate, before any mesh or plan is made.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from jax.sharding import PartitionSpec

from jaxreshard import _files
from jaxreshard._files import InputError, human_bytes, show
from jaxreshard.comm import Cluster, VirtualMesh, VirtualSharding
from jaxreshard.comm._cluster import (
    PAPER_INTER_HOST_GBYTES_PER_S,
    PAPER_INTRA_HOST_GBYTES_PER_S,
    PAPER_LATENCY_S,
)
from jaxreshard.comm._layout import check_spec_fits

CASES_FORMAT = "jaxreshard-reshard-cases/1"
SHIPPED_CASES = "reshard_cases.json"

MAX_CASES_BYTES = 16 * 2**20
MAX_CASES = 1_000
MAX_MESH_DEVICES = 128
"""Devices in one mesh: 8 times the 512-device meshes of `benchmarks/planning_time.py`, which
plan in about a second each (the search strategies grow faster than the devices)."""
MAX_UNIT_TASKS = 2**15
"""Regions the planner moves one by one (per dim, the cuts of both specs together): 16 times
the largest of `benchmarks/planning_time.py` (2,048)."""
MAX_ELEMENTS = 2**38
"""Elements of the array: 1 TiB of float32, more than any one tensor a resharding moves
(`--execute` allocates it, divided by `--scale`)."""
MAX_RANK = 16  # dims of an array or a mesh
NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")  # fullmatch: no trailing newline
NAME_RULE = "1-64 letters, digits, '.', '_' or '-', not starting with '.'"
CLUSTER_KEYS = (
    "devices_per_host",
    "inter_host_gbytes_per_s",
    "intra_host_gbytes_per_s",
    "latency_s",
    "chunk_bytes",
)
CASE_KEYS = (
    *("name", "shape", "dtype", "src_mesh", "src_spec", "dst_mesh", "dst_spec"),
    *("cluster", "about"),
)
MESH_KEYS = ("shape", "axis_names", "devices_per_host")


@dataclasses.dataclass(frozen=True)
class Case:
    """One resharding: an array, its source and destination sharding, and the cluster."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    src: VirtualSharding
    dst: VirtualSharding
    cluster: Cluster
    src_mesh_shape: tuple[int, ...]
    dst_mesh_shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        import jax.numpy as jnp

        return math.prod(self.shape) * jnp.dtype(self.dtype).itemsize


def paper_cluster(devices_per_host: int) -> dict[str, Any]:
    """The paper's cluster model with hosts of `devices_per_host` devices, as a case file's
    `cluster` object."""
    return {
        "devices_per_host": devices_per_host,
        "inter_host_gbytes_per_s": PAPER_INTER_HOST_GBYTES_PER_S,
        "intra_host_gbytes_per_s": PAPER_INTRA_HOST_GBYTES_PER_S,
        "latency_s": PAPER_LATENCY_S,
    }


def shipped_cases_path() -> Path:
    return Path(str(resources.files("jaxreshard") / "data" / SHIPPED_CASES))


def load_cases(path: str | Path | None = None) -> tuple[dict[str, Any], list[Case]]:
    """Read a case file (default: the shipped paper cases); return its cluster dict and cases.

    Raises:
        ValueError: the file cannot be read as JSON, is not `jaxreshard-reshard-cases/1`, or a
            case is invalid, too large, or repeats another's name; the message names the file,
            the key path, the value, the rule and the fix.
    """
    path = Path(path) if path is not None else shipped_cases_path()
    where = f"--cases {path}"
    data = _files.read_json(
        path,
        what="case file",
        max_bytes=MAX_CASES_BYTES,
        expected=f"a {CASES_FORMAT} object, like jaxreshard/data/{SHIPPED_CASES}",
        label=where,
    )
    fmt = data.get("format") if isinstance(data, dict) else None
    if fmt != CASES_FORMAT:
        got = f"format is {show(fmt)}" if isinstance(data, dict) else "the JSON is no object"
        newer = (
            ", a version this jaxreshard does not read (upgrade jaxreshard, or write /1)"
            if isinstance(fmt, str) and fmt.startswith("jaxreshard-reshard-cases/")
            else ""
        )
        raise InputError(
            f"{where}: {got}{newer}, expected {CASES_FORMAT!r} (see jaxreshard/data/"
            f"{SHIPPED_CASES})"
        )
    cluster = dict(_check_cluster(data.get("cluster", {}), f"{where}: cluster"))
    cases_json = _files.expect_list(
        data.get("cases", _files.MISSING), f"{where}: cases", "a list of cases"
    )
    if not cases_json:
        raise InputError(f"{where}: cases is empty; give at least one case")
    if len(cases_json) > MAX_CASES:
        raise InputError(f"{where}: {len(cases_json):,} cases; at most {MAX_CASES:,} per file")
    cases: list[Case] = []
    first: dict[str, int] = {}
    for i, entry in enumerate(cases_json):
        at = f"{where}: cases[{i}]"
        name = _files.expect_dict(entry, at, "a case").get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise InputError(
                f"{at}.name = {show(name)}: a case name is {NAME_RULE} (it names output files, "
                "e.g. with --dump-plans); rename it"
            )
        if name in first:
            raise InputError(
                f"{at}.name = {name!r} is also cases[{first[name]}]'s name; case names are "
                "unique (they key the results and name output files): rename one"
            )
        first[name] = i
        cases.append(case_from_json(entry, cluster, where=at))
    return cluster, cases


def _spec(entries: Any) -> PartitionSpec:
    return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in entries))


def case_from_json(
    case: Mapping[str, Any],
    cluster: Mapping[str, Any],
    where: str = "case",
    *,
    max_mesh_devices: int = MAX_MESH_DEVICES,
) -> Case:
    """Check a case and place it on hosts following the case file's `placement` rule.

    Mesh devices are laid out row-major and fill hosts of `devices_per_host` devices (the mesh's
    own value, else the cluster's); the source mesh starts on host 0, the destination mesh on the
    first host after the source's; global device ids count up in that order, source first.

    Args:
        case: one entry of the file's `cases`.
        cluster: the file's `cluster` (link model and `devices_per_host`).
        where: what to call the case in errors (e.g. `x.json: cases[2]`).
        max_mesh_devices: the most devices a mesh may have: `MAX_MESH_DEVICES` for a case
            file; a program's own cases (benchmarks/planning_time.py) may plan larger ones.

    Raises:
        ValueError: a key is missing or of the wrong type, a mesh or spec does not fit the
            shape, or a size is past `MAX_ELEMENTS`, `MAX_MESH_DEVICES` or `MAX_UNIT_TASKS`.
    """
    case = _files.expect_dict(case, where, "a case")
    name = _files.expect_str(case.get("name", _files.MISSING), f"{where}.name", max_len=256)
    label = name if NAME.fullmatch(name) else show(name)
    where = f"{where} ({label})" if label not in where else where
    _files.reject_unknown_keys(case, CASE_KEYS, where)
    for key in ("shape", "src_mesh", "src_spec", "dst_mesh", "dst_spec"):
        if key not in case:
            raise InputError(f"{where} lacks the key {key!r}; a case has {', '.join(CASE_KEYS)}")
    shape = _check_shape(case["shape"], f"{where}.shape")
    dtype = _check_dtype(case.get("dtype", "float32"), f"{where}.dtype")
    links = {
        **_check_cluster(cluster, "cluster"),
        **_check_cluster(case.get("cluster", {}), f"{where}.cluster"),
    }
    default_per_host = links.pop("devices_per_host", 4)
    hosts: list[tuple[int, ...]] = []
    shardings, mesh_shapes = [], []
    next_id = 0
    for side in ("src", "dst"):
        mesh = _files.expect_dict(case[f"{side}_mesh"], f"{where}.{side}_mesh", "a mesh")
        mesh_shape, axis_names, per_host = _check_mesh(
            mesh, f"{where}.{side}_mesh", default_per_host, max_mesh_devices
        )
        spec = _check_spec(case[f"{side}_spec"], f"{where}.{side}_spec", shape, axis_names)
        sizes = dict(zip(axis_names, mesh_shape))
        try:
            check_spec_fits(shape, sizes, spec, f"{where}.{side}_spec")
        except ValueError as e:
            raise InputError(str(e)) from None
        ids = list(range(next_id, next_id + math.prod(mesh_shape)))
        next_id += len(ids)
        host_of = {}
        for i in range(0, len(ids), per_host):
            host_of.update({d: len(hosts) for d in ids[i : i + per_host]})
            hosts.append(tuple(ids[i : i + per_host]))
        mesh_obj = VirtualMesh.from_ids(mesh_shape, axis_names, ids, host_of)
        shardings.append(VirtualSharding(mesh_obj, spec))
        mesh_shapes.append(mesh_shape)
    _check_unit_tasks(shape, shardings, where)
    return Case(
        name=name,
        shape=shape,
        dtype=dtype,
        src=shardings[0],
        dst=shardings[1],
        cluster=Cluster(tuple(hosts), **{k: links[k] for k in CLUSTER_KEYS[1:] if k in links}),
        src_mesh_shape=mesh_shapes[0],
        dst_mesh_shape=mesh_shapes[1],
    )


def case_to_json(case: Case) -> dict[str, Any]:
    """The case as an entry of a case file: `case_from_json(case_to_json(c), {}) == c`."""
    out: dict[str, Any] = {"name": case.name, "shape": list(case.shape), "dtype": case.dtype}
    first_host = 0
    for side, sharding in (("src", case.src), ("dst", case.dst)):
        out[f"{side}_mesh"] = {
            "shape": list(sharding.mesh.devices.shape),
            "axis_names": list(sharding.mesh.axis_names),
            "devices_per_host": len(case.cluster.hosts[first_host]),
        }
        out[f"{side}_spec"] = [list(e) if isinstance(e, tuple) else e for e in sharding.spec]
        first_host = 1 + max(d.process_index for d in sharding.mesh.devices.flat)
    out["cluster"] = {k: getattr(case.cluster, k) for k in CLUSTER_KEYS[1:]}
    return out


def _check_cluster(value: Any, where: str) -> dict[str, Any]:
    """The link model: known keys with numbers in range (a typo would be ignored silently)."""
    cluster = _files.expect_dict(value, where, "the cluster's link model")
    _files.reject_unknown_keys(cluster, CLUSTER_KEYS, where)
    out: dict[str, Any] = {}
    for key, entry in cluster.items():
        at = f"{where}.{key}"
        if key == "devices_per_host":
            out[key] = _files.expect_int(entry, at, low=1, high=MAX_MESH_DEVICES)
        elif key == "chunk_bytes":
            out[key] = _files.expect_int(entry, at, low=1, high=2**40)
        elif key == "latency_s":  # seconds a message waits: up to a thousand
            out[key] = _files.expect_number(entry, at, high=1e3)
        else:  # bandwidths, GB/s: from 1 kB/s to 1 PB/s
            out[key] = _files.expect_number(entry, at, low=1e-6, high=1e6)
    return out


def _check_shape(value: Any, where: str) -> tuple[int, ...]:
    shape = _files.expect_list(value, where, "the array's shape, like [1024, 512]", MAX_RANK)
    if not shape:
        raise InputError(f"{where} is []; give the array's dims, like [1024, 512]")
    dims = tuple(_files.expect_int(n, f"{where}[{d}]", low=1) for d, n in enumerate(shape))
    elements = math.prod(dims)
    if elements > MAX_ELEMENTS:
        raise InputError(
            f"{where} = {list(dims)} has {elements:.3g} elements (~{human_bytes(4 * elements)} of "
            f"float32); at most 2**38 = {MAX_ELEMENTS:,} "
            "(jaxreshard.bench._cases.MAX_ELEMENTS): use a smaller shape"
        )
    return dims


def _check_dtype(value: Any, where: str) -> str:
    from jaxreshard.comm._planner import canonical_dtype

    dtype = _files.expect_str(value, where, max_len=32)
    try:
        dt = canonical_dtype(dtype, where)
    except TypeError as e:
        raise InputError(str(e)) from None
    import jax.numpy as jnp

    if not (jnp.issubdtype(dt, jnp.number) or jnp.issubdtype(dt, jnp.bool_)):
        raise InputError(
            f"{where} = {show(dtype)}: not a numeric dtype; use one JAX arrays hold, e.g. "
            "float32, bfloat16, int8 or bool"
        )
    return dtype


def _check_mesh(
    mesh: Mapping[str, Any], where: str, default_per_host: int, most: int = MAX_MESH_DEVICES
) -> tuple[tuple[int, ...], tuple[str, ...], int]:
    _files.reject_unknown_keys(mesh, MESH_KEYS, where)
    for key in ("shape", "axis_names"):
        if key not in mesh:
            raise InputError(f"{where} lacks the key {key!r}; a mesh has {', '.join(MESH_KEYS)}")
    raw = _files.expect_list(mesh["shape"], f"{where}.shape", "the mesh's shape", MAX_RANK)
    if not raw:
        raise InputError(f"{where}.shape is []; give the mesh's axis sizes, like [2, 4]")
    mesh_shape = tuple(
        _files.expect_int(n, f"{where}.shape[{i}]", low=1, high=most) for i, n in enumerate(raw)
    )
    devices = math.prod(mesh_shape)
    if devices > most:
        raise InputError(
            f"{where}.shape = {list(mesh_shape)} has {devices:,} devices; at most "
            f"{most:,} per mesh (jaxreshard.bench._cases.MAX_MESH_DEVICES: planning "
            "grows faster than the devices): use a smaller mesh"
        )
    names = _files.expect_list(mesh["axis_names"], f"{where}.axis_names", "axis names", MAX_RANK)
    axis_names = tuple(
        _files.expect_str(a, f"{where}.axis_names[{i}]", max_len=64) for i, a in enumerate(names)
    )
    if len(axis_names) != len(mesh_shape) or len(set(axis_names)) != len(axis_names):
        raise InputError(
            f"{where}.axis_names = {show(list(axis_names))}; give one distinct name per mesh "
            f"dim (shape {list(mesh_shape)})"
        )
    per_host = mesh.get("devices_per_host", default_per_host)
    per_host = _files.expect_int(per_host, f"{where}.devices_per_host", low=1, high=most)
    return mesh_shape, axis_names, per_host


def _check_spec(
    value: Any, where: str, shape: tuple[int, ...], axis_names: tuple[str, ...]
) -> PartitionSpec:
    entries = _files.expect_list(value, where, "a PartitionSpec: one entry per dim", len(shape))
    for d, entry in enumerate(entries):
        for axis in entry if isinstance(entry, list) else [] if entry is None else [entry]:
            if not isinstance(axis, str) or axis not in axis_names:
                raise InputError(
                    f"{where}[{d}] = {show(entry)}; an entry is null (not sharded), a mesh axis "
                    f"name or a list of them, and the mesh's axes are {list(axis_names)}"
                )
    return _spec(entries)


def _check_unit_tasks(shape: tuple[int, ...], shardings: list[VirtualSharding], where: str) -> None:
    """Refuse a case whose regions (the cuts of both specs, per dim) are past `MAX_UNIT_TASKS`."""
    from jaxreshard.comm._layout import spec_axes

    parts = [[1] * len(shape), [1] * len(shape)]
    for side, sharding in enumerate(shardings):
        sizes = sharding.mesh.shape
        for d, entry in enumerate(sharding.spec):
            parts[side][d] = math.prod(sizes[a] for a in spec_axes(entry))
    tasks = math.prod(a + b - math.gcd(a, b) for a, b in zip(*parts))
    if tasks > MAX_UNIT_TASKS:
        raise InputError(
            f"{where}: the two specs cut the array into about {tasks:,} regions to move; at most "
            f"{MAX_UNIT_TASKS:,} (jaxreshard.bench._cases.MAX_UNIT_TASKS): shard fewer dims or "
            "over fewer devices"
        )
