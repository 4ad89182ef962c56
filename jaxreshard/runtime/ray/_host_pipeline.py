"""A pipeline's part in a Ray host actor: the host engine behind the actor's calls.

The actor (`ray/_actor.py`) keeps one `HostPipeline` per pipeline the driver built; it traces
the step again (the function travels by value, and a fingerprint proves the driver's and this trace
agree), compiles its stages through its `HostEngine`, and turns the driver's step calls into the
engine's: array ids into the arrays it keeps, host data into arrays; the engine's outputs into
ids (with small values), kept here for the next step (see [Note: pipelines on Ray] in
`ray/_pipeline.py`). It also reports progress for the driver's deadline ([Note: progress
deadline]) and lets everything go when the driver drops the pipeline ([Note: pipeline
lifetime]).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxreshard._jax_compat import abstract_mesh, make_mesh
from jaxreshard.frontend._trace import trace_step
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime.driver._driver import StepCall
from jaxreshard.runtime.engine._events import PipelineError
from jaxreshard.runtime.engine._host import HostEngine, SegmentCall, StepInputs
from jaxreshard.runtime.engine._placing import as_named
from jaxreshard.runtime.ray._channels import HostChannels
from jaxreshard.runtime.ray._progress import StepProgress
from jaxreshard.runtime.ray._remote import SMALL_BYTES
from jaxreshard.runtime.ray._wire import from_wire, is_key, local_value, to_wire
from jaxreshard.runtime.step._compile import StageCompiler
from jaxreshard.runtime.step._layout import PipelineLayout
from jaxreshard.runtime.step._specs import place, spec_of, transplant_spec


def _small(x: Any) -> Any:
    """A kept array's value if it is small (it travels with the answer), else None. None too
    for one a later step donated before this answer read it (the caller gave it up: `jax.jit`
    would not let it be read either)."""
    if x.size * np.dtype(x.dtype).itemsize > SMALL_BYTES or x.is_deleted():
        return None
    try:
        return local_value(x, required=False)
    except RuntimeError:
        if x.is_deleted():  # (donated while read)
            return None
        raise


class _WatchedCompiler(StageCompiler):
    """A `StageCompiler` whose calls report to the step's `StepProgress`."""

    progress: StepProgress

    def call(self, name: str, *args: Any) -> Any:
        out = super().call(name, *args)
        self.progress.dispatched(f"stage {self.s}'s {name}", out)
        return out


class _WatchedChannels(HostChannels):
    """`HostChannels` whose arrivals report to the step's `StepProgress`."""

    progress: StepProgress

    def release(self, reason: str, running: bool, wait_s: float) -> None:
        """Close for good (the pipeline is dropped): a step still `running` fails with `reason`
        (its receives wake), the sender threads and the receive pool end (waited for at most
        `wait_s`), and the values in flight and placeholders are let go."""
        if running:
            self.fail(PipelineError(reason))
        self.close()
        deadline = time.monotonic() + wait_s
        with self._cond:
            threads = list(self._senders.values())
        threads += list(getattr(self._receivers, "_threads", ()))  # the pool's workers
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            self._senders.clear()
            self._arrived.clear()
            self._placeholders.clear()
            self._nccl_works = []
        self.signal = _no_signal  # (a bound method of the pipeline: a cycle)

    def forget(self, work_id: str) -> None:
        """Let the transport drop what it keeps of `work_id` and of the works under it."""
        self.transport.forget(work_id)  # type: ignore[attr-defined]

    def deliver(self, key: tuple[Any, ...], *args: Any, **kwargs: Any) -> None:
        super().deliver(key, *args, **kwargs)
        if len(key) == 5:  # an instruction's key: (kind, tensor, micro-batch, from, to)
            kind, tensor, mb, src, dst = key
            what = f"receiving {kind} {tensor} of micro-batch {mb} (stage {src} to {dst})"
        else:
            what = f"receiving {key}"
        self.progress.finished(what)


def _no_signal(hosts: Any, step_id: str, key: tuple[Any, ...]) -> None:
    """A dropped pipeline's channels signal nobody."""


