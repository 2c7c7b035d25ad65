"""The trainer's rollout phase on the toy config (in-process, 2 fake devices): failure isolation and DAPO.

Failures are injected into a real run through real components: the real `ToolExecutor` runs a `python` tool that
raises (a broken sandbox), and the real JAX sampler is wrapped so that one request per rollout is rejected (an
engine error) and one trajectory writes a tool call (the tiny random policy never calls a tool by itself).
"""

from pathlib import Path

import jax
import numpy as np
import pytest

from arpo_jax import testing
from arpo_jax.assemble.components import pack_config, shaping_config
from arpo_jax.config import args
from arpo_jax.data import rl_dataset
from arpo_jax.experience import advantages as advantages_lib
from arpo_jax.experience import global_batch, packing
from arpo_jax.experience import reward as reward_lib
from arpo_jax.experience import reward as shaping
from arpo_jax.rollout.sampler import Sampler, SampleResult
from arpo_jax.tools import Tool
from arpo_jax.train import metrics
from arpo_jax.train import trainer as trainer_lib

REPO = Path(__file__).resolve().parents[1]
TEXT_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": (sum(map(ord, solution_str)) % 97) / 97.0}
'''
# Odd-indexed prompts: a text-dependent score; even-indexed ones: always 0 (a group with no signal).
HALF_CONSTANT_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": (sum(map(ord, solution_str)) % 97) / 97.0 if extra_info["index"] % 2 else 0.0}
'''
CRASH_CALL = "<python> crash </python>"


def _config(tmp_path: Path, reward: str, *overrides: str):
    path = tmp_path / "reward.py"
    path.write_text(reward)
    return args.load_config([
        "--config=builtin:toy_cpu", f"--config.reward.custom_path={path}",
        "--config.trainer.progress=false", "--config.trainer.loggers=('jsonl',)", *overrides])


class BrokenPython(Tool):
    tag = "python"

    def __init__(self):
        self.calls = 0

    def execute(self, content):
        self.calls += 1
        raise OSError("sandbox zygote died")


class InjectingSampler(Sampler):
    """The real sampler, except: slot 1's requests are rejected, and slot 0's first request writes CRASH_CALL."""

    def __init__(self, inner, tokenizer):
        self.inner, self.tok = inner, tokenizer
        self.rejected = 0

    def generate(self, requests, settings):
        if any(r.slot_id == 1 for r in requests):
            self.rejected += 1
            raise RuntimeError("engine rejected the request of slot 1")
        results = self.inner.generate(requests, settings)
        for i, r in enumerate(requests):
            if r.slot_id == 0 and "crash" not in self.tok.decode(list(r.token_ids)):
                ids = self.tok.encode(CRASH_CALL, add_special_tokens=False)
                results[i] = SampleResult(ids, CRASH_CALL.removesuffix("</python>"), "stop", "</python>",
                                          results[i].top_logprobs[:len(ids)])
        return results

    def reset_cache(self):
        self.inner.reset_cache()

    def update_weights(self, params):
        return self.inner.update_weights(params)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


