"""A stage's tensor-parallel work, for `partition="auto"` (see [Note: automatic partitioning]
in `_partition.py`): its compute per device and the collectives XLA adds over its model axes.

[Note: tensor-parallel stages in the partitioner]
A segment is timed on one device (`_segment_cost.py`), whole, and divided by the batch axis's
share of the micro-batch on the first mesh. On a mesh with other axes of more than one device
(a `model` axis splitting the parameters), each device computes a part, and XLA adds
collectives to put the parts together: activations summed or gathered over the model axis in
every layer, which cross the NIC in every micro-batch's forward and backward when that axis
spans hosts (measured: a U-Transformer's stage 0 with `model` across 2 hosts at 0.01 GB/s
took 343 ms a forward against 52 ms on a stage whose model axis stayed in its hosts). So, for
each mesh (`TensorParallel`):
1. Each segment's programs are compiled as the runtime runs them, once on one device and once
   on the mesh's model slice (its devices at the first position of the batch axis): the
   forward, from the segment's inputs to its outputs and its VJP's residuals; the whole
   backward and its input gradients alone (B), from those residuals and an output cotangent,
   laid out where the forward leaves them, the parameter gradients laid out as the parameters
   are (as the runtime's accumulators are: a replicated parameter's gradient, computed split,
   is gathered in every W). The parameters are laid out by their arguments' specs, an
   activation where the segment before left it (inside a chunk, XLA keeps a column-parallel
   output split; received replicated, a row-parallel layer's weight gradient would be charged
   in full), the other inputs replicated (the runtime splits a stage's micro-batch over the
   batch axis only). No program is run.
2. Compute: XLA's flops per device of each part on the slice over those on one device (W: the
   whole backward's less B's) scale the segment's timed F, B and W on that mesh, times the
   first mesh's batch share over this mesh's.
3. Collectives: each all-reduce, all-gather, reduce-scatter, all-to-all and
   collective-permute in the slice's programs (the forward's in F, B's in B, the whole
   backward's less B's in W; one in a loop body as often as the loop runs, where XLA knows
   the trip count), its bytes divided by the mesh's batch share (the slice ran the whole
   micro-batch: activations scale with the rows), is priced by the cluster model as rings
   over the mesh's devices: groups of the collective's size, contiguous along the model
   axes, one set for each position on the batch axis, all at once
   (`Cluster.all_reduce_seconds`; a gather, scatter or all-to-all as a reduce-scatter of its
   whole size, a permute as its bytes on every ring edge). The seconds are kept apart from
   compute, as the gradient sums are (`Sums.forward`, `Sums.input_grad`, `Sums.weight`):
   the trials' refit scales compute, not links.
On the local runtime the cluster is one host, so the collectives cost their latency and
little more; on Ray, the hosts' links. The slice is compiled on this process's CPU devices
where the meshes are a Ray runtime's (on a CPU driver `jaxreshard profile` gives it as many as
the pipeline needs; on a GPU one, its CPU backend has one unless XLA_FLAGS asks for more);
with too few, or a program XLA will not compile on the slice (a sharding constraint over the
batch axis inside the step: the slice has 1 device there), the mesh keeps the one-device times
and the report says why.
Not modelled: collectives of a parameter's gradient over a model axis (their bytes do not
scale with the rows, but are divided as if they did); several model axes whose collectives
run over one of them (priced as contiguous groups of the collective's size); collectives XLA
combines into one (their bytes add up, their latency is paid once); a permute's latency (one
step per ring edge, not one); overlap of a collective with compute, which XLA may schedule
(priced in full).
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jc
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxreshard.comm._layout import device_key
from jaxreshard.frontend._split import ACT, PARAM, StepGraph
from jaxreshard.runtime.step._memory import chunks_of
from jaxreshard.runtime.step._segment_cost import _vjp_forward
from jaxreshard.runtime.step._specs import transplant_spec

PARTS = ("forward", "input_grad", "weight_grad")

_OP = re.compile(
    r"=\s*(\([^=]*?\)|\S+)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(-start)?\("
)
_ARRAY = re.compile(r"\b(pred|[a-z]+\d+[a-z0-9]*)\[([\d,<=]*)\]")
_EXPLICIT = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_MESH = re.compile(  # (mesh[axis sizes], an optional device order, {the group's axes})
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((?:[^()]|\([^()]*\))*\))?\s*"
    r"(?:\{([^}]*)\})?"
)
_BITS = {"pred": 8}
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program: its kind, its bytes (an all-reduce's operand, a
    gather's or all-to-all's result, a reduce-scatter's result, a permute's operand), and the
    devices in each of its groups (0: not said; every device of the program), and how many
    times a run of the program runs it (in a loop of known trip count: that many)."""

    kind: str
    nbytes: int
    group: int
    times: int = 1


