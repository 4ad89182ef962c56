"""The Orbax calls a checkpoint makes, in whichever process holds the arrays (the driver, or a
Ray host actor): write a tree, read (part of) one onto shardings."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def _orbax() -> Any:
    import orbax.checkpoint as ocp

    return ocp


def start_write(path: str, tree: Any) -> Any:
    """Start writing `tree` as an Orbax PyTree checkpoint at `path` (which must not exist).
    Returns once the arrays are copied off the devices (so the caller may donate or delete
    them); the files are written in the background: `.wait_until_finished()` on the returned
    checkpointer, then `.close()`."""
    ocp = _orbax()
    checkpointer = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler())
    checkpointer.save(path, args=ocp.args.PyTreeSave(tree))
    return checkpointer


def finish_write(checkpointer: Any) -> None:
    try:
        checkpointer.wait_until_finished()
    finally:
        checkpointer.close()


def write(path: str, tree: Any) -> None:
    finish_write(start_write(path, tree))


def read(path: str, item: Any) -> Any:
    """Read `item`'s leaves (`ShapeDtypeStruct`s with shardings; `PLACEHOLDER` for leaves to
    skip) from the Orbax checkpoint at `path`; each device reads only its own region."""
    ocp = _orbax()
    restore_args = ocp.checkpoint_utils.construct_restore_args(item)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        return checkpointer.restore(
            path, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args)
        )


def placeholder() -> Any:
    return _orbax().PLACEHOLDER


def savable(x: Any) -> Any:
    """A leaf as Orbax writes it: `jax.Array`s as they are, other array-likes and scalars as
    numpy arrays."""
    if isinstance(x, jax.Array):
        return x
    return np.asarray(x)
