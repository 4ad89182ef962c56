"""Comparisons: the same model under each variant of the pipeline config, stepped in turn.

`--compare-schedules` and `--compare-resharding` of `jaxreshard profile`; the schedules' variants
that place delayed weight gradients are built with measured costs (`placement_costs`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxreshard._tracebacks import error_line
from jaxreshard.pipeline import Costs
from jaxreshard.profiler._config import ProfileConfig
from jaxreshard.profiler._measured import measured_costs
from jaxreshard.profiler._profile import _bar, _emulating, _status, runtime_for
from jaxreshard.profiler._report import (
    COMPARE_FORMAT,
    COST_FIELDS,
    comparison_rows,
    comparison_table,
    header_lines,
    places_weights,
)
from jaxreshard.profiler._run import Session, droppable, run_steps
from jaxreshard.runtime._config import PipelineConfig


def schedule_variants(pc: ProfileConfig) -> list[tuple[str, dict[str, Any]]]:
    """1F1B, eager-1F1B, eager-1F1B + weight delay and ZB-H1 (the paper's ablation).

    When `pc` runs a virtual-stage schedule (v model stages per mesh), the same meshes run
    1F1B, eager-1F1B + weight delay and ZB-H1 with the model cut into one stage per mesh, then
    interleaved 1F1B, eager interleaved 1F1B + weight delay and (v = 2) ZB-V and DualPipeV
    with it cut into v per mesh: the same hardware and model, only the schedule differs."""
    one_chunk = [
        ("1f1b", {"schedule": "1f1b", "weight_delay": False}),
        ("eager_1f1b", {"schedule": "eager_1f1b", "weight_delay": False}),
        ("eager_1f1b + weight delay", {"schedule": "eager_1f1b", "weight_delay": True}),
        ("zb_h1", {"schedule": "zb_h1", "weight_delay": False}),
    ]
    v = pc.pipeline.chunks_per_mesh
    if v == 1:
        return one_chunk
    per_mesh = {"num_stages": pc.pipeline.num_meshes(pc.num_stages), "virtual_stages": None}
    chunks = {"num_stages": pc.num_stages, "virtual_stages": v}
    variants = [(label, {**c, **per_mesh}) for label, c in one_chunk if label != "eager_1f1b"]
    variants += [
        (f"interleaved_1f1b (v={v})", {"schedule": "interleaved_1f1b", "weight_delay": False}),
        (
            f"eager_interleaved_1f1b + weight delay (v={v})",
            {"schedule": "eager_interleaved_1f1b", "weight_delay": True},
        ),
    ]
    if v == 2:
        variants += [
            ("zbv (v=2)", {"schedule": "zbv", "weight_delay": False}),
            ("dualpipev (v=2)", {"schedule": "dualpipev", "weight_delay": False}),
        ]
    return variants[:3] + [(label, {**c, **chunks}) for label, c in variants[3:]]


def resharding_variants(pc: ProfileConfig) -> list[tuple[str, dict[str, Any]]]:
    """Every resharding strategy: point-to-point and Alpa's all-gather (the baselines), the
    broadcast variants (without load balancing, and each load balancer), and `auto` (ours:
    the fastest plan per boundary tensor under the cluster model)."""
    del pc
    from jaxreshard.comm import STRATEGY_NAMES

    return [(name, {"resharding": name}) for name in STRATEGY_NAMES]


CALIBRATION_STEPS = 4


def compare(
    pc: ProfileConfig,
    variants: Sequence[tuple[str, dict[str, Any]]],
    *,
    bound: bool = True,
    console: Any = None,
    progress: bool = True,
    title: str = "",
    measure_placement: bool = False,
    failed: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Run the same model under each variant of the pipeline config, stepping them in turn
    (so machine noise hits all alike), and return one row per variant (the first is the
    baseline of the speedups). Each times `RunConfig.num_plain_steps` plain steps beside its
    timed ones, as a single profile does (what training runs at: a timed step blocks on every
    action). With `bound`, also time signal-only steps of each (local).
    With `measure_placement`, the variants that place delayed weight gradients are built with
    measured costs (see `placement_costs`).
    With a `failed` list, a variant that fails (to compile, or in a step: out of memory in a
    program only it runs, say) is dropped from the comparison and recorded there (`label`,
    `error`), and the others go on (the rows' speedups are then over the first that ran: each
    row's `speedup_over`); without it, the comparison fails with it. The signal-only steps of
    `bound` are a diagnostic, and a failure there fails the comparison."""
    if not variants:
        raise ValueError("compare: variants is empty; give at least one (label, changes) pair")
    pc = _emulating(pc)
    configs = [(label, pc.replace_pipeline(**changes)) for label, changes in variants]
    with runtime_for(pc) as runtime:
        if console is not None:
            for line in header_lines(pc):
                console.print(line, highlight=False)
        configs = pin_cuts(configs, runtime=runtime, console=console)
        if measure_placement:
            configs = placement_costs(configs, runtime=runtime, console=console)
        configs = [(label, _costs_that_fit(vpc)) for label, vpc in configs]

        def drop(label: str, error: Exception) -> None:
            if failed is None or not droppable(error):
                raise error
            failed.append({"label": label, "error": error_line(error, 300)})
            if console is not None:
                console.print(f"dropped {label}: {failed[-1]['error']}", highlight=False)

        sessions = []
        for label, vpc in configs:
            try:
                with _status(console, f"compiling {label}"):
                    session = Session(vpc, label, runtime=runtime)
                    session.warm_up()
            except Exception as e:
                drop(label, e)
                continue
            sessions.append(session)
        plain = pc.run.num_plain_steps
        total = (pc.run.steps * (2 if bound else 1) + plain) * len(sessions)
        with _bar(console, progress, total) as advance:
            sessions = run_steps(sessions, pc.run.steps, plain_steps=plain, on_step=advance,
                                 on_failure=lambda s, e: drop(s.label, e))  # fmt: skip
            if bound and sessions:  # (a diagnostic: a variant that fails here fails the run)
                run_steps(sessions, pc.run.steps, signal_only=True, on_step=advance)
        if not sessions:
            raise RuntimeError(
                "every variant of the comparison failed: "
                + "; ".join(f"{f['label']}: {f['error']}" for f in failed or [])
            )
        rows = comparison_rows(sessions)
    if console is not None:
        console.print(comparison_table(rows, title or "comparison"))
    return rows


def measures_placement(pc: ProfileConfig) -> bool:
    """Whether `--compare-schedules` places weight gradients with measured costs
    (`RunConfig.placement_costs`; `auto`: unless a `cost_*` field is set)."""
    mode = pc.run.placement_costs
    if mode != "auto":
        return mode == "measured"
    defaults = PipelineConfig()
    return all(getattr(pc.pipeline, f) == getattr(defaults, f) for f in COST_FIELDS)


def placement_costs(
    configs: Sequence[tuple[str, ProfileConfig]], *, runtime: Any = None, console: Any = None
) -> list[tuple[str, ProfileConfig]]:
    """`configs` with the variants that place delayed weight gradients built with measured
    costs: for each model cut (stages x virtual stages), the first such variant runs as
    configured (warm-up and `CALIBRATION_STEPS` recorded steps), and every variant of that
    cut gets its measured per-stage F, B (with W), W and per-boundary transfer times (seconds)
    as its `cost_*` fields. The zero-bubble schedules are built from profiled times too (Qi et
    al.); the config's defaults (F=1, B=2, W=1, C=1) misplace `W`s when the stages differ, e.g.
    a first stage whose `B` computes nothing and whose `W` is its whole backward."""
    measured: dict[tuple[int, int], Costs] = {}
    out = []
    for label, vpc in configs:
        if not places_weights(vpc.pipeline) or vpc.num_stages < 2:
            out.append((label, vpc))
            continue
        cut = (vpc.num_stages, vpc.pipeline.chunks_per_mesh)
        if cut not in measured:
            with _status(console, f"measuring costs to place weight gradients ({label})"):
                # At least one untimed step: the first compiles, and must not be measured.
                warm = dataclasses.replace(vpc.run, warmup_steps=max(1, vpc.run.warmup_steps))
                session = Session(
                    dataclasses.replace(vpc, run=warm), f"calibration ({label})", runtime=runtime
                )
                session.warm_up()
                for _ in range(CALIBRATION_STEPS):
                    session.step()
                measured[cut] = costs = measured_costs(session.steps, session.layout)
                del session
            if min(costs.forward) <= 0 or min(costs.backward) <= 0:
                raise RuntimeError(
                    f"the calibration run of {label!r} measured no forward or backward time on "
                    f"some stage ({_format_costs(costs)}); place with the config's costs "
                    "instead (--placement-costs config)"
                )
            if console is not None:
                console.print(
                    f"placing weight gradients with measured costs (ms per micro-batch; "
                    f"{_cut_text(cut)}): {_format_costs(costs)}",
                    highlight=False,
                )
        costs = measured[cut]
        out.append(
            (
                label,
                vpc.replace_pipeline(**cost_fields(costs)),
            )
        )
    return out


def cost_fields(costs: Costs) -> dict[str, tuple[float, ...]]:
    """The `PipelineConfig` cost fields (seconds per chunk and boundary) of `costs`."""
    return {"cost_forward": costs.forward, "cost_backward": costs.backward,
            "cost_weight_grad": costs.weight_grad, "cost_comm": costs.comm}  # fmt: skip


def placing_costs(costs: Costs) -> Costs:
    """What a runtime given `cost_fields(costs)` places delayed weight gradients with: the
    same schedule a prediction must simulate."""
    return Costs(forward=costs.forward, backward=costs.backward,
                 weight_grad=costs.weight_grad, comm=costs.comm, apply=costs.apply)  # fmt: skip


def pin_cuts(
    configs: Sequence[tuple[str, ProfileConfig]], *, runtime: Any = None, console: Any = None
) -> list[tuple[str, ProfileConfig]]:
    """`configs` with every `partition="auto"` variant cut as the first variant of its meshes
    and model stages chose: a comparison runs one model on one cut, and only the schedule (or
    the resharding) differs. (Each session would choose anew, from noisy timings.)"""
    chosen: dict[tuple[Any, ...], Any] = {}
    out = []
    for label, vpc in configs:
        p = vpc.pipeline
        if p.partition != "auto" or p.cuts is not None:
            out.append((label, vpc))
            continue
        key = (vpc.num_stages, p.chunks_per_mesh, p.stage_mesh_shape)
        if key not in chosen:
            with _status(console, f"choosing the cut with partition='auto' ({label})"):
                chosen[key] = Session(vpc, label, runtime=runtime).cuts()
            if console is not None:
                text = f"cut after layers {list(chosen[key])} (partition='auto', for {label})"
                console.print(f"{text} for every variant", highlight=False)
        out.append((label, vpc.replace_pipeline(partition="manual", cuts=chosen[key])))
    return out


def _costs_that_fit(pc: ProfileConfig) -> ProfileConfig:
    """`pc`, with per-stage `cost_*` tuples dropped (back to the defaults) where they do not fit
    the variant's model cut and the variant places no weight gradients (comparisons with virtual
    stages cut the model two ways; the costs only order its sends then). Where the variant
    places `W`s, a misfit is the user's to fix, and the runtime says so."""
    p = pc.pipeline
    n = pc.num_stages
    sizes = {"cost_forward": n, "cost_backward": n, "cost_weight_grad": n, "cost_comm": n - 1}
    misfit = [
        f for f, k in sizes.items() if isinstance(getattr(p, f), tuple) and len(getattr(p, f)) != k
    ]
    if not misfit or places_weights(p):
        return pc
    defaults = PipelineConfig()
    return pc.replace_pipeline(**{f: getattr(defaults, f) for f in COST_FIELDS})


def _cut_text(cut: tuple[int, int]) -> str:
    stages, v = cut
    return f"{stages} stages" + (f", {v} per mesh" if v > 1 else "")


def _format_costs(costs: Costs) -> str:
    def ms(values: Sequence[float]) -> str:
        return "/".join(f"{x * 1e3:.1f}" for x in values)

    b_only = [b - w for b, w in zip(costs.backward, costs.weight_grad)]
    return (
        f"F {ms(costs.forward)}, B {ms(b_only)}, W {ms(costs.weight_grad)}, "
        f"transfer {ms(costs.comm)}"
    )


def compare_json(pc: ProfileConfig, kind: str, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    from jaxreshard.profiler._report import describe_devices

    return {
        "format": COMPARE_FORMAT,
        "compare": kind,
        "model": pc.model,
        "preset": pc.preset,
        "config": pc.to_json(),
        "device": describe_devices(),
        "rows": list(rows),
    }


# -- progress -------------------------------------------------------------------------------------
