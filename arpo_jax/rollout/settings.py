"""The rollout's settings: `RolloutConfig` (its config knobs, spec 4.2 and 11.3), the state a worker keeps across
calls (`RolloutState`), validation's greedy sampling. `agent_loop.rollout` runs them."""

from __future__ import annotations

import dataclasses

from arpo_jax import knobs
from arpo_jax.rollout.branching import EntropyBaselines
from arpo_jax.rollout.sampler import SamplingSettings

RULES = ("arpo", "aepo")  # rollout.rule: ARPO's branching (4.2), AEPO's consecutive-branch penalty (5.2)
SCHEDULES = ("stream", "rounds")  # rollout.schedule (module docstring)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Static rollout settings (spec 4.2 and 11.3; script values: n 16, m 8, beam 2, p 0.5, w 0.2).

    Each ``knob`` field is the config field it names (default and meaning: arpo_jax/config/schema.py) under its rule;
    ``components.rollout_config`` builds this from an experiment config."""

    n: int = knobs.knob("rollout.n", knobs.at_least(1))
    initial_rollouts: int = knobs.knob("rollout.initial_rollouts", knobs.at_least(1))
    beam_size: int = knobs.knob("rollout.beam_size", knobs.at_least(1))
    branch_probability: float = knobs.knob("rollout.branch_probability", knobs.UNIT)  # (see B3 for AEPO)
    entropy_weight: float = knobs.knob("rollout.entropy_weight")
    rule: str = knobs.knob("rollout.rule", knobs.one_of(RULES))
    consecutive_penalty: float = knobs.knob("rollout.consecutive_penalty", knobs.NONNEG)
    enable_dynamic_rollouts: bool = knobs.knob("rollout.enable_dynamic_rollouts")
    initial_entropy_tokens: int = knobs.knob("rollout.initial_entropy_tokens", knobs.at_least(1))
    dynamic_beta: float = knobs.knob("rollout.dynamic_beta")
    call_limit: int = knobs.knob("tools.call_limit", knobs.NONNEG)
    response_length: int = knobs.knob("data.max_response_length", knobs.POSITIVE)  # R
    prompt_length: int | None = None  # P: left-padded prompt width (None: longest prompt of the batch)
    max_model_len: int | None = None  # pre-monitoring guards (5.1); None: P + R
    entropy_window: int = knobs.knob("rollout.entropy_window", knobs.at_least(1))
    # Top log-probs per position requested from the engine; 0 (no entropy) is for validation only, so the config's
    # ">= 1" is config.py's rule.
    entropy_top_k: int = knobs.knob("rollout.entropy_top_k")
    entropy_reduce: str = "sum"  # "sum" over positions (reference) or "mean"
    reference_compat: bool = knobs.knob("rollout.reference_compat")  # B1, B3, B4, B10, B11 (module docstring)
    isolate_failures: bool = knobs.knob("rollout.failures.isolate")  # mark failed trajectories instead of raising
    # Wall budget per trajectory from its creation; 0 = none (needs isolation)
    trajectory_timeout_s: float = knobs.knob("rollout.failures.trajectory_timeout_s",
                                             knobs.Rule(lambda v: v >= 0, "0 (none) or seconds"))
    schedule: str = knobs.knob("rollout.schedule", knobs.one_of(SCHEDULES))
    speculate: bool = knobs.knob("rollout.speculate")  # the stream starts refills and branches before they commit

    def __post_init__(self):
        knobs.validate(self)
        knobs.one_of(("sum", "mean")).enforce("RolloutConfig.entropy_reduce", self.entropy_reduce)
        if self.trajectory_timeout_s and not self.isolate_failures:
            raise ValueError("RolloutConfig: trajectory_timeout_s needs isolate_failures")

    def for_validation(self, n: int = 1) -> RolloutConfig:
        """Spec 3.1 validation: no branching, `n` independent samples per prompt (1 in the reference)."""
        return dataclasses.replace(self, n=n, initial_rollouts=n, beam_size=1, enable_dynamic_rollouts=False)


def greedy_settings(settings: SamplingSettings) -> SamplingSettings:
    """Spec 3.1 `do_sample=False`: temperature 0, top_p 1, top_k off."""
    return dataclasses.replace(settings, temperature=0.0, top_p=1.0, top_k=-1)


@dataclasses.dataclass
class RolloutState:
    """State a rollout worker keeps across calls: only the reference's stale entropy dict (B1, compat mode)."""

    baselines: EntropyBaselines = dataclasses.field(default_factory=EntropyBaselines)
