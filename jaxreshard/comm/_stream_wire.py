"""The stream transport's wire: message framing and the handshake's fields, the checks a
message passes before its payload is read, and exact reads (see [Note: stream transport] and
[Note: stream authentication] in `comm/_stream.py`)."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import socket
import struct
from typing import Any

import numpy as np

from jaxreshard.comm._layout import Index, format_index, index_size

_PREFIX = struct.Struct("!IQ")  # header bytes, payload bytes
# The handshake (see [Note: stream authentication]): the listener's challenge (protocol, nonce),
# the connecting host's hello (its id, its nonce, its proof), the listener's proof.
_PROTOCOL = b"jrs-tcp1"
_CHALLENGE = struct.Struct("!8s32s")
_HELLO = struct.Struct("!q32s32s")
_WELCOME = struct.Struct("!32s")
_HOSTS = struct.Struct("!qq")  # (connecting host, listening host), as the proofs cover them
_ITEMSIZES = (1, 2, 4, 8, 16)  # the dtypes' sizes a payload can be a whole number of
CONNECT_TIMEOUT_S = 30.0


def _proof(
    secret: bytes, role: bytes, nonce: bytes, theirs: bytes, connecting: int, listening: int
) -> bytes:
    """HMAC-SHA256 of a handshake's two nonces and two hosts, for `role` (b"connect": the
    connecting host's proof; b"accept": the listener's)."""
    message = _PROTOCOL + role + nonce + theirs + _HOSTS.pack(connecting, listening)
    return hmac.new(secret, message, hashlib.sha256).digest()


def _parse_header(text: bytes, peer: int) -> tuple[str, int, Index, float]:
    """(work, op, region, emulated arrival time) of a message's header from host `peer`;
    `_BadMessage` saying what is wrong with it."""
    try:
        header = json.loads(text)
    except ValueError as e:
        raise _BadMessage(f"a header that is not JSON ({e}): {text[:80]!r}") from None
    if not isinstance(header, dict) or not {"work", "op", "region", "src", "ready"} <= set(header):
        raise _BadMessage(f"a header without work, op, region, src and ready: {text[:80]!r}")
    work, op, src, ready, region = (header[k] for k in ("work", "op", "src", "ready", "region"))
    if src != peer:
        raise _BadMessage(f"a header from host {src!r}, on host {peer}'s connection")
    if not isinstance(work, str) or not _is_count(op):
        raise _BadMessage(f"work {work!r} and op {op!r}: a string and an int >= 0 expected")
    if not isinstance(ready, int | float) or isinstance(ready, bool) or not math.isfinite(ready):
        raise _BadMessage(f"arrival time {ready!r}: a finite number expected")
    if not isinstance(region, list) or not all(
        isinstance(r, list) and len(r) == 2 and _is_count(r[0]) and _is_count(r[1]) and r[0] <= r[1]
        for r in region
    ):
        raise _BadMessage(f"region {region!r}: a list of [start, stop] with 0 <= start <= stop")
    return work, op, tuple((a, b) for a, b in region), float(ready)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _unexpected(region: Index, nbytes: int, dtype: np.dtype, chunks: Any) -> str | None:
    """Why a message of `region` with `nbytes` is not one of the `chunks` of `dtype` a receive
    waits for; None if it is."""
    if region not in chunks:
        shown = ", ".join(format_index(c) for c in sorted(chunks)[:4])
        more = ", ..." if len(chunks) > 4 else ""
        return f"not a piece this receive waits for ({shown}{more}), or one it got already"
    want = index_size(region) * dtype.itemsize
    if nbytes != want:
        return (
            f"{nbytes} payload bytes, but the region holds {index_size(region)} x {dtype.name} "
            f"= {want} bytes"
        )
    return None


def _not_whole_elements(region: Index, nbytes: int) -> str | None:
    """Why `nbytes` cannot be the region's elements of any dtype; None if it can."""
    size = index_size(region)
    if any(size * k == nbytes for k in _ITEMSIZES):
        return None
    sizes = "/".join(map(str, _ITEMSIZES))
    return f"{nbytes} payload bytes for a region of {size} elements of {sizes} bytes each"


class _Refused(ConnectionError):
    """A connection failed the handshake (see [Note: stream authentication])."""


class _BadMessage(ConnectionError):
    """A message this host refuses to read; `work` is the work it named, if any."""

    def __init__(self, why: str, work: str | None = None):
        super().__init__(why)
        self.work = work


class _Truncated(ConnectionError):
    """The peer closed its connection in the middle of a message."""

    def __init__(self, what: str, expected: int, got: int):
        super().__init__(f"{what}: expected {expected} bytes, got {got}")
        self.what, self.expected, self.got = what, expected, got


def _recv_exactly(
    conn: socket.socket,
    nbytes: int,
    into: memoryview | None = None,
    *,
    what: str,
    eof: bool = True,
) -> bytes | memoryview | None:
    """Read exactly `nbytes` (into `into` if given). A peer that closes before the first byte:
    None where a message may end there (`eof`); a peer that closes after it, or where a message
    may not end: `_Truncated` naming `what` and the bytes expected and got."""
    view = into if into is not None else memoryview(bytearray(nbytes))
    got = 0
    while got < nbytes:
        n = conn.recv_into(view[got:], nbytes - got)  # OSError: the connection failed
        if n == 0:
            if got == 0 and eof:
                return None
            raise _Truncated(what, nbytes, got)
        got += n
    return view if into is not None else bytes(view)
