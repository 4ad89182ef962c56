"""Test setup: many fake CPU devices, set before JAX initialises its backend."""

import os
import tempfile
from importlib import metadata, util
from pathlib import Path

NUM_CPU_DEVICES = 24


def _cuda_available() -> bool:
    """A CUDA GPU and a JAX CUDA plugin are here (without importing JAX)."""
    if not Path("/dev/nvidiactl").exists():
        return False
    if any("cuda" in ep.name for ep in metadata.entry_points(group="jax_plugins")):
        return True
    spec = util.find_spec("jax_plugins")
    locations = (spec.submodule_search_locations or []) if spec else []
    return any("cuda" in p.name for loc in locations for p in Path(loc).iterdir())


# CPU devices are the default backend of every test (the fake devices below); on a machine with
# a GPU, the GPU tests (tests/test_gpu.py) find it as jax.devices("gpu").
os.environ.setdefault("JAX_PLATFORMS", "cpu,cuda" if _cuda_available() else "cpu")
if _cuda_available():  # (two xdist workers share the GPU: neither takes 75% of it up front)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", NUM_CPU_DEVICES)
# Identical stage programs (schedule variants, local vs Ray) compile once per process: each
# process of the run (the xdist controller, each worker) has its own cache folder, which its
# Ray hosts share (`compile_cache_settings`), and removes it at the end. (One folder shared by
# the workers, with a size bound so that JAX locks it, made the run slower: 26 against 21
# minutes; with a bound, JAX lists the whole folder on every write.)
_XLA_CACHE = tempfile.mkdtemp(prefix="jaxreshard-tests-xla-")
jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def cpu_devices():
    devices = jax.devices("cpu")
    assert len(devices) >= NUM_CPU_DEVICES, "conftest must set the device count before JAX starts"
    return devices


RAY_CONFIG = dict(
    backend="ray", num_hosts=4, devices_per_host=2, timeout_s=60, object_store_memory=256 * 2**20
)


@pytest.fixture(scope="session")
def _ray_session():
    """Shut the shared Ray runtime down at the end of the session."""
    import jaxreshard

    yield
    jaxreshard.shutdown()


@pytest.fixture
def ray_runtime(_ray_session):
    """The shared local Ray runtime (4 host actors x 2 fake CPU devices, one Ray node each),
    started on first use; a test that kills it starts a new one with `RAY_CONFIG`."""
    pytest.importorskip("ray", reason="Ray is not installed here (the GPU image has none)")
    import jaxreshard
    from jaxreshard.runtime import _api

    current = _api._current
    stale = current is None or not current.is_alive or getattr(current, "_broken", None)
    if stale or current.backend != "ray":
        jaxreshard.shutdown()
        current = jaxreshard.init(**RAY_CONFIG)
    return current


@pytest.fixture
def no_runtime():
    """No runtime (and no Ray) in this process when the test starts: a test file that an xdist
    worker ran before may have left the shared one up (`ray_runtime` starts it again)."""
    import jaxreshard

    jaxreshard.shutdown()


# Where the xdist workers (`-n 2` in pyproject's addopts) report an exit held up by a thread:
# the controller's exit status is its own, so it reads these files as it ends.
_HELD_UP = "JAXRESHARD_TEST_HELD_UP"


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # (the controller, or a run without workers)
        os.environ[_HELD_UP] = tempfile.mkdtemp(prefix="jaxreshard-tests-held-up-")
        try:  # xdist kills a worker still there 10 s after its tests: wait for the watchdog
            from xdist.workermanage import NodeManager

            NodeManager.EXIT_TIMEOUT = 90
        except ImportError:
            pass


def pytest_sessionfinish(session, exitstatus):
    """If the interpreter has not exited a minute after it began to (a worker thread of some
    pool still waiting, which would hold the interpreter's exit up), print every thread's stack
    so the culprit is named, and fail (exit status 3 if the tests passed) instead of hanging CI
    or hiding the leak. An xdist worker also leaves the stacks where the controller looks
    (`pytest_unconfigure`): a worker's own exit status does not reach the run's."""
    import faulthandler
    import sys
    import threading
    import time

    worker = os.environ.get("PYTEST_XDIST_WORKER")
    # The minute counts from when the interpreter starts to exit, not from here: an xdist
    # worker whose files are done is told to finish early, then waits (rightly) for the
    # controller to release it once the other worker is done too, which may take minutes.
    # `threading._register_atexit` callbacks run as the exit begins, before non-daemon
    # threads are joined (CPython 3.9+; concurrent.futures relies on it).
    exiting = threading.Event()
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        exiting.set()
    else:
        register(exiting.set)

    def watchdog():
        exiting.wait()
        time.sleep(60)
        print(
            "\nFAILED: the tests ended a minute ago and the process is still here (a thread that "
            "never ends); threads:",
            file=sys.stderr,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stdout.flush()
        sys.stderr.flush()
        where = os.environ.get(_HELD_UP)
        if worker and where:
            with open(Path(where) / worker, "w") as f:
                faulthandler.dump_traceback(file=f, all_threads=True)
        os._exit(int(exitstatus) or 3)

    threading.Thread(target=watchdog, name="exit-watchdog", daemon=True).start()


def pytest_unconfigure(config):
    """The controller fails the run if a worker's exit was held up (see
    `pytest_sessionfinish`); it waits for its workers to exit before this (up to the
    `EXIT_TIMEOUT` set above, past their watchdog's minute)."""
    import shutil
    import sys

    shutil.rmtree(_XLA_CACHE, ignore_errors=True)
    where = os.environ.get(_HELD_UP)
    if hasattr(config, "workerinput") or not where or not Path(where).is_dir():
        return

    held = sorted(Path(where).iterdir())
    for path in held:
        print(f"\nFAILED: worker {path.name} was still there a minute after its last test; "
              f"threads:\n{path.read_text()}", file=sys.stderr)  # fmt: skip
    shutil.rmtree(where, ignore_errors=True)
    if held:
        sys.stderr.flush()
        os._exit(3)
