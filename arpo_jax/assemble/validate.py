"""Validating experiment configs (``configs/*.py``, ml_collections).

``load_config(["--config=builtin:toy_cpu", "--config.rollout.n=16"])`` (``arpo_jax.config.args``) parses the command
line. ``validate(cfg)`` checks every field against the schema in ``config/schema.py`` (types), the rules of
the components that use them (each ``knobs.knob`` field of their settings dataclasses: allowed values, ranges), the
rules of the fields read directly (below), cross-field rules and the files a command needs, and raises one
``ConfigError`` listing every problem as ``field.path: problem (allowed: ...)``, so a bad launch fails in a second
with all of its mistakes at once, before any device is touched. ``redact`` (``arpo_jax.config.redaction``) makes a
loggable copy.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
from collections.abc import Sequence
from typing import Any

from ml_collections import ConfigDict

from arpo_jax import knobs
from arpo_jax.assemble import files as config_files
from arpo_jax.config.args import (
    BUILTIN,
)
from arpo_jax.config.redaction import to_dict
from arpo_jax.knobs import NONNEG, POSITIVE, UNIT, Rule, at_least

log = logging.getLogger(__name__)

COMMANDS = ("train", "sft", "eval")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
TOOL_TAGS = ("<python>", "</python>", "<search>", "</search>", "<result>", "</result>", "<answer>", "</answer>")

# String fields that name files or folders: `${VAR}` references and `~` are expanded in them.
PATH_FIELDS = ("model.path", "model.tokenizer", "model.init_checkpoint", "model.lora.adapter", "data.train_files",
               "data.val_files",
               "sft.train_files", "sft.val_files", "tools.search.cache_file", "tools.search.corpus_file",
               "reward.custom_path", "rollout.vllm.python", "rollout.vllm.export_dir", "tools.python.python_path")
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class ConfigError(ValueError):
    """Every problem found in a config, one ``field.path: problem (allowed: ...)`` line each."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__(f"{len(self.problems)} config problem(s):\n  " + "\n  ".join(self.problems))


# --------------------------------------------------------------------------------------------------
# Small helpers over dotted paths and the schema
# --------------------------------------------------------------------------------------------------


def _leaves(tree: dict, prefix: str = "") -> dict[str, Any]:
    """Flat {"a.b.c": value} view of a nested dict (dicts are sections, everything else a leaf)."""
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_leaves(value, path + "."))
        else:
            out[path] = value
    return out


@functools.cache
def _schema() -> dict[str, Any] | None:
    """Flat defaults of config/schema.py: the schema (field set and types)."""
    from arpo_jax.config import schema

    return _leaves(schema.get_config().to_dict())


@functools.cache
def _components() -> tuple[type, ...]:
    """The settings dataclasses built from the config (``knobs.from_config``): their knob fields' rules are checked
    here by config field (imported lazily: they pull JAX)."""
    from arpo_jax.experience import collection, packing, reward
    from arpo_jax.rollout import agent_loop, sampler
    from arpo_jax.update import train_step
    from arpo_jax.update import value as critic

    return (train_step.UpdateConfig, agent_loop.RolloutConfig, sampler.SamplingSettings, critic.CriticConfig,
            packing.PackConfig, reward.ShapingConfig, collection.ScheduleConfig)


@functools.cache
def _allowed() -> dict[str, tuple]:
    """Every enum field and its allowed values: the knobs' and those of the fields read directly."""
    knob_enums = {path: rule.values for cls in _components() for _, path, rule in knobs.knob_fields(cls)
                  if rule is not None and rule.values}
    return knob_enums | _direct_enums()


