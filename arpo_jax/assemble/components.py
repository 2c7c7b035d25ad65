"""Config -> components: the rollout engine, the tool executor, the sampling settings, the rollout config, the
packing and shaping settings and the update step's; and the training run's engine with the policy's weights
(`make_rollout_sampler`, `sync_weights`).

Training (`train/trainer.py`), evaluation and chat (`eval/`), the demo's transcript (`demo.py`) and the memory
plan (`plan/`) build these from an experiment config in one way, here, so a setting (a vLLM option, a tool
limit, a sampling parameter) means the same in every command.

    sampler = components.make_sampler(cfg, tokenizer, model=policy, mesh=mesh)   # cfg.rollout.engine = "jax"
    executor = components.make_tool_executor(cfg)
    settings = components.sampling_settings(cfg, seed)
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
from flax import nnx
from jax.sharding import Mesh

from arpo_jax import distributed, knobs, sharding
from arpo_jax.data import toy
from arpo_jax.data.prompts import REFERENCE_DATA_SYSTEM_PROMPT, SYSTEM_PROMPT, SYSTEM_PROMPTS
from arpo_jax.experience.packing import PackConfig
from arpo_jax.experience.reward import ShapingConfig
from arpo_jax.models import lora
from arpo_jax.rollout.agent_loop import RolloutConfig
from arpo_jax.rollout.jax_decode import decode_weights
from arpo_jax.rollout.sampler import CUDA_GRAPHS, ENGINES, Sampler, SamplingSettings
from arpo_jax.tools import ToolExecutor, make_executor
from arpo_jax.update import jit, machinery
from arpo_jax.update import train_step as ts


def make_mesh(cfg, devices=None) -> Mesh:
    """The config's ('data', 'fsdp', 'tensor') mesh over `devices` (default: every device of every process)."""
    return sharding.make_mesh(tuple(cfg.mesh.shape), devices)


def rollout_config(cfg) -> RolloutConfig:
    """The agent loop's settings (spec 3): its knobs (`rollout`, `tools.call_limit`, `data.max_response_length`)
    and the prompt width P."""
    return knobs.from_config(RolloutConfig, cfg, prompt_length=cfg.data.max_prompt_length)


def sampling_settings(cfg, seed: int) -> SamplingSettings:
    """`rollout`'s temperature / top-p / top-k and `seed`, with token log-probs (the rollout correction and its
    metrics). The stop strings and the entropy's log-probs are the agent loop's (`agent_loop.rollout` sets them
    from the executor and the rollout config), so they are not set here."""
    return knobs.from_config(SamplingSettings, cfg, seed=seed, token_logprobs=True)


def make_tool_executor(cfg) -> ToolExecutor:
    """The executor over the enabled tools; `builtin:toy` serves the toy tasks' fictional corpus offline."""
    t = cfg.tools
    tools = {}
    if t.python.enabled:
        tools["python"] = dict(timeout_s=t.python.timeout_s, memory_mb=t.python.memory_mb,
                               ready_sandboxes=t.python.ready_sandboxes,
                               **({"python_path": t.python.python_path} if t.python.python_path else {}))
    if t.search.enabled:
        s = t.search
        if s.backend == "local":
            params = ({"documents": toy.corpus()} if s.corpus_file == toy.BUILTIN else
                      {"corpus_file": os.path.expandvars(s.corpus_file)})
            params |= dict(max_results=s.max_results, result_length=s.result_length)
        elif s.backend == "cache":
            params = dict(cache_file=os.path.expandvars(s.cache_file))
        else:
            params = dict(api_key_env=s.api_key_env, zone=s.zone, location=s.location, max_results=s.max_results,
                          result_length=s.result_length, cache_file=os.path.expandvars(s.cache_file) or None)
        tools["search"] = dict(backend=s.backend, **params)
    return make_executor(tools, max_workers=t.max_workers, timeout_s=t.timeout_s, retry_count=t.retry_count)


