"""`jaxreshard bench reshard`: every strategy on every case, simulated on the cluster model."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxreshard._files import show
from jaxreshard.bench._cases import NAME, NAME_RULE, Case
from jaxreshard.comm import Layout, PlannerOptions, validate_plan
from jaxreshard.comm._planner import STRATEGY_NAMES, canonical_dtype, plan_layouts

RESULTS_FORMAT = "jaxreshard-reshard-results/1"


def plan_case(case: Case, strategy: str, options: PlannerOptions) -> tuple[Any, float]:
    """Plan one case with one strategy, uncached; return the plan and the planning time (s)."""
    dt = canonical_dtype(case.dtype)
    start = time.perf_counter()
    src = Layout.from_sharding(case.src, case.shape, what=f"{case.name} src")
    dst = Layout.from_sharding(case.dst, case.shape, what=f"{case.name} dst")
    plan = plan_layouts.__wrapped__(src, dst, dt.name, dt.itemsize, case.cluster, strategy, options)
    return plan, time.perf_counter() - start


def plan_path(folder: Path, case: str, strategy: str) -> Path:
    """`folder/<case>.<strategy>.json`, refused unless it stays inside `folder`.

    Case names come from the case file: a name such as `../../etc/x`, `/abs` or one with a NUL
    or a newline would write elsewhere, so only `NAME_RULE` names pass (`load_cases` checks
    them too), and the resolved path must lie in the resolved folder.

    Raises:
        ValueError: the name breaks the rule, or the path leaves `folder`.
    """
    for what, name in (("case name", case), ("strategy", strategy)):
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError(
                f"--dump-plans: {what} {show(name)} cannot name a file: it must be "
                f"{NAME_RULE}; rename the case in the case file"
            )
    root = Path(folder).resolve()
    path = (root / f"{case}.{strategy}.json").resolve()
    if path.parent != root:
        raise ValueError(
            f"--dump-plans {folder}: the plan of case {case!r} ({strategy}) would be written to "
            f"{path}, outside the folder; rename the case"
        )
    return path


def bench_cases(
    cases: Sequence[Case],
    *,
    cluster: dict[str, Any],
    strategies: Sequence[str] = STRATEGY_NAMES,
    options: PlannerOptions | None = None,
    dump_plans: Path | None = None,
    validate: bool = True,
    progress: Any = None,
) -> dict[str, Any]:
    """Plan and simulate every case with every strategy; return the results JSON object."""
    options = options or PlannerOptions()
    if dump_plans is not None:
        paths = {
            (case.name, s): plan_path(dump_plans, case.name, s)
            for case in cases
            for s in strategies
        }
        names = [case.name for case in cases]
        if len(set(names)) != len(names):
            again = next(name for name in names if names.count(name) > 1)
            raise ValueError(
                f"--dump-plans: two cases are named {again!r}; one plan file would overwrite "
                "the other: rename one"
            )
        dump_plans.mkdir(parents=True, exist_ok=True)
    out_cases = []
    for case in cases:
        results: dict[str, Any] = {}
        bound = None
        num_tasks = 0
        for strategy in strategies:
            if progress is not None:
                progress(f"{case.name}: {strategy}")
            plan, seconds = plan_case(case, strategy, options)
            bound, num_tasks = plan.lower_bound_s, len(plan.tasks)
            record: dict[str, Any] = {
                "seconds": plan.seconds,
                "plan_ms": seconds * 1e3,
                "num_ops": len(plan.ops),
                "cross_host_bytes": plan.cross_host_bytes(),
            }
            if plan.search_finished is not None and strategy == "broadcast_dfs":
                record["finished"] = plan.search_finished
            if strategy == "auto":
                record["chosen"] = plan.chosen
            if validate:
                problems = validate_plan(plan)
                record["valid"] = not problems
                if problems:
                    record["problems"] = problems[:5]
            results[strategy] = record
            if dump_plans is not None:
                path = paths[(case.name, strategy)]
                path.write_text(json.dumps(plan.to_json(case=case.name), indent=1))
        out_cases.append(
            {
                "name": case.name,
                "shape": list(case.shape),
                "dtype": case.dtype,
                "bytes": case.nbytes,
                "num_hosts": case.cluster.num_hosts,
                "num_unit_tasks": num_tasks,
                "lower_bound_s": bound,
                "results": results,
            }
        )
    return {"format": RESULTS_FORMAT, "cluster": cluster, "cases": out_cases}


_SHORT = {
    "send_recv": "send/recv",
    "allgather": "allgather",
    "broadcast_naive": "bc naive",
    "broadcast_size": "bc size",
    "broadcast_dfs": "bc dfs",
    "broadcast_greedy": "bc greedy",
    "broadcast_match": "bc match",
    "auto": "auto",
}


def results_table(results: dict[str, Any], title: str = "") -> Any:
    """A rich Table of simulated seconds per strategy, speedups and the ratio to the bound."""
    from rich.table import Table

    cases = results["cases"]
    strategies = [s for s in STRATEGY_NAMES if any(s in c["results"] for c in cases)]
    table = Table(title=title or "Cross-mesh resharding, simulated seconds (cluster model)")
    table.add_column("case")
    table.add_column("GiB", justify="right")
    table.add_column("bound s", justify="right")
    for s in strategies:
        table.add_column(_SHORT[s], justify="right")
    has_auto = "auto" in strategies
    if has_auto:
        table.add_column("auto picks")
        table.add_column("auto/bound", justify="right")
        if "allgather" in strategies:
            table.add_column("x allgather", justify="right")
        if "send_recv" in strategies:
            table.add_column("x send/recv", justify="right")
        table.add_column("auto plan ms", justify="right")
    for c in cases:
        r = c["results"]
        row = [c["name"], f"{c['bytes'] / 2**30:.2f}", f"{c['lower_bound_s']:.3f}"]
        row += [f"{r[s]['seconds']:.3f}" for s in strategies]
        if has_auto:
            auto = r["auto"]["seconds"]
            row.append(_SHORT.get(r["auto"]["chosen"], r["auto"]["chosen"]))
            row.append(_ratio(auto, c["lower_bound_s"], digits=3))
            if "allgather" in strategies:
                row.append(_ratio(r["allgather"]["seconds"], auto))
            if "send_recv" in strategies:
                row.append(_ratio(r["send_recv"]["seconds"], auto))
            row.append(f"{r['auto']['plan_ms']:.1f}")
        table.add_row(*row)
    return table


def _ratio(a: float, b: float, digits: int = 2) -> str:
    if b == 0:
        return f"{1:.{digits}f}" if a == 0 else "inf"
    return f"{a / b:.{digits}f}"