@functools.cache
def _direct_enums() -> dict[str, tuple]:
    """Enum fields read directly (not through a knob), with the allowed values of the modules that consume them."""
    from arpo_jax import rewards, sharding, tools
    from arpo_jax.assemble import placement
    from arpo_jax.data import prompts, rl_dataset
    from arpo_jax.experience import advantages
    from arpo_jax.models import transformer
    from arpo_jax.rollout import jax_decode, sampler
    from arpo_jax.update import algos, train_step

    return {
        "model.dtype": transformer.DTYPES,
        "model.param_dtype": transformer.DTYPES,
        "model.remat": tuple(transformer.REMAT_POLICIES),
        "model.attention_impl": ("", *(a for a in transformer.ATTENTION_IMPLS if a)),  # "" = JAX picks
        "mesh.rules": tuple(sharding.RULES),
        "mesh.device": tuple(sharding.DEVICES),
        "data.source": rl_dataset.SOURCES,
        "data.overlong_prompts": rl_dataset.OVERLONG_MODES,
        "data.system_prompt": ("auto", *prompts.SYSTEM_PROMPTS),
        "rollout.engine": sampler.ROLLOUT_ENGINES,
        "rollout.vllm.dtype": ("auto", "bfloat16", "float16", "float32"),
        "rollout.vllm.lora_sync": sampler.LORA_SYNCS,
        "rollout.vllm.cuda_graphs": tuple(sampler.CUDA_GRAPHS),
        "rollout.vllm.placement": placement.PLACEMENTS,
        "rollout.jax.layout": jax_decode.LAYOUTS,
        "rollout.jax.decode_rows": jax_decode.DECODE_ROWS,
        "rollout.jax.decode_lengths": jax_decode.DECODE_LENGTHS,
        "rollout.jax.kv_dtype": jax_decode.KV_DTYPES,
        "tools.search.backend": tuple(tools.SEARCH_BACKENDS),
        "reward.name": (*rewards.REWARDS, "auto"),
        "algorithm.adv_estimator": (*advantages.ADVANTAGE_ESTIMATORS, "gae"),  # gae: PPO with a critic
        "actor.rollout_correction.mode": ("auto", *algos.ROLLOUT_CORRECTION_MODES),  # auto: components
        "sft.schedule": train_step.SCHEDULES,
    }


# --------------------------------------------------------------------------------------------------
# The checker: collects problems; a field that failed its type check is skipped by later checks
# --------------------------------------------------------------------------------------------------


class _Checker:
    def __init__(self, flat: dict[str, Any]):
        self.flat = flat
        self.problems: list[str] = []
        self.bad: set[str] = set()

    def add(self, path: str, problem: str, allowed: str | None = None) -> None:
        self.problems.append(f"{path}: {problem}" + (f" (allowed: {allowed})" if allowed else ""))
        self.bad.add(path)

    def get(self, path: str) -> Any:
        """The value, or None when the field is missing or already reported as mistyped."""
        return None if path in self.bad else self.flat.get(path)

    def require(self, path: str, rule: Rule) -> None:
        """Reports `path` when its value exists and breaks `rule`."""
        value = self.get(path)
        if value is not None and not rule.ok(value):
            self.add(path, rule.message(value))


def _type_name(value: Any) -> str:
    return type(value).__name__


def _check_leaf_type(ck: _Checker, path: str, value: Any, default: Any) -> Any:
    """Checks one leaf against its default's type; returns the normalised value (list -> tuple, int -> float)."""
    if isinstance(default, bool) or isinstance(default, str):
        if not isinstance(value, type(default)):
            ck.add(path, f"expected {_type_name(default)}, got {_type_name(value)} {value!r}", _type_name(default))
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            ck.add(path, f"expected int, got {_type_name(value)} {value!r}", "an int")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, int | float):
            ck.add(path, f"expected float, got {_type_name(value)} {value!r}", "a number")
            return value
        return float(value)
    if isinstance(default, tuple):
        return _check_tuple(ck, path, value, default)
    return value


def _check_tuple(ck: _Checker, path: str, value: Any, default: tuple) -> Any:
    """Tuple fields: a single string becomes a 1-tuple (`--config.data.train_files=x.parquet`); elements typed."""
    element = type(default[0]) if default else str  # the empty defaults are all file lists
    if isinstance(value, str) and element is str:
        value = (value,)
    if not isinstance(value, list | tuple):
        ck.add(path, f"expected a tuple of {element.__name__}, got {_type_name(value)} {value!r}",
               f"a tuple of {element.__name__}")
        return value
    wrong = [v for v in value if not isinstance(v, element) or isinstance(v, bool)]
    if wrong:
        ck.add(path, f"expected a tuple of {element.__name__}, got element(s) {wrong!r}",
               f"a tuple of {element.__name__}")
    return tuple(value)