def engine_kwargs(cfg, processes: int) -> dict:
    """`JaxSampler`'s settings from an experiment config (`rollout.jax`, `rollout.entropy_top_k`), `processes` the
    run's process count: `slots` = 0 means one rollout worker's trajectories (its prompts x rollout.n)."""
    j = cfg.rollout.jax
    workers = cfg.rollout.workers or processes
    slots = j.slots or max(1, cfg.data.train_batch_size // workers) * cfg.rollout.n
    return dict(slots=slots, decode_chunk=j.decode_chunk, prefill_chunk=j.prefill_chunk,
                max_tokens_per_call=j.max_tokens_per_call, layout=j.layout,
                max_logprobs=max(20, cfg.rollout.entropy_top_k), decode_rows=j.decode_rows,
                decode_lengths=j.decode_lengths, kv_dtype=j.kv_dtype)


def make_sampler(cfg, tokenizer, *, engine: str | None = None, model=None, mesh=None,
                 folder: str | os.PathLike | None = None, log_file: str | os.PathLike | None = None,
                 export_dir: str | os.PathLike | None = None, server: dict | None = None) -> Sampler:
    """The rollout engine `engine` (default `rollout.engine`), for contexts of up to prompt + response tokens.

    Args:
      cfg: the experiment config (`rollout.jax` / `rollout.vllm` settings, `data` lengths, `seed`).
      tokenizer: the policy's tokenizer.
      engine: "jax" (the KV-cache sampler over `model`, a CausalLM or its (graphdef, state), on `mesh`), "vllm" (a
        co-located vLLM serving the HF folder `folder`, its log in `log_file`, weight syncs exported to
        `rollout.vllm.export_dir` or else `export_dir`), "transformers" (the HF folder `folder` in PyTorch, float32)
        or "openai" (a server: `server` = OpenAISampler's arguments base_url, model and optional api_key_env,
        timeout_s, max_concurrency).
    """
    engine = engine or cfg.rollout.engine
    max_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    needs = {"jax": model, "vllm": folder, "transformers": folder, "openai": server}
    if engine not in needs:
        raise ValueError(f"rollout engine {engine!r}; allowed: {', '.join(ENGINES)}")
    if needs[engine] is None:
        what = {"jax": "model", "vllm": "folder", "transformers": "folder", "openai": "server"}[engine]
        raise ValueError(f"make_sampler(engine={engine!r}) needs `{what}`")
    if engine == "jax":
        import jax

        from arpo_jax.rollout.jax_sampler import JaxSampler, check_cache_fits

        sampler = JaxSampler(model, tokenizer, max_len=max_len, mesh=mesh, **engine_kwargs(cfg, jax.process_count()))
        check_cache_fits(sampler)
        return sampler
    if engine == "vllm":
        from arpo_jax.assemble import placement
        from arpo_jax.rollout.vllm_sampler import VllmSampler, engine_devices

        v = cfg.rollout.vllm
        gpus = placement.engine_gpus(cfg)  # the job's, or with placement=split the engines' share of them
        try:  # checked here, not in config.py: the GPU count is the host's
            engine_devices(v.engines or None, v.tensor_parallel_size, gpus)
        except ValueError as e:
            raise ValueError(f"rollout.vllm.engines={v.engines}, rollout.vllm.tensor_parallel_size="
                             f"{v.tensor_parallel_size}: {e}") from None
        return VllmSampler(folder, python=v.python or None, log_file=None if log_file is None else str(log_file),
                           export_dir=Path(os.path.expandvars(v.export_dir)) if v.export_dir else export_dir,
                           dtype=v.dtype, max_model_len=max_len, seed=cfg.seed,
                           enforce_eager=CUDA_GRAPHS[v.cuda_graphs],
                           gpu_memory_utilization=v.gpu_memory_utilization, cpu_kv_cache_gb=v.cpu_kv_cache_gb,
                           engines=v.engines or None, tensor_parallel_size=v.tensor_parallel_size, gpus=gpus,
                           # > 0: an engine with LoRA layers, and weight syncs send the adapters only
                           lora_rank=cfg.model.lora.rank if v.lora_sync == "adapters" else 0)
    if engine == "transformers":
        import torch
        from transformers import AutoModelForCausalLM

        from arpo_jax.rollout.hf_sampler import TransformersSampler

        return TransformersSampler(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), tokenizer)
    from arpo_jax.rollout.openai_sampler import OpenAISampler

    server = dict(server)
    return OpenAISampler(server.pop("base_url"), server.pop("model"), tokenizer, **server)


