"""The JAX engine in the real agent loop (issue 54): no compiles after the first call, samples independent of the
number of rows and of tool completion order, tool calls started while the round still decodes.

A tiny Qwen2 model fitted (briefly, so that sampling at T = 1 still varies) to four tool-using conversations of
different lengths writes real `<python>` calls; a deterministic local tool answers with results whose length depends
on the call; ARPO branches. Several rollout calls (steps) with different prompts, and a greedy validation call, must
compile no program after the first call, on a 2-device mesh as the trainer runs the engine.
"""

import random
import threading
import time
import zlib

import jax
import numpy as np
import pytest
from flax import nnx

from arpo_jax import compile_log, quickstart, sharding, testing
from arpo_jax.models import CausalLM, Config
from arpo_jax.rollout.agent_loop import RolloutConfig, greedy_settings, rollout, wrap_tool_result
from arpo_jax.rollout.jax_sampler import JaxSampler
from arpo_jax.rollout.sampler import SamplingSettings
from arpo_jax.tools import ExecutorConfig, Tool, ToolExecutor
from arpo_jax.weights import bpe

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


def _arpo(**kw) -> RolloutConfig:
    """ARPO on the tiny budgets: 2 roots and up to 4 trajectories per prompt, 2 tool calls at most."""
    base = dict(n=4, initial_rollouts=2, beam_size=2, branch_probability=1.0, entropy_weight=0.0)
    return RolloutConfig(**(base | kw), response_length=R, prompt_length=P, call_limit=2)


def _prompts(tok, which):
    return [tok.encode(f"Question: {TASKS[i][0]}") for i in which]


def test_no_compiles_after_the_first_rollout_call(agent):
    tok, model = agent
    mesh = sharding.make_mesh((1, 2, 1), jax.devices()[:2])  # the weights and the cache's rows split over fsdp
    graphdef, state = nnx.split(model)
    rules = sharding.get_rules(model.config.sharding_rules)
    state = jax.device_put(state, sharding.state_shardings(state, mesh, rules))
    sampler = JaxSampler((graphdef, state), tok, max_len=P + R, mesh=mesh, decode_chunk=8, prefill_chunk=64)
    config = _arpo()
    steps = [([0, 1], False), ([2, 3], False), ([3, 0], False), ([1, 2, 3, 0], True), ([2, 1], False)]
    compiles, calls, branches = [], [], []
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
        calls.append(int(out.tool_calls.sum()))
        branches.append(int(out.metrics["rollout/branches"]))
    # The calls that must not compile have tool rounds and branches of their own (not only the first call).
    assert sum(calls[1:]) >= 10 and sum(branches[1:]) >= 4, (calls, branches)
    # The first call compiles the engine's programs (its warm-up) and nothing else; the later calls nothing.
    assert compiles == [len(sampler.programs())] + [0] * (len(steps) - 1), compiles


class ShuffledTool(Tool):
    """`LengthyTool`'s results, each after a random pause: calls complete in a different order on every run."""

    tag = "python"

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.lock = threading.Lock()

    def execute(self, content: str) -> str:
        with self.lock:
            pause = self.rng.uniform(0.0, 0.03)
        time.sleep(pause)
        return LengthyTool().execute_batch([("python", content)])[0]


def _rollouts(tok, model, slots: int, tool_seed: int | None, **config):
    """Two rollout calls; the tool answers after random pauses (`tool_seed`), or at once (None)."""
    sampler = JaxSampler(model, tok, max_len=P + R, slots=slots, decode_chunk=8, prefill_chunk=64)
    if tool_seed is None:
        executor = LengthyTool()
    else:
        executor = ToolExecutor([ShuffledTool(tool_seed)], ExecutorConfig(max_workers=8, timeout_s=60))
    config = _arpo(**{"branch_probability": 0.7} | config)
    try:
        return [
            rollout(
                _prompts(tok, which),
                sampler,
                executor,
                tok,
                config,
                SamplingSettings(temperature=1.0, seed=step, token_logprobs=True),
                rng=step,
            )
            for step, which in enumerate([[0, 1, 2], [3, 1]])
        ]
    finally:
        if tool_seed is not None:
            executor.close()