def _check_types(ck: _Checker, schema: dict[str, Any]) -> None:
    for path in sorted(set(ck.flat) - set(schema)):
        section = path.rpartition(".")[0]
        siblings = sorted(p.removeprefix(section + ".") for p in schema if p.rpartition(".")[0] == section)
        ck.add(path, "unknown field (not defined in config/schema.py; a typo?)", ", ".join(siblings) or None)
    for path in sorted(set(schema) - set(ck.flat)):
        ck.add(path, "missing (config/schema.py defines it)", f"any {_type_name(schema[path])}")
    for path, default in schema.items():
        if path in ck.flat and path not in ck.bad:
            ck.flat[path] = _check_leaf_type(ck, path, ck.flat[path], default)


# --------------------------------------------------------------------------------------------------
# Value checks, one small function per section
# --------------------------------------------------------------------------------------------------

def _check_model(ck: _Checker) -> None:
    if not ck.get("model.path") and not ck.get("model.init_checkpoint"):
        ck.add("model.path", "neither model.path nor model.init_checkpoint is set",
               "an HF folder | builtin:tiny, or model.init_checkpoint")
    if not ck.get("model.path") and not ck.get("model.tokenizer"):
        ck.add("model.tokenizer", "no tokenizer: model.tokenizer and model.path are both empty", "a tokenizer folder")
    _check_lora(ck)


def _check_lora(ck: _Checker) -> None:
    from arpo_jax.models.transformer import LORA_TARGETS

    ck.require("model.lora.rank", at_least(0, "an int >= 0 (0 = off)"))
    if not ck.get("model.lora.rank"):
        if ck.get("model.lora.adapter"):
            ck.add("model.lora.adapter", "a PEFT adapter needs LoRA on", "set model.lora.rank > 0")
        return
    ck.require("model.lora.alpha", POSITIVE)
    ck.require("model.lora.dropout", Rule(lambda v: v == 0, "0.0 (adapter dropout is not implemented)"))
    targets = ck.get("model.lora.targets")
    if targets is not None and (not targets or not set(targets) <= set(LORA_TARGETS)):
        ck.add("model.lora.targets", f"{tuple(targets)!r} is not a non-empty set of projections",
               knobs.fmt(LORA_TARGETS))
    if ck.get("model.ref_on_host"):
        ck.add("model.ref_on_host", "with LoRA the reference is the base itself (no copy to put on the host)", "False")


def _check_mesh(ck: _Checker, device_count: int | None) -> None:
    shape = ck.get("mesh.shape")
    if shape is None:
        return
    allowed = "3 positive ints (data, fsdp, tensor), at most one -1"
    if len(shape) != 3 or shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
        ck.add("mesh.shape", f"{tuple(shape)} is not a valid mesh shape", allowed)
        return
    known = math.prod(s for s in shape if s != -1)
    if device_count is not None:
        fits = device_count % known == 0 if -1 in shape else known == device_count
        if not fits:
            ck.add("mesh.shape", f"{tuple(shape)} does not fit {device_count} devices",
                   f"a product of {device_count}" + (" (-1 fills the rest)" if -1 in shape else ""))
    if shape[2] != 1 and ck.get("mesh.rules") == "fsdp":
        ck.add("mesh.rules", f"'fsdp' leaves the tensor axis of {tuple(shape)} unused (every tensor shard would "
                             "repeat the same work)", "fsdp_tp, or mesh.shape[2] = 1")


