"""What a measured step's prediction charges besides the actions: the host's time between a
rank's actions, a blocked receiver's wake-up, and optimizer segments the driver runs after
every host's step ([Note: host time between actions] in `jaxreshard/profiler/_run.py`)."""

from __future__ import annotations

import pytest
from helpers import step_layout

from jaxreshard.pipeline import Costs, build_schedule, simulate
from jaxreshard.pipeline._formats import costs_from_json
from jaxreshard.profiler._measured import (
    host_between_actions,
    measured_costs,
    predicted_step,
    transfer_durations,
)
from jaxreshard.profiler._run import StepRecord
from jaxreshard.runtime.engine._events import Event


def _starts(timeline) -> dict[str, tuple[float, float]]:
    return {str(t.action): (t.start, t.end) for rank in timeline.stages for t in rank}


def test_a_rank_stays_busy_for_its_host_time_while_the_outputs_travel():
    schedule = build_schedule("gpipe", 2, 2).with_apply()
    plain = Costs.make(2, forward=1.0, backward=2.0)
    busy = Costs.make(2, forward=1.0, backward=2.0, host=0.5)
    a, b = _starts(simulate(schedule, plain)), _starts(simulate(schedule, busy))
    assert a["0F1"] == (1.0, 2.0) and b["0F1"] == (1.5, 2.5)  # after 0F0 and its host time
    assert b["1F0"] == a["1F0"] == (1.0, 2.0)  # 0F0's output left when 0F0 ended
    assert b["1F1"] == (2.5, 3.5)  # 0F1's output, at its end
    assert b["1B0"] == (4.0, 6.0)  # after 1F1 and its host time
    # Each rank's apply waits for its last action's host time too.
    assert simulate(schedule, busy).makespan == pytest.approx(b["0B1"][1] + 0.5)


def test_host_time_round_trips_through_the_costs_json_and_is_overlap_only():
    costs = Costs.make(3, host=[0.1, 0.2, 0.3])
    assert costs.to_json()["host"] == [0.1, 0.2, 0.3]
    assert costs_from_json(costs.to_json(), 3, "t.json") == costs
    assert "host" not in Costs.make(3).to_json()  # (files without it stay as they were)
    assert Costs.make(3).host == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="host has 2 entries, expected 3"):
        Costs.make(3, host=[0.1, 0.2])
    with pytest.raises(ValueError, match=r"host=\[-1.0\] must be >= 0"):
        Costs(forward=(1.0,), backward=(2.0,), weight_grad=(1.0,), comm=(), apply=(0.0,),
              host=(-1.0,))  # fmt: skip
    with pytest.raises(ValueError, match=r"costs\.host .* overlapping transfers only"):
        simulate(build_schedule("1f1b", 3, 3), costs, overlap=False)


def test_host_time_between_actions_leaves_out_the_waits_for_receives():
    schedule = build_schedule("1f1b", 2, 2)
    events = [
        Event(0, "F", 0, 0.0, 1.0, "0F0"),
        Event(0, "send", 0, 1.0, 1.1, "act0 s0->s1", 8, 1),
        Event(0, "F", 1, 1.2, 2.0, "0F1"),  # 0.2 after 0F0
        Event(0, "wait", 0, 2.1, 3.0, "grad0 s1->s0"),
        Event(0, "B", 0, 3.1, 4.0, "0B0"),  # 1.1 after 0F1, 0.9 of it waiting
        Event(1, "F", 0, 1.1, 2.0, "1F0"),
    ]
    assert host_between_actions([StepRecord(4.0, 0.0, events)], schedule) == pytest.approx(
        [0.2, 0.0]  # mean of 0.2 and 0.2; stage 1 ran one action, none followed
    )


