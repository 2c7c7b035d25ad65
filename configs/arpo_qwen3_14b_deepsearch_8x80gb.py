"""ARPO, Qwen3-14B, deep search on one node of 8 x 80 GB GPUs (A100-80GB or H100; `--config.mesh.device=h100-80gb`):
the reference's own node for `ARPO/scripts/ARPO_14b_Deepsearch_1node.sh`, which `arpo_qwen3_14b_deepsearch` (vLLM
beside JAX on every GPU) fits only on 141 GB GPUs.

Beside a resident vLLM engine the update does not fit an 80 GB GPU: it peaks at 49 GiB per GPU over 8 (`arpo-jax
plan`) and the engine's bf16 weights are 27.5 GiB more. So the GPUs are split (rollout.vllm.placement, rollout/
placement.py): the last 3 run one engine each with 0.9 of the GPU (the weights and a KV cache of up to 44 GiB), and
the trainer's mesh spans the other 5 with their whole memory: the float32 params, AdamW moments and gradient buffers
(20 bytes a parameter: 55 GiB a GPU over 5) and the activations of 8192 tokens per device, one full-length
trajectory (on an H100, 9216 would leave JAX's pool 8.5% headroom once 2% of the GPU stays out of it for what the
plan's reserve does not itemise, `plan/memory_model.MARGIN`). Five, because FSDP splits every weight along the
hidden size (5120): 6 would leave them whole on every GPU, and over 4 the state alone is 69 GiB a GPU.

Same algorithm, data and batch as the 141 GB config (64 x 12, mini-batch 8, P 2000, R 6192); more micro-batches.
`--config.rollout.max_staleness=1` lets the engines generate step k+1's rollout while the trainer updates step k
(one step off-policy, corrected by actor.rollout_correction); the default stays the reference's synchronous loop.
"""

from arpo_jax.config.experiments import experiment

deepsearch_config = experiment("arpo_qwen3_14b_deepsearch").get_config


def on_8x80gb(c):
    """The split placement of a 14B config on one node of 8 x 80 GB GPUs (shared with the AEPO variant)."""
    c.mesh.shape = (1, 5, 1)
    c.mesh.device = "a100-80gb"
    c.rollout.vllm.placement = "split"
    c.rollout.vllm.engine_gpus = 3
    c.rollout.vllm.gpu_memory_utilization = 0.9  # of each engine GPU (vLLM's default); nothing else runs there
    c.actor.max_token_len_per_device = 8192  # one full-length trajectory (P 2000 + R 6192); see the docstring
    return c


def get_config():
    c = on_8x80gb(deepsearch_config())
    c.trainer.experiment = "arpo_qwen3_14b_deepsearch_8x80gb"
    return c
