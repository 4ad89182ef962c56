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
import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

import jaxreshard as jr
from jaxreshard._jax_compat import make_mesh
from jaxreshard._tracebacks import error_line
from jaxreshard.pipeline import Costs
from jaxreshard.pipeline._costs import SharedCost
from jaxreshard.pipeline._schedule import PARAM_GRAD
from jaxreshard.profiler._config import ProfileConfig
from jaxreshard.runtime.engine._events import APPLY_EVENT, ARRIVE, SEND, WAIT, Event
from jaxreshard.runtime.step._specs import transplant_spec

COMPUTE_KINDS = ("F", "B", "W", APPLY_EVENT)
LOCAL_STRATEGY = "local"  # between two stages of one mesh (virtual stages): nothing moves


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


# -- statistics -----------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def stage_stats(steps: Sequence[StepRecord], schedule: Any) -> list[dict[str, float]]:
    """Per stage, medians over steps: compute seconds, seconds blocked in RECVs, and the bubble
    of its mesh (1 - the compute of all the rank's stages / step time)."""
    out = []
    rank_of = schedule.rank_of
    for s in range(schedule.num_chunks):
        mates = set(schedule.chunks_of(rank_of(s)))
        compute, blocked, bubble = [], [], []
        for st in steps:
            c = sum(e.end - e.start for e in st.events if e.stage == s and e.kind in COMPUTE_KINDS)
            w = sum(e.end - e.start for e in st.events if e.stage == s and e.kind == WAIT)
            busy = sum(
                e.end - e.start for e in st.events if e.stage in mates and e.kind in COMPUTE_KINDS
            )
            compute.append(c)
            blocked.append(w)
            bubble.append(max(0.0, 1.0 - busy / st.seconds) if st.seconds > 0 else 0.0)
        out.append(
            {
                "stage": s,
                "rank": rank_of(s),
                "compute_seconds": median(compute),
                "blocked_seconds": median(blocked),
                "bubble_fraction": median(bubble),
            }
        )
    return out


def transfer_stats(steps: Sequence[StepRecord], layout: Any) -> list[dict[str, Any]]:
    """Per boundary tensor (and gradient, parameter copy): its layouts, plan and the median
    measured time of one transfer."""
    durations = transfer_durations(steps)
    rows = []
    for t in sorted(layout.transfers.values(), key=_transfer_order):
        measured = durations.get(t.name, [])
        kind = t.name.split(" ")[0].rstrip("0123456789")
        rows.append(
            {
                "name": t.name,
                "kind": kind,
                "src_stage": t.src_stage,
                "dst_stage": t.dst_stage,
                "shape": list(t.shape),
                "dtype": np.dtype(t.dtype).name,
                "src_spec": _spec_text(t.src_spec),
                "dst_spec": _spec_text(t.dst_spec),
                "src_mesh": dict(layout.mesh_shapes[t.src_stage]),
                "dst_mesh": dict(layout.mesh_shapes[t.dst_stage]),
                "strategy": t.plan.strategy if t.plan else LOCAL_STRATEGY,
                "chosen": t.plan.chosen if t.plan else LOCAL_STRATEGY,
                "bytes": t.nbytes,
                "planned_seconds": t.plan.seconds if t.plan else 0.0,
                "measured_seconds": median(measured) if measured else None,
                "per_step": len(measured) / max(1, len(steps)),
            }
        )
    return rows


def _transfer_order(t: Any) -> tuple[Any, ...]:
    kind = t.name.split(" ")[0].rstrip("0123456789")
    order = {"act": 0, "grad": 1, "param": 2, "param_grad": 3}
    return (order.get(kind, 9), t.src_stage, t.dst_stage, t.name)


def _spec_text(spec: Any) -> str:
    parts = []
    for entry in tuple(spec):
        if entry is None:
            parts.append("None")
        elif isinstance(entry, tuple):
            parts.append("(" + ",".join(entry) + ")")
        else:
            parts.append(str(entry))
    return "P(" + ", ".join(parts) + ")"


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


# -- the simulator's prediction for a measured run ------------------------------------------------


_BLOCKED = 20e-6  # a receive that took longer waited for its value (a ready one takes ~5 us)


