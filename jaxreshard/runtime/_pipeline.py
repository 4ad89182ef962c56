"""A cut train step compiled for concrete meshes, and the interpreter of stage programs.

[Note: pipeline execution]
Compilation goes stage by stage, forward then backward, and exchanges only `PartitionSpec`s, so
that a stage can compile in the process that owns its devices (this one, or a host actor):
- `StageCompiler` compiles one stage on its mesh for given input specs: its forward (returning
  outputs and residuals), and its backward (whole, or B and W), with gradient accumulators
  updated in place; it reports the specs XLA chose for every output.
- `layout_pipeline` chains those specs: a boundary tensor leaves its producer with the spec the
  producer's executable gives it, and enters its consumer with the same spec on the consumer's
  mesh when that fits (same axes, divisible), else replicated. Every boundary tensor, gradient and
  parameter copy gets one resharding plan (over the runtime's device ids), reused every
  micro-batch and step, and the schedule becomes per-stage instruction lists.
- `StageRunner` steps through one stage's instructions (see [Note: instructions]) with the
  runtime's `send`/`recv`; compute is dispatched to JAX asynchronously.
The local executor runs one runner thread per stage; a SEND hands the value to a transfer thread
that moves it by its plan while the stage goes on, and a RECV waits, with a deadline, for it. The
first failure stops every runner.

[Note: signal-only bound]
The paper's upper bound on what hiding transfers can buy: every cross-mesh transfer becomes a
signal that keeps the dependency (the receiver still waits for the sender's value to exist) but
carries no data; the receiver computes on zeros placed on its mesh once. A step run so is as fast
as the same schedule with free communication; its losses are meaningless.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
from jax.extend import core as jc
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxreshard._config import PipelineConfig
from jaxreshard._jax_compat import make_mesh
from jaxreshard.comm import Cluster, Plan, plan_reshard
from jaxreshard.comm._emulate import LinkEmulator, sleep_until
from jaxreshard.comm._layout import spec_axes
from jaxreshard.frontend._backward import StageBackward, derive_backward
from jaxreshard.frontend._split import ACT, BATCH, CONST, PARAM, StepGraph
from jaxreshard.pipeline import Costs, Schedule, build_schedule
from jaxreshard.pipeline._action import BACKWARD, FORWARD, WEIGHT
from jaxreshard.pipeline._emit import (
    ACTIVATION,
    GRADIENT,
    PARAM_GRAD,
    RECV_OP,
    RUN,
    SEND_OP,
    Edge,
    Instruction,
    SharedParam,
    emit,
)
from jaxreshard.pipeline._emit import PARAM as PARAM_COPY

# -- specs -----------------------------------------------------------------------------------------


def transplant_spec(spec: Any, mesh_shape: dict[str, int], shape: Sequence[int]) -> P:
    """`spec` when it fits a mesh of `mesh_shape` and an array of `shape`, else replicated."""
    if spec is None or len(spec) > len(shape):
        return P()
    for dim, entry in enumerate(spec):
        axes = spec_axes(entry)
        if any(a not in mesh_shape for a in axes):
            return P()
        if shape[dim] % int(np.prod([mesh_shape[a] for a in axes], dtype=np.int64)):
            return P()
    return P(*spec)


def batch_spec(mesh_shape: dict[str, int], shape: Sequence[int], batch_axis: str | None) -> P:
    if batch_axis and batch_axis in mesh_shape and shape and shape[0] % mesh_shape[batch_axis] == 0:
        return P(batch_axis)
    return P()


def spec_of(sharding: Any) -> P:
    spec = getattr(sharding, "spec", None)
    return P(*spec) if spec is not None else P()


def stage_meshes(config: PipelineConfig, num_stages: int, devices: Sequence[Any]) -> list[Mesh]:
    """Consecutive groups of `devices`, one mesh per stage."""
    shapes = config.mesh_shapes(num_stages)
    need = sum(int(np.prod(s)) for s in shapes)
    if need > len(devices):
        raise ValueError(
            f"the step has {num_stages} stages on meshes {list(shapes)}: {need} devices, but "
            f"this runtime has {len(devices)}; use fewer stages or a smaller stage_mesh_shape, "
            "or more devices (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)"
        )
    meshes, at = [], 0
    for shape in shapes:
        n = int(np.prod(shape))
        grid = np.array(devices[at : at + n]).reshape(shape)
        meshes.append(make_mesh(grid, config.mesh_axis_names, config.axis_types))
        at += n
    return meshes


def check_meshes(meshes: Sequence[Any], num_stages: int) -> None:
    if len(meshes) != num_stages:
        raise ValueError(
            f"parallelize(meshes=...) gives {len(meshes)} meshes for a step of {num_stages} stages"
        )
    seen: dict[Any, int] = {}
    for s, mesh in enumerate(meshes):
        for d in mesh.devices.flat:
            if d in seen:
                raise ValueError(
                    f"stage meshes {seen[d]} and {s} share device {d}; every stage needs its "
                    "own devices (cross-mesh pipelines move data between disjoint meshes)"
                )
            seen[d] = s


# -- compiling one stage ---------------------------------------------------------------------------


def fan_in(graph: StepGraph, s: int) -> list[int]:
    """Per output of stage s: how many cotangents come back (one per consuming stage)."""
    by_id = {a.id: a for a in graph.loss.activations}
    return [
        len(by_id[r.index].consumers) if r.kind == ACT else 1 for r in graph.loss.stages[s].outputs
    ]


class StageCompiler:
    """Compiles stage `s` of a step on `mesh` (in the process that owns the mesh's devices)."""

    def __init__(self, graph: StepGraph, bw: StageBackward, mesh: Mesh, config: PipelineConfig):
        self.graph, self.bw, self.mesh, self.config = graph, bw, mesh, config
        self.s = bw.stage.index
        self.forward: Any = None
        self.backward: Any = None
        self.b_part: Any = None
        self.w_part: Any = None
        self.input_shardings: list[NamedSharding] = []
        self.acc_shardings: list[NamedSharding] = []

    def _sharded(self, avals: Sequence[Any], specs: Sequence[P]) -> list[jax.ShapeDtypeStruct]:
        return [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(self.mesh, sp))
            for a, sp in zip(avals, specs)
        ]

    def compile_forward(self, input_specs: Sequence[P]) -> tuple[list[P], list[P]]:
        """Compile the forward; return the specs of its outputs and of its residuals."""
        structs = self._sharded(self.bw.stage.jaxpr.in_avals, input_specs)
        self.input_shardings = [st.sharding for st in structs]
        with jax.set_mesh(self.mesh):
            self.forward = jax.jit(self.bw.forward).lower(*structs).compile()
        outs, res = self.forward.output_shardings
        return [spec_of(x) for x in outs], [spec_of(x) for x in res]

    def compile_backward(
        self, residual_specs: Sequence[P], output_specs: Sequence[P], loss_scale: float | None
    ) -> list[P]:
        """Compile the backward; return the specs of the activation gradients it sends back."""
        bw, stage = self.bw, self.bw.stage
        fans = fan_in(self.graph, self.s)
        res = self._sharded(bw.residuals, residual_specs)
        cts: list[jax.ShapeDtypeStruct] = []
        for i in () if loss_scale is not None else bw.float_outputs:
            aval = stage.jaxpr.out_avals[i]
            cts += self._sharded([aval] * fans[i], [output_specs[i]] * fans[i])
        acc_avals = [stage.jaxpr.in_avals[bw.diff[k]] for k in bw.param_grads]
        acc = [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.input_shardings[bw.diff[k]])
            for a, k in zip(acc_avals, bw.param_grads)
        ]
        self.acc_shardings = [st.sharding for st in acc]
        # An activation's gradient leaves with the activation's own sharding, the same in every
        # executable variant: each transfer is planned once for one source sharding.
        self.act_grad_shardings = [self.input_shardings[bw.diff[k]] for k in bw.act_grads]
        fns = self.fns = backward_functions(bw, fans, loss_scale)
        # Two variants each: the first micro-batch's gradients become the accumulators (no
        # zeros to fill and add to), the later ones are added to them in place.
        outs = (self.act_grad_shardings, self.acc_shardings)
        with jax.set_mesh(self.mesh):
            if bw.w is None:
                self.backward_first = (
                    jax.jit(fns["full_first"], out_shardings=outs).lower(res, cts).compile()
                )
                self.backward = (
                    jax.jit(fns["full"], donate_argnums=(0,), out_shardings=outs)
                    .lower(acc, res, cts)
                    .compile()
                )
                act_out = self.act_grad_shardings
            else:
                self.b_part = (
                    jax.jit(fns["b"], out_shardings=(self.act_grad_shardings, None))
                    .lower(res, cts)
                    .compile()
                )
                act_out = self.act_grad_shardings
                export_sh = self.b_part.output_shardings[1]
                exports = [
                    jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
                    for a, sh in zip(bw.b.out_avals[len(bw.act_grads) :], export_sh)
                ]
                self.w_first = (
                    jax.jit(fns["w_first"], out_shardings=self.acc_shardings)
                    .lower(res, cts, exports)
                    .compile()
                )
                self.w_part = (
                    jax.jit(fns["w"], donate_argnums=(0,), out_shardings=self.acc_shardings)
                    .lower(acc, res, cts, exports)
                    .compile()
                )
        return [spec_of(x) for x in act_out]

    def set_apply(self, segment: Any, grad_sources: Sequence[int | None]) -> None:
        """Fuse a post-gradient segment into this stage's last backward (see
        [Note: pipeline execution]): the segment reads the final gradients (input i is the
        accumulator of parameter `grad_sources[i]`, or, for None, the next of the caller's
        extra inputs) as they are computed, without writing them out first."""
        fns, apply = self.fns, jc.jaxpr_as_fun(segment)
        slots = [self.acc_params.index(k) if k is not None else None for k in grad_sources]

        def update(grads: Sequence[Any], extra: Sequence[Any]) -> list[Any]:
            rest = iter(extra)
            return apply(*[grads[k] if k is not None else next(rest) for k in slots])

        if self.bw.w is None:

            def first(res, cts, extra):
                acts, grads = fns["full_first"](res, cts)
                return acts, update(grads, extra)

            def later(acc, res, cts, extra):
                acts, grads = fns["full"](acc, res, cts)
                return acts, update(grads, extra)
        else:

            def first(res, cts, exports, extra):
                return update(fns["w_first"](res, cts, exports), extra)

            def later(acc, res, cts, exports, extra):
                return update(fns["w"](acc, res, cts, exports), extra)

        if self.bw.w is None:  # the activation gradients keep their planned sharding
            outs: Any = (self.act_grad_shardings, None)
            self.apply_first = jax.jit(first, out_shardings=outs)
            self.apply_later = jax.jit(later, donate_argnums=(0,), out_shardings=outs)
        else:
            self.apply_first = jax.jit(first)
            self.apply_later = jax.jit(later, donate_argnums=(0,))
        self.fused = True

    fused = False

    @property
    def acc_params(self) -> list[int]:
        return [self.bw.stage.inputs[self.bw.diff[k]].index for k in self.bw.param_grads]


