"""The README's examples run as written (the quickstart in a fresh process, the config files), the
error messages it and the docs quote are the real ones, and every path, link, note and name the
README and docs/*.md cite exists."""

import importlib
import os
import pathlib
import re
import subprocess
import sys

import pytest

import jaxreshard as jr

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PROFILE_DOC = DOCS / "profile.md"
MAX_README_LINES = 300


def _markdown_files() -> list[pathlib.Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _blocks(lang: str, path: pathlib.Path = README) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(), flags=re.S)


def _section(title: str, path: pathlib.Path = README) -> str:
    text = path.read_text()
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
    ci = (ROOT / ".ci" / "run").read_text()
    ci_lines = {line.strip() for line in ci.splitlines()}
    assert 'pip install -e ".[dev]"' in ci_lines and "python -m pytest -q" in ci_lines
    # The README's set-up steps are the ones CI runs (CI puts each on its own line): the venv,
    # its activation and the pip upgrade; then the install and the job or the tests.
    commands = [" ".join(b.replace("\\\n", " ").split()) for b in bash if "python3 -m venv" in b]
    assert len(commands) == 2, commands
    for command in commands:
        steps = [step.strip() for step in command.split("&&")]
        assert len(steps) == 5, steps
        for step in steps[:3]:
            assert step in ci_lines, (step, command)
    assert any(line.startswith("jaxreshard profile gpt") for line in ci_lines)


def test_profile_doc_optimizer_error_is_the_real_message(tmp_path):
    from jaxreshard.profiler import load_profile_config

    section = _section("## Optimizer", PROFILE_DOC)
    (toml,) = [b for b in _blocks("toml", PROFILE_DOC) if "optimizer =" in b and b in section]
    path = tmp_path / "run.toml"
    path.write_text(toml)
    run = load_profile_config("gpt", path).run
    assert (run.optimizer, run.weight_decay, run.clip_norm) == ("adamw", 0.01, 1.0)
    path.write_text("[run]\nweight_decay = 0.01\n")
    with pytest.raises(ValueError) as info:
        load_profile_config("gpt", path)
    assert str(info.value).replace(str(path), "/tmp/p.toml") in PROFILE_DOC.read_text()


def test_benchmarks_virtual_stage_table_is_the_compare_output():
    """The simulated virtual-stage table of docs/benchmarks.md is what `schedule compare` gives."""
    from jaxreshard.pipeline import Costs
    from jaxreshard.pipeline._compare import compare_schedules

    text = (DOCS / "benchmarks.md").read_text()
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


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; keep it to {MAX_README_LINES}"


# ---- every path, link, note and name the README and the docs cite exists ----

_EXTENSIONS = (".py", ".md", ".toml", ".json", ".sh", ".png", ".csv", ".txt", ".yaml", ".yml")
_TOP_DIRS = ("jaxreshard/", "benchmarks/", "examples/", "tests/", "docs/", ".ci/")
_SKIP_DIRS = {".git", ".venv", "__pycache__", "node_modules", ".mypy_cache", ".pytest_cache"}


def _repo_file_names() -> set[str]:
    names = set()
    for _, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".egg-info")]
        names.update(filenames)
    return names


def _prose(text: str) -> str:
    """The text without fenced code blocks (their paths are commands' outputs, not files)."""
    return re.sub(r"(?ms)^```.*?^```", "", text)


def _code_spans(text: str) -> list[str]:
    return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", _prose(text))]


def _is_path(span: str) -> bool:
    """Does this code span name a file or folder of the repository?"""
    if " " in span or not span.strip():
        return False
    if span.startswith(("/", "~", "$", "-", "http:", "https:", ".[")):
        return False  # absolute and home paths, variables, flags, URLs, pip extras
    if any(c in span for c in "<>{}|()=,'\"") or "..." in span:
        return False  # placeholders and expressions
    if re.fullmatch(r"jaxreshard-[\w-]+/\d+", span):
        return False  # a format name, e.g. jaxreshard-profile/1
    return "/" in span or span.endswith(_EXTENSIONS)


