"""The one place that reaches into JAX internals.

Everything version-sensitive sits here so that a JAX upgrade touches one file.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

Slices = tuple[slice, ...]

# [Note: mesh axis types]
# JAX meshes have per-axis types: `Auto` (the compiler propagates shardings; the long-standing
# behaviour) and `Explicit` (shardings are part of array types, "sharding in types"). Defaults
# differ between constructors and releases: `Mesh(devices, names)` makes `Auto` axes,
# `jax.make_mesh` `Explicit` ones, and `AbstractMesh(shape, names)` made `Auto` axes up to jax
# 0.10 and makes `Explicit` ones since 0.11. A step must be traced under an abstract mesh with
# the same axis types as the concrete meshes its stages compile on, or JAX refuses the mismatch.
# So this library never relies on a default: every mesh it makes names its axis types.
AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


def axis_types(names: str | Sequence[str], num_axes: int) -> tuple[Any, ...]:
    """`AxisType`s from config names: one name for every axis, or one per axis."""
    names = (names,) * num_axes if isinstance(names, str) else tuple(names)
    return tuple(AXIS_TYPES[n] for n in names)


def axis_type_names(mesh: Any) -> tuple[str, ...]:
    """A mesh's axis types as config names (`auto` / `explicit`); `Manual` is refused."""
    types = getattr(mesh, "axis_types", None) or (AxisType.Auto,) * len(mesh.axis_names)
    by_type = {t: n for n, t in AXIS_TYPES.items()}
    out = []
    for name, t in zip(mesh.axis_names, types):
        if t not in by_type:
            raise ValueError(
                f"mesh axis {name!r} has axis type {t}; stage meshes take Auto or Explicit axes "
                "(Manual axes belong inside shard_map)"
            )
        out.append(by_type[t])
    return tuple(out)


def make_mesh(devices: Any, names: Sequence[str], types: str | Sequence[str] = "auto") -> Mesh:
    """`Mesh(devices, names)` with the axis types named by `types` (see `axis_types`)."""
    return Mesh(devices, tuple(names), axis_types=axis_types(types, len(names)))


def abstract_mesh(
    shape: Sequence[int], names: Sequence[str], types: str | Sequence[str] = "auto"
) -> Any:
    """`AbstractMesh(shape, names)` with the axis types named by `types`."""
    return AbstractMesh(tuple(shape), tuple(names), axis_types=axis_types(types, len(names)))


def named_sharding_indices(
    mesh_shape: Sequence[int],
    axis_names: Sequence[str],
    spec: PartitionSpec,
    shape: Sequence[int],
) -> tuple[Slices, ...]:
    """Return each mesh position's index into an array of `shape`, in row-major mesh order.

    This is exactly what `NamedSharding(mesh, spec).devices_indices_map(shape)` returns for a
    concrete mesh of that shape, computed without devices: JAX builds the HLO sharding from an
    abstract mesh and converts it to per-device indices. Shardings over devices that are not in
    this process (remote hosts, benchmark clusters) use it so that JAX stays the source of truth.
    """
    mesh = abstract_mesh(mesh_shape, axis_names)
    hlo = NamedSharding(mesh, spec)._to_xla_hlo_sharding(len(shape))
    from jax._src import op_shardings

    num_devices = int(np.prod(mesh_shape, dtype=np.int64))
    return tuple(op_shardings.op_sharding_to_indices(hlo, tuple(shape), num_devices))


def new_jaxpr(
    constvars: Sequence[Any],
    invars: Sequence[Any],
    outvars: Sequence[Any],
    eqns: Sequence[Any],
    name: str = "jaxreshard",
) -> Any:
    """A `jax.extend.core.Jaxpr` with its effects and a DebugInfo (JAX warns without one)."""
    from jax.extend import core as jc

    effects = frozenset().union(*(e.effects for e in eqns)) if eqns else frozenset()
    info = jc.DebugInfo("jaxreshard", name, tuple("" for _ in invars), tuple("" for _ in outvars))
    return jc.Jaxpr(list(constvars), list(invars), list(outvars), list(eqns), effects, info)


def source_location(eqn: Any) -> str:
    """`file:line (function)` of the user code an equation came from, or `?`."""
    try:
        from jax._src import source_info_util

        return source_info_util.summarize(eqn.source_info)
    except Exception:  # older or newer JAX: the location is a nicety
        return "?"


