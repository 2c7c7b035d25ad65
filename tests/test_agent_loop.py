"""The engine-agnostic tool rollout (spec 3), ARPO/AEPO branching in the loop (4, 5), with a scripted sampler."""

import dataclasses
import math
import os
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from arpo_jax import testing
from arpo_jax.rollout import branching
from arpo_jax.rollout.agent_loop import (
    PREMONITOR_SLOT_BASE,
    SCHEDULES,
    RolloutConfig,
    RolloutState,
    encode_tool_result,
    extract_tool_content,
    greedy_settings,
    rollout,
    wrap_tool_result,
)
from arpo_jax.rollout.fake_sampler import ScriptedSampler, Segment, by_slot, fake_token_logprob, random_segment
from arpo_jax.rollout.sampler import SamplingSettings


@pytest.fixture(scope="module")
def tok():
    return testing.make_tiny_tokenizer()


class EchoExecutor:
    """In-process stand-in for ToolExecutor: `R<k>:<content>` (or a fixed text), recording every call."""

    stop_strings = ("</python>", "</search>")

    def __init__(self, reply=None):
        self.reply = reply
        self.requests, self.results = [], []

    def execute_batch(self, requests):
        out = [self.reply if self.reply is not None else f"R{len(self.results) + i}:{c[:8]}"
               for i, (_, c) in enumerate(requests)]
        self.requests += requests
        self.results += out
        return out


def _prompts(tok, k=2):
    texts = ["the of and to", "search python result answer", "think print import math"]
    return [tok.encode(texts[i % 3]) for i in range(k)]


def _response(out, tok, i):
    return tok.decode(out.responses[i, :out.response_length[i]], skip_special_tokens=False)


def _run(tok, segments, config, *, executor=None, prompts=None, rng=0, state=None, st_=None):
    sampler = ScriptedSampler(tok, segments if callable(segments) else by_slot(segments))
    executor = executor or EchoExecutor()
    out = rollout(prompts or _prompts(tok, 1), sampler, executor, tok, config, st_, rng, state=state)
    return out, sampler, executor


CALL = Segment("<think> x </think> <python> print(1+2) </python>")
ANSWER = Segment("<answer> 3 </answer>", eos=True)
ONE = RolloutConfig(n=1, initial_rollouts=1, beam_size=1, response_length=200, call_limit=3)


# ------------------------------------------------------------------------------------ hand-built scenarios (3.3)
def test_result_wrapping_is_byte_exact_and_masked(tok):
    reply = "line one\nzwei drei ü €"
    out, _, ex = _run(tok, {0: [CALL, ANSWER]}, ONE, executor=EchoExecutor(reply))
    assert ex.requests == [("python", "print(1+2)")]
    resp = list(out.responses[0, :out.response_length[0]])
    call_ids = tok.encode(CALL.text, add_special_tokens=False)
    result_ids = tok.encode(" <result>\n" + reply + "\n</result>", add_special_tokens=False)
    answer_ids = tok.encode(ANSWER.text, add_special_tokens=False) + [tok.eos_token_id]
    assert resp == call_ids + result_ids + answer_ids
    assert _response(out, tok, 0) == CALL.text + " <result>\nline one\nzwei drei ü €\n</result>" + ANSWER.text + \
        "<|im_end|>"
    expected = [1] * len(call_ids) + [0] * len(result_ids) + [1] * len(answer_ids)
    assert list(out.loss_mask[0, :len(resp)]) == expected and not out.loss_mask[0, len(resp):].any()
    assert out.finish_reason[0] == "eos" and out.tool_calls[0] == 1 and out.rounds[0] == 2
    assert wrap_tool_result("x") == " <result>\nx\n</result>"


def test_extract_tool_content():
    assert extract_tool_content("a <python> 1 </python> b <python>\n2\n</python> c", "python") == "2"
    assert extract_tool_content("<search> q </search> <search> r", "search") == "q"  # last closer, its opener
    assert extract_tool_content("no opener </search>", "search") == ""
    assert extract_tool_content("<search> no closer", "search") == ""


