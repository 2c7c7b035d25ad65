"""The free-memory check before the JAX engine allocates its KV cache (issue 62: `arpo-jax eval --engine jax` on a
0.5B model was OOM-killed at ~22.5 GB instead of saying what to change)."""

import jax
import numpy as np
import pytest

import arpo_jax
from arpo_jax import device_memory, testing
from arpo_jax.rollout.jax_sampler import JaxSampler, check_cache_fits

GIB = 2**30


def test_host_memory_is_mem_available_or_the_cgroup_remainder_when_lower(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    assert device_memory.host_available_bytes(meminfo, cgroup) == 20000000 * 1024  # no cgroup files
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text(str(5 * GIB))
    assert device_memory.host_available_bytes(meminfo, cgroup) == 20000000 * 1024  # no limit
    (cgroup / "memory.max").write_text(str(8 * GIB))
    assert device_memory.host_available_bytes(meminfo, cgroup) == 3 * GIB  # a SLURM job's 8 GiB, 5 in use
    assert device_memory.host_available_bytes(tmp_path / "none", tmp_path / "none") is None


def test_the_check_names_the_sizes_and_the_fix():
    device_memory.require_fits(9 * GIB, 10 * GIB, "x", "y")  # 90%: fits
    device_memory.require_fits(10**15, None, "x", "y")  # unknown free memory: no check
    with pytest.raises(device_memory.DoesNotFit, match=r"the cache needs 9.50 GiB, more than 90% of the 10.00 GiB "
                       r"free: fewer rows"):
        device_memory.require_fits(int(9.5 * GIB), 10 * GIB, "the cache", "fewer rows")


def test_tree_bytes_counts_whole_arrays():
    tree = {"a": jax.ShapeDtypeStruct((4, 8), np.float32), "b": np.zeros((3,), np.int8)}
    assert device_memory.tree_bytes(tree) == 4 * 8 * 4 + 3


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    path, _ = tiny_hf_dir("qwen2")
    return arpo_jax.from_pretrained(path), testing.make_tiny_tokenizer()


def test_the_engine_refuses_a_cache_larger_than_the_host_before_allocating_it(tiny):
    """Rows the host cannot hold: one line with the numbers and the settings, before the cache exists (a real
    allocation of this size would be killed by the OOM killer, not raise). `make_sampler` runs this check."""
    model, tok = tiny
    free = device_memory.host_available_bytes()
    assert free is not None
    # One row of the tiny model's cache at 4,096 tokens: 2 layers x K and V x 2 KV heads x 32 x float32 = 2 MiB.
    rows = 4 * free // (2 * 2 * 2 * 32 * 4 * 4096)
    with pytest.raises(device_memory.DoesNotFit, match=rf"KV cache \({rows} rows x 4096 tokens\) needs .* GiB "
                       r"free: give it fewer rows \(rollout.jax.slots"):
        check_cache_fits(JaxSampler(model, tok, max_len=4096, slots=rows, restrict_to_tokenizer=False))
    check_cache_fits(JaxSampler(model, tok, max_len=4096, slots=8, restrict_to_tokenizer=False))  # 16 MiB: fits