def test_a_blocked_receiver_ends_its_transfer_when_it_wakes():
    events = [
        Event(0, "send", 0, 1.0, 1.1, "act0 s0->s1", 8, 1),
        Event(1, "wait", 0, 0.5, 1.7, "act0 s0->s1"),  # blocked: woke 0.6 after the send
        Event(0, "send", 1, 2.0, 2.1, "act0 s0->s1", 8, 1),
        Event(1, "wait", 1, 3.0, 3.0, "act0 s0->s1"),  # the value was there: no wait
    ]
    assert transfer_durations([StepRecord(4.0, 0.0, events)]) == {
        "act0 s0->s1": [pytest.approx(0.7), pytest.approx(0.1)]
    }


def _two_stage_step(applies: list[tuple[int, float]], **where) -> StepRecord:
    """1F1B over 2 stages and 1 micro-batch, every action 1 s; each apply 1 s, starting at the
    times given: the pipeline ends at 4 s (stage 1's part at 3 s)."""
    actions = [Event(0, "F", 0, 0.0, 1.0, "0F0"), Event(1, "F", 0, 1.0, 2.0, "1F0"),
               Event(1, "B", 0, 2.0, 3.0, "1B0"), Event(0, "wait", 0, 1.0, 3.0, "grad0 s1->s0"),
               Event(0, "B", 0, 3.0, 4.0, "0B0")]  # fmt: skip
    applied = [Event(s, "A", -1, t, t + 1.0, "apply") for s, t in applies]
    return StepRecord(max(e.end for e in applied), 0.0, actions + applied, **where)


@pytest.mark.parametrize(
    ("applies", "where", "predicted"),
    [
        # One host per stage: stage 1's apply beside stage 0's backward.
        ([(1, 3.0), (0, 4.0)], {"hosts": (0, 1)}, 5.0),
        # One host for both: its segments run after both stages' programs, one by one.
        ([(1, 4.0), (0, 5.0)], {"hosts": (0, 0)}, 6.0),
        # The driver's: after every host's part, one by one.
        ([(0, 4.0), (1, 5.0)], {"hosts": (0, 1), "driver_stages": (0, 1)}, 6.0),
    ],
)
def test_optimizer_segments_run_after_their_hosts_ranks(applies, where, predicted):
    layout = step_layout(build_schedule("1f1b", 2, 1))
    step = _two_stage_step(applies, **where)
    seconds, costs = predicted_step([step], layout)
    assert costs.apply == (1.0, 1.0) and costs.host == (0.0, 0.0)
    assert seconds == pytest.approx(predicted)


def test_gradients_take_their_own_time_back():
    schedule = build_schedule("1f1b", 2, 1)
    same = _starts(simulate(schedule, Costs.make(2, forward=1.0, backward=2.0, comm=0.5)))
    back = Costs.make(2, forward=1.0, backward=2.0, comm=0.5, comm_back=1.5)
    slow = _starts(simulate(schedule, back))
    assert same["1F0"] == slow["1F0"] == (1.5, 2.5)  # activations: comm
    assert same["0B0"][0] == 5.0 and slow["0B0"][0] == 6.0  # gradients: comm_back
    assert back.to_json()["comm_back"] == 1.5 and costs_from_json(back.to_json(), 2, "t") == back
    # (None follows comm, whatever replaces it)
    assert Costs.make(2, comm=0.5).transfer_seconds("gradient", 0) == 0.5


