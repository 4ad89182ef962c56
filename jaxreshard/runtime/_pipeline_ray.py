"""Pipelines on the Ray runtime: stages live in host actors, transfers go host to host.

[Note: pipelines on Ray]
Each stage's mesh must sit inside one host. The driver traces and cuts the step; every host
actor that runs stages traces and cuts it too (the step function travels by value, and a
fingerprint proves both traces agree), compiles its own stages, and is sent the layout: specs,
transfer plans over the runtime's device ids, and its stages' instruction lists. A step then
runs in the actors through the executor core of `_executor.py`: one `StageProgram` thread per
stage, with `HostChannels` (`_host_channels.py`) moving boundary tensors, inside the host by a
local resharding and to other hosts by the plan's host programs over the runtime's transport
(see [Note: boundary tensors]). The driver sends one call per host per step (micro-batches in;
losses, small outputs and array handles out). Parameters, gradients and optimizer state stay in
the actors: a host keeps a step's outputs as the jax.Arrays they are, the optimizer segments
whose inputs are all on one host run there within the step call, and the step returns
`RemoteArray`s that the next call hands straight back. Handles the driver drops are freed in
one batched message per host with the next call.

[Note: progress deadline]
A step may take as long as it needs while it gets on: the driver's wait for the hosts' step calls
ends only when none of the hosts still busy has made progress for `PipelineConfig.timeout_s`
(plus `STEP_GRACE_S`, so that a host's own deadline, which names the transfer it waited for,
speaks first). Every second the driver asks each busy host for its `StepProgress` (a call beside
the step: the actor is threaded); a host progresses when an action it dispatched has finished (its
outputs are ready), a boundary tensor has arrived, or a post-gradient segment has run. The
progress deadline then fails a hung device or host callback, which nothing inside the hosts can
interrupt, in bounded time, and names each host's last finished action.

[Note: pipeline lifetime]
The host actors keep a pipeline (its traced step, compiled executables, channels with their
sender threads and receive pool, placeholders) until the driver lets it go: `RayPipeline.close`
(`Parallelized` evicting or closing a compiled step), `jaxreshard.shutdown()` (which closes every
pipeline it tracks), or dropping the `RayPipeline`, whose `weakref.finalize` holds only the key,
the hosts and a weak reference to the runtime. `close` tells every host now and waits a few
seconds at most (a dead host, or a runtime already shut down, is skipped); the finalizer may run
at any point of any thread, so it only queues the drop for the runtime's drop thread, and at
interpreter exit it does nothing (the actors go with Ray). A host drops it in
`HostActor.pipeline_drop`: a step still running fails, the channels close and their threads end,
and the executables, including the post-gradient segments' (jitted per pipeline for this), go.
Arrays a step kept for the driver's `RemoteArray`s (parameters, optimizer state) stay until those
handles are freed: they outlive the pipeline, and a step compiled again takes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jc
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxreshard._jax_compat import abstract_mesh, make_mesh
from jaxreshard.comm import VirtualMesh, VirtualSharding
from jaxreshard.frontend._split import BATCH, CONST, PARAM, StepGraph
from jaxreshard.frontend._trace import fingerprint, trace_step
from jaxreshard.runtime._api import track_pipeline
from jaxreshard.runtime._compile import StageCompiler, fusable_segments
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime._executor import (
    APPLY_EVENT,
    Event,
    PipelineError,
    RankRunner,
    StageProgram,
    stage_failure,
)
from jaxreshard.runtime._host_channels import (
    HostChannels,
    check_channel_order,
    nccl_programs,
)
from jaxreshard.runtime._layout import PipelineLayout, layout_pipeline, pipeline_schedule
from jaxreshard.runtime._local import stage_backward
from jaxreshard.runtime._remote import SMALL_BYTES, RemoteArray
from jaxreshard.runtime._specs import spec_of, transplant_spec
from jaxreshard.runtime._step import (
    combine_losses,
    combine_results,
    donated,
    pre_values,
    stage_feeds,
)

STEP_GRACE_S = 10.0  # the driver's progress deadline over the hosts' own (see the Note)
DROP_WAIT_S = 5.0  # how long `RayPipeline.close` waits for the hosts to have dropped it

# -- in the host actor -----------------------------------------------------------------------------


class StepProgress:
    """What a host's part of the running step has finished, for the driver's progress deadline
    (see [Note: progress deadline]). Thread-safe; it holds only weak references to outputs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.step_id = ""
        self.count = 0
        self.last = "nothing"
        self._when = time.monotonic()
        self._pending: list[tuple[str, list[Any]]] = []  # dispatched: (what, weakrefs of outputs)

    def begin(self, step_id: str) -> None:
        with self._lock:
            self.step_id, self.count, self.last = step_id, 0, "nothing"
            self._when, self._pending = time.monotonic(), []

    def finished(self, what: str) -> None:
        """Something of the step finished now."""
        with self._lock:
            self._finished(what)

    def dispatched(self, what: str, outputs: Any) -> None:
        """An action was dispatched: it has finished once `outputs` are ready (or gone)."""
        refs = [  # (typed PRNG key arrays cannot say: their key data comes with other outputs)
            weakref.ref(x)
            for x in jax.tree.leaves(outputs)
            if isinstance(x, jax.Array) and hasattr(x, "is_ready")
        ]
        with self._lock:
            self._pending.append((what, refs))
            self._sweep()

    def report(self, step_id: str) -> tuple[int, str, float]:
        """(how many things step `step_id` finished here, the last one, seconds since)."""
        with self._lock:
            if step_id != self.step_id:
                return (0, "nothing", 0.0)
            self._sweep()
            return (self.count, self.last, time.monotonic() - self._when)

    def _finished(self, what: str) -> None:
        self.count += 1
        self.last, self._when = what, time.monotonic()

    def _sweep(self) -> None:
        pending = []
        for what, refs in self._pending:
            if all(_done(ref()) for ref in refs):
                self._finished(what)
            else:
                pending.append((what, refs))
        self._pending = pending


