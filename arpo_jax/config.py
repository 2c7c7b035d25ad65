"""Loading, validating and summarising experiment configs (``arpo_jax/configs/*.py``, ml_collections).

``load_config(["--config=builtin:toy_cpu", "--config.rollout.n=16"])`` goes through the real ``config_flags`` parser
(the same syntax as every flax example; ``builtin:NAME`` is a file shipped in ``arpo_jax/configs/``).
``validate(cfg)`` checks every field against the schema in ``arpo_jax/configs/base.py`` (types), the allowed values
the code accepts (taken from the modules that use them), ranges, cross-field rules and the files a command needs,
and raises one ``ConfigError`` listing every problem as ``field.path: problem (allowed: ...)``, so a bad launch fails
in a second with all of its mistakes at once, before any device is touched. ``redact`` makes a loggable copy;
``jax_mem_fraction`` is the GPU share the launch scripts give JAX.
"""

from __future__ import annotations

import copy
import functools
import glob
import importlib.util
import json
import logging
import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from absl import flags
from ml_collections import ConfigDict, config_flags

from arpo_jax import named_models

log = logging.getLogger(__name__)

BUILTIN = "builtin:"  # prefix of generated inputs (builtin:tiny model, builtin:toy data / corpus): no file to check
COMMANDS = ("train", "sft", "eval")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
TOOL_TAGS = ("<python>", "</python>", "<search>", "</search>", "<result>", "</result>", "<answer>", "</answer>")
REDACTED = "***redacted***"

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
# Loading
# --------------------------------------------------------------------------------------------------


def _is_config_arg(arg: str) -> bool:
    """`--config`, `--config=...`, `--config.a.b=...` and `--noconfig.a.b` (absl accepts one or two dashes)."""
    return re.match(r"^--?(config(=|$|\.)|noconfig\.)", arg) is not None


BUILTIN_CONFIGS = Path(__file__).resolve().parent / "configs"  # shipped with the package: arpo_jax/configs/*.py


def builtin_configs() -> list[str]:
    """Names accepted as `--config=builtin:NAME`: the experiment files shipped in arpo_jax/configs/."""
    return sorted(p.stem for p in BUILTIN_CONFIGS.glob("*.py") if p.stem != "__init__")


def config_file(spec: str) -> str:
    """The config file of `spec`: `builtin:NAME[:ARG]` -> the shipped arpo_jax/configs/NAME.py[:ARG]; a path as is."""
    if not spec.startswith(BUILTIN):
        return spec
    name, _, arg = spec[len(BUILTIN):].partition(":")
    if name not in builtin_configs():
        raise ValueError(f"--config={spec}: no built-in config {name!r}; allowed: "
                         f"{', '.join(f'builtin:{n}' for n in builtin_configs())}, or a path to a .py file")
    return str(BUILTIN_CONFIGS / f"{name}.py") + (f":{arg}" if arg else "")


def _resolve_builtin(config_args: list[str]) -> list[str]:
    """`--config=builtin:NAME` / `--config builtin:NAME` with the shipped file's path."""
    out = list(config_args)
    for i, arg in enumerate(out):
        if re.match(r"^--?config=", arg):
            flag, value = arg.split("=", 1)
            out[i] = f"{flag}={config_file(value)}"
        elif re.match(r"^--?config$", arg) and i + 1 < len(out):
            out[i + 1] = config_file(out[i + 1])
    return out


