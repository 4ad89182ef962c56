"""Laying a compiled step out: every stage's specs, every transfer's plan, the programs."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxreshard.comm import Cluster, Plan, plan_reshard
from jaxreshard.frontend._split import ACT, BATCH, CONST, MB, PARAM, StepGraph
from jaxreshard.pipeline import Costs, Schedule, build_schedule, simulate
from jaxreshard.pipeline._action import FORWARD, Action
from jaxreshard.pipeline._emit import (
    ACTIVATION,
    GRADIENT,
    PARAM_GRAD,
    RECV_OP,
    RUN,
    Edge,
    Instruction,
    SharedParam,
    emit,
)
from jaxreshard.pipeline._emit import PARAM as PARAM_COPY
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime.step._backward import stage_acc_params
from jaxreshard.runtime.step._programs import program_variants
from jaxreshard.runtime.step._specs import (
    batch_spec,
    micro_batch_rows,
    spec_of,
    split_rows,
    transplant_spec,
)


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
    plan: Plan | None  # None between two chunks of one rank (the value stays on its mesh)

    @functools.cached_property
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
    # When each RECV's consumer starts in the simulated schedule (by instruction key): a
    # stage's outgoing transfers go out in this order (see [Note: boundary tensors]).
    need: dict[tuple[Any, ...], float] = dataclasses.field(default_factory=dict)
    # Per stage, how it reduces its parameter gradients over its batch axes (see
    # [Note: gradients reduced once] in `step/_reduction.py`).
    reductions: dict[int, str] = dataclasses.field(default_factory=dict)


def schedule_costs(config: PipelineConfig, num_stages: int) -> Costs:
    """The config's relative per-chunk costs (what places delayed weight gradients)."""
    for name, n in (("cost_forward", num_stages), ("cost_backward", num_stages),
                    ("cost_weight_grad", num_stages), ("cost_comm", num_stages - 1)):  # fmt: skip
        value = getattr(config, name)
        if isinstance(value, tuple) and len(value) != n:
            what = "boundary" if name == "cost_comm" else "model stage (chunk)"
            raise ValueError(
                f"PipelineConfig({name}={list(value)}): the step has {num_stages} model "
                f"stages, so {name} needs {n} entries (one per {what}), not {len(value)}; or "
                "give a single number"
            )
    return Costs.make(
        num_stages,
        forward=config.cost_forward,
        backward=config.cost_backward,
        weight_grad=config.cost_weight_grad if config.split_backward else None,
        comm=config.cost_comm,
    )


def pipeline_schedule(
    config: PipelineConfig, num_stages: int, forward_only: bool = False
) -> Schedule:
    """The schedule of a step of `num_stages` model stages (chunks) on
    `config.num_meshes(num_stages)` meshes, with the config's per-chunk cost model.

    A forward-only step (eval, inference) keeps the schedule's placement of chunks on meshes
    (so it finds the parameters where a training step with the same config left them) and runs
    each rank's chunks in model order, every micro-batch of one before the next: no rank waits
    on a later chunk, so no order deadlocks.
    """
    schedule = build_schedule(
        config.schedule,
        config.num_meshes(num_stages),
        config.num_micro_batches,
        virtual_stages=config.chunks_per_mesh,
        weight_delay=config.weight_delay,
        costs=schedule_costs(config, num_stages),
    )
    if not forward_only:
        return schedule
    m = config.num_micro_batches
    actions = [
        [Action(c, FORWARD, mb) for c in schedule.chunks_of(r) for mb in range(m)]
        for r in range(schedule.num_stages)
    ]
    return Schedule(
        f"{schedule.name} (forward only)",
        schedule.num_stages,
        m,
        False,
        False,
        actions,
        schedule.placement,
    )