def test_call_limit_appends_eos_with_mask_one(tok):
    cfg = dataclasses.replace(ONE, call_limit=2)
    out, _, ex = _run(tok, {0: [CALL] * 5}, cfg)
    assert len(ex.requests) == 2 and out.tool_calls[0] == 2
    L = out.response_length[0]
    assert out.finish_reason[0] == "call_limit" and out.responses[0, L - 1] == tok.eos_token_id
    assert out.loss_mask[0, L - 1] == 1 and out.response_mask[0, L - 1] == 1
    assert _response(out, tok, 0).endswith("</python><|im_end|>")  # the 3rd call got EOS, no result
    assert out.metrics["rollout/call_limit_reached"] == 1
    out0, _, ex0 = _run(tok, {0: [CALL]}, dataclasses.replace(ONE, call_limit=0))
    assert ex0.requests == [] and out0.finish_reason[0] == "call_limit" and out0.tool_calls[0] == 0


@pytest.mark.parametrize("compat", [False, True])
def test_empty_tool_content_ends_silently(tok, compat):
    cfg = dataclasses.replace(ONE, response_length=40, reference_compat=compat)
    out, _, ex = _run(tok, {0: [Segment("<think> x </think> <search>   </search>"), ANSWER]}, cfg)
    L = out.response_length[0]
    assert ex.requests == [] and out.finish_reason[0] == "empty_tool_content" and out.tool_calls[0] == 1
    assert _response(out, tok, 0) == "<think> x </think> <search>   </search>"  # no EOS, no result
    assert out.loss_mask[0, :L].all() and not out.loss_mask[0, L:].any()
    # B10: without EOS the reference's attention also covers the padding; the default does not.
    assert out.response_mask[0, L:].all() if compat else not out.response_mask[0, L:].any()


@pytest.mark.parametrize("compat", [False, True])
def test_closer_without_opener_b10(tok, compat):
    cfg = dataclasses.replace(ONE, reference_compat=compat)
    second = Segment("more text </python>")  # a closer whose opener is in the previous turn
    out, _, ex = _run(tok, {0: [CALL, second, ANSWER]}, cfg)
    if compat:  # the reference grabs everything from the earlier call's opener on, old result included
        grabbed = "print(1+2) </python> <result>\nR0:print(1+\n</result>more text"
        assert [c for _, c in ex.requests] == ["print(1+2)", grabbed] and out.finish_reason[0] == "eos"
    else:
        assert [c for _, c in ex.requests] == ["print(1+2)"] and out.finish_reason[0] == "empty_tool_content"


@pytest.mark.parametrize("compat", [False, True])
def test_special_tokens_in_tool_output_b11(tok, compat):
    cfg = dataclasses.replace(ONE, reference_compat=compat)
    out, _, _ = _run(tok, {0: [CALL, ANSWER]}, cfg, executor=EchoExecutor("a <|im_end|> b"))
    L = out.response_length[0]
    eos_at = np.flatnonzero(out.responses[0, :L] == tok.eos_token_id)
    if compat:  # parsed as EOS inside the (masked) result: the attention stops there
        assert len(eos_at) == 2 and out.response_mask[0, eos_at[0] + 1:].sum() == 0
    else:
        assert list(eos_at) == [L - 1] and out.response_mask[0, :L].all()
    assert encode_tool_result(tok, "x", False) == tok.encode(" <result>\nx\n</result>", add_special_tokens=False)