def process_log(path: str | os.PathLike, process_index: int, process_count: int) -> Path:
    """`path` for one process's engines: `vllm.log` in a one-process run, `vllm.p<i>.log` with several (each node's
    engines write their own log on the shared workdir, and errors quote the right node's lines)."""
    path = Path(path)
    if process_count == 1:
        return path
    return path.with_name(f"{path.stem}.p{process_index}{path.suffix}")


def rollout_correction_mode(cfg) -> str:
    """`actor.rollout_correction.mode` with "auto" resolved: truncate (TIS) for vLLM, off for the JAX engine (the
    trainer's own model code) unless its rollouts are off-policy (`rollout.max_staleness` > 0), off for vLLM at a
    temperature other than 1 (its log-probs are temperature 1's)."""
    mode = cfg.actor.rollout_correction.mode
    if mode == "auto":
        if cfg.rollout.engine == "vllm":
            return "truncate" if cfg.rollout.temperature == 1 else "off"
        return "truncate" if cfg.rollout.get("max_staleness", 0) > 0 else "off"
    return mode


def pack_config(cfg) -> PackConfig:
    """How the step's trajectories are packed: its knobs, the row length resolved (`actor.max_token_len_per_device`,
    0: twice the longest trajectory, P + R) and the longest trajectory (which fixes the batch's shapes)."""
    d = cfg.data
    max_len = d.max_prompt_length + d.max_response_length
    return knobs.from_config(PackConfig, cfg, row_len=cfg.actor.max_token_len_per_device or 2 * max_len,
                             max_len=max_len)


def shaping_config(cfg) -> ShapingConfig:
    return knobs.from_config(ShapingConfig, cfg)


def update_config(cfg) -> ts.UpdateConfig:
    """The jitted update step's settings: its knobs (`actor.*`, the rollout temperature of the log-probs) and the
    resolved rollout correction mode."""
    return knobs.from_config(ts.UpdateConfig, cfg, rollout_correction=rollout_correction_mode(cfg),
                             temperature=cfg.rollout.temperature or 1.0)


def system_prompt_for(cfg) -> str:
    """The system prompt put before a question (eval, chat): the one `data.system_prompt` names, or with "auto" the
    one of the config's training data: the built-in toy tasks' (a real `\\boxed`) when every training file is
    `builtin:toy`, else the reference data's bytes (the backspace artifact kept)."""
    if cfg.data.system_prompt != "auto":
        return SYSTEM_PROMPTS[cfg.data.system_prompt]
    files = list(cfg.data.train_files)
    return SYSTEM_PROMPT if files and all(f == toy.BUILTIN for f in files) else REFERENCE_DATA_SYSTEM_PROMPT


# --------------------------------------------------------------------------------------------------
# The training run's engine and its weights
# --------------------------------------------------------------------------------------------------


def sampler_mesh(mesh: Mesh) -> Mesh:
    """Rollouts are per process (each process generates for its own prompts): a mesh of its devices in `mesh`."""
    ours = set(mesh.devices.flat)
    return sharding.make_mesh((1, -1, 1), devices=[d for d in jax.local_devices() if d in ours])


