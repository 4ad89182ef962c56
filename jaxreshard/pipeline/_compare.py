"""The paper's overlap ablation, in simulation: one table of schedules under the same costs.

The costs are those of the model cut into p stages. A virtual-stage row cuts every stage into v
chunks of equal cost (a chunk's forward is the stage's / v, and so on) and charges `comm` for
every chunk boundary between two ranks (the same activation crosses more boundaries), so all
rows train the same model; its peak memory is reported in stage-micro-batches (chunk-micro-
batches / v) next to the others'.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from jaxreshard.pipeline._costs import Costs
from jaxreshard.pipeline._limits import check_counts
from jaxreshard.pipeline._schedules import build_schedule, check_virtual_stages
from jaxreshard.pipeline._simulate import simulate
from jaxreshard.pipeline._virtual import PLACEMENTS

COMPARE_FORMAT = "jaxreshard-schedule-compare/1"

# (schedule, weight_delay, overlap), in the order of the paper's ablation, then the rest.
ABLATION = (
    ("1f1b", False, False),
    ("1f1b", False, True),
    ("eager_1f1b", False, True),
    ("eager_1f1b", True, True),
    ("1f1b", True, True),
    ("zb_h1", False, True),
    ("gpipe", False, True),
    ("gpipe", True, True),
    ("interleaved_1f1b", False, True),
    ("interleaved_1f1b", True, True),
    ("eager_interleaved_1f1b", False, True),
    ("eager_interleaved_1f1b", True, True),
    ("zbv", False, True),
    ("dualpipev", False, True),
)


@dataclasses.dataclass(frozen=True)
class Row:
    schedule: str
    weight_delay: bool
    overlap: bool
    makespan: float
    bubble_fraction: float
    peak_activations: tuple[int, ...]
    virtual_stages: int = 1

    @property
    def label(self) -> str:
        text = self.schedule + (" + weight delay" if self.weight_delay else "")
        text += f" (v={self.virtual_stages})" if self.virtual_stages > 1 else ""
        return text + ("" if self.overlap else " (no overlap)")

    @property
    def peak_memory(self) -> tuple[float, ...]:
        """Peak activations per rank in whole-stage micro-batches."""
        return tuple(peak / self.virtual_stages for peak in self.peak_activations)


def chunk_costs(costs: Costs, placement: tuple[int, ...]) -> Costs:
    """Per-stage `costs` spread over chunks: each chunk gets its rank's compute (and the
    first micro-batch's extra compute) / v and host time; a chunk boundary between neighbour
    ranks costs their boundary's `comm` (and `comm_back`, `comm_first`), one between other
    ranks (the interleaved ring's p - 1 -> 0) the largest (its first transfer the largest
    whole first transfer). Shared parameters are per stage and left out."""
    v = len(placement) // costs.num_stages

    def comm(a: int, b: int, of: tuple[float, ...] = costs.comm) -> float:
        if a == b:
            return 0.0  # local: never charged
        return of[min(a, b)] if abs(a - b) == 1 else max(of, default=0.0)

    def back(a: int, b: int) -> float:
        return comm(a, b, costs.comm if costs.comm_back is None else costs.comm_back)

    def first(a: int, b: int) -> float:
        if abs(a - b) != 1:  # (the largest whole first transfer, less the largest comm)
            whole = [c + f for c, f in zip(costs.comm, costs.comm_first)]
            return comm(a, b, tuple(whole)) - comm(a, b)
        return comm(a, b, costs.comm_first)

    return Costs.make(
        len(placement),
        forward=[costs.forward[r] / v for r in placement],
        backward=[costs.backward[r] / v for r in placement],
        weight_grad=[costs.weight_grad[r] / v for r in placement],
        comm=[comm(a, b) for a, b in itertools.pairwise(placement)],
        apply=[costs.apply[r] / v for r in placement],
        host=[costs.host[r] for r in placement],
        comm_back=[back(a, b) for a, b in itertools.pairwise(placement)],
        comm_first=[first(a, b) for a, b in itertools.pairwise(placement)],
        forward_first=[costs.forward_first[r] / v for r in placement],
        backward_first=[costs.backward_first[r] / v for r in placement],
        weight_grad_first=[costs.weight_grad_first[r] / v for r in placement],
    )


def compare_schedules(
    num_stages: int, num_micro_batches: int, costs: Costs, *, virtual_stages: int = 2
) -> list[Row]:
    """Simulate every schedule of `ABLATION` under `costs` (per stage; see the module note);
    interleaved rows use `virtual_stages` chunks per rank, ZB-V and DualPipeV two."""
    for arg, value in (("num_stages", num_stages), ("num_micro_batches", num_micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg}={value!r} must be an int >= 1")
    check_virtual_stages("interleaved_1f1b", virtual_stages)
    check_counts(  # every row's schedule, as large as the largest, before any is made
        f"compare with {num_stages:,} stages x {virtual_stages} virtual stages and "
        f"{num_micro_batches:,} micro-batches ({len(ABLATION)} schedules, counted as "
        f"{len(ABLATION)} x the micro-batches)",
        num_stages * max(virtual_stages, 2),
        num_micro_batches * len(ABLATION),
        3,
        "use fewer stages, virtual stages or micro-batches",
    )
    rows = []
    for name, weight_delay, overlap in ABLATION:
        v = virtual_stages if "interleaved" in name else check_virtual_stages(name, None)
        own = chunk_costs(costs, PLACEMENTS[name](num_stages, v)) if name in PLACEMENTS else costs
        schedule = build_schedule(
            name,
            num_stages,
            num_micro_batches,
            virtual_stages=v,
            weight_delay=weight_delay,
            costs=own,
            overlap=overlap,
        )
        timeline = simulate(schedule, own, overlap=overlap)
        rows.append(
            Row(
                name,
                weight_delay,
                overlap,
                timeline.makespan,
                timeline.bubble_fraction,
                timeline.peak_activations,
                v,
            )
        )
    return rows


def _reference(rows: list[Row]) -> Row:
    return next(r for r in rows if r.schedule == "1f1b" and r.overlap and not r.weight_delay)


def compare_json(
    num_stages: int, num_micro_batches: int, costs: Costs, rows: list[Row]
) -> dict[str, Any]:
    ref = _reference(rows)
    return {
        "format": COMPARE_FORMAT,
        "num_stages": num_stages,
        "num_micro_batches": num_micro_batches,
        "costs": costs.to_json(),
        "rows": [
            {
                "schedule": r.schedule,
                "weight_delay": r.weight_delay,
                "overlap": r.overlap,
                "virtual_stages": r.virtual_stages,
                "makespan": r.makespan,
                "speedup_vs_1f1b": ref.makespan / r.makespan if r.makespan else 1.0,
                "makespan_reduction_vs_1f1b": 1 - r.makespan / ref.makespan
                if ref.makespan
                else 0.0,
                "bubble_fraction": r.bubble_fraction,
                "peak_activations": list(r.peak_activations),
                "peak_memory": list(r.peak_memory),
            }
            for r in rows
        ],
    }


def compare_table(rows: list[Row], title: str = "") -> Any:
    from rich.table import Table

    ref = _reference(rows)
    table = Table(title=title)
    columns = ("schedule", "makespan", "vs 1f1b", "lower by", "bubble", "peak act. per stage")
    for column in columns:
        table.add_column(column, justify="left" if column == "schedule" else "right")
    for r in rows:
        table.add_row(
            r.label,
            f"{r.makespan:.4g}",
            f"{ref.makespan / r.makespan:.2f}x" if r.makespan else "-",
            f"{1 - r.makespan / ref.makespan:+.1%}" if ref.makespan else "-",
            f"{r.bubble_fraction:.1%}",
            " ".join(f"{x:g}" for x in r.peak_memory),
        )
    return table
