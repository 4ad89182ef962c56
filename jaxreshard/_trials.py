"""Measuring `partition="auto"`'s fastest predicted choices before choosing one
(`PipelineConfig(partition_trials=N)`; see [Note: automatic partitioning] in
`runtime/step/_partition.py`): each choice is built as a pipeline, its arguments put where it
keeps them, and the choices are timed side by side."""

from __future__ import annotations

import dataclasses
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxreshard.runtime._config import PipelineConfig


def measure_choices(
    partition: Any,
    config: PipelineConfig,
    build: Callable[..., Any],
    leaves: list[Any],
    keep: bool,
) -> Any:
    """Measure the `config.partition_trials` fastest predicted choices under the memory cap,
    side by side (each compiled, warmed by `TRIAL_WARMUP` steps, then timed in rounds; see
    `measure`), on the call's own arguments, nothing donated, the outputs dropped. Each then
    runs one recorded step, and each action's cost (a factor on compute and a fixed cost),
    fitted to its actions (`fit_actions`; see [Note: action costs fitted to a recorded step]
    in `runtime/step/_refit.py`), predicts every choice again; if the fastest of those was not
    measured, it joins and all are measured again. The fastest
    measured is chosen: `partition.trials` and `partition.chosen` say so. A prediction leaves
    out what makes an action slower in a running pipeline than its segments timed alone (its
    fixed cost on the host, contention), and where the choices are close that decides. Every
    measured choice's pipeline, with its own copy of the state, is alive until the choice is
    made: under a memory cap, only as many run as fit together (their estimated peaks summed).
    A choice that fails to compile or run is left out with a warning, unless it is the
    prediction's own and nothing else ran. With `keep` (nothing donated or recorded, so it was
    built as the step's own would be), the chosen one's pipeline is returned to serve the step
    instead of compiling it again."""
    from jaxreshard.runtime.step._partition import (
        TRIAL_BURST,
        TRIAL_ROUNDS,
        TRIAL_WARMUP,
        Trial,
        fit_actions,
        fit_compute_scale,
    )

    running: dict[tuple[int, ...], tuple[Any, list[Any]]] = {}

    def start(cuts: tuple[int, ...]) -> None:
        costs = partition.placement_costs(config, cuts)
        entry = build(dataclasses.replace(config, cuts=cuts, **costs), False, ())
        running[cuts] = (entry, [])  # (closed by the caller, whatever happens)
        placed = _placed(entry.pipeline, leaves)
        running[cuts] = (entry, placed)
        for _ in range(TRIAL_WARMUP):  # (the first compiles)
            entry.pipeline.run(placed)
            entry.pipeline.wait()

    def measure() -> dict[tuple[int, ...], float]:
        """Seconds per step of every running choice: the median over `TRIAL_ROUNDS` rounds, each
        running every choice in turn for `TRIAL_BURST` steps called back to back (as a training
        loop calls them), so that the machine's drift falls on all alike."""
        times: dict[tuple[int, ...], list[float]] = {c: [] for c in running}
        for _ in range(TRIAL_ROUNDS):
            for cuts, (entry, placed) in running.items():
                began = time.perf_counter()
                for _ in range(TRIAL_BURST):
                    entry.pipeline.run(placed)
                entry.pipeline.wait()
                times[cuts].append((time.perf_counter() - began) / TRIAL_BURST)
        return {c: statistics.median(t) for c, t in times.items()}

    began = time.perf_counter()
    choices = {c.cuts: c for c in partition.tried}
    held = [0]  # estimated peak bytes per device of the running choices, together
    failed: set[tuple[int, ...]] = set()  # (left out: never started again)

    def try_start(cuts: tuple[int, ...]) -> None:
        """Start a choice if it fits beside the running ones under the cap (they run side by
        side, each with its own copy of the state); one that fails to compile or run is left
        out with a warning (the others still decide)."""
        need = max(choices[cuts].memory, default=0)
        if partition.cap is not None and running and held[0] + need > partition.cap:
            partition.trials_note.append(
                f"candidates {list(cuts)} not measured: beside the others they would need "
                f"{(held[0] + need) / 2**30:.2f} GiB per device, over the cap"
            )
            return
        try:
            start(cuts)
        except Exception as e:  # (a trial's failure is the prediction's to absorb)
            failed.add(cuts)
            entry = running.pop(cuts, (None,))[0]
            if entry is not None:
                close_entry(entry)
            if cuts == first and config.partition_trials > 1:
                raise  # (the prediction's own, with trials asked for: it would fail alone too)
            # (The default's one trial runs without donation, with a copy of the state: where
            # that fails, the step itself may still fit; the prediction decides.)
            text = f"candidates {list(cuts)} failed to run ({type(e).__name__}: {e})"
            partition.trials_note.append(text)
            rest = "choosing among the others" if cuts != first else "the prediction decides"
            warnings.warn(f"partition_trials: {text}; {rest}", stacklevel=6)
            return
        held[0] += need

    recorded: dict[tuple[int, ...], list[Any]] = {}

    def refit() -> None:
        """Record one step of each running choice not recorded yet (the first recorded call
        compiles what recording needs, so the second's events count), and fit each action's
        cost to them (`fit_actions`); where that fails, one factor to the step times."""
        for cuts, (entry, placed) in running.items():
            if cuts in recorded:
                continue
            try:
                for _ in range(2):
                    entry.pipeline.run(placed, record=True)
                recorded[cuts] = list(entry.pipeline.last_events)
            except Exception as e:  # (the step times still fit the factor)
                recorded[cuts] = []  # (not tried again)
                partition.trials_note.append(
                    f"candidates {list(cuts)}: a recorded step failed ({type(e).__name__}: "
                    f"{e}); its actions are not fitted"
                )
        if not fit_actions(partition, config, recorded):
            fit_compute_scale(partition, config)

    kept = None
    try:
        fitting = [c.cuts for c in partition.tried if c.fits][: config.partition_trials]
        first = fitting[0]
        for cuts in fitting:
            try_start(cuts)
        if not running:  # (the default's one trial failed: the prediction's choice stands)
            partition.seconds += time.perf_counter() - began
            return None
        measured = measure()
        partition.trials = [Trial(c, choices[c].step, t) for c, t in measured.items()]
        refit()
        best = partition.refitted[0][0] if partition.refitted else None
        if best is not None and best not in measured and best not in failed:
            try_start(best)  # (the refitted prediction's fastest)
            if len(running) > len(measured):
                measured = measure()  # (all again, side by side)
                partition.trials = [Trial(c, choices[c].step, t) for c, t in measured.items()]
                refit()  # (with the new choice's actions too)
        partition.chosen = min(partition.trials, key=lambda t: t.measured).cuts
        kept = running.pop(partition.chosen)[0] if keep else None
    finally:
        for entry, _ in running.values():
            close_entry(entry)
        running.clear()  # (the placed arrays go too, even while an error is held)
    partition.seconds += time.perf_counter() - began
    return kept


