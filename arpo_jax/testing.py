"""Test and demo fixtures: tiny HF models and a byte-level BPE tokenizer, built offline.

The tiny models use head_dim >= 32 so the same folders can be served by vLLM's CPU attention later.
torch/transformers are imported lazily: they are only needed where an HF reference model is built.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import threading
import time
from pathlib import Path

import numpy as np

# XLA flags of the test suite (tests/conftest.py sets them for the suite's processes, `subprocess_env` passes them
# on): compile fast, run slower. Most tests compile tiny programs that then run for milliseconds, so LLVM's
# optimisation passes were most of their CPU time. Without LLVM's optimisations, XLA:CPU's older fusion code
# generator (`xla_cpu_use_fusion_emitters=false`) compiles the tiny model's train step 3x faster than the MLIR fusion
# emitters (1.7 vs 5.8 s; its program runs no slower: benchmarks/RESULTS.md); with the optimisations on (a user's
# run) it compiles slower, so it is the tests' setting only. Semantics are XLA's and the same in every process.
TEST_XLA_FLAGS_ENV = "ARPO_TEST_XLA_FLAGS"
FAST_COMPILE_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                          "--xla_cpu_use_fusion_emitters=false")


def subprocess_env(devices: int | None = None, **extra: str) -> dict:
    """The environment for a test's subprocess (`arpo-jax ...`, a JAX worker): this process's, with JAX on CPU with
    `devices` fake devices (None: XLA_FLAGS removed, e.g. for a process that is not JAX's) and the suite's compile
    flags, unbuffered output; `extra` on top. The session's compilation cache (conftest) is inherited."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu",
                                                                       "PYTHONUNBUFFERED": "1"}
    if devices is not None:
        env["XLA_FLAGS"] = f"{os.environ.get(TEST_XLA_FLAGS_ENV, '')} " \
                           f"--xla_force_host_platform_device_count={devices}".strip()
    return env | extra


# Memory of the suite's pytest-xdist workers, with their subprocesses (`ps` of a whole `make test`, benchmarks/
# RESULTS.md): the worker of the real-model group (`xdist_group("smollm2")`: Qwen2.5 in transformers, JAX and a vLLM
# engine) peaked at 12.3 GB, every other worker under 3 GB.
REAL_MODEL_WORKER_GB = 13
TEST_WORKER_GB = 3


