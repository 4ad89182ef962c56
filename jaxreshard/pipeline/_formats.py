"""Schedules as portable data: torch's compute-only CSV, and our timeline JSON read back.

[Note: schedule CSV]
The CSV is `torch.distributed.pipelining`'s compute-only format (`_dump_csv` / `_load_csv`):
one row per rank, one cell per action in execution order, `{stage}{kind}{micro-batch}` with
kinds `F` (forward), `B` (the whole backward), `I` (its input-gradient part) and `W` (its
weight part); an empty cell is an idle slot (ignored: the order is simulated as soon as
possible). torch's DualPipeV writes a fused forward/backward pair as one cell,
`(0F3;3B1)OVERLAP_F_B`; we read that too, and write it on request.
Our actions say `B` for the input-gradient part when a schedule splits its backward (see
`Schedule.split_backward`), so in such a schedule a CSV `I` reads as our `B`, and a whole `B`
reads as our `B` then `W`, fused (one unit that sends its gradient when it ends; see [Note:
fused actions] in `_simulate.py`). A chunk (model stage) must appear on exactly one row; rows
may hold different numbers of chunks.
"""

from __future__ import annotations

import csv
import io
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from jaxreshard.pipeline._action import APPLY, BACKWARD, FORWARD, WEIGHT, Action
from jaxreshard.pipeline._check import check_schedule
from jaxreshard.pipeline._schedule import Schedule
from jaxreshard.pipeline._simulate import ScheduleError

