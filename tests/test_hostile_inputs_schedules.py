"""Hostile input to the schedule and case loaders (issue 25): one clear `ValueError` for every bad
file, counts refused before they are allocated, linear-time import and simulation, and plan
files that stay in their folder. See [Note: hostile input] in `jaxreshard/_files.py` and [Note:
schedule size limits] in `jaxreshard/pipeline/_limits.py`."""

import copy
import json
import os
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxreshard import _files
from jaxreshard.bench import _cases, _simulated
from jaxreshard.bench._cases import case_from_json, case_to_json, load_cases, shipped_cases_path
from jaxreshard.pipeline import (
    SCHEDULE_NAMES,
    Costs,
    Schedule,
    _limits,
    _schedules,
    build_schedule,
    read_csv,
    read_json,
    schedule_from_csv,
    schedule_from_json,
    schedule_to_csv,
    simulate,
)
from jaxreshard.pipeline import _simulate as simulate_module

SHIPPED = json.loads(shipped_cases_path().read_text())


def timeline_json(name="eager_1f1b", p=3, m=4, **kw):
    schedule = build_schedule(name, p, m, **kw)
    return simulate(schedule, Costs.make(schedule.num_chunks, comm=0.5)).to_json()


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


LOADERS = {
    "csv": (read_csv, "x.csv"),
    "json": (read_json, "x.json"),
    "cases": (load_cases, "x.json"),
}


# -- files ------------------------------------------------------------------------------------


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize(
    "content, expected",
    [
        (b"\x00\x01binary", "is a binary file (a NUL byte at offset 0)"),
        (b"\xff\xfe0F0", "is not UTF-8 text (byte 0xff at offset 0)"),
        (b"", "is empty"),
        (b"  \n\n ", "is empty"),
    ],
)
def test_unreadable_content_is_one_error_naming_the_file(tmp_path, loader, content, expected):
    read, name = LOADERS[loader]
    path = write(tmp_path, name, content)
    with pytest.raises(ValueError, match=r"x\.(csv|json)") as info:
        read(path)
    assert expected in str(info.value)


@pytest.mark.parametrize("loader", LOADERS)
def test_missing_files_directories_and_pipes_are_refused(tmp_path, loader):
    read, name = LOADERS[loader]
    with pytest.raises(ValueError, match="no such file; check the path"):
        read(tmp_path / name)
    (tmp_path / "d.csv").mkdir()
    with pytest.raises(ValueError, match="is a directory"):
        read(tmp_path / "d.csv")
    os.mkfifo(tmp_path / "fifo")  # opening it would block until a writer comes: never
    with pytest.raises(ValueError, match="is not a regular file"):
        read(tmp_path / "fifo")
    with pytest.raises(ValueError, match="no such file"):
        read(tmp_path / "no-dir" / name)
    with pytest.raises(ValueError, match="a NUL byte"):
        read("a\0b")


def test_files_past_the_size_limit_are_refused_before_reading(tmp_path, monkeypatch):
    monkeypatch.setattr(_limits, "MAX_CSV_BYTES", 1000)
    path = write(tmp_path, "big.csv", "0F0," * 300)
    with pytest.raises(ValueError, match=r"is 1.2 kB \(1,200 bytes\); a schedule CSV is at most"):
        read_csv(path)
    monkeypatch.setattr(_cases, "MAX_CASES_BYTES", 100)
    with pytest.raises(ValueError, match="at most 100 bytes"):
        load_cases(write(tmp_path, "c.json", json.dumps(SHIPPED)))


