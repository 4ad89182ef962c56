"""The post-gradient segments (the optimizer), compiled before the first step.

[Note: segment executables]
A segment's inputs come from several places: parameters and their gradients (on their stage's
mesh, with the layout's specs), the step's other arguments (optimizer state, as the caller passes
it), the loss and aux outputs, and earlier segments' outputs; the runtime moves each onto the
segment's mesh (`on_mesh`: kept where it already is, else with its spec where that fits, else
replicated). Those shardings are known before the first step, so `SegmentExecutables.warm`
compiles every segment of a process's stages ahead of it (earlier segments first: their outputs'
shardings are later ones' inputs): locally in a background thread beside the stages' compiles, in
a Ray host when it takes the layout. A call whose inputs turn out
laid out otherwise (an optimizer state the caller placed differently) runs the segment's jitted
function instead, which compiles for what it gets. In a layout of mixed mesh shapes the step
is traced under the first stage's shape, and XLA can give a segment's outputs over that grid of
the stage's devices; read by axis name on the stage's mesh, that layout was another one, and the
segment compiled again in the second step (and so did the whole pipeline). Such outputs are
expressed on the stage's own mesh by their physical layout (`_outputs_on`, and `as_named` for
the jitted path).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import jax
from jax.extend import core as jc
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxreshard._jax_compat import named_sharding_on, on_another_grid
from jaxreshard.frontend._split import StepGraph
from jaxreshard.runtime.step._around import donated, quiet_donation
from jaxreshard.runtime.step._compile import _MISMATCH
from jaxreshard.runtime.step._specs import spec_of, transplant_spec


def placed(spec: Any, aval: Any, mesh: Any) -> NamedSharding:
    """The sharding `on_mesh` gives a value of `aval` laid out with `spec` (None: host data)
    on `mesh`: the spec where it fits, else replicated."""
    return NamedSharding(mesh, transplant_spec(spec, dict(mesh.shape), aval.shape))


def _outputs_on(mesh: Any, compiled: Any, fun: Any, donate: Any, structs: Any) -> Any:
    """`compiled`, or compiled again with its outputs expressed on `mesh` where XLA gave them
    over another grid of its devices (a stage of a mixed layout: the step was traced under the
    first stage's mesh shape). The layouts are the same (`named_sharding_on` reads them
    physically, so donated buffers still alias); the outputs then need no conversion in every
    step (`as_named`), and the next step's arguments carry the stage's own specs."""
    outs = list(compiled.output_shardings)
    fixed = [
        named_sharding_on(sh, mesh, len(struct.shape))
        if isinstance(sh, NamedSharding) and on_another_grid(sh, mesh)
        else sh
        for sh, struct in zip(outs, jax.tree.leaves(compiled.out_info))
    ]
    fixed = [f if f is not None else sh for f, sh in zip(fixed, outs)]
    if all(a is b for a, b in zip(fixed, outs)):
        return compiled
    try:
        return jax.jit(fun, donate_argnums=donate, out_shardings=fixed).lower(*structs).compile()
    except Exception:  # (as XLA gave them: `as_named` converts them each step)
        return compiled


class SegmentExecutables:
    """Each post segment of a step: an executable compiled ahead for the expected input
    shardings, or its jitted function (see [Note: segment executables])."""

    def __init__(self, graph: StepGraph):
        self.graph = graph
        self._donate = {j: donated(graph, j) for j in range(len(graph.segments))}
        self._compiled: dict[int, Future] = {}
        self._jitted: dict[int, Any] = {}  # segments whose inputs came laid out otherwise
        self._lock = threading.Lock()

    def warm(
        self,
        meshes: Mapping[int, Any],
        param_specs: Sequence[P],
        leaf_specs: Sequence[P | None],
        only: set[int],
    ) -> None:
        """Compile segments `only` (those that run in this process, on `meshes`, by stage)
        for the shardings their inputs will have at the first step: parameters and gradients
        with `param_specs`, the step's other arguments with `leaf_specs` (None: host data),
        earlier segments' outputs as XLA lays them out."""
        g = self.graph
        futures = {j: Future() for j in sorted(only)}
        if not futures:
            return
        with self._lock:
            self._compiled.update(futures)
        invars = g.outer.jaxpr.invars
        home: dict[Any, P | None] = dict(zip(invars, leaf_specs))
        for k, i in enumerate(g.params):
            home[invars[i]] = home[g.grad_outputs[1 + k]] = param_specs[k]
        if g.grad_outputs:
            home[g.grad_outputs[0]] = P()
        for j, seg in enumerate(g.segments):
            future = futures.get(j)
            if future is None or seg.stage not in meshes:
                for v in seg.outputs:  # (run elsewhere: it arrives as its producer left it)
                    home.setdefault(v, None)
                continue
            mesh = meshes[seg.stage]
            try:
                structs = [
                    jax.ShapeDtypeStruct(
                        v.aval.shape, v.aval.dtype, sharding=placed(home.get(v), v.aval, mesh)
                    )
                    for v in seg.inputs
                ]
                fun, donate = jc.jaxpr_as_fun(seg.jaxpr), self._donate[j]
                with quiet_donation():
                    compiled = jax.jit(fun, donate_argnums=donate).lower(*structs).compile()
                    compiled = _outputs_on(mesh, compiled, fun, donate, structs)
                for v, sharding in zip(seg.outputs, compiled.output_shardings):
                    home[v] = spec_of(sharding)
                future.set_result(compiled)
            except Exception as e:  # the step runs the jitted function instead
                future.set_exception(e)
                for v in seg.outputs:
                    home.setdefault(v, None)

    def compiled_in_steps(self) -> list[int]:
        """The segments that compiled when they ran (inputs laid out otherwise than expected)."""
        return sorted(self._jitted)

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
        fn = self._jitted.get(index)
        if fn is None:  # jitted for this pipeline: its executables go with it
            jaxpr = self.graph.segments[index].jaxpr
            fn = jax.jit(jc.jaxpr_as_fun(jaxpr), donate_argnums=self._donate[index])
            self._jitted[index] = fn
        with quiet_donation():  # (it traces at its first call)
            return fn(*inputs)
