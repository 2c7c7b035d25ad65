"""The suite's own helpers (`arpo_jax.testing`) that are not fixtures: the worker count of `-n auto`."""

import os

import pytest

from arpo_jax import testing


@pytest.mark.parametrize("cores, memory_gb, workers", [
    (2, 24, 2),    # CI's machine: both cores
    (4, 24, 4),    # 13 GB for the real-model worker, 3 GB for each of 3 more
    (8, 24, 4),    # memory-bound
    (16, 128, 16),
    (8, 16, 2),
    (8, 15.9, 1),
    (2, 8, 1),     # below the real-model worker's peak: one worker, never zero
    (1, 64, 1),
])
def test_workers_follow_cores_and_memory(cores, memory_gb, workers):
    assert testing.xdist_workers(cores, memory_gb) == workers


def test_usable_cores_is_this_process_affinity_or_less():
    cores = testing.usable_cores()
    assert 1 <= cores <= len(os.sched_getaffinity(0))
