"""`arpo-jax plan`: per-device memory of every program a config's run executes, held against the device it names.

Two parts:

* **The itemised model** (`itemise`): per device and per program (the policy update, the old/ref log-prob forward, the
  critic's update with `adv_estimator=gae`, and with the JAX engine the sampler's prefill and decode), the bytes of
  each thing alive at that program's peak: params, optimizer state, gradient buffers (float32 accumulator + one
  micro-batch's), the gathered layer and unembedding and their gradients, the activations remat keeps, the recomputed
  layer's working set, the attention workspace, the log-prob head's chunk, KV cache and sampler weights. Sharded sizes
  are exact (the same rules table as the run, `sharding.logical_to_spec`); activation sizes are a model of what a
  GPU/TPU compiler keeps (below). It needs no device and no compile: `jax_mem_fraction` uses it at launch.
* **The compiled check** (`compile_check`): the update and the log-prob forward (and the sampler's prefill and
  decode for the JAX engine, `compile_sampler`) are lowered and compiled at the config's real widths and lengths
  on fake CPU devices with abstract inputs (nothing allocated), with a reduced layer count for compile time, and
  set beside the itemised model of the same reduced model. XLA's argument bytes are exact and match the model's
  state items. XLA's CPU temporaries are reported but not used for the fit: the CPU compiler upcasts bf16 dots to
  float32 and schedules the attention kernel's blocks differently (benchmarks/RESULTS.md measures how far apart
  they are). The same two programs, compiled again with one layer less, give the communication per step
  (`comm_per_step`): every collective of the partitioned programs (`collectives`), one layer's part scaled to the
  model's depth, the micro-batch loop's part times the micro-batches a step runs, the rest times the program's runs.

The activation model (per device, one row of T tokens per batch device, compute dtype c bytes, heads/MLP split
over the tensor axis where the rules say so): remat "full" keeps each layer's input [T, D]; "dots" also the
matmul outputs; "none" everything (~ T (8D + 3(N+2K)H + 4F) c per layer). The recomputed layer in the backward
holds about T (6D + 2(N+2K)H + 5F) c. Attention (`memory_model.attention_kernel` names, per program, the kernel,
whether it skips blocks, its block and its mask; `format_plan` prints it): the blockwise kernel with block skipping
(every backend's default) keeps three float32 [N, block, block] arrays of one block pair in its backward (scores/
probabilities, dP, dS), unskipped three [N, block, T]; plus its float32 dq, dk, dv accumulators [N + 2K, T, H] and
the [T, T] boolean mask the model builds from segment ids (with tree training: one int per key instead); XLA's
attention keeps three float32 [N, T, T]; cuDNN only the mask. These are upper estimates of what XLA's GPU/TPU
buffer assignment keeps alive at once; RESULTS.md records how they compare with compiled figures. Block skipping
saves time, not memory beyond the block size: the plan counts one block pair whatever is skipped.

Tree training (`actor.tree_training`): rows keep T tokens, now tree tokens, so the per-row activations are the
flat ones; what changes is the mask (the tree rule, no [T, T] array) and the batch arrays (T heads and 8T loss
entries a row). `tree_saving` is the saving the config guarantees (the prompt shared by the n trajectories of a
group); ARPO's mid-response branches save more. The micro-batch count the run compiles holds the worst case
(`global_batch.micro_batches`; `micro_batches` here): it sizes the batch arrays. Empty micro-batches are skipped, so
the communication per step counts those the trajectories fill, estimated (`tree_training.micro_batches`: one
trajectory a row, fewer by the tree saving). `programs`: every program the run compiles before its first step.

Fit (`fit.py`): JAX's budget per device is what the device gives it (the whole HBM on TPU; on a GPU what a co-located
vLLM engine and the CUDA contexts and NCCL buffers leave, or with `rollout.vllm.placement=split` the whole GPU less
JAX's own context and buffers); a program fits when its peak leaves `HEADROOM` (10%) of it free, and the vLLM
engines' share must hold the weights and at least one full-length trajectory's KV cache (`fit.engine_memory`).
Under split placement the mesh spans each host's GPUs less `rollout.vllm.engine_gpus`.

The model's `config.json` comes from `model.path`; when that folder is not there (planning before downloading) and
its name is a published model this package knows (`models.published`), the published config is used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from arpo_jax import models, sharding
from arpo_jax.assemble import placement
from arpo_jax.experience import global_batch
from arpo_jax.models.lora import config_with
from arpo_jax.models.published import REAL_CONFIGS
from arpo_jax.models.transformer import resolve_attention
from arpo_jax.plan import collectives, programs
from arpo_jax.plan.fit import (
    budget_gib,  # noqa: F401 (plan's API)
    engine_memory,
    engine_words,
    engines_fit,
    evaluate,
    fallback_fraction,
    gib_items,
)
from arpo_jax.plan.memory_model import (
    GB,
    HEADROOM,
    MARGIN,
    Shapes,
    device_bytes,
    engine_cache,
    engine_reload_gib,
    gpu_reserve_gib,  # noqa: F401 (plan's API)
    itemise,
    param_sizes,
    sampler_items,
    total_bytes,
)
from arpo_jax.sharding import DEVICES
from arpo_jax.update import accumulate, jit, lora
from arpo_jax.update import train_step as ts
from arpo_jax.weights import named_models


def _with_shardings(abstract, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def hf_config_for(model_path: str) -> tuple[dict, str]:
    """(config.json dict, where it came from) for `model.path`, falling back to a published model's config."""
    from arpo_jax.assemble.policy import BUILTIN_TINY

    if model_path == BUILTIN_TINY:  # runtime.build_tiny_model's architecture (its vocabulary is at most 1024)
        tiny = models.Config(model_type="qwen2", vocab_size=1024, hidden_size=128, intermediate_size=384, num_layers=2,
                             num_heads=4, num_kv_heads=2, head_dim=32, qkv_bias=True)
        return models.config_to_hf(tiny), "builtin:tiny"
    if named_models.cache_folder(model_path) is not None:
        path = named_models.model_folder(model_path)  # converted once (seconds) into the cache
    else:
        path = Path(os.path.expandvars(model_path))
    if (path / "config.json").is_file():
        return json.loads((path / "config.json").read_text()), str(path / "config.json")
    if path.name in REAL_CONFIGS:
        return REAL_CONFIGS[path.name], f"published config of {path.name}"
    raise FileNotFoundError(f"model.path={model_path!r}: no config.json there, and {path.name!r} is not a published "
                            f"model this package knows ({', '.join(sorted(REAL_CONFIGS))})")