def test_measured_transfers_are_timed_per_direction_and_shared_parameters_apart():
    layout = step_layout(build_schedule("1f1b", 2, 1), ("act0 s0->s1", 0, 1),
                         ("grad0 s1->s0", 1, 0), ("param7 s0->s1", 0, 1),
                         ("param_grad7 s1->s0", 1, 0))  # fmt: skip
    events = [
        Event(0, "F", 0, 0.0, 1.0, "0F0"),
        Event(0, "send", -1, 0.0, 0.9, "param7 s0->s1", 8, 1),
        Event(0, "send", 0, 1.0, 1.2, "act0 s0->s1", 8, 1),
        Event(1, "F", 0, 1.2, 2.0, "1F0"),
        Event(1, "B", 0, 2.0, 3.0, "1B0"),
        Event(1, "send", 0, 3.0, 3.6, "grad0 s1->s0", 8, 0),
        Event(1, "send", -1, 3.6, 5.0, "param_grad7 s1->s0", 8, 0),
        Event(0, "B", 0, 3.6, 4.0, "0B0"),
    ]
    costs = measured_costs([StepRecord(5.0, 0.0, events)], layout)
    assert costs.comm == pytest.approx((0.2,)) and costs.comm_back == pytest.approx((0.6,))
    # The shared parameter's copy from its send; its gradient from when the link was free
    # again (grad0 in at 3.6), not from its send's start behind it.
    (shared,) = costs.shared
    assert (shared.owner, shared.user, shared.grad) == (0, 1, True)
    assert shared.seconds == pytest.approx(0.9) and shared.back == pytest.approx(1.4)


def test_a_transfer_is_timed_from_the_end_of_the_action_that_made_it():
    layout = step_layout(build_schedule("gpipe", 2, 2), ("act0 s0->s1", 0, 1))
    events = [
        Event(0, "F", 0, 0.0, 1.0, "0F0"),
        Event(0, "F", 1, 1.0, 2.0, "0F1"),
        Event(0, "send", 0, 1.5, 1.6, "act0 s0->s1", 8, 1),  # began 0.5 after 0F0 ended
        Event(1, "arrive", 0, 2.5, 2.5, "act0 s0->s1", 0, 1),
        Event(0, "send", 1, 2.0, 2.1, "act0 s0->s1", 8, 1),
        Event(1, "arrive", 1, 3.0, 3.0, "act0 s0->s1", 0, 1),  # behind mb 0 on the link
    ]
    costs = measured_costs([StepRecord(4.0, 0.0, events)], layout)
    # mb 1: 0.5 from mb 0's arrival (from its send's start 1.0, from 0F1's end 1.0); mb 0:
    # 1.5 from 0F0's end (from its send's start 1.0), the first's extra 1.0
    assert costs.comm == pytest.approx((0.5,)) and costs.comm_first == pytest.approx((1.0,))


def test_the_first_micro_batch_activations_take_their_measured_extra_time():
    schedule = build_schedule("gpipe", 2, 2)
    late = _starts(simulate(schedule, Costs.make(2, comm=0.5, comm_first=2.0)))
    assert late["1F0"][0] == 3.5 and late["1F1"][0] == 4.5  # 1 + 0.5 + 2; then 2 + 0.5 queued
    layout = step_layout(schedule, ("act0 s0->s1", 0, 1))
    events = [
        Event(0, "F", 0, 0.0, 1.0, "0F0"),
        Event(0, "F", 1, 1.0, 2.0, "0F1"),
        Event(0, "send", 0, 1.0, 1.1, "act0 s0->s1", 8, 1),
        Event(1, "arrive", 0, 3.0, 3.0, "act0 s0->s1", 0, 1),  # 2.0 from 0F0's end
        Event(0, "send", 1, 2.0, 2.1, "act0 s0->s1", 8, 1),
        Event(1, "arrive", 1, 3.5, 3.5, "act0 s0->s1", 0, 1),  # 0.5 after mb 0's
    ]
    costs = measured_costs([StepRecord(4.0, 0.0, events)] * 3, layout)
    assert costs.comm == pytest.approx((0.5,)) and costs.comm_first == pytest.approx((1.5,))


