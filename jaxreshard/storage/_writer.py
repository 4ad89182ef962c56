"""A helper process that writes one host's part of a checkpoint with single-process Orbax.

[Note: parts of one host in a distributed runtime]
A Ray host that joined `jax.distributed` (stages spanning hosts) cannot hand Orbax the arrays
only it holds: Orbax's `ArrayHandler` refuses process-local `jax.Array`s when there are several
processes, and its `NumpyHandler` writes only from process 0. So such a host puts its leaves
(whole, from its own shards: the host holds every shard of a stage that lives on it alone) into
`.npy` files in a private folder under /dev/shm and runs this module, a fresh Python process
outside the distributed runtime, which writes them as an ordinary Orbax checkpoint and removes
the folder. Nothing goes through the driver; the cost is the helper's start-up (about a second)
and one copy into memory.

Usage: python -m jaxreshard.storage._writer SOURCE_DIR DEST_DIR
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

WRITER_TIMEOUT_S = 3600.0


def stage_leaves(leaves: Mapping[str, np.ndarray]) -> Path:
    """Put `leaves` (key -> array) into a fresh private folder the helper reads."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    folder = Path(tempfile.mkdtemp(prefix="jaxreshard-ckpt-", dir=base))
    for key, value in leaves.items():
        value = np.asarray(value)
        # The dtype goes in the name: bfloat16 and the other ml_dtypes have no .npy form, so
        # they travel as unsigned integers of their width.
        raw = (
            value.view(f"u{value.dtype.itemsize}")
            if value.dtype.kind == "V" or (value.dtype.name not in np.sctypeDict)
            else value
        )
        np.save(folder / f"{key}__{value.dtype.name}.npy", raw, allow_pickle=False)
    return folder


def start(source: Path, dest: str) -> subprocess.Popen[bytes]:
    """Start the helper writing `source`'s leaves to the Orbax checkpoint `dest`."""
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"  # the helper needs no accelerator (and must not hold one)
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(name, None)
    return subprocess.Popen(
        [sys.executable, "-m", "jaxreshard.storage._writer", str(source), dest],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def finish(process: subprocess.Popen[bytes], source: Path, dest: str) -> tuple[int, int]:
    """Wait for the helper; return the bytes it read and wrote (its /proc/self/io); raise
    with the end of its error output if it failed."""
    try:
        out, err = process.communicate(timeout=WRITER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise TimeoutError(
            f"the checkpoint writer for {dest} ran over {WRITER_TIMEOUT_S:.0f} s; check the "
            "file system"
        ) from None
    finally:
        shutil.rmtree(source, ignore_errors=True)
    if process.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(
            f"the checkpoint writer for {dest} failed (exit {process.returncode}): "
            + " | ".join(tail)
        )
    try:
        read, written = (int(n) for n in out.decode().split()[-2:])
    except ValueError:
        read = written = 0
    return read, written


def main(argv: list[str]) -> int:
    source, dest = Path(argv[0]), argv[1]
    import jax.numpy as jnp

    from jaxreshard.storage import _orbax

    tree: dict[str, Any] = {}
    for path in sorted(source.glob("*.npy")):
        key, dtype = path.stem.rsplit("__", 1)
        tree[key] = np.load(path, allow_pickle=False).view(jnp.dtype(dtype))
    from jaxreshard.storage._host import io_bytes

    read0, written0 = io_bytes()
    _orbax.write(dest, tree)
    read1, written1 = io_bytes()
    print(read1 - read0, written1 - written0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
