"""Checking `jaxreshard.init(address=..., ...)`'s options before anything starts."""

from __future__ import annotations

import math
import re
from typing import Any

from jaxreshard.runtime.ray._runtime import RayRuntime


def check_init_options(address: Any, options: dict[str, Any]) -> None:
    """`init(backend='ray', ...)`'s arguments, checked before Ray starts: known option names,
    an address of a form Ray takes, and the numbers `RayRuntime` would otherwise check only
    after its host actors started."""
    import inspect

    known = [
        p for p in inspect.signature(RayRuntime.__init__).parameters if p not in ("self", "address")
    ]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(
            f"init(backend='ray') got unknown options {unknown}; valid: address, {', '.join(known)}"
        )
    if address is not None and (not isinstance(address, str) or not _ADDRESS.fullmatch(address)):
        raise ValueError(
            f"init(address={address!r}): give 'auto' (the cluster this machine's Ray is in), "
            "'HOST:PORT' of the head node (e.g. '10.0.0.1:6379', or what `jaxreshard "
            "cluster up` prints), or 'ray://HOST:PORT'"
        )
    fraction = options.get("gpu_memory_fraction", 0.6)
    if not _number(fraction) or not 0 < fraction <= 1:
        raise ValueError(f"init(gpu_memory_fraction={fraction!r}): a fraction in (0, 1]")
    gbps = options.get("emulate_network_gbps")
    if gbps is not None and not (_number(gbps) and 1e-6 <= gbps <= 1e6):
        raise ValueError(
            f"init(emulate_network_gbps={gbps!r}): a number of GB/s from 1e-06 to 1e+06, or None"
        )
    store = options.get("object_store_memory")
    if store is not None and not (isinstance(store, int) and 64 * 2**20 <= store <= 2**50):
        raise ValueError(
            f"init(object_store_memory={store!r}): bytes of each node's object store, an int of "
            "at least 64 MiB (67108864), or None for 512 MiB"
        )
    start = options.get("start_timeout_s", 180.0)
    if not _number(start) or not 0 < start < math.inf:
        raise ValueError(f"init(start_timeout_s={start!r}): a finite number of seconds > 0")
    links = options.get("cluster_links")
    if links is not None:
        if not isinstance(links, dict):
            raise TypeError(
                f"init(cluster_links={links!r}): a dict of the cost model's link figures, e.g. "
                "{'inter_host_gbytes_per_s': 1.25, 'latency_s': 2e-05}"
            )
        for key, value in links.items():
            if not _number(value) or not 0 <= value < math.inf:
                raise ValueError(
                    f"init(cluster_links={{{key!r}: {value!r}}}): a finite number >= 0"
                )


_ADDRESS = re.compile(r"auto|(ray://)?[A-Za-z0-9_.:\[\]-]{1,253}:[0-9]{1,5}")


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
