"""The functions a stage's executables trace (see [Note: stage executables] in `_compile.py`):
the backward variants with the optimizer fused in, the last stage's forward and backward at
once, and its scan over several micro-batches. `StageCompiler` compiles them; this mixin holds
what they compute, apart from how they are laid out and compiled."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.extend import core as jc
from jax.sharding import PartitionSpec as P

from jaxreshard.frontend._backward import StageBackward
from jaxreshard.frontend._split import CONST, PARAM
from jaxreshard.frontend._typed_eval import inlined_eval
from jaxreshard.frontend._typed_ops import plain
from jaxreshard.runtime.step._programs import base_name
from jaxreshard.runtime.step._specs import spec_of


class StageFunctions:
    """The traced functions of a stage's executables (a mixin of `StageCompiler`, which sets
    the attributes below)."""

    bw: StageBackward
    fns: dict[str, Any]
    fused: bool
    reduced: tuple[str, ...]
    unreduced: list[bool]
    input_shardings: list[Any]
    acc_params: list[int]
    _given: dict[str, list[bool]]
    _taken: dict[int, int]
    _res_place: dict[int, int]
    _extra_avals: list[Any]
    _extra_specs: list[P]

    # The optimizer inside the last backward ---------------------------------------------------

    def set_apply(
        self,
        segment: Any,
        grad_sources: Sequence[int | None],
        extra_specs: Sequence[P] = (),
        given: Sequence[bool] = (),
        read: Sequence[int | None] = (),
    ) -> None:
        """Fuse a post-gradient segment into this stage's last backward (see
        [Note: pipeline execution]): the segment reads the final gradients (input i is the
        accumulator of parameter `grad_sources[i]`, or, for None, the next of the caller's
        extra inputs, expected with `extra_specs`) as they are computed, without writing them
        out first. `given`: per extra input, whether the caller donated it (the executable may
        overwrite it: `parallelize(donate_argnums=...)`); `read`: the position among the
        stage's inputs of an extra input its forward reads too (a parameter), else None. The
        variants that run the forward (`fb_apply`, `fb_scan_apply`) take such a donated input
        once, as the optimizer's, and give it to the forward from there: one buffer, read by
        the forward and then overwritten by the update in the same program, as under
        `jax.jit` (passing it twice would forbid donating it: measured on an MLP 4x1024 on
        CPU, 8% of the step)."""
        apply = jc.jaxpr_as_fun(segment)
        slots = [self.acc_params.index(k) if k is not None else None for k in grad_sources]
        self._extra_avals = [v for v, k in zip(segment.in_avals, grad_sources) if k is None]
        self._extra_specs = list(extra_specs) or [P()] * len(self._extra_avals)
        n = len(self._extra_avals)
        given, read = list(given) or [False] * n, list(read) or [None] * n
        # The variants that run the forward take a donated parameter once (`_taken`); another
        # donated input the forward reads too (a per-step constant) they keep, as XLA refuses a
        # buffer donated and read by one call.
        kinds = [r.kind for r in self.bw.stage.inputs]
        forward = [g and (i is None or kinds[i] == PARAM) for g, i in zip(given, read)]
        self._given = {"apply": given, "fb_apply": forward}
        # Stage input position -> its place among the donated extra inputs.
        donated = [i for i, g in zip(read, forward) if g]
        self._taken = {i: j for j, i in enumerate(donated) if i is not None}
        # Stage input position -> its place among `apply`'s donated inputs: such an input
        # kept as a residual is taken from them (see [Note: residuals kept by reference]).
        given_read = (i for i, g in zip(read, given) if g)
        self._res_place = {i: j for j, i in enumerate(given_read) if i is not None}

        typed = inlined_eval(segment)

        def update(grads: Sequence[Any], extra: Sequence[Any]) -> list[Any]:
            rest = iter(extra)
            args = [grads[k] if k is not None else next(rest) for k in slots]
            # On the Explicit copy of the mesh, each equation binds under it (the segment was
            # traced under the step's mesh, which newer JAX keeps in its equations).
            return (typed if self.reduced else apply)(*args)

        self._update = update
        self.fused = True

    def _untaken(self, positions: Sequence[int], values: Sequence[Any]) -> list[Any]:
        """`values` (stage inputs at `positions`) without those a fused variant takes from
        its donated optimizer inputs (`set_apply`)."""
        return [x for i, x in zip(positions, values) if i not in self._taken]

    def _retaken(self, positions: Sequence[int], values: Sequence[Any], given: Sequence[Any]):
        """The inverse of `_untaken`, inside the executable."""
        rest = iter(values)
        return [given[self._taken[i]] if i in self._taken else next(rest) for i in positions]

    def _flags(self, name: str, n: int) -> list[bool]:
        name = base_name(name)
        if name == "fb_scan_apply":  # runs the forward too, as `fb_apply` does
            name = "fb_apply"
        return self._given.get(name) or [False] * n

    def _split(self, extra: Sequence[Any], name: str) -> tuple[list[Any], list[Any]]:
        """The optimizer's other inputs as (kept, donated): separate arguments, so that only
        the donated ones are donated."""
        flags = self._flags(name, len(extra))
        return [x for x, g in zip(extra, flags) if not g], [x for x, g in zip(extra, flags) if g]

    def _merge(self, kept: Sequence[Any], given: Sequence[Any], name: str) -> list[Any]:
        kept_it, given_it = iter(kept), iter(given)
        flags = self._flags(name, len(kept) + len(given))
        return [next(given_it) if g else next(kept_it) for g in flags]

    def _donated(self, args: Sequence[Any], name: str) -> tuple[int, ...]:
        """The accumulators, and the donated optimizer inputs if there are any (the last
        argument)."""
        return (0, len(args) - 1) if any(self._flags(name, 0)) else (0,)

    def _reduced(self, acc: Sequence[Any]) -> list[Any]:
        """The accumulators summed over the batch axes they were kept unreduced over (see
        [Note: gradients reduced once]): the step's one all-reduce of them."""
        if not self.reduced:
            return list(acc)
        params = [self.input_shardings[self.bw.diff[k]] for k in self.bw.param_grads]
        return [
            jax.reshard(a, plain(spec_of(sh))) if keep else a
            for a, sh, keep in zip(acc, params, self.unreduced)
        ]

    def _apply(
        self, grads: Sequence[Any], kept: Sequence[Any], given: Sequence[Any], name: str = "apply"
    ) -> Any:
        """The fused optimizer segment on the final (reduced) gradients; `name`: the variant
        whose donation flags split its other inputs into `kept` and `given`."""
        return self._update(self._reduced(grads), self._merge(kept, given, name))

    @property
    def _res_taken(self) -> dict[int, int]:
        """Residual position -> its place among `apply`'s donated inputs, for a residual that
        is a donated input (of the stage's backward as it is now: plain or typed)."""
        forwarded = self.bw.forwarded or (None,) * len(self.bw.residuals)
        return {r: self._res_place[i] for r, i in enumerate(forwarded) if i in self._res_place}

    def res_untaken(self, res: Sequence[Any]) -> list[Any]:
        """`res` without the residuals `apply` takes from its donated inputs (`set_apply`)."""
        return [x for r, x in enumerate(res) if r not in self._res_taken]

    def _res_retaken(self, res: Sequence[Any], given: Sequence[Any]) -> list[Any]:
        """The inverse of `res_untaken`, inside the executable."""
        n = len(res) + len(self._res_taken)
        rest = iter(res)
        return [given[self._res_taken[r]] if r in self._res_taken else next(rest) for r in range(n)]

    def _apply_full(self, acc, res, cts, kept, given):
        acts, grads = self.fns["full"](acc, self._res_retaken(res, given), cts)
        return acts, self._apply(grads, kept, given)

    def _apply_w(self, acc, res, cts, exports, kept, given):
        res = self._res_retaken(res, given)
        return self._apply(self.fns["w"](acc, res, cts, exports), kept, given)

    def _forward_backward(self, args: Sequence[Any]) -> tuple[list[Any], list[Any], list[Any]]:
        outs, res = self.bw.forward(*args)
        acts, grads = self.fns["full_first"](res, [])
        return outs, acts, grads

    def _fb(self, acc, args):
        outs, acts, grads = self._forward_backward(args)
        return outs, acts, [a + g for a, g in zip(acc, grads)]

    def _fb_apply(self, acc, args, kept, given):
        args = self._retaken(range(len(self.bw.stage.inputs)), args, given)
        outs, acts, grads = self._fb(acc, args)
        return outs, acts, self._apply(grads, kept, given, "fb_apply")

    def varying(self) -> list[bool]:
        """Per stage input, whether it differs between micro-batches (a scan's `xs`) or not
        (parameters and per-step constants: passed once)."""
        return [r.kind not in (PARAM, CONST) for r in self.bw.stage.inputs]

    def _fb_scan(self, acc, shared, pieces):
        """The last stage's forward and backward over several micro-batches, as a `lax.scan`
        that accumulates the gradients in its carry: `pieces` has each micro-batch's varying
        inputs (`varying`), `shared` the others. Returns per micro-batch its outputs and
        activation gradients, and the accumulators."""
        varying = self.varying()
        xs = [jax.numpy.stack(column) for column in zip(*pieces)]

        def body(acc, piece):
            given, each = iter(shared), iter(piece)
            args = [next(each) if v else next(given) for v in varying]
            outs, acts, acc = self._fb(acc, args)
            return acc, (outs, acts)

        acc, (outs, acts) = jax.lax.scan(body, list(acc), xs)
        n = len(pieces)
        return (
            [[o[j] for o in outs] for j in range(n)],
            [[a[j] for a in acts] for j in range(n)],
            acc,
        )

    def _fb_scan_apply(self, acc, shared, pieces, kept, given):
        varying = self.varying()
        shared = self._retaken([i for i, v in enumerate(varying) if not v], shared, given)
        outs, acts, grads = self._fb_scan(acc, shared, pieces)
        return outs, acts, self._apply(grads, kept, given, "fb_apply")