def transfer_durations(steps: Sequence[StepRecord]) -> dict[str, list[float]]:
    """Per transfer name: each micro-batch's time on the wire, from the start of its send to
    its arrival at the last receiver (the `arrive` events of every receiving host, on the
    driver's clock), or to the send's end where no receiver records one (a transfer inside a
    process, whose send ends when the value is there). A sender's own end (its bytes handed
    to the transport) says nothing of the link: on 0.01 GB/s NICs a 1 MiB activation's send
    ended after 1.5 ms, its arrival 105 ms later. Where a receiver was blocked waiting for it,
    the transfer ends when that wait did (the receiving thread woke with the value): in one
    process a send's end is its arrival, but the blocked receiver woke 0.6 ms later (median;
    mean 1.7 ms) on this 2-core VM with 4 stages' threads."""
    out: dict[str, list[float]] = {}
    for st in steps:
        for (name, _), (start, end) in _transfer_spans(st).items():
            out.setdefault(name, []).append(end - start)
    return out


def _transfer_spans(st: StepRecord) -> dict[tuple[str, int], tuple[float, float]]:
    """Per (transfer name, micro-batch) of a step: its send's start and its arrival (see
    `transfer_durations`)."""
    arrivals: dict[tuple[str, int], float] = {}
    for e in st.events:
        if e.kind == ARRIVE or (e.kind == WAIT and e.end - e.start > _BLOCKED):
            key = (e.name, e.mb)
            arrivals[key] = max(arrivals.get(key, e.end), e.end)
    return {
        (e.name, e.mb): (e.start, max(e.end, arrivals.get((e.name, e.mb), e.end)))
        for e in st.events
        if e.kind == SEND and e.nbytes > 0
    }


def link_service_times(
    steps: Sequence[StepRecord], layout: Any
) -> dict[tuple[int, int, str], list[float]]:
    """Per (src chunk, dst chunk, kind) the times the simulator's links took, as measured:
    kind `x` is a micro-batch's activations (src < dst, adjacent chunks) or gradients (src >
    dst), `param` the copies of the parameters src keeps and dst reads, `param_grad` their
    gradients back. Each is all of that micro-batch's (or step's) tensors between the two
    chunks, from the end of the action that made them (the F, the B, the user's last action;
    else the first send's start), or from the previous arrival on the same link if later, to
    the last one's arrival.

    A transfer's own time (`transfer_durations`) counts its wait behind the ones before it
    on the link, which the simulator queues itself, and leaves out the time before its send
    starts, which the simulator does not know of. On the 2-host emulated cluster at 0.01
    GB/s (one core per host):
    - eager-1F1B sent a tiny GPT's activations faster than the link took them: their
      medians (5.0 ms, the queue in them) predicted its step 24% long;
    - under ZB-H1 a host's sender thread began a send 0.1-1.4 ms after its F had ended (the
      host's one core was dispatching the next action): from the send's start, the step
      was predicted 12% short;
    - the tied embedding's gradient took 12.8 ms behind 4 micro-batches' gradients and
      2.7 ms behind 8 smaller ones: its queue, not the link.
    Kinds `first` and `later` repeat the activations of the first micro-batch and of the
    others (`Costs.comm_first` is the first's extra over the others'): on Ray a
    step's first send over a boundary arrived 1-4 ms later than the others (a tiny GPT under
    ZB-H1, the user-model template's MLP), which delays every stage after it."""
    names = {t.name: t for t in layout.transfers.values()}
    out: dict[tuple[int, int, str], list[float]] = {}
    for st in steps:
        made: dict[tuple[int, str, int], float] = {}  # (chunk, kind, mb) -> its end
        last: dict[int, float] = {}  # chunk -> its last action's end
        for e in st.events:
            if e.kind in ("F", "B", "W", "FB"):
                made[(e.stage, e.kind, e.mb)] = e.end
                last[e.stage] = max(last.get(e.stage, e.end), e.end)
        groups: dict[tuple[int, int, int, str], list[float]] = {}  # -> [start, end]
        for (name, mb), (start, end) in _transfer_spans(st).items():
            t, kind = names.get(name), _kind(name)
            if t is None:
                continue
            src, dst = t.src_stage, t.dst_stage
            if kind in ("act", "grad"):
                if abs(src - dst) != 1:
                    continue  # (a skip past a stage: no boundary of the simulator's)
                by = "F" if src < dst else "B"
                start = made.get((src, by, mb), made.get((src, "FB", mb), start))
                kind = "x"
            elif kind == "param_grad":
                start = last.get(src, start)
            span = groups.setdefault((src, dst, mb, kind), [start, end])
            span[0], span[1] = min(span[0], start), max(span[1], end)
        free: dict[tuple[int, int], float] = {}
        order = {"param": 0, "x": 1, "param_grad": 2}  # (ties: in the order they are sent)
        ranked = sorted(groups.items(), key=lambda g: (g[1][0], order[g[0][3]], g[1][1]))
        for (src, dst, mb, kind), (start, end) in ranked:
            link = (src, dst)
            begin = max(start, free.get(link, start))
            out.setdefault((src, dst, kind), []).append(max(0.0, end - begin))
            if kind == "x" and src < dst:  # (the step's first on the boundary, and the rest)
                what = "first" if mb == 0 else "later"
                out.setdefault((src, dst, what), []).append(max(0.0, end - begin))
            free[link] = max(free.get(link, end), end)
    return out


