"""Cross-mesh resharding: the planner (pure: imports neither Ray nor CuPy) and its data plane.

Attributes load lazily, so that modules such as `comm._order` are usable without JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxreshard.comm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
