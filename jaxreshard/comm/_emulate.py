"""Emulated host NICs: make one machine behave, in time, like a cluster with slow links.

[Note: network emulation]
On one machine, "hosts" share memory and CPU, so a transfer between them costs what a copy costs,
not what a 10 Gbit/s NIC would. With emulation on, every cross-host transfer books the sending
host's NIC-out and the receiving host's NIC-in of the cluster model (one NIC per host, full
duplex, the same bandwidth everywhere): it starts when both are free and lasts latency + bytes /
bandwidth, and the receiver does not use the data before that end. Waiting is a sleep, so no
CPU is burned and the real work (copies, object transfers) proceeds meanwhile. The bookkeeping is
one small object, shared by all hosts (a Ray actor for the Ray runtime), so contention for a
NIC between many senders is modelled.
"""

from __future__ import annotations

import threading
import time


class LinkEmulator:
    """Books host NICs; `reserve` says when a transfer would start and end on the cluster."""

    def __init__(self, gbytes_per_s: float, latency_s: float = 0.0):
        if not gbytes_per_s > 0:
            raise ValueError(f"emulated network bandwidth {gbytes_per_s!r} GB/s must be > 0")
        self.bytes_per_s = gbytes_per_s * 1e9
        self.latency_s = latency_s
        self._out_free: dict[int, float] = {}
        self._in_free: dict[int, float] = {}
        self._lock = threading.Lock()
        self.booked_bytes = 0

    def reserve(
        self, src_host: int, dst_host: int, nbytes: int, not_before: float | None = None
    ) -> tuple[float, float]:
        """Book `nbytes` from `src_host` to `dst_host`: (start, end) on the monotonic clock."""
        now = time.monotonic()
        with self._lock:
            start = max(
                now if not_before is None else not_before,
                self._out_free.get(src_host, 0.0),
                self._in_free.get(dst_host, 0.0),
            )
            end = start + self.latency_s + nbytes / self.bytes_per_s
            self._out_free[src_host] = end
            self._in_free[dst_host] = end
            self.booked_bytes += nbytes
        return start, end

    def stats(self) -> dict[str, float]:
        return {"booked_bytes": float(self.booked_bytes), "gbytes_per_s": self.bytes_per_s / 1e9}


def sleep_until(when: float) -> None:
    """Sleep (not spin) until `when` on the monotonic clock."""
    left = when - time.monotonic()
    if left > 0:
        time.sleep(left)
