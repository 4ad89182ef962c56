"""The paper's overlap ablation, in simulation: one table of schedules under the same costs."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxreshard.pipeline._costs import Costs
from jaxreshard.pipeline._schedules import build_schedule
from jaxreshard.pipeline._simulate import simulate

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
)


@dataclasses.dataclass(frozen=True)
class Row:
    schedule: str
    weight_delay: bool
    overlap: bool
    makespan: float
    bubble_fraction: float
    peak_activations: tuple[int, ...]

    @property
    def label(self) -> str:
        text = self.schedule + (" + weight delay" if self.weight_delay else "")
        return text + ("" if self.overlap else " (no overlap)")


def compare_schedules(num_stages: int, num_micro_batches: int, costs: Costs) -> list[Row]:
    """Simulate every schedule of `ABLATION` under `costs`."""
    rows = []
    for name, weight_delay, overlap in ABLATION:
        schedule = build_schedule(
            name,
            num_stages,
            num_micro_batches,
            weight_delay=weight_delay,
            costs=costs,
            overlap=overlap,
        )
        timeline = simulate(schedule, costs, overlap=overlap)
        rows.append(
            Row(
                name,
                weight_delay,
                overlap,
                timeline.makespan,
                timeline.bubble_fraction,
                timeline.peak_activations,
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
                "makespan": r.makespan,
                "speedup_vs_1f1b": ref.makespan / r.makespan if r.makespan else 1.0,
                "makespan_reduction_vs_1f1b": 1 - r.makespan / ref.makespan
                if ref.makespan
                else 0.0,
                "bubble_fraction": r.bubble_fraction,
                "peak_activations": list(r.peak_activations),
            }
            for r in rows
        ],
    }


def compare_table(rows: list[Row], title: str = "") -> Any:
    from rich.table import Table

    ref = _reference(rows)
    table = Table(title=title)
    for column in ("schedule", "makespan", "vs 1f1b", "lower by", "bubble", "peak act. per stage"):
        table.add_column(column, justify="left" if column == "schedule" else "right")
    for r in rows:
        table.add_row(
            r.label,
            f"{r.makespan:.4g}",
            f"{ref.makespan / r.makespan:.2f}x" if r.makespan else "-",
            f"{1 - r.makespan / ref.makespan:+.1%}" if ref.makespan else "-",
            f"{r.bubble_fraction:.1%}",
            " ".join(map(str, r.peak_activations)),
        )
    return table
