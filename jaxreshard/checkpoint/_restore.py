"""`jaxreshard.restore_checkpoint`: read a checkpoint into any layout."""

from __future__ import annotations

import os
from typing import Any

import jax

from jaxreshard._tracebacks import api_boundary
from jaxreshard.checkpoint._format import PARTS, Index, check_target_leaves, read_index
from jaxreshard.checkpoint._save import _check_directory
from jaxreshard.storage import _orbax


@api_boundary
def checkpoint_metadata(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The metadata a checkpoint was saved with (`save_checkpoint(metadata=...)`), plus
    `"leaves"`: each saved leaf's key path, shape and dtype."""
    index = read_index(_check_directory(directory))
    return {
        **index.metadata,
        "leaves": [
            {"path": r.path, "shape": list(r.shape), "dtype": r.dtype} for r in index.leaves
        ],
    }


@api_boundary
def restore_checkpoint(directory: str | os.PathLike[str], target: Any) -> Any:
    """Read a checkpoint into the layout `target` describes.

    Every process that holds part of the result reads only the regions it needs, straight
    onto its devices; the result sits exactly on the target's shardings. The checkpoint may
    have been written from any layout (another stage count, other meshes, `jax.jit`, Ray).

    Args:
        directory: a checkpoint written by `save_checkpoint`.
        target: a pytree with the saved tree's structure whose leaves say where each array
            goes: `jax.ShapeDtypeStruct`s with shardings (from `train_step.placement(...)`, a
            `jax.jit` sharding, or `jax.sharding.SingleDeviceSharding(device)`), arrays (their
            shardings are used), or a Ray placement's `RemoteStruct`s. A leaf without a
            sharding goes to `jax.devices()[0]`.

    Returns:
        `target`'s tree with the arrays read (`RemoteArray`s for Ray targets).

    Raises:
        CheckpointError: the directory is missing, incomplete or corrupt, or `target` does not
            match the saved tree (the message names the leaf, the saved and the wanted value).
    """
    from jaxreshard.runtime.ray._remote import RemoteArray, RemoteStruct

    directory = _check_directory(directory)
    index = read_index(directory)
    is_leaf = lambda x: isinstance(x, (RemoteStruct, RemoteArray))
    flat, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=is_leaf)
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    structs = [_struct(x, p) for p, (_, x) in zip(paths, flat)]
    check_target_leaves(index, paths, structs, directory)
    remote = [i for i, s in enumerate(structs) if isinstance(s, RemoteStruct)]
    out: list[Any] = [None] * len(structs)
    if remote:
        from jaxreshard.checkpoint._ray import read_remote

        for i, value in read_remote(directory, index, paths, structs, remote, treedef).items():
            out[i] = value
    local = [i for i in range(len(structs)) if i not in set(remote)]
    if local:
        for i, value in _read_local(directory, index, paths, structs, local, treedef).items():
            out[i] = value
    return jax.tree.unflatten(treedef, out)


def _struct(x: Any, path: str) -> Any:
    """A target leaf as a ShapeDtypeStruct with a sharding (or a RemoteStruct)."""
    from jaxreshard.runtime.ray._remote import RemoteArray, RemoteStruct

    if isinstance(x, RemoteStruct):
        return x
    if isinstance(x, RemoteArray):
        return RemoteStruct(x.shape, x.dtype, x.sharding)
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(
            f"restore_checkpoint(target=...): leaf {path} is a {type(x).__name__}; target "
            "leaves are jax.ShapeDtypeStruct (with a sharding), arrays, or a placement's "
            "structs (train_step.placement(...))"
        )
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    elif not isinstance(sharding, jax.sharding.Sharding):
        raise TypeError(
            f"restore_checkpoint(target=...): leaf {path} has sharding {sharding!r}, which is "
            "not a jax.sharding.Sharding; give NamedSharding(mesh, P(...)) or a device's "
            "SingleDeviceSharding"
        )
    return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype, sharding=sharding)


def _read_local(
    directory: Any,
    index: Index,
    paths: list[str],
    structs: list[Any],
    wanted: list[int],
    treedef: Any,
) -> dict[int, Any]:
    """Leaves `wanted` read in this process onto their shardings."""
    skip = _orbax.placeholder()
    if index.layout == "orbax":
        item = [skip] * len(structs)
        for i in wanted:
            item[i] = structs[i]
        values = jax.tree.leaves(
            _orbax.read(str(directory), jax.tree.unflatten(treedef, item)),
            is_leaf=lambda x: x is skip,
        )
        return {i: values[i] for i in wanted}
    by_path = {r.path: (n, r) for n, r in enumerate(index.leaves)}
    by_part: dict[str, dict[str, tuple[int, Any]]] = {}
    for i in wanted:
        n, record = by_path[paths[i]]
        by_part.setdefault(record.part, {})[Index.key_of(n)] = (i, structs[i])
    out: dict[int, Any] = {}
    for part, items in sorted(by_part.items()):
        read = _read_part(directory / PARTS / part, index, part, items)
        out.update(read)
    return out


def _read_part(
    path: Any, index: Index, part: str, items: dict[str, tuple[int, Any]]
) -> dict[int, Any]:
    """Read `items` (key -> (target position, struct)) from one part: a flat dict with every
    key of the part, PLACEHOLDER for the ones not wanted."""
    skip = _orbax.placeholder()
    keys = index.part_keys(part)
    item = {k: items[k][1] if k in items else skip for k in keys}
    values = _orbax.read(str(path), item)
    return {i: values[k] for k, (i, _) in items.items()}