# [Note: trace meshes]
# `parallelize` traces a step once, under an abstract mesh with the stages' axis names (so that
# sharding constraints resolve), and compiles each stage later under its own concrete mesh. JAX
# records the trace's abstract mesh wherever a trace leaves types behind: every equation's
# context (`eqn.ctx`, which re-binding the equation re-enters), the avals of literals and of the
# variables of nested jaxprs (a `jit` call's outputs take them), and sharding params (the
# `reshard` that `jax.random.bernoulli` applies to its result). Where a primitive's
# sharding rule insists that all inputs share one mesh (`random_fold_in` and `threefry2x32`,
# which Flax's RNG streams and dropout reach), the trace's mesh (no device kind) then meets the
# stage's concrete mesh and JAX refuses. `for_stages` rewrites all of them to the empty mesh,
# which every rule accepts and which leaves the stage's own mesh in charge. Only meshes of `Auto`
# axes: with `Explicit` axes the trace's mesh is the stages' own (see [Note: mesh axis types]),
# and typing needs it.


def _strippable(mesh: Any) -> bool:
    types = getattr(mesh, "axis_types", ())
    return mesh is not None and not mesh.empty and all(t == AxisType.Auto for t in types)


def _empty_mesh() -> Any:
    return AbstractMesh((), (), axis_types=())


def _plain_aval(aval: Any) -> Any:
    sharding = getattr(aval, "sharding", None)
    if sharding is None or not _strippable(sharding.mesh):
        return aval
    spec = PartitionSpec(*([None] * len(aval.shape)))
    return aval.update(sharding=NamedSharding(_empty_mesh(), spec))


def _plain_literal(lit: Any) -> Any:
    from jax._src import core

    aval = _plain_aval(lit.aval)
    if aval is lit.aval:
        return lit
    val = lit.val
    try:
        from jax._src.literals import TypedNdArray

        if isinstance(val, TypedNdArray):
            val = TypedNdArray(np.asarray(val), aval)
    except ImportError:  # older JAX: literals hold plain values
        pass
    return core.Literal(val, aval)


def _plain_context(ctx: Any) -> Any:
    from jax._src import core

    if not _strippable(getattr(ctx, "cur_abstract_mesh", None)):
        return ctx
    try:
        metadata = ctx.xla_metadata
        return core.JaxprEqnContext._create(
            ctx.compute_type,
            ctx.threefry_partitionable,
            _empty_mesh(),
            ctx.remove_size_one_mesh_axis,
            None if metadata is None else tuple(sorted(metadata.items())),
        )
    except (AttributeError, TypeError):  # another JAX: keep the context (the rest still helps)
        return ctx


def _plain_params(params: dict[str, Any]) -> dict[str, Any]:
    """Sharding params on the trace's mesh (`reshard`'s `dst_sharding`) with no axes named in
    their spec, moved to the empty mesh."""
    out = dict(params)
    for k, v in params.items():
        if (
            isinstance(v, NamedSharding)
            and isinstance(v.mesh, AbstractMesh)
            and _strippable(v.mesh)
            and all(entry is None for entry in v.spec)
        ):
            out[k] = NamedSharding(_empty_mesh(), v.spec)
    return out


def map_subjaxprs(params: dict[str, Any], fn: Any) -> dict[str, Any]:
    """`params` with every jaxpr in them (closed, open, or in tuples) replaced by `fn(jaxpr)`."""
    from jax.extend import core as jc

    def one(value: Any) -> Any:
        if isinstance(value, jc.ClosedJaxpr):
            return jc.ClosedJaxpr(fn(value.jaxpr), value.consts)
        if isinstance(value, jc.Jaxpr):
            return fn(value)
        if isinstance(value, (tuple, list)) and any(
            isinstance(v, (jc.ClosedJaxpr, jc.Jaxpr)) for v in value
        ):
            return type(value)(one(v) for v in value)
        return value

    return {k: one(v) for k, v in params.items()}


def for_stages(jaxpr: Any) -> Any:
    """`jaxpr` (open, nested jaxprs included) without the trace's abstract mesh in its
    equations' contexts, literals and variables (see [Note: trace meshes])."""
    from jax._src import core

    memo: dict[int, Any] = {}

    def rewrite(original: Any) -> Any:
        if id(original) in memo:
            return memo[id(original)]
        env: dict[Any, Any] = {}

        def define(v: Any) -> Any:
            aval = _plain_aval(v.aval)
            if aval is v.aval:
                new = v
            elif isinstance(v, core.DropVar):
                new = core.DropVar(aval)
            else:
                new = core.Var(aval)
            env[v] = new
            return new

        def read(a: Any) -> Any:
            if isinstance(a, core.Literal):
                return _plain_literal(a)
            return env[a] if a in env else define(a)

        constvars = [define(v) for v in original.constvars]
        invars = [define(v) for v in original.invars]
        eqns = []
        for eqn in original.eqns:
            eqns.append(
                eqn.replace(
                    invars=[read(a) for a in eqn.invars],
                    outvars=[define(v) for v in eqn.outvars],
                    params=_plain_params(map_subjaxprs(eqn.params, rewrite)),
                    ctx=_plain_context(eqn.ctx),
                )
            )
        outvars = [read(a) for a in original.outvars]
        new = original.replace(constvars=constvars, invars=invars, outvars=outvars, eqns=eqns)
        memo[id(original)] = new
        return new

    return rewrite(jaxpr)