@pytest.mark.slow  # trainer runs
def test_injected_tool_and_engine_failures_are_masked_and_counted(tmp_path):
    # The round schedule: its batched calls are what the engine's bisection counts below (the stream's recovery
    # from an engine error is test_rollout_failures').
    cfg = _config(tmp_path, TEXT_REWARD, "--config.trainer.max_steps=1", "--config.tools.retry_count=2",
                  "--config.rollout.schedule=rounds")
    tr = trainer_lib.Trainer(cfg, tmp_path / "run", testing.trainer_devices())
    try:
        tr.executor.tools["python"].close()
        tr.executor.tools["python"] = broken = BrokenPython()
        tr.sampler = InjectingSampler(tr.sampler, tr.tokenizer)
        seen = []
        advantages = tr._advantages
        tr._advantages = lambda trajs: seen.append(trajs) or advantages(trajs)
        summary = tr.run()
        p1 = _leaves(tr.state.params)

        assert summary["steps"] == 1 and broken.calls == 2  # one failing call, retried once
        assert tr.sampler.rejected == 4  # round 0's batch of 8, its first half, then [slot 0, slot 1], [slot 1]
        records = metrics.read_jsonl(tmp_path / "run" / "metrics.jsonl")
        for r in records:
            assert r["rollout/failed"] == 2 and r["rollout/failed_fraction"] == 2 / 16
            assert r["rollout/failed/tool_error"] == 1 and r["rollout/failed/engine_error"] == 1
            assert r["rollout/failed/tool_timeout"] == r["rollout/failed/wall_budget"] == 0
            assert r["rollout/step_skipped"] == 0 and r["actor/grad_norm"] > 0
        assert len(seen) == 2  # the warm-up's stand-in rollout (its advantages' eager ops compiled), then the step's
        for trajs in seen[1:]:
            t = trajs[0]
            assert list(t.out.failed[:2]) == ["tool_error", "engine_error"] and not t.failed[2:].any()
            assert t.out.finish_reason[1] == "engine_error" and t.out.response_length[1] == 0
            assert "execution failed with message: OSError: sandbox zygote died" in t.responses[0]
            # Masked: no loss token, no loss weight in the packed batch; every other trajectory trains.
            assert not t.loss_masks[0].any() and not t.loss_masks[1].any()
            assert all(m.any() for m in t.loss_masks[2:])
            layout = global_batch.layout(t, pack_config(cfg), mini_prompts=2, rows=tr.batches.rows_per_worker,
                                       row_len=tr.batches.row_len)
            adv = advantages_lib.outcome_advantages(t, cfg.algorithm.adv_estimator)
            batch = global_batch.worker_batch(t, {"advantages": adv}, layout, pack_config(cfg))
            for i in range(len(t.sequences)):
                k, m, b, sl = layout.slots(i)
                assert (batch["loss_weight"][k, m, b, sl].sum() > 0) == (i >= 2)
            # The failed rows are out of their group's baseline: the others' GRPO advantages are over rows 2, 3.
            adv = packing.unpack(layout, batch["advantages"])
            s = t.scores[2:4]
            np.testing.assert_allclose([adv[2][-1], adv[3][-1]], (s - s.mean()) / (s.std(ddof=1) + 1e-6), rtol=1e-5)

        # More failures than rollout.failures.max_fraction: the step is skipped (params unchanged) and logged.
        tr.failures.max_fraction = 0.1
        tr.total_steps = 2
        out = tr.train_step()
        assert out["rollout/step_skipped"] == 1 and "actor/grad_norm" not in out and tr.step == 2
        assert all(np.array_equal(a, b) for a, b in zip(p1, _leaves(tr.state.params)))
        tr.failures.max_skipped_steps = 3  # the third such step in a row stops the run
        failed = np.concatenate([t.failed for t in seen[1].values()]).astype(np.float32)
        assert tr.failures.skip(failed, 3) and tr.failures.skipped_in_a_row == 2
        with pytest.raises(RuntimeError, match="3 steps in a row"):
            tr.failures.skip(failed, 4)
    finally:
        tr.close()


