"""Where user code is: the user's line behind an equation or a call, for error messages.

JAX's own summary of an equation's source (`source_location`) skips JAX's frames only, so an
equation that jaxreshard's markers bind (the backward boundary JAX's AD makes from a
`jr.stage_boundary`) points into `frontend/_markers.py`, and one made under Flax or Equinox into
their files. Messages name the innermost frame outside every installed library instead.
"""

from __future__ import annotations

import functools
import os
import site
import sys
import sysconfig
from types import FrameType
from typing import Any

Frame = tuple[str, int, str]  # (file, line, function)


@functools.cache
def _library_roots() -> tuple[str, ...]:
    """Folders of code that is not the user's: the standard library, installed packages, and
    jaxreshard itself (installed or not)."""
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.update(getattr(site, "getsitepackages", list)())
    roots.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return tuple(os.path.join(os.path.abspath(r), "") for r in roots)


def is_library_file(name: str) -> bool:
    """Whether a frame's file is library code (not the user's)."""
    if name.startswith("<frozen") or name.startswith("<__array_function__"):
        return True
    if name.startswith("<"):  # <stdin>, <string>: the user's
        return False
    return os.path.abspath(name).startswith(_library_roots())


def eqn_frames(eqn: Any) -> list[Frame]:
    """The Python stack that made `eqn`, innermost first (empty where JAX keeps none)."""
    try:
        frames = eqn.source_info.traceback.frames
        return [(f.file_name, f.line_num, f.function_name) for f in frames]
    except Exception:  # another JAX: callers fall back to JAX's summary
        return []


def describe(frame: Frame) -> str:
    file, line, function = frame
    return f"{file}:{line} ({function})"


def user_location(eqn: Any) -> str | None:
    """`file:line (function)` of the innermost user frame that made `eqn`, or None."""
    for frame in eqn_frames(eqn):
        if not is_library_file(frame[0]):
            return describe(frame)
    return None


# JAX's differentiation entry points, by the function name of their frame in `jax/_src/api.py`.
_JAX_TRANSFORMS = {"grad_f": "jax.grad", "value_and_grad_f": "jax.value_and_grad",
                   "vjp": "jax.vjp", "linearize": "jax.linearize"}  # fmt: skip


def gradient_call(eqn: Any) -> tuple[str, str] | None:
    """For an equation JAX's AD made (a transposed marker): the gradient transform that made it
    and the user's line that called it, `(name, "file:line (function)")`; None if the stack
    does not show them. The call is the first user frame outward of JAX's `vjp`; the transform
    is named by the library frame that user line called."""
    frames = eqn_frames(eqn)
    api = [i for i, f in enumerate(frames) if _is_jax_api(f) and _short(f) in _JAX_TRANSFORMS]
    if not api:
        return None
    for i in range(api[0] + 1, len(frames)):
        if is_library_file(frames[i][0]):
            continue
        called = [f for f in frames[api[0] : i] if "traceback_util" not in f[0]]
        return _transform_name(called[-1]), describe(frames[i])
    return None


def _short(frame: Frame) -> str:
    """A frame's function name without its qualifiers (`value_and_grad.<locals>.f` -> `f`)."""
    return frame[2].rsplit(".", 1)[-1]


def _is_jax_api(frame: Frame) -> bool:
    return frame[0].replace(os.sep, "/").endswith("jax/_src/api.py")


def _transform_name(frame: Frame) -> str:
    file = frame[0].replace(os.sep, "/")
    if "/flax/" in file:
        return "nnx.value_and_grad/nnx.grad" if "/nnx/" in file else "a Flax gradient transform"
    if "/equinox/" in file:
        return "eqx.filter_value_and_grad/eqx.filter_grad"
    if _is_jax_api(frame):
        return _JAX_TRANSFORMS.get(_short(frame), "a JAX gradient transform")
    return "a gradient transform"


def caller_location() -> str:
    """`file:line (function)` of the innermost user frame on the current stack (where the user
    called into a library), or `?`."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if not is_library_file(frame.f_code.co_filename):
            return describe((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return "?"