def bind_equation(eqn: Any, values: Sequence[Any], mesh: Any = None) -> list[Any]:
    """Bind `eqn`'s primitive to `values` as `jax.core.eval_jaxpr` does (its source location
    and context kept); return the outputs as a list. `mesh`: an abstract mesh to trace under,
    over the one the equation's context names (newer JAX keeps the step's mesh there)."""
    from jax._src import source_info_util

    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: tuple[Any, ...] = ()
    if isinstance(params, tuple):  # older JAX: (subfuns, params)
        subfuns, params = params
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    traceback = eqn.source_info.traceback
    typed = on_abstract_mesh(mesh)
    with source_info_util.user_context(traceback, name_stack=name_stack), eqn.ctx.manager, typed:
        out = eqn.primitive.bind(*subfuns, *values, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def threefry_partitionable(eqn: Any) -> bool:
    """Whether `eqn` was traced with JAX's partitionable threefry (see [Note: random draws])."""
    value = getattr(getattr(eqn, "ctx", None), "threefry_partitionable", None)
    if value is None:
        import jax

        value = jax.config.jax_threefry_partitionable
    return bool(value)


def source_files(eqn: Any) -> list[str]:
    """The file names of every frame of the Python stack that made `eqn` (innermost first)."""
    try:
        return [frame.file_name for frame in eqn.source_info.traceback.frames]
    except Exception:  # another JAX: callers treat an empty stack as unknown
        return []


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """(number of consts, number of carries) of a `scan` equation: named params up to jax 0.11,
    a flat-tree `ft_in` of (consts, carries, xs) since jax 0.12."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def shard_for_shard(src: NamedSharding, dst: NamedSharding, shape: Sequence[int]) -> bool:
    """Whether moving an array of `shape` from `src` to `dst` is one whole-shard copy per
    device: the k-th device of `src`'s mesh holds exactly what the k-th of `dst`'s must."""
    if src.mesh.devices.shape != dst.mesh.devices.shape:
        return False
    a, b = src.devices_indices_map(tuple(shape)), dst.devices_indices_map(tuple(shape))
    return all(
        a[x] == b[y] for x, y in zip(src.mesh.devices.flat, dst.mesh.devices.flat, strict=True)
    )


def copy_shards(x: Any, dst: NamedSharding) -> Any:
    """`x` moved shard for shard onto `dst`'s devices (see `shard_for_shard`), asynchronously.

    This is the copy `jax.device_put` makes between device sets, without its per-call Python
    checks (about 150 us each on a small CPU box; this takes about 15 us): jaxlib's batched
    copy, where this JAX has it."""
    copy, semantics, device_list = _batched_copy()
    if copy is None:
        import jax

        return jax.device_put(x, dst)
    return copy([x], [device_list(tuple(dst.mesh.devices.flat))], [dst], [semantics])[0]


@functools.cache
def _batched_copy() -> tuple[Any, Any, Any]:
    """jaxlib's batched copy, its reuse-input semantics and `DeviceList` (None first where
    this JAX lacks it); looked up once (a step makes a copy per boundary tensor)."""
    client = _xla_client()
    copy = getattr(client, "batched_copy_array_to_devices_with_sharding", None)
    if copy is None:
        return None, None, None
    return copy, client.ArrayCopySemantics.REUSE_INPUT, client.DeviceList


def _xla_client() -> Any:
    from jax._src.lib import xla_client

    return xla_client


def cpu_collectives_on(hostname: str) -> None:
    """Have this process's CPU client (made at its first computation, after
    `jax.distributed.initialize`) run cross-process collectives over gloo's TCP transport bound
    to `hostname`. JAX's own choice resolves the machine's host name, which on an emulated
    cluster (network namespaces of one machine) names an address the namespace does not have.
    See [Note: multi-host stages] in `runtime/ray/_pipeline.py`."""
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax

    def factory() -> Any:
        collectives = _jax.make_gloo_tcp_collectives(
            distributed_client=distributed.global_state.client, hostname=hostname
        )
        return xla_bridge.make_cpu_client(collectives=collectives)

    xla_bridge.register_backend_factory("cpu", factory, priority=0, fail_quietly=False)


def enable_recoverability() -> bool:
    """Let a multi-controller job go on when one of its processes dies (JAX otherwise ends
    every process once the dead one misses its heartbeats); False where this JAX lacks it."""
    import jax

    try:
        jax.config.update("jax_enable_recoverability", True)
    except (AttributeError, KeyError, ValueError):
        return False
    return True


@functools.lru_cache(maxsize=4096)  # (asked for every output of every step)
def on_another_grid(sharding: NamedSharding, mesh: Any) -> bool:
    """Whether `sharding` lays its array out over `mesh`'s devices arranged in a grid of
    another shape (its spec then names that grid's axes, not `mesh`'s). Not an Explicit or
    otherwise typed copy of `mesh` (same grid), nor an unreduced or reduced value."""
    spec = sharding.spec
    if getattr(spec, "unreduced", None) or getattr(spec, "reduced", None):
        return False
    other = sharding.mesh
    return (
        isinstance(other, Mesh)
        and isinstance(mesh, Mesh)
        and other.devices.shape != mesh.devices.shape
        and sharding.device_set == set(mesh.devices.flat)
    )


def _read_layout(sharding: NamedSharding, mesh: Any, ndim: int) -> NamedSharding | None:
    """A NamedSharding over another grid of `mesh`'s devices, as one on `mesh` with the same
    layout; None where `mesh`'s axes cannot express it."""
    try:
        from jax._src.sharding_impls import GSPMDSharding

        hlo = sharding._to_xla_hlo_sharding(ndim)
        gspmd = GSPMDSharding(sharding._device_assignment, hlo, memory_kind=sharding.memory_kind)
    except Exception:  # (another JAX)
        return None
    return named_sharding_on(gspmd, mesh, ndim)