def _check_data(ck: _Checker, command: str, process_count: int | None) -> None:
    for path in ("data.max_prompt_length", "data.train_batch_size"):
        ck.require(path, POSITIVE)
    for path in ("data.val_batch_size", "data.val_max_samples", "data.seed", "seed"):
        ck.require(path, NONNEG)
    if not ck.get("data.prompt_key"):
        ck.add("data.prompt_key", "is empty", "a column name, e.g. prompt")
    batch, mini = ck.get("data.train_batch_size"), ck.get("actor.ppo_mini_batch_size")
    if batch and mini and mini > 0 and batch % mini:
        ck.add("data.train_batch_size", f"{batch} is not divisible by actor.ppo_mini_batch_size={mini}",
               f"a multiple of {mini}")
    workers = ck.get("rollout.workers")
    if batch and workers and workers > 0 and batch % workers:
        ck.add("data.train_batch_size", f"{batch} is not divisible by rollout.workers={workers}",
               f"a multiple of {workers}")
    if batch and process_count and batch % process_count:
        ck.add("data.train_batch_size", f"{batch} prompts cannot be split evenly over {process_count} processes",
               f"a multiple of {process_count}")
    # Every rollout worker contributes the same number of prompts to each PPO mini-batch.
    resolved = workers if workers and workers > 0 else process_count
    if mini and mini > 0 and resolved and mini % resolved:
        ck.add("actor.ppo_mini_batch_size", f"{mini} prompts cannot be split evenly over {resolved} rollout workers "
               "(rollout.workers, 0 = one per process)", f"a multiple of {resolved}")
    if command == "train":
        if not ck.get("data.train_files"):
            ck.add("data.train_files", "is empty; `train` needs training data", "parquet files | builtin:toy")
        wants_val = (ck.get("trainer.test_freq") or 0) > 0 or ck.get("trainer.val_before_train")
        if wants_val and not ck.get("data.val_files") and "data.val_files" not in ck.bad:
            ck.add("data.val_files", "is empty but trainer.test_freq > 0 or trainer.val_before_train asks for "
                                     "validation", "parquet files | builtin:toy, or trainer.test_freq=0")


def _check_rollout(ck: _Checker, command: str, process_count: int | None) -> None:
    n, m = ck.get("rollout.n"), ck.get("rollout.initial_rollouts")
    if n is not None and m is not None and n < m:
        ck.add("rollout.n", f"{n} is smaller than rollout.initial_rollouts={m}", f">= initial_rollouts ({m})")
    if command == "train" and n is not None and n < 2 and "rollout.n" not in ck.bad:
        ck.add("rollout.n", f"{n}: a group of one trajectory has no group baseline", ">= 2")
    for path in ("rollout.entropy_top_k", "rollout.jax.decode_chunk", "rollout.jax.prefill_chunk"):
        ck.require(path, at_least(1))
    ck.require("rollout.val_kwargs.n", at_least(1, ">= 1 (samples per validation prompt)"))
    if ck.get("rollout.val_kwargs.do_sample"):  # the validation sampling settings (SamplingSettings' rules)
        ck.require("rollout.val_kwargs.temperature", Rule(lambda v: v > 0, "> 0 with val_kwargs.do_sample (False: "
                                                                            "greedy)"))
        from arpo_jax.rollout import sampler

        ck.require("rollout.val_kwargs.top_p", sampler.TOP_P)
        ck.require("rollout.val_kwargs.top_k", sampler.TOP_K)
    elif (ck.get("rollout.val_kwargs.n") or 1) > 1:
        ck.add("rollout.val_kwargs.n", f"{ck.get('rollout.val_kwargs.n')} greedy samples would all be the same",
               "1, or val_kwargs.do_sample=True")
    ck.require("rollout.workers", at_least(0, "0 (one per process) or a positive count"))
    ck.require("rollout.jax.slots", at_least(0, "0 (one worker's trajectories) or a row count"))
    budget, p, r = (ck.get(k) for k in ("rollout.jax.max_tokens_per_call", "data.max_prompt_length",
                                        "data.max_response_length"))
    if budget and p and r and budget < p + r:  # one trajectory's row must fit (the sampler checks its buckets)
        ck.add("rollout.jax.max_tokens_per_call", f"{budget} is less than one trajectory (data.max_prompt_length + "
                                                  f"data.max_response_length = {p + r})", f"0 (no limit) or >= {p + r}")
    else:
        ck.require("rollout.jax.max_tokens_per_call", at_least(0, "0 (no limit) or a token count"))
    if (ck.get("rollout.max_staleness") or 0) > 0 and (process_count or 1) > 1 and ck.get("algorithm.dynamic_sampling"):
        # Dynamic sampling agrees on its extra draws across processes (collectives); from the rollout thread they
        # would interleave with the update's own collectives.
        ck.add("rollout.max_staleness", f"{ck.get('rollout.max_staleness')} with several processes does not support "
               "algorithm.dynamic_sampling", "0, or algorithm.dynamic_sampling=false")
    ck.require("rollout.vllm.gpu_memory_utilization", Rule(lambda v: 0 < v < 1, "0 < x < 1"))
    ck.require("rollout.vllm.cpu_kv_cache_gb", NONNEG)
    ck.require("rollout.vllm.engines", at_least(0, "0 (one per tensor-parallel group of the host's GPUs) or a count"))
    ck.require("rollout.vllm.tensor_parallel_size", at_least(1, ">= 1 (GPUs per engine)"))
    _check_placement(ck)
    workers = ck.get("rollout.workers")
    if workers and process_count and workers % process_count:
        ck.add("rollout.workers", f"{workers} workers cannot be spread evenly over {process_count} processes",
               f"0 or a multiple of {process_count}")
    r = ck.get("data.max_response_length")
    warm = ck.get("rollout.initial_entropy_tokens")
    if ck.get("rollout.enable_dynamic_rollouts") and r and warm and warm >= r:
        ck.add("rollout.initial_entropy_tokens", f"{warm} leaves no room in data.max_response_length={r}",
               f"< {r}")