@pytest.mark.parametrize("compat", [False, True])
def test_the_stream_gives_the_rounds_trajectories_with_the_jax_engine(agent, compat):
    """The real engine: the stream (16 rows, or 3: requests wait and speculative ones are preempted) and the rounds,
    tool calls finishing in another order each run, give the same trajectories, trees and attempts."""
    tok, model = agent
    want = _rollouts(tok, model, 16, 0, schedule="rounds", reference_compat=compat)
    assert sum(o.metrics["rollout/branches"] for o in want) and sum(o.metrics["rollout/refills"] for o in want)
    for slots, seed in ((16, 1), (3, 2), (16, None)):
        got = _rollouts(tok, model, slots, seed, reference_compat=compat)
        for a, b in zip(got, want, strict=True):
            testing.assert_same_rollouts(a, b, atol=1e-5)
        assert sum(o.metrics["rollout/speculative_trajectories"] for o in got) > 0
    # With tools that answer at once, the same rows take fewer sequential steps (seen: 168 against 264 in the
    # default mode). While tools pause the stream decodes speculative work: more steps, none of them waited for.
    steps = [sum(o.metrics["rollout/decode_steps"] for o in out) for out in (got, want)]
    assert steps[0] < steps[1], steps


def test_samples_depend_on_neither_the_slots_nor_the_tool_completion_order(agent):
    """Per-request keys: one row (every request waits for it, every continuation prefills its whole context again)
    or many, with tool calls finishing in another order each run, give the same trajectories."""
    tok, model = agent
    runs = [_rollouts(tok, model, slots, seed) for slots, seed in ((16, 0), (1, 1), (3, 2))]
    assert sum(int(o.tool_calls.sum()) for o in runs[0]) >= 4 and sum(o.metrics["rollout/branches"] for o in runs[0])
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            for field in ("input_ids", "attention_mask", "loss_mask", "tool_calls", "parent_id", "finish_reason"):
                np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
            np.testing.assert_allclose(a.rollout_logp, b.rollout_logp, atol=1e-5)
            for ta, tb in zip(a.trees, b.trees, strict=True):
                for na, nb in zip(ta.nodes, tb.nodes, strict=True):
                    np.testing.assert_allclose(na.segment_entropies, nb.segment_entropies, atol=1e-4)


class _Logged:
    """The engine, logging when each `generate` call returns; after reporting a segment that ends in a tool closer
    it waits (a few seconds at most) for that tool call to start, so a call the loop started at once is seen to
    start inside the call."""

    reports_each = True

    def __init__(self, inner, events: list, started: threading.Event):
        self.inner, self.events, self.started = inner, events, started

    def generate(self, requests, settings, on_result=None):
        def each(i, res):
            self.started.clear()
            on_result(i, res)
            if res.finish_reason == "stop":
                self.started.wait(5.0)

        out = self.inner.generate(requests, settings, on_result=each)
        self.events.append("generate_end")
        return out

    def reset_cache(self):
        self.inner.reset_cache()


def test_tool_calls_start_while_the_round_still_decodes(agent):
    tok, model = agent
    events, started = [], threading.Event()

    class Recording(ToolExecutor):
        def run_batch(self, requests):
            events.append("call")
            started.set()
            return super().run_batch(requests)

    sampler = _Logged(JaxSampler(model, tok, max_len=P + R, slots=8, decode_chunk=4, prefill_chunk=64), events, started)
    executor = Recording([ShuffledTool(0)], ExecutorConfig(max_workers=8, timeout_s=60))
    config = _arpo(initial_rollouts=4, beam_size=1, schedule="rounds")
    try:
        out = rollout(_prompts(tok, [0, 1]), sampler, executor, tok, config, SamplingSettings(temperature=1.0), rng=0)
    finally:
        executor.close()
    assert out.metrics["rollout/tool_calls"] == events.count("call") >= 2
    first_round = events[: events.index("generate_end")]
    assert "call" in first_round  # started before the round's engine call returned


def test_the_stream_runs_tool_calls_while_the_engine_decodes_other_trajectories(agent):
    """Each call starts as its segment comes back, while other requests are still in the engine; the rollout's
    waiting on tools is a fraction of the calls' own time (`rollout/tool_hidden_s`)."""
    tok, model = agent
    engine = JaxSampler(model, tok, max_len=P + R, slots=8, decode_chunk=4, prefill_chunk=64)
    streams, in_flight = [], []

    class Watched(JaxSampler):  # (the engine's stream, kept to look at)
        def __init__(self):
            self.__dict__ = engine.__dict__

        def stream(self, settings):
            streams.append(engine.stream(settings))
            return streams[-1]

    class Recording(ToolExecutor):
        def run_batch(self, requests):
            in_flight.append(len(streams[-1].reqs))  # requests the engine holds as this call starts
            return super().run_batch(requests)

    executor = Recording([ShuffledTool(0)], ExecutorConfig(max_workers=8, timeout_s=60))
    try:
        out = rollout(_prompts(tok, [0, 1]), Watched(), executor, tok, _arpo(initial_rollouts=4, beam_size=1),
                      SamplingSettings(temperature=1.0), rng=0)
    finally:
        executor.close()
    assert out.metrics["rollout/tool_calls"] == len(in_flight) >= 2
    assert max(in_flight) > 0  # a call ran while the engine was decoding others
    assert 0 < out.metrics["rollout/tool_hidden_s"]
