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
import dataclasses
import io
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from jaxreshard import _files
from jaxreshard._files import MISSING, InputError, key_path, show
from jaxreshard.pipeline import _limits
from jaxreshard.pipeline._action import APPLY, BACKWARD, FORWARD, KINDS, WEIGHT, Action
from jaxreshard.pipeline._check import check_schedule
from jaxreshard.pipeline._schedule import Schedule
from jaxreshard.pipeline._simulate import ScheduleError

_CELL = re.compile(r"^([0-9]+)([FBIW])([0-9]+)$")
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
    """Read and check a compute-only CSV schedule (see `schedule_from_csv`).

    Raises:
        ValueError: the file cannot be read as text (missing, a directory, binary, not UTF-8,
            empty, over `MAX_CSV_BYTES`; see [Note: hostile input] in `jaxreshard/_files.py`),
            or is not a valid schedule (`ScheduleError`).
    """
    text = _files.read_text(
        path,
        what="schedule CSV",
        max_bytes=_limits.MAX_CSV_BYTES,
        expected="one row of actions per rank, like '0F0,0B0'",
    )
    return schedule_from_csv(text, name=Path(path).stem, source=str(path), blocking=blocking)


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
            two rows, a row is empty, the ranks wait on each other (the message names the
            actions in the cycle), or the counts are past [Note: schedule size limits] (refused
            at the first cell that goes past them, before anything that large is built).
    """
    if not isinstance(text, str):
        raise ScheduleError(f"{source}: expected the CSV as text (str), got {type(text).__name__}")
    cells = text.count(",") + text.count("\n") + text.count("\r") + 1
    if cells > 2 * _limits.MAX_ACTIONS:
        raise ScheduleError(
            f"{source}: {cells:,} cells (commas and line ends); a schedule CSV has at most "
            f"{2 * _limits.MAX_ACTIONS:,} (twice jaxreshard.pipeline._limits.MAX_ACTIONS, "
            "idle cells included): give a smaller schedule"
        )
    reader = csv.reader(io.StringIO(text, newline=None))
    size = _Size()
    units: list[list[list[tuple[str, int, int, str]]]] = []  # rank -> unit -> (kind, c, mb, at)
    try:
        for r, row in enumerate(reader):
            if r >= _limits.MAX_CHUNKS:
                raise ScheduleError(
                    f"{source}: more than {_limits.MAX_CHUNKS:,} rows (ranks); at most "
                    f"{_limits.MAX_CHUNKS:,} (jaxreshard.pipeline._limits.MAX_CHUNKS)"
                )
            rank_units = []
            for col, cell in enumerate(row):
                where = f"{source} row {r + 1} (rank {r}) cell {col + 1}"
                parsed = _parse_cell(cell.strip(), where, size)
                if parsed:
                    rank_units.append(parsed)
            units.append(rank_units)
    except csv.Error as e:
        raise ScheduleError(
            f"{source} row {reader.line_num}: not CSV ({e}); expected comma-separated cells "
            "like '0F0,0B0', one row per rank"
        ) from None
    while units and not units[-1]:
        units.pop()
    if not units:
        raise ScheduleError(f"{source}: no rows; expected one row of actions per rank")
    for r, rank_units in enumerate(units):
        if not rank_units:
            raise ScheduleError(
                f"{source} row {r + 1} (rank {r}) has no actions; every rank runs at least one "
                "chunk (drop empty rows, or give the rank its chunks)"
            )
    return _build(units, name=name, source=source, blocking=blocking)


class _Size:
    """The largest stage and micro-batch read so far: a cell that makes the schedule too large
    is refused as it is read (see [Note: schedule size limits])."""

    def __init__(self) -> None:
        self.chunks = self.micro_batches = 1
        self.kinds = 2

    def add(self, cell: str, where: str, kind: str, c: int, mb: int) -> None:
        kinds = 3 if kind in "IW" else self.kinds
        chunks, micro_batches = max(self.chunks, c + 1), max(self.micro_batches, mb + 1)
        if (chunks, micro_batches, kinds) == (self.chunks, self.micro_batches, self.kinds):
            return
        if _limits.too_large(chunks, micro_batches, kinds):
            grew = [f"stage {c}"] if c + 1 > self.chunks else []
            grew += [f"micro-batch {mb}"] if mb + 1 > self.micro_batches else []
            grew += ["a split backward (I or W)"] if kinds > self.kinds else []
            raise ScheduleError(
                f"{where} {show(cell)}: {' and '.join(grew)} would make a schedule of "
                f"{_limits.action_limit_message(chunks, micro_batches, kinds)}; number stages "
                "and micro-batches from 0 without gaps"
            )
        self.chunks, self.micro_batches, self.kinds = chunks, micro_batches, kinds


def _parse_cell(cell: str, where: str, size: _Size) -> list[tuple[str, int, int, str]]:
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
                f"; {show(part.strip())} is a torch communication/FSDP action: give the "
                "compute-only CSV (transfers are derived from the compute actions)"
                if any(k in part for k in _TORCH_ONLY)
                else ""
            )
            raise ScheduleError(
                f"{where}: cannot parse {show(cell)}: expected STAGE KIND MB with KIND one of F, "
                f"B (whole backward), I (input gradient), W (weight gradient), like '2F0' or "
                f"'1I3', an empty cell, or '(0F3;3B1)OVERLAP_F_B'{extra}"
            )
        digits = max(len(match.group(1)), len(match.group(3)))
        if digits > _limits.MAX_INDEX_DIGITS:
            raise ScheduleError(
                f"{where}: {show(cell)} has an index of {digits} digits; stages and "
                f"micro-batches have at most {_limits.MAX_INDEX_DIGITS} (a schedule holds at "
                f"most {_limits.MAX_ACTIONS:,} actions)"
            )
        kind, c, mb = match.group(2), int(match.group(1)), int(match.group(3))
        size.add(cell, where, kind, c, mb)
        out.append((kind, c, mb, part.strip()))
    return out


_MOST = 12  # problems, or missing actions, named in one error


def _shown(items: list[str], total: int | None = None) -> str:
    total = len(items) if total is None else total
    more = f" and {total - _MOST} more" if total > _MOST else ""
    return ", ".join(items[:_MOST]) + more


def _build(
    units: list[list[list[tuple[str, int, int, str]]]], *, name: str, source: str, blocking: bool
) -> Schedule:
    where: dict[tuple[int, str, int], list[str]] = defaultdict(list)  # (c, kind, mb) -> places
    ranks: dict[int, set[int]] = defaultdict(set)
    for r, rank_units in enumerate(units):
        for k, unit in enumerate(rank_units):
            for kind, c, mb, cell in unit:
                places = where[(c, kind, mb)]
                if len(places) < 3:  # enough to name; a hostile file may repeat one cell a lot
                    places.append(f"rank {r} action {k + 1} ({cell})")
                else:
                    places.append("")
                ranks[c].add(r)
    problems = []
    shared = [c for c in sorted(ranks) if len(ranks[c]) > 1]
    for c in shared[:4]:
        cells = "; ".join(
            f"rank {r}: "
            + " ".join(cell for unit in units[r] for kind, c2, mb, cell in unit if c2 == c)
            for r in sorted(ranks[c])[:4]
        )
        problems.append(
            f"chunk {c} is on ranks {sorted(ranks[c])} ({cells}); a chunk (model stage) "
            "runs on one rank: put all its actions in one row"
        )
    if len(shared) > 4:
        problems.append(f"and {len(shared) - 4} more chunks are on several ranks")
    num_chunks = 1 + max(ranks)
    m = 1 + max(mb for _, _, mb in where)
    split = any(kind in "IW" for _, kind, _ in where)
    repeated = [(key, places) for key, places in sorted(where.items()) if len(places) > 1]
    for (c, kind, mb), places in repeated[:_MOST]:
        named = ", ".join(p for p in places if p) + (", ..." if len(places) > 3 else "")
        problems.append(f"{c}{kind}{mb} appears {len(places)} times: {named}")
    if len(repeated) > _MOST:
        problems.append(f"and {len(repeated) - _MOST} more actions appear several times")
    absent = [c for c in range(num_chunks) if c not in ranks]  # at most MAX_CHUNKS
    for c in absent[:4]:
        problems.append(
            f"chunk {c} has no actions, but chunks up to {num_chunks - 1} do; every model "
            "stage needs its F and backward on one rank"
        )
    if len(absent) > 4:
        problems.append(f"and {len(absent) - 4} more chunks have no actions")
    # Counted per chunk from the actions given, so that the work is linear in the file even
    # when the largest micro-batch is far beyond the actions (see [Note: schedule size limits]).
    forwards: Counter[int] = Counter()
    backwards: dict[int, set[int]] = defaultdict(set)  # micro-batches with a B or an I
    inputs: dict[int, set[int]] = defaultdict(set)  # with an I
    weights: dict[int, set[int]] = defaultdict(set)  # with a W
    conflicts, lone_weights = [], []
    for c, kind, mb in sorted(where):
        if kind == "F":
            forwards[c] += 1
        elif kind in "BI":
            backwards[c].add(mb)
            if kind == "I":
                inputs[c].add(mb)
        else:
            weights[c].add(mb)
        if kind == "B" and ((c, "I", mb) in where or (c, "W", mb) in where):
            other = "I" if (c, "I", mb) in where else "W"
            conflicts.append(
                f"{c}B{mb} (the whole backward) and {c}{other}{mb} (a part of it) are both "
                "given: write B alone, or I and W"
            )
        elif kind == "W" and (c, "I", mb) not in where:
            lone_weights.append(f"{c}W{mb} has no {c}I{mb}: a weight gradient follows its I")
    for found, what in ((conflicts, "whole and split backwards"), (lone_weights, "lone Ws")):
        problems += found[:_MOST]
        if len(found) > _MOST:
            problems.append(f"and {len(found) - _MOST} more {what}")
    missing: list[str] = []
    num_missing = 0
    for c in sorted(ranks):
        lacking = (m - forwards[c]) + (m - len(backwards[c])) + len(inputs[c] - weights[c])
        if not lacking:
            continue
        num_missing += lacking
        for mb in range(m):  # stops after _MOST: passes only present ones before
            if len(missing) >= _MOST:
                break
            full, part, weight = ((c, k, mb) in where for k in "BIW")
            if (c, "F", mb) not in where:
                missing.append(f"{c}F{mb}")
            if not (full or part):
                missing.append(f"{c}{'I' if split else 'B'}{mb}")
            elif part and not weight:
                missing.append(f"{c}W{mb}")
    if num_missing:
        problems.append(
            f"missing actions (every chunk 0..{num_chunks - 1} needs F and B, or F, I and W, "
            f"for every micro-batch 0..{m - 1}): {_shown(missing, num_missing)}"
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


SCHEDULE_FORMATS = ("jaxreshard-schedule/1", "jaxreshard-schedule/2")
_KEYS = ("kind", "mb", "chunk", "start", "end", "fused")


def read_json(path: str | Path, *, blocking: bool = False) -> Schedule:
    """Read and check a `jaxreshard-schedule/1` or `/2` timeline file (`schedule_from_json`).

    Raises:
        ValueError: the file cannot be read as JSON (see [Note: hostile input] in
            `jaxreshard/_files.py`; at most `MAX_JSON_BYTES`), or is not such a timeline.
    """
    return read_json_with_costs(path, blocking=blocking)[0]


def read_json_with_costs(path: str | Path, *, blocking: bool = False) -> tuple[Schedule, Any]:
    """`read_json`, and the `Costs` the timeline was simulated with (None if it has none)."""
    data = _files.read_json(
        path,
        what="schedule JSON",
        max_bytes=_limits.MAX_JSON_BYTES,
        expected="a jaxreshard-schedule/2 timeline, as `jaxreshard schedule ... --json` writes",
    )
    schedule = schedule_from_json(data, source=str(path), blocking=blocking)
    return schedule, costs_from_json(data.get("costs"), schedule.num_chunks, str(path))


def _shared_cost(value: Any) -> Any:
    """One `SharedCost` from its `to_json` form."""
    from jaxreshard.pipeline._costs import SharedCost

    fields = ("owner", "user", "seconds", "grad", "back")
    if not isinstance(value, dict) or not set(fields[:3]) <= set(value):
        raise ValueError(
            f"shared entry {show(value)} must be an object with owner, user, seconds (and grad, "
            "back)"
        )
    unknown = sorted(set(value) - set(fields), key=str)
    if unknown:
        raise ValueError(
            f"shared entry {show(value)} has unknown key {show(unknown[0])}; its keys are "
            "owner, user, seconds, grad and back"
        )
    owner, user, seconds, grad = (value.get(k, True) for k in fields[:4])
    back = value.get("back")
    for name, x in (("owner", owner), ("user", user)):
        if isinstance(x, bool) or not isinstance(x, int):
            raise ValueError(f"shared entry's {name}={show(x)} must be a chunk index")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ValueError(f"shared entry's seconds={show(seconds)} must be a number")
    if not isinstance(grad, bool):
        raise ValueError(f"shared entry's grad={show(grad)} must be true or false")
    if back is not None and (isinstance(back, bool) or not isinstance(back, (int, float))):
        raise ValueError(f"shared entry's back={show(back)} must be a number")
    return SharedCost(owner, user, float(seconds), grad, None if back is None else float(back))


def costs_from_json(value: Any, num_chunks: int, source: str) -> Any:
    """The `costs` of a timeline (per chunk; `Costs.to_json`'s form), checked; None if absent."""
    from jaxreshard.pipeline._costs import Costs

    if value is None:
        return None
    where = f"{source}: costs"
    costs = _files.expect_dict(value, where, "the costs the timeline was simulated with")
    keys = (
        "forward",
        "backward",
        "weight_grad",
        "comm",
        "apply",
        "host",
        "comm_back",
        "comm_first",
        "forward_first",
        "backward_first",
        "weight_grad_first",
    )
    _files.reject_unknown_keys(costs, (*keys, "shared"), where)
    try:
        made = Costs.make(num_chunks, **{k: costs[k] for k in keys if k in costs})
        shared = costs.get("shared", [])
        if not isinstance(shared, list):
            raise ValueError(f"shared={show(shared)} must be a list")
        return dataclasses.replace(made, shared=tuple(_shared_cost(x) for x in shared))
    except (ValueError, TypeError) as e:
        raise _files.InputError(f"{where}: {e}; fix the file, or give the costs as flags") from None


def schedule_from_json(
    data: Any, *, source: str = "schedule JSON", blocking: bool = False
) -> Schedule:
    """The checked schedule of a `jaxreshard-schedule/1` or `/2` timeline (the order of each
    rank's actions is their start order).

    Args:
        data: the parsed JSON.
        source: what to call the input in errors (e.g. its path).
        blocking: also require that it finishes with blocking transfers (as `read_csv`).

    Raises:
        ValueError: `data` is not such a timeline: the message names the key path (e.g.
            `stages[1][3].mb`), the value, the rule and the fix; counts past [Note: schedule
            size limits] are refused before the actions are read; `ScheduleError` when the
            actions do not make a valid schedule.
    """
    fmt = data.get("format") if isinstance(data, dict) else None
    if fmt not in SCHEDULE_FORMATS:
        newer = (
            "; it is a newer version than this jaxreshard reads: upgrade jaxreshard"
            if isinstance(fmt, str) and fmt.startswith("jaxreshard-schedule/")
            else ""
        )
        got = f"format={show(fmt)}" if isinstance(data, dict) else f"{_what(data)}"
        raise InputError(
            f"{source}: {got}: expected a jaxreshard-schedule/1 or /2 timeline (written by "
            f"`jaxreshard schedule ... --json`){newer}"
        )

    def at(*keys: str | int) -> str:
        return key_path(source, *keys)

    p = _files.expect_int(
        data.get("num_stages", MISSING), at("num_stages"), low=1, high=_limits.MAX_CHUNKS
    )
    m = _files.expect_int(
        data.get("num_micro_batches", MISSING),
        at("num_micro_batches"),
        low=1,
        high=_limits.MAX_ACTIONS,
    )
    stages = _files.expect_list(
        data.get("stages", MISSING), at("stages"), "one list of actions per rank"
    )
    if len(stages) != p:
        raise InputError(
            f"{at('stages')} has {len(stages)} lists, but num_stages is {p}; give one list of "
            "actions per rank"
        )
    placement = data.get("placement", [])
    _files.expect_list(placement, at("placement"), "the rank of each chunk", _limits.MAX_CHUNKS)
    for c, rank in enumerate(placement):
        _files.expect_int(rank, at("placement", c), high=p - 1)
    total = 0
    for r, stage in enumerate(stages):
        total += len(_files.expect_list(stage, at("stages", r), "a list of actions"))
        if total > _limits.MAX_ACTIONS:
            raise InputError(
                f"{at('stages')}: more than {_limits.MAX_ACTIONS:,} actions (at rank {r}): "
                f"{_limits.estimate(total)}; at most {_limits.MAX_ACTIONS:,} "
                "(jaxreshard.pipeline._limits.MAX_ACTIONS)"
            )
    split = data.get("split_backward")
    name = _files.expect_str(data.get("schedule", "json"), at("schedule"))
    weight_delay = _files.expect_bool(data.get("weight_delay", False), at("weight_delay"))
    actions: list[list[Action]] = []
    fused: set[Action] = set()
    for r, stage in enumerate(stages):
        timed = []
        for i, item in enumerate(stage):
            a, start, end, is_fused = _json_action(item, r, at("stages", r, i))
            timed.append((start, end, a))
            if is_fused:
                fused.add(a)
        timed.sort(key=lambda t: (t[0], t[1]))  # stable: ties keep the file's order
        actions.append([a for _, _, a in timed])
    if split is None:
        split = any(a.kind == WEIGHT for rank in actions for a in rank)
    split = _files.expect_bool(split, at("split_backward"))
    try:
        schedule = Schedule(
            name, p, m, split, weight_delay, actions, tuple(placement), frozenset(fused)
        )
    except ValueError as e:
        raise ScheduleError(f"{source}: {e}") from None
    try:
        check_schedule(schedule, blocking=blocking)
    except ScheduleError as e:
        raise ScheduleError(f"{source}: {e}") from None
    return schedule


def _json_action(item: Any, rank: int, where: str) -> tuple[Action, float, float, bool]:
    """One entry of `stages[r]`: (action, start, end, fused)."""
    _files.expect_dict(item, where, 'an action like {"kind": "F", "mb": 0, ...}')
    for key in ("kind", "start", "end"):
        if key not in item:
            raise InputError(f"{where} lacks the key {key!r}; an action has {', '.join(_KEYS)}")
    kind = item["kind"]
    if kind not in KINDS:
        raise InputError(
            f"{where}.kind = {show(kind)}; expected one of {', '.join(map(repr, KINDS))}"
        )
    chunk = _files.expect_int(item.get("chunk", rank), f"{where}.chunk", high=_limits.MAX_CHUNKS)
    if kind == APPLY:
        if item.get("mb") is not None:
            raise InputError(f"{where}.mb = {show(item['mb'])}; an A (apply) action has mb null")
        mb = -1
    else:
        mb = _files.expect_int(item.get("mb", MISSING), f"{where}.mb", high=_limits.MAX_ACTIONS)
    start = _files.expect_number(item["start"], f"{where}.start", low=None)
    end = _files.expect_number(item["end"], f"{where}.end", low=start)
    fused = _files.expect_bool(item.get("fused", False), f"{where}.fused")
    return Action(chunk, kind, mb), start, end, fused


def _what(value: Any) -> str:
    return f"the JSON is {type(value).__name__} {show(value)}, not an object"
