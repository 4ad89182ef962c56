"""Running a profile: train a model with `parallelize` and time every action and transfer.

[Note: what a profile measures]
The first `warmup_steps` steps (the first one compiles) are not timed. Every timed step is one
`Parallelized.profile_call`: the step's wall time from the call until the loss is on the host,
and per stage the `Event`s the runtime records (F/B/W actions, post-gradient segments `A`,
transfers on the sender's lane, and the time a stage sat blocked in a RECV). Recording blocks on
each action's results, so a profiled step dispatches less ahead than an unprofiled one (the tiny
GPT on 2 CPU cores: 1.2-1.3x; actions of 30 ms and more: within 1-2%), and the profile also
times `plain_steps` steps as a training loop runs them (`Session.plain_step`).
The signal-only bound (see [Note: signal-only bound]) runs extra steps whose outputs are thrown
away, so training goes on from correct parameters.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

import jaxreshard as jr
from jaxreshard._jax_compat import make_mesh
from jaxreshard._tracebacks import error_line
from jaxreshard.profiler._config import ProfileConfig
from jaxreshard.runtime.engine._events import Event
from jaxreshard.runtime.step._specs import transplant_spec


@dataclasses.dataclass
class StepRecord:
    """One timed step: wall seconds, the loss, and its events (times from the step's start)."""

    seconds: float
    loss: float
    events: list[Event]
    # The stages whose optimizer segments the driver ran after the hosts' step, in order
    # (`PipelineDriver.last_driver_stages`): segments whose inputs sit on several hosts.
    driver_stages: tuple[int, ...] = ()
    # Per stage, its lead host: a host runs its stages' optimizer segments after all of its
    # ranks' programs have ended (`StepRunner`'s segments, one after another).
    hosts: tuple[int, ...] = ()


def devices_needed(pc: ProfileConfig) -> int:
    return sum(pc.pipeline.devices_per_mesh(pc.num_stages))


class Session:
    """One model under one pipeline config, stepped on demand (comparisons interleave several).

    Args:
        pc: what to run.
        label: a name for tables.
        runtime: the Ray runtime to use when `pc.pipeline.backend == 'ray'`.
    """

    def __init__(self, pc: ProfileConfig, label: str = "", runtime: Any = None):
        self.pc, self.label = pc, label or pc.pipeline.schedule
        spec = pc.spec
        self.module = spec.module
        cfg = pc.model_config
        optimizer = pc.run.make_optimizer()
        params = self.module.init_params(cfg, pc.run.seed)
        self._state_structs = jax.eval_shape(lambda p: (p, optimizer.init(p)), params)
        self.step_fn = spec.train_step(cfg, pc.num_stages, optimizer, pc.candidates)
        pipeline = pc.pipeline
        if pipeline.backend == "ray" and runtime is None:
            raise ValueError("backend 'ray' needs a running Ray runtime (jaxreshard.init)")
        self.pstep = jr.parallelize(self.step_fn, config=pipeline, batch_argnums=(2,))
        self.params = _place_params(pc, params)
        # Optax makes the state's arrays like the parameters (zeros of their shardings), so the
        # pipeline keeps them sharded as the parameters are from the first step on.
        self.opt = optimizer.init(self.params)
        self.compile_seconds = 0.0
        self.steps: list[StepRecord] = []
        self.signal_steps: list[StepRecord] = []
        self.plain_steps: list[StepRecord] = []  # (no events: see `plain_step`)
        self._next_batch = 0
        self.checkpoints: Any = None  # a RunCheckpoints (`--checkpoint`), saving after steps

    @property
    def steps_done(self) -> int:
        """Training steps done (warm-up included, and those of the run it resumed)."""
        return self._next_batch

    def restore(self, path: Any, step: int) -> None:
        """Take the training state of checkpoint `path` (saved after `step` steps, from any
        layout), placed where this pipeline keeps it; the data stream goes on from `step`."""
        target = self.pstep.placement(self.params, self.opt, self._peek_batch())[:2]
        self.params, self.opt = jr.restore_checkpoint(path, target)
        self._next_batch = step

    # -- stepping ---------------------------------------------------------------------------------

    def _batch(self) -> dict[str, Any]:
        batch = self.module.synthetic_batch(
            self.pc.model_config, self.pc.run.batch_size, self._next_batch, self.pc.run.seed
        )
        self._next_batch += 1
        return batch

    def warm_up(self) -> None:
        """Compile, and run the untimed steps.

        They run as the timed ones do (`profile_call`): a recorded step times every action
        apart (the last stage's forward and backward as executables of their own, not the
        fused one of an ordinary call), so the warm-up compiles what the timed steps run and
        nothing they don't."""
        for i in range(self.pc.run.warmup_steps):
            start = time.perf_counter()
            (self.params, self.opt, loss), _ = self.pstep.profile_call(
                self.params, self.opt, self._batch()
            )
            self._check_loss(float(np.asarray(loss)), f"warm-up step {i + 1}")
            if i == 0:
                self.compile_seconds = time.perf_counter() - start
            if self.checkpoints is not None:
                self.checkpoints.after_step(self)

    def step(self, *, signal_only: bool = False) -> StepRecord:
        """One timed step (with `signal_only`, one bound step whose outputs are dropped)."""
        batch = self._batch() if not signal_only else self._peek_batch()
        start = time.perf_counter()
        (params, opt, loss), events = self.pstep.profile_call(
            self.params, self.opt, batch, signal_only=signal_only
        )
        value = float(np.asarray(loss))
        seconds = time.perf_counter() - start
        if not signal_only:
            self._check_loss(value, f"timed step {len(self.steps) + 1}")
            self.params, self.opt = params, opt
            if self.checkpoints is not None:
                self.checkpoints.after_step(self)
        shifted = [dataclasses.replace(e, start=e.start - start, end=e.end - start) for e in events]
        driver = self.pipeline
        lead = {s: hs[0] for s, hs in driver.processes.hosts_of_stage.items()}
        hosts = tuple(lead[s] for s in sorted(lead))
        events = sorted(shifted, key=lambda e: e.start)
        record = StepRecord(seconds, value, events, driver.last_driver_stages, hosts)
        (self.signal_steps if signal_only else self.steps).append(record)
        return record

    def plain_step(self, *, timed: bool = True) -> StepRecord:
        """One step as a training loop runs it: a plain call (nothing recorded, the optimizer
        fused as configured, steps in flight allowed), waited for at its end (the loss on the
        host, the new state ready). Like a signal-only step, it trains nothing: its outputs
        are dropped (the profile's parameters are never donated), so the timed steps' losses
        and the checkpoints are those of consecutive training steps. Untimed (`timed=False`),
        it only compiles what a plain call runs and a recorded one does not."""
        batch = self._peek_batch()
        start = time.perf_counter()
        params, opt, loss = self.pstep(self.params, self.opt, batch)
        value = float(np.asarray(loss))
        jax.block_until_ready((params, opt))
        record = StepRecord(time.perf_counter() - start, value, [])
        self._check_loss(value, f"plain step {len(self.plain_steps) + 1}")
        if timed:
            self.plain_steps.append(record)
        return record

    def _check_loss(self, value: float, when: str) -> None:
        """A loss that is no longer finite ends the run: its timings and profile would describe
        nothing a user trains (and a profile of NaNs would look like a success)."""
        if not np.isfinite(value):
            run = self.pc.run
            raise ValueError(
                f"training diverged: the loss is {value} at {when} (optimizer={run.optimizer!r}, "
                f"learning_rate={run.learning_rate:g}); lower --learning-rate, or set "
                "--clip-norm"
            )

    def _peek_batch(self) -> dict[str, Any]:
        return self.module.synthetic_batch(
            self.pc.model_config, self.pc.run.batch_size, self._next_batch, self.pc.run.seed
        )

    # -- what was built ---------------------------------------------------------------------------

    @property
    def pipeline(self) -> Any:
        return self.pstep.pipeline(self.params, self.opt, self._peek_batch())

    @property
    def layout(self) -> Any:
        return self.pipeline.layout

    def partition(self) -> Any:
        """`partition="auto"`'s report (`PartitionReport`), or None."""
        if self.pc.pipeline.partition != "auto":
            return None
        return self.pstep.plan(self.params, self.opt, self._peek_batch()).partition

    def cuts(self) -> tuple[int, ...] | None:
        """The `jr.stage_candidate` numbers (layer indices: the models mark every layer's end)
        this pipeline cuts after: the config's `cuts`, or `partition="auto"`'s choice; None for
        the model's even `jr.stage_boundary` cuts."""
        if not self.pc.candidates:
            return None
        partition = self.partition()
        return tuple(partition.chosen) if partition is not None else self.pc.pipeline.cuts

    def flops_per_step(self) -> float | None:
        """XLA's count of the unpipelined step's floating-point operations."""
        batch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), self._peek_batch()
        )
        structs = (*self._state_structs, batch)
        try:
            analysis = jax.jit(self.step_fn).trace(*structs).lower().cost_analysis()
        except Exception:  # the count is a nicety; some backends have none
            return None
        if isinstance(analysis, (list, tuple)):
            analysis = analysis[0] if analysis else {}
        flops = (analysis or {}).get("flops")
        return float(flops) if flops and flops > 0 else None

    def memory(self) -> list[dict[str, Any]]:
        """Per stage: micro-batches whose activations its mesh holds at the peak (the
        schedule's, per rank: with virtual stages, counted over the rank's chunks), XLA's size
        of one micro-batch's forward outputs per device (local runtime), and the backend's peak
        bytes in use on the stage's devices (where it reports them)."""
        layout, pipeline = self.layout, self.pipeline
        from jaxreshard.pipeline._simulate import peak_activations

        peaks = peak_activations(layout.schedule)
        rank_of = layout.schedule.rank_of
        compilers = getattr(getattr(pipeline, "compiled", None), "compilers", None)
        out = []
        for s in range(layout.num_stages):
            per_mb = None
            peak_bytes = None
            if compilers is not None:
                try:
                    analysis = compilers[s].executable("forward").memory_analysis()
                    per_mb = int(analysis.output_size_in_bytes) + _kept_inputs(compilers[s])
                except Exception:
                    per_mb = None
                stats = [d.memory_stats() for d in compilers[s].mesh.devices.flat]
                if all(st and "peak_bytes_in_use" in st for st in stats):
                    peak_bytes = max(int(st["peak_bytes_in_use"]) for st in stats)
            out.append(
                {
                    "peak_activations": peaks[rank_of(s)],
                    "activation_bytes_per_microbatch": per_mb,
                    "peak_memory_bytes": peak_bytes,
                }
            )
        return out