def split_config_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Splits argv into the config arguments (with their space-separated values) and the rest.

    `--config path` and `--config.x.y value` take the next token as their value when it does not start with "-";
    a bare `--config.flag` followed by a positional argument must therefore be written `--config.flag=true`.
    """
    config_args, rest = [], []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":  # absl stops parsing flags here; keep everything after it for the caller
            rest.extend(args[i:])
            break
        if not _is_config_arg(arg):
            rest.append(arg)
        elif "=" in arg or arg.startswith(("-noconfig.", "--noconfig.")) or i + 1 == len(args) \
                or args[i + 1].startswith("-"):
            config_args.append(arg)
        else:
            config_args.extend(args[i:i + 2])
            i += 1
        i += 1
    return _resolve_builtin(config_args), rest


def _parse_with_absl(config_args: list[str]) -> ConfigDict:
    """Runs ml_collections' config_flags on a fresh FlagValues (no global absl state is touched)."""
    fv = flags.FlagValues()
    argv = ["arpo-jax", *config_args]
    # sys_argv: config_flags finds the overrides to define in this list instead of the process's sys.argv.
    config_flags.DEFINE_config_file("config", None, "experiment config file", flag_values=fv, sys_argv=argv)
    fv(argv)
    cfg = fv.config
    if cfg is None:
        raise ValueError(f"no config file given; pass --config=builtin:<name> ({', '.join(builtin_configs())}) "
                         "or --config=path/to/file.py")
    if not isinstance(cfg, ConfigDict):
        cfg.keys()  # config_flags defers a load failure to the first access: this raises it (OSError)
        raise ValueError(f"get_config() returned a {type(cfg).__name__}, not a ConfigDict")
    return cfg


def _unknown_overrides(config_args: list[str]) -> list[str]:
    """Names every `--config.a.b` override whose field does not exist in the loaded config file."""
    files = [a for a in config_args if re.match(r"^--?config(=|$)", a)]
    if not files:
        return []
    path_arg = files[-1].split("=", 1)[1] if "=" in files[-1] else config_args[config_args.index(files[-1]) + 1]
    base = _parse_with_absl([f"--config={path_arg}"])
    problems = []
    for arg in config_args:
        match = re.match(r"^--?(?:no)?config\.([^=]+)", arg)
        if match and not _has_field(base, match.group(1)):
            problems.append(_unknown_field_message(base, match.group(1)))
    return problems


def _unknown_field_message(cfg: ConfigDict, path: str) -> str:
    """Names the first part of `path` that does not exist and what exists at that level."""
    node = cfg
    for part in path.split("."):
        if not isinstance(node, ConfigDict):
            return f"{path}: unknown config field {part!r} (allowed: none, the parent is a value, not a section)"
        if part not in node:
            return f"{path}: unknown config field {part!r} (allowed: {', '.join(sorted(node.keys()))})"
        node = node[part]
    return f"{path}: unknown config field"


def parse_config_args(argv: Sequence[str]) -> tuple[ConfigDict, list[str]]:
    """Loads `--config=FILE[:arg]` (or `builtin:NAME[:arg]`) with its `--config.a.b=v` overrides; returns
    (config, other args).

    Errors from absl / ml_collections (missing file, unknown field, a value of the wrong type) become a
    ``ValueError`` whose message names the argument.
    """
    config_args, rest = split_config_args(argv)
    if not any(re.match(r"^--?config(=|$)", a) for a in config_args):
        raise ValueError(f"no config file given; pass --config=builtin:<name> ({', '.join(builtin_configs())}) "
                         "or --config=path/to/file.py")
    try:
        cfg = _parse_with_absl(config_args)
    except (AttributeError, KeyError) as e:  # config_flags reports an unknown override as a bare attribute error
        try:
            problems = _unknown_overrides(config_args)
        except Exception:  # the config file itself is broken: report the original error
            problems = []
        raise ValueError("; ".join(problems) or f"config error: {type(e).__name__}: {e}") from None
    except flags.Error as e:
        raise ValueError(f"config argument error: {e}") from None
    except OSError as e:  # config_flags defers a missing file to the first access of the config
        raise ValueError(f"cannot load the config file: {' '.join(str(e).split())}") from None
    except SyntaxError as e:
        raise ValueError(f"the config file has a syntax error: {e.filename}:{e.lineno}: {e.msg}") from None
    except Exception as e:  # the file's own code (get_config() or a module-level statement) raised
        where = _config_file_arg(config_args)
        raise ValueError(f"the config file {where} failed to load: {type(e).__name__}: {e}") from None
    return cfg, rest


def _config_file_arg(config_args: list[str]) -> str:
    """The `--config=FILE[:ARG]` value (for messages)."""
    for i, a in enumerate(config_args):
        if re.match(r"^--?config$", a) and i + 1 < len(config_args):
            return config_args[i + 1]
        if re.match(r"^--?config=", a):
            return a.split("=", 1)[1]
    return "?"


