"""A checkpoint on the Ray runtime, from the driver's side: every host writes the shards it
holds and reads the regions it needs; the driver only sends descriptions and collects handles
(see [Note: checkpoint format] and `_host.py`)."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxreshard._tree_wire import dump_numbered
from jaxreshard.checkpoint._format import PARTS, Index, LeafRecord, dtype_name
from jaxreshard.storage import _orbax
from jaxreshard.storage._host import LeafPlace

DRIVER_PART = "driver"

# What each host wrote or read in the latest save or restore of this process, by host
# (`{"written_bytes", "read_bytes", "seconds"}`): the per-host share a benchmark reports.
last_io: dict[str, dict[int, dict[str, Any]]] = {"save": {}, "restore": {}}


def _place(key: str, array_id: str, shape: Any, dtype: Any, sharding: Any) -> LeafPlace:
    mesh = sharding.mesh
    ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(mesh.devices)
    return LeafPlace(
        key, array_id, tuple(shape), dtype_name(dtype), ids, tuple(mesh.axis_names),
        sharding.spec,
    )  # fmt: skip


def _part_name(hosts: Sequence[int]) -> str:
    return "host" + "-".join(str(h) for h in hosts)


def _hosts(sharding: Any) -> tuple[int, ...]:
    return tuple(sorted({d.process_index for d in sharding.mesh.devices.flat}))


def start_parts(staged: Path, paths: list[str], leaves: list[Any]) -> tuple[list[LeafRecord], Any]:
    """Have every host start writing its leaves into `staged/parts/`, the driver the host
    data; returns the index's records and the function that finishes the writes."""
    from jaxreshard.runtime.ray._remote import RemoteArray

    runtimes = {id(x.runtime): x.runtime for x in leaves if isinstance(x, RemoteArray)}
    if len(runtimes) > 1:
        raise ValueError("save_checkpoint: the tree holds arrays of two Ray runtimes")
    runtime = next(iter(runtimes.values()))
    runtime._check_usable()
    records: list[LeafRecord] = []
    by_host: dict[int, dict[str, list[LeafPlace]]] = {}
    driver: dict[str, Any] = {}
    for n, (path, x) in enumerate(zip(paths, leaves)):
        key = Index.key_of(n)
        if isinstance(x, RemoteArray):
            runtime._check_array(x)
            hosts = _hosts(x.sharding)
            part = _part_name(hosts)
            place = _place(key, x.array_id, x.shape, x.dtype, x.sharding)
            for h in hosts:
                by_host.setdefault(h, {}).setdefault(part, []).append(place)
        else:
            part = DRIVER_PART
            driver[key] = x if not isinstance(x, jax.Array) else np.asarray(x)
        records.append(LeafRecord(path, tuple(np.shape(x)), dtype_name(x.dtype), part))
    root = staged / PARTS
    root.mkdir(parents=True)
    io: dict[int, dict[str, Any]] = {}
    # Parts of hosts that run a stage together are written one at a time, whole (their hosts
    # meet at Orbax's barriers; two such saves at once have hung at them), before the others.
    single: dict[int, dict[str, list[LeafPlace]]] = {}
    multi: dict[str, dict[int, list[LeafPlace]]] = {}
    for h, parts in by_host.items():
        for part, places in parts.items():
            if "-" in part:
                multi.setdefault(part, {})[h] = places
            else:
                single.setdefault(h, {})[part] = places
    for part in sorted(multi):
        token = secrets.token_hex(6)
        hosts = multi[part]
        what = f"writing checkpoint part {part}"
        runtime._wait(
            {
                h: runtime.actors[h].checkpoint_start_write.remote(token, {part: places}, str(root))
                for h, places in hosts.items()
            },
            what,
        )
        done = runtime._wait(
            {h: runtime.actors[h].checkpoint_finish_write.remote(token) for h in hosts}, what
        )
        _add_io(io, done)
    token = secrets.token_hex(6)
    runtime._wait(
        {
            h: runtime.actors[h].checkpoint_start_write.remote(token, parts, str(root))
            for h, parts in single.items()
        },
        "copying the checkpoint's shards off the devices",
    )
    checkpointer = _orbax.start_write(str(root / DRIVER_PART), driver) if driver else None

    def finish() -> None:
        try:
            done = runtime._wait(
                {h: runtime.actors[h].checkpoint_finish_write.remote(token) for h in single},
                "writing the checkpoint's shards",
            )
            _add_io(io, done)
            last_io["save"] = io
        finally:
            if checkpointer is not None:
                _orbax.finish_write(checkpointer)

    return records, finish