@functools.lru_cache(maxsize=4096)  # (shardings and meshes hash; outputs repeat every step)
def named_sharding_on(sharding: Any, mesh: Any, ndim: int) -> NamedSharding | None:
    """`sharding` as a NamedSharding over `mesh`'s devices: itself if it is one; a GSPMD
    sharding (what XLA gives an output whose layout does not match an input's, e.g. tiles in
    a transposed device order) parsed into a PartitionSpec of `mesh`'s axes, for arrays of
    `ndim` dims; None if it is over other devices or cannot be read so."""
    if isinstance(sharding, NamedSharding):
        if not on_another_grid(sharding, mesh):
            return sharding
        # Over another grid of `mesh`'s devices (a stage of a mixed layout runs a program traced
        # under the first stage's mesh shape): its spec names that grid's axes, so read its
        # layout instead, as XLA's (`P('data')` over a (2, 1) grid is `P('model')` on (1, 2)).
        # Where the stage mesh's axes cannot express it (a 2-way split of a (4, 1) grid read
        # on a (2, 2) one, say), it is kept as it is, as before.
        read = _read_layout(sharding, mesh, ndim)
        return read if read is not None else sharding
    if sharding.device_set != set(mesh.devices.flat):
        return None
    if sharding.is_fully_replicated:  # (a SingleDeviceSharding on a 1-device mesh, say)
        return NamedSharding(mesh, PartitionSpec())
    if not hasattr(sharding, "_hlo_sharding"):
        return None
    from jax._src import sharding_impls

    try:
        named = sharding_impls._gspmd_to_named_sharding_via_mesh(sharding, mesh)
    except Exception:  # a tiling the mesh's axes cannot express
        return None
    return named if named.is_equivalent_to(sharding, ndim) else None


def _indivisible_error() -> type[Exception]:
    try:
        from jax._src.sharding import IndivisibleError
    except ImportError:  # (another JAX: nothing to tell apart)
        return ValueError
    return IndivisibleError


# What jax >= 0.12 raises while compiling when it reads an output sharding XLA chose against the
# trace's abstract mesh of another shape (see `StageCompiler.executable`).
IndivisibleError = _indivisible_error()


def plain_array_types() -> frozenset[type]:
    """The types whose leaves are arrays for sure: JAX's array (its `jax.Array` check is an
    abstract-class test, slow to ask at every leaf of every call) and numpy's."""
    from jax._src.array import ArrayImpl

    return frozenset({ArrayImpl, np.ndarray})


def on_abstract_mesh(mesh: Any) -> Any:
    """A context that traces under `mesh` (an abstract mesh: typed with its axes); no change
    for None."""
    import contextlib

    import jax

    return contextlib.nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(mesh)
