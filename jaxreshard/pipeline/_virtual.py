"""Virtual-stage schedules: p ranks run v > 1 chunks (model stages) each.

See [Note: chunks and ranks] in `_schedule.py` for the data model. Three families:

- `interleaved_1f1b` (Narayanan et al., SC 2021; Megatron-LM's and torch's Interleaved1F1B):
  chunk c on rank c % p ("looped" placement). Micro-batches go in groups of g = p; a rank runs
  the forwards of one group on each of its chunks in model order, the backwards in reverse
  chunk order, and interleaves them 1F1B-style after (v - 1) * g + 2 * (p - 1 - r) warm-up
  forwards, so the bubble shrinks by v. When p does not divide m, the m // p groups differ by
  at most one micro-batch, the larger first (torch takes equal groups of m / (m // p) and
  refuses other m; with a short last group the ranks can wait on each other). With v = 1
  this is `eager_1f1b`'s order (Megatron's interleaved warm-up keeps two micro-batches per
  downstream rank).
  `eager_interleaved_1f1b` uses groups of g = 2p: twice the micro-batches in flight, as
  eager-1F1B has over 1F1B, so that a rank has forwards to run while a boundary tensor goes
  round the ring of ranks. Both split their backward with weight delay (see [Note: weight
  placement] in `_schedules.py`).
- `zbv` (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 6; torch's
  ZBVZeroBubble): two chunks per rank in a V, chunk c on rank c for c < p and on rank
  2p - 1 - c after, so the last rank runs the two middle chunks and rank 0 the first and the
  last. Split backward, fixed order: warm-up forwards, then `F B W` of each chunk in turn, then
  a cool-down that defers `W`s. With F = B = W it has the zero-bubble property: makespan at
  most the per-rank work plus (p - 1) F, peak memory 2p chunk-micro-batches (1F1B's).
- `dualpipev` (DeepSeek's DualPipe cut to one V, as in DeepSeek's DualPipeV and torch's
  DualPipeV): the V placement, and in its main phase a forward of one chunk fused with a
  backward of the other (different micro-batches) on each rank; see [Note: fused actions] in
  `_simulate.py`. Its backwards are whole (written `B` then `W`, fused), except where DualPipe
  splits them to fill the warm-up and cool-down bubbles.

ZB-V and DualPipeV are built for at least the micro-batches their phases need (2p - 1 and 2p)
and then drop the actions of micro-batches beyond m: a subset of a valid order is valid, so
small m needs no special cases. None of these orders is proved valid for every (p, v, m); the
checker accepts them for p <= 10, v <= 5 and m <= 64 (swept once), and tests/test_virtual.py
checks a grid and random configurations.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from jaxreshard.pipeline._action import BACKWARD, FORWARD, WEIGHT, Action

VirtualOrder = Callable[[int, int, int, int], list[Action]]


def looped_placement(num_stages: int, virtual_stages: int) -> tuple[int, ...]:
    """Chunk c on rank c % p (Megatron's interleaved placement)."""
    return tuple(c % num_stages for c in range(num_stages * virtual_stages))


def v_placement(num_stages: int, virtual_stages: int = 2) -> tuple[int, ...]:
    """Chunk c on rank c for c < p, on rank 2p - 1 - c after (ZB-V's and DualPipeV's V)."""
    assert virtual_stages == 2
    p = num_stages
    return tuple(c if c < p else 2 * p - 1 - c for c in range(2 * p))


# -- interleaved 1F1B ---------------------------------------------------------------------------


def group_sizes(num_micro_batches: int, size: int) -> list[int]:
    """Micro-batch groups of about `size`: max(1, m // size) groups as equal as possible, the
    larger first (with m a multiple of `size`, groups of exactly `size`)."""
    count = max(1, num_micro_batches // size)
    base, extra = divmod(num_micro_batches, count)
    return [base + (i < extra) for i in range(count)]


def interleaved_warmup(rank: int, p: int, m: int, v: int, group: int) -> int:
    """Forwards before rank's first 1F1B step: (v - 1) * g + 2 * (p - 1 - rank), with g the
    first group's size, at most m * v."""
    return min(m * v, (v - 1) * group_sizes(m, group)[0] + 2 * (p - 1 - rank))


def _interleaved(rank: int, p: int, m: int, v: int, group: int) -> list[Action]:
    chunks = [i * p + rank for i in range(v)]
    groups, start = [], 0
    for size in group_sizes(m, group):
        groups.append(range(start, start + size))
        start += size
    forwards = [Action(c, FORWARD, j) for g in groups for c in chunks for j in g]
    backwards = [Action(c, BACKWARD, j) for g in groups for c in reversed(chunks) for j in g]
    warmup = interleaved_warmup(rank, p, m, v, group)
    order = forwards[:warmup]
    for k, backward in enumerate(backwards):
        if warmup + k < len(forwards):
            order.append(forwards[warmup + k])
        order.append(backward)
    return order


def interleaved_1f1b_order(rank: int, p: int, m: int, v: int) -> list[Action]:
    """Megatron-LM's interleaved 1F1B order of `rank`'s chunks (groups of p micro-batches)."""
    return _interleaved(rank, p, m, v, p)


def eager_interleaved_1f1b_order(rank: int, p: int, m: int, v: int) -> list[Action]:
    """Interleaved 1F1B with groups of 2p micro-batches (more in flight, to hide transfers)."""
    return _interleaved(rank, p, m, v, 2 * p)


# -- ZB-V and DualPipeV ------------------------------------------------------------------------


class _Counters:
    """The next micro-batch of each (chunk, kind): every chunk runs its micro-batches in order."""

    def __init__(self) -> None:
        self.next: dict[tuple[int, str], int] = {}

    def take(self, chunk: int, kind: str) -> Action:
        mb = self.next.get((chunk, kind), 0)
        self.next[(chunk, kind)] = mb + 1
        return Action(chunk, kind, mb)

    def done(self, chunk: int, kind: str) -> int:
        return self.next.get((chunk, kind), 0)


def zbv_order(rank: int, p: int, m: int, v: int = 2) -> list[Action]:
    """ZB-V's order on `rank` (chunks a = rank and b = 2p - 1 - rank)."""
    assert v == 2
    total = max(m, 2 * p - 1)
    a, b = rank, 2 * p - 1 - rank
    n = _Counters()
    # Warm-up: the first forwards of a, until b's first input can arrive; then a and b
    # alternate; then b runs F B W as micro-batches come back from the loss.
    out = [n.take(a, FORWARD) for _ in range(2 * (p - rank) - 1)]
    for _ in range(rank):
        out += [n.take(b, FORWARD), n.take(a, FORWARD)]
    for _ in range(p - rank):
        out += [n.take(b, FORWARD), n.take(b, BACKWARD), n.take(b, WEIGHT)]
    # Steady state: F B W of a, then of b.
    while n.done(b, FORWARD) < n.done(a, FORWARD) or n.done(a, FORWARD) < total:
        if n.done(a, FORWARD) < total:
            out.append(n.take(a, FORWARD))
        out += [n.take(a, BACKWARD), n.take(a, WEIGHT)]
        out += [n.take(b, FORWARD), n.take(b, BACKWARD), n.take(b, WEIGHT)]
    # Cool-down: input gradients first (they unblock other ranks), weight gradients last.
    for _ in range(rank):
        out += [n.take(a, BACKWARD), n.take(b, BACKWARD)]
    for _ in range(p - rank):
        out += [n.take(a, BACKWARD), n.take(a, WEIGHT)]
    for chunk in (b, a):
        while n.done(chunk, WEIGHT) < total:
            out.append(n.take(chunk, WEIGHT))
    return [x for x in out if x.microbatch_index < m]


def dualpipev_order(rank: int, p: int, m: int) -> tuple[list[Action], set[Action]]:
    """DualPipeV's order on `rank`, and the actions fused with their next one."""
    total = max(m, 2 * p)
    a, b = rank, 2 * p - 1 - rank
    n = _Counters()
    pending: deque[Action] = deque()  # W of split backwards
    units: list[list[Action]] = []  # fused runs

    def forward(chunk: int) -> list[Action]:
        return [n.take(chunk, FORWARD)]

    def whole_backward(chunk: int) -> list[Action]:
        b_ = n.take(chunk, BACKWARD)
        return [b_, Action(chunk, WEIGHT, b_.microbatch_index)]

    def input_backward(chunk: int) -> list[Action]:
        b_ = n.take(chunk, BACKWARD)
        pending.append(Action(chunk, WEIGHT, b_.microbatch_index))
        return [b_]

    def weight() -> list[Action]:
        return [pending.popleft()] if pending else []

    def backward(chunk: int, split: bool) -> list[Action]:
        return input_backward(chunk) if split else whole_backward(chunk)

    def run(*parts: list[Action]) -> None:
        """Each part on its own (a whole backward stays fused as B then W)."""
        units.extend(part for part in parts if part)

    def fuse(*parts: list[Action]) -> None:
        units.append([x for part in parts for x in part])

    for _ in range(2 * (p - rank - 1)):
        run(forward(a))
    for _ in range(rank + 1):
        run(forward(a), forward(b))
    for _ in range(p - rank - 1):
        run(input_backward(b), weight(), forward(b))
    # Main phase: F of a with B of b, then F of b with B of a (the last rank starts unfused).
    for i in range(total - 2 * p + rank + 1):
        if i == 0 and rank == p - 1:
            run(forward(a), whole_backward(b))
        else:
            fuse(forward(a), whole_backward(b))
        fuse(forward(b), whole_backward(a))
    for _ in range(p - rank - 1):
        run(whole_backward(b))
        fuse(forward(b), whole_backward(a))
    # Cool-down: from the middle on, split backwards and fill the gaps with their Ws.
    split = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        run(backward(b, split))
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        run(backward(a, split))
    for _ in range(p - rank - 1):
        run(weight(), backward(a, split))
    while pending:
        run(weight())
    order: list[Action] = []
    fused: set[Action] = set()
    for unit in units:
        kept = [x for x in unit if x.microbatch_index < m]
        order += kept
        fused.update(kept[:-1])
    return order, fused


VIRTUAL_ORDERS: dict[str, VirtualOrder] = {
    "interleaved_1f1b": interleaved_1f1b_order,
    "eager_interleaved_1f1b": eager_interleaved_1f1b_order,
    "zbv": zbv_order,
}
PLACEMENTS: dict[str, Callable[[int, int], tuple[int, ...]]] = {
    "interleaved_1f1b": looped_placement,
    "eager_interleaved_1f1b": looped_placement,
    "zbv": v_placement,
    "dualpipev": v_placement,
}
DEFAULT_VIRTUAL_STAGES = {
    "interleaved_1f1b": 2,
    "eager_interleaved_1f1b": 2,
    "zbv": 2,
    "dualpipev": 2,
}
