"""The post-gradient segments (the optimizer), compiled before the first step.

[Note: segment executables]
A segment's inputs come from several places: parameters and their gradients (on their stage's
mesh, with the layout's specs), the step's other arguments (optimizer state, as the caller passes
it), the loss and aux outputs, and earlier segments' outputs; the runtime moves each onto the
segment's mesh (`on_mesh`: kept where it already is, else with its spec where that fits, else
replicated). Those shardings are known before the first step, so `SegmentExecutables.warm`
compiles every segment ahead of it, in a background thread beside the stages' compiles (earlier
segments first: their outputs' shardings are later ones' inputs). A call whose inputs turn out
laid out otherwise (an optimizer state the caller placed differently) runs the segment's jitted
function instead, which compiles for what it gets.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import jax
from jax.extend import core as jc
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxreshard.frontend._split import StepGraph
from jaxreshard.runtime._compile import _MISMATCH
from jaxreshard.runtime._specs import spec_of, transplant_spec
from jaxreshard.runtime._step import donated, segment_function


def placed(sharding: Any, aval: Any, mesh: Any) -> NamedSharding:
    """The sharding `on_mesh` gives a value of `aval` held with `sharding` (None: on the host)
    on `mesh`."""
    devices = frozenset(mesh.devices.flat)
    if sharding is not None and getattr(sharding, "device_set", None) == devices:
        return sharding
    spec = transplant_spec(spec_of(sharding), dict(mesh.shape), aval.shape)
    return NamedSharding(mesh, spec)


class SegmentExecutables:
    """Each post segment of a step: an executable compiled ahead for the expected input
    shardings, or its jitted function (see [Note: segment executables])."""

    def __init__(self, graph: StepGraph):
        self.graph = graph
        self._donate = {j: donated(graph, j) for j in range(len(graph.segments))}
        self._compiled: dict[int, Future] = {}
        self._jitted: set[int] = set()  # segments whose inputs came laid out otherwise
        self._lock = threading.Lock()

    def warm(
        self,
        meshes: Sequence[Any],
        param_specs: Sequence[P],
        leaves: Sequence[Any],
        skip: set[int],
    ) -> None:
        """Compile every segment but `skip` (those fused into a backward) for the shardings
        its inputs will have at the first step; meant to run in a background thread."""
        g = self.graph
        futures = {j: Future() for j in range(len(g.segments)) if j not in skip}
        if not futures:
            return
        with self._lock:
            self._compiled.update(futures)
        invars = g.outer.jaxpr.invars
        home: dict[Any, Any] = {}
        for v, leaf in zip(invars, leaves):
            home[v] = getattr(leaf, "sharding", None) if isinstance(leaf, jax.Array) else None
        for k, i in enumerate(g.params):
            mesh = meshes[g.owner[k]]
            home[invars[i]] = home[g.grad_outputs[1 + k]] = NamedSharding(mesh, param_specs[k])
        if g.grad_outputs:
            home[g.grad_outputs[0]] = NamedSharding(meshes[g.num_stages - 1], P())
        for j, future in futures.items():
            seg = g.segments[j]
            mesh = meshes[seg.stage]
            try:
                structs = [
                    jax.ShapeDtypeStruct(
                        v.aval.shape, v.aval.dtype, sharding=placed(home.get(v), v.aval, mesh)
                    )
                    for v in seg.inputs
                ]
                fn = jax.jit(jc.jaxpr_as_fun(seg.jaxpr), donate_argnums=self._donate[j])
                compiled = fn.lower(*structs).compile()
                for v, sharding in zip(seg.outputs, compiled.output_shardings):
                    home[v] = sharding
                future.set_result(compiled)
            except Exception as e:  # the step runs the jitted function instead
                future.set_exception(e)
                for v in seg.outputs:
                    home.setdefault(v, None)

    def run(self, index: int, inputs: Sequence[Any]) -> Any:
        """Segment `index` on `inputs` (placed on its mesh)."""
        future = self._compiled.get(index)
        if future is not None and index not in self._jitted:
            try:
                compiled = future.result()
            except Exception:
                compiled = None
            if compiled is not None:
                try:
                    return compiled(*inputs)
                except ValueError as e:
                    if _MISMATCH not in str(e):
                        raise
            self._jitted.add(index)
        return segment_function(self.graph.segments[index].jaxpr, self._donate[index])(*inputs)
