"""What a rank's instruction list asks of its stages' executables (pure: programs in, sets out)."""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence

from jaxreshard.pipeline._action import BACKWARD, FORWARD, WEIGHT
from jaxreshard.pipeline._emit import RECV_OP, RUN, SEND_OP, Instruction


def program_fusion(
    program: Sequence[Instruction], chunks: Sequence[int], last_chunk: int, split: bool
) -> tuple[dict[int, int], dict[int, int]]:
    """For a rank's program (running `chunks`): per chunk, the position of its last backward
    (where a fused optimizer runs; -1 without one), and, unless backwards are `split`, the
    positions of the last chunk's forwards that run fused with the backward right after them
    (forward position -> backward position)."""
    runs = [i for i, ins in enumerate(program) if ins.op == RUN]
    last_backward = {
        c: max(
            (
                i
                for i in runs
                if program[i].action.stage_index == c
                and program[i].action.kind in (BACKWARD, WEIGHT)
            ),
            default=-1,
        )
        for c in chunks
    }
    fused_fb: dict[int, int] = {}
    if last_chunk in chunks and not split:
        for i, j in itertools.pairwise(runs):
            f, b = program[i].action, program[j].action
            if (
                f.stage_index == b.stage_index == last_chunk
                and f.kind == FORWARD
                and b.kind == BACKWARD
                and f.microbatch_index == b.microbatch_index
                and all(ins.op not in (RECV_OP, SEND_OP) for ins in program[i + 1 : j])
            ):
                fused_fb[i] = j
    return last_backward, fused_fb


def program_variants(
    program: Sequence[Instruction],
    chunks: Sequence[int],
    last_chunk: int,
    split: bool,
    fused: Collection[int],
    accumulates: Collection[int],
    recorded: bool = False,
) -> dict[int, set[str]]:
    """Per chunk of a rank, the executables a step calls (see [Note: stage executables]):
    `fused` chunks run their optimizer in their last backward, and `accumulates` lists the
    chunks with parameter gradients. A `recorded` step (a profile's) times forwards and
    backwards apart, so it never runs them fused."""
    last_backward, fused_fb = program_fusion(program, chunks, last_chunk, split)
    if recorded:
        fused_fb = {}
    out: dict[int, set[str]] = {c: set() for c in chunks}
    fused_backwards = set(fused_fb.values())
    for position, ins in enumerate(program):
        if ins.op != RUN or position in fused_backwards:
            continue
        c, kind = ins.action.stage_index, ins.action.kind
        final = c in fused and position == last_backward[c]
        if position in fused_fb:
            final = c in fused and fused_fb[position] == last_backward[c]
            out[c].add("fb_apply" if final else "fb")
        elif kind == FORWARD:
            out[c].add("forward")
        elif kind == BACKWARD:
            out[c].add("apply" if final else "b_part" if split else "backward")
        else:
            out[c].add("apply" if final else "w_part")
        if (kind != FORWARD or position in fused_fb) and c in accumulates:
            out[c].add("zeros")
    return out
