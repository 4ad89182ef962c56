"""What a measured step's prediction charges the step's first micro-batch (its actions' extra
time, a shaped link's quicker first transfer), how a shared gradient leaves a rank with
virtual stages, and how transfer times are averaged ([Note: the first micro-batch's actions]
in `jaxreshard/profiler/_measured.py`)."""

from __future__ import annotations

import pytest
from helpers import step_layout

from jaxreshard.pipeline import Costs, build_schedule, simulate
from jaxreshard.pipeline._costs import SharedCost
from jaxreshard.pipeline._formats import costs_from_json
from jaxreshard.pipeline._schedule import PARAM_GRAD
from jaxreshard.profiler._measured import measured_costs, trimmed_mean, typical_steps
from jaxreshard.profiler._run import StepRecord
from jaxreshard.runtime.engine._events import Event


def _spans(timeline) -> dict[str, tuple[float, float]]:
    return {str(t.action): (t.start, t.end) for rank in timeline.stages for t in rank}


def test_the_first_micro_batch_actions_take_their_extra_time():
    schedule = build_schedule("gpipe", 2, 2)
    spans = _spans(simulate(schedule, Costs.make(2, forward=1.0, forward_first=[1.5, 0.0])))
    assert spans["0F0"] == (0.0, 2.5) and spans["0F1"] == (2.5, 3.5)  # only mb 0 is longer
    assert spans["1F0"] == (2.5, 3.5)  # (stage 1 has no extra)
    costs = Costs.make(2, backward=3.0, weight_grad=1.0, backward_first=2.0, weight_grad_first=0.5)
    # Split: B is the whole backward less W, each with its share of the first's extra.
    assert costs.duration(0, "W", True, 0) == 1.5 and costs.duration(0, "W", True, 1) == 1.0
    assert costs.duration(0, "B", True, 0) == 3.5 and costs.duration(0, "B", True, 1) == 2.0
    assert costs.duration(0, "B", False, 0) == 5.0 and costs.duration(0, "B", False) == 3.0
    assert costs.duration(0, "F", False, 0) == 1.0  # (no forward_first)
    # Simulated: ZB-H1's first B and W on stage 1 each take their share.
    zb = build_schedule("zb_h1", 2, 2)
    split = Costs.make(2, backward=2.0, backward_first=[0.0, 3.0], weight_grad_first=[0.0, 1.0])
    plain, first = _spans(simulate(zb, Costs.make(2, backward=2.0))), _spans(simulate(zb, split))
    assert first["1B0"][1] - first["1B0"][0] == 3.0 and first["1W0"][1] - first["1W0"][0] == 2.0
    assert first["1B1"][1] - first["1B1"][0] == plain["1B1"][1] - plain["1B1"][0] == 1.0


def test_first_micro_batch_fields_are_checked_and_round_trip_through_json():
    costs = Costs.make(3, forward_first=[0.1, 0.0, 0.2], backward_first=0.4)
    assert costs.weight_grad_first == (0.2, 0.2, 0.2)  # half the backward's, as weight_grad
    data = costs.to_json()
    assert data["forward_first"] == [0.1, 0.0, 0.2] and data["weight_grad_first"] == 0.2
    assert costs_from_json(data, 3, "t.json") == costs
    # A first backward slower in B alone: its W part (none) is written, not read back as half.
    b_only = Costs(forward=(1.0,), backward=(2.0,), weight_grad=(1.0,), comm=(), apply=(0.0,),
                   backward_first=(1.0,))  # fmt: skip
    assert b_only.to_json()["weight_grad_first"] == 0.0
    assert costs_from_json(b_only.to_json(), 1, "t.json") == b_only
    assert "forward_first" not in Costs.make(3).to_json()  # (files without it stay as they were)
    with pytest.raises(ValueError, match=r"forward_first=\[-1.0, 0.0\] must be >= 0"):
        Costs.make(2, forward_first=[-1.0, 0.0])
    with pytest.raises(
        ValueError, match=r"stage 0 weight_grad_first=2\.0 exceeds its backward_first"
    ):
        Costs.make(1, backward_first=1.0, weight_grad_first=2.0)


def test_a_first_transfer_may_be_quicker_but_never_take_less_than_no_time():
    schedule = build_schedule("gpipe", 2, 2)
    spans = _spans(simulate(schedule, Costs.make(2, comm=2.0, comm_first=-1.5)))
    assert spans["1F0"][0] == 1.5 and spans["1F1"][0] == 4.0  # 1 + 0.5; then 2 + 2
    with pytest.raises(
        ValueError, match=r"comm_first=-1.5 would make its first transfer take -0.5"
    ):
        Costs.make(2, comm=1.0, comm_first=-1.5)
    with pytest.raises(ValueError, match=r"comm_first=\[-2000000000000.0\] must be >= -1e\+12"):
        Costs.make(2, comm_first=-2e12)


