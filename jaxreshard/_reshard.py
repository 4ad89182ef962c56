"""`jaxreshard.reshard`: move an array to another sharding on other devices, by plan."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

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

    `x` may be one array or a pytree of them (a training state): then `dst_sharding` is one
    sharding for every leaf, or a pytree of the same structure whose leaves are shardings,
    `jax.ShapeDtypeStruct`s with shardings, or `RemoteStruct`s, such as another pipeline's
    `train_step.placement(...)`: the state moves from one layout to another without a disk.
    Host data (numpy) leaves are put onto their target sharding.

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
    if isinstance(x, (jax.Array, RemoteArray, jax.core.Tracer)) or jax.tree_util.treedef_is_leaf(
        jax.tree.structure(x, is_leaf=lambda v: isinstance(v, RemoteArray))
    ):
        return _reshard_one(x, _sharding_of(dst_sharding), strategy, cluster)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(
        x, is_leaf=lambda v: isinstance(v, RemoteArray)
    )
    if _is_target(dst_sharding):
        targets = [dst_sharding] * len(leaves)
    else:
        flat_dst, dst_def = jax.tree.flatten(dst_sharding, is_leaf=_is_target)
        if dst_def != treedef:
            raise ValueError(
                f"reshard(dst_sharding=...): its tree {dst_def} does not match x's {treedef}; "
                "give one sharding for every leaf, or a tree of x's structure (e.g. "
                "train_step.placement(...) of the same arguments)"
            )
        targets = flat_dst
    out = []
    for (path, leaf), target in zip(leaves, targets):
        sharding = _sharding_of(target)
        if not isinstance(leaf, (jax.Array, RemoteArray)):
            if not hasattr(leaf, "shape"):
                raise TypeError(
                    f"reshard(x=...): leaf {jax.tree_util.keystr(path)} is a "
                    f"{type(leaf).__name__}, not an array"
                )
            if isinstance(sharding, jax.sharding.Sharding):
                out.append(jax.device_put(leaf, sharding))
                continue
            from jaxreshard.runtime import current_runtime

            out.append(current_runtime().put(np.asarray(leaf), sharding))
            continue
        out.append(_reshard_one(leaf, sharding, strategy, cluster))
    return jax.tree.unflatten(treedef, out)


def _is_target(t: Any) -> bool:
    """A leaf of `reshard`'s destination tree."""
    from jaxreshard.runtime.ray._remote import RemoteStruct

    return isinstance(t, (jax.sharding.Sharding, jax.ShapeDtypeStruct, RemoteStruct)) or hasattr(
        t, "devices_indices_map"
    )


def _sharding_of(target: Any) -> Any:
    """The sharding a destination leaf names (a ShapeDtypeStruct's, a RemoteStruct's)."""
    from jaxreshard.runtime.ray._remote import RemoteStruct

    if isinstance(target, (jax.ShapeDtypeStruct, RemoteStruct)):
        if target.sharding is None:
            raise ValueError(
                f"reshard(dst_sharding=...): {target} has no sharding; give one (a placement "
                "leaf the pipeline does not keep, such as the batch, has none)"
            )
        return target.sharding
    return target


def _reshard_one(x: Any, dst_sharding: Any, strategy: str, cluster: Cluster | None) -> Any:
    from jaxreshard.runtime.ray._remote import RemoteArray

    if isinstance(x, RemoteArray):
        if x.sharding == dst_sharding:
            return x
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
