import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxreshard._files import InputError
from jaxreshard.pipeline import (
    SCHEDULE_NAMES,
    Action,
    Costs,
    Schedule,
    ScheduleError,
    build_schedule,
    check_schedule,
    simulate,
)
from jaxreshard.pipeline._costs import SharedCost
from jaxreshard.pipeline._formats import costs_from_json
from jaxreshard.pipeline._schedules import PEAK_BOUNDS
from jaxreshard.pipeline._virtual import PLACEMENTS
from jaxreshard.pipeline._visualize import format_timeline


def test_action_prints_and_parses():
    for text in ("2F0", "0B13", "7W2", "3A"):
        assert str(Action.parse(text)) == text
    assert Action.parse("2F0") == Action(2, "F", 0)
    with pytest.raises(ValueError, match="cannot parse action 'F2'"):
        Action.parse("F2")
    with pytest.raises(ValueError, match="need a micro-batch index"):
        Action(0, "F")


def test_checker_accepts_every_schedule_up_to_8_stages_and_32_micro_batches():
    one_chunk = [name for name in SCHEDULE_NAMES if name not in PLACEMENTS]  # others: test_virtual
    # Every count up to 12, then a spread (placing delayed Ws simulates each candidate: slow).
    counts = [*range(1, 13), 15, 16, 17, 24, 31, 32]
    for p in range(1, 9):
        for m in counts:
            for name in one_chunk:
                for weight_delay in (False, True):
                    check_schedule(build_schedule(name, p, m, weight_delay=weight_delay))


GOLDEN = {
    ("1f1b", False): """\
stage 0 | 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3
stage 1 | 1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3
stage 2 | 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3""",
    ("gpipe", False): """\
stage 0 | 0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3
stage 1 | 1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3
stage 2 | 2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3""",
    ("eager_1f1b", False): """\
stage 0 | 0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3
stage 1 | 1F0 1F1 1F2 1B0 1F3 1B1 1B2 1B3
stage 2 | 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3""",
    ("eager_1f1b", True): """\
stage 0 | 0F0 0F1 0F2 0F3 0B0 0W0 0B1 0W1 0B2 0W2 0B3 0W3
stage 1 | 1F0 1F1 1F2 1B0 1F3 1B1 1W0 1B2 1W1 1W2 1B3 1W3
stage 2 | 2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3 2B3 2W1 2W2 2W3""",
    ("zb_h1", False): """\
stage 0 | 0F0 0F1 0F2 0B0 0W0 0F3 0B1 0W1 0B2 0W2 0B3 0W3
stage 1 | 1F0 1F1 1B0 1F2 1B1 1W0 1W1 1F3 1B2 1W2 1B3 1W3
stage 2 | 2F0 2B0 2F1 2B1 2W0 2W1 2F2 2B2 2W2 2F3 2B3 2W3""",
}


@pytest.mark.parametrize("name, weight_delay", list(GOLDEN))
def test_golden_grids(name, weight_delay):
    assert (
        build_schedule(name, 3, 4, weight_delay=weight_delay).grid() == GOLDEN[name, weight_delay]
    )


def test_golden_time_grid():
    costs = Costs.make(3, forward=1, backward=2, weight_grad=1, comm=0)
    text = format_timeline(simulate(build_schedule("zb_h1", 3, 4, costs=costs), costs))
    assert (
        text
        == """\
stage 0 |F0|F1|F2|......B0|W0|F3|B1|W1|B2|W2|B3|W3|
stage 1 |...F0|F1|...B0|F2|B1|W0|F3|B2|W1|B3|W2|W3|
stage 2 |......F0|B0|F1|B1|F2|B2|W0|F3|B3|W1|W2|W3|
(one column = 0.333 time units; '.' idle; makespan 14)"""
    )


@given(
    st.integers(1, 8),
    st.integers(1, 32),
    st.sampled_from([0.5, 1.0, 3.0]),
    st.sampled_from([0.5, 2.0, 4.0]),
)
def test_gpipe_and_1f1b_match_the_analytic_makespan(p, m, forward, backward):
    costs = Costs.make(p, forward=forward, backward=backward, comm=0)
    for name in ("gpipe", "1f1b"):
        timeline = simulate(build_schedule(name, p, m), costs)
        assert timeline.makespan == pytest.approx((m + p - 1) * (forward + backward))