def load_config(argv: Sequence[str]) -> ConfigDict:
    """Like `parse_config_args`, but every argument must belong to the config; returns the locked ConfigDict."""
    cfg, rest = parse_config_args(argv)
    if rest:
        raise ValueError(f"unrecognised arguments (not --config / --config.*): {' '.join(rest)}")
    return cfg


# --------------------------------------------------------------------------------------------------
# Small helpers over dotted paths and the schema
# --------------------------------------------------------------------------------------------------


def _get(cfg: Any, path: str) -> Any:
    for part in path.split("."):
        cfg = cfg[part]
    return cfg


def _has_field(cfg: Any, path: str) -> bool:
    try:
        _get(cfg, path)
    except (KeyError, AttributeError, TypeError):
        return False
    return True


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


def _to_dict(cfg: Any) -> dict:
    return cfg.to_dict() if isinstance(cfg, ConfigDict) else copy.deepcopy(dict(cfg))


@functools.cache
def _schema() -> dict[str, Any] | None:
    """Flat defaults of arpo_jax/arpo_jax/configs/base.py: the schema (field set and types)."""
    from arpo_jax.configs import base

    return _leaves(base.get_config().to_dict())


@functools.cache
def _allowed() -> dict[str, tuple]:
    """Enum fields and their allowed values, from the modules that consume them (imported lazily: they pull JAX)."""
    from arpo_jax import algos, memory_model, packing, rewards, shaping, sharding, tools, train_step
    from arpo_jax.models import transformer

    return {
        "model.dtype": transformer.DTYPES,
        "model.param_dtype": transformer.DTYPES,
        "model.remat": tuple(transformer.REMAT_POLICIES),
        "model.attention_impl": ("", *(a for a in transformer.ATTENTION_IMPLS if a)),  # "" = JAX picks
        "mesh.rules": tuple(sharding.RULES),
        "mesh.device": tuple(memory_model.DEVICES),
        "data.source": ("parquet", "tfds"),
        "data.overlong_prompts": ("error", "filter"),
        "rollout.engine": ("jax", "vllm"),
        "rollout.rule": ("arpo", "aepo"),
        "rollout.vllm.dtype": ("auto", "bfloat16", "float16", "float32"),
        "tools.search.backend": tuple(tools._SEARCH_BACKENDS),
        "reward.name": (*rewards.REWARDS, "auto"),
        "algorithm.adv_estimator": (*algos.ADVANTAGE_ESTIMATORS, "gae"),  # gae: PPO with a critic (trainer)
        "algorithm.overlong": shaping.OVERLONG_MODES,
        "actor.loss": tuple(algos.POLICY_LOSSES),
        "actor.agg_mode": packing.AGG_MODES,
        "actor.micro_norm": packing.MICRO_NORMS,
        "actor.kl_kind": algos.KL_KINDS,
        "actor.rollout_correction.mode": ("auto", *algos.ROLLOUT_CORRECTION_MODES),  # auto: see components
        "actor.rollout_correction.level": algos.ROLLOUT_CORRECTION_LEVELS,
        "actor.schedule": train_step.SCHEDULES,
        "sft.schedule": train_step.SCHEDULES,
    }


def _fmt(values: Sequence) -> str:
    return " | ".join(repr(v) if v == "" else str(v) for v in values)


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

    def require(self, path: str, ok: Callable[[Any], bool], allowed: str) -> None:
        """Range check: reports `path` when its value exists and `ok(value)` is false."""
        value = self.get(path)
        if value is not None and not ok(value):
            self.add(path, f"{value!r} is out of range", allowed)

    def one_of(self, path: str, allowed: Sequence) -> None:
        value = self.get(path)
        if value is not None and value not in allowed:
            self.add(path, f"{value!r} is not a known value", _fmt(allowed))


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
        ck.add(path, "unknown field (not defined in arpo_jax/configs/base.py; a typo?)", ", ".join(siblings) or None)
    for path in sorted(set(schema) - set(ck.flat)):
        ck.add(path, "missing (arpo_jax/configs/base.py defines it)", f"any {_type_name(schema[path])}")
    for path, default in schema.items():
        if path in ck.flat and path not in ck.bad:
            ck.flat[path] = _check_leaf_type(ck, path, ck.flat[path], default)


