"""HF export / import throughput of arpo_jax against transformers' own save_pretrained / from_pretrained.

Same weights, same dtype, same target folder kind (default /dev/shm, where the vLLM weight sync writes). Each
timing is the best of --repeats runs. Export is what every policy update pays before vLLM reloads the weights.

  python benchmarks/engine/convert.py [--hidden 768 --layers 12 --vocab 32000] [--dtype float32] [--dir /dev/shm]

A second table imports the real SmolLM2-135M-Instruct GGUF file (4-bit Q4_1, the named model's source): arpo_jax's
GGUF import (dequantized straight into params, and written as an HF folder) against transformers' own GGUF loader
(`from_pretrained(..., gguf_file=...)`, which needs torch and accelerate). MB/s is of the GGUF file. --no-gguf skips it.

Prints a table, then a final JSON line with MB/s and the ratios (ours / transformers; > 1 means faster).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import arpo_jax  # noqa: E402
from arpo_jax import testing  # noqa: E402


def _folder_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e6


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _hf_load(src: Path, dtype: str, touch: bool = False):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=getattr(torch, dtype))
    if touch:
        with torch.no_grad():
            for p in model.parameters():
                p.sum()
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-gguf", action="store_true", help="skip the GGUF import rows")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    root = Path(tempfile.mkdtemp(prefix="arpo_bench_convert_", dir=args.dir))
    try:
        src = root / "src"
        heads = args.hidden // 64
        ref = testing.make_tiny_hf_model(
            src, "qwen2", dtype=args.dtype, vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
            num_heads=heads, num_kv_heads=max(1, heads // 3), intermediate_size=int(args.hidden * 8 / 3) // 64 * 64)
        n_params = sum(p.numel() for p in ref.parameters())
        mb = _folder_mb(src)

        model = arpo_jax.from_pretrained(src, dtype=args.dtype)
        jax.block_until_ready(jax.tree.leaves(model))
        blob = np.ones(int(mb * 1e6), np.uint8)

        def raw_write():  # the floor: one buffer of the same size written to the same filesystem
            with open(root / "raw.bin", "wb") as f:
                f.write(blob.data)

        rows = {
            "hardware limit: one raw write of that size": _best(raw_write, args.repeats),
            "export arpo_jax.save_pretrained": _best(lambda: arpo_jax.save_pretrained(model, root / "ours"),
                                                     args.repeats),
            "export transformers.save_pretrained": _best(lambda: ref.save_pretrained(str(root / "theirs")),
                                                         args.repeats),
            "import arpo_jax.from_pretrained": _best(
                lambda: jax.block_until_ready(jax.tree.leaves(arpo_jax.from_pretrained(src, dtype=args.dtype))),
                args.repeats),
            # transformers memory-maps safetensors: loading returns before a byte is read. The second row also
            # touches every weight once (what the first forward pass pays), which is what our import includes.
            "import transformers.from_pretrained (lazy)": _best(lambda: _hf_load(src, args.dtype), args.repeats),
            "import transformers + touch every weight": _best(lambda: _hf_load(src, args.dtype, touch=True),
                                                              args.repeats),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"{n_params / 1e6:.1f}M params, {mb:.0f} MB of {args.dtype} safetensors, folder on {args.dir or 'tmp'}, "
          f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}")
    print(f"{'operation':44s} {'seconds':>8s} {'MB/s':>8s}")
    for name, s in rows.items():
        print(f"{name:44s} {s:8.3f} {mb / s:8.0f}")
    result = {
        "benchmark": "convert", "params_m": round(n_params / 1e6, 1), "mb": round(mb, 1), "dtype": args.dtype,
        "export_mb_s": round(mb / rows["export arpo_jax.save_pretrained"]),
        "export_transformers_mb_s": round(mb / rows["export transformers.save_pretrained"]),
        "import_mb_s": round(mb / rows["import arpo_jax.from_pretrained"]),
        "import_transformers_lazy_mb_s": round(mb / rows["import transformers.from_pretrained (lazy)"]),
        "import_transformers_mb_s": round(mb / rows["import transformers + touch every weight"]),
    }
    result["raw_write_mb_s"] = round(mb / rows["hardware limit: one raw write of that size"])
    result["export_ratio"] = round(result["export_mb_s"] / result["export_transformers_mb_s"], 2)
    # Import ratio against the materialised load; the lazy number is reported alongside.
    result["import_ratio"] = round(result["import_mb_s"] / result["import_transformers_mb_s"], 2)
    if not args.no_gguf:
        result |= gguf_rows(args)
    print(json.dumps(result))


def gguf_rows(args) -> dict:
    """GGUF import of the named model's file: arpo_jax (into params; into an HF folder) vs transformers' loader."""
    from arpo_jax.weights import gguf_import, named_models

    file = named_models.gguf_file("smollm2-135m-instruct")
    mb = file.stat().st_size / 1e6
    root = Path(tempfile.mkdtemp(prefix="arpo_bench_gguf_", dir=args.dir))
    try:
        rows = {
            "arpo_jax.from_pretrained(gguf) -> params": _best(
                lambda: jax.block_until_ready(jax.tree.leaves(arpo_jax.from_pretrained(file))), args.repeats),
            "arpo_jax gguf_import.to_hf -> HF folder": _best(
                lambda: gguf_import.to_hf(file, root / "ours"), args.repeats),
            "transformers from_pretrained(gguf_file=)": _best(
                lambda: transformers.AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                                                          dtype=torch.float32), args.repeats),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nGGUF import: {file.name}, {mb:.0f} MB (Q4_1), dequantized to float32")
    for name, s in rows.items():
        print(f"{name:44s} {s:8.3f} {mb / s:8.0f}")
    ours, hf_folder, theirs = (mb / s for s in rows.values())
    return {"gguf_mb": round(mb, 1), "gguf_import_mb_s": round(ours), "gguf_to_hf_mb_s": round(hf_folder),
            "gguf_transformers_mb_s": round(theirs), "gguf_import_ratio": round(ours / theirs, 2)}


if __name__ == "__main__":
    main()