def _done(x: Any) -> bool:
    return x is None or x.is_deleted() or x.is_ready()


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


def _no_signal(host: int, step_id: str, key: tuple[Any, ...]) -> None:
    """A dropped pipeline's channels signal nobody."""


class HostPipeline:
    """The stages of one pipelined step that live on this host (runs inside the host actor)."""

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
    ):
        self.actor, self.config, self.key = actor, config, key
        self.meshes: dict[int, Mesh] = {}
        for s, grid in stage_devices.items():
            grid = np.asarray(grid)
            devices = np.vectorize(lambda g: actor.devices[int(g)], otypes=[object])(grid)
            self.meshes[s] = make_mesh(devices, config.mesh_axis_names, config.axis_types)
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
        )
        self.watch = StepProgress()
        self.compilers: dict[int, StageCompiler] = {}
        for s in stage_devices:
            compiler = _WatchedCompiler(
                self.graph, stage_backward(self.graph, s, config), self.meshes[s], config
            )
            compiler.progress = self.watch
            self.compilers[s] = compiler
        # Optimizer segments run inside their stage's last backward where they can (the driver
        # finds the same ones: `fusable_segments` is a function of the step and the stages).
        self._fused = fusable_segments(self.graph, list(self.compilers), config.num_micro_batches)
        grad_of = {v: k for k, v in enumerate(self.graph.grad_outputs[1:])}
        for s, j in self._fused.items():
            seg = self.graph.segments[j]
            self.compilers[s].set_apply(seg.jaxpr, [grad_of.get(v) for v in seg.inputs])
        self.layout: PipelineLayout | None = None
        self.channels: _WatchedChannels | None = None
        self.runner: RankRunner | None = None
        self._gid = {d: g for g, d in actor.devices.items()}
        self._step_id = ""
        self._running = 0  # step calls under way
        self._segment_fns: dict[tuple[int, tuple[int, ...]], Callable[..., Any]] = {}
        self.dropped = False

    def sharding(self, s: int, spec: P) -> NamedSharding:
        return NamedSharding(self.meshes[s], spec)

    def set_layout(
        self, layout: PipelineLayout, host_of_stage: dict[int, int], transport: str
    ) -> dict[int, int]:
        """Take the layout; make the channels and the programs. Returns the optimizer segments
        fused into this host's stages' last backwards (stage -> segment)."""
        self.layout = layout
        actor = self.actor
        self.channels = _WatchedChannels(
            layout,
            host=actor.host,
            host_of_stage=host_of_stage,
            devices=actor.devices,
            meshes=self.meshes,
            transport=actor._nccl_transport() if transport == "nccl" else actor._transport,
            signal=self._signal,
            timeout_s=self.config.timeout_s,
        )
        self.channels.progress = self.watch
        schedule = layout.schedule
        self.ranks = {  # the ranks (programs) this host runs, and their chunks
            r: schedule.chunks_of(r)
            for r in range(schedule.num_stages)
            if schedule.chunks_of(r)[0] in self.compilers
        }
        programs = {
            r: StageProgram(
                {c: self.compilers[c] for c in chunks}, self.graph, layout, self.channels, r
            )
            for r, chunks in self.ranks.items()
        }
        self.runner = RankRunner(
            programs,
            self.ranks,
            dict.fromkeys(self.compilers, self.channels),
            self.meshes,
            self.graph.owner,
            self.config.timeout_s,
            where=f"host {actor.host}: ",
        )
        return self._fused

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
        if self.runner is not None:
            self.runner.close()
            self.runner = None
        self.compilers = {}
        self._segment_fns = {}
        self._fused = {}
        self.layout = None

    def _segment(self, index: int, donate: tuple[int, ...]) -> Callable[..., Any]:
        """Post-gradient segment `index`, jitted once for this pipeline (its executables go
        with the pipeline, unlike `segment_function`'s process-wide cache)."""
        fn = self._segment_fns.get((index, donate))
        if fn is None:
            jaxpr = self.graph.segments[index].jaxpr
            fn = jax.jit(jc.jaxpr_as_fun(jaxpr), donate_argnums=donate)
            self._segment_fns[(index, donate)] = fn
        return fn

    def _signal(self, host: int, step_id: str, key: tuple[Any, ...]) -> None:
        self.actor.peers[host].pipeline_call.remote(self.key, "signalled", step_id, key)

    def progress(self, step_id: str) -> tuple[int, str, float]:
        """What this host finished of step `step_id` so far (see [Note: progress deadline])."""
        return self.watch.report(step_id)

    def signalled(self, step_id: str, key: tuple[Any, ...]) -> None:
        if self.channels is not None:
            self.channels.signalled(step_id, key)

    def abort(self, step_id: str, reason: str) -> None:
        """Stop the running step `step_id` (a peer failed): every wait ends with `reason`."""
        if self.channels is not None and step_id == self._step_id:
            self.channels.fail(PipelineError(f"host {self.actor.host}: stopped: {reason}"))

    def _shards(self, value: Any) -> dict[int, Any]:
        """A jax.Array's shards by global device id (one per device)."""
        return {self._gid[s.device]: s.data for s in value.addressable_shards}

    def _assemble(self, shape: Sequence[int], sharding: NamedSharding, shards: dict) -> jax.Array:
        arrays = [shards[self._gid[d]] for d in sharding.mesh.devices.flat]
        return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)

    def _held(self, array_id: str, shape: Sequence[int], sharding: NamedSharding) -> jax.Array:
        """Array `array_id` of this host with `sharding`: as a step kept it, when it has that
        sharding (a parameter from the last step), else put together from its shards."""
        whole = self.actor.whole.get(array_id)
        if whole is not None and whole.sharding.is_equivalent_to(sharding, len(shape)):
            return whole
        return self._assemble(shape, sharding, self.actor._array(array_id))

    def _value(self, item: tuple[str, Any], aval: Any, mesh: Mesh) -> Any:
        """A value a driver call describes, placed on `mesh`: by array id on this host (where it
        may sit on another stage's mesh: then it moves between this host's devices), or as
        data."""
        kind, value = item
        if kind == "id":
            array_id, spec, grid = value
            devices = np.vectorize(lambda g: self.actor.devices[int(g)], otypes=[object])(
                np.asarray(grid)
            )
            home = make_mesh(devices, mesh.axis_names, self.config.axis_types)
            array = self._held(array_id, aval.shape, NamedSharding(home, P(*spec)))
            if home == mesh:
                return array
            fitted = transplant_spec(P(*spec), dict(mesh.shape), aval.shape)
            return jax.device_put(array, NamedSharding(mesh, fitted))
        value = from_wire(value)
        spec = transplant_spec(None, dict(mesh.shape), np.shape(value))
        if not _is_key(value):
            value = np.asarray(value, aval.dtype)
        return jax.device_put(value, NamedSharding(mesh, spec))

    def _describe(self, array_id: str, value: Any) -> tuple[Any, ...]:
        """Keep `value` here as `array_id`; describe it for the driver (with its value when it
        is small, so the driver need not fetch it: an optimizer's step count, say)."""
        self.actor._keep(array_id, value)
        dtype = np.dtype(value.dtype)
        small = np.asarray(value) if value.size * dtype.itemsize <= SMALL_BYTES else None
        return (array_id, tuple(spec_of(value.sharding)), value.shape, dtype.name, small)

    # A step ---------------------------------------------------------------------------------------

    def step(
        self,
        step_id: str,
        params: dict[int, str],
        batches: dict[int, list[list[Any]]],
        consts: dict[int, list[Any]],
        record: bool,
        signal_only: bool = False,
        apply_inputs: dict[int, list[tuple[str, Any]]] | None = None,
        segments: list[tuple[int, list[tuple[str, Any]], tuple[int, ...]]] | None = None,
    ) -> dict[str, Any]:
        """Run this host's stages for one step (a `StageProgram` thread per rank, over the
        host's channels), then the post-gradient `segments` whose inputs are all here (see
        `RayPipeline.run`); keep gradients and outputs; return losses (last stage) and what
        was kept."""
        layout, graph, channels = self.layout, self.graph, self.channels
        if self.dropped:
            raise PipelineError(f"host {self.actor.host}: pipeline {self.key} was closed")
        assert layout is not None and channels is not None, "set_layout first"
        self._running += 1
        try:
            return self._step(
                layout, graph, channels, step_id, params, batches, consts, record, signal_only,
                apply_inputs, segments,
            )  # fmt: skip
        finally:
            self._running -= 1
            if self.dropped and not self._running:  # dropped during the step: now it is over
                channels.forget(self.key)

    def _step(
        self,
        layout: PipelineLayout,
        graph: StepGraph,
        channels: _WatchedChannels,
        step_id: str,
        params: dict[int, str],
        batches: dict[int, list[list[Any]]],
        consts: dict[int, list[Any]],
        record: bool,
        signal_only: bool,
        apply_inputs: dict[int, list[tuple[str, Any]]] | None,
        segments: list[tuple[int, list[tuple[str, Any]], tuple[int, ...]]] | None,
    ) -> dict[str, Any]:
        self._step_id = step_id
        self.watch.begin(step_id)
        events: list[Event] | None = [] if record else None
        recorder = events.append if events is not None else None
        losses: list[Any] = [None] * self.config.num_micro_batches
        outputs: dict[tuple[int, int], Any] = {}

        def inputs(s: int) -> tuple[dict[int, Any], list[list[Any]], list[Any], Any]:
            """Stage (chunk) s's parameters, batch pieces, constants and fused optimizer
            inputs, placed on its mesh."""
            stage = graph.loss.stages[s]
            specs = layout.input_specs[s]
            batch_specs = [sp for r, sp in zip(stage.inputs, specs) if r.kind == BATCH]
            const_specs = [sp for r, sp in zip(stage.inputs, specs) if r.kind == CONST]
            mine = {
                k: self._held(
                    array_id,
                    graph.outer.in_avals[graph.params[k]].shape,
                    self.sharding(s, layout.param_specs[k]),
                )
                for k, array_id in params.items()
                if graph.owner[k] == s
            }
            per_mb = [
                [
                    jax.device_put(from_wire(x), self.sharding(s, sp))
                    for x, sp in zip(xs, batch_specs)
                ]
                for xs in batches.get(s, [])
            ]
            stage_consts = [
                jax.device_put(from_wire(x), self.sharding(s, sp))
                for x, sp in zip(consts.get(s, []), const_specs)
            ]
            extra = None
            if apply_inputs and s in apply_inputs:
                seg = graph.segments[self._fused[s]]
                grads = set(graph.grad_outputs[1:])
                avals = [v.aval for v in seg.inputs if v not in grads]
                extra = [
                    self._value(item, aval, self.meshes[s])
                    for item, aval in zip(apply_inputs[s], avals)
                ]
            return mine, per_mb, stage_consts, extra

        assert self.runner is not None
        self.runner.begin(step_id, record=recorder, signal_only=signal_only)
        params_here: dict[int, Any] = {}
        per_mb: dict[int, list[list[Any]]] = {}
        stage_consts: dict[int, list[Any]] = {}
        extra: dict[int, list[Any]] = {}
        for c in self.compilers:
            try:
                mine, per_mb[c], stage_consts[c], extra_c = inputs(c)
            except BaseException as e:
                error = stage_failure(e, f"host {self.actor.host}: stage {c}'s inputs")
                self.runner.fail(error)
                raise error from e
            params_here.update(mine)
            if extra_c is not None:
                extra[c] = extra_c
        results, applied = self.runner.run(
            params_here, per_mb, stage_consts, extra, losses, outputs,
            wait=False,  # the driver's progress deadline watches this host (StepProgress)
        )  # fmt: skip
        own_grads = {
            k: value
            for s, accs in results.items()
            for k, value in accs.items()
            if graph.owner[k] == s
        }
        grads = {k: self._describe(f"{step_id}:grad{k}", v)[0] for k, v in own_grads.items()}
        out: dict[str, Any] = {
            "grads": grads,
            "applied": {
                s: [self._describe(f"{step_id}:fused{s}:{n}", v) for n, v in enumerate(values)]
                for s, values in applied.items()
            },
            "segments": self._run_segments(step_id, segments or [], own_grads, recorder),
        }
        if layout.num_stages - 1 in self.compilers and not graph.forward_only:
            out["losses"] = [np.asarray(v) for v in losses]
        m = self.config.num_micro_batches
        out["results"] = {
            j: [to_wire(outputs[(j, mb)]) for mb in range(m)]
            for j, home in enumerate(graph.loss.result_homes)
            if home in self.compilers
        }
        if events is not None:
            out["events"] = [e.__dict__ for e in events]
            out["clock"] = time.time() - time.perf_counter()  # to align hosts' event times
        return out

    def _run_segments(
        self,
        step_id: str,
        segments: list[tuple[int, list[tuple[str, Any]], tuple[int, ...]]],
        grads: dict[int, Any],
        record: Callable[[Event], None] | None,
    ) -> dict[int, list[Any]]:
        """Post-gradient segments run here, after the step's programs, in order: their inputs
        are this host's gradients ("grad", k), arrays it keeps ("id", ...), data the driver
        sent, or outputs of the segments before them ("out", (j, n))."""
        produced: dict[int, list[Any]] = {}
        described: dict[int, list[Any]] = {}
        for index, items, donate in segments:
            seg = self.graph.segments[index]
            mesh = self.meshes[seg.stage]
            values = []
            for (kind, value), var in zip(items, seg.inputs):
                if kind == "grad":
                    x = grads[value]
                elif kind == "out":
                    j, n = value
                    x = produced[j][n]
                else:
                    values.append(self._value((kind, value), var.aval, mesh))
                    continue
                if x.sharding.device_set != frozenset(mesh.devices.flat):
                    spec = transplant_spec(spec_of(x.sharding), dict(mesh.shape), x.shape)
                    x = jax.device_put(x, NamedSharding(mesh, spec))
                values.append(x)
            start = time.perf_counter()
            outs = self._segment(index, tuple(donate))(*values)
            if record is not None:
                jax.block_until_ready(outs)
                record(Event(seg.stage, APPLY_EVENT, -1, start, time.perf_counter(), "apply"))
            produced[index] = list(outs)
            self.watch.dispatched(f"post segment {index}", outs)
            described[index] = [
                self._describe(f"{step_id}:seg{index}:{n}", v) for n, v in enumerate(outs)
            ]
        return described

    def segment(
        self,
        index: int,
        step_id: str,
        inputs: list[tuple[str, Any]],
        donate: tuple[int, ...] = (),
    ) -> list[Any]:
        """Run post-gradient segment `index` here; keep its outputs; describe them."""
        seg = self.graph.segments[index]
        mesh = self.meshes[seg.stage]
        values = [self._value(item, var.aval, mesh) for item, var in zip(inputs, seg.inputs)]
        outs = self._segment(index, tuple(donate))(*values)
        return [self._describe(f"{step_id}:seg{index}:{n}", v) for n, v in enumerate(outs)]


