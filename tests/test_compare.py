"""The schedule comparison: same model for every row (docs table: test_readme.py)."""

from jaxreshard.pipeline import Costs
from jaxreshard.pipeline._compare import chunk_costs
from jaxreshard.pipeline._virtual import looped_placement, v_placement


def test_chunk_costs_split_each_stage_and_charge_every_boundary_between_ranks():
    costs = Costs.make(3, forward=[1, 2, 3], backward=2, weight_grad=1, comm=[0.5, 1.5])
    looped = chunk_costs(costs, looped_placement(3, 2))
    assert looped.forward == (0.5, 1, 1.5) * 2
    assert looped.comm == (0.5, 1.5, 1.5, 0.5, 1.5)  # rank 2 -> rank 0: the largest
    v = chunk_costs(costs, v_placement(3))
    assert v.forward == (0.5, 1, 1.5, 1.5, 1, 0.5)
    assert v.comm == (0.5, 1.5, 0.0, 1.5, 0.5)  # chunks 2 and 3 share rank 2
    assert sum(v.backward) == sum(costs.backward)