def _array_bytes(dtype: str, dims: str) -> int:
    width = re.match(r"[a-z]+(\d+)", dtype)
    bits = _BITS.get(dtype) or (int(width.group(1)) if width else 8)
    return math.prod(int(d.lstrip("<=")) for d in dims.split(",") if d) * bits // 8


def collectives_of(hlo: str) -> list[Collective]:
    """The collectives in a compiled program's HLO text (`compiled.as_text()`); an async
    collective counted at its start, one in a while loop's body as often as the loop runs
    where XLA knows its trip count."""
    found = []
    times = _loop_counts(hlo)
    computation = ""
    for line in hlo.splitlines():
        if head := _COMPUTATION.match(line):
            computation = head.group(1)
        m = _OP.search(line)
        if m is None:
            continue
        result, kind, start = m.groups()
        if start and kind != "all-reduce":  # ((operands), (results), ...): the results
            parts = _top_level(result)
            result = parts[1] if len(parts) > 1 else result
        nbytes = sum(_array_bytes(t, d) for t, d in _ARRAY.findall(result))
        if nbytes:
            found.append(Collective(kind, nbytes, _group_size(line), times.get(computation, 1)))
    return found


def _loop_counts(hlo: str) -> dict[str, int]:
    """Each computation's runs per run of the program, where a while loop of known trip count
    runs it as its body (nested loops multiply); computations not listed run once."""
    bodies: dict[str, list[tuple[str, int]]] = {}  # computation -> (loop body, trip count)
    computation = ""
    for line in hlo.splitlines():
        if head := _COMPUTATION.match(line):
            computation = head.group(1)
        if (body := _BODY.search(line)) and (trips := _TRIPS.search(line)):
            bodies.setdefault(computation, []).append((body.group(1), int(trips.group(1))))
    counts: dict[str, int] = {}

    def visit(name: str, n: int) -> None:
        for body, trips in bodies.get(name, ()):
            counts[body] = n * trips
            visit(body, n * trips)

    inner = {body for loops in bodies.values() for body, _ in loops}
    for name in bodies:  # (from the computations no loop runs: the text prints callees first)
        if name not in inner:
            visit(name, 1)
    return counts


def _top_level(result: str) -> list[str]:
    """The elements of a tuple shape `(a, (b, c), d)` (the text itself if not a tuple)."""
    if not result.startswith("("):
        return [result]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(result):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 1:
            parts.append(result[start:i])
            start = i + 1
    parts.append(result[start:-1])
    return [p.strip() for p in parts]


def _group_size(line: str) -> int:
    if m := _EXPLICIT.search(line):
        return len([d for d in m.group(1).split(",") if d])
    if m := _IOTA.search(line):
        return int(m.group(2))
    if m := _MESH.search(line):
        sizes = dict(re.findall(r"'?([\w]+)'?=(\d+)", m.group(1)))
        over = [a.strip().strip("'") for a in (m.group(2) or "").split(",") if a.strip()]
        if over and all(a in sizes for a in over):
            return math.prod(int(sizes[a]) for a in over)
    return 0


def _flops(compiled: Any) -> float | None:
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # (a backend without cost analysis)
        return None
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else None
    flops = (analysis or {}).get("flops")
    return float(flops) if flops is not None and flops > 0 else None


@dataclasses.dataclass
class MeshWork:
    """What a segment's parts cost on one mesh beside one device: each part's factor on its
    timed compute, and its collectives' seconds per micro-batch (`PARTS` order)."""

    factors: tuple[float, float, float] = (1.0, 1.0, 1.0)
    seconds: tuple[float, float, float] = (0.0, 0.0, 0.0)
    collectives: int = 0  # (how many, per micro-batch)


@dataclasses.dataclass(frozen=True)
class _Compiled:
    """A segment's programs (forward; whole backward; input gradients alone, or None without
    one) compiled on a model slice: their per-device flops and collectives, and the flops of
    the same programs on one device."""

    flops: tuple[float | None, ...]
    single: tuple[float | None, ...]
    collectives: tuple[tuple[Collective, ...], ...]