def _step(first: float, later: float, arrive_first: float, arrive_later: float) -> StepRecord:
    """GPipe over 2 stages and 2 micro-batches: stage 0's forwards (the first `first` long,
    the second `later`), and its activations' arrivals on stage 1."""
    return StepRecord(6.0, 0.0, [
        Event(0, "F", 0, 0.0, first, "0F0"),
        Event(0, "send", 0, first, first, "act0 s0->s1", 8, 1),
        Event(1, "arrive", 0, arrive_first, arrive_first, "act0 s0->s1", 0, 1),
        Event(0, "F", 1, first, first + later, "0F1"),
        Event(0, "send", 1, first + later, first + later, "act0 s0->s1", 8, 1),
        Event(1, "arrive", 1, arrive_later, arrive_later, "act0 s0->s1", 0, 1),
    ])  # fmt: skip


def test_measured_costs_time_the_first_micro_batch_apart():
    layout = step_layout(build_schedule("gpipe", 2, 2), ("act0 s0->s1", 0, 1))
    # The first forward 3 s, the second 1 s; the first transfer 0.5 s, the second 2 s.
    costs = measured_costs([_step(3.0, 1.0, 3.5, 6.0)], layout)
    assert costs.forward[0] == pytest.approx(1.0) and costs.forward_first[0] == pytest.approx(2.0)
    assert costs.comm == pytest.approx((2.0,)) and costs.comm_first == pytest.approx((-1.5,))
    # A first no slower than the rest: no extra, and every micro-batch's mean.
    costs = measured_costs([_step(1.0, 3.0, 2.0, 5.0)], layout)
    assert costs.forward[0] == pytest.approx(2.0) and costs.forward_first[0] == 0.0


def test_a_stalled_step_is_left_out_of_the_costs():
    """As the median of the measured steps leaves it out of the step time."""
    layout = step_layout(build_schedule("gpipe", 2, 2), ("act0 s0->s1", 0, 1))
    steps = [_step(1.0, 1.0, 1.5, 3.0)] * 3
    stalled = StepRecord(20.0, 0.0, _step(15.0, 1.0, 15.5, 17.0).events)  # > 2 x 6.0
    assert typical_steps([*steps, stalled]) == steps
    costs = measured_costs([*steps, stalled], layout)
    assert costs.forward == pytest.approx((1.0, 0.0)) and costs.forward_first[0] == 0.0
    slow = StepRecord(12.0, 0.0, stalled.events)  # (at most twice the median: kept)
    assert measured_costs([*steps, slow], layout).forward_first[0] == pytest.approx(3.5)


def test_an_unsplit_backward_measures_its_first_extra_whole():
    layout = step_layout(build_schedule("1f1b", 2, 2))
    events = [Event(0, "B", 0, 0.0, 3.0, "0B0"), Event(0, "B", 1, 3.0, 4.0, "0B1")]
    costs = measured_costs([StepRecord(4.0, 0.0, events)], layout)
    assert costs.backward[0] == pytest.approx(1.0) and costs.backward_first[0] == pytest.approx(2.0)
    assert costs.weight_grad_first[0] == pytest.approx(1.0)  # (half, as weight_grad)


def test_transfer_times_are_means_without_the_rare_long_and_short_ones():
    assert trimmed_mean([1.0] * 6 + [3.0] * 3 + [50.0]) == pytest.approx(14 / 8)  # drops 1, 50
    assert trimmed_mean([4.0, 2.0]) == 3.0 and trimmed_mean([]) != trimmed_mean([])  # (nan)
    assert trimmed_mean([1.0, 2.0, 30.0, 3.0]) == 2.5  # (one each side from 3 values on)
    layout = step_layout(build_schedule("gpipe", 2, 2), ("act0 s0->s1", 0, 1))
    later = [2.0] * 6 + [3.0] * 3 + [40.0]  # the second micro-batch's transfer, 10 steps
    steps = [_step(1.0, 1.0, 1.5, 2.0 + s) for s in later]
    assert measured_costs(steps, layout).comm == pytest.approx((19 / 8,))  # (median 2, mean 6.1)


