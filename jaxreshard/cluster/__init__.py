"""An emulated multi-host cluster on one Linux machine: network namespaces with shaped NICs,
one Ray node each (`jaxreshard cluster up|down|status`, `emulated(...)`).

Attributes load lazily (the CLI imports this package before it knows the command).
"""

from __future__ import annotations

from jaxreshard._lazy import lazy_exports

_EXPORTS = {
    "ClusterUnavailable": "jaxreshard.cluster._netns",
    "missing_requirements": "jaxreshard.cluster._netns",
    "EmulatedCluster": "jaxreshard.cluster._describe",
    "HostInfo": "jaxreshard.cluster._describe",
    "up": "jaxreshard.cluster._emulated",
    "down": "jaxreshard.cluster._emulated",
    "down_all": "jaxreshard.cluster._emulated",
    "status": "jaxreshard.cluster._emulated",
    "kill_host": "jaxreshard.cluster._emulated",
    "emulated": "jaxreshard.cluster._emulated",
    "measure_tcp": "jaxreshard.cluster._tcp",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
