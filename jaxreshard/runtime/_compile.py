"""Compiling one stage of a cut step on its mesh (see [Note: pipeline execution])."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jc
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxreshard.frontend._backward import StageBackward
from jaxreshard.frontend._split import ACT, PARAM, StepGraph
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime._specs import spec_of


def fan_in(graph: StepGraph, s: int) -> list[int]:
    """Per output of stage s: how many cotangents come back (one per consuming stage)."""
    by_id = {a.id: a for a in graph.loss.activations}
    return [
        len(by_id[r.index].consumers) if r.kind == ACT else 1 for r in graph.loss.stages[s].outputs
    ]


class StageCompiler:
    """Compiles stage `s` of a step on `mesh` (in the process that owns the mesh's devices)."""

    def __init__(self, graph: StepGraph, bw: StageBackward, mesh: Mesh, config: PipelineConfig):
        self.graph, self.bw, self.mesh, self.config = graph, bw, mesh, config
        self.s = bw.stage.index
        self.forward: Any = None
        self.backward: Any = None
        self.b_part: Any = None
        self.w_part: Any = None
        self.input_shardings: list[NamedSharding] = []
        self.acc_shardings: list[NamedSharding] = []
        self.act_grad_shardings: list[NamedSharding] = []
        self._variants: dict[str, Any] = {}
        self._mb_index: list[Any] = []

    def mb_index(self, mb: int) -> Any:
        """Micro-batch `mb`'s index as the stage reads it (see [Note: random draws]): an int32
        scalar on the stage's mesh, made once per micro-batch."""
        while len(self._mb_index) <= mb:
            index = np.int32(len(self._mb_index))
            self._mb_index.append(jax.device_put(index, NamedSharding(self.mesh, P())))
        return self._mb_index[mb]

    def _sharded(self, avals: Sequence[Any], specs: Sequence[P]) -> list[jax.ShapeDtypeStruct]:
        return [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(self.mesh, sp))
            for a, sp in zip(avals, specs)
        ]

    def compile_forward(self, input_specs: Sequence[P]) -> tuple[list[P], list[P]]:
        """Compile the forward; return the specs of its outputs and of its residuals."""
        structs = self._sharded(self.bw.stage.jaxpr.in_avals, input_specs)
        self.input_shardings = [st.sharding for st in structs]
        with jax.set_mesh(self.mesh):
            self.forward = jax.jit(self.bw.forward).lower(*structs).compile()
        outs, res = self.forward.output_shardings
        return [spec_of(x) for x in outs], [spec_of(x) for x in res]

    def compile_backward(
        self, residual_specs: Sequence[P], output_specs: Sequence[P], loss_scale: float | None
    ) -> list[P]:
        """Compile the backward; return the specs of the activation gradients it sends back."""
        bw, stage = self.bw, self.bw.stage
        fans = fan_in(self.graph, self.s)
        res = self._sharded(bw.residuals, residual_specs)
        cts: list[jax.ShapeDtypeStruct] = []
        for i in () if loss_scale is not None else bw.float_outputs:
            aval = stage.jaxpr.out_avals[i]
            cts += self._sharded([aval] * fans[i], [output_specs[i]] * fans[i])
        acc_avals = [stage.jaxpr.in_avals[bw.diff[k]] for k in bw.param_grads]
        acc = [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.input_shardings[bw.diff[k]])
            for a, k in zip(acc_avals, bw.param_grads)
        ]
        self.acc_shardings = [st.sharding for st in acc]
        # An activation's gradient leaves with the activation's own sharding, the same in every
        # executable variant: each transfer is planned once for one source sharding.
        self.act_grad_shardings = [self.input_shardings[bw.diff[k]] for k in bw.act_grads]
        fns = self.fns = backward_functions(bw, fans, loss_scale)
        # Two variants each: the first micro-batch's gradients become the accumulators (no
        # zeros to fill and add to), the later ones are added to them in place.
        outs = (self.act_grad_shardings, self.acc_shardings)
        with jax.set_mesh(self.mesh):
            if bw.w is None:
                self.backward_first = (
                    jax.jit(fns["full_first"], out_shardings=outs).lower(res, cts).compile()
                )
                self.backward = (
                    jax.jit(fns["full"], donate_argnums=(0,), out_shardings=outs)
                    .lower(acc, res, cts)
                    .compile()
                )
                act_out = self.act_grad_shardings
            else:
                self.b_part = (
                    jax.jit(fns["b"], out_shardings=(self.act_grad_shardings, None))
                    .lower(res, cts)
                    .compile()
                )
                act_out = self.act_grad_shardings
                export_sh = self.b_part.output_shardings[1]
                exports = [
                    jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
                    for a, sh in zip(bw.b.out_avals[len(bw.act_grads) :], export_sh)
                ]
                self.w_first = (
                    jax.jit(fns["w_first"], out_shardings=self.acc_shardings)
                    .lower(res, cts, exports)
                    .compile()
                )
                self.w_part = (
                    jax.jit(fns["w"], donate_argnums=(0,), out_shardings=self.acc_shardings)
                    .lower(acc, res, cts, exports)
                    .compile()
                )
        return [spec_of(x) for x in act_out]

    def set_apply(self, segment: Any, grad_sources: Sequence[int | None]) -> None:
        """Fuse a post-gradient segment into this stage's last backward (see
        [Note: pipeline execution]): the segment reads the final gradients (input i is the
        accumulator of parameter `grad_sources[i]`, or, for None, the next of the caller's
        extra inputs) as they are computed, without writing them out first."""
        fns, apply = self.fns, jc.jaxpr_as_fun(segment)
        slots = [self.acc_params.index(k) if k is not None else None for k in grad_sources]

        def update(grads: Sequence[Any], extra: Sequence[Any]) -> list[Any]:
            rest = iter(extra)
            return apply(*[grads[k] if k is not None else next(rest) for k in slots])

        self._update = update

        if self.bw.w is None:

            def first(res, cts, extra):
                acts, grads = fns["full_first"](res, cts)
                return acts, update(grads, extra)

            def later(acc, res, cts, extra):
                acts, grads = fns["full"](acc, res, cts)
                return acts, update(grads, extra)
        else:

            def first(res, cts, exports, extra):
                return update(fns["w_first"](res, cts, exports), extra)

            def later(acc, res, cts, exports, extra):
                return update(fns["w"](acc, res, cts, exports), extra)

        if self.bw.w is None:  # the activation gradients keep their planned sharding
            outs: Any = (self.act_grad_shardings, None)
            self.apply_first = jax.jit(first, out_shardings=outs)
            self.apply_later = jax.jit(later, donate_argnums=(0,), out_shardings=outs)
        else:
            self.apply_first = jax.jit(first)
            self.apply_later = jax.jit(later, donate_argnums=(0,))
        self.fused = True

    fused = False

    # The last stage's forward and whole backward as one executable (see `StageProgram`): its
    # outputs (the loss, aux outputs), the activation gradients and the accumulators (or the
    # fused optimizer's outputs).

    def _forward_backward(self, args: Sequence[Any]) -> tuple[list[Any], list[Any], list[Any]]:
        outs, res = self.bw.forward(*args)
        acts, grads = self.fns["full_first"](res, [])
        return outs, acts, grads

    def fb_first(self, args: Sequence[Any]) -> Any:
        return self._lazy("fb_first", self._forward_backward, (), True)(args)

    def fb_later(self, acc: Sequence[Any], args: Sequence[Any]) -> Any:
        def later(acc, args):
            loss, acts, grads = self._forward_backward(args)
            return loss, acts, [a + g for a, g in zip(acc, grads)]

        return self._lazy("fb_later", later, (0,), True)(acc, args)

    def fb_apply_first(self, args: Sequence[Any], extra: Sequence[Any]) -> Any:
        def first(args, extra):
            loss, acts, grads = self._forward_backward(args)
            return loss, acts, self._update(grads, extra)

        return self._lazy("fb_apply_first", first, (), False)(args, extra)

    def fb_apply_later(self, acc: Sequence[Any], args: Sequence[Any], extra: Sequence[Any]) -> Any:
        def later(acc, args, extra):
            loss, acts, grads = self._forward_backward(args)
            return loss, acts, self._update([a + g for a, g in zip(acc, grads)], extra)

        return self._lazy("fb_apply_later", later, (0,), False)(acc, args, extra)

    def _lazy(
        self, name: str, fn: Callable[..., Any], donate: tuple[int, ...], accumulate: bool
    ) -> Callable[..., Any]:
        """`fn` jitted with the planned output shardings, compiled under the stage's mesh at
        its first call (only the variants a program uses get compiled)."""
        compiled = self._variants.get(name)
        if compiled is None:
            outs = (None, self.act_grad_shardings, self.acc_shardings if accumulate else None)
            jitted = jax.jit(fn, donate_argnums=donate, out_shardings=outs)

            def first_call(*args: Any) -> Any:
                with jax.set_mesh(self.mesh):
                    executable = jitted.lower(*args).compile()
                self._variants[name] = executable
                return executable(*args)

            return first_call
        return compiled

    @property
    def acc_params(self) -> list[int]:
        return [self.bw.stage.inputs[self.bw.diff[k]].index for k in self.bw.param_grads]


