"""`jaxreshard.reshard`: move an array to another sharding on other devices, by plan."""

from __future__ import annotations

from typing import Any

import jax

from jaxreshard._tracebacks import api_boundary
from jaxreshard.comm import Cluster, plan_reshard
from jaxreshard.comm._local import execute_local
from jaxreshard.comm._planner import check_strategy


@api_boundary
def reshard(
    x: Any,
    dst_sharding: Any,
    *,
    strategy: str = "auto",
    cluster: Cluster | None = None,
) -> Any:
    """Return `x` laid out as `dst_sharding`, moved by a cross-mesh resharding plan.

    Works on local `jax.Array`s (the local runtime: every device of this process) and on the
    Ray runtime's `RemoteArray`s (then `dst_sharding` is a sharding over the runtime's devices).
    Plans are cached per (shape, dtype, shardings, cluster, strategy), so repeated calls pay
    planning once.

    When the source and destination devices overlap (or are the same), this is
    `jax.device_put(x, dst_sharding)`: cross-mesh plans are for disjoint device sets.

    Args:
        x: the array (fully addressable by this process).
        dst_sharding: a `jax.sharding.Sharding` whose devices are disjoint from `x`'s.
        strategy: a strategy of `jaxreshard.comm.STRATEGY_NAMES`; `auto` picks the fastest
            plan under the cluster model.
        cluster: the cost model used to plan; default: the devices grouped into hosts by
            `process_index` (one host for a single process).

    Returns:
        A new array with exactly `dst_sharding` and the values of `x`.

    Raises:
        TypeError: `x` is not an array, or `dst_sharding` not a sharding.
        ValueError: the sharding does not fit `x` (rank, divisibility), names devices this
            process does not have, or the strategy is unknown.
    """
    from jaxreshard.runtime.ray._remote import RemoteArray

    check_strategy(strategy)
    if isinstance(x, RemoteArray):
        return x.runtime.reshard(x, dst_sharding, strategy=strategy)
    if isinstance(x, jax.core.Tracer):
        raise TypeError(
            "reshard(x=...) got a traced value: reshard moves concrete arrays between devices "
            "by a plan and runs outside jax.jit; call it on the jitted function's result, or "
            "use jax.device_put / jax.sharding.reshard inside the jitted function"
        )
    if not isinstance(x, jax.Array):
        raise TypeError(
            f"reshard(x=...) takes a jax.Array (or a jaxreshard RemoteArray); got "
            f"{type(x).__name__}. Convert with jax.device_put(x, src_sharding) first."
        )
    if not isinstance(dst_sharding, jax.sharding.Sharding):
        hint = (
            " It is a sharding over remote devices: use it with arrays of the Ray runtime "
            "(jaxreshard.init(backend='ray'))."
            if hasattr(dst_sharding, "devices_indices_map")
            else ""
        )
        raise TypeError(
            f"reshard(dst_sharding=...) takes a jax.sharding.Sharding such as "
            f"NamedSharding(mesh, P(...)); got {dst_sharding!r}.{hint}"
        )
    if not x.is_fully_addressable:
        raise ValueError(
            "reshard(x=...): x spans devices of other processes; the local runtime moves arrays "
            "between devices of this process (use the Ray runtime across hosts)."
        )
    local = set(jax.local_devices(backend=_platform(dst_sharding)))
    missing = sorted(str(d) for d in dst_sharding.device_set if d not in local)
    if missing:
        raise ValueError(
            f"reshard(dst_sharding=...): devices {missing} are not devices of this process "
            f"(it has {sorted(str(d) for d in local)}); build the destination mesh from "
            "jax.local_devices()."
        )
    if set(x.sharding.device_set) & set(dst_sharding.device_set):
        return jax.device_put(x, dst_sharding)
    plan = plan_reshard(
        x.shape, x.dtype, x.sharding, dst_sharding, cluster=cluster, strategy=strategy
    )
    return execute_local(plan, x, dst_sharding)


def _platform(sharding: jax.sharding.Sharding) -> str:
    return next(iter(sharding.device_set)).platform
