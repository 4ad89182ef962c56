"""What every command shares: the console, writing outputs, argument types, and the one error
path of the command line.

[Note: one error path]
Every failure a user can cause ends as one line on stderr, `jaxreshard COMMAND: error: ...`,
and a non-zero exit code; never a Python traceback. The library raises `ValueError` (or a
subclass) whose text names the file, key, row or argument, the value, the rule and the fix;
`describe` turns the rest into such a line too: the operating system's errors name the path and
what to do, a nesting or memory limit says which, and anything else is reported as a bug of ours
(with `JAXRESHARD_TRACEBACK=1` to print where). Exit codes: 2 for input the command refuses, 1 for
a run that failed, 3 for an emulated cluster that cannot be made here, 130 for Ctrl-C.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import re
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

TRACEBACK_ENV = "JAXRESHARD_TRACEBACK"
_MESSAGE_CHARS = 2000  # one line, not a dump of a hostile input


def make_console():
    """A rich console; off a terminal (logs, CI, pipes) wide enough for our tables."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=200)


class CommandError(ValueError):
    """A refusal of the command line itself (flags that do not go together); exit code 2."""


def describe(e: BaseException) -> tuple[str, int]:
    """One line for a failure, and the exit code (see [Note: one error path])."""
    if isinstance(e, OSError) and not isinstance(e, (TimeoutError, ConnectionError)):
        return _os_error(e), 2
    if isinstance(e, RecursionError):
        return (
            f"the input is nested too deeply to read ({e}); flatten it (a config, schedule or "
            "case file nests a few levels at most)",
            2,
        )
    if isinstance(e, MemoryError):
        return (
            "ran out of memory; the input asks for more than this machine has (use smaller "
            "counts or sizes)",
            2,
        )
    if isinstance(e, (ValueError, TypeError)):  # the library's refusals (and tomllib's, json's)
        return _one_line(str(e) or type(e).__name__), 2
    if isinstance(e, (RuntimeError, TimeoutError, ConnectionError)):  # a run that failed
        return _one_line(str(e) or type(e).__name__), 1
    where = _in_user_model(e)
    if where is not None:  # (a KeyError in the user's synthetic_batch is no bug of ours)
        return (
            f"the model's code raised {type(e).__name__}: {_one_line(str(e))} at {where}; fix "
            f"the model (set {TRACEBACK_ENV}=1 to print the whole traceback)",
            1,
        )
    return (
        f"internal error ({type(e).__name__}: {_one_line(str(e))}); this is a bug in jaxreshard: "
        f"please report it with the command line (set {TRACEBACK_ENV}=1 to print where)",
        1,
    )


def _in_user_model(e: BaseException) -> str | None:
    """`file:line` of the innermost frame of `e`'s traceback in the folder of a model file that
    `jaxreshard profile` loaded (see [Note: user models]), or None."""
    from jaxreshard.models._user import FOLDERS

    if not FOLDERS:
        return None
    ours = Path(__file__).resolve().parent.parent  # (the package: a model beside it is not it)
    where = None
    tb = e.__traceback__
    while tb is not None:
        file = Path(tb.tb_frame.f_code.co_filename)
        if any(file.is_relative_to(f) for f in FOLDERS) and not file.is_relative_to(ours):
            where = f"{file}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


def _os_error(e: OSError) -> str:
    if e.errno is None:  # raised by our code, with its own message
        return _one_line(str(e))
    path = e.filename if e.filename is not None else ""
    fixes = {
        errno.ENOENT: "no such file or directory; check the path",
        errno.EISDIR: "is a directory; give a file",
        errno.ENOTDIR: "a part of the path is not a directory; check the path",
        errno.EACCES: "permission denied; give a path you may read (or write, for an output)",
        errno.EPERM: "operation not permitted; give a path you own",
        errno.ENOSPC: "no space left on the device; free some or write elsewhere",
        errno.EROFS: "read-only file system; write elsewhere",
        errno.ELOOP: "too many symbolic links (or a link where none is followed); give the "
        "real path",
        errno.ENAMETOOLONG: "file name too long; use a shorter one",
        errno.EEXIST: "already exists; remove it or give another path",
    }
    why = fixes.get(e.errno, e.strerror or str(e))
    return _one_line(f"{path}: {why}" if path else f"{why} ({e})")


