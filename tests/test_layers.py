"""The package's layers (README, "Design"): a module imports only from its own layer or lower ones,
and only `_jax_compat.py` touches JAX's private `jax._src`."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jaxreshard"

# Bottom to top; a unit is a subpackage or a module at the package root.
LAYERS = [
    {"_jax_compat", "_lazy", "_machine", "_files", "_tracebacks", "_tree_wire"},
    {"comm", "cluster", "storage"},
    {"pipeline"},
    {"frontend"},
    {"runtime"},
    {
        "_parallelize",
        "_trials",
        "_reuse",
        "_arguments",
        "_plan",
        "_reshard",
        "_state",
        "bench",
        "checkpoint",
        "_elastic",
        "__init__",
    },
    {"models", "profiler"},
    {"cli", "__main__"},
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxreshard"):
            if node.module == "jaxreshard":
                yield from (f"jaxreshard.{a.name}" for a in node.names)
            else:
                yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("jaxreshard"))


MODULES = sorted(ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_module_imports_no_higher_layer(path):
    rel = path.relative_to(ROOT.parent).with_suffix("")
    src = _unit(".".join(rel.parts))
    assert src in RANK, f"{rel}: add its unit {src!r} to LAYERS"
    for module in _imports(path):
        dst = _unit(module)
        assert dst in RANK, f"{rel} imports {module}: add {dst!r} to LAYERS"
        assert RANK[dst] <= RANK[src], f"{rel} (layer {src}) imports {module}, a higher layer"


def test_only_the_compat_module_touches_jax_private_api():
    users = [
        str(p.relative_to(ROOT))
        for p in MODULES
        if any(m.startswith("jax._src") for m in _jax_imports(p))
    ]
    assert users == ["_jax_compat.py"], users


def _jax_imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def test_the_cli_has_no_import_circle():
    """Commands sit on the console/error helpers, `_main` on the commands; none imports up."""
    cli = ROOT / "cli"
    rank = {"_console": 0, "_bench": 1, "_schedule": 1, "_profile": 1, "_cluster": 1}
    rank |= {"_main": 2, "__init__": 3}
    assert {p.stem for p in cli.glob("*.py")} == set(rank), "add the new CLI module here"
    for path in cli.glob("*.py"):
        for module in _imports(path):
            if module.startswith("jaxreshard.cli"):
                dst = module.split(".")[2] if module.count(".") >= 2 else "__init__"
                assert rank[dst] < rank[path.stem], f"cli/{path.name} imports {module}"


# The runtime by role (docs/design.md, "Layers"), bottom to top: a unit imports only lower ones,
# so the host engine runs the same under either runtime and `local` and `ray` never meet.
RUNTIME = {"_config": 0, "step": 1, "engine": 2, "driver": 3, "local": 4, "ray": 4, "_api": 5}
RUNTIME |= {"__init__": 6}


def _runtime_unit(parts: list[str]) -> str:
    return parts[0] if parts else "__init__"


@pytest.mark.parametrize(
    "path",
    sorted((ROOT / "runtime").rglob("*.py")),
    ids=lambda p: str(p.relative_to(ROOT / "runtime")),
)
def test_the_runtime_is_laid_out_by_role(path):
    rel = path.relative_to(ROOT / "runtime").with_suffix("")
    src = _runtime_unit([p for p in rel.parts if p != "__init__"])
    assert src in RUNTIME, f"runtime/{rel}: add its unit {src!r} to RUNTIME"
    for module in _imports(path):
        if not module.startswith("jaxreshard.runtime."):
            continue
        dst = _runtime_unit(module.split(".")[2:3])
        assert dst in RUNTIME, f"runtime/{rel} imports {module}: add {dst!r} to RUNTIME"
        assert dst == src or RUNTIME[dst] < RUNTIME[src], (
            f"runtime/{rel} (unit {src}) imports {module}, a unit at or above its own"
        )


def test_the_runtime_layer_check_can_fail(tmp_path):
    """The check above reads imports inside functions too: a lazy import of `ray` from the
    engine is one."""
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from jaxreshard.runtime.ray._runtime import RayRuntime\n")
    assert list(_imports(bad)) == ["jaxreshard.runtime.ray._runtime"]
    assert RUNTIME["ray"] >= RUNTIME["engine"]
