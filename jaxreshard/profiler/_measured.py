"""What a profile's recorded steps say: per-stage and per-boundary statistics, and the
pipeline simulator's prediction of the run from its own measured costs (`measured_costs`,
`predicted_step`, `OptimizerPhase`; the `--auto` search predicts other configurations from
them). The steps themselves are run by `_run.py`.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxreshard.pipeline import Costs
from jaxreshard.pipeline._costs import SharedCost
from jaxreshard.pipeline._schedule import PARAM_GRAD
from jaxreshard.profiler._run import StepRecord
from jaxreshard.runtime.engine._events import APPLY_EVENT, ARRIVE, SEND, WAIT

COMPUTE_KINDS = ("F", "B", "W", APPLY_EVENT)
LOCAL_STRATEGY = "local"  # between two stages of one mesh (virtual stages): nothing moves


# -- statistics -----------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def trimmed_mean(values: Sequence[float], cut: float = 0.1) -> float:
    """The mean of `values` without the lowest and the highest `cut` of them (a fraction,
    rounded down to whole values, and at least one each where there are 3 or more: a run of
    few steps times its first transfer once a step); nan for none."""
    ordered = sorted(values)
    k = max(int(len(ordered) * cut), 1 if len(ordered) >= 3 else 0)
    kept = ordered[k : len(ordered) - k]
    return float(statistics.fmean(kept)) if kept else float("nan")


def stage_stats(steps: Sequence[StepRecord], schedule: Any) -> list[dict[str, float]]:
    """Per stage, medians over steps: compute seconds, seconds blocked in RECVs, and the bubble
    of its mesh (1 - the compute of all the rank's stages / step time)."""
    out = []
    rank_of = schedule.rank_of
    for s in range(schedule.num_chunks):
        mates = set(schedule.chunks_of(rank_of(s)))
        compute, blocked, bubble = [], [], []
        for st in steps:
            c = sum(e.end - e.start for e in st.events if e.stage == s and e.kind in COMPUTE_KINDS)
            w = sum(e.end - e.start for e in st.events if e.stage == s and e.kind == WAIT)
            busy = sum(
                e.end - e.start for e in st.events if e.stage in mates and e.kind in COMPUTE_KINDS
            )
            compute.append(c)
            blocked.append(w)
            bubble.append(max(0.0, 1.0 - busy / st.seconds) if st.seconds > 0 else 0.0)
        out.append(
            {
                "stage": s,
                "rank": rank_of(s),
                "compute_seconds": median(compute),
                "blocked_seconds": median(blocked),
                "bubble_fraction": median(bubble),
            }
        )
    return out


def transfer_stats(steps: Sequence[StepRecord], layout: Any) -> list[dict[str, Any]]:
    """Per boundary tensor (and gradient, parameter copy): its layouts, plan and the median
    measured time of one transfer."""
    durations = transfer_durations(steps)
    rows = []
    for t in sorted(layout.transfers.values(), key=_transfer_order):
        measured = durations.get(t.name, [])
        kind = t.name.split(" ")[0].rstrip("0123456789")
        rows.append(
            {
                "name": t.name,
                "kind": kind,
                "src_stage": t.src_stage,
                "dst_stage": t.dst_stage,
                "shape": list(t.shape),
                "dtype": np.dtype(t.dtype).name,
                "src_spec": _spec_text(t.src_spec),
                "dst_spec": _spec_text(t.dst_spec),
                "src_mesh": dict(layout.mesh_shapes[t.src_stage]),
                "dst_mesh": dict(layout.mesh_shapes[t.dst_stage]),
                "strategy": t.plan.strategy if t.plan else LOCAL_STRATEGY,
                "chosen": t.plan.chosen if t.plan else LOCAL_STRATEGY,
                "bytes": t.nbytes,
                "planned_seconds": t.plan.seconds if t.plan else 0.0,
                "measured_seconds": median(measured) if measured else None,
                "per_step": len(measured) / max(1, len(steps)),
            }
        )
    return rows


def _transfer_order(t: Any) -> tuple[Any, ...]:
    kind = t.name.split(" ")[0].rstrip("0123456789")
    order = {"act": 0, "grad": 1, "param": 2, "param_grad": 3}
    return (order.get(kind, 9), t.src_stage, t.dst_stage, t.name)


def _spec_text(spec: Any) -> str:
    parts = []
    for entry in tuple(spec):
        if entry is None:
            parts.append("None")
        elif isinstance(entry, tuple):
            parts.append("(" + ",".join(entry) + ")")
        else:
            parts.append(str(entry))
    return "P(" + ", ".join(parts) + ")"


# -- the simulator's prediction for a measured run ------------------------------------------------


_BLOCKED = 20e-6  # a receive that took longer waited for its value (a ready one takes ~5 us)


def transfer_durations(steps: Sequence[StepRecord]) -> dict[str, list[float]]:
    """Per transfer name: each micro-batch's time on the wire, from the start of its send to
    its arrival at the last receiver (the `arrive` events of every receiving host, on the
    driver's clock), or to the send's end where no receiver records one (a transfer inside a
    process, whose send ends when the value is there). A sender's own end (its bytes handed
    to the transport) says nothing of the link: on 0.01 GB/s NICs a 1 MiB activation's send
    ended after 1.5 ms, its arrival 105 ms later. Where a receiver was blocked waiting for it,
    the transfer ends when that wait did (the receiving thread woke with the value): in one
    process a send's end is its arrival, but the blocked receiver woke 0.6 ms later (median;
    mean 1.7 ms) on this 2-core VM with 4 stages' threads."""
    out: dict[str, list[float]] = {}
    for st in steps:
        for (name, _), (start, end) in _transfer_spans(st).items():
            out.setdefault(name, []).append(end - start)
    return out


def _transfer_spans(st: StepRecord) -> dict[tuple[str, int], tuple[float, float]]:
    """Per (transfer name, micro-batch) of a step: its send's start and its arrival (see
    `transfer_durations`)."""
    arrivals: dict[tuple[str, int], float] = {}
    for e in st.events:
        if e.kind == ARRIVE or (e.kind == WAIT and e.end - e.start > _BLOCKED):
            key = (e.name, e.mb)
            arrivals[key] = max(arrivals.get(key, e.end), e.end)
    return {
        (e.name, e.mb): (e.start, max(e.end, arrivals.get((e.name, e.mb), e.end)))
        for e in st.events
        if e.kind == SEND and e.nbytes > 0
    }


def link_service_times(
    steps: Sequence[StepRecord], layout: Any
) -> dict[tuple[int, int, str], list[float]]:
    """Per (src chunk, dst chunk, kind) the times the simulator's links took, as measured:
    kind `x` is a micro-batch's activations (src < dst, adjacent chunks) or gradients (src >
    dst), `param` the copies of the parameters src keeps and dst reads, `param_grad` their
    gradients back. Each is all of that micro-batch's (or step's) tensors between the two
    chunks, from the end of the action that made them (the F, the B; for `param_grad` the last
    action of the user's rank, after which its program sends it; else the first send's
    start), or from the previous arrival on the same link if later, to the last one's
    arrival.

    A transfer's own time (`transfer_durations`) counts its wait behind the ones before it
    on the link, which the simulator queues itself, and leaves out the time before its send
    starts, which the simulator does not know of. On the 2-host emulated cluster at 0.01
    GB/s (one core per host):
    - eager-1F1B sent a tiny GPT's activations faster than the link took them: their
      medians (5.0 ms, the queue in them) predicted its step 24% long;
    - under ZB-H1 a host's sender thread began a send 0.1-1.4 ms after its F had ended (the
      host's one core was dispatching the next action): from the send's start, the step
      was predicted 12% short;
    - the tied embedding's gradient took 12.8 ms behind 4 micro-batches' gradients and
      2.7 ms behind 8 smaller ones: its queue, not the link.
    Kinds `first` and `later` repeat the activations of the first micro-batch and of the
    others (`Costs.comm_first` is the first's extra over the others'): on Ray a
    step's first send over a boundary arrived 1-4 ms later than the others (a tiny GPT under
    ZB-H1, the user-model template's MLP), which delays every stage after it. On a link
    shaped by a token bucket (the emulated cluster's `tc tbf`, 128 KiB of burst) the first
    after an idle spell goes sooner: a tiny U-Transformer's first micro-batch's activations
    took 5.5 ms where the others took 21, and with that extra held at 0 its steps were
    predicted 4-12% long; so the extra may be negative."""
    names = {t.name: t for t in layout.transfers.values()}
    rank_of = layout.schedule.rank_of
    out: dict[tuple[int, int, str], list[float]] = {}
    for st in steps:
        made: dict[tuple[int, str, int], float] = {}  # (chunk, kind, mb) -> its end
        last: dict[int, float] = {}  # rank -> its last action's end
        for e in st.events:
            if e.kind in ("F", "B", "W", "FB") and 0 <= e.stage < layout.schedule.num_chunks:
                made[(e.stage, e.kind, e.mb)] = e.end
                r = rank_of(e.stage)
                last[r] = max(last.get(r, e.end), e.end)
        groups: dict[tuple[int, int, int, str], list[float]] = {}  # -> [start, end]
        for (name, mb), (start, end) in _transfer_spans(st).items():
            t, kind = names.get(name), _kind(name)
            if t is None:
                continue
            src, dst = t.src_stage, t.dst_stage
            if kind in ("act", "grad"):
                if abs(src - dst) != 1:
                    continue  # (a skip past a stage: no boundary of the simulator's)
                by = "F" if src < dst else "B"
                start = made.get((src, by, mb), made.get((src, "FB", mb), start))
                kind = "x"
            elif kind == "param_grad":  # (sent after its rank's last action: `_emit`)
                start = last.get(rank_of(src), start)
            span = groups.setdefault((src, dst, mb, kind), [start, end])
            span[0], span[1] = min(span[0], start), max(span[1], end)
        free: dict[tuple[int, int], float] = {}
        order = {"param": 0, "x": 1, "param_grad": 2}  # (ties: in the order they are sent)
        ranked = sorted(groups.items(), key=lambda g: (g[1][0], order[g[0][3]], g[1][1]))
        for (src, dst, mb, kind), (start, end) in ranked:
            link = (src, dst)
            begin = max(start, free.get(link, start))
            out.setdefault((src, dst, kind), []).append(max(0.0, end - begin))
            if kind == "x" and src < dst:  # (the step's first on the boundary, and the rest)
                what = "first" if mb == 0 else "later"
                out.setdefault((src, dst, what), []).append(max(0.0, end - begin))
            free[link] = max(free.get(link, end), end)
    return out


def host_between_actions(steps: Sequence[StepRecord], schedule: Any) -> list[float]:
    """Per chunk, the mean time its rank spends after one of the chunk's F, B or W actions
    before the rank's next action starts, less the time it waits there for a receive (see
    [Note: host time between actions]); 0.0 for a chunk no action of which another followed.

    [Note: host time between actions]
    A stage's thread posts the sends of an action's outputs (a resharding, a put on the
    transport) and drops what is dead before it dispatches the next action, and a timed step
    blocks on each action; none of that is inside an action's own time. On this 2-core VM it
    took 0.3-0.6 ms per action of a tiny GPT (a 64 KiB in-process send 0.2-2 ms), beside
    actions of 1-5 ms: the simulator, which ran a rank's actions back to back, predicted its
    steps 5-10% short. So the simulator keeps a rank busy for this time after each action
    (`Costs.host`), with the action's outputs already sent: a receiver waits for the transfer,
    not for the sender's host."""
    rank_of = schedule.rank_of
    gaps: dict[int, list[float]] = {}
    for st in steps:
        by_rank: dict[int, list[Any]] = {}
        waits: dict[int, list[Any]] = {}
        for e in st.events:
            if 0 <= e.stage < schedule.num_chunks:
                if e.kind in ("F", "B", "W", "FB"):
                    by_rank.setdefault(rank_of(e.stage), []).append(e)
                elif e.kind in (WAIT, APPLY_EVENT):  # (a gradient sum `{c}R`: the apply's)
                    waits.setdefault(rank_of(e.stage), []).append(e)
        for r, actions in by_rank.items():
            actions.sort(key=lambda e: e.start)
            for x, y in itertools.pairwise(actions):
                waited = sum(max(0.0, min(w.end, y.start) - max(w.start, x.end))
                             for w in waits.get(r, ()))  # fmt: skip
                gaps.setdefault(x.stage, []).append(max(0.0, y.start - x.end - waited))
    return [statistics.fmean(gaps[c]) if c in gaps else 0.0 for c in range(schedule.num_chunks)]


def _kind(name: str) -> str:
    """A runtime transfer's kind from its name: `act`, `grad`, `param` or `param_grad`."""
    return name.split(" ")[0].rstrip("0123456789")


def typical_steps(steps: Sequence[StepRecord], factor: float = 2.0) -> list[StepRecord]:
    """The steps at most `factor` times the median step. A stall (a tiny GPT's forward once
    took 140 ms inside a 56 ms step) is left out of the costs, as the median of the measured
    steps leaves it out of the step time: kept in, its one action set its chunk's mean
    forward to 2.4x the others' and predicted a ZB-H1 step 20% long."""
    if not steps:
        return list(steps)
    mid = median([st.seconds for st in steps])
    return [st for st in steps if st.seconds <= factor * mid]


def measured_costs(steps: Sequence[StepRecord], layout: Any) -> Costs:
    """The schedule cost model of a measured run (seconds): per stage the mean F, B, W and
    optimizer (A) times (the first micro-batch's extra apart: `Costs.forward_first`, ...) and
    its host's time between actions (`host_between_actions`); per
    boundary the time the link took a micro-batch's activations (those after the
    first; the first's extra is `comm_first`) and, apart, its gradients; the shared
    parameters' copies and gradients (all as `link_service_times` times them).

    Compute times are means, not medians: a step lasts the sum of its actions, and the sum of
    n actions is n means; on a loaded machine action times are skewed (a few stretched by
    another process), and medians of them predicted steps 6-10% short. Transfer times are
    means without the lowest and highest tenth (`trimmed_mean`): on a shaped link a
    transfer's time spreads (its token bucket's credit), and those on the critical path add
    up, so medians predicted steps short (the emulated cluster's median error over 30
    recorded runs: 3.5% with medians, 2.7% trimmed); a boundary's plain mean is set by its
    rare long ones (a U-Transformer skip's mean was 22x its median; plain means: 3.1%).
    Steps over twice the median step are left out (`typical_steps`).

    [Note: the first micro-batch's actions]
    A chunk's first backward of a step starts its gradient accumulators in fresh buffers
    (`runtime.step._programs`); later ones add into them in place. On the 2-host emulated
    cluster the deep MLP of the user-model template took 3-6 ms for its first W on every
    chunk and 1-2 ms for the others. Averaged over all micro-batches, that time sat on the
    later Ws (under ZB-V, bubble fillers) instead of the first (on the critical path), and
    its steps were predicted 4-14% short (1-10% with the first's extra apart). So each
    action kind's mean is over the micro-batches after the first, and the first's extra is
    its own cost (none where the first was no slower: then the mean of all). Replaying 30
    recorded runs of ten configurations, the median error went from 3.9% to 3.5% with this
    and the fixes beside it (`comm_first` below zero, a shared gradient sent after its
    rank's last action), and to 2.7% with trimmed means for the transfers."""
    steps = typical_steps(steps)
    schedule = layout.schedule
    n = schedule.num_chunks
    times: dict[tuple[int, str, bool], list[float]] = {}  # (chunk, kind, first mb?) -> times
    applied: dict[int, list[float]] = {}
    for st in steps:
        step_applied: dict[int, float] = {}
        for e in st.events:
            if e.kind in ("F", "B", "W"):
                times.setdefault((e.stage, e.kind, e.mb == 0), []).append(e.end - e.start)
            elif e.kind == APPLY_EVENT:
                step_applied[e.stage] = step_applied.get(e.stage, 0.0) + e.end - e.start
        for s, seconds in step_applied.items():
            applied.setdefault(s, []).append(seconds)

    def mean(s: int, kind: str) -> tuple[float, float]:
        """Chunk s's mean `kind` time after the first micro-batch, and the first's extra
        over it (0.0 where it was no longer: then the mean of all)."""
        first, later = times.get((s, kind, True), []), times.get((s, kind, False), [])
        if not first or not later:
            return (statistics.fmean(first + later) if first or later else 0.0), 0.0
        extra = statistics.fmean(first) - statistics.fmean(later)
        if extra <= 0:
            return statistics.fmean(first + later), 0.0
        return statistics.fmean(later), extra

    split = schedule.split_backward
    f, b, w = ([mean(s, kind) for s in range(n)] for kind in "FBW")
    forward = [x for x, _ in f]
    backward = [x + (y if split else 0.0) for (x, _), (y, _) in zip(b, w)]
    weight = [y if split else x / 2 for (y, _), x in zip(w, backward)]
    backward_first = [x + (y if split else 0.0) for (_, x), (_, y) in zip(b, w)]
    weight_first = [y if split else x / 2 for (_, y), x in zip(w, backward_first)]
    service = link_service_times(steps, layout)

    def seconds(src: int, dst: int, kind: str = "x") -> float:
        values = service.get((src, dst, kind))
        return trimmed_mean(values) if values else 0.0

    # Activations: the micro-batches after the first (the first's extra apart: comm_first).
    comm = [seconds(b, b + 1, "later" if (b, b + 1, "later") in service else "x")
            for b in range(n - 1)]  # fmt: skip
    comm_back = [seconds(b + 1, b) for b in range(n - 1)]
    first = [
        seconds(b, b + 1, "first") - comm[b] if (b, b + 1, "first") in service else 0.0
        for b in range(n - 1)
    ]
    # Shared parameters, per owner and user: their copies, and their gradients back.
    pairs = {(o, u) for o, u, kind in service if kind == "param"}
    grads = {(o, u) for u, o, kind in service if kind == "param_grad"}
    shared = [
        SharedCost(o, u, seconds(o, u, "param"), (o, u) in grads, seconds(u, o, "param_grad"))
        for o, u in sorted(pairs)
    ]
    return Costs.make(
        n,
        forward=forward,
        backward=backward,
        weight_grad=weight,
        comm=comm,
        apply=[statistics.fmean(applied[s]) if s in applied else 0.0 for s in range(n)],
        host=host_between_actions(steps, schedule),
        comm_back=comm_back,
        comm_first=first,
        forward_first=[x for _, x in f],
        backward_first=backward_first,
        weight_grad_first=weight_first,
    ).with_shared(shared)


def step_overhead(steps: Sequence[StepRecord]) -> float:
    """The median time a step spends outside its stages' actions: from the call to the first
    action (the driver splitting the batch and dispatching to the hosts) and from the last
    action's end to the call's return (results back to the driver)."""
    spans = [
        min(e.start for e in st.events) + st.seconds - max(e.end for e in st.events)
        for st in steps
        if st.events
    ]
    return max(0.0, median(spans)) if spans else 0.0


def predicted_step(steps: Sequence[StepRecord], layout: Any) -> tuple[float, Costs]:
    """What the pipeline simulator says a step of this schedule takes with the measured costs
    (transfers overlapping compute, as the runtime runs them), and those costs.

    A parameter shared by two stages (a tied embedding) is in the costs (`Costs.shared`, as
    measured): the simulator sends its copy at the step's start, ahead of the activations on
    the same link, and its gradient back after the user's rank's last action. The optimizer
    segments run after the pipeline (`OptimizerPhase`). The step's fixed cost outside the
    pipeline (`step_overhead`: dispatch and results) is added as measured.
    """
    costs = measured_costs(steps, layout)
    phase = OptimizerPhase.measured(steps, layout.schedule)
    return phase.predict(layout.schedule, costs) + step_overhead(steps), costs


@dataclasses.dataclass(frozen=True)
class OptimizerPhase:
    """When a step's optimizer segments end, from a simulation of its pipeline whose applies
    took no time ([Note: the optimizer after the pipeline]).

    Attributes:
        hosts: per rank (mesh), its lead host (`StepRecord.hosts`, by the rank of each
            chunk): a schedule of the same meshes and another placement of chunks (ZB-V's V
            against interleaved) finds each chunk's host through its own placement.
        seconds: per host, the measured mean time from its stages' last F, B or W (or
            receive) to the end of the last optimizer segment it ran (`apply_phases`).
        on_driver: the chunks whose segments the driver ran (`StepRecord.driver_stages`).

    [Note: the optimizer after the pipeline]
    A host runs the optimizer segments of its stages after all of its ranks' programs have
    ended, dispatched in order (on separate devices they may overlap; the time is measured,
    not summed); the driver runs a segment whose inputs sit on several hosts after every
    host's part, in turn. The simulator ran each chunk's apply after that chunk's last
    action, beside the other ranks' work: on one host of two tiny-GPT stages, 1.6 ms before
    the segments really began. So a prediction simulates the pipeline without its applies,
    then ends each host's part its measured time (`seconds`) after its last action, or after
    a shared parameter's gradient is back (the summed applies where it ran none), and adds
    the driver's applies after the latest.
    """

    hosts: tuple[int, ...]
    seconds: dict[int, float]
    on_driver: tuple[int, ...]

    @classmethod
    def measured(cls, steps: Sequence[StepRecord], schedule: Any) -> OptimizerPhase:
        steps = typical_steps(steps)
        last = steps[-1] if steps else StepRecord(0.0, 0.0, [])
        on_driver = tuple(sorted(set(last.driver_stages)))
        n, p = schedule.num_chunks, schedule.num_stages
        chunk_hosts = last.hosts if len(last.hosts) == n else tuple(range(n))
        ranks = {schedule.rank_of(c): chunk_hosts[c] for c in range(n)}
        hosts = tuple(ranks.get(r, r) for r in range(p))
        return cls(hosts, apply_phases(steps, chunk_hosts, on_driver), on_driver)

    def hosts_of(self, schedule: Any) -> tuple[int, ...]:
        """Per chunk of `schedule`, its host (each rank its own where the rank counts differ)."""
        p = schedule.num_stages
        hosts = self.hosts if len(self.hosts) == p else tuple(range(p))
        return tuple(hosts[schedule.rank_of(c)] for c in range(schedule.num_chunks))

    @staticmethod
    def last_actions(timeline: Any) -> dict[int, float]:
        """Per chunk, when its last simulated F, B or W ends."""
        last: dict[int, float] = {}
        for rank in timeline.stages:
            for t in rank:
                if t.action.kind != "A":
                    c = t.action.stage_index
                    last[c] = max(last.get(c, t.end), t.end)
        return last

    def predict(self, schedule: Any, costs: Costs) -> float:
        """The simulated step (without its fixed cost) of `schedule` under `costs`, its
        optimizer run after the pipeline."""
        from jaxreshard.pipeline import simulate

        n = costs.num_stages
        timeline = simulate(schedule.with_apply(), dataclasses.replace(costs, apply=(0.0,) * n))
        return self.end(timeline, costs.apply)

    def end(self, timeline: Any, apply: Sequence[float]) -> float:
        """The step's end (without its fixed cost): `timeline` simulated with no apply time,
        `apply` each chunk's measured optimizer seconds."""
        hosts = self.hosts_of(timeline.schedule)
        n = len(hosts)
        gradients: dict[int, float] = {}  # chunk -> when its shared parameters' gradients are in
        for tt in timeline.transfers:
            if tt.transfer.kind == PARAM_GRAD:
                c = tt.transfer.dst
                gradients[c] = max(gradients.get(c, tt.end), tt.end)
        last = self.last_actions(timeline)
        end = timeline.makespan
        for h in set(hosts):
            here = [c for c in range(n) if hosts[c] == h]
            at = max(max(last.get(c, 0.0), gradients.get(c, 0.0)) for c in here)
            mine = [c for c in here if c not in self.on_driver]
            end = max(end, at + (self.seconds.get(h, sum(apply[c] for c in mine)) if mine else 0))
        return end + sum(apply[c] for c in self.on_driver)


def apply_phases(
    steps: Sequence[StepRecord], host_of: Sequence[int], on_driver: Sequence[int]
) -> dict[int, float]:
    """Per host, the mean time from the end of its stages' last F, B or W (or receive: a shared
    parameter's gradient) to the end of their last optimizer segment run there (not by the
    driver): the host winds its ranks' threads
    down, places the gradients and runs the segments one after another (on this 2-core VM a
    tiny GPT's two stages in one process: 1.6 ms before the first, then 1.0 and 1.1 ms each,
    where their summed applies said 2.1 ms after the later stage's last action)."""
    spans: dict[int, list[float]] = {}
    for st in steps:
        last: dict[int, float] = {}
        applied: dict[int, float] = {}
        for e in st.events:
            if not 0 <= e.stage < len(host_of):
                continue
            h = host_of[e.stage]
            if e.kind in ("F", "B", "W", "FB", WAIT):  # (a wait: the gradient of a shared one)
                last[h] = max(last.get(h, e.end), e.end)
            elif e.kind == APPLY_EVENT and not (e.stage in on_driver and e.name == "apply"):
                applied[h] = max(applied.get(h, e.end), e.end)
        for h, end in applied.items():
            if h in last:
                spans.setdefault(h, []).append(max(0.0, end - last[h]))
    return {h: statistics.fmean(v) for h, v in spans.items()}