def _placed(pipeline: Any, leaves: list[Any]) -> list[Any]:
    """`leaves` with the arrays the pipeline keeps (parameters, optimizer state) put where it
    keeps them, as a training loop's later steps have them: a step given host or other-layout
    arrays moves them first."""
    from jaxreshard._reshard import reshard
    from jaxreshard.runtime import current_runtime
    from jaxreshard.runtime.ray._remote import RemoteArray
    from jaxreshard.runtime.ray._wire import is_key

    out, host_data = list(leaves), {}
    for i, (x, where) in enumerate(zip(leaves, pipeline.placement(leaves))):
        if where is None or not hasattr(x, "shape") or is_key(x):
            continue
        if isinstance(where, jax.sharding.Sharding):
            out[i] = jax.device_put(x, where)
        elif isinstance(x, RemoteArray):
            out[i] = reshard(x, where)
        else:
            host_data[i] = (np.asarray(x), where)
    if host_data:  # (on Ray: one call per host for all of them)
        out_put = current_runtime().put_many(list(host_data.values()))
        for i, array in zip(host_data, out_put):
            out[i] = array
    return out


def close_entry(entry: Any) -> None:
    """Close a compiled step's pipeline (its threads end; its buffers go with it)."""
    close = getattr(entry.pipeline, "close", None)
    if close is not None:
        close()