uniform_costs = st.builds(
    lambda f, b, w, c: (f, b, b * w, c),
    st.sampled_from([0.5, 1.0, 2.0]),
    st.sampled_from([0.5, 1.0, 2.0, 4.0]),
    st.sampled_from([0.0, 0.25, 0.5, 1.0]),
    st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0]),
)


@given(st.integers(1, 8), st.integers(1, 32), uniform_costs)
def test_peak_activation_bounds(p, m, fbwc):
    forward, backward, weight_grad, comm = fbwc
    costs = Costs.make(p, forward=forward, backward=backward, weight_grad=weight_grad, comm=comm)
    extra = max(1, math.ceil(comm / forward))
    for name in ("gpipe", "1f1b", "eager_1f1b"):
        plain = simulate(build_schedule(name, p, m), costs).peak_activations
        delayed = build_schedule(name, p, m, weight_delay=True, costs=costs)
        for i in range(p):
            assert plain[i] <= PEAK_BOUNDS[name](i, p, m)
            assert delayed_peak(delayed)[i] <= PEAK_BOUNDS[name](i, p, m) + extra
    assert simulate(build_schedule("gpipe", p, m), costs).peak_activations == (m,) * p
    zb = build_schedule("zb_h1", p, m, costs=costs)
    assert max(delayed_peak(zb)) <= min(m, p)  # 1F1B's peak


def delayed_peak(schedule):
    from jaxreshard.pipeline._simulate import peak_activations

    return peak_activations(schedule)


@given(st.integers(1, 6), st.integers(1, 24), uniform_costs)
def test_eager_and_weight_delay_are_never_slower_with_overlap(p, m, fbwc):
    forward, backward, weight_grad, comm = fbwc
    costs = Costs.make(p, forward=forward, backward=backward, weight_grad=weight_grad, comm=comm)

    def makespan(name, weight_delay=False):
        schedule = build_schedule(name, p, m, weight_delay=weight_delay, costs=costs)
        return simulate(schedule, costs).makespan

    one_f_one_b = makespan("1f1b")
    eager = makespan("eager_1f1b")
    assert eager <= one_f_one_b + 1e-9
    assert makespan("eager_1f1b", True) <= min(eager, one_f_one_b) + 1e-9
    assert makespan("1f1b", True) <= one_f_one_b + 1e-9
    assert makespan("gpipe", True) <= makespan("gpipe") + 1e-9


def test_overlap_ablation_of_the_paper():
    p, m = 4, 16
    costs = Costs.make(p, forward=1, backward=2, weight_grad=1, comm=1)

    def makespan(name, weight_delay=False, overlap=True):
        schedule = build_schedule(
            name, p, m, weight_delay=weight_delay, costs=costs, overlap=overlap
        )
        return simulate(schedule, costs, overlap=overlap).makespan

    no_overlap = makespan("1f1b", overlap=False)
    one_f_one_b = makespan("1f1b")
    eager = makespan("eager_1f1b")
    eager_delay = makespan("eager_1f1b", True)
    assert no_overlap > one_f_one_b > eager > eager_delay
    assert eager_delay <= 0.75 * one_f_one_b


def test_zb_h1_bubble_is_a_third_of_1f1b():
    for p, m in ((2, 4), (4, 8), (4, 16), (8, 32)):
        costs = Costs.make(p, forward=1, backward=2, weight_grad=1, comm=0)
        busy = m * 3
        one_f_one_b = simulate(build_schedule("1f1b", p, m), costs).makespan - busy
        zb = simulate(build_schedule("zb_h1", p, m, costs=costs), costs).makespan - busy
        assert zb == pytest.approx(one_f_one_b / 3)


def test_blocking_transfers_block_both_stages():
    costs = Costs.make(2, forward=1, backward=2, comm=1)
    schedule = build_schedule("gpipe", 2, 2)
    overlapped = simulate(schedule, costs, overlap=True)
    blocking = simulate(schedule, costs, overlap=False)
    # Overlap: stage 0 sends mb0 while computing F1. Blocking: the send of mb0 holds stage 0.
    assert [(t.start, t.end) for t in overlapped.stages[0]][:2] == [(0, 1), (1, 2)]
    assert [(t.start, t.end) for t in blocking.stages[0]][:2] == [(0, 1), (2, 3)]
    assert blocking.makespan > overlapped.makespan