def initial_sync(cfg, step: int) -> bool:
    """Whether the engine, which starts from the model's HF folder, must first get the policy's params: they differ
    from the folder's after a resume (`step` > 0), from `model.init_checkpoint`, or with a starting LoRA adapter
    (`model.lora.adapter`: the RL phase after a LoRA SFT; without the sync vLLM sampled the base model until the first
    update)."""
    return step > 0 or bool(cfg.model.init_checkpoint) or bool(cfg.model.lora.rank and cfg.model.lora.adapter)


def make_rollout_sampler(cfg, tokenizer, model_folder: Path, workdir: Path, policy: machinery.Policy, params, *,
                         sync: bool):
    """The rollout engine (`rollout.engine`) with the policy's current params (`sync`: tell vLLM, which loaded
    `model_folder`, about params that differ from it: a resumed run or `model.init_checkpoint`)."""
    if cfg.rollout.engine == "jax":
        model = nnx.merge(sampler_graphdef(policy), sampler_params(params, policy))
        return make_sampler(cfg, tokenizer, model=model, mesh=sampler_mesh(policy.mesh))
    # Several processes on an HSDP mesh export node-locally (each its own, to its /dev/shm: VllmSampler._export);
    # params spread over the hosts go through the run's folder (process 0 writes, every node reads: a shared file
    # system) unless rollout.vllm.export_dir says where; one process exports to /dev/shm.
    log = process_log(workdir / "vllm.log", jax.process_index(), jax.process_count())  # vllm.p<i>.log with several
    # A GPU engine sizes its KV cache from the device's free memory before and after its profiling run, device-wide
    # (vLLM 0.32: utils/mem_utils.py, v1/worker/gpu_worker.py "we assume that the other processes using the same GPU
    # did not change their memory usage"): what this process allocates or frees outside JAX's preallocated pool
    # meanwhile (NCCL communicators at a first collective, kernels loaded at a program's first run) would come out
    # of the engine's KV cache or trip vLLM's profiling assert. So everything dispatched so far (the state's init or
    # restore runs asynchronously) finishes first; then this thread waits in VllmSampler until every engine has its
    # KV cache, and JAX runs nothing in between.
    jax.block_until_ready(jax.live_arrays())
    sampler = make_sampler(cfg, tokenizer, folder=model_folder, log_file=log,
                           export_dir=workdir / "weight_sync" if jax.process_count() > 1 else None)
    if sync:  # with LoRA, model.init_checkpoint's base may differ from `model_folder`: it is sent once, in full
        sampler.update_weights(nnx.merge(policy.graphdef, params), base=bool(cfg.model.init_checkpoint))
    return sampler


def sync_weights(sampler, cfg, policy: machinery.Policy, params) -> float:
    """The weight-sync phase: the sampler gets `params` (the JAX sampler a copy of its own, vLLM the model to
    export). Returns the seconds it took."""
    if cfg.rollout.engine == "jax":
        return sampler.update_weights(sampler_params(params, policy))
    return sampler.update_weights(nnx.merge(policy.graphdef, params))


def sampler_graphdef(policy: machinery.Policy):
    """The graph of the JAX sampler's model: the policy's, or with LoRA its base's (the sampler gets the merged
    weights, `sampler_params`)."""
    return lora.base_graphdef(policy.model_cfg) if policy.model_cfg.lora_rank else policy.graphdef


def sampler_params(params, policy: machinery.Policy):
    """A copy of the policy's params for the JAX sampler (the train step donates its own) in the compute dtype
    (`jax_sampler.decode_weights`: cast before any gather), on local devices: with several processes every one gets
    the whole model (it samples alone). With LoRA the adapters merged into their weights (`lora.jit_engine_weights`:
    unmerged they tripled the decode's matmuls)."""
    cfg = policy.model_cfg
    if cfg.lora_rank:
        params = lora.jit_engine_weights(policy.graphdef, cfg.dtype)(params)
    else:
        params = decode_weights(params, cfg.compute_dtype)
    if jax.process_count() > 1:
        return distributed.replicate_on_local_devices(params, jit.param_shardings(lora.base_config(cfg),
                                                                                 sampler_mesh(policy.mesh)))
    return params