def xdist_workers(cores: int, memory_gb: float) -> int:
    """pytest-xdist workers for `-n auto`: one per core, as many as the memory holds (the real-model worker and
    `TEST_WORKER_GB` for each other), at least one."""
    return max(1, min(cores, 1 + int((memory_gb - REAL_MODEL_WORKER_GB) // TEST_WORKER_GB)))


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, lowered by a cgroup v2 CPU quota (a container's limit)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except (OSError, ValueError):
        return cores
    return cores if quota == "max" else max(1, min(cores, int(quota) // int(period)))


def trainer_devices(n: int = 2) -> list:
    """The first `n` of this process's devices, for a `Trainer` inside the test process: the toy model samples 2-3x
    faster on 2 of the suite's fake devices than on all 8 (tiny programs: per-device overhead, not FLOPs; the
    tree == flat trainer test took 113 s on 8, 50 s on 2), and FSDP over 2 devices is still sharded."""
    import jax

    return jax.local_devices()[:n]


# Tiny variants of each supported family. Every feature that differs between them is switched on somewhere:
# q/k/v bias (qwen2), tied and untied embeddings, q/k norm with explicit head_dim (qwen3), llama3 RoPE scaling.
TINY_VARIANTS = {
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=False),
    "qwen2_tied": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=False, head_dim=48),
    "llama31": dict(model_type="llama", tie_word_embeddings=False,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64}),
    "llama32_tied": dict(model_type="llama", tie_word_embeddings=True),
}


def tiny_hf_config_dict(variant: str = "qwen2", *, vocab_size: int = 512, hidden_size: int = 128,
                        num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 256,
                        **overrides) -> dict:
    d = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
             num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
             head_dim=hidden_size // num_heads, max_position_embeddings=512, rms_norm_eps=1e-6,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=1, eos_token_id=2,
             pad_token_id=0, hidden_act="silu")
    d.update(TINY_VARIANTS[variant])
    d.update(overrides)
    return d


def make_tiny_hf_model(path: str | Path, variant: str = "qwen2", *, seed: int = 0, dtype: str = "float32",
                       scale: float = 0.08, **config_overrides):
    """Builds a random HF torch model, saves it (safetensors) under `path` and returns the torch model.

    Every weight is random, norms and biases included (HF initialises those to 1 and 0, which would hide a
    missing bias or a mis-mapped norm in a parity test).
    """
    import torch
    import transformers

    d = tiny_hf_config_dict(variant, **config_overrides)
    config = transformers.AutoConfig.for_model(**d)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(scale * torch.randn_like(p))
    model = model.to(getattr(torch, dtype)).eval()
    model.save_pretrained(str(path))
    return model


def make_tiny_tokenizer(path: str | Path | None = None, *, vocab_size: int = 512, corpus: list[str] | None = None):
    """A byte-level BPE tokenizer (Qwen2 pipeline, ChatML template) trained offline on a small fixed corpus."""
    from arpo_jax.weights import bpe

    return bpe.train_bpe_tokenizer(corpus or _default_corpus(), vocab_size=vocab_size, path=path)


def _default_corpus() -> list[str]:
    words = ("the of and to in is was for on that with as by at from his her an which or be are were this "
             "search python result answer think print import math sum range def return value number year").split()
    lines = []
    for i in range(400):
        lines.append(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) + f" {i} {i * 37 % 1000}")
    lines += ["<think> x </think> <search> q </search> <result>\n r \n</result> <python> print(1+2) </python>",
              "<answer> The final answer is \\[ \\boxed{42} \\] </answer>"]
    return lines


@contextlib.contextmanager
def scripted_server(respond):
    """A loopback HTTP server; `respond(n, path, body)` -> (status, payload, delay_s) for the n-th request (1-based).

    Yields (base_url, seen): every request's method, path, headers and JSON body.
    """
    seen = []
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self._answer()

        def do_POST(self):
            self._answer()

        def _answer(self):
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = json.loads(raw) if raw else None
            with lock:
                seen.append({"method": self.command, "path": self.path, "headers": dict(self.headers), "body": body})
                n = len(seen)
            status, payload, delay = respond(n, self.path, body)
            time.sleep(delay)
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            with contextlib.suppress(OSError):  # the client may have given up (timeouts)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}/v1", seen
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def assert_same_samples(a, b, atol: float = 1e-4) -> float:
    """Two engines' `SampleResult`s: identical tokens / text / finish / stop string, top-k log-prob dicts of the same
    size whose keys differ only by ties at the k-th rank; returns the largest log-prob difference on common keys."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert (x.text, x.finish_reason, x.stop_string) == (y.text, y.finish_reason, y.stop_string)
        assert len(x.top_logprobs) == len(y.top_logprobs) == min(20, len(x.token_ids))
        for dx, dy in zip(x.top_logprobs, y.top_logprobs):
            if dx.keys() != dy.keys():  # only a tie at the k-th rank may swap a key
                lo_x, lo_y = min(dx.values()), min(dy.values())
                assert abs(lo_x - lo_y) < atol
                assert all(abs(dx[k] - lo_x) < atol for k in dx.keys() - dy.keys())
                assert all(abs(dy[k] - lo_y) < atol for k in dy.keys() - dx.keys())
            common = sorted(dx.keys() & dy.keys())
            worst = max(worst, float(np.abs(np.subtract([dx[k] for k in common], [dy[k] for k in common])).max()))
    return worst


ROLLOUT_ARRAYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "loss_mask",
                  "prompt_index", "slot_id", "parent_id", "tool_calls", "rounds", "response_length", "truncated",
                  "finish_reason", "failed", "rollout_logp")
ROLLOUT_COUNTS = ("trajectories", "branches", "branch_attempts", "refills", "rounds", "tool_calls",
                  "call_limit_reached", "empty_tool_content", "premonitor_tool_calls", "initial_rollouts_mean",
                  "truncated_fraction", "segment_entropy_mean", "critical_path_steps")


def assert_same_rollouts(a, b, atol: float = 0.0) -> None:
    """Two `RolloutOutput`s of one rollout, field by field: every array (the engines' log-probs NaN where no token
    was sampled, in both), the trees (nodes: ids, parents, kinds, rounds, branch points, baselines, entropies; every
    branching attempt: source, entropies, probability, draw, outcome, child) and the counts of the metrics. `atol`:
    how far the log-probs and entropies may differ (0: bit-equal; a real engine's float32 rounds a little
    differently when its decode program has another number of rows: ~5e-7 on CPU); the tokens may not."""
    import dataclasses

    for name in ROLLOUT_ARRAYS:
        if name == "rollout_logp":
            np.testing.assert_allclose(a.rollout_logp, b.rollout_logp, atol=atol, rtol=0, err_msg=name)
        else:
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert len(a.trees) == len(b.trees)
    for ta, tb in zip(a.trees, b.trees):
        fa, fb = dataclasses.asdict(ta), dataclasses.asdict(tb)
        _assert_close_tree(fa, fb, atol, f"tree {ta.prompt_index}")
    for name in ROLLOUT_COUNTS:
        np.testing.assert_allclose(a.metrics[f"rollout/{name}"], b.metrics[f"rollout/{name}"], atol=atol, rtol=0,
                                   err_msg=name)


def _assert_close_tree(x, y, atol: float, where: str) -> None:
    """Nested dicts and lists of a tree: equal, floats to `atol`."""
    if isinstance(x, dict):
        assert x.keys() == y.keys(), where
        for k in x:
            _assert_close_tree(x[k], y[k], atol, f"{where}.{k}")
    elif isinstance(x, list | tuple):
        assert len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y)):
            _assert_close_tree(u, v, atol, f"{where}[{i}]")
    elif isinstance(x, float) and isinstance(y, float):
        assert abs(x - y) <= atol or x == y, f"{where}: {x} != {y}"
    else:
        assert x == y, f"{where}: {x!r} != {y!r}"


def assert_equal_on_cpu(actual, desired) -> None:
    """Two programs that compute the same maths: bit-equal on CPU; within float32 rounding (1e-5) on a GPU or TPU,
    whose compiler fuses (and so rounds) two different programs' equal arithmetic differently (LoRA with B = 0 vs
    the base model's logits: 2.3e-6 apart on an H100 in full float32)."""
    import jax

    tol = 0.0 if jax.default_backend() == "cpu" else 1e-5
    for a, d in zip(jax.tree.leaves(actual), jax.tree.leaves(desired), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(d), atol=tol, rtol=tol)


def randomize_lora_b(model, seed: int = 1, scale: float = 0.05):
    """`model` (with LoRA adapters) with random B matrices: fresh adapters have B = 0 and change nothing, so a test
    of what an adapter does needs these."""
    import jax
    from flax import nnx

    from arpo_jax.models.transformer import LoRAParam

    graphdef, adapters, rest = nnx.split(model, LoRAParam, ...)
    keys = iter(jax.random.split(jax.random.key(seed), 1000))
    flat = [(p, v.replace(scale * jax.random.normal(next(keys), v.shape)) if p[-1] == "lora_b" else v)
            for p, v in nnx.to_flat_state(adapters)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat), rest)