def test_deep_json_is_refused_not_a_recursion_error(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    for read in (read_json, load_cases):
        with pytest.raises(ValueError, match="nested too deeply"):
            read(write(tmp_path, "deep.json", deep))
    nested: list = []
    for _ in range(10_000):  # built without recursion; handed over as data
        nested = [nested]
    data = {"format": "jaxreshard-schedule/2", "num_stages": 1, "num_micro_batches": 1}
    with pytest.raises(ValueError, match=r"stages\[0\]\[0\] is a list \[\[\[\.\.\.\]\]\]"):
        schedule_from_json({**data, "stages": nested})


# -- schedule CSV -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        # 19 bytes that used to take 8.4 GB: a stage index that implies 1e8 chunks.
        ("0F0,0B0\n99999999F0\n", "stage 99999999 would make a schedule of 100,000,000 chunks"),
        (
            "0F0,0B99999999\n",
            "micro-batch 99999999 would make a schedule of 1 chunks x 100,000,000",
        ),
        (
            "0F0,0B0\n1F0,1B0,1F5000000",
            "2 chunks x 5,000,001 micro-batches x 2 kinds = 20,000,004 actions",
        ),
        ("0F" + "9" * 5000, "has an index of 5000 digits; stages and micro-batches have at most 9"),
        ("0F0,0B0\n0F٣", "cannot parse '0F٣'"),  # a non-ASCII digit is no index
        ("0F0,0B0\r1F0,1B0\r", None),  # old Mac line ends read as rows
        ('"0F0\n0B0"', "cannot parse '0F0\\n0B0'"),
        ("0F0,0B0\n" + "x" * 200_000, "not CSV (field larger than field limit"),
    ],
)
def test_hostile_csv_cells_are_refused_with_the_estimate(text, expected):
    if expected is None:
        assert schedule_from_csv(text).num_stages == 2
        return
    with pytest.raises(ValueError) as info:
        schedule_from_csv(text, source="x.csv")
    message = str(info.value)
    assert expected in message and message.startswith("x.csv")
    if "would make" in message:
        assert "at most 200,000 actions" in message and "GB" in message


def test_many_cells_are_refused_before_parsing(monkeypatch):
    monkeypatch.setattr(_limits, "MAX_ACTIONS", 10)
    with pytest.raises(ValueError, match=r"21 cells .* at most 20"):
        schedule_from_csv("," * 20)


def test_a_huge_missing_range_is_named_without_listing_it():
    text = "0F0,0B0,0F1,0B1\n1F0,1B0,1F1,1B1,1F40000,1B40000\n"
    with pytest.raises(ValueError) as info:
        schedule_from_csv(text)
    message = str(info.value)
    assert "missing actions" in message and "0F2, 0B2, 0F3" in message
    assert "and 159982 more" in message and len(message) < 2000


def test_many_problems_make_a_short_message():
    rows = [",".join(f"{c}F0,{c}B0,{c}B0" for c in range(r * 50, r * 50 + 50)) for r in range(40)]
    with pytest.raises(ValueError) as info:
        schedule_from_csv("\n".join(rows))
    message = str(info.value)
    assert "appears 2 times" in message and "and 1988 more actions appear" in message
    assert len(message) < 5000


def test_a_large_grid_in_an_error_shows_the_marked_rows_only():
    schedule = build_schedule("1f1b", 60, 40)
    rows = [list(r) for r in schedule.actions]
    rows[30][10], rows[30][50] = rows[30][50], rows[30][10]  # a B before its F on rank 30
    text = schedule_to_csv(Schedule("x", 60, 40, False, False, rows))
    with pytest.raises(ValueError) as info:
        schedule_from_csv(text)
    message = str(info.value)
    assert "stage 30 | [0]" in message and "<-- ERROR HERE" in message
    assert "stage 29 |" not in message and len(message.splitlines()) < 12


# -- counts in the library --------------------------------------------------------------------


def test_build_schedule_refuses_huge_counts_fast_with_the_estimate():
    with pytest.raises(ValueError) as info:
        build_schedule("eager_1f1b", 10**9, 10**9)
    message = str(info.value)
    assert "eager_1f1b with 1,000,000,000 stages" in message
    assert "x 2 kinds = 2e+18 actions (~1.8e+04 EB, ~6.35e+06 years" in message
    assert "at most 200,000 actions (~1.8 GB) and 100,000 chunks" in message
    with pytest.raises(ValueError, match=r"2e\+09 actions \(~18 TB, ~\d+ h to .*at most 200,000"):
        build_schedule("gpipe", 10, 10**8)
    with pytest.raises(ValueError, match="would take ~40 GB of costs alone"):
        Costs.make(10**9)
    with pytest.raises(ValueError, match=r"must be an int >= 1"):
        build_schedule("1f1b", True, 4)


