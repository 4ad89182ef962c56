"""What each executable of a stage is compiled for (`StageCompiler`'s part that gives, per
executable name, its function, example arguments laid out as planned, output shardings and
donated arguments; see [Note: stage executables] in `_compile.py`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxreshard.frontend._backward import StageBackward
from jaxreshard.runtime.step._programs import base_name, starts_from_zero
from jaxreshard.runtime.step._specs import spec_of


class StageSpecs:
    """The example arguments and out shardings of a stage's executables (a mixin of
    `StageCompiler`, which sets up the attributes below and gives the methods)."""

    bw: StageBackward
    mesh: Mesh
    exec_mesh: Mesh
    reduced: tuple[str, ...]
    input_shardings: list[NamedSharding]
    acc_shardings: list[NamedSharding]
    act_grad_shardings: list[NamedSharding]
    residual_specs: list[P] | None
    loss_scale: float | None
    fans: Any
    _exports: list[NamedSharding] | None
    _extra_avals: list[Any]
    _extra_specs: list[P]
    _output_specs: list[P] | None = None

    compile_forward: Callable[[], Any]
    executable: Callable[..., Any]
    varying: Callable[[], Any]
    res_untaken: Callable[[Any], Any]
    _split: Callable[..., Any]
    _donated: Callable[..., Any]
    _untaken: Callable[..., Any]

    def _sharded(self, avals: Sequence[Any], specs: Sequence[P]) -> list[jax.ShapeDtypeStruct]:
        return [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(self.exec_mesh, sp))
            for a, sp in zip(avals, specs)
        ]

    # Planning: what each executable takes ------------------------------------------------------

    def _residuals(self) -> list[jax.ShapeDtypeStruct]:
        if self.residual_specs is None:
            self.compile_forward()
        if self.reduced:  # typed as traced (a parameter kept for the backward is `reduced`)
            return list(self.bw.residuals)
        return self._sharded(self.bw.residuals, self.residual_specs or [])

    def _cotangents(self) -> list[jax.ShapeDtypeStruct]:
        if self.loss_scale is not None:  # the last stage: the loss's cotangent is a constant
            return []
        if self._output_specs is None:
            self.compile_forward()
        specs = self._output_specs or []
        outs = self.bw.stage.jaxpr.out_avals
        structs: list[jax.ShapeDtypeStruct] = []
        for i in self.bw.float_outputs:
            structs += self._sharded([outs[i]] * self.fans[i], [specs[i]] * self.fans[i])
        return structs

    def _accumulators(self) -> list[jax.ShapeDtypeStruct]:
        avals = [self.bw.stage.jaxpr.in_avals[self.bw.diff[k]] for k in self.bw.param_grads]
        return [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(self.exec_mesh, sh.spec))
            for a, sh in zip(avals, self.acc_shardings)
        ]

    def _export_structs(self) -> list[jax.ShapeDtypeStruct]:
        if self.reduced:  # typed as traced, on the Explicit mesh
            avals = self.bw.b.out_avals[len(self.bw.act_grads) :]
            return [
                jax.ShapeDtypeStruct(
                    a.shape, a.dtype, sharding=NamedSharding(self.exec_mesh, a.sharding.spec)
                )
                for a in avals
            ]
        if self._exports is None:
            self._exports = list(self.executable("b_part").output_shardings[1])
        avals = self.bw.b.out_avals[len(self.bw.act_grads) :]
        return [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
            for a, sh in zip(avals, self._exports)
        ]

    def _extra_structs(self, shardings: Sequence[Any] | None = None) -> list[Any]:
        avals = self._extra_avals
        if shardings is None:
            shardings = [NamedSharding(self.exec_mesh, sp) for sp in self._extra_specs]
        elif self.reduced:  # traced on the Explicit copy of the stage's mesh, as the rest
            shardings = [
                NamedSharding(self.exec_mesh, sh.spec)
                if isinstance(sh, NamedSharding) and sh.mesh.devices.tolist()
                == self.mesh.devices.tolist() else sh
                for sh in shardings
            ]  # fmt: skip
        return [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh) for a, sh in zip(avals, shardings)
        ]

    def _spec(self, name: str, extra: Sequence[Any] | None = None) -> tuple[Any, tuple, Any, tuple]:
        """(function, example args, out_shardings, donated args) of executable `name`: a base
        name, with `/size` for a scan over micro-batches and `@0` for one that starts its
        accumulators at zero itself (`_programs.py`)."""
        base, size = base_name(name), int(name.split("/")[1].split("@")[0]) if "/" in name else 0
        fn, args, outs, donate = self._base_spec(base, size, extra)
        if not starts_from_zero(name):
            return fn, args, outs, donate
        avals = args[0]  # the accumulators' structs

        def from_zero(*rest: Any) -> Any:
            return fn([jax.numpy.zeros(a.shape, a.dtype) for a in avals], *rest)

        return from_zero, args[1:], outs, tuple(i - 1 for i in donate if i > 0)

    def _base_spec(
        self, name: str, size: int, extra: Sequence[Any] | None
    ) -> tuple[Any, tuple, Any, tuple]:
        fns, acc_out, act_out = (
            getattr(self, "fns", {}),
            self.acc_shardings,
            self.act_grad_shardings,
        )
        if name == "forward":
            structs = self._sharded(
                self.bw.stage.jaxpr.in_avals, [spec_of(x) for x in self.input_shardings]
            )
            return self._forward_computed, tuple(structs), None, ()
        if name == "reduce":
            params = [self.input_shardings[self.bw.diff[k]] for k in self.bw.param_grads]

            return self._reduced, (self._accumulators(),), params, (0,)
        if name == "zeros":
            avals = [st for st in self._accumulators()]

            def zeros() -> list[Any]:
                return [jax.numpy.zeros(a.shape, a.dtype) for a in avals]

            return zeros, (), acc_out, ()
        if name == "backward":
            args = (self._accumulators(), self._residuals(), self._cotangents())
            return fns["full"], args, (act_out, acc_out), (0,)
        if name == "b_part":
            return fns["b"], (self._residuals(), self._cotangents()), (act_out, None), ()
        if name == "w_part":
            args = (
                self._accumulators(),
                self._residuals(),
                self._cotangents(),
                self._export_structs(),
            )
            return fns["w"], args, acc_out, (0,)
        if name == "apply":
            extras = self._split(self._extra_structs(extra), name)
            res = self.res_untaken(self._residuals())
            if self.bw.w is None:
                args = (self._accumulators(), res, self._cotangents(), *extras)
                return self._apply_full, args, (act_out, None), self._donated(args, name)
            args = (self._accumulators(), res, self._cotangents(),
                    self._export_structs(), *extras)  # fmt: skip
            return self._apply_w, args, None, self._donated(args, name)
        inputs = self._sharded(
            self.bw.stage.jaxpr.in_avals, [spec_of(x) for x in self.input_shardings]
        )
        everything = range(len(inputs))
        if name == "fb":
            return self._fb, (self._accumulators(), inputs), (None, act_out, acc_out), (0,)
        if name == "fb_apply":
            extras = self._split(self._extra_structs(extra), name)
            args = (self._accumulators(), self._untaken(everything, inputs), *extras)
            return self._fb_apply, args, (None, act_out, None), self._donated(args, name)
        if name in ("fb_scan", "fb_scan_apply"):
            varying = self.varying()
            shared_at = [i for i in everything if not varying[i]]
            shared = [inputs[i] for i in shared_at]
            pieces = [[x for x, v in zip(inputs, varying) if v]] * size
            acts = [act_out] * size
            if name == "fb_scan_apply":
                extras = self._split(self._extra_structs(extra), name)
                args = (self._accumulators(), self._untaken(shared_at, shared), pieces, *extras)
                return self._fb_scan_apply, args, (None, acts, None), self._donated(args, name)
            args = (self._accumulators(), shared, pieces)
            return self._fb_scan, args, (None, acts, acc_out), (0,)
        raise KeyError(name)
