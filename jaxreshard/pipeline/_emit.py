"""The emitter: a schedule plus the boundary tensors become one instruction list per rank.

[Note: instructions]
A rank's worker runs its list in order and knows nothing of schedules. Stage numbers `sN` are
chunks (model-order stages; one per rank unless the schedule has virtual stages):
- `RUN 2F0` / `RUN 2B0` / `RUN 2W0`: compute an action of chunk 2;
- `SEND act3 mb0 s2->s3`: start moving a boundary tensor to another chunk (asynchronous:
  issued as soon as the producing action finishes, so the transfer overlaps what follows);
- `RECV act3 mb0 s2->s3`: wait until it has arrived (the only blocking instruction);
- `FREE fwd mb0 s2` / `FREE res mb0 s2`: drop a micro-batch's forward values / residuals of
  chunk 2.
Activations go forward after `F`; their gradients come back after `B` of the consumer. A
parameter used by several chunks is sent by its owner to the others at the start of the step
(`param`), and their gradient contributions come back at the end (`param_grad`). The lists are
checked before anything runs: every send has its receive and no rank can wait forever
(`comm._order.check_programs`, treating each rank as a host).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from jaxreshard.comm._order import RECV, SEND, OrderError, Step, check_programs
from jaxreshard.pipeline._action import BACKWARD, FORWARD, WEIGHT, Action
from jaxreshard.pipeline._schedule import Schedule

RUN, FREE = "RUN", "FREE"
SEND_OP, RECV_OP = "SEND", "RECV"
ACTIVATION, GRADIENT, PARAM, PARAM_GRAD = "act", "grad", "param", "param_grad"


@dataclasses.dataclass(frozen=True, slots=True)
class Edge:
    """Boundary tensor `tensor` (an activation id) moving from stage `src` to stage `dst`, once
    per micro-batch; `grad`: its gradient comes back from `dst` to `src`."""

    tensor: int
    src: int
    dst: int
    grad: bool


@dataclasses.dataclass(frozen=True, slots=True)
class SharedParam:
    """Parameter `index` kept by stage `owner` and also used by stages `users` (which send
    their gradient contributions back, with `grad`)."""

    index: int
    owner: int
    users: tuple[int, ...]
    grad: bool = True


@dataclasses.dataclass(frozen=True, slots=True)
class Instruction:
    """One step of a stage worker (see [Note: instructions])."""

    op: str
    action: Action | None = None
    kind: str = ""
    tensor: int = -1
    mb: int = -1
    src: int = -1
    dst: int = -1

    def __str__(self) -> str:
        if self.op == RUN:
            return f"RUN {self.action}"
        if self.op == FREE:
            return f"FREE {self.kind} mb{self.mb} s{self.src}"
        what = f"{self.kind}{self.tensor}" + (f" mb{self.mb}" if self.mb >= 0 else "")
        return f"{self.op} {what} s{self.src}->s{self.dst}"

    @property
    def key(self) -> tuple[str, int, int, int, int]:
        """What a SEND and its RECV share."""
        return (self.kind, self.tensor, self.mb, self.src, self.dst)


def emit(
    schedule: Schedule, edges: Sequence[Edge], shared: Sequence[SharedParam] = ()
) -> tuple[tuple[Instruction, ...], ...]:
    """Turn `schedule` into per-rank instruction lists (see [Note: instructions]).

    Edges, shared parameters and instructions name chunks (model-order stages); the program of
    rank r runs the actions of its chunks (`schedule.chunks_of(r)`), so a boundary between two
    chunks of one rank is a SEND and a RECV in the same program. A fused run of actions
    (`schedule.groups`) receives everything it needs first and sends after its last action.
    """
    p = schedule.num_stages
    rank = schedule.rank_of
    programs: list[list[Instruction]] = [[] for _ in range(p)]
    for sp in shared:  # sends first: a user chunk may sit on its owner's rank
        for user in sp.users:
            programs[rank(sp.owner)].append(
                Instruction(SEND_OP, kind=PARAM, tensor=sp.index, src=sp.owner, dst=user)
            )
    for sp in shared:
        for user in sp.users:
            programs[rank(user)].append(
                Instruction(RECV_OP, kind=PARAM, tensor=sp.index, src=sp.owner, dst=user)
            )
    chunks = range(schedule.num_chunks)
    into = {c: [e for e in edges if e.dst == c] for c in chunks}
    out_of = {c: [e for e in edges if e.src == c] for c in chunks}
    for r in range(p):
        for group in schedule.groups(r):
            recvs: list[Instruction] = []
            runs: list[Instruction] = []
            sends: list[Instruction] = []
            frees: list[Instruction] = []
            for action in group:
                c, mb = action.stage_index, action.microbatch_index
                if action.kind == FORWARD:
                    recvs += [
                        Instruction(
                            RECV_OP, kind=ACTIVATION, tensor=e.tensor, mb=mb, src=e.src, dst=c
                        )
                        for e in into[c]
                    ]
                    sends += [
                        Instruction(
                            SEND_OP, kind=ACTIVATION, tensor=e.tensor, mb=mb, src=c, dst=e.dst
                        )
                        for e in out_of[c]
                    ]
                    frees.append(Instruction(FREE, kind="fwd", mb=mb, src=c))
                elif action.kind == BACKWARD:
                    recvs += [
                        Instruction(
                            RECV_OP, kind=GRADIENT, tensor=e.tensor, mb=mb, src=e.dst, dst=c
                        )
                        for e in out_of[c]
                        if e.grad
                    ]
                    sends += [
                        Instruction(
                            SEND_OP, kind=GRADIENT, tensor=e.tensor, mb=mb, src=c, dst=e.src
                        )
                        for e in into[c]
                        if e.grad
                    ]
                    if not schedule.split_backward:
                        frees.append(Instruction(FREE, kind="res", mb=mb, src=c))
                elif action.kind == WEIGHT:
                    frees.append(Instruction(FREE, kind="res", mb=mb, src=c))
                else:
                    continue  # A: the optimizer runs after the pipeline
                runs.append(Instruction(RUN, action))
            programs[r] += [*recvs, *runs, *sends, *frees]
    with_grads = [sp for sp in shared if sp.grad]
    for sp in with_grads:
        for user in sp.users:
            programs[rank(user)].append(
                Instruction(SEND_OP, kind=PARAM_GRAD, tensor=sp.index, src=user, dst=sp.owner)
            )
    for sp in with_grads:
        for user in sp.users:
            programs[rank(sp.owner)].append(
                Instruction(RECV_OP, kind=PARAM_GRAD, tensor=sp.index, src=user, dst=sp.owner)
            )
    result = tuple(tuple(program) for program in programs)
    check_instructions(result, rank)
    return result


def check_instructions(
    programs: Sequence[Sequence[Instruction]], rank_of: Callable[[int], int] = lambda c: c
) -> None:
    """Raise `OrderError` if a receive has no send, or the workers (one per rank, running the
    chunks `rank_of` maps to it) could wait forever."""
    ids: dict[tuple[str, int, int, int, int], int] = {}
    steps: dict[int, list[Step]] = {}
    for s, program in enumerate(programs):
        out = steps.setdefault(s, [])
        for ins in program:
            if ins.op in (SEND_OP, RECV_OP):
                op = ids.setdefault(ins.key, len(ids))
                out.append(
                    Step(op, SEND, peers=(rank_of(ins.dst),))
                    if ins.op == SEND_OP
                    else Step(op, RECV, peers=(rank_of(ins.src),))
                )
    try:
        check_programs(steps)
    except OrderError as e:
        names = {v: k for k, v in ids.items()}
        raise OrderError(
            f"{e}\n(op ids: "
            + ", ".join(
                f"{i}={kind}{t}" + (f" mb{mb}" if mb >= 0 else "") + f" s{a}->s{b}"
                for i, (kind, t, mb, a, b) in sorted(names.items())
            )
            + ")"
        ) from None


def format_programs(programs: Sequence[Sequence[Instruction]], limit: int = 40) -> str:
    """The instruction lists, one stage per block (at most `limit` lines each)."""
    lines = []
    for s, program in enumerate(programs):
        lines.append(f"stage {s}: {len(program)} instructions")
        for ins in program[:limit]:
            lines.append(f"  {ins}")
        if len(program) > limit:
            lines.append(f"  ... {len(program) - limit} more")
    return "\n".join(lines)
