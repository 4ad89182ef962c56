"""A checkpoint directory: its index, its leaves, and the atomic commit that makes it exist.

[Note: checkpoint format]
A checkpoint is a directory that holds:
- `jaxreshard.json`, the index: format version, the user's metadata (JSON, e.g. the step), and
  every leaf of the saved tree in flatten order with its key path (`jax.tree_util.keystr`),
  shape, dtype, and where its data is;
- the data, in Orbax's PyTree format (`orbax-checkpoint`'s `PyTreeCheckpointHandler`, with
  OCDBT), in one of two layouts:
  - `orbax`: the directory itself is one Orbax checkpoint of the tree as the user gave it,
    written by this process (the local runtime, host data). Orbax's own
    `StandardCheckpointer().restore(directory)` reads it.
  - `parts`: `parts/<name>/` are Orbax checkpoints of flat dicts `{leaf number: array}`,
    each written by the processes that hold those leaves (on Ray: each host actor writes the
    leaves of the stages it runs; the driver writes the leaves it holds itself). Nothing is
    gathered on the driver. Each part opens with Orbax's `StandardCheckpointer` too.

A checkpoint is complete or absent: everything is written under a hidden sibling
`.<name>.jaxreshard-tmp-<token>`, the index last (fsynced), then the directory is renamed into
place. Overwriting renames the old one aside first (`.<name>.jaxreshard-old-<token>`) and removes
it after; a crash between the two renames leaves the old one complete under that name, and
`restore_checkpoint` on the missing directory says where it is. A directory without the index is
not a checkpoint (a crash mid-write, or someone else's files) and is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxreshard._files import show

INDEX = "jaxreshard.json"
FORMAT = "jaxreshard-checkpoint"
VERSION = 1
PARTS = "parts"
TMP_TAG = ".jaxreshard-tmp-"
OLD_TAG = ".jaxreshard-old-"
MAX_INDEX_BYTES = 256 * 2**20


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete, corrupt, or does not match the target."""


@dataclasses.dataclass(frozen=True)
class LeafRecord:
    """One saved leaf: where it sits in the tree and in the directory."""

    path: str  # jax.tree_util.keystr of its key path
    shape: tuple[int, ...]
    dtype: str
    part: str | None  # None: the `orbax` layout (the tree itself); else the part's name

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


@dataclasses.dataclass
class Index:
    """The parsed `jaxreshard.json` of a checkpoint."""

    layout: str  # "orbax" | "parts"
    leaves: list[LeafRecord]
    metadata: dict[str, Any]

    def part_keys(self, part: str) -> list[str]:
        """The flat-dict keys of the leaves saved in `part`, in leaf order."""
        return [self.key_of(n) for n, r in enumerate(self.leaves) if r.part == part]

    @staticmethod
    def key_of(i: int) -> str:
        """Leaf `i`'s key in a part's flat dict."""
        return f"leaf{i:06d}"

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "layout": self.layout,
            "metadata": self.metadata,
            "leaves": [
                {"path": r.path, "shape": list(r.shape), "dtype": r.dtype, "part": r.part}
                for r in self.leaves
            ],
        }


