"""Pictures of a timeline: a terminal grid, a Chrome trace (Perfetto), a PNG (matplotlib).

All three take a `Timeline`, simulated or measured, so a real run looks like its simulation.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from jaxreshard.pipeline._action import APPLY
from jaxreshard.pipeline._simulate import Timeline

COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#8172B3", "A": "#7F7F7F"}
IDLE = "."


def _label(action: Any, chunks: bool = False) -> str:
    """`F3` (kind, micro-batch); with virtual stages the chunk leads: `5F3`."""
    if chunks:
        return str(action)
    return action.kind if action.kind == APPLY else f"{action.kind}{action.microbatch_index}"


def _row_names(timeline: Timeline) -> list[str]:
    """`stage s`, or with virtual stages `rank r` (its chunks are in the action labels)."""
    sched = timeline.schedule
    if sched.virtual_stages == 1:
        return [f"stage {s}" for s in range(len(timeline.stages))]
    return [f"rank {r}" for r in range(len(timeline.stages))]


def _rank(timeline: Timeline, chunk: int) -> int:
    sched = timeline.schedule
    return sched.rank_of(chunk) if 0 <= chunk < sched.num_chunks else chunk


def _shade(color: str, level: int, levels: int) -> str:
    """`color` lightened for a rank's later chunks (level 0 is the colour itself)."""
    if levels <= 1 or level == 0:
        return color
    mix = 0.55 * level / (levels - 1)
    rgb = [int(color[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * mix):02x}" for c in rgb)


def format_timeline(timeline: Timeline, *, max_width: int = 160) -> str:
    """A time-aligned text grid: one row per stage, each action drawn over its duration.

    The scale gives the shortest action room for its label (e.g. `F12`, or `5F12` with virtual
    stages) when the whole step fits in `max_width` columns; otherwise actions shrink and labels
    are cut.
    """
    actions = [t for stage in timeline.stages for t in stage]
    if not actions:
        return ""
    chunks = timeline.schedule.virtual_stages > 1
    names = _row_names(timeline)
    origin = min(t.start for t in actions)
    span = max(t.end for t in actions) - origin
    shortest = min((t.end - t.start for t in actions if t.end > t.start), default=1.0)
    label_width = max(len(_label(t.action, chunks)) for t in actions) + 1
    scale = label_width / shortest
    if span * scale > max_width:
        scale = max_width / span if span > 0 else 1.0
    columns = max(1, math.ceil(span * scale - 1e-9))
    lines = []
    for s, stage in enumerate(timeline.stages):
        row = [IDLE] * columns
        for t in stage:
            a = min(columns, round((t.start - origin) * scale))
            b = min(columns, max(a + 1, round((t.end - origin) * scale)))
            text = _label(t.action, chunks)[: b - a].ljust(b - a, "-")
            row[a:b] = list(text[: b - a])
            if b - a > 1:
                row[b - 1] = "|"
        lines.append(f"{names[s]} |{''.join(row)}")
    unit = 1 / scale
    lines.append(f"(one column = {unit:.3g} time units; '{IDLE}' idle; makespan {span:.4g})")
    return "\n".join(lines)


def to_chrome_trace(timeline: Timeline, *, seconds_per_unit: float = 1e-3) -> dict[str, Any]:
    """Chrome trace JSON (`traceEvents`): one process per stage (rank), a compute and a transfer
    lane; transfers between two chunks of one rank move nothing and are left out.

    Args:
        seconds_per_unit: how long one time unit of the timeline is (1e-3: costs in ms; 1.0
            for measured timelines in seconds). Trace timestamps are microseconds.
    """
    us = seconds_per_unit * 1e6
    chunks = timeline.schedule.virtual_stages > 1
    names = _row_names(timeline)
    events: list[dict[str, Any]] = []
    for s in range(len(timeline.stages)):
        events.append({"ph": "M", "name": "process_name", "pid": s, "args": {"name": names[s]}})
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": s, "args": {"sort_index": s}}
        )
        for tid, lane in ((0, "compute"), (1, "transfers out")):
            events.append(
                {"ph": "M", "name": "thread_name", "pid": s, "tid": tid, "args": {"name": lane}}
            )
    for s, stage in enumerate(timeline.stages):
        for t in stage:
            events.append(
                {
                    "name": _label(t.action, chunks),
                    "cat": t.action.kind,
                    "ph": "X",
                    "pid": s,
                    "tid": 0,
                    "ts": t.start * us,
                    "dur": (t.end - t.start) * us,
                    "args": {"action": str(t.action)},
                }
            )
    for i, t in enumerate(timeline.transfers):
        tr = t.transfer
        src, dst = _rank(timeline, tr.src), _rank(timeline, tr.dst)
        if src == dst and chunks:
            continue
        events.append(
            {
                "name": tr.label(),
                "cat": tr.kind,
                "ph": "X",
                "pid": src,
                "tid": 1,
                "ts": t.start * us,
                "dur": (t.end - t.start) * us,
                "args": {
                    "mb": tr.mb,
                    "src": tr.src,
                    "dst": tr.dst,
                    "src_rank": src,
                    "dst_rank": dst,
                },
            }
        )
        # A flow arrow from the send to the receiving stage.
        events.append(
            {
                "name": tr.kind,
                "cat": "flow",
                "ph": "s",
                "id": i,
                "pid": src,
                "tid": 1,
                "ts": t.start * us,
            }
        )
        events.append(
            {
                "name": tr.kind,
                "cat": "flow",
                "ph": "f",
                "bp": "e",
                "id": i,
                "pid": dst,
                "tid": 0,
                "ts": t.end * us,
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def plot_timeline(
    timeline: Timeline, path: str | Path, *, title: str | None = None, unit: str = "time units"
) -> Path:
    """Draw the timeline as a PNG: stages (ranks) as rows, F/B/W coloured (a rank's later chunks
    lighter), fused runs outlined, transfers between ranks as arrows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    p = len(timeline.stages)
    sched = timeline.schedule
    chunks = sched.virtual_stages > 1
    actions = [t for stage in timeline.stages for t in stage]
    origin = min((t.start for t in actions), default=0.0)
    span = max(timeline.makespan, 1e-12)
    fig, ax = plt.subplots(figsize=(min(24, 6 + 0.18 * len(actions) / max(1, p)), 1.0 + 0.7 * p))
    for s, stage in enumerate(timeline.stages):
        y = p - 1 - s
        held = sched.chunks_of(s) if s < sched.num_stages else ()
        run_start: float | None = None
        for t in stage:
            width = t.end - t.start
            level = held.index(t.action.stage_index) if t.action.stage_index in held else 0
            ax.broken_barh(
                [(t.start - origin, width)],
                (y - 0.4, 0.8),
                facecolors=_shade(COLORS[t.action.kind], level, len(held)),
                edgecolor="white",
                linewidth=0.5,
            )
            if width / span > 0.012:
                ax.text(
                    t.start - origin + width / 2,
                    y,
                    _label(t.action, chunks),
                    ha="center",
                    va="center",
                    fontsize=6 if chunks else 7,
                    color="white" if level == 0 else "#333333",
                )
            if t.action in sched.fused:
                run_start = t.start if run_start is None else run_start
            elif run_start is not None:
                ax.add_patch(
                    Rectangle(
                        (run_start - origin, y - 0.45),
                        t.end - run_start,
                        0.9,
                        fill=False,
                        edgecolor="black",
                        linewidth=0.8,
                    )
                )
                run_start = None
    for t in timeline.transfers:
        tr = t.transfer
        if t.end <= t.start:
            continue
        y0, y1 = p - 1 - _rank(timeline, tr.src), p - 1 - _rank(timeline, tr.dst)
        shift = 0.4 if y1 < y0 else -0.4
        ax.annotate(
            "",
            xy=(t.end - origin, y1 - shift),
            xytext=(t.start - origin, y0 + shift),
            arrowprops={"arrowstyle": "->", "color": "#55A868", "alpha": 0.6, "lw": 0.8},
        )
    ax.set_yticks(range(p))
    ax.set_yticklabels(list(reversed(_row_names(timeline))))
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel(unit)
    ax.set_title(
        title
        or (
            f"{sched.describe()}: makespan {timeline.makespan:.4g}, "
            f"bubble {timeline.bubble_fraction:.1%}, overlap {'on' if timeline.overlap else 'off'}"
        ),
        fontsize=10,
    )
    handles = [
        Patch(color=COLORS[k], label=name)
        for k, name in (
            ("F", "forward"),
            ("B", "backward (input grad)" if sched.split_backward else "backward"),
            ("W", "weight grad"),
            ("A", "apply grads"),
        )
        if any(t.action.kind == k for t in actions)
    ]
    handles.append(Patch(color="#55A868", label="transfer"))
    if chunks:
        handles.append(Patch(color="#BBBBBB", label="later chunk of a rank: lighter"))
    if sched.fused:
        handles.append(Patch(fill=False, edgecolor="black", label="fused run"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.35 / fig.get_figheight(), 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
