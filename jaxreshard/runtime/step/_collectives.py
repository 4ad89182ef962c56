"""A stage's own collectives, for `partition="auto"` (see [Note: automatic partitioning] in
`_partition.py`): the sums of its weight gradients over its mesh's batch axis, and the `Sums`
that carry them with its tensor-parallel collectives.

[Note: gradient sums in the partitioner]
A segment is timed on one device, so its times hold no collective. On a mesh whose batch axis
has more than one device, each device ends a backward with its own part of every weight
gradient, and the stage sums them over that axis as the runtime would ([Note: gradients
reduced once] in `_reduction.py`, `reduction_axes`):
- once a step, right after the chunk's last backward, for the parameters only this chunk reads
  (`reduce_gradients="once"`, more than one micro-batch, JAX with unreduced shardings, and no
  parameter of the chunk split over the batch axis): charged in the chunk's apply, which the
  simulator runs there;
- inside every backward otherwise: charged in its W. A parameter that chunks on both sides of
  a cut read (a tied embedding) is summed so by each of them; one split over the batch axis
  (ZeRO-style) is reduce-scattered, and makes its whole chunk sum every micro-batch.
Its time is the cluster model's ring (`Cluster.all_reduce_seconds`) of the chunk's gradient
bytes per device (each parameter as its argument's spec lays it out on the mesh), one ring per
position on the mesh's other axes, all at once: one reduction per chunk, whatever its segment
count, as XLA combines them. Where the batch axis crosses hosts, the NICs carry it.
The sums are kept apart from compute (`Choice.sums`): the trials' refit scales compute and adds
a fixed cost per action, not to the links' time ([Note: action costs fitted to a recorded
step] in `_refit.py`). On the emulated U-Transformer whose stages span hosts at 0.01 GB/s
(2026-11-28), a data-parallel stage's optimizer and `reduce` took 322-397 ms of a 1.3-2.5 s
step; before this, the cut on such meshes rested on compute and boundary transfers alone.
On the local runtime every stage runs in this process, whatever links `emulate_network_gbps`
gives the boundary tensors, so its sums are charged as within one host.
A batch axis that splits no micro-batch (rows it does not divide, or no batch argument) sums
nothing: every device computes the whole micro-batch.
A stage's tensor-parallel collectives (activations summed or gathered over a model axis, every
layer) are priced apart ([Note: tensor-parallel stages in the partitioner] in
`_tensor_parallel.py`) and carried in the same `Sums`. Not modelled: sums over another axis
that splits the stage's inputs and leaves its parameters whole (the runtime keeps those
unreduced too); a JAX refusal that leaves a stage summing every micro-batch (the plan
names it); and, with several chunks on one mesh (virtual stages), the simulator runs every
chunk's apply at the mesh's end, where the runtime runs a chunk's `reduce` after that chunk's
last backward.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from jaxreshard.comm._layout import device_key, spec_axes
from jaxreshard.frontend._split import PARAM, StepGraph
from jaxreshard.pipeline import Costs
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime.step._memory import chunks_of, micro_batch_rows, per_device
from jaxreshard.runtime.step._reduction import _jax_supports
from jaxreshard.runtime.step._specs import transplant_spec


class Sums(NamedTuple):
    """Seconds of a choice's own collectives, per chunk: its gradient sums once a step and per
    micro-batch (in W), and its tensor-parallel collectives per micro-batch in F, B and W
    ([Note: tensor-parallel stages in the partitioner] in `_tensor_parallel.py`; empty: none)."""

    once: tuple[float, ...]
    every: tuple[float, ...]
    forward: tuple[float, ...] = ()
    input_grad: tuple[float, ...] = ()
    weight: tuple[float, ...] = ()

    def in_forward(self, c: int) -> float:
        return self.forward[c] if self.forward else 0.0

    def in_input_grad(self, c: int) -> float:
        """Chunk `c`'s collectives in B (the input gradients) per micro-batch."""
        return self.input_grad[c] if self.input_grad else 0.0

    def in_weight_grad(self, c: int) -> float:
        """Chunk `c`'s collectives in W per micro-batch: its gradient sum and its
        tensor-parallel ones."""
        return self.every[c] + (self.weight[c] if self.weight else 0.0)


def with_sums(costs: Costs, sums: Sums | None) -> Costs:
    """`costs` (compute and transfers) with the collectives of its chunks: the gradient sums
    once a step in the apply, per micro-batch in the backward's W; the tensor-parallel ones in
    F, B and W."""
    if sums is None:
        return costs
    chunks = range(costs.num_stages)
    return dataclasses.replace(
        costs,
        forward=tuple(f + sums.in_forward(c) for c, f in zip(chunks, costs.forward)),
        backward=tuple(
            b + sums.in_input_grad(c) + sums.in_weight_grad(c)
            for c, b in zip(chunks, costs.backward)
        ),
        weight_grad=tuple(w + sums.in_weight_grad(c) for c, w in zip(chunks, costs.weight_grad)),
        apply=tuple(a + t for a, t in zip(costs.apply, sums.once)),
    )


