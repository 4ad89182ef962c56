"""The schedule checker: completeness, per-rank order, dependencies and deadlock freedom."""

from __future__ import annotations

from collections import Counter

from jaxreshard.pipeline._action import APPLY, BACKWARD, FORWARD, WEIGHT, Action
from jaxreshard.pipeline._costs import Costs
from jaxreshard.pipeline._schedule import Schedule
from jaxreshard.pipeline._simulate import ScheduleError, simulate


def check_schedule(schedule: Schedule, *, blocking: bool | None = None) -> None:
    """Raise `ScheduleError` (with the grid, culprits marked) unless `schedule` is valid.

    Rules (a chunk is a model stage, see [Note: chunks and ranks]; with v = 1, chunk = stage =
    rank):
    1. Every (chunk, micro-batch) has exactly one F and one B, and one W when the backward is
       split (none otherwise); actions sit on their chunk's rank; `A`s come last on a rank, at
       most one per chunk; a fused action has a next action on its rank.
    2. On a rank, B of a micro-batch comes after its F on that chunk (so the last chunk runs F
       then B: the loss is there), and W after B.
    3. Across chunks, F on c runs after F on c - 1 of that micro-batch has arrived, and B on c
       after B on c + 1 of it: the dependency graph has no cycle.
    4. With `blocking`, the schedule also finishes when every transfer between ranks blocks its
       sender and its receiver (see [Note: transfer semantics]): no deadlock. By default
       (None) only schedules with one chunk per rank and nothing fused are held to it: the
       virtual-stage schedules are made for asynchronous transfers (as torch, Megatron-LM's
       interleaved schedule with its own batching, and DualPipe run them), and most deadlock
       under the blocking batches of 1F1B.
    """
    marks: dict[Action, str] = {}
    notes: list[str] = []
    p, m, n = schedule.num_stages, schedule.num_micro_batches, schedule.num_chunks
    word = "stage" if schedule.virtual_stages == 1 else "rank"
    if len(schedule.actions) != p:
        raise ScheduleError(
            f"{schedule.describe()}: has {len(schedule.actions)} action lists, expected {p}"
        )
    expected = {FORWARD: 1, BACKWARD: 1, WEIGHT: 1 if schedule.split_backward else 0}
    for r, stage in enumerate(schedule.actions):
        counts = Counter((a.stage_index, a.kind, a.microbatch_index) for a in stage)
        seen: set[tuple[int, str, int]] = set()
        tail = max((i + 1 for i, a in enumerate(stage) if a.kind != APPLY), default=0)
        for position, a in enumerate(stage):
            key = (a.stage_index, a.kind, a.microbatch_index)
            if a.stage_index >= n:
                marks[a] = f"chunk {a.stage_index} is not in 0..{n - 1}"
            elif schedule.rank_of(a.stage_index) != r:
                owner = schedule.rank_of(a.stage_index)
                marks[a] = (
                    f"listed on stage {r} but belongs to stage {owner}"
                    if word == "stage"
                    else f"listed on rank {r} but chunk {a.stage_index} runs on rank {owner}"
                )
            elif a.kind != APPLY and not 0 <= a.microbatch_index < m:
                marks[a] = f"micro-batch {a.microbatch_index} is not in 0..{m - 1}"
            elif counts[key] > 1:
                marks[a] = f"appears {counts[key]} times on {word} {r}"
            elif a.kind == WEIGHT and not schedule.split_backward:
                marks[a] = "W without a split backward"
            elif a.kind == APPLY and position < tail:
                marks[a] = f"the apply-gradient step must come after the {word}'s last B/W"
            elif a.kind == BACKWARD and (a.stage_index, FORWARD, a.mb) not in seen:
                marks[a] = f"B before F of micro-batch {a.mb} on {word} {r}"
            elif a.kind == WEIGHT and (a.stage_index, BACKWARD, a.mb) not in seen:
                marks[a] = f"W before B of micro-batch {a.mb} on {word} {r}"
            elif a in schedule.fused and position == len(stage) - 1:
                marks[a] = "fused with the next action, but it is the last one"
            seen.add(key)
        # Micro-batches present per (chunk, kind): the missing ones are found without a scan
        # of all m (m may be far larger than the actions given).
        present: dict[tuple[int, str], int] = Counter(
            (c, kind) for c, kind, j in counts if 0 <= j < m
        )
        for c in schedule.chunks_of(r):
            for kind, want in expected.items():
                if not want or present[(c, kind)] == m:
                    continue
                missing = _first_missing(counts, c, kind, m, 8)
                shown = ", ".join(f"{c}{kind}{j}" for j in missing)
                left = m - present[(c, kind)] - len(missing)
                notes.append(f"{word} {r} lacks {shown}" + (f" and {left} more" if left else ""))
    if len(notes) > 16:
        notes[16:] = [f"and {len(notes) - 16} more lines like these"]
    if marks or notes:
        raise ScheduleError(
            f"{schedule.describe()} is invalid:\n"
            + "".join(f"  - {note}\n" for note in notes)
            + schedule.grid(marks)
        )
    unit = Costs.make(n, forward=1.0, backward=2.0, weight_grad=1.0, comm=1.0)
    simulate(schedule, unit, overlap=True)  # raises on a dependency cycle
    if blocking is None:
        blocking = schedule.virtual_stages == 1 and not schedule.fused
    if blocking:
        simulate(schedule, unit, overlap=False)  # raises on a deadlock


def _first_missing(counts: Counter, chunk: int, kind: str, m: int, most: int) -> list[int]:
    """The first `most` micro-batches of `chunk` without a `kind` action: a scan that stops
    after them (it passes only present ones before)."""
    out: list[int] = []
    for j in range(m):
        if counts[(chunk, kind, j)] == 0:
            out.append(j)
            if len(out) == most:
                break
    return out
