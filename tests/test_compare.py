"""The schedule comparison: same model for every row, and the README table is its output."""

import pathlib
import re

import pytest

from jaxreshard.pipeline import Costs
from jaxreshard.pipeline._compare import chunk_costs, compare_schedules
from jaxreshard.pipeline._virtual import looped_placement, v_placement

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_chunk_costs_split_each_stage_and_charge_every_boundary_between_ranks():
    costs = Costs.make(3, forward=[1, 2, 3], backward=2, weight_grad=1, comm=[0.5, 1.5])
    looped = chunk_costs(costs, looped_placement(3, 2))
    assert looped.forward == (0.5, 1, 1.5) * 2
    assert looped.comm == (0.5, 1.5, 1.5, 0.5, 1.5)  # rank 2 -> rank 0: the largest
    v = chunk_costs(costs, v_placement(3))
    assert v.forward == (0.5, 1, 1.5, 1.5, 1, 0.5)
    assert v.comm == (0.5, 1.5, 0.0, 1.5, 0.5)  # chunks 2 and 3 share rank 2
    assert sum(v.backward) == sum(costs.backward)


def test_readme_virtual_stage_table_is_the_compare_output():
    text = README.read_text()
    start = text.index("| schedule |", text.index("### Schedules with virtual stages, simulated"))
    table = text[start : text.index("\n\n", start)]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip().replace("*", "") for c in line.strip("|").split("|")]
        rows[re.sub(r" \(v=2\)", "", cells[0])] = cells[1:]
    results = {}
    for comm in (0, 0.5, 1, 2):
        costs = Costs.make(4, forward=1, backward=2, weight_grad=1, comm=comm)
        for row in compare_schedules(4, 16, costs):
            label = row.schedule + (" + weight delay" if row.weight_delay else "")
            if row.overlap:
                results.setdefault(label, {})[comm] = row
    assert len(rows) >= 9
    for label, cells in rows.items():
        got = results[label]
        assert [float(c) for c in cells[:4]] == pytest.approx(
            [got[c].makespan for c in (0, 0.5, 1, 2)]
        ), label
        assert cells[4] == f"{got[0].bubble_fraction:.1%}", label
        assert cells[5] == " ".join(f"{x:g}" for x in got[0].peak_memory), label
