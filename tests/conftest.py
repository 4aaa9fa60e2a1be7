"""Eight emulated CPU devices and float64, set before JAX is imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop each module's compiled programs when it ends. XLA's CPU backend maps
    memory for every executable it keeps; the whole suite in one process
    reached the kernel's limit of 65530 mappings (measured: 22,000 after the
    reliability tests alone) and then segfaulted inside a compile."""
    yield
    jax.clear_caches()
    gc.collect()
