"""What a profile shows: tables, `jaxreshard-profile/1` JSON, a Chrome trace and a PNG.

The measured timeline is a `jaxreshard.pipeline.Timeline` built from the recorded events, so
the trace and the picture look exactly like those of a simulated schedule (`jaxreshard
schedule`), in milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jaxreshard.pipeline._action import Action
from jaxreshard.pipeline._schedule import ACTIVATION, GRADIENT, Transfer
from jaxreshard.pipeline._simulate import TimedAction, TimedTransfer, Timeline
from jaxreshard.pipeline._visualize import to_chrome_trace
from jaxreshard.profiler._measured import (
    COMPUTE_KINDS,
    median,
    predicted_step,
    stage_stats,
    transfer_stats,
)
from jaxreshard.profiler._run import Session, StepRecord
from jaxreshard.runtime.engine._events import SEND, WAIT

PROFILE_FORMAT = "jaxreshard-profile/1"
COMPARE_FORMAT = "jaxreshard-profile-compare/1"
MS = 1e3


def _transfer_kind(name: str) -> str:
    kind = name.split(" ")[0].rstrip("0123456789")
    return {"act": ACTIVATION, "grad": GRADIENT}.get(kind, kind)


def measured_timeline(session: Session, steps: Sequence[StepRecord]) -> Timeline:
    """The steps' events laid end to end as a timeline in milliseconds."""
    schedule = session.layout.schedule
    stages: list[list[TimedAction]] = [[] for _ in range(schedule.num_stages)]  # per rank
    transfers: list[TimedTransfer] = []
    offset = 0.0
    for st in steps:
        for e in st.events:
            start, end = (offset + e.start) * MS, (offset + e.end) * MS
            if e.kind in COMPUTE_KINDS:
                action = Action(e.stage, e.kind, e.mb)
                stages[schedule.rank_of(e.stage)].append(TimedAction(action, start, end))
            elif e.kind == SEND:
                tr = Transfer(_transfer_kind(e.name), e.mb, e.stage, e.dst)
                transfers.append(TimedTransfer(tr, start, end))
        offset += st.seconds
    return Timeline(
        session.layout.schedule,
        None,
        True,
        tuple(tuple(sorted(s, key=lambda t: t.start)) for s in stages),
        tuple(sorted(transfers, key=lambda t: t.start)),
    )


