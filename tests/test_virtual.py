"""Virtual-stage schedules: interleaved 1F1B, ZB-V, DualPipeV (pure; see pipeline/_virtual.py)."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxreshard.pipeline import (
    Costs,
    Schedule,
    ScheduleError,
    build_schedule,
    check_schedule,
    simulate,
)
from jaxreshard.pipeline._schedules import PEAK_BOUNDS
from jaxreshard.pipeline._visualize import format_timeline, plot_timeline, to_chrome_trace

VIRTUAL = ("interleaved_1f1b", "eager_interleaved_1f1b", "zbv", "dualpipev")
EPS = 1e-9


def independent_check(data: dict, costs: Costs) -> None:
    """Check a `jaxreshard-schedule/2` timeline against the rules from first principles.

    Every (chunk, micro-batch) has one F and one B (and one W when split) on its chunk's rank;
    actions of a rank do not overlap and last what the costs say; F of chunk c starts after F of
    c - 1 ended plus the transfer (none within a rank), B of c after B of c + 1 (the last chunk:
    after its own F), W after B; the makespan is the last end.
    """
    assert data["format"] == "jaxreshard-schedule/2"
    p, v, m = data["num_stages"], data["virtual_stages"], data["num_micro_batches"]
    placement = data["placement"]
    n = p * v
    assert len(placement) == n and sorted(placement) == sorted(list(range(p)) * v)
    split = data["split_backward"]
    seen = {}
    for rank, actions in enumerate(data["stages"]):
        previous_end = 0.0
        for a in sorted(actions, key=lambda a: a["start"]):
            c, kind, mb = a["chunk"], a["kind"], a["mb"]
            assert placement[c] == rank, (a, rank)
            assert a["start"] >= previous_end - EPS, ("overlap on rank", rank, a)
            previous_end = a["end"]
            want = {
                "F": costs.forward[c],
                "B": costs.backward[c] - (costs.weight_grad[c] if split else 0.0),
                "W": costs.weight_grad[c],
            }[kind]
            assert a["end"] - a["start"] == pytest.approx(want), a
            assert (c, kind, mb) not in seen, ("duplicate", a)
            seen[(c, kind, mb)] = a
    kinds = ("F", "B", "W") if split else ("F", "B")
    assert set(seen) == {(c, k, j) for c in range(n) for k in kinds for j in range(m)}

    def after(later, earlier, comm):
        assert later["start"] >= earlier["end"] + comm - EPS, (later, earlier, comm)

    def comm(c0, c1):
        return 0.0 if placement[c0] == placement[c1] else costs.comm[min(c0, c1)]

    for c in range(n):
        for j in range(m):
            f, b = seen[(c, "F", j)], seen[(c, "B", j)]
            after(b, f, 0.0)
            if c > 0:
                after(f, seen[(c - 1, "F", j)], comm(c - 1, c))
            if c < n - 1:
                after(b, seen[(c + 1, "B", j)], comm(c, c + 1))
            if split:
                after(seen[(c, "W", j)], b, 0.0)
    ends = [a["end"] for a in seen.values()]
    assert data["makespan"] == pytest.approx(max(ends) - min(a["start"] for a in seen.values()))


@st.composite
def configs(draw):
    name = draw(st.sampled_from(VIRTUAL))
    p = draw(st.integers(1, 6))
    v = draw(st.integers(1, 4)) if "interleaved" in name else 2
    m = draw(st.integers(1, 3 * p + 3))
    n = p * v
    forward = draw(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=n, max_size=n))
    backward = draw(st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=n, max_size=n))
    share = draw(st.sampled_from([0.0, 0.25, 0.5, 1.0]))
    transfers = draw(st.booleans())
    comm = draw(st.lists(st.sampled_from([0.25, 1.0, 2.5]), min_size=n - 1, max_size=n - 1))
    costs = Costs.make(
        n,
        forward=forward,
        backward=backward,
        weight_grad=[b * share for b in backward],
        comm=comm if transfers else 0.0,
    )
    weight_delay = draw(st.booleans())
    return name, p, v, m, costs, weight_delay


@given(configs())
def test_every_virtual_schedule_is_valid_under_an_independent_check(config):
    name, p, v, m, costs, weight_delay = config
    schedule = build_schedule(name, p, m, virtual_stages=v, weight_delay=weight_delay, costs=costs)
    check_schedule(schedule)
    assert schedule.num_chunks == p * v and schedule.virtual_stages == v
    independent_check(simulate(schedule, costs).to_json(), costs)


@pytest.mark.parametrize("name", VIRTUAL)
def test_virtual_schedules_pass_the_checker_on_a_grid(name):
    for p in range(1, 7):
        for v in range(1, 4) if "interleaved" in name else (2,):
            for m in range(1, 3 * p + 2):
                check_schedule(build_schedule(name, p, m, virtual_stages=v))


def test_placements():
    inter = build_schedule("interleaved_1f1b", 4, 8, virtual_stages=3)
    assert inter.placement == (0, 1, 2, 3) * 3
    assert [inter.rank_of(c) for c in (0, 5, 11)] == [0, 1, 3]
    assert inter.chunks_of(1) == (1, 5, 9)
    for name in ("zbv", "dualpipev"):
        v = build_schedule(name, 4, 8)
        assert v.placement == (0, 1, 2, 3, 3, 2, 1, 0)
        assert v.chunks_of(0) == (0, 7) and v.chunks_of(3) == (3, 4)
    assert build_schedule("1f1b", 3, 4).placement == (0, 1, 2)


@given(
    st.integers(1, 8),
    st.integers(1, 4),
    st.integers(1, 4),
    st.sampled_from([0.5, 1.0, 2.0]),
    st.sampled_from([0.5, 1.0, 3.0]),
)
def test_interleaved_meets_its_bound_without_transfers(p, v, groups, forward, backward):
    m = p * groups
    costs = Costs.make(p * v, forward=forward, backward=backward, comm=0)
    for weight_delay in (False, True):
        schedule = build_schedule(
            "interleaved_1f1b", p, m, virtual_stages=v, weight_delay=weight_delay, costs=costs
        )
        makespan = simulate(schedule, costs).makespan
        assert makespan <= (m * v + p - 1) * (forward + backward) + EPS


@pytest.mark.parametrize("p", range(1, 9))
def test_zbv_has_zero_bubble_at_1f1b_memory(p):
    costs = Costs.make(2 * p, forward=1, backward=2, weight_grad=1, comm=0)  # F = B = W = 1
    for m in range(2 * p, 4 * p + 3):
        timeline = simulate(build_schedule("zbv", p, m, costs=costs), costs)
        work = 2 * m * 3
        assert all(timeline.compute_time(r) == work for r in range(p))
        assert timeline.makespan <= work + (p - 1) * 1.0 + EPS
        assert max(timeline.peak_activations) <= 2 * p  # 1F1B's first stage, in chunks


@given(st.integers(1, 6), st.integers(1, 3), st.integers(1, 20), st.sampled_from([0.0, 1.0]))
def test_interleaved_peak_memory_and_weight_delay(p, v, m, comm):
    costs = Costs.make(p * v, forward=1, backward=2, weight_grad=1, comm=comm)
    for name in ("interleaved_1f1b", "eager_interleaved_1f1b"):
        plain = build_schedule(name, p, m, virtual_stages=v)
        delayed = build_schedule(name, p, m, virtual_stages=v, weight_delay=True, costs=costs)
        timeline = simulate(plain, costs)
        assert timeline.peak_activations == tuple(PEAK_BOUNDS[name](r, p, m, v) for r in range(p))
        for r, peak in enumerate(simulate(delayed, costs).peak_activations):
            assert peak <= PEAK_BOUNDS[name](r, p, m, v) + max(1, int(comm))
        assert simulate(delayed, costs).makespan <= timeline.makespan + EPS


def test_interleaved_with_one_chunk_is_eager_1f1b_and_groups_split_evenly():
    for p, m in ((3, 4), (4, 9)):
        one = build_schedule("interleaved_1f1b", p, m, virtual_stages=1)
        assert one.actions == build_schedule("eager_1f1b", p, m).actions
    # m = 7 on 2 ranks: 7 // 2 = 3 groups, of 3, 2 and 2 micro-batches (the larger first).
    rank0 = build_schedule("interleaved_1f1b", 2, 7).actions[0]
    forwards = " ".join(str(a) for a in rank0 if a.kind == "F")
    assert forwards == "0F0 0F1 0F2 2F0 2F1 2F2 0F3 0F4 2F3 2F4 0F5 0F6 2F5 2F6"


GOLDEN = {
    ("interleaved_1f1b", 2, 4): (
        "rank 0 | 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "rank 1 | 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ),
    ("zbv", 2, 4): (
        "rank 0 | 0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0F3 0B0 0W0 3F2 3B2 3W2 0B1 0W1"
        " 3F3 3B3 3W3 0B2 0W2 0B3 0W3",
        "rank 1 | 1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1F3 1B1 1W1 2F3 2B2"
        " 2W2 1B2 2B3 1B3 1W2 2W3 1W3",
    ),
    ("dualpipev", 2, 4): (
        "rank 0 | 0F0 0F1 0F2 3F0 3B0  3W0 3F1 0F3+ 3B1+ 3W1 3F2+ 0B0+ 0W0 3B2+  3W2"
        " 3F3+ 0B1+ 0W1 3B3+ 3W3 0B2 0W2 0B3 0W3",
        "rank 1 | 1F0 2F0 1F1 2F1 1F2 2B0+ 2W0 2F2+ 1B0+ 1W0 1F3+ 2B1+ 2W1 2F3+ 1B1+ "
        " 1W1 2B2+ 2W2 1B2+ 1W2 2B3 1B3 2W3 1W3",
    ),
}


@pytest.mark.parametrize("name, p, m", list(GOLDEN))
def test_golden_grids(name, p, m):
    assert build_schedule(name, p, m).grid() == "\n".join(GOLDEN[name, p, m])


def test_fused_runs_back_to_back_and_send_when_they_end():
    costs = Costs.make(8, forward=1, backward=2, weight_grad=1, comm=0.5)
    schedule = build_schedule("dualpipev", 4, 8)
    assert schedule.fused
    timeline = simulate(schedule, costs)
    for r, stage in enumerate(timeline.stages):
        for t, following in itertools.pairwise(stage):
            if t.action in schedule.fused:
                assert following.start == t.end, (r, t, following)
    ends = {t.action: t.end for stage in timeline.stages for t in stage}
    run_end = {}
    for stage in timeline.stages:
        run = []
        for t in stage:
            run.append(t.action)
            if t.action not in schedule.fused:
                run_end.update({a: t.end for a in run})
                run = []
    for tr in timeline.transfers:
        assert tr.start >= run_end[tr.transfer.producer] - EPS
    assert any(run_end[a] > ends[a] for a in schedule.fused)


def test_transfers_between_chunks_of_one_rank_are_free():
    p = 3
    costs = Costs.make(2 * p, forward=1, backward=2, weight_grad=1, comm=5)
    timeline = simulate(build_schedule("zbv", p, 6), costs)
    local = [t for t in timeline.transfers if {t.transfer.src, t.transfer.dst} == {p - 1, p}]
    assert len(local) == 2 * 6 and all(t.start == t.end for t in local)
    remote = [t for t in timeline.transfers if t not in local]
    assert all(t.end - t.start == 5 for t in remote)
    data = timeline.to_json()
    middle = [t for t in data["transfers"] if {t["src_chunk"], t["dst_chunk"]} == {p - 1, p}]
    assert {(t["src"], t["dst"], t["end"] - t["start"]) for t in middle} == {(p - 1, p - 1, 0)}


def test_virtual_stage_errors():
    with pytest.raises(ValueError, match="gpipe runs one stage per rank"):
        build_schedule("gpipe", 2, 4, virtual_stages=2)
    with pytest.raises(ValueError, match="zbv places exactly two chunks per rank"):
        build_schedule("zbv", 2, 4, virtual_stages=3)
    with pytest.raises(ValueError, match=r"costs are for 2 stages, the schedule has 4 chunks"):
        build_schedule("interleaved_1f1b", 2, 4, weight_delay=True, costs=Costs.make(2))
    with pytest.raises(ValueError, match="give one cost per chunk"):
        simulate(build_schedule("zbv", 2, 4), Costs.make(2))
    with pytest.raises(ValueError, match="give every rank at least one chunk"):
        Schedule("x", 2, 1, False, False, [["0F0", "0B0"], []], (0, 0))


def test_blocking_transfers_are_not_checked_by_default_with_virtual_stages():
    schedule = build_schedule("zbv", 3, 6)
    check_schedule(schedule)  # asynchronous transfers: fine
    with pytest.raises(ScheduleError, match="made for asynchronous transfers"):
        check_schedule(schedule, blocking=True)


def test_apply_steps_one_per_chunk_last():
    schedule = build_schedule("interleaved_1f1b", 2, 4).with_apply()
    check_schedule(schedule)
    assert [str(a) for a in schedule.actions[1][-2:]] == ["1A", "3A"]
    timeline = simulate(schedule, Costs.make(4, apply=0.5))
    assert timeline.stages[1][-1].end - timeline.stages[1][-1].start == 0.5


def test_pictures_show_chunks(tmp_path):
    costs = Costs.make(4, forward=1, backward=2, weight_grad=1, comm=0.5)
    timeline = simulate(build_schedule("dualpipev", 2, 4), costs)
    text = format_timeline(timeline)
    assert text.startswith("rank 0 |0F0|") and "rank 1 |" in text
    trace = to_chrome_trace(timeline)["traceEvents"]
    names = {e["args"]["name"] for e in trace if e.get("name") == "process_name"}
    assert names == {"rank 0", "rank 1"}
    assert any(e.get("name") == "3F0" for e in trace)
    # Chunks 1 -> 2 stay on rank 1: no transfer event for them.
    assert not any(e.get("name", "").endswith("s1->s2") for e in trace)
    png = plot_timeline(timeline, tmp_path / "dpv.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_emitter_refuses_chunks_until_the_runtime_maps_them():
    from jaxreshard.pipeline._emit import emit

    with pytest.raises(ValueError, match="emit: zbv, 2 ranks x 2 virtual stages"):
        emit(build_schedule("zbv", 2, 4), [])
    assert emit(build_schedule("1f1b", 2, 2), [])  # one chunk per rank: as before


def test_hand_written_lists_infer_the_placement():
    lists = [["0F0", "2F0", "2B0", "0B0"], ["1F0", "3F0", "3B0", "1B0"]]
    schedule = Schedule.from_lists(lists)
    assert schedule.placement == (0, 1, 0, 1) and schedule.num_chunks == 4
    check_schedule(schedule)
    with pytest.raises(ValueError, match=r"chunk 2 appears on ranks \[0, 1\]"):
        Schedule.from_lists([["0F0", "2F0", "0B0"], ["1F0", "2B0", "1B0"]])
