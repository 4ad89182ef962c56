"""Cross-mesh resharding: the planner (pure: imports neither Ray nor CuPy) and its cost model."""

from jaxreshard.comm._cluster import Cluster as Cluster
from jaxreshard.comm._layout import Index as Index
from jaxreshard.comm._layout import Layout as Layout
from jaxreshard.comm._layout import VirtualDevice as VirtualDevice
from jaxreshard.comm._layout import VirtualMesh as VirtualMesh
from jaxreshard.comm._layout import VirtualSharding as VirtualSharding
from jaxreshard.comm._layout import describe_sharding as describe_sharding
from jaxreshard.comm._plan import Op as Op
from jaxreshard.comm._plan import Plan as Plan
from jaxreshard.comm._planner import STRATEGY_NAMES as STRATEGY_NAMES
from jaxreshard.comm._planner import plan_reshard as plan_reshard
from jaxreshard.comm._simulate import lower_bound as lower_bound
from jaxreshard.comm._simulate import simulate as simulate
from jaxreshard.comm._strategies import PlannerOptions as PlannerOptions
from jaxreshard.comm._tasks import UnitTask as UnitTask
from jaxreshard.comm._tasks import decompose as decompose
from jaxreshard.comm._validate import validate_plan as validate_plan

__all__ = [
    "Cluster",
    "Index",
    "Layout",
    "Op",
    "Plan",
    "PlannerOptions",
    "STRATEGY_NAMES",
    "UnitTask",
    "VirtualDevice",
    "VirtualMesh",
    "VirtualSharding",
    "decompose",
    "describe_sharding",
    "lower_bound",
    "plan_reshard",
    "simulate",
    "validate_plan",
]
