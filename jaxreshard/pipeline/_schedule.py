"""A schedule: one ordered action list per stage, with its transfers derived, not written."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from jaxreshard.pipeline._action import APPLY, BACKWARD, FORWARD, Action

ACTIVATION = "activation"
GRADIENT = "gradient"


@dataclasses.dataclass(frozen=True, slots=True)
class Transfer:
    """A micro-batch's tensors crossing a stage boundary.

    Activations go from `F` on stage s to `F` on s + 1; gradients from `B` on stage s to `B` on
    s - 1.
    """

    kind: str
    mb: int
    src: int
    dst: int

    @property
    def producer(self) -> Action:
        return Action(self.src, FORWARD if self.kind == ACTIVATION else BACKWARD, self.mb)

    @property
    def consumer(self) -> Action:
        return Action(self.dst, FORWARD if self.kind == ACTIVATION else BACKWARD, self.mb)

    @property
    def boundary(self) -> int:
        """The boundary crossed: b between stages b and b + 1."""
        return min(self.src, self.dst)

    def label(self) -> str:
        """`send act mb3 s0->s1`; measured timelines also carry the runtime's kinds (`param`
        copies of shared parameters, their `param_grad`s), which belong to no micro-batch."""
        short = {ACTIVATION: "act", GRADIENT: "grad", "param_grad": "param grad"}.get(
            self.kind, self.kind
        )
        mb = f" mb{self.mb}" if self.mb >= 0 else ""
        return f"send {short}{mb} s{self.src}->s{self.dst}"


def transfer_from(action: Action, num_stages: int) -> Transfer | None:
    """The transfer an action produces, if any."""
    s, mb = action.stage_index, action.microbatch_index
    if action.kind == FORWARD and s < num_stages - 1:
        return Transfer(ACTIVATION, mb, s, s + 1)
    if action.kind == BACKWARD and s > 0:
        return Transfer(GRADIENT, mb, s, s - 1)
    return None


def transfer_into(action: Action, num_stages: int) -> Transfer | None:
    """The transfer an action waits for, if any."""
    s, mb = action.stage_index, action.microbatch_index
    if action.kind == FORWARD and s > 0:
        return Transfer(ACTIVATION, mb, s - 1, s)
    if action.kind == BACKWARD and s < num_stages - 1:
        return Transfer(GRADIENT, mb, s + 1, s)
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class Schedule:
    """Per-stage action lists of one training step.

    Attributes:
        name: the registry name it was built from (or anything, for hand-written schedules).
        num_stages, num_micro_batches: p and m.
        split_backward: each backward is split into `B` (input gradient) and `W` (weight
            gradient).
        weight_delay: `W`s were placed by the weight-delaying policy.
        actions: one tuple of actions per stage, in execution order.
    """

    name: str
    num_stages: int
    num_micro_batches: int
    split_backward: bool
    weight_delay: bool
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(tuple(a) for a in self.actions))
        if self.num_stages < 1 or self.num_micro_batches < 1:
            raise ValueError(
                f"schedule {self.name!r}: num_stages={self.num_stages} and "
                f"num_micro_batches={self.num_micro_batches} must be >= 1"
            )

    @classmethod
    def from_lists(
        cls,
        lists: Sequence[Iterable[Action | str]],
        *,
        num_micro_batches: int | None = None,
        name: str = "custom",
        weight_delay: bool = False,
    ) -> Schedule:
        """A schedule from per-stage lists of `Action`s or strings like `'0F1'`."""
        actions = tuple(
            tuple(a if isinstance(a, Action) else Action.parse(a) for a in stage) for stage in lists
        )
        flat = [a for stage in actions for a in stage]
        split = any(a.kind == "W" for a in flat)
        if num_micro_batches is None:
            num_micro_batches = 1 + max((a.microbatch_index for a in flat), default=0)
        return cls(name, len(actions), num_micro_batches, split, weight_delay, actions)

    def transfers(self) -> tuple[Transfer, ...]:
        """Every transfer, in the producing stage's order (stage by stage)."""
        out = []
        for stage in self.actions:
            for action in stage:
                t = transfer_from(action, self.num_stages)
                if t is not None:
                    out.append(t)
        return tuple(out)

    def with_apply(self) -> Schedule:
        """The same schedule with each stage's apply-gradient step after its last B/W."""
        if any(a.kind == APPLY for stage in self.actions for a in stage):
            return self
        actions = tuple((*stage, Action(s, APPLY)) for s, stage in enumerate(self.actions))
        return dataclasses.replace(self, actions=actions)

    def describe(self) -> str:
        extra = " + weight delay" if self.weight_delay else ""
        p, m = self.num_stages, self.num_micro_batches
        return f"{self.name}{extra}, {p} stages, {m} micro-batches"

    def grid(self, mark: dict[Action, str] | None = None) -> str:
        """The action lists as a text grid; `mark` flags actions with a reason."""
        return format_grid(self.actions, mark)

    def __str__(self) -> str:
        return f"{self.describe()}\n{self.grid()}"


def format_grid(actions: Sequence[Sequence[Action]], mark: dict[Action, str] | None = None) -> str:
    """One row per stage, one column per position; marked actions print as `>2B3<`."""
    mark = mark or {}
    cells = [[f">{a}<" if a in mark else str(a) for a in stage] for stage in actions]
    columns = max((len(row) for row in cells), default=0)
    widths = [
        max((len(row[c]) for row in cells if c < len(row)), default=0) for c in range(columns)
    ]
    lines = []
    for s, row in enumerate(cells):
        text = " ".join(cell.rjust(widths[c]) for c, cell in enumerate(row))
        line = f"stage {s} | {text}".rstrip()
        reasons = [f"{a}: {mark[a]}" for a in actions[s] if a in mark]
        if reasons:
            line += "   <-- ERROR HERE: " + "; ".join(reasons)
        lines.append(line)
    return "\n".join(lines)
