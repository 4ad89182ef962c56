"""`jaxreshard.save_checkpoint`: write a tree of arrays from wherever its shards are."""

from __future__ import annotations

import atexit
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import jax

from jaxreshard._tracebacks import api_boundary
from jaxreshard.checkpoint._format import (
    Index,
    LeafRecord,
    check_metadata,
    commit,
    dtype_name,
    staging_dir,
    write_index,
)
from jaxreshard.storage import _orbax


class PendingCheckpoint:
    """A checkpoint being written (`save_checkpoint(..., wait=False)`).

    The arrays were copied off the devices before `save_checkpoint` returned, so the next step
    may run (and donate them) at once; the files are written in the background. `wait()` makes
    the checkpoint durable and raises the write's error, if any; until then the directory is
    absent (or still the previous checkpoint).
    """

    def __init__(self, directory: Path, finish: Any, asynchronous: bool):
        self.directory = directory
        self._error: BaseException | None = None
        self._done = threading.Event()
        self.seconds = 0.0  # from the call to the commit
        self._start = time.perf_counter()

        def run() -> None:
            try:
                finish()
            except BaseException as e:
                self._error = e
            finally:
                self.seconds = time.perf_counter() - self._start
                self._done.set()

        if asynchronous:
            _hook_exit()
            self._thread: threading.Thread | None = threading.Thread(
                target=run, name="jaxreshard-checkpoint", daemon=True
            )
            self._thread.start()
            _PENDING.add(self)
        else:
            self._thread = None
            run()

    def done(self) -> bool:
        """Whether the write has finished (committed or failed)."""
        return self._done.is_set()

    @api_boundary
    def wait(self, timeout_s: float | None = 3600.0) -> Path:
        """Block until the checkpoint is committed; return its directory. Raises the write's
        error, or `TimeoutError` after `timeout_s` (the write goes on)."""
        if not self._done.wait(timeout_s):
            raise TimeoutError(
                f"checkpoint {self.directory}: still writing after {timeout_s} s; call wait() "
                "again, or check the file system (full, or very slow)"
            )
        _PENDING.discard(self)
        if self._error is not None:
            raise self._error
        return self.directory

    def __repr__(self) -> str:
        state = (
            "written"
            if self.done() and self._error is None
            else ("failed" if self.done() else "writing")
        )
        return f"PendingCheckpoint({str(self.directory)!r}, {state})"


_PENDING: set[PendingCheckpoint] = set()


def wait_all_pending(timeout_s: float = 600.0) -> None:
    """Let every background write finish (at most `timeout_s` each): the exit hook, so that a
    script whose last act is `save_checkpoint(..., wait=False)` leaves its checkpoint."""
    for pending in list(_PENDING):
        pending._done.wait(timeout_s)
        _PENDING.discard(pending)


_hooked = False


def _hook_exit() -> None:
    """Wait for the background writes at exit, before the thread pools stop.

    At interpreter exit `threading._shutdown` runs threading's own exit hooks, in reverse order,
    before `atexit`'s: `concurrent.futures` stops taking work there, and Orbax's background write
    needs it. So the wait goes into those hooks, registered at the first background write (by
    then Orbax has imported every pool it uses, so this hook runs first); `atexit` where they are
    missing."""
    global _hooked
    if _hooked:
        return
    _hooked = True
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(wait_all_pending, 300.0)
    else:  # pragma: no cover
        atexit.register(wait_all_pending, 300.0)