def _check_placement(ck: _Checker) -> None:
    """rollout.vllm.placement=split: the vLLM engines on engine_gpus GPUs of each host (whole tensor-parallel
    groups), the rest of the host's GPUs for the trainer's mesh."""
    k, tp, engines = (ck.get(f"rollout.vllm.{f}") for f in ("engine_gpus", "tensor_parallel_size", "engines"))
    placement = ck.get("rollout.vllm.placement")
    if placement != "split":
        if k:
            ck.add("rollout.vllm.engine_gpus", f"{k} with rollout.vllm.placement={placement!r} (the engines share "
                   "the trainer's GPUs)", "0, or rollout.vllm.placement=split")
        return
    if ck.get("rollout.engine") != "vllm":
        ck.add("rollout.vllm.placement", f"split with rollout.engine={ck.get('rollout.engine')!r} (the JAX engine "
               "samples on the trainer's own devices)", "colocated, or rollout.engine=vllm")
    host = _gpus_per_host(ck.get("mesh.device"))
    if k is None or k < 1 or k >= host:
        ck.add("rollout.vllm.engine_gpus", f"{k} with rollout.vllm.placement=split",
               f"1 to {host - 1} of a {ck.get('mesh.device')} host's {host} GPUs" if host < 1 << 30 else ">= 1")
    elif tp and tp > 0 and k % tp:
        ck.add("rollout.vllm.engine_gpus", f"{k} GPUs do not hold whole engines of tensor_parallel_size={tp}",
               f"a multiple of rollout.vllm.tensor_parallel_size={tp}")
    elif tp and tp > 0 and engines and engines * tp > k:
        ck.add("rollout.vllm.engines", f"{engines} engines x tensor_parallel_size={tp} need more than "
               f"rollout.vllm.engine_gpus={k} GPUs", f"0 (one per {tp} of them) or at most {k // tp}")


def _gpus_per_host(device: str | None) -> int:
    """GPUs per host of a `mesh.device` GPU type; unbounded for the others (CPU: fake devices stand for GPUs)."""
    from arpo_jax.sharding import DEVICES

    dev = DEVICES.get(device or "")
    return dev.per_host if dev is not None and dev.kind == "gpu" else 1 << 30


