"""Compiling a pipeline for the local runtime: every stage on this process's devices."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxreshard.comm import Cluster
from jaxreshard.frontend._split import StepGraph
from jaxreshard.pipeline import Schedule
from jaxreshard.pipeline._emit import Instruction
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime.engine._host import HostEngine
from jaxreshard.runtime.step._compile import StageCompiler
from jaxreshard.runtime.step._layout import (
    PipelineLayout,
    Transfer,
    layout_pipeline,
    parameter_specs,
    pipeline_schedule,
)
from jaxreshard.runtime.step._specs import spec_of


@dataclasses.dataclass
class CompiledPipeline:
    """A step compiled for this process's devices: its layout and the engine that runs it."""

    graph: StepGraph
    layout: PipelineLayout
    meshes: list[Mesh]
    cluster: Cluster
    engine: HostEngine

    @property
    def config(self) -> PipelineConfig:
        return self.layout.config

    @property
    def num_stages(self) -> int:
        return self.layout.num_stages

    @property
    def compilers(self) -> list[StageCompiler]:
        return [self.engine.compilers[s] for s in range(self.num_stages)]

    @property
    def fused(self) -> dict[int, int]:
        return self.engine.fused

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


def compile_local(
    graph: StepGraph,
    config: PipelineConfig,
    meshes: list[Mesh],
    leaves: Sequence[Any],
    cluster: Cluster,
    recorded: bool = False,
) -> CompiledPipeline:
    """Compile a cut step for this process's devices: `meshes` has one mesh per rank; every
    stage (chunk) compiles on the mesh the schedule places it on (up front, the executables
    a step calls; a `recorded` one's for a profile)."""
    schedule = pipeline_schedule(config, graph.num_stages, graph.forward_only)
    meshes = [meshes[schedule.rank_of(c)] for c in range(graph.num_stages)]
    engine = HostEngine(graph, config, dict(enumerate(meshes)))
    # The optimizer segments compile beside the stages (see [Note: segment executables]).
    specs = parameter_specs(graph, leaves, [dict(mesh.shape) for mesh in meshes])
    leaf_specs = [spec_of(x.sharding) if isinstance(x, jax.Array) else None for x in leaves]
    post = threading.Thread(
        target=engine.warm_segments,
        args=(specs, leaf_specs),
        name="jaxreshard-compile-post",
        daemon=True,
    )
    post.start()
    try:
        layout = layout_pipeline(
            graph,
            config,
            schedule,
            meshes,
            leaves,
            cluster,
            engine.compilers,
            engine.fused,
            recorded,
        )
    finally:
        post.join()
    return CompiledPipeline(graph, layout, meshes, cluster, engine)