def _one_line(text: str) -> str:
    text = " | ".join(line.strip() for line in text.strip().splitlines() if line.strip())
    if len(text) > _MESSAGE_CHARS:
        text = text[:_MESSAGE_CHARS] + f"... ({len(text) - _MESSAGE_CHARS} more characters)"
    return text


def print_error(command: str, e: BaseException) -> int:
    """Print the one line for `e` (and its traceback when asked for); return the exit code."""
    message, code = describe(e)
    print(f"jaxreshard {command}: error: {message}", file=sys.stderr)
    if os.environ.get(TRACEBACK_ENV):
        import traceback

        traceback.print_exception(e)
    return code


# -- outputs ------------------------------------------------------------------------------------


def write_json(path: str | Path, data: object) -> None:
    """Write `data` as JSON to the path the user gave, whole or not at all (a temporary file in
    the same folder, then renamed over it)."""
    try:
        text = json.dumps(data, indent=1, allow_nan=False)
    except ValueError as e:  # strict JSON: what we write, others must read
        raise RuntimeError(
            f"{path}: the output holds a non-finite number ({e}); this is a jaxreshard bug, "
            "please report it with the command line"
        ) from None
    write_text(path, text)


def write_text(path: str | Path, text: str) -> None:
    """Write `text` to the path the user gave. A regular file (or a new one) is written whole
    or not at all: a temporary file beside it, then renamed over it, keeping an existing file's
    permissions (and refused where the user may not write it, as a plain write would be). A
    device, pipe or socket (`/dev/null`, `/dev/stdout`) is written as it is: renaming over it
    would replace it. A symbolic link is followed."""
    given = path
    path = normalized(path)
    try:
        if path.exists() and not path.is_file():  # (is_file follows links)
            if path.is_dir():
                raise CommandError(f"{given}: is a directory; give a file name to write")
            with open(path, "w") as f:  # a device, pipe or socket: write through
                f.write(text)
            return
        target = Path(os.path.realpath(path))  # a link's target is what gets written
        mode = None
        if target.exists():
            if not os.access(target, os.W_OK):
                raise PermissionError(errno.EACCES, "Permission denied", str(given))
            mode = stat.S_IMODE(target.stat().st_mode)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, part = tempfile.mkstemp(prefix=".jaxreshard-", suffix=".part", dir=target.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(part, mode if mode is not None else 0o666 & ~_umask())
            os.replace(part, target)
        finally:
            if os.path.exists(part):
                os.unlink(part)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(given)) from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def normalized(path: str | Path) -> Path:
    """`path` made absolute with `..` and `.` resolved lexically, so that writing
    `sub/../out.json` makes no folder `sub`."""
    return Path(os.path.abspath(os.fspath(path)))


PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def check_writable(flag: str, value: Any, path: Path) -> None:
    """Refuse, before any work, an output path this process could not write: an existing file
    it may not write, or a new one whose first existing folder is a file or not writable."""
    if path.exists():
        if not os.access(path, os.W_OK):
            raise CommandError(
                f"{flag} {value}: permission denied (the file is not writable); give another "
                "path or change its permissions"
            )
        return
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise CommandError(
            f"{flag} {value}: {parent} is a file, not a folder; give a path inside a folder"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CommandError(
            f"{flag} {value}: the folder {parent} is not writable; give a path inside a folder "
            "you may write"
        )


def check_outputs(args: argparse.Namespace, files: dict[str, tuple[str, ...] | None],
                  folders: tuple[str, ...] = ()) -> None:  # fmt: skip
    """Check every output path a command was given before it does any work, so that a bad one
    neither wastes a run nor leaves the other outputs half written: `files` maps each
    argument's dest to the suffixes it may have (None: any), `folders` names the dests that are
    folders. Two outputs may not be one file."""
    seen: dict[Path, str] = {}
    for dest in (*files, *folders):
        value = getattr(args, dest, None)
        if value is None:
            continue
        flag = "--" + dest.replace("_", "-")
        if not str(value).strip() or "\0" in str(value) or str(value) == "-":
            raise CommandError(f"{flag} {value!r}: not a path; give a file name")
        path = normalized(value)
        if path in seen:
            raise CommandError(
                f"{flag} {value}: the same path as {seen[path]}; give each output its own file"
            )
        seen[path] = flag
        if dest in folders:
            if path.exists() and not path.is_dir():
                raise CommandError(f"{flag} {value}: is a file, not a folder; give a folder")
        else:
            if path.is_dir():
                raise CommandError(f"{flag} {value}: is a directory; give a file name to write")
            suffixes = files[dest]
            if suffixes and path.suffix.lower() not in suffixes:
                raise CommandError(
                    f"{flag} {value}: the file name must end in {' or '.join(suffixes)} (the "
                    "format follows it)"
                )
        check_writable(flag, value, path)


# -- argument types -----------------------------------------------------------------------------


def floats(text: str) -> float | list[float]:
    """`1.5` or a per-stage / per-boundary list `1,1.2,0.9`: times >= 0 (at most 1e12)."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number or a comma-separated list of numbers (e.g. 1.5 or 1,2,1)"
        ) from None
    if not all(0 <= v <= 1e12 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every number must be from 0 to 1e12")
    return values[0] if len(values) == 1 else values


def count(low: int, high: int):
    """An argparse type: an int in [low, high] (bounded, so a typo cannot ask for 10**12)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value}: must be at least {low}")
        if value > high:
            raise argparse.ArgumentTypeError(f"{value}: must be at most {high:,}")
        return value

    parse.__name__ = "integer"
    return parse