def _path_exists(span: str, names: set[str]) -> bool:
    bases = (ROOT, ROOT / "jaxreshard")  # `comm/_local.py` means jaxreshard/comm/_local.py
    if "*" in span:
        return any(any(base.glob(span)) for base in bases)
    if "/" not in span.rstrip("/"):
        return span.rstrip("/") in names or any((b / span).exists() for b in bases)
    return any((base / span).exists() for base in bases)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"(?m)^#{1,6} (.+)$", _prose(path.read_text())):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_references(path: pathlib.Path, text: str | None = None) -> list[str]:
    """What `path` (or `text`, read as if it were at `path`) cites that does not exist: relative
    links and their anchors, backticked repository paths, and `[Note: ...]` comments."""
    text = path.read_text() if text is None else text
    names = _repo_file_names()
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(text)):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"link {target!r}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            problems.append(f"link {target!r}: {dest.name} has no heading #{anchor}")
    for span in _code_spans(text):
        if _is_path(span) and not _path_exists(span, names):
            problems.append(f"path `{span}` does not exist in the repository")
    # Repository paths inside commands: code spans with spaces and fenced code blocks.
    commands = [s for s in _code_spans(text) if " " in s]
    commands += re.findall(r"(?ms)^```\w*\n(.*?)^```", text)
    for word in {w.strip(".,;:") for c in commands for w in c.split()}:
        if word.startswith(_TOP_DIRS) and _is_path(word) and not _path_exists(word, names):
            problems.append(f"path {word} (in a command) does not exist in the repository")
    sources = {p: p.read_text() for p in (ROOT / "jaxreshard").rglob("*.py")}
    prose = " ".join(_prose(text).split())
    for note in set(re.findall(r"\[Note: ([^\]]+)\]", prose)) - {"..."}:
        if not any(f"[Note: {note}]" in src for src in sources.values()):
            problems.append(f"[Note: {note}] is in no module of jaxreshard/")
    for note, where in re.findall(r"\[Note: ([^\]]+)\] in `([^`]+)`", prose):
        files = [ROOT / where, ROOT / "jaxreshard" / where]
        if not any(f.is_file() and f"[Note: {note}]" in f.read_text() for f in files):
            problems.append(f"[Note: {note}] is not in {where}")
    return problems


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_paths_links_and_notes_exist(path):
    assert broken_references(path) == []


def test_the_reference_check_catches_made_up_ones():
    made_up = (
        "See `jaxreshard/runtime/_pipeline.py`, `benchmarks/no_such_bench.py`, `DESIGN.md`,\n"
        "[the design](no-such-page.md), [GPUs](ray-and-gpus.md#no-such-heading) and\n"
        "[Note: no such note] in `runtime/engine/_program.py`.\n"
        "These exist: `jaxreshard/runtime/local/_pipeline.py`,\n"
        "`benchmarks/first_step.py`, `examples/train_nnx.py`, `comm/_stream.py`,\n"
        "[design](design.md#layers), `jaxreshard-profile/1`, `/tmp/x.json`,\n"
        "`python benchmarks/planning_time.py --out x.json`.\n"
        "```bash\n"
        "jaxreshard profile gpt --config examples/configs/gpt_huge.toml --json out.json\n"
        "```\n"
    )
    problems = broken_references(DOCS / "example.md", made_up)
    assert len(problems) == 8, problems
    assert any("gpt_huge.toml" in p for p in problems)
    for name in ("_pipeline.py", "no_such_bench.py", "DESIGN.md", "no-such-page.md"):
        assert any(name in p for p in problems), (name, problems)
    assert any("#no-such-heading" in p for p in problems)
    assert sum("no such note" in p for p in problems) == 2


def _resolve(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_cited_jaxreshard_names_exist():
    """`jr.X` and `jaxreshard.X.Y` in the README and the docs name real objects."""
    missing = set()
    for path in _markdown_files():
        for span in _code_spans(path.read_text()):
            m = re.match(r"(jr|jaxreshard)((?:\.\w+)+)", span)
            if m and not _resolve("jaxreshard" + m.group(2)):
                missing.add(f"{path.name}: {span}")
    assert not missing, sorted(missing)
