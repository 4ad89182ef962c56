"""`partition="auto"` on Ray: the step's segments timed on a host, not on the driver.

[Note: segments timed on the hosts]
The partitioner's compute model is each segment's measured forward, B and W
(`runtime/step/_partition.py`). On Ray those times belong to the hosts' devices: a host may have
other devices, fewer cores (an emulated host has one pinned core, where the driver's process
spreads XLA's CPU threads over the machine) or another load. So the driver sends the pickled
step to the first host of the first stage mesh (`time_on_host`), which traces it with every
candidate a boundary, as the driver did (their fingerprints must agree), and times each
segment on its first device (`host_segment_costs`, run by `HostActor.partition_segment_costs`).
The driver keeps the rest: the transfers under the cluster model, memory and the choice.
Measured on 2 emulated hosts with one core each (docs/partitioning.md): a U-Transformer's
segments timed on the driver predicted its steps 30-50% low and ranked its cuts wrongly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxreshard._jax_compat import abstract_mesh
from jaxreshard.frontend._trace import fingerprint, trace_step
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime.step._segment_cost import SegmentCost, segment_cost


def host_segment_costs(
    host: int,
    payload: bytes,
    config: PipelineConfig,
    avals: Sequence[Any],
    batch_leaves: Sequence[int],
    input_specs: Sequence[Any] | None,
    donated: Sequence[int],
    split: int,
) -> dict[str, Any]:
    """On a host: trace the step (`payload`, as `pipeline_prepare` takes it) with every
    candidate a boundary and time each segment on this host's first device; its fingerprint
    and per segment its `SegmentCost` fields and scratch bytes."""
    from jaxreshard.runtime.ray._actor import load_step

    step, static, in_tree = load_step(host, payload, len(avals))
    shape = config.mesh_shapes(None)[0]
    mesh = abstract_mesh(shape, config.mesh_axis_names, config.axis_types)
    graph, _ = trace_step(
        step,
        in_tree,
        avals,
        batch_leaves,
        config.num_micro_batches,
        mesh,
        None,
        input_specs,
        static=static,
        loss_reduction=config.loss_reduction,
        donated=donated,
        cuts="all",
        candidates=[],
    )
    device = jax.local_devices()[0]
    timed = [segment_cost(graph, s, device, split) for s in range(graph.loss.num_stages)]
    return {
        "fingerprint": fingerprint(graph),
        "segments": [(*dataclasses.astuple(c), scratch) for c, scratch in timed],
    }


def time_on_host(
    runtime: Any,
    fun: Callable[..., Any],
    static: dict[int, Any],
    config: PipelineConfig,
    in_tree: Any,
    leaves: Sequence[Any],
    batch_leaves: Sequence[int],
    input_specs: Sequence[Any] | None,
    donated: Sequence[int],
) -> Callable[[Any, int], list[tuple[SegmentCost, int]]]:
    """A timer for `choose_cuts`: `(graph, split) ->` each segment's cost and scratch bytes,
    measured on the first host of the first stage mesh (see [Note: segments timed on the
    hosts])."""
    from jaxreshard.runtime.ray._pipeline import _by_value
    from jaxreshard.runtime.ray._placement import COMPILE_WAIT_S, stage_placement

    def timer(graph: Any, split: int) -> list[tuple[SegmentCost, int]]:
        assert config.num_stages is not None
        _, hosts_of_rank = stage_placement(runtime, config, config.num_meshes(config.num_stages))
        host = hosts_of_rank[0][0]
        avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
        call = runtime.actors[host].partition_segment_costs.remote(
            _by_value(fun, static or {}, in_tree, avals), config, avals, list(batch_leaves),
            input_specs, list(donated), split,
        )  # fmt: skip
        answer = runtime._wait(
            {host: call}, f"timing the step's segments on host {host}", COMPILE_WAIT_S
        )[host]
        if answer["fingerprint"] != fingerprint(graph):
            raise RuntimeError(
                f"host {host} traced the step differently from the driver; the step must be a "
                "pure function of its arguments (same JAX version on every host)"
            )
        return [(SegmentCost(*costs), int(scratch)) for *costs, scratch in answer["segments"]]

    return timer