# --------------------------------------------------------------------------------------------------
# Value checks, one small function per section
# --------------------------------------------------------------------------------------------------

_POS = "> 0"
_NONNEG = ">= 0"
_UNIT = "0 <= x <= 1"


def _pos(v) -> bool:
    return v > 0


def _nonneg(v) -> bool:
    return v >= 0


def _unit(v) -> bool:
    return 0 <= v <= 1


def _check_model(ck: _Checker) -> None:
    if not ck.get("model.path") and not ck.get("model.init_checkpoint"):
        ck.add("model.path", "neither model.path nor model.init_checkpoint is set",
               "an HF folder | builtin:tiny, or model.init_checkpoint")
    if not ck.get("model.path") and not ck.get("model.tokenizer"):
        ck.add("model.tokenizer", "no tokenizer: model.tokenizer and model.path are both empty", "a tokenizer folder")
    _check_lora(ck)


def _check_lora(ck: _Checker) -> None:
    from arpo_jax.models.transformer import LORA_TARGETS

    ck.require("model.lora.rank", _nonneg, "an int >= 0 (0 = off)")
    if not ck.get("model.lora.rank"):
        if ck.get("model.lora.adapter"):
            ck.add("model.lora.adapter", "a PEFT adapter needs LoRA on", "set model.lora.rank > 0")
        return
    ck.require("model.lora.alpha", _pos, _POS)
    ck.require("model.lora.dropout", lambda v: v == 0, "0.0 (adapter dropout is not implemented)")
    targets = ck.get("model.lora.targets")
    if targets is not None and (not targets or not set(targets) <= set(LORA_TARGETS)):
        ck.add("model.lora.targets", f"{tuple(targets)!r} is not a non-empty set of projections", _fmt(LORA_TARGETS))
    if ck.get("model.ref_on_host"):
        ck.add("model.ref_on_host", "with LoRA the reference is the base itself (no copy to put on the host)",
               "False")


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
    for path in ("data.max_prompt_length", "data.max_response_length", "data.train_batch_size"):
        ck.require(path, _pos, _POS)
    for path in ("data.val_batch_size", "data.val_max_samples", "data.seed", "seed"):
        ck.require(path, _nonneg, _NONNEG)
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
    ck.require("rollout.initial_rollouts", lambda v: v >= 1, ">= 1")
    if n is not None and m is not None and m >= 1 and n < m:
        ck.add("rollout.n", f"{n} is smaller than rollout.initial_rollouts={m}", f">= initial_rollouts ({m})")
    if command == "train" and n is not None and n < 2 and "rollout.n" not in ck.bad:
        ck.add("rollout.n", f"{n}: a group of one trajectory has no group baseline", ">= 2")
    for path in ("rollout.beam_size", "rollout.initial_entropy_tokens", "rollout.entropy_window",
                 "rollout.entropy_top_k", "rollout.jax.decode_chunk", "rollout.jax.prefill_chunk"):
        ck.require(path, lambda v: v >= 1, ">= 1")
    ck.require("rollout.branch_probability", _unit, _UNIT)
    ck.require("rollout.top_p", lambda v: 0 < v <= 1, "0 < top_p <= 1")
    ck.require("rollout.temperature", _pos, "> 0 (training samples; log-probs divide by it)")
    ck.require("rollout.top_k", lambda v: v == -1 or v >= 1, "-1 (off) or >= 1")
    ck.require("rollout.consecutive_penalty", _nonneg, _NONNEG)
    ck.require("rollout.val_kwargs.n", lambda v: v >= 1, ">= 1 (samples per validation prompt)")
    if ck.get("rollout.val_kwargs.do_sample"):
        ck.require("rollout.val_kwargs.temperature", _pos, "> 0 with val_kwargs.do_sample (False: greedy)")
        ck.require("rollout.val_kwargs.top_p", lambda v: 0 < v <= 1, "0 < top_p <= 1")
        ck.require("rollout.val_kwargs.top_k", lambda v: v == -1 or v >= 1, "-1 (off) or >= 1")
    elif (ck.get("rollout.val_kwargs.n") or 1) > 1:
        ck.add("rollout.val_kwargs.n", f"{ck.get('rollout.val_kwargs.n')} greedy samples would all be the same",
               "1, or val_kwargs.do_sample=True")
    ck.require("rollout.workers", _nonneg, "0 (one per process) or a positive count")
    budget, p, r = (ck.get(k) for k in ("rollout.jax.max_tokens_per_call", "data.max_prompt_length",
                                        "data.max_response_length"))
    if budget and p and r and budget < p + r:  # one trajectory's row must fit (the sampler checks its buckets)
        ck.add("rollout.jax.max_tokens_per_call", f"{budget} is less than one trajectory (data.max_prompt_length + "
                                                  f"data.max_response_length = {p + r})", f"0 (no limit) or >= {p + r}")
    else:
        ck.require("rollout.jax.max_tokens_per_call", _nonneg, "0 (no limit) or a token count")
    ck.require("rollout.max_staleness", _nonneg, "0 (synchronous) | 1 (one step off-policy) | 2 | ...")
    if (ck.get("rollout.max_staleness") or 0) > 0 and (process_count or 1) > 1 and ck.get("algorithm.dynamic_sampling"):
        # Dynamic sampling agrees on its extra draws across processes (collectives); from the rollout thread they
        # would interleave with the update's own collectives.
        ck.add("rollout.max_staleness", f"{ck.get('rollout.max_staleness')} with several processes does not support "
               "algorithm.dynamic_sampling", "0, or algorithm.dynamic_sampling=false")
    ck.require("rollout.vllm.gpu_memory_utilization", lambda v: 0 < v < 1, "0 < x < 1")
    ck.require("rollout.vllm.cpu_kv_cache_gb", _nonneg, _NONNEG)
    ck.require("rollout.vllm.engines", _nonneg, "0 (one per tensor-parallel group of the host's GPUs) or a count")
    ck.require("rollout.vllm.tensor_parallel_size", lambda v: v >= 1, ">= 1 (GPUs per engine)")
    workers = ck.get("rollout.workers")
    if workers and process_count and workers % process_count:
        ck.add("rollout.workers", f"{workers} workers cannot be spread evenly over {process_count} processes",
               f"0 or a multiple of {process_count}")
    r = ck.get("data.max_response_length")
    warm = ck.get("rollout.initial_entropy_tokens")
    if ck.get("rollout.enable_dynamic_rollouts") and r and warm and warm >= r:
        ck.add("rollout.initial_entropy_tokens", f"{warm} leaves no room in data.max_response_length={r}",
               f"< {r}")


