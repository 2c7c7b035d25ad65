"""AEPO, Qwen3-14B deep research on one node of 8 x 80 GB GPUs: `aepo_qwen3_14b` with the split placement of
`arpo_qwen3_14b_deepsearch_8x80gb` (3 GPUs for the vLLM engines, 5 for the trainer; that file says why)."""

from arpo_jax.config.experiments import experiment

aepo_config = experiment("aepo_qwen3_14b").get_config
on_8x80gb = experiment("arpo_qwen3_14b_deepsearch_8x80gb").on_8x80gb


def get_config():
    c = on_8x80gb(aepo_config())
    c.trainer.experiment = "aepo_qwen3_14b_8x80gb"
    return c