def check_metadata(metadata: Any) -> dict[str, Any]:
    """The user's metadata as a JSON-safe dict, or a TypeError naming what is not."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(
            f"save_checkpoint(metadata={show(metadata)}): metadata is a dict of JSON values "
            "(e.g. {'step': 100}), saved beside the arrays"
        )
    try:
        text = json.dumps(dict(metadata), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"save_checkpoint(metadata=...): {e}; metadata holds JSON values only (str, int, "
            "float, bool, None, lists and dicts of them): convert numpy scalars with int()/float()"
        ) from None
    return json.loads(text)


def read_index(directory: Path) -> Index:
    """Parse a checkpoint's index; a missing, partial or corrupt directory is a
    `CheckpointError` naming it and what is wrong."""
    if not directory.exists():
        aside = sorted(directory.parent.glob(f".{directory.name}{OLD_TAG}*"))
        hint = (
            f"; a save that was overwriting it stopped between its two renames, and the "
            f"previous checkpoint is complete at {aside[-1]}: rename it back"
            if aside
            else ""
        )
        raise CheckpointError(f"checkpoint directory {directory} does not exist{hint}")
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory} is not a directory")
    index = directory / INDEX
    if not index.is_file():
        raise CheckpointError(
            f"{directory} is not a complete jaxreshard checkpoint: it has no {INDEX} (a save "
            "that did not finish never gets one, and its directory keeps a hidden "
            f"'{TMP_TAG}' name; this one may be another tool's). Restore from a complete "
            "checkpoint; an Orbax checkpoint written without jaxreshard opens with "
            "orbax.checkpoint.StandardCheckpointer"
        )
    if index.stat().st_size > MAX_INDEX_BYTES:
        raise CheckpointError(f"{index} is over {MAX_INDEX_BYTES >> 20} MiB: not an index we wrote")
    try:
        data = json.loads(index.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format is {show(data.get('format'))}, not {FORMAT!r}")
        if data.get("version") != VERSION:
            raise ValueError(
                f"version {show(data.get('version'))}; this jaxreshard reads version {VERSION}"
            )
        layout = data["layout"]
        if layout not in ("orbax", "parts"):
            raise ValueError(f"layout {show(layout)} is neither 'orbax' nor 'parts'")
        leaves = []
        for n, r in enumerate(data["leaves"]):
            shape = tuple(int(d) for d in r["shape"])
            if any(d < 0 for d in shape):
                raise ValueError(f"leaves[{n}].shape {shape} has a negative dim")
            dtype = dtype_name(r["dtype"])
            part = r["part"]
            if layout == "parts" and not (isinstance(part, str) and _safe_name(part)):
                raise ValueError(f"leaves[{n}].part {show(part)} is not a part name")
            leaves.append(LeafRecord(str(r["path"]), shape, dtype, part))
        metadata = data.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise ValueError("metadata is not an object")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        what = f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
        raise CheckpointError(
            f"{index} is corrupt ({what}); restore from another checkpoint"
        ) from None
    return Index(layout, leaves, metadata)


def _safe_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name


def write_index(directory: Path, index: Index) -> None:
    """Write the index (the last file of a save) and make it durable."""
    path = directory / INDEX
    with open(path, "w") as f:
        json.dump(index.to_json(), f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def staging_dir(directory: Path) -> Path:
    """A fresh hidden sibling of `directory` to write a checkpoint under (not created)."""
    return directory.parent / f".{directory.name}{TMP_TAG}{secrets.token_hex(4)}"


def commit(staged: Path, directory: Path, overwrite: bool) -> None:
    """Rename a complete staged checkpoint into place (see [Note: checkpoint format])."""
    _fsync_dir(staged)
    if directory.exists() or directory.is_symlink():
        if not overwrite:
            raise FileExistsError(
                f"save_checkpoint: {directory} exists; pass overwrite=True to replace it "
                "(the old checkpoint stays complete until the new one is)"
            )
        if directory.is_symlink() or not directory.is_dir():
            raise FileExistsError(
                f"save_checkpoint: {directory} exists and is not a directory; a checkpoint "
                "only replaces a checkpoint: remove it or choose another path"
            )
        if not (directory / INDEX).is_file() and any(directory.iterdir()):
            raise FileExistsError(
                f"save_checkpoint: {directory} is a non-empty directory that is not a "
                "jaxreshard checkpoint; overwrite replaces only checkpoints: choose another path"
            )
        aside = directory.parent / f".{directory.name}{OLD_TAG}{secrets.token_hex(4)}"
        os.rename(directory, aside)
        os.rename(staged, directory)
        _fsync_dir(directory.parent)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(staged, directory)
        _fsync_dir(directory.parent)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_target_leaves(
    index: Index, paths: Sequence[str], structs: Sequence[Any], directory: Path
) -> None:
    """Every target leaf matches the saved one (path, shape, dtype), else a `CheckpointError`
    naming the leaf, the saved value and the wanted one."""
    saved = {r.path: r for r in index.leaves}
    wanted = set(paths)
    missing = [p for p in paths if p not in saved]
    extra = [r.path for r in index.leaves if r.path not in wanted]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"target leaves {_few(missing)} are not in the checkpoint")
        if extra:
            parts.append(f"saved leaves {_few(extra)} are not in the target")
        raise CheckpointError(
            f"restore_checkpoint({directory}): the target's tree does not match the saved "
            f"one: {'; '.join(parts)}. Build the target from the tree you saved (e.g. "
            "train_step.placement(params, opt_state), or jax.eval_shape of your init)"
        )
    for p, s in zip(paths, structs):
        r = saved[p]
        shape, dtype = tuple(s.shape), dtype_name(s.dtype)
        if shape != r.shape or dtype != r.dtype:
            raise CheckpointError(
                f"restore_checkpoint({directory}): leaf {p} was saved as {r.describe()} but the "
                f"target wants {dtype}{list(shape)}; restore into a target of the saved shape "
                "and dtype (cast or reshape after restoring)"
            )


def _few(items: Sequence[str], n: int = 4) -> str:
    head = ", ".join(items[:n])
    return head + (f" and {len(items) - n} more" if len(items) > n else "")


def dtype_name(dtype: Any) -> str:
    """A dtype's name, bfloat16 and the other ml_dtypes included."""
    import jax.numpy as jnp

    return jnp.dtype(dtype).name


STEP_NAME = re.compile(r"step_(\d{8})")


def step_dir(root: Path, step: int) -> Path:
    """Where a run keeps its checkpoint of step `step` (`root/step_<8 digits>`)."""
    return root / f"step_{step:08d}"


def latest_step(root: Path) -> tuple[int, Path] | None:
    """The newest complete step checkpoint under `root` (one with an index), or None."""
    if not root.is_dir():
        return None
    found = []
    for path in root.iterdir():
        m = STEP_NAME.fullmatch(path.name)
        if m and (path / INDEX).is_file():
            found.append((int(m.group(1)), path))
    return max(found) if found else None
