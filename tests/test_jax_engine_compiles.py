"""The JAX engine in the real agent loop compiles nothing after its first call (issue 54).

A tiny Qwen2 model fitted (briefly, so that sampling at T = 1 still varies) to four tool-using conversations of
different lengths writes real `<python>` calls; a deterministic local tool answers with results whose length depends
on the call; ARPO branches at every decision. Several rollout calls (steps) with different prompts, and a greedy
validation call, must compile no program after the first call.
"""

import zlib

import numpy as np
import pytest
from flax import nnx

from arpo_jax import bpe, compile_log, quickstart
from arpo_jax.models import CausalLM, Config
from arpo_jax.rollout.agent_loop import RolloutConfig, greedy_settings, rollout, wrap_tool_result
from arpo_jax.rollout.jax_sampler import JaxSampler
from arpo_jax.rollout.sampler import SamplingSettings

pytestmark = pytest.mark.slow  # compile-bound

TASKS = [
    ("what is 12 times 19 ?", "print(12 * 19)", "228"),
    ("what is 7 plus 5 ?", "print(7 + 5)", "12"),
    ("how many letters does the word banana have ?", "print(len('banana'))", "6"),
    ("what is 2 to the power 10 ?", "print(2 ** 10)", "1024"),
]
P, R = 24, 72  # prompt and response budgets (tokens)


class LengthyTool:
    """A deterministic local tool: each call's result is a function of its content, 1 to 40 characters long."""

    stop_strings = ("</python>", "</search>")

    def execute_batch(self, requests):
        out = []
        for _, content in requests:
            crc = zlib.crc32(content.encode())
            out.append((str(crc) * 5)[: 1 + crc % 40])
        return out


@pytest.fixture(scope="module")
def agent():
    """(tokenizer, model): a tiny model that has half learnt four tool-using conversations."""
    lines = [
        f"Question: {q} <python> {code} </python>" + wrap_tool_result(a) + f" <answer> {a} </answer>"
        for q, code, a in TASKS
    ]
    tok = bpe.train_bpe_tokenizer(lines, vocab_size=500)
    cfg = Config(
        model_type="qwen2",
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        qkv_bias=True,
        max_position_embeddings=256,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    rows = [tok.encode(line) + [tok.eos_token_id] for line in lines]
    width = max(map(len, rows))
    quickstart.fit(model, np.asarray([r + [0] * (width - len(r)) for r in rows], np.int32), steps=120)
    return tok, model


def _prompts(tok, which):
    return [tok.encode(f"Question: {TASKS[i][0]}") for i in which]


def test_no_compiles_after_the_first_rollout_call(agent):
    tok, model = agent
    sampler = JaxSampler(model, tok, max_len=P + R, decode_chunk=8, prefill_chunk=64)
    config = RolloutConfig(
        n=4,
        initial_rollouts=2,
        beam_size=2,
        branch_probability=1.0,
        entropy_weight=0.0,
        response_length=R,
        prompt_length=P,
        call_limit=2,
    )
    steps = [([0, 1], False), ([2, 3], False), ([3, 0], False), ([1, 2, 3, 0], True), ([2, 1], False)]
    compiles, calls, branches = [], 0, 0
    for step, (which, validation) in enumerate(steps):
        before = compile_log.counts()
        with compile_log.phase("rollout"):
            settings = SamplingSettings(temperature=1.0, seed=step)
            cfg = config.for_validation() if validation else config
            sampler.reset_cache()
            out = rollout(
                _prompts(tok, which),
                sampler,
                LengthyTool(),
                tok,
                cfg,
                greedy_settings(settings) if validation else settings,
                rng=step,
            )
        compiles.append(compile_log.total(compile_log.since(before)))
        calls += int(out.tool_calls.sum())
        branches += int(out.metrics["rollout/branches"])
    assert calls >= 10 and branches >= 4  # the workload has tool rounds and branches
    assert compiles[0] > 0 and compiles[1:] == [0] * (len(steps) - 1), compiles