def backward_functions(
    bw: StageBackward, fans: list[int], loss_scale: float | None
) -> dict[str, Callable[..., Any]]:
    """The jit-able backward functions of a stage: cotangents summed per output; the last
    stage's loss cotangent is the constant `loss_scale`."""

    def cotangents(ct_lists: Sequence[Any]) -> list[Any]:
        if loss_scale is not None:
            aval = bw.stage.jaxpr.out_avals[0]
            return [jax.numpy.full(aval.shape, loss_scale, aval.dtype)]
        out, at = [], 0
        for i in bw.float_outputs:
            parts = ct_lists[at : at + fans[i]]
            at += fans[i]
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            out.append(total)
        return out

    def full_first(res: Sequence[Any], ct_lists: Sequence[Any]):
        grads = jc.jaxpr_as_fun(bw.full)(*res, *cotangents(ct_lists))
        return [grads[k] for k in bw.act_grads], [grads[k] for k in bw.param_grads]

    def full(acc: Sequence[Any], res: Sequence[Any], ct_lists: Sequence[Any]):
        acts, grads = full_first(res, ct_lists)
        return acts, [a + g for a, g in zip(acc, grads)]

    def b(res: Sequence[Any], ct_lists: Sequence[Any]):
        out = jc.jaxpr_as_fun(bw.b)(*res, *cotangents(ct_lists))
        return out[: len(bw.act_grads)], out[len(bw.act_grads) :]

    def w_first(res: Sequence[Any], ct_lists: Sequence[Any], exports: Sequence[Any]):
        return jc.jaxpr_as_fun(bw.w)(*res, *cotangents(ct_lists), *exports)

    def w(acc: Sequence[Any], res: Sequence[Any], ct_lists: Sequence[Any], exports: Sequence[Any]):
        return [a + g for a, g in zip(acc, w_first(res, ct_lists, exports))]

    return {"full": full, "full_first": full_first, "b": b, "w": w, "w_first": w_first}