def test_truncation_at_response_budget(tok):
    cfg = dataclasses.replace(ONE, response_length=12)
    long = Segment("the of and to in is was for on that with as by at from his her an which or be are")
    out, sampler, _ = _run(tok, {0: [long]}, cfg)
    assert out.response_length[0] == 12 and out.finish_reason[0] == "length"
    assert out.responses.shape == (1, 12) and out.loss_mask[0].all()
    assert [r.max_tokens for r in sampler.calls[0][0]] == [12]
    # A tool call whose result crosses R: the result is cut, the slot ends.
    out, sampler, ex = _run(tok, {0: [CALL, ANSWER]}, dataclasses.replace(ONE, response_length=20))
    assert len(ex.requests) == 1 and len(sampler.calls) == 1 and out.truncated[0]
    n_call = len(tok.encode(CALL.text, add_special_tokens=False))
    assert n_call < 20 and out.response_length[0] == 20
    assert out.loss_mask[0, :n_call].all() and not out.loss_mask[0, n_call:].any()  # the call, then the result


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_request_asks_for_its_own_remaining_budget(tok, schedule):
    # Slot 0 calls a tool (a short budget left after its result), slot 1 did not: each request asks for its own
    # remaining budget (the reference gives both the largest, 3.3.1, and cuts the overshoot at the end).
    cfg = RolloutConfig(n=2, initial_rollouts=2, beam_size=1, response_length=60, call_limit=3, schedule=schedule)
    out, sampler, _ = _run(tok, {0: [CALL, Segment("word " * 80)], 1: [Segment("x"), ANSWER]}, cfg)
    plen = len(_prompts(tok, 1)[0])
    reqs = [r for rs, _, _ in sampler.calls for r in rs]
    assert len(reqs) == 4 and all(r.max_tokens == 60 - (len(r.token_ids) - plen) for r in reqs)
    assert len({r.max_tokens for r in reqs}) == 3  # 60 twice (the roots), then each one's own
    assert not out.truncated[0] and out.response_length[0] == 60 and out.finish_reason[0] == "length"


def test_validation_mode_greedy_single_trajectory(tok):
    cfg = RolloutConfig(n=8, initial_rollouts=4, beam_size=2, response_length=60, call_limit=3).for_validation()
    st_ = greedy_settings(SamplingSettings(temperature=1.0, top_p=0.9, top_k=20))
    out, sampler, _ = _run(tok, lambda c: CALL if "<result>" not in c.context else ANSWER, cfg,
                           prompts=_prompts(tok, 3), st_=st_)
    assert out.input_ids.shape[0] == 3 and all(len(t.nodes) == 1 and not t.attempts for t in out.trees)
    used = sampler.calls[0][1]
    assert (used.temperature, used.top_p, used.top_k) == (0.0, 1.0, -1)
    assert used.stop == ("</python>", "</search>") and used.logprobs == 10 and used.logprob_positions == 20


def test_padded_arrays_layout(tok):
    prompts = [tok.encode("the of"), tok.encode("search python result answer think")]
    cfg = RolloutConfig(n=2, initial_rollouts=2, beam_size=1, response_length=16, call_limit=1, prompt_length=12)
    out, _, _ = _run(tok, {i: [ANSWER] for i in range(4)}, cfg, prompts=prompts)
    assert out.input_ids.shape == (4, 28) and list(out.prompt_index) == [0, 0, 1, 1]
    for i in range(4):
        p = prompts[out.prompt_index[i]]
        assert list(out.input_ids[i, 12 - len(p):12]) == p
        assert (out.input_ids[i, :12 - len(p)] == tok.pad_token_id).all()
        assert list(out.attention_mask[i, :12]) == [0] * (12 - len(p)) + [1] * len(p)
        assert list(out.position_ids[i, 12 - len(p):]) == list(range(len(p) + 16))
        L = out.response_length[i]
        assert (out.responses[i, L:] == tok.pad_token_id).all() and out.attention_mask[i, 12:12 + L].all()
    with pytest.raises(ValueError):
        _run(tok, {}, dataclasses.replace(cfg, prompt_length=3), prompts=prompts)


# --------------------------------------------------------------------------------------- branching in the loop
def _branching_script(call):
    """Roots: call a tool twice, then answer; segment entropy by slot id for distinct values."""
    k = call.context.count("<result>")
    spread = 0.1 + 0.05 * (call.request.slot_id % 7) + 0.2 * k
    return dataclasses.replace(CALL if k < 2 else ANSWER, spread=min(spread, 0.9))


