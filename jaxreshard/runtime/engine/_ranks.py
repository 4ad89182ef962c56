"""Running a process's ranks: every rank program of a step, dispatched or threaded."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import jax

from jaxreshard.pipeline._emit import Instruction
from jaxreshard.runtime.engine._channels import Channels
from jaxreshard.runtime.engine._dispatch import Completion, dispatch, stage_failure, wait_for_stages
from jaxreshard.runtime.engine._events import Event, PipelineError
from jaxreshard.runtime.engine._program import StageProgram
from jaxreshard.runtime.engine._threads import JOIN_S, DaemonPool

# -- running a process's ranks ---------------------------------------------------------------


class RankRunner:
    """Runs the ranks a process holds for one step (see [Note: host engine]).

    `begin` starts a step on the ranks' channels; `run` drives every rank's `StageProgram`, from
    this thread (`dispatch`) or, where a channel needs it (profiles, emulated links, several
    channel objects), one pooled thread per rank, ends the step on the channels, and with
    `wait` waits for the step's outputs under a progress deadline (`Completion`). Errors name
    the rank's stage, after `where` ("host 2: ").

    Args:
        programs: the ranks' programs, by rank.
        ranks: each rank's chunks (model stages), by rank.
        channels_of: the channels of each chunk.
        meshes: each chunk's mesh (a threaded rank runs under its first chunk's).
        owner: the stage that owns each parameter.
        timeout_s: `PipelineConfig.timeout_s`.
        where: what the errors start with.
    """

    def __init__(
        self,
        programs: dict[int, StageProgram],
        ranks: dict[int, Sequence[int]],
        channels_of: Mapping[int, Channels],
        meshes: Mapping[int, Any],
        owner: Sequence[int],
        timeout_s: float,
        where: str = "",
    ):
        self.programs, self.ranks, self.channels_of = programs, ranks, dict(channels_of)
        self.meshes, self.owner, self.timeout_s, self.where = meshes, owner, timeout_s, where
        self.channels = list({id(c): c for c in self.channels_of.values()}.values())
        self._pool: DaemonPool | None = None  # made at the first threaded step
        self._completion = Completion()
        self._record: Callable[[Event], None] | None = None
        self.last_log: list[tuple[str, Any]] = []

    def what(self, r: int) -> str:
        chunks = self.ranks[r]
        rank = f"stage {chunks[0]}" if len(chunks) == 1 else f"rank {r} {list(chunks)}"
        return self.where + rank

    @property
    def threaded(self) -> bool:
        """Whether the ranks run in threads of their own (see [Note: one dispatching thread])."""
        return len(self.ranks) > 1 and (
            len(self.channels) > 1 or any(getattr(c, "threaded", True) for c in self.channels)
        )

    def begin(
        self,
        step_id: str,
        *,
        record: Callable[[Event], None] | None = None,
        signal_only: bool = False,
    ) -> None:
        """Start step `step_id` on the ranks' channels (their receives are posted)."""
        chunks_here = [c for r in self.ranks for c in self.ranks[r]]
        for channels in self.channels:
            stages = [c for c in chunks_here if self.channels_of[c] is channels]
            channels.begin(stages, step_id=step_id, record=record, signal_only=signal_only)
        self._record = record

    def fail(self, error: PipelineError) -> None:
        """Fail the step on every channel (every rank, and the hosts they talk to, stop)."""
        for channels in self.channels:
            channels.fail(error)

    def run(
        self,
        params: Mapping[int, Any],
        batches: Mapping[int, list[list[Any]]],
        consts: Mapping[int, list[Any]],
        apply_inputs: Mapping[int, Sequence[Any]],
        losses: list[Any],
        results: dict[tuple[int, int], Any],
        *,
        wait: bool = True,
    ) -> tuple[dict[int, dict[int, Any]], dict[int, list[Any]]]:
        """Run the step `begin` started: `params` by parameter index (each rank takes its
        chunks'), `batches` / `consts` / `apply_inputs` by chunk. Fills `losses` (by
        micro-batch) and `results` (by (result, micro-batch)); returns the gradient
        accumulators and the fused optimizers' outputs, by chunk. A step that fails raises
        `PipelineError` after failing the channels (so every other rank and host stops too)."""
        record = self._record
        log: list[tuple[str, Any]] = []

        def program(r: int) -> Generator[Instruction, None, Any]:
            chunks = self.ranks[r]
            self.programs[r].record = record
            return self.programs[r].steps(
                {k: v for k, v in params.items() if self.owner[k] in chunks},
                {c: batches[c] for c in chunks if c in batches},
                {c: consts[c] for c in chunks if c in consts},
                losses,
                {c: v for c, v in apply_inputs.items() if c in chunks},
                results,
                log,
            )

        if self.threaded:
            done = self._run_threads(program)
        else:
            done = dispatch({r: program(r) for r in self.ranks}, self.channels[0], self.what)
        for channels in self.channels:
            channels.end()  # a step ends when its sends have: their errors and events belong to it
        accumulators: dict[int, dict[int, Any]] = {}
        applied: dict[int, list[Any]] = {}
        for accs, out in done.values():
            accumulators.update(accs)
            applied.update(out)
        # What the step dispatched (every action's outputs), for a watch to name a hung action
        # (`HostEngine.step` takes it at once, for its watch or for nobody). It holds every
        # activation and residual of the step, so nothing keeps it once the step is seen done:
        # kept between steps, it made each step hold the last one's intermediates too.
        self.last_log = log if not wait and record is None else []
        if wait and record is None:  # a recorded step has waited for every action already
            try:
                self._completion.wait((losses, accumulators, applied, results), log,
                                      self.timeout_s)  # fmt: skip
            except PipelineError as e:
                self.fail(e)
                raise
        return accumulators, applied

    def _run_threads(self, program: Callable[[int], Any]) -> dict[int, Any]:
        """Each rank's program in a (pooled) thread of its own, blocking in its RECVs."""
        if self._pool is None:  # daemons: see [Note: threads at exit]
            self._pool = DaemonPool(len(self.ranks), "jaxreshard-stage")
        done: dict[int, Any] = {}

        def worker(r: int) -> None:
            runner = program(r)
            channels = self.channels_of[self.ranks[r][0]]
            try:
                with jax.set_mesh(self.meshes[self.ranks[r][0]]):
                    while True:
                        try:
                            waiting = next(runner)
                        except StopIteration as stop:
                            done[r] = stop.value
                            return
                        channels.wait_any([waiting], time.monotonic() + channels.timeout_s)
            except BaseException as e:
                error = stage_failure(e, self.what(r))
                for each in self.channels:
                    each.fail(error)

        futures = [self._pool.submit(worker, r) for r in self.ranks]
        name = self.where.removesuffix(": ") or "local runtime"
        wait_for_stages(futures, self.channels, self.timeout_s, name)
        return done

    def close(self, join_s: float = JOIN_S) -> None:
        """Free the threads and the channels (idempotent), waiting at most about `join_s`
        for each kind of thread to end (see [Note: threads at exit])."""
        for channels in self.channels:
            channels.close()  # (it joins its sender threads)
        if self._pool is not None:
            self._pool.shutdown(join_s)
            self._pool = None
        self._completion.close(join_s)