def test_a_schedule_claiming_huge_counts_is_refused_at_construction():
    with pytest.raises(ValueError, match="1 chunks x 1,000,000,000,000 micro-batches"):
        Schedule("x", 1, 10**12, False, False, [["0F0", "0B0"]])
    with pytest.raises(ValueError, match="1,000,000,000 chunks"):
        Schedule("x", 10**9, 1, False, False, [])


def test_weight_delay_with_a_huge_comm_ratio_stops_when_no_cap_binds(monkeypatch):
    # ceil(C / F) = 1e18 candidate caps: it used to try them all.
    costs = Costs.make(4, forward=1e-9, backward=2e-9, comm=1e9)
    schedule = build_schedule("eager_1f1b", 4, 8, weight_delay=True, costs=costs)
    assert schedule.split_backward
    # Were the caps to keep binding, the search stops at a budget of placements.
    place = _schedules._place_weights
    monkeypatch.setattr(_schedules, "_place_weights", lambda *a, **k: (place(*a, **k)[0], True))
    monkeypatch.setattr(_schedules, "MAX_WEIGHT_PLACEMENTS", 400)
    with pytest.raises(ValueError, match=r"would place 480 actions in all \(5 tries of 96\)"):
        build_schedule("eager_1f1b", 4, 8, weight_delay=True, costs=costs)


def test_costs_refuse_what_is_not_a_number():
    for bad, expected in [
        ("1,2", "must be a number or a sequence of 2 numbers"),
        ([1, "x"], "holds 'x'"),
        ([1, None], "holds None"),
        (float("inf"), "must be >= 0 and at most 1e"),
        (-1, "must be >= 0 and at most 1e"),
    ]:
        with pytest.raises(ValueError, match=expected):
            Costs.make(2, forward=bad)


# -- linear time ------------------------------------------------------------------------------


def test_100k_actions_import_check_and_simulate_event_driven(monkeypatch):
    """10,000 ranks x 10 actions: polling every rank per round made this take minutes. The
    simulators now wake a rank only when what it waits for is sent: count the wake-ups."""
    woken = []

    class Counting(simulate_module.deque):
        def popleft(self):
            woken.append(1)
            return super().popleft()

    monkeypatch.setattr(simulate_module, "deque", Counting)
    p = 10_000
    text = schedule_to_csv(build_schedule("1f1b", p, 5))
    schedule = schedule_from_csv(text)  # checks: simulates with and without overlap
    assert sum(map(len, schedule.actions)) == 100_000
    timeline = simulate(schedule, Costs.make(p, comm=0.5))
    transfers = len(timeline.transfers)
    assert transfers == 2 * (p - 1) * 5
    # Each simulation: every rank once, then at most one wake-up per transfer.
    assert len(woken) <= 3 * (p + transfers)


# -- schedule JSON ----------------------------------------------------------------------------


def _set(data, path, value):
    target = data
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value


