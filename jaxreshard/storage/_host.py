"""A Ray host actor's side of a checkpoint: write the shards it holds, read the regions it
needs (see [Note: checkpoint format]). Leaves are described by `LeafPlace`: the array id on the
host, and the mesh (global device ids) and spec it has; the host makes `jax.Array`s of its own
shards and hands them to Orbax.

A part written by one host is a single-process Orbax checkpoint. A leaf on a stage mesh that
spans hosts lives in one `jax.distributed` runtime with its peers' shards; the hosts of that mesh
write their part together (Orbax's multi-process save on that subset of processes: primary host
the lowest process, the others write their shards and wait at Orbax's barriers).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxreshard._tree_wire import load_numbered
from jaxreshard.storage import _orbax, _writer


@dataclasses.dataclass(frozen=True)
class LeafPlace:
    """Where a leaf is (or goes) on the hosts."""

    key: str  # its key in the part's flat dict
    array_id: str
    shape: tuple[int, ...]
    dtype: str
    device_ids: np.ndarray  # the mesh, as global device ids
    axis_names: tuple[str, ...]
    spec: Any  # PartitionSpec


def io_bytes() -> tuple[int, int]:
    """This process's bytes read and written through the file system so far (`rchar`/`wchar`
    of /proc/self/io: every read and write call, page cache included)."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines())
        return int(fields["rchar"]), int(fields["wchar"])
    except (OSError, KeyError, ValueError):
        return 0, 0


def _mesh(actor: Any, place: LeafPlace) -> Any:
    import jax

    devices = actor.global_devices or actor.devices
    return jax.sharding.Mesh(
        np.vectorize(lambda g: devices[int(g)], otypes=[object])(place.device_ids),
        place.axis_names,
    )


def _sharding(actor: Any, place: LeafPlace) -> Any:
    import jax

    return jax.sharding.NamedSharding(_mesh(actor, place), place.spec)


def _array(actor: Any, place: LeafPlace) -> Any:
    """The leaf as a `jax.Array` of this host's shards (global when its mesh spans hosts)."""
    import jax

    sharding = _sharding(actor, place)
    whole = actor.whole.get(place.array_id)
    if whole is not None and whole.sharding.is_equivalent_to(sharding, len(place.shape)):
        value = whole
    else:
        shards = actor._array(place.array_id)
        gid = {d: g for g, d in (actor.global_devices or actor.devices).items()}
        arrays = [shards[gid[d]] for d in sharding.addressable_devices_indices_map(place.shape)]
        value = jax.make_array_from_single_device_arrays(tuple(place.shape), sharding, arrays)
    return value


def _processes(actor: Any, place: LeafPlace) -> tuple[int, ...]:
    devices = actor.global_devices or actor.devices
    return tuple(sorted({devices[int(g)].process_index for g in place.device_ids.flat}))


def _checkpointer(processes: Sequence[int], asynchronous: bool, barrier_key: str) -> Any:
    """An Orbax checkpointer for a part written (or read) by `processes`: the default one in
    a single process, else one whose barriers (named by `barrier_key`, so that two stages
    saving at once do not meet at one barrier) and metadata writes involve only them."""
    import jax
    import orbax.checkpoint as ocp

    handler_args: dict[str, Any] = {}
    options: dict[str, Any] = {}
    if jax.process_count() > 1:
        primary = min(processes)
        mp = ocp.options.MultiprocessingOptions(
            primary_host=primary,
            active_processes=set(processes),
            barrier_sync_key_prefix=barrier_key,
        )
        th = ocp.type_handlers
        registry = th.create_type_handler_registry(
            (jax.Array, th.ArrayHandler(primary_host=primary)),
            (np.ndarray, th.NumpyHandler()),
            (np.number, th.ScalarHandler()),
            (int, th.ScalarHandler()),
            (float, th.ScalarHandler()),
            (type(ocp.PLACEHOLDER), th.get_type_handler(type(ocp.PLACEHOLDER))),
        )
        handler_args = {"multiprocessing_options": mp, "type_handler_registry": registry}
        options = {"multiprocessing_options": mp}
    handler = ocp.PyTreeCheckpointHandler(**handler_args)
    if asynchronous:
        return ocp.AsyncCheckpointer(handler, **options)
    return ocp.Checkpointer(handler, **options)


