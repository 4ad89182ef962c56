"""`train_step.plan(...)`: what a parallelized step does, before it runs."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxreshard.comm import describe_sharding
from jaxreshard.frontend._split import ACT, BATCH, CONST, PARAM, StepGraph
from jaxreshard.pipeline._emit import format_programs


@dataclasses.dataclass
class PipelinePlan:
    """What a parallelized step does: stages, meshes, boundary tensors, schedule, programs."""

    graph: StepGraph
    pipeline: Any  # LocalPipeline or RayPipeline
    # partition="auto": the measured segments and cuts, every choice's predicted step, and the
    # choice (see [Note: automatic partitioning] in runtime/step/_partition.py).
    partition: Any = None

    @property
    def layout(self) -> Any:
        return self.pipeline.layout

    @property
    def meshes(self) -> list[Any]:
        return self.pipeline.meshes

    def boundary_tensors(self) -> list[dict[str, Any]]:
        """One record per transfer kind and edge: what moves where, how, and how many bytes."""
        out = []
        for (kind, tensor, src, dst), t in sorted(
            self.layout.transfers.items(), key=lambda kv: (kv[0][0] != "act", kv[0])
        ):
            out.append(
                {
                    "kind": kind,
                    "tensor": tensor,
                    "src_stage": src,
                    "dst_stage": dst,
                    "shape": t.shape,
                    "dtype": str(np.dtype(t.dtype)),
                    "src_sharding": describe_sharding(self.pipeline.sharding(src, t.src_spec)),
                    "dst_sharding": describe_sharding(self.pipeline.sharding(dst, t.dst_spec)),
                    "strategy": t.plan.chosen if t.plan else "local",
                    "bytes": t.nbytes,
                    "per": "step" if kind in ("param", "param_grad") else "micro-batch",
                }
            )
        return out

    def summary(self) -> str:
        """One line: stages (and ranks), micro-batches and their rows, schedule."""
        g, layout = self.graph, self.layout
        schedule = layout.schedule
        stages = f"{g.num_stages} stages"
        if schedule.virtual_stages > 1 or schedule.num_chunks != schedule.num_stages:
            stages += f" on {schedule.num_stages} ranks"
        m = layout.config.num_micro_batches
        if g.batch:
            batches = f"{m} micro-batch{'es' if m > 1 else ''} of {layout.micro_batch_rows} rows"
        elif m == 1:
            batches = "1 micro-batch, no batch argument"
        else:
            batches = (
                f"{m} micro-batches, no batch argument (batch_argnums=()): each micro-batch "
                "computes the whole step"
            )
        delay = " + weight delay" if schedule.weight_delay else ""
        return f"{stages}, {batches}, schedule {schedule.name}{delay}"

    def __str__(self) -> str:
        g, layout = self.graph, self.layout
        lines = [f"pipeline: {self.summary()}"]
        if self.partition is not None:
            lines.append(self.partition.summary())
        for s, mesh in enumerate(self.meshes):
            stage = g.loss.stages[s]
            ids = [d.id for d in mesh.devices.flat]
            kinds = {k: sum(r.kind == k for r in stage.inputs) for k in (PARAM, BATCH, CONST, ACT)}
            lines.append(
                f"  stage {s}: mesh {dict(mesh.shape)} devices {ids}; "
                f"{len(stage.jaxpr.jaxpr.eqns)} equations; inputs: {kinds[PARAM]} params, "
                f"{kinds[BATCH]} batch, {kinds[CONST]} consts, {kinds[ACT]} activations"
            )
        if layout.reductions:
            lines.append("parameter gradients summed over the batch axes:")
            for s, how in sorted(layout.reductions.items()):
                lines.append(f"  stage {s}: {how}")
        lines.append("boundary tensors:")
        for t in self.boundary_tensors():
            lines.append(
                f"  {t['kind']}{t['tensor']} s{t['src_stage']}->s{t['dst_stage']} "
                f"{t['dtype']}{list(t['shape'])} {t['bytes']} B per {t['per']}: "
                f"{t['src_sharding']} -> {t['dst_sharding']} by {t['strategy']}"
            )
        for a in g.loss.activations:
            lines.append(f"  act{a.id} is computed at {a.where}")
        lines.append(f"post-gradient segments on stages: {[seg.stage for seg in g.segments]}")
        lines.append("schedule:")
        lines.append(layout.schedule.grid())
        lines.append("instructions (first ones):")
        lines.append(format_programs(layout.programs, limit=12))
        return "\n".join(lines)
