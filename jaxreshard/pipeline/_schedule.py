"""A schedule: one ordered action list per rank, with its transfers derived, not written."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from jaxreshard.pipeline._action import APPLY, BACKWARD, FORWARD, Action
from jaxreshard.pipeline._limits import check_counts

ACTIVATION = "activation"
GRADIENT = "gradient"
# A shared parameter's copy to a chunk that reads it, and that chunk's gradient contribution
# back (`Costs.shared`; the runtime's kinds, which measured timelines carry too).
PARAM_COPY, PARAM_GRAD = "param", "param_grad"


@dataclasses.dataclass(frozen=True, slots=True)
class Transfer:
    """A micro-batch's tensors crossing a stage boundary.

    Activations go from `F` on stage (chunk) s to `F` on s + 1; gradients from `B` on s to `B`
    on s - 1. `src` and `dst` are chunks; `Schedule.rank_of` gives their ranks.
    """

    kind: str
    mb: int
    src: int
    dst: int
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Simulators look transfers up in dicts several times per action: hash once.
        object.__setattr__(self, "_hash", hash((self.kind, self.mb, self.src, self.dst)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:
        # Rebuilt from its fields: a string's hash differs from process to process.
        return (Transfer, (self.kind, self.mb, self.src, self.dst))

    @property
    def producer(self) -> Action:
        return Action(self.src, FORWARD if self.kind == ACTIVATION else BACKWARD, self.mb)

    @property
    def consumer(self) -> Action:
        return Action(self.dst, FORWARD if self.kind == ACTIVATION else BACKWARD, self.mb)

    @property
    def boundary(self) -> int:
        """The boundary crossed: b between stages (chunks) b and b + 1."""
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
    """Per-rank action lists of one training step.

    [Note: chunks and ranks]
    The model is cut into `num_chunks` = p * v consecutive stages ("chunks", the model-order
    stage index of an action: `Action.stage_index`), and chunk c runs on rank `placement[c]`;
    a rank (one mesh) holds v chunks. With v = 1 (every schedule but the virtual-stage ones)
    chunk c runs on rank c, and "stage" means either. A boundary tensor moves from chunk c to
    c + 1 (and its gradient back); when both chunks sit on one rank, it does not leave the rank
    and costs nothing. Action lists, peak memory and timelines are per rank; costs are per chunk.

    Attributes:
        name: the registry name it was built from (or anything, for hand-written schedules).
        num_stages, num_micro_batches: p (ranks) and m.
        split_backward: each backward is split into `B` (input gradient) and `W` (weight
            gradient).
        weight_delay: `W`s were placed by the weight-delaying policy.
        actions: one tuple of actions per rank, in execution order.
        placement: the rank of each chunk; empty means chunk c on rank c (v = 1). Every rank
            holds at least one chunk; the built schedules hold v each, an imported one may not.
        fused: actions that run fused with the next action of their rank (see [Note: fused
            actions] in `_simulate.py`): DualPipeV's forward/backward pairs, and an imported
            whole backward (`B` then `W` of one micro-batch) in a split schedule.
    """

    name: str
    num_stages: int
    num_micro_batches: int
    split_backward: bool
    weight_delay: bool
    actions: tuple[tuple[Action, ...], ...]
    placement: tuple[int, ...] = ()
    fused: frozenset[Action] = frozenset()

    _chunks: tuple[tuple[int, ...], ...] = dataclasses.field(
        init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(tuple(a) for a in self.actions))
        if self.num_stages < 1 or self.num_micro_batches < 1:
            raise ValueError(
                f"schedule {self.name!r}: num_stages={self.num_stages} and "
                f"num_micro_batches={self.num_micro_batches} must be >= 1"
            )
        p = self.num_stages
        placement = tuple(self.placement)
        # Before any list of p or m entries exists (see [Note: schedule size limits]).
        kinds = 3 if self.split_backward else 2
        check_counts(
            f"schedule {self.name!r}", max(p, len(placement)), self.num_micro_batches, kinds
        )
        placement = placement or tuple(range(p))
        object.__setattr__(self, "placement", placement)
        if len(self.actions) != p:
            raise ValueError(
                f"schedule {self.name!r}: {len(self.actions)} action lists for "
                f"num_stages={p} ranks; give one list per rank"
            )
        if any(not isinstance(a, Action) for rank in self.actions for a in rank):
            actions = tuple(  # strings like '0F1' parse
                tuple(a if isinstance(a, Action) else _parse(a, r) for a in rank)
                for r, rank in enumerate(self.actions)
            )
            object.__setattr__(self, "actions", actions)
        object.__setattr__(self, "fused", frozenset(self.fused))
        chunks: list[list[int]] = [[] for _ in range(p)]
        for c, r in enumerate(placement):
            if 0 <= r < p:
                chunks[r].append(c)
        if len(placement) != sum(map(len, chunks)) or not all(chunks):
            outside = [(c, r) for c, r in enumerate(placement) if not 0 <= r < p][:4]
            empty = [r for r in range(p) if not chunks[r]][:8]
            raise ValueError(
                f"schedule {self.name!r}: placement (the rank of each chunk, "
                f"{len(placement)} chunks) must put each chunk on one of the {p} ranks and "
                "give every rank at least one chunk; "
                + (
                    "; ".join(f"chunk {c} is on rank {r!r}" for c, r in outside)
                    or f"ranks {empty} hold no chunk"
                )
                + f"; e.g. chunk c on rank c % {p}"
            )
        object.__setattr__(self, "_chunks", tuple(map(tuple, chunks)))

    @property
    def num_chunks(self) -> int:
        """p * v: the model-order stages (see [Note: chunks and ranks])."""
        return len(self.placement)

    @property
    def virtual_stages(self) -> int:
        """v: chunks per rank (the most any rank holds, should a placement be uneven)."""
        return max(map(len, self._chunks))

    def rank_of(self, chunk: int) -> int:
        """The rank that runs `chunk`."""
        return self.placement[chunk]

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """The chunks `rank` runs, in model order."""
        return self._chunks[rank]

    def is_local(self, transfer: Transfer) -> bool:
        """Whether `transfer` stays on one rank (it then costs nothing)."""
        return self.placement[transfer.src] == self.placement[transfer.dst]

    @classmethod
    def from_lists(
        cls,
        lists: Sequence[Iterable[Action | str]],
        *,
        num_micro_batches: int | None = None,
        name: str = "custom",
        weight_delay: bool = False,
        placement: Sequence[int] | None = None,
        fused: Iterable[Action | str] = (),
    ) -> Schedule:
        """A schedule from per-rank lists of `Action`s or strings like `'0F1'`.

        `placement` defaults to where the lists put each chunk; when a chunk appears on several
        ranks and there are as many chunks as ranks, to chunk c on rank c (so the checker can
        point at the misplaced actions).
        """
        actions = tuple(
            tuple(a if isinstance(a, Action) else Action.parse(a) for a in rank) for rank in lists
        )
        flat = [a for rank in actions for a in rank]
        split = any(a.kind == "W" for a in flat)
        if num_micro_batches is None:
            num_micro_batches = 1 + max((a.microbatch_index for a in flat), default=0)
        if placement is None:
            placement = infer_placement(actions)
        return cls(
            name,
            len(actions),
            num_micro_batches,
            split,
            weight_delay,
            actions,
            tuple(placement),
            frozenset(a if isinstance(a, Action) else Action.parse(a) for a in fused),
        )

    def transfers(self) -> tuple[Transfer, ...]:
        """Every transfer, local ones included, in the producing rank's order (rank by rank)."""
        out = []
        for rank in self.actions:
            for action in rank:
                t = transfer_from(action, self.num_chunks)
                if t is not None:
                    out.append(t)
        return tuple(out)

    def groups(self, rank: int) -> list[tuple[Action, ...]]:
        """Rank `rank`'s actions as units that run as one: fused runs, and single actions."""
        out: list[tuple[Action, ...]] = []
        run: list[Action] = []
        for action in self.actions[rank]:
            run.append(action)
            if action not in self.fused:
                out.append(tuple(run))
                run = []
        if run:
            out.append(tuple(run))
        return out

    def with_apply(self) -> Schedule:
        """The same schedule with each rank's apply-gradient step after its last B/W (one per
        chunk, in model order)."""
        if any(a.kind == APPLY for rank in self.actions for a in rank):
            return self
        actions = tuple(
            (*rank, *(Action(c, APPLY) for c in self.chunks_of(r)))
            for r, rank in enumerate(self.actions)
        )
        return dataclasses.replace(self, actions=actions)

    def describe(self) -> str:
        extra = " + weight delay" if self.weight_delay else ""
        p, m, v, n = self.num_stages, self.num_micro_batches, self.virtual_stages, self.num_chunks
        if v == 1:
            return f"{self.name}{extra}, {p} stages, {m} micro-batches"
        if n == p * v:
            return f"{self.name}{extra}, {p} ranks x {v} virtual stages, {m} micro-batches"
        return f"{self.name}{extra}, {p} ranks, {n} chunks, {m} micro-batches"

    def grid(self, mark: dict[Action, str] | None = None) -> str:
        """The action lists as a text grid; `mark` flags actions with a reason."""
        label = "stage" if self.virtual_stages == 1 else "rank"
        return format_grid(self.actions, mark, label=label, fused=self.fused)

    def __str__(self) -> str:
        return f"{self.describe()}\n{self.grid()}"