# -- in the driver ---------------------------------------------------------------------------------


class _RemoteCompiler:
    """A `StageCompiler` in a host actor, seen from the driver."""

    def __init__(self, runtime: Any, host: int, key: str, s: int):
        self.runtime, self.host, self.key, self.s = runtime, host, key, s

    def _call(self, method: str, what: str, *args: Any) -> Any:
        actor = self.runtime.actors[self.host]
        call = actor.pipeline_call.remote(self.key, method, self.s, *args)
        return self.runtime._wait({self.host: call}, f"{what} of stage {self.s}")[self.host]

    def prepare(self, specs: Sequence[P], loss_scale: float | None) -> None:
        self._call("prepare", "preparing the executables", list(specs), loss_scale)

    def compile_forward(self) -> tuple[list[P], list[P]]:
        return self._call("compile_forward", "compiling the forward")

    def compile_variants(self, names: Sequence[str], extra_specs: Sequence[P] | None) -> None:
        self._call("compile_variants", "compiling the executables", list(names), extra_specs)


class RayPipeline:
    """A step compiled for the Ray runtime's host actors (see [Note: pipelines on Ray])."""

    def __init__(
        self,
        runtime: Any,
        fun: Callable[..., Any],
        config: PipelineConfig,
        graph: StepGraph,
        in_tree: Any,
        leaves: Sequence[Any],
        batch_leaves: Sequence[int],
        input_specs: Sequence[P] | None,
        static: dict[int, Any] | None = None,
        recorded: bool = False,
    ):
        self.runtime, self.config, self.graph = runtime, config, graph
        self.key = f"pipeline-{uuid.uuid4().hex[:8]}"
        p = graph.num_stages
        schedule = pipeline_schedule(config, p, graph.forward_only)
        shapes = config.mesh_shapes(schedule.num_stages)
        need = sum(int(np.prod(s)) for s in shapes)
        devices = list(runtime.devices)
        if need > len(devices):
            raise ValueError(
                f"the step has {p} stages on meshes {list(shapes)}: {need} devices, but the Ray "
                f"runtime has {len(devices)} ({runtime.cluster.describe()})"
            )
        rank_meshes: list[VirtualMesh] = []
        host_of_rank: list[int] = []
        at = 0
        for r, shape in enumerate(shapes):
            n = int(np.prod(shape))
            chosen = devices[at : at + n]
            at += n
            hosts = {d.process_index for d in chosen}
            if len(hosts) != 1:
                raise ValueError(
                    f"mesh {r} {shape} would span hosts {sorted(hosts)} (devices "
                    f"{[d.id for d in chosen]}); on the Ray runtime every stage's mesh must fit in "
                    "one host: make stage_mesh_shape a divisor of devices_per_host"
                )
            host_of_rank.append(hosts.pop())
            rank_meshes.append(runtime.mesh(shape, config.mesh_axis_names, [d.id for d in chosen]))
        # Stages (chunks) run on the mesh the schedule places them on.
        self.meshes = [rank_meshes[schedule.rank_of(c)] for c in range(p)]
        self.host_of_stage = {c: host_of_rank[schedule.rank_of(c)] for c in range(p)}
        avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
        stages_of: dict[int, dict[int, Any]] = {}
        for s, h in self.host_of_stage.items():
            grid = np.vectorize(lambda d: d.id)(self.meshes[s].devices)
            stages_of.setdefault(h, {})[s] = grid.tolist()
        payload = _by_value(fun, static or {})
        self.hosts = sorted(stages_of)
        # The hosts keep the pipeline until the driver closes it: `close`, `jaxreshard.shutdown()`
        # or dropping it (see [Note: pipeline lifetime]). (No reference to `self` in here.)
        runtime.start_dropper()
        self._finalizer = weakref.finalize(
            self, _drop_on_hosts, weakref.ref(runtime), self.key, tuple(self.hosts)
        )
        self._finalizer.atexit = False  # at exit, the actors go with Ray
        track_pipeline(self)
        try:
            prints = runtime._wait(
                {
                    h: runtime.actors[h].pipeline_prepare.remote(
                        self.key,
                        payload,
                        config,
                        in_tree,
                        avals,
                        list(batch_leaves),
                        input_specs,
                        stages,
                    )
                    for h, stages in stages_of.items()
                },
                "tracing the step on the hosts",
            )
            mine = fingerprint(graph)
            for h, theirs in prints.items():
                if theirs != mine:
                    raise RuntimeError(
                        f"host {h} traced the step differently from the driver; the step must "
                        "be a pure function of its arguments (same JAX version on every host)"
                    )
            compilers = [
                _RemoteCompiler(runtime, self.host_of_stage[s], self.key, s) for s in range(p)
            ]
            fused: dict[int, int] = {}  # as each host fuses its own stages' optimizers
            for stages in stages_of.values():
                fused.update(fusable_segments(graph, list(stages), config.num_micro_batches))
            self.layout = layout_pipeline(
                graph,
                config,
                schedule,
                self.meshes,
                leaves,
                runtime.cluster,
                compilers,
                fused,
                recorded,
            )
            self.transport = runtime.transport
            if self.transport == "nccl":
                check_channel_order(self.layout)
                for channel, programs in nccl_programs(self.layout, self.host_of_stage):
                    runtime._ensure_communicators(programs, channel)
            hosts_fused = runtime._wait(
                {
                    h: runtime.actors[h].pipeline_call.remote(
                        self.key, "set_layout", self.layout, self.host_of_stage, self.transport
                    )
                    for h in stages_of
                },
                "sending the layout",
            )
            theirs = {s: j for per_host in hosts_fused.values() for s, j in per_host.items()}
            assert theirs == fused, (theirs, fused)
            self.fused = fused
            self._donate = {j: donated(graph, j) for j in range(len(graph.segments))}
            self._steps = 0
            self.last_events: list[Event] = []
        except BaseException:
            self.close()  # what the hosts made of it so far
            raise

    def close(self) -> None:
        """Have the host actors drop the pipeline now (its threads end; its executables and
        buffers go), waiting a few seconds at most for them (see [Note: pipeline lifetime]).
        Dropping the pipeline, or `jaxreshard.shutdown()`, does it too; a closed pipeline runs
        no more steps. Idempotent; never raises."""
        detached = self._finalizer.detach()
        if detached is not None:
            runtime_ref, key, hosts = detached[2]
            _drop_on_hosts(runtime_ref, key, hosts, wait_s=DROP_WAIT_S)

    @property
    def closed(self) -> bool:
        """Whether the pipeline was closed, or its runtime shut down (its actors gone)."""
        return not self._finalizer.alive or not self.runtime.is_alive

    def sharding(self, s: int, spec: P) -> VirtualSharding:
        return VirtualSharding(self.meshes[s], spec)

    def run(
        self, leaves: list[Any], *, record: bool = False, signal_only: bool = False
    ) -> list[Any]:
        if self.closed:
            raise RuntimeError(
                f"pipeline {self.key} was closed (close(), jaxreshard.shutdown(), or its runtime "
                "was shut down); a parallelized step compiles again at its next call"
            )
        g, layout, rt = self.graph, self.layout, self.runtime
        m = self.config.num_micro_batches
        step_id = f"{self.key}:{self._steps}"
        self._steps += 1
        rt.flush_frees()  # the handles the last step's outputs replaced
        if self.transport == "nccl":  # an abort (a failed step) ended them all: make them again
            for channel, programs in nccl_programs(layout, self.host_of_stage):
                rt._ensure_communicators(programs, channel)
        values: dict[Any, Any] = dict(zip(g.outer.jaxpr.invars, leaves))
        params = {}
        for k, i in enumerate(g.params):
            sharding = self.sharding(g.owner[k], layout.param_specs[k])
            value = leaves[i]
            if not (
                isinstance(value, RemoteArray) and value.sharding == sharding and not value.is_freed
            ):
                value = rt.put(np.asarray(value), sharding)
            params[k] = value.array_id
            values[g.outer.jaxpr.invars[i]] = value
        host_leaves = [
            x if isinstance(x, RemoteArray) or _is_key(x) else np.asarray(x) for x in leaves
        ]
        pre = pre_values(g, host_leaves, _fetched)
        values.update(pre)
        raw_batches, raw_consts = stage_feeds(g, host_leaves, pre, m)
        grad_vars = set(g.grad_outputs[1:])
        on_host, on_driver = self._place_segments(values)
        calls = {}
        for h in self.hosts:
            stages = [s for s, hh in self.host_of_stage.items() if hh == h]
            apply_inputs = {
                s: [
                    self._locate(values[v], h)
                    for v in g.segments[self.fused[s]].inputs
                    if v not in grad_vars
                ]
                for s in stages
                if s in self.fused
            }
            calls[h] = rt.actors[h].pipeline_call.remote(
                self.key,
                "step",
                step_id,
                {k: params[k] for k in params if self.host_of_stage[g.owner[k]] == h},
                {s: [[to_wire(x) for x in xs] for xs in raw_batches[s]] for s in stages},
                {s: [to_wire(x) for x in raw_consts[s]] for s in stages},
                record,
                signal_only,
                apply_inputs,
                on_host.get(h, []),
            )
        results = rt._wait(
            calls,
            f"running step {step_id}",
            self.config.timeout_s + STEP_GRACE_S,
            work_id=step_id,
            progress=lambda h: rt.actors[h].pipeline_call.remote(self.key, "progress", step_id),
        )
        last_host = self.host_of_stage[layout.num_stages - 1]
        here = time.time() - time.perf_counter()
        self.last_events = [
            Event(
                **{
                    **e,
                    "start": e["start"] + r["clock"] - here,
                    "end": e["end"] + r["clock"] - here,
                }
            )
            for r in results.values()
            for e in r.get("events", [])
        ]
        per_mb = [
            [from_wire(x) for x in results[self.host_of_stage[home]]["results"][j]]
            for j, home in enumerate(g.loss.result_homes)
        ]
        combined = combine_results(per_mb, g.results, self.config.loss_reduction)
        values.update(zip(g.result_outputs, combined))
        if g.forward_only:
            return [
                values[v] if not isinstance(v, jc.Literal) else v.val for v in g.outer.jaxpr.outvars
            ]
        loss = combine_losses(results[last_host]["losses"], self.config.loss_reduction)
        values[g.grad_outputs[0]] = np.asarray(loss, dtype=g.grad_outputs[0].aval.dtype)
        for k, v in enumerate(g.grad_outputs[1:]):
            owner = g.owner[k]
            array_id = results[self.host_of_stage[owner]]["grads"].get(k)
            aval = g.outer.in_avals[g.params[k]]
            if array_id is not None:
                values[v] = RemoteArray(
                    rt,
                    array_id,
                    aval.shape,
                    aval.dtype,
                    self.sharding(owner, layout.param_specs[k]),
                )
            elif owner not in self.fused:  # the loss does not use this parameter
                values[v] = np.zeros(aval.shape, aval.dtype)
        for s, j in self.fused.items():
            described = results[self.host_of_stage[s]]["applied"][s]
            values.update(zip(g.segments[j].outputs, self._remote(s, described)))
        for h, segments in on_host.items():
            for index, _, _ in segments:
                seg = g.segments[index]
                described = results[h]["segments"][index]
                values.update(zip(seg.outputs, self._remote(seg.stage, described)))
        for index in on_driver:  # segments whose inputs sit on several hosts
            seg = g.segments[index]
            host = self.host_of_stage[seg.stage]
            start = time.perf_counter()
            inputs = [self._locate(values[v], host) for v in seg.inputs]
            described = rt._wait(
                {
                    host: rt.actors[host].pipeline_call.remote(
                        self.key, "segment", index, step_id, inputs, self._donate[index]
                    )
                },
                f"post segment {index}",
            )[host]
            if record:
                self.last_events.append(
                    Event(seg.stage, APPLY_EVENT, -1, start, time.perf_counter(), "apply")
                )
            values.update(zip(seg.outputs, self._remote(seg.stage, described)))
        return [
            values[v] if not isinstance(v, jc.Literal) else v.val for v in g.outer.jaxpr.outvars
        ]

    def _place_segments(
        self, values: dict[Any, Any]
    ) -> tuple[dict[int, list[tuple[int, list[tuple[str, Any]], tuple[int, ...]]]], list[int]]:
        """Which post-gradient segments run on their host within the step call (all their
        inputs are there, or are data the call carries: no round trip through the driver, and
        hosts run theirs at once), and which the driver runs after the step, in order."""
        g = self.graph
        grad_of = {v: k for k, v in enumerate(g.grad_outputs[1:])}
        where: dict[Any, tuple[int, tuple[str, Any]]] = {}  # var -> (host, how that host finds it)
        on_host: dict[int, list[tuple[int, list[tuple[str, Any]], tuple[int, ...]]]] = {}
        on_driver: list[int] = []
        fused = set(self.fused.values())
        for index, seg in enumerate(g.segments):
            if index in fused:
                continue
            host = self.host_of_stage[seg.stage]
            items: list[tuple[str, Any]] | None = []
            for v in seg.inputs:
                if v in where:
                    h, item = where[v]
                elif v in grad_of and not g.loss.users(PARAM, grad_of[v]):  # unused: zeros
                    h, item = host, ("data", np.zeros(v.aval.shape, v.aval.dtype))
                elif v in grad_of and g.owner[grad_of[v]] not in self.fused:
                    h, item = self.host_of_stage[g.owner[grad_of[v]]], ("grad", grad_of[v])
                elif v in values and not isinstance(values[v], RemoteArray):
                    h, item = host, ("data", to_wire(values[v]))
                elif v in values and values[v].value is not None:  # small: it travels
                    h, item = host, ("data", values[v].value)
                elif v in values:  # a RemoteArray: here if its mesh is on this host
                    mesh_hosts = {d.process_index for d in values[v].sharding.mesh.devices.flat}
                    h = host if mesh_hosts == {host} else -1
                    item = self._locate(values[v], host) if h == host else ("", None)
                else:
                    h = -1  # made by a fused optimizer or the driver
                if h != host:
                    items = None
                    break
                items.append(item)
            if items is None:
                on_driver.append(index)
                continue
            on_host.setdefault(host, []).append((index, items, self._donate[index]))
            for n, v in enumerate(seg.outputs):
                where[v] = (host, ("out", (index, n)))
        return on_host, on_driver

    def _remote(self, stage: int, described: list[Any]) -> list[RemoteArray]:
        return [
            RemoteArray(self.runtime, array_id, shape, dtype, self.sharding(stage, P(*spec)), small)
            for array_id, spec, shape, dtype, small in described
        ]

    def _locate(self, value: Any, host: int) -> tuple[str, Any]:
        """How a segment on `host` gets a value: by id if it is there, else as data."""
        if isinstance(value, RemoteArray):
            mesh = value.sharding.mesh
            if {d.process_index for d in mesh.devices.flat} == {host}:
                grid = np.vectorize(lambda d: d.id)(mesh.devices).tolist()
                return ("id", (value.array_id, tuple(value.sharding.spec), grid))
            return ("data", value.fetch())
        return ("data", to_wire(value))