@pytest.mark.parametrize(
    "path, value, expected",
    [
        (("format",), "jaxreshard-schedule/9", "newer version than this jaxreshard reads"),
        (("format",), None, "format=None: expected a jaxreshard-schedule/1 or /2"),
        (("stages",), KeyError, "stages is missing; expected one list of actions per rank"),
        (("stages",), "abc", "stages is a string 'abc'"),
        (("stages", 1), {"a": 1}, "stages[1] is an object"),
        (("stages", 1, 0), [], "stages[1][0] is a list [];"),
        (("stages", 1, 0, "mb"), "0", "stages[1][0].mb is a string '0'"),
        (("stages", 1, 0, "mb"), 1.5, "stages[1][0].mb is a number 1.5"),
        (("stages", 1, 0, "mb"), True, "stages[1][0].mb is a boolean True"),
        (("stages", 1, 0, "mb"), -3, "stages[1][0].mb = -3; expected an integer in 0.."),
        (("stages", 1, 0, "kind"), "Q", "stages[1][0].kind = 'Q'; expected one of 'F', 'B'"),
        (("stages", 1, 0, "kind"), ["F"], "stages[1][0].kind = ['F']"),
        (("stages", 1, 0, "start"), KeyError, "stages[1][0] lacks the key 'start'"),
        (("stages", 1, 0, "start"), float("nan"), "start = nan; expected a finite number"),
        (("stages", 1, 0, "end"), -5, "end = -5; expected a number >= "),
        (("stages", 1, 0, "chunk"), 10**30, "chunk = 1000000000000000000000000000000"),
        (("stages", 1, 0, "fused"), "yes", "fused is a string 'yes'; expected true or false"),
        (("num_stages",), 10**9, "num_stages = 1000000000; expected an integer in 1..100,000"),
        (("num_stages",), 2, "stages has 3 lists, but num_stages is 2"),
        (("num_micro_batches",), 10**8, "num_micro_batches = 100000000; expected an integer in"),
        (
            ("num_micro_batches",),
            10**5,
            "3 chunks x 100,000 micro-batches x 2 kinds = 600,000 actions",
        ),
        (("placement",), {"0": 0}, "placement is an object"),
        (("placement", 0), 7, "placement[0] = 7; expected an integer in 0..2"),
        (("split_backward",), "no", "split_backward is a string 'no'"),
        (("schedule",), ["x"], "schedule is a list ['x']; expected a string"),
        (("stages", 1, 0, "mb"), 99, "micro-batch 99 is not in 0..3"),
        (("stages", 2), [], "stage 2 lacks 2F0, 2F1, 2F2, 2F3"),
    ],
)
def test_bad_schedule_json_names_the_key_path(path, value, expected):
    data = timeline_json()
    _set(data, path, value)
    with pytest.raises(ValueError) as info:
        schedule_from_json(data, source="t.json")
    assert str(info.value).startswith("t.json") and expected in str(info.value)


def test_schedule_json_file_round_trips(tmp_path):
    data = timeline_json("zbv", 3, 6)
    path = write(tmp_path, "z.json", json.dumps(data))
    again = read_json(path)
    assert again.actions == schedule_from_json(data).actions
    assert again.placement == tuple(data["placement"])


# -- case files -------------------------------------------------------------------------------