def _parse(item: object, rank: int) -> Action:
    if not isinstance(item, str):
        raise ValueError(f"rank {rank} holds {item!r:.40}, not an Action or a string like '0F1'")
    return Action.parse(item)


def infer_placement(actions: Sequence[Sequence[Action]]) -> tuple[int, ...]:
    """Chunk -> rank from where per-rank lists put the chunks (see `Schedule.from_lists`)."""
    ranks: dict[int, list[int]] = {}
    for r, rank in enumerate(actions):
        for a in rank:
            if r not in ranks.setdefault(a.stage_index, []):
                ranks[a.stage_index].append(r)
    num_chunks = 1 + max(ranks, default=len(actions) - 1)
    if any(len(rs) > 1 for rs in ranks.values()) and num_chunks == len(actions):
        return tuple(range(num_chunks))
    for c in range(num_chunks):
        if c not in ranks:
            raise ValueError(
                f"chunk {c} has no actions, but chunks up to {num_chunks - 1} do; every model "
                "stage needs its F and B on one rank"
            )
        if len(ranks[c]) > 1:
            shown = "; ".join(
                f"rank {r}: " + " ".join(str(a) for a in actions[r] if a.stage_index == c)
                for r in ranks[c]
            )
            raise ValueError(
                f"chunk {c} appears on ranks {ranks[c]} ({shown}); a chunk (model stage) runs "
                "on one rank: move its actions to one row"
            )
    return tuple(ranks[c][0] for c in range(num_chunks))


