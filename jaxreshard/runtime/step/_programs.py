"""What a rank's instruction list asks of its stages' executables (pure: programs in, sets out)."""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from typing import NamedTuple

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


class ScanGroup(NamedTuple):
    """Micro-batches of the last chunk that run as one scanning executable (`scan_groups`)."""

    micro_batches: tuple[int, ...]  # in the order their backwards come
    positions: frozenset[int]  # the program positions of their forwards and backwards


def scan_groups(
    program: Sequence[Instruction], chunks: Sequence[int], last_chunk: int, split: bool
) -> dict[int, ScanGroup]:
    """The runs of a rank's program that compute several micro-batches of the last chunk with
    nothing between them but their forwards, backwards and FREEs (no transfer, no other chunk):
    a one-stage pipeline's whole program, whatever the schedule. Each runs as one executable
    that scans over its micro-batches (see [Note: stage executables]): what a user writes by
    hand as a `lax.scan` accumulation, with no dispatch or accumulator round trip between
    micro-batches. Returns the position of each run's first forward -> its micro-batches, in
    the order their backwards come (the accumulation order), and the positions of its RUNs.
    Unless backwards are `split`."""
    if last_chunk not in chunks or split:
        return {}
    groups: dict[int, ScanGroup] = {}
    window: list[int] = []

    def close() -> None:
        forwards = {program[i].action.microbatch_index: i for i in window
                    if program[i].action.kind == FORWARD}  # fmt: skip
        backwards = {program[i].action.microbatch_index: i for i in window
                     if program[i].action.kind == BACKWARD}  # fmt: skip
        if (
            len(forwards) >= 2
            and forwards.keys() == backwards.keys()
            and len(forwards) + len(backwards) == len(window)
            and all(forwards[mb] < backwards[mb] for mb in forwards)
        ):
            order = tuple(sorted(backwards, key=backwards.__getitem__))
            groups[window[0]] = ScanGroup(order, frozenset(window))
        window.clear()

    for i, ins in enumerate(program):
        if ins.op == RUN:
            a = ins.action
            if a.stage_index == last_chunk and a.kind in (FORWARD, BACKWARD):
                window.append(i)
                continue
        elif ins.op not in (RECV_OP, SEND_OP):
            continue  # a FREE
        close()
    close()
    return groups


class Call(NamedTuple):
    """What a rank runs at one RUN of its program (`program_calls`)."""

    name: str  # the executable (see [Note: stage executables]); "" where an earlier call ran it
    micro_batches: tuple[int, ...]  # the micro-batches it computes
    backward: int  # the position of the last backward it computes (-1: a forward)


# A variant whose gradient accumulators start at zero inside it: it computes all of its chunk's
# gradients of the step (one micro-batch, or a scan over all of them), so no `zeros` executable
# runs first and no accumulator is read back (measured on an MLP 4x1024 on CPU: passing the
# zeros in costs 8% of the step). Not on a stage that keeps its accumulators unreduced.
FROM_ZERO = "@0"


def program_calls(
    program: Sequence[Instruction],
    chunks: Sequence[int],
    last_chunk: int,
    split: bool,
    fused: Collection[int],
    recorded: bool = False,
) -> dict[int, Call]:
    """Per RUN position of a rank's program (running `chunks`), the executable it calls: the
    last chunk's forward and the backward right after it run as one (`fb`), several of them
    with nothing between as a scan (`scan_groups`), and a `fused` chunk's last backward runs
    its optimizer too. A `recorded` step (a profile's) times every action apart, so it fuses
    nothing."""
    last_backward, fused_fb = program_fusion(program, chunks, last_chunk, split)
    groups = scan_groups(program, chunks, last_chunk, split)
    if recorded:
        fused_fb, groups = {}, {}
    accumulating = BACKWARD if not split else WEIGHT
    sums = {
        c: {i for i, ins in enumerate(program)
            if ins.op == RUN and ins.action.stage_index == c and ins.action.kind == accumulating}
        for c in chunks
    }  # fmt: skip

    def named(base: str, c: int, backwards: Collection[int], size: int = 0) -> str:
        if c in fused and last_backward[c] in backwards:  # with the optimizer
            base = {"fb": "fb_apply", "fb_scan": "fb_scan_apply"}.get(base, "apply")
        whole = base not in ("forward", "b_part") and sums[c] <= set(backwards)
        return base + (f"/{size}" if size else "") + (FROM_ZERO if whole else "")

    calls: dict[int, Call] = {}
    for position, ins in enumerate(program):
        if ins.op != RUN or position in calls:
            continue
        c, kind, mb = ins.action.stage_index, ins.action.kind, ins.action.microbatch_index
        if position in groups:
            group = groups[position]
            backwards = {i for i in group.positions if program[i].action.kind == BACKWARD}
            name = named("fb_scan", c, backwards, len(group.micro_batches))
            calls[position] = Call(name, group.micro_batches, max(backwards))
            for i in group.positions - {position}:
                a = program[i].action
                end = i if a.kind == BACKWARD else -1
                calls[i] = Call("", (a.microbatch_index,), end)
        elif position in fused_fb:
            j = fused_fb[position]
            calls[position] = Call(named("fb", c, {j}), (mb,), j)
            calls[j] = Call("", (mb,), j)
        elif kind == FORWARD:
            calls[position] = Call("forward", (mb,), -1)
        elif kind == BACKWARD:
            calls[position] = Call(named("b_part" if split else "backward", c, {position}),
                                   (mb,), position)  # fmt: skip
        else:
            calls[position] = Call(named("w_part", c, {position}), (mb,), position)
    return calls


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
    chunks with parameter gradients."""
    out: dict[int, set[str]] = {c: set() for c in chunks}
    calls = program_calls(program, chunks, last_chunk, split, fused, recorded)
    for position, call in calls.items():
        c = program[position].action.stage_index
        if call.name:
            out[c].add(call.name)
            if (
                call.backward >= 0
                and c in accumulates
                and not starts_from_zero(call.name)
                and call.name != "b_part"
            ):
                out[c].add("zeros")
    return out


def base_name(name: str) -> str:
    """An executable's name without its size and start (`fb_scan_apply/4@0` -> `fb_scan_apply`)."""
    return name.split("/")[0].removesuffix(FROM_ZERO)


def starts_from_zero(name: str) -> bool:
    return name.endswith(FROM_ZERO)