def host_between_actions(steps: Sequence[StepRecord], schedule: Any) -> list[float]:
    """Per chunk, the mean time its rank spends after one of the chunk's F, B or W actions
    before the rank's next action starts, less the time it waits there for a receive (see
    [Note: host time between actions]); 0.0 for a chunk no action of which another followed.

    [Note: host time between actions]
    A stage's thread posts the sends of an action's outputs (a resharding, a put on the
    transport) and drops what is dead before it dispatches the next action, and a timed step
    blocks on each action; none of that is inside an action's own time. On this 2-core VM it
    took 0.3-0.6 ms per action of a tiny GPT (a 64 KiB in-process send 0.2-2 ms), beside
    actions of 1-5 ms: the simulator, which ran a rank's actions back to back, predicted its
    steps 5-10% short. So the simulator keeps a rank busy for this time after each action
    (`Costs.host`), with the action's outputs already sent: a receiver waits for the transfer,
    not for the sender's host."""
    rank_of = schedule.rank_of
    gaps: dict[int, list[float]] = {}
    for st in steps:
        by_rank: dict[int, list[Any]] = {}
        waits: dict[int, list[Any]] = {}
        for e in st.events:
            if 0 <= e.stage < schedule.num_chunks:
                if e.kind in ("F", "B", "W", "FB"):
                    by_rank.setdefault(rank_of(e.stage), []).append(e)
                elif e.kind in (WAIT, APPLY_EVENT):  # (a gradient sum `{c}R`: the apply's)
                    waits.setdefault(rank_of(e.stage), []).append(e)
        for r, actions in by_rank.items():
            actions.sort(key=lambda e: e.start)
            for x, y in itertools.pairwise(actions):
                waited = sum(max(0.0, min(w.end, y.start) - max(w.start, x.end))
                             for w in waits.get(r, ()))  # fmt: skip
                gaps.setdefault(x.stage, []).append(max(0.0, y.start - x.end - waited))
    return [statistics.fmean(gaps[c]) if c in gaps else 0.0 for c in range(schedule.num_chunks)]


def _kind(name: str) -> str:
    """A runtime transfer's kind from its name: `act`, `grad`, `param` or `param_grad`."""
    return name.split(" ")[0].rstrip("0123456789")