GRID_ROWS = 32
GRID_COLUMNS = 48
"""Past these, a grid (in an error message) shows only the marked rows, each around its first
mark: a 100,000-action schedule's error stays a few lines."""


def format_grid(
    actions: Sequence[Sequence[Action]],
    mark: dict[Action, str] | None = None,
    *,
    label: str = "stage",
    fused: frozenset[Action] = frozenset(),
) -> str:
    """One row per rank, one column per position; marked actions print as `>2B3<`, an action
    fused with the next one as `2F3+`. A large grid shows only its marked rows (the first
    rows if none is marked), each cut to the columns around its first mark."""
    mark = mark or {}
    if len(actions) > GRID_ROWS or max(map(len, actions), default=0) > GRID_COLUMNS:
        return _compact_grid(actions, mark, label, fused)

    def cell(a: Action) -> str:
        return (f">{a}<" if a in mark else str(a)) + ("+" if a in fused else "")

    cells = [[cell(a) for a in stage] for stage in actions]
    columns = max((len(row) for row in cells), default=0)
    widths = [
        max((len(row[c]) for row in cells if c < len(row)), default=0) for c in range(columns)
    ]
    lines = []
    for s, row in enumerate(cells):
        text = " ".join(cell.rjust(widths[c]) for c, cell in enumerate(row))
        lines.append(f"{label} {s} | {text}".rstrip() + _reasons(actions[s], mark))
    return "\n".join(lines)


def _reasons(row: Sequence[Action], mark: dict[Action, str], most: int = 4) -> str:
    reasons = [f"{a}: {mark[a]}" for a in row if a in mark]
    if not reasons:
        return ""
    more = f"; and {len(reasons) - most} more" if len(reasons) > most else ""
    return "   <-- ERROR HERE: " + "; ".join(reasons[:most]) + more


def _compact_grid(
    actions: Sequence[Sequence[Action]],
    mark: dict[Action, str],
    label: str,
    fused: frozenset[Action],
) -> str:
    half = GRID_COLUMNS // 4
    marked = [s for s, row in enumerate(actions) if any(a in mark for a in row)]
    rows = (marked or range(len(actions)))[: GRID_ROWS // 2]
    lines = [
        f"({len(actions)} {label}s, up to {max(map(len, actions))} actions each: showing "
        + ("the marked ones" if marked else "the first ones")
        + f", {len(rows)} of {len(marked) if marked else len(actions)}, around their first "
        "mark; [i] is the position of the first action shown)"
    ]
    for s in rows:
        row = actions[s]
        first = next((i for i, a in enumerate(row) if a in mark), 0)
        lo, hi = max(0, first - half), min(len(row), first + half + 1)
        text = " ".join(
            (f">{a}<" if a in mark else str(a)) + ("+" if a in fused else "") for a in row[lo:hi]
        )
        text = ("... " if lo else "") + text + (" ..." if hi < len(row) else "")
        lines.append(f"{label} {s} | [{lo}] {text}" + _reasons(row, mark))
    return "\n".join(lines)
