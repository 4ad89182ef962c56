"""Schedules as portable data: torch's compute-only CSV both ways, JSON timelines read back."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxreshard.pipeline import (
    SCHEDULE_NAMES,
    Action,
    Costs,
    ScheduleError,
    build_schedule,
    schedule_from_csv,
    schedule_from_json,
    schedule_to_csv,
    simulate,
)

# Hand-written: 1F1B on two ranks with an idle cell, the second rank in reverse-friendly order.
HAND_1F1B = """\
0F0,0F1,,0B0,0B1
1F0,1B0,1F1,1B1
"""
# Split backward with a whole B mixed in (as torch's DualPipeV writes them).
HAND_MIXED = """\
0F0, 0F1, 0I0, 0W0, 0B1
1F0, 1B0, 1F1, 1I1, 1W1
"""
DEADLOCK = """\
0F0,0F1,0B0,0B1
1F0,1B0,1F1,1B1
2F1,2B1,2F0,2B0
"""


def starts(timeline):
    return {str(t.action): (t.start, t.end) for rank in timeline.stages for t in rank}


def test_hand_written_csv_replays_as_soon_as_possible():
    schedule = schedule_from_csv(HAND_1F1B)
    assert schedule.num_stages == 2 and schedule.num_micro_batches == 2
    assert not schedule.split_backward and schedule.placement == (0, 1)
    timeline = simulate(schedule, Costs.make(2, forward=1, backward=2, comm=0.5))
    # rank 1 gets mb0 at 1.5, sends its gradient at 4.5; rank 0 waits for it until 5.
    assert starts(timeline) == {
        "0F0": (0, 1),
        "0F1": (1, 2),
        "1F0": (1.5, 2.5),
        "1B0": (2.5, 4.5),
        "1F1": (4.5, 5.5),
        "1B1": (5.5, 7.5),
        "0B0": (5, 7),
        "0B1": (8, 10),
    }
    assert timeline.makespan == 10


def test_whole_backward_in_a_split_csv_sends_its_gradient_at_its_end():
    schedule = schedule_from_csv(HAND_MIXED)
    assert schedule.split_backward
    assert schedule.fused == {Action(1, "B", 0), Action(0, "B", 1)}  # whole B = B then W, fused
    timeline = simulate(schedule, Costs.make(2, forward=1, backward=2, weight_grad=0.5))
    got = starts(timeline)
    assert got["1B0"] == (2, 3.5) and got["1W0"] == (3.5, 4)  # 1B0 as a whole: 2..4
    assert got["0B0"] == (4, 5.5)  # its gradient left at 4, not 3.5
    assert got["1B1"] == (5, 6.5) and got["0B1"] == (6.5, 8) and got["0W1"] == (8, 8.5)
    assert timeline.makespan == 8.5
    assert schedule_to_csv(schedule) == "0F0,0F1,0I0,0W0,0B1\n1F0,1B0,1F1,1I1,1W1\n"


def test_deadlocking_csv_is_refused_naming_the_actions():
    with pytest.raises(ScheduleError) as info:
        schedule_from_csv(DEADLOCK, source="deadlock.csv")
    message = str(info.value)
    assert message.startswith("deadlock.csv: ")
    assert "cycle: 1B0 (needs 2B0) -> 2F1 (needs 1F1) -> 1B0" in message
    assert ">2F1<" in message and "ERROR HERE" in message


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0F0,0B0\n0F1,1F0,1B0,1F1,1B1\n", "chunk 0 is on ranks [0, 1]"),
        ("0F0,0B0,0B0\n1F0,1B0\n", "0B0 appears 2 times: rank 0 action 2 (0B0), rank 0 action 3"),
        ("0F0,0F1,0B0\n1F0,1B0,1F1,1B1\n", "missing actions"),
        ("0F0,0I0\n1F0,1I0,1W0\n", "missing actions (every chunk 0..1 needs F and B, or F, I"),
        ("0F0,0B0,0W0\n1F0,1B0\n", "0B0 (the whole backward) and 0W0 (a part of it)"),
        ("0F0,0Q0\n", "row 1 (rank 0) cell 2: cannot parse '0Q0'"),
        ("0F0,0SEND_F0,0B0\n", "torch communication/FSDP action: give the compute-only CSV"),
        ("0F0,0B0\n,,\n1F0,1B0\n", "row 2 (rank 1) has no actions"),
        ("0F0,0B0\n2F0,2B0\n", "chunk 1 has no actions"),
    ],
)
def test_bad_csvs_are_refused_with_what_is_wrong(text, expected):
    with pytest.raises(ScheduleError) as info:
        schedule_from_csv(text)
    assert expected in str(info.value)


def test_rows_may_hold_different_numbers_of_chunks():
    schedule = schedule_from_csv("0F0,2F0,2B0,0B0\n1F0,1B0\n")
    assert schedule.placement == (0, 1, 0) and schedule.virtual_stages == 2
    assert schedule.describe() == "csv, 2 ranks, 3 chunks, 1 micro-batches"
    timeline = simulate(schedule, Costs.make(3, comm=1))
    assert timeline.makespan == 1 + 1 + 1 + 1 + 1 + 2 + 1 + 2 + 1 + 2
    assert timeline.to_json()["placement"] == [0, 1, 0]


def test_torch_overlap_pairs_read_as_fused_runs():
    schedule = build_schedule("dualpipev", 3, 6)
    plain = schedule_to_csv(schedule)
    paired = schedule_to_csv(schedule, overlap_pairs=True)
    assert "OVERLAP_F_B" not in plain and "(0F5;5B2)OVERLAP_F_B" in paired
    again = schedule_from_csv(paired)
    assert again.actions == schedule.actions and again.fused == schedule.fused
    flat = schedule_from_csv(plain)
    assert flat.actions == schedule.actions and flat.fused < schedule.fused
    costs = Costs.make(6, comm=0.5)
    # Unpairing only removes waits.
    assert simulate(flat, costs).makespan <= simulate(schedule, costs).makespan


@given(
    st.sampled_from(SCHEDULE_NAMES),
    st.integers(1, 5),
    st.integers(1, 12),
    st.booleans(),
)
def test_every_schedule_round_trips_through_csv_and_json(name, p, m, weight_delay):
    schedule = build_schedule(name, p, m, weight_delay=weight_delay)
    again = schedule_from_csv(schedule_to_csv(schedule, overlap_pairs=True))
    costs = Costs.make(schedule.num_chunks, comm=0.25)
    if schedule.split_backward and not again.split_backward:
        # Every backward was whole (B then W, fused): the CSV says B, which reads back unsplit.
        assert all(
            Action(a.stage_index, "W", a.mb) in a_rank
            for a_rank in schedule.actions
            for a in a_rank
            if a.kind == "B"
        )
        assert simulate(again, costs).makespan == simulate(schedule, costs).makespan
        return
    assert again.actions == schedule.actions
    assert again.placement == schedule.placement and again.fused == schedule.fused
    data = simulate(schedule, costs).to_json()
    back = schedule_from_json(data)
    assert back.actions == schedule.actions and back.placement == schedule.placement
    assert back.fused == schedule.fused and back.name == name
    assert simulate(back, costs).makespan == data["makespan"]


def test_json_format_1_still_reads_and_others_are_refused():
    costs = Costs.make(3, comm=0.5)
    data = simulate(build_schedule("eager_1f1b", 3, 4, weight_delay=True), costs).to_json()
    old = dict(data, format="jaxreshard-schedule/1")
    for key in ("virtual_stages", "placement", "split_backward"):
        del old[key]
    old["stages"] = [
        [{k: a[k] for k in ("kind", "mb", "start", "end")} for a in rank] for rank in data["stages"]
    ]
    assert schedule_from_json(old).actions == schedule_from_json(data).actions
    with pytest.raises(ValueError, match="format='x/9': expected a jaxreshard-schedule/1 or /2"):
        schedule_from_json({"format": "x/9"})