def layout_pipeline(
    graph: StepGraph,
    config: PipelineConfig,
    schedule: Schedule,
    meshes: Sequence[Any],
    leaves: Sequence[Any],
    cluster: Cluster,
    compilers: Sequence[Any],
    fused: dict[int, int] | None = None,
    recorded: bool = False,
) -> PipelineLayout:
    """Emit the programs, compile every stage through `compilers` (local `StageCompiler`s or
    remote proxies with their `prepare`, `compile_forward` and `compile_variants`), chaining
    specs, and plan every transfer. `fused` gives the stages whose optimizer segment runs in
    their last backward (stage -> segment); with `recorded`, the executables compiled up front
    are a recorded step's (a profile's).

    Stages are model stages (chunks): `meshes[s]` is the mesh chunk s runs on (the same mesh for
    the chunks of one rank, with virtual stages), and `schedule` places them.

    `meshes` are the stage meshes as the planner should see them: `jax.sharding.Mesh`es locally,
    `VirtualMesh`es over the runtime's devices on Ray.
    """
    p, m = graph.num_stages, config.num_micro_batches
    avals = graph.outer.in_avals
    shapes = [dict(mesh.shape) for mesh in meshes]
    param_specs = parameter_specs(graph, leaves, shapes)
    by_id = {a.id: a for a in graph.loss.activations}
    # The programs first: what they call decides what compiles (see [Note: stage executables]).
    grads = not graph.forward_only
    fused = fused or {}
    edges = [
        Edge(a.id, a.home, c, a.differentiable and grads)
        for a in graph.loss.activations
        for c in a.consumers
    ]
    shared = []
    for k in range(len(graph.params)):
        users = tuple(u for u in graph.loss.users(PARAM, k) if u != graph.owner[k])
        if users:
            shared.append(SharedParam(k, graph.owner[k], users, grads))
    programs = emit(schedule, edges, shared)
    split = config.split_backward and grads
    accumulates = {s for s in range(p) if stage_acc_params(graph, s)}
    variants: dict[int, set[str]] = {}
    for r in range(schedule.num_stages):
        chunks = schedule.chunks_of(r)
        variants.update(
            program_variants(programs[r], chunks, p - 1, split, fused, accumulates, recorded)
        )
    extra = extra_specs(graph, fused, leaves, param_specs, shapes)

    out_specs: list[list[P]] = []
    input_specs: list[list[P]] = []
    rows = micro_batch_rows(graph)
    reductions: dict[int, str] = {}
    act_spec: dict[int, P] = {}
    scale = 1.0 / m if config.loss_reduction == "mean" else 1.0
    # Forwards compile in model order (a stage's input specs are the last one's output specs);
    # everything else a stage's program calls compiles in the background meanwhile (XLA compiles
    # without the GIL).
    pool = ThreadPoolExecutor(max_workers=max(1, p), thread_name_prefix="jaxreshard-compile")
    futures: list[Future] = []
    try:
        for s, stage in enumerate(graph.loss.stages):
            specs = []
            for ref, aval in zip(stage.inputs, stage.jaxpr.in_avals):
                if ref.kind == PARAM:
                    specs.append(
                        param_specs[ref.index]
                        if graph.owner[ref.index] == s
                        else transplant_spec(
                            param_specs[ref.index],
                            shapes[s],
                            aval.shape,
                            f"parameter {ref.index} ({aval.str_short()}), shared with stage {s}",
                        )
                    )
                elif ref.kind == BATCH:
                    dim = graph.feeds[ref.index].dim
                    specs.append(batch_spec(shapes[s], aval.shape, config.batch_axis, dim))
                elif ref.kind in (CONST, MB):
                    specs.append(P())
                else:
                    what = f"boundary tensor act{ref.index} ({aval.str_short()}) entering stage {s}"
                    spec = transplant_spec(act_spec[ref.index], shapes[s], aval.shape, what)
                    specs.append(split_rows(spec, shapes[s], aval.shape, config.batch_axis, rows))
            input_specs.append(specs)
            reductions[s] = compilers[s].prepare(specs, scale if s == p - 1 and grads else None)
            if "forward" in variants[s] or any(r.kind == ACT for r in stage.outputs):
                outs, _ = compilers[s].compile_forward()
            else:  # the last stage, when its forwards run fused with its backwards
                outs = [P()] * len(stage.outputs)
            out_specs.append(outs)
            for ref, sp in zip(stage.outputs, outs):
                if ref.kind == ACT:
                    act_spec[ref.index] = sp
            rest = sorted(variants[s] - {"forward"})
            if rest:
                futures.append(pool.submit(compilers[s].compile_variants, rest, extra.get(s)))
        for f in futures:
            f.result()
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
        # Between two chunks of one rank, a value stays on its mesh: no plan, at most a
        # respecification on the same devices.
        plan = (
            None
            if schedule.rank_of(src) == schedule.rank_of(dst)
            else plan_reshard(
                aval.shape,
                aval.dtype,
                sharding(src, src_spec),
                sharding(dst, dst_spec),
                cluster=cluster,
                strategy=config.resharding,
            )
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

    for s, stage in enumerate(graph.loss.stages):
        diff = [
            i
            for i, (r, a) in enumerate(zip(stage.inputs, stage.jaxpr.in_avals))
            if r.kind in (PARAM, ACT)
            and jax.numpy.issubdtype(a.dtype, jax.numpy.inexact)
            and not graph.forward_only
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
        for i in act_grad_inputs:
            ref, aval, sp = stage.inputs[i], stage.jaxpr.in_avals[i], input_specs[s][i]
            home = by_id[ref.index].home
            home_out = graph.loss.stages[home].outputs.index(ref)
            add(GRADIENT, ref.index, s, home, aval, sp, out_specs[home][home_out])

    rows = {avals[i].shape[0] // m for i in graph.batch}
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
        need_times(schedule, schedule_costs(config, p), programs),
        reductions,
    )


def parameter_specs(
    graph: StepGraph, leaves: Sequence[Any], shapes: Sequence[dict[str, int]]
) -> list[P]:
    """Each parameter's spec on its owner's mesh (of `shapes`): as the caller placed it where
    that fits (a warning says when it does not), else replicated."""
    avals = graph.outer.in_avals
    return [
        transplant_spec(
            spec_of(getattr(leaves[i], "sharding", None)),
            shapes[graph.owner[k]],
            avals[i].shape,
            f"parameter {k} ({avals[i].str_short()}) on stage {graph.owner[k]}",
        )
        for k, i in enumerate(graph.params)
    ]


def extra_specs(
    graph: StepGraph,
    fused: dict[int, int],
    leaves: Sequence[Any],
    param_specs: Sequence[P],
    shapes: Sequence[dict[str, int]],
) -> dict[int, list[P]]:
    """Per fused stage, the specs its optimizer's inputs other than gradients are expected with
    at the first step (see [Note: stage executables]): a parameter as placed, another argument
    as the runtime puts it on the stage's mesh (its spec where it fits), anything else
    replicated."""
    invars = graph.outer.jaxpr.invars
    index = {v: i for i, v in enumerate(invars)}
    param_of = {invars[i]: k for k, i in enumerate(graph.params)}
    grad_vars = set(graph.grad_outputs[1:])
    out: dict[int, list[P]] = {}
    for s, j in fused.items():
        specs = []
        for v in graph.segments[j].inputs:
            if v in grad_vars:
                continue
            if v in param_of:
                specs.append(param_specs[param_of[v]])
            elif v in index:
                leaf = leaves[index[v]]
                sharding = getattr(leaf, "sharding", None)
                specs.append(transplant_spec(spec_of(sharding), shapes[s], np.shape(leaf)))
            else:
                specs.append(P())
        out[s] = specs
    return out


def need_times(
    schedule: Schedule, costs: Costs, programs: Sequence[Sequence[Instruction]]
) -> dict[tuple[Any, ...], float]:
    """For every RECV: the simulated start of the action that consumes it (the next RUN of its
    program; none after it, as for the step's last gradient contributions: infinity)."""
    timeline = simulate(schedule, costs)
    start = {t.action: t.start for stage in timeline.stages for t in stage}
    need: dict[tuple[Any, ...], float] = {}
    for program in programs:
        upcoming = float("inf")
        for ins in reversed(program):
            if ins.op == RUN:
                upcoming = start.get(ins.action, upcoming)
            elif ins.op == RECV_OP:
                need[ins.key] = upcoming
    return need