@pytest.mark.parametrize("compat", [False, True])
def test_branch_copies_the_right_state_b4(tok, compat):
    """The round schedule's calls, round by round (the stream makes the same trajectories: the equivalence tests)."""
    cfg = RolloutConfig(n=2, initial_rollouts=1, beam_size=2, branch_probability=1.0, entropy_weight=0.0,
                        response_length=200, call_limit=3, reference_compat=compat, schedule="rounds")
    out, sampler, _ = _run(tok, _branching_script, cfg)
    (tree,) = out.trees
    branch = [nd for nd in tree.nodes if nd.kind == "branch"]
    assert len(branch) == 1 and branch[0].parent_id == 0
    reqs = [(k, r) for k, (rs, _, _) in enumerate(sampler.calls) for r in rs]
    first = next((k, r) for k, r in reqs if r.slot_id == branch[0].slot_id)
    assert first[1].parent_id == 0  # the cache hint
    parent = {k: r for k, r in reqs if r.slot_id == 0}
    if compat:  # decided right after the first tool result with round-0 entropy; starts from that state
        assert first[0] == 1 and list(first[1].token_ids) == list(parent[1].token_ids)
        assert tree.attempts[0].round == 0 and tree.attempts[0].entropy == tree.nodes[0].segment_entropies[0]
    else:  # decided after sampling the post-tool segment; re-samples that segment from the same state
        assert first[0] == 2 and list(first[1].token_ids) == list(parent[1].token_ids)
        assert tree.attempts[0].round == 1 and tree.attempts[0].entropy == tree.nodes[0].segment_entropies[1]
        assert tree.attempts[0].baseline == tree.nodes[0].segment_entropies[0] == branch[0].baseline
    assert out.rounds[1] == 3  # one inherited segment + its own two


def test_explicit_prng_makes_rollouts_reproducible(tok):
    cfg = RolloutConfig(n=6, initial_rollouts=2, beam_size=3, branch_probability=0.5, entropy_weight=0.2,
                        response_length=200, call_limit=3)

    def run(rng):
        return _run(tok, _branching_script, cfg, prompts=_prompts(tok, 3), rng=rng)[0]

    a, b, c = run(7), run(np.random.default_rng(7)), run(8)
    assert (a.input_ids == b.input_ids).all() and (a.parent_id == b.parent_id).all()
    assert [x.draw for t in a.trees for x in t.attempts] == [x.draw for t in b.trees for x in t.attempts]
    assert [x.draw for t in a.trees for x in t.attempts] != [x.draw for t in c.trees for x in t.attempts]


def test_stale_baseline_b1(tok):
    cfg = RolloutConfig(n=2, initial_rollouts=1, beam_size=2, branch_probability=0.5, entropy_weight=0.2,
                        response_length=200, call_limit=3, reference_compat=True)
    state = RolloutState()
    script = lambda c: dataclasses.replace(_branching_script(c), spread=0.2 if "the of" in c.context else 0.7)
    _run(tok, script, cfg, prompts=[_prompts(tok, 1)[0]], state=state)
    stale = state.baselines.get(0)
    out, _, _ = _run(tok, script, cfg, prompts=[_prompts(tok, 2)[1]], state=state)
    a = out.trees[0].attempts[0]
    assert a.baseline == stale and a.entropy != stale  # compared with the previous call's prompt
    out, _, _ = _run(tok, script, dataclasses.replace(cfg, reference_compat=False), prompts=[_prompts(tok, 2)[1]])
    a = out.trees[0].attempts[0]
    assert a.baseline == out.trees[0].nodes[0].segment_entropies[0]  # default: its own first segment