def _add_io(total: dict[int, dict[str, Any]], done: dict[int, dict[str, Any]]) -> None:
    for h, io in done.items():
        mine = total.setdefault(h, {})
        for k, v in io.items():
            mine[k] = mine.get(k, 0) + v


def _skeleton(treedef: Any, num_leaves: int) -> bytes:
    """The restore target's tree pickled for the hosts (`dump_numbered`), or an error that
    names what does not pickle."""
    try:
        return dump_numbered(jax.tree.unflatten(treedef, [0] * num_leaves))
    except Exception as e:
        raise TypeError(
            f"restore_checkpoint: the target's tree cannot be pickled for the Ray hosts, which "
            f"read an Orbax checkpoint with it ({type(e).__name__}: {e}); make its classes and "
            "static fields picklable, or restore into a plain tree (a dict of its leaves) and "
            "rebuild the model from it"
        ) from e


def read_remote(
    directory: Path,
    index: Index,
    paths: list[str],
    structs: list[Any],
    wanted: list[int],
    treedef: Any,
) -> dict[int, Any]:
    """Target leaves `wanted` (RemoteStructs) read by the hosts of their shardings; returns
    their `RemoteArray`s by position."""
    from jaxreshard.runtime import current_runtime
    from jaxreshard.runtime.ray._remote import SMALL_BYTES, RemoteArray

    runtime = current_runtime()
    if getattr(runtime, "backend", None) != "ray":
        raise RuntimeError(
            "restore_checkpoint: the target holds Ray placements (RemoteStruct) but no Ray "
            "runtime is running; call jaxreshard.init(backend='ray', ...) first"
        )
    runtime._check_usable()
    by_path = {r.path: (n, r) for n, r in enumerate(index.leaves)}
    # Per host, per source (a part, or the whole tree): position in the source's skeleton ->
    # (LeafPlace, new array id).
    calls: dict[tuple[int, tuple[int, ...]], dict[str, Any]] = {}  # (host, its group) -> ...
    out: dict[int, Any] = {}
    whole_skeleton: bytes | None = None  # (the user's tree: pickled once, if read whole)
    parts: dict[str, tuple[bytes, dict[str, int]]] = {}  # part -> (skeleton, positions)
    for i in wanted:
        s = structs[i]
        runtime._check_sharding(s.sharding, f"target leaf {paths[i]}")
        n, record = by_path[paths[i]]
        array_id = runtime._new_id("restore")
        place = _place(Index.key_of(n), array_id, s.shape, s.dtype, s.sharding)
        if index.layout == "orbax":
            if whole_skeleton is None:
                whole_skeleton = _skeleton(treedef, len(structs))
            source, skeleton, position = ".", whole_skeleton, i
        else:
            part = str(record.part)
            if part not in parts:
                keys = sorted(index.part_keys(part))  # (a dict flattens in sorted key order)
                positions = {k: at for at, k in enumerate(keys)}
                parts[part] = (dump_numbered(dict.fromkeys(keys, 0)), positions)
            source = f"{PARTS}/{record.part}"
            skeleton, position = parts[part][0], parts[part][1][place.key]
        group = _hosts(s.sharding)
        for h in group:
            entry = calls.setdefault((h, group), {}).setdefault(source, (skeleton, {}, {}))
            entry[1][position] = place
            entry[2][position] = array_id
        out[i] = RemoteArray(runtime, array_id, s.shape, s.dtype, s.sharding)
    # Leaves whose target spans hosts are read by those hosts together (Orbax's multi-process
    # restore), one group at a time after the rest, as parts are written (see `start_parts`).
    waves: list[dict[int, dict[str, Any]]] = [{}]
    groups: dict[tuple[int, ...], dict[int, dict[str, Any]]] = {}
    for (h, group), sources in calls.items():
        wave = waves[0] if len(group) == 1 else groups.setdefault(group, {})
        wave[h] = sources
    waves += [groups[g] for g in sorted(groups)]
    io: dict[int, dict[str, Any]] = {}
    for wave in waves:
        refs = {
            h: runtime.actors[h].checkpoint_read.remote(
                {str(directory / source): entry for source, entry in sources.items()}
            )
            for h, sources in wave.items()
        }
        _add_io(io, runtime._wait(refs, f"reading checkpoint {directory}"))
    last_io["restore"] = io
    small = [x for x in out.values() if x.nbytes <= SMALL_BYTES]
    for x, value in zip(small, runtime.fetch_many(small)):  # (their values here too, as `put`)
        x.value = value
    return out
