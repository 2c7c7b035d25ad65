"""Rollout / trainer mismatch with the JAX engine: the same model code on both sides, so the mismatch reads ~0.

The sampler's log-prob of each token it sampled (`SamplingSettings.token_logprobs`) against the trainer's old
log-probs of the same tokens (the packed, chunked, fused-head forward of `train_step`), through
`algos.rollout_correction` as the train step uses it. The maths of the correction is tested by hand in
test_algos.py and inside the step in test_train_step.py.
"""

import numpy as np

import arpo_jax
from arpo_jax import testing
from arpo_jax.experience import packing
from arpo_jax.rollout.jax_sampler import JaxSampler
from arpo_jax.rollout.sampler import SampleRequest, SamplingSettings
from arpo_jax.update import algos, jit
from arpo_jax.update import train_step as ts


def test_jax_engine_and_trainer_logprobs_agree(tiny_hf_dir):
    temperature = 0.7  # both sides divide the logits by it
    path, _ = tiny_hf_dir("qwen2")
    model = arpo_jax.from_pretrained(path)
    # The tiny model's vocabulary (512) is larger than the tokenizer's (406); the trainer's log-softmax runs over
    # the model's, so the sampler must too for the two distributions to be the same.
    sampler = JaxSampler(model, testing.make_tiny_tokenizer(), max_len=64, decode_chunk=8,
                         restrict_to_tokenizer=False)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(3, 400, n).tolist() for n in (5, 11, 7, 9)]
    settings = SamplingSettings(temperature=temperature, stop=(), logprobs=0, seed=3, token_logprobs=True)
    results = sampler.generate([SampleRequest(p, 20) for p in prompts], settings)
    assert all(len(r.token_logprobs) == len(r.token_ids) > 0 for r in results)
    assert sampler.generate([SampleRequest(prompts[0], 4)], SamplingSettings(stop=()))[0].token_logprobs is None

    seqs = [np.asarray(p + r.token_ids) for p, r in zip(prompts, results)]
    masks = [np.r_[np.zeros(len(p)), np.ones(len(r.token_ids))] for p, r in zip(prompts, results)]
    rollout = [np.r_[np.full(len(p), np.nan), r.token_logprobs] for p, r in zip(prompts, results)]
    batch, layout = packing.pack_batch(seqs, masks, np.zeros(len(seqs)), mini_batch_size=len(seqs), row_len=64,
                                       rows_per_micro=2, extra={"rollout_logp": rollout})
    graphdef, params = jit.split_model(model)
    old, _ = ts.jit_forward_logprobs(graphdef, model.config, temperature=temperature)(params, batch)
    has = (batch["loss_weight"] > 0) & np.isfinite(batch["rollout_logp"])
    _, keep, m = algos.rollout_correction(np.asarray(old), np.where(has, batch["rollout_logp"], 0.0), has,
                                          mode="mask", segment_ids=batch["segment_ids"])
    assert float(m["tokens"]) == sum(len(r.token_ids) for r in results)
    assert float(m["abs_logp_diff_max"]) < 1e-4, float(m["abs_logp_diff_max"])
    assert abs(float(m["kl"])) < 1e-5 and float(m["masked_fraction"]) == 0 and bool(keep.all())
