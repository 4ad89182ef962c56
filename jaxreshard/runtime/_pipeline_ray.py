"""Pipelines on the Ray runtime: stages live in host actors, transfers go host to host.

[Note: pipelines on Ray]
Each stage's mesh must sit inside one host. The driver traces and cuts the step; every host
actor that runs stages traces and cuts it too (the step function travels by value, and a
fingerprint proves both traces agree), compiles its own stages, and is sent the layout: specs,
transfer plans over the runtime's device ids, and its stages' instruction lists. A step then
runs in the actors: one `StageRunner` thread per stage; a SEND to a stage of the same host is a
local resharding, a SEND to another host runs the sending side of the transfer's plan (its host
program: the slices go into the object store once and on along the plan's chain), and the
matching RECV runs the receiving side. The driver only ships micro-batches in and losses out.
Parameters, gradients and optimizer state stay in the actors; the step returns them as
`RemoteArray`s, which the next call hands straight back to the actors.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import jax
import numpy as np
from jax.extend import core as jc
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxreshard._jax_compat import abstract_mesh, make_mesh
from jaxreshard.comm import VirtualMesh, VirtualSharding, plan_reshard
from jaxreshard.comm._order import host_programs
from jaxreshard.comm._transport import HostData, HostWork, run_host_work
from jaxreshard.frontend._backward import derive_backward
from jaxreshard.frontend._split import BATCH, CONST, StepGraph
from jaxreshard.frontend._trace import fingerprint, trace_step
from jaxreshard.pipeline._emit import Instruction
from jaxreshard.runtime._compile import StageCompiler
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime._executor import APPLY_EVENT, Event, PipelineError, StageRunner
from jaxreshard.runtime._layout import PipelineLayout, Transfer, layout_pipeline
from jaxreshard.runtime._remote import RemoteArray
from jaxreshard.runtime._specs import spec_of, transplant_spec

# -- in the host actor -----------------------------------------------------------------------------


class HostPipeline:
    """The stages of one pipelined step that live on this host (runs inside the host actor)."""

    def __init__(
        self,
        actor: Any,
        fun: Callable[..., Any],
        config: PipelineConfig,
        in_tree: Any,
        avals: Sequence[Any],
        batch_leaves: Sequence[int],
        input_specs: Sequence[P] | None,
        stage_devices: dict[int, Any],
    ):
        self.actor, self.config = actor, config
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
        )
        split = config.weight_delay or config.schedule == "zb_h1"
        self.compilers: dict[int, StageCompiler] = {}
        for s in stage_devices:
            self.compilers[s] = StageCompiler(
                self.graph,
                derive_backward(self.graph.loss.stages[s], split=split),
                self.meshes[s],
                config,
            )
        self.layout: PipelineLayout | None = None
        self.host_of_stage: dict[int, int] = {}
        self._lock = threading.Condition()
        self._local: dict[tuple[Any, ...], Future] = {}
        self._local_plans: dict[tuple[Any, ...], Any] = {}
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="jaxreshard-send")
        self._failure: BaseException | None = None
        self._sends: list[Future] = []  # this step's cross-host sends

    def sharding(self, s: int, spec: P) -> NamedSharding:
        return NamedSharding(self.meshes[s], spec)

    def set_layout(self, layout: PipelineLayout, host_of_stage: dict[int, int]) -> None:
        self.layout, self.host_of_stage = layout, host_of_stage

    # Transfers ------------------------------------------------------------------------------------

    def _shards(self, value: Any) -> dict[int, Any]:
        """A jax.Array's shards by global device id (one per device)."""
        gid = {d: g for g, d in self.actor.devices.items()}
        return {gid[s.device]: s.data for s in value.addressable_shards}

    def _assemble(
        self, shape: Sequence[int], sharding: NamedSharding, shards: dict[int, Any]
    ) -> jax.Array:
        gid = {d: g for g, d in self.actor.devices.items()}
        arrays = [shards[gid[d]] for d in sharding.mesh.devices.flat]
        return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)

    def _work(self, transfer: Transfer, work_id: str, steps: Sequence[Any]) -> HostWork:
        plan = transfer.plan
        own = set(self.actor.devices)
        return HostWork(
            work_id=work_id,
            host=self.actor.host,
            shape=plan.shape,
            dtype=plan.dtype,
            steps=tuple(steps),
            ops={s.op: plan.ops[s.op] for s in steps},
            src_regions={d: i for d, i in zip(plan.src.devices, plan.src.indices) if d in own},
            dst_regions={d: i for d, i in zip(plan.dst.devices, plan.dst.indices) if d in own},
            src_array="",
            dst_array="",
            timeout_s=self.config.timeout_s,
            describe=f"{transfer.name} ({work_id})",
        )

    def _send(self, step_id: str, ins: Instruction, value: Any) -> None:
        transfer = self.layout.transfers[(ins.kind, ins.tensor, ins.src, ins.dst)]
        if self.host_of_stage[ins.dst] == self.actor.host:
            future = self._pool.submit(self._move_local, transfer, value, ins.mb)
            with self._lock:
                self._local[(step_id, *ins.key)] = future
                self._lock.notify_all()
            return
        work_id = _work_id(step_id, ins)

        def send() -> None:
            jax.block_until_ready(value)
            steps = host_programs(transfer.plan).get(self.actor.host, [])
            work = self._work(transfer, work_id, steps)
            data = HostData(work, self._shards(value), self.actor.devices)
            start = time.perf_counter()
            run_host_work(work, data, self.actor._transport)
            self._record(Event.send(transfer, ins.mb, start, time.perf_counter()))

        with self._lock:
            self._sends.append(self._pool.submit(self._guard, send))

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as e:
            with self._lock:
                if self._failure is None:
                    self._failure = e
                self._lock.notify_all()

    def _move_local(self, transfer: Transfer, value: Any, mb: int) -> Any:
        from jaxreshard.comm._local import execute_local

        src = self.sharding(transfer.src_stage, transfer.src_spec)
        dst = self.sharding(transfer.dst_stage, transfer.dst_spec)
        key = (transfer.name, transfer.src_spec, transfer.dst_spec)
        plan = self._local_plans.get(key)
        if plan is None:
            plan = self._local_plans[key] = plan_reshard(
                transfer.shape, transfer.dtype, src, dst, strategy=self.config.resharding
            )
        start = time.perf_counter()
        jax.block_until_ready(value)
        moved = (
            execute_local(plan, value, dst)
            if not set(src.device_set) & set(dst.device_set)
            else jax.device_put(value, dst)
        )
        jax.block_until_ready(moved)
        self._record(Event.send(transfer, mb, start, time.perf_counter()))
        return moved

    def _recv(self, step_id: str, ins: Instruction) -> Any:
        transfer = self.layout.transfers[(ins.kind, ins.tensor, ins.src, ins.dst)]
        timeout = self.config.timeout_s
        if self.host_of_stage[ins.src] == self.actor.host:
            deadline = time.monotonic() + timeout
            key = (step_id, *ins.key)
            with self._lock:
                while key not in self._local:
                    self._check(ins, deadline)
                    self._lock.wait(0.5)
                future = self._local.pop(key)
            return future.result(timeout=max(0.001, deadline - time.monotonic()))
        steps = host_programs(transfer.plan).get(self.actor.host, [])
        work = self._work(transfer, _work_id(step_id, ins), steps)
        data = HostData(work, {}, self.actor.devices)
        try:
            run_host_work(work, data, self.actor._transport)
        finally:
            self.actor._transport.forget(work.work_id)
        dst = self.sharding(ins.dst, transfer.dst_spec)
        return self._assemble(transfer.shape, dst, data.finish())

    def _check(self, ins: Instruction, deadline: float) -> None:
        if self._failure is not None:
            raise PipelineError("stopped: another stage failed") from None
        if time.monotonic() > deadline:
            raise PipelineError(
                f"host {self.actor.host}: stage {ins.dst} waited {self.config.timeout_s:g} s for "
                f"{ins}; stage {ins.src} never sent it"
            )

    def _record(self, event: Event) -> None:
        if self._events is not None:
            self._events.append(event)

    # A step ---------------------------------------------------------------------------------------

    def step(
        self,
        step_id: str,
        params: dict[int, str],
        batches: dict[int, list[list[Any]]],
        consts: dict[int, list[Any]],
        record: bool,
    ) -> dict[str, Any]:
        """Run this host's stages for one step; keep gradients; return losses (last stage)."""
        self._failure = None
        self._sends = []
        self._events: list[Event] | None = [] if record else None
        layout, graph = self.layout, self.graph
        losses: list[Any] = [None] * self.config.num_micro_batches
        results: dict[int, dict[int, Any]] = {}
        errors: list[BaseException] = []

        def placed(k: int) -> Any:
            owner = graph.owner[k]
            shards = self.actor._array(params[k])
            aval = graph.outer.in_avals[graph.params[k]]
            return self._assemble(aval.shape, self.sharding(owner, layout.param_specs[k]), shards)

        def worker(s: int) -> None:
            runner = StageRunner(
                self.compilers[s],
                graph,
                layout,
                lambda ins, v: self._send(step_id, ins, v),
                lambda ins: self._recv(step_id, ins),
                lambda: self._failure is not None,
                self._events.append if self._events is not None else None,
            )
            mine = {k: placed(k) for k in params if graph.owner[k] == s}
            stage = graph.loss.stages[s]
            specs = layout.input_specs[s]
            per_mb = [
                [
                    jax.device_put(np.asarray(x), self.sharding(s, specs[i]))
                    for x, i in zip(
                        pieces, [i for i, r in enumerate(stage.inputs) if r.kind == BATCH]
                    )
                ]
                for pieces in batches.get(s, [])
            ]
            stage_consts = [
                jax.device_put(np.asarray(x), self.sharding(s, specs[i]))
                for x, i in zip(
                    consts.get(s, []), [i for i, r in enumerate(stage.inputs) if r.kind == CONST]
                )
            ]
            try:
                results[s], _ = runner.run(mine, per_mb, stage_consts, losses)
            except BaseException as e:
                with self._lock:
                    if self._failure is None:
                        self._failure = e
                    self._lock.notify_all()
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(s,)) for s in self.compilers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # A step ends when its sends have: their errors belong to it, and so do their events.
        _, pending = wait_futures(list(self._sends), timeout=self.config.timeout_s)
        if pending and not errors and self._failure is None:
            raise TimeoutError(
                f"host {self.actor.host}: {len(pending)} send(s) of step {step_id} did not finish "
                f"within timeout_s={self.config.timeout_s} s after the stages did; a receiving "
                "host may be stuck or dead (raise PipelineConfig.timeout_s if transfers are slow)"
            )
        if errors or self._failure is not None:
            raise errors[0] if errors else self._failure  # type: ignore[misc]
        grads = {}
        for s, accs in results.items():
            for k, value in accs.items():
                if graph.owner[k] == s:
                    array_id = f"{step_id}:grad{k}"
                    self.actor._store(array_id, self._shards(value))
                    grads[k] = array_id
        last = layout.num_stages - 1
        out: dict[str, Any] = {"grads": grads}
        if last in self.compilers:
            out["losses"] = [np.asarray(v) for v in losses]
        if self._events is not None:
            out["events"] = [e.__dict__ for e in self._events]
            out["clock"] = time.time() - time.perf_counter()  # to align hosts' event times
        return out

    def segment(self, index: int, step_id: str, inputs: list[tuple[str, Any]]) -> list[Any]:
        """Run post-gradient segment `index` here; keep its outputs; describe them."""
        seg = self.graph.segments[index]
        mesh = self.meshes[seg.stage]
        values = []
        for (kind, value), var in zip(inputs, seg.inputs):
            if kind == "id":
                array_id, spec = value
                values.append(
                    self._assemble(
                        var.aval.shape, NamedSharding(mesh, P(*spec)), self.actor._array(array_id)
                    )
                )
            else:
                spec = transplant_spec(None, dict(mesh.shape), np.shape(value))
                values.append(
                    jax.device_put(np.asarray(value, var.aval.dtype), NamedSharding(mesh, spec))
                )
        outs = _jitted(seg.jaxpr)(*values)
        described = []
        for n, value in enumerate(outs):
            array_id = f"{step_id}:seg{index}:{n}"
            self.actor._store(array_id, self._shards(value))
            described.append(
                (array_id, tuple(spec_of(value.sharding)), value.shape, np.dtype(value.dtype).name)
            )
        return described