@dataclasses.dataclass
class _HelperWrite:
    """A part being written by a helper process (see `_writer.py`)."""

    job: Any  # a Future of the helper's (bytes read, bytes written)
    source: Any
    dest: str

    def finish(self) -> tuple[int, int]:
        return _writer.finish(self.job, self.source, self.dest)


def start_write(
    actor: Any, token: str, parts: Mapping[str, Sequence[LeafPlace]], root: str
) -> dict[str, Any]:
    """Start writing each part (`root/<part>`) from this host's shards; returns once they are
    off the devices. The writes go on in the background until `finish_write(token)`."""
    import jax
    import orbax.checkpoint as ocp

    read0, written0 = io_bytes()
    start = time.perf_counter()
    pending = []
    for part in sorted(parts):
        places = parts[part]
        tree = {p.key: _array(actor, p) for p in places}
        processes = _processes(actor, places[0])
        dest = f"{root}/{part}"
        if jax.process_count() > 1 and len(processes) == 1:
            # (see [Note: parts of one host in a distributed runtime] in `_writer.py`)
            source = _writer.stage_leaves({k: np.asarray(v) for k, v in tree.items()})
            pending.append(_HelperWrite(_writer.start(source, dest), source, dest))
            continue
        checkpointer = _checkpointer(processes, asynchronous=True, barrier_key=f"{token}-{part}")
        checkpointer.save(dest, args=ocp.args.PyTreeSave(tree))
        pending.append(checkpointer)
    actor.checkpoint_writes[token] = (pending, read0, written0, start)
    return {"copied_s": time.perf_counter() - start}


def finish_write(actor: Any, token: str) -> dict[str, Any]:
    """Wait for the writes `start_write(token)` began; report this host's bytes and time."""
    pending, read0, written0, start = actor.checkpoint_writes.pop(token)
    helper_read = helper_written = 0
    for checkpointer in pending:
        if isinstance(checkpointer, _HelperWrite):
            r, w = checkpointer.finish()
            helper_read, helper_written = helper_read + r, helper_written + w
        else:
            _orbax.finish_write(checkpointer)
    read1, written1 = io_bytes()
    return {
        "written_bytes": written1 - written0 + helper_written,
        "read_bytes": read1 - read0 + helper_read,
        "seconds": time.perf_counter() - start,
    }


def drop_write(actor: Any, token: str) -> None:
    """Forget a write (the driver gave up on it)."""
    entry = actor.checkpoint_writes.pop(token, None)
    if entry is not None:
        for checkpointer in entry[0]:
            try:
                if not isinstance(checkpointer, _HelperWrite):  # (the helper's job runs out)
                    checkpointer.close()
            except Exception:
                pass


def read(
    actor: Any,
    path: str,
    skeleton: bytes,
    places: Mapping[int, LeafPlace],
    new_ids: Mapping[int, str],
) -> dict[str, Any]:
    """Read leaves `places` (by position in `skeleton`'s flatten order) from the Orbax
    checkpoint at `path` onto this host's devices, and keep them as `new_ids`. `skeleton` is
    the saved tree's structure (`dump_numbered`): a flat dict of a part, or the user's tree."""
    import jax
    import orbax.checkpoint as ocp

    read0, _ = io_bytes()
    start = time.perf_counter()
    leaves, treedef = load_numbered(skeleton, f"the restore target's tree for {path}")
    item = [ocp.PLACEHOLDER] * len(leaves)
    for i, place in places.items():
        item[i] = jax.ShapeDtypeStruct(
            place.shape, jax.numpy.dtype(place.dtype), sharding=_sharding(actor, place)
        )
    tree = jax.tree.unflatten(treedef, item)
    processes = sorted({p for place in places.values() for p in _processes(actor, place)})
    restore_args = ocp.checkpoint_utils.construct_restore_args(tree)
    key = f"read-{'-'.join(sorted(new_ids.values()))[:64]}"
    with _checkpointer(processes, asynchronous=False, barrier_key=key) as checkpointer:
        values = checkpointer.restore(
            path, args=ocp.args.PyTreeRestore(item=tree, restore_args=restore_args)
        )
    flat = jax.tree.leaves(values, is_leaf=lambda x: x is ocp.PLACEHOLDER)
    for i, array_id in new_ids.items():
        actor._keep(array_id, flat[i])
    read1, _ = io_bytes()
    return {"read_bytes": read1 - read0, "seconds": time.perf_counter() - start}