@api_boundary
def save_checkpoint(
    directory: str | os.PathLike[str],
    tree: Any,
    *,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    wait: bool = True,
) -> PendingCheckpoint:
    """Save a pytree of arrays (parameters, optimizer state) as an Orbax checkpoint.

    Each array is written from its own shards by whoever holds them: this process on the local
    runtime; on Ray, each host actor writes its stages' arrays into the shared directory.
    Nothing is gathered on the driver. The directory appears only once it is complete (see
    [Note: checkpoint format]): a crash mid-write leaves the previous checkpoint as it was.

    Args:
        directory: the checkpoint's path (its parent is created if needed). On Ray it must be
            a file system every host sees (one machine, or a shared mount).
        tree: any pytree whose leaves are arrays (`jax.Array`, numpy, `RemoteArray`) or
            scalars: what a parallelized step returns, a Flax `nnx.State`, an Equinox module
            filtered to its arrays.
        metadata: JSON values saved beside the arrays (e.g. `{"step": 100}`); read back with
            `checkpoint_metadata`.
        overwrite: replace an existing checkpoint at `directory` (the old one stays complete
            until the new one is).
        wait: False returns once the arrays are off the devices and writes the files in the
            background; call `.wait()` on the result to make it durable.

    Returns:
        A `PendingCheckpoint` (already committed when `wait` is True).
    """
    from jaxreshard.runtime.ray._remote import RemoteArray

    directory = _check_directory(directory)
    info = check_metadata(metadata)
    if not isinstance(overwrite, bool) or not isinstance(wait, bool):
        raise TypeError("save_checkpoint: overwrite and wait are bools")
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, RemoteArray)
    )
    if not flat:
        raise ValueError(
            "save_checkpoint(tree=...): the tree has no leaves; pass the arrays to save "
            "(e.g. (params, opt_state))"
        )
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    leaves = [_check_leaf(x, p) for p, x in zip(paths, (x for _, x in flat))]
    if directory.exists() and not overwrite:
        raise FileExistsError(
            f"save_checkpoint: {directory} exists; pass overwrite=True to replace it (the old "
            "checkpoint stays complete until the new one is), or save to a new path"
        )
    directory.parent.mkdir(parents=True, exist_ok=True)
    staged = staging_dir(directory)
    remote = [i for i, x in enumerate(leaves) if isinstance(x, RemoteArray)]
    if remote:
        from jaxreshard.checkpoint._ray import start_parts

        records, finish_parts = start_parts(staged, paths, leaves)
        index = Index("parts", records, info)
    else:
        records = [
            LeafRecord(p, tuple(x.shape), dtype_name(x.dtype), None) for p, x in zip(paths, leaves)
        ]
        checkpointer = _start_orbax(staged, jax.tree.unflatten(treedef, leaves))
        index = Index("orbax", records, info)

        def finish_parts() -> None:
            _orbax.finish_write(checkpointer)

    def finish() -> None:
        try:
            finish_parts()
            write_index(staged, index)
            commit(staged, directory, overwrite)
        except BaseException:
            _remove_staged(staged)
            raise

    pending = PendingCheckpoint(directory, finish, asynchronous=not wait)
    if wait:
        pending.wait()  # (raises the write's error)
    return pending


def _start_orbax(staged: Path, tree: Any) -> Any:
    try:
        return _orbax.start_write(str(staged), tree)
    except BaseException:
        _remove_staged(staged)
        raise


def _remove_staged(staged: Path) -> None:
    """Remove a failed save's files: its staging dir and Orbax's own temporary one beside it."""
    for path in [staged, *staged.parent.glob(f"{staged.name}.orbax-checkpoint-tmp*")]:
        shutil.rmtree(path, ignore_errors=True)


def _check_directory(directory: Any) -> Path:
    if not isinstance(directory, (str, os.PathLike)) or not str(directory):
        raise TypeError(f"checkpoint directory={directory!r}: give a path (str or pathlib.Path)")
    path = Path(directory).expanduser().absolute()
    if path.name in ("", ".", ".."):
        raise ValueError(f"checkpoint directory={str(directory)!r}: name a directory to create")
    return path


def _check_leaf(x: Any, path: str) -> Any:
    """A leaf as it is saved, or a clear error naming it."""
    from jaxreshard.runtime.ray._remote import RemoteArray

    if isinstance(x, RemoteArray):
        if x.is_freed:
            raise ValueError(
                f"save_checkpoint: leaf {path} ({x!r}) was freed (a step that donated it, or "
                "free()); save the arrays the latest step returned"
            )
        return x
    if isinstance(x, jax.Array):
        if x.is_deleted():
            raise ValueError(
                f"save_checkpoint: leaf {path} ({x.dtype}{list(x.shape)}) was deleted (donated "
                "to a step); save the arrays the latest step returned"
            )
        spec = getattr(x.sharding, "spec", None)
        if spec is not None and (
            getattr(spec, "unreduced", None) or getattr(spec, "reduced", None)
        ):
            raise ValueError(
                f"save_checkpoint: leaf {path} has sharding {x.sharding.spec} (reduced or "
                "unreduced): reshard it to a plain sharding first (jax.reshard(x, P(...)))"
            )
        return x
    if isinstance(x, jax.core.Tracer):
        raise TypeError(f"save_checkpoint: leaf {path} is a traced value; save outside jax.jit")
    value = _orbax.savable(x) if _array_like(x) else None
    if value is None or value.dtype.kind in "OUSV":
        raise TypeError(
            f"save_checkpoint: leaf {path} is a {type(x).__name__}, not an array or a number; "
            "save arrays only (filter the tree first, e.g. eqx.filter(model, eqx.is_array), or "
            "put strings in metadata=)"
        )
    return value


def _array_like(x: Any) -> bool:
    import numpy as np

    return isinstance(x, (np.ndarray, np.generic, int, float, bool, complex)) or hasattr(
        x, "__array__"
    )