@pytest.mark.parametrize("rule,compat", [("arpo", False), ("aepo", False), ("aepo", True)])
def test_loop_branch_frequency(tok, rule, compat):
    """Empirical branch frequency in real rollouts == the formula (one attempt per prompt, B = 1500)."""
    p, w = 0.3, 0.4
    cfg = RolloutConfig(n=2, initial_rollouts=1, beam_size=2, branch_probability=p, entropy_weight=w,
                        response_length=200, call_limit=3, rule=rule, reference_compat=compat)
    spreads = (0.1, 0.6)  # first segment / post-tool segment: dH > 0 in the default mode
    script = lambda c: dataclasses.replace(CALL if "<result>" not in c.context else ANSWER,
                                           spread=spreads[min(c.context.count("<result>"), 1)])
    out, _, _ = _run(tok, script, cfg, prompts=_prompts(tok, 3) * 500, rng=3)
    attempts = [t.attempts[0] for t in out.trees]
    assert all(len(t.attempts) == 1 for t in out.trees)
    delta = attempts[0].entropy - attempts[0].baseline
    p_eff = 1 - p if rule == "aepo" and not compat else p
    prob = branching.branch_probability(rule, delta, p=p_eff, w=w)
    assert all(a.entropy - a.baseline == delta for a in attempts)
    assert delta == 0.0 if compat else delta > 0.5  # compat: a fresh slot id decides with dH = 0
    freq = np.mean([a.branched for a in attempts])
    assert abs(freq - prob) <= 5 * math.sqrt(prob * (1 - prob) / len(attempts))
    kinds = [t.nodes[1].kind for t in out.trees]
    assert kinds.count("branch") == sum(a.branched for a in attempts)  # the rest was refilled
    assert kinds.count("refill") == len(kinds) - kinds.count("branch")


def test_dynamic_initial_rollouts(tok):
    """AEPO pre-monitoring: m = initial_rollouts_dynamic(n, H_root, mean H_tool) per prompt (5.1)."""
    def script(c):
        sid = c.request.slot_id
        if sid >= PREMONITOR_SLOT_BASE:
            root_phase = sid < PREMONITOR_SLOT_BASE + 2
            prompt = (sid - PREMONITOR_SLOT_BASE) % 2
            if root_phase:
                return Segment("the of and " * 8, spread=0.8 if prompt == 0 else 0.05)
            seg = CALL if c.context.count("<result>") < 2 else ANSWER
            return dataclasses.replace(seg, spread=0.1 if prompt == 0 else 0.9)
        return ANSWER
    cfg = RolloutConfig(n=12, initial_rollouts=2, beam_size=2, response_length=200, call_limit=3, rule="aepo",
                        enable_dynamic_rollouts=True)
    ex = EchoExecutor()
    out, sampler, _ = _run(tok, script, cfg, prompts=_prompts(tok, 2), executor=ex)
    for tree in out.trees:
        m = branching.initial_rollouts_dynamic(12, tree.h_root, tree.h_tool_mean)
        assert tree.initial_rollouts == m == sum(nd.kind == "root" for nd in tree.nodes)
    assert out.trees[0].initial_rollouts > 6 > out.trees[1].initial_rollouts  # high vs low root entropy
    assert out.metrics["rollout/premonitor_tool_calls"] == 4 and len(ex.requests) == 4  # discarded rollouts
    assert out.input_ids.shape[0] == 24 and not (out.tool_calls > 0).any()
    vocab = len(tok.get_vocab())
    pre = [res for reqs, _, ress in sampler.calls for r, res in zip(reqs, ress) if r.slot_id >= PREMONITOR_SLOT_BASE]
    h = [branching.segment_entropy(res.top_logprobs, vocab) for res in pre]
    assert out.trees[0].h_root == pytest.approx(h[0])
    assert out.trees[0].h_tool_mean == pytest.approx(np.mean([h[2], h[4], h[6]]))  # 3 segments incl. the first


def test_premonitor_probes_end_at_the_call_limit_uncounted(tok):
    """Pre-monitoring's probes run the rollout's tool round, but their call-limit and empty-call endings are not the
    trajectories' (rollout/call_limit_reached, empty_tool_content), and their calls count apart."""
    probe = lambda c: c.request.slot_id >= PREMONITOR_SLOT_BASE + 1  # noqa: E731  (1 prompt: after the H_root id)
    cfg = dataclasses.replace(ONE, n=2, initial_rollouts=1, call_limit=1, enable_dynamic_rollouts=True)
    out, sampler, ex = _run(tok, lambda c: CALL if probe(c) else ANSWER, cfg)
    assert [len([r for r in reqs if r.slot_id >= PREMONITOR_SLOT_BASE + 1]) for reqs, _, _ in sampler.calls] == [
        0, 1, 1, 0, 0]  # H_root; the probe's call, its second call (the limit: it ends); then the rollout
    assert len(ex.requests) == 1 and out.metrics["rollout/premonitor_tool_calls"] == 1
    assert out.metrics["rollout/call_limit_reached"] == out.metrics["rollout/tool_calls"] == 0
    assert list(out.finish_reason) == ["eos", "eos"]


