"""Cross-mesh resharding: the planner (pure: imports neither Ray nor CuPy) and its data plane.

Attributes load lazily, so that modules such as `comm._order` are usable without JAX.
"""

from __future__ import annotations

from jaxreshard._lazy import lazy_exports

_EXPORTS = {
    "Cluster": "jaxreshard.comm._cluster",
    "Index": "jaxreshard.comm._layout",
    "Layout": "jaxreshard.comm._layout",
    "VirtualDevice": "jaxreshard.comm._layout",
    "VirtualMesh": "jaxreshard.comm._layout",
    "VirtualSharding": "jaxreshard.comm._layout",
    "describe_sharding": "jaxreshard.comm._layout",
    "Op": "jaxreshard.comm._plan",
    "Plan": "jaxreshard.comm._plan",
    "STRATEGY_NAMES": "jaxreshard.comm._planner",
    "plan_reshard": "jaxreshard.comm._planner",
    "lower_bound": "jaxreshard.comm._simulate",
    "simulate": "jaxreshard.comm._simulate",
    "PlannerOptions": "jaxreshard.comm._strategies",
    "UnitTask": "jaxreshard.comm._tasks",
    "decompose": "jaxreshard.comm._tasks",
    "validate_plan": "jaxreshard.comm._validate",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