def measured_costs(steps: Sequence[StepRecord], layout: Any) -> Costs:
    """The schedule cost model of a measured run (seconds): per stage the mean F, B, W and
    optimizer (A) times and its host's time between actions (`host_between_actions`); per
    boundary the median time the link took a micro-batch's activations (those after the
    first; the first's extra is `comm_first`) and, apart, its gradients; the shared
    parameters' copies and gradients (all as `link_service_times` times them).

    Compute times are means, not medians: a step lasts the sum of its actions, and the sum of
    n actions is n means; on a loaded machine action times are skewed (a few stretched by
    another process), and medians of them predicted steps 6-10% short. Transfer times are
    medians: most of them overlap compute, and a boundary's mean is set by its rare long
    ones (a U-Transformer skip's mean was 22x its median), which predicted 4-stage steps up
    to 18% long on this VM's local runtime."""
    schedule = layout.schedule
    n = schedule.num_chunks
    times: dict[tuple[int, str], list[float]] = {}
    for st in steps:
        applied: dict[int, float] = {}
        for e in st.events:
            if e.kind in ("F", "B", "W"):
                times.setdefault((e.stage, e.kind), []).append(e.end - e.start)
            elif e.kind == APPLY_EVENT:
                applied[e.stage] = applied.get(e.stage, 0.0) + e.end - e.start
        for s, seconds in applied.items():
            times.setdefault((s, "A"), []).append(seconds)

    def mean(s: int, kind: str) -> float:
        values = times.get((s, kind))
        return statistics.fmean(values) if values else 0.0

    split = schedule.split_backward
    forward = [mean(s, "F") for s in range(n)]
    backward = [mean(s, "B") + (mean(s, "W") if split else 0.0) for s in range(n)]
    weight = [mean(s, "W") if split else b / 2 for s, b in zip(range(n), backward)]
    service = link_service_times(steps, layout)

    def seconds(src: int, dst: int, kind: str = "x") -> float:
        values = service.get((src, dst, kind))
        return median(values) if values else 0.0

    # Activations: the micro-batches after the first (the first's extra apart: comm_first).
    comm = [seconds(b, b + 1, "later" if (b, b + 1, "later") in service else "x")
            for b in range(n - 1)]  # fmt: skip
    comm_back = [seconds(b + 1, b) for b in range(n - 1)]
    first = [
        max(0.0, seconds(b, b + 1, "first") - comm[b]) if (b, b + 1, "first") in service else 0.0
        for b in range(n - 1)
    ]
    # Shared parameters, per owner and user: their copies, and their gradients back.
    pairs = {(o, u) for o, u, kind in service if kind == "param"}
    grads = {(o, u) for u, o, kind in service if kind == "param_grad"}
    shared = [
        SharedCost(o, u, seconds(o, u, "param"), (o, u) in grads, seconds(u, o, "param_grad"))
        for o, u in sorted(pairs)
    ]
    return Costs.make(
        n,
        forward=forward,
        backward=backward,
        weight_grad=weight,
        comm=comm,
        apply=[mean(s, "A") for s in range(n)],
        host=host_between_actions(steps, schedule),
        comm_back=comm_back,
        comm_first=first,
    ).with_shared(shared)


def step_overhead(steps: Sequence[StepRecord]) -> float:
    """The median time a step spends outside its stages' actions: from the call to the first
    action (the driver splitting the batch and dispatching to the hosts) and from the last
    action's end to the call's return (results back to the driver)."""
    spans = [
        min(e.start for e in st.events) + st.seconds - max(e.end for e in st.events)
        for st in steps
        if st.events
    ]
    return max(0.0, median(spans)) if spans else 0.0


def predicted_step(steps: Sequence[StepRecord], layout: Any) -> tuple[float, Costs]:
    """What the pipeline simulator says a step of this schedule takes with the measured costs
    (transfers overlapping compute, as the runtime runs them), and those costs.

    A parameter shared by two stages (a tied embedding) is in the costs (`Costs.shared`, as
    measured): the simulator sends its copy at the step's start, ahead of the activations on
    the same link, and its gradient back after the user's last action. The optimizer
    segments run after the pipeline (`OptimizerPhase`). The step's fixed cost outside the
    pipeline (`step_overhead`: dispatch and results) is added as measured.
    """
    costs = measured_costs(steps, layout)
    phase = OptimizerPhase.measured(steps, layout.schedule)
    return phase.predict(layout.schedule, costs) + step_overhead(steps), costs


