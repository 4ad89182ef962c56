"""A model of the user's own in `jaxreshard profile` (see [Note: user models]): a .py file or a
module that follows the built-in models' conventions profiles, partitions and searches like
them, and equals `jax.jit`; a reference that does not load says what is missing."""

import dataclasses
import io
import json
import shutil
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxreshard import profiler
from jaxreshard.cli import main
from jaxreshard.models import get_model
from jaxreshard.profiler import load_profile_config
from jaxreshard.profiler._report import summary_tables

EXAMPLE = str(Path(__file__).parent.parent / "examples" / "profile_model.py")


SCAN_EXAMPLE = str(Path(__file__).parent.parent / "examples" / "profile_scan_model.py")


def example_config(path=EXAMPLE, layers=3, **pipeline):
    return load_profile_config(
        path,
        None,
        {
            "model": {"layers": layers, "width": 32, "hidden": 64},
            "run": {"steps": 3, "batch_size": 8},
            "pipeline": {"num_micro_batches": 4, "stage_mesh_shape": (1, 1), **pipeline},
        },
    )


def rich_text(table):
    from rich.console import Console

    console = Console(width=200, record=True, file=io.StringIO())
    console.print(table)
    return console.export_text()


def jit_losses(pc, steps):
    """The losses of `steps` steps of the model's own step under `jax.jit`, from the same
    parameters and batches as the profile."""
    spec = pc.spec
    optimizer = pc.run.make_optimizer()
    params = spec.module.init_params(pc.model_config, pc.run.seed)
    opt = optimizer.init(params)
    step = jax.jit(spec.train_step(pc.model_config, 1, optimizer, False))
    out = []
    for i in range(steps):
        batch = spec.module.synthetic_batch(pc.model_config, pc.run.batch_size, i, pc.run.seed)
        params, opt, loss = step(params, opt, batch)
        out.append(float(loss))
    return np.array(out)


def test_a_model_file_profiles_and_equals_jax_jit():
    pc = example_config(schedule="1f1b", weight_delay=False)
    assert pc.model == EXAMPLE and pc.preset == "tiny" and not pc.spec.builtin
    result = profiler.run_profile(pc, progress=False)
    assert result["model"] == EXAMPLE
    cfg = pc.model_config
    blocks = cfg.layers * (2 * cfg.width * cfg.hidden + cfg.hidden + cfg.width)
    assert result["num_params"] == blocks + cfg.width * cfg.classes + cfg.classes
    losses = np.array([s["loss"] for s in result["steps"]])
    warm = pc.run.warmup_steps
    np.testing.assert_allclose(losses, jit_losses(pc, warm + len(losses))[warm:], rtol=2e-5)
    assert result["unit"] == "samples" and result["samples_per_second"] > 0
    step_table = summary_tables(result)[0]  # one throughput column for this unit
    assert [c.header for c in step_table.columns].count("samples/s") == 1
    assert f"{result['samples_per_second']:,.1f}" in rich_text(step_table)


def test_partition_auto_cuts_a_model_file_at_its_candidates(capsys):
    pc = example_config(partition="auto", num_stages=2, partition_trials=0)
    assert pc.candidates
    result = profiler.run_profile(pc, progress=False)
    assert len(result["cuts"]) == 1 and 0 <= result["cuts"][0] < pc.model_config.layers - 1
    losses = np.array([s["loss"] for s in result["steps"]])
    warm = pc.run.warmup_steps
    np.testing.assert_allclose(losses, jit_losses(pc, warm + len(losses))[warm:], rtol=2e-5)


@pytest.mark.parametrize(
    "pipeline", [{"num_stages": 2}, {"partition": "auto", "num_stages": 3, "partition_trials": 0}]
)
def test_a_scan_over_layers_model_file_is_cut_inside_its_scan_and_equals_jax_jit(pipeline):
    """The example whose blocks are one jr.scan: even stages by its `boundaries=`, or cuts
    that partition="auto" chooses among the gaps between the blocks."""
    pc = example_config(SCAN_EXAMPLE, layers=4, **pipeline)
    result = profiler.run_profile(pc, progress=False)
    assert len(result["stages"]) == pipeline["num_stages"]
    if "partition" in pipeline:
        assert len(result["cuts"]) == 2 and result["partition"]["markers"] == [0, 1, 2]
    losses = np.array([s["loss"] for s in result["steps"]])
    warm = pc.run.warmup_steps
    np.testing.assert_allclose(losses, jit_losses(pc, warm + len(losses))[warm:], rtol=2e-5)


