import subprocess
import sys


def _modules_after(statement):
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_planner_imports_neither_ray_nor_cupy():
    modules = _modules_after("import jaxreshard.comm")
    assert "ray" not in modules and "cupy" not in modules


def test_top_level_import_is_light():
    modules = _modules_after("import jaxreshard")
    assert "ray" not in modules and "cupy" not in modules


def test_schedules_need_neither_jax_nor_ray():
    modules = _modules_after(
        "import jaxreshard.pipeline as p; p.check_schedule(p.build_schedule('zb_h1', 4, 8)); "
        "p.schedule_from_csv(p.schedule_to_csv(p.build_schedule('dualpipev', 4, 8)))"
    )
    assert not {"jax", "ray", "cupy", "matplotlib"} & modules
