"""What `jaxreshard profile MODEL --auto` prints of its record, and its winner as a profile
config file."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxreshard.profiler._config import ProfileConfig

DATA_PARALLEL = "data parallel"


def summary_lines(record: dict[str, Any]) -> list[str]:
    rows = record["measured"]
    ranked = (
        "plain: a training loop's, which rank them"
        if record.get("ranked_by") == "plain_step_seconds"
        else "which rank them"
    )
    lines = [f"search: predicted (calibrated simulator) beside measured (timed steps; "
             f"{ranked}), and the estimated peak memory per device"]  # fmt: skip
    for row in rows:
        predicted = row.get("search_predicted_seconds")
        text = f"{predicted * 1e3:9.1f} ms" if predicted is not None else "        -   "
        peak = row.get("estimated_peak_bytes")
        mem = f"{peak / (1 << 20):9.1f} MiB" if peak is not None else "        -    "
        plain = row.get("plain_step_seconds")
        trained = f" (plain {plain * 1e3:.1f} ms)" if plain else ""
        notes = []
        if row.get("search_extrapolated"):
            notes.append("extrapolated past its calibrations")
        calibrated = row.get("calibration_step_seconds")
        if calibrated:  # (how far the machine's speed moved since it was calibrated)
            notes.append(f"calibrated at {calibrated * 1e3:.1f} ms")
        aside = f"  ({'; '.join(notes)})" if notes else ""
        measured = f"{row['step_seconds'] * 1e3:9.1f} ms{trained}"
        lines.append(f"  {row['label']:<48} predicted {text}  measured {measured}  "
                     f"memory {mem}{aside}")  # fmt: skip
    failed = record.get("failed") or []
    for f in failed:  # (dropped: a training loop could not run them either)
        lines.append(f"  {f['label']:<48} failed, not ranked: {f['error']}")
    over = record.get("over_memory_cap") or []
    if over:
        lines.append(f"not measured: {len(over)} predictions over memory_cap_gib="
                     f"{record['memory_cap_gib']} (the fastest of them "
                     f"{min(over, key=lambda o: o['predicted_seconds'])['label']})")  # fmt: skip
    speedup = record["speedup_over_data_parallel"]
    if record["winner"] == DATA_PARALLEL:
        lines.append("winner: plain data parallelism; no pipeline layout tried beats it here")
    elif speedup is not None:
        step = "plain step" if record.get("ranked_by") == "plain_step_seconds" else "step"
        lines.append(f"winner: {record['winner']}, {speedup:.2f}x data parallelism's {step}")
    elif any(f["label"] == DATA_PARALLEL for f in failed):
        lines.append(f"winner: {record['winner']} (no data-parallel baseline: it failed)")
    else:
        lines.append(f"winner: {record['winner']} (no data-parallel baseline: no batch axis)")
    return lines


def profile_toml(pc: ProfileConfig) -> str:
    """`pc` as a profile config file ([model], [run], [pipeline])."""
    model = {"name": pc.model, "preset": pc.preset, **pc.model_values()}
    tables = {"model": model, "run": dataclasses.asdict(pc.run), "pipeline": pc.pipeline.to_dict()}
    # TOML has no null, and a key left out loads as its default (`batch_axis` as "data") or
    # as the preset's value: a None that differs from those is written "none", as a flag says
    # it; one equal to them is left out.
    defaults = {
        "model": dataclasses.asdict(pc.spec.presets[pc.preset]),
        "run": {f.name: f.default for f in dataclasses.fields(pc.run)},
        "pipeline": {f.name: f.default for f in dataclasses.fields(pc.pipeline)},
    }
    out = [f"# written by `jaxreshard profile {pc.model} --auto`"]
    for name, values in tables.items():
        out.append(f"\n[{name}]")
        for key, value in values.items():
            if value is not None:
                out.append(f"{key} = {_toml(value)}")
            elif defaults[name].get(key) is not None:
                out.append(f'{key} = "none"')
    return "\n".join(out) + "\n"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to TOML")
