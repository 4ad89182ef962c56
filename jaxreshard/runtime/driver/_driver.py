"""One step of a pipeline, from the driver's side: the same for every runtime.

[Note: one step]
What `PipelineDriver.run` does with a step's arguments (the hosts' side is `HostEngine.step`,
[Note: host engine] in `engine/_host.py`):
1. The parameters go where their owner stage's mesh is, as planned (`Hosts.params`: placed on
   this process's devices, or put on the hosts once and kept there; a parameter a step returned
   is already there).
2. The code before the loss (`pre`) runs once on the whole batch, here (see
   [Note: two traces] in `frontend/_split.py`); with the batch it gives the feeds (each split
   into micro-batches by the engine, on its stage's mesh) and the per-step constants.
3. The post-gradient segments (the optimizer) are placed: one runs within its stage's hosts'
   step call when every input is there or can travel with the call (`place_segments`), else
   by the driver after the step.
4. One call per host (`Hosts.call`): its stages' parameters, feeds, constants, fused
   optimizers' inputs and segments. A host whose stage spans several hosts gets the same call
   as its peers; they run that stage together.
5. The answers: the loss (from the last stage's hosts), each parameter's gradient (by its
   owner stage's lead host), the aux outputs per micro-batch, combined as [Note: micro-batch
   semantics] says; the segments the driver places run now, in order; the step's outputs are
   read off.
`Hosts` is the protocol to the processes: `LocalHosts` (`local/_pipeline.py`) calls this
process's engine directly, `RayHosts` (`ray/_pipeline.py`) the host actors.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxreshard.frontend._split import BATCH, CONST, PARAM, StepGraph
from jaxreshard.runtime.driver._deferred import Deferred, StepValue
from jaxreshard.runtime.engine._events import APPLY_EVENT, Event
from jaxreshard.runtime.engine._placing import literal_or
from jaxreshard.runtime.step._around import combine_losses, combine_results, pre_values, step_value
from jaxreshard.runtime.step._layout import PipelineLayout


@dataclasses.dataclass
class StepCall:
    """What the driver sends one host for a step (values as that host reads them: arrays
    locally, ids or host data on Ray).

    Attributes:
        step_id: the step's id.
        params: the parameters its stages own, by index.
        feeds: the whole batch inputs its stages read, by feed index.
        consts: the per-step constants its stages read, by constant index.
        apply_inputs: per stage with a fused optimizer, that segment's inputs other than the
            gradients.
        segments: (segment index, inputs) to run after the stages, in order; an input is
            ("grad", k), ("out", (j, n)), or a value as `Hosts.ref` tags it.
        record, signal_only: as `Parallelized.profile_call`.
        seq: the step's place among the calls the host gets, from 0 (Ray: a host runs them in
            this order, see [Note: asynchronous steps on Ray]); -1 where calls run as made.
        generation: how many failed steps the driver knew of when it sent the call (a host
            cancels the queued steps of a failed step's generation).
    """

    step_id: str
    params: dict[int, Any]
    feeds: dict[int, Any]
    consts: dict[int, Any]
    apply_inputs: dict[int, list[Any]]
    segments: list[tuple[int, list[Any]]]
    record: bool
    signal_only: bool
    seq: int = -1
    generation: int = 0


@dataclasses.dataclass
class HostResult:
    """What one host's step call gave back, as the driver uses it.

    Attributes:
        losses: per micro-batch (a host of the last stage), else None; a `Deferred` list for a
            step that returns before its values exist.
        grads: gradients of the parameters its stages own, by index (values as `Hosts`
            hands them out: arrays locally, `RemoteArray`s on Ray).
        applied: per stage with a fused optimizer, its outputs.
        segments: the outputs of the segments it ran, by index.
        results: per result its stages computed, its value per micro-batch (or a `Deferred`
            list).
        events: timed events, on the driver's clock (with `record`).
    """

    losses: list[Any] | None
    grads: dict[int, Any]
    applied: dict[int, list[Any]]
    segments: dict[int, list[Any]]
    results: dict[int, list[Any]]
    events: list[Event]


class Hosts:
    """How a pipeline's driver reaches the processes that run its stages (see
    [Note: one step]); `hosts_of_stage` lists each stage's hosts, its lead first."""

    hosts_of_stage: dict[int, tuple[int, ...]]

    def begin(self, step_id: str) -> None:
        """Before a step (the Ray driver sends dropped handles' frees, makes NCCL
        communicators an abort ended)."""

    def wait(self) -> None:
        """Wait until every step dispatched so far has finished; raise a failure among them
        (steps whose call returns before they finish; see [Note: asynchronous steps])."""

    def params(self, values: Mapping[int, Any]) -> dict[int, Any]:
        """The step's parameters (by index) where their owner stages hold them."""
        raise NotImplementedError

    def pre_inputs(self, leaves: Sequence[Any]) -> list[Any]:
        """The argument leaves as the driver computes the `pre` part and the feeds from."""
        raise NotImplementedError

    def pre_place(self, inputs: list[Any]) -> list[Any]:
        """The `pre` part's inputs where it can run."""
        return inputs

    def ref(self, value: Any, hosts: Sequence[int], gather: bool = False) -> Any:
        """How `hosts` (one stage's) take `value` in a step call, tagged: ("value", x)
        locally; on Ray ("id", ...) for an array they keep, ("laid", (data, spec)) for an array
        laid out with a spec, ("data", x) for other host data; `NOT_THERE` if they cannot
        without the driver, unless `gather` (the driver brings it over)."""
        raise NotImplementedError

    def call(self, calls: Mapping[int, StepCall]) -> dict[int, HostResult]:
        """Run every host's part of a step; wait (with the progress deadline) for them all."""
        raise NotImplementedError

    def segment(self, stage: int, index: int, step_id: str, inputs: list[Any]) -> list[Any]:
        """Run post-gradient segment `index` on `stage`'s hosts now (its inputs as `ref`
        gives them); its outputs."""
        raise NotImplementedError

    def zeros(self, aval: Any, like: Any) -> Any:
        """The gradient of a parameter the loss does not use."""
        return np.zeros(aval.shape, aval.dtype)

    def loss_value(self, loss: Any, aval: Any) -> Any:
        """The step's loss as it returns it (from the micro-batches' host values: of the
        loss's dtype, as `jax.jit` gives it)."""
        return np.asarray(loss, dtype=aval.dtype)