def _check_shaping_and_failures(ck: _Checker) -> None:
    """DAPO dynamic sampling / overlong handling (algorithm.*) and failure isolation (rollout.failures.*)."""
    ck.require("algorithm.max_extra_rounds", _nonneg, ">= 0 (extra batches rolled out per step)")
    ck.require("algorithm.overlong_penalty_factor", _nonneg, _NONNEG)
    r, buffer = ck.get("data.max_response_length"), ck.get("algorithm.overlong_buffer_len")
    if ck.get("algorithm.overlong") == "penalty" and r and buffer is not None and not 0 < buffer <= r:
        ck.add("algorithm.overlong_buffer_len", f"{buffer} with algorithm.overlong=penalty",
               f"1 .. data.max_response_length ({r})")
    ck.require("rollout.failures.trajectory_timeout_s", _nonneg, "0 (none) or seconds")
    ck.require("rollout.failures.max_fraction", _unit, _UNIT)
    ck.require("rollout.failures.max_skipped_steps", _nonneg, "0 (never stop) or a count")
    if (ck.get("rollout.failures.trajectory_timeout_s") or 0) > 0 and ck.get("rollout.failures.isolate") is False:
        ck.add("rollout.failures.trajectory_timeout_s", "a wall budget needs rollout.failures.isolate=True "
               "(an over-budget trajectory is isolated)", "0, or rollout.failures.isolate=True")