def backward_functions(
    bw: StageBackward, fans: list[int], loss_scale: float | None
) -> dict[str, Callable[..., Any]]:
    """The jit-able backward functions of a stage: cotangents summed per output; the last
    stage's loss cotangent is the constant `loss_scale`."""

    def cotangents(ct_lists: Sequence[Any]) -> list[Any]:
        if loss_scale is not None:
            aval = bw.stage.jaxpr.out_avals[0]
            return [jax.numpy.full(aval.shape, loss_scale, aval.dtype)]
        out, at = [], 0
        for i in bw.float_outputs:
            parts = ct_lists[at : at + fans[i]]
            at += fans[i]
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            out.append(total)
        return out

    def full_first(res: Sequence[Any], ct_lists: Sequence[Any]):
        grads = jc.jaxpr_as_fun(bw.full)(*res, *cotangents(ct_lists))
        return [grads[k] for k in bw.act_grads], [grads[k] for k in bw.param_grads]

    def full(acc: Sequence[Any], res: Sequence[Any], ct_lists: Sequence[Any]):
        acts, grads = full_first(res, ct_lists)
        return acts, [a + g for a, g in zip(acc, grads)]

    def b(res: Sequence[Any], ct_lists: Sequence[Any]):
        out = jc.jaxpr_as_fun(bw.b)(*res, *cotangents(ct_lists))
        return out[: len(bw.act_grads)], out[len(bw.act_grads) :]

    def w_first(res: Sequence[Any], ct_lists: Sequence[Any], exports: Sequence[Any]):
        return jc.jaxpr_as_fun(bw.w)(*res, *cotangents(ct_lists), *exports)

    def w(acc: Sequence[Any], res: Sequence[Any], ct_lists: Sequence[Any], exports: Sequence[Any]):
        return [a + g for a, g in zip(acc, w_first(res, ct_lists, exports))]

    return {"full": full, "full_first": full_first, "b": b, "w": w, "w_first": w_first}


# -- laying the whole pipeline out -----------------------------------------------------------------


@dataclasses.dataclass
class Transfer:
    """How one boundary tensor (or its gradient, or a parameter copy) moves between stages."""

    name: str
    src_stage: int
    dst_stage: int
    shape: tuple[int, ...]
    dtype: Any
    src_spec: P
    dst_spec: P
    plan: Plan

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass
class PipelineLayout:
    """Everything about a compiled step that is not an executable (and pickles)."""

    config: PipelineConfig
    num_stages: int
    mesh_shapes: list[dict[str, int]]
    param_specs: list[P]  # per parameter, on its owner's mesh
    input_specs: list[list[P]]  # per stage, per forward input
    transfers: dict[tuple[str, int, int, int], Transfer]
    schedule: Schedule
    programs: tuple[tuple[Instruction, ...], ...]
    loss_scale: float
    micro_batch_rows: int


def layout_pipeline(
    graph: StepGraph,
    config: PipelineConfig,
    meshes: Sequence[Any],
    leaves: Sequence[Any],
    cluster: Cluster,
    compilers: Sequence[Any],
) -> PipelineLayout:
    """Compile every stage through `compilers` (local `StageCompiler`s or remote proxies with the
    same two methods), chaining specs, then plan every transfer and emit the programs.

    `meshes` are the stage meshes as the planner should see them: `jax.sharding.Mesh`es locally,
    `VirtualMesh`es over the runtime's devices on Ray.
    """
    p, m = graph.num_stages, config.num_micro_batches
    avals = graph.outer.in_avals
    shapes = [dict(mesh.shape) for mesh in meshes]
    param_specs = [
        transplant_spec(
            spec_of(getattr(leaves[i], "sharding", None)), shapes[graph.owner[k]], avals[i].shape
        )
        for k, i in enumerate(graph.params)
    ]
    by_id = {a.id: a for a in graph.loss.activations}
    out_specs: list[list[P]] = []
    res_specs: list[list[P]] = []
    input_specs: list[list[P]] = []
    act_spec: dict[int, P] = {}
    scale = 1.0 / m if config.loss_reduction == "mean" else 1.0
    # A stage's backward needs only its own forward's specs: it compiles in the background
    # while the next stages' forwards do (XLA compiles without the GIL).
    pool = ThreadPoolExecutor(max_workers=max(1, p), thread_name_prefix="jaxreshard-compile")
    backward_futures: list[Future] = []
    for s, stage in enumerate(graph.loss.stages):
        specs = []
        for ref, aval in zip(stage.inputs, stage.jaxpr.in_avals):
            if ref.kind == PARAM:
                specs.append(
                    param_specs[ref.index]
                    if graph.owner[ref.index] == s
                    else transplant_spec(param_specs[ref.index], shapes[s], aval.shape)
                )
            elif ref.kind == BATCH:
                specs.append(batch_spec(shapes[s], aval.shape, config.batch_axis))
            elif ref.kind == CONST:
                specs.append(P())
            else:
                specs.append(transplant_spec(act_spec[ref.index], shapes[s], aval.shape))
        input_specs.append(specs)
        outs, res = compilers[s].compile_forward(specs)
        out_specs.append(outs)
        res_specs.append(res)
        for ref, sp in zip(stage.outputs, outs):
            if ref.kind == ACT:
                act_spec[ref.index] = sp
        backward_futures.append(
            pool.submit(compilers[s].compile_backward, res, outs, scale if s == p - 1 else None)
        )
    try:
        grad_specs: list[list[P]] = [f.result() for f in backward_futures]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)

    def sharding(s: int, spec: P) -> Any:
        mesh = meshes[s]
        if isinstance(mesh, Mesh):
            return NamedSharding(mesh, spec)
        from jaxreshard.comm import VirtualSharding

        return VirtualSharding(mesh, spec)

    transfers: dict[tuple[str, int, int, int], Transfer] = {}

    def add(kind: str, tensor: int, src: int, dst: int, aval: Any, src_spec: P, dst_spec: P):
        plan = plan_reshard(
            aval.shape,
            aval.dtype,
            sharding(src, src_spec),
            sharding(dst, dst_spec),
            cluster=cluster,
            strategy=config.resharding,
        )
        transfers[(kind, tensor, src, dst)] = Transfer(
            f"{kind}{tensor} s{src}->s{dst}",
            src,
            dst,
            tuple(aval.shape),
            np.dtype(aval.dtype),
            src_spec,
            dst_spec,
            plan,
        )

    split = config.weight_delay or config.schedule == "zb_h1"
    for s, stage in enumerate(graph.loss.stages):
        diff = [
            i
            for i, (r, a) in enumerate(zip(stage.inputs, stage.jaxpr.in_avals))
            if r.kind in (PARAM, ACT) and jax.numpy.issubdtype(a.dtype, jax.numpy.inexact)
        ]
        act_grad_inputs = [i for i in diff if stage.inputs[i].kind == ACT]
        for i, (ref, aval) in enumerate(zip(stage.inputs, stage.jaxpr.in_avals)):
            if ref.kind == ACT:
                home = by_id[ref.index].home
                add(ACTIVATION, ref.index, home, s, aval, act_spec[ref.index], input_specs[s][i])
            elif ref.kind == PARAM and graph.owner[ref.index] != s:
                owner = graph.owner[ref.index]
                add(
                    PARAM_COPY, ref.index, owner, s, aval, param_specs[ref.index], input_specs[s][i]
                )
                if i in diff:
                    add(
                        PARAM_GRAD,
                        ref.index,
                        s,
                        owner,
                        aval,
                        input_specs[s][i],
                        param_specs[ref.index],
                    )
        for i, sp in zip(act_grad_inputs, grad_specs[s]):
            ref, aval = stage.inputs[i], stage.jaxpr.in_avals[i]
            home = by_id[ref.index].home
            home_out = graph.loss.stages[home].outputs.index(ref)
            add(GRADIENT, ref.index, s, home, aval, sp, out_specs[home][home_out])

    costs = Costs.make(
        p,
        forward=config.cost_forward,
        backward=config.cost_backward,
        weight_grad=config.cost_weight_grad if split else config.cost_backward / 2,
        comm=config.cost_comm,
    )
    schedule = build_schedule(config.schedule, p, m, weight_delay=config.weight_delay, costs=costs)
    edges = [
        Edge(a.id, a.home, c, a.differentiable) for a in graph.loss.activations for c in a.consumers
    ]
    shared = []
    for k in range(len(graph.params)):
        users = tuple(u for u in graph.loss.users(PARAM, k) if u != graph.owner[k])
        if users:
            shared.append(SharedParam(k, graph.owner[k], users))
    programs = emit(schedule, edges, shared)
    rows = {avals[i].shape[0] for i in graph.batch}  # the step is traced per micro-batch
    return PipelineLayout(
        config,
        p,
        shapes,
        param_specs,
        input_specs,
        transfers,
        schedule,
        programs,
        scale,
        next(iter(rows)) if rows else 0,
    )


# -- running one stage's program -------------------------------------------------------------------


class PipelineError(RuntimeError):
    """A stage failed, or a transfer did not arrive in time."""


@dataclasses.dataclass
class Event:
    """A timed thing that happened during a step (for profiles).

    Kinds: `F`, `B`, `W` (compute), `A` (an optimizer segment run after the pipeline), `send`
    (a transfer, on the sender's lane, `dst` its receiver) and `wait` (a stage blocked in a
    RECV). Times are `time.perf_counter()` seconds of the process that ran the stage.
    """

    stage: int
    kind: str
    mb: int
    start: float
    end: float
    name: str
    nbytes: int = 0
    dst: int = -1

    @classmethod
    def send(cls, transfer: Any, mb: int, start: float, end: float, nbytes: int | None = None):
        """A `send` event of one micro-batch's `transfer` (its bytes unless `nbytes` says)."""
        size = transfer.nbytes if nbytes is None else nbytes
        return cls(
            transfer.src_stage, SEND, mb, start, end, transfer.name, size, transfer.dst_stage
        )


SEND, WAIT, APPLY_EVENT = "send", "wait", "A"


def transfer_name(ins: Instruction) -> str:
    """The name of the `Transfer` an instruction moves (`act3 s0->s1`)."""
    return f"{ins.kind}{ins.tensor} s{ins.src}->s{ins.dst}"


class StageRunner:
    """Steps through one stage's instructions (see [Note: instructions]).

    Args:
        compiler: the stage's compiled executables.
        graph, layout: the step.
        send: `send(instruction, value)` starts a transfer (must not block).
        recv: `recv(instruction) -> value` waits for one (with a deadline).
        stopped: tells the runner that another stage failed.
        record: if given, called with an `Event` after each action (blocks on its results).
    """

    def __init__(
        self,
        compiler: StageCompiler,
        graph: StepGraph,
        layout: PipelineLayout,
        send: Callable[[Instruction, Any], None],
        recv: Callable[[Instruction], Any],
        stopped: Callable[[], bool],
        record: Callable[[Event], None] | None = None,
    ):
        self.c, self.graph, self.layout = compiler, graph, layout
        self.send, self.recv, self.stopped, self.record = send, recv, stopped, record

    def run(
        self,
        params: dict[int, Any],
        batches: list[list[Any]],
        consts: list[Any],
        losses: list[Any],
        apply_inputs: Sequence[Any] | None = None,
    ) -> tuple[dict[int, Any], list[Any] | None]:
        """Run the stage's program.

        Args:
            params: the parameters this stage keeps (owner), by index.
            batches: per micro-batch, the stage's batch inputs in input order.
            consts: the stage's per-step constants in input order.
            losses: filled per micro-batch by the last stage.
            apply_inputs: with a fused optimizer segment (`StageCompiler.set_apply`), its
                inputs other than the gradients.

        Returns:
            The gradient accumulators by parameter index (none when the optimizer was fused),
            and the fused segment's outputs (or None).
        """
        fused = self.c.fused and apply_inputs is not None
        applied: list[Any] | None = None
        last_backward = max(
            i
            for i, ins in enumerate(self.layout.programs[self.c.s])
            if ins.op == RUN and ins.action.kind in (BACKWARD, WEIGHT)
        )
        c, bw = self.c, self.c.bw
        stage, s = bw.stage, self.c.s
        last = s == self.layout.num_stages - 1
        local_params = dict(params)
        acc: list[Any] | None = None  # the first backward's gradients start the accumulators
        acc_params = c.acc_params
        inbox: dict[tuple[int, int], Any] = {}
        outbox: dict[tuple[int, int], Any] = {}
        grads_in: dict[tuple[int, int, int], Any] = {}
        grads_out: dict[tuple[int, int], Any] = {}
        residuals: dict[int, Any] = {}
        exports: dict[int, Any] = {}
        batch_pos = [i for i, r in enumerate(stage.inputs) if r.kind == BATCH]
        const_pos = [i for i, r in enumerate(stage.inputs) if r.kind == CONST]
        consumers = {a.id: a.consumers for a in self.graph.loss.activations}

        def cotangents(mb: int) -> list[Any]:
            if last:
                return []
            return [
                grads_in[(stage.outputs[i].index, consumer, mb)]
                for i in bw.float_outputs
                for consumer in consumers[stage.outputs[i].index]
            ]

        for position, ins in enumerate(self.layout.programs[s]):
            final = fused and position == last_backward
            if self.stopped():
                raise PipelineError("stopped: another stage failed")
            if ins.op == RECV_OP:
                start = time.perf_counter()
                value = self.recv(ins)
                if self.record is not None:
                    self.record(
                        Event(s, WAIT, ins.mb, start, time.perf_counter(), transfer_name(ins))
                    )
                if ins.kind == ACTIVATION:
                    inbox[(ins.tensor, ins.mb)] = value
                elif ins.kind == GRADIENT:
                    grads_in[(ins.tensor, ins.src, ins.mb)] = value
                elif ins.kind == PARAM_COPY:
                    local_params[ins.tensor] = value
                else:  # a user's gradient contribution to a parameter this stage keeps
                    k = acc_params.index(ins.tensor)
                    acc[k] = acc[k] + value
            elif ins.op == SEND_OP:
                if ins.kind == ACTIVATION:
                    self.send(ins, outbox[(ins.tensor, ins.mb)])
                elif ins.kind == GRADIENT:
                    self.send(ins, grads_out[(ins.tensor, ins.mb)])
                elif ins.kind == PARAM_COPY:
                    self.send(ins, local_params[ins.tensor])
                else:
                    self.send(ins, acc[acc_params.index(ins.tensor)])
            elif ins.op == RUN:
                action = ins.action
                mb = action.microbatch_index
                start = time.perf_counter()
                if action.kind == FORWARD:
                    args = []
                    for i, ref in enumerate(stage.inputs):
                        if ref.kind == PARAM:
                            args.append(local_params[ref.index])
                        elif ref.kind == BATCH:
                            args.append(batches[mb][batch_pos.index(i)])
                        elif ref.kind == CONST:
                            args.append(consts[const_pos.index(i)])
                        else:
                            args.append(inbox[(ref.index, mb)])
                    outs, residuals[mb] = c.forward(*args)
                    if last:
                        losses[mb] = outs[0]
                    else:
                        for ref, value in zip(stage.outputs, outs):
                            outbox[(ref.index, mb)] = value
                    done = outs
                elif action.kind == BACKWARD:
                    if final and acc is None:
                        act_grads, applied = c.apply_first(
                            residuals[mb], cotangents(mb), apply_inputs
                        )
                    elif final:
                        act_grads, applied = c.apply_later(
                            acc, residuals[mb], cotangents(mb), apply_inputs
                        )
                        acc = []
                    elif bw.w is None and acc is None:
                        act_grads, acc = c.backward_first(residuals[mb], cotangents(mb))
                    elif bw.w is None:
                        act_grads, acc = c.backward(acc, residuals[mb], cotangents(mb))
                    else:
                        act_grads, exports[mb] = c.b_part(residuals[mb], cotangents(mb))
                    for k, g in zip(bw.act_grads, act_grads):
                        grads_out[(stage.inputs[bw.diff[k]].index, mb)] = g
                    done = act_grads
                elif final:  # WEIGHT, with the optimizer
                    args = (residuals[mb], cotangents(mb), exports.pop(mb), apply_inputs)
                    applied = c.apply_first(*args) if acc is None else c.apply_later(acc, *args)
                    acc, done = [], applied
                else:  # WEIGHT
                    if acc is None:
                        acc = c.w_first(residuals[mb], cotangents(mb), exports.pop(mb))
                    else:
                        acc = c.w_part(acc, residuals[mb], cotangents(mb), exports.pop(mb))
                    done = acc
                if self.record is not None:
                    jax.block_until_ready(done)
                    self.record(Event(s, action.kind, mb, start, time.perf_counter(), str(action)))
            else:  # FREE: drop what this micro-batch no longer needs
                mb = ins.mb
                if ins.kind == "fwd":
                    for store in (inbox, outbox):
                        for key in [k for k in store if k[1] == mb]:
                            del store[key]
                else:
                    residuals.pop(mb, None)
                    for key in [k for k in grads_in if k[2] == mb]:
                        del grads_in[key]
                    for key in [k for k in grads_out if k[1] == mb]:
                        del grads_out[key]
        return (dict(zip(acc_params, acc)) if acc else {}), applied


# -- the local runtime -----------------------------------------------------------------------------


@dataclasses.dataclass
class CompiledPipeline:
    """A step compiled for this process's devices."""

    graph: StepGraph
    layout: PipelineLayout
    meshes: list[Mesh]
    cluster: Cluster
    compilers: list[StageCompiler]
    fused: dict[int, int] = dataclasses.field(default_factory=dict)  # stage -> post segment

    @property
    def config(self) -> PipelineConfig:
        return self.layout.config

    @property
    def num_stages(self) -> int:
        return self.layout.num_stages

    @property
    def transfers(self) -> dict[tuple[str, int, int, int], Transfer]:
        return self.layout.transfers

    @property
    def schedule(self) -> Schedule:
        return self.layout.schedule

    @property
    def programs(self) -> tuple[tuple[Instruction, ...], ...]:
        return self.layout.programs

    def sharding(self, s: int, spec: P) -> NamedSharding:
        return NamedSharding(self.meshes[s], spec)


def fusable_segments(graph: StepGraph, compilers: Sequence[StageCompiler]) -> dict[int, int]:
    """Post segments that can run inside their stage's last backward: stage -> segment index.

    A segment qualifies when it is its stage's only one, reads only that stage's own parameters,
    their gradients (which nothing else needs, not even the step's outputs) and the step's
    inputs, and the stage exchanges no shared parameter's gradient after its last backward.
    """
    by_stage: dict[int, list[int]] = {}
    for j, seg in enumerate(graph.segments):
        by_stage.setdefault(seg.stage, []).append(j)
    invars = graph.outer.jaxpr.invars
    param_owner = {invars[i]: graph.owner[k] for k, i in enumerate(graph.params)}
    grad_of = {v: k for k, v in enumerate(graph.grad_outputs[1:])}
    # Stages that exchange shared parameters' gradients after their last backward.
    exchanging = set()
    for k in range(len(graph.params)):
        others = {u for u in graph.loss.users(PARAM, k) if u != graph.owner[k]}
        if others:
            exchanging |= others | {graph.owner[k]}
    uses: dict[Any, int] = {}
    for seg in graph.segments:
        for v in seg.inputs:
            uses[v] = uses.get(v, 0) + 1
    returned = set(graph.outer.jaxpr.outvars)
    inputs_ok = set(invars) | set(graph.pre_outputs)
    fused = {}
    for s, (j, *others) in by_stage.items():
        seg = graph.segments[j]
        if others or s in exchanging:
            continue
        grads = [v for v in seg.inputs if v in grad_of]
        ok = bool(grads)
        for v in seg.inputs:
            if v in grad_of:
                k = grad_of[v]
                ok &= (
                    graph.owner[k] == s
                    and k in compilers[s].acc_params
                    and uses.get(v) == 1
                    and v not in returned
                )
            elif v in param_owner:
                ok &= param_owner[v] == s
            else:
                ok &= v in inputs_ok and v not in set(graph.batch_vars)
        if ok:
            fused[s] = j
    return fused


