"""The engine-agnostic multi-turn tool rollout with ARPO branching / AEPO dynamic rollouts (spec sections 3-5).

`rollout(prompts, sampler, executor, tokenizer, config, settings, rng)` returns exactly n trajectories per prompt.
The round algorithm is the definition of what is sampled: each round, every active trajectory generates one segment
(until a tool closer, EOS or its own remaining budget, 3.3.1); its entropy (4.1); tool calls detected by the
matched stop string, the call limit (the extra call appends EOS, mask 1), empty tool content (the trajectory ends
silently); the calls executed, results appended as `" <result>\\n{text}\\n</result>"` with loss-mask 0; then
branching (ARPO 4.2 / AEPO 5.2) and the refill rule (4.3). The output (`rollout/output.py`) is padded numpy arrays
(3.4) plus per-trajectory metadata, branching trees and metrics.

Two schedules run it (`RolloutConfig.schedule`), with the same trajectories under the same seed:
* "stream" (default, `streaming.py`): no trajectory waits for another. A continuation re-enters the engine as soon as
  its own tool result is back, a branch forks from its parent's cached row as soon as its deciding entropy exists,
  refills start speculatively in rows nobody needs, and the round algorithm's decisions are replayed over logical
  rounds (`replay.py`) as their inputs arrive, committing or cancelling what was started early.
* "rounds": one batched engine call a round, every tool result of the round awaited, then the decisions: the
  algorithm as written, kept as the reference the stream is tested against.
What makes them agree: every draw is named by what it is for (`identity.py`: a trajectory's tokens by its place in its
prompt's tree and its context, a branching attempt's uniform by the attempt), so no sample depends on which call,
row or thread made it; and each request's budget is its own remaining one (R - response length) where the reference
gives a round's requests the largest of theirs: a request near its budget no longer generates tokens past R (which
the reference cuts at the end), so a tool call closed past R is no longer run and the entropy of a segment cut at R
is that of its kept tokens.

`RolloutConfig.reference_compat` (default False = the intended algorithm), quirk by quirk (spec section 14):

* B1 entropy baseline. Default: H_init is the trajectory's own first-segment entropy, reset every call; a branch
  inherits its parent's (it shares that first segment). Compat: a slot-id keyed dict that the caller keeps in
  `RolloutState` across calls, so from the second call on slots compare against another prompt's entropy.
* B3 AEPO's `p`. Default: the AEPO formula gets `1 - p`, so a larger p means more branching, as in ARPO (P = p + w*dH
  at f = 1). Compat: the configured p as is (inverted meaning). Identical at p = 0.5.
* B4 which segment decides. Default: a trajectory that appended its own tool result decides with the entropy of the
  segment it generated right after that result (the paper's "k tokens after the tool call"); its branch copies the
  state right after the tool result and re-samples that segment. Compat: trajectories still active after this
  round's tools decide with the entropy of the segment *before* the tool call, and the branch copies the state
  after the result.
* B10 tool content. Default: `<tag>` and `</tag>` must both lie in the segment just generated (else the content is
  empty and the trajectory ends). Compat: last `<tag>` before the last `</tag>` of the whole decoded prompt + response.
* B10 attention. Default: response attention = real tokens up to and including the first EOS (padding 0). Compat:
  `get_response_mask`, where the padding of a response without EOS also gets 1.
* B11 tool text. Default: encoded with no special tokens added and special-token strings split as plain text.
  Compat: `tokenizer.encode(text)` (a BOS for Llama; `<|im_end|>` inside a result becomes EOS and cuts attention).

Both modes: the entropy is the spec's sum over <= 20 positions (`entropy_reduce="mean"` exists) and the AEPO
consecutive counter is per prompt and counts refills (B6).

Failure isolation (`RolloutConfig.isolate_failures`, not in the reference): a trajectory is marked failed
(`RolloutOutput.failed` names the cause) when one of its tool calls fails (`tool_error`, `tool_timeout`: the executor
gave up; it still sees the error text and goes on, as in the reference), when its engine request raises
(`engine_error`: `BisectingSampler` retries a failed batch in halves, recursively, so only a request that raises on
its own fails; the trajectory ends there), or when it runs longer than `trajectory_timeout_s` from its creation
(`wall_budget`: it ends after its segment). A failed trajectory is never a branching source; the trainer masks it
out of the loss. Without isolation an engine error propagates, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from arpo_jax.rollout.bisecting_sampler import BisectingSampler
from arpo_jax.rollout.output import RolloutOutput
from arpo_jax.rollout.rounds import PREMONITOR_SLOT_BASE, Loop
from arpo_jax.rollout.sampler import Sampler, SamplingSettings
from arpo_jax.rollout.settings import RULES, SCHEDULES, RolloutConfig, RolloutState, greedy_settings
from arpo_jax.rollout.streaming import run_stream
from arpo_jax.rollout.tool_calls import Executor, encode_tool_result, extract_tool_content, wrap_tool_result

__all__ = ["PREMONITOR_SLOT_BASE", "RULES", "SCHEDULES", "RolloutConfig", "RolloutState", "encode_tool_result",
           "extract_tool_content", "greedy_settings", "rollout", "wrap_tool_result"]


def rollout(prompts_token_ids: Sequence[Sequence[int]], sampler: Sampler, executor: Executor, tokenizer,
            config: RolloutConfig, settings: SamplingSettings | None = None,
            rng: np.random.Generator | int = 0, *, state: RolloutState | None = None) -> RolloutOutput:
    """Runs the tool rollout for a batch of (unpadded) prompts; returns exactly n trajectories per prompt.

    `rng` seeds every branching draw (one number is taken from it; an int seeds a fresh generator); the engine's own
    sampling randomness comes from `settings.seed`. `state` matters only with `reference_compat` (B1); keep one per
    worker.

    `settings` gives the sampling distribution, the seed and `token_logprobs`; the loop owns the fields that follow
    from its own inputs and sets them whatever the caller passed: `stop` (the executor's closing tags, which is how
    a tool call is detected) and `logprobs` / `logprob_positions` (the entropy's top-k and window, `config`).
    """
    rng = np.random.default_rng(rng) if not isinstance(rng, np.random.Generator) else rng
    settings = settings or SamplingSettings()
    engine = sampler
    if config.isolate_failures:  # an engine error fails only the requests that raise on their own
        sampler = BisectingSampler(sampler)
    loop = Loop(prompts_token_ids, sampler, executor, tokenizer, config, settings, int(rng.integers(2 ** 63)),
                state or RolloutState())
    if config.schedule == "rounds":
        return loop.run_rounds()
    return run_stream(loop, engine)