# --------------------------------------------------------------------------------------- property tests (3, 4)
WORDS = ["the", "of", "and", "print", "math", "sum", "value", "42", "x"]


def _random_script(call):
    return random_segment(call.rng, WORDS, 4, orphans=True)


def _parse(seq, pos, contexts, eos, tok, wrappers):
    """Oracle: (model-generated positions, #tool results) of seq[pos:], rebuilt from the recorded engine calls
    and tool results only (backtracking over ambiguous matches); None if no consistent parse exists."""
    if pos == len(seq):
        return set(), 0
    for out in sorted({tuple(o) for o in contexts.get(tuple(seq[:pos]), [])}, key=len, reverse=True):
        if list(out[:len(seq) - pos]) == seq[pos:pos + len(out)]:
            end = min(pos + len(out), len(seq))
            rest = _after_output(seq, end, contexts, eos, tok, wrappers)
            if rest is not None:
                return set(range(pos, end)) | rest[0], rest[1]
    return None


def _after_output(seq, pos, contexts, eos, tok, wrappers):
    if pos == len(seq):
        return set(), 0
    if seq[pos] == eos:  # the call-limit EOS: trained, and the last token
        return ({pos}, 0) if pos == len(seq) - 1 else None
    if tuple(seq[:pos]) in contexts:  # a short "length" segment continued in the next round
        rest = _parse(seq, pos, contexts, eos, tok, wrappers)
        if rest is not None:
            return rest
    for q in range(pos + 1, len(seq) + 1):
        if q < len(seq) and tuple(seq[:q]) not in contexts:
            continue
        text = tok.decode(seq[pos:q], skip_special_tokens=False)
        if (text in wrappers) if q < len(seq) else any(w.startswith(text) for w in wrappers):  # cut at R
            rest = _parse(seq, q, contexts, eos, tok, wrappers)
            if rest is not None:
                return rest[0], rest[1] + 1
    return None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 6), m=st.integers(1, 3), beam=st.integers(1, 3), R=st.integers(3, 120),
       call_limit=st.integers(0, 4), rule=st.sampled_from(["arpo", "aepo"]), compat=st.booleans(),
       p=st.sampled_from([0.0, 0.3, 0.5, 1.0]), w=st.floats(0, 0.5), batch=st.integers(1, 3),
       dynamic=st.booleans(), seed=st.integers(0, 2**16), schedule=st.sampled_from(SCHEDULES))
