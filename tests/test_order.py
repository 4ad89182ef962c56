import pytest
from helpers import cluster_over, virtual
from jax.sharding import PartitionSpec as P

from jaxreshard.comm import plan_reshard
from jaxreshard.comm._order import (
    COLLECTIVE,
    LOCAL,
    RECV,
    SEND,
    OrderError,
    Step,
    check_programs,
    host_programs,
)


def broadcast_plan():
    # One source device on host 0, a replicated destination on hosts 1, 2 and 3.
    src = virtual((1,), P(), 0, 1)
    dst = virtual((3,), P(), 1, 1)
    return plan_reshard(
        (8, 4), "float32", src, dst, cluster=cluster_over(4, 1), strategy="broadcast_greedy"
    )


def test_broadcast_runs_as_a_chain():
    plan = broadcast_plan()
    programs = host_programs(plan)
    assert programs[0] == [Step(0, SEND, peers=(1,))]
    assert programs[1] == [Step(0, RECV, peers=(0,)), Step(0, SEND, peers=(2,))]
    assert programs[2] == [Step(0, RECV, peers=(1,)), Step(0, SEND, peers=(3,))]
    assert programs[3] == [Step(0, RECV, peers=(2,))]
    check_programs(programs, plan.cluster)


def test_collective_programs_and_local_ops():
    plan = plan_reshard(
        (8, 4),
        "float32",
        virtual((2,), P("a"), 0, 2),
        virtual((2,), P(), 2, 2),
        cluster=cluster_over(4, 2),
    )
    programs = host_programs(plan, collectives=True)
    for steps in programs.values():
        assert all(s.role in (COLLECTIVE, LOCAL) for s in steps)
    check_programs(programs, plan.cluster)


def swap_first_two(steps):
    steps = list(steps)
    steps[0], steps[1] = steps[1], steps[0]
    return steps


def test_divergent_collective_order_is_named():
    group = (0, 2)
    same = [Step(0, COLLECTIVE, group=group), Step(1, COLLECTIVE, group=group)]
    check_programs({0: same, 1: list(same)})
    swapped = {0: same, 1: swap_first_two(same)}
    with pytest.raises(
        OrderError,
        match=r"communicator \[0, 2\] diverges at position 0 "
        r"\(host 0: op 0, host 1: op 1\)",
    ):
        check_programs(swapped)


def test_cycle_across_communicators_is_found():
    group_a, group_b = (0, 2, 4), (1, 3, 5)
    programs = {
        0: [Step(0, COLLECTIVE, group=group_a), Step(1, COLLECTIVE, group=group_b)],
        1: [Step(1, COLLECTIVE, group=group_b), Step(0, COLLECTIVE, group=group_a)],
    }
    with pytest.raises(OrderError, match="a cycle across communicators"):
        check_programs(programs)


def test_missing_send_or_receive_and_cycles():
    with pytest.raises(OrderError, match="host 1 waits to receive from host 0, which never sends"):
        check_programs({0: [], 1: [Step(0, RECV, peers=(0,))]})
    with pytest.raises(OrderError, match="host 0 sends to host 1, which never receives it"):
        check_programs({0: [Step(0, SEND, peers=(1,))], 1: []})
    # Each host waits for the other's send first: a cycle.
    cyclic = {
        0: [Step(1, RECV, peers=(1,)), Step(0, SEND, peers=(1,))],
        1: [Step(0, RECV, peers=(0,)), Step(1, SEND, peers=(0,))],
    }
    with pytest.raises(OrderError, match="host 0 waits at op 1 for host 1's send"):
        check_programs(cyclic)


def test_collective_on_the_wrong_hosts():
    plan = broadcast_plan()
    programs = host_programs(plan, collectives=True)
    programs[3] = []
    with pytest.raises(OrderError, match=r"issued by hosts \[0, 1, 2\] but the communicator spans"):
        check_programs(programs, plan.cluster)
