"""`jaxreshard profile` configuration: TOML tables, flag overrides and their errors."""

import dataclasses
import json

import jax.numpy as jnp
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxreshard as jr
from jaxreshard.cli import main
from jaxreshard.profiler import RunConfig, load_profile_config
from jaxreshard.profiler._config import TABLES
from jaxreshard.runtime._config import PipelineConfig


def write(tmp_path, text):
    path = tmp_path / "profile.toml"
    path.write_text(text)
    return path


def test_defaults_preset_file_and_flags_in_order(tmp_path):
    path = write(
        tmp_path,
        """
[model]
name = "gpt"
preset = "tiny"
layers = 6
[run]
steps = 7
[pipeline]
num_stages = 3
schedule = "1f1b"
stage_mesh_shape = [2, 1]
""",
    )
    pc = load_profile_config(
        "gpt", path, {"pipeline": {"schedule": "zb_h1", "num_micro_batches": "8"}}
    )
    assert pc.model_config.layers == 6  # the file overrides the preset
    assert pc.model_config.hidden == 64  # the preset's
    assert pc.run.steps == 7
    assert pc.pipeline.schedule == "zb_h1"  # the flag overrides the file
    assert pc.pipeline.num_micro_batches == 8  # flags arrive as strings
    assert pc.pipeline.stage_mesh_shape == (2, 1)
    assert pc.pipeline.mesh_axis_names == ("data", "model")  # the profile's default
    assert pc.num_stages == 3


def test_flag_values_are_parsed_by_field_type():
    pc = load_profile_config(
        "utransformer",
        None,
        {
            "model": {"channel_mult": "1,2,2,4", "base": "8"},
            "run": {"learning_rate": "3e-3", "address": "none", "plain_steps": "0"},
            "pipeline": {
                "stage_mesh_shape": "1x2",
                "emulate_network_gbps": "1.25",
                "batch_axis": "none",
                "weight_delay": False,
            },
        },
    )
    assert pc.model_config.channel_mult == (1, 2, 2, 4)
    assert pc.model_config.base == 8
    assert pc.run.learning_rate == 3e-3 and pc.run.address is None
    assert pc.run.plain_steps == 0 and pc.run.num_plain_steps == 0
    assert pc.pipeline.stage_mesh_shape == (1, 2)
    assert pc.pipeline.emulate_network_gbps == 1.25
    assert pc.pipeline.batch_axis is None
    assert pc.pipeline.weight_delay is False


