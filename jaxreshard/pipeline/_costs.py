"""The schedule cost model: compute time per stage and action kind, transfer time per boundary."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any

from jaxreshard._files import human_bytes, show
from jaxreshard.pipeline import _limits
from jaxreshard.pipeline._action import APPLY, BACKWARD, FORWARD, WEIGHT
from jaxreshard.pipeline._schedule import GRADIENT

MAX_COST = 1e12
# The first micro-batch's extra compute per stage (`Costs.forward_first`, ...).
FIRST = ("forward_first", "backward_first", "weight_grad_first")


def _per(
    value: float | Sequence[float], n: int, name: str, signed: bool = False
) -> tuple[float, ...]:
    """`value` (one number, or n) as n floats, each at most MAX_COST in size and, unless
    `signed`, >= 0."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        values: tuple[Any, ...] = (value,) * n
    elif isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(
            f"Costs: {name}={show(value)} must be a number or a sequence of {n} numbers"
        )
    else:
        values = tuple(value)
    if len(values) != n:
        raise ValueError(f"Costs: {name} has {len(values)} entries, expected {n} (or one number)")
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, numbers.Real)]
    if bad:
        raise ValueError(f"Costs: {name} holds {show(bad[0])}; every entry must be a number")
    values = tuple(float(v) for v in values)
    if any(not (-MAX_COST if signed else 0) <= v <= MAX_COST for v in values):
        low = f"-{MAX_COST:g}" if signed else "0"
        raise ValueError(
            f"Costs: {name}={show(list(values))} must be >= {low} and at most {MAX_COST:g} (a time "
            "in any unit; sums over a schedule's actions must stay finite)"
        )
    return values


