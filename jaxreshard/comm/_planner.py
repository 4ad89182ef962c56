"""`plan_reshard`: the planner's entry point, the `auto` strategy and the plan cache."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxreshard.comm._cluster import Cluster
from jaxreshard.comm._layout import Layout
from jaxreshard.comm._plan import Plan
from jaxreshard.comm._simulate import lower_bound, simulate_hops
from jaxreshard.comm._strategies import PlannerOptions, build_ops
from jaxreshard.comm._tasks import decompose

STRATEGIES: dict[str, tuple[str, str]] = {
    "send_recv": ("send_recv", "size"),
    "allgather": ("allgather", "size"),
    "broadcast_naive": ("broadcast", "naive"),
    "broadcast_size": ("broadcast", "size"),
    "broadcast_dfs": ("broadcast", "dfs"),
    "broadcast_greedy": ("broadcast", "greedy"),
    "broadcast_match": ("broadcast", "match"),
}
"""Concrete strategies: name -> (primitive, sender choice/ordering). The baselines `send_recv` and
`allgather` get the greedy size-based load balancing, as in the paper's comparison."""

STRATEGY_NAMES = (*STRATEGIES, "auto")
# `auto` breaks ties (equal simulated time) by fewer ops, then by this order.
_PREFERENCE = (
    "broadcast_greedy",
    "broadcast_match",
    "broadcast_size",
    "broadcast_naive",
    "broadcast_dfs",
    "allgather",
    "send_recv",
)


def check_strategy(strategy: str, what: str = "strategy") -> str:
    if strategy not in STRATEGY_NAMES:
        raise ValueError(
            f"{what}={strategy!r} is not a resharding strategy; choose one of "
            f"{', '.join(STRATEGY_NAMES)} ('auto' picks the fastest under the cluster model)."
        )
    return strategy


def canonical_dtype(dtype: Any, what: str = "dtype") -> np.dtype:
    try:
        return jnp.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"{what}={dtype!r} is not a dtype JAX knows; pass e.g. jnp.float32 or 'bfloat16'."
        ) from None


def _check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    try:
        out = tuple(int(n) for n in shape)
    except TypeError:
        raise TypeError(f"shape={shape!r} must be a sequence of ints, e.g. (1024, 512).") from None
    if any(n < 0 for n in out) or any(int(n) != n for n in shape):
        raise ValueError(f"shape={tuple(shape)} must hold non-negative ints.")
    return out


def plan_reshard(
    shape: Sequence[int],
    dtype: Any,
    src_sharding: Any,
    dst_sharding: Any,
    *,
    cluster: Cluster | None = None,
    strategy: str = "auto",
    options: PlannerOptions | None = None,
) -> Plan:
    """Plan moving an array of `shape`/`dtype` from `src_sharding` to `dst_sharding`.

    Args:
        shape: the global shape.
        dtype: the element type (anything `jnp.dtype` accepts).
        src_sharding: where the array lives now: a `jax.sharding.Sharding` (normally a
            `NamedSharding`), or a `VirtualSharding` for devices outside this process.
        dst_sharding: where it must go; its devices must be disjoint from the source's.
        cluster: the cost model; default: the devices grouped into hosts by `process_index`.
        strategy: one of `STRATEGY_NAMES`; `auto` simulates every strategy and keeps the fastest.
        options: budgets and seed of the search-based balancers.

    Returns:
        A frozen `Plan`. Plans are cached: the same arguments return the same object.

    Raises:
        TypeError: a sharding or the dtype is not one.
        ValueError: shapes, specs, devices or the strategy name are invalid (the message names
            the argument, the value, the rule and the fix).
    """
    check_strategy(strategy)
    shape = _check_shape(shape)
    dt = canonical_dtype(dtype)
    src = Layout.from_sharding(src_sharding, shape, what="src_sharding")
    dst = Layout.from_sharding(dst_sharding, shape, what="dst_sharding")
    overlap = sorted(set(src.devices) & set(dst.devices))
    if overlap:
        raise ValueError(
            f"src_sharding and dst_sharding share devices {overlap}; cross-mesh resharding moves "
            "data between disjoint device sets. Within one set of devices use "
            "jax.device_put(x, dst_sharding) (jaxreshard.reshard does this for you)."
        )
    if cluster is None:
        cluster = Cluster.from_devices(
            [*src_sharding.devices_indices_map(shape), *dst_sharding.devices_indices_map(shape)]
        )
    elif not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a jaxreshard Cluster, got {type(cluster).__name__}.")
    cluster.check_covers(src.devices, "source")
    cluster.check_covers(dst.devices, "destination")
    return plan_layouts(
        src, dst, dt.name, dt.itemsize, cluster, strategy, options or PlannerOptions()
    )


@functools.lru_cache(maxsize=4096)
def plan_layouts(
    src: Layout,
    dst: Layout,
    dtype: str,
    itemsize: int,
    cluster: Cluster,
    strategy: str,
    options: PlannerOptions,
) -> Plan:
    """`plan_reshard` on already-checked layouts (cached by value)."""
    tasks = decompose(src, dst, itemsize)
    bound = lower_bound(tasks, cluster)
    if strategy != "auto":
        primitive, balancer = STRATEGIES[strategy]
        ops, finished, _ = build_ops(tasks, cluster, primitive, balancer, options)
        timeline, hops, seconds = simulate_hops(ops, cluster)
        return Plan(
            src.shape,
            dtype,
            itemsize,
            src,
            dst,
            cluster,
            strategy,
            strategy,
            tasks,
            ops,
            timeline,
            seconds,
            bound,
            finished,
            hops,
        )

    candidates = []
    greedy = None
    for name in (
        "send_recv",
        "allgather",
        "broadcast_naive",
        "broadcast_size",
        "broadcast_match",
        "broadcast_greedy",
        "broadcast_dfs",
    ):
        primitive, balancer = STRATEGIES[name]
        ops, finished, assignment = build_ops(
            tasks, cluster, primitive, balancer, options, greedy_assignment=greedy
        )
        if balancer == "greedy":
            greedy = assignment
        timeline, hops, seconds = simulate_hops(ops, cluster)
        candidates.append((name, ops, timeline, seconds, finished, hops))
    fastest = min(c[3] for c in candidates)
    tied = [c for c in candidates if math.isclose(c[3], fastest, rel_tol=1e-9, abs_tol=1e-15)]
    name, ops, timeline, seconds, finished, hops = min(
        tied, key=lambda c: (len(c[1]), _PREFERENCE.index(c[0]))
    )
    return Plan(
        src.shape,
        dtype,
        itemsize,
        src,
        dst,
        cluster,
        "auto",
        name,
        tasks,
        ops,
        timeline,
        seconds,
        bound,
        finished,
        hops,
    )