def test_a_shared_gradient_leaves_after_the_last_action_of_its_users_rank():
    """Interleaved 1F1B on 2 ranks: chunk 3 (rank 1) reads chunk 0's parameter; rank 1 ends
    with chunk 1's backward, and only then does its program send the gradient (`_emit`)."""
    schedule = build_schedule("interleaved_1f1b", 2, 2, virtual_stages=2)
    assert schedule.rank_of(3) == schedule.rank_of(1) == 1
    costs = Costs.make(4, comm=0.5).with_shared([SharedCost(0, 3, 0.25, True, 2.0)])
    timeline = simulate(schedule.with_apply(), costs)
    rank_end = max(t.end for t in timeline.stages[1] if t.action.kind != "A")
    last_of_3 = max(
        t.end for t in timeline.stages[1] if t.action.stage_index == 3 and t.action.kind != "A"
    )
    (back,) = [t for t in timeline.transfers if t.transfer.kind == PARAM_GRAD]
    assert last_of_3 < rank_end and (back.start, back.end) == (rank_end, rank_end + 2.0)


def test_a_shared_gradient_is_timed_from_the_end_of_its_users_rank():
    schedule = build_schedule("interleaved_1f1b", 2, 1, virtual_stages=2)
    layout = step_layout(schedule, ("param7 s0->s3", 0, 3), ("param_grad7 s3->s0", 3, 0))
    events = [
        Event(0, "send", -1, 0.0, 0.5, "param7 s0->s3", 8, 1),
        Event(3, "B", 0, 4.0, 5.0, "3B0"),
        Event(1, "B", 0, 6.0, 7.0, "1B0"),  # rank 1's last action
        Event(3, "send", -1, 7.0, 7.1, "param_grad7 s3->s0", 8, 0),
        Event(0, "arrive", -1, 9.0, 9.0, "param_grad7 s3->s0", 0, 0),
    ]
    (shared,) = measured_costs([StepRecord(10.0, 0.0, events)], layout).shared
    assert shared.back == pytest.approx(2.0)  # from 7.0, not from chunk 3's 5.0


def test_the_first_micro_batch_extras_follow_fits_spreads_and_scales():
    from jaxreshard.pipeline._compare import chunk_costs
    from jaxreshard.profiler._auto_fit import CostModel
    from jaxreshard.runtime.step._refit import calibrated

    small = Costs.make(2, forward_first=1.0, backward_first=2.0, comm=1.0, comm_first=-1.0)
    large = Costs.make(2, forward_first=2.0, backward_first=4.0, comm=1.5, comm_first=-1.5)
    at = CostModel([(4, small), (8, large)], 0.0).at(2)
    assert at.forward_first == pytest.approx((0.5, 0.5))  # (on the line through the points)
    # comm: 0.5 + 0.125 a row; the first transfer takes no time at either point, and its
    # line (fitted flat at 0 outside them) stays there.
    assert at.comm == pytest.approx((0.75,)) and at.comm_first == pytest.approx((-0.75,))
    shorter = Costs.make(2, comm=1.0, comm_first=-0.5)
    at = CostModel([(4, shorter), (8, Costs.make(2, comm=2.0, comm_first=-0.5))], 0.0).at(16)
    # (the first transfer on its own line: 0.5 at 4 rows, 1.5 at 8, so 3.0 at 16 in proportion
    # to the nearer point; the others 4.0. A flat extra would have said 3.5.)
    assert at.comm == pytest.approx((4.0,)) and at.comm_first == pytest.approx((-1.0,))
    assert CostModel([(4, small)], 0.0).at(8).forward_first == (1.0, 1.0)  # (one point: flat)
    spread = chunk_costs(small, (0, 1, 0, 1))  # v = 2: each chunk half its rank's
    assert spread.forward_first == (0.5,) * 4 and spread.weight_grad_first == (0.5,) * 4
    assert calibrated(small, 2.0, 0.1).backward_first == (4.0, 4.0)  # (scaled; no fixed part)


def test_mixed_layouts_take_the_slower_whole_first_transfer():
    from jaxreshard.profiler._auto_fit import CostModel
    from jaxreshard.profiler._auto_mixed import compose

    quick = Costs.make(2, comm=10.0, comm_first=-8.0, forward_first=[1.0, 0.0])  # first: 2
    even = Costs.make(2, comm=3.0, forward_first=[0.0, 0.5])  # first: 3
    costs, _ = compose([CostModel([(4, quick)], 0.0), CostModel([(4, even)], 0.0)], 4)
    assert costs.comm == (10.0,) and costs.comm_first == (-7.0,)  # 3 in all
    assert costs.forward_first == (1.0, 0.5)  # each stage its own layout's