class GradientSums:
    """The gradient sums of any choice of cuts (see the Note): each float parameter's bytes per
    device on each mesh, the segments that read it, and each mesh's rings."""

    def __init__(
        self, graph: StepGraph, specs: Sequence[Any], config: PipelineConfig,
        meshes: Sequence[Any], mesh_of: Sequence[int], cluster: Any,
    ) -> None:  # fmt: skip
        self.config, self.mesh_of, self.cluster = config, mesh_of, cluster
        self.segments = graph.loss.num_stages
        axis = config.batch_axis
        rows = micro_batch_rows(graph)
        self.rings: list[list[list[int]] | None] = []
        for mesh in meshes:
            shape = dict(mesh.shape)
            size = shape.get(axis, 1) if axis else 1
            if graph.forward_only or size < 2 or not rows or rows % size:
                self.rings.append(None)  # (the axis splits no micro-batch: nothing to sum)
                continue
            ids = np.vectorize(device_key, otypes=[int])(np.asarray(mesh.devices, dtype=object))
            at = list(mesh.axis_names).index(axis)
            rings = np.moveaxis(ids, at, -1).reshape(-1, ids.shape[at])
            self.rings.append([[int(d) for d in ring] for ring in rings])
        outer = graph.outer.jaxpr
        # Per parameter: (segments reading it, gradient bytes per device per mesh (0: none to
        # sum), split over the axis); a split one without a gradient still makes its chunk sum
        # every micro-batch, as `reduction_axes` does
        self.params: list[tuple[tuple[int, ...], list[int], list[bool]]] = []
        for k, i in enumerate(graph.params):
            aval = outer.invars[i].aval
            readers = tuple(sorted(set(graph.loss.users(PARAM, k))))
            if not readers:
                continue
            summed = jnp.issubdtype(aval.dtype, jnp.inexact)
            held, split = [], []
            for mesh in meshes:
                shape = dict(mesh.shape)
                held.append(per_device(aval, specs[i], shape) if summed else 0)
                with warnings.catch_warnings():  # (a spec that does not fit is replicated)
                    warnings.simplefilter("ignore")
                    fitted = transplant_spec(specs[i], shape, aval.shape)
                split.append(any(axis in spec_axes(e) for e in fitted))
            self.params.append((readers, held, split))
        self.once_possible = (
            config.reduce_gradients == "once"
            and config.num_micro_batches > 1
            and _jax_supports() is None
        )
        self._seconds: dict[tuple[int, int, bool], float] = {}

    def bytes_per_device(self) -> list[list[int]]:
        """Each segment's gradient bytes per device on each mesh, of the parameters it reads
        first (for the report: a parameter read by several chunks is summed by each, and one
        split over the batch axis is reduce-scattered from its whole size)."""
        out = [[0] * len(self.rings) for _ in range(self.segments)]
        for readers, held, _ in self.params:
            for m, n in enumerate(held):
                out[readers[0]][m] += n if self.rings[m] is not None else 0
        return out

    def costs(self, bounds: Sequence[int]) -> Sums:
        """The sums of the chunks `bounds` (boundary positions) make."""
        chunks = chunks_of(bounds, self.segments)
        chunk_of = {s: c for c, r in enumerate(chunks) for s in r}
        once = [0] * len(chunks)
        every = [0] * len(chunks)
        scatter = [0] * len(chunks)
        split_chunks = set()
        for readers, held, split in self.params:
            reading = sorted({chunk_of[s] for s in readers})
            for c in reading:
                m = self.mesh_of[c]
                if self.rings[m] is None:
                    continue
                if split[m]:
                    scatter[c] += held[m] * self._ring_size(m)  # (each device's whole part)
                    split_chunks.add(c)
                elif len(reading) > 1:
                    every[c] += held[m]
                else:
                    once[c] += held[m]
        seconds_once, seconds_every = [], []
        for c in range(len(chunks)):
            if not self.once_possible or c in split_chunks:
                every[c], once[c] = every[c] + once[c], 0
            m = self.mesh_of[c]
            seconds_once.append(self._ring(m, once[c], False))
            seconds_every.append(self._ring(m, every[c], False) + self._ring(m, scatter[c], True))
        return Sums(tuple(seconds_once), tuple(seconds_every))

    def _ring_size(self, m: int) -> int:
        rings = self.rings[m]
        return len(rings[0]) if rings else 1

    def _ring(self, m: int, nbytes: int, scatter: bool) -> float:
        rings = self.rings[m]
        if rings is None or nbytes <= 0:
            return 0.0
        key = (m, nbytes, scatter)
        if key not in self._seconds:
            self._seconds[key] = self.cluster.all_reduce_seconds(rings, nbytes, scatter=scatter)
        return self._seconds[key]
