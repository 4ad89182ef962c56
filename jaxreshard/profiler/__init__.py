"""End-to-end training profiles: `jaxreshard profile gpt|utransformer` and its library form.

    pc = load_profile_config("gpt", "examples/configs/gpt_tiny.toml", {"run": {"steps": 20}})
    result = run_profile(pc)          # the jaxreshard-profile/1 dict
    rows = compare(pc, schedule_variants(pc))

See [Note: what a profile measures]. One profile: `_profile.py`; comparisons: `_compare.py`; the
`--auto` search: `_auto.py`; settings: `_config.py`; sessions: `_run.py`; statistics and the
simulator's prediction: `_measured.py`; tables and files: `_report.py`.
"""

from jaxreshard.profiler._auto import auto_search, profile_toml
from jaxreshard.profiler._compare import (
    CALIBRATION_STEPS,
    _costs_that_fit,
    compare,
    compare_json,
    measures_placement,
    placement_costs,
    resharding_variants,
    schedule_variants,
)
from jaxreshard.profiler._config import (
    PROFILE_PIPELINE,
    ProfileConfig,
    RunConfig,
    check_fits,
    load_profile_config,
)
from jaxreshard.profiler._profile import run_profile, runtime_for, write_json
from jaxreshard.profiler._run import Session, devices_needed

__all__ = [
    "CALIBRATION_STEPS",
    "auto_search",
    "profile_toml",
    "_costs_that_fit",
    "compare_json",
    "runtime_for",
    "write_json",
    "PROFILE_PIPELINE",
    "ProfileConfig",
    "RunConfig",
    "Session",
    "check_fits",
    "compare",
    "devices_needed",
    "load_profile_config",
    "measures_placement",
    "placement_costs",
    "resharding_variants",
    "run_profile",
    "schedule_variants",
]