def _shape(v: Any) -> tuple[Any, Any]:
    return v.aval.shape, v.aval.dtype


def _now(x: Any) -> Any:
    return x.result() if isinstance(x, Deferred) else x


NOT_THERE = object()  # `Hosts.ref`: the value cannot reach those hosts within the step call


class PipelineDriver:
    """Runs a laid-out pipeline's steps over `hosts` (see [Note: one step]).

    Args:
        graph, layout: the step.
        fused: stages whose optimizer segment runs inside their last backward (stage ->
            segment).
        hosts: the processes that run the stages.
    """

    def __init__(
        self, graph: StepGraph, layout: PipelineLayout, fused: Mapping[int, int], hosts: Hosts
    ):
        self.graph, self.layout, self.fused = graph, layout, dict(fused)
        self.processes = hosts
        self.config = layout.config
        self.last_events: list[Event] = []
        # The stages of the optimizer segments the last call ran on the driver, after every
        # host's step, one after another (a profile's prediction runs them so).
        self.last_driver_stages: tuple[int, ...] = ()
        self._ids = itertools.count()
        self.key = ""  # the step ids' prefix
        self.last_step_id = ""
        g = graph
        grad_vars = set(g.grad_outputs[1:])
        self._apply_vars = {  # a fused segment's inputs other than the gradients
            s: [v for v in g.segments[j].inputs if v not in grad_vars]
            for s, j in self.fused.items()
        }
        self._stages_of: dict[int, list[int]] = {}
        for s, hs in hosts.hosts_of_stage.items():
            for h in hs:
                self._stages_of.setdefault(h, []).append(s)
        index = {v: i for i, v in enumerate(g.outer.jaxpr.invars)}
        self._feeds_of = {  # per host, the feeds its stages read
            h: sorted({r.index for s in ss for r in g.loss.stages[s].inputs if r.kind == BATCH})
            for h, ss in self._stages_of.items()
        }
        self._consts_of = {
            h: sorted({r.index for s in ss for r in g.loss.stages[s].inputs if r.kind == CONST})
            for h, ss in self._stages_of.items()
        }
        self._index = index
        # Parameters the loss does not read (their gradients are zeros), and each gradient
        # output's parameter: asked for every gradient of every step.
        self._unused = frozenset(k for k in range(len(g.params)) if not g.loss.users(PARAM, k))
        self._grad_of = {v: k for k, v in enumerate(g.grad_outputs[1:])}

    def wait(self) -> None:
        """Wait until every step run so far has finished; raise a failure among them."""
        self.processes.wait()

    def placement(self, leaves: Sequence[Any]) -> list[Any]:
        """Where the pipeline keeps each argument leaf (a sharding; None for leaves it does
        not keep: the batch, host data read before the loss). A parameter sits on its owner
        stage's mesh with its planned spec; a leaf the post-gradient segments read (optimizer
        state) on the mesh of the first stage that reads it, with its own spec where that fits,
        else replicated (where the step would put it, see `on_mesh`); any other array leaf where
        it is."""
        from jaxreshard.runtime.step._specs import spec_of, transplant_spec

        g, layout = self.graph, self.layout
        invars = g.outer.jaxpr.invars
        out: list[Any] = [None] * len(leaves)
        for i, x in enumerate(leaves):
            if isinstance(x, jax.Array):
                out[i] = x.sharding
        readers: dict[Any, int] = {}
        for seg in g.segments:
            for v in seg.inputs:
                readers[v] = min(readers.get(v, seg.stage), seg.stage)
        for i, v in enumerate(invars):
            s = readers.get(v)
            if s is None or i in set(g.batch):
                continue
            x = leaves[i]
            spec = transplant_spec(
                spec_of(getattr(x, "sharding", None)), layout.mesh_shapes[s], np.shape(x), None
            )
            out[i] = self.sharding(s, spec)
        for k, i in enumerate(g.params):
            out[i] = self.sharding(g.owner[k], layout.param_specs[k])
        return out

    def step_id(self) -> str:
        """A new step's id (`last_step_id` then)."""
        self.last_step_id = f"{self.key or 'step'}:{next(self._ids)}"
        return self.last_step_id

    def run(
        self, leaves: Sequence[Any], *, record: bool = False, signal_only: bool = False
    ) -> list[Any]:
        """Run one step; return the flat outputs (see [Note: one step])."""
        g, hosts = self.graph, self.processes
        invars = g.outer.jaxpr.invars
        step_id = self.step_id()
        hosts.begin(step_id)
        # 1. Parameters where their owners hold them.
        params = hosts.params({k: leaves[i] for k, i in enumerate(g.params)})
        values: dict[Any, Any] = dict(zip(invars, leaves))
        for k, i in enumerate(g.params):
            values[invars[i]] = params[k]
        # 2. The code before the loss, the feeds and the constants.
        host_leaves = hosts.pre_inputs(leaves)
        pre = pre_values(g, host_leaves, hosts.pre_place)
        values.update(pre)
        feeds = [step_value(self._index, host_leaves, pre, f.var) for f in g.feeds]
        consts = [step_value(self._index, host_leaves, pre, v) for v in g.consts]
        # 3. Where the post-gradient segments run.
        on_host, on_driver = self.place_segments(values)
        self.last_driver_stages = tuple(g.segments[j].stage for j in on_driver)
        # 4. One call per host.
        calls = {}
        for h, stages in self._stages_of.items():
            apply_inputs = {}
            for s in stages:
                if s in self.fused:
                    here = hosts.hosts_of_stage[s]
                    apply_inputs[s] = [
                        hosts.ref(values[v], here, gather=True) for v in self._apply_vars[s]
                    ]
            calls[h] = StepCall(
                step_id,
                {k: params[k] for k in params if g.owner[k] in stages},
                {f: feeds[f] for f in self._feeds_of[h]},
                {c: consts[c] for c in self._consts_of[h]},
                apply_inputs,
                [(j, items) for j, items in on_host if g.segments[j].stage in stages],
                record,
                signal_only,
            )
        results = hosts.call(calls)
        self.last_events = [e for h in sorted(results) for e in results[h].events]
        # 5. What the step made.
        lead = {s: hs[0] for s, hs in hosts.hosts_of_stage.items()}
        m = self.config.num_micro_batches
        reduction = self.config.loss_reduction
        per_mb = [results[lead[home]].results[j] for j, home in enumerate(g.loss.result_homes)]
        later = next((x for x in per_mb if isinstance(x, Deferred)), None)
        if later is None:
            combined = combine_results(per_mb, g.results, reduction)
        else:  # an asynchronous step's: combined when read (see `StepValue`)
            whole = Deferred.of(
                later, lambda: combine_results([_now(x) for x in per_mb], g.results, reduction)
            )
            combined = [
                StepValue(Deferred.of(whole, lambda n=n: whole.result()[n]), *_shape(v))
                for n, v in enumerate(g.result_outputs)
            ]
        values.update(zip(g.result_outputs, combined))
        if g.forward_only:
            return [literal_or(values, v) for v in g.outer.jaxpr.outvars]
        losses = results[lead[self.layout.num_stages - 1]].losses
        aval = g.grad_outputs[0].aval
        if isinstance(losses, Deferred):
            read = losses
            values[g.grad_outputs[0]] = StepValue(
                Deferred.of(
                    read, lambda: hosts.loss_value(combine_losses(read.result(), reduction), aval)
                ),
                aval.shape,
                aval.dtype,
            )
        else:
            assert losses is not None and len(losses) == m
            loss = combine_losses(losses, reduction)
            values[g.grad_outputs[0]] = hosts.loss_value(loss, aval)
        for k, v in enumerate(g.grad_outputs[1:]):
            owner = g.owner[k]
            grad = results[lead[owner]].grads.get(k)
            if grad is not None:
                values[v] = grad
            elif k in self._unused:  # the loss does not use this parameter
                values[v] = hosts.zeros(g.outer.in_avals[g.params[k]], params[k])
            # (else a fused optimizer, or a segment on its hosts, used it up)
        for s, j in self.fused.items():
            values.update(zip(g.segments[j].outputs, results[lead[s]].applied[s]))
        for j, _ in on_host:
            seg = g.segments[j]
            values.update(zip(seg.outputs, results[lead[seg.stage]].segments[j]))
        for j in on_driver:  # segments whose inputs sit on several stages' hosts
            seg = g.segments[j]
            hs = hosts.hosts_of_stage[seg.stage]
            start = time.perf_counter()
            inputs = [hosts.ref(values[v], hs, gather=True) for v in seg.inputs]
            outs = hosts.segment(seg.stage, j, step_id, inputs)
            if record:
                jax.block_until_ready([x for x in outs if isinstance(x, jax.Array)])
                self.last_events.append(
                    Event(seg.stage, APPLY_EVENT, -1, start, time.perf_counter(), "apply")
                )
            values.update(zip(seg.outputs, outs))
        return [literal_or(values, v) for v in g.outer.jaxpr.outvars]

    def place_segments(
        self, values: Mapping[Any, Any]
    ) -> tuple[list[tuple[int, list[Any]]], list[int]]:
        """Which post-gradient segments run within their stage's hosts' step call (every
        input is there, or travels with the call: no round trip through the driver, and hosts
        run theirs at once), with their inputs; and which the driver runs after the step, in
        order."""
        g, hosts, grad_of = self.graph, self.processes, self._grad_of
        made_on: dict[Any, tuple[tuple[int, ...], tuple[str, Any]]] = {}  # var -> (hosts, item)
        on_host: list[tuple[int, list[Any]]] = []
        on_driver: list[int] = []
        fused = set(self.fused.values())
        # What a driver-run segment reads: a later segment that reads it too runs by the driver,
        # after it (in the step's order; on its hosts it could overwrite a gradient that dies
        # there before the driver's segment has read it).
        read_later: set[Any] = set()
        for j, seg in enumerate(g.segments):
            if j in fused:
                continue
            here = hosts.hosts_of_stage[seg.stage]
            items: list[Any] | None = []
            for v in seg.inputs:
                if v in read_later:
                    items = None
                    break
                if v in made_on:
                    where, item = made_on[v]
                    ok = where == here
                elif v in grad_of and grad_of[v] in self._unused:  # unused: zeros
                    item = hosts.ref(np.zeros(v.aval.shape, v.aval.dtype), here)
                    ok = item is not NOT_THERE
                elif v in grad_of and g.owner[grad_of[v]] not in self.fused:
                    owner = g.owner[grad_of[v]]
                    item, ok = ("grad", grad_of[v]), hosts.hosts_of_stage[owner] == here
                elif v in values:
                    item = hosts.ref(values[v], here)
                    ok = item is not NOT_THERE
                else:  # made by a fused optimizer, or after the pipeline by the driver
                    item, ok = None, False
                if not ok:
                    items = None
                    break
                items.append(item)
            if items is None:
                on_driver.append(j)
                read_later.update(seg.inputs)
                continue
            on_host.append((j, items))
            for n, v in enumerate(seg.outputs):
                made_on[v] = (here, ("out", (j, n)))
        return on_host, on_driver