def _kept_inputs(compiler: Any) -> int:
    """Bytes per device of the inputs a stage keeps as residuals of every micro-batch (received
    activations, batch feeds: see [Note: residuals kept by reference]), which its forward does
    not write out; its weights, kept once a step, are not counted."""
    from jaxreshard.frontend._split import PARAM
    from jaxreshard.runtime.step._memory import per_device

    bw, specs = compiler.bw, compiler.residual_specs or []
    mesh = dict(compiler.mesh.shape)
    inputs = bw.stage.inputs
    return sum(
        per_device(aval, spec, mesh)
        for aval, i, spec in zip(bw.residuals, bw.forwarded, specs)
        if i is not None and inputs[i].kind != PARAM
    )


def _place_params(pc: ProfileConfig, params: Any) -> Any:
    """Give the parameters the model's tensor-parallel PartitionSpecs (on the first stage's
    mesh shape, over this process's first devices); the pipeline moves them to their stages.
    Without enough devices here (a Ray driver), they stay on the host, replicated."""
    shape = pc.pipeline.mesh_shapes(pc.pipeline.num_meshes(pc.num_stages))[0]
    n = math.prod(shape)
    if len(jax.devices()) < n:
        return params
    grid = np.array(jax.devices()[:n]).reshape(shape)
    mesh = make_mesh(grid, pc.pipeline.mesh_axis_names, pc.pipeline.axis_types)
    axis = "model" if "model" in pc.pipeline.mesh_axis_names else pc.pipeline.mesh_axis_names[-1]
    specs = pc.spec.param_specs(pc.model_config, axis, params)
    sizes = dict(mesh.shape)

    def place(x: Any, spec: Any) -> Any:
        fitted = transplant_spec(spec, sizes, np.shape(x))
        return jax.device_put(x, NamedSharding(mesh, fitted))

    return jax.tree.map(place, params, specs)