def _check_shaping_and_failures(ck: _Checker) -> None:
    """DAPO dynamic sampling / overlong handling (algorithm.*) and failure isolation (rollout.failures.*)."""
    ck.require("algorithm.max_extra_rounds", at_least(0, ">= 0 (extra batches rolled out per step)"))
    r, buffer = ck.get("data.max_response_length"), ck.get("algorithm.overlong_buffer_len")
    if ck.get("algorithm.overlong") == "penalty" and r and buffer is not None and not 0 < buffer <= r:
        ck.add("algorithm.overlong_buffer_len", f"{buffer} with algorithm.overlong=penalty",
               f"1 .. data.max_response_length ({r})")
    ck.require("rollout.failures.max_fraction", UNIT)
    ck.require("rollout.failures.max_skipped_steps", at_least(0, "0 (never stop) or a count"))
    if (ck.get("rollout.failures.trajectory_timeout_s") or 0) > 0 and ck.get("rollout.failures.isolate") is False:
        ck.add("rollout.failures.trajectory_timeout_s", "a wall budget needs rollout.failures.isolate=True "
               "(an over-budget trajectory is isolated)", "0, or rollout.failures.isolate=True")


def _check_tools(ck: _Checker, command: str, check_files: bool) -> None:
    for path in ("tools.max_workers", "tools.retry_count", "tools.python.memory_mb", "tools.search.max_results",
                 "tools.search.result_length"):
        ck.require(path, at_least(1))
    for path in ("tools.timeout_s", "tools.python.timeout_s"):
        ck.require(path, POSITIVE)
    ck.require("tools.python.ready_sandboxes", at_least(0, "an int >= 0 (0 = start each sandbox on demand)"))
    total, python = ck.get("tools.timeout_s"), ck.get("tools.python.timeout_s")
    if ck.get("tools.python.enabled") and total and python and total < python:
        ck.add("tools.timeout_s", f"{total} is shorter than tools.python.timeout_s={python}: the executor would "
                                  "give up before the sandbox kills the program", f">= {python}")
    if not ck.get("tools.search.enabled"):
        return
    backend = ck.get("tools.search.backend")
    if backend == "cache" and not ck.get("tools.search.cache_file"):
        ck.add("tools.search.cache_file", "is empty but the cache backend serves only it", "a reference JSON cache")
    if backend == "local" and not ck.get("tools.search.corpus_file"):
        ck.add("tools.search.corpus_file", "is empty but the local backend searches it", "a JSON-lines corpus")
    if backend == "brightdata":
        env = ck.get("tools.search.api_key_env")
        if not env or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", env):
            # The value is not echoed: it may be the key itself, and messages end up in logs.
            shown = repr(env) if not env else f"the value ({len(env)} characters, not shown)"
            ck.add("tools.search.api_key_env", f"{shown} is not an environment variable name (never put the key "
                                               "itself in a config)", "a name such as BRIGHTDATA_API_KEY")
        elif check_files and command in ("train", "eval") and not os.environ.get(env):
            ck.add("tools.search.api_key_env", f"environment variable {env} is not set",
                   f"export {env}=..., or tools.search.backend=cache|local")


def _check_reused_old_logprob(ck: _Checker, mode: str) -> None:  # exact for the step's one optimizer step only
    if ck.get("actor.recompute_old_logprob") is not False:
        return
    got = [ck.get(f) for f in ("actor.ppo_epochs", "actor.ppo_mini_batch_size", "data.train_batch_size")]
    if got[0] != 1 or got[1] != got[2] or mode != "off":  # "auto" too: a correction with vLLM or stale rollouts
        ck.add("actor.recompute_old_logprob", f"false needs one optimizer step a training step (actor.ppo_epochs=1, "
               f"actor.ppo_mini_batch_size = data.train_batch_size) and no rollout correction (actor."
               f"rollout_correction.mode=off); here {got[0]}, {got[1]} of {got[2]}, {mode}", "true")


