"""Errors at the API show the user's code, not ours.

[Note: API tracebacks]
An exception that leaves a public entry point (`parallelize`'s call, `plan`, `init`, `reshard`,
...) carries a traceback with jaxreshard's, JAX's and jaxlib's frames taken out, as JAX does for
its own: what is left is the user's script down to the call that failed, and the frames of the
user's code that we ran (the loss, the model) where the error was raised inside them, and the
boundary's own frame (the `raise` that re-raised it); the message names the argument, value,
rule and fix. `JAXRESHARD_TRACEBACK=1` keeps every frame (and the CLI then prints its traceback
too).
"""

from __future__ import annotations

import functools
import os
import pathlib
import threading
import types
from collections.abc import Callable
from typing import Any, TypeVar

TRACEBACK_ENV = "JAXRESHARD_TRACEBACK"
_NOTE = (
    "(jaxreshard removed its own and JAX's frames from this traceback; set "
    f"{TRACEBACK_ENV}=1 to keep them)"
)

_F = TypeVar("_F", bound=Callable[..., Any])
_depth = threading.local()


def _internal_dirs() -> tuple[str, ...]:
    dirs = [str(pathlib.Path(__file__).resolve().parent)]
    for name in ("jax", "jaxlib"):
        try:
            module = __import__(name)
        except ImportError:
            continue
        dirs.append(str(pathlib.Path(module.__file__).resolve().parent))
    return tuple(d + os.sep for d in dirs)


_INTERNAL: tuple[str, ...] | None = None


def _is_internal(filename: str) -> bool:
    global _INTERNAL
    if _INTERNAL is None:
        _INTERNAL = _internal_dirs()
    try:
        path = os.path.realpath(filename)
    except (OSError, ValueError):
        return False
    return path.startswith(_INTERNAL)


def filter_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    """`tb` without the internal frames."""
    kept: list[tuple[Any, int, int]] = []
    while tb is not None:
        if not _is_internal(tb.tb_frame.f_code.co_filename):
            kept.append((tb.tb_frame, tb.tb_lasti, tb.tb_lineno))
        tb = tb.tb_next
    out = None
    for frame, lasti, lineno in reversed(kept):
        out = types.TracebackType(out, frame, lasti, lineno)
    return out


def api_boundary(fn: _F) -> _F:
    """Wrap a public entry point: an exception leaving it (only the outermost one of nested
    entry points) has its traceback filtered (see [Note: API tracebacks])."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_depth, "value", 0)
        _depth.value = depth + 1
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if depth or os.environ.get(TRACEBACK_ENV):
                raise
            filtered = filter_traceback(e.__traceback__)
            if _NOTE not in getattr(e, "__notes__", ()):
                e.add_note(_NOTE)
            # The chained causes were raised inside us too: keep them out of the user's view.
            e.__suppress_context__ = True
            raise e.with_traceback(filtered) from None
        finally:
            _depth.value = depth

    return wrapper  # type: ignore[return-value]


def error_line(e: BaseException, limit: int = 200) -> str:
    """`e` in one line for a plan or a report: its type and its message's first line, at most
    `limit` characters of it (a bare `assert` has no message: its type alone)."""
    lines = str(e).splitlines()
    return f"{type(e).__name__}: {lines[0][:limit]}" if lines else type(e).__name__
