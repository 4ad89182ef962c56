"""A helper process that writes one host's part of a checkpoint with single-process Orbax.

[Note: parts of one host in a distributed runtime]
A Ray host that joined `jax.distributed` (stages spanning hosts) cannot hand Orbax the arrays
only it holds: Orbax's `ArrayHandler` refuses process-local `jax.Array`s when there are several
processes, and its `NumpyHandler` writes only from process 0. So such a host puts its leaves
(whole, from its own shards: the host holds every shard of a stage that lives on it alone) into
`.npy` files in a private folder under /dev/shm and runs this module, a fresh Python process
outside the distributed runtime, which writes them as an ordinary Orbax checkpoint and removes
the folder. Nothing goes through the driver. The helper starts at the host's first save (about
a second: Python, JAX and Orbax imported) and stays for the next ones, taking one job per line
on its stdin; it ends when its stdin closes, with the host actor. What a save costs on top of
an in-process write is one copy into memory.

Usage (by the host actor): python -m jaxreshard.storage._writer --serve
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from concurrent.futures import Future
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


_REPLY = "jaxreshard-writer "  # the prefix of the helper's answers on its stdout


class _Helper:
    """The helper process of this host, kept for the next saves (started on first use; it
    ends when its stdin closes, so with the host actor that started it)."""

    def __init__(self) -> None:
        env = dict(os.environ)
        env["JAX_PLATFORMS"] = "cpu"  # the helper needs no accelerator (and must not hold one)
        for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
            env.pop(name, None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jaxreshard.storage._writer", "--serve"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self._lock = threading.Lock()
        self._pending: dict[int, Future[tuple[int, int]]] = {}
        self._ids = itertools.count()
        self._errors: collections.deque[str] = collections.deque(maxlen=20)
        threading.Thread(target=self._read, name="jaxreshard-writer-out", daemon=True).start()
        threading.Thread(target=self._drain, name="jaxreshard-writer-err", daemon=True).start()

    def alive(self) -> bool:
        return self.process.poll() is None

    def submit(self, source: Path, dest: str) -> Future[tuple[int, int]]:
        job: Future[tuple[int, int]] = Future()
        with self._lock:
            n = next(self._ids)
            self._pending[n] = job
            line = json.dumps({"id": n, "source": str(source), "dest": dest}) + "\n"
            assert self.process.stdin is not None
            try:
                self.process.stdin.write(line.encode())
                self.process.stdin.flush()
            except OSError as e:
                del self._pending[n]
                job.set_exception(RuntimeError(f"the checkpoint writer is gone: {e}"))
        return job

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            text = raw.decode(errors="replace")
            if not text.startswith(_REPLY):
                continue
            reply = json.loads(text[len(_REPLY) :])
            with self._lock:
                job = self._pending.pop(reply["id"], None)
            if job is None:
                continue
            if reply["ok"]:
                job.set_result((reply["read"], reply["written"]))
            else:
                job.set_exception(RuntimeError(f"the checkpoint writer failed: {reply['error']}"))
        with self._lock:  # the helper ended: whatever it had not answered fails
            pending, self._pending = self._pending, {}
        tail = " | ".join(list(self._errors)[-5:])
        for job in pending.values():
            job.set_exception(RuntimeError(f"the checkpoint writer exited: {tail}"))

    def _drain(self) -> None:
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            self._errors.append(raw.decode(errors="replace").strip())


_helper: _Helper | None = None
_helper_lock = threading.Lock()


def start(source: Path, dest: str) -> Future[tuple[int, int]]:
    """Have this host's helper write `source`'s leaves to the Orbax checkpoint `dest` (the
    helper starts on first use and stays for the next saves)."""
    global _helper
    with _helper_lock:
        if _helper is None or not _helper.alive():
            _helper = _Helper()
        helper = _helper
    return helper.submit(source, dest)


def finish(job: Future[tuple[int, int]], source: Path, dest: str) -> tuple[int, int]:
    """Wait for a write; return the bytes the helper read and wrote for it (its
    /proc/self/io); raise with the helper's error if it failed."""
    try:
        return job.result(timeout=WRITER_TIMEOUT_S)
    except TimeoutError:
        raise TimeoutError(
            f"the checkpoint writer for {dest} ran over {WRITER_TIMEOUT_S:.0f} s; check the "
            "file system"
        ) from None
    finally:
        shutil.rmtree(source, ignore_errors=True)


def serve() -> int:
    """The helper: one JSON job per stdin line, one answer per job on stdout, until stdin
    closes."""
    import jax.numpy as jnp

    from jaxreshard.storage import _orbax
    from jaxreshard.storage._host import io_bytes

    for line in sys.stdin:
        job = json.loads(line)
        source = Path(job["source"])
        try:
            tree: dict[str, Any] = {}
            for path in sorted(source.glob("*.npy")):
                key, dtype = path.stem.rsplit("__", 1)
                tree[key] = np.load(path, allow_pickle=False).view(jnp.dtype(dtype))
            read0, written0 = io_bytes()
            _orbax.write(job["dest"], tree)
            read1, written1 = io_bytes()
            reply = {"id": job["id"], "ok": True, "read": read1 - read0,
                     "written": written1 - written0}  # fmt: skip
        except Exception as e:
            reply = {"id": job["id"], "ok": False, "error": f"{type(e).__name__}: {e}"}
        finally:
            shutil.rmtree(source, ignore_errors=True)
        print(_REPLY + json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(serve() if sys.argv[1:] == ["--serve"] else 2)