def _check_actor(ck: _Checker) -> None:
    ck.require("actor.ppo_mini_batch_size", POSITIVE)
    mode = ck.get("actor.rollout_correction.mode")
    if mode in ("truncate", "mask") and ck.get("rollout.engine") == "vllm" and ck.get("rollout.temperature") != 1:
        # vLLM's raw_logprobs are the temperature-1 distribution; the trainer's old log-probs divide by T.
        ck.add("actor.rollout_correction.mode", f"{mode} with rollout.engine=vllm needs rollout.temperature=1 "
               "(vLLM reports temperature-1 log-probs)", "off | auto")
    _check_reused_old_logprob(ck, mode)
    for path in ("actor.max_token_len_per_device", "critic.warmup_steps"):
        ck.require(path, NONNEG)
    for path in ("algorithm.gamma", "algorithm.lam"):
        ck.require(path, UNIT)
    ck.require("actor.ppo_epochs", at_least(1))
    p, r, budget = ck.get("data.max_prompt_length"), ck.get("data.max_response_length"), \
        ck.get("actor.max_token_len_per_device")
    if p and r and budget and 0 < budget < p + r:
        ck.add("actor.max_token_len_per_device", f"{budget} cannot hold one full trajectory (P + R = {p + r})",
               f"0 (= 2 * (P + R)) or >= {p + r}")
    if ck.get("actor.tree_training") and not ck.get("actor.pack"):
        ck.add("actor.tree_training", "true packs trees into rows: it needs actor.pack=true", "false")
    if ck.get("actor.entropy_adv") and ck.get("actor.reference_compat") and not ck.get("actor.entropy_coef"):
        # Legal (it reproduces the reference, B2), but almost never what someone switching entropy_adv on wants.
        log.warning("actor.entropy_adv has no effect: actor.reference_compat with actor.entropy_coef == 0 (B2)")


def _check_trainer(ck: _Checker) -> None:
    ck.require("trainer.total_epochs", at_least(1))
    ck.require("trainer.keep_checkpoints", at_least(1))
    for name in ("max_steps", "save_freq", "test_freq", "log_trajectories", "time_limit_minutes"):
        ck.require(f"trainer.{name}", NONNEG)
    for logger in ck.get("trainer.loggers") or ():
        if logger not in LOGGERS:
            ck.add("trainer.loggers", f"{logger!r} is not a known logger", knobs.fmt(LOGGERS))


def _check_sft(ck: _Checker, command: str, process_count: int | None) -> None:
    for path in ("sft.cutoff_len", "sft.epochs", "sft.lr", "sft.batch_size"):
        ck.require(path, POSITIVE)
    ck.require("sft.warmup_ratio", Rule(lambda v: 0 <= v < 1, "0 <= x < 1"))
    for path in ("sft.weight_decay", "sft.max_token_len_per_device", "sft.save_freq", "sft.max_steps"):
        ck.require(path, NONNEG)
    cutoff, budget = ck.get("sft.cutoff_len"), ck.get("sft.max_token_len_per_device")
    if cutoff and budget and 0 < budget < cutoff:
        ck.add("sft.max_token_len_per_device", f"{budget} cannot hold one example of sft.cutoff_len={cutoff}",
               f"0 (= cutoff_len) or >= {cutoff}")
    batch = ck.get("sft.batch_size")
    if command == "sft" and batch and process_count and batch % process_count:
        ck.add("sft.batch_size", f"{batch} cannot be split evenly over {process_count} processes",
               f"a multiple of {process_count}")
    if command == "sft" and not ck.get("sft.train_files") and "sft.train_files" not in ck.bad:
        ck.add("sft.train_files", "is empty; `sft` needs conversations", "JSON / JSON-lines / parquet files")


def _check_enums_and_knobs(ck: _Checker) -> None:
    for path, allowed in _direct_enums().items():
        if ck.get("reward.custom_path") and path == "reward.name":
            continue  # a custom reward replaces the registered one
        ck.require(path, knobs.one_of(allowed))
    for cls in _components():
        for path, problem in knobs.problems(cls, {p: v for p, v in ck.flat.items() if p not in ck.bad}):
            ck.add(path, problem)


