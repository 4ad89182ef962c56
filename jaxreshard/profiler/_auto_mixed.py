"""Stage meshes of different shapes in `jaxreshard profile --auto`, ranked from the uniform
calibrations before any of them runs.

[Note: mixed stage meshes in the search]
A pipeline's stages rarely cost the same: one stage may
be worth more devices than another (Alpa's inter-operator pass assigns each stage its own
submesh for that reason). Calibrating every mix of stage meshes would cost a few steps per mix,
and the mixes grow as the mesh shapes to the power of the stage count, so the search first
estimates them from what the uniform layouts measured:
- a uniform layout calibrated with its model stages one per mesh measures each stage's F, B, W
  and apply on that mesh shape (fitted in the micro-batch rows: `CostModel`);
- a mix gives stage k the shape of one such layout, so its estimate takes stage k's costs from
  that layout, and each boundary's transfer as the slower of the two layouts' measured transfers
  there (the planner's time between two different meshes is not measured; this is an estimate
  for ranking only), and the step's fixed cost as the larger of theirs;
- the configured schedule at the configured micro-batch count is simulated with those costs.
The mixes considered use every calibrated uniform shape on every mesh, no more devices than the
layout has, and the hosts' devices in order as the runtime places them (a mesh fits in one host
or takes whole hosts); found depth first, at most `MAX_MIXES` of them (the search prints when it
stops there), and none already calibrated (a configured mixed layout). The `--auto-mixed`
best estimates are then calibrated like any layout (with `partition="auto"` choosing their own cut
when the search chooses cuts), so every prediction the search ranks and measures rests on that
layout's own measured costs. With `cuts` searched, each uniform layout was calibrated at the cut
chosen on its meshes: a mix whose meshes come from layouts cut differently gets a rougher
estimate (its stages' costs are of other layers), which the JSON marks (`same_cut: false`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jaxreshard.pipeline import Costs, build_schedule, simulate
from jaxreshard.pipeline._costs import FIRST
from jaxreshard.pipeline._schedule import ACTIVATION, GRADIENT
from jaxreshard.profiler._auto_fit import CostModel
from jaxreshard.profiler._compare import placing_costs
from jaxreshard.profiler._config import ProfileConfig
from jaxreshard.profiler._run import devices_needed

MAX_MIXES = 4096  # (placeable mixes estimated at most; the search says when it stops there)


def mixed_layouts(
    sources: Sequence[tuple[tuple[int, ...], Any, Any]],
    num_meshes: int,
    devices: int,
    per_host: int,
    schedule: str,
    weight_delay: bool,
    micro_batches: int,
    rows: int,
) -> list[dict[str, Any]]:
    """The mixes of stage meshes (see [Note: mixed stage meshes in the search]), fastest
    estimate first: `sources` are (mesh shape, fitted `CostModel`, cuts) of the uniform layouts
    calibrated with one model stage per mesh; `devices`: the layout's; `per_host`: devices per
    host; the configured `schedule`, `weight_delay` and `micro_batches` of `rows` rows. Each
    result: `stage_mesh_shape` (one shape per mesh), `estimate_seconds`, `same_cut`."""
    by_shape: dict[tuple[int, ...], tuple[Any, Any]] = {}
    for shape, model, cuts in sources:
        by_shape.setdefault(tuple(shape), (model, cuts))
    shapes = sorted(by_shape, key=lambda s: (math.prod(s), s))
    if num_meshes < 2 or len(shapes) < 2:
        return []
    out = []
    for mix in placements(shapes, num_meshes, devices, per_host):
        if len(set(mix)) == 1:
            continue
        costs, overhead = compose([by_shape[s][0] for s in mix], rows)
        schedule_of = build_schedule(schedule, num_meshes, micro_batches, virtual_stages=1,
                                     weight_delay=weight_delay,
                                     costs=placing_costs(costs))  # fmt: skip
        seconds = simulate(schedule_of.with_apply(), costs).makespan + overhead
        cuts = {_key(by_shape[s][1]) for s in mix}
        out.append({"stage_mesh_shape": [list(s) for s in mix], "estimate_seconds": seconds,
                    "same_cut": len(cuts) == 1})  # fmt: skip
    out.sort(key=lambda m: m["estimate_seconds"])
    return out


def placements(
    shapes: Sequence[tuple[int, ...]], num_meshes: int, devices: int, per_host: int
) -> list[tuple[tuple[int, ...], ...]]:
    """Every sequence of `num_meshes` of `shapes` that `placeable` allows, found depth first
    (a prefix that no longer fits ends its branch), at most `MAX_MIXES`."""
    out: list[tuple[tuple[int, ...], ...]] = []

    def walk(prefix: tuple[tuple[int, ...], ...]) -> None:
        if len(out) >= MAX_MIXES:
            return
        if len(prefix) == num_meshes:
            out.append(prefix)
            return
        for shape in shapes:
            if placeable((*prefix, shape), devices, per_host):
                walk((*prefix, shape))

    walk(())
    return out


def compose(models: Sequence[Any], rows: int) -> tuple[Costs, float]:
    """Stage k's costs from `models[k]` (each a uniform layout's `CostModel`) at `rows` rows a
    micro-batch; boundary k's transfer the slower of its two layouts' there; the step's fixed
    cost the largest. Shared parameters and the optimizer's phase after the pipeline are left
    out of this estimate: the mixes it ranks best are calibrated, which measures them."""
    at = [m.at(rows) for m in models]
    k_range = range(len(models))
    comm = tuple(max(at[k].comm[k], at[k + 1].comm[k]) for k in range(len(models) - 1))
    # The first transfer: the slower of the two layouts' whole first transfers.
    first = tuple(
        max(at[j].transfer_seconds(ACTIVATION, k, 0) for j in (k, k + 1)) - comm[k]
        for k in range(len(models) - 1)
    )
    back = tuple(
        max(at[k].transfer_seconds(GRADIENT, k), at[k + 1].transfer_seconds(GRADIENT, k))
        for k in range(len(models) - 1)
    )
    costs = Costs(
        forward=tuple(at[k].forward[k] for k in k_range),
        backward=tuple(at[k].backward[k] for k in k_range),
        weight_grad=tuple(at[k].weight_grad[k] for k in k_range),
        comm=comm,
        apply=tuple(at[k].apply[k] for k in k_range),
        host=tuple(at[k].host[k] for k in k_range),
        comm_back=back,
        comm_first=first,
        **{name: tuple(getattr(at[k], name)[k] for k in k_range) for name in FIRST},
    )
    return costs, max(m.overhead_at(rows) for m in models)


def placeable(shapes: Sequence[Sequence[int]], devices: int, per_host: int) -> bool:
    """Whether stage meshes of these shapes, taking `devices` devices in order in hosts of
    `per_host`, each fit in one host or take whole hosts (as the runtime places them)."""
    at = 0
    for shape in shapes:
        n = math.prod(shape)
        if n <= per_host:
            if at % per_host + n > per_host:
                return False
        elif at % per_host or n % per_host:
            return False
        at += n
    return at <= devices


def _key(cuts: Any) -> Any:
    return tuple(cuts) if cuts is not None else None


def mixes_of(pc: ProfileConfig, calibrated: list[dict[str, Any]], per_host: int | None) -> list:
    """The mixed stage meshes estimated from `calibrated`'s uniform layouts of one model stage
    per mesh (see [Note: mixed stage meshes in the search]), fastest first."""
    p = pc.pipeline
    if p.chunks_per_mesh != 1 or "explicit" in p.axis_types:
        return []  # (the estimate puts stage k on mesh k; Explicit axes trace one mesh shape)
    meshes = p.num_meshes(pc.num_stages)
    sources, seen = [], set()
    for entry in calibrated:
        shapes = pc.replace_pipeline(**entry["changes"]).pipeline.mesh_shapes(meshes)
        seen.add(tuple(map(tuple, shapes)))
        if "measured" in entry and entry["option"] == 0 and len(set(shapes)) == 1:
            sources.append((shapes[0], CostModel.fit(entry["measured"]), entry.get("cuts")))
    devices = devices_needed(pc)
    m = p.num_micro_batches
    mixes = mixed_layouts(sources, meshes, devices, per_host or p.devices_per_host or devices,
                          p.schedule, p.weight_delay, m, pc.run.batch_size // m)  # fmt: skip
    return [x for x in mixes if tuple(map(tuple, x["stage_mesh_shape"])) not in seen]


def mix_text(mix: dict[str, Any]) -> str:
    shapes = ", ".join("x".join(map(str, s)) for s in mix["stage_mesh_shape"])
    return f"{shapes} ({mix['estimate_seconds'] * 1e3:.1f} ms)"
