"""AEPO, Qwen2.5-7B-Instruct: `AEPO/scripts/AEPO_Qwen25_7B_DeepResearch.sh` with the AEPO `ppo_trainer.yaml`.

The ARPO reasoning setup (same data, batch, P/R, n/m/beam/p/w, 8 GPUs) plus AEPO: the consecutive-branch penalty
in the rollout (spec 5.2), entropy-balanced clipping (10.1) and entropy-aware advantages (10.2). The script turns
dynamic rollouts (5.1) off. AEPO yaml tools: call_limit 6, 32 workers, 4 attempts.
"""

from arpo_jax.config.experiments import experiment

arpo_config = experiment("arpo_qwen25_7b_reasoning").get_config


def set_aepo(c):
    """The AEPO switches shared by both AEPO scripts (flags dyn/clip/adv = False/True/True)."""
    c.rollout.rule = "aepo"
    c.rollout.enable_dynamic_rollouts = False
    c.actor.loss = "aepo"  # entropy-balanced clipping
    c.actor.entropy_adv = True  # entropy-aware advantages
    c.tools.call_limit = 6
    c.tools.max_workers = 32
    c.tools.retry_count = 4
    return c


def get_config():
    c = set_aepo(arpo_config())
    c.trainer.experiment = "aepo_qwen25_7b"
    return c
