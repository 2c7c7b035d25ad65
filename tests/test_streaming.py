"""The streaming schedule gives the round schedule's trajectories (rollout/streaming.py, replay.py, identity.py).

A scripted engine whose "model" writes a random segment drawn from the request's own seed (so the same request
writes the same whichever way it is scheduled) and a tool whose answers depend on the call alone but come back
after random pauses: under one seed, the stream (with few rows or many, speculation on or off) and the rounds give
the same output, field by field: tokens, masks, log-probs, row order, slot ids, parents, kinds, finish reasons,
trees and every branching attempt. With speculation on, trajectories did start early and some were cancelled:
none of their tokens reaches the output, since it equals the rounds'.
"""

import dataclasses
import random
import threading
import time
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from arpo_jax import testing
from arpo_jax.rollout.agent_loop import RolloutConfig, RolloutState, rollout
from arpo_jax.rollout.fake_sampler import ScriptedSampler, random_segment
from arpo_jax.rollout.sampler import SamplingSettings

WORDS = ["the", "of", "and", "to", "search", "python", "result", "answer", "think", "print"]


@pytest.fixture(scope="module")
def tok():
    return testing.make_tiny_tokenizer()


def keyed_script(call):
    """A random segment from the request's own seed: a tool call (most often), an empty call, EOS, plain text."""
    return random_segment(np.random.default_rng(call.seed), WORDS, 30)


class SlowTool:
    """Answers from the call's content alone, after a random pause (results come back in a new order each run)."""

    stop_strings = ("</python>", "</search>")

    def __init__(self, seed: int, pause_s: float = 0.004):
        self.rng, self.lock, self.pause = random.Random(seed), threading.Lock(), pause_s

    def execute_batch(self, requests):
        out = []
        for tag, content in requests:
            with self.lock:
                pause = self.rng.uniform(0.0, self.pause)
            time.sleep(pause)
            crc = zlib.crc32(f"{tag}:{content}".encode())
            out.append((str(crc) * 3)[: 1 + crc % 17])
        return out


def _run(tok, cfg, prompts, seed, *, rows=64, tool_seed=0, state=None):
    sampler = ScriptedSampler(tok, keyed_script, rows=rows)
    settings_ = SamplingSettings(temperature=1.0, seed=seed, token_logprobs=True)
    out = rollout(prompts, sampler, SlowTool(tool_seed), tok, cfg, settings_, seed, state=state)
    return out, sampler


def assert_same_rollout(a, b):
    testing.assert_same_rollouts(a, b)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 8), m=st.integers(1, 3), beam=st.sampled_from([1, 2, 2, 3]), R=st.integers(8, 200),
       call_limit=st.integers(0, 4), rule=st.sampled_from(["arpo", "aepo"]), compat=st.booleans(),
       p=st.sampled_from([0.0, 0.5, 0.8, 1.0]), w=st.floats(0, 0.5), batch=st.integers(1, 4),
       dynamic=st.booleans(), seed=st.integers(0, 2**16), rows=st.sampled_from([1, 3, 64]),
       speculate=st.booleans())
def test_the_stream_gives_the_rounds_trajectories(tok, n, m, beam, R, call_limit, rule, compat, p, w, batch, dynamic,
                                                 seed, rows, speculate):
    cfg = RolloutConfig(n=n, initial_rollouts=m, beam_size=beam, branch_probability=p, entropy_weight=w, rule=rule,
                        response_length=R, call_limit=call_limit, reference_compat=compat,
                        enable_dynamic_rollouts=dynamic, initial_entropy_tokens=6, schedule="rounds")
    prompts = [tok.encode(" ".join(WORDS[b:b + 3])) for b in range(batch)]
    want, _ = _run(tok, cfg, prompts, seed)
    got, _ = _run(tok, dataclasses.replace(cfg, schedule="stream", speculate=speculate), prompts, seed, rows=rows,
                  tool_seed=seed + 1)
    assert_same_rollout(got, want)
    assert list(got.prompt_index) == [b for b in range(batch) for _ in range(n)]  # exactly n a prompt
    m = got.metrics
    for name, hit in [("branched", m["rollout/branches"] > 0), ("refilled", m["rollout/refills"] > 0),
                      ("started early", m["rollout/speculative_trajectories"] > 0),
                      ("cancelled", m["rollout/speculative_trajectories"] > m["rollout/speculative_committed"])]:
        event(name if hit else f"not {name}")  # coverage shown by --hypothesis-show-statistics