def median_step(steps: Sequence[StepRecord]) -> StepRecord:
    ordered = sorted(steps, key=lambda s: s.seconds)
    return ordered[(len(ordered) - 1) // 2]


def chrome_trace(session: Session, steps: Sequence[StepRecord]) -> dict[str, Any]:
    """Perfetto-ready trace of all timed steps: one process per stage with a compute lane, a
    transfers-out lane and a lane of the time blocked in receives; a marker per step."""
    timeline = measured_timeline(session, steps)
    trace = to_chrome_trace(timeline, seconds_per_unit=1e-3)
    events = trace["traceEvents"]
    for s in range(len(timeline.stages)):
        events.append(
            {"ph": "M", "name": "thread_name", "pid": s, "tid": 2, "args": {"name": "blocked"}}
        )
    offset = 0.0
    for i, st in enumerate(steps):
        events.append(
            {
                "name": f"step {i} ({st.seconds * MS:.1f} ms, loss {st.loss:.4g})",
                "ph": "i",
                "s": "g",
                "pid": 0,
                "tid": 0,
                "ts": offset * 1e6,
            }
        )
        for e in st.events:
            if e.kind == WAIT and e.end > e.start:
                events.append(
                    {
                        "name": f"wait {e.name}" + (f" mb{e.mb}" if e.mb >= 0 else ""),
                        "cat": "wait",
                        "ph": "X",
                        "pid": timeline.schedule.rank_of(e.stage),
                        "tid": 2,
                        "ts": (offset + e.start) * 1e6,
                        "dur": (e.end - e.start) * 1e6,
                    }
                )
        offset += st.seconds
    return trace


# -- the summary ----------------------------------------------------------------------------------


def profile_json(session: Session, flops: float | None) -> dict[str, Any]:
    """The `jaxreshard-profile/1` object (see DESIGN.md, "Formats")."""
    pc, steps = session.pc, session.steps
    layout = session.layout
    step_s = median([s.seconds for s in steps])
    per_sample = pc.spec.units_per_sample(pc.model_config)
    samples_per_s = pc.run.batch_size / step_s if step_s > 0 else None
    stats = stage_stats(steps, layout.schedule)
    memory = session.memory()
    shapes = layout.mesh_shapes
    for row, mem in zip(stats, memory):
        row.update(mem)
        row["mesh_shape"] = dict(shapes[row["stage"]])
        # How the stage sums its parameter gradients over its batch axes (see [Note: gradients
        # reduced once] in `runtime/step/_reduction.py`).
        row["gradient_reduction"] = layout.reductions.get(row["stage"], "")
    out: dict[str, Any] = {
        "format": PROFILE_FORMAT,
        "model": pc.model,
        "preset": pc.preset,
        "num_params": pc.spec.num_params(pc.model_config),
        "schedule": pc.pipeline.schedule,
        "weight_delay": pc.pipeline.weight_delay,
        "resharding": pc.pipeline.resharding,
        "backend": pc.pipeline.backend,
        "emulate_network_gbps": pc.pipeline.emulate_network_gbps,
        "config": pc.to_json(),
        "device": describe_devices(),
        "compile_seconds": session.compile_seconds,
        "cuts": session.cuts(),
        "partition": partition.to_json() if (partition := session.partition()) else None,
        "steps": [{"seconds": s.seconds, "loss": s.loss} for s in steps],
        "step_seconds": step_s,
        # Steps as a training loop runs them (nothing recorded; see `Session.plain_step`).
        "plain_steps": [{"seconds": s.seconds, "loss": s.loss} for s in session.plain_steps],
        "plain_step_seconds": (
            median([s.seconds for s in session.plain_steps]) if session.plain_steps else None
        ),
        # The pipeline simulator's step time for this schedule with the measured costs.
        "predicted_step_seconds": predicted_step(steps, layout)[0],
        "samples_per_second": samples_per_s,
        "unit": pc.spec.unit,
        "units_per_second": samples_per_s * per_sample if samples_per_s else None,
        "flops_per_step": flops,
        "model_tflops": flops / step_s / 1e12 if flops and step_s > 0 else None,
        "transfer_seconds": median(
            [sum(e.end - e.start for e in st.events if e.kind == SEND) for st in steps]
        ),
        "stages": stats,
        "boundary_tensors": transfer_stats(steps, layout),
    }
    if session.signal_steps:
        bound = median([s.seconds for s in session.signal_steps])
        out["signal_only"] = {
            "step_seconds": bound,
            "steps": [{"seconds": s.seconds} for s in session.signal_steps],
            "fraction_of_bound": bound / step_s if step_s > 0 else None,
        }
    return out


def describe_devices() -> str:
    """The devices the stages run on: this process's, or the running Ray runtime's hosts'."""
    import jax

    from jaxreshard.runtime import running_runtime

    runtime = running_runtime()
    if getattr(runtime, "backend", None) == "ray":
        hosts = runtime.hosts
        platform = runtime.devices[0].platform if runtime.devices else "?"
        return f"{len(hosts)} Ray hosts x {max(map(len, hosts))} {platform}"
    devices = jax.devices()
    kind = devices[0].device_kind if devices else "?"
    return f"{len(devices)} x {devices[0].platform} ({kind})" if devices else "none"


def _params_text(count: int | None) -> str:
    return f"{count / 1e6:.2f} M parameters" if count is not None else "parameters not counted"


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"  # pragma: no cover


def _fmt_s(seconds: float | None) -> str:
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "n/a"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def header_lines(pc: Any) -> list[str]:
    """What runs, in a few lines (with the emulation notice when it is on)."""
    p = pc.pipeline
    lines = [
        f"{pc.model} {pc.preset}: {_params_text(pc.spec.num_params(pc.model_config))}; "
        f"batch {pc.run.batch_size} = {p.num_micro_batches} micro-batches x "
        f"{pc.run.batch_size // p.num_micro_batches}",
        f"pipeline: {pc.num_stages} stages on meshes "
        f"{list(p.mesh_shapes(p.num_meshes(pc.num_stages)))} "
        f"{tuple(p.mesh_axis_names)}, schedule {p.schedule}"
        f"{' + weight delay' if p.weight_delay else ''}, resharding {p.resharding}, "
        f"backend {p.backend}; devices: {describe_devices()}",
    ]
    if p.emulate_network_gbps is not None:
        lines.append(
            f"[bold yellow]network emulation ON[/]: every transfer between stages on different "
            f"hosts waits as on a {p.emulate_network_gbps:g} GB/s "
            f"({p.emulate_network_gbps * 8:g} Gbit/s) NIC per host (cluster cost model), "
            f"{p.devices_per_host} devices per host; step times include those waits"
        )
    return lines


def summary_tables(result: dict[str, Any]) -> list[Any]:
    """Rich tables: the step, the stages, the boundary tensors."""
    from rich.table import Table

    step = Table(title="step (median over timed steps; compile excluded)", title_justify="left")
    losses = [s["loss"] for s in result["steps"]]
    tflops = result["model_tflops"]
    # A model whose unit is the sample (a user model without `UNIT`) gets one throughput column:
    # the two keys are one, and the second value (samples/s, to a tenth) stays.
    plain = result.get("plain_step_seconds")
    cells = {
        "step time": _fmt_s(result["step_seconds"]),
        **({"plain step": _fmt_s(plain)} if plain else {}),
        "predicted": _fmt_s(result["predicted_step_seconds"]),
        f"{result['unit']}/s": (
            f"{result['units_per_second']:,.0f}" if result["units_per_second"] else "n/a"
        ),
        "samples/s": (
            f"{result['samples_per_second']:,.1f}" if result["samples_per_second"] else "n/a"
        ),
        "model TFLOP/s": f"{tflops:.4f}" if tflops else "n/a",
        "transfers (sum)": _fmt_s(result["transfer_seconds"]),
        "compile": _fmt_s(result["compile_seconds"]),
        "loss first -> last": f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "n/a",
    }
    for col in cells:
        step.add_column(col, justify="right")
    step.add_row(*cells.values())
    if plain and result["step_seconds"] > 1.05 * plain:
        step.caption = (
            f"a timed step waits for each action to time it: here it took "
            f"{result['step_seconds'] / plain:.2f}x a plain step (a training loop's: nothing "
            "timed, each step waited for at its end); the prediction and the tables below "
            "describe timed steps"
        )
        step.caption_justify = "left"
    stages = Table(title="stages (medians per step)", title_justify="left")
    for col in (
        "stage",
        "mesh",
        "compute",
        "blocked in receives",
        "bubble",
        "peak activations (mb)",
        "activations/mb/device",
        "peak memory",
    ):
        stages.add_column(col, justify="right")
    for row in result["stages"]:
        stages.add_row(
            str(row["stage"]),
            "x".join(str(v) for v in row["mesh_shape"].values()),
            _fmt_s(row["compute_seconds"]),
            _fmt_s(row["blocked_seconds"]),
            f"{row['bubble_fraction']:.1%}",
            str(row["peak_activations"]),
            _fmt_bytes(row["activation_bytes_per_microbatch"]),
            _fmt_bytes(row["peak_memory_bytes"])
            if row["peak_memory_bytes"] is not None
            else "n/a (backend reports none)",
        )
    stages.caption = "; ".join(
        f"stage {row['stage']} sums its gradients {row['gradient_reduction']}"
        for row in result["stages"]
        if row.get("gradient_reduction")
    )
    stages.caption_justify = "left"
    tensors = Table(title="boundary tensors (measured: median per transfer)", title_justify="left")
    for col in (
        "transfer",
        "shape",
        "src sharding",
        "dst sharding",
        "strategy",
        "bytes",
        "planned",
        "measured",
        "per step",
    ):
        tensors.add_column(
            col, justify="right" if col in ("bytes", "planned", "measured", "per step") else "left"
        )
    for t in result["boundary_tensors"]:
        strategy = (
            t["strategy"] if t["strategy"] == t["chosen"] else f"{t['strategy']}: {t['chosen']}"
        )
        tensors.add_row(
            t["name"],
            f"{tuple(t['shape'])} {t['dtype']}",
            f"{t['src_spec']} on {_mesh_text(t['src_mesh'])}",
            f"{t['dst_spec']} on {_mesh_text(t['dst_mesh'])}",
            strategy,
            _fmt_bytes(t["bytes"]),
            _fmt_s(t["planned_seconds"]),
            _fmt_s(t["measured_seconds"]),
            f"{t['per_step']:g}",
        )
    tables = [step, stages, tensors]
    if "signal_only" in result:
        bound = result["signal_only"]
        tables.append(
            f"signal-only bound (every transfer a signal that keeps its dependency): "
            f"{_fmt_s(bound['step_seconds'])} per step; this run reaches "
            f"{bound['fraction_of_bound']:.0%} of it"
        )
    return tables


def _mesh_text(mesh: dict[str, int]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in mesh.items()) + "}"


# -- comparisons ----------------------------------------------------------------------------------


COST_FIELDS = ("cost_forward", "cost_backward", "cost_weight_grad", "cost_comm")


def _listed(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def places_weights(pipeline: Any) -> bool:
    """Whether the schedule builder places `W`s with the config's cost model (ZB-V and
    DualPipeV have fixed orders; unsplit schedules have no `W`)."""
    return pipeline.split_backward and pipeline.schedule not in ("zbv", "dualpipev")


def comparison_rows(sessions: Sequence[Session]) -> list[dict[str, Any]]:
    """One row per session: median step time, speedup over the first, the same of its plain
    steps (None where it ran none), the signal-only bound and how close to it the run is, and
    the largest loss difference from the first."""
    base = median([s.seconds for s in sessions[0].steps])
    base_plain = _plain_median(sessions[0])
    base_losses = [s.loss for s in sessions[0].steps]
    rows = []
    for session in sessions:
        step_s = median([s.seconds for s in session.steps])
        plain = _plain_median(session)
        bound = median([s.seconds for s in session.signal_steps]) if session.signal_steps else None
        losses = [s.loss for s in session.steps]
        predicted, costs = predicted_step(session.steps, session.layout)
        rows.append(
            {
                "label": session.label,
                "predicted_seconds": predicted,
                "measured_costs": costs.to_json(),
                "schedule": session.pc.pipeline.schedule,
                "weight_delay": session.pc.pipeline.weight_delay,
                "resharding": session.pc.pipeline.resharding,
                "placement_costs": (
                    {
                        f.removeprefix("cost_"): _listed(getattr(session.pc.pipeline, f))
                        for f in COST_FIELDS
                    }
                    if places_weights(session.pc.pipeline)
                    else None
                ),
                "step_seconds": step_s,
                "best_step_seconds": min(s.seconds for s in session.steps),
                "speedup": base / step_s if step_s > 0 else None,
                "speedup_over": sessions[0].label,
                "plain_step_seconds": plain,
                "plain_speedup": base_plain / plain if base_plain and plain else None,
                "signal_only_seconds": bound,
                "fraction_of_bound": bound / step_s if bound and step_s > 0 else None,
                "max_loss_difference": max(
                    (abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, base_losses)),
                    default=0.0,
                ),
                "compile_seconds": session.compile_seconds,
                "blocked_seconds": [
                    r["blocked_seconds"]
                    for r in stage_stats(session.steps, session.layout.schedule)
                ],
            }
        )
    base_predicted = rows[0]["predicted_seconds"]
    for r in rows:
        p = r["predicted_seconds"]
        r["predicted_speedup"] = base_predicted / p if p > 0 else None
        r["measured_over_predicted"] = r["step_seconds"] / p if p > 0 else None
    return rows


def _plain_median(session: Session) -> float | None:
    return median([s.seconds for s in session.plain_steps]) if session.plain_steps else None


def comparison_table(rows: Sequence[dict[str, Any]], title: str) -> Any:
    from rich.table import Table

    plain = all(r.get("plain_step_seconds") for r in rows)
    table = Table(title=title, title_justify="left")
    for col in (
        "variant",
        "step time (median)",
        "best",
        "speedup",
        *(("plain step", "plain speedup") if plain else ()),
        "predicted",
        "predicted speedup",
        "measured / predicted",
        "signal-only bound",
        "% of bound",
        "blocked per stage",
        "loss diff",
    ):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in rows:
        table.add_row(
            r["label"],
            _fmt_s(r["step_seconds"]),
            _fmt_s(r["best_step_seconds"]),
            f"{r['speedup']:.2f}x" if r["speedup"] else "n/a",
            *(
                (
                    _fmt_s(r["plain_step_seconds"]),
                    f"{r['plain_speedup']:.2f}x" if r["plain_speedup"] else "n/a",
                )
                if plain
                else ()
            ),
            _fmt_s(r["predicted_seconds"]),
            f"{r['predicted_speedup']:.2f}x" if r["predicted_speedup"] else "n/a",
            f"{r['measured_over_predicted']:.2f}" if r["measured_over_predicted"] else "n/a",
            _fmt_s(r["signal_only_seconds"]),
            f"{r['fraction_of_bound']:.0%}" if r["fraction_of_bound"] else "n/a",
            " ".join(_fmt_s(b) for b in r["blocked_seconds"]),
            f"{r['max_loss_difference']:.1e}",
        )
    return table