def test_timeline_json_format():
    costs = Costs.make(2, forward=1, backward=2, weight_grad=1, comm=0.5)
    data = simulate(build_schedule("1f1b", 2, 3, weight_delay=True, costs=costs), costs).to_json()
    assert data["format"] == "jaxreshard-schedule/2"
    assert {
        "schedule",
        "weight_delay",
        "num_stages",
        "num_micro_batches",
        "costs",
        "makespan",
        "bubble_fraction",
        "peak_activations",
        "stages",
        "transfers",
    } <= set(data)
    assert len(data["stages"]) == 2
    for stage in data["stages"]:
        assert sorted(a["kind"] for a in stage) == ["B"] * 3 + ["F"] * 3 + ["W"] * 3
        for a in stage:
            assert a["end"] >= a["start"] >= 0
    kinds = sorted(t["kind"] for t in data["transfers"])
    assert kinds == ["activation"] * 3 + ["gradient"] * 3
    b_dur = [a["end"] - a["start"] for a in data["stages"][0] if a["kind"] == "B"]
    assert b_dur == [1.0, 1.0, 1.0]  # backward minus weight_grad
    # /2 over /1: chunks (with one chunk per rank, a stage's chunk is its index).
    assert data["virtual_stages"] == 1 and data["placement"] == [0, 1]
    assert {a["chunk"] for a in data["stages"][1]} == {1}
    assert all(t["src_chunk"] == t["src"] and t["dst_chunk"] == t["dst"] for t in data["transfers"])


def broken(lists):
    return Schedule.from_lists([s.split() for s in lists])


@pytest.mark.parametrize(
    "lists, culprit, reason",
    [
        (["0F0 0B0", "1F0 1B0 1B0"], ">1B0<", "appears 2 times"),
        (["0F0 0B0", "1B0 1F0"], ">1B0<", "B before F"),
        (["0F0 0W0 0B0", "1F0 1B0 1W0"], ">0W0<", "W before B"),
        (["0F0 0B0", "1F0 0B0"], ">0B0<", "belongs to stage 0"),
        (["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"], ">0B0<", "waits for send grad mb0"),
        (
            ["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1", "2F1 2B1 2F0 2B0"],
            "<-- ERROR HERE",
            "cannot finish",
        ),
    ],
)
def test_checker_rejects_broken_schedules_with_a_marked_grid(lists, culprit, reason):
    with pytest.raises(ScheduleError) as info:
        check_schedule(broken(lists))
    message = str(info.value)
    assert culprit in message and reason in message and "stage 1 |" in message


def test_checker_reports_missing_actions():
    with pytest.raises(ScheduleError, match="stage 1 lacks 1B1"):
        check_schedule(broken(["0F0 0F1 0B0 0B1", "1F0 1F1 1B0"]))


def test_checker_finds_blocking_deadlock():
    # Fine with asynchronous transfers. With blocking ones, stage 0's batch after F1 (send mb1,
    # receive the gradient of mb1) waits for stage 1, whose batch after B0 (send the gradient of
    # mb0, receive mb1) waits for stage 0 to post the receive of mb0's gradient, which comes
    # only after B1.
    schedule = broken(["0F0 0F1 0B1 0B0", "1F0 1B0 1F1 1B1"])
    check_schedule(schedule, blocking=False)
    simulate(schedule, Costs.make(2), overlap=True)
    with pytest.raises(ScheduleError, match="deadlocks with blocking transfers"):
        check_schedule(schedule)


def test_apply_step_comes_last():
    schedule = build_schedule("1f1b", 3, 4).with_apply()
    check_schedule(schedule)
    assert all(stage[-1] == Action(s, "A") for s, stage in enumerate(schedule.actions))
    costs = Costs.make(3, apply=0.5)
    timeline = simulate(schedule, costs)
    assert timeline.stages[0][-1].end - timeline.stages[0][-1].start == 0.5
    with pytest.raises(ScheduleError, match="after the stage's last B/W"):
        check_schedule(broken(["0F0 0A 0B0", "1F0 1B0"]))