def _check_tools(ck: _Checker, command: str, check_files: bool) -> None:
    ck.require("tools.call_limit", _nonneg, _NONNEG)
    for path in ("tools.max_workers", "tools.retry_count", "tools.python.memory_mb", "tools.search.max_results",
                 "tools.search.result_length"):
        ck.require(path, lambda v: v >= 1, ">= 1")
    for path in ("tools.timeout_s", "tools.python.timeout_s"):
        ck.require(path, _pos, _POS)
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


def _check_actor(ck: _Checker) -> None:
    for path in ("actor.lr", "actor.max_grad_norm", "actor.ppo_mini_batch_size", "actor.logprob_chunk",
                 "critic.lr", "critic.cliprange_value"):
        ck.require(path, _pos, _POS)
    for path in ("actor.clip_low", "actor.clip_high"):
        ck.require(path, lambda v: 0 <= v < 1, "0 <= clip < 1")
    ck.require("actor.clip_c", lambda v: v > 1, "> 1")
    ck.require("actor.rollout_correction.threshold", lambda v: v > 1, "> 1")
    mode = ck.get("actor.rollout_correction.mode")
    if mode in ("truncate", "mask") and ck.get("rollout.engine") == "vllm" and ck.get("rollout.temperature") != 1:
        # vLLM's raw_logprobs are the temperature-1 distribution; the trainer's old log-probs divide by T.
        ck.add("actor.rollout_correction.mode", f"{mode} with rollout.engine=vllm needs rollout.temperature=1 "
               "(vLLM reports temperature-1 log-probs)", "off | auto")
    for path in ("actor.kl_coef", "actor.entropy_coef", "actor.entropy_adv_alpha", "actor.weight_decay",
                 "actor.warmup_steps", "actor.max_token_len_per_device", "critic.warmup_steps"):
        ck.require(path, _nonneg, _NONNEG)
    for path in ("actor.min_lr_ratio", "algorithm.gamma", "algorithm.lam"):
        ck.require(path, _unit, _UNIT)
    ck.require("actor.ppo_epochs", lambda v: v >= 1, ">= 1")
    p, r, budget = ck.get("data.max_prompt_length"), ck.get("data.max_response_length"), \
        ck.get("actor.max_token_len_per_device")
    if p and r and budget and 0 < budget < p + r:
        ck.add("actor.max_token_len_per_device", f"{budget} cannot hold one full trajectory (P + R = {p + r})",
               f"0 (= 2 * (P + R)) or >= {p + r}")
    if ck.get("actor.tree_training") and ck.get("algorithm.adv_estimator") == "gae":
        ck.add("actor.tree_training", "true does not support a critic (algorithm.adv_estimator=gae) yet", "false")
    if ck.get("actor.tree_training") and not ck.get("actor.pack"):
        ck.add("actor.tree_training", "true packs trees into rows: it needs actor.pack=true", "false")
    if ck.get("actor.entropy_adv") and ck.get("actor.reference_compat") and not ck.get("actor.entropy_coef"):
        # Legal (it reproduces the reference, B2), but almost never what someone switching entropy_adv on wants.
        log.warning("actor.entropy_adv has no effect: actor.reference_compat with actor.entropy_coef == 0 (B2)")


def _check_trainer(ck: _Checker) -> None:
    ck.require("trainer.total_epochs", lambda v: v >= 1, ">= 1")
    ck.require("trainer.keep_checkpoints", lambda v: v >= 1, ">= 1")
    for path in ("trainer.max_steps", "trainer.save_freq", "trainer.test_freq", "trainer.log_trajectories"):
        ck.require(path, _nonneg, _NONNEG)
    for logger in ck.get("trainer.loggers") or ():
        if logger not in LOGGERS:
            ck.add("trainer.loggers", f"{logger!r} is not a known logger", _fmt(LOGGERS))


