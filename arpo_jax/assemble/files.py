"""The file checks of ``arpo_jax.assemble.validate``: the model, data, corpus, cache and interpreters a command needs
exist (and the model's context holds P + R), so a wrong path fails at launch, named by its field."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from arpo_jax.config.args import BUILTIN
from arpo_jax.weights import named_models

# `ck` below is assemble.validate's checker: `get(path)` (None when missing or already reported), `add(path, problem,
# allowed)` and `bad` (the reported paths).


def _file_exists(name: str) -> bool:
    return bool(glob.glob(name)) if any(c in name for c in "*?[") else os.path.exists(name)


def _fetch_or(allowed: str, name: str) -> str:
    """A missing file of the data manifest (`$ARPO_DATA/rl/train_10k.parquet`, ...): the command that fetches it."""
    from arpo_jax.data import manifest

    hint = manifest.fetch_hint(name)
    return f"{hint} writes it; or {allowed}" if hint else allowed


def _check_file_list(ck, path: str) -> None:
    if ck.get("data.source") == "tfds" and path.startswith("data."):
        return  # tfds builder names, not files
    for name in ck.get(path) or ():
        if not name.startswith(BUILTIN) and not _file_exists(name):
            ck.add(path, f"file {name!r} does not exist", _fetch_or("existing files, globs or builtin:<name>", name))
        elif path.startswith("data.") and name.endswith(".parquet") and ck.get("data.source") != "tfds":
            from arpo_jax.data import sources

            for f in sorted(glob.glob(name)):  # the footer only: a bad file is found before any model is built
                problem = sources.check_parquet(f, ck.get("data.prompt_key") or "prompt")
                if problem:
                    ck.add(path, problem, "parquet files in the reference schema (data_source, prompt, "
                                          "reward_model, extra_info)")


def _check_model_files(ck, command: str) -> None:
    model = ck.get("model.path")
    if command in ("train", "eval") and not ck.get("model.init_checkpoint"):
        from arpo_jax.assemble import policy as policy_lib  # the builtin tiny model's shape lives there

        if model == policy_lib.BUILTIN_TINY:
            check_positions(ck, policy_lib.TINY_MAX_POSITIONS)
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


def _check_context_length(ck, config_json: Path) -> None:
    """P + R must fit the model's positions (RoPE tables beyond them are extrapolation the model never saw)."""
    try:
        limit = json.loads(config_json.read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return
    check_positions(ck, limit)


def check_positions(ck, limit: Any) -> None:
    p, r = ck.get("data.max_prompt_length"), ck.get("data.max_response_length")
    if isinstance(limit, int) and p and r and p + r > limit:
        ck.add("data.max_response_length", f"P + R = {p + r} exceeds the model's max_position_embeddings={limit}",
               f"P + R <= {limit}")


def check_files(ck, command: str) -> None:
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
        ck.add("tools.search.cache_file", f"{cache!r} does not exist", _fetch_or("a reference JSON cache file", cache))
    if search == "brightdata" and cache and not Path(cache).parent.is_dir():
        ck.add("tools.search.cache_file", f"the folder of {cache!r} does not exist",
               _fetch_or("a path in an existing folder", cache))
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
