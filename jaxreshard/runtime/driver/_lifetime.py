"""Pipelines' lifetime: `shutdown` and the interpreter's exit close the pipelines still alive."""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import Any

# The pipelines built since the runtime started: `shutdown` closes those still alive.
_pipelines: weakref.WeakSet[Any] = weakref.WeakSet()


def track_pipeline(pipeline: Any) -> None:
    """Have `shutdown` close `pipeline` (its `close()`) if it is still alive then, and the
    interpreter's exit too if it runs steps in this process (`pipeline.close_at_exit`)."""
    global _exit_hook
    _pipelines.add(pipeline)
    if not _exit_hook:
        # Registered after JAX's exit hooks (JAX is imported before any pipeline is built), so
        # it runs before them: the threads end while JAX is still whole (see
        # [Note: threads at exit] in `engine/_threads.py`).
        atexit.register(_close_pipelines_at_exit)
        _exit_hook = True


_exit_hook = False


def _close_pipelines_at_exit() -> None:
    for pipeline in list(_pipelines):
        if getattr(pipeline, "close_at_exit", False):
            try:
                pipeline.close()
            except Exception:  # exit goes on; the other pipelines still close
                logging.getLogger(__name__).debug("closing %r at exit failed", pipeline)


def close_pipelines() -> None:
    """Close every pipeline built so far (`jaxreshard.shutdown`)."""
    for pipeline in list(_pipelines):
        pipeline.close()
    _pipelines.clear()