def _check_sft(ck: _Checker, command: str, process_count: int | None) -> None:
    for path in ("sft.cutoff_len", "sft.epochs", "sft.lr", "sft.batch_size"):
        ck.require(path, _pos, _POS)
    ck.require("sft.warmup_ratio", lambda v: 0 <= v < 1, "0 <= x < 1")
    for path in ("sft.weight_decay", "sft.max_token_len_per_device", "sft.save_freq", "sft.max_steps"):
        ck.require(path, _nonneg, _NONNEG)
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


def _check_enums(ck: _Checker) -> None:
    for path, allowed in _allowed().items():
        if ck.get("reward.custom_path") and path == "reward.name":
            continue  # a custom reward replaces the registered one
        ck.one_of(path, allowed)


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


def _file_exists(name: str) -> bool:
    return bool(glob.glob(name)) if any(c in name for c in "*?[") else os.path.exists(name)


def _check_file_list(ck: _Checker, path: str) -> None:
    if ck.get("data.source") == "tfds" and path.startswith("data."):
        return  # tfds builder names, not files
    for name in ck.get(path) or ():
        if not name.startswith(BUILTIN) and not _file_exists(name):
            ck.add(path, f"file {name!r} does not exist", "existing files, globs or builtin:<name>")
        elif path.startswith("data.") and name.endswith(".parquet") and ck.get("data.source") != "tfds":
            from arpo_jax.data import rl_dataset

            for f in sorted(glob.glob(name)):  # the footer only: a bad file is found before any model is built
                problem = rl_dataset.check_parquet(f, ck.get("data.prompt_key") or "prompt")
                if problem:
                    ck.add(path, problem, "parquet files in the reference schema (data_source, prompt, "
                                          "reward_model, extra_info)")


def _check_model_files(ck: _Checker, command: str) -> None:
    model = ck.get("model.path")
    if command in ("train", "eval") and not ck.get("model.init_checkpoint"):
        from arpo_jax import runtime  # the builtin tiny model's shape lives there

        if model == runtime.BUILTIN_TINY:
            _check_positions(ck, runtime.TINY_MAX_POSITIONS)
    if model and not model.startswith(BUILTIN):
        allowed = f"an HF folder | a .gguf file | a model name ({', '.join(named_models.NAMED)}) | builtin:tiny"
        if named_models.is_gguf(model) and not named_models.is_named(model) and not Path(model).is_file():
            ck.add("model.path", f"{model!r}: no such GGUF file", allowed)
            return
        folder = named_models.cache_folder(model) or Path(model)
        config_json = folder / "config.json"
        if config_json.is_file():
            _check_context_length(ck, config_json)
        elif folder == Path(model):  # named models and GGUF files are converted when loaded
            ck.add("model.path", f"{model!r} is not a model folder (no config.json)", allowed)
    tokenizer = ck.get("model.tokenizer")
    if tokenizer and not tokenizer.startswith(BUILTIN) and not Path(tokenizer).is_dir():
        ck.add("model.tokenizer", f"{tokenizer!r} is not a folder", "a folder with tokenizer files")
    init = ck.get("model.init_checkpoint")
    if init and not Path(init).is_dir():
        ck.add("model.init_checkpoint", f"{init!r} is not a directory", "an orbax checkpoint directory")