@dataclasses.dataclass(frozen=True, slots=True)
class SharedCost:
    """Parameters that chunk `owner` keeps and chunk `user` also reads (a tied embedding): the
    owner sends them at the start of the step, taking `seconds` on the link from owner to user,
    and the user's first action waits for them; with `grad`, the user sends its gradient
    contribution back after its rank's last action, as long again (or `back` seconds), and the
    owner's apply waits for it (the runtime's `param` and `param_grad` transfers; see [Note:
    instructions])."""

    owner: int
    user: int
    seconds: float
    grad: bool = True
    back: float | None = None

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.back is None:
            del out["back"]  # (as long as the copy: files without it stay as they were)
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class Costs:
    """Per-stage compute times and per-boundary transfer times (any time unit, e.g. seconds).

    Attributes:
        forward: forward time of one micro-batch, per stage.
        backward: the whole backward of one micro-batch, per stage.
        weight_grad: the weight-gradient part of `backward`, per stage. With the backward split,
            `B` lasts `backward - weight_grad` and `W` lasts `weight_grad`.
        comm: transfer time of one micro-batch's tensors across each boundary (stage b to b+1,
            and its gradient back unless `comm_back` says), per boundary.
        comm_back: the gradients' way back (b+1 to b), per boundary; None (as `comm`) by
            default. Measured runs give both: on a shaped link the way that carries a burst
            of sends is slower than the other (2-host cluster at 0.01 GB/s: a tiny GPT's
            64 KiB activations took 8.2 ms, the same size of gradients 1.3 ms).
        comm_first: per boundary, how much longer the step's first micro-batch's activations
            take (zeros by default), negative where shorter (down to `-comm`): on Ray a
            step's first send over a boundary arrived 1-4 ms later than the others, and on a
            shaped link that was idle before the step 3-4x sooner (measured, see
            `jaxreshard/profiler/_measured.py`).
        apply: apply-gradient (optimizer) time, per stage.
        shared: parameters read by chunks other than their owner (`SharedCost`), at most one
            per (owner, user) pair; none by default.
        forward_first, backward_first, weight_grad_first: per stage, how much longer the
            step's first micro-batch's forward, whole backward and W take than `forward`,
            `backward` and `weight_grad` (zeros by default; `weight_grad_first` is the W part
            of `backward_first`). A chunk's first backward starts its gradient accumulators
            in fresh buffers; on the 2-host emulated cluster an MLP's first W took 3-6 ms
            where the others took 1-2 (see `jaxreshard/profiler/_measured.py`).
        host: per stage, how long its rank stays busy after each of its F, B and W actions
            with that action's outputs already on their way: the host's own work between two
            actions (posting the sends, dropping what is dead, dispatching the next); a
            fused run of actions pays its actions' host time at its end. Zeros by default;
            a profile measures it (see [Note: host time between actions] in
            `jaxreshard/profiler/_measured.py`).
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight_grad: tuple[float, ...]
    comm: tuple[float, ...]
    apply: tuple[float, ...]
    shared: tuple[SharedCost, ...] = ()
    host: tuple[float, ...] = ()
    comm_back: tuple[float, ...] | None = None
    comm_first: tuple[float, ...] = ()
    forward_first: tuple[float, ...] = ()
    backward_first: tuple[float, ...] = ()
    weight_grad_first: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.forward)
        if n < 1:
            raise ValueError("Costs: need at least one stage")
        for name in ("host", "comm_first", *FIRST):  # (frozen fields: set once, normalised)
            value, size = getattr(self, name), n - 1 if name == "comm_first" else n
            empty = isinstance(value, tuple) and not value
            object.__setattr__(
                self, name, _per(0.0 if empty else value, size, name, signed=name == "comm_first")
            )
        if self.comm_back is not None:  # (None: as `comm`, whatever `replace` makes it)
            object.__setattr__(self, "comm_back", _per(self.comm_back, n - 1, "comm_back"))
        if not isinstance(self.shared, tuple):
            object.__setattr__(self, "shared", tuple(self.shared))  # (hashable, as the rest)
        pairs = set()
        for x in self.shared:
            if not isinstance(x, SharedCost):
                raise ValueError(f"Costs: shared holds {show(x)}; every entry must be a SharedCost")
            chunks = (x.owner, x.user)
            if (
                any(isinstance(c, bool) or not isinstance(c, int) for c in chunks)
                or not all(0 <= c < n for c in chunks)
                or x.owner == x.user
            ):
                raise ValueError(
                    f"Costs: shared {x} must name two different chunks of the {n} (ints 0 to "
                    f"{n - 1})"
                )
            for seconds in (x.seconds, 0.0 if x.back is None else x.back):
                if (
                    isinstance(seconds, bool)
                    or not isinstance(seconds, numbers.Real)
                    or not 0 <= seconds <= MAX_COST
                ):
                    raise ValueError(f"Costs: shared {x} must take 0 to {MAX_COST:g} seconds")
            if (x.owner, x.user) in pairs:
                raise ValueError(
                    f"Costs: shared names chunks {x.owner} -> {x.user} twice; give one entry "
                    "per pair (the seconds of all the parameters they share, summed)"
                )
            pairs.add((x.owner, x.user))
        for name in ("backward", "weight_grad", "apply"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Costs: {name} must have one entry per stage ({n})")
        if len(self.comm) != n - 1:
            raise ValueError(f"Costs: comm must have one entry per boundary ({n - 1})")
        for b, (c, f) in enumerate(zip(self.comm, self.comm_first)):
            if c + f < 0:
                raise ValueError(
                    f"Costs: boundary {b}'s comm_first={f} would make its first transfer take "
                    f"{c + f:g} (comm={c} plus comm_first); comm_first must be >= -comm"
                )
        for s, (b, w) in enumerate(zip(self.backward, self.weight_grad)):
            if w > b:
                raise ValueError(
                    f"Costs: stage {s} weight_grad={w} exceeds its whole backward={b}; "
                    "weight_grad is the part of backward spent on weight gradients"
                )
        for s, (b, w) in enumerate(zip(self.backward_first, self.weight_grad_first)):
            if w > b:
                raise ValueError(
                    f"Costs: stage {s} weight_grad_first={w} exceeds its backward_first={b}; "
                    "weight_grad_first is the W part of the first backward's extra time"
                )

    @classmethod
    def make(
        cls,
        num_stages: int,
        *,
        forward: float | Sequence[float] = 1.0,
        backward: float | Sequence[float] = 2.0,
        weight_grad: float | Sequence[float] | None = None,
        comm: float | Sequence[float] = 0.0,
        apply: float | Sequence[float] = 0.0,
        host: float | Sequence[float] = 0.0,
        comm_back: float | Sequence[float] | None = None,
        comm_first: float | Sequence[float] = 0.0,
        forward_first: float | Sequence[float] = 0.0,
        backward_first: float | Sequence[float] = 0.0,
        weight_grad_first: float | Sequence[float] | None = None,
    ) -> Costs:
        """Costs from numbers (uniform) or per-stage / per-boundary sequences.

        `weight_grad` defaults to half of `backward`, `weight_grad_first` to half of
        `backward_first`, `comm_back` to `comm`.
        """
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"Costs: num_stages={show(num_stages)} must be an int >= 1")
        if num_stages > _limits.MAX_CHUNKS:  # before tuples of that length exist
            raise ValueError(
                f"Costs: num_stages={num_stages:,} chunks (model stages) would take "
                f"~{human_bytes(num_stages * 5 * 8)} of costs alone, and a schedule of at least "
                f"{num_stages * 2:.3g} actions; at most {_limits.MAX_CHUNKS:,} "
                "(jaxreshard.pipeline._limits.MAX_CHUNKS): use fewer stages"
            )
        backward_t = _per(backward, num_stages, "backward")
        if weight_grad is None:
            weight_grad = [b / 2 for b in backward_t]
        backward_first_t = _per(backward_first, num_stages, "backward_first")
        if weight_grad_first is None:
            weight_grad_first = [b / 2 for b in backward_first_t]
        return cls(
            forward=_per(forward, num_stages, "forward"),
            backward=backward_t,
            weight_grad=_per(weight_grad, num_stages, "weight_grad"),
            comm=_per(comm, num_stages - 1, "comm"),
            apply=_per(apply, num_stages, "apply"),
            host=_per(host, num_stages, "host"),
            comm_back=None if comm_back is None else _per(comm_back, num_stages - 1, "comm_back"),
            comm_first=_per(comm_first, num_stages - 1, "comm_first", signed=True),
            forward_first=_per(forward_first, num_stages, "forward_first"),
            backward_first=backward_first_t,
            weight_grad_first=_per(weight_grad_first, num_stages, "weight_grad_first"),
        )

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    def with_shared(self, shared: Sequence[SharedCost]) -> Costs:
        """These costs with `shared` as their shared parameters."""
        return dataclasses.replace(self, shared=tuple(shared))

    def transfer_seconds(self, kind: str, boundary: int, mb: int = -1) -> float:
        """How long a micro-batch's transfer of `kind` (a `Transfer`'s: gradients go back)
        takes across `boundary` (the first micro-batch's activations `comm_first` longer, or
        shorter where it is negative)."""
        if kind == GRADIENT:
            return (self.comm if self.comm_back is None else self.comm_back)[boundary]
        return self.comm[boundary] + (self.comm_first[boundary] if mb == 0 else 0.0)

    def duration(self, stage: int, kind: str, split: bool, mb: int = -1) -> float:
        """How long one action of `kind` on micro-batch `mb` takes on `stage` (`split`:
        backward split into B/W; the first micro-batch's `*_first` longer)."""
        if kind == APPLY:
            return self.apply[stage]
        if mb == 0:
            return self._first_duration(stage, kind, split)
        if kind == FORWARD:
            return self.forward[stage]
        if kind == BACKWARD:
            return self.backward[stage] - (self.weight_grad[stage] if split else 0.0)
        assert kind == WEIGHT
        return self.weight_grad[stage]

    def _first_duration(self, stage: int, kind: str, split: bool) -> float:
        if kind == FORWARD:
            return self.forward[stage] + self.forward_first[stage]
        w = self.weight_grad[stage] + self.weight_grad_first[stage]
        if kind == WEIGHT:
            return w
        assert kind == BACKWARD
        return self.backward[stage] + self.backward_first[stage] - (w if split else 0.0)

    def to_json(self) -> dict[str, Any]:
        def compact(values: tuple[float, ...]) -> float | list[float]:
            return values[0] if values and len(set(values)) == 1 else list(values)

        return (
            {
                "forward": compact(self.forward),
                "backward": compact(self.backward),
                "weight_grad": compact(self.weight_grad),
                "comm": compact(self.comm) if self.comm else 0.0,
                "apply": compact(self.apply),
            }
            | ({"shared": [x.to_json() for x in self.shared]} if self.shared else {})
            | ({"host": compact(self.host)} if any(self.host) else {})
            | ({"comm_first": compact(self.comm_first)} if any(self.comm_first) else {})
            # (weight_grad_first with backward_first: a reader defaults it to half of that)
            | {
                name: compact(getattr(self, name))
                for name in FIRST
                if any(getattr(self, name))
                or (name == "weight_grad_first" and any(self.backward_first))
            }
            | (
                {"comm_back": compact(self.comm_back)}
                if self.comm_back is not None and self.comm_back != self.comm
                else {}
            )
        )
