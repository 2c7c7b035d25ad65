"""Cold-start SFT of Qwen2.5-7B-Instruct before ARPO/AEPO (spec 11.3, `LLaMA-Factory/arpo_train_sft/yaml/qwen.yaml`).

Full fine-tuning on 8 GPUs: cutoff 15000 tokens, lr 7e-6, 3 epochs, cosine with 10% warmup, bf16 compute; the
reference's per-device batch 1 x gradient accumulation 2 x 8 GPUs = 16 examples per optimizer step. Put the
cold-start conversations (ShareGPT `conversations` or OpenAI `messages`, JSON / JSON lines / parquet) at
`$ARPO_DATA/sft/arpo_sft.json`, or override `--config.sft.train_files=<file>`.
Run: `arpo-jax sft --config=builtin:sft_qwen25_7b --workdir=runs/sft_7b`; then start RL from it with
`--config.model.init_checkpoint=runs/sft_7b/checkpoints`.
"""

from arpo_jax.config.schema import get_config as base_config


def get_config():
    c = base_config()
    c.model.path = "${ARPO_MODELS}/Qwen2.5-7B-Instruct"
    c.model.dtype = "bfloat16"
    c.model.remat = "full"  # 15k-token examples
    c.mesh.shape = (1, 8, 1)
    c.mesh.rules = "fsdp"
    c.mesh.device = "a100-80gb"

    c.sft.train_files = ("${ARPO_DATA}/sft/arpo_sft.json",)
    c.sft.val_files = ()
    c.sft.cutoff_len = 15000
    c.sft.epochs = 3
    c.sft.lr = 7e-6
    c.sft.schedule = "cosine"
    c.sft.warmup_ratio = 0.1
    c.sft.weight_decay = 0.0
    c.sft.batch_size = 16
    c.sft.max_token_len_per_device = 0  # = cutoff_len: one full-length example per device per micro-batch
    c.sft.save_freq = 0  # once per epoch
    c.trainer.experiment = "sft_qwen25_7b"
    return c
