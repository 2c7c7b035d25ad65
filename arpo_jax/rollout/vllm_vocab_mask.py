"""A vLLM logits processor that keeps sampling inside the tokenizer's vocabulary (runs in vLLM's processes only).

Qwen's embedding matrix has more rows than its tokenizer has ids (152,064 vs 151,665 for Qwen2.5): the reference
samples only tokenizer ids ("fix oov error"). A per-request `allowed_token_ids` list does the same, but vLLM then
validates the 151k-int list in Python for every request and fills a mask row from it whenever the request enters
the batch. This processor builds one boolean row of the padding ids when the engine starts and masks the whole
batch's logits with it at every step: same place in vLLM's sampler (before penalties, temperature, top-k/top-p and
the processed log-probs), so the same samples and log-probs.

The vLLM worker names it by module (`vllm_vocab_mask:TokenizerVocabMask`): it imports vllm at the top, so the
arpo_jax package never imports it (the trainer's process has no vllm).
"""

from __future__ import annotations

import torch
from vllm.tokenizers import cached_tokenizer_from_config
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor


def padding_mask(tokenizer_ids, model_vocab: int) -> torch.Tensor | None:
    """[model_vocab] bool, True at the ids the tokenizer never produces; None when there are none."""
    mask = torch.ones(model_vocab, dtype=torch.bool)
    mask[torch.as_tensor(sorted(i for i in set(tokenizer_ids) if 0 <= i < model_vocab), dtype=torch.long)] = False
    return mask if bool(mask.any()) else None


class TokenizerVocabMask(LogitsProcessor):
    """-inf at every id of the model's vocabulary that the tokenizer lacks, for every request of the batch."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        model_config = vllm_config.model_config
        vocab = cached_tokenizer_from_config(model_config).get_vocab()
        mask = padding_mask(vocab.values(), model_config.get_vocab_size())
        self.mask = None if mask is None else mask.to(device)

    def is_argmax_invariant(self) -> bool:
        return self.mask is None  # masking changes greedy picks (a padding id may hold the largest logit)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Nothing per request: every request gets the same mask."""

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.mask is not None:
            logits.masked_fill_(self.mask, float("-inf"))  # [B, V] with the [V] row broadcast over the batch
        return logits
