"""Rollout: sampler engines behind one interface, the multi-turn tool loop, ARPO/AEPO branching."""

from arpo_jax.rollout.agent_loop import RolloutConfig, rollout
from arpo_jax.rollout.output import RolloutOutput
from arpo_jax.rollout.sampler import FinishReason, Sampler, SampleRequest, SampleResult, SamplingSettings

__all__ = ["FinishReason", "RolloutConfig", "RolloutOutput", "SampleRequest", "SampleResult", "Sampler",
           "SamplingSettings", "rollout"]
