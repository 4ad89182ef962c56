"""Resharding benchmark cases (`jaxreshard-reshard-cases/1`) as virtual meshes on a cluster."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from jax.sharding import PartitionSpec

from jaxreshard.comm import Cluster, VirtualMesh, VirtualSharding

CASES_FORMAT = "jaxreshard-reshard-cases/1"
SHIPPED_CASES = "reshard_cases.json"


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


def shipped_cases_path() -> Path:
    return Path(str(resources.files("jaxreshard") / "data" / SHIPPED_CASES))


def load_cases(path: str | Path | None = None) -> tuple[dict[str, Any], list[Case]]:
    """Read a case file (default: the shipped paper cases); return its cluster dict and cases."""
    path = Path(path) if path is not None else shipped_cases_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"--cases {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--cases {path}: not valid JSON ({e})") from None
    if data.get("format") != CASES_FORMAT:
        raise ValueError(
            f"--cases {path}: format is {data.get('format')!r}, expected {CASES_FORMAT!r}"
        )
    cluster = dict(data.get("cluster", {}))
    cases = [case_from_json(c, cluster, where=f"{path}") for c in data["cases"]]
    return cluster, cases


def _spec(entries: Any) -> PartitionSpec:
    return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in entries))


def case_from_json(case: Mapping[str, Any], cluster: Mapping[str, Any], where: str = "") -> Case:
    """Place a case on hosts following the case file's `placement` rule.

    Mesh devices are laid out row-major and fill hosts of `devices_per_host` devices (the mesh's
    own value, else the cluster's); the source mesh starts on host 0, the destination mesh on the
    first host after the source's; global device ids count up in that order, source first.
    """
    name = case.get("name", "?")
    try:
        links = {**cluster, **case.get("cluster", {})}
        default_per_host = int(links.pop("devices_per_host", 4))
        hosts: list[tuple[int, ...]] = []
        meshes = []
        next_id = 0
        for side in ("src_mesh", "dst_mesh"):
            mesh = case[side]
            mesh_shape = tuple(int(n) for n in mesh["shape"])
            per_host = int(mesh.get("devices_per_host", default_per_host))
            ids = list(range(next_id, next_id + math.prod(mesh_shape)))
            next_id += len(ids)
            host_of = {}
            for i in range(0, len(ids), per_host):
                host_of.update({d: len(hosts) for d in ids[i : i + per_host]})
                hosts.append(tuple(ids[i : i + per_host]))
            meshes.append(VirtualMesh.from_ids(mesh_shape, mesh["axis_names"], ids, host_of))
        keys = ("inter_host_gbytes_per_s", "intra_host_gbytes_per_s", "latency_s", "chunk_bytes")
        topo = Cluster(tuple(hosts), **{k: links[k] for k in keys if k in links})
        return Case(
            name=name,
            shape=tuple(int(n) for n in case["shape"]),
            dtype=case.get("dtype", "float32"),
            src=VirtualSharding(meshes[0], _spec(case["src_spec"])),
            dst=VirtualSharding(meshes[1], _spec(case["dst_spec"])),
            cluster=topo,
            src_mesh_shape=tuple(case["src_mesh"]["shape"]),
            dst_mesh_shape=tuple(case["dst_mesh"]["shape"]),
        )
    except KeyError as e:
        raise ValueError(f"{where}: case {name!r} lacks the key {e}") from None