# --------------------------------------------------------------------------------------------------
# Environment references and files
# --------------------------------------------------------------------------------------------------


def _expand(ck: _Checker, path: str, value: str, strict: bool) -> str:
    """`${VAR}` and `~` expansion; an unset variable is an error only when files are checked."""
    missing = [name for name in _ENV_REF.findall(value) if name not in os.environ]
    if missing:
        if strict:
            ck.add(path, f"environment variable(s) {', '.join(missing)} not set in {value!r}",
                   f"export {missing[0]}=<folder>")
        return value
    value = _ENV_REF.sub(lambda m: os.environ[m.group(1)], value)
    return value if value.startswith(BUILTIN) else os.path.expanduser(value)


def _expand_paths(ck: _Checker, strict: bool) -> None:
    for path in PATH_FIELDS:
        value = ck.get(path)
        if isinstance(value, str):
            ck.flat[path] = _expand(ck, path, value, strict)
        elif isinstance(value, tuple):
            ck.flat[path] = tuple(_expand(ck, path, v, strict) for v in value)



# --------------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------------


def _unflatten(flat: dict[str, Any]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def validate(cfg: ConfigDict, *, device_count: int | None = None, process_count: int | None = None,
             check_files: bool = True, command: str = "train") -> ConfigDict:
    """Checks the whole config and returns a normalised, locked copy; raises one ConfigError listing every problem.

    Args:
      cfg: the experiment config (from `load_config`, or any ConfigDict / dict with the schema's fields).
      device_count: when given, mesh.shape must fit exactly that many devices (-1 filling the rest).
      process_count: when given, batches must split evenly over that many processes.
      check_files: expand `${VAR}` (an unset variable is then an error) and check that the files and folders
        `command` needs exist, and that the search API key's environment variable is set.
      command: train | sft | eval; which inputs are required.

    Returns:
      A copy with `${VAR}` / `~` expanded in path fields, lists as tuples, ints in float fields as floats.
    """
    if command not in COMMANDS:
        raise ValueError(f"command {command!r}; allowed: {knobs.fmt(COMMANDS)}")
    ck = _Checker(_leaves(to_dict(cfg)))
    schema = _schema()
    if schema is not None:
        _check_types(ck, schema)
    _expand_paths(ck, strict=check_files)
    _check_enums_and_knobs(ck)
    _check_model(ck)
    _check_mesh(ck, device_count)
    _check_data(ck, command, process_count)
    _check_rollout(ck, command, process_count)
    _check_tools(ck, command, check_files)
    _check_shaping_and_failures(ck)
    _check_actor(ck)
    _check_trainer(ck)
    _check_sft(ck, command, process_count)
    if check_files:
        config_files.check_files(ck, command)
    if ck.problems:
        raise ConfigError(ck.problems)
    out = ConfigDict(_unflatten(ck.flat))
    out.lock()
    return out


def check_tokenizer(tokenizer: Any, cfg: ConfigDict | None = None) -> None:
    """The tool tags must survive encode -> decode: the loop finds calls and results by their text.

    Accepts a `transformers` tokenizer or a `tokenizers.Tokenizer`. Raises ConfigError naming model.tokenizer.
    """
    where = (cfg.model.tokenizer or cfg.model.path) if cfg is not None else "the tokenizer"
    problems = []
    for text in (*TOOL_TAGS, "".join(TOOL_TAGS)):
        decoded = _roundtrip(tokenizer, text)
        if decoded != text:
            problems.append(f"model.tokenizer: {text!r} does not round-trip through {where!r} (decodes to "
                            f"{decoded!r}) (allowed: a tokenizer that encodes the tool tags losslessly, e.g. the "
                            "policy's own)")
    if problems:
        raise ConfigError(problems)


def _roundtrip(tokenizer: Any, text: str) -> str:
    encoded = tokenizer.encode(text, add_special_tokens=False)
    ids = getattr(encoded, "ids", encoded)  # tokenizers.Encoding vs a list of ints
    return tokenizer.decode(ids, skip_special_tokens=False)
