"""HF folder <-> orbax checkpoint, GGUF -> HF folder (the logic behind `arpo-jax convert` and conversion/*.py)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from flax import nnx

from arpo_jax.weights import checkpoint, hf, lora_io, pretrained

TOKENIZER_SUBDIR = "tokenizer"


def hf_to_orbax(hf_dir: str | Path, out_dir: str | Path, *, dtype: str | None = None, step: int = 0,
                mesh=None) -> dict:
    """Imports an HF folder and saves it as an orbax checkpoint at `step`; tokenizer files are kept alongside."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} exists and is not a folder: pick a checkpoint directory to create")
    t0 = time.perf_counter()
    dtype = dtype or hf.checkpoint_dtype(hf_dir)
    model = pretrained.from_pretrained(hf_dir, dtype=dtype, mesh=mesh)
    t1 = time.perf_counter()
    with checkpoint.Checkpointer(out_dir) as ckpt:
        if step in ckpt.all_steps():
            raise ValueError(f"{out_dir} already holds a checkpoint for step {step}: pick another --out or --step")
        ckpt.save(step, nnx.state(model, nnx.Param), config=model.config, meta={"source": str(hf_dir)}, force=True)
    tok_files = [f for f in hf.TOKENIZER_FILES if (hf_dir / f).is_file()]
    if tok_files:
        (out_dir / TOKENIZER_SUBDIR).mkdir(parents=True, exist_ok=True)
        for f in tok_files:
            shutil.copy2(hf_dir / f, out_dir / TOKENIZER_SUBDIR / f)
    return {"import_s": t1 - t0, "save_s": time.perf_counter() - t1, "step": step, "dtype": dtype,
            "tokenizer_files": len(tok_files)}


def gguf_to_hf(gguf_file: str | Path, out_dir: str | Path, *, dtype: str = "float32", overwrite: bool = False) -> dict:
    """Writes the model of a GGUF file as an HF folder (see arpo_jax.weights.gguf_import)."""
    from arpo_jax.weights import gguf_import

    t0 = time.perf_counter()
    gguf_import.to_hf(gguf_file, out_dir, dtype=dtype, overwrite=overwrite)
    return {"convert_s": time.perf_counter() - t0, "out": str(out_dir), "dtype": dtype}


def orbax_to_hf(ckpt_dir: str | Path, out_dir: str | Path, *, step: int | None = None,
                tokenizer: str | Path | None = None, dtype: str | None = None, overwrite: bool = False) -> dict:
    """Exports the params of an orbax checkpoint (default: latest intact step) as an HF folder.

    `out_dir` is checked before anything is restored: only a previous export is replaced unless `overwrite`, and
    never a run (`hf.check_export_destination`).
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"--ckpt {ckpt_dir}: no checkpoint found (no such directory; "
                                f"expected a checkpoint directory, e.g. RUN/checkpoints)")
    hf.check_export_destination(out_dir, overwrite=overwrite)
    t0 = time.perf_counter()
    model = checkpoint.Checkpointer(ckpt_dir, create=False).restore_model(step)
    t1 = time.perf_counter()
    if tokenizer is None and (ckpt_dir / TOKENIZER_SUBDIR).is_dir():
        tokenizer = ckpt_dir / TOKENIZER_SUBDIR
    hf.save_pretrained(model, out_dir, tokenizer=tokenizer, dtype=dtype, overwrite=overwrite)
    return {"restore_s": t1 - t0, "export_s": time.perf_counter() - t1, "tokenizer": str(tokenizer or "")}


# --------------------------------------------------------------------------------------------------
# `arpo-jax export`

EXPORT_FORMATS = ("merged", "peft")


def _copy_training_settings(out: Path, ckpt: Path | None, adapter: str | os.PathLike | None) -> None:
    """The PEFT folder gets the settings it was trained with: from the run's config.json (`RUN/checkpoints` ->
    `RUN/config.json`), or the source adapter's own file."""
    import json

    settings = {}
    if ckpt is not None and (ckpt.parent / "config.json").is_file():
        settings = lora_io.training_settings(lora_io.read_json(ckpt.parent / "config.json", "the run's config"))
    elif adapter is not None:
        settings = lora_io.read_training_settings(adapter)
    if settings and out.is_dir():
        (out / lora_io.TRAINING_SETTINGS).write_text(json.dumps(settings, indent=2) + "\n")


def export_lora(out: str | os.PathLike, *, fmt: str = "merged", ckpt: str | os.PathLike | None = None,
           step: int | None = None, adapter: str | os.PathLike | None = None, base: str | os.PathLike | None = None,
           dtype: str | None = None, overwrite: bool = False) -> dict:
    """Writes a LoRA model as a merged HF folder (`fmt="merged"`) or a PEFT adapter folder (`"peft"`).

    The model: the newest (or `step`) of an orbax checkpoint directory `ckpt` of a LoRA run, or the PEFT folder
    `adapter` on the HF folder `base`. `base` is also what the PEFT folder's `base_model_name_or_path` names.
    """
    from arpo_jax.weights import checkpoint, pretrained

    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"--format {fmt!r}; allowed: {EXPORT_FORMATS}")
    if (ckpt is None) == (adapter is None):
        raise ValueError("export needs exactly one source: --ckpt RUN/checkpoints, or --adapter PEFT_FOLDER --base HF")
    if adapter is not None and base is None:
        raise ValueError("--adapter needs --base: the HF folder the adapter was trained on")
    hf.check_export_destination(out, overwrite=overwrite)
    tokenizer = None
    if ckpt is not None:
        ckpt = Path(ckpt)
        model = checkpoint.Checkpointer(ckpt, create=False).restore_model(step)
        if (ckpt / TOKENIZER_SUBDIR).is_dir():
            tokenizer = ckpt / TOKENIZER_SUBDIR
    else:
        model = lora_io.load_peft(pretrained.from_pretrained(base, dtype=dtype or hf.checkpoint_dtype(base)), adapter)
        tokenizer = base if any((Path(base) / f).is_file() for f in hf.TOKENIZER_FILES) else None
    if not model.config.lora_rank:
        raise ValueError(f"{ckpt}: the checkpoint holds no LoRA adapters (use `arpo-jax convert orbax-to-hf`)")
    if fmt == "peft":
        written = lora_io.save_peft(model, out, base_model=str(base or ""), overwrite=overwrite)
        _copy_training_settings(Path(written), ckpt, adapter)
    else:
        written = hf.save_pretrained(model, out, tokenizer=tokenizer, dtype=dtype, overwrite=overwrite)
    return {"out": str(written), "format": fmt, "rank": model.config.lora_rank, "alpha": model.config.lora_alpha,
            "targets": list(model.config.lora_targets)}