def test_the_command_takes_a_model_file_with_its_flags_and_auto_writes_a_config_that_loads(
    tmp_path, capsys
):
    toml, out = tmp_path / "best.toml", tmp_path / "auto.json"
    flags = ["--layers", "3", "--width", "32", "--hidden", "64", "--batch-size", "8",
             "--stage-mesh-shape", "1,1", "--steps", "2", "--no-progress", "--compile-cache",
             "off"]  # fmt: skip
    code = main(["profile", EXAMPLE, *flags, "--auto", "--auto-meshes", "keep",
                 "--auto-virtual", "keep", "--auto-top", "1", "--auto-toml", str(toml),
                 "--json", str(out), "--plain-steps", "0"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    record = json.loads(out.read_text())
    assert record["model"] == EXAMPLE and record["layouts"][0]["cuts"] is not None
    assert {row["label"] for row in record["measured"]} >= {"data parallel"}
    again = load_profile_config(EXAMPLE, toml)  # the winner's config names the model file
    assert again.model == EXAMPLE and again.model_config.width == 32
    assert json.loads(json.dumps(again.pipeline.to_dict())) == record["winner_pipeline"]

    assert main(["profile", EXAMPLE, "--help"]) == 0
    text = capsys.readouterr().out
    assert "--width V" in text and "features every block reads and writes" in text
    assert "tiny, deep (default: tiny)" in text


def test_a_module_on_the_path_and_a_spec_attribute_load(tmp_path, monkeypatch):
    shutil.copy(EXAMPLE, tmp_path / "my_mlp.py")
    (tmp_path / "my_specs.py").write_text(
        textwrap.dedent(
            """
            import my_mlp
            from jaxreshard.models import ModelSpec

            SPEC = ModelSpec("anything", my_mlp.MLPConfig, {"small": my_mlp.MLPConfig(layers=2)},
                             my_mlp, "rows", lambda cfg: 1, lambda cfg: cfg.layers)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = get_model("my_mlp")
    assert spec.name == "my_mlp" and not spec.builtin and spec.default_preset == "tiny"
    assert spec.num_units(spec.presets["deep"]) == 8 and spec.unit == "samples"
    by_file = get_model(str(tmp_path / "my_specs.py") + ":SPEC")
    assert by_file.name.endswith("my_specs.py:SPEC") and by_file.unit == "rows"
    assert by_file.default_preset == "small" and not by_file.builtin
    pc = load_profile_config(f"{tmp_path / 'my_specs.py'}:SPEC", None, {"run": {"steps": 1}})
    assert pc.preset == "small" and pc.model_config.layers == 2


def write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


MINIMAL = textwrap.dedent(
    """
    import dataclasses
    import numpy as np

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        layers: int = 2

    PRESETS = {"only": Cfg()}

    def num_layers(cfg):
        return cfg.layers

    def init_params(cfg, seed):
        return {"w": np.ones((4, 4), np.float32)}

    def synthetic_batch(cfg, batch_size, step, seed):
        return {"x": np.ones((batch_size, 4), np.float32)}
    """
)
TRAIN_STEP = "\ndef train_step(cfg, num_stages, optimizer):\n    pass\n"


@pytest.mark.parametrize(
    "body, words",
    [
        (MINIMAL, ["does not define", "train_step(cfg, num_stages, optimizer"]),
        ("x = 1\n", ["PRESETS", "num_layers(cfg)", "init_params(cfg, seed)", "Your own model"]),
        (MINIMAL.replace('{"only": Cfg()}', '{"only": 3}')
         + "\ndef train_step(cfg, num_stages, optimizer):\n    pass\n",
         ["PRESETS must map names to instances of one dataclass"]),
        ("raise RuntimeError('broken on purpose')\n", ["importing", "broken on purpose"]),
    ],
)  # fmt: skip
def test_a_model_that_does_not_follow_the_conventions_is_refused_with_what_is_missing(
    tmp_path, capsys, body, words
):
    path = write(tmp_path, "bad_model.py", body)
    assert main(["profile", path, "--steps", "1"]) != 0
    err = capsys.readouterr().err
    assert f"jaxreshard profile {path}: error: model '{path}'" in err
    for word in words:
        assert word in err


def test_a_config_names_the_model_file_by_any_path_to_it(tmp_path, monkeypatch):
    monkeypatch.chdir(Path(EXAMPLE).parent.parent)
    toml = tmp_path / "c.toml"
    toml.write_text('[model]\nname = "./examples/profile_model.py"\npreset = "deep"\n')
    pc = load_profile_config(EXAMPLE, toml)
    assert pc.preset == "deep" and pc.model == EXAMPLE
    toml.write_text('[model]\nname = "examples/other.py"\n')
    with pytest.raises(ValueError, match="but the command profiles"):
        load_profile_config(EXAMPLE, toml)


def test_references_that_do_not_resolve_say_what_to_give(tmp_path, capsys, monkeypatch):
    assert main(["profile", "gtp"]) != 0
    assert "no module 'gtp'" in capsys.readouterr().err
    missing = str(tmp_path / "nowhere.py")
    assert main(["profile", missing]) != 0
    assert f"no file {missing}" in capsys.readouterr().err
    with pytest.raises(ValueError, match="has no attribute 'NOPE'"):
        get_model(f"{EXAMPLE}:NOPE")
    write(tmp_path, "needs_missing.py", "import not_installed_anywhere_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"importing needs_missing failed.*install what it"):
        get_model("needs_missing")
    bad_count = write(tmp_path, "zero_layers.py", MINIMAL.replace("return cfg.layers", "return 0")
                      + "\ndef train_step(cfg, num_stages, optimizer):\n    pass\n")  # fmt: skip
    with pytest.raises(ValueError, match=r"num_layers\(cfg\) returned 0"):
        load_profile_config(bad_count, None, {})


def test_partition_auto_on_a_model_without_candidates_names_the_keyword(tmp_path):
    path = write(tmp_path, "no_candidates.py", MINIMAL
                 + "\ndef train_step(cfg, num_stages, optimizer):\n    pass\n")  # fmt: skip
    pc = load_profile_config(path, None, {"pipeline": {"partition": "auto"}})
    with pytest.raises(ValueError, match="candidates=False"):
        pc.spec.train_step(pc.model_config, 2, None, pc.candidates)
    with pytest.raises(ValueError, match="returned NoneType"):  # (called as written)
        pc.spec.train_step(pc.model_config, 2, None, False)


def test_a_spec_without_a_param_count_counts_init_params():
    spec = get_model(EXAMPLE)
    cfg = dataclasses.replace(spec.presets["tiny"], layers=1, width=2, hidden=3, classes=4)
    assert spec.num_params(cfg) == (2 * 3 + 3) + (3 * 2 + 2) + (2 * 4 + 4)
    specs = spec.param_specs(cfg, "model", None)
    assert specs["blocks"][0]["up"]["w"] == jax.sharding.PartitionSpec(None, "model")


def test_a_config_field_named_like_a_flag_is_refused_in_one_line(tmp_path, capsys):
    for field in ("seed", "json"):  # a [run] key; one of the command's own flags
        body = MINIMAL.replace("layers: int = 2", f"layers: int = 2\n    {field}: int = 0")
        path = write(tmp_path, f"clash_{field}.py", body + TRAIN_STEP)
        assert main(["profile", path, "--steps", "1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"jaxreshard profile {path}: error: model") and "Traceback" not in err
        assert f"'{field}'" in err or f" {field}," in err or f"field(s) {field}" in err
        assert "rename" in err


def test_computed_fields_are_no_flags_and_values_must_be_what_a_file_holds(tmp_path, capsys):
    from jaxreshard.profiler._auto_report import profile_toml

    body = MINIMAL.replace(
        "    layers: int = 2\n",
        "    layers: int = 2\n"
        "    width: int = dataclasses.field(init=False, default=0)\n\n"
        "    def __post_init__(self):\n"
        "        object.__setattr__(self, 'width', 4 * self.layers)\n",
    )
    path = write(tmp_path, "computed.py", body + TRAIN_STEP)
    pc = load_profile_config(path, None, {"model": {"layers": 3}})
    assert pc.model_config.width == 12
    toml = tmp_path / "again.toml"
    toml.write_text(profile_toml(pc))
    assert "width" not in toml.read_text()
    assert load_profile_config(path, toml).model_config.width == 12
    assert main(["profile", path, "--help"]) == 0
    assert "--width" not in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown key 'width'"):
        load_profile_config(path, None, {"model": {"width": 3}})

    dtype = MINIMAL.replace("layers: int = 2", "layers: int = 2\n    dtype: object = np.float32")
    path = write(tmp_path, "with_dtype.py", dtype + TRAIN_STEP)
    with pytest.raises(ValueError, match=r"dtype=<class 'numpy.float32'> \(from its preset\)"):
        load_profile_config(path, None, {})


def test_a_model_file_travels_to_ray_hosts_by_value_whichever_module_makes_the_step(
    tmp_path, monkeypatch
):
    """A host process can import neither the model file's module (a name only this process
    gave it) nor a helper module beside it: both go by value."""
    import pickle
    import sys

    from jaxreshard.runtime.ray._pipeline import _by_value

    write(tmp_path, "step_helper.py", """
        import jaxreshard as jr

        def make_step(loss_fn, cfg):
            def step(params, opt_state, batch):
                loss, grads = jr.value_and_grad(loss_fn)(params, batch, cfg)
                return params, opt_state, loss
            return step
        """)  # fmt: skip
    body = MINIMAL + textwrap.dedent("""
        import jax.numpy as jnp
        from step_helper import make_step

        def loss_fn(p, batch, cfg):
            return jnp.mean(batch["x"] @ p["w"]) * cfg.layers

        def train_step(cfg, num_stages, optimizer):
            return make_step(loss_fn, cfg)
        """)  # fmt: skip
    spec = get_model(write(tmp_path, "split_model.py", body))
    step = spec.train_step(spec.presets["only"], 1, None, False)
    assert step.__module__ == "step_helper"
    blob = _by_value(step, {})
    for name in [n for n in sys.modules if n.startswith("jaxreshard_user_model_split_model")]:
        monkeypatch.delitem(sys.modules, name)  # (as on a host: neither module is there)
    monkeypatch.delitem(sys.modules, "step_helper")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    fun, _, _ = pickle.loads(blob)
    params = {"w": np.ones((4, 4), np.float32)}
    _, _, loss = fun(params, None, {"x": np.ones((2, 4), np.float32)})
    assert float(loss) == 8.0


def test_a_bare_name_that_is_an_installed_module_says_which_file_it_imported():
    with pytest.raises(ValueError, match=r"imported from .*json.*give its path \(\./name\.py\)"):
        get_model("json")


def test_a_spec_whose_module_has_no_param_specs_replicates():
    from types import SimpleNamespace

    from jaxreshard.models import ModelSpec

    example = get_model(EXAMPLE)
    module = SimpleNamespace(**{k: getattr(example.module, k) for k in
                                ("init_params", "train_step", "synthetic_batch")})  # fmt: skip
    spec = ModelSpec("x", example.config_type, example.presets, module, "samples",
                     lambda c: 1, lambda c: c.layers, builtin=False)  # fmt: skip
    specs = spec.param_specs(spec.presets["tiny"], "model", {"a": np.ones(2), "b": [np.ones(1)]})
    assert specs == {"a": jax.sharding.PartitionSpec(), "b": [jax.sharding.PartitionSpec()]}


def test_an_error_in_the_models_own_code_is_reported_as_the_models(tmp_path, capsys):
    body = MINIMAL.replace(
        '    return {"w": np.ones((4, 4), np.float32)}',
        '    return {"w": np.ones((4, 4), np.float32), "v": {}["no_such_key"]}',
    )
    path = write(tmp_path, "raises.py", body + TRAIN_STEP.replace("pass", "return lambda *a: a"))
    assert main(["profile", path, "--steps", "1", "--stage-mesh-shape", "1,1"]) == 1
    err = capsys.readouterr().err
    assert "the model's code raised KeyError: 'no_such_key'" in err
    assert f"{path}:" in err and "bug in jaxreshard" not in err


def test_a_step_that_is_not_a_function_or_is_jitted(tmp_path):
    path = write(tmp_path, "none_step.py", MINIMAL + TRAIN_STEP)
    spec = get_model(path)
    with pytest.raises(ValueError, match="returned NoneType, not the step function"):
        spec.train_step(spec.presets["only"], 2, None, False)
    jitted = write(tmp_path, "jitted_step.py", MINIMAL + textwrap.dedent("""
        import jax

        def train_step(cfg, num_stages, optimizer):
            @jax.jit
            def step(params, opt_state, batch):
                return params, opt_state, 0.0
            return step
        """))  # fmt: skip
    spec = get_model(jitted)
    step = spec.train_step(spec.presets["only"], 2, None, False)
    assert step.__name__ == "step" and not hasattr(step, "lower")  # (parallelize compiles it)


def test_more_devices_than_jax_started_with_is_refused_naming_the_fix(capsys):
    args = ["profile", EXAMPLE, "--stage-mesh-shape", "1,64", "--steps", "1"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "needs 128 CPU devices, but JAX had started in this process with" in err
    assert "JAX_NUM_CPU_DEVICES=128" in err


def test_neighbour_files_a_model_file_imports_travel_by_value_too(tmp_path, monkeypatch):
    import pickle
    import sys

    from jaxreshard.runtime.ray._pipeline import _by_value

    write(tmp_path, "nb_layers.py", "def double(x):\n    return 2 * x\n")
    body = MINIMAL + textwrap.dedent("""
        import nb_layers

        def train_step(cfg, num_stages, optimizer):
            def step(params, opt_state, batch):
                return params, opt_state, nb_layers.double(batch["x"]).sum()
            return step
        """)  # fmt: skip
    spec = get_model(write(tmp_path, "nb_model.py", body))
    step = spec.train_step(spec.presets["only"], 1, None, False)
    blob = _by_value(step, {})
    for name in [n for n in sys.modules if n.startswith("jaxreshard_user_model_nb_model")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "nb_layers")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    fun, _, _ = pickle.loads(blob)
    assert float(fun(None, None, {"x": np.ones(3)})[2]) == 6.0


def test_a_list_field_set_by_flag_is_a_list(tmp_path):
    body = MINIMAL.replace(
        "    layers: int = 2\n",
        "    layers: int = 2\n"
        "    sizes: list[int] = dataclasses.field(default_factory=lambda: [1, 2])\n",
    )
    path = write(tmp_path, "with_list.py", body + TRAIN_STEP)
    assert load_profile_config(path, None, {"model": {"sizes": "3,4"}}).model_config.sizes == [3, 4]
    toml = tmp_path / "c.toml"
    toml.write_text("[model]\nsizes = [5, 6, 7]\n")
    assert load_profile_config(path, toml).model_config.sizes == [5, 6, 7]


def test_a_checkpoint_resumes_with_the_model_file_given_by_another_path(tmp_path, monkeypatch):
    monkeypatch.chdir(Path(EXAMPLE).parent.parent)
    flags = ["--layers", "2", "--width", "16", "--hidden", "32", "--batch-size", "4",
             "--num-micro-batches", "2", "--stage-mesh-shape", "1,1", "--steps", "1",
             "--warmup-steps", "1", "--no-progress", "--compile-cache", "off",
             "--checkpoint", str(tmp_path / "ck")]  # fmt: skip
    assert main(["profile", "examples/profile_model.py", *flags]) == 0
    assert main(["profile", "./examples/profile_model.py", *flags, "--resume"]) == 0


def test_a_literal_field_takes_only_its_values(tmp_path):
    body = "from typing import Literal\n" + MINIMAL.replace(
        "    layers: int = 2\n",
        '    layers: int = 2\n    act: Literal["gelu", "relu"] = "gelu"\n'
        "    k: Literal[1, 2] = 1\n",
    )
    path = write(tmp_path, "with_literal.py", body + TRAIN_STEP)
    cfg = load_profile_config(path, None, {"model": {"act": "relu", "k": "2"}}).model_config
    assert (cfg.act, cfg.k) == ("relu", 2)
    with pytest.raises(ValueError, match=r"act='tanh': must be one of 'gelu', 'relu'"):
        load_profile_config(path, None, {"model": {"act": "tanh"}})
