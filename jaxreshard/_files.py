"""Reading a user's input file: every problem is one `InputError` naming the file and the fix.

[Note: hostile input]
A file given on the command line (a schedule CSV or JSON, a case file) may be missing, a
directory, a pipe, binary, huge, or valid JSON of the wrong shape. The readers refuse each with
one `InputError` (a `ValueError`) whose message names the file, the place in it (row and cell,
or a JSON key path like `cases[2].src_mesh.shape[0]`), the value (shortened: `show`), the rule
and the fix, before anything is allocated in proportion to a count read from the file. Nothing
else may escape a reader: no `KeyError`, `TypeError`, `RecursionError` or `UnicodeDecodeError`.
The size limits are module constants next to each reader, and the message states them.
"""

from __future__ import annotations

import json
import math
import reprlib
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

MiB = 2**20


class InputError(ValueError):
    """A user's input file (or the data read from it) is not what its reader accepts."""


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()
"""`data.get(key, MISSING)`: the `expect_*` checks then say the key is missing."""


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 2, 40, 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4


def show(value: Any) -> str:
    """`repr(value)`, shortened: a hostile value (a 10 MB string, a list nested 900 deep) must
    not turn an error message into a dump (or a `RecursionError`)."""
    return _REPR.repr(value)


def human_bytes(n: float) -> str:
    """`40 GB`, `64 MiB`-style sizes for messages (decimal units; binary for exact powers)."""
    k = int(n)
    if k == n and k >= MiB and k & (k - 1) == 0:  # a power of two: a limit
        return f"{k // MiB} MiB" if k < 2**30 else f"{k >> 30} GiB"
    for unit, size in (("EB", 1e18), ("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n / 1e3:.3g} kB" if n >= 1e3 else f"{n:.0f} bytes"


def read_text(
    path: str | Path, *, what: str, max_bytes: int, expected: str, label: str | None = None
) -> str:
    """The UTF-8 text of the regular file `path`, at most `max_bytes` bytes long.

    Args:
        path: the file.
        what: what the file is, for messages (`schedule CSV`).
        max_bytes: the size limit (read before the file is: a larger file is refused).
        expected: what the file should hold, for messages.
        label: how messages start (default: `what` and the path, e.g. `--cases x.json`).

    Raises:
        InputError: the file is missing, a directory or no regular file, unreadable, larger
            than `max_bytes`, binary (a NUL byte) or not UTF-8, or empty (only whitespace).
    """
    try:
        p = Path(path)
    except TypeError:
        raise InputError(f"{label or what}: {show(path)} is not a path") from None
    where = label or (f"{what} {str(p)!r}" if any(c in str(p) for c in "\n\r\t") else f"{what} {p}")
    try:
        info = p.stat()
    except ValueError:  # a NUL byte in the path
        raise InputError(
            f"{label or what} {show(str(path))}: not a usable path (a NUL byte)"
        ) from None
    except (FileNotFoundError, NotADirectoryError):
        raise InputError(f"{where}: no such file; check the path") from None
    except PermissionError:
        raise InputError(f"{where}: permission denied; give a file you may read") from None
    except OSError as e:
        raise InputError(f"{where}: cannot be read ({e.strerror or e}); check the path") from None
    if stat.S_ISDIR(info.st_mode):
        raise InputError(f"{where}: is a directory; give the path of a {what}")
    if not stat.S_ISREG(info.st_mode):
        raise InputError(
            f"{where}: is not a regular file (a pipe, socket or device, which could block or "
            "never end); copy it to a file first"
        )
    limit = f"at most {human_bytes(max_bytes)} ({max_bytes:,} bytes)"
    if info.st_size > max_bytes:
        raise InputError(
            f"{where}: is {human_bytes(info.st_size)} ({info.st_size:,} bytes); a {what} is "
            f"{limit}: give a smaller one"
        )
    try:
        with open(p, "rb") as f:
            data = f.read(max_bytes + 1)  # a file that grows meanwhile stops here
    except PermissionError:
        raise InputError(f"{where}: permission denied; give a file you may read") from None
    except OSError as e:
        raise InputError(f"{where}: cannot be read ({e.strerror or e})") from None
    if len(data) > max_bytes:
        raise InputError(f"{where}: is larger than {limit}; give a smaller one")
    return decode_text(data, where=where, what=what, expected=expected)


def decode_text(data: bytes, *, where: str, what: str, expected: str) -> str:
    """`data` as UTF-8 text (a leading byte-order mark dropped); see `read_text`."""
    nul = data.find(b"\0")
    if nul >= 0:
        raise InputError(
            f"{where}: is a binary file (a NUL byte at offset {nul}), not a {what}; expected "
            f"{expected}"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            f"{where}: is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
            f"save it as UTF-8 text: {expected}"
        ) from None
    text = text.removeprefix("\ufeff")
    if not text.strip():
        raise InputError(f"{where}: is empty; expected {expected}")
    return text


def read_json(
    path: str | Path, *, what: str, max_bytes: int, expected: str, label: str | None = None
) -> Any:
    """The JSON value in `path` (see `read_text` and `parse_json`)."""
    text = read_text(path, what=what, max_bytes=max_bytes, expected=expected, label=label)
    return parse_json(text, where=label or f"{what} {path}")


def parse_json(text: str, *, where: str) -> Any:
    """`json.loads(text)`, with its failures (bad syntax, nesting past Python's recursion limit,
    an integer of thousands of digits) as one `InputError`."""
    try:
        return json.loads(text)
    except RecursionError:
        raise InputError(
            f"{where}: JSON nested too deeply to read (deeper than Python's recursion limit); "
            "the format nests a few levels at most"
        ) from None
    except ValueError as e:  # json.JSONDecodeError, and int()'s digit limit
        raise InputError(f"{where}: not valid JSON ({e})") from None


# -- checking JSON values: a key path in every message --------------------------------------


def key_path(where: str, *keys: str | int) -> str:
    """`where` plus JSON keys: `x.json: cases[2].src_mesh.shape`."""
    out = ""
    for key in keys:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else key)
    return f"{where}: {out}" if out else where


def expect_dict(value: Any, where: str, what: str = "an object") -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise InputError(f"{where} is {_what(value)}; expected {what} ({{...}})")
    return value


def expect_list(value: Any, where: str, what: str = "a list", max_len: int | None = None) -> list:
    if not isinstance(value, list):
        raise InputError(f"{where} is {_what(value)}; expected {what} ([...])")
    if max_len is not None and len(value) > max_len:
        raise InputError(f"{where} has {len(value):,} entries; at most {max_len:,} are accepted")
    return value


def expect_int(value: Any, where: str, *, low: int = 0, high: int | None = None) -> int:
    """An int (not a bool, not 2.0) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{where} is {_what(value)}; expected an integer >= {low}")
    if value < low or (high is not None and value > high):
        rule = f">= {low}" if high is None else f"in {low}..{high:,}"
        raise InputError(f"{where} = {show(value)}; expected an integer {rule}")
    return value


def expect_number(
    value: Any,
    where: str,
    *,
    low: float | None = 0.0,
    strict: bool = False,
    high: float | None = None,
) -> float:
    """A finite number (not a bool) >= `low` (> `low` with `strict`; any with None), and at
    most `high` (if given)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{where} is {_what(value)}; expected a number")
    if not math.isfinite(value):
        raise InputError(f"{where} = {show(value)}; expected a finite number")
    if low is not None and (value < low or (strict and value == low)):
        rule = f"{'>' if strict else '>='} {low:g}"
        raise InputError(f"{where} = {show(value)}; expected a number {rule}")
    if high is not None and value > high:
        raise InputError(f"{where} = {show(value)}; expected a number <= {high:g}")
    return float(value)


def expect_str(value: Any, where: str, *, max_len: int = 256) -> str:
    if not isinstance(value, str):
        raise InputError(f"{where} is {_what(value)}; expected a string")
    if len(value) > max_len:
        raise InputError(f"{where} is a string of {len(value):,} characters; at most {max_len}")
    return value


def expect_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{where} is {_what(value)}; expected true or false")
    return value


def reject_unknown_keys(data: Mapping[str, Any], known: Sequence[str], where: str) -> None:
    """Refuse a key the format does not have (a typo would otherwise be ignored silently)."""
    unknown = [k for k in data if k not in known]
    if unknown:
        raise InputError(
            f"{where} has the unknown key {show(unknown[0])}; the keys are {', '.join(known)}"
        )


def _what(value: Any) -> str:
    """`a string 'x'`, `null`, `missing`: what a JSON value is, for messages."""
    if value is MISSING:
        return "missing"
    return "null" if value is None else f"{_kind(value)} {show(value)}"


def _kind(value: Any) -> str:
    names = {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)