_CELL = re.compile(r"^(\d+)([FBIW])(\d+)$")
_PAIR = re.compile(r"^\((.*)\)OVERLAP_F_B$")
_TORCH_ONLY = ("UNSHARD", "RESHARD", "REDUCE_GRAD", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
_NOTATION = (
    "(in the grid, an action is STAGE KIND MB; B is the CSV's I when backwards are split, and a "
    "whole B shows as B then W, fused: `+`)"
)


def schedule_to_csv(schedule: Schedule, *, overlap_pairs: bool = False) -> str:
    """The schedule as torch's compute-only CSV (see [Note: schedule CSV]).

    Args:
        schedule: any schedule; `A` (apply-gradient) actions have no CSV form and are left out.
        overlap_pairs: write a fused forward + backward as torch's `(..;..)OVERLAP_F_B` cell
            (DualPipeV); by default every action gets its own cell and the pairing is lost.

    Returns:
        The CSV text, one row per rank.
    """
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for r in range(schedule.num_stages):
        row: list[str] = []
        for unit in schedule.groups(r):
            cells = _cells(unit, schedule.split_backward)
            if overlap_pairs and len(cells) == 2 and _is_pair(cells):
                row.append(f"({cells[0]};{cells[1]})OVERLAP_F_B")
            else:
                row += cells
        writer.writerow(row)
    return out.getvalue()


def _cells(unit: tuple[Action, ...], split: bool) -> list[str]:
    """A unit's cells; a `B` directly followed by its own `W` is one whole backward, `B`."""
    cells, i = [], 0
    while i < len(unit):
        a = unit[i]
        c, mb = a.stage_index, a.microbatch_index
        if a.kind == APPLY:
            pass
        elif a.kind == BACKWARD and i + 1 < len(unit) and unit[i + 1] == Action(c, WEIGHT, mb):
            cells.append(f"{c}B{mb}")
            i += 1
        elif a.kind == BACKWARD:
            cells.append(f"{c}{'I' if split else 'B'}{mb}")
        else:
            cells.append(str(a))
        i += 1
    return cells


def _is_pair(cells: list[str]) -> bool:
    kinds = [_CELL.match(cell).group(2) for cell in cells]  # type: ignore[union-attr]
    return kinds[0] == "F" and kinds[1] in "BI"


def write_csv(schedule: Schedule, path: str | Path, *, overlap_pairs: bool = False) -> Path:
    """Write `schedule_to_csv(schedule)` to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(schedule_to_csv(schedule, overlap_pairs=overlap_pairs))
    return path


def read_csv(path: str | Path, *, blocking: bool = False) -> Schedule:
    """Read and check a compute-only CSV schedule (see `schedule_from_csv`)."""
    path = Path(path)
    return schedule_from_csv(path.read_text(), name=path.stem, source=str(path), blocking=blocking)


def schedule_from_csv(
    text: str, *, name: str = "csv", source: str = "CSV", blocking: bool = False
) -> Schedule:
    """Parse and check torch's compute-only CSV (see [Note: schedule CSV]).

    Args:
        text: the CSV, one row per rank.
        name: the schedule's name.
        source: what to call the input in errors (e.g. its path).
        blocking: also require that it finishes with blocking transfers (see
            [Note: transfer semantics]); torch runs transfers asynchronously, so by default not.

    Returns:
        The checked `Schedule`; its placement (chunk -> rank) is where the rows put the chunks.

    Raises:
        ScheduleError: a cell does not parse, an action is missing or repeated, a chunk is on
            two rows, a row is empty, or the ranks wait on each other (the message names the
            actions in the cycle).
    """
    rows = list(csv.reader(io.StringIO(text)))
    while rows and not any(cell.strip() for cell in rows[-1]):
        rows.pop()
    if not rows:
        raise ScheduleError(f"{source}: no rows; expected one row of actions per rank")
    units: list[list[list[tuple[str, int, int, str]]]] = []  # rank -> unit -> (kind, c, mb, at)
    for r, row in enumerate(rows):
        rank_units = []
        for col, cell in enumerate(row):
            parsed = _parse_cell(cell.strip(), f"{source} row {r + 1} (rank {r}) cell {col + 1}")
            if parsed:
                rank_units.append(parsed)
        if not rank_units:
            raise ScheduleError(
                f"{source} row {r + 1} (rank {r}) has no actions; every rank runs at least one "
                "chunk (drop empty rows, or give the rank its chunks)"
            )
        units.append(rank_units)
    return _build(units, name=name, source=source, blocking=blocking)


def _parse_cell(cell: str, where: str) -> list[tuple[str, int, int, str]]:
    """A cell as [(kind, chunk, mb, cell)]: empty, one action, or an OVERLAP_F_B pair."""
    if not cell:
        return []
    pair = _PAIR.match(cell)
    parts = pair.group(1).split(";") if pair else [cell]
    out = []
    for part in parts:
        match = _CELL.match(part.strip())
        if not match:
            extra = (
                f"; {part.strip()!r} is a torch communication/FSDP action: give the compute-only "
                "CSV (transfers are derived from the compute actions)"
                if any(k in part for k in _TORCH_ONLY)
                else ""
            )
            raise ScheduleError(
                f"{where}: cannot parse {cell!r}: expected STAGE KIND MB with KIND one of F, B "
                f"(whole backward), I (input gradient), W (weight gradient), like '2F0' or "
                f"'1I3', an empty cell, or '(0F3;3B1)OVERLAP_F_B'{extra}"
            )
        out.append((match.group(2), int(match.group(1)), int(match.group(3)), part.strip()))
    return out


def _build(
    units: list[list[list[tuple[str, int, int, str]]]], *, name: str, source: str, blocking: bool
) -> Schedule:
    where: dict[tuple[int, str, int], list[str]] = defaultdict(list)  # (c, kind, mb) -> places
    ranks: dict[int, set[int]] = defaultdict(set)
    for r, rank_units in enumerate(units):
        for k, unit in enumerate(rank_units):
            for kind, c, mb, cell in unit:
                where[(c, kind, mb)].append(f"rank {r} action {k + 1} ({cell})")
                ranks[c].add(r)
    problems = []
    for c in sorted(ranks):
        if len(ranks[c]) > 1:
            cells = "; ".join(
                f"rank {r}: "
                + " ".join(cell for unit in units[r] for kind, c2, mb, cell in unit if c2 == c)
                for r in sorted(ranks[c])
            )
            problems.append(
                f"chunk {c} is on ranks {sorted(ranks[c])} ({cells}); a chunk (model stage) "
                "runs on one rank: put all its actions in one row"
            )
    num_chunks = 1 + max(ranks)
    m = 1 + max(mb for _, _, mb in where)
    split = any(kind in "IW" for _, kind, _ in where)
    for (c, kind, mb), places in sorted(where.items()):
        if len(places) > 1:
            problems.append(f"{c}{kind}{mb} appears {len(places)} times: {', '.join(places)}")
    missing = []
    for c in range(num_chunks):
        if c not in ranks:
            problems.append(
                f"chunk {c} has no actions, but chunks up to {num_chunks - 1} do; every model "
                "stage needs its F and backward on one rank"
            )
            continue
        for mb in range(m):
            full, part, weight = ((c, k, mb) in where for k in "BIW")
            if (c, "F", mb) not in where:
                missing.append(f"{c}F{mb}")
            if not (full or part):
                missing.append(f"{c}{'I' if split else 'B'}{mb}")
            if full and (part or weight):
                problems.append(
                    f"{c}B{mb} (the whole backward) and {c}{'I' if part else 'W'}{mb} (a part of "
                    "it) are both given: write B alone, or I and W"
                )
            elif part and not weight:
                missing.append(f"{c}W{mb}")
            elif weight and not part:
                problems.append(f"{c}W{mb} has no {c}I{mb}: a weight gradient follows its I")
    if missing:
        shown = ", ".join(missing[:12]) + (
            f" and {len(missing) - 12} more" if len(missing) > 12 else ""
        )
        problems.append(
            f"missing actions (every chunk 0..{num_chunks - 1} needs F and B, or F, I and W, "
            f"for every micro-batch 0..{m - 1}): {shown}"
        )
    if problems:
        raise ScheduleError(
            f"{source} is not a valid schedule:\n" + "".join(f"  - {p}\n" for p in problems)
        )

    actions: list[list[Action]] = []
    fused: set[Action] = set()
    for rank_units in units:
        rank: list[Action] = []
        for unit in rank_units:
            run: list[Action] = []
            for kind, c, mb, _ in unit:
                if kind == "F":
                    run.append(Action(c, FORWARD, mb))
                elif kind in "IW":
                    run.append(Action(c, BACKWARD if kind == "I" else WEIGHT, mb))
                else:
                    run.append(Action(c, BACKWARD, mb))
                    if split:  # a whole backward in a split schedule: B then W, fused
                        run.append(Action(c, WEIGHT, mb))
            fused.update(run[:-1])
            rank += run
        actions.append(rank)
    placement = tuple(min(ranks[c]) for c in range(num_chunks))
    try:
        schedule = Schedule(name, len(actions), m, split, False, actions, placement, fused)
    except ValueError as e:
        raise ScheduleError(f"{source}: {e}") from None
    try:
        check_schedule(schedule, blocking=blocking)
    except ScheduleError as e:
        note = f"\n{_NOTATION}" if split else ""
        raise ScheduleError(f"{source}: {e}{note}") from None
    return schedule


def schedule_from_json(data: dict[str, Any]) -> Schedule:
    """The schedule of a `jaxreshard-schedule/1` or `/2` timeline (the order of each rank's
    actions is their start order).

    Raises:
        ValueError: `data` is not such a timeline.
    """
    fmt = data.get("format") if isinstance(data, dict) else None
    if fmt not in ("jaxreshard-schedule/1", "jaxreshard-schedule/2"):
        raise ValueError(
            f"format={fmt!r}: expected a jaxreshard-schedule/1 or /2 timeline (written by "
            "`jaxreshard schedule ... --json`)"
        )
    actions: list[list[Action]] = []
    fused: set[Action] = set()
    for r, stage in enumerate(data["stages"]):
        rank = []
        for item in sorted(stage, key=lambda a: (a["start"], a["end"])):
            chunk = item.get("chunk", r)
            a = (
                Action(chunk, item["kind"])
                if item["kind"] == APPLY
                else Action(chunk, item["kind"], item["mb"])
            )
            rank.append(a)
            if item.get("fused"):
                fused.add(a)
        actions.append(rank)
    split = data.get("split_backward", any(a.kind == WEIGHT for rank in actions for a in rank))
    return Schedule(
        data.get("schedule", "json"),
        data["num_stages"],
        data["num_micro_batches"],
        split,
        bool(data.get("weight_delay", False)),
        actions,
        tuple(data.get("placement", ())),
        frozenset(fused),
    )