def run_steps(
    sessions: Sequence[Session],
    steps: int,
    *,
    signal_only: bool = False,
    plain_steps: int = 0,
    on_step: Callable[[Session, StepRecord], None] | None = None,
    on_failure: Callable[[Session, Exception], None] | None = None,
) -> list[Session]:
    """Step every session `steps` times, round-robin, so that machine noise hits all alike;
    with `plain_steps`, that many plain steps too (`Session.plain_step`), taking turns with
    the timed ones (the first, untimed, compiles what a plain call runs: its time is added to
    `compile_seconds`). With `on_failure`, a session whose step raises is handed to it and
    stepped no more, and the others go on (unless `droppable` says no: a runtime that broke,
    or a bug of ours). Returns the sessions that ran every step."""

    def plain(session: Session, timed: bool = True) -> StepRecord:
        try:
            return session.plain_step(timed=timed)
        except (RuntimeError, MemoryError) as e:  # (where a recorded call runs: memory, say)
            if is_fatal(e):
                raise
            raise RuntimeError(
                "a plain step (a training loop's call, timed beside the recorded steps) "
                f"failed: {error_line(e)}; --plain-steps 0 (plain_steps = 0) times the "
                "recorded steps only"
            ) from e

    live = list(sessions)

    def each(take: Callable[[Session], StepRecord], counted: bool = True) -> None:
        for session in list(live):
            try:
                record = take(session)
            except Exception as e:
                if on_failure is None or not droppable(e):
                    raise
                live.remove(session)
                on_failure(session, e)
                continue
            if counted and on_step is not None:  # (outside the try: its errors are its own)
                on_step(session, record)

    def compile_plain(session: Session) -> StepRecord:
        record = plain(session, timed=False)
        session.compile_seconds += record.seconds
        return record

    if plain_steps:  # (its compile counts as the warm-up's does, with its run)
        each(compile_plain, counted=False)
    for i in range(max(steps, plain_steps)):
        if i < steps:
            each(lambda session: session.step(signal_only=signal_only))
        if i < plain_steps:
            each(plain)
    return live


def droppable(error: Exception) -> bool:
    """Whether a comparison may drop the variant that raised `error` and go on: not if the
    runtime broke (`is_fatal`), nor for an error that is a bug of ours rather than the
    variant's (a `TypeError` or `AttributeError` would fail every variant alike)."""
    return not is_fatal(error) and not isinstance(error, _OUR_BUGS)


_OUR_BUGS = (TypeError, AttributeError, AssertionError)


def is_fatal(error: BaseException) -> bool:
    """Whether `error` leaves nothing more to run: a Ray runtime whose host died
    (`RuntimeBroken`, anywhere in its chain)."""
    from jaxreshard.runtime.ray._wait import RuntimeBroken  # (imports no Ray)

    return any(isinstance(e, RuntimeBroken) for e in _chain(error))


def _chain(error: BaseException | None) -> list[BaseException]:
    # (`__context__` too, even under `raise ... from None`: a wrapper that hides the cause
    # from the traceback still leaves the runtime broken)
    seen: list[BaseException] = []
    while error is not None and error not in seen:
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen
