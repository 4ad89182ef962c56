"""A cut train step compiled for concrete meshes, and its execution on the local runtime.

[Note: pipeline execution]
`compile_pipeline` turns a `StepGraph` into per-stage executables: each stage's forward, its
backward (whole, or B and W), and the post-gradient segments, compiled ahead of time for the
shardings their inputs will have. It fixes every boundary tensor's two layouts: the source is the
sharding the producing stage's compiled executable gives the value; the destination is the same
`PartitionSpec` on the consuming stage's mesh when that mesh has the same axes and the spec
divides the value, else replicated. Each boundary tensor (and its gradient) gets one resharding
plan, reused every micro-batch and step.

`LocalExecutor` runs one worker thread per stage, each stepping through its instruction list (see
[Note: instructions]); compute is dispatched to JAX asynchronously, a SEND hands the value to a
transfer thread that waits for it and moves it by its plan while the stage goes on, and a RECV
waits, with a deadline, for the transfer's result. The first failure stops every worker.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass
class Transfer:
    """How one boundary tensor (or its gradient, or a parameter copy) moves between stages."""

    name: str
    src_stage: int
    dst_stage: int
    shape: tuple[int, ...]
    dtype: Any
    src_sharding: Any
    dst_sharding: Any
    plan: Plan

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass
class CompiledPipeline:
    """Everything needed to run a step for one input signature (see [Note: pipeline execution])."""

    graph: StepGraph
    config: PipelineConfig
    meshes: list[Mesh]
    cluster: Cluster
    schedule: Schedule
    programs: tuple[tuple[Instruction, ...], ...]
    backwards: list[StageBackward]
    param_shardings: list[Any]  # per parameter, on its owner's mesh
    input_shardings: list[list[Any]]  # per stage, per forward input
    forward: list[Any]
    backward: list[Any]  # unsplit: (acc..., res..., cts...) -> (act grads..., acc...)
    b_part: list[Any]
    w_part: list[Any]
    acc_params: list[list[int]]  # per stage: parameter index of each gradient accumulator
    transfers: dict[tuple[str, int, int, int], Transfer]
    loss_scale: float
    micro_batch_rows: int

    @property
    def num_stages(self) -> int:
        return len(self.meshes)


# -- shardings ------------------------------------------------------------------------------------


def transplant(sharding: Any, mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
    """The same PartitionSpec on `mesh` when its axes allow it and it divides `shape`, else
    replicated on `mesh`."""
    spec = getattr(sharding, "spec", None)
    if spec is not None:
        sizes = dict(mesh.shape)
        ok = len(spec) <= len(shape)
        for dim, entry in enumerate(spec if ok else ()):
            axes = spec_axes(entry)
            if any(a not in sizes for a in axes):
                ok = False
                break
            factor = int(np.prod([sizes[a] for a in axes], dtype=np.int64))
            if shape[dim] % factor:
                ok = False
                break
        if ok:
            return NamedSharding(mesh, spec)
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, shape: Sequence[int], batch_axis: str | None) -> NamedSharding:
    if batch_axis and batch_axis in mesh.shape and shape and shape[0] % mesh.shape[batch_axis] == 0:
        return NamedSharding(mesh, P(batch_axis))
    return NamedSharding(mesh, P())


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
        meshes.append(Mesh(np.array(devices[at : at + n]).reshape(shape), config.mesh_axis_names))
        at += n
    return meshes


def check_meshes(meshes: Sequence[Mesh], num_stages: int) -> None:
    if len(meshes) != num_stages:
        raise ValueError(
            f"parallelize(meshes=...) gives {len(meshes)} meshes for a step of {num_stages} stages"
        )
    seen: dict[int, int] = {}
    for s, mesh in enumerate(meshes):
        for d in mesh.devices.flat:
            if d.id in seen:
                raise ValueError(
                    f"stage meshes {seen[d.id]} and {s} share device {d.id}; every stage needs its "
                    "own devices (cross-mesh pipelines move data between disjoint meshes)"
                )
            seen[d.id] = s


# -- compilation ----------------------------------------------------------------------------------


def compile_pipeline(
    graph: StepGraph,
    config: PipelineConfig,
    meshes: list[Mesh],
    leaves: Sequence[Any],
    cluster: Cluster,
) -> CompiledPipeline:
    """Compile every stage for concrete shardings and plan every transfer."""
    p = graph.num_stages
    m = config.num_micro_batches
    outer_avals = graph.outer.in_avals
    split = config.weight_delay or config.schedule == "zb_h1"
    backwards = [derive_backward(stage, split=split) for stage in graph.loss.stages]

    rows = {outer_avals[i].shape[0] for i in graph.batch}
    micro_rows = next(iter(rows)) // m if rows else 0

    param_shardings = []
    for k, i in enumerate(graph.params):
        mesh = meshes[graph.owner[k]]
        param_shardings.append(
            transplant(getattr(leaves[i], "sharding", None), mesh, outer_avals[i].shape)
        )

    transfers: dict[tuple[str, int, int, int], Transfer] = {}

    def add_transfer(
        kind: str, tensor: int, src: int, dst: int, aval: Any, src_sharding: Any, dst_sharding: Any
    ) -> None:
        plan = plan_reshard(
            aval.shape,
            aval.dtype,
            src_sharding,
            dst_sharding,
            cluster=cluster,
            strategy=config.resharding,
        )
        transfers[(kind, tensor, src, dst)] = Transfer(
            f"{kind}{tensor} s{src}->s{dst}",
            src,
            dst,
            tuple(aval.shape),
            aval.dtype,
            src_sharding,
            dst_sharding,
            plan,
        )

    # Forward, stage by stage: every input's sharding is known once its producer is compiled.
    act_src: dict[int, Any] = {}  # activation id -> sharding its producer gives it
    input_shardings: list[list[Any]] = []
    forward = []
    residual_shardings = []
    output_shardings = []
    for s, bw in enumerate(backwards):
        stage, mesh = bw.stage, meshes[s]
        shardings = []
        for ref, aval in zip(stage.inputs, stage.jaxpr.in_avals):
            if ref.kind == PARAM:
                owner = graph.owner[ref.index]
                shardings.append(
                    param_shardings[ref.index]
                    if owner == s
                    else transplant(param_shardings[ref.index], mesh, aval.shape)
                )
            elif ref.kind == BATCH:
                shardings.append(batch_sharding(mesh, aval.shape, config.batch_axis))
            elif ref.kind == CONST:
                shardings.append(NamedSharding(mesh, P()))
            else:
                shardings.append(transplant(act_src[ref.index], mesh, aval.shape))
        input_shardings.append(shardings)
        structs = [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
            for a, sh in zip(stage.jaxpr.in_avals, shardings)
        ]
        with jax.set_mesh(mesh):
            compiled = jax.jit(bw.forward).lower(*structs).compile()
        outs_sh, res_sh = compiled.output_shardings
        forward.append(compiled)
        residual_shardings.append(list(res_sh))
        output_shardings.append(list(outs_sh))
        for ref, sh in zip(stage.outputs, outs_sh):
            if ref.kind == ACT:
                act_src[ref.index] = sh
    activations = {a.id: a for a in graph.loss.activations}
    for s, bw in enumerate(backwards):
        for ref, sh, aval in zip(bw.stage.inputs, input_shardings[s], bw.stage.jaxpr.in_avals):
            if ref.kind == ACT:
                home = activations[ref.index].home
                add_transfer(ACTIVATION, ref.index, home, s, aval, act_src[ref.index], sh)
    # Shared parameters: the owner sends a copy at the start of each step.
    for s, bw in enumerate(backwards):
        for ref, sh, aval in zip(bw.stage.inputs, input_shardings[s], bw.stage.jaxpr.in_avals):
            if ref.kind == PARAM and graph.owner[ref.index] != s:
                add_transfer(
                    PARAM_COPY,
                    ref.index,
                    graph.owner[ref.index],
                    s,
                    aval,
                    param_shardings[ref.index],
                    sh,
                )

    # Backward, last stage first: output cotangents arrive with the outputs' own sharding.
    scale = 1.0 / m if config.loss_reduction == "mean" else 1.0
    backward, b_part, w_part, acc_params = (
        [None] * p,
        [None] * p,
        [None] * p,
        [[] for _ in range(p)],
    )
    for s in reversed(range(p)):
        bw, mesh = backwards[s], meshes[s]
        stage = bw.stage
        fan_in = _fan_in(graph, s)
        res_structs = [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
            for a, sh in zip(bw.residuals, residual_shardings[s])
        ]
        ct_structs = []
        is_last = s == p - 1
        for i in () if is_last else bw.float_outputs:  # the loss cotangent is a constant
            aval = stage.jaxpr.out_avals[i]
            for _ in range(fan_in[i]):
                ct_structs.append(
                    jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=output_shardings[s][i])
                )
        acc_index = [stage.inputs[bw.diff[k]].index for k in bw.param_grads]
        acc_params[s] = acc_index
        acc_structs = [
            jax.ShapeDtypeStruct(
                stage.jaxpr.in_avals[bw.diff[k]].shape,
                stage.jaxpr.in_avals[bw.diff[k]].dtype,
                sharding=input_shardings[s][bw.diff[k]],
            )
            for k in bw.param_grads
        ]
        acc_sh = [st.sharding for st in acc_structs]
        fns = _backward_functions(bw, fan_in, scale if is_last else None)
        with jax.set_mesh(mesh):
            if bw.w is None:
                backward[s] = (
                    jax.jit(
                        fns["full"],
                        donate_argnums=(0,),
                        out_shardings=(None, acc_sh),
                    )
                    .lower(acc_structs, res_structs, ct_structs)
                    .compile()
                )
                act_out = backward[s].output_shardings[0]
            else:
                b_part[s] = jax.jit(fns["b"]).lower(res_structs, ct_structs).compile()
                act_out, export_sh = b_part[s].output_shardings
                export_structs = [
                    jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
                    for a, sh in zip(bw.b.out_avals[len(bw.act_grads) :], export_sh)
                ]
                w_part[s] = (
                    jax.jit(
                        fns["w"],
                        donate_argnums=(0,),
                        out_shardings=acc_sh,
                    )
                    .lower(acc_structs, res_structs, ct_structs, export_structs)
                    .compile()
                )
        for k, sh in zip(bw.act_grads, act_out):
            ref = stage.inputs[bw.diff[k]]
            act = activations[ref.index]
            aval = stage.jaxpr.in_avals[bw.diff[k]]
            home_out = graph.loss.stages[act.home].outputs.index(ref)
            add_transfer(
                GRADIENT, ref.index, s, act.home, aval, sh, output_shardings[act.home][home_out]
            )
        for k in bw.param_grads:
            ref = stage.inputs[bw.diff[k]]
            owner = graph.owner[ref.index]
            if owner != s:
                aval = stage.jaxpr.in_avals[bw.diff[k]]
                add_transfer(
                    PARAM_GRAD,
                    ref.index,
                    s,
                    owner,
                    aval,
                    input_shardings[s][bw.diff[k]],
                    param_shardings[ref.index],
                )

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
    shared = [
        SharedParam(
            k, graph.owner[k], tuple(u for u in graph.loss.users(PARAM, k) if u != graph.owner[k])
        )
        for k in range(len(graph.params))
    ]
    programs = emit(schedule, edges, [sp for sp in shared if sp.users])
    return CompiledPipeline(
        graph,
        config,
        meshes,
        cluster,
        schedule,
        programs,
        backwards,
        param_shardings,
        input_shardings,
        forward,
        backward,
        b_part,
        w_part,
        acc_params,
        transfers,
        scale,
        micro_rows,
    )


def _fan_in(graph: StepGraph, s: int) -> list[int]:
    """Per output of stage s: how many cotangents come back (one per consuming stage)."""
    stage = graph.loss.stages[s]
    out = []
    by_id = {a.id: a for a in graph.loss.activations}
    for ref in stage.outputs:
        out.append(len(by_id[ref.index].consumers) if ref.kind == ACT else 1)
    return out


def _backward_functions(
    bw: StageBackward, fan_in: list[int], loss_scale: float | None
) -> dict[str, Callable[..., Any]]:
    """The jit-able backward functions of a stage: cotangents summed per output; the last
    stage's loss cotangent is the constant `loss_scale`."""

    def cotangents(ct_lists: Sequence[Any]) -> list[Any]:
        if loss_scale is not None:
            aval = bw.stage.jaxpr.out_avals[0]
            return [jax.numpy.full(aval.shape, loss_scale, aval.dtype)]
        out, at = [], 0
        for i in bw.float_outputs:
            parts = ct_lists[at : at + fan_in[i]]
            at += fan_in[i]
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            out.append(total)
        return out

    def full(acc: Sequence[Any], res: Sequence[Any], ct_lists: Sequence[Any]):
        grads = jc.jaxpr_as_fun(bw.full)(*res, *cotangents(ct_lists))
        acts = [grads[k] for k in bw.act_grads]
        new_acc = [a + grads[k] for a, k in zip(acc, bw.param_grads)]
        return acts, new_acc

    def b(res: Sequence[Any], ct_lists: Sequence[Any]):
        out = jc.jaxpr_as_fun(bw.b)(*res, *cotangents(ct_lists))
        return out[: len(bw.act_grads)], out[len(bw.act_grads) :]

    def w(acc: Sequence[Any], res: Sequence[Any], ct_lists: Sequence[Any], exports: Sequence[Any]):
        grads = jc.jaxpr_as_fun(bw.w)(*res, *cotangents(ct_lists), *exports)
        return [a + g for a, g in zip(acc, grads)]

    return {"full": full, "b": b, "w": w}


# -- execution on the local runtime ---------------------------------------------------------------


class PipelineError(RuntimeError):
    """A stage worker failed, or a transfer did not arrive in time."""


@dataclasses.dataclass
class Event:
    """A timed thing that happened during a step (for profiles)."""

    stage: int
    kind: str  # "F", "B", "W" (compute) or "send" (a transfer, on the sender's lane)
    mb: int
    start: float
    end: float
    name: str
    nbytes: int = 0
    dst: int = -1


class LocalExecutor:
    """Runs a compiled pipeline on this process's devices (see [Note: pipeline execution])."""

    def __init__(
        self,
        compiled: CompiledPipeline,
        *,
        record: bool = False,
        transfer_hook: Callable[[Transfer, Any], Any] | None = None,
    ):
        self.c = compiled
        self.record = record
        self.events: list[Event] = []
        self._lock = threading.Condition()
        self._mailbox: dict[tuple[str, int, int, int, int], Future] = {}
        self._failure: BaseException | None = None
        self._pool = ThreadPoolExecutor(
            max_workers=max(4, 2 * compiled.num_stages), thread_name_prefix="jaxreshard-transfer"
        )
        self._hook = transfer_hook
        gbps = compiled.config.emulate_network_gbps
        self._emulator = (
            LinkEmulator(gbps, compiled.cluster.latency_s) if gbps is not None else None
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # Transfers -------------------------------------------------------------------------------

    def _move(self, transfer: Transfer, value: Any) -> Any:
        from jaxreshard._reshard import execute

        start = time.perf_counter()
        value.block_until_ready() if hasattr(value, "block_until_ready") else None
        src_ids = {d.id for d in transfer.src_sharding.device_set}
        dst_ids = {d.id for d in transfer.dst_sharding.device_set}
        if src_ids & dst_ids:
            moved = jax.device_put(value, transfer.dst_sharding)
        else:
            moved = execute(transfer.plan, value, transfer.dst_sharding)
        if self._emulator is not None:
            sleep_until(self._emulate(transfer))
        moved.block_until_ready()
        if self.record:
            self.events.append(
                Event(
                    transfer.src_stage,
                    "send",
                    -1,
                    start,
                    time.perf_counter(),
                    transfer.name,
                    transfer.nbytes,
                    transfer.dst_stage,
                )
            )
        return moved

    def _emulate(self, transfer: Transfer) -> float:
        """When the transfer would end on the cluster's NICs ([Note: network emulation])."""
        host = self.c.cluster.host_of
        end = 0.0
        for op in transfer.plan.ops:
            if op.kind == "allgather":
                continue
            chain = (op.src_device, *op.dst_devices)
            for a, b in zip(chain, chain[1:]):
                if host(a) != host(b):
                    _, hop_end = self._emulator.reserve(host(a), host(b), op.nbytes)  # type: ignore[union-attr]
                    end = max(end, hop_end)
        return end

    def _send(self, ins: Instruction, value: Any) -> None:
        transfer = self.c.transfers[(ins.kind, ins.tensor, ins.src, ins.dst)]
        future = self._pool.submit(self._move, transfer, value)
        with self._lock:
            self._mailbox[ins.key] = future
            self._lock.notify_all()

    def _recv(self, ins: Instruction) -> Any:
        deadline = time.monotonic() + self.c.config.timeout_s
        with self._lock:
            while ins.key not in self._mailbox:
                if self._failure is not None:
                    raise PipelineError("stopped: another stage failed") from None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PipelineError(
                        f"stage {ins.dst} waited {self.c.config.timeout_s:g} s for {ins} "
                        f"({self.c.transfers[(ins.kind, ins.tensor, ins.src, ins.dst)].name}); "
                        f"stage {ins.src} never sent it"
                    )
                self._lock.wait(min(left, 0.5))
            future = self._mailbox.pop(ins.key)
        try:
            return future.result(timeout=max(0.001, deadline - time.monotonic()))
        except TimeoutError:
            raise PipelineError(
                f"stage {ins.dst}: the transfer {ins} did not finish within "
                f"{self.c.config.timeout_s:g} s"
            ) from None

    # Stage workers ---------------------------------------------------------------------------

    def run(
        self, params: list[Any], batches: list[list[list[Any]]], consts: list[list[Any]]
    ) -> tuple[list[Any], list[Any]]:
        """Run every stage's program for one step.

        Args:
            params: per parameter k, its value on its owner's mesh.
            batches: per stage, per micro-batch, the stage's batch inputs (in input order).
            consts: per stage, its per-step constant inputs (in input order).

        Returns:
            (losses per micro-batch, accumulated gradient per parameter on its owner).
        """
        p = self.c.num_stages
        accumulators: list[dict[int, Any]] = [{} for _ in range(p)]
        losses: list[Any] = [None] * self.c.config.num_micro_batches
        results: list[Any] = [None] * p
        threads = [
            threading.Thread(
                target=self._worker,
                name=f"jaxreshard-stage{s}",
                args=(s, params, batches[s], consts[s], accumulators, losses, results),
            )
            for s in range(p)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self._failure is not None:
            raise self._failure
        grads: list[Any] = [
            accumulators[self.c.graph.owner[k]].get(k) for k in range(len(self.c.graph.params))
        ]
        return losses, grads

    def _worker(
        self,
        s: int,
        params: list[Any],
        batches: list[list[Any]],
        consts: list[Any],
        accumulators: list[dict[int, Any]],
        losses: list[Any],
        results: list[Any],
    ):
        try:
            self._run_program(s, params, batches, consts, accumulators, losses)
        except BaseException as e:  # first failure wins; wake everyone
            with self._lock:
                if self._failure is None:
                    self._failure = (
                        e
                        if isinstance(e, PipelineError)
                        else PipelineError(f"stage {s} failed: {type(e).__name__}: {e}")
                    )
                    self._failure.__cause__ = e
                self._lock.notify_all()

    def _run_program(
        self,
        s: int,
        params: list[Any],
        batches: list[list[Any]],
        consts: list[Any],
        accumulators: list[dict[int, Any]],
        losses: list[Any],
    ) -> None:
        c = self.c
        bw = c.backwards[s]
        stage = bw.stage
        last = s == c.num_stages - 1
        local_params: dict[int, Any] = {
            k: params[k] for k in range(len(params)) if c.graph.owner[k] == s
        }
        acc = self._zeros(s)
        inbox: dict[tuple[int, int], Any] = {}  # (activation, mb) -> value
        outbox: dict[tuple[int, int], Any] = {}  # (activation, mb) -> value produced here
        grads_in: dict[tuple[int, int, int], Any] = {}  # (activation, consumer, mb) -> value
        grads_out: dict[tuple[int, int], Any] = {}  # (activation, mb) -> gradient to send back
        residuals: dict[int, list[Any]] = {}
        exports: dict[int, list[Any]] = {}
        batch_pos = [i for i, r in enumerate(stage.inputs) if r.kind == BATCH]
        const_pos = [i for i, r in enumerate(stage.inputs) if r.kind == CONST]
        by_id = {a.id: a for a in c.graph.loss.activations}
        for ins in c.programs[s]:
            if self._failure is not None:
                raise PipelineError("stopped: another stage failed")
            if ins.op == RECV_OP:
                value = self._recv(ins)
                if ins.kind == ACTIVATION:
                    inbox[(ins.tensor, ins.mb)] = value
                elif ins.kind == GRADIENT:
                    grads_in[(ins.tensor, ins.src, ins.mb)] = value
                elif ins.kind == PARAM_COPY:
                    local_params[ins.tensor] = value
                else:  # PARAM_GRAD: a user's contribution to a parameter this stage keeps
                    k = c.acc_params[s].index(ins.tensor)
                    acc[k] = acc[k] + value
            elif ins.op == SEND_OP:
                if ins.kind == ACTIVATION:
                    value = outbox[(ins.tensor, ins.mb)]
                elif ins.kind == GRADIENT:
                    value = grads_out[(ins.tensor, ins.mb)]
                elif ins.kind == PARAM_COPY:
                    value = local_params[ins.tensor]
                else:
                    value = acc[c.acc_params[s].index(ins.tensor)]
                self._send(ins, value)
            elif ins.op == RUN:
                action, mb = ins.action, ins.mb if ins.mb >= 0 else ins.action.microbatch_index
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
                    outs, res = c.forward[s](*args)
                    residuals[mb] = res
                    if last:
                        losses[mb] = outs[0]
                    else:
                        for ref, value in zip(stage.outputs, outs):
                            outbox[(ref.index, mb)] = value
                    if self.record:
                        jax.block_until_ready(outs)
                elif action.kind == BACKWARD:
                    cts = self._cotangents(s, mb, grads_in, by_id)
                    if bw.w is None:
                        act_grads, acc = c.backward[s](acc, residuals[mb], cts)
                    else:
                        act_grads, exported = c.b_part[s](residuals[mb], cts)
                        exports[mb] = exported
                    for k, g in zip(bw.act_grads, act_grads):
                        grads_out[(stage.inputs[bw.diff[k]].index, mb)] = g
                    if self.record:
                        jax.block_until_ready(act_grads)
                elif action.kind == WEIGHT:
                    cts = self._cotangents(s, mb, grads_in, by_id)
                    acc = c.w_part[s](acc, residuals[mb], cts, exports.pop(mb))
                    if self.record:
                        jax.block_until_ready(acc)
                if self.record:
                    self.events.append(
                        Event(s, action.kind, mb, start, time.perf_counter(), str(action))
                    )
            else:  # FREE
                mb = ins.mb
                if ins.kind == "fwd":
                    for key in [k for k in inbox if k[1] == mb]:
                        del inbox[key]
                    for key in [k for k in outbox if k[1] == mb]:
                        del outbox[key]
                else:
                    residuals.pop(mb, None)
                    for key in [k for k in grads_in if k[2] == mb]:
                        del grads_in[key]
                    for key in [k for k in grads_out if k[1] == mb]:
                        del grads_out[key]
        accumulators[s] = dict(zip(c.acc_params[s], acc))

    def _zeros(self, s: int) -> list[Any]:
        c = self.c
        bw = c.backwards[s]
        out = []
        for k in bw.param_grads:
            i = bw.diff[k]
            aval = bw.stage.jaxpr.in_avals[i]
            out.append(jax.device_put(np.zeros(aval.shape, aval.dtype), c.input_shardings[s][i]))
        return out

    def _cotangents(
        self, s: int, mb: int, grads_in: dict[tuple[int, int, int], Any], by_id: dict[int, Any]
    ) -> list[Any]:
        """The received output cotangents of stage s, one per (float output, consumer)."""
        stage = self.c.backwards[s].stage
        if s == self.c.num_stages - 1:
            return []
        out = []
        for i in self.c.backwards[s].float_outputs:
            ref = stage.outputs[i]
            for consumer in by_id[ref.index].consumers:
                out.append(grads_in[(ref.index, consumer, mb)])
        return out
