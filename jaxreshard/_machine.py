"""What this machine has now, for the size guards that refuse an input before it is allocated."""

from __future__ import annotations

import os


def available_memory_bytes() -> int | None:
    """Memory this machine has available now (Linux's MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def format_bytes(n: float) -> str:
    """`n` bytes in binary units, e.g. `1.5 GiB`."""
    for unit, size in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"
