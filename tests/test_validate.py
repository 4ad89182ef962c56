import dataclasses

from helpers import cluster_over, virtual
from jax.sharding import PartitionSpec as P

from jaxreshard.comm import Op, plan_reshard, validate_plan


def make_plan(strategy="broadcast_greedy"):
    # Case 3 in small: 2 source hosts, 2 destination hosts, 4 cross-host unit tasks.
    src = virtual((2, 2), P(None, "a"), 0, 2)
    dst = virtual((2, 2), P("a"), 4, 2)
    return plan_reshard((4, 4), "float32", src, dst, cluster=cluster_over(8, 2), strategy=strategy)


def test_valid_plan_has_no_problems():
    for strategy in ("send_recv", "allgather", "broadcast_naive", "broadcast_greedy"):
        assert validate_plan(make_plan(strategy)) == []


def test_missing_op_is_caught():
    plan = make_plan()
    broken = dataclasses.replace(plan, ops=plan.ops[1:], timeline=plan.timeline[1:])
    assert any("never receives" in p for p in validate_plan(broken))


def test_sender_without_data_is_caught():
    plan = make_plan()
    op = plan.ops[0]
    wrong = dataclasses.replace(
        op, src_device=next(d for d in range(4, 8) if d not in op.dst_devices)
    )
    broken = dataclasses.replace(plan, ops=(wrong, *plan.ops[1:]))
    assert any("does not hold" in p for p in validate_plan(broken))


def test_too_fast_and_overlapping_ops_are_caught():
    plan = make_plan()
    squeezed = tuple((0.0, 1e-9) for _ in plan.timeline)
    problems = validate_plan(dataclasses.replace(plan, timeline=squeezed, hops=()))
    assert any("less than the" in p for p in problems)
    end = max(e for _, e in plan.timeline)
    together = tuple((0.0, end) for _ in plan.timeline)
    problems = validate_plan(dataclasses.replace(plan, timeline=together, hops=()))
    assert any("overlap on host" in p for p in problems)
    # The same with each hop timed: every hop of every op at once.
    hops = tuple(tuple((0.0, end) for _ in spans) for spans in plan.hops)
    problems = validate_plan(dataclasses.replace(plan, timeline=together, hops=hops))
    assert any("overlap on host" in p for p in problems)


def test_hops_are_checked_one_by_one():
    plan = make_plan("broadcast_greedy")
    assert validate_plan(plan) == []
    i = next(k for k, spans in enumerate(plan.hops) if len(spans) >= 2)
    spans = list(plan.hops[i])

    def with_spans(new):
        return dataclasses.replace(plan, hops=(*plan.hops[:i], tuple(new), *plan.hops[i + 1 :]))

    (s0, e0), (_, e1) = spans[0], spans[1]
    short = [(s0, s0 + 1e-9), *spans[1:]]  # (the first hop moves its bytes in no time)
    assert any("hop 0" in p and "less than the" in p for p in validate_plan(with_spans(short)))
    ahead = [spans[0], (s0 - 1.0, e1), *spans[2:]]  # (the second hop starts before the first)
    assert any("ahead of the hop before it" in p for p in validate_plan(with_spans(ahead)))
    instant = [spans[0]] * len(spans)  # (every relay forwards in the instant it receives)
    assert any("ahead of the hop before it" in p for p in validate_plan(with_spans(instant)))
    missing = spans[:-1]
    assert any("hop times" in p for p in validate_plan(with_spans(missing)))
    late = [(s0 + 1.0, e0 + 1.0), *spans[1:]]  # (the op's span no longer starts at its first hop)
    assert any("do not span it" in p for p in validate_plan(with_spans(late)))


def test_allgather_part_must_arrive_first():
    plan = make_plan("allgather")
    assert any(op.kind == "allgather" for op in plan.ops)
    early = tuple(
        (0.0, e - s) if op.kind == "allgather" else (s, e)
        for op, (s, e) in zip(plan.ops, plan.timeline)
    )
    problems = validate_plan(dataclasses.replace(plan, timeline=early))
    assert any("lacks its part" in p for p in problems)


def test_op_records_reject_nonsense():
    import pytest

    with pytest.raises(ValueError, match="use broadcast"):
        Op("send", ((0, 1),), 4, 0, (1, 2))
    with pytest.raises(ValueError, match="must be one of"):
        Op("scatter", ((0, 1),), 4, 0, (1,))
    with pytest.raises(ValueError, match="do not tile"):
        Op("allgather", ((0, 4),), 16, devices=(1, 2), parts=(((0, 1),), ((1, 2),)))