# --------------------------------------------------------------------------------------------------
# A config's plan: shapes, budget, fit, fixes
# --------------------------------------------------------------------------------------------------


def is_sft(cfg) -> bool:
    """A config for `arpo-jax sft` (SFT data, no RL data): plan the SFT update."""
    return bool(cfg.sft.train_files) and not cfg.data.train_files


def shapes_of(cfg, mesh_shape: tuple[int, int, int], rules_name: str, command: str | None = None) -> Shapes:
    """The sizes a config's run gives its programs (as the trainer / SFT and the sampler compute them)."""
    from arpo_jax.assemble.components import engine_kwargs, pack_config
    from arpo_jax.rollout.jax_decode import engine_shape

    command = command or ("sft" if is_sft(cfg) else "train")
    mesh = dict(zip(sharding.MESH_AXES, mesh_shape))
    batch_devices = math.prod(mesh[a] for a in sharding.get_rules(rules_name)["batch"])
    processes = max(1, math.prod(mesh_shape) // host_devices(cfg))
    p, r = cfg.data.max_prompt_length, cfg.data.max_response_length
    if command == "sft":
        seq = cfg.sft.max_token_len_per_device or cfg.sft.cutoff_len
        micro = max(1, -(-cfg.sft.batch_size // batch_devices))
        return Shapes("sft", 1.0, seq, micro, cfg.actor.logprob_chunk, "", 0.0, False, False, processes, 0, 0, 0,
                      cfg.sft.cutoff_len)
    workers = cfg.rollout.workers or processes
    rows_per_worker = max(1, batch_devices // workers)
    rows = workers * rows_per_worker / batch_devices
    pack = pack_config(cfg)
    seq = pack.row_len
    micro = max(1, -(-cfg.actor.ppo_mini_batch_size * cfg.rollout.n // (workers * rows_per_worker)))
    tree = bool(cfg.actor.tree_training)
    saving = tree_saving(p, r, cfg.rollout.n) if tree else 1.0
    micro = max(1, math.ceil(micro / saving))  # the same tokens in fewer rows
    fixed = global_batch.micro_batches(pack, workers, rows_per_worker, tree=tree)  # the run's M, room for the worst
    local = max(1, math.prod(mesh_shape) // processes)
    # The JAX engine's rows (`rollout.jax.slots`; default one worker's trajectories) and cache length, as it sizes them.
    kw = engine_kwargs(cfg, processes)
    engine = engine_shape(max_len=p + r, slots=kw["slots"], prefill_chunk=kw["prefill_chunk"],
                          decode_chunk=kw["decode_chunk"], batch_multiple=local, max_tokens_per_call=0,
                          decode_rows="all")
    return Shapes("train", rows, seq, micro, cfg.actor.logprob_chunk, cfg.rollout.engine,
                  cfg.rollout.vllm.gpu_memory_utilization, cfg.algorithm.adv_estimator == "gae",
                  bool(cfg.actor.kl_coef) and not cfg.model.ref_on_host, processes,
                  sampler_chunk(engine.slots, engine.cache_len, local, cfg.rollout.jax.max_tokens_per_call),
                  engine.cache_len, cfg.rollout.jax.prefill_chunk, p + r, tree, saving, fixed,
                  cfg.rollout.vllm.tensor_parallel_size, bool(cfg.actor.kl_coef) and cfg.model.ref_on_host,
                  "split" if placement.is_split(cfg) else "colocated", 4 if cfg.rollout.vllm.dtype == "float32" else 2,
                  *engine_cache(cfg.rollout.jax, DEVICES[cfg.mesh.device].kind))


def host_devices(cfg) -> int:
    """The mesh's devices on one host (one process): the device's per host, less the engines' GPUs under split."""
    return placement.trainer_gpus(cfg, DEVICES[cfg.mesh.device].per_host)


def sampler_chunk(slots: int, s_len: int, local: int, budget: int) -> int:
    """The JAX engine's rows: `slots`, or with a token budget the most (a multiple of the local devices, at least
    one) whose cache of `s_len` slots a row fits it (`jax_decode.engine_shape`)."""
    if not budget:
        return slots
    return min(slots, max(local, budget // s_len // local * local))


def tree_saving(prompt: int, response: int, n: int) -> float:
    """Tree training's saving (flat tokens / tree tokens) that a config guarantees: a group's n trajectories share
    at least their prompt, so a group of full-length trajectories is n (P + R) tokens flat and at most P + n R as a
    tree. Branches forked mid-response (ARPO, AEPO) share more and shorter trajectories less: the real ratio is
    `perf/tree_tokens_flat / perf/tree_tokens_computed`, logged each step."""
    return n * (prompt + response) / (prompt + n * response)


_FIXES = {
    "attention_workspace": "model.attention_impl=blockwise (or cudnn on GPU), or a smaller token budget per device",
    "remat_activations": "model.remat=full, or a smaller actor.max_token_len_per_device",
    "layer_working_set": "a smaller actor.max_token_len_per_device (or sft.max_token_len_per_device)",
    "optimizer_state": "more devices in mesh.shape (FSDP), or mesh.rules=fsdp_tp with a tensor axis",
    "params": "more devices in mesh.shape", "grad_accumulator": "more devices in mesh.shape",
    "micro_batch_grads": "more devices in mesh.shape",
    "kv_cache": "a smaller rollout.jax.max_tokens_per_call or rollout.jax.slots (fewer cache rows)",
    "kv_rows_gathered": "a smaller rollout.jax.prefill_chunk (fewer rows per prefill call)",
    "prefill_scores": "a smaller rollout.jax.prefill_chunk",
    "sampler_params": "more devices per host (each host's sampler holds the whole model in the compute dtype)",
    "critic_params_and_optimizer": "more devices in mesh.shape",
}


def fixes(r: dict) -> list[str]:
    """The largest items of the worst program and what would shrink them, plus the seq / vLLM settings that fit."""
    out = []
    for name, gib in list(r["items_gib"].items())[:3] if not r.get("jax_fits", r["fits"]) else ():
        out.append(f"{name} = {gib:.2f} GiB: {_FIXES.get(name, 'more devices')}")
    for setting, value in r.get("fitting_settings", {}).items():
        out.append(f"{setting}={value} fits")
    if not r.get("jax_fits", r["fits"]) and (r.get("engines") or {}).get("placement") == "colocated":
        out.append("rollout.vllm.placement=split with rollout.vllm.engine_gpus=k: the engines on k GPUs of their own, "
                   "JAX on the others with their whole memory (configs/*_8x80gb.py)")
    if not (r.get("engines") or {}).get("fits", True):
        e = r["engines"]
        out.append(f"vLLM's {e['share_gib']} GiB a GPU hold less than the weights ({e['weights_gib']} GiB) and one "
                   "trajectory: a larger rollout.vllm.gpu_memory_utilization, a larger tensor_parallel_size, or "
                   "rollout.vllm.placement=split (GPUs of their own)")
    return out


def _model_config(cfg, layers: int | None = None):
    from arpo_jax.assemble.policy import runtime_options

    hf_cfg, source = hf_config_for(cfg.model.path)
    if layers:
        hf_cfg = dict(hf_cfg, num_hidden_layers=layers)
    model_cfg = models.config_from_hf(hf_cfg, **runtime_options(cfg))
    if cfg.model.lora.rank:
        model_cfg = config_with(model_cfg, cfg.model.lora.rank, cfg.model.lora.alpha, cfg.model.lora.targets)
    return model_cfg, source


def _mesh_shape(cfg, devices: int) -> tuple[int, int, int]:
    shape = list(cfg.mesh.shape)
    if -1 in shape:
        shape[shape.index(-1)] = devices // math.prod(s for s in shape if s != -1)
    return tuple(shape)


def analyse(cfg, *, devices: int = 8, command: str | None = None) -> dict:
    """The itemised plan of an experiment config on the device it names (`mesh.device`); no compile."""
    model_cfg, source = _model_config(cfg)
    mesh_shape = _mesh_shape(cfg, devices)
    device = cfg.mesh.device
    backend = DEVICES[device].kind
    sh = shapes_of(cfg, mesh_shape, model_cfg.sharding_rules, command)
    plan = itemise(model_cfg, mesh_shape, sh, backend)
    r = evaluate(plan["programs"], device, sh.engine, sh.gpu_memory_utilization, sh.engine_tp, sh.placement,
                 engine_reload_gib(model_cfg, sh.engine_bytes, sh.engine_tp))
    r |= {"model": source, "params": plan["sizes"]["total_params"], "mesh": list(mesh_shape),
          "rules": model_cfg.sharding_rules, "command": sh.command, "engine": sh.engine, "seq": sh.seq,
          "rows_per_device": sh.rows, "remat": model_cfg.remat, "attention": plan["attention"],
          "attention_by_program": plan["attention_by_program"],
          "tree_training": {"on": sh.tree, "saving_at_least": round(sh.tree_saving, 3),
                            "micro_batches": sh.micro_batches} if sh.command == "train" else None,
          "sampler_batch": sh.sampler_batch, "sampler_len": sh.sampler_len, "host_devices": host_devices(cfg),
          "programs_gib": {p: {k: round(v / GB, 3) for k, v in items.items()}
                           for p, items in plan["programs"].items()},
          "micro_batches": sh.fixed_micro_batches or sh.micro_batches,
          "programs": programs.run_programs(cfg, sh, model_cfg, mesh_shape,
                                            {p: sum(items.values()) for p, items in plan["programs"].items()})}
    r["jax_fits"] = r["fits"]
    if sh.engine == "vllm" and DEVICES[device].kind == "gpu":  # the engines' share must hold the model
        r["engines"] = engine_memory(model_cfg, r["params"], sh, device)
        r["fits"] = r["fits"] and r["engines"]["fits"]
    if not r["fits"]:
        r["fitting_settings"] = {} if r["jax_fits"] else _fitting_settings(model_cfg, mesh_shape, sh, backend, device)
        r["fixes"] = fixes(r)
    return r


def _fitting_settings(c, mesh_shape, sh: Shapes, backend: str, device: str) -> dict:
    """The largest token budget per device (multiples of 1024, at least one trajectory) and, beside vLLM, the
    largest gpu_memory_utilization with which every program fits."""
    def fits(shapes, util):
        programs = itemise(c, mesh_shape, shapes, backend)["programs"]
        shapes = dataclasses.replace(shapes, gpu_memory_utilization=util)
        return evaluate(programs, device, shapes.engine, util, shapes.engine_tp, shapes.placement,
                        engine_reload_gib(c, shapes.engine_bytes, shapes.engine_tp))["fits"] and \
            engines_fit(c, param_sizes(c, tuple(mesh_shape)).total_params, shapes, device)

    out = {}
    field = "sft.max_token_len_per_device" if sh.command == "sft" else "actor.max_token_len_per_device"
    for t in range(sh.seq - sh.seq % 1024, sh.min_seq - 1, -1024):
        if fits(dataclasses.replace(sh, seq=t), sh.gpu_memory_utilization):
            out[field] = t
            break
    if sh.engine == "jax" and sh.command == "train":
        local = max(1, math.prod(mesh_shape) // sh.processes)
        b = sh.sampler_batch
        while b >= local:
            if fits(dataclasses.replace(sh, sampler_batch=b), sh.gpu_memory_utilization):
                out["rollout.jax.max_tokens_per_call"] = b * sh.sampler_len
                break
            b //= 2
    if sh.engine == "vllm" and DEVICES[device].kind == "gpu":
        for util in (x / 100 for x in range(int(sh.gpu_memory_utilization * 100), 9, -5)):
            if fits(sh, util):
                out["rollout.vllm.gpu_memory_utilization"] = round(util, 2)
                break
    return out


def memory_split(cfg) -> dict:
    """`analyse` of a config for the launch: JAX's planned share of each device (`jax_fraction`) and the fit. A
    mesh with a -1 is planned on one host of the named device (8 GPUs, 4 TPU chips; 8 for `cpu`)."""
    shape, host = tuple(cfg.mesh.shape), min(8, DEVICES[cfg.mesh.device].per_host)
    return analyse(cfg, devices=math.prod(shape) if -1 not in shape else placement.trainer_gpus(cfg, host))


def jax_mem_fraction(cfg) -> float:
    """The share of each GPU JAX may take (XLA_PYTHON_CLIENT_MEM_FRACTION, set by the launch scripts).

    Beside a co-located vLLM: the planned peak (`memory_split`: the largest program per device + 10% headroom, as
    a share of `mesh.device`, leaving `memory_model.MARGIN`); the engine has the rest (`arpo-jax plan` checks
    `rollout.vllm.gpu_memory_utilization`); under `rollout.vllm.placement=split` the same share of JAX's own GPUs.
    No plannable device (`mesh.device=cpu`) or model config: `fit.fallback_fraction`. The JAX engine: 0.9."""
    if cfg.rollout.engine != "vllm":
        return 0.9
    with contextlib.suppress(FileNotFoundError):  # no config.json for model.path yet: nothing to plan from
        if cfg.mesh.device != "cpu":
            return memory_split(cfg)["jax_fraction"]
    return fallback_fraction(cfg.mesh.device, cfg.rollout.vllm.gpu_memory_utilization, placement.is_split(cfg))



# --------------------------------------------------------------------------------------------------
# The compiled check: the update and the log-prob forward on fake devices, abstract inputs
# --------------------------------------------------------------------------------------------------


def _abstract_state(model_cfg, mesh, update_cfg):
    graphdef, abstract_state = nnx.split(models.abstract_model(model_cfg), nnx.Param)
    abstract_params = nnx.to_pure_dict(abstract_state)
    opt = lora.freeze_base(ts.make_optimizer(update_cfg, 1000), model_cfg)  # LoRA: no moments for the base
    shardings = jit.state_shardings(opt, jit.param_shardings(model_cfg, mesh), abstract_params, mesh)
    abstract_train_state = jax.eval_shape(lambda p: accumulate.TrainState(p, opt.init(p), jnp.zeros((), jnp.int32),
                                                                  jnp.zeros((), jnp.int32)), abstract_params)
    return graphdef, abstract_state, opt, shardings, _with_shardings(abstract_train_state, shardings)


def _abstract_batch(mesh, model_cfg, update_cfg, micro, rows, seq):
    batch_sh = jax.sharding.NamedSharding(mesh, sharding.batch_spec(mesh, model_cfg.sharding_rules))
    ints = ("input_ids", "targets", "positions", "segment_ids")
    floats = ("loss_weight", "advantages", "old_logp") + (("ref_logp",) if update_cfg.kl_coef else ())
    return {k: jax.ShapeDtypeStruct((micro, rows, seq), jnp.int32 if k in ints else jnp.float32, sharding=batch_sh)
            for k in ints + floats}


def _memory(compiled) -> dict:
    mem = compiled.memory_analysis()
    return {"argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
            "alias_bytes": mem.alias_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
            # Donated state aliases its output, so the peak is arguments + temporaries (+ the small outputs).
            "peak_per_device": mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
            - mem.alias_size_in_bytes}


def _comm(hlo: str, per_host: int) -> dict:
    """A program's collectives (`collectives.summary`), split into those of its micro-batch loop (ops in
    `accumulate.MICRO_BATCH_SCOPE`: once per micro-batch) and the rest (once per run, e.g. HSDP's gradient sum)."""
    items, exact = collectives.collectives(hlo, per_host)
    inside = [accumulate.MICRO_BATCH_SCOPE in c.op.split("/") for c in items]
    return {"per_micro_batch": collectives.summary([c for c, i in zip(items, inside) if i]),
            "per_run": collectives.summary([c for c, i in zip(items, inside) if not i]), "exact": exact}


def plan(model_cfg: models.Config, mesh_shape, update_cfg: ts.UpdateConfig, *, micro: int, rows: int,
         seq: int, forward: bool = False, per_host: int = 0) -> dict:
    """Per-device bytes of one optimizer step of [micro, rows, seq] on `mesh_shape` (and, with `forward`, of the
    log-prob forward over the same batch), compiled on this host's first devices with abstract inputs; and each
    program's collectives (`collectives.summary`: bytes per device per run, `per_host` devices a host)."""
    mesh = sharding.make_mesh(mesh_shape, devices=jax.devices()[:math.prod(mesh_shape)])
    graphdef, abstract_state, opt, shardings, state = _abstract_state(model_cfg, mesh, update_cfg)
    batch = _abstract_batch(mesh, model_cfg, update_cfg, micro, rows, seq)
    step = ts.jit_train_step(graphdef, model_cfg, update_cfg, opt, mesh, shardings)
    t = time.perf_counter()
    compiled, hlo = collectives.compile_partitioned(step.lower(state, batch))
    compile_s = time.perf_counter() - t
    n_dev = mesh.devices.size
    params_dev, opt_dev = device_bytes(state.params), device_bytes(state.opt_state)
    total_state = total_bytes(state.params) + total_bytes(state.opt_state)
    out = {
        "mesh": list(mesh.devices.shape), "rules": model_cfg.sharding_rules, "devices": n_dev,
        "backend": jax.default_backend(), "params": models.param_count(abstract_state), "layers": model_cfg.num_layers,
        "param_dtype": model_cfg.param_dtype, "compute_dtype": model_cfg.dtype, "remat": model_cfg.remat,
        "attention": resolve_attention(model_cfg.attention_impl, dtype=model_cfg.dtype),
        "micro_batches": micro, "rows": rows, "seq": seq, "compile_s": round(compile_s, 1),
        "params_per_device": params_dev, "opt_state_per_device": opt_dev, "batch_per_device": device_bytes(batch),
        **_memory(compiled),
        "ideal_state_per_device": total_state // n_dev,
        "state_vs_ideal": round((params_dev + opt_dev) / (total_state / n_dev), 4),
        "comm": _comm(hlo, per_host),
    }
    if forward:
        fwd = ts.jit_forward_logprobs(graphdef, model_cfg, temperature=update_cfg.temperature,
                                      chunk=update_cfg.logprob_chunk, mesh=mesh)
        t = time.perf_counter()
        compiled, hlo = collectives.compile_partitioned(fwd.lower(state.params, batch))
        out["forward"] = {"compile_s": round(time.perf_counter() - t, 1), **_memory(compiled),
                          "comm": _comm(hlo, per_host)}
    return out


def compile_sampler(model_cfg: models.Config, sh: Shapes, local_devices: int) -> dict:
    """The JAX engine's longest prefill and its decode (`jax_decode.engine_programs`; stacked cache and scanned
    layers as on a TPU; a GPU's default unrolled layout holds the same weight and cache bytes, per layer) compiled for
    an engine of B x S rows on a process's local devices, abstract inputs: {program: XLA bytes per device}."""
    from arpo_jax.models.transformer import KVCache
    from arpo_jax.rollout import jax_decode as jd

    mesh = sharding.make_mesh((1, local_devices, 1), devices=jax.devices()[:local_devices])
    graphdef, abstract = nnx.split(models.abstract_model(model_cfg))
    p_sh = sharding.state_shardings(abstract, mesh, sharding.get_rules(model_cfg.sharding_rules))
    abstract = jax.eval_shape(lambda a: jd.decode_weights(a, model_cfg.compute_dtype), abstract)  # the sampler's copy
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, p_sh)
    shape = jd.engine_shape(max_len=sh.sampler_len, slots=sh.sampler_batch, prefill_chunk=sh.prefill_chunk,
                            decode_chunk=16, decode_rows="all", decode_lengths="all")  # every row and slot
    b, s = shape.slots, shape.cache_len

    def rows(*tail, dtype=jnp.int32):  # [B, ...] split over the local devices
        spec = jax.sharding.PartitionSpec(("fsdp",), *([None] * len(tail)))
        return jax.ShapeDtypeStruct((b, *tail), dtype, sharding=jax.sharding.NamedSharding(mesh, spec))

    kv_sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, ("fsdp",), None, None, None))
    kv = jax.ShapeDtypeStruct((model_cfg.num_layers, b, model_cfg.num_kv_heads, s, model_cfg.head_dim),
                              model_cfg.compute_dtype, sharding=kv_sh)
    ds = jd.DecodeState(KVCache(kv, kv, rows(s), rows()), rows(model_cfg.hidden_size, dtype=model_cfg.compute_dtype),
                        rows(dtype=bool), rows(), rows(shape.stop_len))
    fns = jd.jitted(graphdef, model_cfg, shape)
    programs = jd.engine_programs(fns, shape, state, ds, n_eos=1, vocab=None)
    longest = max((n for n in programs if n.startswith("prefill")), key=lambda n: int(n.rsplit("x", 1)[1]))
    out = {}
    with jax.set_mesh(mesh):
        for name, program in (("sampler_prefill", longest), ("sampler_decode", f"decode_{shape.slots}")):
            fn, args = programs[program]
            t0 = time.perf_counter()
            c = fn.lower(*args).compile()
            out[name] = {"compile_s": round(time.perf_counter() - t0, 1), **_memory(c)}
    return out


def compile_check(cfg, *, devices: int = 8, layers: int = 2, command: str | None = None) -> dict:
    """The update (and, for RL, the log-prob forward) compiled at the config's widths and lengths with `layers`
    decoder layers, beside the itemised model of the same reduced model: XLA's argument bytes against the model's
    params + optimizer state + batch (exact up to small counters), XLA's CPU temporaries against the model's
    non-state items (the CPU figure overstates: see the module docstring)."""
    from arpo_jax.assemble.components import update_config

    model_cfg, _ = _model_config(cfg, layers)
    mesh_shape = _mesh_shape(cfg, devices)
    sh = shapes_of(cfg, mesh_shape, model_cfg.sharding_rules, command)
    rows = math.prod(dict(zip(sharding.MESH_AXES, mesh_shape))[a]
                     for a in sharding.get_rules(model_cfg.sharding_rules)["batch"])
    rows = max(1, round(rows * sh.rows))
    # Hosts matter for a GPU cluster's network; a TPU slice is one ICI domain whatever its hosts.
    per_host = host_devices(cfg) if DEVICES[cfg.mesh.device].kind == "gpu" else 0
    compiled = plan(model_cfg, mesh_shape, update_config(cfg), micro=1, rows=rows, seq=sh.seq,
                    forward=sh.command == "train", per_host=per_host)
    # The model of the same reduced program, for the same single micro-batch and on the CPU backend's attention; flat
    # as `plan` compiles it (a tree row's batch arrays, T heads and 8T loss entries, are larger).
    one = dataclasses.replace(sh, micro_batches=1, fixed_micro_batches=1, engine="", critic=False, ref_on_device=False,
                              tree=False)
    model = itemise(model_cfg, mesh_shape, one, "cpu")["programs"]
    state_keys = ("params", "optimizer_state", "batch")
    upd = model["update"]
    out = {"layers": layers, "compile_s": compiled["compile_s"],
           "update": {"xla_arguments_gib": compiled["argument_bytes"] / GB,
                      "model_state_gib": sum(upd[k] for k in state_keys) / GB,
                      "xla_cpu_temp_gib": compiled["temp_bytes"] / GB,
                      "model_temp_gib": sum(v for k, v in upd.items() if k not in state_keys) / GB}}
    if "forward" in compiled:
        fwd = model["logprob_forward"]
        out["logprob_forward"] = {"compile_s": compiled["forward"]["compile_s"],
                                  "xla_arguments_gib": compiled["forward"]["argument_bytes"] / GB,
                                  "model_params_gib": fwd["params"] / GB,
                                  "xla_cpu_temp_gib": compiled["forward"]["temp_bytes"] / GB,
                                  "model_temp_gib": sum(v for k, v in fwd.items()
                                                        if k not in ("params", "optimizer_state", "batch")) / GB}
    if layers >= 2:
        fewer = plan(_model_config(cfg, layers - 1)[0], mesh_shape, update_config(cfg), micro=1, rows=rows,
                     seq=sh.seq, forward=sh.command == "train", per_host=per_host)
        out["comm_per_step_gib"] = comm_per_step(cfg, sh, compiled, fewer, layers)
    if sh.command == "train" and sh.engine == "jax":
        local = max(1, math.prod(mesh_shape) // sh.processes)
        smp = sampler_items(model_cfg, param_sizes(model_cfg, tuple(mesh_shape)), sh, local)
        resident = ("params", "optimizer_state")  # the train state: not an argument of the sampler's programs
        for name, mem in compile_sampler(model_cfg, sh, local).items():
            items = smp[name]
            out[name] = {"compile_s": mem["compile_s"], "xla_arguments_gib": mem["argument_bytes"] / GB,
                         "model_state_gib": (items["sampler_params"] + items["kv_cache"]) / GB,
                         "xla_cpu_temp_gib": mem["temp_bytes"] / GB,
                         "model_temp_gib": sum(v for k, v in items.items()
                                               if k not in (*resident, "sampler_params", "kv_cache")) / GB}
    return jax.tree.map(lambda x: round(x, 3) if isinstance(x, float) else x, out)


def comm_per_step(cfg, sh: Shapes, at_layers: dict, at_fewer: dict, layers: int) -> dict:
    """Each device's collective traffic (GiB, by kind) in one training step of the full-depth model, from one
    micro-batch's programs compiled at `layers` and `layers - 1` decoder layers (`plan`): the difference is one
    layer's part, scaled to the model's depth. A program's micro-batch part counts once per micro-batch, the rest
    once per run (`_comm`): the update runs once per mini-batch and PPO epoch over its micro-batches, the log-prob
    forward once over all of the rollout's (twice with an on-device reference)."""
    depth = _model_config(cfg)[0].num_layers
    if sh.command == "sft":
        runs = {"update": (1, sh.micro_batches)}  # program runs a step, micro-batches each
    else:
        minis = max(1, cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size)
        runs = {"update": (minis * cfg.actor.ppo_epochs, sh.micro_batches),
                "forward": (1 + sh.ref_on_device, sh.micro_batches * minis)}
    total: dict[str, float] = {}
    exact = True
    for program, (n_runs, n_micro) in runs.items():
        big, small = (at_layers, at_fewer) if program == "update" else (at_layers["forward"], at_fewer["forward"])
        exact &= big["comm"]["exact"] and small["comm"]["exact"]
        for part, times in (("per_run", n_runs), ("per_micro_batch", n_runs * n_micro)):
            b, s = big["comm"][part], small["comm"][part]
            for k in b.keys() | s.keys():
                one = s.get(k, 0.0) + (depth - layers + 1) * (b.get(k, 0.0) - s.get(k, 0.0))
                total[k] = total.get(k, 0.0) + times * one / GB
    return total | {"micro_batches": {p: r * m for p, (r, m) in runs.items()},
                    "program_runs": {p: r for p, (r, _) in runs.items()}, "exact": exact}


def plan_config(cfg, *, devices: int = 8, compile_layers: int = 0, command: str | None = None) -> dict:
    """`arpo-jax plan`: the itemised plan of a config, and with `compile_layers` > 0 the compiled check."""
    r = analyse(cfg, devices=devices, command=command)
    if compile_layers:
        r["compiled"] = compile_check(cfg, devices=devices, layers=compile_layers, command=command)
    return r


def _kernel_words(a: dict) -> str:
    """"blockwise (skip, 512x512 blocks, tree rule)" from `memory_model.attention_kernel`'s dict."""
    if a["kernel"] != "blockwise":
        return f"{a['kernel']} ({a['mask']} mask)" if "mask" in a else a["kernel"]
    b = a["block"]
    return (f"blockwise (skip, {b}x{b} blocks" if a["skip_blocks"] else f"blockwise (no skip, {b}-query blocks") + \
        f", {a['mask']})"


def format_plan(r: dict) -> str:
    """The per-program table of `plan_config`'s result."""
    progs = list(r["programs_gib"])
    items = sorted({k for p in progs for k in r["programs_gib"][p]},
                   key=lambda k: -max(r["programs_gib"][p].get(k, 0) for p in progs))
    width = max(12, *(len(p) for p in progs))
    lines = [f"{r['model']}: {r['params'] / 1e9:.2f}B params, mesh {tuple(r['mesh'])} rules={r['rules']}, "
             f"remat={r['remat']}, {r['command']} rows/device={r['rows_per_device']:g} x {r['seq']} tokens, "
             f"engine={r['engine'] or '-'}; attention: "
             + ", ".join(f"{p}={_kernel_words(a)}" for p, a in r["attention_by_program"].items())
             + (f"; tree training: rows of tree tokens, saving >= {r['tree_training']['saving_at_least']:g}x "
                f"(the prompt shared n ways), {r['tree_training']['micro_batches']} micro-batches"
                if (r.get("tree_training") or {}).get("on") else ""),
             f"device {r['device']}: {r['hbm_gib']} GiB, JAX budget {r['budget_gib']} GiB per device",
             f"{'GiB per device':28s}" + "".join(f"{p:>{width + 1}s}" for p in progs)]
    for k in items:
        lines.append(f"{k:28s}" + "".join(f"{r['programs_gib'][p].get(k, 0):{width + 1}.2f}" for p in progs))
    lines.append(f"{'peak':28s}" + "".join(f"{r['program_peaks_gib'][p]:{width + 1}.2f}" for p in progs))
    verdict = "fits" if r.get("jax_fits", r["fits"]) else "DOES NOT FIT"
    split = (r.get("engines") or {}).get("placement") == "split"
    lines.append(f"{verdict}: peak {r['peak_gib']} GiB ({r['peak_program']}) of {r['budget_gib']} GiB, headroom "
                 f"{r['headroom']:.0%} (needs {HEADROOM:.0%})"
                 + (f"; JAX fraction {r['jax_fraction']}, vLLM may take up to {r['engine_fraction_max']}"
                    if "engine_fraction_max" in r else f"; JAX fraction {r['jax_fraction']}" if split else ""))
    if r.get("reserve_gib"):  # outside both budgets, per GPU
        where = "JAX's pool, per trainer GPU" if split else "JAX's and vLLM's shares, per GPU"
        lines.append(f"outside {where}: " + gib_items(r["reserve_gib"]) + f"; {MARGIN:.0%} of the GPU for the rest")
    if r.get("engines"):
        lines.append(engine_words(r["engines"], r["host_devices"]))
    for fix in r.get("fixes", []):
        lines.append(f"  fix: {fix}")
    lines += programs.format_programs(r.get("programs", []))
    if "compiled" in r:
        c = r["compiled"]
        lines.append(f"compiled check ({c['layers']} layers, fake CPU devices, {c['compile_s']} s): "
                     + "; ".join(f"{p}: XLA args {v['xla_arguments_gib']:.2f} GiB vs model "
                                 f"{v.get('model_state_gib', v.get('model_params_gib')):.2f}, CPU temps "
                                 f"{v['xla_cpu_temp_gib']:.2f} vs model {v['model_temp_gib']:.2f}"
                                 for p, v in c.items() if isinstance(v, dict) and "xla_arguments_gib" in v))
        if comm := c.get("comm_per_step_gib"):
            dev = DEVICES[r["device"]]
            cluster = dev.kind == "gpu" and math.prod(r["mesh"]) > r["host_devices"]  # hosts joined by a network
            kinds = [k for k in collectives.KINDS if comm.get(k, 0) >= 0.05]
            lines.append(f"communication per device per step ({'' if comm['exact'] else 'at least, '}compiled at "
                         f"{c['layers'] - 1} and {c['layers']} layers, scaled to the model's depth and "
                         f"{' + '.join(f'{n} {p}' for p, n in comm['micro_batches'].items())} micro-batches): "
                         f"{comm['total']:.1f} GiB = " + " + ".join(f"{comm[k]:.1f} {k}" for k in kinds)
                         + (f"; across hosts {comm['across_hosts']:.1f} GiB" if cluster else ""))
    return "\n".join(lines)