def _check_context_length(ck: _Checker, config_json: Path) -> None:
    """P + R must fit the model's positions (RoPE tables beyond them are extrapolation the model never saw)."""
    try:
        limit = json.loads(config_json.read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return
    _check_positions(ck, limit)


def _check_positions(ck: _Checker, limit: Any) -> None:
    p, r = ck.get("data.max_prompt_length"), ck.get("data.max_response_length")
    if isinstance(limit, int) and p and r and p + r > limit:
        ck.add("data.max_response_length", f"P + R = {p + r} exceeds the model's max_position_embeddings={limit}",
               f"P + R <= {limit}")


def _check_files(ck: _Checker, command: str) -> None:
    _check_model_files(ck, command)
    if command in ("train", "sft") and "wandb" in (ck.get("trainer.loggers") or ()) \
            and importlib.util.find_spec("wandb") is None:
        ck.add("trainer.loggers", "includes 'wandb' but wandb is not installed",
               "pip install arpo-jax[wandb], or drop 'wandb'")
    lists = {"train": ("data.train_files", "data.val_files"), "sft": ("sft.train_files", "sft.val_files"),
             "eval": ("data.val_files",)}[command]
    for path in lists:
        _check_file_list(ck, path)
    search = ck.get("tools.search.enabled") and ck.get("tools.search.backend")
    cache = ck.get("tools.search.cache_file")
    if search == "cache" and cache and not Path(cache).is_file():
        ck.add("tools.search.cache_file", f"{cache!r} does not exist", "a reference JSON cache file")
    if search == "brightdata" and cache and not Path(cache).parent.is_dir():
        ck.add("tools.search.cache_file", f"the folder of {cache!r} does not exist", "a path in an existing folder")
    corpus = ck.get("tools.search.corpus_file")
    if search == "local" and corpus and not corpus.startswith(BUILTIN) and not Path(corpus).is_file():
        ck.add("tools.search.corpus_file", f"{corpus!r} does not exist", "a JSON-lines file | builtin:toy")
    custom = ck.get("reward.custom_path")
    if custom and not Path(custom).is_file():
        ck.add("reward.custom_path", f"{custom!r} does not exist", "a Python file")
    for path in ("rollout.vllm.python", "tools.python.python_path"):
        exe = ck.get(path)
        if exe and not os.access(exe, os.X_OK):
            ck.add(path, f"{exe!r} is not an executable", "a Python interpreter, or '' for this one")


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
      cfg: the experiment config (from `load_config`, or any ConfigDict / dict with the base.py fields).
      device_count: when given, mesh.shape must fit exactly that many devices (-1 filling the rest).
      process_count: when given, batches must split evenly over that many processes.
      check_files: expand `${VAR}` (an unset variable is then an error) and check that the files and folders
        `command` needs exist, and that the search API key's environment variable is set.
      command: train | sft | eval; which inputs are required.

    Returns:
      A copy with `${VAR}` / `~` expanded in path fields, lists as tuples, ints in float fields as floats.
    """
    if command not in COMMANDS:
        raise ValueError(f"command {command!r}; allowed: {_fmt(COMMANDS)}")
    ck = _Checker(_leaves(_to_dict(cfg)))
    schema = _schema()
    if schema is not None:
        _check_types(ck, schema)
    _expand_paths(ck, strict=check_files)
    _check_enums(ck)
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
        _check_files(ck, command)
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


def _is_secret_key(key: str) -> bool:
    """api_key / apikey / secret / password anywhere in the name, or `token` as its last word (not tokenizer);
    camelCase names count as snake_case (authToken = auth_token)."""
    words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", str(key)).lower().replace("-", "_").split("_")
    joined = "_".join(words)
    return ("api_key" in joined or "apikey" in words or "secret" in joined or "password" in joined
            or "passwd" in words or words[-1] == "token")


# Values shaped like real credentials (OpenAI / HF / GitHub / Slack / AWS) are hidden under any key.
_SECRET_VALUE = re.compile(r"^(sk-|hf_|ghp_|gho_|github_pat_|xox[abp]-|AKIA)[A-Za-z0-9_\-]{16,}$")
_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


def _redact_value(key: str, value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _redact_value(k, v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_redact_value(key, v) for v in value)
    if not isinstance(value, str) or not value:
        return value
    if _SECRET_VALUE.match(value):
        return REDACTED
    if _is_secret_key(key):
        # Names of environment variables (api_key_env = "BRIGHTDATA_API_KEY") are not secrets; anything else is.
        is_env_name = key.lower().endswith("_env") and _ENV_NAME.match(value)
        return value if is_env_name else REDACTED
    return value


def redact(cfg: ConfigDict | dict) -> dict:
    """A plain nested dict of the config for dumps and logs, with credential-looking values replaced.

    The package's one redaction: the metrics logger applies it again to what it writes (config.json, W&B)."""
    return {k: _redact_value(k, v) for k, v in _to_dict(cfg).items()}


__all__ = ["BUILTIN", "ConfigError", "PATH_FIELDS", "TOOL_TAGS", "check_tokenizer", "load_config",
           "parse_config_args", "redact", "split_config_args", "validate"]
