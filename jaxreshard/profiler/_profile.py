"""Running one profile: the runtime it needs, the session, its tables and files."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from jaxreshard.profiler._config import ProfileConfig
from jaxreshard.profiler._report import (
    chrome_trace,
    header_lines,
    measured_timeline,
    median_step,
    profile_json,
    summary_tables,
)
from jaxreshard.profiler._run import Session, run_steps


@contextlib.contextmanager
def runtime_for(pc: ProfileConfig) -> Iterator[Any]:
    """The Ray runtime a profile needs (None for the local backend): the running one, or one
    started for the profile (a local cluster of one host per stage, or `run.address`'s) and
    shut down after it."""
    if pc.pipeline.backend != "ray":
        yield None
        return
    import jaxreshard
    from jaxreshard.runtime import current_runtime

    running = current_runtime()
    if running.backend == "ray":
        yield running
        return
    sizes = pc.pipeline.devices_per_mesh(pc.num_stages)
    per_stage = max(sizes)
    options: dict[str, Any] = {"timeout_s": pc.pipeline.timeout_s}
    if pc.pipeline.emulate_network_gbps is not None:
        options["emulate_network_gbps"] = pc.pipeline.emulate_network_gbps
    if pc.run.address is not None:
        runtime = jaxreshard.init("ray", address=pc.run.address, **options)
    else:
        # The host actors join one jax.distributed runtime only if a stage's mesh spans hosts:
        # joined, a CPU host runs even its own devices' collectives over gloo (a tensor-parallel
        # tiny GPT: 162 ms a step against 58 ms unjoined; docs/ray-and-gpus.md).
        runtime = jaxreshard.init(
            "ray",
            num_hosts=pc.num_stages,
            devices_per_host=per_stage,
            object_store_memory=512 * 2**20,
            distributed=meshes_span_hosts(sizes, per_stage),
            **options,
        )
    try:
        yield runtime
    finally:
        jaxreshard.shutdown()


def meshes_span_hosts(sizes: Sequence[int], per_host: int) -> bool:
    """Whether meshes of `sizes` devices, taking hosts' devices in order (`per_host` each, as
    the Ray runtime places stages), put some mesh on more than one host."""
    at = 0
    for n in sizes:
        if at // per_host != (at + n - 1) // per_host:
            return True
        at += n
    return False


def _emulating(pc: ProfileConfig) -> ProfileConfig:
    """With network emulation, every stage is its own host unless devices_per_host says so."""
    p = pc.pipeline
    if p.emulate_network_gbps is not None and p.devices_per_host is None:
        return pc.replace_pipeline(devices_per_host=max(p.devices_per_mesh(pc.num_stages)))
    return pc


def run_profile(
    pc: ProfileConfig,
    *,
    bound: bool = False,
    console: Any = None,
    progress: bool = True,
    json_path: str | Path | None = None,
    trace_path: str | Path | None = None,
    plot_path: str | Path | None = None,
    checkpoint: str | Path | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Train `pc`'s model for its warm-up and timed steps and return the profile
    (`jaxreshard-profile/1`); print it to `console` (a rich Console) if given, and write the
    JSON, the Chrome trace and the PNG of the median step's measured timeline if asked. With
    `bound`, also time as many signal-only steps (local backend). With `checkpoint` (a
    folder), save the training state every `checkpoint_every` steps and at the end; with
    `resume`, start from the newest checkpoint there (see [Note: run checkpoints])."""
    from jaxreshard.profiler._checkpoints import RunCheckpoints

    pc = _emulating(pc)
    with runtime_for(pc) as runtime:
        session = Session(pc, runtime=runtime)
        if console is not None:
            for line in header_lines(pc):
                console.print(line, highlight=False)
        checkpoints = None
        if checkpoint is not None:
            checkpoints = RunCheckpoints(checkpoint, checkpoint_every, pc)
            if resume:
                with _status(console, "restoring the newest checkpoint"):
                    step = checkpoints.resume(session)
                if console is not None:
                    console.print(
                        f"resumed from step {step} ({checkpoints.restore_seconds:.2f} s)"
                        if step is not None
                        else f"--resume: no checkpoint in {checkpoints.root} yet; starting afresh"
                    )
            session.checkpoints = checkpoints
        with _status(console, "compiling and warming up"):
            session.warm_up()
        if console is not None and pc.candidates:
            how = "chosen by partition='auto'" if pc.pipeline.cuts is None else "as configured"
            console.print(f"cuts: after layers {list(session.cuts() or ())} ({how}; "
                          "train_step.plan(...) says why)", highlight=False)  # fmt: skip
        plain = pc.run.num_plain_steps
        with _bar(console, progress, pc.run.steps * (2 if bound else 1) + plain) as advance:
            run_steps([session], pc.run.steps, plain_steps=plain, on_step=advance)
            if bound:
                run_steps([session], pc.run.steps, signal_only=True, on_step=advance)
        flops = session.flops_per_step()
        result = profile_json(session, flops)
        if checkpoints is not None:
            result["checkpoints"] = checkpoints.finish(session)
            if console is not None:
                last = result["checkpoints"]["saved"][-1]
                console.print(
                    f"checkpoint: {last['path']} (step {last['step']}; writing took "
                    f"{last.get('seconds', 0.0):.2f} s, the step waited "
                    f"{last['blocking_s']:.2f} s)"
                )
        if console is not None:
            for table in summary_tables(result):
                console.print(table)
        _write_outputs(session, result, console, json_path, trace_path, plot_path)
    return result


def _write_outputs(session, result, console, json_path, trace_path, plot_path) -> None:
    say = console.print if console is not None else (lambda *a, **k: None)
    if json_path:
        write_json(json_path, result)
        say(f"wrote {json_path}")
    if trace_path:
        write_json(trace_path, chrome_trace(session, session.steps))
        say(f"wrote {trace_path} (open in https://ui.perfetto.dev)")
    if plot_path:
        from jaxreshard.pipeline._visualize import plot_timeline

        step = median_step(session.steps)
        timeline = measured_timeline(session, [step])
        pc = session.pc
        emu = pc.pipeline.emulate_network_gbps
        title = (
            f"{pc.model} {pc.preset}, measured: {pc.pipeline.schedule}"
            f"{' + weight delay' if pc.pipeline.weight_delay else ''}, {pc.num_stages} stages x "
            f"{pc.pipeline.num_micro_batches} micro-batches, step {step.seconds * 1e3:.1f} ms"
            + (f", network emulated at {emu:g} GB/s" if emu is not None else "")
        )
        plot_timeline(timeline, plot_path, title=title, unit="ms (measured)")
        say(f"wrote {plot_path}")


def write_json(path: str | Path, data: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


# -- comparisons ----------------------------------------------------------------------------------


@contextlib.contextmanager
def _status(console: Any, text: str) -> Iterator[None]:
    if console is None:
        yield
        return
    with console.status(text):
        yield


@contextlib.contextmanager
def _bar(console: Any, progress: bool, total: int) -> Iterator[Callable[[Any, Any], None]]:
    if console is None or not progress:
        yield lambda session, record: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("steps", total=total, info="")

        def advance(session: Any, record: Any) -> None:
            what = "signal-only" if record in session.signal_steps else f"loss {record.loss:.4f}"
            bar.update(
                task,
                advance=1,
                info=f"{session.label}: {record.seconds * 1e3:.1f} ms, {what}",
            )

        yield advance
