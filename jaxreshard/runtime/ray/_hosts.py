"""The driver's side of a pipeline's host actors: step calls, their answers, and asynchronous
steps.

[Note: asynchronous steps on Ray]
A step on the Ray runtime returns as `jax.jit`'s does (see [Note: asynchronous steps] for the
local runtime): once its calls are sent, with handles to what it will make.
- Every output's id is known before the hosts answer: `{step}:grad{k}`, `{step}:fused{s}:{n}`,
  `{step}:seg{j}:{n}`. What the driver cannot know from the step alone (which gradients a host
  returns, each output's spec) it takes from the answers of the steps run before: the first
  steps of a pipeline run synchronously, until two answers in a row describe the same outputs;
  from then on the driver builds the handles itself (`_predicted`). A `RemoteArray` so
  made carries its step's watch: whatever reads it on the hosts (`fetch`, `reshard`, a
  checkpoint, an explicit `free`) waits for the step first; a dropped handle's batched free goes
  out once its step has finished.
- The loss and the aux outputs, which come back as host data, are `StepValue`s: read when asked
  for (`float`, `np.asarray`, `jax.block_until_ready`).
- A small array (`SMALL_BYTES`) keeps its value on the driver: a step's output once its answer
  came, one the driver put or a checkpoint restored, or a resharding of those. A step gets
  it with the call, even where its stage's hosts do not hold it (Adam's step count, put on
  the first stage's hosts and read by every stage's optimizer): otherwise that stage's
  optimizer would run by the driver after the step, and every such step synchronously. To a
  stage that spans hosts it goes laid out with its spec (those hosts' executables take
  global arrays only).
- A watch thread (`StepWatch.track_call`) waits for each step's answers in order, under the
  progress deadline (see [Note: progress deadline]), checks that they describe the outputs the
  driver predicted (if not, it corrects the handles, and the next steps run synchronously until
  the answers are stable again), and fills in the small arrays' values. A failure surfaces at
  the next call or at `wait()`, with the message a synchronous step gives, and the steps sent
  after the failed one are cancelled on their hosts.
- Each host runs a pipeline's step calls in the order they were sent (`StepCall.seq`), one
  dispatch at a time: a step's dispatch ends when its stages have dispatched every action and
  their sends have been delivered (the channels are then free for the next step), and its
  answer waits for its values while the next step dispatches. The hosts of a stage that spans
  hosts so run its steps, and their collectives, in one order.
- At most `PipelineConfig.steps_in_flight` steps (8 at most on Ray: a step in flight holds a
  thread of each of its host actors, which have 16, and the hosts' progress reports keep the
  last 16 steps) are sent and not seen finished; a call beyond that waits for the oldest.
- Recorded steps (`profile_call`) and the first steps run synchronously. A step whose
  post-gradient segments the driver runs is sent as the others, then waited for before those
  segments run (their inputs sit on several stages' hosts): it returns once done, with its loss
  a `StepValue` as ever.
- An array that another pipeline's running step makes is waited for before a step names it
  (`RayHosts._ordered`): only one pipeline's steps run in call order on the hosts.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxreshard.comm import VirtualMesh, VirtualSharding
from jaxreshard.frontend._split import StepGraph
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime.driver._deferred import Deferred
from jaxreshard.runtime.driver._driver import NOT_THERE, HostResult, Hosts, StepCall
from jaxreshard.runtime.engine._events import Event
from jaxreshard.runtime.engine._watch import StepWatch
from jaxreshard.runtime.ray._nccl_order import nccl_programs
from jaxreshard.runtime.ray._remote import SMALL_BYTES, RemoteArray
from jaxreshard.runtime.ray._wire import from_wire, is_key, merge_wire, to_wire
from jaxreshard.runtime.step._layout import PipelineLayout
from jaxreshard.runtime.step._specs import spec_of

STEP_GRACE_S = 10.0  # the driver's progress deadline over the hosts' own (see the Note)
RAY_STEPS_IN_FLIGHT = 8  # `PipelineConfig.steps_in_flight`'s cap on Ray
_Later = tuple[Future[Any], dict[str, Any], str]  # `RayHosts._results`'s `later`
LATER = "later"  # a predicted answer's values: they come with the real one


class RayHosts(Hosts):
    """The driver's way to a pipeline's host actors (see [Note: one step]): step calls as actor
    calls, values as `RemoteArray`s and host data."""

    def __init__(
        self,
        runtime: Any,
        key: str,
        graph: StepGraph,
        config: PipelineConfig,
        meshes: Sequence[VirtualMesh],
        hosts_of_stage: Mapping[int, tuple[int, ...]],
    ):
        self.runtime, self.key, self.graph, self.config = runtime, key, graph, config
        self.meshes = list(meshes)
        self.hosts_of_stage = dict(hosts_of_stage)
        self.layout: PipelineLayout | None = None
        self.transport = runtime.transport
        self._lead = {s: hs[0] for s, hs in self.hosts_of_stage.items()}
        # Asynchronous steps (see [Note: asynchronous steps on Ray]).
        self.watch = StepWatch()
        self._seq = 0  # calls sent
        self._template: dict[int, Any] | None = None  # what the last answers described
        self._stable = False  # the last two answers described the same outputs
        self._sent: list[str] = []  # steps sent asynchronously and not seen finished
        self._failures = 0  # steps seen failed (`StepCall.generation`)
        self._lock = threading.Lock()  # `_seq`, `_sent`, `_failures`: driver and watch threads

    def sharding(self, s: int, spec: P) -> VirtualSharding:
        return VirtualSharding(self.meshes[s], spec)

    def begin(self, step_id: str) -> None:
        rt = self.runtime
        # An earlier step's failure raises here. (At most RAY_STEPS_IN_FLIGHT on Ray: each
        # step in flight holds a host actor thread, and the actors have 16.)
        self.watch.admit(min(self.config.steps_in_flight, RAY_STEPS_IN_FLIGHT))
        rt.flush_frees()  # the handles the last step's outputs replaced
        if self.transport == "nccl":  # an abort (a failed step) ended them all: make them again
            assert self.layout is not None
            for channel, programs in nccl_programs(self.layout, self.hosts_of_stage):
                rt._ensure_communicators(programs, channel)

    def wait(self) -> None:
        self.watch.wait()

    def params(self, values: Mapping[int, Any]) -> dict[int, Any]:
        g, layout = self.graph, self.layout
        assert layout is not None
        out, host_data = {}, {}
        for k, value in values.items():
            sharding = self.sharding(g.owner[k], layout.param_specs[k])
            if not (
                isinstance(value, RemoteArray) and value.sharding == sharding and not value.is_freed
            ):
                host_data[k] = (np.asarray(value), sharding)
                continue
            self._ordered(value)
            out[k] = value
        if host_data:
            out.update(zip(host_data, self._put_params(host_data)))
        return {k: out[k] for k in values}

    def _put_params(self, items: Mapping[int, tuple[np.ndarray, VirtualSharding]]) -> list[Any]:
        """Put parameters (index -> value, sharding) on their stages' hosts, in one call per
        host; a host that died meanwhile is named with its stages, as in a step (a step's first
        act is to put the parameters it was given as host data, so a host lost just before a
        step fails here)."""
        from jaxreshard.runtime.ray._wait import RuntimeBroken

        try:
            return self.runtime.put_many(list(items.values()))
        except RuntimeBroken as e:
            if e.host is None:  # broken before: the message says how
                raise
            lost = [k for k in items if e.host in self.hosts_of_stage[self.graph.owner[k]]]
            lost = lost or list(items)
            stages = sorted({self.graph.owner[k] for k in lost})
            where = f"on stage{'s' if len(stages) > 1 else ''} {_listed(stages)}'s hosts"
            shown = [f"{k}: {items[k][0].dtype}{list(items[k][0].shape)}" for k in lost[:5]]
            more = f" and {len(lost) - 5} more" if len(lost) > 5 else ""
            plural = "s" if len(lost) > 1 else ""
            what = f"parameter{plural} {', '.join(shown)}{more}, {where}"
            broken = RuntimeBroken(f"{e} (putting {what}; {self._stages_text(e.host)})")
            broken.host = e.host
            raise broken from None

    def _ordered(self, value: RemoteArray) -> None:
        """Before a step call names `value` by id: an array another pipeline's running step
        makes may not exist on its hosts yet (only this pipeline's steps run in call order
        there), so that step is waited for."""
        if value.pending is not None and not value.step_id.startswith(f"{self.key}:"):
            value.settle()

    def pre_inputs(self, leaves: Sequence[Any]) -> list[Any]:
        return [x if isinstance(x, RemoteArray) or is_key(x) else np.asarray(x) for x in leaves]

    def pre_place(self, inputs: list[Any]) -> list[Any]:
        """The driver's copies of values the `pre` part reads (arrays the hosts hold come
        over)."""
        return [x.fetch() if isinstance(x, RemoteArray) else x for x in inputs]

    def ref(self, value: Any, hosts: Sequence[int], gather: bool = False) -> Any:
        """The value, where the driver has it: ("laid", (data, spec)) for a driver `jax.Array`,
        which the hosts place with that spec where it fits, as the local runtime keeps an
        array's spec (the executables compiled ahead expect it); for a small `RemoteArray`
        with its value (even where those hosts keep it), ("data", data) to one host, "laid" to
        several. Else ("id", ...) for an array those hosts keep; ("answer", (ref, id)) for a
        small array a running step makes on other hosts (read from that step's answer);
        ("data", data) for the rest."""
        if isinstance(value, jax.Array) and not is_key(value):
            return ("laid", (to_wire(value), tuple(spec_of(value.sharding))))
        if not isinstance(value, RemoteArray):
            return ("data", to_wire(value))
        if value.value is not None and not value.is_freed:  # small: it travels
            if len(hosts) == 1:  # (bare: a compiled executable places it as it was compiled for)
                return ("data", value.value)
            # (a stage that spans hosts takes global arrays only: laid out with its spec)
            return ("laid", (value.value, tuple(value.sharding.spec)))
        mesh = value.sharding.mesh
        if {d.process_index for d in mesh.devices.flat} == set(hosts):
            self._ordered(value)
            grid = np.vectorize(lambda d: d.id)(mesh.devices).tolist()
            return ("id", (value.array_id, tuple(value.sharding.spec), grid))
        if value.source is not None and not value.is_ready():
            # Small, made by a step still running on other hosts: those hosts read it from
            # that step's answer when they need it (an optimizer's step count, say).
            return ("answer", (value.source, value.array_id))
        if gather:
            return ("laid", (value.fetch(), tuple(value.sharding.spec)))
        return NOT_THERE

    def call(self, calls: Mapping[int, StepCall]) -> dict[int, HostResult]:
        first = next(iter(calls.values()))
        step_id = first.step_id
        asynchronous = (
            self._stable
            and not first.record
            and self._template is not None
            and all(  # the segments run where they ran in the steps the template is of
                sorted(j for j, _ in c.segments) == sorted(self._template[h]["segments"])
                for h, c in calls.items()
            )
        )
        if not asynchronous:
            self.watch.wait()  # the steps before it first (a recorded step's time is its own)
        with self._lock:  # (against the watch seeing a failure meanwhile: see `_finish`)
            refs = self._send(calls, asynchronous)
        if not asynchronous:
            answers = self._wait_step(refs, step_id)
            template = _template(answers)
            self._stable, self._template = template == self._template, template
            return self._results(answers)
        assert self._template is not None
        predicted = _predicted(self._template, step_id, self.config.num_micro_batches)
        box: dict[str, Any] = {}
        handles: weakref.WeakValueDictionary[str, RemoteArray] = weakref.WeakValueDictionary()
        future = self.watch.track_call(
            step_id, lambda: self._finish(refs, step_id, predicted, box, handles)
        )
        self.runtime.steps_sent[self.key] = weakref.ref(future)  # (frees of handles wait for it)
        out = self._results(predicted, (future, box, step_id))
        for h, result in out.items():
            for x in [*result.grads.values(), *_flat(result.applied), *_flat(result.segments)]:
                x.pending, x.step_id = future, step_id
                handles[x.array_id] = x
            # A small output of a stage on one host comes with that host's answer, where other
            # hosts may read it (`ref`); a stage that spans hosts answers with no value.
            made = [(s, xs) for s, xs in result.applied.items()] + [
                (self.graph.segments[j].stage, xs) for j, xs in result.segments.items()
            ]
            for stage, xs in made:
                if len(self.hosts_of_stage[stage]) == 1:
                    for x in xs:
                        if x.nbytes <= SMALL_BYTES:
                            x.source = refs[h]
        return out

    def _send(self, calls: Mapping[int, StepCall], asynchronous: bool) -> dict[int, Any]:
        """Send every host its call (numbered `seq`, of this failure generation); an
        asynchronous step joins the steps sent and not seen finished."""
        rt = self.runtime
        seq = self._seq  # (taken once the calls are made: a failure before leaves no gap)
        wire = {
            h: StepCall(
                c.step_id,
                {k: x.array_id for k, x in c.params.items()},
                {f: to_wire(x) for f, x in c.feeds.items()},
                {i: to_wire(x) for i, x in c.consts.items()},
                c.apply_inputs,
                c.segments,
                c.record,
                c.signal_only,
                seq,
                self._failures,
            )
            for h, c in calls.items()
        }
        refs = {h: rt.actors[h].pipeline_step.remote(self.key, c) for h, c in wire.items()}
        self._seq += 1
        if asynchronous:
            self._sent.append(next(iter(calls.values())).step_id)
        return refs

    def _wait_step(self, refs: dict[int, Any], step_id: str) -> dict[int, Any]:
        """The hosts' answers to step `step_id`, under the progress deadline."""
        rt = self.runtime
        return self._wait(
            refs,
            f"running step {step_id}",
            self.config.timeout_s + STEP_GRACE_S,
            work_id=step_id,
            progress=lambda h: rt.actors[h].pipeline_progress.remote(self.key, step_id),
        )

    def _finish(
        self,
        refs: dict[int, Any],
        step_id: str,
        predicted: dict[int, Any],
        box: dict[str, Any],
        handles: Mapping[str, RemoteArray],
    ) -> None:
        """The watch's part of an asynchronous step (see [Note: asynchronous steps on Ray]):
        wait for its answers; on a failure cancel the steps sent after it; check the outputs
        they describe against the handles made, correcting them if they differ; fill in the
        small values."""
        try:
            answers = self._wait_step(refs, step_id)
        except BaseException as e:
            with self._lock:
                self._failures += 1  # (calls sent from now on are not cancelled on its account)
                at = self._sent.index(step_id) if step_id in self._sent else len(self._sent)
                later, self._sent[at:] = self._sent[at + 1 :], []
                self._stable = False
            for sid in later:
                self.runtime._abort(sid, f"step {step_id}, called before it, failed")
            raise e
        with self._lock:
            if step_id in self._sent:
                self._sent.remove(step_id)
        box["answers"] = answers
        if _template(answers) != _template(predicted):
            self._stable = False  # (the next steps run synchronously until stable again)
        for r in answers.values():
            for kind in ("applied", "segments"):
                for s, described in r[kind].items():
                    stage = s if kind == "applied" else self.graph.segments[s].stage
                    for array_id, spec, _, _, small in described:
                        x = handles.get(array_id)
                        if x is not None:
                            x.sharding = self.sharding(stage, P(*spec))
                            x.value = small

    def _results(
        self,
        answers: Mapping[int, Any],
        later: tuple[Future[Any], dict[str, Any], str] | None = None,
    ) -> dict[int, HostResult]:
        """The driver's view of the hosts' answers; with `later` (the step's watch, where its
        answers will be, its id), of predicted answers, whose values come with the real ones."""
        here = time.time() - time.perf_counter()
        g = self.graph
        out = {}

        def deferred(read: Any) -> Deferred:
            assert later is not None
            future, box, step_id = later
            return Deferred(future, lambda: read(box["answers"]), step_id)

        for h, r in answers.items():
            events = [
                Event(
                    **{
                        **e,
                        "start": e["start"] + r["clock"] - here,
                        "end": e["end"] + r["clock"] - here,
                    }
                )
                for e in r.get("events", [])
                if self._lead.get(e["stage"], h) == h  # a stage's hosts record the same actions
            ]
            results: dict[int, Any] = {}
            for j, per_mb in r["results"].items():
                hosts = self.hosts_of_stage[g.loss.result_homes[j]]
                if hosts[0] != h:  # (the lead's answer carries the stage's, merged once)
                    continue
                read = _merged_results(j, hosts, len(per_mb))
                results[j] = read(answers) if later is None else deferred(read)
            # Handles only from a stage's lead host: a stage's hosts keep its arrays under the
            # same ids, and a second handle would free them when it goes.
            grads = {}
            for k, array_id in r["grads"].items():
                if self._lead[g.owner[k]] != h:
                    continue
                aval = g.outer.in_avals[g.params[k]]
                assert self.layout is not None
                sharding = self.sharding(g.owner[k], self.layout.param_specs[k])
                grads[k] = RemoteArray(self.runtime, array_id, aval.shape, aval.dtype, sharding)
            applied = {s: self._remote(s, d) for s, d in r["applied"].items() if self._lead[s] == h}
            segments = {
                j: self._remote(g.segments[j].stage, d)
                for j, d in r["segments"].items()
                if self._lead[g.segments[j].stage] == h
            }
            losses = r["losses"]
            if losses == LATER:
                losses = deferred(lambda a, h=h: a[h]["losses"])
            out[h] = HostResult(losses, grads, applied, segments, results, events)
        return out

    def _wait(self, refs: dict[int, Any], what: str, *args: Any, **kwargs: Any) -> dict[int, Any]:
        """`RayRuntime._wait` for calls that run stages (a step, a segment), and what a failure
        means with stages that span hosts: a host of such a stage that failed or stopped may
        leave the others in its collectives, which nothing can interrupt; if any is still busy
        a few seconds after the failure, the runtime is marked broken (it could not run another
        step) and the error says so. A dead host's error names its stage."""
        import ray

        from jaxreshard.runtime.engine._dispatch import STOP_GRACE_S
        from jaxreshard.runtime.ray._wait import RuntimeBroken

        rt = self.runtime
        spanning = {s: hs for s, hs in self.hosts_of_stage.items() if len(hs) > 1}
        try:
            return rt._wait(refs, what, *args, **kwargs)
        except RuntimeBroken as e:
            broken = RuntimeBroken(f"{e} ({self._stages_text(e.host)})")
            broken.host = e.host
            raise broken from None
        except Exception as e:
            if not spanning:
                raise
            busy = [h for h in refs if any(h in hs for hs in spanning.values())]
            done, _ = ray.wait([refs[h] for h in busy], num_returns=len(busy), timeout=STOP_GRACE_S)
            if len(done) == len(busy) and not isinstance(e, TimeoutError):
                raise  # every host of those stages got out: nothing is stuck
            stages = "; ".join(self._stages_text(hs[0]) for hs in spanning.values())
            rt._broken = f"{what} failed with stages that span hosts ({stages})"
            raise RuntimeBroken(
                f"{e}. Stages that span hosts ({stages}) run collectives across their hosts, "
                "and hosts of them are still busy: one that stopped holds the others in its "
                "collectives, so this runtime cannot run more steps; call jaxreshard.shutdown() "
                "and jaxreshard.init() again"
            ) from e

    def _stages_text(self, host: int | None) -> str:
        """Which stages a host runs, with their hosts (for messages)."""
        stages = [s for s, hs in self.hosts_of_stage.items() if host in hs]
        if host is None or not stages:
            return "it runs no stage of this pipeline"
        parts = []
        for s in stages:
            hs = self.hosts_of_stage[s]
            parts.append(
                f"stage {s}" + (f" with hosts {', '.join(map(str, hs))}" if len(hs) > 1 else "")
            )
        return f"host {host} runs {', '.join(parts)}"

    def segment(self, stage: int, index: int, step_id: str, inputs: list[Any]) -> list[Any]:
        rt = self.runtime
        self.watch.wait()  # (its inputs may be arrays the step makes on these hosts)
        hosts = self.hosts_of_stage[stage]
        described = self._wait(
            {
                h: rt.actors[h].pipeline_segment.remote(self.key, index, step_id, inputs)
                for h in hosts
            },
            f"post segment {index} of step {step_id}",
            self.config.timeout_s + STEP_GRACE_S,
        )[hosts[0]]
        return self._remote(stage, described)

    def _remote(self, stage: int, described: list[Any]) -> list[RemoteArray]:
        return [
            RemoteArray(self.runtime, array_id, shape, dtype, self.sharding(stage, P(*spec)), small)
            for array_id, spec, shape, dtype, small in described
        ]


def _flat(per_key: Mapping[int, list[RemoteArray]]) -> list[RemoteArray]:
    return [x for values in per_key.values() for x in values]


def _merged_results(j: int, hosts: Sequence[int], m: int) -> Any:
    """Reads aux output `j` per micro-batch from answers: from the pieces each of its stage's
    hosts sent."""

    def read(answers: Mapping[int, Any]) -> list[Any]:
        return [
            from_wire(merge_wire([answers[x]["results"][j][mb] for x in hosts])) for mb in range(m)
        ]

    return read


def _template(answers: Mapping[int, Any]) -> dict[int, Any]:
    """What step answers describe, without the step's ids and values: which gradients each
    host returns, the spec, shape and dtype of each output it keeps, whether it gives losses,
    its aux outputs (see [Note: asynchronous steps on Ray])."""
    return {
        h: {
            "grads": sorted(r["grads"]),
            "applied": {s: [tuple(d[1:4]) for d in ds] for s, ds in r["applied"].items()},
            "segments": {j: [tuple(d[1:4]) for d in ds] for j, ds in r["segments"].items()},
            "losses": r["losses"] is not None,
            "results": sorted(r["results"]),
        }
        for h, r in answers.items()
    }


def _predicted(template: Mapping[int, Any], step_id: str, m: int) -> dict[int, Any]:
    """The answers step `step_id` will give, as far as the driver needs them to return (its
    outputs' ids and specs), from the last answers' `_template`; values come `LATER`."""
    return {
        h: {
            "grads": {k: f"{step_id}:grad{k}" for k in t["grads"]},
            "applied": {
                s: [(f"{step_id}:fused{s}:{n}", *d, None) for n, d in enumerate(ds)]
                for s, ds in t["applied"].items()
            },
            "segments": {
                j: [(f"{step_id}:seg{j}:{n}", *d, None) for n, d in enumerate(ds)]
                for j, ds in t["segments"].items()
            },
            "losses": LATER if t["losses"] else None,
            "results": {j: [LATER] * m for j in t["results"]},
        }
        for h, t in template.items()
    }


def _listed(numbers: Sequence[int]) -> str:
    return ", ".join(str(n) for n in numbers)