def case_file(tmp_path, change):
    data = copy.deepcopy(SHIPPED)
    change(data)
    return write(tmp_path, "cases.json", json.dumps(data))


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda d: d.update(format="jaxreshard-reshard-cases/2"), "a version this jaxreshard"),
        (lambda d: d.update(format=7), "format is 7, expected 'jaxreshard-reshard-cases/1'"),
        (lambda d: d.pop("cases"), "cases is missing; expected a list of cases"),
        (lambda d: d.update(cases=[]), "cases is empty"),
        (lambda d: d.update(cases={"a": 1}), "cases is an object"),
        (lambda d: d["cases"].__setitem__(0, "case1"), "cases[0] is a string 'case1'"),
        (lambda d: d["cases"][1].pop("shape"), "cases[1] (case2) lacks the key 'shape'"),
        (lambda d: d["cases"][1].update(shape="1024"), "cases[1] (case2).shape is a string"),
        (lambda d: d["cases"][1].update(shape=[1024, 0]), "shape[1] = 0; expected an integer >= 1"),
        (lambda d: d["cases"][1].update(shape=[1024, 2.5]), "shape[1] is a number 2.5"),
        (
            lambda d: d["cases"][1].update(shape=[10**6, 10**6]),
            "has 1e+12 elements (~4 TB of float32); at most 2**38",
        ),
        (lambda d: d["cases"][1].update(shape=[1] * 17), "shape has 17 entries; at most 16"),
        (lambda d: d["cases"][1].update(dtype="float7"), "dtype='float7' is not a dtype JAX knows"),
        (lambda d: d["cases"][1].update(typo=1), "has the unknown key 'typo'"),
        (lambda d: d["cases"][1]["src_mesh"].pop("axis_names"), "lacks the key 'axis_names'"),
        (
            lambda d: d["cases"][1]["src_mesh"].update(shape=[1000, 1000, 1000]),
            "src_mesh.shape[0] = 1000; expected an integer in 1..128",
        ),
        (
            lambda d: d["cases"][1]["src_mesh"].update(shape=[8, 8, 4], axis_names=["x", "y", "z"]),
            "has 256 devices; at most 128 per mesh",
        ),
        (lambda d: d["cases"][1]["src_mesh"].update(axis_names=["x", "x"]), "one distinct name"),
        (lambda d: d["cases"][1]["src_mesh"].update(devices_per_host=0), "devices_per_host = 0"),
        (lambda d: d["cases"][1].update(src_spec=["q", None, None]), "src_spec[0] = 'q'"),
        (lambda d: d["cases"][1].update(src_spec=[["x", 3]]), "src_spec[0] = ['x', 3]"),
        (lambda d: d["cases"][1].update(src_spec=[None] * 4), "src_spec has 4 entries; at most 3"),
        (lambda d: d["cases"][1].update(src_spec=[["x", "x"]]), "uses mesh axis 'x' for dims 0"),
        (lambda d: d["cases"][1].update(shape=[1023, 8, 8]), "does not divide it"),
        (lambda d: d["cluster"].update(latency_s=-1), "cluster.latency_s = -1"),
        (lambda d: d["cluster"].update(inter_host_gbytes_per_s=0), "expected a number >= 1e-06"),
        (lambda d: d["cluster"].update(inter_host_gbytes_per_sec=1), "unknown key"),
        (
            lambda d: d["cases"][2].update(name="case1"),
            "also cases[0]'s name; case names are unique",
        ),
        (
            lambda d: d["cases"][2].update(name="../../etc/x"),
            "cases[2].name = '../../etc/x': a case",
        ),
        (lambda d: d["cases"][2].update(name="/abs"), "cases[2].name = '/abs'"),
        (lambda d: d["cases"][2].update(name="a\0b"), r"cases[2].name = 'a\x00b'"),
        (lambda d: d["cases"][2].update(name="a\nb"), r"cases[2].name = 'a\nb'"),
        (lambda d: d["cases"][2].update(name=".hidden"), "not starting with '.'"),
        (lambda d: d["cases"][2].update(name=3), "cases[2].name = 3"),
    ],
)
def test_bad_case_files_name_the_key_path(tmp_path, change, expected):
    path = case_file(tmp_path, change)
    with pytest.raises(ValueError) as info:
        load_cases(path)
    assert str(info.value).startswith(f"--cases {path}")
    assert expected in str(info.value)


def test_a_case_with_too_many_regions_is_refused_before_planning():
    case = copy.deepcopy(SHIPPED["cases"][0])
    case.update(shape=[4096, 4096, 4096], src_spec=["x", "y", None], dst_spec=[None, "x", "y"])
    case["src_mesh"] = {"shape": [64, 64], "axis_names": ["x", "y"]}
    case["dst_mesh"] = {"shape": [63, 65], "axis_names": ["x", "y"]}
    case["shape"] = [4096, 4095 * 64, 65]
    with pytest.raises(ValueError, match=r"about [\d,]+ regions to move; at most 32,768"):
        # (meshes this large pass: the region count is the limit here)
        case_from_json(case, SHIPPED["cluster"], where="c.json: cases[0]", max_mesh_devices=4096)


