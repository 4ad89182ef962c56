"""Test setup: many fake CPU devices, set before JAX initialises its backend."""

import os

NUM_CPU_DEVICES = 24
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", NUM_CPU_DEVICES)

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
