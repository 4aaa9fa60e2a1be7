"""Eight emulated CPU devices and float64, set before JAX is imported; the
deterministic sample (`tests/matrix.py`) and how to rerun a failed case."""

import os
import shutil
import tempfile

# XLA:CPU compiles cheaper at no change to the HLO the tests count (LLVM level
# 0, the older fusion emitters and LLVM's expensive passes off where the
# installed jaxlib has them: `solvax._accounting.compile_flags` says what each
# saves), and 8 devices. The entry points the tests start get the same flags
# (`helpers.entry_point_env`), and so do the benchmarks' smoke runs (without
# the device count: each script sets its own; they assert no time). Importing
# solvax starts no JAX backend.
from solvax._accounting import compile_flags  # noqa: E402

TEST_XLA_FLAGS = compile_flags.cheap_flags(devices=8)
compile_flags.set_flags(TEST_XLA_FLAGS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the run, shared by the xdist workers
# (they inherit this environment from the controller, which sets it first) and
# by the entry points the tests start: a program compiled twice, in two tests,
# two workers or after a module's `jax.clear_caches()`, is compiled once. A new
# folder per run unless JAX_COMPILATION_CACHE_DIR is set (then it is kept).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="solvax-test-cache-")
    os.environ["SOLVAX_TEST_CACHE_OWNER"] = str(os.getpid())  # the controller removes it
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

import gc  # noqa: E402
import shlex  # noqa: E402

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402
from matrix import MODE  # noqa: E402

# Properties draw the same examples on every run of a commit (no example
# database, no random seed); the full matrix draws 4x as many (tests/matrix.py).
settings.register_profile("solvax", derandomize=True, database=None, print_blob=True)
settings.load_profile("solvax")


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop each module's compiled programs when it ends. XLA's CPU backend maps
    memory for every executable it keeps; the whole suite in one process
    reached the kernel's limit of 65530 mappings (measured: 22,000 after the
    reliability tests alone) and then segfaulted inside a compile."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test says how to rerun exactly that case."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        rerun = f"SOLVAX_TEST_MATRIX={MODE} python -m pytest {shlex.quote(item.nodeid)}"
        report.sections.append(("rerun this case", rerun))


def pytest_report_header(config):
    return (f"solvax test matrix: {MODE} (SOLVAX_TEST_MATRIX=full runs every combination); "
            f"jax {jax.__version__}")


def pytest_unconfigure(config):
    """The run's own cache folder goes when the run ends (in the process that made it)."""
    if os.environ.get("SOLVAX_TEST_CACHE_OWNER") == str(os.getpid()):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