def test_plan_files_stay_in_their_folder(tmp_path):
    folder = tmp_path / "plans"
    assert _simulated.plan_path(folder, "case1", "auto") == (folder / "case1.auto.json").resolve()
    for name in ("../../etc/x", "/abs", "a\0b", "a\nb", ".hidden", "", "x" * 65):
        with pytest.raises(ValueError, match="cannot name a file"):
            _simulated.plan_path(folder, name, "auto")
    # A case made in code (not read from a file) with a bad name writes nothing anywhere.
    entry = dict(SHIPPED["cases"][2], name="../escape")
    case = case_from_json(entry, SHIPPED["cluster"])
    with pytest.raises(ValueError, match=r"case name '\.\./escape' cannot name a file"):
        _simulated.bench_cases(
            [case], cluster=SHIPPED["cluster"], strategies=("send_recv",), dump_plans=folder
        )
    assert not folder.exists() and not (tmp_path / "escape.send_recv.json").exists()
    good = case_from_json(SHIPPED["cases"][2], SHIPPED["cluster"])
    with pytest.raises(ValueError, match="two cases are named 'case3'"):
        _simulated.bench_cases(
            [good, good], cluster=SHIPPED["cluster"], strategies=("send_recv",), dump_plans=folder
        )


# -- properties -------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
CSV_TEXT = st.text(alphabet=string.digits + 'FBIWA,;()\n\r "' + "OVERLAP_", max_size=80)


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.text(max_size=200), CSV_TEXT))
def test_any_text_is_a_schedule_or_a_value_error(text):
    try:
        schedule = schedule_from_csv(text)
    except ValueError:
        return
    assert schedule_from_csv(schedule_to_csv(schedule, overlap_pairs=True)).actions == (
        schedule.actions
    )


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200), st.sampled_from(sorted(LOADERS)))
def test_any_bytes_in_a_file_are_read_or_refused(tmp_path_factory, data, loader):
    read, name = LOADERS[loader]
    path = tmp_path_factory.mktemp("b") / name
    path.write_bytes(data)
    try:
        read(path)
    except ValueError as e:
        assert str(path) in str(e)


@settings(max_examples=300, deadline=None)
@given(JSON)
def test_any_json_is_refused_with_a_value_error(data):
    with pytest.raises(ValueError):
        schedule_from_json(data)
    with pytest.raises(ValueError):
        schedule_from_json({"format": "jaxreshard-schedule/2", "num_stages": 1, "stages": data})
    with pytest.raises(ValueError):
        case_from_json(data, {})
    if isinstance(data, dict):
        with pytest.raises(ValueError):
            case_from_json({**SHIPPED["cases"][0], **data, "shape": data}, {})


def _leaves(data, path=()):
    """Every (path, value) of a JSON value, iteratively."""
    stack = [(path, data)]
    while stack:
        path, value = stack.pop()
        yield path, value
        if isinstance(value, dict):
            stack += [((*path, k), v) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [((*path, i), v) for i, v in enumerate(value)]


VALID_TIMELINE = timeline_json("dualpipev", 2, 4)
TIMELINE_PATHS = [p for p, _ in _leaves(VALID_TIMELINE) if p]
CASE_PATHS = [p for p, _ in _leaves(SHIPPED) if p]


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(TIMELINE_PATHS), JSON | st.just(KeyError))
def test_one_changed_value_in_a_timeline_is_read_or_refused(path, value):
    data = copy.deepcopy(VALID_TIMELINE)
    _set(data, path, value)
    try:
        schedule = schedule_from_json(data)
    except ValueError:
        return
    assert sum(map(len, schedule.actions)) == sum(map(len, data["stages"]))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(CASE_PATHS), JSON | st.just(KeyError))