def test_host_time_is_per_rank_and_leaves_out_gradient_sums():
    """Virtual stages: chunks 0 and 3 share rank 0 (ZB-V), so a gap runs from chunk 0's action
    to chunk 3's; a gradient sum (an `A` event `0R`) inside a gap is the apply's, not host."""
    schedule = build_schedule("zbv", 2, 2)
    assert schedule.rank_of(0) == schedule.rank_of(3) == 0
    events = [
        Event(0, "F", 0, 0.0, 1.0, "0F0"),
        Event(3, "F", 0, 1.5, 2.0, "3F0"),  # 0.5 after chunk 0's, on the same rank
        Event(3, "B", 0, 2.0, 3.0, "3B0"),
        Event(3, "A", -1, 3.0, 3.8, "3R"),  # a gradient sum
        Event(0, "B", 0, 4.0, 5.0, "0B0"),  # 1.0 after 3B0: 0.2 of it host time
    ]
    host = host_between_actions([StepRecord(5.0, 0.0, events)], schedule)
    assert host == pytest.approx([0.5, 0.0, 0.0, 0.1])  # chunk 3: mean of 0.0 and 0.2


def test_a_shared_gradient_delays_its_owners_optimizer_and_placement_follows_the_schedule():
    from jaxreshard.pipeline._costs import SharedCost
    from jaxreshard.profiler._measured import OptimizerPhase

    schedule = build_schedule("1f1b", 2, 1)
    costs = Costs.make(2, forward=1.0, backward=2.0, apply=0.5).with_shared(
        [SharedCost(0, 1, 0.0, True, 4.0)]
    )
    phase = OptimizerPhase(hosts=(0, 1), seconds={0: 0.5, 1: 0.5}, on_driver=())
    # 0F0 0-1, 1F0 1-2, 1B0 2-4, 0B0 4-6; the gradient leaves after 1B0 (4) and is in at 8.
    assert phase.predict(schedule, costs) == pytest.approx(8.5)
    assert phase.predict(schedule, costs.with_shared([])) == pytest.approx(6.5)
    # Per rank: a V placement puts chunks 0 and 3 on rank 0's host.
    v = build_schedule("zbv", 2, 1)
    assert phase.hosts_of(v) == (0, 1, 1, 0)


def test_new_cost_fields_are_checked():
    with pytest.raises(ValueError, match="comm_back has 1 entries, expected 2"):
        Costs.make(3, comm_back=[1.0])
    with pytest.raises(ValueError, match=r"boundary 0's comm_first=-1.0 would make its first"):
        Costs.make(3, comm_first=[-1.0, 0.0])
    from jaxreshard.pipeline._costs import SharedCost

    with pytest.raises(ValueError, match="must take 0 to"):
        Costs.make(2).with_shared([SharedCost(0, 1, 1.0, True, -2.0)])
    with pytest.raises(Exception, match=r"back=.* must be a number"):
        costs_from_json({"shared": [{"owner": 0, "user": 1, "seconds": 1, "back": "x"}]}, 2, "t")
    import numpy as np

    with pytest.raises(ValueError, match=r"Costs: host=array.* must be a number or a sequence"):
        Costs(forward=(1.0, 1.0), backward=(2.0, 2.0), weight_grad=(1.0, 1.0), comm=(0.0,),
              apply=(0.0, 0.0), host=np.array([0.1, 0.2]))  # fmt: skip


def test_the_search_predicts_the_schedule_the_runtime_builds_from_its_cost_fields():
    """The runtime places delayed Ws from `cost_fields` (no comm_back, host, shared): the
    search's prediction must simulate that schedule, not one placed with all its costs."""
    from jaxreshard.profiler._auto import _predict
    from jaxreshard.profiler._compare import cost_fields

    costs = Costs.make(3, forward=1.0, backward=2.0, weight_grad=1.5, comm=0.1, comm_back=6.0,
                       host=0.3)  # fmt: skip
    changes = {"schedule": "zb_h1", "weight_delay": True}
    _, predicted = _predict(costs, changes, 6)
    fields = {k.removeprefix("cost_"): v for k, v in cost_fields(costs).items()}
    runtime = build_schedule("zb_h1", 3, 6, weight_delay=True, costs=Costs.make(3, **fields))
    assert predicted.actions == runtime.actions