@pytest.mark.parametrize("rule,compat,dynamic", [("arpo", False, False), ("arpo", True, False), ("aepo", False, True),
                                                  ("aepo", True, False)])
@pytest.mark.parametrize("rows,speculate", [(1, True), (4, True), (64, True), (64, False)])
def test_the_stream_gives_the_rounds_trajectories_at_the_reference_shape(tok, rule, compat, dynamic, rows, speculate):
    """The reference's shape (n 8, m 4 or AEPO's pre-monitoring, beam 2, p 0.5, w 0.2), where every prompt branches
    and refills; one engine row (every request waits, committed work preempts speculative work) up to many."""
    cfg = RolloutConfig(n=8, initial_rollouts=4, beam_size=2, branch_probability=0.5, entropy_weight=0.2, rule=rule,
                        response_length=200, call_limit=3, reference_compat=compat, enable_dynamic_rollouts=dynamic,
                        initial_entropy_tokens=6, schedule="rounds")
    prompts = [tok.encode(" ".join(WORDS[b:b + 3])) for b in range(4)]
    for seed in (1, 2):
        want, _ = _run(tok, cfg, prompts, seed)
        got, _ = _run(tok, dataclasses.replace(cfg, schedule="stream", speculate=speculate), prompts, seed,
                      rows=rows, tool_seed=seed + 7)
        assert_same_rollout(got, want)
        assert want.metrics["rollout/branches"] > 0 and want.metrics["rollout/refills"] > 0


def test_speculation_starts_early_cancels_what_is_not_to_be_and_saves_decode_steps(tok):
    """ARPO at the reference's shape (n 8, m 4): the stream starts branches and refills early; some are cancelled
    (their tokens discarded, none in the output: it equals the rounds'); the stream's sequential decode steps are far
    fewer than the rounds' (a round costs its longest segment; refills wait for their round)."""
    cfg = RolloutConfig(n=8, initial_rollouts=4, beam_size=2, branch_probability=0.5, entropy_weight=0.2,
                        response_length=300, call_limit=3, schedule="rounds")
    prompts = [tok.encode(" ".join(WORDS[b:b + 3])) for b in range(6)]
    want, _ = _run(tok, cfg, prompts, 11)
    got, _ = _run(tok, dataclasses.replace(cfg, schedule="stream"), prompts, 11, tool_seed=3)
    assert_same_rollout(got, want)
    m = got.metrics
    assert m["rollout/branches"] > 0 and m["rollout/refills"] > 0
    assert m["rollout/speculative_trajectories"] > m["rollout/speculative_committed"] > 0  # some were cancelled
    assert m["rollout/speculative_tokens_discarded"] > 0
    assert m["rollout/decode_steps"] < 0.7 * want.metrics["rollout/decode_steps"], (m["rollout/decode_steps"],
                                                                                    want.metrics["rollout/decode_steps"])
    assert m["rollout/critical_path_steps"] == want.metrics["rollout/critical_path_steps"]
    assert m["rollout/decode_steps"] >= m["rollout/critical_path_steps"]


def test_reference_compat_stale_baselines_carry_over_in_both_schedules(tok):
    """B1 (compat): the stale slot-id dict a worker keeps across calls gives the same second call in both."""
    cfg = RolloutConfig(n=4, initial_rollouts=2, beam_size=2, branch_probability=0.5, entropy_weight=0.4,
                        response_length=120, call_limit=3, reference_compat=True, schedule="rounds")
    prompts = [tok.encode(" ".join(WORDS[b:b + 3])) for b in range(3)]
    outs = {}
    for schedule in ("rounds", "stream"):
        state = RolloutState()
        c = dataclasses.replace(cfg, schedule=schedule)
        first, _ = _run(tok, c, prompts, 5, state=state)
        second, _ = _run(tok, c, prompts[::-1], 6, state=state)
        outs[schedule] = (first, second, dict(state.baselines.values))
    for a, b in zip(outs["rounds"][:2], outs["stream"][:2]):
        assert_same_rollout(b, a)
    assert outs["rounds"][2] == outs["stream"][2]
