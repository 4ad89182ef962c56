"""The emitter: a schedule plus the boundary tensors become one instruction list per stage.

[Note: instructions]
A stage's worker runs its list in order and knows nothing of schedules:
- `RUN 2F0` / `RUN 2B0` / `RUN 2W0`: compute an action;
- `SEND act3 mb0 s2->s3`: start moving a boundary tensor to another stage (asynchronous: issued
  as soon as the producing action finishes, so the transfer overlaps what follows);
- `RECV act3 mb0 s2->s3`: wait until it has arrived (the only blocking instruction);
- `FREE fwd mb0` / `FREE res mb0`: drop a micro-batch's forward values / residuals.
Activations go forward after `F`; their gradients come back after `B` of the consumer. A
parameter used by several stages is sent by its owner to the others at the start of the step
(`param`), and their gradient contributions come back at the end (`param_grad`). The lists are
checked before anything runs: every send has its receive and no stage can wait forever
(`comm._order.check_programs`, treating each stage as a host).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

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
    """Parameter `index` kept by stage `owner` and also used by stages `users`."""

    index: int
    owner: int
    users: tuple[int, ...]


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
            return f"FREE {self.kind} mb{self.mb}"
        what = f"{self.kind}{self.tensor}" + (f" mb{self.mb}" if self.mb >= 0 else "")
        return f"{self.op} {what} s{self.src}->s{self.dst}"

    @property
    def key(self) -> tuple[str, int, int, int, int]:
        """What a SEND and its RECV share."""
        return (self.kind, self.tensor, self.mb, self.src, self.dst)


def emit(
    schedule: Schedule, edges: Sequence[Edge], shared: Sequence[SharedParam] = ()
) -> tuple[tuple[Instruction, ...], ...]:
    """Turn `schedule` into per-stage instruction lists (see [Note: instructions])."""
    if schedule.virtual_stages > 1 or schedule.fused:
        raise ValueError(
            f"emit: {schedule.describe()} runs several chunks per rank or fuses actions; the "
            "emitter maps one chunk to one stage worker so far: use a schedule with one chunk "
            "per rank (gpipe, 1f1b, eager_1f1b, zb_h1)"
        )
    p = schedule.num_stages
    programs: list[list[Instruction]] = [[] for _ in range(p)]
    for sp in shared:
        for user in sp.users:
            programs[sp.owner].append(
                Instruction(SEND_OP, kind=PARAM, tensor=sp.index, src=sp.owner, dst=user)
            )
            programs[user].append(
                Instruction(RECV_OP, kind=PARAM, tensor=sp.index, src=sp.owner, dst=user)
            )
    into = {s: [e for e in edges if e.dst == s] for s in range(p)}
    out_of = {s: [e for e in edges if e.src == s] for s in range(p)}
    for s in range(p):
        program = programs[s]
        for action in schedule.actions[s]:
            mb = action.microbatch_index
            if action.kind == FORWARD:
                program += [
                    Instruction(RECV_OP, kind=ACTIVATION, tensor=e.tensor, mb=mb, src=e.src, dst=s)
                    for e in into[s]
                ]
                program.append(Instruction(RUN, action))
                program += [
                    Instruction(SEND_OP, kind=ACTIVATION, tensor=e.tensor, mb=mb, src=s, dst=e.dst)
                    for e in out_of[s]
                ]
                program.append(Instruction(FREE, kind="fwd", mb=mb))
            elif action.kind == BACKWARD:
                program += [
                    Instruction(RECV_OP, kind=GRADIENT, tensor=e.tensor, mb=mb, src=e.dst, dst=s)
                    for e in out_of[s]
                    if e.grad
                ]
                program.append(Instruction(RUN, action))
                program += [
                    Instruction(SEND_OP, kind=GRADIENT, tensor=e.tensor, mb=mb, src=s, dst=e.src)
                    for e in into[s]
                    if e.grad
                ]
                if not schedule.split_backward:
                    program.append(Instruction(FREE, kind="res", mb=mb))
            elif action.kind == WEIGHT:
                program.append(Instruction(RUN, action))
                program.append(Instruction(FREE, kind="res", mb=mb))
    for sp in shared:
        for user in sp.users:
            programs[user].append(
                Instruction(SEND_OP, kind=PARAM_GRAD, tensor=sp.index, src=user, dst=sp.owner)
            )
            programs[sp.owner].append(
                Instruction(RECV_OP, kind=PARAM_GRAD, tensor=sp.index, src=user, dst=sp.owner)
            )
    result = tuple(tuple(program) for program in programs)
    check_instructions(result)
    return result


def check_instructions(programs: Sequence[Sequence[Instruction]]) -> None:
    """Raise `OrderError` if a receive has no send, or the workers could wait forever."""
    ids: dict[tuple[str, int, int, int, int], int] = {}
    steps: dict[int, list[Step]] = {}
    for s, program in enumerate(programs):
        out = steps.setdefault(s, [])
        for ins in program:
            if ins.op in (SEND_OP, RECV_OP):
                op = ids.setdefault(ins.key, len(ids))
                out.append(
                    Step(op, SEND, peers=(ins.dst,))
                    if ins.op == SEND_OP
                    else Step(op, RECV, peers=(ins.src,))
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
