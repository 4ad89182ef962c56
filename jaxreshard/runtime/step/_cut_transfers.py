"""What crosses a cut, in seconds, for `partition="auto"` (see [Note: automatic partitioning]
in `_partition.py`): the boundary tensors of each candidate, and the parameters that chunks on
both sides of a cut read."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxreshard.comm import VirtualSharding, plan_reshard
from jaxreshard.frontend._graph import PARAM
from jaxreshard.frontend._split import StepGraph
from jaxreshard.pipeline._costs import SharedCost
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime.step._memory import (
    borrowed_bytes,
    chunks_of,
    micro_batch_rows,
    nbytes,
    rows_dim,
)
from jaxreshard.runtime.step._specs import batch_spec, transplant_spec


def _sharding(mesh: Any, spec: Any) -> Any:
    if isinstance(mesh, jax.sharding.Mesh):
        return NamedSharding(mesh, spec)
    return VirtualSharding(mesh, spec)  # a Ray runtime's mesh


class SharedParams:
    """The transfers of parameters that several segments read, for any choice of cuts: where
    the cuts put its readers in several chunks, the first keeps it (as the runtime's owner),
    sends it to the others at the start of the step, and gets their gradient contributions
    back before its optimizer runs (`SharedCost`; a tied embedding: its first and last
    segments). Planned as boundary tensors are, in the step argument's layout where it fits the
    mesh, else replicated, one plan per parameter and pair of meshes."""

    def __init__(
        self, graph: StepGraph, specs: Sequence[Any], config: PipelineConfig, cluster: Any,
        meshes: Sequence[Any], mesh_of: Sequence[int],
    ) -> None:  # fmt: skip
        self.graph, self.specs, self.config, self.cluster = graph, specs, config, cluster
        self.meshes, self.mesh_of = meshes, mesh_of
        self.readers = {}
        for k in range(len(graph.params)):
            users = tuple(sorted(set(graph.loss.users(PARAM, k))))
            if len(users) > 1:
                self.readers[k] = users
        self._seconds: dict[tuple[int, int, int], float] = {}

    def listed(self) -> list[tuple[int, int, tuple[int, ...]]]:
        avals = self.graph.outer.in_avals
        return [(k, nbytes(avals[self.graph.params[k]]), users)
                for k, users in self.readers.items()]  # fmt: skip

    def costs(self, bounds: Sequence[int]) -> tuple[SharedCost, ...]:
        """The `Costs.shared` of the chunks `bounds` make (one entry per owner and reader)."""
        pairs: dict[tuple[int, int], list[Any]] = {}
        for k, chunks in self._reader_chunks(bounds):
            for c in chunks[1:]:
                entry = pairs.setdefault((chunks[0], c), [0.0, False])
                entry[0] += self.seconds(k, chunks[0], c)
                entry[1] = entry[1] or self._differentiable(k)
        return tuple(SharedCost(o, u, t, grad) for (o, u), (t, grad) in pairs.items())

    def copy_bytes(self, bounds: Sequence[int]) -> list[int]:
        """Per mesh, the bytes per device its chunks hold of parameters another chunk owns
        (`borrowed_bytes`; the stage memory estimate counts only the owner's)."""
        extra = [0] * len(self.meshes)
        avals = self.graph.outer.in_avals
        for k, chunks in self._reader_chunks(bounds):
            aval, spec = avals[self.graph.params[k]], self.specs[self.graph.params[k]]
            for c in chunks[1:]:
                m = self.mesh_of[c]
                same = m == self.mesh_of[chunks[0]]
                shape = dict(self.meshes[m].shape)
                extra[m] += borrowed_bytes(aval, spec, shape, self._differentiable(k), same)
        return extra

    def _reader_chunks(self, bounds: Sequence[int]) -> list[tuple[int, list[int]]]:
        """Each shared parameter and the chunks that `bounds` make that read it, the owner
        (the first) first."""
        if not self.readers:
            return []
        chunk_of = {}
        for c, r in enumerate(chunks_of(bounds, self.graph.loss.num_stages)):
            chunk_of.update(dict.fromkeys(r, c))
        return [(k, sorted({chunk_of[s] for s in users})) for k, users in self.readers.items()]

    def _differentiable(self, k: int) -> bool:
        aval = self.graph.outer.in_avals[self.graph.params[k]]
        return not self.graph.forward_only and bool(np.issubdtype(aval.dtype, np.inexact))

    def seconds(self, k: int, owner: int, user: int) -> float:
        a, b = self.mesh_of[owner], self.mesh_of[user]
        if a == b:
            return 0.0  # (both chunks on one mesh: nothing moves)
        key = (k, a, b)
        if key not in self._seconds:
            aval = self.graph.outer.in_avals[self.graph.params[k]]
            shape = tuple(aval.shape)
            spec = self.specs[self.graph.params[k]]
            src, dst = self.meshes[a], self.meshes[b]
            with warnings.catch_warnings():  # (a spec that does not fit warns where it's placed)
                warnings.simplefilter("ignore")
                on_src = transplant_spec(spec, dict(src.shape), shape)
                on_dst = transplant_spec(spec, dict(dst.shape), shape)
            plan = plan_reshard(
                shape,
                aval.dtype,
                _sharding(src, on_src),
                _sharding(dst, on_dst),
                cluster=self.cluster,
                strategy=self.config.resharding,
            )
            self._seconds[key] = plan.seconds
        return self._seconds[key]


def crossing_spec(
    mesh_shape: dict[str, int], shape: Sequence[int], rows: int, batch_axis: str | None
) -> P:
    """A boundary tensor's layout on a stage mesh, as the partitioner prices it: split over
    the batch axis along the micro-batch's rows, as the stage that makes it lays it out (a
    scan's stacked outputs, (layers, rows), along dim 1); whole where no dim has the rows
    (`rows` 0: no batch feed, dim 0)."""
    dim = 0 if not rows else rows_dim(shape, rows)
    if dim is None:
        return P()
    return batch_spec(mesh_shape, shape, batch_axis, dim)


def crossing_seconds(
    graph: StepGraph, position: int, src_mesh: Any, dst_mesh: Any, config: PipelineConfig,
    cluster: Any,
) -> float:  # fmt: skip
    """Seconds to move what crosses boundary `position` (made at or before it, used after it)
    from `src_mesh` to `dst_mesh`: one direction, as `Costs.comm` wants it (the simulator
    charges the same for the gradients' way back)."""
    total = 0.0
    rows = micro_batch_rows(graph)
    for act in graph.loss.activations:
        if act.home <= position < max(act.consumers):
            shape, dtype = tuple(act.aval.shape), act.aval.dtype
            spec_src = crossing_spec(dict(src_mesh.shape), shape, rows, config.batch_axis)
            spec_dst = crossing_spec(dict(dst_mesh.shape), shape, rows, config.batch_axis)
            plan = plan_reshard(
                shape,
                dtype,
                _sharding(src_mesh, spec_src),
                _sharding(dst_mesh, spec_dst),
                cluster=cluster,
                strategy=config.resharding,
            )
            total += plan.seconds  # (the simulator charges it again for the gradient back)
    return total
