"""A real 2-process JAX run on localhost: sharded HF import, forward and export across processes."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import arpo_jax

pytestmark = pytest.mark.slow  # two JAX processes

WORKER = Path(__file__).with_name("multihost_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_load_forward_export(tiny_hf_dir, tmp_path):
    path, _ = tiny_hf_dir("qwen2")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(WORKER.parents[1])
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(port), str(path), str(tmp_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    ids = np.random.RandomState(0).randint(0, 512, (8, 16))
    expected = np.asarray(arpo_jax.from_pretrained(path)(ids))
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), expected, atol=1e-5)
    a, b = load_file(str(path / "model.safetensors")), load_file(str(tmp_path / "export" / "model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
