"""AEPO, Qwen3-14B deep research: `AEPO/scripts/AEPO_Qwen3_14B_DeepResearch.sh` with the AEPO `ppo_trainer_dr.yaml`.

The ARPO 14B deep-search setup (64 x 12, mini 8, P 2000, R 6192, 5 epochs) with the AEPO switches of aepo_qwen25_7b.
"""

from arpo_jax.config.experiments import experiment

set_aepo = experiment("aepo_qwen25_7b").set_aepo
arpo_config = experiment("arpo_qwen3_14b_deepsearch").get_config


def get_config():
    c = set_aepo(arpo_config())
    c.trainer.experiment = "aepo_qwen3_14b"
    return c
