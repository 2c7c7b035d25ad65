"""The policy of a config, as the RL trainer, the SFT loop and evaluation load it: model, tokenizer, folder.

`model.path` is an HF folder, a model name or a `.gguf` file (both converted once into a cached HF folder by
named_models), or `builtin:tiny`: a tiny Qwen2-architecture model (random weights) with a BPE tokenizer trained on
the built-in toy tasks, written once to `<workdir>/builtin_tiny` so that the toy config runs on a fresh machine with
nothing downloaded. `model.init_checkpoint` (an orbax checkpoint directory, e.g. an SFT
run's `checkpoints/`) replaces the folder's weights with the newest checkpoint's.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from pathlib import Path

from jax.sharding import Mesh

from arpo_jax.distributed import barrier, is_main_process
from arpo_jax.models import CausalLM
from arpo_jax.models.lora import config_with, with_adapters
from arpo_jax.weights import hf, lora_io, named_models, pretrained

log = logging.getLogger(__name__)

BUILTIN_TINY = "builtin:tiny"
TINY_MAX_POSITIONS = 2048  # the builtin tiny model's positions: data.max_prompt_length + max_response_length must fit


def model_dir(cfg, workdir: str | os.PathLike) -> Path:
    """The HF folder the policy starts from (building the builtin tiny model first when asked for)."""
    if cfg.model.path == BUILTIN_TINY:
        dest = Path(workdir) / "builtin_tiny"
        if is_main_process() and not (dest / "config.json").exists():
            shutil.copytree(_tiny_model_of_this_process(cfg.seed), dest, dirs_exist_ok=True)
        barrier("builtin_tiny")
        return dest
    return named_models.model_folder(cfg.model.path)  # a named model / .gguf is converted once into the cache


def load_tokenizer(cfg, model_folder: Path):
    from transformers import AutoTokenizer

    path = os.path.expandvars(cfg.model.tokenizer) if cfg.model.tokenizer else str(model_folder)
    return AutoTokenizer.from_pretrained(path)


def runtime_options(cfg) -> dict:
    """Model runtime settings from `config.model` / `config.mesh` (see models.Config)."""
    return dict(dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype, remat=cfg.model.remat,
                attention_impl=cfg.model.attention_impl or None, sharding_rules=cfg.mesh.rules)


def load_policy(cfg, workdir: str | os.PathLike, mesh: Mesh) -> tuple[CausalLM, object, Path]:
    """(model sharded over `mesh`, tokenizer, its HF folder) for the config's starting point; with `model.lora`
    its adapters attached (`with_lora`)."""
    model, tokenizer, folder = _load_base_policy(cfg, workdir, mesh)
    return with_lora(model, cfg.model.lora, seed=cfg.seed, mesh=mesh), tokenizer, folder


def _load_base_policy(cfg, workdir: str | os.PathLike, mesh: Mesh) -> tuple[CausalLM, object, Path]:
    folder = model_dir(cfg, workdir)
    if not cfg.model.init_checkpoint:
        model = pretrained.from_pretrained(folder, mesh=mesh, **runtime_options(cfg))
        return model, load_tokenizer(cfg, folder), folder
    from arpo_jax.weights.checkpoint import Checkpointer

    with Checkpointer(os.path.expandvars(cfg.model.init_checkpoint), async_save=False) as ckpt:
        step = ckpt.latest_step()
        if step is None:
            raise FileNotFoundError(f"model.init_checkpoint={cfg.model.init_checkpoint!r} holds no checkpoint")
        model = ckpt.restore_model(step, mesh=mesh, **runtime_options(cfg))
    log.info("policy weights from %s step %d", cfg.model.init_checkpoint, step)
    return model, load_tokenizer(cfg, folder), folder


_TINY_MODELS: dict[int, Path] = {}  # seed -> this process's build of builtin:tiny


def _tiny_model_of_this_process(seed: int) -> Path:
    """builtin:tiny built once per process and seed into a temporary folder that each run's work dir copies: the
    BPE training and the model init took ~4 s per run (tests, sweeps and notebooks start many runs in a process)."""
    folder = _TINY_MODELS.get(seed)
    if folder is None or not (folder / "config.json").is_file():  # first use, or the temporary folder was removed
        root = Path(tempfile.mkdtemp(prefix="arpo_jax_builtin_tiny_"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        folder = _TINY_MODELS[seed] = build_tiny_model(root / "model", seed=seed)
    return folder


def build_tiny_model(dest: str | os.PathLike, *, seed: int = 0, vocab_size: int = 1024, hidden_size: int = 128,
                     num_layers: int = 2) -> Path:
    """A tiny Qwen2-architecture HF folder (head_dim 32, so vLLM can serve it) with a BPE tokenizer of the toy tasks.

    `hidden_size` (a multiple of 64) sets the width: hidden_size / 32 query heads, half as many KV heads, an MLP of
    3 x hidden_size."""
    from flax import nnx

    from arpo_jax.data import toy
    from arpo_jax.models import Config
    from arpo_jax.weights import bpe

    tokenizer = bpe.train_bpe_tokenizer(toy.tokenizer_corpus(), vocab_size=vocab_size)
    cfg = Config(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=hidden_size,
                 intermediate_size=3 * hidden_size, num_layers=num_layers, num_heads=hidden_size // 32,
                 num_kv_heads=hidden_size // 64, head_dim=32, qkv_bias=True, rope_theta=10000.0,
                 max_position_embeddings=TINY_MAX_POSITIONS, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id)
    return hf.save_pretrained(CausalLM(cfg, rngs=nnx.Rngs(seed)), dest, tokenizer=tokenizer)


def with_lora(model: CausalLM, lora_cfg, *, seed: int = 0, mesh: Mesh | None = None) -> CausalLM:
    """The policy for `config.model.lora`: `model` itself when rank is 0 or when it already holds these adapters
    (restored from a LoRA checkpoint), else `model` with the PEFT folder `lora_cfg.adapter` or fresh adapters."""
    if not lora_cfg.rank:
        return model
    want = config_with(model.config, lora_cfg.rank, lora_cfg.alpha, lora_cfg.targets)
    if lora_cfg.adapter:
        model = lora_io.load_peft(model, os.path.expandvars(lora_cfg.adapter), mesh=mesh)
        if want != model.config:
            raise ValueError(f"model.lora.adapter={lora_cfg.adapter!r} holds rank {model.config.lora_rank}, alpha "
                             f"{model.config.lora_alpha}, targets {model.config.lora_targets}: set model.lora to match")
        return model
    if model.config.lora_rank:
        if want != model.config:
            raise ValueError(f"the starting checkpoint's adapters (rank {model.config.lora_rank}, alpha "
                             f"{model.config.lora_alpha}, {model.config.lora_targets}) differ from model.lora")
        return model
    return with_adapters(model, lora_cfg.rank, lora_cfg.alpha, lora_cfg.targets, seed=seed, mesh=mesh)