def test_one_changed_value_in_a_case_file_is_read_or_refused(tmp_path_factory, path, value):
    data = copy.deepcopy(SHIPPED)
    _set(data, path, value)
    file = tmp_path_factory.mktemp("c") / "cases.json"
    file.write_text(json.dumps(data))
    try:
        load_cases(file)
    except ValueError as e:
        assert str(file) in str(e)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(SCHEDULE_NAMES),
    st.integers(1, 5),
    st.integers(1, 10),
    st.booleans(),
    st.booleans(),
)
def test_schedules_round_trip_through_csv_and_json_files(tmp_path_factory, name, p, m, wd, pairs):
    schedule = build_schedule(name, p, m, weight_delay=wd)
    folder = tmp_path_factory.mktemp("s")
    (folder / "s.csv").write_text(schedule_to_csv(schedule, overlap_pairs=pairs))
    again = read_csv(folder / "s.csv")
    assert again.num_micro_batches == m and again.placement == schedule.placement
    if not schedule.split_backward or again.split_backward:
        assert again.actions == schedule.actions
    data = simulate(schedule, Costs.make(schedule.num_chunks, comm=0.25)).to_json()
    (folder / "s.json").write_text(json.dumps(data))
    back = read_json(folder / "s.json")
    assert back.actions == schedule.actions and back.fused == schedule.fused
    assert back.placement == schedule.placement and back.name == name


@st.composite
def cases(draw):
    """A valid case: meshes of up to 3 axes, specs that divide the shape."""
    sides = {}
    shape = [draw(st.integers(1, 4)) for _ in range(draw(st.integers(1, 3)))]
    factors = [1] * len(shape)
    for side in ("src", "dst"):
        mesh_shape = [draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 3)))]
        names = ["x", "y", "z"][: len(mesh_shape)]
        spec, free = [], list(zip(names, mesh_shape))
        for d in range(len(shape)):
            k = draw(st.integers(0, len(free)))
            axes, free = free[:k], free[k:]
            size = 1
            for _, n in axes:
                size *= n
            factors[d] = factors[d] * size // _gcd(factors[d], size)
            spec.append(None if not axes else [a for a, _ in axes])
        mesh = {"shape": mesh_shape, "axis_names": names}
        if draw(st.booleans()):
            mesh["devices_per_host"] = draw(st.integers(1, 4))
        sides[side] = (mesh, spec)
    return {
        "name": draw(st.from_regex(_cases.NAME, fullmatch=True)),
        "shape": [n * f for n, f in zip(shape, factors)],
        "dtype": draw(st.sampled_from(["float32", "bfloat16", "int8"])),
        "src_mesh": sides["src"][0],
        "src_spec": sides["src"][1],
        "dst_mesh": sides["dst"][0],
        "dst_spec": sides["dst"][1],
    }


def _gcd(a, b):
    while b:
        a, b = b, a % b
    return a


@settings(max_examples=100, deadline=None)
@given(cases(), st.integers(1, 8))
def test_cases_round_trip_through_json(tmp_path_factory, entry, per_host):
    cluster = dict(SHIPPED["cluster"], devices_per_host=per_host)
    case = case_from_json(entry, cluster)
    assert case_from_json(case_to_json(case), {}) == case
    file = tmp_path_factory.mktemp("c") / "cases.json"
    file.write_text(
        json.dumps({"format": _cases.CASES_FORMAT, "cluster": cluster, "cases": [entry]})
    )
    assert load_cases(file) == (cluster, [case])


def test_show_keeps_messages_short():
    assert len(_files.show("x" * 10**6)) < 60
    assert len(_files.show(list(range(10**5)))) < 60


def test_a_programs_own_case_may_plan_a_mesh_larger_than_a_case_files():
    """A case file's meshes stop at `MAX_MESH_DEVICES`; a benchmark's own cases (planning time
    on 64 hosts x 8 devices) raise the limit for themselves, and only they."""
    from jaxreshard.bench._cases import paper_cluster

    case = {
        "name": "big", "shape": [512, 8], "dtype": "float32",
        "src_mesh": {"shape": [8, 8, 8], "axis_names": ["x", "y", "z"]},
        "src_spec": [["x", "y", "z"], None],
        "dst_mesh": {"shape": [8, 8, 8], "axis_names": ["x", "y", "z"]},
        "dst_spec": [None, None],
    }  # fmt: skip
    with pytest.raises(_files.InputError, match="has 512 devices; at most 128 per mesh"):
        case_from_json(case, paper_cluster(8))
    big = case_from_json(case, paper_cluster(8), max_mesh_devices=512)
    assert big.cluster.num_hosts == 128