def compile_local(
    graph: StepGraph,
    config: PipelineConfig,
    meshes: list[Mesh],
    leaves: Sequence[Any],
    cluster: Cluster,
) -> CompiledPipeline:
    split = config.weight_delay or config.schedule == "zb_h1"
    compilers = [
        StageCompiler(graph, derive_backward(stage, split=split), meshes[s], config)
        for s, stage in enumerate(graph.loss.stages)
    ]
    layout = layout_pipeline(graph, config, meshes, leaves, cluster, compilers)
    fused = fusable_segments(graph, compilers)
    grad_of = {v: k for k, v in enumerate(graph.grad_outputs[1:])}
    for s, j in fused.items():
        seg = graph.segments[j]
        compilers[s].set_apply(seg.jaxpr, [grad_of.get(v) for v in seg.inputs])
    return CompiledPipeline(graph, layout, meshes, cluster, compilers, fused)


class LocalExecutor:
    """Runs a compiled pipeline on this process's devices (see [Note: pipeline execution])."""

    def __init__(self, compiled: CompiledPipeline):
        self.c = compiled
        self.events: list[Event] = []
        self._record: Callable[[Event], None] | None = None
        self._lock = threading.Condition()
        self._mailbox: dict[tuple[str, int, int, int, int], Future] = {}
        self._failure: BaseException | None = None
        self._pool = ThreadPoolExecutor(
            max_workers=max(8, 4 * compiled.num_stages), thread_name_prefix="jaxreshard-transfer"
        )
        # One long-lived thread per stage, reused every step.
        self._stages = ThreadPoolExecutor(
            max_workers=compiled.num_stages, thread_name_prefix="jaxreshard-stage"
        )
        self.signal_only = False
        self._placeholders: dict[tuple[str, P], Any] = {}
        gbps = compiled.config.emulate_network_gbps
        self._emulator = (
            LinkEmulator(gbps, compiled.cluster.latency_s) if gbps is not None else None
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._stages.shutdown(wait=False, cancel_futures=True)

    def _move(self, transfer: Transfer, value: Any, mb: int) -> tuple[Any, float]:
        """Move a value by its plan; return it and when (monotonic clock) the receiver may use
        it: now, or the end of its emulated hops. The receiver, not this transfer thread,
        sleeps until then, so that slow emulated links never hold the thread pool."""
        from jaxreshard._reshard import execute

        start = time.perf_counter()
        check_source(transfer, value, self.c.sharding(transfer.src_stage, transfer.src_spec))
        jax.block_until_ready(value)
        dst = self.c.sharding(transfer.dst_stage, transfer.dst_spec)
        ready = 0.0
        if self.signal_only:
            moved = self._placeholder(transfer, dst)
        else:
            moved = execute(transfer.plan, value, dst)
            if self._emulator is not None:
                ready = emulated_end(self._emulator, self.c.cluster, transfer.plan)
        jax.block_until_ready(moved)
        if self._record is not None:
            end = time.perf_counter() + max(0.0, ready - time.monotonic())
            self._record(Event.send(transfer, mb, start, end, 0 if self.signal_only else None))
        return moved, ready

    def _placeholder(self, transfer: Transfer, dst: NamedSharding) -> Any:
        """Signal-only mode's stand-in for a transfer's result: zeros already in place, made
        once (see [Note: signal-only bound])."""
        key = (transfer.name, transfer.dst_spec)
        with self._lock:
            value = self._placeholders.get(key)
            if value is None:
                value = self._placeholders[key] = jax.device_put(
                    np.zeros(transfer.shape, transfer.dtype), dst
                )
        return value

    def _send(self, ins: Instruction, value: Any) -> None:
        transfer = self.c.transfers[(ins.kind, ins.tensor, ins.src, ins.dst)]
        future = self._pool.submit(self._move, transfer, value, ins.mb)
        with self._lock:
            self._mailbox[ins.key] = future
            self._lock.notify_all()

    def _recv(self, ins: Instruction) -> Any:
        timeout = self.c.config.timeout_s
        deadline = time.monotonic() + timeout
        with self._lock:
            while ins.key not in self._mailbox:
                if self._failure is not None:
                    raise PipelineError("stopped: another stage failed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PipelineError(
                        f"stage {ins.dst} waited {timeout:g} s for {ins}; stage {ins.src} never "
                        "sent it"
                    )
                self._lock.wait(min(left, 0.5))
            future = self._mailbox.pop(ins.key)
        try:
            value, ready = future.result(timeout=max(0.001, deadline - time.monotonic()))
            sleep_until(ready)
            return value
        except TimeoutError:
            raise PipelineError(
                f"stage {ins.dst}: the transfer {ins} did not finish within {timeout:g} s"
            ) from None

    def run(
        self,
        params: list[Any],
        batches: list[list[list[Any]]],
        consts: list[list[Any]],
        *,
        record: bool = False,
        signal_only: bool = False,
        apply_inputs: dict[int, list[Any]] | None = None,
    ) -> tuple[list[Any], list[Any], dict[int, list[Any]]]:
        """Run every stage's program; return the loss per micro-batch, the gradient per parameter
        (None where an optimizer segment was fused) and the fused segments' outputs by stage.

        With `record`, every action and transfer is timed into `self.events` (which blocks on
        each action's results, so use it for profiles). With `signal_only`, transfers carry no
        data (see [Note: signal-only bound]): the results are wrong, the timing is the bound.
        """
        self.signal_only = signal_only
        self.events = []
        self._record = self.events.append if record else None
        self._mailbox.clear()
        self._failure = None
        p = self.c.num_stages
        owner = self.c.graph.owner
        accumulators: list[dict[int, Any]] = [{} for _ in range(p)]
        applied: dict[int, list[Any]] = {}
        losses: list[Any] = [None] * self.c.config.num_micro_batches

        def worker(s: int) -> None:
            runner = StageRunner(
                self.c.compilers[s],
                self.c.graph,
                self.c.layout,
                self._send,
                self._recv,
                lambda: self._failure is not None,
                self._record,
            )
            mine = {k: v for k, v in enumerate(params) if owner[k] == s}
            try:
                with jax.set_mesh(self.c.meshes[s]):
                    accumulators[s], out = runner.run(
                        mine, batches[s], consts[s], losses, (apply_inputs or {}).get(s)
                    )
                if out is not None:
                    applied[s] = out
            except BaseException as e:
                with self._lock:
                    if self._failure is None:
                        self._failure = (
                            e
                            if isinstance(e, PipelineError)
                            else PipelineError(f"stage {s} failed: {type(e).__name__}: {e}")
                        )
                        self._failure.__cause__ = e
                    self._lock.notify_all()

        if p == 1:
            worker(0)  # nothing to overlap with: no thread
        else:
            for future in [self._stages.submit(worker, s) for s in range(p)]:
                future.result()
        if self._failure is not None:
            raise self._failure
        grads = [accumulators[owner[k]].get(k) for k in range(len(params))]
        return losses, grads, applied


def check_source(transfer: Transfer, value: Any, planned: Any) -> None:
    """A transfer's plan says which device holds which slice: moving a value laid out otherwise
    would deliver wrong data, so refuse it (an internal error, never silent)."""
    if not value.sharding.is_equivalent_to(planned, len(transfer.shape)):
        raise PipelineError(
            f"{transfer.name}: the value leaves stage {transfer.src_stage} as {value.sharding} but "
            f"its transfer was planned for {planned}; this is a jaxreshard bug, please report it"
        )


def emulated_end(emulator: LinkEmulator, cluster: Cluster, plan: Plan) -> float:
    """When a plan's cross-host hops would end on the emulated NICs (see
    [Note: network emulation])."""
    host = cluster.host_of
    end = 0.0
    for op in plan.ops:
        if op.kind == "allgather":
            continue
        chain = (op.src_device, *op.dst_devices)
        for a, b in itertools.pairwise(chain):
            if host(a) != host(b):
                end = max(end, emulator.reserve(host(a), host(b), op.nbytes)[1])
    return end