def fusable_segments(graph: StepGraph, compilers: Mapping[int, StageCompiler]) -> dict[int, int]:
    """Post segments that can run inside their stage's last backward: stage -> segment index,
    for the stages of `compilers` (all of them locally, a host's own on Ray).

    A segment qualifies when it is its stage's only one, reads only that stage's own parameters,
    their gradients (which nothing else needs, not even the step's outputs) and the step's
    inputs, and the stage exchanges no shared parameter's gradient after its last backward.
    """
    by_stage: dict[int, list[int]] = {}
    for j, seg in enumerate(graph.segments):
        by_stage.setdefault(seg.stage, []).append(j)
    invars = graph.outer.jaxpr.invars
    param_owner = {invars[i]: graph.owner[k] for k, i in enumerate(graph.params)}
    grad_of = {v: k for k, v in enumerate(graph.grad_outputs[1:])}
    # Stages that exchange shared parameters' gradients after their last backward.
    exchanging = set()
    for k in range(len(graph.params)):
        others = {u for u in graph.loss.users(PARAM, k) if u != graph.owner[k]}
        if others:
            exchanging |= others | {graph.owner[k]}
    uses: dict[Any, int] = {}
    for seg in graph.segments:
        for v in seg.inputs:
            uses[v] = uses.get(v, 0) + 1
    returned = set(graph.outer.jaxpr.outvars)
    inputs_ok = set(invars) | set(graph.pre_outputs)
    fused = {}
    for s, (j, *others) in by_stage.items():
        seg = graph.segments[j]
        if others or s in exchanging or s not in compilers:
            continue
        grads = [v for v in seg.inputs if v in grad_of]
        ok = bool(grads)
        for v in seg.inputs:
            if v in grad_of:
                k = grad_of[v]
                ok &= (
                    graph.owner[k] == s
                    and k in compilers[s].acc_params
                    and uses.get(v) == 1
                    and v not in returned
                )
            elif v in param_owner:
                ok &= param_owner[v] == s
            else:
                ok &= v in inputs_ok and v not in set(graph.batch_vars)
        if ok:
            fused[s] = j
    return fused