def _drop_on_hosts(
    runtime_ref: Any, key: str, hosts: tuple[int, ...], wait_s: float | None = None
) -> None:
    """A `RayPipeline`'s finalizer (and `close`): the hosts drop pipeline `key`. From the
    finalizer (`wait_s` None) only a message is queued: it may run at any point of any thread."""
    runtime = runtime_ref()
    if runtime is None:
        return
    with contextlib.suppress(Exception):  # nothing may raise from a finalizer
        runtime.drop_pipeline(key, hosts, wait_s)


@dataclasses.dataclass(frozen=True)
class KeyData:
    """A typed PRNG key array on its way between the driver and a host (numpy cannot hold one):
    its key data and implementation."""

    data: np.ndarray
    impl: str


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def to_wire(x: Any) -> Any:
    """A value as a step call carries it: numpy, or `KeyData` for typed keys."""
    if _is_key(x):
        return KeyData(np.asarray(jax.random.key_data(x)), str(jax.random.key_impl(x)))
    return np.asarray(x)


def from_wire(x: Any) -> Any:
    """The inverse of `to_wire`."""
    if isinstance(x, KeyData):
        return jax.random.wrap_key_data(x.data, impl=x.impl)
    return x


def _fetched(values: list[Any]) -> list[Any]:
    """The driver's copies of values the `pre` part reads (arrays the hosts hold come over)."""
    return [x.fetch() if isinstance(x, RemoteArray) else x for x in values]