def test_rollout_invariants(tok, n, m, beam, R, call_limit, rule, compat, p, w, batch, dynamic, seed, schedule):
    cfg = RolloutConfig(n=n, initial_rollouts=m, beam_size=beam, branch_probability=p, entropy_weight=w,
                        rule=rule, response_length=R, call_limit=call_limit, reference_compat=compat,
                        enable_dynamic_rollouts=dynamic, initial_entropy_tokens=6, schedule=schedule)
    prompts = _prompts(tok, batch)
    sampler = ScriptedSampler(tok, _random_script, seed=seed)
    ex = EchoExecutor()
    out = rollout(prompts, sampler, ex, tok, cfg, SamplingSettings(token_logprobs=True), seed)

    # Exactly n trajectories per prompt, in prompt order; the trees hold exactly those.
    assert out.input_ids.shape == (batch * n, max(map(len, prompts)) + R)
    assert list(out.prompt_index) == [b for b in range(batch) for _ in range(n)]
    assert len(set(out.slot_id.tolist())) == batch * n

    main = [(r, res) for reqs, _, ress in sampler.calls for r, res in zip(reqs, ress)
            if r.slot_id < PREMONITOR_SLOT_BASE]
    contexts = {}
    for r, res in main:
        contexts.setdefault(tuple(r.token_ids), []).append(res.token_ids)
    # The budget: every request asks for its own remaining budget, never more than R.
    for r, _ in main:
        (plen,) = {len(q) for q in prompts if list(r.token_ids[:len(q)]) == q}
        assert 0 < r.max_tokens == R - (len(r.token_ids) - plen) <= R

    eos = tok.eos_token_id
    for i in range(batch * n):
        plen = len(prompts[out.prompt_index[i]])
        L = out.response_length[i]
        assert L <= R and (out.responses[i, L:] == tok.pad_token_id).all()
        seq = list(prompts[out.prompt_index[i]]) + out.responses[i, :L].tolist()
        parsed = _parse(seq, plen, contexts, eos, tok, {wrap_tool_result(x) for x in ex.results})
        assert parsed is not None, f"trajectory {i} does not decompose into engine outputs and tool results"
        model = np.isin(np.arange(plen, plen + L), sorted(parsed[0]))
        n_results = parsed[1]
        first_eos = next((t for t in range(L) if seq[plen + t] == eos), R)  # no EOS: attention runs on (B10)
        attn = np.arange(R) <= first_eos
        if not compat:
            attn &= np.arange(R) < L
        assert (out.response_mask[i] == attn).all()
        expected = np.zeros(R, np.int32)
        expected[:L] = model & (np.arange(L) <= first_eos)
        assert (out.loss_mask[i] == expected).all()  # 0 exactly on tool-result tokens (and after EOS)
        # The engine's log-prob of every token it sampled (a branch inherits its parent's), NaN elsewhere: tool
        # results, padding and an appended call-limit EOS (not sampled).
        sampled = np.zeros(R, bool)
        sampled[:L] = model
        if out.finish_reason[i] == "call_limit" and seq[-1] == eos and not out.truncated[i]:
            sampled[L - 1] = False
        assert (np.isfinite(out.rollout_logp[i]) == sampled).all()
        np.testing.assert_array_equal(out.rollout_logp[i][sampled],
                                      np.float32([fake_token_logprob(int(t)) for t in out.responses[i][sampled]]))
        # The call limit.
        assert out.tool_calls[i] <= call_limit and n_results <= call_limit
        if out.finish_reason[i] == "call_limit":
            assert out.tool_calls[i] == call_limit and (out.truncated[i] or seq[-1] == eos)
        assert out.finish_reason[i] in ("eos", "call_limit", "empty_tool_content", "length", "stop")

    for name, hit in [("branched", out.metrics["rollout/branches"] > 0),
                      ("refilled", out.metrics["rollout/refills"] > 0),
                      ("call limit", "call_limit" in out.finish_reason), ("truncated", out.truncated.any()),
                      ("empty content", "empty_tool_content" in out.finish_reason),
                      ("pre-monitoring", out.trees[0].h_root is not None)]:
        event(name if hit else f"no {name}")  # coverage shown by --hypothesis-show-statistics
    p_eff = 1 - p if rule == "aepo" and not compat else p
    for b, tree in enumerate(out.trees):
        ids = [nd.slot_id for nd in tree.nodes]
        assert ids == sorted(ids) and ids == out.slot_id[b * n:(b + 1) * n].tolist() and len(ids) == n
        node = {nd.slot_id: nd for nd in tree.nodes}
        assert sum(nd.kind == "root" for nd in tree.nodes) == tree.initial_rollouts <= n
        assert all(nd.kind == "root" for nd in tree.nodes[:tree.initial_rollouts])
        children = [a.child for a in tree.attempts if a.branched]
        assert sorted(children) == [nd.slot_id for nd in tree.nodes if nd.kind == "branch"]
        for a in tree.attempts:
            src = node[a.source]
            assert a.branched == (a.child is not None) and a.round >= src.round_created
            assert a.probability == branching.branch_probability(rule, a.entropy - a.baseline, p=p_eff, w=w,
                                                                 consecutive=a.consecutive)
            if a.branched:
                child = node[a.child]
                assert child.parent_id == a.source and child.round_created == a.round + 1 and a.child > a.source
        per_source_round = {}
        for a in tree.attempts:
            per_source_round[(a.round, a.source)] = per_source_round.get((a.round, a.source), 0) + 1
        assert all(k <= beam - 1 for k in per_source_round.values())
        if rule == "arpo":
            assert all(a.consecutive == 0 for a in tree.attempts)
    if rule == "aepo":  # the per-prompt consecutive-branch counters (5.2), rebuilt from the trees round by round
        counters = [0] * batch
        for r in range(int(out.metrics["rollout/rounds"])):
            for b, tree in enumerate(out.trees):
                assert all(a.consecutive == counters[b] for a in tree.attempts if a.round == r)
            new = [sum(nd.kind != "root" and nd.round_created == r + 1 for nd in t.nodes) for t in out.trees]
            if any(new):
                counters = [c + 1 if k else 0 for c, k in zip(counters, new)]