@pytest.mark.parametrize(
    "text, words",
    [
        ("[modle]\npreset = 'tiny'\n", ["modle", "[model]", "[run]", "[pipeline]"]),
        ("[model]\nhiden = 32\n", ["hiden", "valid keys", "hidden"]),
        ("[model]\npreset = 'huge'\n", ["preset='huge'", "tiny", "125M", "2.6B"]),
        ("[model]\nname = 'utransformer'\n", ["name='utransformer'", "gpt"]),
        ("[run]\nsteps = 'ten'\n", ["steps", "'ten'", "integer"]),
        ("[run]\nbatch_size = 10\n", ["batch_size=10", "num_micro_batches=4", "multiple"]),
        ("[pipeline]\nschedule = '1f2b'\n", ["schedule='1f2b'", "eager_1f1b", "zb_h1"]),
        ("[pipeline]\nresharding = 'magic'\n", ["resharding='magic'", "broadcast_greedy"]),
        ("[pipeline]\nnum_stages = 9\n", ["num_stages=9", "4 layers", "at most 4"]),
        ("[pipeline]\nmicro_batches = 4\n", ["micro_batches", "num_micro_batches"]),
        ("[model]\nhidden = 30\n", ["hidden=30", "heads=4"]),
        ("not toml = = 1", ["not valid TOML"]),
        ("[pipeline]\ncost_forward = [1, -2]\n", ["cost_forward=(1, -2)", "> 0", "per model"]),
        (
            "[pipeline]\ncost_comm = 'fast'\n",
            ["cost_comm='fast'", "a number or a list", "without quotes"],
        ),
        ("[run]\nplacement_costs = 'guess'\n", ["placement_costs='guess'", "measured"]),
        ("[run]\nplain_steps = -1\n", ["plain_steps=-1", "from 0", "or none"]),
    ],
)
def test_bad_config_files_name_key_value_and_choices(tmp_path, text, words):
    path = write(tmp_path, text)
    with pytest.raises(ValueError) as info:
        load_profile_config("gpt", path)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert str(path) in str(info.value) or "hidden=30" in str(info.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.toml: no such file"):
        load_profile_config("gpt", tmp_path / "nope.toml")


def test_bad_flags_exit_2_with_the_flag_named(capsys):
    assert main(["profile", "gpt", "--schedule", "1f2b"]) == 2
    err = capsys.readouterr().err
    assert "schedule='1f2b'" in err and "--schedule" in err and "eager_1f1b" in err
    assert main(["profile", "gpt", "--steps", "many"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert main(["profile", "utransformer", "--stage-mesh-shape", "1,two"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err


def test_unknown_model_is_an_argparse_error(capsys):
    assert main(["profile", "bert"]) == 2
    assert "gpt" in capsys.readouterr().err


def test_shipped_configs_load(monkeypatch):
    import tomllib
    from pathlib import Path

    root = Path(__file__).parent.parent
    monkeypatch.chdir(root)  # (a config of a model file names it from the repository's root)
    configs = sorted((root / "examples" / "configs").glob("*.toml"))
    assert len(configs) >= 4
    for path in configs:
        model = tomllib.loads(path.read_text())["model"]["name"]
        pc = load_profile_config(model, path)
        assert pc.spec.num_params(pc.model_config) > 0


def trained(optimizer):
    """A parameter at 1 after two updates with gradient 10: compares optimizers by what they
    do (Optax transformations do not compare)."""
    params = {"w": jnp.ones(3)}
    state = optimizer.init(params)
    for _ in range(2):
        updates, state = optimizer.update({"w": jnp.full(3, 10.0)}, state, params)
        params = optax.apply_updates(params, updates)
    return float(params["w"][0])


def test_optimizer_keys_from_file_and_flags(tmp_path):
    pc = load_profile_config("gpt")
    assert pc.run.optimizer == "adam"
    assert trained(pc.run.make_optimizer()) == trained(optax.adam(1e-3))
    path = write(
        tmp_path,
        "[run]\noptimizer = 'adamw'\nlearning_rate = 0.1\nweight_decay = 0.5\nclip_norm = 2.0\n",
    )
    pc = load_profile_config("gpt", path)
    assert (pc.run.optimizer, pc.run.weight_decay, pc.run.clip_norm) == ("adamw", 0.5, 2.0)
    want = optax.chain(optax.clip_by_global_norm(2.0), optax.adamw(0.1, weight_decay=0.5))
    assert trained(pc.run.make_optimizer()) == trained(want)
    assert pc.to_json()["run"]["optimizer"] == "adamw"
    # Flags override the file ("none" unsets a key the file set).
    flags = {"optimizer": "sgd", "momentum": "0.9", "learning_rate": "0.01", "clip_norm": "none"}
    pc = load_profile_config("gpt", path, {"run": {**flags, "weight_decay": "none"}})
    assert pc.run.clip_norm is None and pc.run.momentum == 0.9
    assert trained(pc.run.make_optimizer()) == trained(optax.sgd(0.01, momentum=0.9))
    pc = load_profile_config("gpt", None, {"run": {"optimizer": "sgd"}})
    assert trained(pc.run.make_optimizer()) == trained(optax.sgd(1e-3))


@pytest.mark.parametrize(
    "text, flags, words",
    [
        ("optimizer = 'adagrad'", {}, ["optimizer='adagrad'", "adam, adamw, sgd", "FILE"]),
        ("", {"optimizer": "lion"}, ["optimizer='lion'", "adam, adamw, sgd", "--optimizer"]),
        ("optimizer = 3", {}, ["optimizer=3", "string", "FILE"]),
        ("weight_decay = 0.1", {}, ["weight_decay=0.1", "optimizer='adamw'", "FILE"]),
        ("optimizer = 'sgd'", {"weight_decay": "0.1"}, ["weight_decay=0.1", "--weight-decay"]),
        ("optimizer = 'adamw'\nweight_decay = -1", {}, ["weight_decay=-1", ">= 0", "FILE"]),
        ("momentum = 0.9", {}, ["momentum=0.9", "optimizer='sgd'", "optimizer='adam'"]),
        ("optimizer = 'sgd'\nmomentum = 1.0", {}, ["momentum=1.0", "< 1", "FILE"]),
        ("clip_norm = 0", {}, ["clip_norm=0", "> 0", "FILE"]),
        ("", {"clip_norm": "big"}, ["clip_norm='big'", "number", "--clip-norm"]),
        ("learning_rate = -1", {}, ["learning_rate=-1", "> 0", "FILE"]),
        ("optimiser = 'adam'", {}, ["optimiser", "valid keys", "optimizer", "clip_norm"]),
    ],
)
def test_bad_optimizer_keys_name_source_value_and_choices(tmp_path, text, flags, words):
    path = write(tmp_path, f"[run]\n{text}\n")
    with pytest.raises(ValueError) as info:
        load_profile_config("gpt", path, {"run": flags})
    message = str(info.value)
    for word in words:
        assert word.replace("FILE", f"{path} [run]") in message, (word, message)


def test_optimizer_flags_exist(capsys):
    assert main(["profile", "gpt", "--optimizer", "adagrad"]) == 2
    err = capsys.readouterr().err
    assert "--optimizer" in err and "adamw" in err


def test_per_stage_costs_from_file_and_flags(tmp_path):
    """The schedule builder's cost model may be one number or one per stage (a profile's
    measured costs); lengths are checked against the step's stages, naming the field."""
    from jaxreshard.runtime.step._layout import schedule_costs

    path = write(tmp_path, "[pipeline]\ncost_forward = [2, 1]\ncost_weight_grad = 0.5\n")
    pc = load_profile_config(
        "gpt",
        path,
        {
            "pipeline": {"cost_backward": "3,2.5", "cost_comm": "0.25"},
            "run": {"placement_costs": "config"},
        },
    )
    p = pc.pipeline
    assert (p.cost_forward, p.cost_backward, p.cost_weight_grad, p.cost_comm) == (
        (2.0, 1.0), (3.0, 2.5), 0.5, 0.25,
    )  # fmt: skip
    costs = schedule_costs(p, 2)
    assert costs.forward == (2.0, 1.0) and costs.weight_grad == (0.5, 0.5)
    assert costs.comm == (0.25,)
    with pytest.raises(
        ValueError, match=r"cost_forward=\[2.0, 1.0\]\): the step has 3 model stages.*not 2"
    ):
        schedule_costs(p, 3)
    with pytest.raises(ValueError, match=r"cost_weight_grad=.*exceeds cost_backward"):
        p.replace(cost_weight_grad=(0.5, 2.6))


# -- property tests: any file loads or is refused with one ValueError ----------------------------


def _toml(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(_toml, value)) + "]"
    return str(value)


_KEYS = sorted(
    {f.name for f in dataclasses.fields(PipelineConfig)}
    | {f.name for f in dataclasses.fields(RunConfig)}
    | {"name", "preset", "layers", "hidden", "heads", "seq", "vocab", "nonsense"}
)
_SCALARS = (
    st.integers(-(2**66), 2**66)
    | st.sampled_from([0, 1, 2, 4, 8, 10**12])
    | st.floats()
    | st.booleans()
    | st.text(st.characters(codec="ascii", exclude_characters="\x7f"), max_size=12)
    | st.sampled_from(["gpt", "tiny", "1f1b", "eager_1f1b", "data", "none", "1,2"])
)
FIXTURE = HealthCheck.function_scoped_fixture  # the test rewrites one file each example
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4), max_leaves=12)
_TABLES = st.dictionaries(
    st.sampled_from([*TABLES, "optimizer"]),
    st.dictionaries(st.sampled_from(_KEYS), _VALUES, max_size=5),
    max_size=3,
)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(tables=_TABLES)
def test_any_profile_config_loads_or_is_one_value_error(tmp_path, tables):
    text = "".join(
        f"[{table}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in values.items())
        for table, values in tables.items()
    )
    path = write(tmp_path, text)
    try:
        pc = load_profile_config("gpt", path)
    except ValueError as e:
        assert str(e) and "\n" not in str(e).strip(), str(e)
        return
    assert isinstance(pc.pipeline, PipelineConfig) and pc.run.learning_rate > 0
    assert all(isinstance(n, str) for n in pc.pipeline.mesh_axis_names)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_any_bytes_load_or_are_one_value_error(tmp_path, raw):
    path = tmp_path / "profile.toml"
    path.write_bytes(raw)
    try:
        load_profile_config("utransformer", path)
    except ValueError as e:
        assert str(path) in str(e) or "[" in str(e), str(e)


@pytest.mark.parametrize(
    "sizes, per_host, spans",
    [
        ([2, 2], 2, False),  # one stage per host
        ([4, 4], 2, True),  # each stage takes two hosts
        ([1, 2], 2, True),  # the second mesh starts on host 0 and ends on host 1
        ([1, 1, 2], 2, False),
        ([3], 4, False),
    ],
)
def test_a_profile_joins_jax_distributed_only_for_meshes_that_span_hosts(sizes, per_host, spans):
    from jaxreshard.profiler._profile import meshes_span_hosts

    assert meshes_span_hosts(sizes, per_host) is spans


def test_a_written_config_loads_back_the_same_none_included(tmp_path):
    """`--auto-toml` writes the chosen config; TOML has no null, and a key left out loads as its
    default (`batch_axis` as "data"), so a `None` the user set is written as "none"."""
    from jaxreshard.profiler._auto_report import profile_toml

    flags = {"run": {"clip_norm": "none"}, "pipeline": {"batch_axis": "none"}}
    pc = load_profile_config("gpt", None, flags)
    assert pc.pipeline.batch_axis is None
    path = tmp_path / "again.toml"
    path.write_text(profile_toml(pc))
    assert 'batch_axis = "none"' in path.read_text()
    again = load_profile_config("gpt", path)
    assert again.pipeline == pc.pipeline and again.run == pc.run
    # The library reads the [pipeline] table of the same file alike.
    assert jr.PipelineConfig.from_toml(path) == pc.pipeline
    path.write_text('[run]\naddress = "None"\n')
    assert load_profile_config("gpt", path).run.address is None


def test_none_in_a_file_is_none_unless_a_literal_names_it():
    from typing import Literal

    from jaxreshard.profiler._config import coerce

    assert coerce("none", str | None, "w") is None
    assert coerce("none", Literal["none", "gelu"] | None, "w") == "none"
    with pytest.raises(ValueError, match="integer"):
        coerce("none", int, "w")  # (a field that takes no None)
