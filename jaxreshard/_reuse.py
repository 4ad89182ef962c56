"""The compiled steps of a `parallelize`d function, by argument signature; one compile for
arguments placed differently but laid out alike on the stage meshes.

[Note: one compile for equivalent placements]
A compiled step is cached by its arguments'
signature: shapes, dtypes and PartitionSpecs as placed (`_arguments.signature`). The compiled
pipeline itself depends on those specs only through what each stage makes of them: every
parameter's spec transplanted onto its owner's mesh (`parameter_specs`), and each fused
optimizer's other inputs onto their stage's mesh (`extra_specs`); every call then moves each
argument to those shardings. So two signatures whose leaves differ only in specs that transplant
alike onto every stage that reads them are laid out alike (a spec over an axis of one device on
each of those meshes shards nothing). That happens on every train loop whose stage meshes differ
in shape: parameters placed by the user on one mesh, say `P('model')` over a model axis of 2,
come back from the step on their owner's mesh, where that axis has one device, as `P()`. The
second call's signature is new, and before this it compiled the whole pipeline again (a profile
of a mixed layout measured a 4-5 s first timed step, 2026-11-29). On a miss, a cached step of
the same argument structure whose transplanted specs equal the new arguments' serves instead,
and the new signature is cached to it. Values cannot differ either way: every call moves each
argument to the shardings the step was compiled for. What the reused step keeps is its first
compile's choices: with `partition="auto"`, the cuts chosen then (the partitioner reads the
arguments' specs too). Local pipelines on Auto axes only: a step traced on Explicit axes types
its inputs by their specs, and a Ray pipeline keeps its own layout on the hosts.
"""

from __future__ import annotations

import collections
import contextlib
import warnings
from collections.abc import Sequence
from typing import Any

from jaxreshard._jax_compat import axis_type_names
from jaxreshard._trials import close_entry
from jaxreshard.comm._layout import normalized_spec
from jaxreshard.frontend._split import PARAM
from jaxreshard.runtime.step._layout import extra_specs, parameter_specs


class StepCache(collections.OrderedDict):
    """Compiled steps (`_Entry`) by argument signature, least recently used first. Several
    signatures may share one step (see [Note: one compile for equivalent placements]); a
    step's pipeline is closed (its threads end, its buffers go) once no signature holds it."""

    def lookup(self, key: Any) -> Any:
        """The step cached for `key`, now the most recently used (None: none, or closed by
        `close` or `jaxreshard.shutdown()`); a TypeError for an unhashable key."""
        entry = self.get(key)
        if entry is None or getattr(entry.pipeline, "closed", False):
            return None
        with contextlib.suppress(KeyError):  # (dropped by another thread meanwhile)
            self.move_to_end(key)
        return entry

    def equivalent(self, key: tuple[Any, ...], arrays: Sequence[Any], static: object) -> Any:
        """A cached step these arguments would compile alike (signature `key`, array leaves
        `arrays`), or None."""
        for other, entry in list(self.items()):  # (other threads may call meanwhile)
            if entry.stage_specs is None or getattr(entry.pipeline, "closed", False):
                continue
            if not same_but_specs(other, key, static):
                continue
            if stage_specs(entry.pipeline, arrays) == entry.stage_specs:
                stage_specs(entry.pipeline, arrays, quiet=False)  # (this placement's warnings)
                return entry
        return None

    def remember(self, key: Any, entry: Any, limit: int) -> None:
        """Cache `entry` for `key`; past `limit` compiled steps the least recently used
        signatures are dropped."""
        old = self.pop(key, None)
        if old is not None and old is not entry:
            self._drop(old)
        self[key] = entry
        while len({id(e) for e in list(self.values())}) > limit:
            _, dropped = self.popitem(last=False)
            self._drop(dropped)

    def close_all(self) -> None:
        while self:
            self._drop(self.popitem()[1])

    def _drop(self, entry: Any) -> None:
        if all(e is not entry for e in list(self.values())):
            close_entry(entry)


def stage_specs(pipeline: Any, leaves: Sequence[Any], quiet: bool = True) -> Any:
    """What a local compiled pipeline makes of `leaves`' specs (see [Note: one compile for
    equivalent placements]); None where another placement could compile differently (a
    Ray pipeline, Explicit axes). `quiet`: without the warnings a spec that does not fit a
    stage gives (the caller asks again, not quiet, for arguments it will run)."""
    compiled = getattr(pipeline, "compiled", None)
    if compiled is None:
        return None
    graph, meshes = compiled.graph, compiled.meshes
    if "explicit" in axis_type_names(meshes[0]):  # (the trace typed its inputs by their specs)
        return None
    shapes = [dict(mesh.shape) for mesh in meshes]
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")
        params = parameter_specs(graph, leaves, shapes)
        extra = extra_specs(graph, compiled.engine.fused, leaves, params, shapes)
    readers: dict[int, set[int]] = {k: {graph.owner[k]} for k in range(len(params))}
    for s, stage in enumerate(graph.loss.stages):
        for ref in stage.inputs:
            if ref.kind == PARAM:
                readers[ref.index].add(s)
    return (
        tuple(_norm(spec, [shapes[s] for s in readers[k]]) for k, spec in enumerate(params)),
        tuple(
            (s, tuple(_norm(spec, [shapes[s]]) for spec in specs))
            for s, specs in sorted(extra.items())
        ),
    )


def same_but_specs(a: tuple[Any, ...], b: tuple[Any, ...], static: object) -> bool:
    """Whether two signature keys (in_tree, then per leaf (shape, dtype, spec) or (`static`,
    value)) differ at most in their arrays' specs."""
    if len(a) != len(b) or a[0] != b[0]:
        return False
    for x, y in zip(a[1:], b[1:]):
        if (x[0] is static) != (y[0] is static):
            return False
        if (x if x[0] is static else x[:2]) != (y if y[0] is static else y[:2]):
            return False
    return True


def _norm(spec: Any, meshes: Sequence[dict[str, int]]) -> Any:
    """`spec` without the axes that have one device on every one of these meshes (they shard
    nothing on any stage that reads the value)."""
    ones = {a: 1 for a in meshes[0] if all(m.get(a, 1) == 1 for m in meshes)}
    return normalized_spec(spec, ones)
