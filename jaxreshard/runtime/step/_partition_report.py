"""What `partition="auto"` measured and chose (see [Note: automatic partitioning] in
`_partition.py`): each choice, the trials, and the report `train_step.plan(...)` prints."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from jaxreshard.pipeline import Costs
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime.step._collectives import Sums, with_sums
from jaxreshard.runtime.step._memory import SegmentMemory, size
from jaxreshard.runtime.step._refit import COMPUTE_SCALES
from jaxreshard.runtime.step._segment_cost import SegmentCost

MAX_CHOICES = 20_000
TRIAL_WARMUP = 2  # steps run before a measured choice (`partition_trials`) is timed
TRIAL_ROUNDS = 5  # rounds that time every measured choice in turn (the median is kept)
TRIAL_BURST = 2  # steps per choice and round, called back to back


class NoCutFits(ValueError):
    """No choice of cuts fits under the memory cap (the message says what the least needs)."""


class Trial(NamedTuple):
    """One of the fastest predicted choices, measured (`partition_trials`)."""

    cuts: tuple[int, ...]
    predicted: float  # seconds
    measured: float  # seconds per step: the median of `TRIAL_ROUNDS` rounds (see `Trial`'s use)


class Choice(NamedTuple):
    """One way to cut the step: its candidate cuts, predicted step and memory per device."""

    cuts: tuple[int, ...]
    step: float  # predicted seconds
    memory: tuple[int, ...]  # estimated peak bytes per device, per mesh
    fits: bool  # under the memory cap (or no cap)
    costs: Costs | None = None  # per chunk, seconds per micro-batch: compute and transfers
    scratch: tuple[int, ...] = ()  # of `memory`, per mesh: XLA scratch (no array shows it)
    sums: Sums | None = None  # per chunk: its gradient sums (simulated with `costs`)


@dataclasses.dataclass
class PartitionReport:
    """What the partitioner measured and chose (see [Note: automatic partitioning])."""

    markers: list[Any]  # per boundary of the all-candidates trace: "forced" or a candidate
    segments: list[SegmentCost]
    crossing: dict[int, list[float]]  # boundary position -> seconds, per adjacent chunk pair
    tried: list[Choice]  # those under the cap fastest first, then those over it
    chosen: tuple[int, ...]
    seconds: float  # spent measuring and choosing
    memory: list[list[SegmentMemory]] = dataclasses.field(default_factory=list)  # [seg][mesh]
    cap: int | None = None  # bytes per device; None: no cap
    trials: list[Trial] = dataclasses.field(default_factory=list)  # `partition_trials` >= 1
    compute_scale: float | None = None  # fitted to the trials (see `_refit.py`)
    action_cost: float | None = None  # seconds each action adds, fitted with it
    step_scale: float | None = None  # the factor on those predicted steps, from the trials
    action_points: int = 0  # (chunk, action kind) medians `fit_actions` fitted; 0: step times
    trials_note: list[str] = dataclasses.field(default_factory=list)  # choices left out
    refitted: list[tuple[tuple[int, ...], float]] = dataclasses.field(default_factory=list)
    # Parameters read by more than one segment: (index, bytes, segments reading it)
    shared: list[tuple[int, int, tuple[int, ...]]] = dataclasses.field(default_factory=list)
    # Gradient bytes per device each segment sums over each mesh's batch axis: [seg][mesh]
    gradient_bytes: list[list[int]] = dataclasses.field(default_factory=list)
    # Per mesh, its tensor-parallel work: the plan's lines and the JSON (see `_tensor_parallel`)
    tensor_parallel: list[str] = dataclasses.field(default_factory=list)
    tensor_parallel_json: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    ways: int = 0  # ways to place the free boundaries
    limit: int = MAX_CHOICES  # the ways predicted one by one at most; past it, a search's

    @property
    def searched(self) -> bool:
        """Whether `tried` is a search's (see [Note: cut search]), not every way to cut."""
        return self.ways > self.limit

    def placement_costs(self, config: PipelineConfig, cuts: Any = None) -> dict[str, Any]:
        """The `PipelineConfig` cost fields that make the runtime place delayed weight
        gradients as the chosen prediction (or that of `cuts`) did (its measured per-chunk
        costs, in ms), when the config splits the backward and leaves those fields at their
        defaults; else none."""
        cuts = self.chosen if cuts is None else tuple(cuts)
        chosen = next(c for c in self.tried if c.cuts == cuts)
        defaults = {f.name: f.default for f in dataclasses.fields(PipelineConfig)}
        names = ("cost_forward", "cost_backward", "cost_weight_grad", "cost_comm")
        if not config.split_backward or chosen.costs is None:
            return {}
        if any(getattr(config, n) != defaults[n] for n in names):
            return {}  # the user's own
        c = with_sums(chosen.costs, chosen.sums)
        ms = [tuple(x * 1e3 for x in v) for v in (c.forward, c.backward, c.weight_grad, c.comm)]
        return dict(zip(names, ms))

    def to_json(self) -> dict[str, Any]:
        """The report as JSON: each segment's measured seconds per micro-batch, each cut's
        transfer seconds, every choice's predicted step and peak bytes per device."""
        return {
            "chosen": list(self.chosen),
            "seconds": self.seconds,
            "ways": self.ways,
            "searched": self.searched,
            "markers": [m if m == "forced" else int(m) for m in self.markers],
            "segments": [dataclasses.asdict(s) for s in self.segments],
            "crossing_seconds": {str(k): list(v) for k, v in self.crossing.items()},
            "gradient_bytes_per_device": [list(v) for v in self.gradient_bytes],
            "tensor_parallel": self.tensor_parallel_json,
            "shared_params": [
                {"param": k, "bytes": held, "segments": list(segs)} for k, held, segs in self.shared
            ],
            "memory_cap_bytes": self.cap,
            "tried": [
                {
                    "cuts": list(c.cuts),
                    "predicted_seconds": c.step,
                    "peak_bytes": list(c.memory),
                    "fits": c.fits,
                    **(
                        {
                            "gradient_sum_seconds": {
                                "once": list(c.sums.once),
                                "every_micro_batch": list(c.sums.every),
                            }
                        }
                        if c.sums is not None and any(c.sums.once + c.sums.every)
                        else {}
                    ),
                    **(
                        {
                            "tensor_parallel_seconds": {
                                "forward": list(c.sums.forward),
                                "input_grad": list(c.sums.input_grad),
                                "weight_grad": list(c.sums.weight),
                            }
                        }
                        if c.sums is not None
                        and any(c.sums.forward + c.sums.input_grad + c.sums.weight)
                        else {}
                    ),
                }
                for c in self.tried
            ],
            "compute_scale": self.compute_scale,
            "action_cost_seconds": self.action_cost,
            "action_points": self.action_points,
            "step_scale": self.step_scale,
            "trials_note": list(self.trials_note),
            "refitted": [
                {"cuts": list(cuts), "predicted_seconds": step} for cuts, step in self.refitted
            ],
            "trials": [
                {
                    "cuts": list(t.cuts),
                    "predicted_seconds": t.predicted,
                    "measured_seconds": t.measured,
                }
                for t in self.trials
            ],
        }

    def summary(self) -> str:
        cap = f"memory cap {size(self.cap)} per device" if self.cap else "no memory cap"
        lines = [
            f"automatic partition: {len(self.segments)} segments between "
            f"{len(self.markers)} markers ({sum(m != 'forced' for m in self.markers)} "
            f"candidates); chose candidates {list(self.chosen)} in {self.seconds:.1f} s; {cap}",
            *(
                [
                    f"  {self.ways:,} ways to cut, over the {self.limit:,} predicted one by one: "
                    f"{len(self.tried)} predicted, a shortlist by dynamic programming and local "
                    "moves ([Note: cut search]; the best found, not always the best there is)"
                ]
                if self.searched
                else []
            ),
            "  segment   forward    backward   (W)       state      residuals/mb  "
            "crossing after it (per chunk pair)",
        ]
        for i, seg in enumerate(self.segments):
            after = ""
            if i < len(self.markers):
                kind = self.markers[i]
                label = "forced" if kind == "forced" else f"candidate {kind}"
                times = ", ".join(f"{t * 1e3:.2f} ms" for t in self.crossing.get(i, []))
                after = f"{label}: {times}"
            mem = self.memory[i][0] if self.memory else SegmentMemory(0, 0, 0, 0)
            lines.append(
                f"  {i:7d} {seg.forward * 1e3:8.2f} ms {seg.backward * 1e3:8.2f} ms "
                f"{seg.weight_grad * 1e3:7.2f} ms  {size(mem.state):>9} {size(mem.residuals):>9}"
                f"     {after}"
            )
        held = [max(v) for v in self.gradient_bytes]
        chosen = next((c for c in self.tried if c.cuts == self.chosen), None)
        if any(held) and chosen is not None and chosen.sums is not None:
            sums = ", ".join(
                f"{c}: {once * 1e3:.2f} ms once a step, {every * 1e3:.2f} ms per micro-batch"
                for c, (once, every) in enumerate(zip(chosen.sums.once, chosen.sums.every))
            )
            lines.append(
                "  gradient bytes per device each segment sums over the batch axis (a parameter "
                "at its first reader; by each reading chunk where a cut separates them): "
                + ", ".join(size(n) for n in held)
                + f"; the chosen chunks' sums: {sums}"
            )
        lines.extend(f"  {line}" for line in self.tensor_parallel)
        if (
            chosen is not None
            and chosen.sums is not None
            and any(chosen.sums.forward + chosen.sums.input_grad + chosen.sums.weight)
        ):
            lines.append(
                "  the chosen chunks' tensor-parallel collectives per micro-batch (F / B / W): "
                + ", ".join(
                    f"{c}: {f * 1e3:.2f} / {b * 1e3:.2f} / {w * 1e3:.2f} ms"
                    for c, (f, b, w) in enumerate(
                        zip(chosen.sums.forward, chosen.sums.input_grad, chosen.sums.weight)
                    )
                )
            )
        for k, held, segs in self.shared:
            lines.append(
                f"  parameter {k} ({size(held)}) is read by segments {list(segs)}: where a cut "
                "separates them, its copy to the later chunks and their gradients back are "
                "charged"
            )
        fitting = [c for c in self.tried if c.fits]
        lines.append("  fastest choices (predicted step, peak memory per device):")
        for c in fitting[:5]:
            lines.append(
                f"    candidates {list(c.cuts)}: {c.step * 1e3:.2f} ms, {size(max(c.memory))}"
            )
        if len(fitting) > 5:
            slowest = fitting[-1]
            lines.append(
                f"    ... {len(fitting) - 5} more; slowest {list(slowest.cuts)}: "
                f"{slowest.step * 1e3:.2f} ms"
            )
        if not self.trials and len(fitting) > 1:
            lines.append(
                "  (predicted only, partition_trials=0: 1, the default, runs the fastest and "
                "refits the prediction to it; N runs the N fastest)"
            )
        if self.trials:
            lines.append(
                f"  measured (side by side, median of {TRIAL_ROUNDS} rounds of {TRIAL_BURST} steps "
                "on the call's arguments; the fastest measured is chosen):"
            )
            for t in self.trials:
                mark = "  <- chosen" if t.cuts == self.chosen else ""
                lines.append(
                    f"    candidates {list(t.cuts)}: {t.measured * 1e3:.2f} ms measured, "
                    f"{t.predicted * 1e3:.2f} ms predicted ({t.measured / t.predicted:.2f}x){mark}"
                )
        lines.extend(f"  ({note})" for note in self.trials_note)
        if self.compute_scale is not None:
            top = ", ".join(f"{list(c)} {t * 1e3:.2f} ms" for c, t in self.refitted[:3])
            measured_best = bool(self.refitted) and any(
                t.cuts == self.refitted[0][0] for t in self.trials
            )
            if self.compute_scale in (COMPUTE_SCALES[0], COMPUTE_SCALES[-1]):
                lines.append(
                    f"  (the compute factor is at the end of the {COMPUTE_SCALES[0]:.2f}-"
                    f"{COMPUTE_SCALES[-1]:.1f} it tries: the steps are not compute's)"
                )
            if self.action_points:
                fitted = (
                    f"each action as compute x {self.compute_scale:.2f} + "
                    f"{(self.action_cost or 0.0) * 1e3:.2f} ms fits the recorded steps' "
                    f"actions best ({self.action_points} medians), and the step x "
                    f"{self.step_scale or 1.0:.2f} the measured ones"
                )
            else:
                fitted = f"compute x {self.compute_scale:.2f} fits the measured steps best"
            lines.append(
                f"  {fitted}; with it the fastest predictions are {top}"
                + (" (the fastest of them is measured too)" if measured_best else "")
            )
        over = [c for c in self.tried if not c.fits]
        if over:
            best = min(over, key=lambda c: c.step)
            lines.append(
                f"  over the memory cap: {len(over)} choices; the fastest of them, candidates "
                f"{list(best.cuts)}, {best.step * 1e3:.2f} ms, needs {size(max(best.memory))}"
            )
        return "\n".join(lines)
