"""The README's examples run as written (the quickstart in a fresh process, the config files)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

import jaxreshard as jr

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start : end if end >= 0 else len(text)]


def test_quickstart_runs_in_a_fresh_process():
    quickstart = re.findall(r"```python\n(.*?)```", _section("## Quickstart"), flags=re.S)[0]
    assert "@jr.parallelize" in quickstart
    # The quickstart sets its own device count; JAX in the child must not see ours.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    check = "import math\nassert math.isfinite(float(loss)), loss\nprint('LOSS', float(loss))\n"
    code = quickstart + "\n" + check
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOSS" in proc.stdout
    assert "stage" in proc.stdout.lower()  # the printed plan


def test_readme_pipeline_toml_loads(tmp_path):
    (toml,) = [b for b in _blocks("toml") if "[pipeline]" in b and "pipeline.toml" in b]
    path = tmp_path / "pipeline.toml"
    path.write_text(toml)
    config = jr.PipelineConfig.from_toml(path, num_micro_batches=16)
    assert config.num_micro_batches == 16
    assert config.schedule == "eager_1f1b" and config.weight_delay is True
    assert config.stage_mesh_shape == (1, 2)
    assert config.replace(schedule="zb_h1", weight_delay=False).schedule == "zb_h1"


def test_readme_error_example_is_the_real_message():
    with pytest.raises(ValueError) as info:
        jr.PipelineConfig(schedule="1F1B")
    assert str(info.value) in README.read_text()


def test_readme_set_up_commands():
    bash = _blocks("bash")
    assert any("pip install -e . && jaxreshard profile gpt" in b for b in bash)
    assert any('pip install -e ".[dev]" && python -m pytest -q' in b for b in bash)
    ci = (README.parent / ".ci" / "run").read_text()
    assert 'pip install -e ".[dev]"' in ci and "python -m pytest -q" in ci


def test_readme_optimizer_error_is_the_real_message(tmp_path):
    from jaxreshard.profiler import load_profile_config

    section = _section("## Profile GPT")
    (toml,) = [b for b in _blocks("toml") if "optimizer =" in b and b in section]
    path = tmp_path / "run.toml"
    path.write_text(toml)
    run = load_profile_config("gpt", path).run
    assert (run.optimizer, run.weight_decay, run.clip_norm) == ("adamw", 0.01, 1.0)
    path.write_text("[run]\nweight_decay = 0.01\n")
    with pytest.raises(ValueError) as info:
        load_profile_config("gpt", path)
    assert str(info.value).replace(str(path), "/tmp/p.toml") in README.read_text()
