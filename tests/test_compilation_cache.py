"""The persistent compilation cache (`distributed.enable_compilation_cache`): a second process loads what the first
compiled instead of compiling again (JAX's own debug log says which)."""

import os
import subprocess
import sys

import pytest

from arpo_jax import distributed

pytestmark = pytest.mark.slow  # four JAX processes

_CODE = """
import logging
logging.basicConfig(level=logging.DEBUG)
import jax, jax.numpy as jnp
from arpo_jax import distributed
print("CACHE_DIR", distributed.enable_compilation_cache())
jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8))).block_until_ready()
"""


def _run(env):
    out = subprocess.run([sys.executable, "-c", _CODE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    cache_dir = next(line.split(maxsplit=1)[1] for line in out.stdout.splitlines() if line.startswith("CACHE_DIR"))
    return cache_dir, "Persistent compilation cache hit for 'jit__lambda'" in out.stderr


def test_a_second_process_hits_the_persistent_cache(tmp_path):
    drop = (distributed.COMPILATION_CACHE_ENV, "JAX_COMPILATION_CACHE_DIR")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(ARPO_CACHE=str(tmp_path), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PLATFORMS="cpu")
    assert _run(env) == (str(tmp_path / "jax-compilation"), False)  # $ARPO_CACHE/jax-compilation, compiled
    assert _run(env) == (str(tmp_path / "jax-compilation"), True)  # loaded from the cache
    assert _run({**env, distributed.COMPILATION_CACHE_ENV: "off"}) == ("None", False)
    assert _run({**env, distributed.COMPILATION_CACHE_ENV: str(tmp_path / "mine")})[0] == str(tmp_path / "mine")