_INSTALLED = ("jaxreshard", "jax", "jaxlib", "numpy")  # the hosts import these packages themselves


def _by_value(fun: Callable[..., Any], static: dict[int, Any]) -> bytes:
    """Pickle the step and its static leaves so that host actors can run it even if its module
    is not installed (a script, a test file, an example): its module travels by value. Modules
    it imports travel by reference: the hosts must be able to import them."""
    from ray import cloudpickle

    name = getattr(fun, "__module__", "") or ""
    module = sys.modules.get(name)
    registered = False
    if module is not None and name != "__main__" and name.split(".")[0] not in _INSTALLED:
        try:
            cloudpickle.register_pickle_by_value(module)
            registered = True
        except (ValueError, TypeError) as e:
            warnings.warn(
                f"the step's module {name!r} cannot travel to the Ray hosts by value "
                f"({type(e).__name__}: {e}); it is pickled by reference, so every host must be "
                f"able to import {name!r} (install it there, or define the step in a module "
                "imported with an `import` statement)",
                stacklevel=3,
            )
    try:
        return cloudpickle.dumps((fun, static))
    except Exception as e:
        raise TypeError(
            f"the step or one of its static (non-array) argument leaves cannot be pickled for the "
            f"Ray host actors: {type(e).__name__}: {e}; pass such values as arrays or close over "
            "them in a function defined at module level"
        ) from e
    finally:
        if registered:
            cloudpickle.unregister_pickle_by_value(module)