def test_a_shared_parameter_delays_its_readers_first_action_and_its_owners_apply():
    """A parameter chunk 0 keeps and chunk 2 also reads (a tied embedding): its copy leaves at
    the start, before the activations on that link, and chunk 2's first action waits for it;
    chunk 2's gradient contribution goes back after its last action, and chunk 0's apply
    waits for it. Chunks on one rank (a V) share it for free."""
    schedule = build_schedule("1f1b", 3, 4).with_apply()
    plain = Costs.make(3, forward=1, backward=2, comm=0.5, apply=1)
    shared = dataclasses.replace(plain, shared=(SharedCost(0, 2, 10.0),))
    before, after = simulate(schedule, plain), simulate(schedule, shared)
    first = {s: stage[0].start for s, stage in enumerate(after.stages)}
    assert first[2] >= 10.0 > before.stages[2][0].start
    back = next(t for t in after.transfers if t.transfer.kind == "param_grad")
    last_of_2 = max(t.end for t in after.stages[2] if t.action.kind != "A")
    assert (back.start, back.end) == (last_of_2, last_of_2 + 10.0)
    assert after.stages[0][-1].start >= back.end  # 0A
    copy = next(t for t in after.transfers if t.transfer.kind == "param")
    assert (copy.start, copy.end) == (0.0, 10.0)
    assert after.makespan >= before.makespan + 10.0
    # A read without a gradient (grad=False) sends nothing back; two chunks of one rank pay
    # nothing.
    no_grad = (SharedCost(0, 2, 10.0, grad=False),)
    timeline = simulate(schedule, dataclasses.replace(shared, shared=no_grad))
    assert [t.transfer.kind for t in timeline.transfers].count("param_grad") == 0
    assert timeline.makespan < after.makespan
    v = build_schedule("zbv", 2, 4).with_apply()  # chunks 0 and 3 on rank 0
    costs = Costs.make(4, forward=1, backward=2, comm=0.5, apply=1)
    assert simulate(v, dataclasses.replace(costs, shared=(SharedCost(0, 3, 10.0),))).makespan == (
        simulate(v, costs).makespan
    )
    # JSON: written and read back.
    assert costs_from_json(shared.to_json(), 3, "t") == shared


def test_shared_costs_are_checked():
    plain = Costs.make(2)
    for bad, match in [
        ((SharedCost(0, 0, 1.0),), "two different chunks"),
        ((SharedCost(0, 5, 1.0),), "two different chunks"),
        ((SharedCost(0, 1, -1.0),), "must take 0 to"),
        ((SharedCost(0, 1, 1.0), SharedCost(0, 1, 2.0)), "names chunks 0 -> 1 twice"),
        (((0, 1, 1.0),), "every entry must be a SharedCost"),
    ]:
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(plain, shared=bad)
    schedule = build_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match=r"transfers only; simulate with overlap \(overlap=True"):
        simulate(
            schedule, dataclasses.replace(plain, shared=(SharedCost(0, 1, 1.0),)), overlap=False
        )
    with pytest.raises(InputError, match="must be an object with owner, user, seconds"):
        costs_from_json({"forward": 1, "shared": [{"owner": 0}]}, 2, "t")
    with pytest.raises(InputError, match="unknown key 'sec'; its keys are owner, user"):
        costs_from_json({"shared": [{"owner": 0, "user": 1, "seconds": 1, "sec": 2}]}, 2, "t")
    for bad in (SharedCost(True, 1, 1.0), SharedCost(0.0, 1, 1.0), SharedCost(0, 1, "x")):
        with pytest.raises(ValueError, match=r"must name two different chunks|must take 0 to"):
            dataclasses.replace(plain, shared=(bad,))
    listed = dataclasses.replace(plain, shared=[SharedCost(0, 1, 1.0)])
    assert listed.shared == (SharedCost(0, 1, 1.0),) and hash(listed)
    # A schedule that deadlocks, with an owner's apply waiting on a gradient contribution: the
    # error names the stuck actions (not a crash on the contribution's producer).
    stuck = broken(["0F0 0B0 0A", "1F0 1B0 1F1 1B1 1A"])  # (0F1 never runs)
    costs = dataclasses.replace(Costs.make(2, apply=1), shared=(SharedCost(0, 1, 1.0),))
    with pytest.raises(ScheduleError, match="cannot finish"):
        simulate(stuck, costs)


def test_bad_arguments():
    with pytest.raises(ValueError, match="is not a schedule; choose one of gpipe, 1f1b"):
        build_schedule("interleaved", 2, 2)
    with pytest.raises(ValueError, match="num_micro_batches=0 must be an int >= 1"):
        build_schedule("1f1b", 2, 0)
    with pytest.raises(ValueError, match="comm has 3 entries, expected 1"):
        Costs.make(2, comm=[1, 2, 3])
    with pytest.raises(ValueError, match=r"weight_grad=3\.0 exceeds its whole backward=2\.0"):
        Costs.make(1, backward=2, weight_grad=3)