def _work_id(step_id: str, ins: Instruction) -> str:
    """What the sending and the receiving host call one transfer of one step."""
    kind, tensor, mb, src, dst = ins.key
    return f"{step_id}:{kind}{tensor}:mb{mb}:s{src}->s{dst}"


_JITTED: dict[int, Any] = {}


def _jitted(jaxpr: Any) -> Any:
    fn = _JITTED.get(id(jaxpr))
    if fn is None:
        fn = _JITTED[id(jaxpr)] = jax.jit(jc.jaxpr_as_fun(jaxpr))
    return fn


# -- in the driver ---------------------------------------------------------------------------------


class _RemoteCompiler:
    """A `StageCompiler` in a host actor, seen from the driver."""

    def __init__(self, runtime: Any, host: int, key: str, s: int):
        self.runtime, self.host, self.key, self.s = runtime, host, key, s

    def compile_forward(self, specs: Sequence[P]) -> tuple[list[P], list[P]]:
        actor = self.runtime.actors[self.host]
        return self.runtime._wait(
            {
                self.host: actor.pipeline_call.remote(
                    self.key, "compile_forward", self.s, list(specs)
                )
            },
            f"compiling stage {self.s} forward",
        )[self.host]

    def compile_backward(
        self, residual_specs: Sequence[P], output_specs: Sequence[P], loss_scale: float | None
    ) -> list[P]:
        actor = self.runtime.actors[self.host]
        return self.runtime._wait(
            {
                self.host: actor.pipeline_call.remote(
                    self.key,
                    "compile_backward",
                    self.s,
                    list(residual_specs),
                    list(output_specs),
                    loss_scale,
                )
            },
            f"compiling stage {self.s} backward",
        )[self.host]


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
    ):
        self.runtime, self.config, self.graph = runtime, config, graph
        self.key = f"pipeline-{uuid.uuid4().hex[:8]}"
        p = graph.num_stages
        shapes = config.mesh_shapes(p)
        need = sum(int(np.prod(s)) for s in shapes)
        devices = list(runtime.devices)
        if need > len(devices):
            raise ValueError(
                f"the step has {p} stages on meshes {list(shapes)}: {need} devices, but the Ray "
                f"runtime has {len(devices)} ({runtime.cluster.describe()})"
            )
        self.meshes: list[VirtualMesh] = []
        self.host_of_stage: dict[int, int] = {}
        at = 0
        for s, shape in enumerate(shapes):
            n = int(np.prod(shape))
            chosen = devices[at : at + n]
            at += n
            hosts = {d.process_index for d in chosen}
            if len(hosts) != 1:
                raise ValueError(
                    f"stage {s}'s mesh {shape} would span hosts {sorted(hosts)} (devices "
                    f"{[d.id for d in chosen]}); on the Ray runtime every stage must fit in one "
                    "host: make stage_mesh_shape a divisor of devices_per_host"
                )
            self.host_of_stage[s] = hosts.pop()
            self.meshes.append(runtime.mesh(shape, config.mesh_axis_names, [d.id for d in chosen]))
        avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
        stages_of: dict[int, dict[int, Any]] = {}
        for s, h in self.host_of_stage.items():
            grid = np.vectorize(lambda d: d.id)(self.meshes[s].devices)
            stages_of.setdefault(h, {})[s] = grid.tolist()
        payload = _by_value(fun)
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
                    f"host {h} traced the step differently from the driver; the step must be a "
                    "pure function of its arguments (same JAX version on every host)"
                )
        compilers = [_RemoteCompiler(runtime, self.host_of_stage[s], self.key, s) for s in range(p)]
        self.layout = layout_pipeline(
            graph, config, self.meshes, leaves, runtime.cluster, compilers
        )
        runtime._wait(
            {
                h: runtime.actors[h].pipeline_call.remote(
                    self.key, "set_layout", self.layout, self.host_of_stage
                )
                for h in stages_of
            },
            "sending the layout",
        )
        self.hosts = sorted(stages_of)
        self._steps = 0
        self.last_events: list[Event] = []

    def sharding(self, s: int, spec: P) -> VirtualSharding:
        return VirtualSharding(self.meshes[s], spec)

    def run(self, leaves: list[Any], *, record: bool = False) -> list[Any]:
        g, layout, rt = self.graph, self.layout, self.runtime
        m = self.config.num_micro_batches
        step_id = f"{self.key}:{self._steps}"
        self._steps += 1
        params = {}
        param_values = []
        for k, i in enumerate(g.params):
            sharding = self.sharding(g.owner[k], layout.param_specs[k])
            value = leaves[i]
            if not (
                isinstance(value, RemoteArray) and value.sharding == sharding and not value.is_freed
            ):
                value = rt.put(np.asarray(value), sharding)
            params[k] = value.array_id
            param_values.append(value)
        consts_all = _const_values(g, leaves)
        batches: dict[int, list[list[Any]]] = {}
        consts: dict[int, list[Any]] = {}
        for s, stage in enumerate(g.loss.stages):
            pieces = [
                np.split(np.asarray(leaves[r.index]), m, axis=0)
                for r in stage.inputs
                if r.kind == BATCH
            ]
            if pieces:
                batches[s] = [[piece[mb] for piece in pieces] for mb in range(m)]
            consts[s] = [np.asarray(consts_all[r.index]) for r in stage.inputs if r.kind == CONST]
        calls = {}
        for h in self.hosts:
            stages = [s for s, hh in self.host_of_stage.items() if hh == h]
            calls[h] = rt.actors[h].pipeline_call.remote(
                self.key,
                "step",
                step_id,
                {k: params[k] for k in params if self.host_of_stage[g.owner[k]] == h},
                {s: batches[s] for s in stages if s in batches},
                {s: consts[s] for s in stages},
                record,
            )
        results = rt._wait(
            calls, f"running step {step_id}", self.config.timeout_s + 30, work_id=step_id
        )
        last_host = self.host_of_stage[layout.num_stages - 1]
        losses = results[last_host]["losses"]
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
        loss = np.mean(losses) if self.config.loss_reduction == "mean" else np.sum(losses)
        values: dict[Any, Any] = dict(zip(g.outer.jaxpr.invars, leaves))
        for k, i in enumerate(g.params):
            values[g.outer.jaxpr.invars[i]] = param_values[k]
        values[g.grad_outputs[0]] = np.asarray(loss, dtype=g.grad_outputs[0].aval.dtype)
        for k, v in enumerate(g.grad_outputs[1:]):
            owner = g.owner[k]
            array_id = results[self.host_of_stage[owner]]["grads"].get(k)
            aval = g.outer.in_avals[g.params[k]]
            if array_id is None:  # the loss does not use this parameter
                values[v] = np.zeros(aval.shape, aval.dtype)
                continue
            values[v] = RemoteArray(
                rt, array_id, aval.shape, aval.dtype, self.sharding(owner, layout.param_specs[k])
            )
        for index, seg in enumerate(g.segments):
            host = self.host_of_stage[seg.stage]
            start = time.perf_counter()
            inputs = [self._locate(values[v], host) for v in seg.inputs]
            described = rt._wait(
                {
                    host: rt.actors[host].pipeline_call.remote(
                        self.key, "segment", index, step_id, inputs
                    )
                },
                f"post segment {index}",
            )[host]
            if record:
                self.last_events.append(
                    Event(seg.stage, APPLY_EVENT, -1, start, time.perf_counter(), "apply")
                )
            for var, (array_id, spec, shape, dtype) in zip(seg.outputs, described):
                values[var] = RemoteArray(
                    rt, array_id, shape, dtype, self.sharding(seg.stage, P(*spec))
                )
        return [
            values[v] if not isinstance(v, jc.Literal) else v.val for v in g.outer.jaxpr.outvars
        ]

    def _locate(self, value: Any, host: int) -> tuple[str, Any]:
        """How a segment on `host` gets a value: by id if it is there, else as data."""
        if isinstance(value, RemoteArray):
            mesh_hosts = {d.process_index for d in value.sharding.mesh.devices.flat}
            if mesh_hosts == {host}:
                return ("id", (value.array_id, tuple(value.sharding.spec)))
            return ("data", value.fetch())
        return ("data", np.asarray(value))


def _const_values(g: StepGraph, leaves: list[Any]) -> list[Any]:
    index = {v: i for i, v in enumerate(g.outer.jaxpr.invars)}
    if g.pre is not None:
        pre_in = [np.asarray(leaves[index[v]]) for v in g.pre_inputs]
        pre = dict(zip(g.pre_outputs, jax.jit(jc.jaxpr_as_fun(g.pre))(*pre_in)))
    else:
        pre = {}
    return [leaves[index[v]] if v in index else pre[v] for v in g.consts]


def _by_value(fun: Callable[..., Any]) -> bytes:
    """Pickle the step so that host actors can run it even if its module is not installed
    (a script, a test file, an example): its module travels by value."""
    from ray import cloudpickle

    module = sys.modules.get(getattr(fun, "__module__", "") or "")
    registered = False
    if (
        module is not None
        and module.__name__ not in ("__main__",)
        and not module.__name__.startswith(("jaxreshard", "jax", "numpy"))
    ):
        try:
            cloudpickle.register_pickle_by_value(module)
            registered = True
        except (ValueError, TypeError):
            pass
    try:
        return cloudpickle.dumps(fun)
    finally:
        if registered:
            cloudpickle.unregister_pickle_by_value(module)
