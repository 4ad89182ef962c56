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


def _label(action: Any) -> str:
    return action.kind if action.kind == APPLY else f"{action.kind}{action.microbatch_index}"


def format_timeline(timeline: Timeline, *, max_width: int = 160) -> str:
    """A time-aligned text grid: one row per stage, each action drawn over its duration.

    The scale gives the shortest action room for its label (e.g. `F12`) when the whole step fits
    in `max_width` columns; otherwise actions shrink and labels are cut.
    """
    actions = [t for stage in timeline.stages for t in stage]
    if not actions:
        return ""
    origin = min(t.start for t in actions)
    span = max(t.end for t in actions) - origin
    shortest = min((t.end - t.start for t in actions if t.end > t.start), default=1.0)
    label_width = max(len(_label(t.action)) for t in actions) + 1
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
            text = _label(t.action)[: b - a].ljust(b - a, "-")
            row[a:b] = list(text[: b - a])
            if b - a > 1:
                row[b - 1] = "|"
        lines.append(f"stage {s} |{''.join(row)}")
    unit = 1 / scale
    lines.append(f"(one column = {unit:.3g} time units; '{IDLE}' idle; makespan {span:.4g})")
    return "\n".join(lines)


def to_chrome_trace(timeline: Timeline, *, seconds_per_unit: float = 1e-3) -> dict[str, Any]:
    """Chrome trace JSON (`traceEvents`): one process per stage, a compute and a transfer lane.

    Args:
        seconds_per_unit: how long one time unit of the timeline is (1e-3: costs in ms; 1.0
            for measured timelines in seconds). Trace timestamps are microseconds.
    """
    us = seconds_per_unit * 1e6
    events: list[dict[str, Any]] = []
    for s in range(len(timeline.stages)):
        events.append({"ph": "M", "name": "process_name", "pid": s, "args": {"name": f"stage {s}"}})
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
                    "name": _label(t.action),
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
        events.append(
            {
                "name": tr.label(),
                "cat": tr.kind,
                "ph": "X",
                "pid": tr.src,
                "tid": 1,
                "ts": t.start * us,
                "dur": (t.end - t.start) * us,
                "args": {"mb": tr.mb, "src": tr.src, "dst": tr.dst},
            }
        )
        # A flow arrow from the send to the receiving stage.
        events.append(
            {
                "name": tr.kind,
                "cat": "flow",
                "ph": "s",
                "id": i,
                "pid": tr.src,
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
                "pid": tr.dst,
                "tid": 0,
                "ts": t.end * us,
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def plot_timeline(
    timeline: Timeline, path: str | Path, *, title: str | None = None, unit: str = "time units"
) -> Path:
    """Draw the timeline as a PNG: stages as rows, F/B/W coloured, transfers as arrows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    p = len(timeline.stages)
    actions = [t for stage in timeline.stages for t in stage]
    origin = min((t.start for t in actions), default=0.0)
    span = max(timeline.makespan, 1e-12)
    fig, ax = plt.subplots(figsize=(min(24, 6 + 0.18 * len(actions) / max(1, p)), 1.0 + 0.7 * p))
    for s, stage in enumerate(timeline.stages):
        y = p - 1 - s
        for t in stage:
            width = t.end - t.start
            ax.broken_barh(
                [(t.start - origin, width)],
                (y - 0.4, 0.8),
                facecolors=COLORS[t.action.kind],
                edgecolor="white",
                linewidth=0.5,
            )
            if width / span > 0.012:
                ax.text(
                    t.start - origin + width / 2,
                    y,
                    _label(t.action),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
    for t in timeline.transfers:
        tr = t.transfer
        if t.end <= t.start:
            continue
        y0, y1 = p - 1 - tr.src, p - 1 - tr.dst
        shift = 0.4 if y1 < y0 else -0.4
        ax.annotate(
            "",
            xy=(t.end - origin, y1 - shift),
            xytext=(t.start - origin, y0 + shift),
            arrowprops={"arrowstyle": "->", "color": "#55A868", "alpha": 0.6, "lw": 0.8},
        )
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"stage {s}" for s in reversed(range(p))])
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel(unit)
    sched = timeline.schedule
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
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.35 / fig.get_figheight(), 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