@pytest.mark.slow  # trainer runs
def test_dynamic_sampling_and_overlong_handling(tmp_path):
    cfg = _config(tmp_path, HALF_CONSTANT_REWARD, "--config.trainer.max_steps=1",
                  "--config.algorithm.dynamic_sampling=true", "--config.algorithm.max_extra_rounds=3",
                  "--config.algorithm.overlong=mask", "--config.rollout.workers=2")
    tr = trainer_lib.Trainer(cfg, tmp_path / "run", testing.trainer_devices())
    try:
        rollouts = []
        roll = tr._rollout
        tr._rollout = lambda ex, w, **kw: rollouts.append((ex, w, kw)) or roll(ex, w, **kw)
        seen = []
        advantages = tr._advantages
        tr._advantages = lambda trajs: seen.append(trajs) or advantages(trajs)
        tr.run()
        record = metrics.read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
        # Odd-indexed prompts are the informative groups. Each of the 2 workers needs 2 of them: it draws its share
        # of the next batches until it has them, while the other worker may go on (at most 3 extra batches).
        rounds, odd, drawn, filled = [], 0, 0, 0
        assert len(seen) == 2  # the warm-up's stand-in rollout (its advantages' eager ops compiled), then the step's
        for w, t in seen[1].items():
            mine = [(ex, kw.get("extra_round", 0)) for ex, w_, kw in rollouts if w_ == w]
            per_batch = [sum(e.extra_info["index"] % 2 for e in ex) for ex, _ in mine]
            assert [r for _, r in mine] == list(range(len(mine)))  # consecutive batches of the stream
            assert sum(per_batch[:-1]) < 2 <= sum(per_batch) or len(mine) == 4  # stopped once full
            rounds.append(len(mine))
            odd, drawn, filled = odd + sum(per_batch), drawn + 2 * len(mine), filled + max(0, 2 - sum(per_batch))
            first_odd = [e for ex, _ in mine for e in ex if e.extra_info["index"] % 2][:2]
            assert len(t.sequences) == 8 and list(t.group) == [g for g in range(2) for _ in range(4)]
            for g, e in enumerate(first_odd):  # the batch: the first informative groups, in draw order
                for i in range(4 * g, 4 * g + 4):
                    np.testing.assert_array_equal(t.sequences[i][:t.prompt_lengths[i]], e.prompt_ids)
            _, informative = shaping.informative_groups(t.scores, t.group)
            assert informative.sum() == len(first_odd)
        assert max(rounds) >= 2  # the test needs at least one extra batch
        assert record["dynamic_sampling/extra_rounds"] == max(rounds) - 1
        assert record["dynamic_sampling/kept_fraction"] == odd / drawn
        assert record["dynamic_sampling/filled_groups"] == filled
        assert tr.position.to_dict() == {"epoch": 0, "step_in_epoch": max(rounds)}  # the batches used up
        # overlong = mask: responses that did not end within R are out of the loss (and still in the baseline).
        cut = np.concatenate([t.out.finish_reason == "length" for t in seen[1].values()])
        assert 0 < cut.sum() < len(cut) and record["response/overlong_masked_fraction"] == cut.mean()
        assert all(m.any() != c for m, c in zip([m for t in seen[1].values() for m in t.loss_masks], cut))
        # overlong = penalty on the same rollout: the score is the reward plus 0.5 * min(0, (128 - buf - length) / buf),
        # with the buffer starting at the shortest response (so some responses are penalised and some are not).
        t = max(seen[1].values(), key=lambda t: len(set(t.out.response_length)))
        length = t.out.response_length.astype(np.float64)
        buf = 128 - int(length.min())
        penalty = _config(tmp_path, HALF_CONSTANT_REWARD, "--config.algorithm.overlong=penalty",
                          f"--config.algorithm.overlong_buffer_len={buf}",
                          "--config.algorithm.overlong_penalty_factor=0.5")
        shaped = reward_lib.shape_rollout(t, shaping_config(penalty))
        np.testing.assert_allclose(shaped.scores, t.scores + 0.5 * np.minimum(0.0, (128 - buf - length) / buf),
                                   atol=1e-6)
        assert (shaped.scores < t.scores).any() and (shaped.scores == t.scores).any()
        # Without trainer.max_steps the run ends after total_epochs of data, whatever the step count.
        tr.cfg.trainer.max_steps, tr.total_steps = 0, 10**6
        assert not tr._done()
        tr.position = rl_dataset.DataPosition(cfg.trainer.total_epochs, 0)
        assert tr._done()
    finally:
        tr.close()