class HostPipeline:
    """The stages of one pipelined step that run on this host (inside the host actor).

    `stage_devices` gives, per stage this host runs, its mesh as a grid of global device ids;
    a stage that spans hosts has devices of other hosts in it (every host of it runs it, see
    [Note: multi-host stages] in `ray/_pipeline.py`)."""

    def __init__(
        self,
        actor: Any,
        key: str,
        fun: Callable[..., Any],
        static: dict[int, Any],
        config: PipelineConfig,
        in_tree: Any,
        avals: Sequence[Any],
        batch_leaves: Sequence[int],
        input_specs: Sequence[P] | None,
        stage_devices: dict[int, Any],
        donated: Sequence[int] = (),
    ):
        self.actor, self.config, self.key = actor, config, key
        self.meshes: dict[int, Mesh] = {s: self._mesh(grid) for s, grid in stage_devices.items()}
        # Traced as the driver did (see [Note: mesh axis types]): with Explicit axes, under this
        # host's own stage mesh, since JAX records the mesh in every equation.
        trace_mesh = (
            abstract_mesh(config.mesh_shapes(None)[0], config.mesh_axis_names, config.axis_types)
            if input_specs is None
            else next(iter(self.meshes.values())).abstract_mesh
        )
        self.graph, _ = trace_step(
            fun,
            in_tree,
            avals,
            batch_leaves,
            config.num_micro_batches,
            trace_mesh,
            config.num_stages,
            input_specs,
            static=static,
            loss_reduction=config.loss_reduction,
            donated=donated,
            cuts=config.cuts,
        )
        self.watch = StepProgress()
        self.engine = HostEngine(
            self.graph,
            config,
            self.meshes,
            compiler=_WatchedCompiler,
            where=f"host {actor.host}: ",
        )
        for compiler in self.engine.compilers.values():
            compiler.progress = self.watch  # type: ignore[attr-defined]
        self.compilers = self.engine.compilers
        self.channels: _WatchedChannels | None = None
        self._step_id = ""
        self._running = 0  # step calls under way
        self.dropped = False
        # Step calls run in the driver's order (`StepCall.seq`), one dispatch at a time (see
        # [Note: asynchronous steps on Ray] in `ray/_hosts.py`).
        self._turn = threading.Condition()
        self._next_seq = 0
        self._moved_at = time.monotonic()  # when a step last took or gave up its turn
        self._cancelled: dict[str, str] = {}  # step id -> why (aborted before its turn)
        self._waiting: dict[str, int] = {}  # steps waiting for their turn -> generation

    def _mesh(self, grid: Any) -> Mesh:
        """A mesh of global device ids as this process's JAX sees it."""
        devices = np.vectorize(lambda g: self.actor.device(int(g)), otypes=[object])(
            np.asarray(grid)
        )
        return make_mesh(devices, self.config.mesh_axis_names, self.config.axis_types)

    def set_layout(
        self,
        layout: PipelineLayout,
        hosts_of_stage: Mapping[int, Sequence[int]],
        transport: str,
        leaf_specs: Sequence[P | None],
    ) -> dict[int, int]:
        """Take the layout; make the channels and the programs, and compile the post-gradient
        segments of this host's stages. Returns the optimizer segments fused into this host's
        stages' last backwards (stage -> segment)."""
        actor = self.actor
        self.channels = _WatchedChannels(
            layout,
            host=actor.host,
            host_of_stage=hosts_of_stage,
            devices=actor.devices,
            meshes=self.meshes,
            transport=actor._nccl_transport() if transport == "nccl" else actor._transport,
            signal=self._signal,
            timeout_s=self.config.timeout_s,
        )
        self.channels.progress = self.watch
        self.engine.warm_segments(layout.param_specs, leaf_specs)
        self.engine.start(layout, dict.fromkeys(self.engine.compilers, self.channels))
        return self.engine.fused

    def drop(self, wait_s: float = 2.0) -> None:
        """Free what this pipeline holds here (`HostActor.pipeline_drop`): a step still running
        fails, the channels close and their threads end (waited for at most `wait_s`), and the
        executables, the traced step and the arrays the pipeline keeps (in flight, placeholders)
        are let go. Arrays kept for the driver's handles (`HostActor.whole`) stay until freed.
        Idempotent."""
        if self.dropped:
            return
        self.dropped = True
        channels, self.channels = self.channels, None
        if channels is not None:
            host = self.actor.host
            channels.release(f"host {host}: pipeline {self.key} was closed", self._running > 0,
                             wait_s)  # fmt: skip
            if not self._running:  # (a running step's own receives may still read it)
                channels.forget(self.key)
        self.engine.close()
        self.compilers = {}

    def _signal(self, hosts: Sequence[int], step_id: str, key: tuple[Any, ...]) -> None:
        for h in hosts:
            self.actor.peers[h].pipeline_signalled.remote(self.key, step_id, key)

    def progress(self, step_id: str) -> tuple[int, str, float]:
        """What this host finished of step `step_id` so far (see [Note: progress deadline])."""
        return self.watch.report(step_id)

    def signalled(self, step_id: str, key: tuple[Any, ...]) -> None:
        if self.channels is not None:
            self.channels.signalled(step_id, key)

    def abort(self, step_id: str, reason: str) -> None:
        """Stop step `step_id` (a peer failed, or a step before it did): the running one's
        waits end with `reason`; one still queued here (or not yet arrived) will not run."""
        if not step_id.startswith(f"{self.key}:"):
            return  # (another pipeline's step, or a resharding)
        if self.channels is not None and step_id == self._step_id:
            self.channels.fail(PipelineError(f"host {self.actor.host}: stopped: {reason}"))
        with self._turn:
            if len(self._cancelled) > 1024:  # (steps that had run already: forget the oldest)
                del self._cancelled[next(iter(self._cancelled))]
            self._cancelled[step_id] = reason

    # Values between the driver and the engine ---------------------------------------------------

    def _held(self, array_id: str, shape: Sequence[int], sharding: NamedSharding) -> jax.Array:
        """Array `array_id` with `sharding` (this host's shards of it): as a step kept it, when
        it has that sharding (a parameter from the last step), moved to it when a step kept it
        on the same devices otherwise (the driver's handle of an asynchronous step's output
        says what the last step made: see [Note: asynchronous steps on Ray]), else put
        together from its shards here."""
        whole = self.actor.whole.get(array_id)
        if whole is not None:
            if whole.sharding.is_equivalent_to(sharding, len(shape)):
                return whole
            if whole.sharding.device_set == sharding.device_set:
                return jax.device_put(whole, sharding)
        return self.actor.assembled(array_id, sharding, tuple(shape))

    def _value(self, item: tuple[str, Any], aval: Any, mesh: Mesh) -> Any:
        """A value a driver call describes, for a stage on `mesh`: an array this host keeps
        (on its own mesh; the engine moves it where it is needed), host data laid out with a
        spec (placed so on `mesh` where it fits, else replicated), or host data."""
        kind, value = item
        if kind == "answer":
            return self._answered(*value)
        if kind == "id":
            array_id, spec, grid = value
            return self._held(array_id, aval.shape, NamedSharding(self._mesh(grid), P(*spec)))
        if kind == "laid":
            data, spec = value
            data = np.asarray(data, aval.dtype)
            fitted = transplant_spec(P(*spec), dict(mesh.shape), data.shape)
            return place(data, NamedSharding(mesh, fitted))
        return from_wire(value)

    def _answered(self, answer: Any, array_id: str) -> Any:
        """A small output of a step another host runs, from that step's answer (see
        `RayHosts.ref`): waited for as a boundary tensor is, until it comes, the step fails,
        or this step is aborted."""
        import ray

        start = time.monotonic()
        bound = self.config.timeout_s * 10  # (the driver's progress deadline ends it before)
        while not ray.wait([answer], timeout=1.0)[0]:
            if self.channels is not None and self.channels.stopped:
                raise PipelineError(f"host {self.actor.host}: stopped while waiting for {array_id}")
            if time.monotonic() - start > bound:
                raise PipelineError(
                    f"host {self.actor.host}: {array_id}, made by a step on another host, did not "
                    f"come within {bound:g} s (10 x timeout_s)"
                )
        result = ray.get(answer)
        for kind in ("applied", "segments"):
            for described in result[kind].values():
                for d in described:
                    if d[0] == array_id:
                        return d[4]
        raise PipelineError(f"host {self.actor.host}: no {array_id} in its step's answer")

    def _describe(self, array_id: str, value: Any) -> tuple[Any, ...]:
        """Keep `value` here as `array_id`; describe it for the driver: (id, spec, shape,
        dtype, None); the step's answer puts a small array's value last (`_small`), so the
        driver need not fetch it (an optimizer's step count, say)."""
        if not isinstance(value.sharding, NamedSharding) and not is_key(value):
            mesh = next(
                (
                    m
                    for m in self.meshes.values()
                    if set(m.devices.flat) == value.sharding.device_set
                ),
                None,
            )
            value = as_named(value, mesh) if mesh is not None else value
            if not isinstance(value.sharding, NamedSharding):
                raise PipelineError(
                    f"host {self.actor.host}: {array_id} has a {type(value.sharding).__name__} "
                    "that no stage mesh expresses as a PartitionSpec; this is a jaxreshard bug, "
                    "please report it"
                )
        self.actor._keep(array_id, value)
        return (array_id, tuple(spec_of(value.sharding)), value.shape, np.dtype(value.dtype).name,
                None)  # fmt: skip

    # A step ---------------------------------------------------------------------------------------

    def step(self, call: StepCall) -> dict[str, Any]:
        """Run this host's part of a step: once the steps sent before it have been dispatched
        here, dispatch its stages and the post-gradient segments the driver placed here, and
        keep gradients and outputs (the next step may go on); then wait for its values and
        return losses (hosts of the last stage), what was kept (described, with the values of
        small arrays), aux outputs, events."""
        if self.dropped:
            raise PipelineError(f"host {self.actor.host}: pipeline {self.key} was closed")
        assert self.channels is not None, "set_layout first"
        channels = self.channels
        self._running += 1
        try:
            try:
                self._await_turn(call)  # (if it gives up, the steps after it need not wait)
                with self._turn:
                    why = self._cancelled.pop(call.step_id, None)
                if why is not None:
                    raise PipelineError(
                        f"host {self.actor.host}: step {call.step_id} was cancelled: {why}"
                    )
                try:
                    out, result = self._dispatch(call)
                except BaseException:
                    # The steps queued behind it, sent before the driver knew of a failure,
                    # read what it would have made.
                    with self._turn:
                        for step_id, generation in self._waiting.items():
                            if generation == call.generation:
                                self._cancelled[step_id] = f"step {call.step_id} failed before it"
                    raise
            finally:
                with self._turn:
                    if call.seq >= 0:
                        self._next_seq = max(self._next_seq, call.seq + 1)
                    self._moved_at = time.monotonic()
                    self._turn.notify_all()
            return self._answer(call, out, result)
        finally:
            self._running -= 1
            if self.dropped and not self._running:  # dropped during the step: now it is over
                channels.forget(self.key)

    def _await_turn(self, call: StepCall) -> None:
        """Wait until the steps sent before `call` have been dispatched here. A step that is
        dispatching has deadlines of its own; one that never arrives fails this one after
        `timeout_s` without any step moving. A step waiting here is cancelled if one before it
        fails here."""
        limit = self.config.timeout_s
        with self._turn:
            self._waiting[call.step_id] = call.generation
            try:
                while call.seq > self._next_seq and not self.dropped:
                    idle = time.monotonic() - self._moved_at
                    if idle > limit and self._running == len(self._waiting):  # none dispatches
                        raise PipelineError(
                            f"host {self.actor.host}: step {call.step_id} (call {call.seq} of "
                            f"pipeline {self.key}) waited {idle:.0f} s for call "
                            f"{self._next_seq}, which never reached this host (the driver or "
                            "its link to this host failed?)"
                        )
                    self._turn.wait(1.0)
            finally:
                self._waiting.pop(call.step_id, None)
            if self.dropped:
                raise PipelineError(f"host {self.actor.host}: pipeline {self.key} was closed")
            self._moved_at = time.monotonic()

    def _dispatch(self, call: StepCall) -> tuple[Any, dict[str, Any]]:
        """Dispatch this host's part of step `call`; keep its outputs here under their ids
        (those the driver builds its handles with: `_predicted` in `ray/_hosts.py`); describe them
        without values."""
        g, step_id = self.graph, call.step_id
        self._step_id = step_id
        self.watch.begin(step_id)
        avals = g.outer.in_avals
        layout = self.engine.layout
        assert layout is not None
        params = {
            k: self._held(
                array_id,
                avals[g.params[k]].shape,
                NamedSharding(self.meshes[g.owner[k]], layout.param_specs[k]),
            )
            for k, array_id in call.params.items()
        }
        grad_vars = set(g.grad_outputs[1:])
        apply_inputs = {}
        for s, items in call.apply_inputs.items():
            seg = g.segments[self.engine.fused[s]]
            others = [v.aval for v in seg.inputs if v not in grad_vars]
            mesh = self.meshes[s]
            apply_inputs[s] = [self._value(item, a, mesh) for item, a in zip(items, others)]
        segments = []
        for j, items in call.segments:
            inputs = []
            for (kind, value), var in zip(items, g.segments[j].inputs):
                if kind in ("grad", "out"):
                    inputs.append((kind, value))
                else:
                    mesh = self.meshes[g.segments[j].stage]
                    inputs.append(("value", self._value((kind, value), var.aval, mesh)))
            segments.append(SegmentCall(j, inputs))
        out = self.engine.step(
            StepInputs(
                step_id,
                params,
                {f: from_wire(x) for f, x in call.feeds.items()},
                {c: from_wire(x) for c, x in call.consts.items()},
                apply_inputs,
                segments,
                call.record,
                call.signal_only,
            ),
            wait=False,  # the driver's progress deadline watches this host (StepProgress)
            on_segment=self.watch.dispatched,
        )
        result: dict[str, Any] = {
            "grads": {k: self._describe(f"{step_id}:grad{k}", v)[0] for k, v in out.grads.items()},
            "applied": {
                s: [self._describe(f"{step_id}:fused{s}:{n}", v) for n, v in enumerate(values)]
                for s, values in out.applied.items()
            },
            "segments": {
                j: [self._describe(f"{step_id}:seg{j}:{n}", v) for n, v in enumerate(values)]
                for j, values in out.segments.items()
            },
        }
        return out, result

    def _answer(self, call: StepCall, out: Any, result: dict[str, Any]) -> dict[str, Any]:
        """The step's answer to the driver, once its values are computed: `result` with the
        values of small kept arrays, the losses, the aux outputs and the events."""
        for kind in ("applied", "segments"):
            for i, values in getattr(out, kind).items():
                result[kind][i] = [(*d[:4], _small(v)) for d, v in zip(result[kind][i], values)]
        result["losses"] = None if out.losses is None else [local_value(v) for v in out.losses]
        result["results"] = {}
        m = self.config.num_micro_batches
        for j in sorted({j for j, _ in out.results}):
            result["results"][j] = [to_wire(out.results[(j, mb)]) for mb in range(m)]
        if call.record:
            result["events"] = [e.__dict__ for e in out.events]
            result["clock"] = time.time() - time.perf_counter()  # to align hosts' event times
        return result

    def segment(self, index: int, step_id: str, inputs: list[tuple[str, Any]]) -> list[Any]:
        """Run post-gradient segment `index` here now; keep its outputs; describe them."""
        seg = self.graph.segments[index]
        mesh = self.meshes[seg.stage]
        values = [self._value(item, var.aval, mesh) for item, var in zip(inputs, seg.inputs)]
        outs = self.engine.segment(index, values)
        return [
            (*self._describe(f"{step_id}:seg{index}:{n}", v)[:4], _small(v))
            for n, v in enumerate(outs)
        ]
