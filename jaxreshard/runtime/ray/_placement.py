"""Where a pipeline's stages go on the Ray runtime, and compiling them there."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec as P

from jaxreshard.comm import VirtualMesh
from jaxreshard.runtime._config import PipelineConfig

# How long tracing and compiling a pipeline on the hosts may take (a big stage or optimizer
# compiles for minutes); the runtime's `timeout_s` bounds its data movement, not XLA.
COMPILE_WAIT_S = 900.0


class _RemoteCompiler:
    """A `StageCompiler` in the host actors of a stage, seen from the driver: every host of the
    stage compiles it (they run it together); the lead host's answer is the stage's."""

    def __init__(self, runtime: Any, hosts: Sequence[int], key: str, s: int):
        self.runtime, self.hosts, self.key, self.s = runtime, tuple(hosts), key, s

    def _call(self, method: str, what: str, *args: Any) -> Any:
        calls = {
            h: getattr(self.runtime.actors[h], method).remote(self.key, self.s, *args)
            for h in self.hosts
        }
        answers = self.runtime._wait(calls, f"{what} of stage {self.s}", COMPILE_WAIT_S)
        lead = answers[self.hosts[0]]
        for h in self.hosts[1:]:
            if answers[h] != lead:
                raise RuntimeError(
                    f"stage {self.s} spans hosts {list(self.hosts)}, but host {h} compiled it "
                    f"to {answers[h]} and host {self.hosts[0]} to {lead}; every host of a stage "
                    "needs the same JAX and XLA versions and flags"
                )
        return lead

    def prepare(self, specs: Sequence[P], loss_scale: float | None) -> str:
        return self._call(
            "pipeline_prepare_stage", "preparing the executables", list(specs), loss_scale
        )

    def compile_forward(self) -> tuple[list[P], list[P]]:
        return self._call("pipeline_compile_forward", "compiling the forward")

    def compile_variants(self, names: Sequence[str], extra_specs: Sequence[P] | None) -> None:
        self._call(
            "pipeline_compile_variants", "compiling the executables", list(names), extra_specs
        )


def stage_placement(
    runtime: Any, config: PipelineConfig, num_meshes: int
) -> tuple[list[VirtualMesh], list[tuple[int, ...]]]:
    """Each rank's mesh over the runtime's devices (taken in order) and its hosts (see
    [Note: multi-host stages]); errors name the mesh and the fix."""
    shapes = config.mesh_shapes(num_meshes)
    need = sum(int(np.prod(s)) for s in shapes)
    devices = list(runtime.devices)
    if need > len(devices):
        raise ValueError(
            f"the step runs on meshes {list(shapes)}: {need} devices, but the Ray runtime has "
            f"{len(devices)} ({runtime.cluster.describe()})"
        )
    on_host: dict[int, list[int]] = {}
    for d in devices:
        on_host.setdefault(d.process_index, []).append(d.id)
    meshes, hosts_of_rank, at = [], [], 0
    for r, shape in enumerate(shapes):
        n = int(np.prod(shape))
        chosen = devices[at : at + n]
        at += n
        ids = [d.id for d in chosen]
        hosts = sorted({d.process_index for d in chosen})
        if len(hosts) > 1:
            partial = [h for h in hosts if not set(on_host[h]) <= set(ids)]
            if partial:
                h = partial[0]
                raise ValueError(
                    f"mesh {r} {tuple(shape)} would take devices {ids}: part of host {h}'s "
                    f"{on_host[h]}; a stage mesh either fits in one host or takes whole hosts "
                    f"(see [Note: multi-host stages]): give it a number of devices that divides "
                    f"or is a multiple of the hosts' {len(on_host[h])}, or reorder the stage "
                    "mesh shapes"
                )
            if not getattr(runtime, "distributed", False):
                raise ValueError(
                    f"mesh {r} {tuple(shape)} spans hosts {hosts}, but the host actors did not "
                    "join a jax.distributed runtime (init(backend='ray', distributed=False), or "
                    "a single host); start the runtime with distributed=True (the default with "
                    "two or more hosts), or make every stage mesh fit in one host"
                )
        hosts_of_rank.append(tuple(hosts))
        meshes.append(runtime.mesh(shape, config.mesh_axis_names, ids))
    return meshes, hosts_of_rank


class DistributedCostWarning(UserWarning):
    """The host actors joined `jax.distributed` though no stage of a pipeline spans hosts; on
    CPU that makes every collective inside a stage run over gloo."""


def warn_distributed_cost(
    runtime: Any, shapes: Sequence[Sequence[int]], hosts_of_rank: Sequence[Sequence[int]]
) -> None:
    """Warn (once per runtime) when a CPU runtime joined `jax.distributed` and this pipeline
    needs it for nothing while its stages run collectives (a mesh of several devices)."""
    if not getattr(runtime, "distributed", False) or getattr(runtime, "_warned_cost", False):
        return
    infos = getattr(runtime, "infos", None) or [{}]
    if infos[0].get("platform") != "cpu":
        return  # (GPUs run a host's own collectives over NCCL either way)
    if any(len(h) > 1 for h in hosts_of_rank) or all(int(np.prod(s)) == 1 for s in shapes):
        return
    runtime._warned_cost = True
    warnings.warn(
        "the Ray runtime's host actors joined jax.distributed (init's default with two or more "
        "hosts), but no stage mesh of this pipeline spans hosts; on CPU every collective inside "
        "a stage then runs over gloo (a tensor-parallel tiny GPT measured 2.8x slower per "
        "step). When every stage mesh fits in one host, start the runtime with "
        "jaxreshard.init(backend='ray', ..., distributed=False)",
        DistributedCostWarning,
        stacklevel=2,
    )