# -------------------------------------------------------------------------- end to end with the real tools
@pytest.fixture(scope="module")
def python_tool():
    from arpo_jax.tools import make_tool

    root = tempfile.mkdtemp(prefix="arpo_loop_test_")
    os.chmod(root, 0o755)  # the sandbox's private uid must reach its workdir
    tool = make_tool("python", timeout_s=20.0, pool=False, preload_modules=(), tmp_root=root)
    yield tool
    tool.close()


def _agent_script(call):
    """A 'model' that computes with Python, then searches, then answers from both results."""
    ctx = call.context.split("<|im_start|>assistant\n")[-1]
    results = [part.split("\n</result>")[0] for part in ctx.split("<result>\n")[1:]]
    if not results:
        return Segment("<think> compute first </think> <python>\nimport math\nprint(math.factorial(5) // 2)\n</python>")
    if len(results) == 1:
        return Segment(f"<think> got {results[0]} </think> <search> capital of France </search>")
    city = "Paris" if "Paris" in results[1] else "unknown"
    return Segment(f"<answer> {results[0]} {city} </answer>", eos=True)


@pytest.mark.parametrize("backend", ["cache", "local"])
def test_end_to_end_with_real_tools(tok, tmp_path, python_tool, backend):
    from arpo_jax.tools import ExecutorConfig, ToolExecutor, make_tool

    if backend == "cache":
        cache = tmp_path / "cache.json"
        cache.write_text('{"capital of France": "Page 1: Paris is the capital of France."}', encoding="utf-8")
        search = make_tool("search", backend="cache", cache_file=str(cache))
    else:
        search = make_tool("search", backend="local", documents=["Paris is the capital of France.",
                                                                 "Python is a programming language."],
                           max_results=1)
    expected_search = search.execute("capital of France")
    executor = ToolExecutor([python_tool, search], ExecutorConfig(max_workers=4, retry_count=1))
    try:
        messages = [{"role": "user", "content": "What is 5!/2, and the capital of France?"}]
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts = [tok.encode(prompt, add_special_tokens=False)] * 2
        cfg = RolloutConfig(n=3, initial_rollouts=2, beam_size=2, response_length=300, call_limit=3)
        sampler = ScriptedSampler(tok, _agent_script)
        out = rollout(prompts, sampler, executor, tok, cfg, SamplingSettings(), 0)
    finally:
        executor.close(close_tools=False)
    assert out.input_ids.shape[0] == 6
    for i in range(6):
        text = _response(out, tok, i)
        assert " <result>\n60\n</result>" in text
        assert f" <result>\n{expected_search}\n</result>" in text and "Paris" in expected_search
        assert text.endswith("<answer> 60 Paris </answer><|im_end|>") and out.finish_reason[i] == "eos"
        assert out.tool_calls[i] == 2
        # Tool-result tokens are exactly the loss-mask zeros.
        L = out.response_length[i]
        zeros = int((out.loss_mask[i, :L] == 0).sum())
        n_result = len(encode_tool_result(tok, "60")) + len(encode_tool_result(tok, expected_search))
        assert zeros == n_result
    assert out.metrics["rollout/tool_calls"] >= 4 and executor.metrics()["tools/python/successes"] >= 2
