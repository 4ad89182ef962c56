"""The schedule checker: completeness, per-stage order, dependencies and deadlock freedom."""

from __future__ import annotations

from collections import Counter

from jaxreshard.pipeline._action import APPLY, BACKWARD, FORWARD, WEIGHT, Action
from jaxreshard.pipeline._costs import Costs
from jaxreshard.pipeline._schedule import Schedule
from jaxreshard.pipeline._simulate import ScheduleError, simulate


def check_schedule(schedule: Schedule, *, blocking: bool = True) -> None:
    """Raise `ScheduleError` (with the grid, culprits marked) unless `schedule` is valid.

    Rules:
    1. Every (stage, micro-batch) has exactly one F and one B, and one W when the backward is
       split (none otherwise); actions sit on their own stage; an `A` comes last, at most once.
    2. On a stage, B of a micro-batch comes after its F (so the last stage runs F then B: the
       loss is there), and W after B.
    3. Across stages, F on s runs after F on s - 1 of that micro-batch has arrived, and B on s
       after B on s + 1 of it: the dependency graph has no cycle.
    4. With `blocking`, the schedule also finishes when every transfer blocks its sender and
       its receiver (see [Note: transfer semantics]): no deadlock.
    """
    marks: dict[Action, str] = {}
    notes: list[str] = []
    p, m = schedule.num_stages, schedule.num_micro_batches
    if len(schedule.actions) != p:
        raise ScheduleError(
            f"{schedule.describe()}: has {len(schedule.actions)} action lists, expected {p}"
        )
    expected = {FORWARD: 1, BACKWARD: 1, WEIGHT: 1 if schedule.split_backward else 0}
    for s, stage in enumerate(schedule.actions):
        counts = Counter((a.kind, a.microbatch_index) for a in stage)
        seen_at: dict[tuple[str, int], int] = {}
        for position, a in enumerate(stage):
            key = (a.kind, a.microbatch_index)
            if a.stage_index != s:
                marks[a] = f"listed on stage {s} but belongs to stage {a.stage_index}"
            elif a.kind != APPLY and not 0 <= a.microbatch_index < m:
                marks[a] = f"micro-batch {a.microbatch_index} is not in 0..{m - 1}"
            elif counts[key] > 1:
                marks[a] = f"appears {counts[key]} times on stage {s}"
            elif a.kind == WEIGHT and not schedule.split_backward:
                marks[a] = "W without a split backward"
            elif a.kind == APPLY and position != len(stage) - 1:
                marks[a] = "the apply-gradient step must come after the stage's last B/W"
            elif a.kind == BACKWARD and (FORWARD, a.mb) not in seen_at:
                marks[a] = f"B before F of micro-batch {a.mb} on stage {s}"
            elif a.kind == WEIGHT and (BACKWARD, a.mb) not in seen_at:
                marks[a] = f"W before B of micro-batch {a.mb} on stage {s}"
            seen_at.setdefault(key, position)
        for kind, want in expected.items():
            missing = [j for j in range(m) if counts[(kind, j)] == 0] if want else []
            if missing:
                shown = ", ".join(f"{s}{kind}{j}" for j in missing[:8])
                more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
                notes.append(f"stage {s} lacks {shown}{more}")
    if marks or notes:
        raise ScheduleError(
            f"{schedule.describe()} is invalid:\n"
            + "".join(f"  - {n}\n" for n in notes)
            + schedule.grid(marks)
        )
    unit = Costs.make(p, forward=1.0, backward=2.0, weight_grad=1.0, comm=1.0)
    simulate(schedule, unit, overlap=True)  # raises on a dependency cycle
    if blocking:
        simulate(schedule, unit, overlap=False)  # raises on a deadlock