def _finite_float(rule: str, ok: Any):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and ok(value)):
            raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number {rule}")
        return value

    parse.__name__ = "number"
    return parse


positive_float = _finite_float("> 0", lambda v: v > 0)  # an argparse type
nonnegative_float = _finite_float(">= 0", lambda v: v >= 0)  # an argparse type


# -- help from docstrings -----------------------------------------------------------------------

_ATTRIBUTE = re.compile(r"^(\s+)([a-z_][a-z0-9_, ]*):\s*(.*)$")


def field_docs(cls: type) -> dict[str, str]:
    """The `Attributes:` section of a dataclass's docstring, field -> one line of text (a line
    like `a, b: ...` documents both)."""
    lines = (cls.__doc__ or "").splitlines()
    docs: dict[str, str] = {}
    inside, indent, names = False, None, []
    for line in lines:
        if line.strip() == "Attributes:":
            inside = True
            continue
        if not inside:
            continue
        if not line.strip():
            continue
        m = _ATTRIBUTE.match(line)
        if m and (indent is None or len(m.group(1)) == indent):
            indent = len(m.group(1))
            names = [n.strip() for n in m.group(2).split(",") if n.strip()]
            for n in names:
                docs[n] = m.group(3).strip()
        elif indent is not None and len(line) - len(line.lstrip()) > indent:
            for n in names:
                docs[n] += " " + line.strip()
        else:
            break
    return docs


MAX_CPU_DEVICES = 512  # fake CPU devices: each is a client with its own threads


def cpu_devices(n: int, what: str = "the pipeline", *, required: bool = False) -> None:
    """Give JAX's CPU backend `n` devices (before it starts) when it is the platform; with
    `required` (the devices run here), refuse if JAX already started with fewer."""
    import contextlib

    import jax

    on_cpu = jax.config.jax_platforms in (None, "", "cpu")
    if on_cpu and n > MAX_CPU_DEVICES:
        raise CommandError(
            f"{what} needs {n:,} devices; on the CPU JAX gets at most {MAX_CPU_DEVICES} fake "
            "devices here; use smaller stage meshes (stage_mesh_shape) or fewer stages"
        )
    if on_cpu and n > jax.config.jax_num_cpu_devices:
        # JAX already started (a library caller): keep what it has.
        with contextlib.suppress(RuntimeError):
            jax.config.update("jax_num_cpu_devices", n)
        have = len(jax.devices("cpu"))
        if required and have < n:
            raise CommandError(
                f"{what} needs {n} CPU devices, but JAX had started in this process with "
                f"{have} before the command could give it more: an import ran JAX first (a "
                "model file that makes a JAX array, or calls jax.devices(), when imported); "
                "make such values inside the model's functions, or run with "
                f"JAX_NUM_CPU_DEVICES={n}"
            )