@dataclasses.dataclass(frozen=True)
class OptimizerPhase:
    """When a step's optimizer segments end, from a simulation of its pipeline whose applies
    took no time ([Note: the optimizer after the pipeline]).

    Attributes:
        hosts: per rank (mesh), its lead host (`StepRecord.hosts`, by the rank of each
            chunk): a schedule of the same meshes and another placement of chunks (ZB-V's V
            against interleaved) finds each chunk's host through its own placement.
        seconds: per host, the measured mean time from its stages' last F, B or W (or
            receive) to the end of the last optimizer segment it ran (`apply_phases`).
        on_driver: the chunks whose segments the driver ran (`StepRecord.driver_stages`).

    [Note: the optimizer after the pipeline]
    A host runs the optimizer segments of its stages after all of its ranks' programs have
    ended, dispatched in order (on separate devices they may overlap; the time is measured,
    not summed); the driver runs a segment whose inputs sit on several hosts after every
    host's part, in turn. The simulator ran each chunk's apply after that chunk's last
    action, beside the other ranks' work: on one host of two tiny-GPT stages, 1.6 ms before
    the segments really began. So a prediction simulates the pipeline without its applies,
    then ends each host's part its measured time (`seconds`) after its last action, or after
    a shared parameter's gradient is back (the summed applies where it ran none), and adds
    the driver's applies after the latest.
    """

    hosts: tuple[int, ...]
    seconds: dict[int, float]
    on_driver: tuple[int, ...]

    @classmethod
    def measured(cls, steps: Sequence[StepRecord], schedule: Any) -> OptimizerPhase:
        last = steps[-1] if steps else StepRecord(0.0, 0.0, [])
        on_driver = tuple(sorted(set(last.driver_stages)))
        n, p = schedule.num_chunks, schedule.num_stages
        chunk_hosts = last.hosts if len(last.hosts) == n else tuple(range(n))
        ranks = {schedule.rank_of(c): chunk_hosts[c] for c in range(n)}
        hosts = tuple(ranks.get(r, r) for r in range(p))
        return cls(hosts, apply_phases(steps, chunk_hosts, on_driver), on_driver)

    def hosts_of(self, schedule: Any) -> tuple[int, ...]:
        """Per chunk of `schedule`, its host (each rank its own where the rank counts differ)."""
        p = schedule.num_stages
        hosts = self.hosts if len(self.hosts) == p else tuple(range(p))
        return tuple(hosts[schedule.rank_of(c)] for c in range(schedule.num_chunks))

    @staticmethod
    def last_actions(timeline: Any) -> dict[int, float]:
        """Per chunk, when its last simulated F, B or W ends."""
        last: dict[int, float] = {}
        for rank in timeline.stages:
            for t in rank:
                if t.action.kind != "A":
                    c = t.action.stage_index
                    last[c] = max(last.get(c, t.end), t.end)
        return last

    def predict(self, schedule: Any, costs: Costs) -> float:
        """The simulated step (without its fixed cost) of `schedule` under `costs`, its
        optimizer run after the pipeline."""
        from jaxreshard.pipeline import simulate

        n = costs.num_stages
        timeline = simulate(schedule.with_apply(), dataclasses.replace(costs, apply=(0.0,) * n))
        return self.end(timeline, costs.apply)

    def end(self, timeline: Any, apply: Sequence[float]) -> float:
        """The step's end (without its fixed cost): `timeline` simulated with no apply time,
        `apply` each chunk's measured optimizer seconds."""
        hosts = self.hosts_of(timeline.schedule)
        n = len(hosts)
        gradients: dict[int, float] = {}  # chunk -> when its shared parameters' gradients are in
        for tt in timeline.transfers:
            if tt.transfer.kind == PARAM_GRAD:
                c = tt.transfer.dst
                gradients[c] = max(gradients.get(c, tt.end), tt.end)
        last = self.last_actions(timeline)
        end = timeline.makespan
        for h in set(hosts):
            here = [c for c in range(n) if hosts[c] == h]
            at = max(max(last.get(c, 0.0), gradients.get(c, 0.0)) for c in here)
            mine = [c for c in here if c not in self.on_driver]
            end = max(end, at + (self.seconds.get(h, sum(apply[c] for c in mine)) if mine else 0))
        return end + sum(apply[c] for c in self.on_driver)


def apply_phases(
    steps: Sequence[StepRecord], host_of: Sequence[int], on_driver: Sequence[int]
) -> dict[int, float]:
    """Per host, the mean time from the end of its stages' last F, B or W (or receive: a shared
    parameter's gradient) to the end of their last optimizer segment run there (not by the
    driver): the host winds its ranks' threads
    down, places the gradients and runs the segments one after another (on this 2-core VM a
    tiny GPT's two stages in one process: 1.6 ms before the first, then 1.0 and 1.1 ms each,
    where their summed applies said 2.1 ms after the later stage's last action)."""
    spans: dict[int, list[float]] = {}
    for st in steps:
        last: dict[int, float] = {}
        applied: dict[int, float] = {}
        for e in st.events:
            if not 0 <= e.stage < len(host_of):
                continue
            h = host_of[e.stage]
            if e.kind in ("F", "B", "W", "FB", WAIT):  # (a wait: the gradient of a shared one)
                last[h] = max(last.get(h, e.end), e.end)
            elif e.kind == APPLY_EVENT and not (e.stage in on_driver and e.name == "apply"):
                applied[h] = max(applied.get(h, e.end), e.end)
        for h, end in applied.items():
            if h in last:
                spans.setdefault(h, []).append(max(0.0, end - last[h]))
    return {h: statistics.fmean(v) for h, v in spans.items()}
