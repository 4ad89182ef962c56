"""`jr.scan`: `lax.scan` over a stack of layers whose iterations are stage candidates.

[Note: candidates inside a scanned stack]
A `jr.stage_candidate` inside a `lax.scan` body is traced once for every iteration, so it cannot
say after which layer a stage ends. `jr.scan` has `lax.scan`'s signature and results; while
`parallelize` traces a step with a choice of cuts (see [Note: candidate cuts]), the gap after
every `candidate_every`-th iteration (in the order the iterations run) is a candidate, numbered
with the step's other candidates in the order the loss reaches them. Where some are chosen, the
scan runs as consecutive `lax.scan`s over the pieces of `xs` between the chosen gaps, and the
carry between two pieces passes a stage boundary; the pieces' stacked outputs are concatenated
back in index order. `boundaries=` names gaps that always end a stage (a forced boundary, also
outside a choice of cuts), which are then not candidates. A piece runs exactly the iterations
the whole scan would run, on the same carry, so the results equal `lax.scan`'s. With neither a
chosen candidate nor `boundaries` it is one `lax.scan`.

Each piece slices its part of `xs` where it runs, so a stacked parameter read by the pieces of
two stages is read by both: the first keeps it, and the others get a copy of the whole stack
each step and send their gradient contributions back, as for any parameter several stages read
([Note: stage cutting] in `_split.py`); the partitioner charges that copy to every choice that
cuts inside the stack. Where the link is slow and the stack large, give each stage its own stack
and its own scan, with a `jr.stage_candidate` between the scans.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxreshard.frontend._jaxprs import PipelineSplitError
from jaxreshard.frontend._markers import _boundary, _state
from jaxreshard.frontend._source import caller_location


def scan(
    f: Callable[[Any, Any], tuple[Any, Any]],
    init: Any,
    xs: Any = None,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
    *,
    candidate_every: int = 1,
    boundaries: Sequence[int] = (),
) -> tuple[Any, Any]:
    """`jax.lax.scan`, whose iterations a pipeline stage may end after.

    Same arguments and results as `lax.scan(f, init, xs, length, reverse, unroll)`. Inside a
    `parallelize`d step with `PipelineConfig(partition="auto")` or `cuts=...`, the gap after
    every `candidate_every`-th iteration (the last excepted) is a `jr.stage_candidate` on the
    carry, numbered with the step's other candidates in the order the loss reaches them: a scan
    of `length` iterations adds `(length - 1) // candidate_every` of them. A chosen one splits
    the scan into two scans, the carry crossing to the next stage between them (see [Note:
    candidates inside a scanned stack]). A scan whose carry holds no arrays adds none (nothing
    would cross), and neither does a `jr.scan` inside another's body (the outer's iterations
    are the candidates). `boundaries`: iteration counts after which a stage must end (a
    `jr.stage_boundary` on the carry: `(6,)` ends a stage after the first 6 iterations run),
    hand-placed stages inside the stack; those gaps are not candidates. Elsewhere, and without
    `boundaries`, it is `lax.scan`.
    """
    try:
        every = operator.index(candidate_every)
    except TypeError:
        every = 0
    if isinstance(candidate_every, bool) or every < 1:
        raise ValueError(
            f"{caller_location()}: jr.scan(candidate_every={candidate_every!r}): the number of "
            "iterations between two candidates, an int >= 1 (2: a stage may end after every "
            "other layer)"
        )
    try:
        given = () if boundaries is None else tuple(boundaries)
    except TypeError:
        given = None
    chosen = getattr(_state, "cuts", None)
    if chosen is None and given == ():
        return lax.scan(f, init, xs, length, reverse, unroll)
    n = _length(xs, length)
    forced = _boundaries(boundaries, given, n, init)
    nested = getattr(_state, "scan_body", 0) > 0
    if nested and forced:
        raise PipelineSplitError(
            f"{caller_location()}: jr.scan(boundaries={boundaries!r}) inside the body of another "
            "jr.scan: a boundary there would end a stage inside the outer scan, whose body is "
            "traced once for all its iterations; put the boundaries on the outer jr.scan"
        )
    body = _body(f)
    gaps: list[int] = []
    first = getattr(_state, "candidates", 0)
    if chosen is not None:
        if not nested and jax.tree.leaves(init):
            gaps = [g for g in range(every, n, every) if g not in forced]
        _state.candidates = first + len(gaps)
    marks = {g: "forced" for g in forced}
    for k, g in enumerate(gaps):
        if chosen == "all" or (chosen is not None and first + k in chosen):
            marks[g] = first + k
    if not marks:
        return lax.scan(body, init, xs, length, reverse, unroll)
    cuts = sorted(marks)
    carry, pieces = init, []
    for k, (a, b) in enumerate(zip([0, *cuts], [*cuts, n])):
        if k:
            carry = _boundary(carry, marks[a])
        lo, hi = (n - b, n - a) if reverse else (a, b)
        part = jax.tree.map(lambda x, lo=lo, hi=hi: x[lo:hi], xs)
        steps = None if jax.tree.leaves(xs) else hi - lo
        carry, ys = lax.scan(body, carry, part, steps, reverse, unroll)
        pieces.append(ys)
    if reverse:
        pieces.reverse()
    return carry, jax.tree.map(lambda *ys: jnp.concatenate(ys, axis=0), *pieces)


def _boundaries(boundaries: Any, given: tuple[Any, ...] | None, n: int, init: Any) -> set[int]:
    """`jr.scan(boundaries=...)` (`given`: as a tuple, None if not a sequence) checked:
    distinct iteration counts from 1 to n - 1, on a carry that holds arrays."""
    try:
        forced = None if given is None else [operator.index(b) for b in given]
    except TypeError:
        forced = None
    if (
        forced is None
        or isinstance(boundaries, (str, bytes))
        or any(isinstance(b, (bool, np.bool_)) for b in given or ())
        or any(not 1 <= b < n for b in forced)
        or len(set(forced)) != len(forced)
    ):
        raise ValueError(
            f"{caller_location()}: jr.scan(boundaries={boundaries!r}): distinct iteration "
            f"counts from 1 to {n - 1} (this scan runs {n}), each the iterations run before a "
            "stage ends; e.g. (6,) for two stages of 6 layers of 12"
        )
    if forced and not jax.tree.leaves(init):
        raise ValueError(
            f"{caller_location()}: jr.scan(boundaries={boundaries!r}) on a carry with no "
            "arrays: nothing would cross to the next stage; end the stage outside the scan"
        )
    return set(forced)


def _body(f: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """`f`, counted as a `jr.scan` body while it is traced (`_state.scan_body`): a candidate
    there is refused, a nested `jr.scan` adds none, and its boundaries are refused."""

    @functools.wraps(f)
    def body(carry: Any, x: Any) -> Any:
        _state.scan_body = getattr(_state, "scan_body", 0) + 1
        try:
            return f(carry, x)
        finally:
            _state.scan_body -= 1

    return body


def _length(xs: Any, length: int | None) -> int:
    """The scan's iteration count, checked as `lax.scan` checks it."""
    leaves = jax.tree.leaves(xs)
    if not leaves:
        if length is None:
            raise ValueError(
                f"{caller_location()}: jr.scan with no xs needs length=, the number of "
                "iterations (as lax.scan does)"
            )
        return int(length)
    shapes = [jnp.shape(leaf) for leaf in leaves]
    if any(len(shape) == 0 for shape in shapes):
        raise ValueError(
            f"{caller_location()}: jr.scan: an xs leaf is a scalar; every leaf of xs is scanned "
            "along its leading axis (as lax.scan does), so give each one"
        )
    sizes = sorted({int(shape[0]) for shape in shapes})
    if len(sizes) > 1 or (length is not None and int(length) != sizes[0]):
        given = "" if length is None else f" and length={length}"
        raise ValueError(
            f"{caller_location()}: jr.scan: the xs leaves' leading sizes are {sizes}{given}; "
            "they must all be the number of iterations (as lax.scan requires)"
        )
    return sizes[0]
