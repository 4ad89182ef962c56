"""A stage's own collectives, for `partition="auto"` (see [Note: automatic partitioning] in
`_partition.py`): the sums of its weight gradients over its mesh's batch axis.

[Note: gradient sums in the partitioner]
A segment is timed on one device, so its times hold no collective. On a mesh whose batch axis
has more than one device, each device ends a backward with its own part of every weight
gradient, and the stage sums them over that axis:
- once a step, right after the chunk's last backward (`reduce_gradients="once"` with more than
  one micro-batch): simulated as part of the chunk's apply, which runs there;
- inside every backward (`"every_micro_batch"`, or one micro-batch): part of its W.
Its time is the cluster model's ring all-reduce (`Cluster.all_reduce_seconds`) of the
segment's gradient bytes per device (each parameter as its argument's spec lays it out on the
mesh), one ring per position on the mesh's other axes, all at once. Where the batch axis
crosses hosts, the NICs carry it. A parameter-heavy segment then weighs on its chunk: once a
step, its sum hides where the chunk's last backward is early (a later stage's, during the
earlier stages' drain); summed every micro-batch, it adds to that chunk's every W. On the emulated
U-Transformer whose stages span hosts at 0.01 GB/s (2026-11-28), a data-parallel stage's
optimizer and `reduce` took 322-397 ms of a 1.3-2.5 s step; before this, the cut on such meshes
rested on compute and boundary transfers alone.
On the local runtime every stage runs in this process, whatever links `emulate_network_gbps`
gives the boundary tensors, so its sums are charged as within one host.
Not modelled: a stage's tensor-parallel collectives (activations summed or gathered over a model
axis, every layer), whose sizes only the program compiled for the stage mesh knows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxreshard.comm._layout import device_key
from jaxreshard.frontend._split import StepGraph
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime.step._memory import per_device


def gradient_sum_seconds(
    graph: StepGraph, s: int, mesh: Any, specs: Sequence[Any], config: PipelineConfig,
    cluster: Any,
) -> float:  # fmt: skip
    """Seconds for `mesh` to sum the gradients of the parameters segment `s` owns over its batch
    axis, once (see the Note); `specs`: each outer invar's PartitionSpec (None: replicated)."""
    axis = config.batch_axis
    shape = dict(mesh.shape)
    if graph.forward_only or not axis or shape.get(axis, 1) < 2:
        return 0.0
    outer = graph.outer.jaxpr
    held = 0
    for k, owner in enumerate(graph.owner):
        i = graph.params[k]
        aval = outer.invars[i].aval
        if owner == s and np.issubdtype(aval.dtype, np.inexact):
            held += per_device(aval, specs[i], shape)
    if not held:
        return 0.0
    ids = np.vectorize(device_key, otypes=[int])(np.asarray(mesh.devices, dtype=object))
    at = list(mesh.axis_names).index(axis)
    rings = np.moveaxis(ids, at, -1).reshape(-1, ids.shape[at])
    return cluster.all_reduce_seconds([[int(d) for d in ring] for ring in rings], held)
