"""Compiling one stage of a cut step on its mesh (see [Note: pipeline execution])."""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxreshard._jax_compat import IndivisibleError, named_sharding_on
from jaxreshard._tracebacks import error_line
from jaxreshard.frontend._backward import StageBackward, derive_backward
from jaxreshard.frontend._split import PARAM, StepGraph
from jaxreshard.frontend._typed_ops import plain
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime.step._around import quiet_donation
from jaxreshard.runtime.step._backward import backward_functions, fan_in, stage_acc_params
from jaxreshard.runtime.step._executable_specs import StageSpecs
from jaxreshard.runtime.step._functions import StageFunctions
from jaxreshard.runtime.step._programs import FROM_ZERO, base_name, starts_from_zero
from jaxreshard.runtime.step._reduction import (
    describe,
    explicit_copy,
    reduction_axes,
    unreduced,
)
from jaxreshard.runtime.step._specs import place, spec_of

# The message of a compiled executable called with inputs laid out otherwise than it was compiled
# for (it checks before running, so nothing was donated yet).
_MISMATCH = "Computation was compiled for input shardings that disagree"


# [Note: stage executables]
# A stage runs a few executables, each compiled once for the shardings the layout planned:
#   forward(*inputs) -> (outputs, residuals)
#   zeros() -> gradient accumulators, zero (every step starts them so)
#   backward(acc, res, cts) -> (activation gradients, acc + parameter gradients)   (unsplit)
#   b_part(res, cts) -> (activation gradients, exports)                            (split: B)
#   w_part(acc, res, cts, exports) -> acc + parameter gradients                     (split: W)
#   apply(acc, res, cts[, exports], extra) -> the last backward (or W) and the stage's optimizer
#       segment at once, which reads the final gradients as they are computed (with one
#       micro-batch: see `fusable_segments`)
#   fb(acc, inputs) -> (outputs, activation gradients, acc)  (the last stage's F and B at once)
#   fb_apply(acc, inputs, extra) -> (outputs, activation gradients, optimizer outputs)
#   fb_scan/k(acc, shared, pieces) -> per micro-batch (outputs, activation gradients), acc:
#       the last stage's F and B of k micro-batches as one `lax.scan` whose carry is the
#       accumulators (a run of the program with nothing else between: `scan_groups`)
#   fb_scan_apply/k(acc, shared, pieces, extra) -> the same, then the optimizer segment
#   reduce(acc) -> the accumulators summed over the batch axes they were kept unreduced over
#       (after the step's last backward; see [Note: gradients reduced once]); a fused optimizer
#       variant reduces them itself before it updates
# A name ending in `@0` is the variant without `acc`: it computes all of its chunk's gradients
# of the step (one micro-batch, or a scan over all of them) and starts them at zero inside, so
# a one-stage pipeline's step is one program, as a hand-written scan under `jax.jit` is.
# A fused variant that runs the forward takes a parameter the caller donated once, as the
# optimizer's input, and gives it to the forward from there (`set_apply`).
#
# [Note: residuals kept by reference]
# Many residuals are the stage's own inputs, unchanged: the weights a matmul's input gradient
# reads, a received activation, a batch feed. An executable's outputs are new buffers, so a
# forward that returned them would copy every such weight once per micro-batch, and each
# micro-batch alive would hold its own copy (measured on CPU: returning four 1024x1024 f32
# weights made their forward 2.4x slower). So `forward` returns only the residuals it computes,
# and `residuals_of` puts the inputs themselves (the same arrays) where the others go
# (`StageBackward.forwarded` says which). A fused optimizer that overwrites a donated weight
# (`apply`) must not also read it as a residual argument, which XLA refuses: it takes those
# residuals from its donated inputs inside the program (`_res_taken`), as `fb_apply` does
# the forward's inputs.
#
# Accumulators start at zero rather than from the first micro-batch's gradients, so every
# backward has one variant (0 + g is g exactly). `used_variants` (`_executor.py`) reads from a
# rank's program which of them a step calls; those compile before the first step, in parallel
# (XLA compiles without holding the GIL), and the others (a profile's separate F and B of the
# last stage) at their first call. `apply` and `fb_apply` also take the optimizer's other inputs
# (its state), whose shardings are the caller's: they compile for the shardings expected at the
# first step (`extra_specs`), and again for any others they meet.


