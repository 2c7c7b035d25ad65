"""A rollout engine over a transformers (PyTorch) model: proof that an exported policy runs outside JAX.

One request at a time through `model.generate` (no KV cache kept across calls, no batching): meant for reloading
an export and answering a few questions with real tools (`arpo-jax demo`), not for training throughput. Stop strings
are transformers' own `stop_strings` criterion; the result follows the `Sampler` contract: the stop string's tokens
kept in `token_ids`, removed from `text`. No top-k log-probs are returned (only ARPO's branching needs them).
"""

from __future__ import annotations

from collections.abc import Sequence

from arpo_jax.rollout.sampler import (
    Sampler,
    SampleRequest,
    SampleResult,
    SamplingSettings,
    finish_generation,
    request_seed,
    seed_index,
)


class TransformersSampler(Sampler):
    """`Sampler` over `AutoModelForCausalLM` + its tokenizer; greedy when `settings.temperature == 0`."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model.eval(), tokenizer
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        # Like the JAX and vLLM samplers: only ids the tokenizer knows (a model's vocab is often padded beyond them).
        self.suppress = list(range(len(tokenizer), model.config.vocab_size)) or None

    def generate(self, requests: Sequence[SampleRequest], settings: SamplingSettings) -> list[SampleResult]:
        import torch

        results = []
        for i, req in enumerate(requests):
            sample = settings.temperature > 0
            kwargs = dict(max_new_tokens=req.max_tokens, do_sample=sample, stop_strings=list(settings.stop) or None,
                          tokenizer=self.tokenizer, pad_token_id=self.tokenizer.pad_token_id,
                          suppress_tokens=self.suppress)
            if sample:
                torch.manual_seed(request_seed(settings.seed, seed_index(req, i), req.token_ids))
                kwargs |= dict(temperature=settings.temperature, top_p=settings.top_p,
                               top_k=settings.top_k if settings.top_k > 0 else None)
            else:
                kwargs |= dict(temperature=None, top_p=None, top_k=None)
            ids = torch.tensor([list(req.token_ids)], dtype=torch.long)
            with torch.no_grad():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            new = out[0, ids.shape[1]:].tolist()
            text = self.tokenizer.decode(new, skip_special_tokens=True)
            results.append(SampleResult(new, *finish_generation(text, new, settings.stop, self.eos_ids), []))
        return results

    def update_weights(self, params_or_path) -> float:
        raise NotImplementedError("TransformersSampler serves a fixed exported model; load a new one instead")
