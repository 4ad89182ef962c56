"""Pipeline schedules as data (pure Python: needs neither JAX, Ray nor CuPy).

A schedule is one ordered list of actions (`2F0`: stage 2, forward, micro-batch 0) per rank;
with virtual stages a rank runs several chunks (model stages) and `schedule.rank_of(chunk)`
says where each runs. Transfers are derived from the actions. Schedules are built by name (or
read from torch's compute-only CSV), checked, and simulated under a cost model before anything
runs.
"""

from jaxreshard.pipeline._action import Action as Action
from jaxreshard.pipeline._check import check_schedule as check_schedule
from jaxreshard.pipeline._costs import Costs as Costs
from jaxreshard.pipeline._formats import read_csv as read_csv
from jaxreshard.pipeline._formats import read_json as read_json
from jaxreshard.pipeline._formats import schedule_from_csv as schedule_from_csv
from jaxreshard.pipeline._formats import schedule_from_json as schedule_from_json
from jaxreshard.pipeline._formats import schedule_to_csv as schedule_to_csv
from jaxreshard.pipeline._formats import write_csv as write_csv
from jaxreshard.pipeline._schedule import Schedule as Schedule
from jaxreshard.pipeline._schedule import Transfer as Transfer
from jaxreshard.pipeline._schedules import SCHEDULE_NAMES as SCHEDULE_NAMES
from jaxreshard.pipeline._schedules import build_schedule as build_schedule
from jaxreshard.pipeline._simulate import ScheduleError as ScheduleError
from jaxreshard.pipeline._simulate import Timeline as Timeline
from jaxreshard.pipeline._simulate import simulate as simulate

__all__ = [
    "SCHEDULE_NAMES",
    "Action",
    "Costs",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "Transfer",
    "build_schedule",
    "check_schedule",
    "read_csv",
    "read_json",
    "schedule_from_csv",
    "schedule_from_json",
    "schedule_to_csv",
    "simulate",
    "write_csv",
]
