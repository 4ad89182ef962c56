"""`jaxreshard profile MODEL --auto`: search stage meshes, cuts, schedules and micro-batch counts by
the calibrated simulator, measure the best few beside plain data parallelism, keep the fastest.

[Note: configuration search]
1. Mesh layouts (`mesh_layouts`, unless `--auto-meshes keep`): every stage gets the same mesh,
   of any size that divides the layout's devices by the stage count and either fits in a host
   or takes whole hosts, in every shape over the mesh axes. The shape says where each axis
   sits: a stage mesh takes the hosts' devices in order, so on a mesh that spans hosts its
   first axis (of size above 1) crosses them. Smaller meshes leave devices idle (one stage per
   host can beat a stage spanning hosts over slow links: see docs/benchmarks.md).
2. Calibrate each layout, once per cut option (`cut_options`): with `cuts`, the model marks a
   `jr.stage_candidate` after every layer and the first calibration run lets
   `partition="auto"` choose the cut on the layout's meshes, for the configured schedule and
   micro-batch count (if no cut fits `memory_cap_gib` there, without the cap, which the
   predictions then check at every count). It chooses by its prediction alone
   (`partition_trials=0`): the search measures its best configurations itself. Every later
   run of the layout takes that cut (`cuts=...`); past `MAX_CHOICES` ways to cut,
   `partition="auto"` searches them ([Note: cut search]). With `virtual`, a second option
   cuts the model into 2 model stages per mesh (1 for a config of more), whose calibration
   (with a split backward, so that W is measured) predicts the virtual-stage schedules.
   Each runs its warm-up and timed steps, recorded, at its micro-batch count and at twice
   (or half) it, and at the first count once more with the other kind of backward (fused
   for a split one, split for a fused one: [Note: the other backward] in `_auto_fit.py`);
   each stage's measured F, B, W and transfer times (`measured_costs`; a stage's own
   collectives are inside its F, B and W) are fitted as `fixed + per_row * rows` per
   micro-batch, so that smaller micro-batches pay their actions' fixed cost (the transfers
   that move no rows too: the shared parameters', the first activation's extra); the
   optimizer's, run after the pipeline as the calibration measured it (`OptimizerPhase`),
   and the step's fixed cost (fitted per point in the micro-batch count) are taken as
   measured. A layout's points step in turns (one at a time where a later one does not
   build beside the first). A layout that does not build (a model
   axis the model's shapes do not divide) is reported and skipped.
3. Predict: per layout and cut, every schedule of `schedule_variants` for its model stages per
   mesh, with every micro-batch count that divides the batch into micro-batches its stages'
   batch axis splits evenly (1 to 32 of them), is simulated with the fitted costs at its
   micro-batch size; a schedule that places delayed `W`s carries those costs as its `cost_*`
   fields, so that its measured run places them as simulated. Its peak memory per
   device is estimated too (`_auto_memory.py`: each stage's state, residuals and what B keeps
   for W, at each calibration point, fitted in the rows and walked along the schedule), and
   one over `memory_cap_gib` is not measured (JSON `over_memory_cap`; none fitting is an
   error). XLA's scratch is not in this estimate (the stages compile where they run).
   Refine (`_refine`, at most `refine` times): while one of the `top` fastest predictions
   has micro-batch rows outside its layout's calibration points (JSON `extrapolated`), that
   layout is calibrated at that count too (that point alone), and every prediction is made
   again, each from the two points either side of its rows (`pair`). A count whose
   calibration fails is left out.
4. Measure: the `top` fastest predictions and plain data parallelism (one stage on all the
   layout's devices, the batch split over the batch axis, one micro-batch: what a user would
   write with `jax.jit` instead) run side by side (`compare`), and each prints predicted
   beside measured. One that fails to compile or step (out of memory in a program the
   estimate did not see, say) is dropped with its error (JSON `failed`), and the rest go on.
5. Choose: the fastest measured, data parallelism included, so the search never picks a
   layout slower than it. Each is measured as a training loop runs it (its plain steps, as a
   profile times them; with `plain_steps = 0`, its timed steps, which block on every action
   and so charge a layout of many small actions more than training does). The shortlist of
   step 4 still comes from predictions calibrated on timed steps, so such a layout can be
   left out before it is measured. The winner's config is written as TOML (`--auto-toml`),
   and `--json` records every configuration tried.
Mixed stage meshes (stages on meshes of different shapes) are estimated from the uniform
layouts' calibrations, and the best few of them are calibrated and ranked like the others:
[Note: mixed stage meshes in the search] in `_auto_mixed.py`.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from pathlib import Path
from typing import Any

from jaxreshard._tracebacks import error_line
from jaxreshard.pipeline import Costs, build_schedule, simulate
from jaxreshard.profiler._auto_fit import CostModel, calibrated_range
from jaxreshard.profiler._auto_memory import LayoutMemory, memory_point
from jaxreshard.profiler._auto_mixed import MAX_MIXES, mix_text, mixes_of
from jaxreshard.profiler._auto_report import (
    DATA_PARALLEL,
    profile_toml,
    summary_lines,
)
from jaxreshard.profiler._compare import (
    compare,
    cost_fields,
    measures_placement,
    placing_costs,
    schedule_variants,
)
from jaxreshard.profiler._config import ProfileConfig
from jaxreshard.profiler._measured import (
    OptimizerPhase,
    measured_costs,
    median,
    step_overhead,
)
from jaxreshard.profiler._profile import _bar, _emulating, _status, runtime_for
from jaxreshard.profiler._report import places_weights
from jaxreshard.profiler._run import Session, devices_needed, droppable, is_fatal, run_steps
from jaxreshard.runtime.step._partition import NoCutFits

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
UNCAPPED_GIB = 1e9  # (a cap no device reaches: the partitioner's cut without one)


def auto_search(
    pc: ProfileConfig,
    *,
    top: int = 3,
    console: Any = None,
    progress: bool = True,
    toml_path: str | Path | None = None,
    meshes: bool = True,
    cuts: bool = True,
    virtual: bool = True,
    mixed: int = 2,
    refine: int = 3,
) -> dict[str, Any]:
    """Search, measure and choose (see [Note: configuration search]); returns the JSON record.
    `meshes=False` keeps the configured stage meshes, `cuts=False` the model's configured cut
    (even stages, or the config's `cuts`), `virtual=False` its model stages per mesh; `mixed`:
    how many mixes of stage meshes (see [Note: mixed stage meshes in the search]) to
    calibrate beside the uniform layouts, 0 for none; `refine`: how many calibration points
    the search may add where its best predictions extrapolate (`_refine`), 0 for none."""
    pc = _emulating(pc)
    calibrated: list[dict[str, Any]] = []
    mixes: list[dict[str, Any]] = []
    with runtime_for(pc) as runtime:
        hosts = getattr(runtime, "hosts", None)  # (Ray: each host's devices)
        sizes = {len(h) for h in hosts or ()}
        per_host = sizes.pop() if len(sizes) == 1 else None  # (uneven hosts: the config's)
        layouts = mesh_layouts(pc, per_host) if meshes else [{}]
        options = cut_options(pc, cuts, virtual)
        for layout in layouts:
            for o, cut in enumerate(options):
                entry = _calibrated(pc, {**layout, **cut}, runtime, console, progress,
                                    required=not calibrated)  # fmt: skip
                entry["option"] = o
                calibrated.append(entry)
        if meshes and mixed > 0:  # [Note: mixed stage meshes in the search]
            mixes = mixes_of(pc, calibrated, per_host)
            if mixes and console is not None:
                best = ", ".join(mix_text(m) for m in mixes[:mixed])
                capped = f" (the first {MAX_MIXES} placeable)" if len(mixes) >= MAX_MIXES else ""
                console.print(f"mixed stage meshes: {len(mixes)}{capped} estimated from the "
                              f"uniform calibrations; calibrating the best "
                              f"{min(mixed, len(mixes))}: {best}", highlight=False)  # fmt: skip
            for mix in mixes[:mixed]:
                changes = {"stage_mesh_shape": tuple(map(tuple, mix["stage_mesh_shape"])),
                           **options[0]}  # fmt: skip
                entry = _calibrated(pc, changes, runtime, console, progress, required=False)
                entry["option"] = 0
                mix["calibrated"] = "measured" in entry
                if "error" in entry:
                    mix["error"] = entry["error"]
                calibrated.append(entry)
        ranked = _ranked(pc, calibrated)
        ranked, refinements = _refine(pc, calibrated, ranked, top, refine, runtime, console,
                                      progress)  # fmt: skip
    predictions, memory, over_cap = ranked.predictions, ranked.memory, ranked.over_cap
    cap = pc.pipeline.memory_cap_gib
    if not predictions and over_cap:
        least = min(over_cap, key=lambda o: o["estimated_peak_bytes"])
        raise ValueError(
            f"profile --auto: no configuration fits in memory_cap_gib={cap} per device: the "
            f"least ({least['label']}) needs {least['estimated_peak_bytes'] / (1 << 30):.3f} "
            "GiB by the estimate. Raise memory_cap_gib, or give the stages more devices (a "
            "bigger layout) so that they shard the batch or the parameters"
        )
    chosen = predictions[:top]
    variants = [(p.label, p.changes) for p in chosen]
    dp = data_parallel_changes(pc)
    if dp is not None:
        variants.append((DATA_PARALLEL, dp))
    failed: list[dict[str, Any]] = []  # (a finalist a training loop could not run is dropped)
    rows = compare(pc, variants, bound=False, console=console, progress=progress,
                   title=f"{pc.model} {pc.preset}: the {len(chosen)} best predicted layouts "
                         "and data parallelism", failed=failed)  # fmt: skip
    predicted = {p.label: p for p in chosen}
    for row in rows:
        finalist = predicted.get(row["label"])
        row["search_predicted_seconds"] = finalist and finalist.seconds
        row["search_extrapolated"] = finalist and finalist.extrapolated
        row["calibration_step_seconds"] = finalist and _calibration_step(
            pc, calibrated[finalist.entry], finalist
        )
        row["estimated_peak_bytes"] = memory.get(row["label"])
    # Ranked by what training runs at, the plain steps, where every row has them.
    key = "plain_step_seconds" if all(r["plain_step_seconds"] for r in rows) else "step_seconds"
    best = min(rows, key=lambda r: r[key])
    dp_row = next((r for r in rows if r["label"] == DATA_PARALLEL), None)
    changes = dict(variants)[best["label"]]
    winner = pc.replace_pipeline(**changes)
    first = calibrated[0]
    record = {
        "format": "jaxreshard-profile-auto/1",
        "model": pc.model,
        "preset": pc.preset,
        "calibration": _calibration_json(first),
        "layouts": [_calibration_json(entry) for entry in calibrated],
        "mixed_layouts": [{"calibrated": False, **m} for m in mixes],
        "predicted": [
            {
                "label": p.label,
                "predicted_seconds": p.seconds,
                "changes": p.changes,
                "estimated_peak_bytes": memory.get(p.label),
                "extrapolated": p.extrapolated,
            }
            for p in predictions
        ],
        "refinements": refinements,
        "memory_cap_gib": cap,
        "over_memory_cap": over_cap,
        "measured": rows,
        "failed": failed,
        "ranked_by": key,
        "winner": best["label"],
        "winner_pipeline": winner.pipeline.to_dict(),
        "speedup_over_data_parallel": dp_row[key] / best[key] if dp_row else None,
    }
    if console is not None:
        for line in summary_lines(record):
            console.print(line, highlight=False)
    if toml_path is not None:
        Path(toml_path).write_text(profile_toml(winner))
        if console is not None:
            console.print(f"wrote {toml_path} (jaxreshard profile {pc.model} --config {toml_path})")
    return record


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One configuration the search simulated: its predicted step, label and pipeline
    changes; which calibrated layout (`entry`, its index) and micro-batch count it is; and
    whether its micro-batch rows lie outside that layout's calibration points (`extrapolated`:
    its costs come from their line, not from between them)."""

    seconds: float
    label: str
    changes: dict[str, Any]
    entry: int
    micro_batches: int
    extrapolated: bool


@dataclasses.dataclass
class Ranked:
    """Every prediction that fits the memory cap, fastest first; each one's estimated peak
    bytes per device, by label; and those over the cap."""

    predictions: list[Prediction]
    memory: dict[str, int | None]
    over_cap: list[dict[str, Any]]


def _ranked(pc: ProfileConfig, calibrated: list[dict[str, Any]]) -> Ranked:
    """Step 3 of [Note: configuration search]: every calibrated layout's schedules and
    micro-batch counts, simulated with its fitted costs (a count whose own calibration failed
    left out: it would not run), ranked."""
    predictions: list[Prediction] = []
    memory: dict[str, int | None] = {}  # label -> estimated peak bytes per device
    cap = pc.pipeline.memory_cap_gib
    cap_bytes = int(cap * (1 << 30)) if cap is not None else None
    over_cap: list[dict[str, Any]] = []
    searched = {entry["layout"] for entry in calibrated}
    placing = measures_placement(pc)
    for k, entry in enumerate(calibrated):
        if "measured" not in entry:
            continue
        lpc = pc.replace_pipeline(**entry["changes"])
        model = CostModel.fit(entry["measured"], entry.get("split"), entry.get("other"))
        points = [rows for rows, _, _ in entry["measured"]]
        where = f", meshes {entry['layout']}" if len(searched) > 1 else ""
        if "cuts" in entry:
            where += f", cuts {entry['cuts']}"
        v = lpc.pipeline.chunks_per_mesh
        for label, changes in schedule_variants(lpc):
            if changes.get("virtual_stages", v) != v:
                continue  # (another cut of the model: the calibration's costs do not apply)
            for m in MICRO_BATCHES:
                if pc.run.batch_size % m or (pc.run.batch_size // m) % _batch_split(lpc):
                    continue  # (a micro-batch must split evenly over the stages' batch axis)
                if m in entry.get("failed_points", {}):
                    continue
                rows = pc.run.batch_size // m
                costs = model.at(rows, lpc.pipeline.replace(**changes).split_backward)
                seconds, schedule = _predict(costs, changes, m, entry.get("phase"))
                run = dict(changes)
                if placing:  # (the runtime places Ws as the prediction did)
                    run.update(_placement(lpc.pipeline.replace(**changes), costs))
                seconds += model.overhead_at(rows)
                text = f"{label}, {m} micro-batches{where}"
                peak = max(entry["memory"].peak(schedule, rows)) if entry["memory"] else None
                memory[text] = peak
                if cap_bytes is not None and peak is not None and peak > cap_bytes:
                    over_cap.append({"label": text, "predicted_seconds": seconds,
                                     "estimated_peak_bytes": peak})  # fmt: skip
                    continue
                changes_m = {**entry["changes"], **run, "num_micro_batches": m}
                outside = not calibrated_range(points, rows)
                predictions.append(Prediction(seconds, text, changes_m, k, m, outside))
    predictions.sort(key=lambda p: p.seconds)
    return Ranked(predictions, memory, over_cap)


def _calibration_step(pc: ProfileConfig, entry: dict[str, Any], p: Prediction) -> float | None:
    """The median step a calibration run of `p`'s very configuration (its layout's schedule
    at one of its calibration points) measured, else None: beside the measured row, how much
    the machine's speed moved between calibrating and measuring."""
    lp = pc.replace_pipeline(**entry["changes"]).pipeline
    if (p.changes.get("schedule"), p.changes.get("weight_delay")) != (lp.schedule, lp.weight_delay):
        return None
    placed = {k: v for k, v in p.changes.items() if k.startswith("cost_")}
    if any(getattr(lp, k) != v for k, v in placed.items()):
        return None  # (its Ws placed by the measured costs: maybe another order than calibrated)
    for (rows, _, _), seconds in zip(entry["measured"], entry["step_seconds"]):
        if rows * p.micro_batches == pc.run.batch_size:
            return seconds
    return None


def _refine(
    pc: ProfileConfig,
    calibrated: list[dict[str, Any]],
    ranked: Ranked,
    top: int,
    budget: int,
    runtime: Any,
    console: Any,
    progress: bool,
) -> tuple[Ranked, list[dict[str, Any]]]:
    """Calibrate where the shortlist extrapolates: while one of the `top` best predictions has
    micro-batch rows outside its layout's calibration points, and at most `budget` times,
    run that layout at that count as a calibration point of its own, refit, re-rank. The
    fitted line is right between its points and drifts outside them: on the 2-host emulated
    cluster, a tiny GPT calibrated at 4 and 8 micro-batches ran at 16 in 1.15-1.56x its
    prediction, and the search had ranked it level with 8, which ran 20-40% faster (see
    docs/benchmarks.md). Returns the new ranking and a record per point added: its layout,
    micro-batch count, the prediction before, and the error where it did not run (its count
    is then left out of the layout's predictions: it would not run measured either)."""
    done: list[dict[str, Any]] = []
    while len(done) < budget:
        outside = next((p for p in ranked.predictions[:top] if p.extrapolated), None)
        if outside is None:
            break
        entry, m = calibrated[outside.entry], outside.micro_batches
        counts = sorted(pc.run.batch_size // rows for rows, _, _ in entry["measured"])
        if console is not None:
            console.print(f"refining: {outside.label} is predicted from calibrations at "
                          f"{', '.join(map(str, counts))} micro-batches; calibrating at {m}",
                          highlight=False)  # fmt: skip
        record = {"layout": entry["layout"], "micro_batches": m, "label": outside.label,
                  "predicted_before": outside.seconds}  # fmt: skip
        try:
            _add_point(pc, entry, m, runtime, console, progress)
        except Exception as e:  # (too small a micro-batch for the stages, out of memory, ...)
            if not droppable(e):
                raise
            record["error"] = error_line(e, 300)
            entry.setdefault("failed_points", {})[m] = record["error"]
            if console is not None:
                console.print(f"  not calibrated ({record['error']}); left out")
        done.append(record)
        ranked = _ranked(pc, calibrated)
        after = next((p for p in ranked.predictions if p.label == outside.label), None)
        record["predicted_after"] = after and after.seconds
    return ranked, done


def _calibrated(
    pc: ProfileConfig,
    changes: dict[str, Any],
    runtime: Any,
    console: Any,
    progress: bool,
    required: bool,
) -> dict[str, Any]:
    """Calibrate the layout `changes` make (see `_calibrate`): its search entry, with the cut
    `partition="auto"` chose as every later run's, or the error that skipped it (raised when
    `required`: the configured layout must build)."""
    lpc = pc.replace_pipeline(**changes)
    entry: dict[str, Any] = {"layout": _layout_text(lpc), "changes": changes}
    try:
        chosen, fields = _calibrate(lpc, runtime, console, progress)
        entry.update(fields)  # (all at once: a layout that failed has none of them)
    except Exception as e:  # (a mesh the model does not shard on, say)
        if is_fatal(e) or required:  # (a host died: nothing more runs)
            raise
        entry["error"] = error_line(e, 300)
        if console is not None:
            console.print(f"skipped meshes {entry['layout']}: {entry['error']}")
        return entry
    if chosen is not None:  # partition="auto" chose; every later run takes its cut
        entry["cuts"] = list(chosen)
        kept = {k: v for k, v in changes.items() if k != "partition_trials"}
        if pc.pipeline.partition_trials > 1:  # (trials are partition='auto''s)
            kept["partition_trials"] = 1
        entry["changes"] = {**kept, "partition": "manual", "cuts": chosen}
    return entry


def _calibrate(
    pc: ProfileConfig, runtime: Any, console: Any, progress: bool
) -> tuple[tuple[int, ...] | None, dict[str, Any]]:
    """Run `pc`'s layout at its calibration points. Returns the cut `partition="auto"` chose
    (None: not asked to) and the layout's search entry fields: `measured` ((micro-batch
    rows, measured costs, step overhead) per point), `step_seconds` (each point's median
    step), `memory` (the stages' memory estimate; None if it could not be made), `phase`
    (where and how long the optimizer ran after the pipeline: the first point's, as it does
    not change with the micro-batches), `split` (the kind of backward the points ran) and
    `other` (the costs of a run at the first point with the other kind: `_other_backward`;
    None where it did not run). If no cut fits the memory cap at the first point's
    micro-batch count, the cut is chosen without it: the predictions, at every count, are
    checked against the cap (see [Note: configuration search]).

    The points step in turns, as `compare` does: on a shared machine a run's speed drifts by
    10-30% over minutes (the tiny GPT on the 2-host emulated cluster: one configuration
    profiled twice, 99.0 and 81.2 ms), and the fit's slope and the two kinds' difference are
    small beside that. Where a later point does not build beside the first (out of memory
    with every point's state held at once, say), the points run one at a time instead."""
    counts = _calibration_points(pc)
    first = _warmed(pc.replace_pipeline(num_micro_batches=counts[0]), runtime, console)
    chosen = first.cuts() if pc.pipeline.partition == "auto" else None

    def at(m: int) -> ProfileConfig:  # (every point measures the cut the first one chose)
        cpc = pc.replace_pipeline(num_micro_batches=m)
        return cpc if chosen is None else cpc.replace_pipeline(partition="manual", cuts=chosen)

    fields: dict[str, Any] = {"measured": [], "step_seconds": [], "phase": None}
    fields["split"] = pc.pipeline.split_backward
    points: list[Any] | None = []

    def record(session: Session) -> None:
        nonlocal points
        _record(fields, session)
        if fields["phase"] is None:
            fields["phase"] = OptimizerPhase.measured(session.steps, session.layout.schedule)
        if points is not None:
            points = _memory_points(points, session, console)

    sessions = [first]
    try:
        sessions += [_warmed(at(m), runtime, console) for m in counts[1:]]
    except Exception as e:
        if not droppable(e):
            raise
        sessions = []
        gc.collect()  # (what the later points built goes now, cycles too)
        if console is not None:
            console.print(f"meshes {_layout_text(pc)}: a second calibration point does not "
                          f"build beside the first ({error_line(e)}); calibrating its points "
                          "one at a time")  # fmt: skip
    if sessions:
        other = _other_backward(at(counts[0]), runtime, console)

        def dropped(session: Session, error: Exception) -> None:
            if session is not other:
                raise error
            _no_other(at(counts[0]), error, console)

        together = [*sessions, *([other] if other is not None else [])]
        with _bar(console, progress, pc.run.steps * len(together)) as advance:
            live = run_steps(together, pc.run.steps, on_step=advance, on_failure=dropped)
        for session in sessions:
            record(session)
        fields["other"] = (
            measured_costs(other.steps, other.layout) if other is not None and other in live
            else None
        )  # fmt: skip
    else:  # (one session at a time: the first, then each later point, then the other kind)
        alone, first = [first], None  # (the first point's state goes once it has run)
        for m in counts:
            session = alone.pop() if alone else _warmed(at(m), runtime, console)
            with _bar(console, progress, pc.run.steps) as advance:
                run_steps([session], pc.run.steps, on_step=advance)
            record(session)
            del session  # (before the next point's is built)
        other = _other_backward(at(counts[0]), runtime, console)
        fields["other"] = None
        if other is not None:
            try:
                with _bar(console, progress, pc.run.steps) as advance:
                    run_steps([other], pc.run.steps, on_step=advance)
                fields["other"] = measured_costs(other.steps, other.layout)
            except Exception as e:
                if not droppable(e):
                    raise
                _no_other(at(counts[0]), e, console)
    fields["memory"] = LayoutMemory(points) if points else None
    return chosen, fields


def _other_backward(pc: ProfileConfig, runtime: Any, console: Any) -> Session | None:
    """`pc`'s layout, warmed up with the other kind of backward than its schedule's (fused
    for a split one, split for a fused one: eager 1F1B, or eager interleaved 1F1B for more
    model stages per mesh, without or with weight delay; see [Note: the other backward] in
    `_auto_fit.py`), or None (with a line why) where that schedule does not build."""
    p = pc.pipeline
    schedule = "eager_1f1b" if p.chunks_per_mesh == 1 else "eager_interleaved_1f1b"
    opc = pc.replace_pipeline(schedule=schedule, weight_delay=not p.split_backward)
    try:
        return _warmed(opc, runtime, console)
    except Exception as e:  # (a micro-batch count the schedule does not take, say)
        if not droppable(e):
            raise
        _no_other(pc, e, console)
        return None


def _no_other(pc: ProfileConfig, error: Exception, console: Any) -> None:
    if console is not None:
        kind = "B + W" if pc.pipeline.split_backward else "the fused backward"
        why = error_line(error)
        console.print(f"meshes {_layout_text(pc)}: no calibration of the other kind of "
                      f"backward ({why}); both kinds predicted with {kind}")  # fmt: skip


def _warmed(cpc: ProfileConfig, runtime: Any, console: Any) -> Session:
    """A calibration session of `cpc`'s layout at its micro-batch count, warmed up (with
    `partition="auto"`, its cut chosen: without the memory cap where no cut fits under it,
    and printed)."""
    m = cpc.pipeline.num_micro_batches
    kind = "split" if cpc.pipeline.split_backward else "fused"
    text = (f"calibrating meshes {_layout_text(cpc)}{_chunks_text(cpc)} at {m} micro-batches "
            f"({kind} backward)")  # fmt: skip
    with _status(console, text):
        session = Session(cpc, "calibration", runtime=runtime)
        try:
            session.warm_up()
        except NoCutFits:
            if console is not None:
                console.print(f"meshes {_layout_text(cpc)}: no cut fits the memory cap at "
                              f"{m} micro-batches; choosing the cut without it")  # fmt: skip
            cpc = cpc.replace_pipeline(memory_cap_gib=UNCAPPED_GIB)
            session = Session(cpc, "calibration", runtime=runtime)
            session.warm_up()
    if cpc.pipeline.partition == "auto" and console is not None:
        where = f"meshes {_layout_text(cpc)}{_chunks_text(cpc)}"
        console.print(f"{where}: partition='auto' cuts after layers "
                      f"{list(session.cuts() or ())}", highlight=False)  # fmt: skip
    return session


def _record(entry: dict[str, Any], session: Session) -> None:
    """A stepped calibration session's point, added to its layout's search entry: its
    micro-batch rows, measured costs and step overhead (`measured`), and its median step."""
    entry["measured"].append((session.layout.micro_batch_rows,
                              measured_costs(session.steps, session.layout),
                              step_overhead(session.steps)))  # fmt: skip
    entry["step_seconds"].append(median([st.seconds for st in session.steps]))


def _memory_points(points: list[Any], session: Session, console: Any) -> list[Any] | None:
    """`points` with the session's memory estimate added, or None (with a line why) where the
    estimate cannot trace the model: the layout then goes without a memory check."""
    try:
        return [*points, memory_point(session)]
    except Exception as e:
        if console is not None:
            layout = _layout_text(session.pc)
            console.print(f"no memory estimate for meshes {layout}: {error_line(e)}")
        return None


def _add_point(
    pc: ProfileConfig, entry: dict[str, Any], m: int, runtime: Any, console: Any, progress: bool
) -> None:
    """Calibrate `entry`'s layout (its chosen cut) at `m` micro-batches too: a point of its
    fitted costs and of its memory estimate."""
    cpc = pc.replace_pipeline(**entry["changes"]).replace_pipeline(num_micro_batches=m)
    session = _warmed(cpc, runtime, console)
    with _bar(console, progress, cpc.run.steps) as advance:
        run_steps([session], cpc.run.steps, on_step=advance)
    _record(entry, session)
    if entry["memory"] is not None:
        points = _memory_points(entry["memory"].points, session, console)
        entry["memory"] = LayoutMemory(points) if points else None


def cut_options(pc: ProfileConfig, cuts: bool, virtual: bool) -> list[dict[str, Any]]:
    """How `--auto` cuts the model on each layout, as pipeline changes: the configured model
    stages per mesh first, then (with `virtual`) one other count (2 per mesh for a config of 1,
    where the model has the layers; 1 for a config of more); with `cuts`, each cut chosen by
    `partition="auto"` from a `jr.stage_candidate` after every layer, else as configured."""
    p = pc.pipeline
    units = pc.spec.num_units(pc.model_config)

    def cut(stages: int, configured: bool) -> dict[str, Any]:
        auto = cuts and stages >= 2
        if auto:  # (the prediction alone: the search measures its best configurations itself)
            return {"partition": "auto", "cuts": None, "partition_trials": 0}
        if configured and not cuts:
            return {}  # (as configured: even, or the config's own cuts)
        # (A configured `cuts` is for the configured stage count; too many choices: even.)
        return {"partition": "manual", "cuts": None} if pc.candidates or cuts else {}

    options = [cut(pc.num_stages, True)]
    if not virtual:
        return options
    meshes = p.num_meshes(pc.num_stages)
    if p.chunks_per_mesh == 1:
        if 2 * meshes <= units:  # (measured with a split backward: its Ws are predicted too)
            options.append({**cut(2 * meshes, False), "num_stages": 2 * meshes,
                            "virtual_stages": 2, "schedule": "eager_interleaved_1f1b",
                            "weight_delay": True})  # fmt: skip
    elif meshes >= 2:  # (one stage per mesh, on the same meshes)
        options.append({**cut(meshes, False), "num_stages": meshes, "virtual_stages": None,
                        "schedule": "eager_1f1b", "weight_delay": True})  # fmt: skip
    return options


def _chunks_text(pc: ProfileConfig) -> str:
    v = pc.pipeline.chunks_per_mesh
    return f", {v} model stages per mesh" if v > 1 else ""


def _placement(pipeline: Any, costs: Costs) -> dict[str, Any]:
    """The `cost_*` fields that make the runtime place a schedule's delayed weight gradients
    with these (predicted) costs, as the simulator did; none where the schedule places none."""
    if not places_weights(pipeline) or min(costs.forward) <= 0 or min(costs.backward) <= 0:
        return {}
    return cost_fields(costs)


def _calibration_json(entry: dict[str, Any]) -> dict[str, Any]:
    out = {"layout": entry["layout"], "changes": entry["changes"], "cuts": entry.get("cuts")}
    if "error" in entry:
        return {**out, "error": entry["error"]}
    measured = entry["measured"]
    return {
        **out,
        "micro_batch_rows": [rows for rows, _, _ in measured],
        "step_seconds": entry["step_seconds"],
        "costs": [costs.to_json() for _, costs, _ in measured],
        "split_backward": entry["split"],
        "other_backward_costs": entry["other"] and entry["other"].to_json(),
        "step_overhead_seconds": [overhead for _, _, overhead in measured],
    }


def mesh_layouts(pc: ProfileConfig, per_host: int | None = None) -> list[dict[str, Any]]:
    """The stage-mesh layouts `--auto` calibrates (see [Note: configuration search]): the
    configured one first (no changes), then every uniform stage mesh over the layout's devices
    that fits in a host or takes whole hosts (`per_host` devices each; default the config's
    `devices_per_host`, else one host), as pipeline changes."""
    p = pc.pipeline
    meshes = p.num_meshes(pc.num_stages)
    devices = devices_needed(pc)
    per_host = per_host or p.devices_per_host or devices
    configured = p.mesh_shapes(meshes)
    out: list[dict[str, Any]] = [{}]
    for size in range(1, devices // meshes + 1):
        if (devices // meshes) % size:
            continue
        if not (per_host % size == 0 or size % per_host == 0):
            continue  # (a mesh fits in a host or takes whole hosts)
        for shape in _shapes(size, len(p.mesh_axis_names)):
            if all(s == shape for s in configured):
                continue
            out.append({"stage_mesh_shape": shape})
    return out


def _shapes(size: int, axes: int) -> list[tuple[int, ...]]:
    """Every shape of `axes` dimensions with `size` elements."""
    if axes == 1:
        return [(size,)]
    return [
        (d, *rest)
        for d in range(1, size + 1)
        if size % d == 0
        for rest in _shapes(size // d, axes - 1)
    ]


def _layout_text(pc: ProfileConfig) -> str:
    p = pc.pipeline
    shapes = p.mesh_shapes(p.num_meshes(pc.num_stages))
    if len(set(shapes)) == 1:
        return f"{len(shapes)} x {'x'.join(map(str, shapes[0]))}"
    return ", ".join("x".join(map(str, s)) for s in shapes)


def _calibration_points(pc: ProfileConfig) -> list[int]:
    """The micro-batch counts to calibrate at: the configured one and a second (twice it, or
    half, ...) that divides the batch into micro-batches the stages' batch axis splits evenly,
    so that each action's time fits `a + b * rows` (the configured one alone if none does)."""
    m = pc.pipeline.num_micro_batches
    split = _batch_split(pc)  # (a micro-batch's rows split evenly over the batch axis)
    counts = [n for n in (m, 2 * m, m // 2, m // 4, m // 8) if n >= 1]
    fits = [
        n
        for n in dict.fromkeys(counts)
        if pc.run.batch_size % n == 0
        and pc.run.batch_size // n >= 2
        and (pc.run.batch_size // n) % split == 0
    ]
    return fits[:2] or [m]


def _predict(
    costs: Costs, changes: dict[str, Any], m: int, phase: OptimizerPhase | None = None
) -> tuple[float, Any]:
    """The simulated step of `changes`' schedule at `m` micro-batches of these costs, and the
    schedule; with `phase` (the calibration's), its optimizer runs after the pipeline as
    measured there (see [Note: the optimizer after the pipeline])."""
    v = changes.get("virtual_stages") or 1
    # Placed with the costs the runtime gets (`cost_fields`), so that it runs this schedule.
    placing = placing_costs(costs)
    schedule = build_schedule(
        changes["schedule"],
        len(costs.forward) // v,
        m,
        virtual_stages=v,
        weight_delay=changes.get("weight_delay", False),
        costs=placing,
    )
    if phase is None:
        return simulate(schedule.with_apply(), costs).makespan, schedule
    return phase.predict(schedule, costs), schedule


def _batch_split(pc: ProfileConfig) -> int:
    """The rows a micro-batch needs a multiple of for every stage mesh to split it evenly (the
    least common multiple of their batch axes' sizes)."""
    p = pc.pipeline
    if p.batch_axis is None:
        return 1
    k = p.mesh_axis_names.index(p.batch_axis)
    shapes = p.mesh_shapes(p.num_meshes(pc.num_stages))
    return math.lcm(*(shape[k] for shape in shapes if k < len(shape))) if shapes else 1


def data_parallel_changes(pc: ProfileConfig) -> dict[str, Any] | None:
    """The pipeline changes for plain data parallelism on the layout's devices: one stage,
    the batch axis over every device, one micro-batch (None without a batch axis)."""
    p = pc.pipeline
    axis = p.batch_axis
    if axis is None or axis not in p.mesh_axis_names:
        return None
    devices = sum(_size(shape) for shape in p.mesh_shapes(p.num_meshes(pc.num_stages)))
    shape = tuple(devices if name == axis else 1 for name in p.mesh_axis_names)
    if pc.run.batch_size % devices:
        return None
    return {"num_stages": 1, "stage_mesh_shape": shape, "num_micro_batches": 1,
            "schedule": "1f1b", "weight_delay": False, "virtual_stages": None,
            "partition": "manual", "cuts": None}  # fmt: skip


def _size(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out