class TensorParallel:
    """Each segment's compute factor and collectives on each mesh (see the Note)."""

    def __init__(
        self, graph: StepGraph, specs: Sequence[Any], batch_axis: str | None,
        meshes: Sequence[Any], splits: Sequence[int], cluster: Any,
    ) -> None:  # fmt: skip
        self.segments = graph.loss.num_stages
        self.work = [[MeshWork() for _ in range(self.segments)] for _ in meshes]
        self.notes: list[str] = [""] * len(meshes)  # per mesh: why it keeps one device's times
        self.priced = [False] * len(meshes)
        self._graph, self._specs = graph, specs
        self._single: dict[int, tuple[float | None, ...]] = {}  # per segment, on one device
        # slice shape -> each segment's programs there (or why not): meshes of a shape compile once
        by_shape: dict[tuple[Any, ...], list[_Compiled] | str] = {}
        for m, (mesh, split) in enumerate(zip(meshes, splits)):
            ratio = splits[0] / split  # (the timed costs hold the first mesh's batch share)
            undivided = [MeshWork((ratio,) * 3) for _ in range(self.segments)]
            self.work[m] = undivided
            shape = dict(mesh.shape)
            if all(shape[a] == 1 for a in mesh.axis_names if a != batch_axis):
                continue  # (no model axis: the batch share alone)
            key = tuple((a, 1 if a == batch_axis else shape[a]) for a in mesh.axis_names)
            if key not in by_shape:
                try:
                    slice_mesh = _model_slice(mesh, batch_axis)
                    made: dict[int, Any] = {}  # activation id -> its sharding on the slice
                    by_shape[key] = [self._compile(s, slice_mesh, made)
                                     for s in range(self.segments)]  # fmt: skip
                except Exception as e:  # (too few devices; XLA or a constraint refusing it)
                    by_shape[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            compiled = by_shape[key]
            if isinstance(compiled, str):
                self.notes[m] = compiled
                continue
            rings = _rings(mesh, batch_axis)
            self.work[m] = [_priced(c, ratio, rings, split, cluster) for c in compiled]
            self.priced[m] = True

    def _compile(self, s: int, mesh: Mesh, made: dict[int, Any]) -> _Compiled:
        """Segment `s`'s programs on the model slice `mesh`; `made`: where the segments before
        it left their activations there (updated with its own). Without a differentiable input
        (or in a forward-only step), its forward alone."""
        graph = self._graph
        stage = graph.loss.stages[s]
        closed = stage.jaxpr
        shardings: list[Any] = []
        for ref, aval in zip(stage.inputs, closed.in_avals):
            if ref.kind == ACT and ref.index in made:  # (as the segment before laid it out)
                shardings.append(made[ref.index])
                continue
            spec = P()
            if ref.kind == PARAM and hasattr(aval, "shape"):
                with warnings.catch_warnings():  # (a spec that does not fit is replicated)
                    warnings.simplefilter("ignore")
                    spec = transplant_spec(
                        self._specs[graph.params[ref.index]], dict(mesh.shape), aval.shape
                    )
            shardings.append(NamedSharding(mesh, spec))
        structs = [
            jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a
            for a in closed.in_avals
        ]
        # Where XLA leaves this segment's outputs is where the next segment of a chunk finds
        # them (a cut between them plans its own move, which a chunk's inside does not have).
        fun = jc.jaxpr_as_fun(closed)
        with jax.set_mesh(mesh):
            alone = jax.jit(fun, in_shardings=tuple(shardings)).lower(*structs).compile()
        for ref, sharding in zip(stage.outputs, alone.output_shardings):
            if ref.kind == ACT:
                made[ref.index] = sharding
        one = jax.sharding.SingleDeviceSharding(mesh.devices.flat[0])  # (the slice's platform)
        parts = _forward(graph, s)
        if parts is None:  # (nothing differentiable: its forward alone, as the runtime runs it)
            if s not in self._single:
                on_one = jax.jit(fun, in_shardings=(one,) * len(structs)).lower(*structs)
                self._single[s] = (_flops(on_one.compile()), None, None)
            return _Compiled(
                (_flops(alone), None, None), self._single[s],
                (tuple(collectives_of(alone.as_text())), (), ()),
            )  # fmt: skip
        forward, n, params = parts
        outs, residuals = jax.eval_shape(forward, *structs)
        if s not in self._single:
            everywhere = (one,) * len(structs)
            on_one = _compiled_parts(forward, n, structs, everywhere, outs, residuals,
                                     lambda tree: jax.tree.map(lambda _: one, tree))  # fmt: skip
            self._single[s] = _flops_of(on_one)
        with jax.set_mesh(mesh):
            grads_at = [shardings[i] for i in params]
            programs = _compiled_parts(
                forward, n, structs, tuple(shardings), outs, residuals, None, grads_at
            )
        return _Compiled(
            _flops_of(programs),
            self._single[s],
            tuple(tuple(collectives_of(p.as_text())) if p is not None else () for p in programs),
        )

    def compute(self, segments: Sequence[Any], s: int, m: int) -> tuple[float, float, float]:
        """Segment `s`'s timed forward, whole backward and weight-gradient seconds on mesh
        `m`."""
        f, b, w = self.work[m][s].factors
        seg = segments[s]
        only = seg.backward - seg.weight_grad
        return seg.forward * f, only * b + seg.weight_grad * w, seg.weight_grad * w

    def costs(self, bounds: Sequence[int], mesh_of: Sequence[int]) -> tuple[tuple[float, ...], ...]:
        """Per chunk of the chunks `bounds` make: its collectives' seconds per micro-batch in F,
        in B and in W (`PARTS` order)."""
        chunks = chunks_of(bounds, self.segments)
        return tuple(
            tuple(sum(self.work[mesh_of[c]][s].seconds[k] for s in r) for c, r in enumerate(chunks))
            for k in range(3)
        )

    def summary(self) -> list[str]:
        """A line per mesh with model axes: its compute per device and collectives."""
        lines = []
        for m, work in enumerate(self.work):
            if self.notes[m]:
                lines.append(f"mesh {m}: tensor-parallel work not priced: {self.notes[m]}")
            elif self.priced[m]:
                total = [sum(w.seconds[k] for w in work) * 1e3 for k in range(3)]
                n = sum(w.collectives for w in work)
                lines.append(
                    f"mesh {m}: {n} collectives over its model axes per micro-batch, the whole "
                    f"model's F / B / W {total[0]:.2f} / {total[1]:.2f} / {total[2]:.2f} ms; "
                    "compute per device x "
                    + "/".join(f"{np.median([w.factors[k] for w in work]):.2f}" for k in range(3))
                    + " of the timed (median over segments)"
                )
        return lines

    def to_json(self) -> list[dict[str, Any]]:
        return [
            {
                "priced": self.priced[m],
                "note": self.notes[m],
                "factors": [list(w.factors) for w in work],
                "collective_seconds": [list(w.seconds) for w in work],
            }
            for m, work in enumerate(self.work)
        ]


def _priced(c: _Compiled, ratio: float, rings: np.ndarray, split: int, cluster: Any) -> MeshWork:
    """A segment's factors on its timed compute and its collectives' seconds on a mesh of
    these `rings`, from its programs on the mesh's model slice."""
    factors = []
    for k in range(3):  # forward, input gradients, weight gradients
        part, alone = _part(c.flops, k), _part(c.single, k)
        factors.append(ratio * part / alone if part is not None and alone else ratio)
    f, whole, only = (sum(_seconds(x, rings, split, cluster) for x in program)
                      for program in c.collectives)  # fmt: skip
    seconds = (f, only, max(whole - only, 0.0))
    count = sum(x.times for program in c.collectives[:2] for x in program)  # (F; B + W)
    return MeshWork(tuple(factors), seconds, count)  # type: ignore[arg-type]


def _part(flops: Sequence[float | None], k: int) -> float | None:
    """Part `k`'s flops (forward, B, W) from the programs' (forward; whole backward; input
    gradients alone, None without one: then the whole backward is W)."""
    f, whole, only = flops
    if k == 0:
        return f
    if k == 1:
        return only
    if whole is None:
        return None
    part = whole - (only or 0.0)
    return part if part > 0 else None


def _flops_of(programs: Sequence[Any]) -> tuple[float | None, ...]:
    return tuple(_flops(p) if p is not None else None for p in programs)


def _forward(graph: StepGraph, s: int) -> tuple[Any, int, list[int]] | None:
    """Segment `s`'s forward as the runtime runs it (its outputs and its VJP's residuals, from
    its inputs), how many differentiable activations it reads, and its differentiable
    parameters (input positions, in its VJP's order after them); None without a
    differentiable input."""
    stage = graph.loss.stages[s]
    closed = stage.jaxpr
    inexact = [jax.numpy.issubdtype(a.dtype, jax.numpy.inexact) for a in closed.in_avals]
    acts = [i for i, r in enumerate(stage.inputs) if r.kind == ACT and inexact[i]]
    params = [i for i, r in enumerate(stage.inputs) if r.kind == PARAM and inexact[i]]
    if graph.forward_only or not acts + params:
        return None
    return _vjp_forward(jc.jaxpr_as_fun(closed), acts + params, closed, stage), len(acts), params


def _compiled_parts(
    forward: Any, n: int, structs: Sequence[Any], shardings: Sequence[Any], outs: Any,
    residuals: Any, laid: Any = None, grads_at: Sequence[Any] = (),
) -> list[Any]:  # fmt: skip
    """The forward compiled for `shardings`, and the backward as the runtime runs it, from the
    forward's residuals and an output cotangent (each laid out where the forward leaves them,
    or by `laid(tree)`): whole, its parameter gradients laid out by `grads_at` (as the
    runtime's accumulators are: a replicated parameter's gradient is gathered there), and its
    input gradients alone (None without any)."""
    compiled = jax.jit(forward, in_shardings=tuple(shardings)).lower(*structs).compile()
    if laid is None:  # (in the trees of `outs` and `residuals`: a VJP's traces differ)
        at = jax.tree.leaves(compiled.output_shardings)
        outs_at, residuals_at = jax.tree.unflatten(jax.tree.structure((outs, residuals)), at)
    else:
        outs_at, residuals_at = laid(outs), laid(residuals)

    def backward(keep: int | None) -> Any:
        def run(f: Any, cts: Any) -> Any:
            grads = list(f(cts))
            for k, at in enumerate(grads_at):
                grads[n + k] = jax.lax.with_sharding_constraint(grads[n + k], at)
            return grads[:keep]

        program = jax.jit(run, in_shardings=(residuals_at, outs_at))
        return program.lower(residuals, outs).compile()

    return [compiled, backward(None), backward(n) if n else None]


def _model_slice(mesh: Any, batch_axis: str | None) -> Mesh:
    """The mesh's devices at the first position of its batch axis (kept, of size 1), as a
    `Mesh` this process can compile for: the mesh's own devices, or on a Ray runtime's meshes
    this process's CPU devices."""
    names = tuple(mesh.axis_names)
    shape = dict(mesh.shape)
    dims = tuple(1 if a == batch_axis else shape[a] for a in names)
    if isinstance(mesh, Mesh):
        devices = np.asarray(mesh.devices)
        if batch_axis in names:
            devices = np.take(devices, [0], axis=names.index(batch_axis))
        return Mesh(devices.reshape(dims), names)
    need = math.prod(dims)
    try:
        cpus = jax.devices("cpu")
    except RuntimeError:  # (no CPU backend in this process)
        cpus = []
    if len(cpus) < need:
        raise ValueError(
            f"its model axes need {need} devices to compile on and this process has "
            f"{len(cpus)} CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count={need})"
        )
    return Mesh(np.asarray(cpus[:need]).reshape(dims), names)


def _rings(mesh: Any, batch_axis: str | None) -> np.ndarray:
    """The mesh's device keys, one row per position on its batch axis, in the model axes'
    order."""
    ids = np.vectorize(device_key, otypes=[int])(np.asarray(mesh.devices, dtype=object))
    names = list(mesh.axis_names)
    if batch_axis in names:
        ids = np.moveaxis(ids, names.index(batch_axis), 0)
    return ids.reshape(ids.shape[0] if batch_axis in names else 1, -1)


def _seconds(c: Collective, rings: np.ndarray, split: int, cluster: Any) -> float:
    """The cluster model's seconds for collective `c` of a model slice's program (each of its
    runs), run at once by every batch position's devices over the micro-batch's `1 / split`
    rows."""
    width = rings.shape[1]
    g = c.group if c.group and width % c.group == 0 else width
    if g < 2:
        return 0.0
    groups = [list(map(int, group)) for group in rings.reshape(-1, g)]
    nbytes = c.nbytes / split
    if c.kind == "all-reduce":
        once = cluster.all_reduce_seconds(groups, nbytes)
    elif c.kind == "reduce-scatter":
        once = cluster.all_reduce_seconds(groups, nbytes * g, scatter=True)
    elif c.kind == "collective-permute":  # (its bytes on each ring edge; g - 1 latency steps)
        once = cluster.all_reduce_seconds(groups, nbytes * g / (g - 1), scatter=True)
    else:
        once = cluster.all_reduce_seconds(groups, nbytes, scatter=True)
    return once * c.times