class StageCompiler(StageSpecs, StageFunctions):
    """Compiles stage `s` of a step on `mesh` (in the process that owns the mesh's devices);
    see [Note: stage executables]."""

    def __init__(self, graph: StepGraph, bw: StageBackward, mesh: Mesh, config: PipelineConfig):
        self.graph, self.bw, self.mesh, self.config = graph, bw, mesh, config
        self.s = bw.stage.index
        self.input_shardings: list[NamedSharding] = []
        self.acc_shardings: list[NamedSharding] = []
        self.act_grad_shardings: list[NamedSharding] = []
        self.residual_specs: list[P] | None = None
        self.loss_scale: float | None = None
        self.fused = False  # an optimizer segment runs inside the last backward (`set_apply`)
        self._ready: dict[Any, Any] = {}  # variant (and extra shardings) -> executable
        self._lock = threading.Lock()
        self._mb_index: list[Any] = []
        self._exports: list[NamedSharding] | None = None
        self._extra_avals: list[Any] = []
        self._extra_specs: list[P] = []
        # Per fused variant, per optimizer input of its segment: donated (see `set_apply`).
        self._given: dict[str, list[bool]] = {}
        # Stage input position -> its place among a fused variant's donated inputs (`set_apply`).
        self._taken: dict[int, int] = {}
        # Stage input position -> its place among `apply`'s donated inputs (`set_apply`).
        self._res_place: dict[int, int] = {}
        self.fans = fan_in(graph, self.s)
        # Where the executables are traced: the stage's mesh, or its all-Explicit copy when the
        # accumulators stay unreduced over `reduced` (see [Note: gradients reduced once]).
        self.exec_mesh = mesh
        self.reduced: tuple[str, ...] = ()
        self.reduction = ""  # how the stage reduces its gradients, for the plan
        self._plain_bw = bw

    def mb_index(self, mb: int) -> Any:
        """Micro-batch `mb`'s index as the stage reads it (see [Note: random draws]): an int32
        scalar on the stage's mesh, made once per micro-batch."""
        while len(self._mb_index) <= mb:
            index = np.int32(len(self._mb_index))
            self._mb_index.append(place(index, NamedSharding(self.mesh, P())))
        return self._mb_index[mb]

    def variant(self, name: str) -> str:
        """The executable that runs the program's call `name` on this stage: a stage keeping
        its accumulators unreduced starts them from its `zeros` executable (which types them)."""
        return name.removesuffix(FROM_ZERO) if self.reduced else name

    def prepare(self, input_specs: Sequence[P], loss_scale: float | None) -> str:
        """Take the stage's input specs (and, for the last stage, the loss's cotangent); return
        how the stage reduces its parameter gradients (see [Note: gradients reduced once])."""
        self.loss_scale = loss_scale
        self._use(self._plain_bw, self.mesh, (), frozenset(), input_specs)
        axes: tuple[str, ...] = ()
        params: frozenset[int] = frozenset()
        why = "the step computes no gradients"
        if self.bw.full is not None:
            axes, params, why = reduction_axes(
                self.graph, self.s, self.mesh, input_specs, self.config, self.acc_params
            )
        if axes:
            try:
                self._reduce_once(axes, params, input_specs)
            except Exception as e:  # JAX refused the typed trace: today's path
                self._use(self._plain_bw, self.mesh, (), frozenset(), input_specs)
                axes, why = (), f"JAX: {error_line(e)}"
        kept = len(self.acc_params) - len(params) if axes else 0
        self.reduction = describe(axes, why, kept)
        return self.reduction

    def _use(
        self,
        bw: StageBackward,
        exec_mesh: Mesh,
        reduced: tuple[str, ...],
        params: frozenset[int],
        specs: Sequence[P],
    ) -> None:
        """Compile from `bw` on `exec_mesh`, keeping the accumulators of `params` unreduced
        over `reduced`."""
        self.bw, self.exec_mesh, self.reduced = bw, exec_mesh, reduced
        self._ready.clear()
        self.residual_specs = self._output_specs = self._exports = None
        self.input_shardings = [NamedSharding(self.mesh, sp) for sp in specs]
        # Per accumulator, whether it stays unreduced until the step's `reduce`.
        self.unreduced = [bw.stage.inputs[bw.diff[k]].index in params for k in bw.param_grads]
        acc = [spec_of(self.input_shardings[bw.diff[k]]) for k in bw.param_grads]
        self.acc_shardings = [
            NamedSharding(exec_mesh, unreduced(sp, reduced))
            if keep
            else NamedSharding(self.mesh, sp)
            for sp, keep in zip(acc, self.unreduced)
        ]
        # An activation's gradient leaves with the activation's own sharding, the same in every
        # executable: each transfer is planned once for one source sharding.
        self.act_grad_shardings = [self.input_shardings[bw.diff[k]] for k in bw.act_grads]
        if bw.full is not None:
            self.fns = backward_functions(bw, self.fans, self.loss_scale)

    def _reduce_once(
        self, axes: tuple[str, ...], params: frozenset[int], specs: Sequence[P]
    ) -> None:
        """Derive the stage again typed on an Explicit copy of its mesh, the accumulators of
        `params` unreduced over `axes`, and trace every backward variant (so that JAX's
        refusals come now, while the stage can still take today's path)."""
        mesh = explicit_copy(self.mesh)
        shardings = [NamedSharding(mesh, sp) for sp in specs]
        stage = self.bw.stage
        cast = [i for i, r in enumerate(stage.inputs) if r.kind == PARAM and r.index in params]
        with jax.set_mesh(mesh):
            bw = derive_backward(
                stage,
                split=self.bw.w is not None,
                in_shardings=shardings,
                reduced=axes,
                reduced_inputs=cast,
            )
        self._use(bw, mesh, axes, params, specs)
        self.compile_forward()
        names = ["zeros", "reduce"]
        names += ["backward"] if bw.w is None else ["b_part", "w_part"]
        if self.loss_scale is not None:
            names.append("fb")
            if len(self.graph.loss.stages) == 1 and bw.w is None:  # a scan over micro-batches
                names.append("fb_scan_apply/2" if self.fused else "fb_scan/2")
        if self.fused:  # the optimizer reads the gradients reduced, in the same program
            names.append("apply")  # (a recorded step's, on the last stage too)
            if self.loss_scale is not None:
                names.append("fb_apply")
        for name in names:
            fn, args, out_shardings, donate = self._spec(name)
            with jax.set_mesh(mesh), quiet_donation():
                jax.jit(fn, donate_argnums=donate, out_shardings=out_shardings).lower(*args)

    def compile_forward(self) -> tuple[list[P], list[P]]:
        """Compile the forward; return the specs of its outputs and of its residuals (its
        outputs' cotangents come back with the outputs' specs)."""
        outs, res = self.executable("forward").output_shardings
        out_avals = self.bw.stage.jaxpr.out_avals
        self._output_specs = [self._spec_of(x, a) for x, a in zip(outs, out_avals)]
        if self.reduced:  # typed residuals (a `reduced` parameter among them) keep their type
            self.residual_specs = [  # (a residual JAX types on no mesh, `cond`'s index: whole)
                P() if r.sharding is None else plain(r.sharding.spec) for r in self.bw.residuals
            ]
        else:
            computed = iter(res)
            self.residual_specs = [
                spec_of(self.input_shardings[i])
                if i is not None
                else self._spec_of(next(computed), a)
                for a, i in zip(self.bw.residuals, self._forwarded)
            ]
        return list(self._output_specs), list(self.residual_specs)

    @property
    def _forwarded(self) -> tuple[int | None, ...]:
        return self.bw.forwarded or (None,) * len(self.bw.residuals)

    def _forward_computed(self, *inputs: Any) -> tuple[list[Any], list[Any]]:
        """The forward, returning only the residuals it computes (see [Note: residuals kept by
        reference])."""
        outs, res = self.bw.forward(*inputs)
        return outs, [r for r, i in zip(res, self._forwarded) if i is None]

    def residuals_of(self, inputs: Sequence[Any], computed: Sequence[Any]) -> list[Any]:
        """A micro-batch's residuals: what `forward` computed, and its own `inputs` where the
        residual is one of them."""
        rest = iter(computed)
        return [inputs[i] if i is not None else next(rest) for i in self._forwarded]

    def _spec_of(self, sharding: Any, aval: Any) -> P:
        """An output's spec on the stage mesh (XLA may give a GSPMD sharding)."""
        named = named_sharding_on(sharding, self.mesh, len(aval.shape))
        if named is None:
            raise ValueError(
                f"stage {self.s}: XLA laid an output of shape {aval.shape} out as {sharding}, "
                "which no PartitionSpec of the stage mesh expresses; this is a jaxreshard bug, "
                "please report it"
            )
        return spec_of(named)

    def act_grad_specs(self) -> list[P]:
        return [spec_of(sh) for sh in self.act_grad_shardings]

    # Compiling ------------------------------------------------------------------------------

    def executable(self, name: str, extra: Sequence[Any] | None = None) -> Any:
        """Executable `name`, compiled at its first use (see [Note: stage executables]);
        `extra`: the shardings of the optimizer inputs it takes (apply, fb_apply), if not the
        planned ones."""
        key = (name, None if extra is None else tuple(extra))
        found = self._ready.get(key)
        if found is not None:
            return found
        fn, args, out_shardings, donate = self._spec(name, extra)
        with jax.set_mesh(self.exec_mesh), quiet_donation():
            if self.reduced:
                out_shardings = self._on_stage_mesh(fn, args, out_shardings)
            jitted = jax.jit(fn, donate_argnums=donate, out_shardings=out_shardings)
            try:
                compiled = jitted.lower(*args).compile()
            except IndivisibleError:
                # jax >= 0.12 reads an output's XLA-chosen sharding against the abstract mesh
                # its value was traced under (the step's, of stage 0's shape) and refuses one
                # that mesh cannot express, though the stage's own mesh can. Outputs left to
                # XLA are then pinned replicated on the stage mesh: correct, and only where the
                # stage meshes differ in shape on that JAX.
                shapes = jax.eval_shape(fn, *args)
                pinned = _filled(out_shardings, shapes, NamedSharding(self.mesh, P()))
                jitted = jax.jit(fn, donate_argnums=donate, out_shardings=pinned)
                compiled = jitted.lower(*args).compile()
        with self._lock:
            return self._ready.setdefault(key, compiled)

    def _on_stage_mesh(self, fn: Any, args: Sequence[Any], out_shardings: Any) -> Any:
        """`out_shardings` with the outputs left to XLA pinned to their traced types, on the
        stage's own mesh (a typed trace decides them anyway): what leaves the executables is
        laid out as on the plain path. Unreduced outputs (the accumulators) stay as they are."""
        shapes = jax.eval_shape(fn, *args)

        def on_mesh(struct: Any) -> Any:
            sharding = struct.sharding
            if sharding is None:  # (JAX typed no sharding: XLA's choice, as on the plain path)
                return None
            spec = sharding.spec
            if spec.unreduced or spec.reduced:
                return sharding
            return NamedSharding(self.mesh, plain(spec))

        filled = jax.tree.map(on_mesh, shapes)
        if out_shardings is None:
            return filled
        return _merged(out_shardings, filled)

    def compile_variants(
        self, names: Sequence[str], extra_specs: Sequence[P] | None = None
    ) -> None:
        """Compile these executables now (the ones a step will call); `extra_specs`: the specs
        the fused optimizer's other inputs come with at the first step."""
        if extra_specs is not None:
            self._extra_specs = list(extra_specs)
        names = {self.variant(n) for n in names}
        if self.reduced:  # (a fused optimizer reduces in the last backward)
            names |= {"zeros"} if self.fused else {"reduce", "zeros"}
        first = ("forward", "b_part")  # the others take their output shardings
        for name in sorted(names, key=lambda n: first.index(n) if n in first else len(first)):
            self.executable(name)

    def call(self, name: str, *args: Any) -> Any:
        """Run executable `name` on `args` (the last of them the optimizer's other inputs, for
        apply and fb_apply: the executable planned for them runs them if they are laid out as
        planned, one compiled for their shardings if not)."""
        base = base_name(name)
        if base in ("apply", "fb_apply", "fb_scan_apply"):
            shardings = tuple(x.sharding for x in args[-1])
            given, args = args[-1], list(args[:-1])
            if base == "apply":  # ([acc,] res, ...): a donated weight among res goes once
                at = 0 if starts_from_zero(name) else 1
                args[at] = self.res_untaken(args[at])
            elif base == "fb_apply":  # (acc, inputs): the forward's donated inputs go once
                args[-1] = self._untaken(range(len(args[-1])), args[-1])
            elif base == "fb_scan_apply":  # (acc, shared, pieces)
                varying = self.varying()
                args[-2] = self._untaken([i for i, v in enumerate(varying) if not v], args[-2])
            args = (*args, *self._split(given, name))
            compiled = self._ready.get((name, shardings))
            if compiled is None:
                planned = self.executable(name)
                try:
                    out = planned(*args)
                except ValueError as e:
                    if _MISMATCH not in str(e):
                        raise
                    return self.executable(name, shardings)(*args)
                self._ready[(name, shardings)] = planned
                return out
            return compiled(*args)
        compiled = self._ready.get((name, None))
        if compiled is None:
            compiled = self.executable(name)
        return compiled(*args)

    @functools.cached_property
    def acc_params(self) -> list[int]:
        """The parameters whose gradients this stage accumulates, in accumulator order."""
        return stage_acc_params(self.graph, self.s)

    @functools.cached_property
    def acc_slot(self) -> dict[int, int]:
        """A parameter's position among the accumulators."""
        return {k: i for i, k in enumerate(self.acc_params)}


def _merged(out_shardings: Any, filled: Any) -> Any:
    """`out_shardings` (None for outputs left to XLA) with those outputs taken from `filled`."""
    if out_shardings is None:
        return filled
    if isinstance(out_shardings, (tuple, list)):
        return type(out_shardings)(_merged(o, f) for o, f in zip(out_shardings, filled))
    return out_shardings


def _filled(out_shardings: Any, shapes: Any, default: Any) -> Any:
    """`out_shardings` (None for outputs left to XLA) with those outputs given `default`."""
    if out_shardings is None:
        return jax.tree.map(lambda _: default, shapes)
    if isinstance(out_shardings, (tuple, list)):
        return type(out_shardings)(_filled(o, s, default) for o, s in zip(out_shardings, shapes))
    return out_shardings
